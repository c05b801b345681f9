#!/usr/bin/env bash
# Thinker decode levers on one H200 (run from the repo root; needs the full-size checkpoint at /tmp/ck).
# 1. bench.thinker at batches 1 and 16, overlapped decode off vs on in the same run (same engine, same
#    graphs): engine ms/step, graph replay ms, matmul-stack floor, ratios, chained-step counts.
# 2. bench.cuda_smoke --stages thinker: graphed Triton engine (overlap on, the default) vs the eager
#    torch engine, tokens equal within bf16 near-ties.
# Writes 3 files under $OUT: thinker_bench.json, thinker_smoke.json, thinker.md (both Markdown reports).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
[ -f /tmp/ck/config.json ] || { echo "no checkpoint at /tmp/ck"; exit 1; }
md="$OUT/thinker.md"
: > "$md"
timeout "${BENCH_BUDGET:-110}" python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 \
  ${LEVER:---overlap both} --no-hf --decode-steps "${STEPS:-128}" --warmup-steps 16 --prefill-iters 2 \
  --json-out "$OUT/thinker_bench.json" > /tmp/thinker_bench.log 2>&1
rc=$?
echo "bench.thinker rc=$rc after $(( $(date +%s) - t0 )) s"
{ echo "## bench.thinker (rc=$rc)"; echo; sed -n '/^Thinker engine benchmark/,$p' /tmp/thinker_bench.log; } >> "$md"
[ $rc -eq 0 ] || tail -40 /tmp/thinker_bench.log | tee -a "$md"
timeout "${SMOKE_BUDGET:-60}" python3 -m bench.cuda_smoke --checkpoint /tmp/ck --device cuda --stages thinker \
  --out-dir /tmp/thinker_smoke > /tmp/thinker_smoke.log 2>&1
rc=$?
echo "cuda_smoke rc=$rc after $(( $(date +%s) - t0 )) s"
cp /tmp/thinker_smoke/cuda_smoke.json "$OUT/thinker_smoke.json" 2>/dev/null
{ echo; echo "## bench.cuda_smoke --stages thinker (rc=$rc)"; echo; grep '^\[cuda_smoke\]' /tmp/thinker_smoke.log;
  echo; cat /tmp/thinker_smoke/cuda_smoke.md 2>/dev/null; } >> "$md"
[ $rc -eq 0 ] || tail -30 /tmp/thinker_smoke.log | tee -a "$md"
cat "$md"
