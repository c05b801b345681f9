"""Talker model on the tiny checkpoint: loading contract, conditions, and the runner vs plain transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from services.common.checkpoint import Checkpoint, CheckpointError
from services.common.errors import INVALID_ARGUMENT, StageError
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import TalkerRunner


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> MiniCPMTTS:
    torch.manual_seed(0)
    return MiniCPMTTS.from_checkpoint(Checkpoint(tiny_ckpt))


def _condition(model: MiniCPMTTS, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151000, (n,), generator=gen)
    hidden = torch.randn(n, model.cfg.llm_dim, generator=gen)
    return ids, hidden


def test_sizes_come_from_tts_config(model: MiniCPMTTS, tiny_ckpt: Path) -> None:
    tts = json.loads((tiny_ckpt / "config.json").read_text())["tts_config"]
    assert model.cfg.hidden_size == tts["hidden_size"] and model.cfg.llm_dim == tts["llm_dim"]
    assert len(model.model.layers) == tts["num_hidden_layers"]
    assert model.emb_text.weight.shape == (tts["num_text_tokens"], tts["hidden_size"])
    assert model.head_weight.shape == (tts["num_audio_tokens"], tts["hidden_size"])
    assert model.cfg.eos_id == 6561


def test_head_is_the_materialised_weight_norm(model: MiniCPMTTS, tiny_ckpt: Path) -> None:
    t = Checkpoint(tiny_ckpt).load_tensors(("tts.head_code.",), dtype=torch.float32)
    lin = torch.nn.utils.parametrizations.weight_norm(
        torch.nn.Linear(model.cfg.hidden_size, 6562, bias=False)
    )
    with torch.no_grad():
        lin.parametrizations.weight.original0.copy_(t["tts.head_code.0.parametrizations.weight.original0"])
        lin.parametrizations.weight.original1.copy_(t["tts.head_code.0.parametrizations.weight.original1"])
    torch.testing.assert_close(model.head_weight.data, lin.weight.detach(), rtol=1e-5, atol=1e-6)


def test_conditions_per_mode(model: MiniCPMTTS) -> None:
    ids, hidden = _condition(model, 7, 1)
    proj = F.normalize(model.projector_semantic(hidden), p=2, dim=-1)
    rows = model.emb_text(ids) + proj
    eos, bos = (
        model.emb_text.weight[model.cfg.text_eos_token_id],
        model.emb_text.weight[model.cfg.audio_bos_token_id],
    )
    whole = model.whole_utterance_condition(ids, hidden)
    torch.testing.assert_close(whole, torch.cat([rows, eos[None], bos[None]]))
    assert torch.equal(model.streaming_chunk_condition(ids, hidden, text_finished=True), whole)
    torch.testing.assert_close(
        model.streaming_chunk_condition(ids, hidden, False), torch.cat([rows, bos[None]])
    )
    torch.testing.assert_close(model.duplex_unit_condition(ids, hidden), torch.cat([rows, bos[None]]))


def test_bad_condition_inputs_are_typed_errors(model: MiniCPMTTS) -> None:
    ids, hidden = _condition(model, 4, 2)
    cases = [
        (ids, hidden[:, :-1], "hidden"),  # width mismatch
        (ids, hidden[:3], "hidden"),  # rows mismatch
        (torch.tensor([1, 2, 3, 152064]), hidden, "token_ids"),  # beyond emb_text
        (torch.tensor([1, -2, 3, 4]), hidden, "token_ids"),
    ]
    for bad_ids, bad_hidden, param in cases:
        with pytest.raises(StageError) as exc:
            model.condition_rows(bad_ids, bad_hidden)
        assert exc.value.code == INVALID_ARGUMENT and exc.value.param == param


def test_missing_tts_config_key_is_a_contract_error(tiny_ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    broken.mkdir()
    for p in tiny_ckpt.iterdir():
        if p.name != "config.json":
            (broken / p.name).symlink_to(p)
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    del cfg["tts_config"]["top_k"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="top_k"):
        MiniCPMTTS.from_checkpoint(Checkpoint(broken))
    shutil.rmtree(broken)


def _reference_logits(model: MiniCPMTTS, cond: torch.Tensor, codes: list[int]) -> list[torch.Tensor]:
    """Plain transformers LlamaModel with a DynamicCache, one sequence, teacher-forced on ``codes``."""
    out = []
    with torch.inference_mode():
        cache = DynamicCache()
        pos = torch.arange(cond.shape[0])[None]
        res = model.model(inputs_embeds=cond[None], position_ids=pos, past_key_values=cache, use_cache=True)
        out.append(model.head_logits(res.last_hidden_state[0, -1]))
        p = cond.shape[0]
        for c in codes:
            x = model.emb_code[0](torch.tensor([[c]]))
            res = model.model(
                inputs_embeds=x, position_ids=torch.tensor([[p]]), past_key_values=cache, use_cache=True
            )
            out.append(model.head_logits(res.last_hidden_state[0, -1]))
            p += 1
    return out


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_runner_batched_decode_matches_transformers(
    model: MiniCPMTTS, kernels: str, request: pytest.FixtureRequest
) -> None:
    """Three streams at different positions in one batched step give the single-stream logits, on the
    torch decode path and on the fused Triton kernels (through Triton's interpreter on CPU)."""
    if kernels == "triton":
        request.getfixturevalue("triton_interpreter_scalars")
    runner = TalkerRunner(model, num_slots=4, kernels=kernels)
    assert runner.kernels == kernels and (runner._fused is not None) == (kernels == "triton")
    conds = [model.whole_utterance_condition(*_condition(model, n, 10 + n)) for n in (3, 11, 6)]
    slots = [runner.cache.allocate() for _ in conds]
    codes = [[(97 * i + 13 * k) % 6561 for k in range(12)] for i in range(3)]
    got: list[list[torch.Tensor]] = [[runner.prefill(s, c)] for s, c in zip(slots, conds, strict=True)]
    # stream 2 joins the batch late: it is prefilled but sits out the first 4 steps
    for step in range(12):
        active = [i for i in range(3) if not (i == 2 and step < 4)]
        logits = runner.decode(
            [slots[i] for i in active], [codes[i][step - (4 if i == 2 else 0)] for i in active]
        )
        for row, i in enumerate(active):
            got[i].append(logits[row])
    for i in range(3):
        used = codes[i][: len(got[i]) - 1]
        ref = _reference_logits(model, conds[i], used)
        for a, b in zip(got[i], ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_batched_prefill_equals_one_prefill_per_slot(model: MiniCPMTTS) -> None:
    """Conditions of different lengths, one slot already holding context, prefilled in one forward: the
    same last-row logits, KV and lengths as one prefill per slot, and later decodes agree too."""
    batched, single = TalkerRunner(model, num_slots=4), TalkerRunner(model, num_slots=4)
    first = model.whole_utterance_condition(*_condition(model, 5, 40))
    conds = [model.whole_utterance_condition(*_condition(model, n, 41 + n)) for n in (3, 12, 7)]
    slots = [0, 2, 3]
    for runner in (batched, single):
        runner.prefill(0, first)  # slot 0 continues after 5 + its condition rows
        for s in slots[1:]:
            runner.cache.lengths[s] = 0
    got = batched.prefill_batch(list(zip(slots, conds, strict=True)))
    want = torch.stack([single.prefill(s, c) for s, c in zip(slots, conds, strict=True)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert batched.cache.lengths == single.cache.lengths
    for s in slots:
        n = batched.cache.lengths[s]
        torch.testing.assert_close(batched.cache.k[:, s, :n], single.cache.k[:, s, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        batched.decode(slots, [5, 6, 7]), single.decode(slots, [5, 6, 7]), rtol=1e-4, atol=1e-4
    )


def test_runner_decode_with_in_step_sampling_equals_decode_then_sample(model: MiniCPMTTS) -> None:
    """The graphed step function (forward + sampler) draws what the separate list-based sampler draws."""
    from services.talker import sampling as smp

    fused, split = TalkerRunner(model, num_slots=4), TalkerRunner(model, num_slots=4)
    conds = [model.whole_utterance_condition(*_condition(model, n, 30 + n)) for n in (4, 9)]
    params = [smp.SamplingParams(0.8, 0.85, 25, 1.05, seed) for seed in (7, 8)]
    rows_a = [smp.RowState(p) for p in params]
    rows_b = [smp.RowState(p) for p in params]
    slots = [1, 2]  # a gap at slot 0: idle rows inside the batch bucket
    for runner in (fused, split):
        for s, c in zip(slots, conds, strict=True):
            runner.cache.lengths[s] = 0
            runner.prefill(s, c)
    codes = [11, 12]
    vocab = model.cfg.num_audio_tokens
    for t in range(8):
        rules = [smp.whole_utterance_rules(t + 1, 50)] * 2
        packed = [smp.pack_row(r, rule, vocab) for r, rule in zip(rows_a, rules, strict=True)]
        ids, logits = fused.decode_sample(slots, codes, packed, want_logits=True)
        ref_logits = split.decode(slots, codes)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
        assert ids == smp.sample(ref_logits, rows_b, rules, model.cfg.eos_id)
        for ra, rb, code in zip(rows_a, rows_b, ids, strict=True):
            ra.remember(code)
            rb.remember(code)
        codes = ids
    assert fused.cache.lengths == split.cache.lengths
