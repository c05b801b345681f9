"""The end-to-end benchmark harness on CPU: percentile math, the pinned workload, one short real run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.chat_workload import Workload, make_prompts, request_body
from bench.e2e_client import percentiles

REPO = Path(__file__).resolve().parents[1]


def test_percentiles_match_numpy_linear_interpolation() -> None:
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 101):
        values = rng.exponential(100.0, size=n).tolist()
        got = percentiles(values)
        for key, q in (("p50", 50), ("p90", 90), ("p99", 99)):
            assert got[key] == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
        assert got["mean"] == pytest.approx(float(np.mean(values)))
        assert got["min"] == min(values) and got["max"] == max(values)


def test_percentiles_known_values_and_empty() -> None:
    got = percentiles([4.0, 1.0, 3.0, 2.0])
    assert got["p50"] == 2.5
    assert got["p90"] == pytest.approx(3.7)
    assert percentiles([]) == {}


def test_prompts_have_exact_token_count_and_are_distinct(tiny_ckpt: Path) -> None:
    from services.common.checkpoint import Checkpoint

    tok = Checkpoint(tiny_ckpt).tokenizer()
    prompts = make_prompts(tok, 12, 64)
    assert len(set(prompts)) == 12
    assert all(len(tok.encode(p, add_special_tokens=False)) == 64 for p in prompts)


def test_request_body_pins_the_workload() -> None:
    w = Workload(prompt_tokens=64, spoken_tokens=10, first_chunk_tokens=10, audio_frames=200)
    body = request_body("hi", w, "m")
    thinker, talker = body["sampling_params_list"]
    assert thinker["min_tokens"] == thinker["max_tokens"] == 10 and thinker["ignore_eos"] is True
    assert talker["fixed_frames"] == 200 and w.audio_seconds == 8.0
    assert body["stream"] is True and "ref_audio" not in body
    # The gateway accepts these overrides as they are (no 400 at request time).
    from gateway.openai.protocol import parse_chat_request

    req = parse_chat_request(body, "m")
    assert req.thinker_sampling["ignore_eos"] is True and req.talker_sampling["fixed_frames"] == 200


def _run_bench(
    module: str, ckpt: Path, out: Path, levels: list[str], extra: list[str], timeout_s: float
) -> None:
    """Run a chat benchmark on the CPU profile with the short test workload (25 frames of audio)."""
    cmd = [sys.executable, "-m", module, "--checkpoint", str(ckpt), "--deploy-config", "cpu", *levels]
    cmd += [*extra, "--audio-frames", "25", "--out-dir", str(out)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_e2e_runs_on_cpu_and_writes_results(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "e2e"
    _run_bench(
        "bench.e2e",
        tiny_ckpt,
        out,
        ["--concurrency", "1,2", "--requests-per-level", "2", "--warmup", "1", "--warmup-rounds", "0"],
        ["--timeline-requests", "1", "--bursts", "1", "--timeline-first", "--max-seconds", "500"],
        timeout_s=700,
    )
    report = json.loads((out / "e2e.json").read_text())
    assert report["status"] == "ok"
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["requests"] == 2 and lv["failed"] == 0 and lv["req_per_s"] > 0
        for metric in ("ttft_ms", "ttfp_ms", "e2e_ms", "rtf", "audio_s"):
            assert {"mean", "p50", "p90", "p99"} <= set(lv["metrics"][metric])
        assert lv["metrics"]["ttft_ms"]["p50"] <= lv["metrics"]["e2e_ms"]["p50"]
        # 25 fixed frames = 1 s of codec time; the vocoder adds a short tail.
        assert 1.0 <= lv["metrics"]["audio_s"]["mean"] < 1.5
        # Server-side first-token means (from the gateway's and the thinker's /metrics) nest inside the
        # client's TTFT: the thinker's span lies within the gateway's, which lies within the client's.
        ft = lv["first_token_ms"]
        assert (
            0 < ft["thinker_ttft_mean_ms"] <= ft["gateway_ttft_mean_ms"] <= lv["metrics"]["ttft_ms"]["mean"]
        )
    for reqs in report["requests"].values():
        assert all(r["ok"] and r["completion_tokens"] == 10 and r["prompt_tokens"] > 64 for r in reqs)
    assert "first_audio" in report["timeline_ms"]
    # c=2 ran as one burst of 2 (--bursts 1): its row lists both requests' TTFT in send order.
    [burst] = report["bursts"]["2"]
    assert burst["ok"] == 2 and len(burst["ttft_ms_in_send_order"]) == 2
    # every process's full collections during the burst (heap frozen at start: usually none)
    assert set(burst["full_gcs"]) <= {"gateway", "thinker-0", "talker-0", "code2wav-0"}
    assert all(r["burst"] == 0 for r in report["requests"]["2"])
    # --timeline-first: the c=2 marks (one group of 2, on its own connections) were taken before the levels.
    assert report["timeline_first"] and [m["send_index"] for m in report["timeline_raw_ms"]["2"]] in (
        [0.0, 1.0],
        [1.0, 0.0],
    )
    assert report["workload"]["first_window_frames"] == 25
    md = (out / "e2e.md").read_text()
    assert "| 1 | 2 | 0 |" in md and "| 2 | 2 | 0 |" in md
    assert "| c | client TTFT mean | gateway TTFT mean | thinker TTFT mean |" in md
    assert "| full GCs (process: n, ms) |" in md
    # Teardown: every child the harness started is gone.
    pids = json.loads((out / "logs" / "pids.json").read_text())
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.slow
def test_inprocess_pipeline_runs_on_cpu(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "inproc"
    _run_bench(
        "bench.inprocess",
        tiny_ckpt,
        out,
        ["--concurrency", "1,2", "--requests-per-level", "2", "--warmup", "1", "--warmup-rounds", "0"],
        ["--device", "cpu"],
        timeout_s=600,
    )
    report = json.loads((out / "inprocess.json").read_text())
    assert report["status"] == "ok" and [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["failed"] == 0 and 1.0 <= lv["metrics"]["audio_s"]["mean"] < 1.5
        assert (
            lv["metrics"]["ttft_ms"]["p50"] < lv["metrics"]["ttfp_ms"]["p50"] < lv["metrics"]["e2e_ms"]["p50"]
        )
    for reqs in report["requests"].values():
        assert all(r["completion_tokens"] == 10 for r in reqs)
    assert report["workload"]["prompt_tokens_with_template"] > 64


def test_full_gc_deltas_per_process(tmp_path: Path) -> None:
    """The bursts' full-collection column: counts and pauses between two scrapes of each process's
    ``minicpmo_gc_pause_seconds{generation="2"}``; other generations and unreachable processes left out."""
    from bench.e2e_client import full_gcs_between, scrape_full_gcs

    page = tmp_path / "metrics.txt"

    def write(count: float, seconds: float) -> None:
        page.write_text(
            f'minicpmo_gc_pause_seconds_count{{generation="2"}} {count}\n'
            f'minicpmo_gc_pause_seconds_sum{{generation="2"}} {seconds}\n'
            'minicpmo_gc_pause_seconds_count{generation="0"} 50.0\n'
        )

    urls = {"talker-0": page.as_uri(), "gone": "http://127.0.0.1:9/metrics"}
    write(3, 0.25)
    before = scrape_full_gcs(urls)
    assert before == {"talker-0": (3.0, 0.25)}
    write(4, 0.4)
    after = scrape_full_gcs(urls)
    assert full_gcs_between(before, after) == {
        "talker-0": {"full_collections": 1.0, "pause_ms": pytest.approx(150.0)}
    }
    assert full_gcs_between(after, after) == {}


def test_bursts_send_together_on_fresh_connections() -> None:
    """``run_bursts`` against a minimal streaming server: every burst's requests arrive together, each on
    a connection of its own (none reused across bursts), and the per-burst rows match the requests."""
    import asyncio
    import base64
    import io
    import wave

    from bench.e2e_client import run_bursts

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(b"\0\0" * 2400)  # 0.1 s
    audio = base64.b64encode(buf.getvalue()).decode()
    chunks = [
        {"choices": [{"delta": {"content": "hi"}}]},
        {"modality": "audio", "choices": [{"delta": {"content": audio}}]},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    connections: list[float] = []
    arrivals: list[float] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/1.1 with keep-alive: serves requests on this connection until the client closes it."""
        connections.append(asyncio.get_running_loop().time())
        payload = body.encode()
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break  # the client closed the connection
            length = next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
            await reader.readexactly(int(length.split(b":")[1]))
            arrivals.append(asyncio.get_running_loop().time())
            await asyncio.sleep(0.05)  # the "pipeline": every request in flight at once overlaps here
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                + f"content-length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        writer.close()

    async def main() -> tuple:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await run_bursts(
                f"http://127.0.0.1:{port}", 3, 2, 10.0, bodies=[{"n": i} for i in range(6)], gap_s=0.2
            )

    summary, reqs, rows = asyncio.run(main())
    assert summary.requests == 6 and summary.failed == 0 and not summary.truncated
    assert [r.burst for r in reqs] == [0, 0, 0, 1, 1, 1]
    assert all(r.ok and r.ttft_s is not None and r.ttfp_s is not None for r in reqs)
    assert len(connections) == 6  # a fresh connection for every request of every burst
    first, second = sorted(arrivals)[:3], sorted(arrivals)[3:]
    assert max(first) - min(first) < 0.04 and min(second) - max(first) >= 0.2  # together, then the gap
    assert [r["burst"] for r in rows] == [0, 1] and all(r["ok"] == 3 for r in rows)
    assert rows[0]["ttfp_p50_ms"] >= 50 and len(rows[1]["ttft_ms_in_send_order"]) == 3


def test_timeline_records_failed_requests_and_goes_on() -> None:
    """A slow request (httpx.ReadTimeout), an error status and a body that is not JSON are recorded in
    ``errors``; the request that answered still gives its marks."""
    import asyncio

    from bench.e2e import timeline

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
        kind = json.loads(await reader.readexactly(int(length.split(b":")[1])))["kind"]
        if kind == "slow":
            await asyncio.sleep(2.0)
        status, payload = {
            "ok": (b"200 OK", json.dumps({"metrics": {"first_text": 0.1, "audio_done": 0.5}}).encode()),
            "slow": (b"200 OK", b"{}"),
            "error": (b"500 Internal Server Error", b'{"error": {"message": "boom"}}'),
            "garbage": (b"200 OK", b"not json"),
        }[kind]
        writer.write(b"HTTP/1.1 " + status + f"\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def main() -> tuple[list[dict[str, float]], list[dict]]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        errors: list[dict] = []
        bodies = [{"kind": k} for k in ("slow", "ok", "error", "garbage")]
        async with server:
            marks = await timeline(f"http://127.0.0.1:{port}", bodies, 0.5, concurrency=2, errors=errors)
        return marks, errors

    marks, errors = asyncio.run(main())
    assert len(marks) == 1 and marks[0]["first_text"] == 0.1 and marks[0]["send_index"] == 1.0
    assert sorted((e["burst"], e["send_index"]) for e in errors) == [(0, 0), (1, 0), (1, 1)]
    by_index = {(e["burst"], e["send_index"]): e["error"] for e in errors}
    assert by_index[(0, 0)].startswith("ReadTimeout")
    assert by_index[(1, 0)].startswith("HTTP 500") and by_index[(1, 1)].startswith("JSONDecodeError")


def test_a_stray_http_error_is_recorded_not_raised() -> None:
    """guarded_run turns an HTTP client error that escaped the bench body into rc 1 and a status, so the
    caller still writes its report."""
    import httpx

    from bench.launch import guarded_run

    report: dict = {}
    stopped: list[bool] = []
    with guarded_run(report, "test") as run:
        run.teardown.append(lambda: stopped.append(True))
        raise httpx.ReadTimeout("timed out")
    assert run.rc == 1 and report["status"].startswith("error: timed out") and stopped == [True]


def test_launch_passes_no_kv_budget_unless_asked() -> None:
    """The thinker sizes its KV pool from its cap by default; an explicit budget is handed through."""
    import argparse

    from bench.launch import add_launch_flags, stage_args_for
    from services.common.deploy_profile import load_profile

    p = argparse.ArgumentParser()
    add_launch_flags(p)
    profile = load_profile("minicpmo_4_5")  # every stage on cuda:0
    args = p.parse_args(["--checkpoint", "x"])
    assert args.thinker_kv_budget == "auto" and "--kv-budget" not in stage_args_for(args, profile).get(
        "thinker", []
    )
    args = p.parse_args(["--checkpoint", "x", "--thinker-kv-budget", "12G"])
    assert stage_args_for(args, profile)["thinker"] == ["--kv-budget", "12G"]


def test_prefix_cache_bench_runs_on_cpu(tiny_ckpt: Path, tmp_path: Path) -> None:
    """``bench.prefix_cache`` end to end on the tiny checkpoint (text only, short prompts): the second
    request with a shared prefix and the repeated image report cached tokens, the JSON is written."""
    out = tmp_path / "prefix"
    cmd = [
        sys.executable,
        "-m",
        "bench.prefix_cache",
        "--checkpoint",
        str(tiny_ckpt),
        "--deploy-config",
        "cpu",
        "--device",
        "cpu",
        "--modalities",
        "text",
        "--prefix-tokens",
        "200",
        "--short-tokens",
        "32",
        "--turn-system-tokens",
        "60",
        "--turn-user-tokens",
        "20",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--spoken-tokens",
        "3",
        "--out-dir",
        str(out),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "prefix_cache.json").read_text())
    r = report["results"]
    assert r["shared_prefix"]["first_cached_tokens"] == [0]
    assert r["shared_prefix"]["second_cached_tokens"][0] >= 192  # 200 system tokens + template, whole blocks
    assert r["repeated_image"]["cached_tokens"][1] > r["repeated_image"]["cached_tokens"][0]
    assert r["three_turn_chat"][1]["cached_tokens"] >= 64  # at least the system prompt and the first question
    assert report["thinker_counters_delta"]["minicpmo_thinker_prefix_cache_hit_tokens_total"] > 0
    assert (out / "logs" / "thinker-0.log").exists() and (out / "prefix_cache.md").exists()
