#!/usr/bin/env bash
# Automatic prefix caching through the launched pipeline (default single-GPU profile, prefix caching on):
# a 2000-token shared prefix sent twice vs 64-token prompts (cached_tokens of the second, TTFP ratio), a
# 3-turn chat's prompt / cached / prefilled tokens per turn, and a repeated image. Text and audio out
# (TTFP = first audio), as bench.e2e. Env: BUDGET (seconds for the whole run, 420), MODALITIES (audio|text),
# EXTRA (more bench.prefix_cache flags).
# Writes $OUT/prefix_cache/ (prefix_cache.json, prefix_cache.md, the stage logs, kept on failure).
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
budget=${BUDGET:-420}
# shellcheck disable=SC2086  # EXTRA is a list of flags
timeout "$budget" "$PY" -m bench.prefix_cache --checkpoint "$CKPT" --deploy-config "$PROFILE" --device cuda \
  --modalities "${MODALITIES:-audio}" --prefix-tokens 2000 --short-tokens 64 --reps 5 \
  --stage-args thinker=--graph-warmup-context=256 --out-dir "$OUT/prefix_cache" ${EXTRA:-} \
  > /tmp/prefix_cache.log 2>&1
rc=$?
echo "bench.prefix_cache rc=$rc after $(elapsed) s"
cat "$OUT/prefix_cache/prefix_cache.md" 2>/dev/null
grep -h "healthy after\|KVBudgetError\|Traceback\|Error" "$OUT"/prefix_cache/logs/*.log 2>/dev/null | cut -c1-260 | head -10
[ $rc -eq 0 ] || tail -30 /tmp/prefix_cache.log
