#!/usr/bin/env bash
# The whole test suite: build both static agents (embedded into rsb and used by the sshd
# tests), build every binary, then run all tests. Needs what .ci/run installs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-agents.sh
cargo build --workspace --bins
cargo test --workspace --no-fail-fast -- "$@"
