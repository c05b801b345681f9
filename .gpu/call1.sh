#!/usr/bin/env bash
# Session 9 call 1: e2e (talker warm-up prefill check) then bench.thinker --skinny both (drop_graphs fix).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
run_e2e ${E2E_BUDGET:-170} 8,1 4 120
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null; sed -n '/^| c |/,/^$/p;/Bursts at/,/^$/p' /tmp/e2e/e2e.md
grep -h "captured\|warm" /tmp/e2e/logs/*talker* 2>/dev/null | head -5
timeout "${BENCH_BUDGET:-200}" python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 \
  --skinny both --no-hf --decode-steps 128 --warmup-steps 16 --prefill-iters 2 \
  --json-out "$OUT/thinker_bench.json" > /tmp/thinker_bench.log 2>&1
rc=$?
echo "bench.thinker rc=$rc after $(( $(date +%s) - t0 )) s"
sed -n '/^Thinker engine benchmark/,$p' /tmp/thinker_bench.log > "$OUT/thinker.md"; cat "$OUT/thinker.md"
[ $rc -eq 0 ] || tail -40 /tmp/thinker_bench.log
