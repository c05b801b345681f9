#!/usr/bin/env bash
# Session 11, call 6: the final defaults (skinny O on from the built-in table, swapped lm_head, no env):
# bench.thinker at batch 1 and 16, then the chat e2e at c=8,1.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint after $(( $(date +%s) - t0 )) s"
timeout 80 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --overlap on --no-hf \
  --decode-steps 64 --warmup-steps 8 --prefill-iters 3 --json-out "$OUT/thinker.json" > "$OUT/thinker.log" 2>&1
echo "bench.thinker rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| batch | overlap/,/^$/p' "$OUT/thinker.log"; grep -E "^Prefill" "$OUT/thinker.log"
left=$(( 335 - ($(date +%s) - t0) ))
echo "e2e budget $left s"
[ "$left" -gt 180 ] || exit 0
run_e2e "$left" 8,1 4 $(( left - 10 )) --timeline-first
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null
sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
grep -h "code2wav warm-up\|no graph for\|healthy after" /tmp/e2e/logs/*.log /tmp/e2e.log 2>/dev/null | cut -c1-200 | head -8
