"""fp8 thinker weights (services.thinker.fp8_weights, kernels.fp8_quant / fp8_gemm) on CPU.

The quantizer's round trip is checked against e4m3's error bound; the fp8 GEMM runs through Triton's
interpreter (fp32: the interpreter has no bf16 arithmetic) against the torch reference, over the decode
layout (padded rows, split K, residual in place) and the prefill layout. Then the thinker on the tiny
checkpoint: the torch engine with ``weights="fp8"`` (the fp8 round trip of every projection) decodes
greedily end to end with logits close to bf16's, and the Triton fp8 step (the fp8 GEMMs, unfolded and
folded loops, eager and packed rows) gives the torch fp8 engine's logits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

from services.common.checkpoint import Checkpoint  # noqa: E402
from services.common.kernels.fp8_quant import FP8_MAX, fp8_linear_ref, quantize_fp8  # noqa: E402
from services.thinker.engine import EngineConfig, ThinkerEngine  # noqa: E402
from services.thinker.runner import DecodeRow, PrefillChunk, StepInput, build_qwen3_llm  # noqa: E402
from tests.thinker_greedy import greedy_tokens  # noqa: E402


def test_round_trip_error_is_within_e4m3_bound() -> None:
    """Per row: |W - q*s| ≤ 2^-4 * max|W[row]| (3 mantissa bits, round to nearest; subnormals are finer
    in absolute terms), scales are max|W|/448, zero rows stay exact, outlier rows cost other rows nothing."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g)
    w[3] *= 1000.0  # an outlier row
    w[7] = 0.0
    fw = quantize_fp8(w.to(torch.bfloat16))
    assert fw.q.dtype == torch.float8_e4m3fn and fw.scale.dtype == torch.float32
    wb = w.to(torch.bfloat16).float()
    err = (fw.dequantize() - wb).abs()
    row_max = wb.abs().amax(dim=1)
    assert bool((err <= row_max[:, None] * 2.0**-4 + 1e-30).all())
    torch.testing.assert_close(fw.scale[torch.arange(64) != 7], (row_max / FP8_MAX)[torch.arange(64) != 7])
    assert float(fw.scale[7]) == 1.0 and bool((fw.dequantize()[7] == 0).all())
    # the outlier row's scale is its own: an ordinary row keeps its relative precision
    rel = (err[0] / row_max[0]).max()
    assert rel <= 2.0**-4 and float(fw.q.float().abs().amax()) == FP8_MAX
    # mean error far under the bound: most elements round within their own (finer) spacing
    assert float((err / row_max[:, None].clamp_min(1e-30)).mean()) < 0.02


def test_fp8_linear_matches_dequantized_matmul_in_tolerance() -> None:
    """The fp8 linear stays within a few % of the bf16 product (relative to the output's scale), and is
    the fp32 matmul of the dequantized weight."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 512, generator=g) / 16
    a = torch.randn(5, 512, generator=g)
    fw = quantize_fp8(w)
    got = fp8_linear_ref(a, fw)
    torch.testing.assert_close(got, a @ fw.dequantize().t(), rtol=1e-5, atol=1e-5)
    ref = a @ w.t()
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.05


@pytest.fixture
def _interpreter(triton_interpreter_scalars: None) -> None:
    """Tests that run the Triton kernels go through the interpreter (see ``conftest.py``)."""


@pytest.mark.usefixtures("_interpreter")
@pytest.mark.parametrize("m", [1, 3, 16, 40, 100])
def test_fp8_gemm_kernel_matches_torch_reference(m: int) -> None:
    from services.common.kernels.fp8_gemm import Fp8Config, fp8_linear

    g = torch.Generator().manual_seed(10 + m)
    tile = 16 if m <= 16 else 64 if m <= 64 else 128  # one row tile (a packed step's layout above 32)
    configs = [
        None,  # the interpreter's default (one big tile)
        Fp8Config(tile, 32, 64, 1, 4, 1),  # ragged N tail (80 = 2.5 tiles)
        Fp8Config(tile, 32, 32, 3, 4, 1),  # split K over 3 (ragged: K/3 is not a block multiple)
        Fp8Config(16, 64, 64, 4, 4, 1),  # several row tiles when m > 16 (the split then is not used)
    ]
    for n, k in ((80, 256), (48, 200)):
        w = quantize_fp8(torch.randn(n, k, generator=g) / 8)
        a = torch.randn(m, k, generator=g)
        bias, res = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
        for cfg in configs:
            ref = fp8_linear_ref(a, w, bias, res)
            got = fp8_linear(a, w, bias, residual=res, config=cfg)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=str(cfg))
            inplace = res.clone()
            out = fp8_linear(a, w, residual=inplace, out=inplace, config=cfg)
            assert out.data_ptr() == inplace.data_ptr()
            torch.testing.assert_close(out, fp8_linear_ref(a, w, None, res), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                fp8_linear(a, w, config=cfg), fp8_linear_ref(a, w), rtol=1e-5, atol=1e-5
            )
    with pytest.raises(ValueError, match="residual"):
        fp8_linear(a, w, residual=res[:, :10])


@pytest.mark.usefixtures("_interpreter")
def test_split_counters_are_left_zeroed() -> None:
    from services.common.kernels import fp8_gemm

    g = torch.Generator().manual_seed(2)
    w, a = quantize_fp8(torch.randn(96, 256, generator=g)), torch.randn(2, 256, generator=g)
    cfg = fp8_gemm.Fp8Config(16, 32, 32, 4, 4, 1)
    first = fp8_gemm.fp8_linear(a, w, config=cfg)
    assert int(fp8_gemm._COUNTERS[a.device].abs().sum()) == 0
    assert torch.equal(fp8_gemm.fp8_linear(a, w, config=cfg), first)  # partials added in split order


def test_config_table_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode row counts take the nearest tuned bucket (above, else below) with a row tile that holds
    them; other shapes and prefill row counts take the default rule."""
    from services.common.kernels import fp8_gemm

    a, b = fp8_gemm.Fp8Config(16, 64, 256, 4, 4, 4), fp8_gemm.Fp8Config(16, 128, 128, 2, 4, 4)
    monkeypatch.setattr(fp8_gemm, "FP8_CONFIGS", {(1, 4096, 4096): a, (16, 4096, 4096): b})
    cuda = torch.device("cuda")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda device: 132)
    assert fp8_gemm.config_for(1, 4096, 4096, cuda) == a
    assert fp8_gemm.config_for(5, 4096, 4096, cuda) == b  # bucket 8: the nearest above is 16
    assert fp8_gemm.config_for(24, 4096, 4096, cuda) == b._replace(block_m=32)  # none above: below, 32 rows
    assert fp8_gemm.config_for(1, 6144, 4096, cuda) == fp8_gemm.default_config(1, 6144, 4096)
    assert fp8_gemm.config_for(300, 4096, 4096, cuda) == fp8_gemm.default_config(300, 4096, 4096)


def test_default_config_splits_decode_and_tiles_prefill() -> None:
    from services.common.kernels import fp8_gemm

    d = fp8_gemm.default_config
    assert d(1, 4096, 4096).split_k == 8 and d(1, 4096, 12288).split_k == 8
    assert d(16, 24576, 4096).split_k == 1 and d(1, 151748, 4096).split_k == 1
    assert d(32, 4096, 4096).block_m == 32 and d(512, 4096, 4096) == fp8_gemm.Fp8Config(128, 128, 64, 1, 8, 3)


def test_packed_step_buckets_take_their_own_built_in_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 64- and 128-row graph buckets (packed decode + prefill steps) have swept entries for every
    thinker GEMM but the 128-row lm_head (whose best was the default), each launchable with one row tile
    (so its K split is used), and the lookup picks them for any row count of the bucket."""
    from services.common.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    for bucket, rows in ((64, (33, 64)), (128, (65, 128))):
        for n, k in shapes + ([(151748, 4096)] if bucket == 64 else []):
            cfg = fp8_gemm.FP8_CONFIGS[(bucket, n, k)]
            assert fp8_gemm._checked("built-in", (bucket, n, k), cfg) == cfg
            assert cfg.block_m == bucket and cfg != fp8_gemm.default_config(bucket, n, k, 132)
            assert all(fp8_gemm.config_for(m, n, k, cuda) == cfg for m in rows)
    assert fp8_gemm.config_for(200, 4096, 4096, cuda) == fp8_gemm.default_config(200, 4096, 4096, 132)


@pytest.mark.usefixtures("_interpreter")
def test_check_table_flags_a_config_that_computes_something_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.thinker.fp8 --check``: a table entry agrees with the reference at its bucket's rows and a
    ragged count (plain and with the in-place residual); an entry whose kernel output is off is flagged,
    and the sweep skips such a candidate instead of timing it."""
    from bench.thinker import fp8 as bench_fp8
    from services.common.kernels import fp8_gemm

    cpu = torch.device("cpu")
    good = {(64, 80, 256): fp8_gemm.Fp8Config(64, 32, 64, 3, 4, 1)}
    rows = bench_fp8.check_table(good, cpu, torch.float32)  # type: ignore[arg-type]
    assert [r["rows"] for r in rows] == [57, 64] and all(r["ok"] for r in rows)
    real = fp8_gemm.fp8_linear

    def off_by_one(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        return out.add_(1.0)  # an output that is wrong everywhere

    monkeypatch.setattr(fp8_gemm, "fp8_linear", off_by_one)
    rows = bench_fp8.check_table(good, cpu, torch.float32)  # type: ignore[arg-type]
    assert not any(r["ok"] for r in rows) and all(r["error"] > bench_fp8.TOLERANCE for r in rows)


def test_check_refuses_a_table_file_that_is_not_a_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.thinker.fp8 --check --table FILE``: a file that is not a sweep ends with exit 2 and the
    reason, before anything runs (the thinker's own table loader)."""
    from bench.thinker.fp8 import main

    bad = tmp_path / "t.json"
    bad.write_text('{"not": "a sweep"}')
    assert main(["--device", "cpu", "--check", "--table", str(bad)]) == 2
    assert "expected the list a sweep's --json-out writes" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the thinker
def _llm(tiny_ckpt: Path) -> torch.nn.Module:
    """A fresh tiny LLM: quantization changes the module, so no test shares one."""
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    return build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")


def _steps(engine: ThinkerEngine) -> list[torch.Tensor]:
    """Logits of a two-chunk eager prefill, then of a packed-row step (decode row + short chunk)."""
    runner = engine.runner
    blocks_a, blocks_b = engine.cache.pool.allocate(8), engine.cache.pool.allocate(8)
    out = runner.step(
        StepInput(
            prefill=[
                PrefillChunk(list(range(2000, 2040)), 0, blocks_a, want_logits=True),
                PrefillChunk(list(range(3000, 3020)), 0, blocks_b, want_logits=True),
            ]
        )
    )
    step = StepInput(
        decode=[DecodeRow(7, 40, blocks_a)], prefill=[PrefillChunk([5, 6, 8], 20, blocks_b, want_logits=True)]
    )
    packed = runner.packed_step_eager(step)
    return [*out.prefill_logits, packed.decode_logits[0], packed.prefill_logits[0]]  # type: ignore[list-item]


def _engine(llm: torch.nn.Module, **config: Any) -> ThinkerEngine:
    return ThinkerEngine(
        llm, EngineConfig(max_num_seqs=4, kv_budget_bytes=8 << 20, **config), torch.device("cpu")
    )


def test_fp8_engine_decodes_greedily_with_logits_close_to_bf16(tiny_ckpt: Path) -> None:
    """``weights="fp8"`` on the torch backend: greedy decode runs end to end (tokens may differ from
    bf16's on a random tiny model), the module's projections hold fp8 values, and the logits stay close."""
    tokens, runner = greedy_tokens(_llm(tiny_ckpt), "torch", graphed=False, weights="fp8")
    assert runner.weights == "fp8" and all(len(t) == 5 for t in tokens)
    llm: Any = runner.llm
    w = llm.model.layers[0].mlp.down_proj.weight
    assert torch.equal(w, quantize_fp8(w).dequantize(w.dtype))  # a fixed point: already on the fp8 grid
    ref = _steps(_engine(_llm(tiny_ckpt)))
    got = _steps(_engine(_llm(tiny_ckpt), weights="fp8"))
    # e4m3 rounds each weight by up to 2^-4 of its row's largest (~3.6 % rms on Gaussian weights), and
    # the random tiny model's product errors add up like its products: a few % of the logits' scale per
    # GEMM. A wrong scale, row or layout misses by ~100 %.
    for r, q in zip(ref, got, strict=True):
        err = (q - r).abs()
        assert float(err.max()) < 0.15 * float(r.abs().max()), float(err.max())
        assert float(err.mean()) < 0.08 * float(r.abs().mean()), float(err.mean())
        assert float(torch.corrcoef(torch.stack([q, r]))[0, 1]) > 0.99


@pytest.mark.usefixtures("_interpreter")
@pytest.mark.parametrize("fold", [False, True])
def test_triton_fp8_step_gives_the_torch_fp8_logits(tiny_ckpt: Path, fold: bool) -> None:
    """The Triton backend's fp8 GEMMs (eager prefill and packed rows; the folded loop when the norms are
    folded) against the torch engine on the same fp8 weights. Unfolded both round the same weights, so
    they agree to fp32 summation order; folded, the norm weights were multiplied in before quantizing
    (other roundings), so the bound is the fp8 one."""
    ref = _steps(_engine(_llm(tiny_ckpt), weights="fp8"))
    engine = _engine(_llm(tiny_ckpt))
    engine.runner.set_kernels("triton")
    engine.runner.set_norm_fold(fold)
    engine.runner.quantize_weights()
    runner = engine.runner
    assert runner.head_fp8 is not None and runner.layers[0].fp8 is not None
    assert runner.layers[0].qkv_weight.numel() == 0  # the bf16 projection weights were released
    got = _steps(engine)
    for r, q in zip(ref, got, strict=True):
        if fold:
            assert float((q - r).abs().max()) < 0.15 * float(r.abs().max())
            assert float(torch.corrcoef(torch.stack([q, r]))[0, 1]) > 0.99
        else:
            torch.testing.assert_close(q, r, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="kernel backend"):
        runner.set_kernels("torch")


def test_fidelity_command_reports_fp8_against_bf16(tiny_ckpt: Path, tmp_path: Path) -> None:
    """``python -m bench.thinker.fp8_fidelity`` on the tiny checkpoint (CPU): per prompt the teacher-forced
    logit error is positive and small against the logits' spread, agreements are shares."""
    import json

    from bench.thinker.fp8_fidelity import main

    out = tmp_path / "fid.json"
    argv = ["--checkpoint", str(tiny_ckpt), "--device", "cpu", "--prompts", "2", "--tokens", "4"]
    assert main([*argv, "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["prompts"]) == 2 and result["tokens"] == 4
    for r in result["prompts"]:
        assert 0 < r["logit_mean_abs_err"] <= r["logit_max_abs_err"]
        assert r["logit_mean_abs_err_over_std"] < 0.1
        assert (
            0 <= r["teacher_forced_top1_agreement"] <= 1
            and 0 <= r["greedy_tokens_before_first_difference"] <= 4
        )
    # The KV cache alone (bf16 weights, e4m3 cache): a second engine on the same module.
    kv = tmp_path / "kv.json"
    assert main([*argv, "--weights", "bf16", "--kv-cache", "fp8", "--json-out", str(kv)]) == 0
    cache_only = json.loads(kv.read_text())
    assert (cache_only["weights"], cache_only["kv_cache"]) == ("bf16", "fp8")
    assert all(0 < r["logit_mean_abs_err_over_std"] < 0.1 for r in cache_only["prompts"])


# ---- fp8 KV cache -------------------------------------------------------------------------------------
def test_kv_cache_format_sets_the_element_type_and_the_bytes_per_token() -> None:
    from services.thinker.kv_cache import KVLayout, PagedKVCache, kv_cache_dtype

    assert kv_cache_dtype("bf16", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache"):
        kv_cache_dtype("int8", torch.bfloat16)
    bf16 = KVLayout(2, 2, 8, torch.bfloat16, 4)
    fp8 = KVLayout(2, 2, 8, torch.float8_e4m3fn, 4)
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token
    budget = 64 * bf16.bytes_per_block
    assert (
        PagedKVCache(fp8, budget, "cpu").capacity_tokens
        > 1.9 * PagedKVCache(bf16, budget, "cpu").capacity_tokens
    )


def test_cache_rows_round_to_e4m3_and_widen_exactly() -> None:
    from services.common.kernels import read_cache_rows, write_cache_rows

    cache = torch.zeros(8, 2, 4, dtype=torch.float8_e4m3fn)
    rows = torch.tensor([[[0.1, -3.3, 500.0, 1e-4]] * 2, [[2.0, -2.0, 7.9, -1000.0]] * 2])
    write_cache_rows(cache, torch.tensor([5, 1]), rows)
    got = read_cache_rows(cache, torch.tensor([5, 1]), torch.float32)
    assert torch.equal(got, rows.to(torch.float8_e4m3fn).float())
    assert float(got.abs().max()) == FP8_MAX  # beyond ±448 saturates
    assert float(cache[0].float().abs().sum()) == 0.0  # other slots untouched


def test_fp8_kv_cache_logits_close_to_the_full_precision_cache(tiny_ckpt: Path) -> None:
    """The torch path with an e4m3 cache: every key and value rounded to 3 mantissa bits, the logits of
    prefill and packed-row steps stay close to those of the model-dtype cache."""
    ref = _steps(_engine(_llm(tiny_ckpt)))
    engine = _engine(_llm(tiny_ckpt), kv_cache="fp8")
    assert engine.cache.k[0].dtype == torch.float8_e4m3fn
    got = _steps(engine)
    for r, q in zip(ref, got, strict=True):
        assert float((q - r).abs().max()) < 0.05 * float(r.abs().max())
        assert float(torch.corrcoef(torch.stack([q, r]))[0, 1]) > 0.999
    assert not torch.equal(got[0], ref[0])  # the cache did round


@pytest.mark.usefixtures("_interpreter")
def test_triton_kernels_with_an_fp8_kv_cache_track_the_torch_path(tiny_ckpt: Path) -> None:
    """The Triton kernels' fp8 stores and loads (eager prefill and the one-launch packed step) against
    the torch path on the same e4m3 cache. Only close, not equal: Triton's interpreter rounds a value
    just below a power of two down a binade when converting to e4m3 (1.97 -> 1.0; the GPU rounds to
    nearest), so exactness is checked on the GPU (``bench.cuda_smoke --kv-cache fp8``)."""
    ref = _steps(_engine(_llm(tiny_ckpt), kv_cache="fp8"))
    engine = _engine(_llm(tiny_ckpt), kv_cache="fp8")
    engine.runner.set_kernels("triton")
    got = _steps(engine)
    for r, q in zip(ref, got, strict=True):
        assert float((q - r).abs().max()) < 0.15 * float(r.abs().max())
        assert float(torch.corrcoef(torch.stack([q, r]))[0, 1]) > 0.99


@pytest.mark.usefixtures("_interpreter")
def test_rope_attention_microbench_runs_on_an_fp8_cache() -> None:
    """``bench.thinker.attention --rope --kv-cache fp8`` (the launch sweep for ``kv_cache: fp8``): one
    point at the full-size head layout, one layer and one launch, through the interpreter."""
    from bench.thinker.attention import _rope_sweep

    point = _rope_sweep(
        torch.device("cpu"),
        1,
        16,
        lambda b, c: 1,
        layers=1,
        launches=[(32, 2, 1)],
        kv_dtype=torch.float8_e4m3fn,
    )
    assert point["kv_cache"] == "float8_e4m3fn" and point["two_kernels_us"] > 0
    assert point["best"]["launch"] == "(32, 2, 1)" and point["best"]["us"] > 0


def test_a_sweep_table_file_feeds_the_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.thinker.fp8 --json-out`` rows load as table entries keyed by row bucket: a packed step's
    64- and 128-row buckets too, which the built-in table leaves to the default. A file that is not an
    fp8 sweep (a skinny table, a config the kernel cannot launch, not JSON) is refused with why."""
    import json

    from services.common.kernels import fp8_gemm, skinny

    split = [128, 64, 128, 4, 8, 3]
    rows = [
        {"rows": 128, "n": 4096, "k": 12288, "default": [128, 128, 64, 1, 8, 3], "default_us": 40.0,
         "best": {"config": split, "us": 30.0}, "best_gb_s": 1.0, "timed": []},
        {"rows": 64, "n": 6144, "k": 4096, "best": {"config": [64, 64, 128, 2, 4, 3], "us": 9.0}},
        {"rows": 1, "n": 24576, "k": 4096, "best": None},
    ]  # fmt: skip
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(rows))
    monkeypatch.setattr(fp8_gemm, "FP8_CONFIGS", {})
    assert fp8_gemm.use_table(path) == 2
    cuda = torch.device("cuda")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda device: 132)
    assert fp8_gemm.config_for(100, 4096, 12288, cuda) == fp8_gemm.Fp8Config(*split)  # bucket 128
    assert fp8_gemm.config_for(40, 6144, 4096, cuda) == fp8_gemm.Fp8Config(64, 64, 128, 2, 4, 3)
    assert fp8_gemm.config_for(1, 24576, 4096, cuda) == fp8_gemm.default_config(1, 24576, 4096)
    assert fp8_gemm.config_for(300, 4096, 12288, cuda) == fp8_gemm.default_config(300, 4096, 12288)

    skinny_rows = [{"rows": 1, "n": 4096, "k": 4096, "best": {"config": [64, 128, 4, 4, 3, True], "us": 9.0}}]
    bad = {
        "skinny.json": json.dumps(skinny_rows),
        "tile.json": json.dumps([{**rows[0], "best": {"config": [128, 48, 64, 1, 8, 3], "us": 1.0}}]),
        "short.json": json.dumps([{**rows[0], "best": {"config": [128, 64, 64], "us": 1.0}}]),
        "dict.json": json.dumps({"rows": 1}),
        "text.json": "not json",
    }
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=name):
            fp8_gemm.load_table(tmp_path / name)
    with pytest.raises(ValueError, match="not a skinny GEMM"):  # and the other way round
        skinny.load_table(path)


def test_thinker_start_refuses_a_bad_table_before_loading_the_model(tmp_path: Path) -> None:
    from services.thinker.__main__ import load_kernel_tables

    bad = tmp_path / "h200-fp8.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="thinker: kernel table .*h200-fp8.json"):
        load_kernel_tables(None, str(bad))
