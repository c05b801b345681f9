#!/usr/bin/env bash
# The audio API end to end through the launched pipeline (gateway + three stage processes on one GPU, the
# default single-GPU profile): /v1/audio/speech time to first audio byte and RTF for a 20-word input at
# c=1 and c=8, default voice vs a registered voice (the checkpoint's reference clip uploaded once), and
# /v1/audio/transcriptions of a 60 s clip at c=1; per level, each stage's busy time, steps, batch and
# the thinker tokens / talker frames each request cost (bench/stage_profile.py, from the stages' metrics).
# Env: REQUESTS (speech requests per level, 32), BUDGET (seconds for the whole run, 540), EXTRA (more
# bench.audio_speech flags, e.g. --interleave, --voices default, --words 60, --levels 8,
# --stage-overrides JSON). Writes $OUT/audio/ (audio.json, audio.md, the stage logs). Run from the
# repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
budget=${BUDGET:-540}
# shellcheck disable=SC2086  # EXTRA is a list of flags
timeout "$budget" "$PY" -m bench.audio_speech --checkpoint "$CKPT" --deploy-config "$PROFILE" --device cuda \
  --requests "${REQUESTS:-32}" --levels 1,8 --transcriptions 5 --out-dir "$OUT/audio" ${EXTRA:-} \
  > /tmp/audio.log 2>&1
rc=$?
echo "bench.audio_speech rc=$rc after $(elapsed) s"
cat "$OUT/audio/audio.md" 2>/dev/null
[ $rc -eq 0 ] || tail -30 /tmp/audio.log
