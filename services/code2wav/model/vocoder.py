"""Streaming HiFT vocoder step (mel -> 24 kHz wave) for a batch of streams.

Follows the reference streaming driver: prepend the stream's last 8 mel frames, force the first samples
of the harmonic source to the cached source (so the excitation is continuous across windows), synthesise,
cross-fade the first 3840 samples with the held-back tail of the previous window (Hamming window of
2·3840, computed in float64 like the reference), then hold back the last 3840 samples (160 ms) unless
the window is the stream's last.

The neural-source-filter excitation is computed here rather than through ``SourceModuleHnNSF2`` because
the package draws its random harmonic phases and additive noise from the global RNG on every call. Here
the noise comes from one explicit ``torch.Generator`` per stream, or is switched off entirely (then the
output equals the package's with its noise calls returning zeros, which is how the oracle was recorded).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator

MEL_CACHE_FRAMES = 8  # 160 ms of mel re-synthesised at the start of each window


@dataclass
class HiftCache:
    """Per-stream vocoder state: mel [1, 80, <=8], source [1, 1, <=3840], held-back speech [1, <=3840]."""

    mel: torch.Tensor
    source: torch.Tensor
    speech: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mel, self.source, self.speech))

    def signature(self) -> tuple[int, ...]:
        return (self.mel.shape[2], self.source.shape[2], self.speech.shape[1])

    @staticmethod
    def empty(mel_bins: int, device: torch.device) -> HiftCache:
        return HiftCache(
            mel=torch.zeros(1, mel_bins, 0, device=device),
            source=torch.zeros(1, 1, 0, device=device),
            speech=torch.zeros(1, 0, device=device),
        )


def nsf_source(
    hift: HiFTGenerator, f0: torch.Tensor, generators: list[torch.Generator] | None
) -> torch.Tensor:
    """Harmonic excitation [B, 1, L] from the frame-rate f0 [B, F]; ``generators`` None = noise off."""
    module = hift.m_source
    sine = module.l_sin_gen
    f0_up = hift.f0_upsamp(f0[:, None]).transpose(1, 2)  # [B, L, 1] at the sample rate
    length = f0_up.shape[1]
    harmonics = torch.arange(1, sine.harmonic_num + 2, device=f0.device, dtype=f0_up.dtype)
    rad = (f0_up * harmonics / sine.sampling_rate) % 1  # [B, L, H] cycles per sample
    if generators is not None:
        # Random initial phase per overtone (the fundamental keeps phase 0), one draw per stream.
        initial = torch.stack([torch.rand(rad.shape[2], generator=g, device=g.device) for g in generators])
        initial[:, 0] = 0
        rad[:, 0, :] = rad[:, 0, :] + initial.to(rad.device)
    # Integrate phase at the frame rate and interpolate back up, as SineGen2 does (keeps it smooth).
    scale = sine.upsample_scale
    rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
    phase = torch.cumsum(rad, dim=1) * 2 * np.pi
    phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=scale, mode="linear").transpose(1, 2)
    waves = torch.sin(phase) * sine.sine_amp
    voiced = (f0_up > sine.voiced_threshold).type(torch.float32)
    if generators is not None:
        amp = voiced * sine.noise_std + (1 - voiced) * sine.sine_amp / 3
        noise = torch.stack(
            [torch.randn(length, waves.shape[2], generator=g, device=g.device) for g in generators]
        ).to(waves.device)
        waves = waves * voiced + amp * noise
    else:
        waves = waves * voiced
    return module.l_tanh(module.l_linear(waves)).transpose(1, 2)


def hift_pre_istft(hift: HiFTGenerator, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """HiFT decoder up to (and including) ``conv_post``: the graph-capturable part (no host syncs)."""
    s_real, s_imag = hift._stft(source.squeeze(1))
    s_stft = torch.cat([s_real, s_imag], dim=1)
    x = hift.conv_pre(mel)
    for i in range(hift.num_upsamples):
        x = F.leaky_relu(x, hift.lrelu_slope)
        x = hift.ups[i](x)
        if i == hift.num_upsamples - 1:
            x = hift.reflection_pad(x)
        si = hift.source_resblocks[i](hift.source_downs[i](s_stft))
        x = x + si
        xs = None
        for j in range(hift.num_kernels):
            y = hift.resblocks[i * hift.num_kernels + j](x)
            xs = y if xs is None else xs + y
        x = xs / hift.num_kernels
    x = F.leaky_relu(x)
    return hift.conv_post(x)


def hift_istft(hift: HiFTGenerator, spec: torch.Tensor) -> torch.Tensor:
    """Magnitude/phase head + inverse STFT + clamp (eager: ``torch.istft`` checks its window on the host)."""
    n_bins = hift.istft_params["n_fft"] // 2 + 1
    magnitude = torch.exp(spec[:, :n_bins, :])
    phase = torch.sin(spec[:, n_bins:, :])
    wave = hift._istft(magnitude, phase)
    return torch.clamp(wave, -hift.audio_limit, hift.audio_limit)


class VocoderStepper:
    """Batched streaming HiFT with per-stream caches and optional per-stream NSF noise."""

    def __init__(self, hift: HiFTGenerator) -> None:
        self.hift = hift
        self.hop = int(hift.f0_upsamp.scale_factor)  # samples per mel frame (480)
        self.holdback = MEL_CACHE_FRAMES * self.hop
        window = torch.from_numpy(np.hamming(2 * self.holdback))  # float64, like the reference
        self.window = window.to(next(hift.parameters()).device)
        # f0 predictor and pre-iSTFT decoder; the CUDA-graph runner swaps these on GPU.
        self.f0_fn = hift.f0_predictor
        self.decode_fn = lambda mel, source: hift_pre_istft(hift, mel, source)

    @torch.inference_mode()
    def step(
        self,
        chunk_mel: torch.Tensor,
        caches: list[HiftCache],
        last: bool,
        generators: list[torch.Generator] | None,
    ) -> tuple[torch.Tensor, list[HiftCache]]:
        """chunk_mel [B, 80, F] -> emitted samples [B, N] and the updated per-stream caches."""
        mel = torch.cat([torch.cat([c.mel for c in caches], dim=0), chunk_mel], dim=2)
        f0 = self.f0_fn(mel)
        source = nsf_source(self.hift, f0, generators)
        cached = caches[0].source.shape[2]
        if cached:
            source[:, :, :cached] = torch.cat([c.source for c in caches], dim=0)
        speech = hift_istft(self.hift, self.decode_fn(mel, source))
        tail = caches[0].speech.shape[1]
        if tail:
            prev = torch.cat([c.speech for c in caches], dim=0)
            half = self.holdback
            faded = speech[:, :half] * self.window[:half] + prev[:, -half:] * self.window[half:]
            speech = speech.clone()
            speech[:, :half] = faded
        new_caches = [
            HiftCache(
                mel=mel[i : i + 1, :, -MEL_CACHE_FRAMES:].clone(),
                source=source[i : i + 1, :, -self.holdback :].clone(),
                speech=speech[i : i + 1, -self.holdback :].clone(),
            )
            for i in range(mel.shape[0])
        ]
        emitted = speech if last else speech[:, : -self.holdback]
        return emitted, new_caches
