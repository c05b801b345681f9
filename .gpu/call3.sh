#!/usr/bin/env bash
# Session 9 call 3: attention launch sweep, e2e with the first burst's marks, realtime 16 sessions x 60 s.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m bench.thinker.attention --device cuda --sweep --batches 1,16 --contexts 512,1024 \
  > "$OUT/attn_sweep.log" 2>&1
echo "attention sweep rc=$? after $(( $(date +%s) - t0 )) s"; sed -n '/^| batch/,$p' "$OUT/attn_sweep.log"; tail -3 "$OUT/attn_sweep.log"
run_e2e 170 8,1 4 120 --timeline-first
echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null; sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p' /tmp/e2e/e2e.md
for f in /tmp/e2e/logs/*.log; do echo "== $f"; grep -i "eager\|compil\|no graph\|slow\|warn" "$f" | tail -6; done 2>/dev/null | head -60
left=$(( 575 - ($(date +%s) - t0) ))
if [ "$left" -gt 150 ]; then
  timeout "$left" python3 -m bench.realtime_duplex --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml \
    --device cuda --units 10 --lanes turn --warmup 1 --startup-timeout 150 --sessions 16 \
    --duration $(( left > 260 ? 60 : 30 )) --out-dir /tmp/rt > /tmp/rt.log 2>&1
  echo "realtime rc=$? after $(( $(date +%s) - t0 )) s"
  cp /tmp/rt/realtime.json "$OUT/rt.json" 2>/dev/null; cp /tmp/rt/realtime.md "$OUT/rt.md" 2>/dev/null; head -30 /tmp/rt/realtime.md 2>/dev/null || tail -20 /tmp/rt.log
fi
