"""Code2wav part of ``bench.cuda_smoke``: each GPU flow path against the eager fp32 package path.

    python -m bench.cuda_smoke --checkpoint DIR --stages code2wav

Fixed inputs: the checkpoint's reference voice, two streams (seeds 1 and 2, HiFT source noise off so
every path is deterministic) batched together over a first window of 10 codes, three steady windows of
25 and a last window of 7, codes drawn from a fixed generator. The reference is the package's DiT
blocks, eager, TF32 off (full fp32). Compared with it, per variant: the mel (max abs difference and
RMS relative to the reference's RMS) and the waveform (RMS relative, and the mean absolute difference of
the log-magnitude STFT in dB over the bins within 60 dB of the loudest: HiFT integrates the phase of its
source, so sample-wise waveform differences grow fast while the spectrum stays put).

Variants: ``fused-fp32`` eager (the rewrite itself), ``fused-fp32-graphs`` (one graph per window's
solve, encoder graphs; must equal the eager fused path to float rounding), ``package-tf32-graphs`` (the
previous serving path, for scale) and ``fused-bf16-graphs`` (the serving default on CUDA). A variant
fails when its mel RMS error exceeds its bound (``BOUNDS``); bf16's bound only catches a broken path,
its figures are what BENCHMARKS.md states.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.checkpoint import CODEC_SILENCE_ID, Checkpoint

# variant -> (dit, dtype, cuda graphs, tf32, bound on the mel's relative RMS error)
VARIANTS: dict[str, tuple[str, torch.dtype, bool, bool, float]] = {
    "fused-fp32": ("fused", torch.float32, False, False, 1e-4),
    "fused-fp32-graphs": ("fused", torch.float32, True, False, 1e-4),
    "package-tf32-graphs": ("package", torch.float32, True, True, 5e-2),
    "fused-bf16-graphs": ("fused", torch.bfloat16, True, True, 5e-2),
}


@dataclass
class Code2WavComparison:
    variant: str
    mel_max_abs: float
    mel_rel_rms: float
    wav_rel_rms: float
    wav_max_abs: float
    spec_db_mean_abs: float
    samples: int
    seconds: float
    verdict: str  # pass | FAIL


def _windows() -> list[tuple[list[int], bool]]:
    codes = torch.randint(0, 6561, (10 + 3 * 25 + 7,), generator=torch.Generator().manual_seed(17)).tolist()
    sizes, out, context, pos = [10, 25, 25, 25, 7], [], [CODEC_SILENCE_ID] * 3, 0
    for i, n in enumerate(sizes):
        window = context + codes[pos : pos + n]
        out.append((window, i == len(sizes) - 1))
        context, pos = window[-3:], pos + n
    return out


def _run(model: Any, prompt: Any, variant: str) -> tuple[np.ndarray, np.ndarray, float]:
    from services.code2wav.model.cuda_graphs import enable_cuda_graphs
    from services.code2wav.runner import Code2WavRunner

    dit, dtype, graphs, tf32, _ = VARIANTS.get(variant, ("package", torch.float32, False, False, 0.0))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    runner = Code2WavRunner(model, dit=dit, dit_dtype=dtype)
    if graphs and model.device.type == "cuda":
        enable_cuda_graphs(runner)
    states = [runner.open_stream(f"{variant}-{s}", prompt, s) for s in (1, 2)]
    mels: list[list[torch.Tensor]] = [[], []]
    wavs: list[list[np.ndarray]] = [[], []]
    t0 = time.perf_counter()
    for tokens, last in _windows():
        for i, res in enumerate(runner.run([(st, tokens, last) for st in states])):
            mels[i].append(res.mel)
            wavs[i].append(res.samples)
    seconds = time.perf_counter() - t0
    mel = np.stack([torch.cat(m, 1).numpy() for m in mels])
    wav = np.stack([np.concatenate(w) for w in wavs])
    return mel, wav, seconds


def _spec_db(wav: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(wav).double()
    spec = torch.stft(x, 1024, 256, window=torch.hann_window(1024, dtype=torch.float64), return_complex=True)
    return (20 * torch.log10(spec.abs() + 1e-9)).numpy()


def compare(
    variant: str, ref: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray], seconds: float
) -> Code2WavComparison:
    (ref_mel, ref_wav), (mel, wav) = ref, got
    if mel.shape != ref_mel.shape or wav.shape != ref_wav.shape:
        return Code2WavComparison(variant, *(float("inf"),) * 5, wav.shape[-1], seconds, "FAIL")

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b**2)), 1e-12))

    ref_db, db = _spec_db(ref_wav), _spec_db(wav)
    loud = ref_db > ref_db.max() - 60
    out = Code2WavComparison(
        variant=variant,
        mel_max_abs=float(np.abs(mel - ref_mel).max()),
        mel_rel_rms=rel(mel, ref_mel),
        wav_rel_rms=rel(wav, ref_wav),
        wav_max_abs=float(np.abs(wav - ref_wav).max()),
        spec_db_mean_abs=float(np.abs(db - ref_db)[loud].mean()),
        samples=int(wav.shape[-1]),
        seconds=round(seconds, 3),
        verdict="pass",
    )
    if not np.isfinite(wav).all() or out.mel_rel_rms > VARIANTS[variant][4]:
        out.verdict = "FAIL"
    return out


def check_code2wav(args: argparse.Namespace, device: torch.device) -> list[Code2WavComparison]:
    from services.code2wav.model.loader import load_token2wav
    from services.code2wav.model.prompt import ReferenceVoiceEncoder

    ckpt = Checkpoint(args.checkpoint)
    model = load_token2wav(ckpt.token2wav_dir, device)
    voices = ReferenceVoiceEncoder(ckpt.token2wav_dir, model.device, model.dims.up_rate)
    prompt = voices.encode_file(ckpt.ref_audio_path)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        mel, wav, _ = _run(model, prompt, "package-fp32-eager")
        out = []
        for variant in VARIANTS:
            got_mel, got_wav, seconds = _run(model, prompt, variant)
            c = compare(variant, (mel, wav), (got_mel, got_wav), seconds)
            print(
                f"[cuda_smoke] code2wav {variant}: {c.verdict} (mel max {c.mel_max_abs:.3g}, rel RMS "
                f"{c.mel_rel_rms:.3g}; wave rel RMS {c.wav_rel_rms:.3g}, spectrum {c.spec_db_mean_abs:.3g} dB)",
                flush=True,
            )
            out.append(c)
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def markdown(rows: list[Code2WavComparison]) -> list[str]:
    lines = [
        "| code2wav variant (vs package fp32 eager) | mel max abs | mel rel RMS | wave rel RMS | wave max abs"
        " | log-spectrum mean abs dB | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        lines.append(
            f"| {c.variant} | {c.mel_max_abs:.3g} | {c.mel_rel_rms:.3g} | {c.wav_rel_rms:.3g} | "
            f"{c.wav_max_abs:.3g} | {c.spec_db_mean_abs:.3g} | {c.verdict} |"
        )
    return lines
