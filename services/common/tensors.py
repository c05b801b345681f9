"""Conversions between torch tensors and the proto ``Tensor`` message (audio ``Pcm``: :mod:`services.common.pcm`).

The dtype always travels with the bytes (bf16 in production, fp32 in fidelity tests), so a receiver never
guesses. bf16 has no numpy dtype; it crosses as its raw 16-bit pattern and is rebuilt with ``view``.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.pb import common_pb2

_TORCH_TO_PB: dict[torch.dtype, common_pb2.DType] = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.int64: common_pb2.DTYPE_INT64,
    torch.int32: common_pb2.DTYPE_INT32,
}
# Compute dtype names as stage CLIs and deploy profiles spell them.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_PB_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in _TORCH_TO_PB.items()}
_ITEMSIZE: dict[torch.dtype, int] = {
    torch.float32: 4,
    torch.bfloat16: 2,
    torch.float16: 2,
    torch.int64: 8,
    torch.int32: 4,
}


def compute_dtype(name: str | None, device: str) -> torch.dtype:
    """A stage's ``--dtype``: the named dtype, or bf16 on CUDA and fp32 on CPU when none is given."""
    if name is None:
        name = "bfloat16" if device.startswith("cuda") else "float32"
    return TORCH_DTYPES[name]


def dtype_to_proto(dtype: torch.dtype) -> common_pb2.DType:
    if dtype not in _TORCH_TO_PB:
        raise StageError(INVALID_ARGUMENT, f"dtype {dtype} cannot be sent as a Tensor message")
    return _TORCH_TO_PB[dtype]


def dtype_from_proto(code: int) -> torch.dtype:
    if code not in _PB_TO_TORCH:
        raise StageError(INVALID_ARGUMENT, f"unsupported tensor dtype code {code}", "dtype")
    return _PB_TO_TORCH[code]


def tensor_to_proto(t: torch.Tensor, dtype: torch.dtype | None = None) -> common_pb2.Tensor:
    """Serialise ``t`` (any device) as a contiguous little-endian Tensor message, optionally cast."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
    return common_pb2.Tensor(dtype=dtype_to_proto(t.dtype), shape=list(t.shape), data=raw.numpy().tobytes())


def tensor_from_proto(msg: common_pb2.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """Rebuild a tensor; raises ``StageError(INVALID_ARGUMENT)`` when bytes and shape disagree."""
    dtype = dtype_from_proto(msg.dtype)
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise StageError(INVALID_ARGUMENT, f"negative tensor dimension in shape {list(shape)}", "shape")
    numel = int(np.prod(shape)) if shape else 1
    if len(msg.data) != numel * _ITEMSIZE[dtype]:
        raise StageError(
            INVALID_ARGUMENT,
            f"tensor bytes ({len(msg.data)}) do not match shape {list(shape)} of {dtype}",
            "data",
        )
    if dtype in (torch.bfloat16, torch.float16):
        arr = np.frombuffer(msg.data, dtype=np.int16).copy()
        t = torch.from_numpy(arr).view(dtype)
    else:
        np_dtype = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}[dtype]
        t = torch.from_numpy(np.frombuffer(msg.data, dtype=np_dtype).copy())
    return t.reshape(shape).to(device)
