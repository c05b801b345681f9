"""Registered voices on the thinker: encode a reference clip once, and build the speech system prompt
from the stored rows instead of the clip.

``encode_voice`` runs the processor and the audio encoder over the clip exactly as a prompt's audio part
would be (16 kHz log-mel pieces of at most 30 s, 10 rows per second) and returns the rows
(``VoiceEmbedding``), which the gateway stores beside the clip. A turn whose ``ThinkerOpen.voice`` carries
them gets the same speech system prompt a ``ref_audio`` would give — ``[prefix, <audio>, suffix]`` of
:func:`~services.thinker.processor.chat.speech_system_message` — with the placeholder's ``<unk>`` rows
taken from the stored rows, so the clip is neither decoded nor encoded again (tests compare the two).

What a turn derives from the stored rows (the prefix's token ids, its input rows on the model device and
the content key the prefix cache names them by) is derived once per voice: :class:`VoicePrefixCache`
keeps it keyed by a hash of the rows' bytes, so a request naming a known voice costs the thinker no
device work before its prefill (no embedding, no copy, no wait for the engine's queued steps), as a
request in the default voice. A duplex session takes the stored rows as its reference voice
(:func:`voice_rows`), instead of encoding the clip again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter

from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.pb import thinker_pb2
from services.common.pcm import pcm_to_float
from services.common.tensors import tensor_from_proto, tensor_to_proto

VOICE_PREFIX_BUILDS = Counter(
    "minicpmo_thinker_voice_prefix_builds_total",
    "Speech system prefixes derived from a registered voice's stored rows (once per voice and process)",
)
VOICE_PREFIX_HITS = Counter(
    "minicpmo_thinker_voice_prefix_hits_total",
    "Requests naming a registered voice whose derived speech system prefix was already cached",
)
REFERENCE_ENCODES = Counter(
    "minicpmo_thinker_reference_encodes_total",
    "Reference voice clips run through the audio encoder: EncodeVoice (registration) and an inline "
    "ref_audio of a turn or a duplex session (a registered voice's stored rows are never encoded again)",
)
VOICE_CACHE_SIZE = 64  # voices whose derived prefix a thinker keeps (LRU); ~1 MB of device rows each


def encode_voice(backend: Any, request: thinker_pb2.ThinkerVoiceRequest) -> thinker_pb2.VoiceEmbedding:
    """The audio-encoder rows of the request's clip (runs in a worker thread: the encoder blocks)."""
    from services.thinker.processor import AudioClip, AudioInput, Message

    if not request.ref_audio.data:
        raise StageError(INVALID_ARGUMENT, "ref_audio is empty", "ref_audio")
    samples, rate = pcm_to_float(request.ref_audio)
    processed = backend.processor([Message("user", [AudioInput(AudioClip(samples, rate))])])
    with torch.inference_mode():
        pieces = backend.model.get_audio_embeds(
            processed.audio_features, processed.audio_feature_lens, backend.model.dims.audio.chunk_length_s
        )
    rows = torch.cat(pieces) if pieces else torch.zeros(0, backend.hidden_size)
    expected = sum(int(e - s) for s, e in processed.audio_bounds.tolist())
    if rows.shape[0] != expected or expected == 0:
        raise StageError(INVALID_ARGUMENT, "the clip gives no audio rows", "ref_audio")
    digest = hashlib.sha256(np.ascontiguousarray(samples, dtype=np.float32).tobytes()).hexdigest()
    REFERENCE_ENCODES.inc()
    return thinker_pb2.VoiceEmbedding(embeds=tensor_to_proto(rows.detach().cpu()), digest=digest)


def voice_key(voice: thinker_pb2.VoiceEmbedding) -> bytes:
    """The content key of stored rows: a hash of their bytes, dtype and shape (what the rows are, whatever
    the gateway calls the voice), so a key always names the same rows."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{voice.embeds.dtype}:{list(voice.embeds.shape)}".encode())
    h.update(voice.embeds.data)
    return h.digest()


def voice_rows(backend: Any, open_msg: thinker_pb2.ThinkerOpen) -> torch.Tensor | None:
    """The stored rows of ``open_msg.voice`` (None without one), checked against the model."""
    if not open_msg.HasField("voice"):
        return None
    if open_msg.ref_audio.data:
        raise StageError(INVALID_ARGUMENT, "send either ref_audio or voice, not both", "voice")
    return checked_rows(backend, open_msg.voice)


def checked_rows(backend: Any, voice: thinker_pb2.VoiceEmbedding) -> torch.Tensor:
    """``voice``'s rows as a tensor, refused (400 ``voice.embeds``) when they do not fit this model."""
    rows = tensor_from_proto(voice.embeds)
    if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[1] != backend.hidden_size:
        raise StageError(
            INVALID_ARGUMENT,
            f"voice rows have shape {list(rows.shape)}; this model needs [n, {backend.hidden_size}]",
            "voice.embeds",
        )
    return rows


def speech_system_prefix(backend: Any, rows: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The speech system turn for a stored voice: its token ids and input embeddings (text rows from the
    embedding table, the audio placeholder's rows from ``rows``)."""
    from services.thinker.processor import LISTEN_ID, UNK_ID
    from services.thinker.processor.audio import audio_placeholder
    from services.thinker.processor.chat import AUDIO_TAG, render_chat, speech_system_message

    message = speech_system_message(np.zeros(1, np.float32))  # the clip itself is not needed
    text = render_chat([message], add_generation_prompt=False).replace(
        AUDIO_TAG, audio_placeholder(int(rows.shape[0]))
    )
    ids = [t for t in backend.processor.encode_text(text) if t != LISTEN_ID]
    model = backend.model
    with torch.inference_mode():
        embeds = model.embed_tokens(torch.tensor(ids, device=model.device)).clone()
        unk = torch.tensor(ids, device=model.device) == UNK_ID
        if int(unk.sum()) != rows.shape[0]:
            raise StageError(INVALID_ARGUMENT, "voice rows do not fit the audio placeholder", "voice.embeds")
        embeds[unk] = rows.to(device=embeds.device, dtype=embeds.dtype)
    return ids, embeds


@dataclass(frozen=True)
class VoicePrefix:
    """What a turn needs of a registered voice: the speech system turn's ids, its input rows (on the model
    device) and the content key that names those rows for the prefix cache."""

    ids: list[int]
    embeds: torch.Tensor
    key: bytes


class VoicePrefixCache:
    """Derived speech system prefixes of registered voices, keyed by :func:`voice_key` (LRU).

    Prompt building runs on the backend's executor threads, so lookups and inserts hold a lock; two
    requests racing on a new voice may both derive it (the result is the same), the later one is kept."""

    def __init__(self, size: int = VOICE_CACHE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[bytes, VoicePrefix] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, backend: Any, open_msg: thinker_pb2.ThinkerOpen) -> VoicePrefix | None:
        """The prefix for ``open_msg.voice`` (None without a voice), derived at most once per voice."""
        if not open_msg.HasField("voice"):
            return None
        if open_msg.ref_audio.data:
            raise StageError(INVALID_ARGUMENT, "send either ref_audio or voice, not both", "voice")
        key = voice_key(open_msg.voice)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
        if hit is not None:
            VOICE_PREFIX_HITS.inc()
            return hit
        ids, embeds = speech_system_prefix(backend, checked_rows(backend, open_msg.voice))
        prefix = VoicePrefix(ids, embeds.detach(), key)
        VOICE_PREFIX_BUILDS.inc()
        with self._lock:
            self._items[key] = prefix
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return prefix
