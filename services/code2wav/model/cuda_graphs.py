"""CUDA graphs for the fixed window shapes of the Code2Wav stage (GPU only; CPU stays eager).

What is captured, per distinct input-shape key (lazily, on first use, up to ``max_graphs`` per part):

* one DiT estimator evaluation with caches (:func:`dit_blocks_chunk`): the 10-step Euler loop stays in
  Python and replays the graph once per step; the time embedding is computed outside (the package builds
  its frequency table on the host);
* the HiFT f0 predictor and the HiFT decoder up to ``conv_post`` (``torch.istft`` checks its window on the
  host, so the inverse STFT and the NSF source, which draws per-stream random numbers, stay eager).

Steady streaming has few keys: windows of 25 new codes give 50 mel frames and estimator caches of
300/350/400 frames after a 6 s prompt, times the batch sizes seen. Replays copy inputs into static
buffers; outputs live in graph-owned buffers that the next replay overwrites, so callers copy what they
keep (``FlowStepper._solve`` does). A key whose capture fails falls back to eager for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.code2wav.model.flow_step import dit_blocks_chunk
from services.code2wav.model.vocoder import hift_pre_istft

log = logging.getLogger(__name__)

Key = tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph  # anything with replay(); tests substitute a host-side emulation
    inputs: list[torch.Tensor | None]
    outputs: tuple[torch.Tensor, ...]


Capture = Callable[[Callable[..., tuple[torch.Tensor, ...]], tuple[torch.Tensor | None, ...]], _Captured]


def capture_cuda_graph(
    fn: Callable[..., tuple[torch.Tensor, ...]], args: tuple[torch.Tensor | None, ...]
) -> _Captured:
    """Warm ``fn`` up on a side stream, then capture it on static copies of ``args``."""
    inputs = [None if a is None else a.clone() for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up kernels, cuBLAS/cuFFT plans and the allocator off the graph
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a CUDA call from another thread of the server (a freed tensor's stream event, the
    # gRPC side) must not invalidate this capture. Seen on the H200 as a cuDNN "unable to find an engine"
    # during capture, after which the process hit an illegal address.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = fn(*inputs)
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    return _Captured(graph, inputs, tuple(outputs))


class ShapeKeyedGraphs:
    """Replays one CUDA graph per input-shape key of ``fn``; eager for keys it cannot (or may not) hold."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        max_graphs: int = 32,
        capture: Capture = capture_cuda_graph,
    ) -> None:
        self.name = name
        self.fn = fn
        self.max_graphs = max_graphs
        self.capture = capture
        self.graphs: dict[Key, _Captured | None] = {}
        self.replays = 0
        self.eager_calls = 0

    @staticmethod
    def key(args: tuple[torch.Tensor | None, ...]) -> Key:
        return tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args)

    def __call__(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        key = self.key(args)
        entry = self.graphs.get(key, False)
        if entry is False:
            if len(self.graphs) >= self.max_graphs:
                entry = None
            else:
                try:
                    entry = self.capture(self.fn, args)
                    log.info("captured %s graph #%d for %s", self.name, len(self.graphs) + 1, key)
                except Exception as exc:  # noqa: BLE001 - a shape we cannot capture simply runs eager
                    log.warning(
                        "%s: CUDA graph capture failed for %s (%s); running eager", self.name, key, exc
                    )
                    entry = None
                    if any(a is not None and a.is_cuda for a in args):
                        # A failed capture can leave the device in an error state; surface it here, at
                        # the capture, rather than as an unrelated error in the next kernel.
                        torch.cuda.synchronize()
                self.graphs[key] = entry
        if entry is None:
            self.eager_calls += 1
            out = self.fn(*args)
            return (out,) if isinstance(out, torch.Tensor) else out
        for static, arg in zip(entry.inputs, args, strict=True):
            if static is not None and arg is not None:
                static.copy_(arg)
        entry.graph.replay()
        self.replays += 1
        return entry.outputs


def enable_cuda_graphs(
    runner: object, max_graphs: int = 32, capture: Capture | None = None
) -> dict[str, ShapeKeyedGraphs]:
    """Route the runner's DiT estimator and HiFT parts through shape-keyed CUDA graphs (CUDA only).

    ``capture`` replaces the real capture (tests emulate replay semantics on CPU with it)."""
    flow = runner.flow  # type: ignore[attr-defined]
    vocoder = runner.vocoder  # type: ignore[attr-defined]
    if capture is None:
        if runner.device.type != "cuda":  # type: ignore[attr-defined]
            return {}
        capture = capture_cuda_graph
    dit = flow.dit
    hift = vocoder.hift
    estimator = ShapeKeyedGraphs(
        "dit",
        lambda x, mu, temb, spks, cond, cnn, att: dit_blocks_chunk(dit, x, mu, temb, spks, cond, cnn, att),
        max_graphs,
        capture,
    )
    f0 = ShapeKeyedGraphs("hift_f0", lambda mel: (hift.f0_predictor(mel),), max_graphs, capture)
    decode = ShapeKeyedGraphs(
        "hift_decode", lambda mel, source: (hift_pre_istft(hift, mel, source),), max_graphs, capture
    )
    eager_estimator = flow.estimator

    def graphed_estimator(x, mu, temb, spks, cond, cnn, att):  # noqa: ANN001, ANN202
        if att is None:  # prompt setup: runs once per voice and seed, not worth a graph
            return eager_estimator(x, mu, temb, spks, cond, cnn, att)
        return estimator(x, mu, temb, spks, cond, cnn, att)

    flow.estimator = graphed_estimator
    vocoder.f0_fn = lambda mel: f0(mel)[0]
    vocoder.decode_fn = lambda mel, source: decode(mel, source)[0]
    runner.cuda_graphs = True  # type: ignore[attr-defined]
    return {"dit": estimator, "hift_f0": f0, "hift_decode": decode}
