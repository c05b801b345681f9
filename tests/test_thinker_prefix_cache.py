"""Automatic prefix caching in the thinker (tiny checkpoint, CPU, fp32).

Greedy outputs with the cache are identical to an engine without it: for a shared prefix, an exact
repeat, a multi-turn history, after LRU eviction under a small KV budget, under concurrent requests that
share a prefix, and through the packed-row (emulated CUDA graph) path. The block pool's reference counts
and eviction order, the media keys of the processor (a repeated image is a hit, another image is not),
and ``cached_tokens`` through the gRPC server.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from services.common.checkpoint import Checkpoint
from services.common.grpc_server import ServeOptions
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.thinker.backend import build_backend
from services.thinker.engine import EngineConfig, EngineEvent, ThinkerEngine
from services.thinker.kv_cache import BlockPool, OutOfBlocks
from services.thinker.prefix_hash import MediaSpan, chain_hashes
from services.thinker.runner import build_qwen3_llm
from services.thinker.sampling import Sampler, SamplingConfig
from services.thinker.scheduler import WorkItem
from services.thinker.server import make_server
from tests.graph_emulation import emulated

torch.set_num_threads(1)
BS = 16  # the engine's default block size


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> torch.nn.Module:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    return build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")


def make_engine(
    llm: torch.nn.Module, *, cache: bool, budget: int = 8 << 20, graphed: bool = False
) -> ThinkerEngine:
    engine = ThinkerEngine(
        llm,
        EngineConfig(max_num_seqs=4, kv_budget_bytes=budget, max_step_tokens=64, prefix_caching=cache),
        torch.device("cpu"),
    )
    if graphed:
        engine.runner.use_cuda_graphs = True
        engine.runner.graph_capture = emulated
    return engine


class Run:
    """One request's events."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []

    def __call__(self, ev: EngineEvent) -> None:
        self.events.append(ev)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def cached(self) -> int:
        assert not [e.error for e in self.events if e.error is not None]
        return self.events[-1].cached_tokens


def submit(engine: ThinkerEngine, prompt: list[int], max_tokens: int = 6) -> Run:
    run = Run()
    sampler = Sampler(SamplingConfig(max_tokens=max_tokens, stop_token_ids=()))
    engine.submit(engine.open(run), WorkItem(list(prompt), sampler=sampler))
    return run


def solo(engine: ThinkerEngine, prompt: list[int], max_tokens: int = 6) -> Run:
    run = submit(engine, prompt, max_tokens)
    engine.run_until_idle()
    return run


def ids(start: int, n: int) -> list[int]:
    return [1000 + (start + 7 * i) % 5000 for i in range(n)]


SYSTEM = ids(0, 70)  # 4 full blocks + 6 tokens


# ------------------------------------------------------------------------------------------------ pool
def test_pool_refcounts_lru_and_duplicates() -> None:
    pool = BlockPool(6, prefix_caching=True)  # 5 usable
    a = pool.allocate(3)
    for block, h in zip(a, (b"h0", b"h1", b"h2"), strict=True):
        assert pool.register(block, h)
    assert not pool.register(a[0], b"other") and not pool.register(pool.allocate(1)[0], b"h0")
    assert pool.lookup([b"h0", b"h1", b"x", b"h2"]) == a[:2]
    pool.acquire(a[:2])  # a second reader
    assert [pool.refcount(b) for b in a] == [2, 2, 1]
    pool.release(a)  # the first owner goes: the readers keep two blocks, the third stays cached
    assert pool.used_blocks == 3 and pool.free_blocks == 2 and pool.cached_blocks == 3
    pool.release(a[:2])
    assert pool.used_blocks == 1 and pool.free_blocks == 4  # cached blocks count as free
    # One block on the free list, then LRU: the chain's deep end (h2, released first) goes before its head.
    got = pool.allocate(2)
    assert pool.evictions == 1 and pool.lookup([b"h0", b"h1", b"h2"]) == a[:2] and a[2] in got
    got += pool.allocate(1)
    assert pool.evictions == 2 and pool.lookup([b"h0", b"h1"]) == [a[0]]
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.release([got[0], got[0]])
    assert not BlockPool(4).register(1, b"h")  # caching off: a plain free list


def test_block_keys_chain_positions_and_media() -> None:
    toks = ids(0, 40)
    base = chain_hashes(toks, BS, [])
    assert len(base) == 2 and chain_hashes(toks[:33], BS, []) == base
    assert chain_hashes(toks, BS, [], limit=31) == base[:1]
    other = chain_hashes([toks[0] + 1, *toks[1:]], BS, [])
    assert other[0] != base[0] and other[1] != base[1]  # a hash names the whole prefix
    img = [MediaSpan(20, 36, b"A" * 16)]
    keyed = chain_hashes(toks, BS, img)
    assert keyed[0] == base[0] and keyed[1] != base[1]
    assert chain_hashes(toks, BS, [MediaSpan(20, 36, b"A" * 16)]) == keyed
    assert chain_hashes(toks, BS, [MediaSpan(20, 36, b"B" * 16)])[1] != keyed[1]
    assert chain_hashes(toks, BS, [MediaSpan(20, 36, b"A" * 16, 4)])[1] != keyed[1]


# ----------------------------------------------------------------------------------------- engine
def test_shared_prefix_repeat_and_multi_turn_match_no_cache(llm: torch.nn.Module) -> None:
    ref, eng = make_engine(llm, cache=False), make_engine(llm, cache=True)
    a, b = SYSTEM + ids(100, 9), SYSTEM + ids(200, 13)
    exact = ids(300, 64)  # ends on a block boundary: the last block is recomputed for its logits
    for prompt, want_cached in ((a, 0), (b, 64), (a, 64), (exact, 0), (exact, 48)):
        got, want = solo(eng, prompt), solo(ref, prompt)
        assert got.tokens == want.tokens, prompt[:3]
        assert got.cached == want_cached and want.cached == 0
    # Turn 2 carries turn 1 and its answer: the cached part grows past the old prompt. The answer's
    # last token was never fed, so the cache holds prompt + answer[:-1].
    turn1 = solo(eng, a, max_tokens=20)
    turn2 = a + turn1.tokens + ids(400, 11)
    got, want = solo(eng, turn2), solo(ref, turn2)
    assert got.tokens == want.tokens
    assert got.cached == (len(a) + len(turn1.tokens) - 1) // BS * BS > len(a) // BS * BS
    assert eng.scheduler.hit_tokens >= 64 * 3 + 48 and eng.kv_used_bytes == 0


def test_eviction_under_small_budget_matches_no_cache(llm: torch.nn.Module) -> None:
    block = make_engine(llm, cache=False).layout.bytes_per_block
    ref, eng = make_engine(llm, cache=False), make_engine(llm, cache=True, budget=9 * block)  # 8 usable
    prompts = [ids(1000 * k, 50) for k in range(4)]  # 3 blocks cached each, 4 blocks reserved
    order = [0, 1, 2, 0, 3, 1, 0, 2]
    hits = []
    for k in order:
        got, want = solo(eng, prompts[k]), solo(ref, prompts[k])
        assert got.tokens == want.tokens, k
        hits.append(got.cached)
    pool = eng.cache.pool
    assert pool.evictions > 0 and any(hits) and not all(hits[:3])
    assert pool.used_blocks == 0 and pool.free_blocks == pool.capacity


@pytest.mark.parametrize("graphed", [False, True])
def test_concurrent_requests_sharing_a_prefix_match_no_cache(llm: torch.nn.Module, graphed: bool) -> None:
    prompts = [SYSTEM + ids(500 + 50 * k, 5 + 3 * k) for k in range(5)]
    want = [solo(make_engine(llm, cache=False), p).tokens for p in prompts]
    eng = make_engine(llm, cache=True, graphed=graphed)
    runs = []
    for p in prompts:  # staggered: later ones are admitted while earlier ones prefill or decode
        runs.append(submit(eng, p))
        eng.step()
    eng.run_until_idle()
    assert [r.tokens for r in runs] == want
    assert any(r.cached == 64 for r in runs[1:])
    if graphed:
        counts = eng.runner.step_counts
        assert counts["graph"] + counts["graph_mixed"] > 0
    assert eng.kv_used_bytes == 0


def test_persistent_sequence_prefix_hits_and_unkeyed_rows_stay_private(llm: torch.nn.Module) -> None:
    eng = make_engine(llm, cache=True)
    hidden = int(llm.config.hidden_size)

    def session(rows: torch.Tensor | None) -> tuple[Run, object]:
        run = Run()
        seq = eng.open(run, persistent=True)
        eng.submit(seq, WorkItem(list(SYSTEM), sampler=None))
        eng.run_until_idle()
        unit = ids(900, 20)
        embeds = None if rows is None else rows
        eng.submit(
            seq, WorkItem(unit, embeds, sampler=Sampler(SamplingConfig(max_tokens=3, stop_token_ids=())))
        )
        eng.run_until_idle()
        return run, seq

    first, seq1 = session(torch.randn(20, hidden))
    second, seq2 = session(torch.randn(20, hidden))
    prefix_events = [e for e in second.events if e.finish_reason == "prefilled"]
    assert prefix_events[0].cached_tokens == 64  # the session prefix is shared
    unit_events = [e for e in second.events if e.token is not None]
    assert unit_events[-1].cached_tokens == 0  # embedded rows without a media key: never looked up
    # Blocks holding the unkeyed rows were never registered: another prompt with the same ids misses.
    assert eng.cache.pool.cached_blocks == len(SYSTEM) // BS
    eng.close(seq1)  # type: ignore[arg-type]
    eng.close(seq2)  # type: ignore[arg-type]
    eng.run_until_idle()
    assert eng.kv_used_bytes == 0


def test_prefix_counters(llm: torch.nn.Module) -> None:
    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    before = {
        n: value(n)
        for n in (
            "minicpmo_thinker_prefix_cache_hit_tokens_total",
            "minicpmo_thinker_prefix_cache_miss_tokens_total",
        )
    }
    eng = make_engine(llm, cache=True)
    solo(eng, SYSTEM + [5])
    solo(eng, SYSTEM + [6])
    eng.step()  # the gauges and counters are written at the next step
    hit = (
        value("minicpmo_thinker_prefix_cache_hit_tokens_total")
        - before["minicpmo_thinker_prefix_cache_hit_tokens_total"]
    )
    miss = (
        value("minicpmo_thinker_prefix_cache_miss_tokens_total")
        - before["minicpmo_thinker_prefix_cache_miss_tokens_total"]
    )
    assert hit == 64 and miss == 2 * 71 - 64


# ------------------------------------------------------------------------------------ media + server
def _png(shade: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), shade, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    cfg = EngineConfig(max_context=1024, kv_budget_bytes=16 << 20, max_step_tokens=128)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    b.engine.start()
    yield b
    b.engine.shutdown()
    b.executor.shutdown(wait=False)


def _image_open(shade: int, text: str) -> thinker_pb2.ThinkerOpen:
    msg = thinker_pb2.ChatMessage(
        role="user",
        content=[
            thinker_pb2.ContentPart(image=thinker_pb2.ImagePart(data=_png(shade))),
            thinker_pb2.ContentPart(text=text),
        ],
    )
    return thinker_pb2.ThinkerOpen(
        id=common_pb2.Identity(request_id="r"),
        mode=common_pb2.STREAM_MODE_TURN,
        messages=[msg],
        sampling=thinker_pb2.SamplingParams(max_tokens=4, temperature=0.0),
    )


def test_processor_keys_images_by_content(backend) -> None:  # noqa: ANN001
    from services.thinker.processor import ImageInput, Message

    def spans(shade: int) -> list[MediaSpan]:
        return backend.processor([Message("user", [ImageInput(_png(shade)), "hi"])]).media_spans

    same, again, other = spans(100), spans(100), spans(30)
    assert same and same == again
    assert [(s.start, s.end) for s in other] == [(s.start, s.end) for s in same]
    assert {s.digest for s in other}.isdisjoint({s.digest for s in same})


def test_cached_tokens_through_the_server_and_repeated_image(backend) -> None:  # noqa: ANN001
    async def collect(stub, open_msg) -> list[thinker_pb2.ThinkerResponse]:  # noqa: ANN001
        async def gen() -> AsyncIterator[thinker_pb2.ThinkerRequest]:
            yield thinker_pb2.ThinkerRequest(open=open_msg)

        return [r async for r in stub.Generate(gen(), timeout=120)]

    async def body() -> None:
        server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = thinker_pb2_grpc.ThinkerServiceStub(ch)
                first = (await collect(stub, _image_open(100, "What is it?")))[-1].done
                again = (await collect(stub, _image_open(100, "What colour?")))[-1].done
                other = (await collect(stub, _image_open(30, "What is it?")))[-1].done
        finally:
            await server.stop(grace=0.5)
        assert first.usage.cached_tokens == 0
        # The image's rows (64 per slice) lie before the question: the second prompt finds them cached.
        assert again.usage.cached_tokens >= 64 and again.usage.prompt_tokens > again.usage.cached_tokens
        # Another picture with the same placeholder ids only shares the blocks before it.
        assert other.usage.cached_tokens < again.usage.cached_tokens

    asyncio.run(body())


# ------------------------------------------------------------------------------- real process + gateway
@pytest.mark.slow
def test_cached_tokens_in_chat_usage_through_a_thinker_process(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A real thinker process behind the gateway: the second request with the same long system prompt
    reports the shared blocks in ``usage.prompt_tokens_details.cached_tokens`` (non-streamed and
    streamed), and the thinker's /metrics counts the hit."""
    import httpx
    from gateway_server import ThreadedGateway
    from stage_processes import dead_address, start_stages, stop_all

    from gateway.config import GatewayConfig
    from services.common.deploy_profile import load_profile

    (thinker,) = start_stages(tiny_ckpt, tmp_path, [("thinker", ["--max-context", "1024"])])
    try:
        addrs = {"thinker": thinker.addr, "talker": dead_address(), "code2wav": dead_address()}
        system = "You are a careful assistant. " * 20
        with ThreadedGateway(GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu"))) as gw:

            def chat(question: str, **extra: object) -> httpx.Response:
                body = {
                    "model": "openbmb/MiniCPM-o-4_5",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    "modalities": ["text"],
                    "max_tokens": 3,
                    **extra,
                }
                r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                return r

            first = chat("Hello?").json()["usage"]
            second = chat("Why?").json()["usage"]
            assert first["prompt_tokens_details"]["cached_tokens"] == 0
            cached = second["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 128 and cached % BS == 0 and cached < second["prompt_tokens"]
            lines = chat("How?", stream=True, stream_options={"include_usage": True}).text.splitlines()
            chunks = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]
            assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        metrics = httpx.get(f"http://127.0.0.1:{thinker.metrics_port}/metrics", timeout=10).text
        hits = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith("minicpmo_thinker_prefix_cache_hit_tokens_total")
        ]
        assert hits and float(hits[0].split()[-1]) >= 2 * cached
    finally:
        stop_all([thinker])


def test_reopened_duplex_session_hits_its_prefix_and_decides_the_same(backend) -> None:  # noqa: ANN001
    """A realtime session opened again with the same instructions and reference voice (a resumed or
    reconnected session) finds its prefix cached; its units decide exactly as the first session's did."""
    from test_thinker_duplex import END, _session, duplex_open, unit

    from services.common.pcm import pcm_from_float

    voice = pcm_from_float((0.2 * np.sin(np.arange(32000) / 7.0)).astype(np.float32), 16000)
    other = pcm_from_float((0.2 * np.sin(np.arange(32000) / 3.0)).astype(np.float32), 16000)
    instructions = "You are a friendly voice assistant. Keep answers short. " * 4

    def run(ref: common_pb2.Pcm) -> list[thinker_pb2.ThinkerResponse]:
        opened = duplex_open(instructions=instructions, force_listen_units=1)
        opened.open.ref_audio.CopyFrom(ref)
        return asyncio.run(_session(backend, [opened, unit(0), unit(1), unit(2), END]))

    first, again, changed = run(voice), run(voice), run(other)

    def decisions(got: list[thinker_pb2.ThinkerResponse]) -> list[tuple[int, list[int]]]:
        return [(r.unit.decision, list(r.unit.token_ids)) for r in got if r.HasField("unit")]

    assert decisions(first) == decisions(again) and len(decisions(first)) == 3
    # Each unit says how much context the session already held when it was fed (realtime usage's cached
    # input): the prefix for the first unit, then the context after the unit before it.
    units = [r.unit for r in again if r.HasField("unit")]
    assert units[0].context_before > 100
    assert [u.context_before for u in units[1:]] == [u.context_tokens for u in units[:-1]]
    cached = [got[-1].done.usage.cached_tokens for got in (first, again, changed)]
    # The voice's 20 rows (2 s) sit after the instructions and reach into the last full block: another
    # voice shares only the blocks before them.
    assert cached[1] >= 112 and cached[1] % BS == 0 and cached[2] < cached[1]


@pytest.mark.parametrize("graphed", [False, True])
def test_shared_blocks_through_the_triton_kernels(
    llm: torch.nn.Module, graphed: bool, triton_interpreter_scalars: None
) -> None:
    """The fused Triton attention (interpreted on CPU) reads shared blocks and prefills from a cached
    position exactly as the torch path computes the whole prompt."""
    prompts = [SYSTEM[:40] + ids(700 + 30 * k, 4 + k) for k in range(3)]
    ref = make_engine(llm, cache=False)
    want = [solo(ref, p, max_tokens=3).tokens for p in prompts]
    eng = make_engine(llm, cache=True, graphed=graphed)
    eng.runner.set_kernels("triton")
    got = [solo(eng, p, max_tokens=3) for p in prompts]
    assert [r.tokens for r in got] == want
    assert [r.cached for r in got] == [0, 32, 32]
