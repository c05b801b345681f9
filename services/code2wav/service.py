"""Assemble a runnable Code2Wav stage (model, voice encoder, runner, engine, gRPC server) from CLI args.

Kept apart from ``__main__`` so tests and benchmarks build the exact same stack in-process.
"""

from __future__ import annotations

import argparse

import torch

from services.code2wav.engine import Code2WavEngine
from services.code2wav.model.loader import load_token2wav
from services.code2wav.model.prompt import ReferenceVoiceEncoder
from services.code2wav.runner import Code2WavRunner
from services.code2wav.server import SERVICE_FULL_NAME, Code2WavServicer, add_servicer, stage_info
from services.common.checkpoint import Checkpoint
from services.common.grpc_server import ServeOptions, StageServer


def dit_choice(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """Resolve ``--dit`` / ``--dit-dtype`` (``auto``: the fused bf16 solve on CUDA, the package's fp32
    blocks on CPU, where they are the path checked against the upstream oracle)."""
    cuda = str(args.device).startswith("cuda")
    dit = getattr(args, "dit", "auto")
    if dit == "auto":
        dit = "fused" if cuda else "package"
    dtype = getattr(args, "dit_dtype", "auto")
    if dtype == "auto":
        dtype = "bfloat16" if cuda and dit == "fused" else "float32"
    return dit, torch.bfloat16 if dtype == "bfloat16" else torch.float32


def window_codes(text: str) -> tuple[int, ...]:
    """``--window-codes`` ("25" or "25,50") as sizes; each in [1, MAX_NEW_TOKENS]."""
    from services.code2wav.runner import MAX_NEW_TOKENS

    try:
        sizes = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise SystemExit(f"--window-codes {text!r}: comma-separated integers expected") from None
    if not sizes or any(not 1 <= n <= MAX_NEW_TOKENS for n in sizes):
        raise SystemExit(f"--window-codes {text!r}: each size must be in [1, {MAX_NEW_TOKENS}]")
    return sizes


def build_engine(args: argparse.Namespace) -> tuple[Code2WavEngine, Checkpoint]:
    ckpt = Checkpoint(args.checkpoint)
    if str(args.device).startswith("cuda"):
        # The flow and vocoder compute in fp32; on GPU their matmuls otherwise run as SIMT fp32 kernels.
        # TF32 keeps fp32 storage and range with a 10-bit mantissa product (measured: bench/README.md).
        tf32 = getattr(args, "tf32", "on") == "on"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    model = load_token2wav(ckpt.token2wav_dir, args.device)
    voices = ReferenceVoiceEncoder(
        ckpt.token2wav_dir, model.device, model.dims.up_rate, cache_size=args.voice_cache
    )
    dit, dit_dtype = dit_choice(args)
    runner = Code2WavRunner(
        model,
        n_timesteps=args.cfm_steps,
        cache_dtype=torch.bfloat16 if args.cache_dtype == "bfloat16" else torch.float32,
        nsf_noise=args.nsf_noise == "on",
        dit=dit,
        dit_dtype=dit_dtype,
    )
    if args.cuda_graphs == "on" and model.device.type == "cuda":
        from services.code2wav.model.cuda_graphs import enable_cuda_graphs

        enable_cuda_graphs(runner)
    engine = Code2WavEngine(
        runner,
        voices,
        ckpt.ref_audio_path,
        max_batch=args.max_batch,
        max_streams=args.max_streams,
        window_codes=window_codes(getattr(args, "window_codes", "25")),
    )
    return engine, ckpt


async def build_stage_server(
    args: argparse.Namespace, options: ServeOptions
) -> tuple[StageServer, Code2WavEngine]:
    """Build and start the engine, then return an (unstarted) stage server bound to it."""
    engine, ckpt = build_engine(args)
    await engine.start()
    servicer = Code2WavServicer(engine, stage_info(engine, str(ckpt.config.get("version", ""))))
    server = StageServer("code2wav", SERVICE_FULL_NAME, add_servicer(servicer), options, drain=engine.drain)
    return server, engine
