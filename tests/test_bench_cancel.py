"""The cancellation-latency bench on CPU: gauge parsing, and one short real run through the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cancel import parse_gauges

REPO = Path(__file__).resolve().parents[1]


def test_parse_gauges_sums_label_sets_and_ignores_other_metrics() -> None:
    text = (
        "# HELP minicpmo_stage_in_flight Requests admitted\n"
        "# TYPE minicpmo_stage_in_flight gauge\n"
        'minicpmo_stage_in_flight{stage="talker"} 2.0\n'
        'minicpmo_stage_in_flight{stage="other"} 1.0\n'
        'minicpmo_stage_streams_active{stage="talker"} 0.0\n'
        'minicpmo_stage_queue_depth{stage="talker"} 5.0\n'
    )
    assert parse_gauges(text) == {"minicpmo_stage_in_flight": 3.0, "minicpmo_stage_streams_active": 0.0}
    assert parse_gauges("") == {"minicpmo_stage_in_flight": 0.0, "minicpmo_stage_streams_active": 0.0}


@pytest.mark.slow
def test_cancel_bench_runs_on_cpu_and_observes_every_release(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "cancel"
    cmd = [
        sys.executable,
        "-m",
        "bench.cancel",
        "--checkpoint",
        str(tiny_ckpt),
        "--deploy-config",
        "cpu",
        "--device",
        "cpu",
        "--requests",
        "2",
        "--warmup",
        "0",
        "--audio-frames",
        "500",
        "--release-timeout",
        "60",
        "--max-seconds",
        "300",
        "--out-dir",
        str(out),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "cancel.json").read_text())
    assert report["status"] == "ok" and report["completed"] == 2 and report["all_released"] is True
    stages = {name.split("-")[0] for name in report["metrics_urls"]}
    assert stages == {"thinker", "talker", "code2wav"}
    for r in report["results"]:
        assert r["ok"] and r["ttfp_ms"] > 0 and set(r["release_ms"]) == set(report["metrics_urls"])
        assert r["overall_ms"] == max(r["release_ms"].values())
    for m in report["summary"]["per_stage_ms"].values():
        assert {"p50", "p90", "max"} <= set(m)
    assert {"p50", "p90", "max"} <= set(report["summary"]["overall_ms"])
    assert "target" in report["verdict"] and (out / "cancel.md").read_text().startswith("## Cancellation")
    # The pipeline was torn down: no child of the run is still alive.
    for pid in json.loads((out / "logs" / "pids.json").read_text()).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
