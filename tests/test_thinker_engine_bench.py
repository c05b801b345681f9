"""Smoke test of ``python -m bench.thinker`` on the tiny checkpoint with tiny iteration counts (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_bench_runs_and_reports(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.thinker.__main__ import main

    out = tmp_path / "bench.json"
    argv = [
        "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--batches", "2", "--context-len", "8",
        "--decode-steps", "2", "--warmup-steps", "1", "--prompt-len", "12", "--prefill-iters", "1",
        "--hf-decode-steps", "1", "--hbm-gbps", "100", "--overlap", "both", "--skinny", "both",
        "--json-out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    # --overlap both: the batch runs with the overlapped decode off, then on (CPU: no graphs, nothing chains);
    # --skinny both: twice over, the skinny GEMMs off then on (CPU torch kernels: never actually on)
    assert [(r["batch"], r["overlap"]) for r in result["engine_decode"]] == [(2, False), (2, True)] * 2
    assert not any(r["skinny"] for r in result["engine_decode"])
    assert all(r["chained_steps"] == 0 for r in result["engine_decode"])
    assert [r["batch"] for r in result["transformers_decode"]] == [2]
    for r in result["engine_decode"]:
        assert r["ms_per_step"] > 0 and r["tok_s_total"] == pytest.approx(r["batch"] * r["tok_s_per_stream"])
        assert r["roofline_ms"] == pytest.approx(1e3 * r["bytes_per_step"] / 100e9)
    assert result["engine_prefill"]["prompt_len"] == 12 and result["transformers_prefill"]["tok_s"] > 0
    text = capsys.readouterr().out
    assert "| batch | engine ms/step" in text and "| one prompt | 12 |" in text
