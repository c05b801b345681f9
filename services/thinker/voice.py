"""Registered voices on the thinker: encode a reference clip once, and build the speech system prompt
from the stored rows instead of the clip.

``encode_voice`` runs the processor and the audio encoder over the clip exactly as a prompt's audio part
would be (16 kHz log-mel pieces of at most 30 s, 10 rows per second) and returns the rows
(``VoiceEmbedding``), which the gateway stores beside the clip. A turn whose ``ThinkerOpen.voice`` carries
them gets the same speech system prompt a ``ref_audio`` would give — ``[prefix, <audio>, suffix]`` of
:func:`~services.thinker.processor.chat.speech_system_message` — with the placeholder's ``<unk>`` rows
taken from the stored rows, so the clip is neither decoded nor encoded again (tests compare the two).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.pb import thinker_pb2
from services.common.pcm import pcm_to_float
from services.common.tensors import tensor_from_proto, tensor_to_proto


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
    return thinker_pb2.VoiceEmbedding(embeds=tensor_to_proto(rows.detach().cpu()), digest=digest)


def voice_rows(backend: Any, open_msg: thinker_pb2.ThinkerOpen) -> torch.Tensor | None:
    """The stored rows of ``open_msg.voice`` (None without one), checked against the model."""
    if not open_msg.HasField("voice"):
        return None
    if open_msg.ref_audio.data:
        raise StageError(INVALID_ARGUMENT, "send either ref_audio or voice, not both", "voice")
    rows = tensor_from_proto(open_msg.voice.embeds)
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
