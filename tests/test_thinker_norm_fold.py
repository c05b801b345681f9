"""The folded-norm decode loop (services.thinker.fused_forward ``_folded_layers``) on CPU.

The RMSNorm weights go into the QKV and gate|up GEMMs (``fold_norm_weights``); the kernels after those
GEMMs scale each row by the residual row's ``1/RMS`` (``rms_of``; the Triton kernels' scaled variants are
checked in ``test_common_kernels.py``). Checked here: the scaling is the norm; the folded module computing
what the unfolded one did; the runner taking the folded loop for packed-row steps only, and its logits
and greedy tokens (through emulated row graphs) against the torch backend on an unfolded copy.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU
triton = pytest.importorskip("triton")

from services.common.checkpoint import Checkpoint  # noqa: E402
from services.common.kernels import norm_fold_enabled, rms_norm_ref, scale_rows_ref  # noqa: E402
from services.thinker.engine import EngineConfig, ThinkerEngine  # noqa: E402
from services.thinker.runner import DecodeRow, PrefillChunk, StepInput, build_qwen3_llm  # noqa: E402
from tests.thinker_greedy import greedy_tokens  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_scalars(triton_interpreter_scalars: None) -> None:
    """Every test here runs the kernels through the interpreter (see ``conftest.py``)."""


def test_norm_fold_switch() -> None:
    """On by default with CUDA and Triton (it won its A/B); a caller (tests, the benchmark) may ask."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert norm_fold_enabled(cuda, "triton") and not norm_fold_enabled(cpu, "triton")
    assert not norm_fold_enabled(cuda, "torch", True)  # the torch backend runs the module's own order
    assert norm_fold_enabled(cpu, "triton", True) and not norm_fold_enabled(cuda, "triton", False)


def test_scaled_rows_are_the_folded_norm() -> None:
    """``r * ((W * g) @ x)`` is ``W @ rms_norm(x, g)`` (fp32: to rounding)."""
    g = torch.Generator().manual_seed(3)
    x = 5 * torch.randn(4, 64, generator=g)
    w, gamma = torch.randn(96, 64, generator=g), 1 + torch.rand(64, generator=g)
    want = F.linear(rms_norm_ref(x, gamma, 1e-6), w)
    got = scale_rows_ref(F.linear(x, w * gamma), (x, 1e-6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> torch.nn.Module:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    llm = build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")
    # the tiny checkpoint's norm weights may be ones; make them matter so a missing fold shows
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in llm.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=gen))
    return llm


def _engine(llm: torch.nn.Module, kernels: str, fold: bool | None) -> ThinkerEngine:
    engine = ThinkerEngine(
        llm, EngineConfig(max_num_seqs=4, kv_budget_bytes=8 << 20, norm_fold=fold), torch.device("cpu")
    )
    engine.runner.set_kernels(kernels)
    return engine


def test_folded_module_computes_the_same(llm: torch.nn.Module) -> None:
    folded = copy.deepcopy(llm)
    ids = torch.tensor([[11, 500, 3, 77, 1024, 9]])
    want = llm(input_ids=ids).logits
    engine = _engine(folded, "triton", True)
    assert engine.runner.norm_fold
    layer = folded.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    torch.testing.assert_close(folded(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    before = layer.self_attn.q_proj.weight.clone()
    _engine(folded, "triton", True)  # a second runner over the folded module: no second fold
    assert torch.equal(layer.self_attn.q_proj.weight, before)


def test_runner_takes_folded_loop_for_packed_steps(llm: torch.nn.Module) -> None:
    """Packed-row steps run the folded loop (eager steps do not); both give the unfolded torch outputs."""
    ref_engine = _engine(llm, "torch", None)
    engine = _engine(copy.deepcopy(llm), "triton", True)
    outs = []
    for eng in (ref_engine, engine):
        blocks_a, blocks_b = eng.cache.pool.allocate(8), eng.cache.pool.allocate(8)
        prefill = StepInput(
            prefill=[
                PrefillChunk(list(range(2000, 2070)), 0, blocks_a),
                PrefillChunk(list(range(3000, 3030)), 0, blocks_b),
            ]
        )
        eng.runner.step(prefill)
        step = StepInput(
            decode=[DecodeRow(7, 70, blocks_a)],
            prefill=[PrefillChunk([5, 6, 8], 30, blocks_b, want_logits=True)],
        )
        outs.append(eng.runner.step(step) if eng is ref_engine else eng.runner.packed_step_eager(step))
    fused = engine.runner.fused
    assert fused.folded_passes == 1  # the packed step only; the eager prefill kept the norm kernels
    ref, got = outs
    torch.testing.assert_close(got.decode_logits, ref.decode_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.decode_hidden, ref.decode_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.prefill_logits[0], ref.prefill_logits[0], rtol=1e-4, atol=1e-4)
    engine.runner.set_norm_fold(False)  # the loop switch: the norm kernels again, on the folded weights
    assert not engine.runner.norm_fold


def test_folded_loop_with_skinny_o_gives_the_torch_outputs(llm: torch.nn.Module) -> None:
    """The folded loop with its O projection + residual add as ``skinny.linear_accumulate`` (the first
    layer into a new tensor, the rest in place) gives the torch backend's outputs on a packed step."""
    ref_engine = _engine(llm, "torch", None)
    engine = _engine(copy.deepcopy(llm), "triton", True)
    engine.runner.fused.skinny_o = True
    from services.common.kernels import skinny

    calls: list[bool] = []
    real = skinny.linear_accumulate

    def spy(h, w, residual, out=None, config=None):  # noqa: ANN001, ANN202
        calls.append(out is residual)
        return real(h, w, residual, out=out, config=config)

    outs = []
    for eng in (ref_engine, engine):
        blocks = eng.cache.pool.allocate(8)
        eng.runner.step(StepInput(prefill=[PrefillChunk(list(range(2000, 2040)), 0, blocks)]))
        step = StepInput(decode=[DecodeRow(7, 40, blocks)])
        if eng is engine:
            skinny.linear_accumulate = spy
            try:
                outs.append(eng.runner.packed_step_eager(step))
            finally:
                skinny.linear_accumulate = real
        else:
            outs.append(eng.runner.step(step))
    assert calls == [False] + [True] * (len(calls) - 1) and len(calls) == len(llm.model.layers)
    ref, got = outs
    torch.testing.assert_close(got.decode_logits, ref.decode_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.decode_hidden, ref.decode_hidden, rtol=1e-4, atol=1e-4)


def test_graphed_engine_with_folded_norms_gives_torch_tokens(llm: torch.nn.Module) -> None:
    """Greedy decode through (emulated) row graphs on the folded loop equals the unfolded torch engine."""
    want, _ = greedy_tokens(llm, "torch", graphed=False)
    got, runner = greedy_tokens(copy.deepcopy(llm), "triton", graphed=True, norm_fold=True)
    assert runner.fused.folded_passes > 0 and got == want and all(len(t) == 5 for t in got)


def test_packed_step_with_a_long_chunk_attends_in_two_launches(
    llm: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed step of more than ``ROPE_ATTENTION_MAX_ROWS`` rows (here a 40-token chunk, longer than the
    one-launch kernel's look-back, beside a decode row) writes every key first and attends in a second
    launch, and gives the torch backend's outputs; a short packed step keeps the one launch."""
    from services.thinker.fused_forward import ROPE_ATTENTION_MAX_ROWS

    ref_engine = _engine(llm, "torch", None)
    engine = _engine(copy.deepcopy(llm), "triton", True)
    ops = engine.runner.ops
    launches: list[str] = []
    real_one, real_store = ops.rope_attention, ops.qk_rope_store

    def one(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        launches.append("one")
        return real_one(*args, **kwargs)

    def store(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        launches.append("two")
        return real_store(*args, **kwargs)

    outs = []
    for eng in (ref_engine, engine):
        blocks_a, blocks_b = eng.cache.pool.allocate(8), eng.cache.pool.allocate(8)
        eng.runner.step(StepInput(prefill=[PrefillChunk(list(range(2000, 2020)), 0, blocks_a)]))
        step = StepInput(
            decode=[DecodeRow(7, 20, blocks_a)],
            prefill=[PrefillChunk(list(range(3000, 3040)), 0, blocks_b, want_logits=True)],
        )
        assert step.num_tokens > ROPE_ATTENTION_MAX_ROWS
        if eng is engine:
            packed = eng.runner.pack_rows(step)
            assert packed is not None and len(packed[0]) == 41
            monkeypatch.setattr(ops, "rope_attention", staticmethod(one))
            monkeypatch.setattr(ops, "qk_rope_store", staticmethod(store))
            outs.append(eng.runner.packed_step_eager(step))
            eng.runner.packed_step_eager(StepInput(decode=[DecodeRow(9, 21, blocks_a)]))
        else:
            outs.append(eng.runner.step(step))
    layers = len(llm.model.layers)
    assert launches == ["two"] * layers + ["one"] * layers
    ref, got = outs
    torch.testing.assert_close(got.decode_logits, ref.decode_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.prefill_logits[0], ref.prefill_logits[0], rtol=1e-4, atol=1e-4)
