#!/usr/bin/env bash
# Run a list of `swarm train` arms, N at a time (one libtorch thread each), then plot and
# tabulate them with `swarm plot` (the first arm is the reference of the gap column).
#
#   scripts/ablate.sh ARMS_FILE OUT_DIR [JOBS]
#
# ARMS_FILE: one arm per line, `NAME  swarm-train-flags…` (# comments and blank lines skipped).
# Each arm writes OUT_DIR/NAME.json (+ .png) and OUT_DIR/NAME.log; an arm whose report exists
# is not run again, so an interrupted sweep resumes where it stopped.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARMS="$1"; OUT="$2"; JOBS="${3:-2}"
# SWARM may name a copy of the binary, so a rebuild does not change arms mid-sweep.
SWARM="${SWARM:-$ROOT/target/release/swarm}"
[[ -x "$SWARM" ]] || { bash "$ROOT/scripts/setup.sh" && (cd "$ROOT" && cargo build --release -p node); }
mkdir -p "$OUT"
run_arm() {
    local name="$1"; shift
    [[ -f "$OUT/$name.json" ]] && return 0
    local t0=$SECONDS
    if "$SWARM" train --threads 1 "$@" --report "$OUT/$name.json" >"$OUT/$name.log" 2>&1; then
        echo "done: $name ($((SECONDS - t0)) s): $(grep 'final eval loss' "$OUT/$name.log")"
    else
        echo "FAILED: $name (see $OUT/$name.log)"
    fi
}
export -f run_arm; export OUT SWARM
grep -v '^\s*#' "$ARMS" | grep -v '^\s*$' | while read -r name flags; do
    # shellcheck disable=SC2086
    printf '%s\0' "run_arm $name $flags"
done | xargs -0 -P "$JOBS" -I{} bash -c '{}'
reports=()
while read -r name _; do reports+=("$OUT/$name.json"); done < <(grep -v '^\s*#' "$ARMS" | grep -v '^\s*$')
"$SWARM" plot --out "$OUT/all.png" "${reports[@]}"
