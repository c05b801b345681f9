"""bench.thinker.grammar_engines on the tiny checkpoint's (real) vocabulary: both engines walk the same
schema-valid token stream, and every step's mask allows the token that comes next."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.thinker import grammar_engines as ge

pytest.importorskip("llguidance")
pytest.importorskip("xgrammar")


@pytest.mark.parametrize("engine_cls", [ge._Llguidance, ge._Xgrammar])
def test_masks_allow_the_document_and_nothing_else_at_the_start(tiny_ckpt: Path, engine_cls: type) -> None:
    tokenizer = ge.load_tokenizer(tiny_ckpt)
    vocab = max(len(tokenizer), ge.IM_END_ID + 1)
    tokens = list(tokenizer.encode(ge._document(1), add_special_tokens=False))
    engine = engine_cls(tokenizer, vocab)
    engine.compile()
    engine.start(2)
    for step, token in enumerate(tokens):
        engine.fill()
        words = engine.mask[:, token // 32].to(torch.int64) & (1 << (token % 32))
        assert bool(words.all()), f"{engine.name}: step {step} masks out the document's token {token}"
        if step == 0:  # a JSON object must open with '{': most of the vocabulary is masked out
            allowed = sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in engine.mask[0].tolist())
            assert 0 < allowed < vocab // 10
        engine.advance(token)


def test_report_has_both_engines_and_batches(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "ge.json"
    assert (
        ge.main(["--checkpoint", str(tiny_ckpt), "--batches", "1,3", "--stops", "1", "--json-out", str(out)])
        == 0
    )
    import json

    data = json.loads(out.read_text())
    assert [r["engine"] for r in data["results"]] == ["llguidance", "xgrammar"]
    for r in data["results"]:
        assert set(r["batches"]) == {"1", "3"}
        assert all(b["steps"] == data["tokens"] and b["fill_us_p50"] > 0 for b in r["batches"].values())
