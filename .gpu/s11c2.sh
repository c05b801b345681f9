#!/usr/bin/env bash
# Session 11, call 2: (1) prefill of 512 tokens, 10 timed iterations each printed, with the profiler's
# prefill and decode-step tables (batch 1 and 16); (2) the one-launch attention at 0.5x/1x/2x the rule's
# key splits (batch 16 and 1, context 576), and the packed-chunk case (last 13 rows one chunk).
set -uo pipefail
source .gpu/env.sh || exit 1
start_call || exit 1
timeout 150 python3 -m bench.thinker --checkpoint /tmp/ck --device cuda --batches 1,16 --overlap on --no-hf \
  --decode-steps 64 --warmup-steps 8 --prefill-iters 10 --profile --json-out "$OUT/thinker_prof.json" \
  > "$OUT/thinker_prof.log" 2>&1
echo "bench.thinker rc=$? after $(( $(date +%s) - t0 )) s"
sed -n '/^| batch | overlap/,/^$/p' "$OUT/thinker_prof.log"; grep -E "^Prefill" "$OUT/thinker_prof.log"
timeout 170 python3 -m bench.thinker.attention --device cuda --rope --batches 16 --contexts 576 \
  --rope-splits 0.5,1,2 --rope-launches 32:2:2,64:2:2,64:2:1,128:2:2,32:4:2,64:4:2,128:4:2,64:8:2 \
  --rope-chunk 13 > "$OUT/rope16.log" 2>&1
echo "rope b16 rc=$? after $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m bench.thinker.attention --device cuda --rope --batches 1,4 --contexts 576 \
  --rope-splits 0.5,1,2 --rope-launches 64:8:2,128:4:2,64:4:2 > "$OUT/rope1.log" 2>&1
echo "rope b1 rc=$? after $(( $(date +%s) - t0 )) s"
python3 - "$OUT/rope16.log" "$OUT/rope1.log" <<'PY'
import json, re, sys
for f in sys.argv[1:]:
    txt = open(f).read()
    for m in re.finditer(r'^\[\n.*?^\]', txt, re.S | re.M):
        for p in json.loads(m.group(0)):
            top = sorted(p["one_launch_us"].items(), key=lambda kv: kv[1])[:6]
            print(p["batch"], p["context"], "chunk", p["chunk"], "rule splits", p["splits"], "two", round(p["two_kernels_us"], 1),
                  "best:", [(k, round(v, 1)) for k, v in top])
PY
tail -5 "$OUT/rope16.log"
