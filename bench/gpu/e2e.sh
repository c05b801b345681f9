#!/usr/bin/env bash
# The chat route end to end through the launched pipeline (gateway + three stage processes on one GPU, the
# default single-GPU profile, MPS when the host has nvidia-cuda-mps-control): streaming requests with
# text and audio out, 4 bursts at each concurrency of CONCURRENCY (default "8,1") on fresh connections,
# the first burst after start counted. Reports per concurrency TTFT, TTFP (time to first audio) p50/p90,
# E2E and RTF, a row per burst, and the per-stage marks of the first burst's requests.
# Env: CONCURRENCY, BUDGET (seconds for the whole run, 300), EXTRA (more bench.e2e flags).
# Writes $OUT/e2e/ (e2e.json, e2e.md, the stage logs). Run from the repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
budget=${BUDGET:-300}
# shellcheck disable=SC2086  # EXTRA is a list of flags
run_e2e "$budget" "${CONCURRENCY:-8,1}" 4 $(( budget - 30 )) --timeline-first ${EXTRA:-}
rc=$?
echo "bench.e2e rc=$rc after $(elapsed) s"
mkdir -p "$OUT/e2e"
cp /tmp/e2e/*.json /tmp/e2e/*.md "$OUT/e2e/" 2>/dev/null
cp -r /tmp/e2e/logs "$OUT/e2e/" 2>/dev/null
sed -n '/^| c |/,/^$/p;/^| burst/,/^$/p;/^| mark/,/^$/p' /tmp/e2e/e2e.md 2>/dev/null
grep -h "code2wav warm-up\|talker warm-up\|no graph for\|healthy after\|slow engine step" /tmp/e2e/logs/*.log \
  2>/dev/null | cut -c1-260 | head -14
[ $rc -eq 0 ] || tail -30 /tmp/e2e.log
