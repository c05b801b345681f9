"""CUDA smoke harness: the comparison rules, the CPU skip, and a CPU dry run of both engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.cuda_smoke import Run, compare

REPO = Path(__file__).resolve().parents[1]


def _run(tokens: list[int], scale: float = 1.0) -> Run:
    return Run(tokens=list(tokens), rows=[torch.full((4,), float(t) * scale) for t in tokens])


def test_compare_identical_near_tie_and_mismatch() -> None:
    top2 = [(1, 5, 1.0), (2, 6, 1.0), (3, 9, 0.01), (4, 8, 1.0)]
    same = compare("talker", 1, 0, _run([1, 2, 3, 4]), _run([1, 2, 3, 4]), top2, 0.05)
    assert same.verdict == "identical" and same.first_diff is None and same.compared_rows == 4
    tie = compare("talker", 1, 0, _run([1, 2, 3, 4]), _run([1, 2, 9, 9]), top2, 0.05)
    assert tie.verdict == "near-tie" and tie.first_diff == 2 and tie.margin_at_diff == 0.01
    # small margin but the graph did not pick the runner-up: a real difference
    odd = compare("talker", 1, 0, _run([1, 2, 3, 4]), _run([1, 2, 7, 4]), top2, 0.05)
    assert odd.verdict == "MISMATCH"
    wrong = compare("talker", 1, 0, _run([1, 2, 3, 4]), _run([1, 6, 3, 4]), top2, 0.05)
    assert wrong.verdict == "MISMATCH" and wrong.first_diff == 1  # runner-up, but a clear margin
    drift = compare("talker", 1, 0, _run([1, 2, 3, 4]), _run([1, 2, 3, 4], scale=1.5), top2, 0.05)
    assert drift.verdict == "identical" and drift.max_rel_diff_before > 0.3  # reported only
    strict = compare(
        "talker", 1, 0, _run([1, 2, 3, 4]), _run([1, 2, 3, 4], scale=1.5), top2, 0.05, rel_tol=0.1
    )
    assert strict.verdict == "MISMATCH"
    short = compare("thinker", 1, 0, _run([1, 2, 3]), _run([1, 2]), [None] * 3, 0.05)
    assert short.verdict == "MISMATCH" and short.first_diff == 2


def test_compare_with_eager_logits_counts_three_way_ties() -> None:
    """With the eager logits the graph's pick only has to score within the margin of the eager best."""
    logits = torch.zeros(10)
    logits[3], logits[7], logits[9] = 5.0, 5.0, 4.99  # a three-way near-tie at step 0
    tie = compare("thinker", 1, 0, _run([3, 1]), _run([9, 1]), [], 0.05, logits_at=lambda k: logits)
    assert tie.verdict == "near-tie" and tie.first_diff == 0 and tie.margin_at_diff == 0.0
    assert tie.gap_at_diff == pytest.approx(0.01, abs=1e-6)
    far = compare("thinker", 1, 0, _run([3, 1]), _run([1, 1]), [], 0.05, logits_at=lambda k: logits)
    assert far.verdict == "MISMATCH" and far.gap_at_diff == pytest.approx(5.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_skips_without_cuda(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cuda_smoke", "--checkpoint", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "skipped: no CUDA" in proc.stdout


@pytest.mark.slow
def test_cpu_dry_run_of_both_engines(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    cmd = [
        sys.executable,
        "-m",
        "bench.cuda_smoke",
        "--checkpoint",
        str(tiny_ckpt),
        "--allow-cpu",
        "--device",
        "cpu",
        "--tokens",
        "8",
        "--frames",
        "12",
        "--out-dir",
        str(out),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "cuda_smoke.json").read_text())
    # thinker: 1 + 3 + 3 + 4 (the last two cases with a late arrival); talker: 1 + 3
    assert report["status"] == "pass" and len(report["comparisons"]) == 15
    for c in report["comparisons"]:
        assert c["verdict"] == "identical"
        assert c["tokens"] == (8 if c["stage"] == "thinker" else 12)
        assert c["compared_rows"] >= c["tokens"] - 1
