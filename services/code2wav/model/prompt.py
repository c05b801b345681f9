"""Reference voice -> prompt features (S3 tokens, CAM++ x-vector, 24 kHz mel), cached by content hash.

Every reference is normalised to exactly 6.0 s (truncate or zero-pad at its own rate) so the prompt is
always 150 tokens / 300 mel frames: equal cache shapes across streams are what lets windows of different
streams share a batch and a CUDA graph (docs/model.md, Code2Wav reference voice). The two feature branches
follow the reference front end: S3 tokens and the CAM++ fbank from the 16 kHz signal, the prompt mel from the
24 kHz signal, each obtained with ``torchaudio``'s resampler only when the input is at another rate (so a 16
kHz PCM reference such as the default voice gives exactly the reference numbers). That resampler, not the
project's soxr one, because upstream's token2wav uses it and the voice's tokens and x-vector depend on it
(:func:`services.common.audio.resample_torchaudio`).

The S3 tokenizer is built with the dimensions found in the ONNX file (``s3tokenizer.load_model``
assumes the full 1280-d/6-layer model, which the tiny test checkpoint is not). CAM++ runs through
onnxruntime on CPU with one intra-op thread, as upstream does.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import torch
import torchaudio.compliance.kaldi as kaldi
from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2
from s3tokenizer.utils import log_mel_spectrogram, onnx2torch
from stepaudio2.flashcosyvoice.utils.audio import mel_spectrogram

from services.common.audio import read_audio, resample_torchaudio

PROMPT_SECONDS = 6.0
TOKENIZER_RATE = 16000
VOCODER_RATE = 24000
MIN_REFERENCE_SECONDS = 1.0
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 192000
SILENCE_RMS = 1e-4
S3_HEAD_DIM = 64  # fixed by the S3 tokenizer's rotary table (docs/model.md, Tiny checkpoint)


class ReferenceAudioError(ValueError):
    """The reference voice cannot be used (empty, too short, silent, not finite, odd sample rate)."""


@dataclass(frozen=True)
class PromptFeatures:
    """Everything a stream needs from its reference voice (all on the model device)."""

    tokens: torch.Tensor  # [1, P] int32 S3 speech tokens
    mel: torch.Tensor  # [1, 2P, 80] prompt mel (24 kHz front end)
    spk_emb: torch.Tensor  # [1, 192] CAM++ x-vector
    digest: str  # sha256 of the normalised samples and rate

    @property
    def frames(self) -> int:
        return int(self.mel.shape[1])


def build_s3_tokenizer(onnx_path: str | Path) -> S3TokenizerV2:
    """S3TokenizerV2 with width/heads/layers/mels read from the ONNX weights, loaded strictly."""
    state = onnx2torch(str(onnx_path), None, False)
    conv1 = state.get("encoder.conv1.weight")
    if conv1 is None:
        raise ValueError(f"{onnx_path}: no encoder.conv1 weight; not an S3 tokenizer v2 file")
    width, n_mels = int(conv1.shape[0]), int(conv1.shape[1])
    layers = {int(m.group(1)) for k in state if (m := re.match(r"encoder\.blocks\.(\d+)\.", k))}
    config = ModelConfig(
        n_mels=n_mels, n_audio_state=width, n_audio_head=width // S3_HEAD_DIM, n_audio_layer=len(layers)
    )
    model = S3TokenizerV2("speech_tokenizer_v2_25hz", config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def decode_wav_file(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a wav/flac file as float32 mono samples (soundfile; no torchcodec needed)."""
    return read_audio(path)


def normalise_reference(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """Validate and cut/pad a mono reference to exactly :data:`PROMPT_SECONDS` at its own rate."""
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise ReferenceAudioError(
            f"reference sample rate {sample_rate} Hz outside [{MIN_SAMPLE_RATE}, {MAX_SAMPLE_RATE}]"
        )
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if samples.size < MIN_REFERENCE_SECONDS * sample_rate:
        raise ReferenceAudioError(
            f"reference audio is {samples.size / sample_rate:.2f} s; at least {MIN_REFERENCE_SECONDS} s is needed"
        )
    if not np.all(np.isfinite(samples)):
        raise ReferenceAudioError("reference audio contains NaN or infinite samples")
    if float(np.sqrt(np.mean(samples.astype(np.float64) ** 2))) < SILENCE_RMS:
        raise ReferenceAudioError("reference audio is silent")
    target = round(PROMPT_SECONDS * sample_rate)
    if samples.size >= target:
        return np.ascontiguousarray(samples[:target])
    return np.concatenate([samples, np.zeros(target - samples.size, dtype=np.float32)])


class ReferenceVoiceEncoder:
    """Turns reference audio into :class:`PromptFeatures`, with a bounded LRU keyed by content hash."""

    def __init__(
        self,
        asset_dir: str | Path,
        device: torch.device,
        up_rate: int = 2,
        cache_size: int = 32,
    ) -> None:
        asset_dir = Path(asset_dir)
        self.device = device
        self.up_rate = up_rate
        self.tokenizer = build_s3_tokenizer(asset_dir / "speech_tokenizer_v2_25hz.onnx").to(device)
        self.n_mels = self.tokenizer.config.n_mels
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = 1
        self.speaker_model = onnxruntime.InferenceSession(
            str(asset_dir / "campplus.onnx"), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self.cache_size = cache_size
        self._cache: OrderedDict[str, PromptFeatures] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def digest(samples: np.ndarray, sample_rate: int) -> str:
        h = hashlib.sha256(str(sample_rate).encode())
        h.update(np.ascontiguousarray(samples, dtype=np.float32).tobytes())
        return h.hexdigest()

    def encode(self, samples: np.ndarray, sample_rate: int) -> PromptFeatures:
        """Validate, normalise and featurise; identical audio is computed once (LRU)."""
        normalised = normalise_reference(samples, sample_rate)
        key = self.digest(normalised, sample_rate)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        features = self._featurise(normalised, sample_rate, key)
        with self._lock:
            self.misses += 1
            self._cache[key] = features
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return features

    def encode_file(self, path: str | Path) -> PromptFeatures:
        samples, rate = decode_wav_file(path)
        return self.encode(samples, rate)

    @torch.inference_mode()
    def _featurise(self, samples: np.ndarray, sample_rate: int, key: str) -> PromptFeatures:
        # torchaudio's resampler, not soxr: upstream's token2wav prepares the prompt with it (module doc).
        wave16 = torch.from_numpy(resample_torchaudio(samples, sample_rate, TOKENIZER_RATE))
        s3_mel = log_mel_spectrogram(wave16, n_mels=self.n_mels).unsqueeze(0).to(self.device)
        s3_len = torch.tensor([s3_mel.shape[2]], dtype=torch.int32, device=self.device)
        tokens, _ = self.tokenizer.quantize(s3_mel, s3_len)
        tokens = tokens.to(torch.int32)

        fbank = kaldi.fbank(wave16.unsqueeze(0), num_mel_bins=80, dither=0, sample_frequency=TOKENIZER_RATE)
        fbank = fbank - fbank.mean(dim=0, keepdim=True)
        spk = self.speaker_model.run(
            None, {self.speaker_model.get_inputs()[0].name: fbank.unsqueeze(0).numpy()}
        )[0]
        spk_emb = torch.from_numpy(np.asarray(spk, dtype=np.float32)).reshape(1, -1).to(self.device)

        wave24 = torch.from_numpy(resample_torchaudio(samples, sample_rate, VOCODER_RATE)).unsqueeze(0)
        mel = mel_spectrogram(wave24).transpose(1, 2)  # [1, F, 80]
        frames = tokens.shape[1] * self.up_rate
        if mel.shape[1] >= frames:
            mel = mel[:, :frames]
        else:
            mel = torch.nn.functional.pad(mel, (0, 0, 0, frames - mel.shape[1]), mode="replicate")
        if not (torch.isfinite(mel).all() and torch.isfinite(spk_emb).all()):
            raise ReferenceAudioError("reference audio produced non-finite features")
        return PromptFeatures(
            tokens=tokens, mel=mel.contiguous().to(self.device), spk_emb=spk_emb, digest=key
        )
