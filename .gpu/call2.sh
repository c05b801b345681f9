#!/usr/bin/env bash
# Session 9 call 2: bench.thinker --norm-fold both (+ profile), cuda_smoke thinker, e2e, realtime 16 x 30 s.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --norm-fold both \
  --overlap both --profile --no-hf --decode-steps 128 --warmup-steps 16 --prefill-iters 2 \
  --json-out "$OUT/thinker_bench.json" > "$OUT/thinker_bench.log" 2>&1
echo "bench.thinker rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^Thinker engine benchmark/,$p' "$OUT/thinker_bench.log"
timeout 120 python3 -m bench.cuda_smoke --checkpoint /tmp/ck --device cuda --stages thinker \
  --out-dir /tmp/thinker_smoke > /tmp/thinker_smoke.log 2>&1
echo "cuda_smoke rc=$? after $(( $(date +%s) - t0 )) s"
cp /tmp/thinker_smoke/cuda_smoke.json "$OUT/thinker_smoke.json" 2>/dev/null; cp /tmp/thinker_smoke/cuda_smoke.md "$OUT/thinker_smoke.md" 2>/dev/null
grep '^\[cuda_smoke\]' /tmp/thinker_smoke.log | tail -8; tail -5 /tmp/thinker_smoke.log
run_e2e 170 8,1 4 120
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null; sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p' /tmp/e2e/e2e.md
grep -h "folded\|thinker kernels" /tmp/e2e/logs/*thinker* 2>/dev/null | head -3
left=$(( 570 - ($(date +%s) - t0) ))
if [ "$left" -gt 110 ]; then
  timeout "$left" python3 -m bench.realtime_duplex --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml \
    --device cuda --units 10 --lanes turn --warmup 1 --startup-timeout 150 --sessions 16 \
    --duration ${RT_DUR:-30} --out-dir /tmp/rt > /tmp/rt.log 2>&1
  echo "realtime rc=$? after $(( $(date +%s) - t0 )) s"
  cp /tmp/rt/realtime.json "$OUT/rt.json" 2>/dev/null; cp /tmp/rt/realtime.md "$OUT/rt.md" 2>/dev/null; head -30 /tmp/rt/realtime.md 2>/dev/null || tail -20 /tmp/rt.log
fi
