#!/usr/bin/env bash
# Session 10, call 3: the one-launch rotary + attention A/B in bench.thinker (overlap on, batches 1 and
# 16), cuda_smoke on the default (one launch on), then the chat e2e at c=8,1 (4 bursts, timelines).
set -uo pipefail
source .gpu/env.sh || exit 1
start_call || exit 1
thinker_ab "--overlap on --rope-attention both" 200
run_e2e 170 8,1 4 120 --timeline-first
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null
sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
grep -h "slow engine step" /tmp/e2e/logs/*.log 2>/dev/null | cut -c1-250 | head -12
