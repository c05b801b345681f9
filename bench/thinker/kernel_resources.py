"""The thinker's Triton kernels compiled for a GPU on any machine: each launch's registers and spills.

    python -m bench.thinker.kernel_resources [--arch 90]

Triton compiles ahead of time for a named target with the ``ptxas`` its wheel ships, so no GPU (and no
driver) is needed. Why: Triton's interpreter, which the CPU tests run the kernels through, checks what a
kernel computes but never compiles it, so a kernel that does not compile for the card, or a launch whose
registers spill to local memory, shows only on the GPU host. This prints, for the full-size thinker's
shapes, the rotary + attention kernel's default launch of 1, 4 and 16 rows (bf16 and e4m3 caches, with
the ``preload`` field off and on) and the fp8 GEMM kernel at every entry of the built-in ``FP8_CONFIGS``:
registers per thread, spilled stack bytes per thread and shared memory. A spill is a hint, not a verdict:
the 16-row default launch spills and still measured fastest (``bench.thinker.attention --rope``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# The full-size thinker (Qwen3-8B): query and KV heads, head dim, KV block, hidden size; a decode context.
HQ, HKV, D, PAGE, HIDDEN, CONTEXT, SMS = 32, 8, 128, 16, 4096, 576, 132


def compile_resources(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int, arch: int) -> dict[str, int]:  # fmt: skip
    """Compile ``kernel`` for ``sm_{arch}``; its ``{"registers", "stack", "shared"}`` per thread/block, read
    from the cubin by the wheel's ``cuobjdump``. Raises what the compiler raises for a launch it refuses."""
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
    )
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(item.split(":") for line in usage.splitlines() if "REG:" in line for item in line.split())
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": int(fields["SHARED"])}


def rope_attention_case(rows: int, one_byte_cache: bool, preload: bool, arch: int = 90) -> dict[str, Any]:
    """The rotary + attention kernel's default launch for ``rows`` rows at the full-size shapes."""
    from services.common.kernels import key_splits
    from services.common.kernels.rope_attention import LOOKBACK, _rope_attention_kernel, default_launch

    block_n, warps, stages, *rest = default_launch(rows, one_byte_cache)
    cache = "*fp8e4nv" if one_byte_cache else "*bf16"
    constexprs = dict(
        HQ=HQ, HKV=HKV, G=HQ // HKV, D=D, PAGE=PAGE, BLOCK_M=16, BLOCK_N=block_n,
        SPLITS=key_splits(rows, HKV, CONTEXT, SMS), LOOK=LOOKBACK, HAS_NORM=True, SCALED=True, HIDDEN=HIDDEN,
        CHUNK=1024, IEEE=False, V_EARLY=bool(rest[0]) if rest else False, PRELOAD=preload,
    )  # fmt: skip
    scalars = {"table_stride": "i64", "n_rows": "i32", "eps": "fp32", "x_eps": "fp32", "scale_log2": "fp32"}
    pointers = {"pos_ptr": "*i64", "slot_ptr": "*i64", "table_ptr": "*i64", "po_ptr": "*fp32", "pm_ptr": "*fp32",
                "pl_ptr": "*fp32", "cnt_ptr": "*i32", "k_ptr": cache, "v_ptr": cache}  # fmt: skip
    signature = {
        n: "constexpr" if n in constexprs else scalars.get(n) or pointers.get(n) or "*bf16"
        for n in _rope_attention_kernel.arg_names
    }
    launch = (block_n, warps, stages, int(constexprs["V_EARLY"]), int(preload))  # the five launch fields
    res = compile_resources(_rope_attention_kernel, signature, constexprs, warps, stages, arch)
    return {"kernel": "rope_attention", "rows": rows, "cache": cache[1:], "launch": list(launch), **res}


def fp8_gemm_case(rows: int, n: int, k: int, cfg: Any, arch: int = 90) -> dict[str, Any]:
    """The fp8 GEMM kernel for ``rows x n x k`` with ``cfg`` (an ``Fp8Config``), as ``fp8_linear`` launches
    it with a residual added in place (the O and down projections)."""
    from services.common.kernels.fp8_gemm import _fp8_gemm_kernel

    split = cfg.split_k if triton.cdiv(rows, cfg.block_m) == 1 else 1
    k_per = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)
    constexprs = dict(
        N=n, K=k, HAS_BIAS=False, HAS_RES=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split, K_PER=k_per, EVEN=n % cfg.block_n == 0 and k_per * split == k, IEEE=False,
    )  # fmt: skip
    types = {
        "w_ptr": "*fp8e4nv",
        "s_ptr": "*fp32",
        "b_ptr": "*fp32",
        "ws_ptr": "*fp32",
        "cnt_ptr": "*i32",
        "m": "i32",
    }
    signature = {
        n_: "constexpr" if n_ in constexprs else types.get(n_, "*bf16") for n_ in _fp8_gemm_kernel.arg_names
    }
    res = compile_resources(_fp8_gemm_kernel, signature, constexprs, cfg.num_warps, cfg.num_stages, arch)
    return {"kernel": "fp8_gemm", "rows": rows, "n": n, "k": k, "launch": list(cfg), **res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.thinker.kernel_resources", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 and H200)")
    args = ap.parse_args(argv)
    from services.common.kernels.fp8_gemm import FP8_CONFIGS

    rows = [
        rope_attention_case(r, fp8, pre, args.arch)
        for r in (1, 4, 16)
        for fp8 in (False, True)
        for pre in (False, True)
    ]
    rows += [fp8_gemm_case(m, n, k, cfg, args.arch) for (m, n, k), cfg in sorted(FP8_CONFIGS.items())]
    print(
        f"| kernel | rows | shape / cache | launch | registers | spilled stack bytes | shared bytes |  (sm_{args.arch})"
    )
    print("|---|---:|---|---|---:|---:|---:|")
    for r in rows:
        what = r.get("cache") or f"{r['n']} x {r['k']}"
        launch = ":".join(str(int(v)) for v in r["launch"])
        print(
            f"| {r['kernel']} | {r['rows']} | {what} | {launch} | {r['registers']} | {r['stack']} | {r['shared']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
