#!/usr/bin/env bash
# Code2Wav on the full-size checkpoint: the first window's latency (the part of time-to-first-audio that
# code2wav owns) and the real-time factor per concurrency, with the fused bf16 DiT and TF32 on (the
# served configuration), 4 windows per stream, at CONCURRENCY streams (default "1,8"), with windows of
# WINDOW_CODES new codes (default "25"; "25,50" also measures the 2 s windows of talker.codec.window_frames 50).
# Env: CONCURRENCY, WINDOW_CODES, BENCH_BUDGET (seconds, 200).
# Writes $OUT/code2wav.log and $OUT/code2wav.md. Run from the repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
timeout "${BENCH_BUDGET:-200}" "$PY" -m bench.code2wav --checkpoint "$CKPT" --device cuda --dit fused \
  --dit-dtype bfloat16 --tf32 on --concurrency "${CONCURRENCY:-1,8}" --windows 4 --reference-streams 0 \
  --window-codes "${WINDOW_CODES:-25}" \
  > "$OUT/code2wav.log" 2>&1
rc=$?
echo "bench.code2wav rc=$rc after $(elapsed) s"
grep -E "^\|" "$OUT/code2wav.log" | tee "$OUT/code2wav.md"
[ $rc -eq 0 ] || tail -30 "$OUT/code2wav.log"
