"""Omni-DuplexEval splits from a local copy in the published layout.

The dataset is published as one Parquet file per split, ``ROOT/data/<SPLIT>-00000-of-00001.parquet``
(several shards ``-0000k-of-0000n`` are read in order). Each row: ``id``, ``video`` and
``question_audio`` (structs ``{bytes, path}``: inline bytes, or a path relative to ROOT),
``question_text``, ``answer1``, ``answer2`` (RTD reference answers), ``reminder1``, ``reminder2`` (PR
reminder times in seconds, or null), ``video_duration`` (seconds) and ``video_type``.

Split families: ``RTD_*`` (real-time description: timeliness and content of what is said while the
video plays) and ``PR_*`` (proactive response: a correction, or reminders due at given times).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RTD_SPLITS = (
    "RTD_world_knowledge",
    "RTD_counting",
    "RTD_fine_grained_movement",
    "RTD_interaction_relation",
    "RTD_OCR",
    "RTD_Omni",
)
PR_SPLITS = ("PR_correction", "PR_event_reminder", "PR_post_event_reminder")
SPLITS = RTD_SPLITS + PR_SPLITS
_SHARD = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}\.parquet$")


@dataclass(frozen=True)
class Sample:
    id: str
    split: str
    video: bytes
    question_audio: bytes
    question_text: str
    answers: tuple[str, ...]
    reminders: tuple[float, ...]
    video_duration: float | None

    @property
    def family(self) -> str:
        return "rtd" if self.split.startswith("RTD") else "pr"

    @property
    def task(self) -> str:
        """``rtd``, ``correction``, ``event_reminder`` or ``post_event_reminder``."""
        return "rtd" if self.family == "rtd" else self.split.removeprefix("PR_")


def available_splits(root: Path) -> dict[str, list[Path]]:
    """Split name -> its shard files, for every Parquet file under ``root/data`` in the published naming."""
    found: dict[str, list[Path]] = {}
    for path in sorted((root / "data").glob("*.parquet")):
        match = _SHARD.match(path.name)
        if match:
            found.setdefault(match.group("split"), []).append(path)
    return found


def _media(value: Any, root: Path, what: str, sample_id: str) -> bytes:
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        path = Path(value) if Path(value).is_absolute() else root / value
        return path.read_bytes()
    raise ValueError(f"sample {sample_id}: no {what} (neither bytes nor a path)")


def _seconds(value: Any) -> float | None:
    if isinstance(value, dict):
        value = value.get("start", value.get("time"))
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def load_split(root: Path, split: str, shards: list[Path]) -> list[Sample]:
    import pyarrow.parquet as pq

    samples = []
    for shard in shards:
        for row in pq.read_table(shard).to_pylist():
            sid = str(row.get("id") or f"{split}_{len(samples)}")
            samples.append(
                Sample(
                    id=sid,
                    split=split,
                    video=_media(row.get("video"), root, "video", sid),
                    question_audio=_media(row.get("question_audio"), root, "question_audio", sid),
                    question_text=str(row.get("question_text") or ""),
                    answers=tuple(str(row[k]) for k in ("answer1", "answer2") if row.get(k)),
                    reminders=tuple(
                        t
                        for t in (_seconds(row.get("reminder1")), _seconds(row.get("reminder2")))
                        if t is not None
                    ),
                    video_duration=_seconds(row.get("video_duration")),
                )
            )
    return samples


def load_samples(root: Path, split: str = "all", limit: int | None = None) -> list[Sample]:
    """The samples of ``split`` (``all``, one name, or a comma list), at most ``limit`` per split.

    Raises ``ValueError`` naming the splits that are present when a requested one is not.
    """
    found = available_splits(root)
    if not found:
        raise ValueError(
            f"no split files under {root / 'data'} (expected data/<SPLIT>-00000-of-00001.parquet)"
        )
    wanted = sorted(found) if split == "all" else [s.strip() for s in split.split(",") if s.strip()]
    missing = [s for s in wanted if s not in found]
    if missing:
        raise ValueError(f"split(s) {missing} not found; present: {sorted(found)}")
    out: list[Sample] = []
    for name in wanted:
        out += load_split(root, name, found[name])[:limit]
    return out
