"""The e2e workload through the three stage engines called in ONE process: no gRPC, no gateway, no HTTP.

    python -m bench.inprocess --checkpoint DIR --device cuda --concurrency 1,4,8 --requests-per-level 32

This is the other half of "what does the service split cost": ``bench.e2e`` drives the real deployment
(three stage processes + gateway, chat route over HTTP/SSE); this drives the same engines directly, each
on its own thread as in its server, handing tensors and code lists between them in memory:

    ThinkerEngine (greedy, 10 spoken tokens, hidden rows)  ->  TalkerEngine (fixed frames, codec windows)
    ->  Code2WavEngine (default cached voice, per-window audio)

Same workload and definitions as ``bench.e2e`` (64-token prompts rendered with the chat template and the
TTS template on, ``--spoken-tokens``, ``--audio-frames``, the profile's codec windows), measured from the
moment a request is handed to the thinker: TTFT = first sampled token (the e2e client sees the first
text delta over SSE instead), TTFP = first audio samples out of code2wav, E2E = last window done,
RTF = (last − first audio) ÷ audio duration. Same percentiles and table as ``bench.e2e``; comparing the
two tables at equal concurrency gives the end-to-end cost of the split (gRPC hops, gateway, HTTP/SSE,
and separate CUDA contexts time-slicing instead of one process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.chat_workload import Workload, make_prompts
from bench.e2e_client import LevelSummary, RequestResult, markdown_table, summarize_level
from bench.launch import environment
from services.common.deploy_profile import DeployProfile, load_profile, parse_overrides


class Engines:
    """The three engines of one process, started the way their servers start them."""

    def __init__(self, args: argparse.Namespace, profile: DeployProfile) -> None:
        from services.code2wav.__main__ import build_parser as c2w_parser
        from services.code2wav.service import build_engine as build_c2w
        from services.common.checkpoint import Checkpoint
        from services.talker.engine import TalkerEngine
        from services.talker.model.tts import MiniCPMTTS
        from services.thinker.engine import EngineConfig, ThinkerEngine
        from services.thinker.processor import ThinkerProcessor
        from services.thinker.runner import build_qwen3_llm

        device = args.device
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        ckpt = Checkpoint(args.checkpoint)
        thinker_p, talker_p, c2w_p = (profile.stage(s) for s in ("thinker", "talker", "code2wav"))
        t0 = time.perf_counter()
        llm = build_qwen3_llm(
            ckpt.config,
            ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=dtype, device=device),
            dtype,
            device,
        )
        self.processor = ThinkerProcessor.from_checkpoint(ckpt)
        budget = int(args.thinker_kv_gb * 2**30) if device.startswith("cuda") else None
        self.thinker = ThinkerEngine(
            llm,
            EngineConfig(
                max_num_seqs=thinker_p.max_num_seqs,
                kv_budget_bytes=budget,
                max_context=thinker_p.max_model_len or 40960,
            ),
            device,
        )
        self.talker = TalkerEngine(
            MiniCPMTTS.from_checkpoint(ckpt, dtype=dtype, device=device), max_streams=talker_p.max_num_seqs
        )
        c2w_args = c2w_parser().parse_args(
            ["--checkpoint", str(args.checkpoint), "--device", device, "--max-batch", str(c2w_p.max_num_seqs)]
        )
        self.code2wav, _ = build_c2w(c2w_args)
        self.codec = talker_p.codec
        print(f"[inprocess] engines built in {time.perf_counter() - t0:.1f} s", flush=True)

    async def start(self) -> None:
        self.thinker.start()
        self.talker.start()
        await self.code2wav.start()

    async def stop(self) -> None:
        self.thinker.shutdown()
        self.talker.shutdown()
        await self.code2wav.stop()

    def prompt_ids(self, text: str) -> list[int]:
        from services.thinker.processor.chat import Message

        processed = self.processor([Message("user", [text])], enable_thinking=False, use_tts_template=True)
        return processed.input_ids.tolist()


async def one_request(eng: Engines, ids: list[int], w: Workload, index: int) -> RequestResult:
    """Thinker -> talker -> code2wav for one prompt, timed from the hand-off to the thinker."""
    from services.talker.streams import ConditionInput, DoneOut, ErrorOut, WindowOut
    from services.thinker.sampling import Sampler, SamplingConfig
    from services.thinker.scheduler import WorkItem

    loop = asyncio.get_running_loop()
    res = RequestResult(ok=False, prompt_tokens=len(ids))
    thinker_q: asyncio.Queue[Any] = asyncio.Queue()
    talker_q: asyncio.Queue[Any] = asyncio.Queue()
    t0 = time.perf_counter()
    seq = eng.thinker.open(lambda ev: loop.call_soon_threadsafe(thinker_q.put_nowait, ev))
    cfg = SamplingConfig(max_tokens=w.spoken_tokens, min_tokens=w.spoken_tokens, ignore_eos=True)
    eng.thinker.submit(seq, WorkItem(ids, sampler=Sampler(cfg), emit_hidden=True, feed_last=True))
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    handle = None
    st = None
    try:
        while True:  # thinker: every generated token is spoken (TTS template); rows align 1:1 with tokens
            ev = await thinker_q.get()
            if ev.error is not None:
                res.error = f"thinker: {ev.error}"
                return res
            if ev.hidden is not None and ev.fed_token is not None:
                rows.append(ev.hidden)
            if ev.token is not None:
                tokens.append(int(ev.token))
                if res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - t0
            if ev.finish_reason is not None:
                break
        res.completion_tokens = len(tokens)
        spoken = tokens[: len(rows)]
        settings = eng.talker.make_settings(
            request_id=f"inproc-{index}",
            sampling=eng.talker.default_sampling(seed=w.seed),
            fixed_frames=w.audio_frames,
            window_frames=eng.codec.window_frames,
            left_context=eng.codec.left_context_frames,
            first_window_frames=eng.codec.first_window_frames,
        )
        handle = await eng.code2wav.open_stream(f"inproc-{index}", None, w.seed)
        st = eng.talker.open(settings, lambda out: loop.call_soon_threadsafe(talker_q.put_nowait, out))
        # Fixed-frame mode decodes once the turn's last chunk is in; the span is one chunk here.
        eng.talker.chunk(
            st, ConditionInput(torch.tensor(spoken, dtype=torch.long), torch.stack(rows), True, True, 0, 0, 0)
        )
        eng.talker.end(st)
        first_audio = last_audio = None
        talker_done = False
        windows_sent = windows_done = 0
        while not (talker_done and windows_done == windows_sent):
            getters = [asyncio.ensure_future(handle.outputs.get())]
            if not talker_done:
                getters.append(asyncio.ensure_future(talker_q.get()))
            done, pending = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for fut in pending:
                fut.cancel()
            for fut in done:
                item = fut.result()
                if isinstance(item, tuple):  # code2wav (tag, WindowResult | StageError)
                    _tag, result = item
                    if isinstance(result, Exception):
                        res.error = f"code2wav: {result}"
                        return res
                    windows_done += 1
                    if result.samples.size:
                        now = time.perf_counter() - t0
                        first_audio = now if first_audio is None else first_audio
                        last_audio = now
                        res.audio_s += result.samples.shape[0] / 24_000
                        res.audio_chunks += 1
                elif isinstance(item, WindowOut):
                    eng.code2wav.submit(
                        handle,
                        list(item.window.codes),
                        item.window.left_context,
                        item.window.is_last,
                        windows_sent,
                    )
                    windows_sent += 1
                elif isinstance(item, ErrorOut):
                    res.error = f"talker: {item.error}"
                    return res
                elif isinstance(item, DoneOut):
                    talker_done = True
        res.e2e_s = time.perf_counter() - t0
        res.ttfp_s = first_audio
        if first_audio is not None and last_audio is not None and res.audio_s > 0:
            res.rtf = (last_audio - first_audio) / res.audio_s
        res.ok = res.audio_s > 0
        if not res.ok:
            res.error = "no audio"
        return res
    finally:
        eng.thinker.close(seq)
        if st is not None:
            eng.talker.close(st)
        if handle is not None:
            eng.code2wav.close(handle)


async def run_level(
    eng: Engines,
    prompt_ids: list[list[int]],
    w: Workload,
    c: int,
    n: int,
    deadline: float,
    progress: bool = True,
) -> tuple[LevelSummary, list[RequestResult]]:
    sem = asyncio.Semaphore(c)
    results: list[RequestResult] = []
    skipped = 0

    async def worker(i: int) -> None:
        nonlocal skipped
        async with sem:
            if time.monotonic() >= deadline:
                skipped += 1
                return
            started = time.perf_counter() - t0
            r = await one_request(eng, prompt_ids[i % len(prompt_ids)], w, i)
            r.started_s = started
            results.append(r)
            if progress:
                print(
                    f"  c={c} [{len(results)}/{n}] ttfp={(r.ttfp_s or 0) * 1000:.0f}ms e2e={r.e2e_s * 1000:.0f}ms "
                    f"audio={r.audio_s:.2f}s {'ok' if r.ok else 'FAILED ' + r.error}",
                    flush=True,
                )

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(n)))
    wall = time.perf_counter() - t0
    return summarize_level(c, results, wall, skipped), results


async def drive(
    args: argparse.Namespace, profile: DeployProfile, w: Workload, deadline: float
) -> dict[str, Any]:
    from services.common.checkpoint import Checkpoint

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    n_prompts = max(args.requests_per_level, max(levels), args.warmup, 1)
    prompts = make_prompts(Checkpoint(args.checkpoint).tokenizer(), n_prompts, w.prompt_tokens)
    eng = Engines(args, profile)
    await eng.start()
    out: dict[str, Any] = {"levels": [], "requests": {}}
    try:
        ids = [eng.prompt_ids(p) for p in prompts]
        out["prompt_tokens_with_template"] = len(ids[0])
        if args.warmup:
            print(f"[inprocess] warm-up: {args.warmup} request(s) at c=1", flush=True)
            s, _ = await run_level(eng, ids[-args.warmup :], w, 1, args.warmup, deadline)
            if s.failed:
                raise RuntimeError("warm-up request failed")
        for c in levels:
            if time.monotonic() >= deadline:
                print(f"[inprocess] out of time before c={c}", flush=True)
                break
            if args.warmup_rounds:
                await run_level(eng, ids, w, c, args.warmup_rounds * c, deadline, progress=False)
            print(f"[inprocess] c={c}: {args.requests_per_level} request(s)", flush=True)
            summary, reqs = await run_level(eng, ids, w, c, args.requests_per_level, deadline)
            out["levels"].append(summary)
            out["requests"][str(c)] = [asdict(r) for r in reqs]
    finally:
        await eng.stop()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.inprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--deploy-config", default="minicpmo_4_5", help="profile for max sequences and codec windows"
    )
    p.add_argument("--stage-overrides", default=None, help="JSON deep-merged into the profile (as bench.e2e)")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests-per-level", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--spoken-tokens", type=int, default=10)
    p.add_argument("--audio-frames", type=int, default=200)
    p.add_argument("--thinker-kv-gb", type=float, default=16.0)
    p.add_argument("--max-seconds", type=float, default=480.0)
    p.add_argument("--out-dir", default=None, help="default: $OUT/inprocess or ./bench-results/inprocess")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("[inprocess] --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    w = Workload(args.prompt_tokens, args.spoken_tokens, 10, args.audio_frames)
    profile = load_profile(args.deploy_config).with_overrides(parse_overrides(args.stage_overrides))
    out_dir = Path(args.out_dir or Path(os.environ.get("OUT", "bench-results")) / "inprocess")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(drive(args, profile, w, t_start + args.max_seconds))
    summaries: list[LevelSummary] = result["levels"]
    codec = profile.stage("talker").codec
    report = {
        "bench": "inprocess",
        "device": args.device,
        "profile": profile.name,
        "workload": {
            **asdict(w),
            "audio_seconds": w.audio_seconds,
            "first_window_frames": codec.first_window_frames,
            "window_frames": codec.window_frames,
            "left_context_frames": codec.left_context_frames,
            "prompt_tokens_with_template": result.get("prompt_tokens_with_template"),
        },
        "environment": environment(),
        "levels": [asdict(s) for s in summaries],
        "requests": result["requests"],
        "status": "ok" if summaries and not any(s.failed for s in summaries) else "failures",
        "wall_s": time.monotonic() - t_start,
    }
    (out_dir / "inprocess.json").write_text(json.dumps(report, indent=2))
    md = (
        f"## Same workload, the three engines in one process (device {args.device}, no gRPC/gateway/HTTP)\n\n"
        + markdown_table(summaries)
        + "\n"
    )
    (out_dir / "inprocess.md").write_text(md)
    print(md, flush=True)
    print(f"[inprocess] status {report['status']}; wrote {out_dir / 'inprocess.json'}", flush=True)
    return 0 if report["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
