"""Code2Wav benchmark: ``python -m bench.code2wav --checkpoint DIR --device cuda``.

Runs on the checkpoint's ``assets/token2wav`` weights (a full-size random checkpoint has the real shapes)
and measures, in one process and one run:

* prompt setup: reference-voice featurisation (S3 tokens, CAM++, mel) and the flow's prompt pass that
  produces a stream's origin caches;
* our runner at each concurrency ``c`` (``--concurrency``, default 1,4,8,16): ``c`` streams with
  different seeds and codes advance in lock step, windows of 3 context + 25 new codes (1 s of audio;
  ``--window-codes`` sets the new codes: the window size the talker's ``codec.window_frames`` chooses),
  equal windows batched; first-window latency (window 0, which emits 0.84 s), steady window time,
  aggregate speed (audio seconds produced per wall second, i.e. x real time), per-stream cache bytes;
  after an untimed warm-up pass per ``c`` (CUDA-graph capture, allocator, autotuning);
* the reference: stepaudio2's own ``Token2wav.stream`` loop on the same weights, one stream after the
  other (its caches live in shared scratch buffers, so it cannot interleave streams).

Prints one JSON object, then a Markdown table (the form BENCHMARKS.md records). On CPU it runs as a
smoke test with small ``--windows``/``--concurrency`` on the tiny checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from services.code2wav.model.loader import load_token2wav, normalise_hift_keys
from services.code2wav.model.prompt import PromptFeatures, ReferenceVoiceEncoder
from services.code2wav.runner import Code2WavRunner, cfm_noise_table
from services.code2wav.service import dit_choice
from services.common.checkpoint import CODEC_SILENCE_ID, Checkpoint

CONTEXT, NEW = 3, 25


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.code2wav", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma-separated stream counts")
    p.add_argument("--windows", type=int, default=8, help="timed windows per stream (1 s of audio each)")
    p.add_argument(
        "--window-codes",
        default=str(NEW),
        help="new codes per window, comma-separated (25 = 1 s of audio, the talker's default; at most 50)",
    )
    p.add_argument("--cfm-steps", type=int, default=10)
    p.add_argument("--cache-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--nsf-noise", choices=("on", "off"), default="on")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    p.add_argument("--dit", choices=("auto", "package", "fused"), default="auto", help="as the stage's --dit")
    p.add_argument("--dit-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument(
        "--tf32",
        choices=("on", "off"),
        default="off",
        help="off keeps the fp32 parts comparable with the reference",
    )
    p.add_argument(
        "--reference-streams", type=int, default=2, help="streams for the Token2wav loop (0 skips)"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stream_windows(seed: int, n: int, new: int = NEW) -> list[list[int]]:
    """``n`` steady windows of ``new`` codes of one stream: silence context first, then each window
    repeats the last 3."""
    codes = torch.randint(0, 6561, (n * new,), generator=torch.Generator().manual_seed(seed)).tolist()
    windows, context = [], [CODEC_SILENCE_ID] * CONTEXT
    for i in range(n):
        w = context + codes[i * new : (i + 1) * new]
        windows.append(w)
        context = w[-CONTEXT:]
    return windows


def bench_ours(
    runner: Code2WavRunner, prompt: PromptFeatures, concurrency: int, n_windows: int, new: int = NEW
) -> dict[str, Any]:
    device = runner.device
    rate = runner.model.sample_rate

    def one_pass(seed_base: int) -> tuple[list[float], float, list]:
        states = [runner.open_stream(f"b{i}", prompt, seed=seed_base + i) for i in range(concurrency)]
        windows = [_stream_windows(seed_base + i, n_windows, new) for i in range(concurrency)]
        _sync(device)
        times, samples = [], 0
        for w in range(n_windows):
            t0 = time.perf_counter()
            results = runner.run([(s, windows[i][w], False) for i, s in enumerate(states)])
            _sync(device)
            times.append(time.perf_counter() - t0)
            samples += sum(r.samples.shape[0] for r in results)
        return times, samples / rate, states

    one_pass(10_000)  # warm-up: graph capture, allocator, autotuning (setup of these seeds not timed)
    for i in range(concurrency):  # prime the origin caches of the timed seeds outside the timing
        runner.open_stream("prime", prompt, seed=20_000 + i)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, audio_s, states = one_pass(20_000)
    wall = sum(times)
    steady = times[1:] or times
    return {
        "impl": "ours",
        "concurrency": concurrency,
        "windows_per_stream": n_windows,
        "window_codes": new,
        "first_window_ms": round(times[0] * 1e3, 2),
        "steady_window_ms": round(statistics.median(steady) * 1e3, 2),
        "audio_s": round(audio_s, 3),
        "wall_s": round(wall, 4),
        "x_realtime": round(audio_s / wall, 2),
        "per_stream_x_realtime": round(audio_s / wall / concurrency, 2),
        "cache_bytes_per_stream": max(s.cache_bytes for s in states),
        "cache_bound_bytes": runner.max_stream_cache_bytes(prompt.frames),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


class _DeviceTorch:
    """``torch`` as seen by ``stepaudio2.token2wav`` on a non-CUDA host: ``device='cuda'`` -> ``device``.
    Only used to smoke-test this benchmark on CPU; on CUDA the package runs untouched."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def tensor(self, *a: Any, **kw: Any) -> torch.Tensor:
        kw["device"] = self._device
        return torch.tensor(*a, **kw)

    def zeros(self, *a: Any, **kw: Any) -> torch.Tensor:
        kw["device"] = self._device
        return torch.zeros(*a, **kw)


@contextlib.contextmanager
def _package_on(device: torch.device) -> Iterator[None]:
    import stepaudio2.token2wav as t2w_mod

    if device.type == "cuda":
        yield
        return
    saved = t2w_mod.torch
    t2w_mod.torch = _DeviceTorch(device)  # type: ignore[assignment]
    try:
        yield
    finally:
        t2w_mod.torch = saved


def bench_reference(
    ckpt: Checkpoint,
    prompt: PromptFeatures,
    device: torch.device,
    streams: int,
    n_windows: int,
    cfm_steps: int,
) -> dict[str, Any]:
    """stepaudio2 ``Token2wav.stream`` per stream, on a Token2wav assembled from the same asset files.

    ``Token2wav.__init__`` is bypassed only because it hard-codes ``.cuda()``, the full-size S3 model and
    a path-based prompt loader; the objects it would build are built here from the same files (flow with
    the package's scratch buffers restored, HiFT with weight norm as the package loads it), and the
    prompt features are ours (identical to the package's, see the fidelity dump).
    """
    from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator
    from stepaudio2.token2wav import Token2wav

    ref = load_token2wav(ckpt.token2wav_dir, device)
    flow, d = ref.flow, ref.dims
    dec = flow.decoder
    dec.register_buffer("rand_noise", cfm_noise_table(0, d.mel_bins, 50 * 600).to(device), persistent=False)
    steps_buf = max(16, cfm_steps)
    dec.register_buffer(
        "cnn_cache_buffer",
        torch.zeros(steps_buf, d.dit_depth, 2, 2 * d.dit_hidden, 2, device=device),
        persistent=False,
    )
    dec.register_buffer(
        "att_cache_buffer",
        torch.zeros(steps_buf, d.dit_depth, 2, d.dit_heads, 1000, 2 * d.dit_head_dim, device=device),
        persistent=False,
    )
    dec.estimator.register_buffer(
        "att_cache_buffer",
        torch.zeros(d.dit_depth, 2, d.dit_heads, 1000, 2 * d.dit_head_dim, device=device),
        persistent=False,
    )
    dec.estimator.register_buffer(
        "cnn_cache_buffer", torch.zeros(d.dit_depth, 2, 2 * d.dit_hidden, 2, device=device), persistent=False
    )
    hift = HiFTGenerator()
    state = torch.load(ckpt.token2wav_dir / "hift.pt", map_location="cpu", weights_only=True)
    hift.load_state_dict(normalise_hift_keys(state))
    hift.stft_window = hift.stft_window.to(device)
    t2w = Token2wav.__new__(Token2wav)
    t2w.float16, t2w.n_timesteps = False, cfm_steps
    t2w.flow, t2w.hift = flow, hift.to(device).eval()
    t2w.mel_cache_len, t2w.source_cache_len = 8, 8 * 480
    t2w.speech_window = torch.from_numpy(np.hamming(2 * 8 * 480)).to(device)
    lens = torch.tensor([prompt.tokens.shape[1]], dtype=torch.int32, device=device)
    mel_lens = torch.tensor([prompt.frames], dtype=torch.int32, device=device)
    t2w.cache = (prompt.tokens, lens, prompt.spk_emb, prompt.mel, mel_lens)
    silence = torch.full((1, CONTEXT), CODEC_SILENCE_ID, dtype=prompt.tokens.dtype, device=device)

    setup_times, first, steady, audio, wall = [], [], [], 0.0, 0.0
    with _package_on(device), torch.inference_mode():
        for s in range(-1, streams):  # stream -1 is an untimed warm-up
            t0 = time.perf_counter()
            cache = flow.setup_cache(
                torch.cat([prompt.tokens, silence], 1), prompt.mel, prompt.spk_emb, n_timesteps=cfm_steps
            )
            t2w.stream_cache = {k: v.clone() for k, v in cache.items()}
            _sync(device)
            if s >= 0:
                setup_times.append(time.perf_counter() - t0)
            t2w.hift_cache_dict = dict(
                mel=torch.zeros(1, d.mel_bins, 0, device=device),
                source=torch.zeros(1, 1, 0, device=device),
                speech=torch.zeros(1, 0, device=device),
            )
            for w, tokens in enumerate(_stream_windows(30_000 + s, n_windows)):
                t0 = time.perf_counter()
                wav = t2w.stream(tokens, prompt_wav=None, last_chunk=False, return_waveform=True)
                dt = time.perf_counter() - t0
                if s >= 0:
                    (first if w == 0 else steady).append(dt)
                    audio += wav.shape[-1] / ref.sample_rate
                    wall += dt
    return {
        "impl": "stepaudio2 Token2wav.stream (per stream)",
        "concurrency": 1,
        "streams": streams,
        "windows_per_stream": n_windows,
        "setup_ms": round(statistics.median(setup_times) * 1e3, 2),
        "first_window_ms": round(statistics.median(first) * 1e3, 2),
        "steady_window_ms": round(statistics.median(steady or first) * 1e3, 2),
        "audio_s": round(audio, 3),
        "wall_s": round(wall, 4),
        "x_realtime": round(audio / wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":  # by default fp32 means fp32: TF32 stays out of the comparison
        torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"
        torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    dit, dit_dtype = dit_choice(args)
    ckpt = Checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    model = load_token2wav(ckpt.token2wav_dir, device)
    voices = ReferenceVoiceEncoder(ckpt.token2wav_dir, model.device, model.dims.up_rate)
    load_s = time.perf_counter() - t0
    runner = Code2WavRunner(
        model,
        n_timesteps=args.cfm_steps,
        cache_dtype=torch.bfloat16 if args.cache_dtype == "bfloat16" else torch.float32,
        nsf_noise=args.nsf_noise == "on",
        dit=dit,
        dit_dtype=dit_dtype,
    )
    graphs: dict[str, Any] = {}
    if args.cuda_graphs == "on" and device.type == "cuda":
        from services.code2wav.model.cuda_graphs import enable_cuda_graphs

        graphs = enable_cuda_graphs(runner)

    t0 = time.perf_counter()
    prompt = voices.encode_file(ckpt.ref_audio_path)
    _sync(device)
    voice_ms = (time.perf_counter() - t0) * 1e3
    runner.open_stream("warm", prompt, seed=1)  # first setup pays one-off costs
    t0 = time.perf_counter()
    runner.open_stream("setup", prompt, seed=2)
    _sync(device)
    setup_ms = (time.perf_counter() - t0) * 1e3

    rows = [
        bench_ours(runner, prompt, int(c), args.windows, int(n))
        for n in args.window_codes.split(",")
        for c in args.concurrency.split(",")
    ]
    reference = None
    if args.reference_streams > 0:
        reference = bench_reference(
            ckpt, prompt, device, args.reference_streams, args.windows, args.cfm_steps
        )

    d = model.dims
    result: dict[str, Any] = {
        "bench": "code2wav",
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "model": {
            "dit_depth": d.dit_depth,
            "dit_hidden": d.dit_hidden,
            "encoder_layers": d.encoder_layers,
            "encoder_channels": d.encoder_channels,
            "flow_params": sum(p.numel() for p in model.flow.parameters()),
            "hift_params": sum(p.numel() for p in model.hift.parameters()),
        },
        "config": {
            "cfm_steps": args.cfm_steps,
            "cache_dtype": args.cache_dtype,
            "nsf_noise": args.nsf_noise,
            "cuda_graphs": bool(graphs),
            "dit": dit,
            "dit_dtype": str(dit_dtype).removeprefix("torch."),
            "tf32": args.tf32,
            "windows": args.windows,
        },
        "load_s": round(load_s, 2),
        "voice_features_ms": round(voice_ms, 2),
        "prompt_setup_ms": round(setup_ms, 2),
        "ours": rows,
        "reference": reference,
        "graphs": {
            k: {
                "captured": sum(v is not None for v in g.graphs.values()),
                "replays": g.replays,
                "eager_calls": g.eager_calls,
            }
            for k, g in graphs.items()
        },
    }
    if reference:
        for row in rows:
            row["speedup_vs_reference"] = round(row["x_realtime"] / reference["x_realtime"], 2)
    by_c = {r["concurrency"]: r for r in rows if r["window_codes"] == NEW}  # the targets' window size
    result["targets"] = {
        "first_window_ms_c1<=30": by_c[1]["first_window_ms"] <= 30 if 1 in by_c else None,
        "first_window_ms_c8<=60": by_c[8]["first_window_ms"] <= 60 if 8 in by_c else None,
        "x_realtime_c8>=50": by_c[8]["x_realtime"] >= 50 if 8 in by_c else None,
        "speedup_c8>=5": (by_c[8].get("speedup_vs_reference", 0) >= 5) if 8 in by_c and reference else None,
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print()
    print(
        f"Code2Wav on {result['gpu'] or result['device']} (CFM {args.cfm_steps} steps, DiT {dit} "
        f"{result['config']['dit_dtype']}, TF32 {args.tf32}, caches {args.cache_dtype}, "
        f"CUDA graphs {'on' if graphs else 'off'}); voice features {voice_ms:.0f} ms, prompt setup {setup_ms:.0f} ms"
    )
    print()
    print(
        "| implementation | streams | first window (ms) | steady window (ms) | aggregate x real time |"
        " vs reference | cache / stream (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        label = "ours (batched)" if r["window_codes"] == NEW else f"ours, {r['window_codes']}-code windows"
        print(
            f"| {label} | {r['concurrency']} | {r['first_window_ms']:.1f} | {r['steady_window_ms']:.1f} | "
            f"{r['x_realtime']:.1f} | {r.get('speedup_vs_reference', float('nan')):.2f}x | "
            f"{r['cache_bytes_per_stream'] / 2**20:.0f} |"
        )
    if reference:
        print(
            f"| stepaudio2 Token2wav.stream | 1 (x{reference['streams']} sequential) | "
            f"{reference['first_window_ms']:.1f} | {reference['steady_window_ms']:.1f} | "
            f"{reference['x_realtime']:.1f} | 1.00x | - |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
