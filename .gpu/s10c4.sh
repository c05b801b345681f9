#!/usr/bin/env bash
# Session 10, call 4: rotary + attention, two kernels vs the one launch at each launch config (step
# conditions), then the chat e2e at c=8,1 with the talker's scratch-stream warm-up.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m bench.thinker.attention --rope --batches 1,4,16 --contexts 576 > "$OUT/rope_sweep.log" 2>&1
echo "rope sweep rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| batch/,$p' "$OUT/rope_sweep.log"; tail -3 "$OUT/rope_sweep.log"
run_e2e 170 8,1 4 120 --timeline-first
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null
sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
grep -h "slow engine step\|talker warm-up" /tmp/e2e/logs/*.log 2>/dev/null | cut -c1-250 | head -12
