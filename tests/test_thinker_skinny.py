"""The skinny decode GEMMs (services.common.kernels.skinny) against the torch composition, on CPU.

As in ``test_common_kernels.py`` the Triton kernels run through Triton's interpreter (fp32 and fp16: the
interpreter has no bf16 arithmetic). Each op is compared with TorchOps' norm/gate followed by an fp32
``F.linear``; the residual must be the old one bit for bit. Then the runner must pick the skinny path for a
packed-row step of few rows, and only then, and give the torch backend's logits and tokens through it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU
triton = pytest.importorskip("triton")

from services.common.checkpoint import Checkpoint  # noqa: E402
from services.common.kernels import TorchOps, skinny_enabled  # noqa: E402
from services.thinker.engine import EngineConfig, ThinkerEngine  # noqa: E402
from services.thinker.runner import DecodeRow, PrefillChunk, StepInput, build_qwen3_llm  # noqa: E402
from tests.thinker_greedy import greedy_tokens  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_scalars(triton_interpreter_scalars: None) -> None:
    """Every test here runs the kernels through the interpreter (see ``conftest.py``)."""


def _sk():  # noqa: ANN202
    from services.common.kernels import skinny

    return skinny


def _configs():  # noqa: ANN202
    cfg = _sk().SkinnyConfig
    return [
        None,  # the default (no split at these K)
        cfg(32, 64, 1, 4, 1, True),  # ragged N tail (80 = 2.5 tiles)
        cfg(32, 32, 4, 4, 1, True),  # split-K over 4, merged by the last split
        cfg(16, 32, 3, 4, 1, False),  # broadcast-sum, split-K over 3 (ragged: K/3 is not a block multiple)
    ]


def _bound(a: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element error bound of the kernel against ``F.linear(a, w)`` in fp32 (``ref``).

    One rounding of the output to ``dtype`` (eps·|ref|), plus operand elements that may differ from the
    reference's by one ulp (the row's sum of squares is added in another fp32 order, which can move the
    normalised value across a rounding boundary) and the fp32 summation order of the product: each at most
    eps per term of ``|a|·|w|``; 4·eps·(|a|@|w|.T) covers both with margin. A wrong tile, row, split or
    prologue misses by a sizeable fraction of |ref| and fails it.
    """
    eps = torch.finfo(dtype).eps
    return eps * ref.abs() + 4 * eps * F.linear(a.float().abs(), w.float().abs())


def _check(got: torch.Tensor, a_ref: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = F.linear(a_ref.float(), w.float(), None if bias is None else bias.float())
    err = (got.float() - ref).abs()
    bound = _bound(a_ref, w, ref, got.dtype)
    assert got.dtype == a_ref.dtype and got.shape == ref.shape
    assert bool((err <= bound).all()), (
        f"max err {err.max().item():.3g}, worst excess {(err - bound).max():.3g}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_ops_match_torch_composition(dtype: torch.dtype, m: int) -> None:
    sk = _sk()
    g = torch.Generator().manual_seed(m)
    for n, k in ((80, 256), (48, 200)):  # 200: K not a multiple of any block
        x, d = (torch.randn(m, k, generator=g).to(dtype) for _ in range(2))
        nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
        w = (torch.randn(n, k, generator=g) / 8).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        gate_up = torch.randn(m, 2 * k, generator=g).to(dtype)
        s_ref, h_ref = TorchOps.add_rms_norm(x, d, nw, 1e-6)
        for cfg in _configs():
            x_new, y = sk.linear_add_rms_norm(x, d, nw, 1e-6, w, config=cfg)
            assert torch.equal(x_new, s_ref), cfg  # the residual: bit for bit
            _check(y, h_ref, w, None)
            _check(sk.linear_add_rms_norm(x, d, nw, 1e-6, w, bias, config=cfg)[1], h_ref, w, bias)
            _check(sk.linear_rms_norm(x, nw, 1e-6, w, config=cfg), TorchOps.rms_norm(x, nw, 1e-6), w, None)
            _check(sk.linear_silu_mul(gate_up, w, config=cfg), TorchOps.silu_mul(gate_up), w, None)
            _check(sk.linear(x, w, bias, config=cfg), x, w, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_prologues_round_like_the_old_kernels(dtype: torch.dtype) -> None:
    """With an identity weight the GEMM returns its operand exactly: the SwiGLU prologue must equal the
    old gate bit for bit, the norm prologue the old norm to one ulp in rare elements (the sum-of-squares
    order differs)."""
    sk = _sk()
    g = torch.Generator().manual_seed(5)
    k = 192
    eye = torch.eye(k, dtype=dtype)
    cfg = sk.SkinnyConfig(64, 64, 3, 4, 1, True)  # split: each output column still has one nonzero term
    from services.common.kernels.triton_ops import TritonOps

    gate_up = torch.randn(3, 2 * k, generator=g).to(dtype)
    assert torch.equal(sk.linear_silu_mul(gate_up, eye, config=cfg), TritonOps.silu_mul(gate_up))
    x, d = (torch.randn(3, k, generator=g).to(dtype) for _ in range(2))
    nw = torch.randn(k, generator=g).to(dtype)
    s_old, h_old = TritonOps.add_rms_norm(x, d, nw, 1e-6)
    s_new, h_new = sk.linear_add_rms_norm(x, d, nw, 1e-6, eye, config=cfg)
    assert torch.equal(s_new, s_old)
    torch.testing.assert_close(h_new, h_old, rtol=torch.finfo(dtype).eps, atol=0)
    # a one-ulp move needs a sum within ~1e-7 of a rounding boundary: rare; a missing rounding point
    # (the normalised value not rounded before the weight product) would differ in many elements
    assert (h_new != h_old).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_linear_accumulate_is_addmm_into_the_residual(dtype: torch.dtype, m: int) -> None:
    """``linear_accumulate`` = ``residual + h @ W.T`` rounded once, into a new tensor (residual untouched)
    or into the residual itself, with and without split-K."""
    sk = _sk()
    g = torch.Generator().manual_seed(10 + m)
    n, k = 80, 256
    h = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / 8).to(dtype)
    res = torch.randn(m, n, generator=g).to(dtype)
    want = res.float() + F.linear(h.float(), w.float())
    bound = _bound(h, w, F.linear(h.float(), w.float()), dtype) + torch.finfo(dtype).eps * want.abs()
    for cfg in _configs():
        before = res.clone()
        got = sk.linear_accumulate(h, w, res, config=cfg)
        assert torch.equal(res, before) and got.data_ptr() != res.data_ptr()
        assert bool(((got.float() - want).abs() <= bound).all()), cfg
        inplace = res.clone()
        out = sk.linear_accumulate(h, w, inplace, out=inplace, config=cfg)
        assert out.data_ptr() == inplace.data_ptr()
        assert torch.equal(inplace, got)  # the same sums, whichever buffer they land in
    with pytest.raises(ValueError, match="residual"):
        sk.linear_accumulate(h, w, res[:, :40])


def test_skinny_o_is_on_and_has_tuned_configs() -> None:
    """The skinny O projection is the default (a benchmark may turn it off); the built-in table holds its
    H200 configs (1 and 16 rows), so the engine never runs it on the untuned default config."""
    from services.common.kernels import skinny_o_enabled

    assert skinny_o_enabled() and not skinny_o_enabled(False) and skinny_o_enabled(True)
    sk = _sk()
    assert {(1, 4096, 4096), (16, 4096, 4096)} <= set(sk.SKINNY_CONFIGS)
    assert sk.config_for(8, 4096, 4096) is sk.SKINNY_CONFIGS[(16, 4096, 4096)]


def test_split_counters_are_left_zeroed() -> None:
    """The last split resets its tile's counter, so the next call (a replay, the next layer) starts clean."""
    sk = _sk()
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 128, generator=g), torch.randn(96, 128, generator=g)
    cfg = sk.SkinnyConfig(32, 32, 4, 4, 1, True)
    first = sk.linear(x, w, config=cfg)
    assert int(sk._COUNTERS[x.device].abs().sum()) == 0
    assert torch.equal(sk.linear(x, w, config=cfg), first)  # deterministic: partials added in split order


def test_config_table_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    sk = _sk()
    a, b = sk.SkinnyConfig(64, 128, 4, 4, 3, True), sk.SkinnyConfig(32, 256, 1, 4, 3, False)
    monkeypatch.setattr(sk, "SKINNY_CONFIGS", {(4, 4096, 4096): a, (1, 4096, 4096): b})
    assert sk.config_for(1, 4096, 4096) is b
    assert sk.config_for(3, 4096, 4096) is a  # bucket 4
    assert sk.config_for(16, 4096, 4096) is a  # no bucket above: the nearest below
    assert sk.config_for(2, 4096, 4096) is a  # bucket 2 missing: the nearest above
    assert sk.config_for(1, 6144, 4096) == sk.default_config(1, 6144, 4096)
    # the default splits K until 64-column tiles make two programs per SM (each split ≥ 512 deep)
    assert sk.default_config(1, 4096, 4096).split_k == 8
    assert sk.default_config(1, 4096, 12288).split_k == 8
    assert sk.default_config(1, 24576, 4096).split_k == 1


def test_microbench_table_file_feeds_the_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.thinker.skinny --json-out`` rows (their best config) load as table entries keyed by row
    bucket; a shape whose sweep found nothing usable is left to the default."""
    import json

    sk = _sk()
    rows = [
        {"rows": 16, "n": 4096, "k": 12288, "best": {"config": [128, 128, 4, 8, 4, True], "us": 40.0}},
        {"rows": 3, "n": 6144, "k": 4096, "best": {"config": [32, 256, 2, 4, 3, False], "us": 9.0}},
        {"rows": 1, "n": 24576, "k": 4096, "best": None},
    ]
    path = tmp_path / "skinny.json"
    path.write_text(json.dumps(rows))
    table = sk.load_table(path)
    assert table == {
        (16, 4096, 12288): sk.SkinnyConfig(128, 128, 4, 8, 4, True),
        (4, 6144, 4096): sk.SkinnyConfig(32, 256, 2, 4, 3, False),
    }
    monkeypatch.setattr(sk, "SKINNY_CONFIGS", {})
    assert sk.use_table(path) == 2
    assert sk.config_for(9, 4096, 12288) == sk.SkinnyConfig(128, 128, 4, 8, 4, True)
    assert sk.config_for(1, 24576, 4096) == sk.default_config(1, 24576, 4096)


def test_skinny_switch() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # off unless asked: it measured slower than norm kernels + cuBLAS on the H200
    assert not skinny_enabled(cuda, "triton") and not skinny_enabled(cpu, "triton")
    assert not skinny_enabled(cuda, "torch", True)  # the torch backend never takes it
    assert skinny_enabled(cpu, "triton", True) and not skinny_enabled(cuda, "triton", False)


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> torch.nn.Module:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    return build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")


def _prefilled(llm: torch.nn.Module) -> tuple[ThinkerEngine, list[int], list[int]]:
    engine = ThinkerEngine(llm, EngineConfig(max_num_seqs=4, kv_budget_bytes=8 << 20), torch.device("cpu"))
    engine.runner.set_kernels("triton")
    blocks_a, blocks_b = engine.cache.pool.allocate(8), engine.cache.pool.allocate(8)
    engine.runner.step(
        StepInput(
            prefill=[
                PrefillChunk(list(range(2000, 2070)), 0, blocks_a),
                PrefillChunk(list(range(3000, 3030)), 0, blocks_b),
            ]
        )
    )
    return engine, blocks_a, blocks_b


def test_runner_selects_skinny_for_packed_decode_steps(llm: torch.nn.Module) -> None:
    """Packed-row steps of ≤ 16 rows take the skinny GEMMs when on; eager steps, big packed steps, the
    default and the torch backend do not. Through them the step gives the torch backend's outputs."""
    engine, blocks_a, blocks_b = _prefilled(llm)
    runner = engine.runner
    assert not runner.skinny_gemm  # CPU: off unless asked for
    runner.set_skinny_gemm(True)
    fused = runner.fused
    step = StepInput(
        decode=[DecodeRow(7, 70, blocks_a)], prefill=[PrefillChunk([5, 6, 8], 30, blocks_b, want_logits=True)]
    )
    before = fused.skinny_passes
    skinny_out = runner.packed_step_eager(step)  # the graph body: 4 rows
    assert fused.skinny_passes == before + 1
    runner.step(step)  # CPU: an eager step (prefill path), cuBLAS GEMMs
    big = StepInput(
        decode=[DecodeRow(7, 70, blocks_a)], prefill=[PrefillChunk(list(range(17)), 30, blocks_b)]
    )
    runner.packed_step_eager(big)  # 18 rows: above the skinny limit
    assert fused.skinny_passes == before + 1
    runner.set_skinny_gemm(None)  # the default: off
    plain_out = runner.packed_step_eager(step)
    assert fused.skinny_passes == before + 1 and not runner.skinny_gemm
    runner.set_kernels("torch")
    ref = runner.step(step)
    for out in (skinny_out, plain_out):
        torch.testing.assert_close(out.decode_logits, ref.decode_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.decode_hidden, ref.decode_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.prefill_logits[0], ref.prefill_logits[0], rtol=1e-4, atol=1e-4)


def test_graphed_engine_with_skinny_gemms_gives_torch_tokens(llm: torch.nn.Module) -> None:
    """Greedy decode through (emulated) row graphs on the skinny path equals the eager torch engine."""
    want, _ = greedy_tokens(llm, "torch", graphed=False)
    got, runner = greedy_tokens(llm, "triton", graphed=True, skinny_gemm=True)
    assert runner.fused.skinny_passes > 0 and got == want and all(len(t) == 5 for t in got)
