"""Where a benchmark level's time went, per stage, from the stages' own Prometheus metrics.

Each stage replica exposes ``/metrics`` (``--metrics-port``, by default its gRPC port + 1000;
:func:`bench.cancel.stage_endpoints` finds them for a launched pipeline). :func:`scrape` reads every
``minicpmo_*`` sample of every replica; two scrapes around a level give, by difference
(:func:`level_profile`):

* per replica: **busy** = the sum of its engine steps' wall time (``minicpmo_stage_step_seconds``) over
  the level's wall time, the **steps** taken, the mean **batch** (``minicpmo_stage_batch_size``: rows
  per thinker/talker step, windows per code2wav model batch) and the mean step time; streams opened;
* thinker: prompt tokens prefilled and found in the prefix cache, decode tokens, its step split
  (``forward`` = the model, ``sample`` = the rest) and a turn's mean prompt building time on the encode
  executor (template, media, encoders: a transcription window's audio encoder pass) and wait for it;
* talker: codec frames, and how many streams' prefills shared one forward;
* code2wav: audio seconds, its busy seconds per audio second, first-window latency and the histogram of
  its per-step real-time factor (``minicpmo_code2wav_real_time_factor``: step seconds / audio seconds of
  that step's windows);
* per request (dividing by the level's request count): thinker prefill tokens, talker frames, code2wav
  windows' audio.

A stage whose busy fraction nears 1 is the one limiting the level (with MPS the stages' kernels overlap,
so the fractions may add up to more than 1); its steps and batch say whether it runs many small batches
(batching lost) or few large ones (compute bound). Busy seconds per audio second (B, every stage, over
the level's audio) bound the level: the stage can serve at most 1/B audio seconds per wall second, so c
streams cannot get a stream RTF below c x B of the busiest stage. The thinker times a step one step late and on a GPU
from CUDA events (docs/thinker.md), so its busy time is the model's, not the host's.
"""

from __future__ import annotations

import re
import urllib.request
from typing import Any

_SAMPLE = re.compile(r"^(minicpmo_[a-zA-Z0-9_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")
# Counters whose per-request average the report gives: (stage, sample name, report key).
PER_REQUEST = (
    ("thinker", "minicpmo_thinker_prefill_tokens_total", "thinker_prefill_tokens"),
    ("thinker", "minicpmo_thinker_prefix_cache_hit_tokens_total", "thinker_cached_prompt_tokens"),
    ("thinker", "minicpmo_thinker_decode_tokens_total", "thinker_decode_tokens"),
    ("talker", "minicpmo_talker_frames_total", "talker_frames"),
    ("code2wav", "minicpmo_code2wav_audio_seconds_total", "code2wav_audio_s"),
)


def parse(text: str) -> dict[str, float]:
    """Every ``minicpmo_*`` sample of one Prometheus text page, keyed ``name{labels}`` (labels as given)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def scrape(endpoints: dict[str, str], timeout: float = 10.0) -> dict[str, dict[str, float]]:
    """``{replica name: samples}`` for every reachable endpoint (an unreachable one is left out)."""
    out: dict[str, dict[str, float]] = {}
    for name, url in endpoints.items():
        try:
            text = urllib.request.urlopen(url, timeout=timeout).read().decode()
        except OSError:
            continue
        out[name] = parse(text)
    return out


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _histogram(before: dict[str, float], after: dict[str, float], name: str) -> dict[str, float]:
    """Per-bucket counts (not cumulative) of histogram ``name`` between two scrapes: ``{le: count}``."""
    cumulative: list[tuple[float, str, float]] = []
    for key, value in after.items():
        m = re.fullmatch(rf'{name}_bucket\{{le="([^"]+)"\}}', key)
        if m:
            le = m.group(1)
            cumulative.append((float(le), le, value - before.get(key, 0.0)))
    cumulative.sort()
    out: dict[str, float] = {}
    prev = 0.0
    for _, le, total in cumulative:
        out[le] = total - prev
        prev = total
    return out


def _stage_of(replica: str) -> str:
    """A launcher child name (``talker-0``) -> its stage (``talker``)."""
    return replica.rsplit("-", 1)[0] if replica.rsplit("-", 1)[-1].isdigit() else replica


def level_profile(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    wall_s: float,
    requests: int,
) -> dict[str, Any]:
    """The level's profile (see the module docstring) from two :func:`scrape` results around it."""
    stages: dict[str, dict[str, Any]] = {}
    totals: dict[str, float] = {}
    for replica, post in sorted(after.items()):
        pre = before.get(replica, {})
        stage = _stage_of(replica)
        label = f'{{stage="{stage}"}}'
        busy = _delta(pre, post, f"minicpmo_stage_step_seconds_sum{label}")
        steps = _delta(pre, post, f"minicpmo_stage_step_seconds_count{label}")
        rows = _delta(pre, post, f"minicpmo_stage_batch_size_sum{label}")
        batches = _delta(pre, post, f"minicpmo_stage_batch_size_count{label}")
        entry: dict[str, Any] = {
            "stage": stage,
            "busy_s": busy,
            "busy_fraction": busy / wall_s if wall_s > 0 else 0.0,
            "steps": steps,
            "mean_step_ms": 1000.0 * busy / steps if steps else 0.0,
            "batches": batches,
            "mean_batch": rows / batches if batches else 0.0,
            "streams_opened": _delta(pre, post, f"minicpmo_stage_requests_total{label}"),
        }
        if stage == "thinker":
            for phase in ("forward", "sample"):
                key = f'minicpmo_thinker_step_phase_seconds_sum{{phase="{phase}"}}'
                entry[f"{phase}_s"] = _delta(pre, post, key)
            entry["voice_prefix_builds"] = _delta(pre, post, "minicpmo_thinker_voice_prefix_builds_total")
            for phase in ("wait", "build"):  # a turn's prompt building on the encode executor
                n = _delta(pre, post, f'minicpmo_thinker_prompt_build_seconds_count{{phase="{phase}"}}')
                total = _delta(pre, post, f'minicpmo_thinker_prompt_build_seconds_sum{{phase="{phase}"}}')
                entry[f"prompt_{phase}_ms_mean"] = 1000.0 * total / n if n else 0.0
        elif stage == "talker":
            n = _delta(pre, post, "minicpmo_talker_prefill_batch_count")
            entry["prefill_forwards"] = n
            entry["mean_prefill_streams"] = (
                _delta(pre, post, "minicpmo_talker_prefill_batch_sum") / n if n else 0.0
            )
        elif stage == "code2wav":
            audio = _delta(pre, post, "minicpmo_code2wav_audio_seconds_total")
            entry["audio_s"] = audio
            n = _delta(pre, post, "minicpmo_code2wav_real_time_factor_count")
            entry["step_rtf_mean"] = (
                _delta(pre, post, "minicpmo_code2wav_real_time_factor_sum") / n if n else 0.0
            )
            entry["step_rtf_histogram"] = _histogram(pre, post, "minicpmo_code2wav_real_time_factor")
            n = _delta(pre, post, "minicpmo_code2wav_first_window_seconds_count")
            entry["first_window_ms_mean"] = (
                1000.0 * _delta(pre, post, "minicpmo_code2wav_first_window_seconds_sum") / n if n else 0.0
            )
            entry["stored_voice_loads"] = _delta(pre, post, "minicpmo_code2wav_stored_voice_loads_total")
            entry["origin_setups"] = _delta(pre, post, "minicpmo_code2wav_origin_setups_total")
        stages[replica] = entry
        for st, name, key in PER_REQUEST:
            if st == stage:
                totals[key] = totals.get(key, 0.0) + _delta(pre, post, name)
    audio = totals.get("code2wav_audio_s", 0.0)
    for entry in stages.values():  # the most audio per wall second this stage's busy time would allow
        entry["busy_per_audio_s"] = entry["busy_s"] / audio if audio > 0 else 0.0
    per_request = {key: value / requests for key, value in totals.items()} if requests else {}
    return {"wall_s": wall_s, "requests": requests, "stages": stages, "per_request": per_request}


def markdown(profile: dict[str, Any]) -> list[str]:
    """The profile as markdown lines: one row per replica, then the per-request costs."""
    lines = [
        "| replica | busy s / wall s | busy s per audio s | steps | mean step ms | mean batch | streams | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, st in profile["stages"].items():
        notes = []
        if st["stage"] == "thinker":
            notes.append(
                f"forward {st.get('forward_s', 0):.2f} s, sample {st.get('sample_s', 0):.2f} s; prompt build "
                f"{st.get('prompt_build_ms_mean', 0):.1f} ms after {st.get('prompt_wait_ms_mean', 0):.1f} ms wait"
            )
        elif st["stage"] == "talker" and st.get("prefill_forwards"):
            notes.append(f"{st['mean_prefill_streams']:.1f} streams per prefill forward")
        elif st["stage"] == "code2wav":
            notes.append(f"{st['audio_s']:.1f} s audio, first window {st['first_window_ms_mean']:.0f} ms")
        lines.append(
            f"| {name} | {st['busy_s']:.2f} / {profile['wall_s']:.2f} ({100 * st['busy_fraction']:.0f}%) "
            f"| {st['busy_per_audio_s']:.4f} | {st['steps']:.0f} | {st['mean_step_ms']:.1f} | {st['mean_batch']:.2f} "
            f"| {st['streams_opened']:.0f} | {'; '.join(notes)} |"
        )
    per = profile.get("per_request") or {}
    if per:
        lines.append("")
        lines.append(
            "Per request: "
            + ", ".join(f"{key.replace('_', ' ')} {value:.1f}" for key, value in sorted(per.items()))
        )
    for name, st in profile["stages"].items():
        hist = {le: n for le, n in st.get("step_rtf_histogram", {}).items() if n}
        if hist:
            cells = ", ".join(f"≤{le}: {n:.0f}" for le, n in hist.items())
            lines.append(f"{name} step RTF (mean {st['step_rtf_mean']:.3f}): {cells}")
    return lines
