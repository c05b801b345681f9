#!/usr/bin/env bash
# Session 11, call 6: the final defaults (skinny O on from the built-in table, swapped lm_head, no env):
# bench.thinker at batch 1 and 16, then the chat e2e at c=8,1.
set -uo pipefail
source .gpu/env.sh || exit 1
start_call || exit 1
timeout 80 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --overlap on --no-hf \
  --decode-steps 64 --warmup-steps 8 --prefill-iters 3 --json-out "$OUT/thinker.json" > "$OUT/thinker.log" 2>&1
echo "bench.thinker rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| batch | overlap/,/^$/p' "$OUT/thinker.log"; grep -E "^Prefill" "$OUT/thinker.log"
e2e_rest 335 180 "code2wav warm-up\|no graph for\|healthy after"
