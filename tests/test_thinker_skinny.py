"""The skinny O-projection GEMM (services.common.kernels.skinny) against torch, on CPU.

As in ``test_common_kernels.py`` the Triton kernel runs through Triton's interpreter (fp32 and fp16: the
interpreter has no bf16 arithmetic). ``linear_accumulate`` is compared with ``residual + h @ W.T`` in
fp32, with and without split-K; then its config table, and the tuning microbench that writes it. The
folded decode loop that runs it is tested in ``test_thinker_norm_fold.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU
triton = pytest.importorskip("triton")


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

    One rounding of the output to ``dtype`` (eps·|ref|) plus the fp32 summation order of the product (at
    most eps per term of ``|a|·|w|``); 4·eps·(|a|@|w|.T) covers it with margin. A wrong tile, row or split
    misses by a sizeable fraction of |ref| and fails it.
    """
    eps = torch.finfo(dtype).eps
    return eps * ref.abs() + 4 * eps * F.linear(a.float().abs(), w.float().abs())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_linear_accumulate_is_addmm_into_the_residual(dtype: torch.dtype, m: int) -> None:
    """``linear_accumulate`` = ``residual + h @ W.T`` rounded once, into a new tensor (residual untouched)
    or into the residual itself, with and without split-K."""
    sk = _sk()
    g = torch.Generator().manual_seed(10 + m)
    for n, k in ((80, 256), (48, 200)):  # 200: K not a multiple of any block
        h = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / 8).to(dtype)
        res = torch.randn(m, n, generator=g).to(dtype)
        want = res.float() + F.linear(h.float(), w.float())
        bound = _bound(h, w, F.linear(h.float(), w.float()), dtype) + torch.finfo(dtype).eps * want.abs()
        for cfg in _configs():
            before = res.clone()
            got = sk.linear_accumulate(h, w, res, config=cfg)
            assert got.dtype == dtype and got.shape == (m, n)
            assert torch.equal(res, before) and got.data_ptr() != res.data_ptr()
            assert bool(((got.float() - want).abs() <= bound).all()), (n, k, cfg)
            inplace = res.clone()
            out = sk.linear_accumulate(h, w, inplace, out=inplace, config=cfg)
            assert out.data_ptr() == inplace.data_ptr()
            assert torch.equal(inplace, got)  # the same sums, whichever buffer they land in
    with pytest.raises(ValueError, match="residual"):
        sk.linear_accumulate(h, w, res[:, :40])
    with pytest.raises(ValueError, match="does not fit"):
        sk.linear_accumulate(h[:, :100].contiguous(), w, res)


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
    x, w, res = (
        torch.randn(2, 128, generator=g),
        torch.randn(96, 128, generator=g),
        torch.randn(2, 96, generator=g),
    )
    cfg = sk.SkinnyConfig(32, 32, 4, 4, 1, True)
    first = sk.linear_accumulate(x, w, res, config=cfg)
    assert int(sk._COUNTERS[x.device].abs().sum()) == 0
    # deterministic: partials added in split order
    assert torch.equal(sk.linear_accumulate(x, w, res, config=cfg), first)


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


def test_tuning_microbench_writes_a_loadable_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.thinker.skinny`` on a shrunken O shape: every candidate config matches cuBLAS's addmm, and
    its ``--json-out`` loads as table entries (the file the ``kernel_table`` profile key names)."""
    import json

    from bench.thinker import skinny as bench

    out = tmp_path / "o.json"
    assert bench.main(["--device", "cpu", "--rows", "1", "--scale", "32", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["rows"], r["shape"], r["n"], r["k"]) for r in rows] == [(1, "o", 128, 128)]
    sweep = rows[0]["sweep"]
    assert sweep and all("us" in e and e["max_abs_err"] < 1e-4 for e in sweep), sweep
    sk = _sk()
    monkeypatch.setattr(sk, "SKINNY_CONFIGS", {})
    assert sk.use_table(out) == 1 and sk.config_for(1, 128, 128) == sk.SkinnyConfig(
        *rows[0]["best"]["config"]
    )
