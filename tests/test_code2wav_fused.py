"""The fused DiT solve (services/code2wav/model/fused_dit.py) against the package's blocks, on CPU.

The package path stays the CPU default and the one checked against the upstream oracle
(tests/test_code2wav_model.py); these tests pin the fused path to it: fp32 to float rounding, bf16 within
a stated bound, and its CUDA-graph wiring (one graph per window's whole solve, encoder graphs, the shared
output arena it writes into directly) through a host-side emulation of capture and replay.
"""

from __future__ import annotations

import argparse
import functools
import json
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.code2wav.dump import talker_windows
from services.code2wav.model.flow_step import FlowStepper
from services.code2wav.model.loader import load_token2wav
from services.code2wav.model.prompt import ReferenceVoiceEncoder
from services.code2wav.runner import Code2WavRunner, WindowCursor
from services.code2wav.service import dit_choice
from services.common.checkpoint import CODEC_SILENCE_ID, Checkpoint
from services.common.cuda_graphs import SharedBuffers
from tests.graph_emulation import emulated_capture

MEL_ATOL = 1e-4
WAV_ATOL = 1e-3  # as tests/test_code2wav_model.py: HiFT's phase integration amplifies float differences


@pytest.fixture(scope="module")
def stack(tiny_ckpt: Path) -> Iterator[types.SimpleNamespace]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ckpt = Checkpoint(tiny_ckpt)
    model = load_token2wav(ckpt.token2wav_dir, "cpu")
    voices = ReferenceVoiceEncoder(ckpt.token2wav_dir, model.device, model.dims.up_rate)
    prompt = voices.encode_file(ckpt.ref_audio_path)
    codes = torch.randint(0, 6561, (53,), generator=torch.Generator().manual_seed(4)).tolist()
    windows = talker_windows(codes, 3)  # 25 + 25 new codes, then a last window of 3
    package = Code2WavRunner(model)
    reference = [_stream(package, package.open_stream(f"p{i}", prompt, i), windows) for i in (1, 2)]
    yield types.SimpleNamespace(model=model, prompt=prompt, windows=windows, reference=reference)
    torch.set_num_threads(threads)


def _stream(runner: Code2WavRunner, state, windows) -> dict:  # noqa: ANN001
    cursor = WindowCursor()
    mels, wavs = [], []
    for tokens, last in windows:
        (res,) = runner.run([(state, runner.check_window(cursor, tokens, 3, last), last)])
        mels.append(res.mel)
        wavs.append(res.samples)
    return {"mel": torch.cat(mels, 1).numpy(), "wav": np.concatenate(wavs)}


def _batched(runner: Code2WavRunner, prompt, windows, seeds=(1, 2)) -> list[dict]:  # noqa: ANN001
    """Streams with ``seeds`` advancing together (equal windows share one batch)."""
    states = [runner.open_stream(f"s{s}", prompt, s) for s in seeds]
    cursors = [WindowCursor() for _ in seeds]
    outs = [{"mel": [], "wav": []} for _ in seeds]
    for tokens, last in windows:
        items = [
            (st, runner.check_window(c, tokens, 3, last), last) for st, c in zip(states, cursors, strict=True)
        ]
        for out, res in zip(outs, runner.run(items), strict=True):
            out["mel"].append(res.mel)
            out["wav"].append(res.samples)
    return [{"mel": torch.cat(o["mel"], 1).numpy(), "wav": np.concatenate(o["wav"])} for o in outs]


def test_fused_fp32_matches_package_blocks_batched(stack) -> None:  # noqa: ANN001
    """Two streams batched through the fused fp32 solve give each stream's package-path mel and audio."""
    runner = Code2WavRunner(stack.model, dit="fused")
    assert runner.flow.compute_dtype == torch.float32 and runner.est_cache_dtype == torch.float32
    for got, ref in zip(_batched(runner, stack.prompt, stack.windows), stack.reference, strict=True):
        assert np.abs(got["mel"] - ref["mel"]).max() < MEL_ATOL
        assert got["wav"].shape == ref["wav"].shape
        assert np.abs(got["wav"] - ref["wav"]).max() < WAV_ATOL


def test_fused_bf16_stays_close_and_keeps_bf16_caches(stack) -> None:  # noqa: ANN001
    """bf16 DiT: caches are stored in bf16 (half the bytes) and the mel stays within 2% RMS of fp32."""
    runner = Code2WavRunner(stack.model, dit="fused", dit_dtype=torch.bfloat16)
    state = runner.open_stream("b", stack.prompt, 1)
    assert state.flow.estimator_att.dtype == torch.bfloat16
    assert state.flow.conformer_att.dtype == torch.float32  # the encoder stays fp32
    got = _stream(runner, state, stack.windows)
    bound = runner.max_stream_cache_bytes(stack.prompt.frames)
    assert (
        state.cache_bytes <= bound < Code2WavRunner(stack.model).max_stream_cache_bytes(stack.prompt.frames)
    )
    ref = stack.reference[0]
    assert got["wav"].shape == ref["wav"].shape and np.isfinite(got["wav"]).all()
    rms = np.sqrt(np.mean((got["mel"] - ref["mel"]) ** 2)) / np.sqrt(np.mean(ref["mel"] ** 2))
    assert 0 < rms < 0.02, rms


def test_stage_built_with_the_fused_dit_reports_it(stack, tiny_ckpt: Path) -> None:  # noqa: ANN001
    """``--dit fused`` through the stage's own assembly: the runner uses the fused solver and GetInfo says
    so (CPU: no graphs, so start-up runs no warm-up)."""
    from services.code2wav.__main__ import build_parser
    from services.code2wav.server import stage_info
    from services.code2wav.service import build_engine

    args = build_parser().parse_args(["--checkpoint", str(tiny_ckpt), "--dit", "fused", "--voice-cache", "2"])
    engine, _ = build_engine(args)
    assert engine.runner.flow.fused is not None and not engine.runner.cuda_graphs
    props = stage_info(engine, "t").properties
    assert (props["dit"], props["dit_dtype"]) == ("fused", "float32")
    default = build_engine(build_parser().parse_args(["--checkpoint", str(tiny_ckpt)]))[0]
    assert stage_info(default, "t").properties["dit"] == "package"  # CPU default: the oracle path


def test_dit_choice_and_bad_combinations() -> None:
    def ns(**kw: str) -> argparse.Namespace:
        return argparse.Namespace(**{"device": "cpu", "dit": "auto", "dit_dtype": "auto", **kw})

    assert dit_choice(ns()) == ("package", torch.float32)  # CPU default: the oracle-checked path
    assert dit_choice(ns(device="cuda:0")) == ("fused", torch.bfloat16)
    assert dit_choice(ns(device="cuda", dit_dtype="float32")) == ("fused", torch.float32)
    assert dit_choice(ns(device="cuda", dit="package")) == ("package", torch.float32)
    assert dit_choice(ns(dit="fused")) == ("fused", torch.float32)
    with pytest.raises(ValueError, match="fp32 only"):
        FlowStepper(types.SimpleNamespace(flow=None, dims=None), dit="package", dit_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dit must be"):
        FlowStepper(types.SimpleNamespace(flow=None, dims=None), dit="onnx")


def _shared_capture(calls: list):  # noqa: ANN202
    shared = SharedBuffers()

    def capture(fn, args: tuple):  # noqa: ANN001, ANN202
        calls.append((getattr(fn, "fills_outputs", False), args))
        return emulated_capture(fn, args, shared)

    return capture, shared


def test_graphed_fused_flow_matches_eager_and_captures_last_windows(stack) -> None:  # noqa: ANN001
    """With graphs, the fused path replays one solve graph per window (not one per Euler step) and the
    encoder from its own graphs, all through one shared output arena that the next replay overwrites,
    and the audio equals the eager fused runner's bit for bit. The warm-up also captures last windows at
    batch 1, so a live short last window replays instead of running eager."""
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs

    calls: list = []
    capture, shared = _shared_capture(calls)
    runner = Code2WavRunner(stack.model, dit="fused")
    graphs = enable_cuda_graphs(runner, capture=capture)
    assert set(graphs) == {"flow_solve", "encoder", "encoder_last", "hift_f0", "hift_decode"}
    ran = runner.warm_up_shapes(
        stack.prompt, max_batch=1, first_windows=(25,), steady_windows=1, last_windows=(3,)
    )
    # first, steady, the 3-code last window from the steady state and from the first window's (a reply
    # of one window: its caches are still short of the steady length)
    assert ran == 4 and all(g.frozen for g in graphs.values())
    assert sum(fills for fills, _ in calls) == graphs["flow_solve"].captured == 4  # only the solve fills
    assert graphs["encoder_last"].captured == 2
    before = {name: (g.replays, g.eager_calls) for name, g in graphs.items()}
    graphed = _stream(runner, runner.open_stream("g", stack.prompt, 1), stack.windows)
    delta = {
        name: (g.replays - before[name][0], g.eager_calls - before[name][1]) for name, g in graphs.items()
    }
    # Two steady windows and the 3-code last window all replay: one solve replay each, no eager call.
    assert delta == {
        "flow_solve": (3, 0),
        "encoder": (2, 0),
        "encoder_last": (1, 0),
        "hift_f0": (3, 0),
        "hift_decode": (3, 0),
    }
    eager_runner = Code2WavRunner(stack.model, dit="fused")
    eager = _stream(eager_runner, eager_runner.open_stream("e", stack.prompt, 1), stack.windows)
    assert np.array_equal(graphed["mel"], eager["mel"]) and np.array_equal(graphed["wav"], eager["wav"])
    assert shared.outputs.nbytes > 0


def test_cuda_smoke_code2wav_compare_rules() -> None:
    """bench.cuda_smoke's code2wav verdicts: zero error passes, an error over the variant's bound or a
    shape change fails, and the figures are the ones the docstring names."""
    from bench.cuda_smoke_code2wav import compare

    gen = np.random.default_rng(0)
    mel = gen.standard_normal((2, 80, 40)).astype(np.float32)
    wav = (0.1 * gen.standard_normal((2, 4800))).astype(np.float32)
    same = compare("fused-fp32", (mel, wav), (mel.copy(), wav.copy()), 0.1)
    assert same.verdict == "pass" and same.mel_max_abs == same.mel_rel_rms == same.wav_rel_rms == 0
    assert same.spec_db_mean_abs == 0 and same.samples == 4800
    off = compare("fused-fp32", (mel, wav), (mel * 1.01, wav), 0.1)
    assert off.verdict == "FAIL" and off.mel_rel_rms == pytest.approx(0.01, rel=1e-3)
    assert compare("fused-bf16-graphs", (mel, wav), (mel * 1.01, wav), 0.1).verdict == "pass"  # bound 5%
    assert compare("fused-fp32", (mel, wav), (mel[:, :, :-1], wav), 0.1).verdict == "FAIL"


def test_warm_up_covers_a_realtime_units_flush_after_a_short_first_window(stack) -> None:  # noqa: ANN001
    """A realtime speaking unit with a 10-frame first window sends 10 codes, then flushes the unit's other
    15 as a window of its own, then whole 25-code windows. The warm-up captures that 15-code window from
    the first window's state, so none of the three runs eager (an eager window made code2wav's barge-in
    drain 148-187 ms on the H200), and the audio equals the eager runner's."""
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs

    calls: list = []
    capture, _ = _shared_capture(calls)
    runner = Code2WavRunner(stack.model, dit="fused")
    graphs = enable_cuda_graphs(runner, capture=capture)
    ran = runner.warm_up_shapes(
        stack.prompt, max_batch=1, first_windows=(10, 25), steady_windows=1, last_windows=()
    )
    assert ran == 5  # first 10, its 15-code flush, a steady window; first 25, a steady window
    codes = torch.randint(0, 6561, (50,), generator=torch.Generator().manual_seed(7)).tolist()
    w1 = [CODEC_SILENCE_ID] * 3 + codes[:10]
    w2 = w1[-3:] + codes[10:25]
    w3 = w2[-3:] + codes[25:50]
    windows = [(w1, False), (w2, False), (w3, False)]
    before = {name: g.eager_calls for name, g in graphs.items()}
    graphed = _stream(runner, runner.open_stream("g", stack.prompt, 1), windows)
    assert {name: g.eager_calls - before[name] for name, g in graphs.items()} == dict.fromkeys(graphs, 0)
    eager_runner = Code2WavRunner(stack.model, dit="fused")
    eager = _stream(eager_runner, eager_runner.open_stream("e", stack.prompt, 1), windows)
    assert np.array_equal(graphed["mel"], eager["mel"]) and np.array_equal(graphed["wav"], eager["wav"])


def _warmed_up(stack, max_batch: int):  # noqa: ANN001, ANN202
    """A fused runner on emulated graphs after a small warm-up (first and steady windows of 25 codes, last
    windows of 0 and 3): ``(runner, graph sets, windows run)``."""
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs

    capture, _ = _shared_capture([])
    runner = Code2WavRunner(stack.model, dit="fused")
    graphs = enable_cuda_graphs(runner, capture=capture)
    ran = runner.warm_up_shapes(
        stack.prompt, max_batch=max_batch, first_windows=(25,), steady_windows=1, last_windows=(0, 3)
    )
    return runner, graphs, ran


def test_warm_up_covers_duplex_turn_ends_at_every_batch_size(stack) -> None:  # noqa: ANN001
    """A duplex turn ends with an empty last window (its units are whole windows), and with many sessions
    several end together: the warm-up captures that window at every batch size, not only at batch 1
    (on the H200 at 16 sessions such batches of 2, 4 and 8 ran eager), and a batch of two turn ends
    replays with the eager runner's audio."""
    runner, graphs, ran = _warmed_up(stack, max_batch=2)
    # per batch size (2 and 1, both powers of two): first, steady, two last windows; at batch 1 also the
    # two last windows from the first window's state (a reply of one window)
    assert ran == 10
    codes = torch.randint(0, 6561, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    w1 = [CODEC_SILENCE_ID] * 3 + codes[:25]
    w2 = w1[-3:] + codes[25:50]
    windows = [(w1, False), (w2, False), (w2[-3:], True)]
    before = {name: g.eager_calls for name, g in graphs.items()}
    graphed = _batched(runner, stack.prompt, windows)
    assert {name: g.eager_calls - before[name] for name, g in graphs.items()} == dict.fromkeys(graphs, 0)
    eager = _batched(Code2WavRunner(stack.model, dit="fused"), stack.prompt, windows)
    for got, ref in zip(graphed, eager, strict=True):
        assert np.array_equal(got["mel"], ref["mel"]) and np.array_equal(got["wav"], ref["wav"])


def test_sub_batches_replay_the_graphed_sizes_largest_first() -> None:
    """A batch with no graph of its own runs as the largest batch sizes its key was captured at: the
    powers of two of a remainder (7 = 4 + 2 + 1), ones for a short reply's last window (captured at batch
    1 only); a key captured at its own size, or at none, stays whole, and so does anything before the
    sets are frozen."""
    key, other = ("remainder",), ("short",)
    graphed = {(key, n) for n in (1, 2, 4, 8)} | {(other, 1)}
    sets = {"flow_solve": types.SimpleNamespace(frozen=True)}
    runner = types.SimpleNamespace(graphed_batches=graphed, graph_sets=sets)
    split = functools.partial(Code2WavRunner.sub_batches, runner)
    assert {n: split(key, n) for n in (1, 3, 5, 7, 8, 11, 15)} == {
        1: [1],
        3: [2, 1],
        5: [4, 1],
        7: [4, 2, 1],
        8: [8],
        11: [8, 2, 1],
        15: [8, 4, 2, 1],
    }
    assert split(other, 3) == [1, 1, 1] and split(("never",), 3) == [3]
    sets["flow_solve"].frozen = False
    assert split(key, 7) == [7]


def test_replies_ending_together_replay_as_power_of_two_sub_batches(stack) -> None:  # noqa: ANN001
    """Three replies ending together with a 3-code remainder: the warm-up captured that last window at
    batch 2 and 1 (powers of two) but not 3, so the runner runs it as 2 + 1, each replaying its graphs,
    instead of one eager batch of 3 (before: eager on every set). Steady windows, which have a graph at
    batch 3, stay whole; each stream gets the eager runner's audio for its own seed, in input order."""
    runner, graphs, ran = _warmed_up(stack, max_batch=3)
    # first and steady at batch 3, 2, 1; the empty last at each; the 3-code one at 2, 1; at batch 1 both
    # last windows from the first window's state too
    assert ran == 13
    codes = torch.randint(0, 6561, (53,), generator=torch.Generator().manual_seed(11)).tolist()
    w1 = [CODEC_SILENCE_ID] * 3 + codes[:25]
    w2 = w1[-3:] + codes[25:50]
    windows = [(w1, False), (w2, False), (w2[-3:] + codes[50:], True)]
    seeds = (1, 2, 3)
    before = {name: g.eager_calls for name, g in graphs.items()}
    graphed = _batched(runner, stack.prompt, windows, seeds)
    assert {name: g.eager_calls - before[name] for name, g in graphs.items()} == dict.fromkeys(graphs, 0)
    assert runner.last_batch_sizes == [3, 3, 2, 1]
    eager_runner = Code2WavRunner(stack.model, dit="fused")
    eager = _batched(eager_runner, stack.prompt, windows, seeds)
    assert eager_runner.last_batch_sizes == [3, 3, 3]  # no graphs: never split
    # The CPU's float rounding depends on the batch size, so the whole eager batch of 3 agrees to rounding
    # and an eager runner made to split the same way agrees bit for bit.
    split_runner = Code2WavRunner(stack.model, dit="fused")
    split_runner.sub_batches = lambda key, size: [2, 1] if key[5] and size == 3 else [size]  # type: ignore[method-assign]
    split = _batched(split_runner, stack.prompt, windows, seeds)
    for got, ref, whole in zip(graphed, split, eager, strict=True):
        assert np.array_equal(got["mel"], ref["mel"]) and np.array_equal(got["wav"], ref["wav"])
        assert np.abs(got["mel"] - whole["mel"]).max() < MEL_ATOL
        assert np.abs(got["wav"] - whole["wav"]).max() < WAV_ATOL
    # The empty last window (3 context codes) has its own graph at batch 3: it stays one batch.
    # (The steady state's keys: the ones with graphs above batch 1; a first window's state has its last
    # windows at batch 1 only, test_short_replies_end_on_graphs_one_at_a_time.)
    (empty,) = {key for key, n in runner.graphed_batches if key[5] and key[4] == 3 and n == 3}
    (remainder,) = {key for key, n in runner.graphed_batches if key[5] and key[4] == 6 and n == 2}
    assert runner.sub_batches(empty, 3) == [3] and runner.sub_batches(remainder, 3) == [2, 1]
    assert runner.sub_batches(remainder, 4) == [2, 2]  # no graph at 4 (the warm-up stopped at 3)
    unseen = (*remainder[:4], 9, *remainder[5:])  # a last window of a size never captured: eager, whole
    assert runner.sub_batches(unseen, 3) == [3]


def test_short_replies_end_on_graphs_one_at_a_time(stack) -> None:  # noqa: ANN001
    """A reply of one window ends from caches still short of their steady length. The warm-up captures
    those last windows at batch 1 (before, they ran eager: a batch of 4 such windows took 267 ms on the
    H100 under load), and three replies ending together replay as 1 + 1 + 1 with nothing eager, each
    with the audio of an eager runner split the same way."""
    runner, graphs, _ = _warmed_up(stack, max_batch=3)
    codes = torch.randint(0, 6561, (28,), generator=torch.Generator().manual_seed(13)).tolist()
    w1 = [CODEC_SILENCE_ID] * 3 + codes[:25]
    windows = [(w1, False), (w1[-3:] + codes[25:], True)]
    seeds = (1, 2, 3)
    before = {name: g.eager_calls for name, g in graphs.items()}
    graphed = _batched(runner, stack.prompt, windows, seeds)
    assert {name: g.eager_calls - before[name] for name, g in graphs.items()} == dict.fromkeys(graphs, 0)
    assert runner.last_batch_sizes[-4:] == [3, 1, 1, 1]
    split_runner = Code2WavRunner(stack.model, dit="fused")
    split_runner.sub_batches = lambda key, size: [1] * size if key[5] else [size]  # type: ignore[method-assign]
    split = _batched(split_runner, stack.prompt, windows, seeds)
    for got, ref in zip(graphed, split, strict=True):
        assert np.array_equal(got["mel"], ref["mel"]) and np.array_equal(got["wav"], ref["wav"])


def test_warm_up_of_two_window_sizes_leaves_neither_eager(stack) -> None:  # noqa: ANN001
    """``--window-codes 25,50``: the warm-up captures both steady sizes (each with its own first window),
    so a turn of 50-code windows after a 10-code first window and a realtime unit's 25-code windows both
    replay, with nothing eager."""
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs

    calls: list = []
    capture, _ = _shared_capture(calls)
    runner = Code2WavRunner(stack.model, dit="fused")
    graphs = enable_cuda_graphs(runner, capture=capture)
    ran = runner.warm_up_shapes(
        stack.prompt, max_batch=1, first_windows=(10,), steady_windows=2, steady_new=(25, 50), last_windows=()
    )
    # per size: first 10 + its flush + 2 steady windows, and a first window of the size + 2 steady
    assert ran == (1 + 1 + 2) + (1 + 2) + (1 + 1 + 2) + (1 + 2)
    codes = torch.randint(0, 6561, (160,), generator=torch.Generator().manual_seed(9)).tolist()

    def turn(sizes: list[int]) -> list[tuple[list[int], bool]]:
        out, context, at = [], [CODEC_SILENCE_ID] * 3, 0
        for n in sizes:
            window = context + codes[at : at + n]
            out.append((window, False))
            context, at = window[-3:], at + n
        return out

    before = {name: g.eager_calls for name, g in graphs.items()}
    _stream(runner, runner.open_stream("w50", stack.prompt, 1), turn([10, 50, 50]))
    _stream(runner, runner.open_stream("w25", stack.prompt, 1), turn([10, 15, 25, 25]))
    assert {name: g.eager_calls - before[name] for name, g in graphs.items()} == dict.fromkeys(graphs, 0)


def test_short_replies_bench_runs_its_cases_on_cpu(
    tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench.code2wav_short_replies (the GPU figure of the warm-up's short-reply last windows) runs its
    procedure end to end on the tiny checkpoint: every reply shape, its last window timed on the stage's
    runner and on an eager one; without graphs nothing can run eager from a frozen set."""
    from bench.code2wav_short_replies import REPLIES, main

    assert (
        main(
            [
                "--checkpoint",
                str(tiny_ckpt),
                "--device",
                "cpu",
                "--batches",
                "1",
                "--reps",
                "1",
                "--max-batch",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    result = json.loads(out[: out.index("\n}\n") + 2])
    assert [c["reply"] for c in result["cases"]] == list(REPLIES)
    assert all(c["as_run"] == [1] and c["eager_calls"] == 0 and c["eager_ms"] > 0 for c in result["cases"])
    assert "| chat reply of 50 frames (10 + 25 + 15) | 1 | 1 |" in out
