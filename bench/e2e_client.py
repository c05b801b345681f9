"""Load generator for the chat route: streaming requests at fixed concurrency, per-request timings.

Measures, per request, on the client side (definitions):

* TTFT: request sent → first non-empty text delta;
* TTFP: request sent → first audio chunk (time to first audio byte);
* E2E: request sent → ``[DONE]``;
* RTF: (last audio chunk − first audio chunk) ÷ audio duration received.

The workload is pinned by the caller (prompt length, forced speech length through per-stage sampling
overrides) so runs are comparable across commits and machines.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    ttfp_s: float | None = None
    e2e_s: float = 0.0
    audio_s: float = 0.0
    rtf: float | None = None
    text_chars: int = 0
    audio_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    started_s: float = 0.0  # offset of the send from the start of the level (queueing analysis)
    error: str = ""
    burst: int | None = None  # index of the burst it was sent in (burst mode), else None


@dataclass
class LevelSummary:
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    req_per_s: float
    truncated: bool = False  # the level hit its deadline before every request was sent
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    # Server-side first-token means over the level (bench.e2e fills it from /metrics): where TTFT went.
    first_token_ms: dict[str, float] = field(default_factory=dict)


def histogram_sums(url: str, prefix: str) -> dict[str, float]:
    """``_sum`` and ``_count`` samples of the histograms whose names start with the regex ``prefix``, from
    one Prometheus ``/metrics`` page; the key keeps the label set (``name_sum{phase="x"}``)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^({prefix}[a-z_]+(?:_sum|_count))(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m:
            key = m.group(1) + (m.group(2) or "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


GC_FULL = 'minicpmo_gc_pause_seconds_{}{{generation="2"}}'  # services.common.heap, full collections


def scrape_full_gcs(urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    """``(count, seconds)`` of full (generation 2) garbage collections so far, per process name."""
    out: dict[str, tuple[float, float]] = {}
    for name, url in urls.items():
        try:
            sums = histogram_sums(url, "minicpmo_gc_pause_")
        except OSError:
            continue  # a process without a metrics port
        out[name] = (sums.get(GC_FULL.format("count"), 0.0), sums.get(GC_FULL.format("sum"), 0.0))
    return out


def full_gcs_between(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Per process with a full collection between two scrapes: how many, and their pause in ms."""
    out: dict[str, dict[str, float]] = {}
    for name, (count, seconds) in after.items():
        c0, s0 = before.get(name, (0.0, 0.0))
        if count > c0:
            out[name] = {"full_collections": count - c0, "pause_ms": 1000.0 * (seconds - s0)}
    return out


def _wav_duration_s(raw: bytes) -> float:
    import soundfile as sf

    info = sf.info(io.BytesIO(raw))
    return info.frames / float(info.samplerate)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {
        "mean": statistics.fmean(xs),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "min": xs[0],
        "max": xs[-1],
    }


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float
) -> RequestResult:
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    first_audio = last_audio = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                now = time.perf_counter() - t0
                for choice in chunk.get("choices", []):
                    content = (choice.get("delta") or {}).get("content") or ""
                    if chunk.get("modality") == "audio":
                        if not content:
                            continue
                        raw = base64.b64decode(content)
                        meta = choice.get("audio_metadata") or {}
                        if meta.get("frame_count") and meta.get("sample_rate_hz"):
                            res.audio_s += meta["frame_count"] / meta["sample_rate_hz"]
                        else:
                            res.audio_s += _wav_duration_s(raw)
                        res.audio_chunks += 1
                        if first_audio is None:
                            first_audio = now
                        last_audio = now
                    elif content:
                        if res.ttft_s is None:
                            res.ttft_s = now
                        res.text_chars += len(content)
        res.e2e_s = time.perf_counter() - t0
        res.ttfp_s = first_audio
        if first_audio is not None and last_audio is not None and res.audio_s > 0:
            res.rtf = (last_audio - first_audio) / res.audio_s
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.e2e_s = time.perf_counter() - t0
    finally:
        if not res.ok and not res.error:
            res.error = "cancelled"
    return res


async def run_level(
    base_url: str,
    body: dict[str, Any],
    concurrency: int,
    num_requests: int,
    timeout: float = 300.0,
    progress: bool = True,
    deadline: float | None = None,
    bodies: list[dict[str, Any]] | None = None,
    require_audio: bool = False,
) -> tuple[LevelSummary, list[RequestResult]]:
    """Send ``num_requests`` requests with at most ``concurrency`` in flight.

    ``bodies`` (optional) gives a distinct body per request (cycled); otherwise every request sends
    ``body``. ``deadline`` (a ``time.monotonic()`` value) stops *sending* new requests once passed;
    requests already in flight finish (bounded by ``timeout``) and the summary is flagged ``truncated``.
    ``require_audio`` counts a request that completed without any audio as failed.
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    results: list[RequestResult] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    skipped = 0
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker(index: int) -> None:
            nonlocal skipped
            async with sem:
                if deadline is not None and time.monotonic() >= deadline:
                    skipped += 1
                    return
                req_body = bodies[index % len(bodies)] if bodies else body
                started = time.perf_counter() - t0
                r = await one_request(client, url, req_body, timeout)
                r.started_s = started
                if require_audio and r.ok and r.audio_s <= 0:
                    r.ok, r.error = False, "completed without audio"
                results.append(r)
                if progress:
                    tag = "ok" if r.ok else f"FAILED {r.error}"
                    print(
                        f"  c={concurrency} [{len(results)}/{num_requests}] ttfp="
                        f"{(r.ttfp_s or 0) * 1000:.0f}ms e2e={r.e2e_s * 1000:.0f}ms audio={r.audio_s:.2f}s {tag}",
                        flush=True,
                    )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(num_requests)))
        wall = time.perf_counter() - t0
    return summarize_level(concurrency, results, wall, skipped), results


async def run_bursts(
    base_url: str,
    concurrency: int,
    bursts: int,
    timeout: float = 300.0,
    *,
    bodies: list[dict[str, Any]],
    deadline: float | None = None,
    require_audio: bool = False,
    gap_s: float = 0.5,
    gc_urls: dict[str, str] | None = None,
) -> tuple[LevelSummary, list[RequestResult], list[dict[str, Any]]]:
    """``bursts`` rounds of ``concurrency`` requests sent together, each round on fresh connections.

    Every burst opens its own client (new TCP connections, as independent callers arriving together
    would), sends all its requests at once, waits for every one to finish, then pauses ``gap_s`` so the
    pipeline is idle before the next. The first burst counts like the others (pass no warm-up rounds to
    include the first burst after start). Returns the level summary over all requests, the requests
    (``burst`` set) and one row per burst: its TTFP/TTFT medians and maxima and each request's TTFT in
    send order, which shows whether one request was served ahead of the rest. With ``gc_urls`` (process
    name -> its ``/metrics``) a row also says which processes ran a full garbage collection during the
    burst and for how long (a full collection holds the GIL: every stream of that process waits).
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    gcs = await asyncio.to_thread(scrape_full_gcs, gc_urls) if gc_urls else {}
    results: list[RequestResult] = []
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for b in range(bursts):
        if deadline is not None and time.monotonic() >= deadline:
            break
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits) as client:
            burst_bodies = [bodies[(b * concurrency + i) % len(bodies)] for i in range(concurrency)]
            sent = time.perf_counter() - t0
            got = await asyncio.gather(*(one_request(client, url, body, timeout) for body in burst_bodies))
        for r in got:
            r.burst, r.started_s = b, sent
            if require_audio and r.ok and r.audio_s <= 0:
                r.ok, r.error = False, "completed without audio"
        results.extend(got)
        ok = [r for r in got if r.ok]
        ttfp = [r.ttfp_s * 1000 for r in ok if r.ttfp_s is not None]
        ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        rows.append(
            {
                "burst": b,
                "ok": len(ok),
                "failed": len(got) - len(ok),
                "ttfp_p50_ms": statistics.median(ttfp) if ttfp else None,
                "ttfp_max_ms": max(ttfp) if ttfp else None,
                "ttft_p50_ms": statistics.median(ttft) if ttft else None,
                "ttft_ms_in_send_order": [None if r.ttft_s is None else r.ttft_s * 1000 for r in got],
                "ttfp_ms_in_send_order": [None if r.ttfp_s is None else r.ttfp_s * 1000 for r in got],
            }
        )
        if gc_urls:
            now = await asyncio.to_thread(scrape_full_gcs, gc_urls)
            rows[-1]["full_gcs"], gcs = full_gcs_between(gcs, now), now
        print(
            f"  c={concurrency} burst {b}: TTFP p50 {rows[-1]['ttfp_p50_ms'] or float('nan'):.0f} ms, "
            f"max {rows[-1]['ttfp_max_ms'] or float('nan'):.0f} ms, {rows[-1]['failed']} failed",
            flush=True,
        )
        await asyncio.sleep(gap_s)
    wall = time.perf_counter() - t0
    skipped = (bursts - len(rows)) * concurrency
    return summarize_level(concurrency, results, wall, skipped), results, rows


def summarize_level(
    concurrency: int, results: list[RequestResult], wall: float, skipped: int
) -> LevelSummary:
    """One level's row: request counts, throughput and the percentiles of the successful requests."""
    ok = [r for r in results if r.ok]
    return LevelSummary(
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(ok),
        wall_s=wall,
        req_per_s=len(ok) / wall if wall > 0 else 0.0,
        truncated=skipped > 0,
        metrics={
            "ttft_ms": percentiles([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
            "ttfp_ms": percentiles([r.ttfp_s * 1000 for r in ok if r.ttfp_s is not None]),
            "e2e_ms": percentiles([r.e2e_s * 1000 for r in ok]),
            "rtf": percentiles([r.rtf for r in ok if r.rtf is not None]),
            "audio_s": percentiles([r.audio_s for r in ok]),
        },
    )


def markdown_table(levels: list[LevelSummary]) -> str:
    rows = [
        "| c | req | failed | req/s | TTFT p50/p90/p99 ms | TTFP p50/p90/p99 ms | E2E p50/p90/p99 ms "
        "| RTF mean/p50/p90/p99 | audio s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(m: dict[str, float], keys: tuple[str, ...], nd: int = 0) -> str:
        if not m:
            return "—"
        return " / ".join(f"{m[k]:.{nd}f}" for k in keys)

    for lv in levels:
        m = lv.metrics
        rows.append(
            f"| {lv.concurrency} | {lv.requests}{' (cut)' if lv.truncated else ''} | {lv.failed} | "
            f"{lv.req_per_s:.2f} | "
            f"{fmt(m['ttft_ms'], ('p50', 'p90', 'p99'))} | {fmt(m['ttfp_ms'], ('p50', 'p90', 'p99'))} | "
            f"{fmt(m['e2e_ms'], ('p50', 'p90', 'p99'))} | {fmt(m['rtf'], ('mean', 'p50', 'p90', 'p99'), 3)} | "
            f"{fmt(m['audio_s'], ('mean',), 2)} |"
        )
    return "\n".join(rows)


def summaries_to_json(levels: list[LevelSummary]) -> list[dict[str, Any]]:
    return [asdict(lv) for lv in levels]
