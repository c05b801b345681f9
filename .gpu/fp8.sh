#!/usr/bin/env bash
# fp8 thinker weights on one H100/H200, full-size random checkpoint (run from the repo root; ~7 min on a
# fresh host: checkpoint ~1 min, bench ~4-5 min, fidelity ~1 min).
# 1. bench.thinker --weights fp8 at batches 1 and 16, overlapped decode on: the bf16 steps and bf16
#    matmul-stack floor, then the same engine quantized to fp8, the fp8 GEMM configs swept (--fp8-tune,
#    the winners printed as FP8_CONFIGS entries), the fp8 steps, the fp8 matmul-stack floor, and the
#    ratios (fp8 step / fp8 floor, fp8 step / bf16 step) in one run.
# 2. bench.thinker.fp8_fidelity: fp8 against bf16 on 4 chat prompts x 64 greedy tokens (teacher-forced
#    logit error and top-1 agreement, free-running greedy agreement).
# Writes under $OUT: fp8_bench.json, fp8_bench.log, fp8_fidelity.json, fp8.md (both Markdown reports).
set -uo pipefail
source .gpu/env.sh || exit 1
start_call || exit 1
md="$OUT/fp8.md"
: > "$md"
timeout "${BENCH_BUDGET:-330}" python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 \
  --overlap on --no-hf --weights fp8 --fp8-tune --decode-steps 128 --warmup-steps 16 --prefill-iters 2 \
  --json-out "$OUT/fp8_bench.json" > "$OUT/fp8_bench.log" 2>&1
rc=$?
echo "bench.thinker --weights fp8 rc=$rc after $(( $(date +%s) - t0 )) s"
{ echo "## bench.thinker --weights fp8 (rc=$rc)"; echo; sed -n '/^Thinker engine benchmark/,$p' "$OUT/fp8_bench.log";
  echo; echo "fp8 GEMM sweep:"; sed -n '/^fp8 GEMM sweep/,/^[^ ]/p' "$OUT/fp8_bench.log"; } >> "$md"
[ $rc -eq 0 ] || tail -40 "$OUT/fp8_bench.log" | tee -a "$md"
timeout "${FIDELITY_BUDGET:-120}" python3 -m bench.thinker.fp8_fidelity --checkpoint /tmp/ck --device cuda \
  --prompts 4 --tokens 64 --json-out "$OUT/fp8_fidelity.json" > /tmp/fp8_fidelity.log 2>&1
rc=$?
echo "fp8_fidelity rc=$rc after $(( $(date +%s) - t0 )) s"
{ echo; echo "## bench.thinker.fp8_fidelity (rc=$rc)"; echo; sed -n '/^fp8 vs bf16/,$p' /tmp/fp8_fidelity.log; } >> "$md"
[ $rc -eq 0 ] || tail -30 /tmp/fp8_fidelity.log | tee -a "$md"
cat "$md"
