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
    assert '"bench": "talker"' in out and "| kernels | streams |" in out
