"""The gRPC hop benchmark: realistic message sizes, and a short real run over loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.hops import Messages, Payload
from services.common.tensors import tensor_from_proto

REPO = Path(__file__).resolve().parents[1]


def test_messages_have_the_pipeline_sizes_and_round_trip() -> None:
    m = Messages(Payload(hidden_size=4096), "cpu")
    speech = m.speech(3)
    assert speech.speech.id.chunk_seq == 3
    assert speech.ByteSize() >= 10 * 4096 * 2  # hidden [10, 4096] bf16
    hidden = tensor_from_proto(speech.speech.hidden)
    assert hidden.dtype == torch.bfloat16 and tuple(hidden.shape) == (10, 4096)
    assert torch.equal(hidden, m.hidden)
    relayed = m.talker_chunk(4, speech.speech)
    assert (
        m.absorb_talker_chunk(talker_msg := relayed) == 4 and talker_msg.chunk.hidden == speech.speech.hidden
    )
    window = m.window_out(5).window
    assert len(window.codes) == 28 and window.left_context == 3
    assert m.absorb_window_in(m.window_in(6, window)) == 6
    audio = m.audio(7)
    assert len(audio.audio.pcm.data) == 24_000 * 2  # 1 s of s16le at 24 kHz


def test_hops_bench_runs_with_small_counts(tmp_path: Path) -> None:
    out = tmp_path / "hops"
    cmd = [
        sys.executable,
        "-m",
        "bench.hops",
        "--iters",
        "30",
        "--warmup",
        "5",
        "--hidden-size",
        "1024",
        "--out-dir",
        str(out),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "hops.json").read_text())
    hops = {h["hop"]: h for h in report["hops"]}
    assert len(hops) == 7
    for h in hops.values():
        assert h["grpc_ms"]["p50"] > 0 and h["grpc_ms"]["p99"] >= h["grpc_ms"]["p50"]
        assert h["in_process_ms"]["p50"] < h["grpc_ms"]["p50"]
        assert h["added_p50_ms"] == h["grpc_ms"]["p50"] - h["in_process_ms"]["p50"]
    assert hops["thinker -> gateway"]["bytes"] > 10 * 1024 * 2
    assert hops["thinker -> gateway -> talker (relay)"]["meets_target"] is None
    assert "| gateway -> talker |" in (out / "hops.md").read_text()
