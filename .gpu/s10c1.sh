#!/usr/bin/env bash
# Session 10, call 1: the PDL A/B in bench.thinker (overlap on, batches 1 and 16), cuda_smoke on the
# default (PDL on), and the attention sweep under step conditions (own pages per layer, bucketed table).
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
LEVER="--overlap on --pdl both" BENCH_BUDGET=200 bash .gpu/thinker.sh
cp /tmp/thinker_bench.log "$OUT/" 2>/dev/null
echo "thinker done after $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m bench.thinker.attention --sweep --batches 1,16 --contexts 576 > "$OUT/attn_sweep.log" 2>&1
echo "sweep rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| batch/,$p' "$OUT/attn_sweep.log"; tail -5 "$OUT/attn_sweep.log"
