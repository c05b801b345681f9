"""bench.thinker.constrained on the tiny checkpoint (CPU, eager): every arm runs and keeps its whole batch
(the bench's grammar never completes, whatever the random weights write), and a grammar row's tokens
follow the bench's grammar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.thinker import constrained as bc
from services.common.checkpoint import Checkpoint
from services.thinker.constrained import IM_END_ID, GrammarCompiler, fill_masks

pytest.importorskip("llguidance")


def test_every_arm_reports_its_whole_batch(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--checkpoint", str(tiny_ckpt), "--device", "cpu", "--batch", "2", "--steps", "3"]
    assert bc.main([*argv, "--warmup", "1", "--context-len", "16"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[: out.index("\n|")])
    assert [r["arm"] for r in report["results"]] == list(bc.ARMS)
    for r in report["results"]:
        assert r["rows_running_at_end"] == 2 and r["ms_per_step"] > 0 and 0.0 <= r["chained"] <= 1.0
        assert (r["mask_fill_ms"] is None) == (r["arm"] in ("greedy", "sampled"))
    with pytest.raises(SystemExit):
        bc.main([*argv, "--arms", "greedy,nope"])


def test_the_endless_grammar_never_allows_the_end(tiny_ckpt: Path) -> None:
    """After a complete object the grammar allows the next object only: never <|im_end|>."""
    tokenizer = Checkpoint(tiny_ckpt).tokenizer()
    matcher = GrammarCompiler(tokenizer, len(tokenizer)).from_grammar(bc.endless_json_grammar())
    doc = '{"name":"a","age":3,"tags":["x"],"address":{"city":"b","zip":"c"}}\n'
    for _ in range(2):
        for token in tokenizer.encode(doc, add_special_tokens=False):
            mask = fill_masks([matcher])
            assert int(mask[0, token // 32]) >> (token % 32) & 1, token
            matcher.accept(token)
        mask = fill_masks([matcher])
        allowed = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero()
        assert IM_END_ID not in allowed.flatten().tolist() and len(allowed) > 0
        assert not matcher.finished and not matcher.failed
