#!/usr/bin/env bash
# Session 9 call 1: e2e (talker warm-up prefill check) then bench.thinker --skinny both (drop_graphs fix).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
[ -f /tmp/ck/config.json ] || python3 -m services.common.checkpoint_tool make --size full --device cuda /tmp/ck > /tmp/ck.log 2>&1 || { tail -20 /tmp/ck.log; exit 1; }
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout "${E2E_BUDGET:-170}" python3 -m bench.e2e --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml --device cuda \
  --concurrency 8,1 --bursts 4 --warmup 1 --warmup-rounds 0 --requests-per-level 5 --timeline-requests 3 \
  --timeline-bursts 4 --max-seconds 120 --stage-args thinker=--graph-warmup-context=256 \
  --out-dir /tmp/e2e > /tmp/e2e.log 2>&1
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
