#!/usr/bin/env bash
# The c=8 chat bursts with the start-up heap frozen (default) and not (MINICPMO_GC_FREEZE=0), same call:
# each burst row of e2e.md says which processes ran a full GC and for how long; the stage logs' slow-step
# lines (MINICPMO_SLOW_STEP_MS, 50 ms) say which talker phase a slow burst spent its time in.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
for freeze in 1 0; do
  export MINICPMO_GC_FREEZE=$freeze
  run_e2e 170 8,1 4 120 --timeline-first
  echo "e2e freeze=$freeze rc=$? after $(( $(date +%s) - t0 )) s"
  mkdir -p "$OUT/e2e_freeze$freeze"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e_freeze$freeze/" 2>/dev/null
  sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p' /tmp/e2e/e2e.md
  grep -h "slow engine step\|froze" /tmp/e2e/logs/*.log 2>/dev/null | cut -c1-300 | head -20
done
