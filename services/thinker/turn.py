"""Turn-mode stream logic: engine events -> TextDelta, SpeechChunk (span + hidden rows) and Done.

Kept apart from the stream handler (:mod:`services.thinker.turn_stream`) so it can be tested without a
network. Span rules (docs/model.md, Thinker to talker hand-off): with ``want_speech`` the prompt ends with
``<|tts_bos|>`` (the TTS template is forced on), so every generated token up to the end token
(``<|tts_eos|>`` 151704 or ``<|im_end|>`` 151645, both excluded) is spoken. A generated ``<|tts_bos|>``
(possible when a client turns the template off) is not spoken itself. Each spoken token travels with
the final-norm hidden row computed when that token was the model input, so rows align 1:1 with ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.pb import common_pb2, thinker_pb2
from services.common.tensors import tensor_to_proto
from services.thinker.sampling import StopText

TTS_BOS_ID = 151703
SPAN_END_IDS = frozenset({151704, 151645})
# <tool_call> ... </tool_call>: a function call is not spoken (the speech says the text part only).
TOOL_CALL_ID, TOOL_CALL_END_ID = 151657, 151658


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


def _token_bytes(piece: str) -> bytes:
    """The bytes of a vocabulary entry (an added token that is not byte-mapped is its UTF-8 text)."""
    if all(ch in _BYTE_DECODER for ch in piece):
        return bytes(_BYTE_DECODER[ch] for ch in piece)
    return piece.encode("utf-8")


class IncrementalDetokenizer:
    """UTF-8-safe incremental text: a delta never ends inside a multi-byte character.

    Decodes a small window (from the last emitted boundary) instead of the whole output each step, and
    holds text back while the window ends with U+FFFD (an incomplete byte sequence).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (may contain U+FFFD for truncated bytes)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


@dataclass
class SpanChunker:
    """Buffers spoken tokens with their hidden rows and cuts them into SpeechChunks."""

    first_chunk_tokens: int
    chunk_tokens: int
    ids: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    sent_chunks: int = 0

    def add(self, token_id: int, row: torch.Tensor) -> None:
        self.ids.append(int(token_id))
        self.rows.append(row)

    def ready(self) -> bool:
        want = self.first_chunk_tokens if self.sent_chunks == 0 else self.chunk_tokens
        return len(self.ids) >= want

    def take(self, hidden_size: int) -> tuple[list[int], torch.Tensor]:
        want = self.first_chunk_tokens if self.sent_chunks == 0 else self.chunk_tokens
        n = min(want, len(self.ids))
        return self._pop(n, hidden_size)

    def take_all(self, hidden_size: int) -> tuple[list[int], torch.Tensor]:
        return self._pop(len(self.ids), hidden_size)

    def _pop(self, n: int, hidden_size: int) -> tuple[list[int], torch.Tensor]:
        ids, rows = self.ids[:n], self.rows[:n]
        self.ids, self.rows = self.ids[n:], self.rows[n:]
        self.sent_chunks += 1
        hidden = torch.stack(rows) if rows else torch.zeros(0, hidden_size)
        return ids, hidden


class TurnOutput:
    """Turns the engine events of one turn-mode request into response messages.

    ``emit`` receives ``ThinkerResponse`` messages in order; identity fields are copied from the open
    message and ``chunk_seq`` counts responses on this stream.
    """

    def __init__(
        self,
        tokenizer: Any,
        identity: common_pb2.Identity,
        emit: Callable[[thinker_pb2.ThinkerResponse], None],
        *,
        hidden_size: int,
        want_speech: bool,
        prompt_ends_with_tts_bos: bool,
        first_chunk_tokens: int,
        chunk_tokens: int,
        hidden_dtype: torch.dtype | None,
        stop_ids: frozenset[int],
        prompt_tokens: int = 0,
        stop: tuple[str, ...] = (),
        top_logprobs: int | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        # Stop strings: text that could still become a match is held back; the match and after are cut.
        self.stop_text = StopText(stop) if stop else None
        self.top_logprobs = top_logprobs  # None: no logprobs on the deltas
        self.prompt_tokens = prompt_tokens  # repeated on every TextDelta for running usage
        self.identity = identity
        self._emit = emit
        self.hidden_size = hidden_size
        self.want_speech = want_speech
        self.span_active = want_speech
        self.saw_tts_bos = prompt_ends_with_tts_bos
        self.chunker = SpanChunker(first_chunk_tokens, chunk_tokens)
        self.hidden_dtype = hidden_dtype
        self.stop_ids = stop_ids
        self.seq = 0
        self.span_closed = False
        self.pending_span: set[int] = set()  # positions of span tokens whose row has not arrived yet
        self.generated: list[int] = []
        self.speech_tokens = 0
        self.rows_seen = 0
        self.in_tool_call = False

    def _id(self) -> common_pb2.Identity:
        ident = common_pb2.Identity()
        ident.CopyFrom(self.identity)
        ident.chunk_seq = self.seq
        self.seq += 1
        return ident

    # ----------------------------------------------------------------------------------- events
    def on_token(
        self,
        token: int,
        finished: str | None,
        logprobs: tuple[float, list[tuple[int, float]]] | None = None,
    ) -> None:
        """A newly sampled token; ``finished`` is the engine's finish reason when this token ended it."""
        self.generated.append(token)
        is_end = finished == "stop" and token in self.stop_ids
        if not is_end:
            text = self.detok.push(token)
            if self.stop_text is not None:
                text = self.stop_text.feed(text)
            delta = thinker_pb2.TextDelta(
                id=self._id(), token_ids=[token], text=text, prompt_tokens=self.prompt_tokens
            )
            if self.top_logprobs is not None and logprobs is not None:
                delta.logprobs.append(self._logprob(token, logprobs))
            self._emit(thinker_pb2.ThinkerResponse(text=delta))
        if not self.want_speech or self.span_closed:
            return
        if token in SPAN_END_IDS or is_end:
            self.span_closed = True
            return
        if token == TTS_BOS_ID:
            self.saw_tts_bos = True
            return  # the marker itself is not spoken
        if token in (TOOL_CALL_ID, TOOL_CALL_END_ID) or self.in_tool_call:
            self.in_tool_call = token != TOOL_CALL_END_ID
            return
        self.pending_span.add(len(self.generated) - 1)

    def on_row(self, fed_token: int, row: torch.Tensor) -> None:
        """The hidden row of the next generated token in order (computed when it was fed back)."""
        position = self.rows_seen
        self.rows_seen += 1
        if position in self.pending_span:
            self.pending_span.discard(position)
            self.chunker.add(fed_token, row)
            self.speech_tokens += 1
            while self.chunker.ready():
                ids, hidden = self.chunker.take(self.hidden_size)
                self._send_speech(ids, hidden, is_last=False)

    def _token_text(self, token: int) -> tuple[str, bytes]:
        """A token's own text and UTF-8 bytes (byte-level BPE: a partial character keeps its bytes)."""
        tok = self.detok.tokenizer
        piece = tok.convert_ids_to_tokens(int(token))
        data = _token_bytes(piece) if isinstance(piece, str) else b""
        return data.decode("utf-8", errors="replace"), data

    def _logprob(self, token: int, lp: tuple[float, list[tuple[int, float]]]) -> thinker_pb2.TokenLogprob:
        text, data = self._token_text(token)
        out = thinker_pb2.TokenLogprob(token_id=token, token=text, token_bytes=data, logprob=lp[0])
        for tid, value in lp[1][: self.top_logprobs or 0]:
            t_text, t_data = self._token_text(tid)
            out.top_logprobs.append(
                thinker_pb2.TopLogprob(token_id=tid, token=t_text, token_bytes=t_data, logprob=value)
            )
        return out

    def on_forced(self, token_ids: list[int], rows: torch.Tensor) -> None:
        """Teacher-forced tokens with their prefill rows: text, then spoken rows, as sampled ones would be."""
        for token, row in zip(token_ids, rows, strict=True):
            self.generated.append(int(token))
            text = self.detok.push(int(token))
            self._emit(
                thinker_pb2.ThinkerResponse(
                    text=thinker_pb2.TextDelta(
                        id=self._id(), token_ids=[int(token)], text=text, prompt_tokens=self.prompt_tokens
                    )
                )
            )
            self.chunker.add(int(token), row)
            self.speech_tokens += 1
            while self.chunker.ready():
                ids, hidden = self.chunker.take(self.hidden_size)
                self._send_speech(ids, hidden, is_last=False)

    def finish(self, reason: str, prompt_tokens: int, cached_tokens: int = 0) -> None:
        tail = self.detok.flush()
        if self.stop_text is not None:
            tail = self.stop_text.feed(tail) + self.stop_text.flush()
        if tail:
            delta = thinker_pb2.TextDelta(id=self._id(), text=tail, prompt_tokens=self.prompt_tokens)
            self._emit(thinker_pb2.ThinkerResponse(text=delta))
        if self.want_speech:
            ids, hidden = self.chunker.take_all(self.hidden_size)
            self._send_speech(ids, hidden, is_last=True)
        completion = len(self.generated)
        usage = common_pb2.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            cached_tokens=cached_tokens,
        )
        if self.want_speech:
            usage.extra["speech_tokens"] = self.speech_tokens
        self._emit(
            thinker_pb2.ThinkerResponse(
                done=common_pb2.Done(id=self._id(), finish_reason=reason, usage=usage)
            )
        )

    def _send_speech(self, ids: list[int], hidden: torch.Tensor, *, is_last: bool) -> None:
        text = self.detok.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        chunk = thinker_pb2.SpeechChunk(
            id=self._id(),
            token_ids=ids,
            hidden=tensor_to_proto(hidden, self.hidden_dtype),
            text=text,
            turn_start=self.chunker.sent_chunks == 1,
            turn_end=is_last,
            segment_end=is_last,
            is_last=is_last,
        )
        self._emit(thinker_pb2.ThinkerResponse(speech=chunk))
