"""``python -m services.thinker``: the stage server, or one of the subcommands in :data:`SUBCOMMANDS`.

``python -m services.thinker --checkpoint DIR [--device cuda] ...`` builds the backend
(:mod:`services.thinker.backend`) and serves it (:mod:`services.thinker.server`) until SIGTERM;
``python -m services.thinker dump ...`` runs the fidelity dump (:mod:`services.thinker.dump`;
``dump --duplex``: :mod:`services.thinker.duplex_dump`). A new
subcommand is one entry in :data:`SUBCOMMANDS`: a name and a function taking the remaining arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import sys
import time
from collections.abc import Callable

from services.common.errors import StageError
from services.common.grpc_server import add_serve_arguments, serve_forever, serve_options_from_args
from services.common.kernels.tables import load_tables
from services.common.stage_settings import add_memory_fraction_argument, apply_memory_cap, parse_stage_args
from services.common.tensors import TORCH_DTYPES
from services.thinker.backend import build_backend
from services.thinker.duplex_policy import warmup_duplex_policy
from services.thinker.duplex_window import DuplexWindow
from services.thinker.engine import STAGE, EngineConfig
from services.thinker.kv_cache import KV_CACHE_FORMATS, KVBudgetError
from services.thinker.server import make_server
from services.thinker.whisper_graph import encode_batch_limit, warmup_whisper_stream_graphs

log = logging.getLogger("services.thinker")


def _dump(argv: list[str]) -> int:
    """``dump``: the fidelity dump; ``dump --duplex``: the oracle's scripted duplex session."""
    if "--duplex" in argv:
        from services.thinker.duplex_dump import main as duplex_dump_main

        return int(duplex_dump_main([a for a in argv if a != "--duplex"]) or 0)
    from services.thinker.dump import main as dump_main  # imported on use: the dump needs no gRPC

    return int(dump_main(argv) or 0)


# Subcommand name -> entry point taking the arguments after it; anything else starts the server.
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {"dump": _dump}


def parse_size(text: str) -> int | None:
    """``--kv-budget`` accepts bytes or a suffix: 512M, 20G, 1.5GiB; ``auto`` (None) sizes it from the cap."""
    if text.strip().lower() == "auto":
        return None
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in scale:
        return int(float(t[:-1]) * scale[t[-1]])
    return int(float(t))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m services.thinker", description="MiniCPM-o 4.5 Thinker stage")
    ap.add_argument("--checkpoint", required=True, help="MiniCPM-o 4.5 checkpoint directory")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None)
    ap.add_argument(
        "--kv-budget",
        type=parse_size,
        default=None,
        help="KV cache bytes (e.g. 20G), checked against the memory fraction's cap at start; 'auto' (the "
        "default): the cap minus the weights and 2 GiB headroom, or without a fraction 90%% of free GPU "
        "memory after the headroom",
    )
    ap.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--max-context", type=int, default=None, help="cap below config max_position_embeddings")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="sequences computing at once")
    ap.add_argument(
        "--max-step-tokens",
        type=int,
        default=512,
        help="rows per engine step: decode rows, then prefill chunks in the rest (profile max_step_tokens)",
    )
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    ap.add_argument("--compile", action="store_true", help="torch.compile the per-layer blocks (GPU)")
    ap.add_argument(
        "--graph-warmup-context",
        type=int,
        default=None,
        help="capture decode CUDA graphs for every batch bucket up to --max-num-seqs and context bucket up "
        "to this many tokens before serving (default: every context a graph serves, up to the model's "
        "context or 16384; 0: capture lazily, which stalls every stream up to seconds per new bucket)",
    )
    ap.add_argument(
        "--duplex-window",
        choices=("off", "basic"),
        default="off",
        help="what a duplex session does at the context limit: 'off' ends it with context_length_exceeded; "
        "'basic' keeps the prefix and the newest units within --duplex-window-low tokens once the next unit "
        "could pass --duplex-window-high, and goes on",
    )
    ap.add_argument("--duplex-window-high", type=int, default=8000, help="tokens that trigger a trim (basic)")
    ap.add_argument("--duplex-window-low", type=int, default=6000, help="tokens kept after a trim (basic)")
    ap.add_argument(
        "--weights",
        choices=("bf16", "fp8"),
        default="bf16",
        help="projection weights: bf16 (the checkpoint's dtype) or fp8 (e4m3 with per-channel scales, "
        "quantized at load; the Triton kernels on CUDA)",
    )
    ap.add_argument(
        "--kv-cache",
        choices=KV_CACHE_FORMATS,
        default="bf16",
        help="KV cache: bf16 (the model's dtype) or fp8 (e4m3, no scale: half the bytes per token; "
        "profile kv_cache)",
    )
    ap.add_argument(
        "--kernels",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="decode kernels: auto = Triton on CUDA, torch elsewhere (profile kernels)",
    )
    ap.add_argument(
        "--kernel-table",
        default=None,
        metavar="JSON",
        help="skinny-GEMM configs measured by `bench.thinker.skinny --json-out` for this GPU (profile kernel_table)",
    )
    ap.add_argument(
        "--fp8-table",
        default=None,
        metavar="JSON",
        help="fp8 GEMM configs measured by `bench.thinker.fp8 --json-out` for this GPU or for row counts the "
        "built-in table leaves to the default (profile fp8_table)",
    )
    ap.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share full KV blocks of repeated prompt prefixes (and repeated images/audio) across requests; "
        "profile key stages.thinker.prefix_caching",
    )
    ap.add_argument(
        "--whisper-graphs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="replay duplex encode passes' streaming-Whisper layers from CUDA graphs captured at start "
        "(services/thinker/whisper_graph.py); profile key stages.thinker.whisper_graphs",
    )
    ap.add_argument("--log-level", default="INFO")
    add_memory_fraction_argument(ap)
    add_serve_arguments(ap, STAGE)
    return ap


def load_kernel_tables(skinny_table: str | None, fp8_table: str | None) -> None:
    """Add measured launch configs to the skinny and fp8 GEMMs' built-in tables (profile keys
    ``kernel_table`` and ``fp8_table``); a file that is not such a table ends the process with why."""
    try:
        for kernel, path, entries in load_tables(skinny_table, fp8_table):
            log.info("thinker: %d %s configs from %s", entries, kernel, path)
    except ValueError as exc:
        raise SystemExit(f"thinker: {exc}") from None


def serve(argv: list[str]) -> int:
    """Build the backend from the CLI flags, capture the decode graphs and serve until SIGTERM."""
    faulthandler.enable()  # a native crash (SIGSEGV in a C extension) prints every thread's stack
    args, fraction = parse_stage_args(build_parser(), STAGE, argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = EngineConfig(
        max_context=args.max_context or 1 << 30,
        max_num_seqs=args.max_num_seqs,
        max_step_tokens=args.max_step_tokens,
        block_size=args.kv_block_size,
        kv_budget_bytes=args.kv_budget,
        use_cuda_graphs=not args.no_cuda_graphs,
        compile_layers=args.compile,
        memory_fraction=apply_memory_cap(STAGE, args.device, fraction, log),
        memory_fraction_key=fraction.key,
        # fp8 weights are laid out for the kernel backend: quantized after an explicit --kernels applies
        weights=args.weights if args.kernels == "auto" else "bf16",
        kv_cache=args.kv_cache,
        prefix_caching=args.prefix_caching,
    )
    load_kernel_tables(args.kernel_table, args.fp8_table)  # before any capture; a bad file fails fast
    try:
        backend = build_backend(
            args.checkpoint, args.device, args.dtype, cfg, whisper_graphs=args.whisper_graphs
        )
    except KVBudgetError as exc:
        raise SystemExit(f"thinker: {exc}") from None
    if args.kernels != "auto":
        backend.engine.runner.set_kernels(args.kernels)
        if args.weights == "fp8":
            backend.engine.runner.quantize_weights()
    if args.duplex_window == "basic":
        try:
            window = DuplexWindow(args.duplex_window_high, args.duplex_window_low)
            backend.duplex_window = window.validate(backend.engine.max_context)
        except StageError as exc:
            raise SystemExit(f"thinker: {exc.message}") from None
    if args.kv_budget is not None:
        budget_source = "--kv-budget"
    elif cfg.memory_fraction is not None:
        budget_source = f"memory fraction {cfg.memory_fraction:g} from {fraction.source}"
    else:
        budget_source = "default"
    log.info("thinker KV cache: %.2f GiB (%s)", backend.engine.cache.budget_bytes / 2**30, budget_source)
    t0 = time.perf_counter()
    warm_context = args.graph_warmup_context
    if warm_context is None:
        warm_context = backend.engine.max_context  # warmup_graphs caps it at the largest graph context
    captured = backend.engine.runner.warmup_graphs(
        args.max_num_seqs, warm_context, backend.engine.config.max_step_tokens
    )
    if captured:
        log.info("thinker: captured %d decode CUDA graphs in %.1f s", captured, time.perf_counter() - t0)
    if backend.engine.runner.use_cuda_graphs:
        t0 = time.perf_counter()
        vocab = int(backend.engine.runner.llm.config.vocab_size)
        device = backend.engine.runner.device
        policy = warmup_duplex_policy(backend.ckpt.root, vocab, device, args.max_num_seqs)
        if policy:
            log.info("thinker: captured %d duplex policy graphs in %.2f s", policy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        limit = encode_batch_limit(args.max_num_seqs)
        whisper = warmup_whisper_stream_graphs(backend.model.apm, limit) if args.whisper_graphs else 0
        if whisper:
            log.info(
                "thinker: captured %d streaming-Whisper graphs in %.2f s", whisper, time.perf_counter() - t0
            )
    backend.engine.start()
    server = make_server(backend, serve_options_from_args(args))
    try:
        asyncio.run(serve_forever(server))
    finally:
        backend.engine.shutdown()
        backend.executor.shutdown(wait=False, cancel_futures=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]](args[1:])
    return serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
