"""The soft-interrupt driver's checks over recorded artifacts (pure logic; the demo it runs is covered e2e)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "soft_driver", REPO / "examples" / "realtime_duplex_soft_interrupt.py"
)
assert _spec and _spec.loader
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)


def _args(**kw: Any) -> argparse.Namespace:
    base = {
        "validation_mode": "model-policy",
        "min_audio_deltas_per_response": 2,
        "min_responses": 2,
        "input_sha256": None,
        "input_wav": None,
        "expect_second_response_substring": None,
    }
    return argparse.Namespace(**{**base, **kw})


def _response(rid: str, deltas: int, status: str = "completed") -> list[dict[str, Any]]:
    evs = [{"type": "response.created", "response_id": rid}]
    evs += [{"type": "response.output_audio.delta", "response_id": rid}] * deltas
    evs.append({"type": "response.done", "response_id": rid, "response": {"status": status}})
    return evs


def test_model_policy_pass_and_failures() -> None:
    listen = {"type": "response.listen"}
    commit = {"type": "input_audio_buffer.committed"}
    events = [listen, *_response("r1", 2), listen, commit, listen]
    ok = driver.summarize(events, {"ok": True}, _args())
    assert ok["ok"], ok
    late = driver.summarize(
        [listen, *_response("r1", 2), {"type": "response.output_audio.delta", "response_id": "r1"}, commit],
        {"ok": True},
        _args(),
    )
    assert not late["checks"]["no_stale_audio"]
    cancelled = driver.summarize([*_response("r1", 2, "cancelled"), commit], {"ok": True}, _args())
    assert not cancelled["checks"]["no_cancelled_response_done"]
    after_commit = driver.summarize([commit, *_response("r1", 3)], {"ok": True}, _args())
    assert not after_commit["checks"]["first_response_before_final_commit"]
    few = driver.summarize([*_response("r1", 1), commit], {"ok": True}, _args())
    assert not few["checks"]["min_audio_deltas_per_response"]


def test_response_required(tmp_path: Path) -> None:
    import hashlib

    wav = tmp_path / "in.wav"
    wav.write_bytes(b"RIFF....")
    digest = hashlib.sha256(wav.read_bytes()).hexdigest()
    listen = {"type": "response.listen"}
    commit = {"type": "input_audio_buffer.committed"}
    events = [listen, *_response("r1", 2), listen, *_response("r2", 2), listen, commit, listen]
    result = {"ok": True, "responses": [{"transcript": "hi"}, {"transcript": "好的 谢谢"}]}
    args = _args(
        validation_mode="response-required",
        input_sha256=digest,
        input_wav=str(wav),
        expect_second_response_substring="好的谢谢",
    )
    summary = driver.summarize(events, result, args)
    assert summary["ok"], summary
    assert summary["followup_response_transcript_expectation_ok"] is True
    wrong = driver.summarize(
        events, result, _args(validation_mode="response-required", input_sha256="0" * 64, input_wav=str(wav))
    )
    assert not wrong["ok"] and not wrong["checks"]["input_sha256"]
