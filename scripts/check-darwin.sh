#!/usr/bin/env bash
# Type-checks (clippy, warnings denied) every crate of the workspace, tests included, for both
# macOS targets, on Linux. The C dependencies (libsqlite3-sys, ring, blake3) are compiled by zig
# for darwin, which is what cargo-zigbuild sets up (CC/AR per target); zig ships the macOS libc
# headers, so no SDK is needed to type-check. Nothing is linked: see README "macOS" for why.
#
# Needs: `zig` (pip install ziglang) and `cargo-zigbuild` (pip install cargo-zigbuild, or
# cargo install cargo-zigbuild). .ci/run installs both. Exits non-zero as soon as a crate stops
# compiling for either target, or has a warning there.
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(aarch64-apple-darwin x86_64-apple-darwin)
if ! command -v cargo-zigbuild >/dev/null; then
  echo "check-darwin: cargo-zigbuild is not installed (pip install ziglang cargo-zigbuild)" >&2
  exit 2
fi
if ! command -v zig >/dev/null && ! python3 -c 'import ziglang' 2>/dev/null; then
  echo "check-darwin: zig is not installed (pip install ziglang)" >&2
  exit 2
fi
installed=$(rustup target list --installed)
for t in "${targets[@]}"; do
  grep -qx "$t" <<<"$installed" || rustup target add "$t"
done
for t in "${targets[@]}"; do
  echo "check-darwin: $t" >&2
  # RSB_BUILD_AGENTS=0: deploy/build.rs builds no musl agents for a type-check (it embeds
  # target/agents/* when present, else none).
  RSB_BUILD_AGENTS=0 cargo-zigbuild clippy --locked --workspace --all-targets --target "$t" \
    -- -D warnings
done
echo "check-darwin: every crate type-checks for ${targets[*]}" >&2
