"""Audio for the voice-activity tests: a streaming feeder, and synthesized speech: espeak-ng (Debian's ``espeak-ng``) renders a sentence,
and the clean rendering gives the ground-truth speech span that a detector must find under noise.

espeak-ng is installed by scripts/setup.sh where apt-get can; without it the callers skip and say why.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.audio import read_audio, resample

RATE = 16_000
# Starts and ends on voiced sounds, so the clean span is unambiguous; the comma makes a short pause that
# a 500 ms silence window must bridge.
SENTENCE = "Open the door and bring me a glass of water, please."


def espeak(text: str = SENTENCE) -> np.ndarray:
    """``text`` spoken by espeak-ng, as 16 kHz float32 mono; skips the test when espeak-ng is absent."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it with apt-get as root)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([exe, "-w", str(path), text], check=True, capture_output=True, timeout=60)
        samples, rate = read_audio(path)
    return resample(samples, rate, RATE)


def speech_span(clean: np.ndarray, frame: int = 160, floor: float = 0.01) -> tuple[int, int]:
    """First and last sample of the 10 ms frames of ``clean`` whose RMS exceeds ``floor``."""
    n = clean.size // frame
    rms = np.sqrt(np.mean(clean[: n * frame].reshape(n, frame).astype(np.float64) ** 2, axis=1))
    loud = np.nonzero(rms > floor)[0]
    return int(loud[0]) * frame, int(loud[-1] + 1) * frame


def active_rms(clean: np.ndarray) -> float:
    """RMS over the speech span only (the level an SNR is quoted against)."""
    start, end = speech_span(clean)
    return float(np.sqrt(np.mean(clean[start:end].astype(np.float64) ** 2)))


def feed(detector: Any, audio: np.ndarray, chunk: int | None = None) -> list[Any]:
    """Every event a streaming VAD detector yields for ``audio``, appended whole or in ``chunk``-sample pieces."""
    if chunk is None:
        return detector.process(audio)
    events: list[Any] = []
    for i in range(0, audio.size, chunk):
        events += detector.process(audio[i : i + chunk])
    return events


def white_noise(n: int, rms: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * rms).astype(np.float32)
