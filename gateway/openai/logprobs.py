"""OpenAI's ``logprobs`` object from the thinker's per-token log-probabilities."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.common.pb import thinker_pb2


def _entry(token: str, data: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": float(logprob), "bytes": list(data)}


def content_logprobs(items: Iterable[thinker_pb2.TokenLogprob]) -> list[dict[str, Any]]:
    """``choices[].logprobs.content``: one entry per generated token, with its ``top_logprobs``."""
    return [
        {
            **_entry(lp.token, lp.token_bytes, lp.logprob),
            "top_logprobs": [_entry(t.token, t.token_bytes, t.logprob) for t in lp.top_logprobs],
        }
        for lp in items
    ]


def logprobs_object(items: Iterable[thinker_pb2.TokenLogprob]) -> dict[str, Any]:
    return {"content": content_logprobs(items), "refusal": None}
