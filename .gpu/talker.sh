#!/usr/bin/env bash
# Talker K-steps-per-replay A/B on one H200 (run from the repo root; needs the full-size checkpoint at /tmp/ck).
# 1. bench.talker at batches 1 and 16, fused Triton kernels (the CUDA default), 1 vs 4 vs 8 decode steps
#    per graph replay (one engine each, same weights, same run): frames/s per stream, ms/step, replay ms/step.
# 2. bench.cuda_smoke --stages talker: the graphed engine at the default K (4) and at K=8 vs the eager
#    torch engine one step at a time: codes equal within bf16 near-ties.
# Writes under $OUT: talker_bench.json, talker_smoke_k4.json, talker_smoke_k8.json, talker.md.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
[ -f /tmp/ck/config.json ] || { echo "no checkpoint at /tmp/ck"; exit 1; }
md="$OUT/talker.md"
: > "$md"
timeout "${BENCH_BUDGET:-110}" python3 -m bench.talker --checkpoint /tmp/ck --device cuda --batches 1,16 \
  --frames "${FRAMES:-200}" --baseline-frames 0 --repeats 2 --kernels triton --steps-per-replay "${KS:-1,4,8}" \
  --out "$OUT/talker_bench.json" > /tmp/talker_bench.log 2>&1
rc=$?
echo "bench.talker rc=$rc after $(( $(date +%s) - t0 )) s"
{ echo "## bench.talker (rc=$rc)"; echo; sed -n '/^Talker on/,$p' /tmp/talker_bench.log; } >> "$md"
[ $rc -eq 0 ] || tail -40 /tmp/talker_bench.log | tee -a "$md"
for k in 4 8; do
  timeout "${SMOKE_BUDGET:-40}" python3 -m bench.cuda_smoke --checkpoint /tmp/ck --device cuda --stages talker \
    --talker-steps-per-replay "$k" --out-dir "/tmp/talker_smoke_k$k" > "/tmp/talker_smoke_k$k.log" 2>&1
  rc=$?
  echo "cuda_smoke K=$k rc=$rc after $(( $(date +%s) - t0 )) s"
  cp "/tmp/talker_smoke_k$k/cuda_smoke.json" "$OUT/talker_smoke_k$k.json" 2>/dev/null
  { echo; echo "## bench.cuda_smoke --stages talker --talker-steps-per-replay $k (rc=$rc)"; echo;
    grep '^\[cuda_smoke\]' "/tmp/talker_smoke_k$k.log"; echo; cat "/tmp/talker_smoke_k$k/cuda_smoke.md" 2>/dev/null; } >> "$md"
  [ $rc -eq 0 ] || tail -30 "/tmp/talker_smoke_k$k.log" | tee -a "$md"
done
cat "$md"
