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
        "--hf-decode-steps", "1", "--hbm-gbps", "100", "--overlap", "both", "--skinny-o", "both",
        "--json-out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    # --overlap both: the batch runs with the overlapped decode off, then on (CPU: no graphs, nothing chains);
    # --skinny-o both: twice over, the skinny O projection off then on (CPU torch kernels: no folded loop
    # runs it, but each arm reports its setting)
    assert [(r["batch"], r["overlap"], r["skinny_o"]) for r in result["engine_decode"]] == [
        (2, False, False),
        (2, True, False),
        (2, False, True),
        (2, True, True),
    ]
    assert all(r["chained_steps"] == 0 for r in result["engine_decode"])
    assert [r["batch"] for r in result["transformers_decode"]] == [2]
    for r in result["engine_decode"]:
        assert r["ms_per_step"] > 0 and r["tok_s_total"] == pytest.approx(r["batch"] * r["tok_s_per_stream"])
        assert r["roofline_ms"] == pytest.approx(1e3 * r["bytes_per_step"] / 100e9)
    assert result["engine_prefill"]["prompt_len"] == 12 and result["transformers_prefill"]["tok_s"] > 0
    text = capsys.readouterr().out
    assert "| batch | engine ms/step" in text and "| one prompt | 12 |" in text


def test_bench_fp8_arm_reports_against_bf16(
    tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--weights fp8``: the bf16 figures, then the same engine quantized, each fp8 step beside the bf16
    step of its batch (CPU torch kernels: the fp8 round trip, no fp8 GEMM and so no fp8 floor); no
    transformers baseline (the module's weights are the fp8 ones by then)."""
    from bench.thinker.__main__ import main

    out = tmp_path / "bench.json"
    argv = [
        "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--batches", "1,2", "--context-len", "8",
        "--decode-steps", "2", "--warmup-steps", "1", "--prompt-len", "12", "--prefill-iters", "1",
        "--overlap", "off", "--weights", "fp8", "--json-out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert all(r["weights"] == "bf16" for r in result["engine_decode"])
    fp8 = result["fp8"]["engine_decode"]
    assert [(r["batch"], r["weights"]) for r in fp8] == [(1, "fp8"), (2, "fp8")]
    for r in fp8:
        bf16 = next(x for x in result["engine_decode"] if x["batch"] == r["batch"])
        assert r["bf16_ratio"] == pytest.approx(r["ms_per_step"] / bf16["ms_per_step"])
    assert "transformers_decode" not in result and result["fp8"]["engine_prefill"]["prompt_len"] == 12
    assert "| batch | overlap | bf16 ms/step | fp8 ms/step |" in capsys.readouterr().out


def test_bench_loads_a_sweep_table_before_the_engine(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fp8-table``: the sweep's winners join the fp8 GEMM table before the engine is built and the
    JSON names the file; a file that is not a sweep ends the run with exit 2 and the reason."""
    from bench.thinker.__main__ import main
    from services.common.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "FP8_CONFIGS", dict(fp8_gemm.FP8_CONFIGS))
    sweep = tmp_path / "fp8.json"
    sweep.write_text(
        json.dumps([{"rows": 64, "n": 4096, "k": 4096, "best": {"config": [64, 64, 64, 2, 4, 3]}}])
    )
    out = tmp_path / "bench.json"
    argv = [
        "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--batches", "1", "--context-len", "8",
        "--decode-steps", "1", "--warmup-steps", "1", "--prompt-len", "8", "--prefill-iters", "1",
        "--no-hf", "--overlap", "off", "--fp8-table", str(sweep), "--json-out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["tables"] == [{"kernel": "fp8 GEMM", "path": str(sweep), "entries": 1}]
    assert fp8_gemm.FP8_CONFIGS[(64, 4096, 4096)] == fp8_gemm.Fp8Config(64, 64, 64, 2, 4, 3)
    sweep.write_text(json.dumps({"not": "a sweep"}))
    assert main(argv) == 2
    assert "expected the list a sweep's --json-out writes" in capsys.readouterr().err


def test_fp8_matmul_stack_floor_runs_the_fp8_gemms(triton_interpreter_scalars: None) -> None:
    """The fp8 floor times ``fp8_linear`` over the step's weights (here two small ones, through Triton's
    interpreter on CPU)."""
    import torch

    from bench.thinker import fp8
    from services.common.kernels.fp8_quant import quantize_fp8

    weights = [quantize_fp8(torch.randn(96, 64)), quantize_fp8(torch.randn(64, 96))]
    assert fp8.matmul_stack_ms(weights, 2, torch.device("cpu"), torch.float32, iters=1) > 0
    assert fp8.candidates(1, 4096, 4096) and not fp8.candidates(256, 4096, 4096)
    packed = fp8.candidates(128, 4096, 12288)  # a packed step: one 128-row tile, K split or not
    assert all(c.block_m == 128 for c in packed) and {c.split_k for c in packed} == {1, 2, 4, 8}
    assert all(c.split_k == 1 for c in fp8.candidates(1, 151748, 4096))  # the lm_head: tiles fill the card
