#!/usr/bin/env bash
# Session 11, call 5: tune the skinny O projection (bench.thinker.skinny --shapes o) and A/B it in the
# engine (--skinny-o both, the tuned table); bench.cuda_smoke with it on; then the chat e2e at c=8,1
# (code2wav's remainder last windows graphed: warm-up time and any eager window).
set -uo pipefail
source .gpu/env.sh || exit 1
start_call || exit 1
timeout 100 python3 -m bench.thinker.skinny --device cuda --rows 1,16 --shapes o --json-out "$OUT/skinny_o.json" \
  > "$OUT/skinny_o.log" 2>&1
echo "skinny tune rc=$? after $(( $(date +%s) - t0 )) s"; grep -E "^\[skinny\]|SKINNY_CONFIGS|^    \(" "$OUT/skinny_o.log" | head -8
export MINICPMO_THINKER_SKINNY_TABLE="$OUT/skinny_o.json"
timeout 150 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --overlap on --no-hf \
  --skinny-o both --decode-steps 128 --warmup-steps 16 --prefill-iters 5 --json-out "$OUT/thinker.json" > "$OUT/thinker.log" 2>&1
echo "bench.thinker rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| batch | overlap/,/^$/p' "$OUT/thinker.log"; grep -E "^Prefill" "$OUT/thinker.log"; grep -iE "Traceback|Error" "$OUT/thinker.log" | head -3
MINICPMO_THINKER_SKINNY_O=1 timeout 70 python3 -m bench.cuda_smoke --checkpoint /tmp/ck --device cuda --stages thinker \
  --out-dir /tmp/thinker_smoke > /tmp/thinker_smoke.log 2>&1
echo "cuda_smoke rc=$? after $(( $(date +%s) - t0 )) s"
cp /tmp/thinker_smoke/cuda_smoke.md "$OUT/thinker_smoke.md" 2>/dev/null
grep '^\[cuda_smoke\]' /tmp/thinker_smoke.log | grep -v "engine steps" | tail -9
e2e_rest 575 200 "code2wav warm-up\|no graph for\|warm-up\|healthy after" 15
