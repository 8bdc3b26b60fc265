#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, then every crate's tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
cargo test --workspace "$@"
