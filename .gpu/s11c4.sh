#!/usr/bin/env bash
# Session 11, call 4: the lm_head orientation at every row bucket; bench.thinker with the swapped
# lm_head (floor both ways); bench.cuda_smoke --stages thinker; the chat e2e at c=8,1 (code2wav's
# remainder last windows now graphed at power-of-two batches: its warm-up line and any eager windows).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
timeout 60 python3 -m bench.thinker.gemm --device cuda --gemms lm_head --batches 1,2,4,8,16,32 \
  --lm-head-chunks "" > "$OUT/gemm_head.log" 2>&1
echo "gemm rc=$? after $(( $(date +%s) - t0 )) s"; sed -n '/^| GEMM/,$p' "$OUT/gemm_head.log"
make_checkpoint || exit 1
echo "checkpoint after $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --overlap on --no-hf \
  --decode-steps 128 --warmup-steps 16 --prefill-iters 5 --json-out "$OUT/thinker.json" > "$OUT/thinker.log" 2>&1
echo "bench.thinker rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| batch | overlap/,/^$/p' "$OUT/thinker.log"; grep -E "^Prefill" "$OUT/thinker.log"; grep -iE "Traceback|Error" "$OUT/thinker.log" | head -3
timeout 70 python3 -m bench.cuda_smoke --checkpoint /tmp/ck --device cuda --stages thinker \
  --out-dir /tmp/thinker_smoke > /tmp/thinker_smoke.log 2>&1
echo "cuda_smoke rc=$? after $(( $(date +%s) - t0 )) s"
cp /tmp/thinker_smoke/cuda_smoke.md "$OUT/thinker_smoke.md" 2>/dev/null
grep '^\[cuda_smoke\]' /tmp/thinker_smoke.log | grep -v "engine steps" | tail -9
run_e2e 170 8,1 4 120 --timeline-first
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null; cp -r /tmp/e2e/logs "$OUT/e2e/" 2>/dev/null
sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p' /tmp/e2e/e2e.md
grep -h "code2wav warm-up\|no graph for\|talker warm-up" /tmp/e2e/logs/*.log 2>/dev/null | cut -c1-260 | head -12
