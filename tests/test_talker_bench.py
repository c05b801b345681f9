"""The GPU benchmark script runs end to end on CPU with tiny weights and prints JSON + a Markdown table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.talker.__main__ import main


def test_bench_smoke_on_cpu(
    tiny_ckpt: Path, capsys: pytest.CaptureFixture[str], triton_interpreter_scalars: None
) -> None:
    """Both decode backends (the Triton one through the interpreter on CPU), one engine each."""
    result = main(
        [
            "--checkpoint",
            str(tiny_ckpt),
            "--device",
            "cpu",
            "--batches",
            "1,2",
            "--frames",
            "6",
            "--baseline-frames",
            "3",
            "--cond-len",
            "4",
            "--repeats",
            "1",
            "--kernels",
            "torch,triton",
        ]
    )
    assert [(r["kernels"], r["batch"]) for r in result["rows"]] == [
        ("torch", 1),
        ("torch", 2),
        ("triton", 1),
        ("triton", 2),
    ]
    assert all(r["engine_fps_per_stream"] > 0 and r["baseline_fps_per_stream"] > 0 for r in result["rows"])
    out = capsys.readouterr().out
    assert '"bench": "talker"' in out and "| kernels | steps/replay | streams |" in out


def test_bench_steps_per_replay_ab_on_cpu(tiny_ckpt: Path) -> None:
    """``--steps-per-replay 1,4`` runs one engine per K and tags each row with it (the GPU A/B)."""
    result = main(
        [
            *("--checkpoint", str(tiny_ckpt), "--device", "cpu", "--batches", "1,2", "--frames", "9"),
            *("--baseline-frames", "0", "--cond-len", "4", "--repeats", "1", "--kernels", "torch"),
            *("--steps-per-replay", "1,4"),
        ]
    )
    assert [(r["steps_per_replay"], r["batch"]) for r in result["rows"]] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert all(r["engine_fps_per_stream"] > 0 for r in result["rows"])


def test_prefill_bench_smoke_on_cpu(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench.talker.prefill times the eager prefill per (streams, rows, start) case and prints its table;
    the graphed column is CUDA-only (no graphs on the CPU)."""
    from bench.talker.prefill import main as prefill_main

    result = prefill_main(
        ["--checkpoint", str(tiny_ckpt), "--device", "cpu", "--streams", "1,2", "--rows", "5",
         "--starts", "0,70", "--repeats", "2"]
    )  # fmt: skip
    cases = [(c["streams"], c["rows"], c["start"]) for c in result["cases"]]
    assert cases == [(1, 5, 0), (1, 5, 70), (2, 5, 0), (2, 5, 70)]
    assert all(c["eager_ms"] > 0 and "graphed_ms" not in c for c in result["cases"])
    assert result["graphs"] == 0
    out = capsys.readouterr().out
    assert "| streams | rows | start | eager ms | graphed ms | replayed |" in out and "| 2 | 5 | 70 |" in out
