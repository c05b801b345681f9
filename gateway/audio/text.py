"""Splitting a long ``/v1/audio/speech`` input into segments at sentence boundaries.

Each segment is one thinker -> talker -> code2wav run; the talker speaks at most a couple of thousand
codec frames (~80 s) per run, so an input of up to 4096 characters is read as consecutive segments of at
most :data:`MAX_SEGMENT_CHARS` characters. Sentences (ending in ``.``, ``!``, ``?``, ``;``, their CJK
forms, or a line break) are packed greedily into segments; a sentence longer than a segment is cut at
its last comma or space that fits, and only a text without either is cut mid-word.
"""

from __future__ import annotations

import re

MAX_SEGMENT_CHARS = 400
_SENTENCE_END = re.compile(r"(?<=[.!?;。！？；…])\s+|(?<=[。！？；])|\n+")


def split_sentences(text: str) -> list[str]:
    """The non-empty sentences of ``text``, each keeping its punctuation."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def _cut_long(sentence: str, limit: int) -> list[str]:
    out: list[str] = []
    rest = sentence
    while len(rest) > limit:
        window = rest[:limit]
        cut = max(window.rfind(", "), window.rfind("，"), window.rfind("、"))
        cut = cut + 1 if cut > 0 else window.rfind(" ")
        if cut <= 0:
            cut = limit
        out.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    if rest:
        out.append(rest)
    return out


def split_segments(text: str, limit: int = MAX_SEGMENT_CHARS) -> list[str]:
    """``text`` as segments of at most ``limit`` characters, cut at sentence boundaries where possible."""
    segments: list[str] = []
    current = ""
    for sentence in split_sentences(text):
        for piece in _cut_long(sentence, limit) if len(sentence) > limit else [sentence]:
            joined = f"{current} {piece}" if current else piece
            if len(joined) <= limit:
                current = joined
            else:
                segments.append(current)
                current = piece
    if current:
        segments.append(current)
    return segments
