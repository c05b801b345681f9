#!/usr/bin/env bash
# fp8 thinker weights on the full-size checkpoint (H100 or H200; ~7 min on a fresh host: checkpoint ~1 min,
# bench ~4-5 min, fidelity ~1 min).
#   1. bench.thinker --weights fp8 at batches 1 and 16, overlapped decode on: the bf16 steps, the bf16
#      matmul-stack floor and prefill; then the same engine's weights quantized to fp8, the fp8 GEMM
#      configs swept (--fp8-tune; the winners printed as FP8_CONFIGS entries), the fp8 steps, the fp8
#      matmul-stack floor (the step's fp8 GEMMs alone in one CUDA graph) and prefill, each fp8 step as a
#      ratio to the fp8 floor and to the bf16 step, all in one run.
#   2. bench.thinker.fp8_fidelity: fp8 against bf16 on 4 chat prompts x 64 greedy tokens (teacher-forced
#      logit error and top-1 agreement, free-running greedy agreement) for docs/fidelity.md.
# Env: BENCH_BUDGET / FIDELITY_BUDGET (seconds, 330 / 120), TUNE (default "--fp8-tune"; empty: no sweep).
# Writes $OUT/fp8_bench.json, $OUT/fp8_bench.log, $OUT/fp8_fidelity.json, $OUT/fp8.md. Run from the
# repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
md="$OUT/fp8.md"
: > "$md"
# shellcheck disable=SC2086  # TUNE is a flag or nothing
timeout "${BENCH_BUDGET:-330}" "$PY" -m bench.thinker --checkpoint "$CKPT" --device cuda --batches 1,16 \
  --overlap on --no-hf --weights fp8 ${TUNE---fp8-tune} --decode-steps 128 --warmup-steps 16 --prefill-iters 2 \
  --json-out "$OUT/fp8_bench.json" > "$OUT/fp8_bench.log" 2>&1
rc=$?
echo "bench.thinker --weights fp8 rc=$rc after $(elapsed) s"
{ echo "## bench.thinker --weights fp8 (rc=$rc)"; echo; sed -n '/^Thinker engine benchmark/,$p' "$OUT/fp8_bench.log"
  echo; echo "fp8 GEMM sweep (FP8_CONFIGS entries):"; grep -E '^    \([0-9]+, [0-9]+, [0-9]+\): Fp8Config' "$OUT/fp8_bench.log"; } >> "$md"
[ $rc -eq 0 ] || tail -40 "$OUT/fp8_bench.log" | tee -a "$md"
timeout "${FIDELITY_BUDGET:-120}" "$PY" -m bench.thinker.fp8_fidelity --checkpoint "$CKPT" --device cuda \
  --prompts 4 --tokens 64 --json-out "$OUT/fp8_fidelity.json" > /tmp/fp8_fidelity.log 2>&1
rc=$?
echo "fp8_fidelity rc=$rc after $(elapsed) s"
{ echo; echo "## bench.thinker.fp8_fidelity (rc=$rc)"; echo; sed -n '/ KV cache vs bf16 weights/,$p' /tmp/fp8_fidelity.log; } >> "$md"
[ $rc -eq 0 ] || tail -30 /tmp/fp8_fidelity.log | tee -a "$md"
cat "$md"
