"""CLI: ``python -m services.code2wav --checkpoint DIR --device cpu|cuda[:N] --port 50053`` serves the
stage; ``python -m services.code2wav dump --checkpoint DIR --reference REF.npz --out OUT.npz`` writes a
fidelity dump (see :mod:`services.code2wav.dump`)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import sys

import torch

from services.code2wav.dump import add_dump_arguments, dump_main
from services.common.grpc_server import add_serve_arguments, serve_forever, serve_options_from_args
from services.common.stage_settings import add_memory_fraction_argument, apply_memory_cap, parse_stage_args

log = logging.getLogger("services.code2wav")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.code2wav", description=__doc__)
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint root (assets/token2wav, assets/HT_ref_audio.wav)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--max-batch", type=int, default=16, help="windows per engine step")
    parser.add_argument("--max-streams", type=int, default=64, help="open streams before RESOURCE_EXHAUSTED")
    parser.add_argument("--cfm-steps", type=int, default=10, help="Euler steps of the flow-matching ODE")
    parser.add_argument(
        "--cache-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="storage dtype of the per-stream attention caches (compute stays fp32)",
    )
    parser.add_argument(
        "--nsf-noise",
        choices=("on", "off"),
        default="on",
        help="HiFT source noise (per-stream seeded generator); off reproduces the oracle",
    )
    parser.add_argument(
        "--cuda-graphs", choices=("on", "off"), default="on", help="CUDA graphs on GPU devices"
    )
    parser.add_argument(
        "--tf32",
        choices=("on", "off"),
        default="on",
        help="TF32 tensor cores for the fp32 matmuls and convolutions on CUDA (off: full fp32, slower)",
    )
    parser.add_argument(
        "--dit",
        choices=("auto", "package", "fused"),
        default="auto",
        help="DiT estimator path: the package's blocks step by step (the CPU reference) or the fused solve"
        " (one CUDA graph per window); auto = fused on CUDA, package on CPU",
    )
    parser.add_argument(
        "--dit-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="compute dtype of the fused DiT and its caches; auto = bfloat16 with the fused DiT on CUDA",
    )
    parser.add_argument("--voice-cache", type=int, default=32, help="reference voices kept (LRU)")
    parser.add_argument(
        "--window-codes",
        default="25",
        help="steady window sizes (new codes) whose CUDA graphs the start-up warm-up captures, comma-"
        "separated: the talker's codec.window_frames (25); e.g. 25,50 when turn-mode speech uses 50-code "
        "windows (shapes not captured run eager)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    add_memory_fraction_argument(parser)
    add_serve_arguments(parser, "code2wav")
    return parser


async def _serve(args: argparse.Namespace) -> None:
    from services.code2wav.service import build_stage_server

    server, engine = await build_stage_server(args, serve_options_from_args(args))
    try:
        await serve_forever(server)
    finally:
        await engine.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["dump"]:
        dump_parser = argparse.ArgumentParser(prog="python -m services.code2wav dump")
        add_dump_arguments(dump_parser)
        return dump_main(dump_parser.parse_args(argv[1:]))
    faulthandler.enable()  # a native crash (SIGSEGV in a C extension) prints every thread's stack
    args, fraction = parse_stage_args(build_parser(), "code2wav", argv)
    apply_memory_cap("code2wav", args.device, fraction, log)  # before the model loads, so it counts too
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
