# Sourced by the .gpu/*.sh scripts on the GPU host (run from the repo root): install the carried wheels
# (.whl/, see ../shared/tools/gpu-host-wheels.sh) into /tmp/site, point PYTHONPATH at them and the repo,
# and make $OUT. Returns non-zero if the wheels do not install.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; return 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench-results}
mkdir -p "$OUT"

# The full-size random checkpoint at /tmp/ck (made once per machine, 40-55 s).
make_checkpoint() {
  [ -f /tmp/ck/config.json ] || python3 -m services.common.checkpoint_tool make --size full --device cuda /tmp/ck \
    > /tmp/ck.log 2>&1 || { tail -20 /tmp/ck.log; return 1; }
}

# The chat-route e2e of issue 17 (c=8 bursts on fresh connections, the first burst after start counted):
# run_e2e BUDGET_S CONCURRENCY TIMELINE_BURSTS MAX_SECONDS [more bench.e2e flags]; writes /tmp/e2e.
run_e2e() {
  local budget=$1 conc=$2 tl=$3 maxs=$4
  shift 4
  timeout "$budget" python3 -m bench.e2e --checkpoint /tmp/ck --deploy-config configs/deploy/minicpmo_4_5.yaml \
    --device cuda --concurrency "$conc" --bursts 4 --warmup 1 --warmup-rounds 0 --requests-per-level 5 \
    --timeline-requests 3 --timeline-bursts "$tl" --max-seconds "$maxs" \
    --stage-args thinker=--graph-warmup-context=256 "$@" --out-dir /tmp/e2e > /tmp/e2e.log 2>&1
}

# A call's start: t0 (for the elapsed-seconds lines) and the checkpoint.
start_call() {
  t0=$(date +%s)
  make_checkpoint || return 1
  echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
}

# run_e2e at c=8,1 in what is left of CALL_S seconds since t0 (skipped under MIN_S), then its tables to
# $OUT/e2e and stdout, with the stage-log lines matching PATTERN; bench.e2e's --max-seconds is the budget
# less MARGIN_S (default 10): e2e_rest CALL_S MIN_S PATTERN [MARGIN_S].
e2e_rest() {
  local left=$(( $1 - ($(date +%s) - t0) )) min=$2 pattern=$3 margin=${4:-10}
  echo "e2e budget $left s"
  [ "$left" -gt "$min" ] || return 0
  run_e2e "$left" 8,1 4 $(( left - margin )) --timeline-first
  echo "e2e rc=$? after $(( $(date +%s) - t0 )) s"
  mkdir -p "$OUT/e2e"; cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null
  sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md
  grep -h "$pattern" /tmp/e2e/logs/*.log /tmp/e2e.log 2>/dev/null | cut -c1-260 | head -14
}

# .gpu/thinker.sh with LEVER's arms and BUDGET_S for bench.thinker, its log kept under $OUT:
# thinker_ab LEVER BUDGET_S.
thinker_ab() {
  LEVER="$1" BENCH_BUDGET="$2" bash .gpu/thinker.sh
  cp /tmp/thinker_bench.log "$OUT/" 2>/dev/null
  echo "thinker done after $(( $(date +%s) - t0 )) s"
}
