"""Hardware floors the thinker bench reports its figures against, measured in the same run.

* **Matmul-stack floor** of a decode step: the step's weight matmuls alone, with the engine's own
  (fused) weights — QKV, O, gate|up, down for every layer, then lm_head — on ``[batch, hidden]``
  activations, recorded into one CUDA graph and replayed (eager on CPU). No attention, norms, rotary,
  sampling or host work: what a decode step costs if everything else were free. A decode step is
  reported as a ratio to it.
  The same stack with the lm_head's operands swapped (``W @ xᵀ``, the engine's graphed form, which
  cuBLAS runs faster at several rows) is reported beside it (``ms_swapped_head``), so that a ratio can
  be read against either.
* **Dense bf16 matmul rate**: one large square product (8192³ on CUDA), the compute ceiling a prefill
  is reported as a share of (its matmul FLOPs ÷ its time ÷ this rate).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_per_call(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` (CUDA events on the GPU, wall clock on CPU), after two warm-ups."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def step_weights(runner) -> list[torch.Tensor]:  # noqa: ANN001 (ModelRunner)
    """The weight matrices one decode step multiplies by, in order (the runner's fused layout)."""
    mats: list[torch.Tensor] = []
    for lay in runner.layers:
        mats += [lay.qkv_weight, lay.o_weight, lay.gate_up_weight, lay.down_weight]
    mats.append(runner.llm.lm_head.weight)
    return mats


@torch.inference_mode()
def matmul_stack_ms(
    weights: list[torch.Tensor],
    batch: int,
    device: torch.device,
    iters: int = 50,
    swap_last: bool = False,
) -> float:
    """Milliseconds of one pass of ``x @ W.T`` over ``weights`` for ``batch`` rows (one graph on CUDA).

    ``swap_last``: the last product (the lm_head) as ``W @ x.T``, as the engine's graphed step computes it
    (:meth:`~services.thinker.fused_forward.FusedForward.head_logits`); the floor proper is plain.
    """
    dtype = weights[0].dtype
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype, device=device) for w in weights}
    outputs = [torch.empty(batch, w.shape[0], dtype=dtype, device=device) for w in weights]
    if swap_last:
        outputs[-1] = torch.empty(weights[-1].shape[0], batch, dtype=dtype, device=device)

    def body() -> None:
        for i, (w, out) in enumerate(zip(weights, outputs, strict=True)):
            if swap_last and i == len(weights) - 1:
                torch.mm(w, inputs[w.shape[1]].t(), out=out)
            else:
                torch.matmul(inputs[w.shape[1]], w.t(), out=out)

    if device.type != "cuda":
        return 1e3 * time_per_call(body, device, max(1, iters // 25))
    graph = capture_graph(body, device)
    ms = 1e3 * time_per_call(graph.replay, device, iters)
    del graph
    return ms


def capture_graph(body: Callable[[], object], device: torch.device, repeat: int = 1) -> torch.cuda.CUDAGraph:
    """``body`` run once on a side stream (lazy init, allocator), then ``repeat`` times into one graph."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            body()
    return graph


@torch.inference_mode()
def matmul_rate(device: torch.device, dtype: torch.dtype, size: int | None = None) -> float:
    """Dense matmul FLOP/s of one ``size``³ product (8192 on CUDA, 256 on CPU)."""
    n = size or (8192 if device.type == "cuda" else 256)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    out = torch.empty(n, n, dtype=dtype, device=device)
    t = time_per_call(lambda: torch.matmul(a, b, out=out), device, 10 if device.type == "cuda" else 2)
    return 2 * n**3 / t


def prefill_flops(runner, tokens: int) -> float:  # noqa: ANN001 (ModelRunner)
    """Matmul FLOPs of a prefill of ``tokens`` from empty: weight GEMMs + causal attention (QK and PV)."""
    weight = sum(w.numel() for w in step_weights(runner)[:-1])  # lm_head runs on the last row only
    attn = 2 * 2 * runner.num_heads * runner.head_dim * tokens * (tokens + 1) / 2 * len(runner.layers)
    return 2.0 * weight * tokens + 2.0 * runner.llm.lm_head.weight.numel() + attn


@torch.inference_mode()
def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (1 GiB buffers on CUDA)."""
    n = nbytes or (2**30 if device.type == "cuda" else 2**24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_per_call(lambda: dst.copy_(src), device, 20 if device.type == "cuda" else 2)
    return 2 * n / t


def reference(runner, batches: list[int], device: torch.device) -> dict:  # noqa: ANN001 (ModelRunner)
    """All floors of one run: matmul stack per batch, bf16 matmul rate, copy bandwidth."""
    weights = step_weights(runner)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    stack = [
        {"batch": b, "ms": matmul_stack_ms(weights, b, device), "ms_swapped_head": matmul_stack_ms(weights, b, device, swap_last=True)}
        for b in batches
    ]  # fmt: skip
    for r in stack:
        r["weight_tb_s"] = nbytes / (r["ms"] / 1e3) / 1e12
    return {
        "matmul_stack": stack,
        "weight_bytes": nbytes,
        "matmul_tflop_s": matmul_rate(device, weights[0].dtype) / 1e12,
        "copy_tb_s": copy_bandwidth(device) / 1e12,
    }
