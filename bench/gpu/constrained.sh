#!/usr/bin/env bash
# Constrained decoding on the full-size checkpoint (H100 or H200; ~3 min on a fresh host, checkpoint included):
#   1. bench.thinker.constrained: full engine decode steps at batches 1 and 16, greedy vs sampled vs every
#      row under a JSON grammar vs half the rows under it ("mixed"), all in the overlapped decode (masks
#      filled on the host one step behind, applied behind the replay), and the grammar arm with the overlap
#      off ("constrained_sync"); the headline is the constrained step's overhead over the greedy step
#      (target <= 5% at batch 16); "chained" ~1.00 says the arm ran overlapped;
#   2. bench.thinker.grammar_engines: llguidance vs xgrammar mask fill per step on the host's cores, with the
#      checkpoint's tokenizer, batches 1 and 16 (the faster engine serves).
# Writes $OUT/constrained.log (its JSON object and table), $OUT/grammar_engines.json, $OUT/grammar_engines.log.
# Run from the repository root.
set -uo pipefail
source bench/gpu/env.sh || exit 1
make_checkpoint || exit 1
timeout "${BENCH_BUDGET:-240}" "$PY" -m bench.thinker.constrained --checkpoint "$CKPT" --device cuda \
  --batch 1,16 --steps 100 > "$OUT/constrained.log" 2>&1
rc=$?
echo "bench.thinker.constrained rc=$rc after $(elapsed) s"
sed -n '/^|/p' "$OUT/constrained.log"
[ $rc -eq 0 ] || tail -30 "$OUT/constrained.log"
timeout "${ENGINES_BUDGET:-150}" "$PY" -m bench.thinker.grammar_engines --checkpoint "$CKPT" --batches 1,16 \
  --json-out "$OUT/grammar_engines.json" > "$OUT/grammar_engines.log" 2>&1
rc=$?
echo "bench.thinker.grammar_engines rc=$rc after $(elapsed) s"
sed -n '/^|/p' "$OUT/grammar_engines.log"
[ $rc -eq 0 ] || tail -30 "$OUT/grammar_engines.log"
