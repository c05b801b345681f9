"""Fidelity dump: stream the oracle's fixed codec sequence and write arrays under the oracle's keys.

``python -m services.code2wav dump --checkpoint DIR --reference REF.npz --out OUT.npz`` reads
``code2wav.codes`` and ``code2wav.cfm_noise`` from the reference file, injects that noise (so no RNG is
involved), turns the vocoder's NSF noise off, feeds the codes the way the Talker delivers them (chunks of
25, the last one shorter and flagged last, windows of 3 context + 25 new tokens, then a final flush) and
saves prompt features, per-window mels, the waveform and the window bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from services.code2wav.model.loader import load_token2wav
from services.code2wav.model.prompt import ReferenceVoiceEncoder
from services.code2wav.runner import Code2WavRunner, WindowCursor
from services.common.checkpoint import CODEC_SILENCE_ID, Checkpoint

CHUNK_TOKENS = 25


def talker_windows(
    codes: list[int], lookahead: int, chunk: int = CHUNK_TOKENS
) -> list[tuple[list[int], bool]]:
    """Windows exactly as the reference driver forms them from Talker chunks of ``chunk`` codes."""
    windows: list[tuple[list[int], bool]] = []
    buffer = [CODEC_SILENCE_ID] * lookahead
    for start in range(0, len(codes), chunk):
        is_last = start + chunk >= len(codes)
        buffer += codes[start : start + chunk]
        if len(buffer) >= chunk + lookahead:
            windows.append((buffer[: chunk + lookahead], is_last))
            buffer = buffer[chunk:]
    if not windows or not windows[-1][1]:
        windows.append((list(buffer), True))
    return windows


def run_dump(
    checkpoint: str,
    reference: str,
    out: str,
    device: str,
    threads: int | None,
    dit: str = "package",
    dit_dtype: torch.dtype = torch.float32,
) -> dict:
    """Run the oracle's windows through the runner (``dit`` picks the DiT path) and write the npz."""
    if threads:
        torch.set_num_threads(threads)
    ref = np.load(reference)
    codes = [int(c) for c in ref["code2wav.codes"]]
    noise = torch.from_numpy(ref["code2wav.cfm_noise"]).unsqueeze(0)
    ckpt = Checkpoint(checkpoint)
    t0 = time.perf_counter()
    model = load_token2wav(ckpt.token2wav_dir, device)
    voices = ReferenceVoiceEncoder(ckpt.token2wav_dir, model.device, up_rate=model.dims.up_rate)
    runner = Code2WavRunner(model, n_timesteps=10, nsf_noise=False, dit=dit, dit_dtype=dit_dtype)
    prompt = voices.encode_file(ckpt.ref_audio_path)
    state = runner.open_stream("dump", prompt, noise=noise)
    windows = talker_windows(codes, runner.lookahead)
    results = []
    cursor = WindowCursor()
    for tokens, is_last in windows:
        checked = runner.check_window(cursor, tokens, runner.lookahead, is_last)
        results.extend(runner.run([(state, checked, is_last)]))
    arrays = {
        "code2wav.codes": np.asarray(codes, dtype=np.int64),
        "code2wav.window_tokens": np.concatenate([np.asarray(w, dtype=np.int64) for w, _ in windows]),
        "code2wav.window_lengths": np.asarray([len(w) for w, _ in windows], dtype=np.int64),
        "code2wav.window_last_chunk": np.asarray([last for _, last in windows], dtype=bool),
        "code2wav.prompt_speech_tokens": prompt.tokens[0].cpu().numpy().astype(np.int64),
        "code2wav.spk_emb": prompt.spk_emb[0].cpu().numpy().astype(np.float32),
        "code2wav.prompt_mels": prompt.mel[0].cpu().numpy().astype(np.float32),
        "code2wav.cfm_noise": ref["code2wav.cfm_noise"].astype(np.float32),
        "code2wav.chunk_mels": torch.cat([r.mel for r in results], dim=1).numpy().astype(np.float32),
        "code2wav.chunk_mel_frames": np.asarray([r.mel.shape[1] for r in results], dtype=np.int64),
        "code2wav.wav": np.concatenate([r.samples for r in results]).astype(np.float32),
        "code2wav.chunk_samples": np.asarray([r.samples.shape[0] for r in results], dtype=np.int64),
    }
    meta = {
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "nsf_noise": False,
        "dit": dit,
        "dit_dtype": str(dit_dtype).removeprefix("torch."),
        "cfm_noise": "injected from the reference file (code2wav.cfm_noise)",
        "seconds": round(time.perf_counter() - t0, 2),
    }
    arrays["meta_json"] = np.asarray(json.dumps(meta))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **arrays)
    return meta


def add_dump_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint root (holds assets/token2wav)")
    parser.add_argument(
        "--reference", required=True, help="oracle npz with code2wav.codes and code2wav.cfm_noise"
    )
    parser.add_argument("--out", required=True, help="npz to write")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--dit", choices=("package", "fused"), default="package", help="DiT path (the stage's --dit)"
    )
    parser.add_argument("--dit-dtype", choices=("float32", "bfloat16"), default="float32")


def dump_main(args: argparse.Namespace) -> int:
    dtype = torch.bfloat16 if args.dit_dtype == "bfloat16" else torch.float32
    meta = run_dump(args.checkpoint, args.reference, args.out, args.device, args.threads, args.dit, dtype)
    print(json.dumps(meta))
    return 0
