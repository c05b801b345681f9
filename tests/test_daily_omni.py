"""The Daily-Omni runner (examples/online_serving/minicpmo/daily_omni.py): letter extraction and scoring
on fixed outcomes, then end to end on a small synthetic set in the published layout (qa.json + Videos/)
against the embedded launcher on the tiny checkpoint, both pack modes, resumed from its results file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from launched_pipeline import Served, launched
from media_samples import mp4_bytes, wav_bytes

from examples.online_serving.minicpmo import daily_omni as do


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("B. A dog barks", "B"),
        ("Answer: (C)", "C"),
        ("The answer is D.", "D"),
        ("答案是A", "A"),
        ("Because of the bird, C", "C"),  # the B of "Because" and "bird" are inside words
        ("none of them", None),
        ("", None),
        (None, None),
        ("a lowercase b", None),
    ],
)
def test_first_choice_letter(text: str | None, letter: str | None) -> None:
    assert do.first_choice_letter(text) == letter


def _outcome(
    qid: str, status: str, correct: bool, duration: str = "30s", category: str = "Pets"
) -> do.Outcome:
    return do.Outcome(
        qid=qid,
        status=status,
        correct=correct,
        predicted="A" if status == "answered" else None,
        answer="A",
        duration=duration,
        category=category,
        task_type="Event",
    )


def test_summary_counts_failures_apart_from_wrong_answers() -> None:
    outs = [
        _outcome("1", "answered", True),
        _outcome("2", "answered", False),
        _outcome("3", "failed", False, duration="60s"),
        _outcome("4", "answered", True, duration="60s", category="Travel"),
    ]
    report = do.summarize(outs)
    overall = report["overall"]
    assert (overall["answered"], overall["failed"], overall["correct"], overall["wrong"]) == (3, 1, 2, 1)
    assert overall["accuracy"] == pytest.approx(2 / 3) and overall["accuracy_incl_failures"] == pytest.approx(
        0.5
    )
    assert report["by_duration"]["60s"]["failed"] == 1 and report["by_duration"]["60s"]["accuracy"] == 1.0
    assert report["by_category"]["Travel"]["questions"] == 1
    assert [f["qid"] for f in report["failures"]] == ["3"]


def make_dataset(root: Path) -> None:
    """Three questions in the published layout; the third names a video whose files are missing."""
    rows = []
    for i, (vid, duration) in enumerate([("vidA", "30s"), ("vidB", "60s"), ("vidMissing", "30s")]):
        rows.append(
            {
                "Question": f"What happens in clip {i}?",
                "Choice": ["A. a tone", "B. a bark", "C. rain", "D. nothing"],
                "Answer": "A",
                "video_id": vid,
                "Type": "Event Sequence",
                "video_duration": duration,
                "video_category": "Music" if i else "Pets",
            }
        )
        if vid != "vidMissing":
            folder = root / "Videos" / vid
            folder.mkdir(parents=True)
            (folder / f"{vid}_video.mp4").write_bytes(mp4_bytes(3.0))
            (folder / f"{vid}_audio.wav").write_bytes(wav_bytes(3.0))
    (root / "qa.json").write_text(json.dumps(rows))


def test_bad_dataset_root_is_reported(tmp_path: Path) -> None:
    assert do.main(["--dataset-root", str(tmp_path), "--results", str(tmp_path / "r.jsonl")]) == 2


@pytest.fixture(scope="module")
def served(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launched(tiny_ckpt, tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.mark.slow
@pytest.mark.parametrize("pack", do.PACK_MODES)
def test_end_to_end_against_the_launcher(served: Served, tmp_path: Path, pack: str) -> None:
    root = tmp_path / "Daily-Omni"
    make_dataset(root)
    results = tmp_path / "results.jsonl"
    argv = [
        "--api-base",
        f"{served.url}/v1",
        "--dataset-root",
        str(root),
        "--results",
        str(results),
        "--pack",
        pack,
        "--concurrency",
        "2",
    ]
    assert do.main([*argv, "--limit", "2"]) == 0
    first = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(o["status"] for o in first) == ["answered", "answered"], first
    plain = httpx.post(
        f"{served.url}/v1/chat/completions",
        timeout=300,
        json={
            "model": "openbmb/MiniCPM-o-4_5",
            "modalities": ["text"],
            "max_tokens": 4,
            "messages": [{"role": "user", "content": do.prompt_text(do.load_questions(root)[0])}],
        },
    ).json()
    for o in first:  # three seconds of video and sound reached the prompt (3 frames x 64 + ~30 audio)
        assert o["prompt_tokens"] >= plain["usage"]["prompt_tokens"] + 3 * 64 + 25, o

    # Resume over the whole set: the two answered questions are not asked again, the third fails apart.
    assert do.main(argv) == 0
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == 3 and lines[2]["status"] == "failed" and "FileNotFoundError" in lines[2]["error"]
    report = json.loads(results.with_suffix(".summary.json").read_text())
    overall = report["overall"]
    assert (overall["questions"], overall["answered"], overall["failed"]) == (3, 2, 1)
    correct = sum(o["correct"] for o in lines)
    assert overall["correct"] == correct and overall["accuracy"] == correct / 2
    assert set(report["by_duration"]) == {"30s", "60s"} and report["by_duration"]["30s"]["failed"] == 1
    assert report["config"] == {
        "pack": pack,
        "enable_thinking": False,
        "max_tokens": 256,
        "model": "openbmb/MiniCPM-o-4_5",
        "questions": 3,
    }
