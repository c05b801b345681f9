#!/usr/bin/env bash
# Session 9 call 5: the c=8 bursts after the talker's prefill sweep at start (first burst's marks first).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
[ -f /tmp/ck/config.json ] || python3 -m services.common.checkpoint_tool make --size full --device cuda /tmp/ck > /tmp/ck.log 2>&1 || { tail -20 /tmp/ck.log; exit 1; }
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m bench.e2e --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml --device cuda \
  --concurrency 8 --bursts 4 --warmup 1 --warmup-rounds 0 --requests-per-level 5 --timeline-requests 3 \
  --timeline-bursts 2 --timeline-first --max-seconds 100 --stage-args thinker=--graph-warmup-context=256 \
  --out-dir /tmp/e2e > /tmp/e2e.log 2>&1
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null; sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
grep -h "prefill warm\|captured" /tmp/e2e/logs/talker-0.log | head -3; tail -3 /tmp/e2e.log
