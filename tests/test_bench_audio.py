"""``python -m bench.audio_speech`` end to end on the CPU with the tiny checkpoint: it launches the
pipeline, registers the voice, measures speech at one level for both voices and one 60 s transcription,
writes its report and tears everything down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_audio_bench_runs_on_cpu(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "audio"
    cmd = [
        sys.executable,
        "-m",
        "bench.audio_speech",
        "--checkpoint",
        str(tiny_ckpt),
        "--deploy-config",
        "cpu",
    ]
    cmd += ["--device", "cpu", "--requests", "1", "--warmup", "0", "--levels", "1", "--transcriptions", "1"]
    cmd += ["--out-dir", str(out), "--stage-overrides", '{"talker": {"sampling": {"max_new_frames": 20}}}']
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((out / "audio.json").read_text())
    assert report["status"] == "ok"
    assert [(lv["voice"], lv["concurrency"]) for lv in report["speech"]] == [("default", 1), ("bench", 1)]
    for level in report["speech"]:
        assert 0 < level["ttfb_s"]["p50"] <= level["results"][0]["total_s"] and level["audio_s"]["mean"] > 0
    assert report["transcription"]["latency_s"]["p50"] > 0
    md = (out / "audio.md").read_text()
    assert "60 s transcription" in md
    # Each level's stage profile, from the stages' own metrics scraped around it.
    for level in report["speech"]:
        prof = level["profile"]
        stages = {s["stage"]: s for s in prof["stages"].values()}
        assert set(stages) == {"thinker", "talker", "code2wav"}
        for st in stages.values():
            assert st["steps"] > 0 and 0 < st["busy_s"] <= prof["wall_s"] * 1.05 and st["mean_batch"] >= 1
            assert st["streams_opened"] == 1  # one request, one segment
        assert stages["code2wav"]["audio_s"] == pytest.approx(level["audio_s"]["mean"], rel=0.05)
        assert stages["thinker"]["prompt_build_ms_mean"] > 0 and stages["thinker"]["prompt_wait_ms_mean"] >= 0
        assert sum(stages["code2wav"]["step_rtf_histogram"].values()) == stages["code2wav"]["steps"]
        per = prof["per_request"]
        assert per["thinker_prefill_tokens"] > 20
        assert 0 < per["talker_frames"] <= 20  # the frame budget ends the turn (no frames past it)
    assert report["speech"][1]["profile"]["stages"]["code2wav-0"]["stored_voice_loads"] == 1
    assert report["transcription"]["profile"]["per_request"]["thinker_decode_tokens"] > 0
    assert md.count("| replica |") == 3 and "talker frames" in md
