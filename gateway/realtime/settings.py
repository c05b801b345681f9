"""Deployment knobs of the realtime endpoint; defaults follow docs/protocol.md (the reference server's
values)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RealtimeSettings:
    # session.voice naming a registered voice -> its clip (16 kHz mono float32) and the stages' stored
    # features (gateway.audio.voices.RealtimeVoice); None when the name is not registered. Set from the
    # voice registry by mount_realtime.
    voice_lookup: Callable[[str], Any] | None = None
    thinker_target: str = "127.0.0.1:50051"
    talker_target: str = "127.0.0.1:50052"
    code2wav_target: str = "127.0.0.1:50053"
    served_model: str = "openbmb/MiniCPM-o-4_5"
    max_sessions: int = 4
    max_frame_bytes: int = 15 * 1024 * 1024
    config_timeout_s: float = 10.0
    disconnect_grace_s: float = 30.0
    journal_ttl_s: float = 60.0
    journal_max_bytes: int = 8 * 1024 * 1024
    max_pending_input_bytes: int = 16 * 1024 * 1024
    max_pending_commits: int = 4
    # Turn lane: the gateway feeds silent units while a requested response is speaking; this caps them.
    max_response_units: int = 30
    overlap_silence_rms: float = 0.003
    supports_barge_in: bool = True
    supports_session_resume: bool = True
    # Hidden-state rows per thinker chunk and their dtype on the wire ("bf16" or "fp32").
    hidden_dtype: str = "fp32"
    # Frames of a speaking turn's first codec window (0: a full window, upstream's duplex framing). The
    # gateway sets the deploy profile's talker.codec.first_window_frames, as the chat route uses: the first
    # audio leaves after that many frames instead of a whole unit's 25.
    first_window_frames: int = 0
    seed: int | None = None
    # session.close / a session-ending failure waits at most this long for the stage streams to wind down
    # before it answers session.closed (the gRPC pipeline cancels its calls first, so this is a backstop).
    pipeline_close_timeout_s: float = 5.0
