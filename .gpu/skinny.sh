#!/usr/bin/env bash
# Skinny decode GEMMs (issue 17) + the e2e chat route and the native realtime lane on the default profile
# (MPS). Run from the repo root. 1. the microbench tunes the skinny configs (rows 1 and 16) and writes
# $OUT/skinny.json; 2. bench.thinker A/B (--skinny both) and cuda_smoke with that table
# (MINICPMO_THINKER_SKINNY_TABLE); 3. bench.e2e; 4. the native lane while time is left.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout "${TUNE_BUDGET:-170}" python3 -m bench.thinker.skinny --device cuda --rows "${TUNE_ROWS:-1,16}" \
  --json-out "$OUT/skinny.json" > "$OUT/skinny.md" 2> /tmp/skinny.err
echo "skinny microbench rc=$? after $(( $(date +%s) - t0 )) s"; tail -3 /tmp/skinny.err; cat "$OUT/skinny.md"
[ -s "$OUT/skinny.json" ] && export MINICPMO_THINKER_SKINNY_TABLE=$PWD/$OUT/skinny.json
[[ "$OUT" = /* ]] && [ -s "$OUT/skinny.json" ] && export MINICPMO_THINKER_SKINNY_TABLE=$OUT/skinny.json
LEVER="--skinny both" BENCH_BUDGET=${BENCH_BUDGET:-170} SMOKE_BUDGET=${SMOKE_BUDGET:-90} OUT=$OUT bash .gpu/thinker.sh | tail -60
# A skinny path that failed on the GPU must not take the e2e and realtime runs down with it.
grep -q "^## bench.thinker (rc=0)" "$OUT/thinker.md" || { export MINICPMO_THINKER_SKINNY_GEMM=0; echo "skinny off for the rest"; }
echo "thinker done after $(( $(date +%s) - t0 )) s"
run_e2e ${E2E_BUDGET:-150} 8,1 4 120
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null; sed -n '/^| c |/,/^$/p;/Bursts at/,/^$/p' /tmp/e2e/e2e.md
left=$(( ${TOTAL:-585} - ($(date +%s) - t0) ))
if [ "$left" -gt 100 ]; then
  timeout "$left" python3 -m bench.realtime_duplex --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml \
    --device cuda --units 10 --lanes native --warmup 1 --startup-timeout 150 --sessions ${NATIVE_LEVELS:-4} \
    --duration ${NATIVE_DUR:-30} --out-dir /tmp/rt_native > /tmp/rt_native.log 2>&1
  echo "native rc=$? after $(( $(date +%s) - t0 )) s"
  cp /tmp/rt_native/realtime.json "$OUT/rt_native.json" 2>/dev/null; cat /tmp/rt_native/realtime.md 2>/dev/null || tail -20 /tmp/rt_native.log
fi
