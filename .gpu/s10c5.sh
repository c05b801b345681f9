#!/usr/bin/env bash
# Session 10, call 5: the one-launch rotary + attention (per-row-count launches) A/B in bench.thinker,
# cuda_smoke on the defaults, then the chat e2e at c=8,1 with the talker warm-up on its engine thread,
# and a second c=8 e2e if the call has time left.
set -uo pipefail
source .gpu/env.sh || exit 1
start_call || exit 1
thinker_ab "--overlap on --rope-attention both" 200
for run in 1 2; do
  [ $run -eq 2 ] && [ $(( $(date +%s) - t0 )) -gt 300 ] && break
  conc=8,1; [ $run -eq 2 ] && conc=8
  run_e2e 150 $conc 4 120 --timeline-first
  echo "e2e run $run rc=$? after $(( $(date +%s) - t0 )) s"
  mkdir -p "$OUT/e2e$run"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e$run/" 2>/dev/null
  sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
  grep -h "slow engine step\|talker warm-up" /tmp/e2e/logs/*.log 2>/dev/null | cut -c1-200 | head -12
done
