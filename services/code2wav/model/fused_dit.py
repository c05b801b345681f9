"""The whole guided CFM solve of the DiT estimator in fewer, larger kernels (fp32 or bf16).

Same math as :func:`services.code2wav.model.flow_step.dit_blocks_chunk` driven by
:meth:`FlowStepper._solve` (the package's blocks), rearranged so that one Euler step launches about half
the kernels and no step needs the host:

* **Time conditioning is constant.** The solve's time grid is fixed (cosine schedule, ``n_timesteps``),
  and every adaLN modulation depends on the time embedding only, so the 17 modulations of each step
  (16 blocks + final layer) are computed once here, not per step; ``scale`` is stored as ``1 + scale`` so
  that a modulation is one ``addcmul``. This also removes the host-built frequency table the package's
  time embedder copies to the device on every call, which is what kept the 10-step loop out of one
  CUDA graph.
* **The input projection is split.** Of ``in_proj([x, mu, spks, cond])`` only the ``x`` part changes
  between steps (and is the same for the conditional and unconditional rows); the rest is computed once
  per window.
* **q/k/v as one GEMM**, the two per-head LayerNorms as one normalisation plus one ``addcmul``, the new
  keys/values written straight into the caller's cache tensor (``torch.cat(..., out=)``), attention
  through SDPA (:mod:`services.common.sdpa`: flash kernels in bf16 on CUDA, never cuDNN attention).
* **The causal convolutions as GEMMs** on the (rows, time, channels) layout: the cached 2 frames and
  the window are unfolded into [rows, T, C*3] and multiplied by the weight viewed as [out, C*3], instead
  of transposing to channels-first around a cuDNN conv (whose layout conversions cost 12% of device
  time in the profile, BENCHMARKS.md).

Precision: the Euler state ``x`` and the velocity combination stay fp32; with ``dtype=bfloat16`` the DiT
weights, activations and its attention/conv caches are bf16 (LayerNorm and softmax accumulate in fp32
inside their kernels). The fp32 variant matches the package path to float rounding (tests); the bf16
error against it is stated in BENCHMARKS.md (``bench.cuda_smoke --stages code2wav``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.code2wav.model.time_grid import cosine_time_span
from services.common.sdpa import attention


@dataclass
class _Block:
    """One DiT block's weights, re-laid-out for the fused step (see the module docstring)."""

    w_qkv: torch.Tensor  # [3 * inner, hidden]
    b_qkv: torch.Tensor
    qk_w: torch.Tensor  # [2, 1, head_dim]: q_norm / k_norm weights, broadcast over heads
    qk_b: torch.Tensor
    qk_eps: float
    w_proj: torch.Tensor
    b_proj: torch.Tensor
    w_conv1: torch.Tensor  # [hidden, hidden * 3]  (Conv1d weight [out, in, 3] viewed flat)
    b_conv1: torch.Tensor
    conv_ln_w: torch.Tensor
    conv_ln_b: torch.Tensor
    conv_ln_eps: float
    w_conv2: torch.Tensor
    b_conv2: torch.Tensor
    w_fc1: torch.Tensor
    b_fc1: torch.Tensor
    w_fc2: torch.Tensor
    b_fc2: torch.Tensor


def _block_weights(block: Any, dtype: torch.dtype) -> _Block:
    """``block`` is one of stepaudio2's (untyped) DiT blocks; its submodules are read by name."""
    att, conv, mlp = block.attn, block.conv.block, block.mlp
    if att.q_norm.eps != att.k_norm.eps:
        raise ValueError("fused DiT needs equal q_norm / k_norm eps")

    def c(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).contiguous()

    conv1, conv_ln, conv2 = conv[1], conv[3], conv[6]
    return _Block(
        w_qkv=c(torch.cat([att.to_q.weight, att.to_k.weight, att.to_v.weight])),
        b_qkv=c(torch.cat([att.to_q.bias, att.to_k.bias, att.to_v.bias])),
        qk_w=c(torch.stack([att.q_norm.weight, att.k_norm.weight]).unsqueeze(1)),
        qk_b=c(torch.stack([att.q_norm.bias, att.k_norm.bias]).unsqueeze(1)),
        qk_eps=float(att.q_norm.eps),
        w_proj=c(att.proj.weight),
        b_proj=c(att.proj.bias),
        w_conv1=c(conv1.weight.reshape(conv1.out_channels, -1)),
        b_conv1=c(conv1.bias),
        conv_ln_w=c(conv_ln.weight),
        conv_ln_b=c(conv_ln.bias),
        conv_ln_eps=float(conv_ln.eps),
        w_conv2=c(conv2.weight.reshape(conv2.out_channels, -1)),
        b_conv2=c(conv2.bias),
        w_fc1=c(mlp.fc1.weight),
        b_fc1=c(mlp.fc1.bias),
        w_fc2=c(mlp.fc2.weight),
        b_fc2=c(mlp.fc2.bias),
    )


def _causal_conv(
    x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Kernel-3 causal conv of x [R, T, C] after the cached frames ``cache`` [R, 2, C], as one GEMM."""
    padded = torch.cat([cache, x], dim=1)  # [R, T + 2, C]
    windows = padded.unfold(1, 3, 1)  # [R, T, C, 3]: (channel, tap) like the Conv1d weight
    return F.linear(windows.reshape(x.shape[0], x.shape[1], -1), weight, bias)


class FusedDiTSolver:
    """Runs the 10-step guided Euler solve of one window (or the prompt setup) for a batch of streams.

    Built once per model from the package DiT's weights; holds its own re-laid-out copies (fp32 or bf16).
    :meth:`solve` has the signature and cache layouts of ``FlowStepper._solve``.
    """

    def __init__(
        self, dit: Any, n_timesteps: int, cfg_rate: float, dtype: torch.dtype = torch.float32
    ) -> None:
        param = next(dit.parameters())
        device = param.device
        self.dtype = dtype
        self.n_timesteps = n_timesteps
        self.cfg_rate = float(cfg_rate)
        self.hidden = int(dit.in_proj.out_features)
        self.mel_bins = int(dit.out_channels)
        att = dit.blocks[0].attn
        self.heads, self.head_dim = int(att.num_heads), int(att.head_dim)
        self.depth = len(dit.blocks)
        with torch.no_grad():
            # The time grid and step sizes exactly as FlowStepper._solve accumulates them.
            t_span = cosine_time_span(n_timesteps, device, torch.float32)
            t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
            times, steps = [], []
            for step in range(1, n_timesteps + 1):
                times.append(t)
                steps.append(dt.reshape(()))
                t = t + dt
                if step < n_timesteps:
                    dt = t_span[step + 1] - t
            temb = dit.t_embedder(torch.cat(times).to(param.dtype))  # [steps, hidden]
            self.dts = torch.stack(steps).float()  # [steps] fp32, indexed inside the solve
            mods = []
            for block in dit.blocks:
                m = block.adaLN_modulation(temb).view(n_timesteps, 9, self.hidden).clone()
                m[:, 1::3] += 1  # scale_msa, scale_mlp, scale_conv -> 1 + scale
                mods.append(m)
            self.mods = torch.stack(mods, dim=1).to(dtype)  # [steps, depth, 9, hidden]
            final = dit.final_layer.adaLN_modulation(temb).view(n_timesteps, 2, self.hidden).clone()
            final[:, 1] += 1
            self.final_mods = final.to(dtype)  # [steps, 2, hidden]
            w_in = dit.in_proj.weight.detach()
            self.w_in_x = w_in[:, : self.mel_bins].to(dtype).contiguous()
            self.w_in_rest = w_in[:, self.mel_bins :].to(dtype).contiguous()
            self.b_in = dit.in_proj.bias.detach().to(dtype)
            self.w_out = dit.final_layer.linear.weight.detach().to(dtype)
            self.b_out = dit.final_layer.linear.bias.detach().to(dtype)
        self.blocks = [_block_weights(b, dtype) for b in dit.blocks]

    # ------------------------------------------------------------------ one block
    def _block(
        self,
        p: _Block,
        x: torch.Tensor,
        mod: torch.Tensor,
        cnn_cache: torch.Tensor | None,
        att_cache: torch.Tensor | None,
        cnn_out: torch.Tensor,
        att_out: torch.Tensor,
    ) -> torch.Tensor:
        """x [R, T, hidden] -> x; writes the new conv cache [R, 2h, 2] and attention cache
        [R, heads, T + L, 2*hd] (new frames first) into ``cnn_out`` / ``att_out``."""
        rows, frames, hidden = x.shape
        heads, hd = self.heads, self.head_dim
        # attention
        a = torch.addcmul(mod[0], F.layer_norm(x, (hidden,), eps=1e-6), mod[1])
        qkv = F.linear(a, p.w_qkv, p.b_qkv).view(rows, frames, 3, heads, hd)
        qk = torch.addcmul(p.qk_b, F.layer_norm(qkv[:, :, :2], (hd,), eps=p.qk_eps), p.qk_w)
        kv_new = torch.cat([qk[:, :, 1], qkv[:, :, 2]], dim=-1).transpose(1, 2)  # [R, heads, T, 2hd]
        if att_cache is None:
            att_out.copy_(kv_new)
        else:
            torch.cat([kv_new, att_cache], dim=2, out=att_out)
        o = attention(qk[:, :, 0].transpose(1, 2), att_out[..., :hd], att_out[..., hd:])  # never cuDNN
        o = F.linear(o.transpose(1, 2).reshape(rows, frames, heads * hd), p.w_proj, p.b_proj)
        x = torch.addcmul(x, mod[2], o)
        # causal conv block (caches are channels-first [R, 2h, 2] like the package's)
        c = torch.addcmul(mod[6], F.layer_norm(x, (hidden,), eps=1e-6), mod[7])
        if cnn_cache is None:
            cache1 = cache2 = x.new_zeros(rows, 2, hidden)
        else:
            cache1 = cnn_cache[:, :hidden].transpose(1, 2)
            cache2 = cnn_cache[:, hidden:].transpose(1, 2)
        tail1 = torch.cat([cache1, c], dim=1)[:, -2:]
        c = _causal_conv(c, cache1, p.w_conv1, p.b_conv1)
        c = F.mish(F.layer_norm(c, (hidden,), p.conv_ln_w, p.conv_ln_b, p.conv_ln_eps))
        tail2 = torch.cat([cache2, c], dim=1)[:, -2:]
        c = _causal_conv(c, cache2, p.w_conv2, p.b_conv2)
        torch.cat([tail1.transpose(1, 2), tail2.transpose(1, 2)], dim=1, out=cnn_out)
        x = torch.addcmul(x, mod[8], c)
        # mlp
        m = torch.addcmul(mod[3], F.layer_norm(x, (hidden,), eps=1e-6), mod[4])
        m = F.linear(F.gelu(F.linear(m, p.w_fc1, p.b_fc1), approximate="tanh"), p.w_fc2, p.b_fc2)
        return torch.addcmul(x, mod[5], m)

    # ------------------------------------------------------------------ the solve
    def solve(
        self,
        z: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        cnn_cache: torch.Tensor | None,
        att_cache: torch.Tensor | None,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Euler-integrate from noise ``z`` [B, 80, T]; returns (x [B, 80, T] fp32, per-step conv caches
        [steps, depth, 2B, 2h, 2], per-step attention caches [steps, depth, 2B, heads, L + T, 2hd]).

        ``cnn_cache`` / ``att_cache`` are the stream caches ([steps, depth, 2B, ...], rows cond first) or
        None (prompt setup). ``out`` gives the three result tensors to fill (a CUDA graph's output
        buffers); otherwise they are allocated."""
        batch, _, frames = z.shape
        dtype = self.dtype
        past = 0 if att_cache is None else int(att_cache.shape[4])
        if out is None:
            x_out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
            cnn_out = z.new_empty((self.n_timesteps, self.depth, 2 * batch, 2 * self.hidden, 2), dtype=dtype)
            att_out = z.new_empty(
                (self.n_timesteps, self.depth, 2 * batch, self.heads, past + frames, 2 * self.head_dim),
                dtype=dtype,
            )
        else:
            x_out, cnn_out, att_out = out
        # Constant part of the input projection, rows [cond_0..cond_B, uncond_0..uncond_B].
        rest = torch.cat([mu, spks.unsqueeze(2).expand(-1, -1, frames), cond], dim=1).transpose(1, 2)
        const = F.linear(rest.to(dtype), self.w_in_rest, self.b_in)  # [B, T, h]
        const = torch.stack([const, self.b_in.expand_as(const)])  # uncond rows: zeros in, bias out
        x = z.float()
        for step in range(self.n_timesteps):
            h = (const + F.linear(x.transpose(1, 2).to(dtype), self.w_in_x)).view(2 * batch, frames, -1)
            for i, p in enumerate(self.blocks):
                h = self._block(
                    p,
                    h,
                    self.mods[step, i],
                    None if cnn_cache is None else cnn_cache[step, i],
                    None if att_cache is None else att_cache[step, i],
                    cnn_out[step, i],
                    att_out[step, i],
                )
            fm = self.final_mods[step]
            h = torch.addcmul(fm[0], F.layer_norm(h, (self.hidden,), eps=1e-6), fm[1])
            velocity = F.linear(h, self.w_out, self.b_out).transpose(1, 2).float()  # [2B, 80, T]
            guided = (1.0 + self.cfg_rate) * velocity[:batch] - self.cfg_rate * velocity[batch:]
            x = x + self.dts[step] * guided
        x_out.copy_(x)
        return x_out, cnn_out, att_out
