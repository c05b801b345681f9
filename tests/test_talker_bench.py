"""The GPU benchmark script runs end to end on CPU with tiny weights and prints JSON + a Markdown table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.talker.__main__ import main


def test_bench_smoke_on_cpu(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
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
        ]
    )
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert all(r["engine_fps_per_stream"] > 0 and r["baseline_fps_per_stream"] > 0 for r in result["rows"])
    out = capsys.readouterr().out
    assert '"bench": "talker"' in out and "| streams |" in out
