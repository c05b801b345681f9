"""Thinker model on the tiny checkpoint: LLM consistency, encoder contracts, streaming audio, batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.thinker.model import ThinkerModel
from services.thinker.model.audio import chunked_attention_allowed
from services.thinker.model.vision import bucketed_position_ids, sincos_2d
from services.thinker.processor import AudioInput, ImageInput, ThinkerProcessor

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_ckpt) -> ThinkerModel:
    return ThinkerModel.from_checkpoint(tiny_ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def processor(tiny_ckpt) -> ThinkerProcessor:
    return ThinkerProcessor.from_checkpoint(tiny_ckpt)


def _image(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _audio(seconds: float, seed: int = 0) -> np.ndarray:
    n = int(16_000 * seconds)
    t = np.arange(n) / 16_000
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * 330 * t * (1 + t)) + 0.02 * rng.standard_normal(n)).astype(np.float32)


def test_llm_is_transformers_qwen3_and_weights_match_checkpoint(model, tiny_ckpt):
    from transformers import Qwen3ForCausalLM

    from services.common.checkpoint import Checkpoint

    assert isinstance(model.llm, Qwen3ForCausalLM)
    assert model.embed_tokens is model.llm.model.embed_tokens
    stored = Checkpoint(tiny_ckpt).load_tensors(["llm.model.norm.weight", "vpm.post_layernorm.weight"])
    torch.testing.assert_close(
        model.llm.model.norm.weight, stored["llm.model.norm.weight"].float(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        model.vpm.post_layernorm.weight, stored["vpm.post_layernorm.weight"].float(), rtol=0, atol=0
    )


def test_text_prompt_forward_equals_plain_llm_call(model, processor):
    p = processor([{"role": "user", "content": "Tell me something about rivers."}])
    embeds = model.embed_prompt(p)
    hidden, logits = model.forward_hidden(embeds)
    with torch.inference_mode():
        ref = model.llm(input_ids=p.input_ids[None], output_hidden_states=True, use_cache=False)
    assert hidden.shape == (p.num_tokens, model.dims.hidden_size)
    torch.testing.assert_close(hidden, ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref.logits[0, -1], rtol=1e-5, atol=1e-5)


def test_image_prompt_contract_896x448_gives_three_slices_of_64(model, processor):
    p = processor([{"role": "user", "content": [ImageInput(_image(896, 448)), "What is this?"]}])
    vision = model.get_vision_embeds(p.pixel_values, p.tgt_sizes)
    assert vision.shape == (3, 64, model.dims.hidden_size)
    embeds = model.embed_prompt(p)
    assert embeds.shape == (p.num_tokens, model.dims.hidden_size)
    # every placeholder row carries the vision row of its slice, every other row the token embedding
    for k, (s, e) in enumerate(p.image_bounds.tolist()):
        torch.testing.assert_close(embeds[s:e], vision[k], rtol=0, atol=0)
    text_rows = torch.ones(p.num_tokens, dtype=torch.bool)
    for s, e in p.image_bounds.tolist():
        text_rows[s:e] = False
    torch.testing.assert_close(embeds[text_rows], model.embed_tokens(p.input_ids[text_rows]), rtol=0, atol=0)


def test_vision_slice_does_not_depend_on_its_batch_neighbours(model, processor):
    small = processor.process_frames([_image(300, 200, 1)], 1)
    big = processor.process_frames([_image(896, 448, 2)], 9)
    alone = model.get_vision_embeds(small[0], small[1])
    mixed = model.get_vision_embeds(big[0] + small[0], torch.cat([big[1], small[1]]))
    torch.testing.assert_close(mixed[-1:], alone, rtol=1e-5, atol=1e-5)


def test_audio_contract_3_2_s_gives_32_embeddings(model, processor):
    p = processor([{"role": "user", "content": [AudioInput(_audio(3.2)), "Answer."]}])
    rows = model.get_audio_embeds(p.audio_features, p.audio_feature_lens)
    assert [r.shape for r in rows] == [(32, model.dims.hidden_size)]
    embeds = model.embed_prompt(p)
    ((s, e),) = p.audio_bounds.tolist()
    torch.testing.assert_close(embeds[s:e], rows[0], rtol=0, atol=0)


def test_chunked_audio_attention_is_causal_per_second(model, processor):
    allowed = chunked_attention_allowed(120, 50)
    assert (
        allowed[0, 49]
        and not allowed[0, 50]
        and allowed[99, 0]
        and not allowed[99, 100]
        and allowed[119, 119]
    )
    feats, lens, count = processor.process_audio(_audio(3.0, 3))
    full = model.get_audio_embeds(feats, lens, 1.0)[0]
    # later seconds never leak into earlier chunks: cutting the mel after 2 s leaves the first second
    # unchanged (the second one changes: its last encoder frame's convolution looks one mel frame ahead,
    # and attention inside a chunk is bidirectional)
    head = model.get_audio_embeds(feats[:, :, :200], torch.tensor([200]), 1.0)[0]
    assert head.shape[0] == 20
    torch.testing.assert_close(head[:10], full[:10], rtol=1e-5, atol=1e-5)
    assert count == full.shape[0] == 30


def test_streaming_audio_units_match_offline_chunked_encoding(model, processor):
    feats, lens, _ = processor.process_audio(_audio(4.0, 4))
    mel = feats[0, :, : int(lens[0])]
    offline = model.get_audio_embeds(feats, lens, 1.0)[0]
    state = model.new_audio_stream()
    units = []
    for k in range(4):
        piece = mel[:, 100 * k : 100 * (k + 1)]
        nxt = mel[:, 100 * (k + 1) : 100 * (k + 1) + 2] if k < 3 else None
        units.append(model.get_audio_embeds_streaming(piece, state, nxt))
    assert all(u.shape == (10, model.dims.hidden_size) for u in units)
    torch.testing.assert_close(torch.cat(units), offline, rtol=1e-4, atol=1e-4)
    assert state.frames == 200


def test_audio_stream_cache_is_one_pool_slot_of_audio_stream_bytes(model, processor):
    """The KV budget reserves ``audio_stream_bytes`` per duplex session: the stream's first piece takes one
    slot of exactly that size in the pooled cache, which it keeps (same slot, same memory) up to the
    encoder's position limit and across a reset; ``release`` gives it back, a pass already queued for a
    closed session keeps none, and the next stream reuses the slot instead of growing the pool."""
    feats, lens, _ = processor.process_audio(_audio(1.0, 1))
    piece = feats[0, :, :100]
    pool = model.apm.stream_pool
    state = model.new_audio_stream()
    assert state.cache is None and state.kv == []
    model.get_audio_embeds_streaming(piece, state, piece[:, :2])
    slot, buffer = state.slot, state.cache
    assert buffer is not None and buffer.numel() * buffer.element_size() == model.audio_stream_bytes()
    slots = pool.tensor.shape[0]
    per_unit = 50  # encoder frames per 1 s unit
    for _ in range(model.dims.audio.max_source_positions // per_unit - 1):
        model.get_audio_embeds_streaming(piece, state, piece[:, :2])
    assert state.frames == model.dims.audio.max_source_positions and state.slot == slot
    assert state.cache.data_ptr() == buffer.data_ptr()
    assert [k.shape[2] for k, _ in state.kv] == [state.frames] * model.dims.audio.num_layers
    state.reset()
    assert state.frames == 0 and state.slot == slot
    held = pool.in_use
    state.release()
    assert state.cache is None and state.kv == []
    model.get_audio_embeds_streaming(piece, state, piece[:, :2])  # a pass that was already queued
    assert state.cache is None and state.slot is None  # a closed session keeps no slot
    fresh = model.new_audio_stream()
    model.get_audio_embeds_streaming(piece, fresh, piece[:, :2])
    assert pool.in_use == held and pool.tensor.shape[0] == slots
    fresh.release()


def test_audio_cache_pool_reuses_a_released_slot_only_from_the_next_pass_and_grows_keeping_contents():
    """A slot released while a pass runs is not handed out again in that pass (the pass may still write
    it); more sessions than the capacity double the pool and keep what the held slots hold."""
    from services.thinker.model.audio import AudioCachePool

    pool = AudioCachePool((2, 3), capacity=2)
    like = torch.zeros(1)
    with pool.pass_lock:
        pool.begin_pass()
        a, b = pool.acquire(like), pool.acquire(like)
        assert pool.tensor is not None and pool.tensor.shape == (2, 2, 3) and {a, b} == {0, 1}
        pool.tensor[a].fill_(7.0)
        pool.release(b)  # the session closes during the pass
        c = pool.acquire(like)  # not b: the pool grows instead
        assert c not in (a, b) and pool.tensor.shape[0] == 4
        assert torch.equal(pool.tensor[a], torch.full((2, 3), 7.0))
    with pool.pass_lock:
        pool.begin_pass()
        assert pool.in_use == 2  # a and c
        assert pool.acquire(like) in (b, 3)


def test_merge_rejects_row_count_mismatch(model, processor):
    p = processor([{"role": "user", "content": [AudioInput(_audio(1.0)), "x"]}])
    wrong = [torch.zeros(3, model.dims.hidden_size)]
    with pytest.raises(ValueError, match="audio rows"):
        model.merge_embeddings(p.input_ids, audio_embeds=wrong, audio_bounds=p.audio_bounds)


def test_position_buckets_and_sincos_table():
    assert torch.equal(bucketed_position_ids(70, 70, 70), torch.arange(4900))
    ids = bucketed_position_ids(23, 45, 70)
    assert ids.shape == (23 * 45,) and len(set(ids.tolist())) == 23 * 45 and int(ids.max()) < 4900
    table = sincos_2d(128, 3, 4)
    assert table.shape == (3, 4, 128) and table.dtype == np.float32
    np.testing.assert_allclose(table[0, 0], np.r_[np.zeros(32), np.ones(32), np.zeros(32), np.ones(32)])
    np.testing.assert_allclose(table[2, 1, :32], np.sin(1.0 / 10000 ** (np.arange(32) / 32)), rtol=1e-6)


def test_from_checkpoint_rejects_a_shape_mismatch(tiny_ckpt, tmp_path):
    import json
    import shutil

    from services.common.checkpoint import CheckpointError

    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, copy, ignore=shutil.ignore_patterns("assets"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["vision_config"]["intermediate_size"] += 2
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="vpm"):
        ThinkerModel.from_checkpoint(copy, dtype=torch.float32)


def test_bfloat16_load_runs(tiny_ckpt, processor):
    m = ThinkerModel.from_checkpoint(tiny_ckpt, dtype=torch.bfloat16)
    p = processor([{"role": "user", "content": "hi"}])
    hidden, logits = m.forward_hidden(m.embed_prompt(p))
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert m.llm.model.rotary_emb.inv_freq.dtype == torch.float32
