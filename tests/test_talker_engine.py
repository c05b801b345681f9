"""Talker engine on the tiny checkpoint: batching vs a plain loop, seeds, turn forms, budgets, rollover,
interrupts and window framing of real runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from services.common.checkpoint import Checkpoint
from services.common.errors import INVALID_ARGUMENT, StageError
from services.talker import sampling as smp
from services.talker.engine import TalkerEngine
from services.talker.model.tts import MiniCPMTTS
from services.talker.streams import (
    ConditionInput,
    DoneOut,
    ErrorOut,
    InterruptAckOut,
    Output,
    StreamState,
    WindowOut,
)

EOS = 6561
SIL = 4218


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> MiniCPMTTS:
    return MiniCPMTTS.from_checkpoint(Checkpoint(tiny_ckpt))


def cond_input(
    model: MiniCPMTTS,
    n: int,
    seed: int,
    *,
    last: bool = True,
    turn_end: bool = False,
    epoch: int = 0,
    turn: int = 0,
) -> ConditionInput:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151000, (n,), generator=gen)
    return ConditionInput(
        ids, torch.randn(n, model.cfg.llm_dim, generator=gen), last, turn_end, epoch, turn, 0
    )


class Sink:
    def __init__(self) -> None:
        self.items: list[Output] = []

    def __call__(self, out: Output) -> None:
        self.items.append(out)

    @property
    def windows(self) -> list[WindowOut]:
        return [o for o in self.items if isinstance(o, WindowOut)]

    @property
    def frames(self) -> list[int]:
        return [c for w in self.windows for c in w.window.codes[w.window.left_context :]]

    @property
    def done(self) -> list[DoneOut]:
        return [o for o in self.items if isinstance(o, DoneOut)]


def eos_bias(model: MiniCPMTTS, monkeypatch: pytest.MonkeyPatch, bias: float = 1e4) -> None:
    """Make EOS the model's favourite so stopping rules are observable on random weights."""
    original = model.head_logits

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden).clone()
        logits[..., EOS] += bias
        return logits

    monkeypatch.setattr(model, "head_logits", biased)


def _reference_greedy(
    model: MiniCPMTTS, cond: torch.Tensor, codes: list[int], min_frames: int, penalty: float
):
    """Plain unbatched loop (transformers LlamaModel + DynamicCache), teacher-forced on the engine's codes.

    Returns (raw logits per step, processed scores per step) with upstream's whole-utterance rules written
    out directly: temperature, penalty over the last 16 frames from step 1, top-p/top-k (argmax-neutral),
    EOS masked for t < min_frames.
    """
    raws, scores = [], []
    with torch.inference_mode():
        cache = DynamicCache()
        res = model.model(
            inputs_embeds=cond[None],
            position_ids=torch.arange(cond.shape[0])[None],
            past_key_values=cache,
            use_cache=True,
        )
        pos = cond.shape[0]
        for t in range(len(codes) + 1):
            raw = model.head_logits(res.last_hidden_state[0, -1])
            s = raw.clone()
            if t > 0:
                for tok in set(codes[max(0, t - 16) : t]):
                    alpha = penalty ** codes[max(0, t - 16) : t].count(tok)
                    s[tok] = s[tok] * alpha if s[tok] < 0 else s[tok] / alpha
            if t < min_frames:
                s[EOS] = float("-inf")
            raws.append(raw)
            scores.append(s)
            if t == len(codes):
                break
            x = model.emb_code[0](torch.tensor([[codes[t]]]))
            res = model.model(
                inputs_embeds=x, position_ids=torch.tensor([[pos]]), past_key_values=cache, use_cache=True
            )
            pos += 1
    return raws, scores


def test_greedy_batched_engine_equals_plain_reference_loop(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=4)
    taps: dict[int, list[torch.Tensor]] = {}
    engine.logits_observer = lambda st, lg: taps.setdefault(id(st), []).append(lg.clone())
    prefill_sizes: list[int] = []
    batched_prefill = engine.runner.prefill_batch
    engine.runner.prefill_batch = lambda items: (prefill_sizes.append(len(items)), batched_prefill(items))[1]
    greedy = engine.default_sampling(temperature=1.0, greedy=True)  # penalty 1.05 from tts_config stays on
    sinks, streams, conds = [], [], []
    for i, n in enumerate((5, 12, 8)):
        sink = Sink()
        st = engine.open(engine.make_settings(sampling=greedy, fixed_frames=40 + 5 * i), sink)
        c = cond_input(model, n, 100 + i)
        engine.chunk(st, c)
        if i == 2:
            engine.step()  # stream 2 joins a batch that is already decoding
            engine.step()
        sinks.append(sink)
        streams.append(st)
        conds.append(c)
    engine.run_until_idle()
    checked = 0
    for i, (sink, st, c) in enumerate(zip(sinks, streams, conds, strict=True)):
        codes = sink.frames
        assert len(codes) == 40 + 5 * i and sink.done[0].finish_reason == "stop"
        whole = model.whole_utterance_condition(c.token_ids, c.hidden)
        raws, scores = _reference_greedy(model, whole, codes[:-1], min_frames=50, penalty=1.05)
        mine = taps[id(st)]
        assert len(mine) == len(codes)
        for t, (a, raw, s) in enumerate(zip(mine, raws, scores, strict=True)):
            torch.testing.assert_close(a, raw, rtol=1e-4, atol=1e-4)
            top2 = s.topk(2).values
            if float(top2[0] - top2[1]) > 1e-3:  # near-ties of random weights may flip; skip those
                assert int(s.argmax()) == codes[t], f"stream {i} step {t}"
                checked += 1
    assert checked > 100
    assert prefill_sizes[0] == 3  # the three conditions arrived before the first step: one batched prefill


def test_prefill_warm_up_leaves_every_slot_empty(model: MiniCPMTTS) -> None:
    """The start-up burst prefill (``warmup_prefill``, run by the server on CUDA) feeds every slot at once
    and empties them again: a stream afterwards decodes exactly as on a cold engine (with the warm-up's
    rows left counted, its prefill would start behind them and attend to them)."""

    def warm(engine: TalkerEngine) -> None:  # bursts of 1, 2 and 3 streams at two widths
        assert engine.runner.warmup_prefill(widths=(4, 16)) == (1 + 2 + 3) * (4 + 16)
        assert engine.runner.cache.lengths == [0, 0, 0]

    assert _frames_after(model, warm) == _frames_after(model, None)


def _frames_after(model: MiniCPMTTS, warm: Callable[[TalkerEngine], None] | None) -> list[int]:
    """The frames of one greedy stream on a 3-slot engine, after ``warm`` ran on it (None: cold)."""
    engine = TalkerEngine(model, max_streams=3)
    if warm is not None:
        warm(engine)
    sink = Sink()
    greedy = engine.default_sampling(temperature=1.0, greedy=True)
    st = engine.open(engine.make_settings(sampling=greedy, fixed_frames=30), sink)
    engine.chunk(st, cond_input(model, 6, 7))
    engine.run_until_idle()
    return sink.frames


def test_a_failed_batched_prefill_falls_back_to_one_prefill_per_stream(model: MiniCPMTTS) -> None:
    """If the batched forward fails, each stream is prefilled alone (only a stream at fault would get an
    error): the streams still produce exactly the frames of an engine whose batched prefill works."""

    def run(break_batches: bool) -> list[list[int]]:
        engine = TalkerEngine(model, max_streams=4)
        if break_batches:

            def failing(items: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
                raise RuntimeError("batched prefill broke")

            engine.runner.prefill_batch = failing
        greedy = engine.default_sampling(temperature=1.0, greedy=True)
        sinks = []
        for i, n in enumerate((4, 9, 6)):
            sink = Sink()
            engine.chunk(
                engine.open(engine.make_settings(sampling=greedy, fixed_frames=12), sink),
                cond_input(model, n, 300 + i),
            )
            sinks.append(sink)
        engine.run_until_idle()
        assert all(len(sink.done) == 1 for sink in sinks)
        assert not [o for sink in sinks for o in sink.items if isinstance(o, ErrorOut)]
        return [sink.frames for sink in sinks]

    assert run(break_batches=True) == run(break_batches=False)


def _seeded_frames(model: MiniCPMTTS, extra_streams: int, frames: int = 60) -> list[int]:
    engine = TalkerEngine(model, max_streams=8)
    target = Sink()
    st = engine.open(
        engine.make_settings(sampling=engine.default_sampling(seed=1234), fixed_frames=frames), target
    )
    others = []
    for k in range(extra_streams):
        s = Sink()
        o = engine.open(
            engine.make_settings(sampling=engine.default_sampling(seed=k), fixed_frames=frames + 7 * k), s
        )
        engine.chunk(o, cond_input(model, 4 + k, 500 + k))
        engine.step()
        others.append(s)
    engine.chunk(st, cond_input(model, 9, 42))
    engine.run_until_idle()
    assert all(len(s.frames) > 0 for s in others)
    return target.frames


def test_seeded_sampling_is_batch_invariant(model: MiniCPMTTS) -> None:
    alone = _seeded_frames(model, 0)
    crowded = _seeded_frames(model, 3)
    assert len(alone) == 60 and alone == crowded
    assert len(set(alone)) > 10  # really sampled, not a constant


def test_whole_utterance_min_50_frames_and_eos_never_emitted(model: MiniCPMTTS, monkeypatch) -> None:
    eos_bias(model, monkeypatch)
    engine = TalkerEngine(model, max_streams=2)
    sink = Sink()
    engine.chunk(engine.open(engine.make_settings(), sink), cond_input(model, 6, 7))
    engine.run_until_idle()
    assert len(sink.frames) == 50 and EOS not in sink.frames
    assert sink.done[0].finish_reason == "stop" and sink.done[0].frames == 50
    assert EOS not in [c for w in sink.windows for c in w.window.codes]


def test_whole_utterance_max_frames_gives_length(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=1)
    sink = Sink()
    engine.chunk(
        engine.open(engine.make_settings(max_new_frames=30, min_new_frames=30), sink), cond_input(model, 6, 8)
    )
    engine.run_until_idle()
    if sink.done[0].finish_reason == "length":
        assert len(sink.frames) == 30
    else:  # random weights may sample EOS right at the floor
        assert len(sink.frames) <= 30


def test_streaming_turn_over_its_frame_budget_drops_its_other_chunks(model: MiniCPMTTS) -> None:
    """A turn that reaches max_new_frames in its first chunk ends there (one Done, frames = the budget);
    its other chunks, queued or arriving later, start no turn of their own."""
    engine = TalkerEngine(model, max_streams=1)
    sink = Sink()
    st = engine.open(engine.make_settings(max_new_frames=12), sink)
    engine.chunk(st, cond_input(model, 10, 70, last=False))
    engine.chunk(st, cond_input(model, 10, 71, last=False))
    engine.run_until_idle()
    engine.chunk(st, cond_input(model, 10, 72, last=True))  # the turn's last chunk, after its end
    engine.run_until_idle()
    assert [d.finish_reason for d in sink.done] == ["length"] and len(sink.frames) == 12
    assert sum(w.window.is_last for w in sink.windows) == 1 and not st.skip_to_last


def test_streaming_chunks_stop_at_eos_and_recompute_previous_chunk(model: MiniCPMTTS, monkeypatch) -> None:
    eos_bias(model, monkeypatch, bias=6.0)  # EOS likely but not certain: chunks end on the model's EOS
    engine = TalkerEngine(model, max_streams=1)
    obs: list[tuple[int, int, int]] = []  # (segment, step in segment, cache length at these logits)
    engine.logits_observer = lambda st, lg: obs.append(
        (st.turn_segments, st.seg_t, engine.runner.cache.lengths[st.slot])
    )
    sink = Sink()
    st = engine.open(engine.make_settings(sampling=engine.default_sampling(seed=3)), sink)
    for k in range(3):
        engine.chunk(st, cond_input(model, 10, 60 + k, last=k == 2))
    engine.run_until_idle()
    assert len(sink.done) == 1 and EOS not in sink.frames
    assert sum(w.window.is_last for w in sink.windows) == 1 and sink.windows[-1].window.is_last
    per_seg = [[o for o in obs if o[0] == k] for k in range(3)]
    frames = [len(seg) - 1 for seg in per_seg]  # every chunk ended on a sampled EOS
    assert sum(frames) == len(sink.frames)
    # chunk 0: 10 rows + audio_bos; later chunks (sliding_recompute) restart from position 0 with
    # previous condition + previous chunk's frames + this condition (+ text_eos on the last chunk)
    assert [seg[0][2] for seg in per_seg] == [11, 11 + frames[0] + 11, 11 + frames[1] + 12]


def test_duplex_units_budgets_and_turn_end(model: MiniCPMTTS, monkeypatch) -> None:
    eos_bias(model, monkeypatch)
    engine = TalkerEngine(model, max_streams=1)
    sink = Sink()
    st = engine.open(engine.make_settings(duplex=True), sink)
    engine.chunk(st, cond_input(model, 5, 1, last=False))  # turn start: EOS allowed at once → 0 frames
    engine.chunk(st, cond_input(model, 5, 2, last=False))  # mid-turn: EOS masked for all 26 samples
    engine.chunk(st, cond_input(model, 5, 3, last=False))
    engine.chunk(st, cond_input(model, 5, 4, last=False, turn_end=True))  # turn end: no floor → EOS
    engine.end(st)
    engine.run_until_idle()
    assert len(sink.frames) == 50  # 0 + 25 + 25 + 0
    assert EOS not in sink.frames
    assert [w.window.is_last for w in sink.windows] == [False, False, True]
    assert sink.done[-1].frames == 50


def test_duplex_new_turn_id_closes_the_open_turn(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=1)
    sink = Sink()
    st = engine.open(engine.make_settings(duplex=True), sink)
    engine.chunk(st, cond_input(model, 5, 1, last=False, turn=1))
    engine.chunk(st, cond_input(model, 5, 2, last=False, turn=1))
    engine.chunk(st, cond_input(model, 5, 3, last=False, turn=2))  # turn 1 never got turn_end
    engine.end(st)
    engine.run_until_idle()
    last = [w for w in sink.windows if w.window.is_last]
    assert [w.meta.turn_id for w in last] == [1, 2]
    fresh = [w for w in sink.windows if w.meta.turn_id == 2]
    assert fresh[0].window.codes[:3] == [SIL] * 3 and len(sink.done) == 1


def test_duplex_turn_end_ignores_eos_just_after_the_25_frame_boundary(model: MiniCPMTTS, monkeypatch) -> None:
    original = model.head_logits
    calls = {"n": 0}

    def eos_from_step_25(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden).clone()
        if calls["n"] >= 25:  # call k gives the logits of sample t = k (one stream)
            logits[..., EOS] += 1e4
        calls["n"] += 1
        return logits

    monkeypatch.setattr(model, "head_logits", eos_from_step_25)
    engine = TalkerEngine(model, max_streams=1)
    sink = Sink()
    st = engine.open(engine.make_settings(duplex=True), sink)
    engine.chunk(st, cond_input(model, 5, 1, last=False, turn_end=True))
    engine.end(st)
    engine.run_until_idle()
    # EOS is masked for t = 25..29 at a turn end, then honoured: 30 frames, not 25 (and not 103)
    assert len(sink.frames) == 30 and EOS not in sink.frames


def test_duplex_rollover_keeps_the_stream_going_past_4096(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=1)
    lengths: list[int] = []
    engine.logits_observer = lambda st, lg: lengths.append(engine.runner.cache.lengths[st.slot])
    sink = Sink()
    st = engine.open(engine.make_settings(duplex=True), sink)
    units = 12  # each unit: 400 condition rows + audio_bos + 25 frames = 426 positions → > 4096 in total
    for u in range(units):
        engine.chunk(st, cond_input(model, 400, 900 + u, last=False, turn_end=u == units - 1))
    engine.end(st)
    engine.run_until_idle()
    assert not any(isinstance(o, StageError) for o in sink.items)
    assert units * 426 > 4096 and max(lengths) <= 4096
    assert len(sink.frames) >= 25 * (units - 2)  # mid-turn units always give 25 frames
    firsts = lengths[::26][: units - 1]
    # unit k starts at 401 + 426 k until the next unit would not fit; then it restarts at the
    # one-chunk recompute window: previous condition (401) + its 25 frames + this condition (401)
    assert 827 in firsts[2:] and any(b < a for a, b in zip(firsts, firsts[1:], strict=False))


def test_interrupt_drops_work_and_acks(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=2)
    sink = Sink()
    st = engine.open(engine.make_settings(fixed_frames=200), sink)
    engine.chunk(st, cond_input(model, 6, 1))
    for _ in range(60):
        engine.step()
    before = len(sink.frames)
    engine.interrupt(st, 1)
    engine.chunk(st, cond_input(model, 6, 2, epoch=0))  # stale epoch: ignored
    engine.run_until_idle()
    acks = [o for o in sink.items if isinstance(o, InterruptAckOut)]
    assert len(acks) == 1 and acks[0].new_epoch == 1 and acks[0].dropped_items == 1
    assert len(sink.frames) == before and not sink.done
    engine.chunk(st, cond_input(model, 6, 3, epoch=1))
    engine.run_until_idle()
    assert len(sink.done) == 1 and sink.done[0].meta.epoch == 1 and sink.done[0].frames == 200
    new_windows = [w for w in sink.windows if w.meta.epoch == 1]
    assert new_windows[0].window.codes[:3] == [SIL] * 3  # the new turn starts with fresh padding


def test_more_streams_than_slots_queue_and_finish(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=2)
    sinks = [Sink() for _ in range(5)]
    for i, s in enumerate(sinks):
        engine.chunk(engine.open(engine.make_settings(fixed_frames=30), s), cond_input(model, 4, i))
    engine.run_until_idle()
    assert all(len(s.frames) == 30 and len(s.done) == 1 for s in sinks)
    assert engine.runner.cache.free_slots == 2


def test_bad_chunks_raise_typed_errors_before_queueing(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=1)
    st: StreamState = engine.open(engine.make_settings(), Sink())
    bad: list[Callable[[], ConditionInput]] = [
        lambda: ConditionInput(
            torch.tensor([1, 2]), torch.randn(2, model.cfg.llm_dim + 1), True, False, 0, 0, 0
        ),
        lambda: ConditionInput(
            torch.tensor([1, 10**6]), torch.randn(2, model.cfg.llm_dim), True, False, 0, 0, 0
        ),
    ]
    for make in bad:
        with pytest.raises(StageError) as exc:
            engine.chunk(st, make())
        assert exc.value.code == INVALID_ARGUMENT
    assert engine.run_until_idle() >= 1 and not st.queue


def test_duplex_penalty_history_is_per_unit(model: MiniCPMTTS) -> None:
    row = smp.RowState(smp.SamplingParams(0.8, 0.85, 25, 1.05, 0))
    engine = TalkerEngine(model, max_streams=1)
    st = engine.open(engine.make_settings(duplex=True), Sink())
    engine.chunk(st, cond_input(model, 5, 1, last=False))
    engine.chunk(st, cond_input(model, 5, 2, last=False))
    seen: list[int] = []
    engine.logits_observer = lambda s, lg: seen.append(len(s.row.history) if s.seg_t == 0 else -1)
    engine.end(st)
    engine.run_until_idle()
    assert [h for h in seen if h >= 0] == [0, 0]  # each unit starts with an empty penalty history
    assert row.history == []


def test_first_window_size_and_flush_control(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=1)
    sink = Sink()
    st = engine.open(engine.make_settings(fixed_frames=40, first_window_frames=10), sink)
    engine.chunk(st, cond_input(model, 5, 11))
    engine.run_until_idle()
    sizes = [(w.window.left_context, w.window.new_frames, w.window.is_last) for w in sink.windows]
    assert sizes == [(3, 10, False), (3, 25, False), (3, 5, True)]
    assert sink.windows[0].window.codes[:3] == [SIL] * 3
    assert [w.meta.chunk_seq for w in sink.windows] == [0, 1, 2]

    # Flush: a duplex mid-turn unit's buffered frames leave now instead of waiting for 25
    flushed = Sink()
    st = engine.open(engine.make_settings(duplex=True, window_frames=40), flushed)
    engine.chunk(st, cond_input(model, 5, 12, last=False))
    engine.chunk(st, cond_input(model, 5, 13, last=False))
    engine.run_until_idle()
    before = len(flushed.windows)
    engine.flush(st)
    engine.run_until_idle()
    assert len(flushed.windows) == before + 1 and not flushed.windows[-1].window.is_last
    assert len(flushed.frames) == 50


def test_empty_whole_utterance_finishes_without_audio(model: MiniCPMTTS) -> None:
    engine = TalkerEngine(model, max_streams=1)
    sink = Sink()
    st = engine.open(engine.make_settings(), sink)
    engine.chunk(
        st,
        ConditionInput(
            torch.zeros(0, dtype=torch.long), torch.zeros(0, model.cfg.llm_dim), True, False, 0, 0, 0
        ),
    )
    engine.run_until_idle()
    assert sink.frames == [] and sink.done[0].frames == 0
    assert [w.window.codes for w in sink.windows] == [[SIL] * 3]  # one last window so Code2Wav can close


def test_scratch_stream_warm_up_leaves_the_engine_empty(model: MiniCPMTTS) -> None:
    """The server's start-up scratch streams (``warm_up_streams``, on CUDA) run bursts through the whole
    engine path on its thread, in both condition forms, and wait until the engine closed them: no stream
    and no used slot remain, and a stream afterwards decodes exactly as on a cold engine."""
    from services.talker.warmup import warm_up_streams

    def warm(engine: TalkerEngine) -> None:
        with pytest.raises(RuntimeError, match="engine.start"):
            warm_up_streams(engine, (1,))
        engine.start()
        try:
            assert warm_up_streams(engine, (1, 3), max_frames=6) == 4
        finally:
            engine.shutdown()
        assert engine.num_streams == 0 and engine.runner.cache.free_slots == 3

    assert _frames_after(model, warm) == _frames_after(model, None)


def test_prefill_attention_never_takes_cudnn(model: MiniCPMTTS, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager prefill's SDPA runs with cuDNN attention switched off: on the H200 cuDNN built a plan for
    each new (batch, rows, keys) shape on first use, 60-1500 ms each (``bench/gpu/sdpa_probe.py``), and prefill
    shapes change with every burst. The switch is checked where SDPA is called."""
    from services.talker import runner as runner_mod

    seen: list[bool] = []
    sdpa = runner_mod.F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(runner_mod.F, "scaled_dot_product_attention", spy)
    engine = TalkerEngine(model, max_streams=2)
    for i in range(2):
        engine.chunk(engine.open(engine.make_settings(fixed_frames=2), Sink()), cond_input(model, 5 + i, i))
    engine.run_until_idle()
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # only inside the call: the process default is untouched
