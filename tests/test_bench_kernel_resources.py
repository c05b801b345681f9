"""``bench.thinker.kernel_resources``: the thinker's Triton kernels compile for an sm_90 target on a
machine without a GPU (the interpreter the other kernel tests use never compiles them), and the
compiled launch's resources are read back from the cubin. It runs in a child process: this process's
kernels may already be the interpreter's (``TRITON_INTERPRET`` is read when a kernel module loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json
from bench.thinker import kernel_resources as kr
from services.common.kernels.fp8_gemm import FP8_CONFIGS
key = (128, 4096, 12288)  # a packed step's down projection: one 128-row tile, K split over 4
out = [kr.rope_attention_case(r, fp8, pre) for r, fp8, pre in ((16, True, False), (16, True, True), (1, False, True))]
out.append(kr.fp8_gemm_case(*key, FP8_CONFIGS[key]))
print(json.dumps(out))
"""


@pytest.mark.slow  # a child process and a few seconds of ptxas per kernel
def test_default_launches_and_a_packed_fp8_config_compile_for_sm90() -> None:
    from services.common.kernels.fp8_gemm import FP8_CONFIGS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    *rope, gemm = json.loads(done.stdout)
    for r, preload in zip(rope, (0, 1, 1), strict=True):
        assert r["kernel"] == "rope_attention" and len(r["launch"]) == 5 and r["launch"][-1] == preload
        assert 0 < r["registers"] <= 255 and r["stack"] >= 0 and r["shared"] > 0
    assert gemm["launch"] == list(FP8_CONFIGS[(128, 4096, 12288)]) and 0 < gemm["registers"] <= 255
