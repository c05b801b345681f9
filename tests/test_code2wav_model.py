"""Code2Wav model-level tests on the tiny checkpoint (CPU): streaming equals an unbatched reference
built from the stepaudio2 modules' own streaming path, batch invariance, sample counts, cache bound,
window validation, reference-voice errors and the safe flow.yaml loader."""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.code2wav.dump import talker_windows
from services.code2wav.model import flow_yaml
from services.code2wav.model.loader import load_token2wav
from services.code2wav.model.prompt import ReferenceAudioError, ReferenceVoiceEncoder
from services.code2wav.runner import Code2WavRunner, WindowCursor, cfm_noise_table
from services.common.checkpoint import CODEC_SILENCE_ID, Checkpoint
from services.common.cuda_graphs import SharedBuffers
from services.common.errors import INVALID_ARGUMENT, OUT_OF_ORDER, StageError
from tests.graph_emulation import emulated_capture, recording_capture

MEL_ATOL = 1e-4
WAV_ATOL = 1e-3  # HiFT's phase integration amplifies float-order differences (docs/model.md, Tiny checkpoint)


@pytest.fixture(scope="module")
def stack(tiny_ckpt: Path) -> Iterator[types.SimpleNamespace]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier on the shared 2-core host; restored for other test modules
    ckpt = Checkpoint(tiny_ckpt)
    model = load_token2wav(ckpt.token2wav_dir, "cpu")
    voices = ReferenceVoiceEncoder(ckpt.token2wav_dir, model.device, model.dims.up_rate)
    prompt = voices.encode_file(ckpt.ref_audio_path)
    yield types.SimpleNamespace(
        ckpt=ckpt, model=model, voices=voices, prompt=prompt, runner=Code2WavRunner(model)
    )
    torch.set_num_threads(threads)


def _codes(seed: int, n: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stream(runner: Code2WavRunner, states: list, windows: list[list[tuple[list[int], bool]]]) -> list[dict]:
    """Feed stream i its windows; all streams advance together so equal windows share a batch."""
    cursors = [WindowCursor() for _ in states]
    outs: list[dict] = [{"mel": [], "wav": [], "counts": []} for _ in states]
    for step in range(len(windows[0])):
        items = []
        for state, cursor, wins in zip(states, cursors, windows, strict=True):
            tokens, last = wins[step]
            items.append((state, runner.check_window(cursor, tokens, 3, last), last))
        for out, res in zip(outs, runner.run(items), strict=True):
            out["mel"].append(res.mel)
            out["wav"].append(res.samples)
            out["counts"].append(res.samples.shape[0])
    return [
        {"mel": torch.cat(o["mel"], 1).numpy(), "wav": np.concatenate(o["wav"]), "counts": o["counts"]}
        for o in outs
    ]


class _NoNoiseTorch:
    """Stands in for ``torch`` inside the HiFT source module: its random draws become zeros."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def rand(*size: int, **kw: object) -> torch.Tensor:
        return torch.zeros(*size, **kw)

    @staticmethod
    def randn_like(t: torch.Tensor, **kw: object) -> torch.Tensor:
        return torch.zeros_like(t, **kw)


def _package_reference(ckpt: Checkpoint, prompt, noise: torch.Tensor, windows, monkeypatch) -> dict:  # noqa: ANN001
    """Straightforward per-stream streaming with the package's own drivers (setup_cache,
    inference_chunk, HiFTGenerator.forward, fade_in_out), batch 1, fresh modules, small scratch buffers."""
    from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator
    from stepaudio2.flashcosyvoice.modules.hifigan_components import layers
    from stepaudio2.token2wav import fade_in_out

    monkeypatch.setattr(layers, "torch", _NoNoiseTorch())
    ref = load_token2wav(ckpt.token2wav_dir, "cpu")
    flow, d = ref.flow, ref.dims
    frames = 600
    dec = flow.decoder
    dec.register_buffer("rand_noise", noise.clone(), persistent=False)
    dec.register_buffer(
        "cnn_cache_buffer", torch.zeros(10, d.dit_depth, 2, 2 * d.dit_hidden, 2), persistent=False
    )
    dec.register_buffer(
        "att_cache_buffer",
        torch.zeros(10, d.dit_depth, 2, d.dit_heads, frames, 2 * d.dit_head_dim),
        persistent=False,
    )
    dec.estimator.register_buffer(
        "att_cache_buffer",
        torch.zeros(d.dit_depth, 2, d.dit_heads, frames, 2 * d.dit_head_dim),
        persistent=False,
    )
    dec.estimator.register_buffer(
        "cnn_cache_buffer", torch.zeros(d.dit_depth, 2, 2 * d.dit_hidden, 2), persistent=False
    )
    hift = HiFTGenerator()
    state = torch.load(ckpt.token2wav_dir / "hift.pt", map_location="cpu", weights_only=True)
    hift.load_state_dict({k.removeprefix("generator."): v for k, v in state.items()})
    hift.eval()

    def clone(c: dict) -> dict:
        return {k: v.clone() for k, v in c.items()}

    P = prompt.frames
    silence = torch.full((1, 3), CODEC_SILENCE_ID, dtype=prompt.tokens.dtype)
    cache = clone(
        flow.setup_cache(torch.cat([prompt.tokens, silence], 1), prompt.mel, prompt.spk_emb, n_timesteps=10)
    )
    h_mel, h_src, h_speech = torch.zeros(1, 80, 0), torch.zeros(1, 1, 0), torch.zeros(1, 0)
    window = torch.from_numpy(np.hamming(2 * 3840))
    mels, wavs = [], []
    with torch.inference_mode():
        for tokens, last in windows:
            mel, cache = flow.inference_chunk(torch.tensor([tokens]), prompt.spk_emb, cache, last, 10)
            cache = clone(cache)
            if cache["estimator_att_cache"].shape[4] > P + 100:
                e = cache["estimator_att_cache"]
                cache["estimator_att_cache"] = torch.cat([e[:, :, :, :, :P], e[:, :, :, :, -100:]], 4)
            if cache["conformer_att_cache"].shape[3] > P + 100:
                c = cache["conformer_att_cache"]
                cache["conformer_att_cache"] = torch.cat([c[:, :, :, :P], c[:, :, :, -100:]], 3)
            full = torch.cat([h_mel, mel], 2)
            speech, source = hift(full, h_src)
            if h_speech.shape[-1] > 0:
                speech = fade_in_out(speech, h_speech, window)
            h_mel, h_src, h_speech = full[..., -8:], source[:, :, -3840:], speech[:, -3840:]
            mels.append(mel[0])
            wavs.append((speech if last else speech[:, :-3840])[0].numpy())
    return {
        "mel": torch.cat(mels, 1).numpy(),
        "wav": np.concatenate(wavs),
        "counts": [w.shape[0] for w in wavs],
    }


def test_streaming_matches_package_reference_and_sample_counts(stack, monkeypatch) -> None:  # noqa: ANN001
    codes = _codes(1, 53)
    windows = talker_windows(codes, 3)
    assert [len(w) for w, _ in windows] == [28, 28, 6]
    noise = cfm_noise_table(7, 80, stack.runner.noise_frames(stack.prompt.frames))
    state = stack.runner.open_stream("a", stack.prompt, noise=noise)
    ours = _stream(stack.runner, [state], [windows])[0]
    assert ours["counts"] == [20160, 24000, 9600]
    ref = _package_reference(stack.ckpt, stack.prompt, noise, windows, monkeypatch)
    assert ref["counts"] == ours["counts"]
    assert np.abs(ours["mel"] - ref["mel"]).max() <= MEL_ATOL
    assert np.abs(ours["wav"] - ref["wav"]).max() <= WAV_ATOL
    assert np.abs(ours["wav"]).max() > 0.01  # not a silent pass


def test_batch_invariance_and_seed_reproducibility(stack) -> None:  # noqa: ANN001
    """Three streams (two voices, three seeds) batched together equal each stream run alone.

    Tolerance: mel 1e-4, wave 1e-3 max abs (batched GEMMs may sum in another order)."""
    rate = 24000
    t = np.arange(int(4.5 * rate)) / rate
    other = (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    prompts = [stack.prompt, stack.prompt, stack.voices.encode(other, rate)]
    assert prompts[2].frames == prompts[0].frames  # normalised to 6 s: equal shapes, one batch
    seeds = [1, 2, 3]
    windows = [
        [(w, False), (w[-3:] + w[:3], True)] for w in ([CODEC_SILENCE_ID] * 3 + _codes(s, 25) for s in seeds)
    ]
    runner = stack.runner
    batched = _stream(
        runner, [runner.open_stream(str(s), p, s) for s, p in zip(seeds, prompts, strict=True)], windows
    )
    assert runner.last_batch_sizes[-2:] == [3, 3]
    for i, (seed, prompt) in enumerate(zip(seeds, prompts, strict=True)):
        alone = _stream(runner, [runner.open_stream("solo", prompt, seed)], [windows[i]])[0]
        assert alone["counts"] == batched[i]["counts"] == [20160, 9600]
        assert np.abs(alone["mel"] - batched[i]["mel"]).max() <= MEL_ATOL
        assert np.abs(alone["wav"] - batched[i]["wav"]).max() <= WAV_ATOL
    assert np.abs(batched[0]["mel"] - batched[1]["mel"]).max() > 1e-2  # seeds matter


def test_cache_memory_bound_after_100_windows(stack) -> None:  # noqa: ANN001
    runner = Code2WavRunner(stack.model, n_timesteps=1)  # one ODE step: same cache rules, faster test
    state = runner.open_stream("long", stack.prompt, 5)
    bound = runner.max_stream_cache_bytes(stack.prompt.frames)
    cursor, prev = WindowCursor(), [CODEC_SILENCE_ID] * 3
    codes = _codes(9, 400)
    for i in range(100):
        tokens = prev + codes[4 * i : 4 * i + 4]
        prev = tokens[-3:]
        res = runner.run([(state, runner.check_window(cursor, tokens, 3, False), False)])[0]
        assert res.samples.shape[0] == (8 * 480 if i else 8 * 480 - 3840)
        assert state.cache_bytes <= bound
    assert state.flow.att_frames == stack.prompt.frames + 100
    assert state.flow.conformer_att.shape[3] == stack.prompt.frames + 100
    assert state.samples_emitted == 100 * 4 * 2 * 480 - 3840


def test_bf16_caches_halve_memory(stack) -> None:  # noqa: ANN001
    runner16 = Code2WavRunner(stack.model, cache_dtype=torch.bfloat16)
    s16 = runner16.open_stream("bf", stack.prompt, 1)
    s32 = stack.runner.open_stream("fp", stack.prompt, 1)
    assert s16.flow.nbytes * 2 == s32.flow.nbytes


def test_window_validation_errors(stack) -> None:  # noqa: ANN001
    runner = stack.runner
    good = [CODEC_SILENCE_ID] * 3 + list(range(25))
    with pytest.raises(StageError) as err:
        runner.check_window(WindowCursor(), good[:-1] + [6561], 3, False)
    assert err.value.code == INVALID_ARGUMENT and "out of range" in err.value.message
    with pytest.raises(StageError) as err:
        runner.check_window(WindowCursor(), good[:5], 3, False)
    assert err.value.code == INVALID_ARGUMENT and "too short" in err.value.message
    with pytest.raises(StageError) as err:
        runner.check_window(WindowCursor(), good, 2, False)
    assert err.value.code == INVALID_ARGUMENT
    cursor = WindowCursor()
    runner.check_window(cursor, good, 3, False)
    with pytest.raises(StageError) as err:  # context must repeat the previous window's last 3 codes
        runner.check_window(cursor, [1, 2, 3] + list(range(25)), 3, False)
    assert err.value.code == INVALID_ARGUMENT
    runner.check_window(cursor, good[-3:] + [7, 8], 3, True)
    with pytest.raises(StageError) as err:
        runner.check_window(cursor, [7, 8, 8, 9, 9, 9, 9], 3, False)
    assert err.value.code == OUT_OF_ORDER
    # A first window without context gets the silence context prepended.
    assert runner.check_window(WindowCursor(), list(range(25)), 0, False)[:3] == [CODEC_SILENCE_ID] * 3


@pytest.mark.parametrize(
    ("samples", "rate", "match"),
    [
        (np.full(16000 * 3, np.nan, dtype=np.float32), 16000, "NaN"),
        (np.random.default_rng(0).normal(size=8000).astype(np.float32), 16000, "at least"),
        (np.zeros(16000 * 3, dtype=np.float32), 16000, "silent"),
        (np.ones(100, dtype=np.float32), 100, "sample rate"),
    ],
)
def test_bad_reference_audio(stack, samples: np.ndarray, rate: int, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ReferenceAudioError, match=match):
        stack.voices.encode(samples, rate)


def test_voice_features_cached_by_content(stack) -> None:  # noqa: ANN001
    samples = np.random.default_rng(1).normal(scale=0.1, size=24000 * 2).astype(np.float32)
    a = stack.voices.encode(samples, 24000)
    hits = stack.voices.hits
    b = stack.voices.encode(samples.copy(), 24000)
    assert b is a and stack.voices.hits == hits + 1
    assert a.tokens.shape[1] == 150 and a.mel.shape[1] == 300


def test_flow_yaml_rejects_foreign_tags(tmp_path: Path) -> None:
    bad = tmp_path / "flow.yaml"
    bad.write_text("flow: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(flow_yaml.FlowConfigError):
        flow_yaml.load_flow_from_yaml(bad)
    bad.write_text("flow: !new:os.system\n  command: 'true'\n")
    with pytest.raises(flow_yaml.FlowConfigError):
        flow_yaml.load_flow_from_yaml(bad)


def test_graph_replay_semantics_match_eager(stack) -> None:  # noqa: ANN001
    """The graphed code path (static inputs, reused outputs, shape keys) gives the eager numbers."""
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs

    runner = Code2WavRunner(stack.model)
    graphs = enable_cuda_graphs(runner, capture=emulated_capture)
    windows = talker_windows(_codes(4, 53), 3)[:2]
    graphed = _stream(runner, [runner.open_stream("g", stack.prompt, 1)], [windows])[0]
    eager = _stream(stack.runner, [stack.runner.open_stream("e", stack.prompt, 1)], [windows])[0]
    assert np.array_equal(graphed["mel"], eager["mel"]) and np.array_equal(graphed["wav"], eager["wav"])
    assert len(graphs["dit"].graphs) == 2 and graphs["dit"].replays == 20  # caches of 300 and 350 frames
    assert len(graphs["hift_decode"].graphs) == 2  # 50 and 8 + 50 mel frames


def test_graphs_sharing_input_and_output_arenas_match_eager(stack) -> None:  # noqa: ANN001
    """Every graph (DiT, f0, decoder) reading its inputs from and writing its outputs into the same bytes,
    as on CUDA, still gives the eager numbers: inputs are copied in before each replay, and the code
    consumes each replay's outputs before the next replay of any graph."""
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs

    shared = SharedBuffers()
    shared_capture = functools.partial(emulated_capture, shared=shared)
    runner = Code2WavRunner(stack.model, nsf_noise=True)
    eager_runner = Code2WavRunner(stack.model, nsf_noise=True)
    graphs = enable_cuda_graphs(runner, capture=shared_capture)
    windows = talker_windows(_codes(4, 53), 3)[:2]
    graphed = _stream(runner, [runner.open_stream("g", stack.prompt, 1)], [windows])[0]
    eager = _stream(eager_runner, [eager_runner.open_stream("e", stack.prompt, 1)], [windows])[0]
    assert np.array_equal(graphed["mel"], eager["mel"]) and np.array_equal(graphed["wav"], eager["wav"])
    entries = [entry for g in graphs.values() for entry in g.graphs.values() if entry is not None]
    assert len(entries) == 6 and shared.inputs.allocations == shared.outputs.allocations == 1
    assert {e.outputs[0].data_ptr() for e in entries} == {shared.outputs.buffer.data_ptr()}
    assert {e.inputs[0].data_ptr() for e in entries} == {shared.inputs.buffer.data_ptr()}


def test_startup_warm_up_captures_every_batch_size_then_freezes(stack) -> None:  # noqa: ANN001
    """warm_up_shapes runs only when graphs are on; it captures the window shapes for every batch size
    1..max_batch through the batched path, then freezes every set: live streams of those shapes replay,
    a shape it did not cover (the short last window) runs eager without a capture, and the audio equals
    the eager runner's."""
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs

    assert stack.runner.warm_up_shapes(stack.prompt, max_batch=3) == 0  # eager runner: nothing to warm
    calls: list = []
    runner = Code2WavRunner(stack.model)
    graphs = enable_cuda_graphs(runner, capture=recording_capture(calls))
    assert not any(g.frozen for g in graphs.values())
    assert runner.warm_up_shapes(stack.prompt, max_batch=3, first_windows=(25,), steady_windows=1) == 6
    assert all(g.frozen for g in graphs.values()) and runner.last_batch_sizes == []
    # Batch size of each capture, told apart by arity: the DiT (7 inputs) runs 2B rows (cond and uncond),
    # the f0 predictor (1) and the decoder (2) one row per stream.
    assert {a[0].shape[0] // 2 for a in calls if len(a) == 7} == {1, 2, 3}
    assert {a[0].shape[0] for a in calls if len(a) == 1} == {a[0].shape[0] for a in calls if len(a) == 2}
    assert {a[0].shape[0] for a in calls if len(a) == 1} == {1, 2, 3}
    # Two window shapes (estimator caches of 300 and 350 frames; mel of 50 and 8 + 50) per batch size.
    assert {name: g.captured for name, g in graphs.items()} == {"dit": 6, "hift_f0": 6, "hift_decode": 6}
    captures = len(calls)
    before = {name: (g.replays, g.eager_calls) for name, g in graphs.items()}

    windows = talker_windows(_codes(4, 53), 3)  # 25 + 25 new codes, then a last window of 3
    graphed = _stream(
        runner, [runner.open_stream(f"live{i}", stack.prompt, i) for i in (1, 2)], [windows] * 2
    )
    eager_runner = stack.runner
    eager = _stream(
        eager_runner, [eager_runner.open_stream(f"e{i}", stack.prompt, i) for i in (1, 2)], [windows] * 2
    )
    assert len(calls) == captures  # frozen: nothing captured under live traffic
    # Two warmed windows replay (10 CFM steps each for the DiT); the short last window runs eager.
    delta = {
        name: (g.replays - before[name][0], g.eager_calls - before[name][1]) for name, g in graphs.items()
    }
    assert delta == {"dit": (20, 10), "hift_f0": (2, 1), "hift_decode": (2, 1)}
    for g, e in zip(graphed, eager, strict=True):
        assert np.array_equal(g["mel"], e["mel"]) and np.array_equal(g["wav"], e["wav"])
