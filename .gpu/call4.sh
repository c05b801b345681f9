#!/usr/bin/env bash
# Session 9 call 4: bench.thinker (folded norms + two-stage attention), cuda_smoke thinker, realtime 16 x 30 s
# with the folded norms on (default) and off (MINICPMO_THINKER_NORM_FOLD=0), same call.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --overlap both --profile \
  --no-hf --decode-steps 128 --warmup-steps 16 --prefill-iters 2 --json-out "$OUT/thinker_bench.json" > "$OUT/thinker_bench.log" 2>&1
echo "bench.thinker rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^Same-run floors/,$p' "$OUT/thinker_bench.log"; grep "_paged_attention_kernel\|_qk_rope\|_silu" "$OUT/thinker_bench.log" | head -6
timeout 110 python3 -m bench.cuda_smoke --checkpoint /tmp/ck --device cuda --stages thinker \
  --out-dir /tmp/thinker_smoke > /tmp/thinker_smoke.log 2>&1
echo "cuda_smoke rc=$? after $(( $(date +%s) - t0 )) s"
cp /tmp/thinker_smoke/cuda_smoke.json "$OUT/thinker_smoke.json" 2>/dev/null; cp /tmp/thinker_smoke/cuda_smoke.md "$OUT/thinker_smoke.md" 2>/dev/null
grep '^\[cuda_smoke\]' /tmp/thinker_smoke.log | tail -3
for arm in on off; do
  left=$(( 560 - ($(date +%s) - t0) ))
  [ "$left" -gt 120 ] || { echo "no time for realtime $arm"; break; }
  if [ $arm = off ]; then export MINICPMO_THINKER_NORM_FOLD=0; fi
  timeout "$left" python3 -m bench.realtime_duplex --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml \
    --device cuda --units 10 --lanes turn --warmup 1 --startup-timeout 150 --sessions 16 \
    --duration 30 --out-dir /tmp/rt_$arm > /tmp/rt_$arm.log 2>&1
  echo "realtime fold=$arm rc=$? after $(( $(date +%s) - t0 )) s"
  cp /tmp/rt_$arm/realtime.json "$OUT/rt_$arm.json" 2>/dev/null; sed -n '/^| sessions/,/^$/p' /tmp/rt_$arm/realtime.md 2>/dev/null | tail -1 || tail -5 /tmp/rt_$arm.log
  grep -h "folded norms" /tmp/rt_$arm/logs/*thinker* 2>/dev/null | head -1
done
