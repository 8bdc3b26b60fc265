#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, then every crate's tests, then a bounded
# fuzzing pass where cargo-fuzz exists. Ends with one summary line: "tests: N passed, N failed,
# N skipped".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
LOG="$(mktemp -t swarm-test.XXXXXX)"
trap 'rm -f "$LOG"' EXIT
cargo test --workspace "$@" 2>&1 | tee "$LOG"

# The fuzz targets (their own workspace, see fuzz/Cargo.toml) build here on stable, and each
# replays its corpus once (fuzz/tests/corpus.rs), so a target that stops compiling fails CI.
CARGO_TARGET_DIR="$ROOT/target/fuzz" cargo test --manifest-path "$ROOT/fuzz/Cargo.toml" 2>&1 | tee -a "$LOG"

# Fuzz every decoder of untrusted bytes for a bounded time where cargo-fuzz (nightly) exists;
# the proptest suites above cover the same decoders everywhere else.
FUZZ_SECONDS="${SWARM_FUZZ_SECONDS:-10}"
if [[ "$FUZZ_SECONDS" -gt 0 ]] && cargo +nightly fuzz --version >/dev/null 2>&1; then
    (
        cd "$ROOT/fuzz"
        for target in $(cargo +nightly fuzz list); do
            echo "fuzz: $target for ${FUZZ_SECONDS}s"
            cargo +nightly fuzz run "$target" -- -max_total_time="$FUZZ_SECONDS" -print_final_stats=0 2>&1 | tail -n 2
        done
    )
else
    echo "fuzz: skipped (cargo-fuzz with a nightly toolchain is not installed; proptest covered the decoders)"
fi

awk '/^test result:/ {
        for (i = 1; i <= NF; i++) {
            if ($(i+1) ~ /^passed/) p += $i
            if ($(i+1) ~ /^failed/) f += $i
            if ($(i+1) ~ /^ignored/) s += $i
        }
     }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' "$LOG"
