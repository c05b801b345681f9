#!/usr/bin/env bash
# Session 11, call 1: the O-weight L2 prefetch inside the one-launch attention, A/B in one process per
# variant (placement at the start / end of each attention program; K/V loads evict-first or normal),
# then bench.cuda_smoke with the default (prefetch on). Writes thinker_*.json / *.md under $OUT.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint after $(( $(date +%s) - t0 )) s"
run() {  # run TAG LEVER ENV...
  local tag=$1 lever=$2; shift 2
  env "$@" timeout 170 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --overlap on \
    --l2-prefetch "$lever" --no-hf --decode-steps 128 --warmup-steps 16 --prefill-iters 2 \
    --json-out "$OUT/thinker_$tag.json" > "/tmp/thinker_$tag.log" 2>&1
  echo "== $tag rc=$? after $(( $(date +%s) - t0 )) s"
  { echo "## $tag ($*)"; sed -n '/^| batch | overlap/,/^$/p' "/tmp/thinker_$tag.log"; } | tee -a "$OUT/thinker.md"
  grep "^Prefill:" "/tmp/thinker_$tag.log"
  grep -iE "error|Traceback" "/tmp/thinker_$tag.log" | head -5
}
run start_normal both MINICPMO_L2PF_AT=start
run end_evict on MINICPMO_L2PF_AT=end MINICPMO_KV_EVICT_FIRST=1
run start_evict on MINICPMO_L2PF_AT=start MINICPMO_KV_EVICT_FIRST=1
timeout 70 python3 -m bench.cuda_smoke --checkpoint /tmp/ck --device cuda --stages thinker \
  --out-dir /tmp/thinker_smoke > /tmp/thinker_smoke.log 2>&1
echo "cuda_smoke rc=$? after $(( $(date +%s) - t0 )) s"
cp /tmp/thinker_smoke/cuda_smoke.md "$OUT/thinker_smoke.md" 2>/dev/null
grep '^\[cuda_smoke\]' /tmp/thinker_smoke.log | tail -12
tail -3 /tmp/thinker_start_normal.log
