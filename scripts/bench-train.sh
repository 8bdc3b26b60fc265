#!/usr/bin/env bash
# The training benchmarks of docs/BENCHMARKS.md: DeMo against AdamW + all-reduce on `tiny`
# (synthetic corpus and tinyshakespeare), a top-k sweep, the codec's share of step time for
# `tiny` and `small`, and the size of a `1.2b` update. Writes runs/bench/ (JSON + PNG).
# Takes ~20 minutes on a 2-core CPU. Run on a quiet machine: the timings are wall clock.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SW="$ROOT/scripts/swarm"
OUT="$ROOT/runs/bench"
SHAKES="${SHAKESPEARE:-$ROOT/../shared/data/tinyshakespeare.txt}"
mkdir -p "$OUT"
"$SW" --version >/dev/null   # builds once

echo "== tiny, synthetic corpus, 8 replicas, 300 steps"
"$SW" train --optimizer demo  --report "$OUT/syn-demo.json"  >/dev/null
"$SW" train --optimizer adamw --report "$OUT/syn-adamw.json" >/dev/null
"$SW" plot "$OUT/syn-adamw.json" "$OUT/syn-demo.json" --out "$OUT/syn-compare.png"

echo "== tiny, synthetic corpus: DeMo top-k sweep (bytes against loss)"
for k in 16 32 64; do
    "$SW" train --optimizer demo --topk $k --report "$OUT/syn-demo-k$k.json" >/dev/null
done
"$SW" plot "$OUT/syn-adamw.json" "$OUT/syn-demo.json" "$OUT"/syn-demo-k{16,32,64}.json --out "$OUT/syn-topk.png"

if [[ -f "$SHAKES" ]]; then
    echo "== tiny, tinyshakespeare (bytes), 8 replicas, 300 steps"
    "$SW" train --optimizer demo  --data "$SHAKES" --report "$OUT/shk-demo.json"  >/dev/null
    "$SW" train --optimizer adamw --data "$SHAKES" --report "$OUT/shk-adamw.json" >/dev/null
    "$SW" train --optimizer demo  --data "$SHAKES" --topk 32 --report "$OUT/shk-demo-k32.json" >/dev/null
    "$SW" plot "$OUT/shk-adamw.json" "$OUT/shk-demo.json" "$OUT/shk-demo-k32.json" --out "$OUT/shk-compare.png"
fi

echo "== codec share of step time (compress + aggregate + apply) / (forward + backward)"
"$SW" train --model tiny --replicas 8 --steps 30 --eval-every 0 | grep -E "codec share"
"$SW" train --model tiny --replicas 8 --batch 16 --steps 30 --eval-every 0 | grep -E "codec share"
"$SW" train --model small --replicas 2 --steps 4 --eval-every 0 --report "$OUT/small-timing.json" | grep -E "codec share|wall"

echo "== bytes of one 1.2b update at the defaults"
"$SW" codec size --model 1.2b
