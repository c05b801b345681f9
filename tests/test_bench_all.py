"""bench/all: step selection, per-step records, results under $OUT, failure propagation (CPU, cheap steps)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_all_runs_selected_steps_into_out(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "BENCH_DEVICE": "cpu",
        "STEP_TIMEOUT": "300",
    }
    proc = subprocess.run(
        [
            str(REPO / "bench" / "all"),
            "--checkpoint",
            str(tiny_ckpt),
            "--steps",
            "checkpoint,cuda_smoke,nonsense",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # the unknown step fails the run
    assert "not regenerating" in proc.stdout  # the existing checkpoint is reused
    assert "skipped: no CUDA" in (out / "cuda_smoke.log").read_text()
    rows = (out / "steps.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["step", "rc", "seconds", "started_utc"]
    assert rows[1].split("\t")[:2] == ["cuda_smoke", "0"]
    assert "failed steps: nonsense" in proc.stdout
    summary = (out / "SUMMARY.md").read_text()
    assert "| cuda_smoke | 0 |" in summary and "python:" in (out / "environment.txt").read_text()


def test_bench_all_refuses_steps_without_a_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "BENCH_DEVICE": "cpu"}
    proc = subprocess.run(
        [
            str(REPO / "bench" / "all"),
            "--checkpoint",
            str(tmp_path / "missing"),
            "--steps",
            "cuda_smoke",
            "--results",
            str(tmp_path / "r"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "no checkpoint at" in proc.stdout
