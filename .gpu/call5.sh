#!/usr/bin/env bash
# Session 9 call 5: the c=8 bursts after the talker's prefill sweep at start (first burst's marks first).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
run_e2e 150 8 2 100 --timeline-first
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null; sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
grep -h "prefill warm\|captured" /tmp/e2e/logs/talker-0.log | head -3; tail -3 /tmp/e2e.log
