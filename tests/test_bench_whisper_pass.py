"""``python -m bench.thinker.whisper_pass`` on the CPU with the tiny encoder dims: it runs, reports every
batch, and a pass over several sessions dispatches about as many operators as a pass over one (the
sessions' attention and cache writes are batched, not one set of launches per session)."""

from __future__ import annotations

import json

import pytest

from bench.thinker import whisper_pass


def test_whisper_pass_bench_counts_a_batched_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert whisper_pass.main(["--device", "cpu", "--dims", "tiny", "--batches", "1,8", "--passes", "2"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    one, eight = report["rows"]
    assert (one["batch"], eight["batch"]) == (1, 8) and one["ms"] > 0 and eight["ms"] > 0
    # What grows with the sessions is only each unit's window on the host (about 6 operators, views and a
    # concatenation). Per-session attention and cache writes cost 51 per extra session on these dims.
    assert (eight["ops"] - one["ops"]) / 7 < 8, (one, eight)


def test_whisper_pass_graphs_need_a_gpu() -> None:
    """``--graphs`` compares real CUDA graph replays with the eager pass; on the CPU it says so and stops."""
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        whisper_pass.main(
            ["--device", "cpu", "--dims", "tiny", "--batches", "1", "--passes", "1", "--graphs"]
        )
