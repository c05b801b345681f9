#!/usr/bin/env bash
# Realtime full-duplex capacity through the launched pipeline (default single-GPU profile): SESSIONS
# concurrent sessions (default "16") on /v1/realtime?duplex=1, each streaming DURATION seconds (30) of
# audio paced in real time on LANES ("turn"; "native" for the model-owned turn taking; "turn native"
# for both), after one warm-up session. Reports per level: unit RTF p50/p90/p99 (a session keeps up
# while it stays under 1), playout underruns, first audio after commit, barge-in latency at the client
# and each stage's drain, the thinker's unit and step split, each stage's busy share.
# Env: SESSIONS, DURATION, LANES, BUDGET (seconds, 400), LEVEL_TIMEOUT (seconds a level may run before
# its unfinished sessions are stopped and reported as such; 2 x DURATION + 60), EXTRA (more
# bench.realtime_duplex flags, e.g. "--gpu-sharing time_slice" to run the stages without MPS),
# STARTUP_TIMEOUT (seconds the stages may take to report serving, 300: on an H100 under MPS they took
# 141 s in one run and more than 150 in the next, code2wav's graph warm-up the longest),
# WHISPER_PASS (1: first time one batched streaming-Whisper pass at 1/4/16/24 sessions, full-size
# shapes, alone on the card, into $OUT/realtime/whisper_pass.md, about half a minute; 0 skips it).
# Writes $OUT/realtime/realtime.json, realtime.md and the stage logs (realtime/logs/) as it goes, so a run
# cut short by the host's time limit keeps every finished level and every log. Run from the repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
mkdir -p "$OUT/realtime"
if [ "${WHISPER_PASS:-1}" = 1 ]; then
  timeout 120 "$PY" -m bench.thinker.whisper_pass --device cuda --dims full --batches 1,4,16,24 --passes 10 \
    > "$OUT/realtime/whisper_pass.md" 2> "$OUT/realtime/whisper_pass.log"
  echo "bench.thinker.whisper_pass rc=$? after $(elapsed) s"
  tail -6 "$OUT/realtime/whisper_pass.md"
fi
# shellcheck disable=SC2086  # SESSIONS and EXTRA are lists
timeout "${BUDGET:-400}" "$PY" -m bench.realtime_duplex --checkpoint "$CKPT" --deploy-config "$PROFILE" \
  --device cuda --units 10 --lanes ${LANES:-turn} --warmup 1 --startup-timeout "${STARTUP_TIMEOUT:-300}" \
  --sessions ${SESSIONS:-16} --duration "${DURATION:-30}" --level-timeout "${LEVEL_TIMEOUT:-$((2 * ${DURATION:-30} + 60))}" \
  ${EXTRA:-} --out-dir "$OUT/realtime" \
  > "$OUT/realtime/bench.log" 2>&1
rc=$?
echo "bench.realtime_duplex rc=$rc after $(elapsed) s"
grep -h "slow engine step\|while serving\|no graph for\|OutOfMemory" "$OUT"/realtime/logs/*.log 2>/dev/null \
  | cut -c1-220 | head -12
cat "$OUT/realtime/realtime.md" 2>/dev/null || tail -30 "$OUT/realtime/bench.log"
