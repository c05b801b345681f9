"""The pinned chat workload of the chat-route benchmarks (BENCHMARKS.md, Setup).

Every request is a distinct user text of exactly ``prompt_tokens`` tokens by the checkpoint's tokenizer,
with speech output: the thinker speaks exactly ``spoken_tokens`` tokens (``min_tokens = max_tokens``,
``ignore_eos``) and the talker produces exactly ``audio_frames`` codec frames (``fixed_frames``).
:mod:`bench.e2e`, :mod:`bench.cancel` and :mod:`bench.inprocess` all send these bodies.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

CODEC_FRAME_RATE_HZ = 25
FILLER_TEXT = (
    "The harbour town woke slowly under a grey sky while fishing boats returned with their nets and the "
    "market stalls opened one by one. Children ran along the sea wall, a baker carried trays of warm bread "
    "across the square, and an old clockmaker adjusted the tower clock that had been running late for "
    "three weeks. Travellers from the inland valleys arrived by the morning train, asking for directions "
    "to the lighthouse, the museum of maritime history and the small library that kept letters written "
    "by sailors over two centuries. In the afternoon the wind turned, the clouds opened, and the whole "
    "bay shone with a pale golden light that painters had tried to capture for generations. "
)


@dataclass
class Workload:
    prompt_tokens: int = 64
    spoken_tokens: int = 10
    first_chunk_tokens: int = 10
    audio_frames: int = 200
    seed: int = 42

    @property
    def audio_seconds(self) -> float:
        return self.audio_frames / CODEC_FRAME_RATE_HZ


def make_prompts(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """``count`` distinct texts that each encode to exactly ``tokens`` tokens (no prefix sharing)."""
    words = FILLER_TEXT.split()
    prompts: list[str] = []
    offset = 0
    attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > 50 * count + 100:
            raise RuntimeError(f"could not build {count} prompts of exactly {tokens} tokens")
        rotated = words[offset % len(words) :] + words[: offset % len(words)]
        text = f"Request {len(prompts)}: " + " ".join(rotated * 4)
        offset += 7
        ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
        candidate = tokenizer.decode(ids)
        if len(tokenizer.encode(candidate, add_special_tokens=False)) == tokens and candidate not in prompts:
            prompts.append(candidate)
    return prompts


def request_body(prompt: str, w: Workload, model: str, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "stream": stream,
        "sampling_params_list": [
            {
                "temperature": 0.0,
                "max_tokens": w.spoken_tokens,
                "min_tokens": w.spoken_tokens,
                "ignore_eos": True,
            },
            {"fixed_frames": w.audio_frames, "seed": w.seed},
        ],
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    else:
        body["return_stage_metrics"] = True
    return body


def add_workload_flags(p: argparse.ArgumentParser, audio_frames: int, audio_help: str) -> None:
    """The workload's flags, with the benchmark's own default length of speech."""
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--spoken-tokens", type=int, default=10, help="thinker tokens (min = max, EOS ignored)")
    p.add_argument("--first-chunk-tokens", type=int, default=10)
    p.add_argument("--audio-frames", type=int, default=audio_frames, help=audio_help)


def workload_from_args(args: argparse.Namespace) -> Workload:
    return Workload(args.prompt_tokens, args.spoken_tokens, args.first_chunk_tokens, args.audio_frames)
