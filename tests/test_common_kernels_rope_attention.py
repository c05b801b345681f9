"""The one-launch rotary + K/V write + attention kernel (``kernels.rope_attention``) on CPU.

It runs through Triton's interpreter against ``TorchOps.rope_attention`` (``qk_rope_store`` then
``paged_attention``) on a packed step that has every kind of row: decode rows of two sequences, a
prefill chunk in the middle of a sequence, one from position 0 and a padded row. The cache slots this
step writes start as garbage, so a kernel that read a fresh key back from the cache would fail.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from services.common.kernels import AttentionTiles, TorchOps, rope_attention_enabled  # noqa: E402

HQ, HKV, D, PAGE, HIDDEN = 4, 2, 32, 4, 80


@pytest.fixture(autouse=True)
def _interpreter_scalars(triton_interpreter_scalars: None) -> None:
    """Every test here runs the kernels through the interpreter (see ``conftest.py``)."""


def _packed_step(dtype: torch.dtype, splits: int) -> dict:
    """Rows ``[A@9 | B@3..7 | C@0..2 | D@6 | pad]`` over scattered pages, like ``ModelRunner.pack_rows``."""
    g = torch.Generator().manual_seed(7)
    blocks = {"A": [3, 9, 1], "B": [4, 11], "C": [6], "D": [8, 2]}
    rows = [("A", 9)] + [("B", p) for p in range(3, 8)] + [("C", p) for p in range(3)] + [("D", 6)]
    width = 4
    table = torch.zeros(len(rows) + 1, width, dtype=torch.long)  # the pad row keeps the scratch block 0
    pos = torch.zeros(len(rows) + 1, dtype=torch.long)
    slots = torch.zeros(len(rows) + 1, dtype=torch.long)  # the pad row writes scratch slot 0
    for i, (seq, p) in enumerate(rows):
        used = p // PAGE + 1
        table[i, :used] = torch.tensor(blocks[seq][:used])
        pos[i] = p
        slots[i] = blocks[seq][used - 1] * PAGE + p % PAGE
    t = len(rows) + 1
    return {
        "qkv": torch.randn(t, (HQ + 2 * HKV) * D, generator=g).to(dtype),
        "w": (1 + 0.1 * torch.randn(HQ + HKV, D, generator=g)).to(dtype),
        "cos": torch.randn(16, D, generator=g).to(dtype),
        "sin": torch.randn(16, D, generator=g).to(dtype),
        "x": (3 * torch.randn(t, HIDDEN, generator=g)).to(dtype),
        "k": torch.randn(12 * PAGE, HKV, D, generator=g).to(dtype),
        "v": torch.randn(12 * PAGE, HKV, D, generator=g).to(dtype),
        "slots": slots,
        "tiles": AttentionTiles(torch.arange(t), torch.ones(t, dtype=torch.long), torch.arange(t), pos, table, PAGE, 1, splits),
    }  # fmt: skip


def _run(ops, s: dict, norm: bool, scaled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    k, v = s["k"].clone(), s["v"].clone()
    out = ops.rope_attention(
        s["qkv"], s["w"] if norm else None, 1e-6, s["cos"], s["sin"], s["slots"], k, v, s["tiles"], HQ,
        (s["x"], 1e-6) if scaled else None,
    )  # fmt: skip
    return out, k, v


def _launched(s: dict, launch: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel on step ``s`` (norm and folded input norm on) with an explicit ``launch``."""
    from services.common.kernels.triton_ops import TritonOps

    k, v = s["k"].clone(), s["v"].clone()
    out = TritonOps.rope_attention(
        s["qkv"], s["w"], 1e-6, s["cos"], s["sin"], s["slots"], k, v, s["tiles"], HQ, (s["x"], 1e-6), launch,
    )  # fmt: skip
    return out, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_rope_attention_matches_rotary_then_attention(dtype: torch.dtype, splits: int) -> None:
    from services.common.kernels.triton_ops import TritonOps

    s = _packed_step(dtype, splits)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=3e-3)
    ctol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    for norm, scaled in [(True, True), (True, False), (False, False)]:
        want, want_k, want_v = _run(TorchOps, s, norm, scaled)
        got, got_k, got_v = _run(TritonOps, s, norm, scaled)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(got_k, want_k, **ctol)  # every row's K at its slot, nothing else
        torch.testing.assert_close(got_v, want_v, **ctol)
    # The fresh keys come from the QKV rows, never back from the cache: with every write sent to the
    # scratch slot (so the fresh slots keep their garbage), the output is still the reference's. The
    # interpreter runs programs one after another, so without this a kernel reading the cache would pass.
    want = _run(TorchOps, s, True, True)[0]
    s["slots"] = torch.zeros_like(s["slots"])
    torch.testing.assert_close(_run(TritonOps, s, True, True)[0], want, **tol)
    # A second launch (a graph replay, the next layer): the split counters were left at zero.
    torch.testing.assert_close(_run(TritonOps, s, True, True)[0], want, **tol)


@pytest.mark.parametrize("splits", [1, 2])
def test_rope_attention_early_values_change_nothing(splits: int) -> None:
    """``v_early`` (a launch's fourth field: each key block's values loaded beside its keys) only moves a
    load: the output and the cache writes are bit-identical to the default order's, at several key-block
    widths."""
    s = _packed_step(torch.float16, splits)

    def run(launch: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launched(s, launch)

    for block_n in (16, 32):
        late, early = run((block_n, 4, 1)), run((block_n, 4, 1, 1))
        for a, b in zip(late, early, strict=True):
            assert torch.equal(a, b)
    want = _run(TorchOps, s, True, True)[0]
    torch.testing.assert_close(run((16, 4, 1, 1))[0], want, rtol=0, atol=3e-3)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_rope_attention_preloaded_first_block(splits: int) -> None:
    """``preload`` (a launch's fifth field: each split's first key block loaded before the prologue) only
    moves loads for a row without fresh rows (A, B@3, C@0, D, the pad): bit-identical output; the rows of
    a chunk, whose splits it cuts from the position instead, match the reference; and the fresh rows'
    slots it loads with the first block never reach the output, even holding NaN."""
    s = _packed_step(torch.float16, splits)

    def run(launch: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launched(s, launch)

    want = _run(TorchOps, s, True, True)[0]
    plain, pre = run((16, 4, 1, 1, 0)), run((16, 4, 1, 1, 1))
    no_fresh = [0, 1, 6, 9, 10]
    assert torch.equal(plain[0][no_fresh], pre[0][no_fresh])
    assert torch.equal(plain[1], pre[1]) and torch.equal(plain[2], pre[2])  # the same cache writes
    torch.testing.assert_close(pre[0], want, rtol=0, atol=3e-3)
    fresh_slots = s["slots"][[2, 3, 4, 5, 7, 8]]
    s["k"][fresh_slots] = float("nan")
    s["v"][fresh_slots] = float("nan")
    s["slots"] = torch.zeros_like(s["slots"])  # every write to the scratch slot: the NaN stays
    torch.testing.assert_close(run((16, 4, 1, 1, 1))[0], want, rtol=0, atol=3e-3)
    s["k"], s["v"] = s["k"].to(torch.float8_e4m3fn), s["v"].to(torch.float8_e4m3fn)  # a one-byte cache
    plain, pre = run((16, 4, 1, 1, 0)), run((16, 4, 1, 1, 1))
    assert torch.equal(plain[0][no_fresh], pre[0][no_fresh]) and not pre[0].isnan().any()


def test_rope_attention_rejects_prefill_tiles() -> None:
    from services.common.kernels.triton_ops import TritonOps

    s = _packed_step(torch.float32, 1)
    tiles = s["tiles"]
    s["tiles"] = AttentionTiles(tiles.row, tiles.length, tiles.seq, tiles.pos, tiles.table, PAGE, 16)
    with pytest.raises(ValueError, match="one-row tiles"):
        _run(TritonOps, s, True, True)


def test_rope_attention_is_the_default() -> None:
    assert rope_attention_enabled() and rope_attention_enabled(True) and not rope_attention_enabled(False)


def test_fresh_row_window_covers_every_one_launch_step() -> None:
    """The kernel looks back ``LOOKBACK`` rows for fresh rows; the thinker runs it for packed steps of
    up to ``ROPE_ATTENTION_MAX_ROWS`` rows (a chunk is never longer than its step), so a larger limit
    would silently drop keys."""
    from services.common.kernels.rope_attention import LOOKBACK
    from services.thinker.fused_forward import ROPE_ATTENTION_MAX_ROWS

    assert ROPE_ATTENTION_MAX_ROWS <= LOOKBACK
