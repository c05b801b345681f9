"""K decode steps per replay (services/talker/multistep.py) against one step per replay, on the tiny checkpoint.

The block path must generate exactly what the one-step path generates: the same codes, windows, Done
records and logits for every turn form (whole utterance, streaming chunks, duplex units with a turn
end), seeded sampling with a strong repetition penalty (so the device-side penalty history matters),
EOS floors that change inside a block, rows ending at different steps and a stream joining mid-decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.checkpoint import Checkpoint
from services.talker import multistep
from services.talker import sampling as smp
from services.talker.engine import TalkerEngine
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import TalkerRunner
from services.talker.streams import ConditionInput, Output, StreamState, WindowOut

EOS = 6561


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> MiniCPMTTS:
    return MiniCPMTTS.from_checkpoint(Checkpoint(tiny_ckpt))


def _cond(
    model: MiniCPMTTS, n: int, seed: int, *, last: bool = True, turn_end: bool = False
) -> ConditionInput:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151000, (n,), generator=gen)
    return ConditionInput(ids, torch.randn(n, model.cfg.llm_dim, generator=gen), last, turn_end, 0, 0, 0)


def _eos_bias(model: MiniCPMTTS, monkeypatch: pytest.MonkeyPatch, bias: float) -> None:
    """EOS likely but not certain, so segments end on a sampled EOS at varied steps."""
    original = model.head_logits

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden).clone()
        logits[..., EOS] += bias
        return logits

    monkeypatch.setattr(model, "head_logits", biased)


Trace = dict[str, list[object]]


def _engine(model: MiniCPMTTS, k: int, streams: int) -> tuple[TalkerEngine, Trace]:
    engine = TalkerEngine(model, max_streams=streams, steps_per_replay=k)
    assert (engine.runner.blocks is not None) == (k > 1)
    trace: Trace = {}

    def observe(st: StreamState, logits: torch.Tensor) -> None:
        assert st.slot is not None and st.row is not None
        state = (st.turn_segments, st.seg_t, engine.runner.cache.lengths[st.slot], st.row.draws)
        trace.setdefault(st.settings.request_id, []).append((state, logits.clone()))

    engine.logits_observer = observe
    return engine, trace


def _sampling(engine: TalkerEngine, seed: int) -> smp.SamplingParams:
    return engine.default_sampling(seed=seed, repetition_penalty=1.6, temperature=0.9)


def _whole_and_join(model: MiniCPMTTS, k: int) -> tuple[dict[str, list[Output]], Trace]:
    """Three whole utterances ending at different steps: fixed counts (EOS masked) and one that samples
    the (strongly biased) EOS as soon as its floor of 6 frames lifts, inside a block for k = 3 and 8;
    the third joins after two engine steps, while the others decode."""
    engine, trace = _engine(model, k, 4)
    outs: dict[str, list[Output]] = {}
    specs = [
        ("a", dict(fixed_frames=37), 11),
        ("b", dict(min_new_frames=6, max_new_frames=45), 12),
        ("c", dict(fixed_frames=23), 13),
    ]
    for name, extra, seed in specs:
        outs[name] = []
        st = engine.open(
            engine.make_settings(request_id=name, sampling=_sampling(engine, seed), **extra),  # type: ignore[arg-type]
            outs[name].append,
        )
        if name == "c":
            engine.step()
            engine.step()
        engine.chunk(st, _cond(model, 6 + seed % 5, seed))
        engine.end(st)
    engine.run_until_idle()
    return outs, trace


def _streaming(model: MiniCPMTTS, k: int) -> tuple[dict[str, list[Output]], Trace]:
    engine, trace = _engine(model, k, 2)
    outs: dict[str, list[Output]] = {"s": []}
    st = engine.open(engine.make_settings(request_id="s", sampling=_sampling(engine, 5)), outs["s"].append)
    for c in range(3):
        engine.chunk(st, _cond(model, 8, 40 + c, last=c == 2))
    engine.end(st)
    engine.run_until_idle()
    return outs, trace


def _duplex(model: MiniCPMTTS, k: int) -> tuple[dict[str, list[Output]], Trace]:
    """Turn start (EOS allowed), two mid-turn units (25 frames), a turn-end unit; a second stream in a
    whole utterance shares the batch so rows end at different steps."""
    engine, trace = _engine(model, k, 2)
    outs: dict[str, list[Output]] = {"d": [], "w": []}
    d = engine.open(
        engine.make_settings(request_id="d", duplex=True, sampling=_sampling(engine, 8)), outs["d"].append
    )
    w = engine.open(
        engine.make_settings(request_id="w", sampling=_sampling(engine, 9), fixed_frames=41), outs["w"].append
    )
    engine.chunk(w, _cond(model, 7, 70))
    for u in range(4):
        engine.chunk(d, _cond(model, 5, 80 + u, last=False, turn_end=u == 3))
    engine.end(d)
    engine.end(w)
    engine.run_until_idle()
    return outs, trace


SCENARIOS = {
    "whole_and_join": (_whole_and_join, 1e4),
    "streaming": (_streaming, 3.0),
    "duplex": (_duplex, 5.0),
}


def _frames(items: list[Output]) -> list[int]:
    return [c for o in items if isinstance(o, WindowOut) for c in o.window.codes[o.window.left_context :]]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_k_steps_per_replay_generate_exactly_what_one_step_does(
    model: MiniCPMTTS, monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    run, bias = SCENARIOS[scenario]
    _eos_bias(model, monkeypatch, bias)
    ref_out, ref_trace = run(model, 1)
    assert all(_frames(items) for items in ref_out.values())
    assert sum(len(set(_frames(items))) for items in ref_out.values()) > 20  # really sampled
    for k in (3, 8):
        out, trace = run(model, k)
        assert out == ref_out, f"k={k}: outputs differ"  # windows, Done, metas, in each stream's order
        assert trace.keys() == ref_trace.keys()
        for name, steps in ref_trace.items():
            got = trace[name]
            assert [s for s, _ in got] == [s for s, _ in steps], f"k={k} stream {name}: step states differ"
            for (_, a), (_, b) in zip(got, steps, strict=True):
                if scenario == "whole_and_join":
                    # the joining stream enters the batch at a block boundary, so some steps of the others
                    # run in a different batch bucket (GEMM shape): fp32 noise, as for any batch change
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
                else:
                    assert torch.equal(a, b), f"k={k} stream {name}: logits differ"


@pytest.mark.parametrize("k", [3, 8])
def test_duplex_turn_end_eos_window_inside_a_block(
    model: MiniCPMTTS, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """A turn-end unit ignores EOS for t = 25..29; a block spanning t = 28..30 (k = 3) or 25..32 (k = 8)
    must lift the mask at t = 30 mid-block, as one step at a time does."""
    original = model.head_logits
    calls = {"n": 0}

    def eos_from_sample_25(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden).clone()
        if calls["n"] >= 25:  # one stream alone: call t gives the logits of sample t (until it ends)
            logits[..., EOS] += 1e4
        calls["n"] += 1
        return logits

    monkeypatch.setattr(model, "head_logits", eos_from_sample_25)

    def run(steps: int) -> list[Output]:
        calls["n"] = 0
        engine = TalkerEngine(model, max_streams=1, steps_per_replay=steps)
        out: list[Output] = []
        st = engine.open(engine.make_settings(duplex=True, sampling=_sampling(engine, 2)), out.append)
        engine.chunk(st, _cond(model, 5, 1, last=False, turn_end=True))
        engine.end(st)
        engine.run_until_idle()
        return out

    ref = run(1)
    assert len(_frames(ref)) == 30 and EOS not in _frames(ref)
    assert run(k) == ref


def test_eos_ends_segments_inside_blocks(model: MiniCPMTTS, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenarios above really end segments by EOS off block boundaries (else they prove little)."""
    _eos_bias(model, monkeypatch, SCENARIOS["streaming"][1])
    _, trace = _streaming(model, 1)
    per_segment: dict[int, int] = {}
    for (segment, _t, _len, _draws), _ in trace["s"]:
        per_segment[segment] = per_segment.get(segment, 0) + 1
    # samples per chunk = 1 after the prefill + decode steps; some chunk's decode steps are not a multiple of 8
    assert len(per_segment) == 3 and any((n - 1) % 8 for n in per_segment.values())


def test_plan_caps_steps_by_context_room_and_the_length_bucket(model: MiniCPMTTS) -> None:
    runner = TalkerRunner(model, num_slots=4)
    blocks = multistep.BlockDecoder(runner, 8)
    assert blocks.lengths == [1, 2, 4, 8] and multistep.block_lengths(6) == [1, 2, 4, 6]
    lengths = runner.cache.lengths
    lengths[0], lengths[1] = 30, 61  # top 61: bucket 64 holds positions up to 63 → 3 steps for everyone
    assert blocks.plan([0, 1], [8, 8]) == ([3, 3], 64)
    lengths[1] = 64  # top 64: bucket 128, room for 8
    assert blocks.plan([0, 1], [8, 2]) == ([8, 2], 128)
    ctx = runner.context
    lengths[2] = ctx - 2  # two positions left in slot 2's context
    steps, read_len = blocks.plan([0, 2], [8, 8])
    assert steps[1] == 2 and read_len == ctx
    lengths[2] = ctx
    with pytest.raises(ValueError, match="context limit"):
        blocks.plan([2], [8])


def test_select_steps() -> None:
    assert multistep.select_steps(None, graphs=False) == 1
    assert multistep.select_steps(None, graphs=True) == multistep.DEFAULT_STEPS_ON_CUDA
    assert multistep.select_steps(2, graphs=True) == 2
    assert multistep.select_steps(8, graphs=False) == 8
    with pytest.raises(ValueError):
        multistep.select_steps(0, graphs=True)


def _block_vs_steps(model: MiniCPMTTS, kernels: str) -> None:
    """Runner level: one 4-step block over slots 1 and 2 (row 2 stops after 2 steps; rows 0, 3 idle)
    equals four one-step replays, and the K/V the block wrote past row 2's end is never read: row 2
    continuing from its true length gives the ids of a runner that never ran past it."""
    vocab = model.cfg.num_audio_tokens
    conds = [model.whole_utterance_condition(*_pair(model, n, 60 + n)) for n in (5, 8)]
    slots = [1, 2]

    def fresh() -> tuple[TalkerRunner, list[smp.RowState]]:
        runner = TalkerRunner(model, num_slots=4, kernels=kernels)
        for s, c in zip(slots, conds, strict=True):
            runner.prefill(s, c)
        return runner, [smp.RowState(smp.SamplingParams(0.8, 0.85, 25, 1.6, s)) for s in (3, 4)]

    def one_step(
        runner: TalkerRunner, rows: list[smp.RowState], use: list[int], codes: list[int], t: int
    ) -> list[int]:
        packed = [smp.pack_row(rows[i], smp.whole_utterance_rules(t, 3), vocab) for i in use]
        ids, _ = runner.decode_sample([slots[i] for i in use], codes, packed)
        for i, code in zip(use, ids, strict=True):
            rows[i].remember(code)
        return ids

    ref, ref_rows = fresh()
    codes, ref_ids = [17, 18], [[], []]  # type: ignore[var-annotated]
    for t in range(1, 5):
        use = [0, 1] if t <= 2 else [0]
        ids = one_step(ref, ref_rows, use, [codes[i] for i in use], t)
        for i, code in zip(use, ids, strict=True):
            ref_ids[i].append(code)
            codes[i] = code
    runner, rows = fresh()
    blocks = multistep.BlockDecoder(runner, 4)
    steps, read_len = blocks.plan(slots, [4, 4])
    assert steps == [4, 4]
    knobs = [
        [smp.step_knobs(r.params, smp.whole_utterance_rules(1 + j, 3), r.draws + j) for j in range(n)]
        for r, n in zip(rows, steps, strict=True)
    ]
    got, _ = blocks.decode(slots, [17, 18], [r.history for r in rows], knobs, read_len)
    assert got[0] == ref_ids[0] and got[1][:2] == ref_ids[1]
    # row 2 keeps only its first 2 ids: the K/V the block wrote at its next 2 positions is stale, and
    # continuing from its true length must give what the runner that never went past it gives
    runner.cache.lengths[1] += 4
    runner.cache.lengths[2] += 2
    for code in got[1][:2]:
        rows[1].remember(code)
    rows[1].draws = 2
    cont = one_step(runner, rows, [1], [got[1][1]], 3)
    want = one_step(ref, ref_rows, [1], [ref_ids[1][-1]], 3)
    assert cont == want
    assert runner.cache.lengths[2] == ref.cache.lengths[2]


def test_block_equals_one_step_replays_torch_path(model: MiniCPMTTS) -> None:
    _block_vs_steps(model, "torch")


@pytest.mark.usefixtures("triton_interpreter_scalars")
def test_block_equals_one_step_replays_fused_path(model: MiniCPMTTS) -> None:
    _block_vs_steps(model, "triton")


def _pair(model: MiniCPMTTS, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151000, (n,), generator=gen), torch.randn(n, model.cfg.llm_dim, generator=gen)
