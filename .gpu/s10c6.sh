#!/usr/bin/env bash
# Session 10, call 6: the SDPA per-shape probe, then (if the fix is in) the chat e2e at c=8,1.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
timeout 60 python3 .gpu/sdpa_probe.py 2>&1 | tail -8
echo "probe after $(( $(date +%s) - t0 )) s"
make_checkpoint || exit 1
run_e2e 140 8,1 4 120 --timeline-first
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null
sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
grep -h "slow engine step\|talker warm-up" /tmp/e2e/logs/*.log 2>/dev/null | cut -c1-200 | head -12
