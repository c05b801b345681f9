"""Prefix-cache benchmark through the gateway: what a repeated prefix saves a chat client.

Usage::

    python -m bench.prefix_cache --checkpoint FULL_SIZE_DIR [--deploy-config minicpmo_4_5] [--device cuda]
        [--prefix-tokens 2000] [--short-tokens 64] [--reps 5] [--modalities audio|text] [--out-dir DIR]
    python -m bench.prefix_cache --url http://host:8099 --checkpoint DIR   # an already running gateway

It launches the pipeline as ``bench.e2e`` does (``bench.launch.Pipeline``: the profile, its memory caps,
stage logs under ``OUT_DIR/logs``), then, one request at a time, streaming:

1. **short**: ``--reps`` distinct ``--short-tokens`` prompts (no shared prefix): the TTFP baseline;
2. **shared prefix**: per rep a fresh ``--prefix-tokens`` system prompt, sent twice with different
   questions: the first computes it (a miss), the second finds it cached. Reports the second's
   ``usage.prompt_tokens_details.cached_tokens`` (target ≥ 1984 for a 2000-token prefix) and its TTFP
   against the short prompts' (target ≤ 1.3×);
3. **3-turn chat**: a conversation carried over three turns (each turn's request holds the whole history
   and the model's earlier answers): prompt tokens, cached tokens and prefill tokens (prompt − cached)
   per turn beside the tokens new in that turn: the prefill should follow the new tokens only;
4. **repeated image**: one generated picture asked about twice: the second request's cached tokens
   cover the image's rows (keyed by the picture's content, not its placeholder ids).

TTFP is the first audio chunk with ``--modalities audio`` (default, as in bench.e2e) and is reported with
TTFT (first text) in both modes. The thinker's prefix-cache counters are read from its ``/metrics``
before and after. Writes ``prefix_cache.json`` and ``prefix_cache.md`` to ``--out-dir`` (default
``$OUT/prefix_cache``), also after an error.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.chat_workload import FILLER_TEXT
from bench.launch import (
    Pipeline,
    add_launch_flags,
    environment,
    guarded_run,
    stage_args_for,
    with_gpu_sharing,
)

TARGETS = {
    "cached_tokens_min": 1984,  # of a 2000-token shared prefix
    "ttfp_ratio_max": 1.3,  # second request with the shared prefix vs a 64-token prompt
}
HIT_METRICS = (
    "minicpmo_thinker_prefix_cache_hit_tokens_total",
    "minicpmo_thinker_prefix_cache_miss_tokens_total",
    "minicpmo_thinker_prefix_cache_evictions_total",
)


@dataclass
class Sample:
    """One streamed request: first text / first audio (s from send), usage, or the error."""

    label: str
    ok: bool = False
    ttft_s: float | None = None
    ttfp_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def exact_text(tokenizer: Any, tokens: int, tag: str) -> str:
    """A text that encodes to exactly ``tokens`` tokens, opened by ``tag`` (distinct tags: distinct
    first blocks, so two texts share no cached prefix)."""
    words = FILLER_TEXT.split()
    for shift in range(len(words)):
        body = " ".join((words[shift:] + words[:shift]) * (tokens // len(words) + 2))
        ids = tokenizer.encode(f"{tag}: {body}", add_special_tokens=False)[:tokens]
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text, add_special_tokens=False)) == tokens:
            return text
    raise RuntimeError(f"could not build a text of exactly {tokens} tokens")


def make_image_png(seed: int = 7, size: int = 448) -> bytes:
    """A noise picture (fixed seed: the same bytes each time it is built)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def chat_body(
    messages: list[dict[str, Any]], model: str, modalities: str, spoken_tokens: int, audio_frames: int
) -> dict[str, Any]:
    """A streamed chat request with pinned generation lengths (greedy, EOS ignored)."""
    text = {"temperature": 0.0, "max_tokens": spoken_tokens, "min_tokens": spoken_tokens, "ignore_eos": True}
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if modalities == "audio":
        body["modalities"] = ["text", "audio"]
        body["sampling_params_list"] = [text, {"fixed_frames": audio_frames, "seed": 42}]
    else:
        body["modalities"] = ["text"]
        body.update(text)
    return body


async def stream_one(client: Any, url: str, body: dict[str, Any], label: str, timeout: float) -> Sample:
    """Send one streaming request; never raises (a failure is in ``Sample.error``)."""
    import httpx

    s = Sample(label)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return s
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = str(chunk["error"])[:300]
                    return s
                now = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    s.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    s.completion_tokens = int(usage.get("completion_tokens") or 0)
                    s.cached_tokens = int(
                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    )
                for choice in chunk.get("choices", []):
                    content = (choice.get("delta") or {}).get("content") or ""
                    if not content:
                        continue
                    if chunk.get("modality") == "audio":
                        s.ttfp_s = now if s.ttfp_s is None else s.ttfp_s
                    else:
                        s.ttft_s = now if s.ttft_s is None else s.ttft_s
                        s.text += content
        s.ok = True
    except (httpx.HTTPError, ValueError) as exc:
        s.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        s.e2e_s = time.perf_counter() - t0
    if s.ok and body.get("modalities") == ["text"]:
        s.ttfp_s = s.ttft_s  # text only: the first packet is the first text
    return s


def scrape_counters(metrics_url: str | None) -> dict[str, float]:
    if not metrics_url:
        return {}
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        name = line.split(" ", 1)[0]
        if name in HIT_METRICS:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


async def run_workload(
    args: argparse.Namespace, url: str, tokenizer: Any, model: str, samples: list[Sample]
) -> dict[str, Any]:
    """The four parts, in order; every request lands in ``samples`` as it finishes."""
    import httpx

    def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return chat_body(messages, model, args.modalities, args.spoken_tokens, args.audio_frames)

    def user(text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    async with httpx.AsyncClient() as client:

        async def send(messages: list[dict[str, Any]], label: str) -> Sample:
            s = await stream_one(client, url, body(messages), label, args.request_timeout)
            samples.append(s)
            state = "ok" if s.ok else f"FAILED {s.error}"
            print(
                f"[prefix] {label}: prompt {s.prompt_tokens} cached {s.cached_tokens} "
                f"ttft {s.ttft_s} ttfp {s.ttfp_s} {state}",
                flush=True,
            )
            return s

        for i in range(args.warmup):
            await send([user(exact_text(tokenizer, args.short_tokens, f"Warm-up {i}"))], "warmup")
        short = [
            await send([user(exact_text(tokenizer, args.short_tokens, f"Short request {i}"))], "short")
            for i in range(args.reps)
        ]
        first, second = [], []
        for i in range(args.reps):
            system = {"role": "system", "content": exact_text(tokenizer, args.prefix_tokens, f"Context {i}")}
            first.append(await send([system, user("Summarise the story in one line.")], "shared_first"))
            second.append(await send([system, user("Who is the main character?")], "shared_second"))
        # 3-turn chat: each turn carries the history and the model's earlier answers.
        history: list[dict[str, Any]] = [
            {"role": "system", "content": exact_text(tokenizer, args.turn_system_tokens, "Chat rules")}
        ]
        turns = []
        for t in range(3):
            history.append(user(exact_text(tokenizer, args.turn_user_tokens, f"Turn {t} question")))
            s = await send(history, f"turn{t + 1}")
            turns.append(s)
            history.append({"role": "assistant", "content": s.text or "..."})
        image = base64.b64encode(make_image_png()).decode()

        def image_turn(question: str) -> list[dict[str, Any]]:
            part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
            return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]

        img_first = await send(image_turn("What is in this picture?"), "image_first")
        img_second = await send(image_turn("Describe its colours."), "image_second")

    short_ttfp = _median([s.ttfp_s for s in short])
    hit_ttfp = _median([s.ttfp_s for s in second])
    cached_min = min((s.cached_tokens for s in second if s.ok), default=0)
    out: dict[str, Any] = {
        "short": {
            "tokens": args.short_tokens,
            "ttfp_ms_p50": _ms(short_ttfp),
            "ttft_ms_p50": _ms(_median([s.ttft_s for s in short])),
        },
        "shared_prefix": {
            "prefix_tokens": args.prefix_tokens,
            "first_ttfp_ms_p50": _ms(_median([s.ttfp_s for s in first])),
            "second_ttfp_ms_p50": _ms(hit_ttfp),
            "second_ttft_ms_p50": _ms(_median([s.ttft_s for s in second])),
            "second_prompt_tokens": [s.prompt_tokens for s in second],
            "second_cached_tokens": [s.cached_tokens for s in second],
            "first_cached_tokens": [s.cached_tokens for s in first],
            "ttfp_ratio_vs_short": (hit_ttfp / short_ttfp) if hit_ttfp and short_ttfp else None,
        },
        "three_turn_chat": [
            {
                "turn": k + 1,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "prefill_tokens": s.prefill_tokens,
                "new_tokens": s.prompt_tokens - (turns[k - 1].prompt_tokens if k else 0),
                "ttfp_ms": _ms(s.ttfp_s),
            }
            for k, s in enumerate(turns)
        ],
        "repeated_image": {
            "prompt_tokens": [img_first.prompt_tokens, img_second.prompt_tokens],
            "cached_tokens": [img_first.cached_tokens, img_second.cached_tokens],
            "ttfp_ms": [_ms(img_first.ttfp_s), _ms(img_second.ttfp_s)],
        },
    }
    ratio = out["shared_prefix"]["ttfp_ratio_vs_short"]
    later = out["three_turn_chat"][1:]
    out["verdicts"] = {
        "cached_tokens_ge_1984": cached_min >= TARGETS["cached_tokens_min"]
        if args.prefix_tokens >= 2000
        else None,
        "ttfp_ratio_le_1.3": ratio is not None and ratio <= TARGETS["ttfp_ratio_max"],
        # the history was cached up to its last partial block: prefill ≤ new tokens + one block
        "turn_prefill_follows_new_tokens": bool(later)
        and all(t["prefill_tokens"] <= t["new_tokens"] + 16 for t in later),
        "repeated_image_hit": img_second.cached_tokens > img_first.cached_tokens,
    }
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 1)


def render_markdown(report: dict[str, Any]) -> str:
    r = report.get("results") or {}
    lines = [f"# Prefix cache ({report.get('status')})", ""]
    if not r:
        return "\n".join([*lines, report.get("error_detail", "no results"), ""])
    sp, sh = r["shared_prefix"], r["short"]
    lines += [
        f"Card: {', '.join(report['environment'].get('gpus', ['cpu']))}; modalities {report['modalities']}",
        "",
        "| request | TTFP p50 ms | cached tokens |",
        "|---|---:|---:|",
        f"| {sh['tokens']}-token prompt | {sh['ttfp_ms_p50']} | 0 |",
        f"| {sp['prefix_tokens']}-token prefix, 1st | {sp['first_ttfp_ms_p50']} | {sp['first_cached_tokens']} |",
        f"| {sp['prefix_tokens']}-token prefix, 2nd | {sp['second_ttfp_ms_p50']} | {sp['second_cached_tokens']} |",
        "",
        f"2nd / short TTFP: {sp['ttfp_ratio_vs_short']}",
        "",
        "| turn | prompt | cached | prefilled | new | TTFP ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['prefill_tokens']} | "
        f"{t['new_tokens']} | {t['ttfp_ms']} |"
        for t in r["three_turn_chat"]
    ]
    img = r["repeated_image"]
    lines += [
        "",
        f"Repeated image: prompt {img['prompt_tokens']}, cached {img['cached_tokens']}, TTFP ms {img['ttfp_ms']}",
        "",
        "Verdicts: " + ", ".join(f"{k}={v}" for k, v in r["verdicts"].items()),
        f"Thinker counters (delta): {report.get('thinker_counters_delta')}",
        "",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n")[0])
    add_launch_flags(p)
    p.add_argument("--url", default=None, help="benchmark a running gateway instead of launching one")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--short-tokens", type=int, default=64)
    p.add_argument("--turn-system-tokens", type=int, default=300)
    p.add_argument("--turn-user-tokens", type=int, default=100)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modalities", choices=["audio", "text"], default="audio")
    p.add_argument("--spoken-tokens", type=int, default=10)
    p.add_argument("--audio-frames", type=int, default=50, help="talker frames per request (audio mode)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument(
        "--out-dir", default=None, help="default: $OUT/prefix_cache or ./bench-results/prefix_cache"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from services.common.checkpoint import Checkpoint
    from services.common.deploy_profile import load_profile, parse_overrides

    args = build_parser().parse_args(argv)
    out_dir = Path(args.out_dir or Path(os.environ.get("OUT", "bench-results")) / "prefix_cache")
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.deploy_config)
    if args.device:
        profile = profile.with_device(args.device)
    if args.stage_overrides:
        profile = profile.with_overrides(parse_overrides(args.stage_overrides))
    profile = with_gpu_sharing(profile, args)
    checkpoint = Path(args.checkpoint)
    report: dict[str, Any] = {
        "bench": "prefix_cache",
        "profile": profile.name,
        "modalities": args.modalities,
        "targets": TARGETS,
        "environment": environment(),
        "status": "started",
    }
    samples: list[Sample] = []
    with guarded_run(report, "prefix") as run:
        url, thinker_metrics = args.url, None
        if url is None:
            from bench.cancel import stage_endpoints

            pipeline = Pipeline(profile, checkpoint, out_dir / "logs", stage_args_for(args, profile))
            run.teardown.append(pipeline.stop)
            pipeline.start()
            report["startup_s"] = pipeline.wait_healthy(args.startup_timeout)
            url = pipeline.url
            thinker_metrics = next(
                (e.metrics_url for e in stage_endpoints(pipeline) if e.stage == "thinker"), None
            )
        tokenizer = Checkpoint(checkpoint).tokenizer()
        before = scrape_counters(thinker_metrics)
        report["results"] = asyncio.run(
            run_workload(args, url, tokenizer, profile.served_model_name, samples)
        )
        after = scrape_counters(thinker_metrics)
        report["thinker_counters_delta"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        failed = [s for s in samples if not s.ok]
        report["status"] = "ok" if not failed else f"{len(failed)} request(s) failed"
    report["requests"] = [asdict(s) | {"text": s.text[:80]} for s in samples]
    (out_dir / "prefix_cache.json").write_text(json.dumps(report, indent=2))
    md = render_markdown(report)
    (out_dir / "prefix_cache.md").write_text(md)
    print(md, flush=True)
    print(f"[prefix] wrote {out_dir / 'prefix_cache.json'}", flush=True)
    return run.rc or (0 if report["status"] == "ok" else 1)


if __name__ == "__main__":
    sys.exit(main())
