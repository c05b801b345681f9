"""bench.duplex_policy on CPU: the harness runs both arms from the same policy and generator state."""

from __future__ import annotations

import json
from pathlib import Path

from bench.duplex_policy import main


def test_bench_duplex_policy_arms_see_the_same_inputs(tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    assert main(["--device", "cpu", "--rows", "1,4", "--iters", "3", "--json-out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["rows"], r["draw"].split()[0]) for r in results] == [
        (1, "greedy"),
        (1, "sampled"),
        (4, "greedy"),
        (4, "sampled"),
    ]
    # On CPU both arms are the eager path: equal tokens on every call, sampled rows included, only if each
    # call starts from the same history, turn state and generator state.
    assert all(r["equal"] == r["calls"] == 3 for r in results)
    assert all(r["eager_ms"] > 0 and r["replay_ms"] > 0 for r in results)
