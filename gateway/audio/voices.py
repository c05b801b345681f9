"""The voice registry: uploaded reference voices, featurised once and kept on a shared directory.

Layout (``gateway.voice_dir`` of the deploy profile, a volume every gateway replica mounts)::

    <voice_dir>/<name>/clip.wav      the trimmed reference clip (16-bit mono, its own rate)
    <voice_dir>/<name>/code2wav.pb   code2wav's ``VoicePrompt`` for it (S3 prompt tokens, prompt mel,
                                     CAM++ x-vector), computed by the code2wav stage's ``EncodeVoice``
    <voice_dir>/<name>/thinker.pb    the thinker's ``VoiceEmbedding`` (the audio encoder's rows for the
                                     clip), computed by the thinker stage's ``EncodeVoice``
    <voice_dir>/<name>/meta.json     name, created_at, duration, sample rate, ref_text, feature digest

A voice is written into a hidden temporary directory and renamed into place, so a reader (any replica)
sees a voice completely or not at all, and two replicas registering one name race on the rename: one
wins, the other answers 409. The gateway never runs a model: the features come from the stages, and a
request naming the voice sends them as they are (``ThinkerOpen.voice``: the rows the thinker's speech
system prompt holds for the clip; ``Code2WavOpen.voice``: code2wav's prompt), so a registered voice is
never decoded, encoded or featurised per request. The talker takes nothing from a reference. The clip
itself is kept for re-deriving; a realtime session sends the thinker the stored rows as well (the duplex
prefix holds them where an inline clip's encoder rows would be).

Names: OpenAI's built-in voice names (:data:`BUILTIN_VOICES`) and ``default`` are the checkpoint's
default voice and cannot be registered; an uploaded name is 1-64 characters of letters, digits, ``_``,
``-`` and ``.``, starting with a letter or digit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gateway.openai.errors import APIError, invalid_request
from services.common.audio import read_audio, wav_bytes
from services.common.pb import code2wav_pb2, common_pb2, thinker_pb2
from services.common.pcm import pcm_from_float

DEFAULT_VOICE = "default"
BUILTIN_VOICES: tuple[str, ...] = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
MIN_CLIP_S, MAX_CLIP_S = 1.0, 30.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Silence trimming: 20 ms frames quieter than 40 dB below the clip's loudest frame (or than -60 dBFS)
# are silence; leading and trailing silence is cut.
_FRAME_S = 0.02
_REL_DB, _ABS_RMS = -40.0, 1e-3


@dataclass(frozen=True)
class RegisteredVoice:
    """A stored voice, as the request paths use it."""

    name: str
    clip: common_pb2.Pcm  # the trimmed clip (realtime sessions build their duplex prefix from audio)
    thinker: thinker_pb2.VoiceEmbedding  # the thinker's stored audio-encoder rows
    code2wav: code2wav_pb2.VoicePrompt  # code2wav's stored features
    meta: dict[str, object]


class RealtimeVoice(NamedTuple):
    """What a realtime session takes from a registered voice: the clip (16 kHz mono float32; the session's
    reference for everything that checks one exists) and the stages' stored features, which the
    session's thinker and code2wav streams get instead of the clip."""

    clip: np.ndarray
    code2wav: code2wav_pb2.VoicePrompt
    thinker: thinker_pb2.VoiceEmbedding


def is_builtin(name: str) -> bool:
    return name == DEFAULT_VOICE or name in BUILTIN_VOICES


def trim_silence(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """``samples`` without leading and trailing silence (20 ms frames, see the module constants)."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    frame = max(1, int(_FRAME_S * sample_rate))
    n = x.size // frame
    if n == 0:
        return x[:0]
    rms = np.sqrt(np.mean(x[: n * frame].reshape(n, frame).astype(np.float64) ** 2, axis=1))
    threshold = max(_ABS_RMS, float(rms.max()) * 10 ** (_REL_DB / 20))
    loud = np.flatnonzero(rms >= threshold)
    if loud.size == 0:
        return x[:0]
    start, end = int(loud[0]) * frame, min(x.size, (int(loud[-1]) + 1) * frame)
    return x[start:end]


def check_clip(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """The trimmed clip, or a 400 (param ``file``) when it is not 1-30 s long after trimming silence."""
    trimmed = trim_silence(samples, sample_rate)
    seconds = trimmed.size / float(sample_rate)
    if seconds < MIN_CLIP_S:
        raise invalid_request(
            f"the voice clip has {seconds:.2f} s of sound after trimming silence; at least {MIN_CLIP_S:g} s is needed",
            "file",
            "audio_too_short",
        )
    if seconds > MAX_CLIP_S:
        raise invalid_request(
            f"the voice clip has {seconds:.1f} s of sound after trimming silence; at most {MAX_CLIP_S:g} s is allowed",
            "file",
            "audio_too_long",
        )
    return trimmed


class VoiceRegistry:
    """Registered voices under ``root`` (None: the registry is off and only built-in names resolve)."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root else None
        self._cache: dict[str, tuple[float, RegisteredVoice]] = {}

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def require_root(self) -> Path:
        if self.root is None:
            raise invalid_request(
                "the voice registry is not configured on this server (deploy profile gateway.voice_dir)",
                None,
            )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise APIError(
                503,
                f"the voice directory is not usable on this server ({exc.strerror}); see gateway.voice_dir",
                None,
            ) from exc
        return self.root

    @staticmethod
    def check_name(name: str, param: str = "name") -> str:
        if not _NAME.match(name or ""):
            raise invalid_request(
                f"invalid voice name {name!r}: 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit",
                param,
            )
        if is_builtin(name.lower()):
            raise invalid_request(f"voice {name!r} is a built-in voice name", param, "voice_exists", 409)
        return name

    # ---------------------------------------------------------------- reads
    def resolve(self, name: str | None, param: str = "voice") -> RegisteredVoice | None:
        """None for the default voice (no name, ``default`` or an OpenAI built-in name), the stored voice
        for a registered name; a 400 naming the voice otherwise."""
        if name is None or is_builtin(str(name).lower()):
            return None
        name = str(name)
        voice = self._load(name) if self.root is not None and _NAME.match(name) else None
        if voice is None:
            raise invalid_request(
                f"unknown voice {name!r}: use a built-in voice ({', '.join(BUILTIN_VOICES)}) or one registered "
                "with POST /v1/audio/voices",
                param,
                "voice_not_found",
            )
        return voice

    def _load(self, name: str) -> RegisteredVoice | None:
        assert self.root is not None
        folder = self.root / name
        try:
            stamp = (folder / "meta.json").stat().st_mtime
        except OSError:
            self._cache.pop(name, None)
            return None
        hit = self._cache.get(name)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        try:
            meta = json.loads((folder / "meta.json").read_text())
            features = code2wav_pb2.VoicePrompt.FromString((folder / "code2wav.pb").read_bytes())
            rows = thinker_pb2.VoiceEmbedding.FromString((folder / "thinker.pb").read_bytes())
            samples, rate = read_audio(folder / "clip.wav")
        except (OSError, ValueError, RuntimeError):
            return None  # half-deleted by another replica: as good as gone
        voice = RegisteredVoice(name, pcm_from_float(samples, rate), rows, features, meta)
        self._cache[name] = (stamp, voice)
        return voice

    def realtime_voice(self, name: str) -> RealtimeVoice | None:
        """A registered voice for a realtime session (its clip at 16 kHz and both stages' features)."""
        if self.root is None or not _NAME.match(name):
            return None
        voice = self._load(name)
        if voice is None:
            return None
        from services.common.audio import resample
        from services.common.pcm import pcm_to_float

        samples, rate = pcm_to_float(voice.clip)
        return RealtimeVoice(resample(samples, rate, 16_000), voice.code2wav, voice.thinker)

    def list(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = [
            {"name": DEFAULT_VOICE, "type": "builtin", "description": "the checkpoint's default voice"}
        ]
        out += [
            {"name": n, "type": "builtin", "description": "OpenAI voice name; speaks with the default voice"}
            for n in BUILTIN_VOICES
        ]
        if self.root is None or not self.root.is_dir():
            return out
        for folder in sorted(self.root.iterdir()):
            if folder.name.startswith(".") or not (folder / "meta.json").is_file():
                continue
            try:
                meta = json.loads((folder / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            out.append({"type": "uploaded", **meta})
        return out

    # ---------------------------------------------------------------- writes
    def store(
        self,
        name: str,
        clip: np.ndarray,
        sample_rate: int,
        features: code2wav_pb2.VoicePrompt,
        thinker_rows: thinker_pb2.VoiceEmbedding,
        ref_text: str | None,
    ) -> dict[str, object]:
        """Write the voice atomically; 409 when the name exists (here or on another replica)."""
        root = self.require_root()
        if (root / name).exists():
            raise invalid_request(
                f"voice {name!r} already exists; DELETE /v1/audio/voices/{name} first",
                "name",
                "voice_exists",
                409,
            )
        meta: dict[str, object] = {
            "name": name,
            "created_at": int(time.time()),
            "duration_s": round(clip.size / float(sample_rate), 3),
            "sample_rate": int(sample_rate),
            "ref_text": ref_text or None,
            "digest": features.digest,
        }
        tmp = root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            (tmp / "clip.wav").write_bytes(wav_bytes(clip, sample_rate))
            (tmp / "code2wav.pb").write_bytes(features.SerializeToString())
            (tmp / "thinker.pb").write_bytes(thinker_rows.SerializeToString())
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                os.rename(tmp, root / name)
            except OSError as exc:  # the name appeared meanwhile (another replica)
                raise invalid_request(f"voice {name!r} already exists", "name", "voice_exists", 409) from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return {"type": "uploaded", **meta}

    def delete(self, name: str) -> None:
        if is_builtin(name.lower()):
            raise invalid_request(f"voice {name!r} is built in and cannot be deleted", "name")
        root = self.require_root()
        folder = root / name
        if not _NAME.match(name) or not (folder / "meta.json").is_file():
            raise APIError(404, f"voice {name!r} does not exist", "name")
        # Rename first, so readers on any replica stop seeing it at once, then remove the files.
        gone = root / f".del-{uuid.uuid4().hex}"
        try:
            os.rename(folder, gone)
        except OSError as exc:
            raise APIError(404, f"voice {name!r} does not exist", "name") from exc
        shutil.rmtree(gone, ignore_errors=True)
        self._cache.pop(name, None)
