#!/usr/bin/env bash
# Thinker decode and prefill on the full-size checkpoint, then its CUDA-graph correctness check.
#   1. bench.thinker at batches 1 and 16: engine ms per decode step, graph replay ms, the same-run matmul
#      floor (the step's weight matmuls alone in one CUDA graph) and decode as a ratio to it, prefill of
#      512 tokens in ms and as a share of the dense matmul rate.
#   2. bench.cuda_smoke --stages thinker: the graphed Triton engine against the eager torch engine,
#      tokens equal within bf16 near-ties.
# Env: LEVER (bench.thinker flags for an A/B in the same run, default "--overlap on"; e.g.
# "--skinny-o both", "--rope-attention both"), STEPS (decode steps, 128), WARMUP (warm-up steps, 16),
# PREFILL_ITERS (timed prefills, 5),
# BENCH_BUDGET / SMOKE_BUDGET (seconds, 150 / 90).
# Writes $OUT/thinker.json, $OUT/thinker.md, $OUT/thinker_smoke.json. Run from the repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
md="$OUT/thinker.md"
: > "$md"
# shellcheck disable=SC2086  # LEVER is a list of flags
timeout "${BENCH_BUDGET:-150}" "$PY" -m bench.thinker --checkpoint "$CKPT" --device cuda --batches 1,16 \
  ${LEVER:---overlap on} --no-hf --decode-steps "${STEPS:-128}" --warmup-steps "${WARMUP:-16}" \
  --prefill-iters "${PREFILL_ITERS:-5}" --json-out "$OUT/thinker.json" > /tmp/thinker.log 2>&1
rc=$?
echo "bench.thinker rc=$rc after $(elapsed) s"
{ echo "## bench.thinker (rc=$rc)"; echo; sed -n '/^Thinker engine benchmark/,$p' /tmp/thinker.log; } >> "$md"
[ $rc -eq 0 ] || tail -40 /tmp/thinker.log | tee -a "$md"
timeout "${SMOKE_BUDGET:-90}" "$PY" -m bench.cuda_smoke --checkpoint "$CKPT" --device cuda --stages thinker \
  --out-dir /tmp/thinker_smoke > /tmp/thinker_smoke.log 2>&1
rc=$?
echo "cuda_smoke rc=$rc after $(elapsed) s"
cp /tmp/thinker_smoke/cuda_smoke.json "$OUT/thinker_smoke.json" 2>/dev/null
{ echo; echo "## bench.cuda_smoke --stages thinker (rc=$rc)"; echo; grep '^\[cuda_smoke\]' /tmp/thinker_smoke.log
  echo; cat /tmp/thinker_smoke/cuda_smoke.md 2>/dev/null; } >> "$md"
[ $rc -eq 0 ] || tail -30 /tmp/thinker_smoke.log | tee -a "$md"
cat "$md"
