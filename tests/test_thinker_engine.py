"""Thinker engine on the tiny checkpoint (CPU, fp32): equality with transformers, batch invariance,
hidden-row alignment, KV admission under a byte budget, freeing on close, context limit, sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from services.common.checkpoint import Checkpoint
from services.common.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, StageError
from services.thinker.engine import EngineConfig, EngineEvent, ThinkerEngine
from services.thinker.runner import build_qwen3_llm
from services.thinker.sampling import Sampler, SamplingConfig, sample_from_logits
from services.thinker.scheduler import WorkItem

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> torch.nn.Module:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    return build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")


class Collector:
    """Sink that records events per sequence."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []

    def __call__(self, ev: EngineEvent) -> None:
        self.events.append(ev)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def finish(self) -> str | None:
        done = [e.finish_reason for e in self.events if e.finish_reason]
        return done[-1] if done else None

    @property
    def errors(self) -> list[StageError]:
        return [e.error for e in self.events if e.error is not None]


def greedy(max_tokens: int = 10, **kw: object) -> Sampler:
    return Sampler(SamplingConfig(max_tokens=max_tokens, stop_token_ids=(), **kw))  # type: ignore[arg-type]


PROMPTS = [list(range(1000 + 37 * i, 1000 + 37 * i + n)) for i, n in enumerate((23, 41, 9, 30))]


def run_requests(engine: ThinkerEngine, prompts: list[list[int]], samplers: list[Sampler]) -> list[Collector]:
    sinks = []
    for prompt, sampler in zip(prompts, samplers, strict=True):
        sink = Collector()
        engine.submit(engine.open(sink), WorkItem(prompt, sampler=sampler, emit_hidden=True))
        sinks.append(sink)
    engine.run_until_idle()
    return sinks


def reference(
    llm: torch.nn.Module, prompt: list[int], generated: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers forward over prompt+generated: (logits that chose each generated token, last hidden)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        out = llm(ids, output_hidden_states=True)
    n = len(prompt)
    return out.logits[0, n - 1 : n - 1 + len(generated)], out.hidden_states[-1][0]


def test_matches_transformers_and_chunked_prefill(llm: torch.nn.Module) -> None:
    # A 6-token step budget forces several prefill chunks per prompt.
    engine = ThinkerEngine(llm, EngineConfig(max_step_tokens=6, kv_budget_bytes=8 << 20), "cpu")
    (sink,) = run_requests(engine, [PROMPTS[1]], [greedy(12)])
    with torch.no_grad():
        want = llm.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=12, do_sample=False)[
            0, len(PROMPTS[1]) :
        ]
    assert sink.tokens == want.tolist()
    assert sink.finish == "length"


def test_batch_invariance(llm: torch.nn.Module) -> None:
    """A prompt alone and inside a batch of 4 (different lengths, mixed prefill/decode steps)."""
    engine = ThinkerEngine(llm, EngineConfig(max_step_tokens=32, kv_budget_bytes=8 << 20), "cpu")
    (alone,) = run_requests(engine, [PROMPTS[0]], [greedy(16)])
    batch = run_requests(engine, PROMPTS, [greedy(16) for _ in PROMPTS])
    logits, _ = reference(llm, PROMPTS[0], alone.tokens)
    top2 = torch.topk(logits, 2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    # Compare tokens up to the first near-tie (random weights produce them); fp32 drift is ~1e-6.
    compared = 0
    for step, margin in enumerate(margins):
        assert batch[0].tokens[step] == alone.tokens[step], f"step {step} margin {margin}"
        compared += 1
        if margin < 1e-3:
            break
    assert compared >= 4
    rows_alone = [e.hidden for e in alone.events if e.hidden is not None]
    rows_batch = [e.hidden for e in batch[0].events if e.hidden is not None]
    n = compared - 1
    for a, b in zip(rows_alone[:n], rows_batch[:n], strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    # Every request of the batch equals its own transformers greedy continuation.
    for prompt, sink in zip(PROMPTS, batch, strict=True):
        ref_logits, _ = reference(llm, prompt, sink.tokens)
        assert torch.equal(ref_logits.argmax(-1), torch.tensor(sink.tokens)) or _near_tie(
            ref_logits, sink.tokens
        )


def _near_tie(logits: torch.Tensor, tokens: list[int]) -> bool:
    picked = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return bool(((logits.max(-1).values - picked) < 1e-3).all())


def test_hidden_rows_align_with_fed_tokens(llm: torch.nn.Module) -> None:
    """Each decode event carries the final-norm row produced when its ``fed_token`` was the input."""
    engine = ThinkerEngine(llm, EngineConfig(max_step_tokens=64, kv_budget_bytes=8 << 20), "cpu")
    sink = Collector()
    engine.submit(
        engine.open(sink), WorkItem(PROMPTS[2], sampler=greedy(6), emit_hidden=True, feed_last=True)
    )
    engine.run_until_idle()
    fed = [(e.fed_token, e.hidden) for e in sink.events if e.hidden is not None]
    # feed_last: every generated token, including the one that hit max_tokens, gets its row.
    assert [t for t, _ in fed] == sink.tokens
    _, hidden = reference(llm, PROMPTS[2], sink.tokens)
    n = len(PROMPTS[2])
    for k, (_, row) in enumerate(fed):
        assert torch.allclose(row, hidden[n + k], atol=1e-4, rtol=1e-4)


def kv_gauge() -> float:
    value = REGISTRY.get_sample_value("minicpmo_thinker_kv_used_bytes")
    assert value is not None
    return value


def test_kv_budget_admission_waits_and_never_exceeds(llm: torch.nn.Module) -> None:
    probe = ThinkerEngine(llm, EngineConfig(block_size=16, kv_budget_bytes=1 << 20), "cpu")
    block = probe.layout.bytes_per_block
    # 1 scratch block + 4 usable: one request (prompt 30 + 20 new = 4 blocks) fits, two do not.
    budget = 5 * block
    engine = ThinkerEngine(
        llm, EngineConfig(block_size=16, kv_budget_bytes=budget, max_step_tokens=64), "cpu"
    )
    a, b = Collector(), Collector()
    engine.submit(engine.open(a), WorkItem(PROMPTS[3], sampler=greedy(20)))
    engine.submit(engine.open(b), WorkItem(PROMPTS[3], sampler=greedy(20)))
    saw_waiting = False
    for _ in range(200):
        did = engine.step()
        assert engine.kv_used_bytes <= budget and kv_gauge() <= budget
        if engine.scheduler.queue_depth == 1 and engine.scheduler.running:
            saw_waiting = True
            assert not b.tokens  # the second request has not started while it waits
        if not did and engine.is_idle():
            break
    assert saw_waiting
    assert a.finish == "length" and b.finish == "length"
    assert a.tokens == b.tokens  # same prompt, greedy: waiting did not change the result
    assert 0 < engine.max_kv_used_bytes <= budget
    assert engine.kv_used_bytes == 0 and kv_gauge() == 0


def test_request_that_can_never_fit_is_rejected(llm: torch.nn.Module) -> None:
    probe = ThinkerEngine(llm, EngineConfig(block_size=16, kv_budget_bytes=1 << 20), "cpu")
    engine = ThinkerEngine(
        llm, EngineConfig(block_size=16, kv_budget_bytes=3 * probe.layout.bytes_per_block), "cpu"
    )
    sink = Collector()
    engine.submit(engine.open(sink), WorkItem(PROMPTS[1], sampler=greedy(100)))
    engine.run_until_idle()
    assert [e.code for e in sink.errors] == [RESOURCE_EXHAUSTED]
    assert engine.kv_used_bytes == 0


def test_close_frees_kv_immediately(llm: torch.nn.Module) -> None:
    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")
    sink = Collector()
    seq = engine.open(sink)
    engine.submit(seq, WorkItem(PROMPTS[1], sampler=greedy(500)))
    for _ in range(3):
        engine.step()
    assert engine.kv_used_bytes > 0 and kv_gauge() > 0
    engine.close(seq)
    engine.step()
    assert engine.kv_used_bytes == 0 and kv_gauge() == 0
    assert REGISTRY.get_sample_value("minicpmo_stage_in_flight", {"stage": "thinker"}) == 0
    assert engine.is_idle()


def test_context_length_exceeded_and_length_finish(llm: torch.nn.Module) -> None:
    engine = ThinkerEngine(llm, EngineConfig(max_context=48, kv_budget_bytes=8 << 20), "cpu")
    with pytest.raises(StageError) as exc:
        engine.check_prompt_length(49)
    assert exc.value.code == CONTEXT_LENGTH_EXCEEDED and exc.value.code_name == "context_length_exceeded"
    too_long = Collector()
    engine.submit(engine.open(too_long), WorkItem(list(range(500, 560)), sampler=greedy(4)))
    fits = Collector()
    engine.submit(engine.open(fits), WorkItem(PROMPTS[1], sampler=greedy(100)))
    engine.run_until_idle()
    assert [e.code for e in too_long.errors] == [CONTEXT_LENGTH_EXCEEDED]
    # 41-token prompt in a 48-token context: it stops with "length" when the cache is full.
    assert fits.finish == "length" and len(fits.tokens) == 48 - 41 + 1
    assert engine.kv_used_bytes == 0


def test_seeded_sampling_is_reproducible_inside_a_batch(llm: torch.nn.Module) -> None:
    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")

    def sampler(seed: int) -> Sampler:
        return Sampler(
            SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=8, stop_token_ids=())
        )

    (alone,) = run_requests(engine, [PROMPTS[0]], [sampler(7)])
    batch = run_requests(engine, PROMPTS, [sampler(7), sampler(8), greedy(8), sampler(9)])
    other = run_requests(engine, [PROMPTS[0]], [sampler(123)])
    assert batch[0].tokens == alone.tokens
    assert other[0].tokens != alone.tokens


def test_stop_ids_min_tokens_ignore_eos(llm: torch.nn.Module) -> None:
    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")
    (free,) = run_requests(engine, [PROMPTS[0]], [greedy(8)])
    first = free.tokens[0]
    (stopped,) = run_requests(
        engine, [PROMPTS[0]], [Sampler(SamplingConfig(max_tokens=8, stop_token_ids=(first,)))]
    )
    assert stopped.tokens == [first] and stopped.finish == "stop"
    (forced,) = run_requests(
        engine, [PROMPTS[0]], [Sampler(SamplingConfig(max_tokens=8, min_tokens=3, stop_token_ids=(first,)))]
    )
    assert first not in forced.tokens[:3] and len(forced.tokens) >= 3
    (ignored,) = run_requests(
        engine,
        [PROMPTS[0]],
        [Sampler(SamplingConfig(max_tokens=8, ignore_eos=True, stop_token_ids=(first,)))],
    )
    assert ignored.tokens == free.tokens and ignored.finish == "length"


def test_sampling_primitives() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert all(sample_from_logits(logits, 1.0, 1, 1.0, gen) == 1 for _ in range(20))  # top-k 1 = argmax
    assert all(sample_from_logits(logits, 1.0, 0, 0.01, gen) == 1 for _ in range(20))  # tiny top-p = argmax
    drawn = {sample_from_logits(logits, 1.0, 2, 1.0, gen) for _ in range(200)}
    assert drawn == {1, 2}  # top-k 2 keeps exactly the two best
    s = Sampler(SamplingConfig(repetition_penalty=2.0))
    assert s.choose(logits, [1], 0) == 2  # 3.0 / 2 < 2.9: the penalised best loses
    with pytest.raises(StageError) as exc:
        SamplingConfig(top_p=0.0).validate()
    assert exc.value.code == INVALID_ARGUMENT and exc.value.param == "sampling.top_p"


def test_graph_body_with_padded_rows_matches_eager(llm: torch.nn.Module) -> None:
    """The fixed-shape decode body that CUDA graphs record, run on CPU: padded rows change nothing."""
    from services.thinker.runner import DecodeRow, StepInput

    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20, use_cuda_graphs=True), "cpu")
    assert not engine.runner.use_cuda_graphs  # guarded by device type: CPU is always eager
    seqs = [engine.open(Collector()) for _ in range(2)]
    for seq, prompt in zip(seqs, PROMPTS[:2], strict=True):
        engine.submit(seq, WorkItem(prompt, sampler=greedy(50)))
    engine.step()  # both prompts prefilled in one step; each now holds a sampled token to feed
    rows = [DecodeRow(s.next_token, len(s.tokens), s.blocks) for s in seqs]  # type: ignore[arg-type]
    eager = engine.runner.step(StepInput(decode=rows))
    host = engine.runner._decode_host(rows, 4, 8)  # batch bucket 4, 8 blocks of context
    with torch.inference_mode():
        hidden, logits = engine.runner.decode_forward_static(*host)
    assert torch.allclose(hidden[:2], eager.decode_hidden, atol=1e-5, rtol=1e-5)
    assert torch.allclose(logits[:2].float(), eager.decode_logits, atol=1e-4, rtol=1e-4)
    again = engine.runner.step(StepInput(decode=rows))  # padded rows wrote to scratch only
    assert torch.equal(again.decode_hidden, eager.decode_hidden)


def test_runner_logits_and_hidden_equal_transformers(llm: torch.nn.Module) -> None:
    """Chunked prefill + decode over the paged cache vs one transformers forward (fp32, <= 1e-4)."""
    from services.thinker.kv_cache import KVLayout, PagedKVCache
    from services.thinker.runner import DecodeRow, ModelRunner, PrefillChunk, StepInput

    cfg = llm.config
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, 16)
    runner = ModelRunner(llm, PagedKVCache(layout, 16 * layout.bytes_per_block, "cpu"))
    blocks = runner.cache.pool.allocate(4)
    ids = list(range(2000, 2037))
    with torch.no_grad():
        ref = llm(torch.tensor([ids]), output_hidden_states=True)
    a = runner.step(StepInput(prefill=[PrefillChunk(ids[:20], 0, blocks, want_logits=True)]))
    b = runner.step(StepInput(prefill=[PrefillChunk(ids[20:36], 20, blocks, want_logits=True)]))
    c = runner.step(StepInput(decode=[DecodeRow(ids[36], 36, blocks)]))
    assert torch.allclose(a.prefill_logits[0], ref.logits[0, 19], atol=1e-4, rtol=0)
    assert torch.allclose(b.prefill_logits[0], ref.logits[0, 35], atol=1e-4, rtol=0)
    assert torch.allclose(c.decode_logits[0], ref.logits[0, 36], atol=1e-4, rtol=0)
    assert torch.allclose(c.decode_hidden[0], ref.hidden_states[-1][0, 36], atol=1e-4, rtol=0)


def test_packed_row_step_matches_the_eager_step(llm: torch.nn.Module) -> None:
    """A step of decode rows plus short prefill chunks (one with embedding rows) run as packed rows (what
    a row CUDA graph replays) gives the eager step's logits and hidden rows, and leaves the same KV."""
    from services.thinker.kv_cache import KVLayout, PagedKVCache
    from services.thinker.runner import DecodeRow, ModelRunner, PrefillChunk, StepInput

    cfg = llm.config
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, 16)
    runner = ModelRunner(llm, PagedKVCache(layout, 32 * layout.bytes_per_block, "cpu"))
    seqs = [runner.cache.pool.allocate(3) for _ in range(3)]
    prompts = [list(range(3000 + 50 * i, 3000 + 50 * i + 20)) for i in range(3)]
    runner.step(StepInput(prefill=[PrefillChunk(p, 0, b) for p, b in zip(prompts, seqs, strict=True)]))
    gen = torch.Generator().manual_seed(5)
    embeds = torch.randn(6, cfg.hidden_size, generator=gen) * 0.02
    step = StepInput(
        decode=[DecodeRow(4000, 20, seqs[0])],
        prefill=[
            PrefillChunk(list(range(4100, 4106)), 20, seqs[1], embeds=embeds, want_logits=True),
            PrefillChunk(list(range(4200, 4209)), 20, seqs[2], want_logits=True),
        ],
    )
    packed = runner.packed_step_eager(step)
    k_packed = [k.clone() for k in runner.cache.k]
    eager = runner._eager_step(step)  # rewrites the same slots
    assert torch.allclose(packed.decode_logits, eager.decode_logits, atol=1e-4, rtol=0)
    assert torch.allclose(packed.decode_hidden, eager.decode_hidden, atol=1e-5, rtol=0)
    for got, want in zip(packed.prefill_logits, eager.prefill_logits, strict=True):
        assert got is not None and want is not None
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
    # The pool is uninitialised storage: slots neither step writes hold the same bits in both, NaN included.
    same = (
        torch.allclose(a, b, atol=1e-5, rtol=0, equal_nan=True)
        for a, b in zip(k_packed, runner.cache.k, strict=True)
    )
    assert all(same)
    # The embedding rows were used: the same chunk without them gives other logits.
    plain = StepInput(prefill=[PrefillChunk(list(range(4100, 4106)), 20, seqs[1], want_logits=True)])
    assert not torch.allclose(
        runner.packed_step_eager(plain).prefill_logits[0], packed.prefill_logits[0], atol=1e-3
    )
    # Chunks pack up to PACKED_MAX_ROWS rows in all, whatever their length (16 sessions' decode rows
    # plus units arriving together, or a long unit that opens a turn).
    long_chunk = StepInput(prefill=[PrefillChunk(list(range(40)), 0, runner.cache.pool.allocate(3))])
    packed_long = runner.pack_rows(long_chunk)
    assert packed_long is not None and [r.position for r in packed_long[0]] == list(range(40))
    units = [PrefillChunk(list(range(13)), 0, runner.cache.pool.allocate(1)) for _ in range(8)]
    many = StepInput(decode=[DecodeRow(4000, 20, seqs[0])] * 16, prefill=units)
    packed_many = runner.pack_rows(many)
    assert packed_many is not None and len(packed_many[0]) == 16 + 8 * 13 <= ModelRunner.PACKED_MAX_ROWS
    too_many = StepInput(decode=many.decode, prefill=[*units, units[0]])
    assert runner.pack_rows(too_many) is None


def test_engine_metrics_exported(llm: torch.nn.Module) -> None:
    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")
    before = {
        name: REGISTRY.get_sample_value(name) or 0.0
        for name in ("minicpmo_thinker_prefill_tokens_total", "minicpmo_thinker_decode_tokens_total")
    }
    ttft_before = REGISTRY.get_sample_value("minicpmo_thinker_ttft_seconds_count") or 0.0
    run_requests(engine, [PROMPTS[2]], [greedy(5)])
    assert REGISTRY.get_sample_value("minicpmo_thinker_prefill_tokens_total") - before[
        "minicpmo_thinker_prefill_tokens_total"
    ] == len(PROMPTS[2])
    assert (
        REGISTRY.get_sample_value("minicpmo_thinker_decode_tokens_total")
        - before["minicpmo_thinker_decode_tokens_total"]
        == 4
    )  # 5 tokens: the first comes from the prefill step
    assert REGISTRY.get_sample_value("minicpmo_thinker_ttft_seconds_count") == ttft_before + 1
    assert REGISTRY.get_sample_value("minicpmo_thinker_decode_tokens_per_second") > 0
    assert REGISTRY.get_sample_value("minicpmo_thinker_kv_budget_bytes") == engine.cache.budget_bytes
    assert REGISTRY.get_sample_value("minicpmo_stage_queue_depth", {"stage": "thinker"}) == 0
    assert REGISTRY.get_sample_value("minicpmo_thinker_running") == 0


def test_engines_sharing_one_model_do_not_copy_weights(llm: torch.nn.Module) -> None:
    first = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=1 << 20), "cpu")
    second = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=1 << 20), "cpu")
    for a, b in zip(first.runner.layers, second.runner.layers, strict=True):
        assert a.qkv_weight.data_ptr() == b.qkv_weight.data_ptr()
        assert a.gate_up_weight.data_ptr() == b.gate_up_weight.data_ptr()
    attn = llm.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == first.runner.layers[0].qkv_weight.data_ptr()


def test_graph_warmup_enumerates_every_bucket_up_to_the_limits() -> None:
    """Startup capture covers batch buckets up to max_num_seqs and context buckets up to the limit, so no
    request in that range meets a lazy capture; CPU (no graphs) captures nothing."""
    from types import SimpleNamespace

    from services.thinker.runner import ModelRunner

    seen: list[tuple[int, int]] = []
    fake = SimpleNamespace(
        use_cuda_graphs=True,
        GRAPH_BATCH_BUCKETS=ModelRunner.GRAPH_BATCH_BUCKETS,
        GRAPH_MIN_CONTEXT=ModelRunner.GRAPH_MIN_CONTEXT,
        GRAPH_MAX_CONTEXT=ModelRunner.GRAPH_MAX_CONTEXT,
        PACKED_MAX_ROWS=ModelRunner.PACKED_MAX_ROWS,
        _graph_for=lambda b, c: seen.append((b, c)),
        kernel_backend="torch",
        burst_warmup_step=ModelRunner.burst_warmup_step,
    )
    eager: list = []
    fake._eager_step = eager.append
    # Row buckets go up to PACKED_MAX_ROWS (128) even for 8 sequences: packed prefill steps use them.
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    assert ModelRunner.warmup_graphs(fake, 8, 1024) == 24
    assert seen == [(b, c) for b in buckets for c in (256, 512, 1024)]
    seen.clear()
    assert ModelRunner.warmup_graphs(fake, 3, 300) == 16  # 300 -> bucket 512
    assert seen == [(b, c) for b in buckets for c in (256, 512)]
    assert ModelRunner.warmup_graphs(fake, 8, 0) == 0
    # The CLI default asks for the model's whole context: every bucket a graph serves (up to 16384).
    seen.clear()
    assert ModelRunner.warmup_graphs(fake, 24, 40960) == 56
    assert seen[-1] == (128, ModelRunner.GRAPH_MAX_CONTEXT) and fake.graphs_warmed
    # Every warm-up first runs one eager step into the scratch block, so the eager kernel variants
    # compile and the allocator grows at start-up rather than at the first prefill or burst: 16 tokens
    # by default, a full step of 16-token chunks (max_batch of them with logits) when given its size.
    eager.clear()
    fake.kernel_backend = "triton"
    assert ModelRunner.warmup_graphs(fake, 1, 256) == 8
    [step] = eager
    assert not step.decode and [(len(c.token_ids), c.start, c.blocks) for c in step.prefill] == [(16, 0, [0])]
    eager.clear()
    assert ModelRunner.warmup_graphs(fake, 8, 256, max_step_tokens=512) == 8
    [step] = eager
    assert step.num_tokens == 512 and {(c.start, tuple(c.blocks)) for c in step.prefill} == {(0, (0,))}
    assert sum(c.want_logits for c in step.prefill) == 8
    fake.use_cuda_graphs = False
    assert ModelRunner.warmup_graphs(fake, 8, 1024) == 0


def test_forward_failures_are_typed() -> None:
    """Device OOM maps to RESOURCE_EXHAUSTED (the gateway answers 429 / resource_exhausted), others INTERNAL."""
    from services.common.errors import INTERNAL, RESOURCE_EXHAUSTED
    from services.thinker.errors import failure

    oom = failure("thinker forward failed", torch.OutOfMemoryError("CUDA out of memory"))
    assert oom.code == RESOURCE_EXHAUSTED and "out of device memory" in str(oom)
    other = failure("thinker forward failed", RuntimeError("boom"))
    assert other.code == INTERNAL and "RuntimeError: boom" in str(other)


def test_a_failed_sampling_step_ends_its_streams_and_the_engine_goes_on(
    llm: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device memory running out after the forward (sampling, emitting) ends the step's sequences with
    RESOURCE_EXHAUSTED and frees their KV; it does not escape the step, where the same plan would be
    planned, and fail, again and again with its clients waiting. The next request is served."""
    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")
    real = engine._consume
    calls = {"n": 0}

    def fail_once(*args: object, **kw: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_consume", fail_once)
    first, second = run_requests(engine, PROMPTS[:1], [greedy(4)]), None
    assert [e.code for e in first[0].errors] == [RESOURCE_EXHAUSTED] and not first[0].tokens
    assert engine.kv_used_bytes == 0 and engine.is_idle()
    second = run_requests(engine, PROMPTS[1:2], [greedy(4)])
    assert not second[0].errors and len(second[0].tokens) == 4 and second[0].finish == "length"


def test_an_iteration_that_keeps_failing_ends_every_stream(
    llm: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure outside any one step's plan (here the planner itself) that repeats ends every running and
    waiting stream with a typed error after MAX_STEP_FAILURES iterations instead of leaving them hanging."""
    import time

    from services.common.errors import INTERNAL

    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")

    def broken_plan() -> None:
        raise RuntimeError("planner broke")

    monkeypatch.setattr(engine.scheduler, "plan", broken_plan)
    sinks = [Collector(), Collector()]
    for sink, prompt in zip(sinks, PROMPTS, strict=False):
        engine.submit(engine.open(sink), WorkItem(prompt, sampler=greedy(4)))
    engine.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(s.errors for s in sinks):
            time.sleep(0.02)
    finally:
        engine.shutdown()
    assert [[e.code for e in s.errors] for s in sinks] == [[INTERNAL], [INTERNAL]]
    assert "failed repeatedly" in str(sinks[0].errors[0]) and "planner broke" in str(sinks[0].errors[0])
    assert engine.kv_used_bytes == 0


def test_row_graph_path_matches_eager_engine_on_cpu(
    llm: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA-graph step path (packing, static buffers, embedding overrides, output split, no capture in a
    prefill step) with the graph emulated on the host: same tokens and hidden rows as the eager engine."""
    replays: list[int] = []

    def emulated(runner, body):  # noqa: ANN001, ANN202 (the Capture hook)
        out = body()

        def replay() -> None:
            hidden, logits = body()  # reads the static input buffers, like the recorded graph
            out[0].copy_(hidden)
            out[1].copy_(logits)
            replays.append(1)

        return replay, out

    gen = torch.Generator().manual_seed(11)
    # The last prompt lands in the same row bucket as the embedding prompt before it, so stale embedding
    # rows of that graph would show.
    prompts = [
        list(range(1000, 1012)),
        list(range(1100, 1120)),
        PROMPTS[1],
        list(range(1300, 1309)),
        list(range(1400, 1409)),
    ]
    embeds = torch.randn(len(prompts[3]), llm.config.hidden_size, generator=gen) * 0.02

    import services.thinker.engine as engine_module

    host_picks: list[int] = []  # steps whose tokens were chosen after the forward (not in the graph)
    real_choose = engine_module.choose_tokens

    def counting_choose(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        host_picks.append(1)
        return real_choose(*args, **kwargs)

    def run(graphed: bool) -> list[Collector]:
        host_picks.clear()
        engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")
        if graphed:
            engine.runner.use_cuda_graphs = True
            engine.runner.graph_capture = emulated
            # with the burst warm-up step (512 tokens into scratch) first: it must leave no trace
            assert engine.runner.warmup_graphs(4, 64, 512) == 8  # row buckets 1..128 x context 256
        sinks = []
        for i, prompt in enumerate(prompts):
            sink = Collector()
            item = WorkItem(prompt, embeds if i == 3 else None, sampler=greedy(12), emit_hidden=True)
            engine.submit(engine.open(sink), item)
            sinks.append(sink)
            engine.step()  # staggered: later prompts prefill while earlier ones decode
        engine.run_until_idle()
        if graphed:
            assert len(engine.runner._graphs) == 8  # everything fit the warmed buckets: no capture
            # Greedy rows of graph steps take the graph's own argmax; only eager steps pick on the host.
            assert len(host_picks) <= engine.runner.step_counts["eager"]
        return sinks

    monkeypatch.setattr(engine_module, "choose_tokens", counting_choose)
    eager, graphed = run(False), run(True)
    assert replays, "no step replayed a row graph"
    for e, g in zip(eager, graphed, strict=True):
        assert g.tokens == e.tokens and len(e.tokens) == 12
        he = torch.stack([ev.hidden for ev in e.events if ev.hidden is not None])
        hg = torch.stack([ev.hidden for ev in g.events if ev.hidden is not None])
        assert torch.allclose(hg, he, atol=1e-4, rtol=0)


def test_never_written_cache_memory_cannot_reach_the_logits(llm: torch.nn.Module) -> None:
    """The pool is uninitialised storage and may hold NaN where nothing was written yet (a sequence's
    last block past its end). Attention masks those positions, but a masked NaN still poisons the output
    (0 * NaN): the eager, packed and prefill paths must read the zeroed scratch slot there instead."""
    from services.thinker.kv_cache import KVLayout, PagedKVCache
    from services.thinker.runner import DecodeRow, ModelRunner, PrefillChunk, StepInput

    cfg = llm.config
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, 16)
    runner = ModelRunner(llm, PagedKVCache(layout, 32 * layout.bytes_per_block, "cpu"))
    for t in runner.cache.k + runner.cache.v:
        t[layout.block_size :].fill_(float("nan"))  # every block but scratch
    seqs = [runner.cache.pool.allocate(3) for _ in range(2)]
    first = runner.step(
        StepInput(prefill=[PrefillChunk(list(range(3000, 3020)), 0, seqs[0], want_logits=True)])
    )
    step = StepInput(
        decode=[DecodeRow(4000, 20, seqs[0])],
        prefill=[PrefillChunk(list(range(4200, 4209)), 0, seqs[1], want_logits=True)],
    )
    outputs = [first.prefill_logits[0], *runner.packed_step_eager(step).prefill_logits]
    eager = runner._eager_step(step)
    outputs += [eager.decode_logits, *eager.prefill_logits, runner.packed_step_eager(step).decode_logits]
    assert all(x is not None and bool(torch.isfinite(x).all()) for x in outputs)
