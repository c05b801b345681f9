#!/usr/bin/env bash
# Session 11, call 3: (1) bench.thinker.gemm: each decode GEMM as written vs operands swapped (and the
# lm_head in vocabulary chunks), batch 1 and 16; (2) the one-launch attention on a packed chunk after
# dealing its fresh keys round the key splits; (3) bench.code2wav first windows (SDPA helper in the DiT).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
timeout 150 python3 -m bench.thinker.gemm --device cuda --batches 1,16 > "$OUT/gemm.log" 2>&1
echo "gemm rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| GEMM/,$p' "$OUT/gemm.log"; tail -3 "$OUT/gemm.log" | grep -i error
timeout 100 python3 -m bench.thinker.attention --device cuda --rope --batches 16 --contexts 576 \
  --rope-launches 64:2:2 --rope-chunk 13 > "$OUT/rope_chunk.log" 2>&1
echo "rope chunk rc=$? after $(( $(date +%s) - t0 )) s"
grep -A4 "^| batch" "$OUT/rope_chunk.log"
make_checkpoint || exit 1
echo "checkpoint after $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m bench.code2wav --checkpoint /tmp/ck --dit fused --dit-dtype bfloat16 --tf32 on \
  --concurrency 1,8 --windows 4 --reference-streams 0 > "$OUT/code2wav.log" 2>&1
echo "code2wav rc=$? after $(( $(date +%s) - t0 )) s"
grep -E "^\|" "$OUT/code2wav.log" | tail -8; tail -3 "$OUT/code2wav.log"
