"""The thinker's engine on the Triton kernels of :mod:`services.common.kernels`, on CPU.

The kernels run through Triton's interpreter (``TRITON_INTERPRET=1``). A whole engine on the tiny
checkpoint with the Triton backend must give the torch backend's tokens and hidden rows, eagerly and
through the packed-row (graph body) step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU
triton = pytest.importorskip("triton")

from services.common.checkpoint import Checkpoint  # noqa: E402
from services.thinker.engine import EngineConfig, ThinkerEngine  # noqa: E402
from services.thinker.runner import DecodeRow, PrefillChunk, StepInput, build_qwen3_llm  # noqa: E402
from services.thinker.sampling import Sampler, SamplingConfig  # noqa: E402
from services.thinker.scheduler import WorkItem  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_scalars(triton_interpreter_scalars: None) -> None:
    """Every test here runs the kernels through the interpreter (see ``conftest.py``)."""


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> torch.nn.Module:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    return build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")


def _engine_run(llm: torch.nn.Module, kernels: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    engine = ThinkerEngine(
        llm, EngineConfig(max_num_seqs=4, kv_budget_bytes=8 << 20, max_step_tokens=24), torch.device("cpu")
    )
    engine.runner.set_kernels(kernels)
    assert engine.runner.kernel_backend == kernels
    prompts = [list(range(1000 + 37 * i, 1000 + 37 * i + n)) for i, n in enumerate((23, 41, 9))]
    tokens: list[list[int]] = [[] for _ in prompts]
    rows: list[torch.Tensor] = []
    for i, prompt in enumerate(prompts):
        seq = engine.open(
            lambda ev, i=i: (
                ev.token is not None
                and tokens[i].append(ev.token)
                or (ev.hidden is not None and rows.append(ev.hidden))
            )
        )
        cfg = SamplingConfig(max_tokens=6, stop_token_ids=())
        engine.submit(seq, WorkItem(prompt, sampler=Sampler(cfg), emit_hidden=True))
    engine.run_until_idle()
    return tokens, rows


def test_engine_with_triton_kernels_matches_torch_kernels(llm: torch.nn.Module) -> None:
    """Chunked prefill (41 tokens over 24-token steps) and batched decode through the Triton path."""
    want_tokens, want_rows = _engine_run(llm, "torch")
    got_tokens, got_rows = _engine_run(llm, "triton")
    assert got_tokens == want_tokens and all(len(t) == 6 for t in got_tokens)
    assert len(got_rows) == len(want_rows) > 0
    for got, want in zip(got_rows, want_rows, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_packed_row_step_with_triton_kernels_matches_eager(llm: torch.nn.Module) -> None:
    """The graph body (one-row tiles over per-row block tables) equals the eager Triton step and the
    torch step, for a decode row plus a 3-token prefill chunk packed as rows."""
    engine = ThinkerEngine(llm, EngineConfig(max_num_seqs=4, kv_budget_bytes=8 << 20), torch.device("cpu"))
    runner = engine.runner
    runner.set_kernels("triton")
    blocks_a, blocks_b = engine.cache.pool.allocate(8), engine.cache.pool.allocate(8)
    prompt_a, prompt_b = list(range(2000, 2070)), list(range(3000, 3030))
    runner.step(StepInput(prefill=[PrefillChunk(prompt_a, 0, blocks_a), PrefillChunk(prompt_b, 0, blocks_b)]))
    step = StepInput(
        decode=[DecodeRow(7, 70, blocks_a)], prefill=[PrefillChunk([5, 6, 8], 30, blocks_b, want_logits=True)]
    )
    packed = runner.packed_step_eager(step)
    eager = runner.step(step)
    runner.set_kernels("torch")
    ref = runner.step(step)
    for out in (packed, eager):
        torch.testing.assert_close(out.decode_logits, ref.decode_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.decode_hidden, ref.decode_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.prefill_logits[0], ref.prefill_logits[0], rtol=1e-4, atol=1e-4)


def test_a_wide_packed_step_with_triton_kernels_matches_torch(llm: torch.nn.Module) -> None:
    """What many duplex sessions make: several decode rows plus three 13-token units, 47 rows in all
    (past the skinny GEMMs' 32-row limit, each chunk within the fused kernel's look-back), through the
    graph body on the Triton kernels, equals the torch step: decode rows, each chunk's last logits and
    hidden rows."""
    engine = ThinkerEngine(llm, EngineConfig(max_num_seqs=8, kv_budget_bytes=8 << 20), torch.device("cpu"))
    runner = engine.runner
    runner.set_kernels("triton")
    seqs = [engine.cache.pool.allocate(6) for _ in range(11)]
    prompts = [list(range(2000 + 90 * i, 2000 + 90 * i + 30 + i)) for i in range(11)]
    runner.step(StepInput(prefill=[PrefillChunk(p, 0, b) for p, b in zip(prompts, seqs, strict=True)]))
    decode = [DecodeRow(7 + i, len(prompts[i]), seqs[i]) for i in range(8)]
    units = [
        PrefillChunk(
            list(range(500 + 13 * k, 513 + 13 * k)), len(prompts[8 + k]), seqs[8 + k], None, True, True
        )
        for k in range(3)
    ]
    step = StepInput(decode=decode, prefill=units)
    assert runner.pack_rows(step) is not None and step.num_tokens == 47
    packed = runner.packed_step_eager(step)
    runner.set_kernels("torch")
    ref = runner.step(step)  # rewrites the same key/value slots with the torch kernels
    torch.testing.assert_close(packed.decode_logits, ref.decode_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed.decode_hidden, ref.decode_hidden, rtol=1e-4, atol=1e-4)
    for k in range(3):
        torch.testing.assert_close(packed.prefill_logits[k], ref.prefill_logits[k], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed.prefill_hidden[k], ref.prefill_hidden[k], rtol=1e-4, atol=1e-4)
