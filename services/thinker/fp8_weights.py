"""fp8 weights for the thinker's linear layers (``weights: fp8``): quantization at load and the layer loop.

:func:`quantize_runner` turns a :class:`~services.thinker.runner.ModelRunner`'s projection weights (QKV,
O, gate|up, down of every layer, and the lm_head) into e4m3 with one scale per output channel
(:mod:`services.common.kernels.fp8_gemm`; the kernel module imports Triton, so it is imported on use), after the RMSNorm weights were folded into the QKV and
gate|up columns (folding multiplies columns, which a per-row scale cannot absorb afterwards). How the
step then runs depends on the kernel backend:

* Triton (CUDA): the runner keeps only the fp8 tensors (the bf16 projection weights are released, so
  the weights take half the memory) and :func:`fp8_layers` runs every step's GEMMs through
  :func:`~services.common.kernels.fp8_gemm.fp8_linear` — the folded loop of
  :class:`~services.thinker.fused_forward.FusedForward` (six launches per layer, the O and down GEMMs
  adding into the residual in place) for every step when the norms are folded, else the norm-kernel loop.
  The transformers module's projection layers then hold empty weights: its own ``forward`` (the no-cache
  reference pass, the transformers baseline) is not available with fp8 weights on CUDA.
* torch (CPU, tests): the weights are replaced in place by their dequantized values ``q * s`` in the
  model's dtype. The module and the torch step path then compute the fp8 model's function (up to the
  rounding of ``q * s`` to that dtype) with no fp8 kernel, which is what the CPU fidelity measurement and
  the end-to-end tests run; memory is not saved.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from services.common.kernels.fp8_quant import Fp8Layer, quantize_fp8
from services.thinker.layer_ops import FusedLayer

if TYPE_CHECKING:
    from services.common.kernels import AttentionTiles

# The runner (services.thinker.runner.ModelRunner) and its FusedForward import this module, so they are
# typed by what is used of them here, not imported (no import cycle, even for the type checker).
Runner = Any
Forward = Any

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("bf16", "fp8")


def check_weights(weights: str) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)} (got {weights!r})")
    return weights


def fake_quantize_(weight: torch.Tensor) -> None:
    """Replace ``weight`` in place by its fp8 round trip ``q * s`` (in its own dtype)."""
    weight.copy_(quantize_fp8(weight).dequantize(weight.dtype))


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


@torch.no_grad()
def quantize_runner(runner: Runner) -> None:
    """Quantize the runner's projection weights and its lm_head to fp8 (see the module docstring).

    Idempotent per runner; a second runner over a module already quantized on CUDA finds the fp8 tensors
    the first one left on the module and shares them.
    """
    llm: Any = runner.llm  # a transformers Qwen3ForCausalLM
    head = llm.lm_head
    if runner.kernel_backend == "torch":
        if getattr(llm, "_thinker_fp8", None) != "fake":
            for lay in runner.layers:
                for w in (lay.qkv_weight, lay.o_weight, lay.gate_up_weight, lay.down_weight):
                    fake_quantize_(w)
            if head.weight is llm.model.embed_tokens.weight:  # tied: the embedding stays as it is
                head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
            fake_quantize_(head.weight)
            llm._thinker_fp8 = "fake"  # type: ignore[assignment]
        runner.head_fp8 = None
        return
    shared = getattr(llm, "_thinker_fp8", None)
    if shared == "fake":
        raise RuntimeError("this model was fp8-rounded for the torch kernels; load it again for Triton")
    if isinstance(shared, tuple):
        layers, head_fp8 = shared
    else:
        layers = []
        for module, lay in zip(llm.model.layers, runner.layers, strict=True):
            layers.append(
                Fp8Layer(
                    quantize_fp8(lay.qkv_weight),
                    quantize_fp8(lay.o_weight),
                    quantize_fp8(lay.gate_up_weight),
                    quantize_fp8(lay.down_weight),
                )
            )
            # Drop this layer's bf16 tensors before the next layer is quantized: the peak stays at the bf16
            # weights plus one layer's fp8 copy, which fits a KV pool already sized to the stage's cap.
            _release(module)
            empty = _empty_like(lay.o_weight)
            lay.qkv_weight = lay.o_weight = lay.gate_up_weight = lay.down_weight = empty
        head_fp8 = quantize_fp8(head.weight)
        if head.weight is not llm.model.embed_tokens.weight:
            head.weight = nn.Parameter(_empty_like(head.weight), requires_grad=False)
        llm._thinker_fp8 = (layers, head_fp8)  # type: ignore[assignment]
    for lay, q in zip(runner.layers, layers, strict=True):
        lay.fp8 = q
        empty = _empty_like(lay.o_weight)
        lay.qkv_weight = lay.o_weight = lay.gate_up_weight = lay.down_weight = empty
    runner.head_fp8 = head_fp8
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # the released bf16 weights go back to the device
    log.info(
        "thinker weights: fp8 (e4m3, per-channel scales), %.2f GB of projection weights",
        (sum(sum(w.nbytes() for w in (q.qkv, q.o, q.gate_up, q.down)) for q in layers) + head_fp8.nbytes())
        / 1e9,
    )


def _release(module: Any) -> None:
    """Point a decoder layer's projection Linears at empty weights (the fused bf16 tensors can go)."""
    attn, mlp = module.self_attn, module.mlp
    for lin in (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    ):
        lin.weight = nn.Parameter(_empty_like(lin.weight), requires_grad=False)
        if hasattr(lin, "_thinker_fused"):
            del lin._thinker_fused


def head_logits(runner: Runner, hidden: torch.Tensor) -> torch.Tensor:
    """The lm_head over ``hidden [rows, hidden]`` through the fp8 GEMM: ``[rows, vocab]``."""
    from services.common.kernels.fp8_gemm import fp8_linear

    assert runner.head_fp8 is not None
    head: Any = runner.llm.lm_head
    return fp8_linear(hidden.contiguous(), runner.head_fp8, head.bias)


def _fp8_of(lay: FusedLayer) -> Fp8Layer:
    if lay.fp8 is None:
        raise RuntimeError("a layer without fp8 weights in the fp8 layer loop")
    return lay.fp8


def fp8_layers(
    ff: Forward,
    x: torch.Tensor,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    tiles: AttentionTiles,
    packed: bool,
) -> torch.Tensor:
    """Every decoder layer over packed rows ``x [T, hidden]`` with fp8 GEMMs; returns the final-norm hidden.

    With folded norms (any step): ``x`` is the residual stream, the QKV and gate|up GEMMs read it as it
    is, the kernel after each scales by the row's ``1/RMS``, and the O and down GEMMs add into it (the
    first O writes a new tensor, so the caller's embeddings are never overwritten). Otherwise the norm
    kernels run before the QKV and gate|up GEMMs, as in ``FusedForward.layers``.
    """
    from services.common.kernels.fp8_gemm import fp8_linear

    r = ff.runner
    ops = r.ops
    if r.norm_fold:
        for idx, lay in enumerate(r.layers):
            w = _fp8_of(lay)
            qkv = fp8_linear(x, w.qkv, lay.qkv_bias)
            o = ff._attention(
                idx, qkv, positions, write_slots, tiles, rms_of=(x, lay.input_eps), one_launch=packed
            )
            x = fp8_linear(o, w.o, lay.o_bias, residual=x, out=None if idx == 0 else x)
            act = ops.silu_mul(fp8_linear(x, w.gate_up), rms_of=(x, lay.post_eps))
            x = fp8_linear(act, w.down, residual=x, out=x)
        return ff._final_norm(x, None)
    delta: torch.Tensor | None = None
    for idx, lay in enumerate(r.layers):
        w = _fp8_of(lay)
        if delta is None:
            h = ops.rms_norm(x, lay.input_norm_weight, lay.input_eps)
        else:
            x, h = ops.add_rms_norm(x, delta, lay.input_norm_weight, lay.input_eps)
        o = ff._attention(
            idx, fp8_linear(h, w.qkv, lay.qkv_bias), positions, write_slots, tiles, one_launch=packed
        )
        x, h = ops.add_rms_norm(x, fp8_linear(o, w.o, lay.o_bias), lay.post_norm_weight, lay.post_eps)
        delta = fp8_linear(ops.silu_mul(fp8_linear(h, w.gate_up)), w.down)
    return ff._final_norm(x, delta)
