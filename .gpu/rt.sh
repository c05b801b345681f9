#!/usr/bin/env bash
# Realtime A/B on one H200: encode-ahead + turn look-ahead OFF vs ON (issue 16). Run from the repo root.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
run() {
  name=$1; shift
  timeout "$BUDGET" python3 -m bench.realtime_duplex --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml \
    --device cuda --units 10 --lanes turn --warmup 1 --startup-timeout 150 --out-dir /tmp/$name "$@" > /tmp/$name.log 2>&1
  echo "$name rc=$? after $(( $(date +%s) - t0 )) s"
  cp /tmp/$name/realtime.json "$OUT/$name.json" 2>/dev/null; cp /tmp/$name/realtime.md "$OUT/$name.md" 2>/dev/null
  cat /tmp/$name/realtime.md 2>/dev/null || tail -30 /tmp/$name.log
}
[[ " ${ARMS:-off on} " == *" off "* ]] && BUDGET=${OFF_BUDGET:-230} MINICPMO_DUPLEX_ENCODE_AHEAD=0 MINICPMO_REALTIME_TURN_LOOKAHEAD=0 run rt_off${TAG:-} --sessions ${OFF_LEVELS:-1 16} --duration ${DUR:-30}
[[ " ${ARMS:-off on} " == *" on "* ]] && BUDGET=${ON_BUDGET:-290} run rt_on${TAG:-} --sessions ${ON_LEVELS:-1 4 16} --duration ${DUR:-30}
