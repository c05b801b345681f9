"""SigLIP "navit" vision tower and the perceiver resampler that turns each slice into query rows.

The tower sees a batch of slices of different patch grids. Every slice arrives in *patch layout*
(``[3, patch, patch * n_patches]``: the patches laid side by side, as the processor writes them), so a
batch is padded along the width only. Two details make the outputs match the reference numerically:

* position ids are not ``row * w + col``: each slice's fractional patch coordinates are bucketed into
  the learned ``side x side`` table (70 x 70 for a 980 px table and 14 px patches), so any grid up to
  70 x 70 patches maps onto the same table;
* padded patches are excluded from attention with a per-slice key mask, and from the resampler with a
  key-padding mask, so a slice's embedding does not depend on what it is batched with.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers.activations import ACT2FN

from services.common.sdpa import attention
from services.thinker.model.config import VisionDims


def bucketed_position_ids(grid_h: int, grid_w: int, side: int) -> torch.Tensor:
    """Flat position ids (length ``grid_h * grid_w``) of a patch grid in the ``side x side`` table.

    Fractional coordinates ``k / n`` (computed in float32, as the reference does) are bucketed against
    the boundaries ``1/side, 2/side, ...``; the float32 arithmetic matters at bucket edges.
    """
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32)
    # The step 1/n is computed in float32 (a tensor division), then passed on as that float32 value.
    step_h = (1 / torch.tensor(grid_h, dtype=torch.int32)).item()
    step_w = (1 / torch.tensor(grid_w, dtype=torch.int32)).item()
    frac_h = torch.arange(0, 1 - 1e-6, step_h, dtype=torch.float32)
    frac_w = torch.arange(0, 1 - 1e-6, step_w, dtype=torch.float32)
    rows = torch.bucketize(frac_h, boundaries, right=True)
    cols = torch.bucketize(frac_w, boundaries, right=True)
    return (rows[:, None] * side + cols).flatten()


class VisionEmbeddings(nn.Module):
    """Per-patch linear embedding (a stride-``patch`` convolution) plus bucketed learned positions."""

    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        self.side = dims.patches_per_side
        self.patch_size = dims.patch_size
        self.patch_embedding = nn.Conv2d(
            3, dims.hidden_size, kernel_size=dims.patch_size, stride=dims.patch_size
        )
        self.position_embedding = nn.Embedding(self.side * self.side, dims.hidden_size)

    def forward(self, pixels: torch.Tensor, tgt_sizes: torch.Tensor) -> torch.Tensor:
        """``pixels`` [B, 3, patch, patch * max_patches] -> [B, max_patches, D]."""
        batch = pixels.shape[0]
        emb = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        max_patches = emb.shape[1]
        position_ids = torch.zeros(batch, max_patches, dtype=torch.long)
        for i in range(batch):
            h, w = int(tgt_sizes[i, 0]), int(tgt_sizes[i, 1])
            position_ids[i, : h * w] = bucketed_position_ids(h, w, self.side)
        return emb + self.position_embedding(position_ids.to(emb.device))


class VisionAttention(nn.Module):
    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        d = dims.hidden_size
        self.num_heads = dims.num_heads
        self.head_dim = d // dims.num_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        out = attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dims.hidden_size, dims.intermediate_size)
        self.fc2 = nn.Linear(dims.intermediate_size, dims.hidden_size)
        self.act = ACT2FN[dims.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer block (SigLIP naming, so checkpoint keys load as-is)."""

    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)
        self.self_attn = VisionAttention(dims)
        self.layer_norm2 = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)
        self.mlp = VisionMLP(dims)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        self.layers = nn.ModuleList([VisionEncoderLayer(dims) for _ in range(dims.num_layers)])


class SiglipNavitTower(nn.Module):
    """Embeddings -> ``num_layers`` encoder blocks -> post LayerNorm (no pooling head)."""

    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        self.dims = dims
        self.embeddings = VisionEmbeddings(dims)
        self.encoder = VisionEncoder(dims)
        self.post_layernorm = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, tgt_sizes: torch.Tensor) -> torch.Tensor:
        """``pixels`` [B, 3, patch, patch * max_patches], ``tgt_sizes`` [B, 2] (h, w in patches)."""
        x = self.embeddings(pixels, tgt_sizes)
        lengths = (tgt_sizes[:, 0] * tgt_sizes[:, 1]).to(x.device)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
        # Only build a mask when some slice is padded: a full batch then runs unmasked attention.
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


def sincos_2d(embed_dim: int, grid_h: int, grid_w: int) -> np.ndarray:
    """Fixed 2-D sin-cos table ``[grid_h, grid_w, embed_dim]`` (float32, computed in NumPy float32).

    The first half of the channels encodes the column index, the second half the row index; each half
    is ``[sin(p * w_k), cos(p * w_k)]`` with ``w_k = 10000 ** (-k / (half / 2))``.
    """
    half = embed_dim // 2

    def encode(pos: np.ndarray) -> np.ndarray:
        freqs = np.arange(half // 2, dtype=np.float32)
        freqs /= half / 2.0
        freqs = 1.0 / 10000**freqs
        angles = np.einsum("hw,d->hwd", pos, freqs)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)

    cols, rows = np.meshgrid(np.arange(grid_w, dtype=np.float32), np.arange(grid_h, dtype=np.float32))
    return np.concatenate([encode(cols), encode(rows)], axis=-1)


class Resampler(nn.Module):
    """Perceiver resampler: ``query_num`` learned queries cross-attend to one slice's patch features.

    Keys get the 2-D sin-cos position of their patch; values do not. Output: ``[B, query_num, H]``.
    """

    def __init__(self, query_num: int, embed_dim: int, num_heads: int, kv_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Parameter(torch.zeros(query_num, embed_dim))
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_q = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_kv = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_post = nn.LayerNorm(embed_dim, eps=1e-6)
        self.proj = nn.Parameter(torch.zeros(embed_dim, embed_dim))
        self._pos_cache: dict[tuple[int, int], torch.Tensor] = {}

    def _positions(self, h: int, w: int) -> torch.Tensor:
        key = (h, w)
        if key not in self._pos_cache:
            self._pos_cache[key] = torch.from_numpy(sincos_2d(self.embed_dim, h, w)).reshape(h * w, -1)
        return self._pos_cache[key]

    def forward(self, feats: torch.Tensor, tgt_sizes: torch.Tensor) -> torch.Tensor:
        """``feats`` [B, max_patches, kv_dim] (padded), ``tgt_sizes`` [B, 2] -> [B, query_num, H]."""
        batch, max_patches = feats.shape[0], feats.shape[1]
        device, dtype = feats.device, feats.dtype
        pos = torch.zeros(batch, max_patches, self.embed_dim, dtype=dtype, device=device)
        pad = torch.ones(batch, max_patches, dtype=torch.bool, device=device)
        for i in range(batch):
            h, w = int(tgt_sizes[i, 0]), int(tgt_sizes[i, 1])
            pos[i, : h * w] = self._positions(h, w).to(device=device, dtype=dtype)
            pad[i, : h * w] = False
        kv = self.ln_kv(self.kv_proj(feats)).transpose(0, 1)  # [L, B, H]
        q = self.ln_q(self.query).unsqueeze(1).expand(-1, batch, -1)  # [Q, B, H]
        out = self.attn(q, kv + pos.transpose(0, 1), kv, key_padding_mask=pad, need_weights=False)[0]
        return self.ln_post(out.transpose(0, 1)) @ self.proj
