"""Does the talker's eager SDPA pay a per-shape cost on the H200? First vs repeat call of new prefill
shapes (talker dims: 12 heads x 64, bf16, additive mask), default backends vs cuDNN attention off."""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = torch.device("cuda")
print("cudnn_sdp_enabled", torch.backends.cuda.cudnn_sdp_enabled(), torch.__version__)


def run(b: int, L: int, R: int) -> float:
    q = torch.randn(b, 12, L, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, 12, R, 64, device=dev, dtype=torch.bfloat16)
    m = torch.zeros(b, 1, L, R, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        F.scaled_dot_product_attention(q, k, k, attn_mask=m)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


for name, ctx in [
    ("default", None),
    ("no cudnn", [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]),
]:
    base = 7 if ctx is None else 11
    rows = []
    for i, (b, L) in enumerate(
        [(1, base + 6), (1, base + 12), (7, base + 20), (2, base + 30), (1, base + 6)]
    ):
        R = L + 3 * i + 2
        if ctx is None:
            first, again = run(b, L, R), run(b, L, R)
        else:
            with sdpa_kernel(ctx):
                first, again = run(b, L, R), run(b, L, R)
        rows.append(f"B{b} L{L} R{R}: first {first:.1f} ms, again {again:.1f} ms")
    print(name, "|", "; ".join(rows))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    run(1, 40, 45)
print([e.key for e in prof.key_averages()][:8])
