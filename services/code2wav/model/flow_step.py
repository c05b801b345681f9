"""Streaming flow step (codec tokens -> mel) for a batch of streams, with caches sized from the model.

The math is the Step-Audio2 ``CausalMaskedDiffWithXvec.inference_chunk`` path: conformer encoder with
per-stream conv/attention caches, then a 10-step Euler solve of the CFM ODE on the cosine schedule with
classifier-free guidance, where every step of the DiT estimator reads and extends its own per-step
attention cache. We call the package's modules (encoder ``forward_chunk``, the DiT's embedder, blocks and
final layer) but not its ``DiT.forward_chunk``/``CausalConditionalCFM.forward_chunk`` drivers, because
those write into fixed batch-1 scratch buffers; running the blocks ourselves lets rows of several streams
share one batch (conditional rows first, then the unconditional CFG rows) and keeps cache memory at what
the model needs.

Cache layout per stream (batch dimension of size 1, or 2 for the estimator's cond/uncond pair):

* ``conformer_cnn``  [1, C, 2 + 2*up]           pre-lookahead conv tail + upsample conv tail
* ``conformer_att``  [layers, 1, heads, T, 2*dk]  keys|values, oldest first
* ``estimator_cnn``  [steps, depth, 2, 2*hidden, 2]
* ``estimator_att``  [steps, depth, 2, heads, T, 2*hd]  keys|values, **newest first** (the DiT block
  prepends the new chunk; its attention has no positions, so order only matters for trimming)

After each window both attention caches are trimmed exactly like the reference streaming driver: when
longer than ``prompt_frames + 100`` keep the first ``prompt_frames`` and the last 100 entries. The CFM
noise of a window is read from the stream's noise table at offset = estimator cache length (0 during
prompt setup), which is the reference's offset rule (docs/model.md, Code2Wav).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from services.code2wav.model.loader import Token2WavModel
from services.code2wav.model.time_grid import cosine_time_span

HISTORY_FRAMES = 100  # frames kept beyond the prompt when trimming attention caches (reference value)

# estimator(x, mu, temb, spks, cond, cnn_cache | None, att_cache | None) -> (velocity, new_cnn, new_att)
EstimatorFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor | None,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


@dataclass
class FlowCache:
    """Per-stream (or, stacked, per-batch) flow caches; see the module docstring for shapes."""

    conformer_cnn: torch.Tensor
    conformer_att: torch.Tensor
    estimator_cnn: torch.Tensor
    estimator_att: torch.Tensor

    @property
    def att_frames(self) -> int:
        """Estimator attention-cache length in mel frames: also the CFM noise offset of the next window."""
        return int(self.estimator_att.shape[4])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.conformer_cnn, self.conformer_att, self.estimator_cnn, self.estimator_att)

    def signature(self) -> tuple[int, ...]:
        """Shape key: windows of streams with equal signatures can share a batch."""
        return (self.conformer_att.shape[3], self.estimator_att.shape[4], self.conformer_cnn.shape[2])

    def to(self, dtype: torch.dtype, est_dtype: torch.dtype | None = None) -> FlowCache:
        """Cast (conformer caches to ``dtype``, estimator caches to ``est_dtype``, default ``dtype``)."""
        est = dtype if est_dtype is None else est_dtype
        return FlowCache(
            self.conformer_cnn.to(dtype),
            self.conformer_att.to(dtype),
            self.estimator_cnn.to(est),
            self.estimator_att.to(est),
        )


def stack_caches(
    caches: list[FlowCache], dtype: torch.dtype, est_dtype: torch.dtype | None = None
) -> FlowCache:
    """Stack per-stream caches into one batch; estimator rows become [cond_0..cond_B, uncond_0..uncond_B].

    Conformer caches come out in ``dtype``, estimator caches in ``est_dtype`` (default ``dtype``)."""
    est_dtype = dtype if est_dtype is None else est_dtype
    est_cnn = [c.estimator_cnn for c in caches]
    est_att = [c.estimator_att for c in caches]
    return FlowCache(
        conformer_cnn=torch.cat([c.conformer_cnn for c in caches], dim=0).to(dtype),
        conformer_att=torch.cat([c.conformer_att for c in caches], dim=1).to(dtype),
        estimator_cnn=torch.cat([t[:, :, :1] for t in est_cnn] + [t[:, :, 1:] for t in est_cnn], dim=2).to(
            est_dtype
        ),
        estimator_att=torch.cat([t[:, :, :1] for t in est_att] + [t[:, :, 1:] for t in est_att], dim=2).to(
            est_dtype
        ),
    )


def split_caches(
    batch: FlowCache, dtype: torch.dtype, est_dtype: torch.dtype | None = None
) -> list[FlowCache]:
    """Inverse of :func:`stack_caches`; every stream gets its own (contiguous) copy in ``dtype``
    (estimator caches in ``est_dtype``, default ``dtype``)."""
    est_dtype = dtype if est_dtype is None else est_dtype
    n = batch.conformer_cnn.shape[0]
    out = []
    for i in range(n):
        out.append(
            FlowCache(
                conformer_cnn=batch.conformer_cnn[i : i + 1].to(dtype, copy=True),
                conformer_att=batch.conformer_att[:, i : i + 1].to(dtype, copy=True),
                estimator_cnn=torch.cat(
                    [batch.estimator_cnn[:, :, i : i + 1], batch.estimator_cnn[:, :, n + i : n + i + 1]],
                    dim=2,
                ).to(est_dtype),
                estimator_att=torch.cat(
                    [batch.estimator_att[:, :, i : i + 1], batch.estimator_att[:, :, n + i : n + i + 1]],
                    dim=2,
                ).to(est_dtype),
            )
        )
    return out


def trim_caches(cache: FlowCache, prompt_frames: int) -> FlowCache:
    """Bound cache growth: keep the first ``prompt_frames`` and the last 100 entries (reference rule)."""
    limit = prompt_frames + HISTORY_FRAMES
    est, conf = cache.estimator_att, cache.conformer_att
    if est.shape[4] > limit:
        est = torch.cat([est[:, :, :, :, :prompt_frames], est[:, :, :, :, -HISTORY_FRAMES:]], dim=4)
    if conf.shape[3] > limit:
        conf = torch.cat([conf[:, :, :, :prompt_frames], conf[:, :, :, -HISTORY_FRAMES:]], dim=3)
    return replace(cache, estimator_att=est, conformer_att=conf)


def max_cache_bytes(
    model: Token2WavModel,
    prompt_frames: int,
    n_timesteps: int,
    dtype: torch.dtype,
    est_dtype: torch.dtype | None = None,
) -> int:
    """Upper bound of one stream's flow-cache bytes between windows (after trimming); conformer caches
    in ``dtype``, estimator caches in ``est_dtype`` (default ``dtype``)."""
    d = model.dims
    frames = prompt_frames + HISTORY_FRAMES
    conformer = d.encoder_layers * d.encoder_heads * frames * 2 * d.encoder_head_dim
    conformer += d.encoder_channels * (2 + 2 * d.up_rate)
    estimator = n_timesteps * d.dit_depth * 2 * d.dit_heads * frames * 2 * d.dit_head_dim
    estimator += n_timesteps * d.dit_depth * 2 * 2 * d.dit_hidden * 2
    est_elem = (dtype if est_dtype is None else est_dtype).itemsize
    return conformer * dtype.itemsize + estimator * est_elem


def timestep_embedding(dit: Any, t: torch.Tensor) -> torch.Tensor:
    """DiT time conditioning [R] -> [R, 1, hidden]. Kept out of CUDA graphs: the package builds its
    frequency table on the host and copies it to the device on every call."""
    return dit.t_embedder(t).unsqueeze(1)


def dit_blocks_chunk(
    dit: Any,
    x: torch.Tensor,
    mu: torch.Tensor,
    temb: torch.Tensor,
    spks: torch.Tensor,
    cond: torch.Tensor,
    cnn_cache: torch.Tensor | None,
    att_cache: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DiT evaluation on a chunk with caches: x/mu/cond [R, 80, T], temb [R, 1, hidden], spks [R, 80].

    Returns the velocity [R, 80, T], the new conv cache [depth, R, 2*hidden, 2] and the new attention
    cache [depth, R, heads, L + T, 2*hd] (new frames first, as the blocks build it).
    """
    frames = x.shape[2]
    h = torch.cat([x, mu, spks.unsqueeze(2).expand(-1, -1, frames), cond], dim=1)
    h = dit.in_proj(h.transpose(1, 2))
    new_cnn, new_att = [], []
    for i, block in enumerate(dit.blocks):
        h, cnn_i, att_i = block.forward_chunk(
            h,
            temb,
            None if cnn_cache is None else cnn_cache[i],
            None if att_cache is None else att_cache[i],
            None,
        )
        new_cnn.append(cnn_i)
        new_att.append(att_i)
    out = dit.final_layer(h, temb).transpose(1, 2)
    return out, torch.stack(new_cnn), torch.stack(new_att)


# solver(z, mu, spks, cond, cnn_caches | None, att_caches | None) -> (x, per-step cnn, per-step att)
SolverFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# encoder(tokens, conformer_cnn, conformer_att) -> (mu [B, 80, T], new conformer cnn, new conformer att)
EncoderFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]

DIT_IMPLS = ("package", "fused")


class FlowStepper:
    """Runs prompt setup and streaming windows of the flow model for batches of streams.

    ``dit`` picks the estimator path: ``package`` runs the package's DiT blocks once per Euler step
    (:meth:`_solve`, the reference the others are checked against); ``fused`` runs the whole solve
    through :class:`services.code2wav.model.fused_dit.FusedDiTSolver` in ``dit_dtype`` (fp32 or bf16),
    which needs no host work between steps, so the CUDA-graph runner captures the 10 steps as one graph.
    The caches a window produces are in :attr:`compute_dtype` (bf16 with a bf16 DiT).
    """

    def __init__(
        self,
        model: Token2WavModel,
        n_timesteps: int = 10,
        dit: str = "package",
        dit_dtype: torch.dtype = torch.float32,
    ) -> None:
        if dit not in DIT_IMPLS:
            raise ValueError(f"dit must be one of {DIT_IMPLS}, got {dit!r}")
        if dit == "package" and dit_dtype != torch.float32:
            raise ValueError("the package DiT path computes in fp32 only; use dit='fused' for bf16")
        self.model = model
        self.flow = model.flow
        self.dit = model.flow.decoder.estimator
        self.n_timesteps = n_timesteps
        self.cfg_rate = model.dims.cfg_rate
        self.dit_impl = dit
        self.compute_dtype = dit_dtype
        # Per-CFM-step estimator callables; the CUDA-graph runner replaces these on GPU.
        self.estimator: EstimatorFn = self._eager_estimator
        self.fused = None
        self.solver: SolverFn = self._solve
        if dit == "fused":
            from services.code2wav.model.fused_dit import FusedDiTSolver

            self.fused = FusedDiTSolver(self.dit, n_timesteps, self.cfg_rate, dit_dtype)
            self.solver = self.fused.solve
        self.eager_solver: SolverFn = self.solver  # prompt setup: once per voice, never graphed
        self.encode: EncoderFn = self._encode_eager
        self.encode_last: EncoderFn = functools.partial(self._encode_eager, last=True)

    def _encode_eager(
        self, tokens: torch.Tensor, cnn_cache: torch.Tensor, att_cache: torch.Tensor, last: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token embedding, conformer chunk with caches and projection: mu [B, 80, T] and new caches."""
        xs = self.flow.input_embedding(tokens)
        h, conf_cnn, conf_att = self.flow.encoder.forward_chunk(
            xs=xs, last_chunk=last, cnn_cache=cnn_cache, att_cache=att_cache
        )
        return self.flow.encoder_proj(h).transpose(1, 2).contiguous(), conf_cnn, conf_att

    def _eager_estimator(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        temb: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        cnn_cache: torch.Tensor | None,
        att_cache: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dit_blocks_chunk(self.dit, x, mu, temb, spks, cond, cnn_cache, att_cache)

    def project_speaker(self, spk_emb: torch.Tensor) -> torch.Tensor:
        """x-vector [B, 192] -> speaker condition [B, 80] (L2-normalised, affine)."""
        return self.flow.spk_embed_affine_layer(F.normalize(spk_emb, dim=1))

    def _solve(
        self,
        z: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        cnn_cache: torch.Tensor | None,
        att_cache: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Euler-integrate the guided ODE from noise ``z`` [B, 80, T]; returns x and the per-step caches."""
        batch = z.shape[0]
        t_span = cosine_time_span(self.n_timesteps, z.device, z.dtype)
        t = t_span[0].unsqueeze(0)
        dt = t_span[1] - t_span[0]
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)
        spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)
        x = z
        cnn_out: torch.Tensor | None = None
        att_out: torch.Tensor | None = None
        for step in range(1, self.n_timesteps + 1):
            velocity, cnn_new, att_new = self.estimator(
                torch.cat([x, x], dim=0),
                mu_in,
                timestep_embedding(self.dit, t.expand(2 * batch)),
                spks_in,
                cond_in,
                None if cnn_cache is None else cnn_cache[step - 1],
                None if att_cache is None else att_cache[step - 1],
            )
            v_cond, v_uncond = velocity[:batch], velocity[batch:]
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            t = t + dt
            if step < self.n_timesteps:
                dt = t_span[step + 1] - t
            # Copy each step's caches out at once: a graphed estimator reuses its output buffers.
            if cnn_out is None or att_out is None:
                cnn_out = cnn_new.new_empty((self.n_timesteps, *cnn_new.shape))
                att_out = att_new.new_empty((self.n_timesteps, *att_new.shape))
            cnn_out[step - 1].copy_(cnn_new)
            att_out[step - 1].copy_(att_new)
        assert cnn_out is not None and att_out is not None
        return x, cnn_out, att_out

    @torch.inference_mode()
    def setup(
        self,
        prompt_tokens: torch.Tensor,
        prompt_mel: torch.Tensor,
        spk_cond: torch.Tensor,
        noise: torch.Tensor,
    ) -> FlowCache:
        """Prime one stream: prompt tokens + ``lookahead`` silence tokens [1, P+3], prompt mel [1, 2P, 80]."""
        d = self.model.dims
        if (prompt_tokens.shape[1] - d.lookahead) * d.up_rate != prompt_mel.shape[1]:
            raise ValueError(
                f"prompt tokens {tuple(prompt_tokens.shape)} do not match mel {tuple(prompt_mel.shape)}"
            )
        xs = self.flow.input_embedding(prompt_tokens)
        h, conf_cnn, conf_att = self.flow.encoder.forward_chunk(
            xs=xs, last_chunk=False, cnn_cache=None, att_cache=None
        )
        mu = self.flow.encoder_proj(h).transpose(1, 2).contiguous()
        z = noise[:, :, : mu.shape[2]]
        _, est_cnn, est_att = self.eager_solver(
            z, mu, spk_cond, prompt_mel.transpose(1, 2).contiguous(), None, None
        )
        return FlowCache(conf_cnn, conf_att, est_cnn, est_att)

    @torch.inference_mode()
    def step(
        self,
        tokens: torch.Tensor,
        spk_cond: torch.Tensor,
        cache: FlowCache,
        noise: torch.Tensor,
        last: bool,
        prompt_frames: int,
    ) -> tuple[torch.Tensor, FlowCache]:
        """One streaming window for B streams: tokens [B, T] -> mel [B, 80, F]; caches stacked (B rows).

        ``noise`` [B, 80, N] holds each stream's noise table; the window reads it at the cache offset.
        """
        encode = self.encode_last if last else self.encode
        mu, conf_cnn, conf_att = encode(tokens, cache.conformer_cnn, cache.conformer_att)
        offset = cache.att_frames
        frames = mu.shape[2]
        if offset + frames > noise.shape[2]:
            raise ValueError(f"noise table too short: need {offset + frames} frames, have {noise.shape[2]}")
        z = noise[:, :, offset : offset + frames]
        mel, est_cnn, est_att = self.solver(
            z, mu, spk_cond, torch.zeros_like(mu), cache.estimator_cnn, cache.estimator_att
        )
        new_cache = trim_caches(FlowCache(conf_cnn, conf_att, est_cnn, est_att), prompt_frames)
        return mel, new_cache
