"""The duplex decision policy (docs/model.md, Duplex) as one CUDA graph replay per step.

Why: the batched policy of :mod:`services.thinker.duplex_policy` is ~100 small torch ops a step (masks,
penalties, the raw first draw, top-k/top-p, two Gumbel draws, their per-row parameter copies). Each is a
few microseconds of GPU work and ~10 µs of host dispatch, so a duplex step spent more host time on them
than the GPU spent (BENCHMARKS.md, "Duplex policy graph": 2.7 ms of host per step at one session, 6.5 ms at 16,
against a 5 ms decode step). Captured once per row bucket, the step's host work is two small copies into
static buffers, one replay and the read-back of the tokens.

:func:`draw_static` is the same computation as ``_policy_tokens`` written with fixed shapes: every row's
parameters come in one ``[n, 6]`` tensor and its penalty window padded to a fixed width (a window is
padded with its own first id, which writes the same value twice; a row without one divides id 0 by 1.0,
which leaves it bit for bit). On the same inputs and the same generator state it gives the same tokens
(tests/test_thinker_duplex_policy_graph.py on CPU; ``bench.duplex_policy`` compares the replay with the
eager path on the GPU).

Only what a capture can hold takes this path: rows drawn from the global generator (a seeded session
draws from its own, which a replay cannot advance), one forbidden mask shared by every row, the captured
top-k and window width. Graphs are captured at start (:func:`warmup_policy_graphs`), before the engine
thread and the encode threads run; a step that needs a shape not captured runs the eager path instead of
capturing while other threads use the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

# The captured draws are the default; ``bench.duplex_policy`` sets this False for its eager arm.
ENABLED = True
PARAMS = 6  # divisor, temperature, top-k, top-p, sampled, forced (one float row per policy)
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def draw_static(
    logits: torch.Tensor,
    forbidden: torch.Tensor,
    window_ids: torch.Tensor,
    params: torch.Tensor,
    k: int,
    ids: tuple[int, int, int, int],
    turn_eos_penalty: float,
) -> torch.Tensor:
    """The duplex draw of ``_policy_tokens`` on fixed shapes; returns the raw token of every row.

    ``logits [n, V]`` fp32, ``forbidden [1, V]`` bool, ``window_ids [n, W]`` int64, ``params [n, 6]`` fp32,
    ``k`` the top-k width of the draw, ``ids`` = (chunk_eos, listen, chunk_tts_eos, turn_eos).
    """
    chunk_eos, listen, chunk_tts_eos, turn_eos = ids
    n, vocab = logits.shape
    neg_inf = float("-inf")
    divisor, temps, ks, top_p = (params[:, i : i + 1] for i in range(4))
    sampled = params[:, 4] > 0.5
    forced = params[:, 5] > 0.5
    tiny = torch.finfo(torch.float32).tiny

    first = torch.where(
        sampled,
        _gumbel(logits, torch.rand(n, vocab, device=logits.device).clamp_(min=tiny)),
        logits.argmax(-1),
    )
    model_stop = (first == chunk_eos) & ~forced

    masked = logits.masked_fill(forbidden, neg_inf)
    masked[:, chunk_eos] = neg_inf
    for col in (listen, chunk_tts_eos):
        masked[:, col].masked_fill_(forced, neg_inf)
    masked.scatter_(1, window_ids, masked.gather(1, window_ids) / divisor)
    t = masked[:, turn_eos]
    masked[:, turn_eos] = torch.where(t > 0, t / turn_eos_penalty, t * turn_eos_penalty)

    vals, top_ids = torch.topk(masked / temps, k, dim=-1)
    rank = torch.arange(k, device=logits.device).unsqueeze(0)
    vals = vals.masked_fill(rank >= ks, neg_inf)
    probs = torch.softmax(vals, dim=-1)
    keep = (probs.cumsum(-1) - probs < top_p) | (rank == 0)
    vals = vals.masked_fill(~keep, neg_inf)
    pick = _gumbel(vals, torch.rand(n, k, device=logits.device).clamp_(min=tiny))
    drawn = top_ids.gather(1, pick.unsqueeze(1)).squeeze(1)

    token = torch.where(sampled, drawn, masked.argmax(-1))
    return torch.where(model_stop, torch.full_like(token, chunk_eos), token)


def _gumbel(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.argmax(scores - torch.log(-torch.log(u)), dim=-1)


@dataclass
class _Captured:
    """One captured draw: its static inputs, its output and the pinned host buffers that feed it."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    window_ids: torch.Tensor
    params: torch.Tensor
    out: torch.Tensor
    host_ids: torch.Tensor
    host_params: torch.Tensor


class PolicyGraphs:
    """The captured draws of one device and forbidden mask, keyed by (row bucket, top-k)."""

    def __init__(
        self,
        forbidden: torch.Tensor,
        width: int,
        ids: tuple[int, int, int, int],
        penalty: float,
        default_k: int,
    ) -> None:
        self.forbidden_1d = forbidden  # the sessions' shared mask (they hold this very tensor)
        self.forbidden = forbidden.reshape(1, -1)
        self.default_k = int(default_k)  # the top-k a batch of greedy rows replays with (any captured one)
        self.device = forbidden.device
        self.vocab = int(self.forbidden.shape[1])
        self.width = int(width)
        self.ids = ids
        self.penalty = float(penalty)
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def has(self, rows: int, k: int) -> bool:
        bucket = _bucket(rows)
        return bucket is not None and (bucket, k) in self._graphs

    def capture(self, rows: int, k: int) -> None:
        """Capture the draw for ``rows`` rows (rounded up to a bucket) at top-k ``k``; call before serving."""
        bucket = _bucket(rows)
        if bucket is None or (bucket, k) in self._graphs:
            return
        dev = self.device
        logits = torch.zeros(bucket, self.vocab, dtype=torch.float32, device=dev)
        window_ids = torch.zeros(bucket, self.width, dtype=torch.long, device=dev)
        params = torch.ones(bucket, PARAMS, dtype=torch.float32, device=dev)

        def run() -> torch.Tensor:
            return draw_static(logits, self.forbidden, window_ids, params, k, self.ids, self.penalty)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # allocator and kernel set-up outside the capture
                run()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = run()
        self._graphs[(bucket, k)] = _Captured(
            graph,
            logits,
            window_ids,
            params,
            out,
            torch.zeros(bucket, self.width, dtype=torch.long).pin_memory(),
            torch.zeros(bucket, PARAMS, dtype=torch.float32).pin_memory(),
        )

    def tokens(
        self, logits: torch.Tensor, params: np.ndarray, windows: Sequence[np.ndarray], k: int
    ) -> list[int]:
        """Raw tokens for ``logits [n, V]`` (fp32 or bf16 on the device); the shape must be captured."""
        n = int(logits.shape[0])
        bucket = _bucket(n)
        assert bucket is not None
        cap = self._graphs[(bucket, k)]
        ids = cap.host_ids.numpy()
        for r, w in enumerate(windows):
            if w.shape[0]:
                ids[r, : w.shape[0]] = w
                ids[r, w.shape[0] :] = w[0]
            else:
                ids[r] = 0
        cap.host_params.numpy()[:n] = params
        # The previous step's copies out of these pinned buffers finished at its read-back (a sync).
        cap.window_ids[:n].copy_(cap.host_ids[:n], non_blocking=True)
        cap.params[:n].copy_(cap.host_params[:n], non_blocking=True)
        cap.logits[:n].copy_(logits)
        cap.graph.replay()
        return [int(x) for x in cap.out[:n].tolist()]  # the step's one sync


def _bucket(rows: int) -> int | None:
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return None


_REGISTRY: dict[int, PolicyGraphs] = {}  # by id() of the shared forbidden mask; the engine thread reads it


def graphs_for(forbidden: torch.Tensor) -> PolicyGraphs | None:
    """The captured draws for sessions sharing ``forbidden``, or None (none captured, or turned off)."""
    if not ENABLED:
        return None
    return _REGISTRY.get(id(forbidden))


def warmup_policy_graphs(
    forbidden: torch.Tensor,
    max_rows: int,
    *,
    top_k: int,
    width: int,
    ids: tuple[int, int, int, int],
    penalty: float,
) -> int:
    """Capture the draw for every row bucket up to ``max_rows`` at the default top-k; returns how many."""
    if forbidden.device.type != "cuda" or not ENABLED:
        return 0
    graphs = _REGISTRY.get(id(forbidden))
    if graphs is None:
        graphs = _REGISTRY[id(forbidden)] = PolicyGraphs(forbidden, width, ids, penalty, top_k)
    for bucket in ROW_BUCKETS:
        graphs.capture(bucket, top_k)
        if bucket >= max_rows:
            break
    return len(graphs._graphs)
