"""The realtime duplex bench on CPU: one short launch-mode run through the real stages and gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_realtime_bench_launches_the_pipeline_and_reports_barge_in(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "realtime"
    cmd = [
        sys.executable, "-m", "bench.realtime_duplex", "--checkpoint", str(tiny_ckpt), "--deploy-config", "cpu",
        "--device", "cpu", "--sessions", "1", "--units", "2", "--out-dir", str(out),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (level,) = json.loads((out / "realtime.json").read_text())["levels"]
    assert level["sessions"] == 1 and level["failed"] == 0, level
    assert level["first_audio_s"]["n"] == 1 and level["barge_in_ms"]["n"] == 1
    assert level["unit_decision_mean_ms"] > 0 and level["gateway_barge_in_mean_ms"] is not None
    # The thinker's drain histogram is scraped from its own metrics port (0 when no unit was running).
    assert level["thinker_drain_mean_ms"] is not None and level["thinker_drain_mean_ms"] >= 0
    # The thinker's unit split (queued / encode / engine) and step split (forward / sample) are scraped.
    for key in ("thinker_unit_encode_mean_ms", "thinker_unit_engine_mean_ms", "thinker_step_forward_mean_ms",
                "thinker_step_sample_mean_ms"):
        assert level[key] is not None and level[key] > 0, key
    assert (out / "realtime.md").read_text().startswith("| sessions |")
    for pid in json.loads((out / "logs" / "pids.json").read_text()).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
