"""``minicpmo-checkpoint``: make a random-weight checkpoint in the real MiniCPM-o 4.5 layout, or check one.

minicpmo-checkpoint make --size tiny|full --seed N [--device cpu|cuda] [--force] OUT_DIR
minicpmo-checkpoint check DIR
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minicpmo-checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make", help="write a random-weight checkpoint")
    make.add_argument("out_dir")
    make.add_argument(
        "--size",
        choices=("tiny", "full"),
        default="tiny",
        help="tiny: small widths for tests (docs/model.md, Tiny checkpoint); full: real bf16 dimensions",
    )
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--device", default="cpu", help="where tensors are drawn: cpu or cuda[:N]")
    make.add_argument("--force", action="store_true", help="replace an existing checkpoint directory")
    make.add_argument(
        "--max-shard-gb",
        type=float,
        default=None,
        help="pack shards up to this size (default: tiny = llm.|rest, full = 4 GB)",
    )

    check = sub.add_parser("check", help="validate a checkpoint directory against the contract")
    check.add_argument("dir")
    check.add_argument("--skip-assets", action="store_true", help="do not load the token2wav assets")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make":
        from .generate import make_checkpoint

        try:
            make_checkpoint(
                args.out_dir,
                size=args.size,
                seed=args.seed,
                device=args.device,
                force=args.force,
                max_shard_gb=args.max_shard_gb,
            )
        except (FileExistsError, RuntimeError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    from .check import run_check

    return run_check(args.dir, load_assets=not args.skip_assets)


if __name__ == "__main__":
    sys.exit(main())
