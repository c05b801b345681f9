"""Omni-DuplexEval against a running server: ``generate``, ``evaluate``, ``summarize``.

    python -m examples.online_serving.minicpmo.omni_duplex_eval generate --dataset /data/Omni-DuplexEval \\
        --url http://127.0.0.1:8000 --ref-audio voice.wav --response-root out/responses [--split RTD_OCR] \\
        [--limit 5] [--concurrency 2] [--pace realtime|as-fast-as-possible]
    python -m examples.online_serving.minicpmo.omni_duplex_eval evaluate --dataset /data/Omni-DuplexEval \\
        --response-root out/responses --score-root out/scores --judge-base-url http://JUDGE:8001/v1 \\
        --judge-model NAME [--judge-video-mode video_url|frame-sample] [--allow-invalid-clock]
    python -m examples.online_serving.minicpmo.omni_duplex_eval summarize --score-root out/scores

See generate.py (sessions, pacing, the media clock), evaluate.py (judging) and dataset.py (the layout).
Exit status: 0 when every selected sample was handled, 1 when some failed (listed on stderr), 2 for bad
arguments or a dataset that cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

if not __package__:  # run by path (python examples/...py): the repository root goes first on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from examples.online_serving.minicpmo.omni_duplex_eval.dataset import load_samples  # noqa: E402
from examples.online_serving.minicpmo.omni_duplex_eval.evaluate import JUDGE_VIDEO_MODES, evaluate, summarize  # noqa: E402
from examples.online_serving.minicpmo.omni_duplex_eval.generate import PACES, generate  # noqa: E402


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset", type=Path, required=True, help="local copy: DIR/data/<SPLIT>-00000-of-00001.parquet"
    )
    p.add_argument("--split", default="all", help="all, a split name, or a comma list")
    p.add_argument("--limit", type=int, default=None, help="at most N samples per split")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--response-root", type=Path, required=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="omni_duplex_eval", description="Omni-DuplexEval for a realtime duplex server"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run one realtime duplex session per sample")
    _common(gen)
    gen.add_argument("--url", default="http://127.0.0.1:8000", help="the server (its /v1/realtime is used)")
    gen.add_argument("--model", default="openbmb/MiniCPM-o-4_5")
    gen.add_argument(
        "--ref-audio", type=Path, default=None, help="voice WAV; without it the session is text-only"
    )
    gen.add_argument("--pace", choices=PACES, default="realtime")
    gen.add_argument("--overwrite", action="store_true", help="redo samples that already have a response")
    ev = sub.add_parser("evaluate", help="score generated responses with a judge model")
    _common(ev)
    ev.add_argument("--score-root", type=Path, required=True)
    ev.add_argument("--judge-base-url", required=True, help="OpenAI-compatible /v1 URL of the judge")
    ev.add_argument("--judge-model", required=True)
    ev.add_argument("--judge-video-mode", choices=JUDGE_VIDEO_MODES, default="video_url")
    ev.add_argument("--judge-fps", type=float, default=2.0)
    ev.add_argument("--judge-max-tokens", type=int, default=512)
    ev.add_argument("--window-size", type=float, default=10.0, help="seconds after a reminder time judged")
    ev.add_argument(
        "--allow-invalid-clock",
        action="store_true",
        help="score responses generated without real-time pacing",
    )
    ev.add_argument("--timeout", type=float, default=600.0, help="seconds per judge request")
    sm = sub.add_parser("summarize", help="per split and overall scores")
    sm.add_argument("--score-root", type=Path, required=True)
    args = ap.parse_args(argv)
    if getattr(args, "concurrency", 1) < 1 or (getattr(args, "limit", None) or 1) < 1:
        ap.error("--concurrency and --limit must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "summarize":
        report = summarize(args.score_root)
        (args.score_root / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        return 0
    try:
        samples = load_samples(args.dataset, args.split, args.limit)
    except (ValueError, OSError) as exc:
        print(f"omni_duplex_eval: {exc}", file=sys.stderr)
        return 2
    if args.command == "generate":
        rows = asyncio.run(generate(samples, args))
        args.response_root.mkdir(parents=True, exist_ok=True)
        metrics_path = args.response_root / "duplex_metrics.json"
        old = json.loads(metrics_path.read_text()) if metrics_path.exists() else {"samples": []}
        keep = {(r["split"], r["id"]) for r in rows}
        merged = [r for r in old["samples"] if (r["split"], r["id"]) not in keep] + rows
        metrics_path.write_text(json.dumps({"pace": args.pace, "samples": merged}, indent=2) + "\n")
        failed = [f"{r['split']}/{r['id']}: {r['error']}" for r in rows if "error" in r]
    else:
        scored, failed = asyncio.run(evaluate(samples, args))
        print(f"scored {scored} of {len(samples)} samples into {args.score_root}")
    for line in failed:
        print(f"omni_duplex_eval: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
