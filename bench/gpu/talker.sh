#!/usr/bin/env bash
# Talker decode on the full-size checkpoint, then its CUDA-graph correctness check.
#   1. bench.talker at batches 1 and 16 with the fused Triton kernels (the CUDA default): frames/s per
#      stream (real time is 25 frames/s), ms per step, graph replay ms per step, for each value of
#      KS (decode steps per graph replay; default "4", the engine's default; "1,4,8" for the A/B).
#   2. bench.cuda_smoke --stages talker: the graphed engine against the eager torch engine one step at a
#      time, codes equal within bf16 near-ties.
#   3. bench.talker.prefill: batched prefill ms of 1, 4, 8 streams (12 and 40 rows, at 0 and 900), eager
#      vs the captured prefill graphs, with the graph set's capture time and pool memory.
# Env: KS, FRAMES (200), BENCH_BUDGET / SMOKE_BUDGET / PREFILL_BUDGET (seconds, 150 / 60 / 90).
# Writes $OUT/talker.json, $OUT/talker.md, $OUT/talker_smoke.json, $OUT/talker_prefill.json. Run from the
# repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
md="$OUT/talker.md"
: > "$md"
timeout "${BENCH_BUDGET:-150}" "$PY" -m bench.talker --checkpoint "$CKPT" --device cuda --batches 1,16 \
  --frames "${FRAMES:-200}" --baseline-frames 0 --repeats 2 --kernels triton --steps-per-replay "${KS:-4}" \
  --out "$OUT/talker.json" > /tmp/talker.log 2>&1
rc=$?
echo "bench.talker rc=$rc after $(elapsed) s"
{ echo "## bench.talker (rc=$rc)"; echo; sed -n '/^Talker on/,$p' /tmp/talker.log; } >> "$md"
[ $rc -eq 0 ] || tail -40 /tmp/talker.log | tee -a "$md"
timeout "${SMOKE_BUDGET:-60}" "$PY" -m bench.cuda_smoke --checkpoint "$CKPT" --device cuda --stages talker \
  --out-dir /tmp/talker_smoke > /tmp/talker_smoke.log 2>&1
rc=$?
echo "cuda_smoke rc=$rc after $(elapsed) s"
cp /tmp/talker_smoke/cuda_smoke.json "$OUT/talker_smoke.json" 2>/dev/null
{ echo; echo "## bench.cuda_smoke --stages talker (rc=$rc)"; echo; grep '^\[cuda_smoke\]' /tmp/talker_smoke.log
  echo; cat /tmp/talker_smoke/cuda_smoke.md 2>/dev/null; } >> "$md"
[ $rc -eq 0 ] || tail -30 /tmp/talker_smoke.log | tee -a "$md"
timeout "${PREFILL_BUDGET:-90}" "$PY" -m bench.talker.prefill --checkpoint "$CKPT" --device cuda \
  --out "$OUT/talker_prefill.json" > /tmp/talker_prefill.log 2>&1
rc=$?
echo "bench.talker.prefill rc=$rc after $(elapsed) s"
{ echo; echo "## bench.talker.prefill (rc=$rc)"; echo; sed -n '/^Talker prefill on/,$p' /tmp/talker_prefill.log; } >> "$md"
[ $rc -eq 0 ] || tail -30 /tmp/talker_prefill.log | tee -a "$md"
cat "$md"
