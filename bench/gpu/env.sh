# Shared set-up for the bench/gpu/*.sh recipes. Source it from the repository root on the GPU host:
#   source bench/gpu/env.sh
# The host is a fresh H100 or H200 machine with torch (and CUDA) preinstalled and no network. The
# project is installed with --no-deps so the host's torch is kept; any Python dependency the host lacks
# travels with the working tree as wheels in .whl/ (made on a networked machine by bench/gpu/wheels.sh)
# and is installed from there into /tmp/site, also with --no-deps.
# Afterwards: the repository is importable, $OUT exists (default bench-results/), and
#   make_checkpoint   writes the full-size random-weight checkpoint to $CKPT (default /tmp/ck) once;
#   elapsed           prints seconds since this file was sourced;
#   run_e2e ...       runs the chat-route e2e of bench/gpu/e2e.sh (see there).
# Returns non-zero when a carried wheel does not install.

export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/tmp/wheels.log 2>&1 || { tail -5 /tmp/wheels.log; echo "wheel install failed"; return 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# The console scripts (minicpmo-serve, minicpmo-checkpoint); the repo on PYTHONPATH is what the benches use,
# so a host whose setuptools cannot build the project still runs every recipe.
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/project-install.log 2>&1 \
  || echo "note: 'pip install --no-deps -e .' failed (see /tmp/project-install.log); using PYTHONPATH=$PWD"

OUT=${OUT:-bench-results}
CKPT=${CKPT:-/tmp/ck}
PROFILE=${PROFILE:-configs/deploy/minicpmo_4_5.yaml}
mkdir -p "$OUT"
_t0=$(date +%s)

elapsed() { echo "$(( $(date +%s) - _t0 ))"; }

# The full-size random checkpoint (real shapes, random bf16 weights; 40-55 s, 19 GB), made once per host.
make_checkpoint() {
  [ -f "$CKPT/config.json" ] && return 0
  "$PY" -m services.common.checkpoint_tool make --size full --device cuda "$CKPT" > /tmp/ckpt.log 2>&1 \
    || { tail -20 /tmp/ckpt.log; return 1; }
  echo "checkpoint ready after $(elapsed) s"
}

# The chat-route e2e: 4 bursts of CONCURRENCY streaming requests on fresh connections, the first burst
# after start counted, one warm-up request, per-request timelines for TIMELINE_BURSTS bursts.
#   run_e2e BUDGET_S CONCURRENCY TIMELINE_BURSTS MAX_SECONDS [more bench.e2e flags]   (writes /tmp/e2e)
run_e2e() {
  local budget=$1 conc=$2 tl=$3 maxs=$4
  shift 4
  timeout "$budget" "$PY" -m bench.e2e --checkpoint "$CKPT" --deploy-config "$PROFILE" \
    --device cuda --concurrency "$conc" --bursts 4 --warmup 1 --warmup-rounds 0 --requests-per-level 5 \
    --timeline-requests 3 --timeline-bursts "$tl" --max-seconds "$maxs" \
    --stage-args thinker=--graph-warmup-context=256 "$@" --out-dir /tmp/e2e > /tmp/e2e.log 2>&1
}
