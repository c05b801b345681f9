"""Staggered greedy decode of three prompts through a thinker engine on CPU, eager or through emulated
row graphs: the shared workload of the tests that compare a graph-only kernel path with the torch engine."""

from __future__ import annotations

from typing import Any

import torch

from services.thinker.engine import EngineConfig, ThinkerEngine
from services.thinker.runner import ModelRunner
from services.thinker.sampling import Sampler, SamplingConfig
from services.thinker.scheduler import WorkItem
from tests.graph_emulation import emulated


def greedy_tokens(
    llm: torch.nn.Module, kernels: str, graphed: bool, **config: Any
) -> tuple[list[list[int]], ModelRunner]:
    """Five greedy tokens for each of three prompts (later prompts prefill while earlier ones decode);
    ``config``: extra :class:`EngineConfig` fields. Returns the tokens and the engine's runner."""
    engine = ThinkerEngine(
        llm, EngineConfig(max_num_seqs=4, kv_budget_bytes=8 << 20, **config), torch.device("cpu")
    )
    engine.runner.set_kernels(kernels)
    if graphed:
        engine.runner.use_cuda_graphs = True
        engine.runner.graph_capture = emulated
    tokens: list[list[int]] = [[] for _ in range(3)]
    for i, n in enumerate((23, 9, 14)):
        seq = engine.open(lambda ev, i=i: ev.token is not None and tokens[i].append(ev.token))
        prompt = list(range(1000 + 37 * i, 1000 + 37 * i + n))
        engine.submit(seq, WorkItem(prompt, sampler=Sampler(SamplingConfig(max_tokens=5, stop_token_ids=()))))
        engine.step()  # staggered: later prompts prefill while earlier ones decode
    engine.run_until_idle()
    return tokens, engine.runner
