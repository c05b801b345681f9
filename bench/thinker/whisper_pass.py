"""One batched streaming-Whisper pass, as the duplex encoder runs it once a second:

    python -m bench.thinker.whisper_pass --device cuda [--dims full] [--batches 1,4,16,24]

For each batch size B: B sessions at staggered points of their streams (session b has ``b % 20 + 1``
units cached, so the caches have different lengths, as on a live server), each giving its next 1 s unit
(100 mel frames from the host, as :mod:`services.thinker.duplex_encode` hands them) to one
:meth:`~services.thinker.model.thinker.ThinkerModel`-style pass: the conv front, every encoder layer
and the pooled caches (:meth:`WhisperChunkedEncoder.forward_chunks`). Reports per pass:

* ``ms``: median wall time of ``--passes`` passes, the device synchronised after each;
* ``ops``: aten operators dispatched (counted in one extra pass): on a GPU each is a kernel launch or a
  view, so at a few microseconds of host time each this is what makes a pass host-bound;
* ``ms_per_session``: ``ms / B``.

With ``--graphs``, an encoder with the same weights runs the same passes through the CUDA graphs of
:mod:`services.thinker.whisper_graph` (as the thinker does on a GPU), and each row adds ``graph_ms``,
``graph_ops`` and the largest difference of its last pass's rows from the eager pass's (``max_abs_diff``,
and ``rel_diff`` over the rows' largest magnitude).

``--dims full`` is the real encoder's shapes (24 layers, width 1024, 16 heads: random weights, no
checkpoint needed); ``--dims tiny`` the test checkpoint's (2 layers, width 64), where a CPU pass is
almost all dispatch and so shows the host cost alone. Prints one JSON object and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.thinker.model.audio import AudioStreamState, StreamPiece, WhisperChunkedEncoder
from services.thinker.model.config import AudioDims
from services.thinker.whisper_graph import warmup_whisper_stream_graphs

DIMS = {
    "full": AudioDims(1024, 24, 16, 4096, 80, 1500, "gelu", 5, 1.0),
    "tiny": AudioDims(64, 2, 4, 256, 80, 1500, "gelu", 5, 1.0),
}
UNIT = 100  # mel frames of a 1 s unit
WARM_UNITS = 20  # the most units a session has cached before its measured passes


class _OpCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    encoder: WhisperChunkedEncoder, batch: int, passes: int, device: torch.device
) -> tuple[dict[str, Any], torch.Tensor]:
    """Median ms and aten ops of one pass over ``batch`` sessions at staggered stream positions, and the
    rows of the last timed pass (the same pieces for every encoder: the generator is seeded by ``batch``)."""
    gen = torch.Generator().manual_seed(batch)
    states = [AudioStreamState() for _ in range(batch)]
    history = [b % WARM_UNITS + 1 for b in range(batch)]

    def piece(b: int) -> StreamPiece:
        mel = torch.randn(encoder.dims.num_mel_bins, UNIT + 2, generator=gen)
        return StreamPiece(mel[:, :UNIT], states[b], mel[:, UNIT:])

    def next_pieces() -> list[StreamPiece]:
        for state in states:  # a stream starts over before it would pass the encoder's positions
            if state.frames + UNIT // 2 > encoder.dims.max_source_positions:
                state.reset()
        return [piece(b) for b in range(batch)]

    for k in range(max(history)):  # fill the caches: session b encodes history[b] units
        todo = [piece(b) for b in range(batch) if k < history[b]]
        encoder.forward_chunks(todo)
    times = []
    for _ in range(passes + 1):  # the first pass is a warm-up
        pieces = next_pieces()
        _sync(device)
        t0 = time.perf_counter()
        rows = encoder.forward_chunks(pieces)
        _sync(device)
        times.append(1000 * (time.perf_counter() - t0))
    counter = _OpCounter()
    pieces = next_pieces()
    with counter:
        encoder.forward_chunks(pieces)
    for state in states:
        state.release()
    ms = statistics.median(times[1:])
    out = {"batch": batch, "ms": round(ms, 3), "ms_per_session": round(ms / batch, 3), "ops": counter.ops}
    return out, rows


def graphed_twin(encoder: WhisperChunkedEncoder, max_batch: int) -> WhisperChunkedEncoder:
    """An encoder with ``encoder``'s weights whose passes replay the thinker's graphs."""
    twin = WhisperChunkedEncoder(encoder.dims).to(
        device=encoder.conv1.weight.device, dtype=encoder.conv1.weight.dtype
    )
    twin.load_state_dict(encoder.state_dict())
    twin.eval().stream_pool.capacity = encoder.stream_pool.capacity
    if warmup_whisper_stream_graphs(twin, max_batch) == 0:
        raise SystemExit("--graphs needs a CUDA device")
    return twin


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--dims", choices=sorted(DIMS), default="full")
    ap.add_argument("--batches", default="1,4,16,24")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--graphs", action="store_true", help="also time the graphed pass and compare its rows")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    encoder = WhisperChunkedEncoder(DIMS[args.dims]).to(device=device, dtype=dtype).eval()
    batches = [int(b) for b in args.batches.split(",")]
    encoder.stream_pool.capacity = max(batches)
    rows = []
    with torch.inference_mode():
        twin = graphed_twin(encoder, max(batches)) if args.graphs else None
        for batch in batches:
            row, eager_rows = measure(encoder, batch, args.passes, device)
            if twin is not None:
                graphed, graph_rows = measure(twin, batch, args.passes, device)
                diff = float((graph_rows.float() - eager_rows.float()).abs().max())
                row |= {"graph_ms": graphed["ms"], "graph_ops": graphed["ops"], "max_abs_diff": diff}
                row["rel_diff"] = diff / max(float(eager_rows.float().abs().max()), 1e-30)
            rows.append(row)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": card, "dims": args.dims, "dtype": str(dtype), "rows": rows}))
    graphs = " graphed ms / pass | graphed aten ops | rows' max diff (relative) |" if args.graphs else ""
    print(f"\n| B | ms / pass | ms / session | aten ops / pass |{graphs}  ({card}, {args.dims} dims)")
    print("|---|---|---|---|" + ("---|---|---|" if args.graphs else ""))
    for r in rows:
        extra = ""
        if args.graphs:
            extra = f" {r['graph_ms']} | {r['graph_ops']} | {r['max_abs_diff']:.3g} ({r['rel_diff']:.2g}) |"
        print(f"| {r['batch']} | {r['ms']} | {r['ms_per_session']} | {r['ops']} |{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
