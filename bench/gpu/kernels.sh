#!/usr/bin/env bash
# Thinker kernel microbenchmarks (no checkpoint needed; random tensors of the real shapes):
#   1. bench.thinker.gemm: each decode GEMM as written vs with its operands swapped, batches 1 and 16;
#   2. bench.thinker.attention --rope: rotary + paged attention as two kernels vs the one-launch kernel,
#      at 0.5x/1x/2x the key-split rule, batch 1 and 16, context 576;
#   3. bench.thinker.skinny: tunes the skinny O-projection GEMM at rows 1 and 16 and prints the table
#      (compare with the built-in table in the thinker's kernels before changing it);
#   4. bench/gpu/sdpa_probe.py: whether eager SDPA pays a first-call cost per new shape (talker prefill);
#   5. bench.duplex_policy: the duplex decision policy per step, eager batched ops vs the captured replay.
# Writes $OUT/gemm.log, $OUT/rope.log, $OUT/skinny_o.json, $OUT/skinny_o.log, $OUT/sdpa_probe.log,
# $OUT/duplex_policy.log.
# Run from the repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
timeout 150 "$PY" -m bench.thinker.gemm --device cuda --batches 1,16 > "$OUT/gemm.log" 2>&1
echo "gemm rc=$? after $(elapsed) s"; sed -n '/^| GEMM/,$p' "$OUT/gemm.log"
timeout 170 "$PY" -m bench.thinker.attention --device cuda --rope --batches 1,16 --contexts 576 \
  --rope-splits 0.5,1,2 > "$OUT/rope.log" 2>&1
echo "rope attention rc=$? after $(elapsed) s"; sed -n '/^| batch/,$p' "$OUT/rope.log"
timeout 100 "$PY" -m bench.thinker.skinny --device cuda --rows 1,16 --shapes o --json-out "$OUT/skinny_o.json" \
  > "$OUT/skinny_o.log" 2>&1
echo "skinny tune rc=$? after $(elapsed) s"; grep -E "^\[skinny\]|^    \(" "$OUT/skinny_o.log" | head -8
timeout 60 "$PY" bench/gpu/sdpa_probe.py > "$OUT/sdpa_probe.log" 2>&1
echo "sdpa probe rc=$? after $(elapsed) s"; tail -8 "$OUT/sdpa_probe.log"
timeout 90 "$PY" -m bench.duplex_policy --rows 1,4,16 --iters 200 > "$OUT/duplex_policy.log" 2>&1
echo "duplex policy rc=$? after $(elapsed) s"; grep -E "^\|" "$OUT/duplex_policy.log" | tail -10
