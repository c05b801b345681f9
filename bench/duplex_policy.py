"""The duplex decision policy per step: the eager batched ops against the captured replay (GPU).

For each row count it times ``DuplexPolicy.choose_rows`` (what the engine calls once a step, host packing
and the token read-back included) on the eager path and on the replay, and checks that both pick the
same tokens: greedy rows must agree exactly; sampled rows are compared under the same generator state.
No checkpoint is needed: the policy sees only logits over the real vocabulary and a forbidden mask.
On CPU (``--device cpu``, the harness test) nothing is captured and both columns run the eager path.

    python -m bench.duplex_policy --rows 1,4,16 --iters 200
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from services.thinker import duplex_policy_graph
from services.thinker.duplex_policy import (
    CHUNK_EOS,
    CHUNK_TTS_EOS,
    LISTEN,
    TURN_EOS,
    TURN_EOS_LENGTH_PENALTY,
    DuplexPolicy,
    DuplexSampling,
    PolicyState,
)
from services.thinker.duplex_policy_graph import warmup_policy_graphs

VOCAB = 151748


def _policies(n: int, forbidden: torch.Tensor, temperature: float) -> list[DuplexPolicy]:
    out = []
    for r in range(n):
        state = PolicyState(history=list(range(1000 + r, 1000 + r + 300)))
        out.append(
            DuplexPolicy(
                DuplexSampling(temperature=temperature),
                state,
                forbidden,
                force_listen=False,
                force_speak=False,
            )
        )
    return out


def _time(
    policies: list[DuplexPolicy], logits: torch.Tensor, iters: int, graphs: bool
) -> tuple[float, list[list[int]]]:
    """Mean ms per call and every call's tokens; every call starts from the same policy state (history and
    turn state) and the same generator state, so the eager and the replayed runs see the same inputs."""
    duplex_policy_graph.ENABLED = graphs
    n = len(policies)
    start = [(list(p.state.history), p.state.turn_ended) for p in policies]
    picks: list[list[int]] = []
    total = 0.0
    for i in range(iters):
        for p, (history, turn_ended) in zip(policies, start, strict=True):
            p.state.history[:] = history
            p.state.turn_ended = turn_ended
        torch.manual_seed(i)  # every device's generator
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        picks.append(DuplexPolicy.choose_rows(policies, logits, [[]] * n, [3] * n))
        total += time.perf_counter() - t0
    for p, (history, turn_ended) in zip(policies, start, strict=True):
        p.state.history[:] = history
        p.state.turn_ended = turn_ended
    return 1000 * total / iters, picks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu runs the harness only: nothing is captured there")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    forbidden = torch.zeros(VOCAB, dtype=torch.bool, device=dev)
    forbidden[[7, 500, 151_700]] = True
    rows = [int(x) for x in args.rows.split(",")]
    defaults = DuplexSampling()
    t0 = time.perf_counter()
    captured = warmup_policy_graphs(
        forbidden,
        max(rows),
        top_k=defaults.top_k,
        width=defaults.penalty_window,
        ids=(CHUNK_EOS, LISTEN, CHUNK_TTS_EOS, TURN_EOS),
        penalty=TURN_EOS_LENGTH_PENALTY,
    )
    print(f"captured {captured} policy graphs in {time.perf_counter() - t0:.2f} s")
    if not captured:
        print("no graphs on this device: the replay column runs the eager path too (a harness check)")
    results = []
    print("| rows | draw | eager ms/step | replay ms/step | speed-up | tokens equal |")
    print("|---:|---|---:|---:|---:|---|")
    for n in rows:
        logits = (torch.randn(n, VOCAB, device=dev) * 2).to(torch.bfloat16)
        for temperature in (0.0, defaults.temperature):
            policies = _policies(n, forbidden, temperature)
            _time(policies, logits, 5, False)
            _time(policies, logits, 5, True)
            eager_ms, eager = _time(policies, logits, args.iters, False)
            graph_ms, graph = _time(policies, logits, args.iters, True)
            same = sum(a == b for a, b in zip(eager, graph, strict=True))
            kind = "greedy" if temperature == 0.0 else f"sampled (T={temperature})"
            print(
                f"| {n} | {kind} | {eager_ms:.3f} | {graph_ms:.3f} | {eager_ms / graph_ms:.1f}x | {same}/{len(eager)} |"
            )
            results.append(
                {
                    "rows": n,
                    "draw": kind,
                    "eager_ms": eager_ms,
                    "replay_ms": graph_ms,
                    "equal": same,
                    "calls": len(eager),
                }
            )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    greedy_ok = all(r["equal"] == r["calls"] for r in results if r["draw"] == "greedy")
    return 0 if greedy_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
