#!/usr/bin/env bash
# Build the static musl rsb-agent for x86_64 and aarch64 without docker (rust-lld + the apt
# cross gcc for blake3's C code), and copy them to
#   ${RSB_EMBED_AGENTS_DIR:-target/agents}/<triple>/rsb-agent
# `cargo build` does the same build by itself (deploy/build.rs, same target dir
# target/agents-build and flags, so whichever runs second finds it fresh); this script adds what
# a build script must not do: fail on a missing prerequisite (CI), enforce the size budget, and
# smoke-test the aarch64 agent under qemu.
# Fails when an agent exceeds 2 MiB (it is uploaded on every first connect to a new host), and
# smoke-tests the aarch64 build under qemu when qemu-aarch64-static is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

targets=(x86_64-unknown-linux-musl aarch64-unknown-linux-musl)
max_bytes=$((2 * 1024 * 1024))
out_dir=${RSB_EMBED_AGENTS_DIR:-$root/target/agents}
cargo_target_dir=${CARGO_TARGET_DIR:-$root/target}

die() {
  echo "build-agents: $*" >&2
  exit 1
}

# Check every prerequisite first, so one run names everything that is missing.
missing=()
if command -v rustup >/dev/null 2>&1; then
  installed=$(rustup target list --installed)
  for t in "${targets[@]}"; do
    grep -qx "$t" <<<"$installed" || missing+=("Rust target $t: rustup target add $t")
  done
else
  echo "build-agents: rustup not found; assuming the musl targets are installed" >&2
fi
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 ||
  missing+=("aarch64 C cross compiler (blake3 NEON): apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross")
command -v aarch64-linux-gnu-ar >/dev/null 2>&1 ||
  missing+=("aarch64-linux-gnu-ar: apt-get install binutils-aarch64-linux-gnu")
# blake3_neon.c includes <assert.h>; without the arm64 libc headers gcc fails on bits/wordsize.h.
if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 &&
  ! echo '#include <assert.h>' | aarch64-linux-gnu-gcc -x c -fsyntax-only - >/dev/null 2>&1; then
  missing+=("arm64 libc headers: apt-get install libc6-dev-arm64-cross")
fi
command -v gcc >/dev/null 2>&1 || missing+=("gcc (blake3 x86 asm): apt-get install gcc")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'build-agents: missing prerequisite: %s\n' "${missing[@]}" >&2
  exit 1
fi

for t in "${targets[@]}"; do
  echo "build-agents: building $t" >&2
  cargo build --config .cargo/musl-lld.toml -p rsb-agent --profile release-agent --target "$t" \
    --target-dir "$cargo_target_dir/agents-build" ||
    die "cargo build failed for $t"
  src="$cargo_target_dir/agents-build/$t/release-agent/rsb-agent"
  [ -f "$src" ] || die "build reported success but $src does not exist"
  mkdir -p "$out_dir/$t"
  # Copy then rename, so a concurrent rsb build never embeds a half-written file.
  cp "$src" "$out_dir/$t/rsb-agent.tmp"
  mv -f "$out_dir/$t/rsb-agent.tmp" "$out_dir/$t/rsb-agent"
done

status=0
for t in "${targets[@]}"; do
  f="$out_dir/$t/rsb-agent"
  size=$(stat -c %s "$f")
  printf '%-28s %9d bytes  %s\n' "$t" "$size" "$f"
  if [ "$size" -gt "$max_bytes" ]; then
    echo "build-agents: $f is $size bytes, over the $max_bytes-byte limit" >&2
    status=1
  fi
done
[ "$status" -eq 0 ] || exit 1

if command -v qemu-aarch64-static >/dev/null 2>&1; then
  f="$out_dir/aarch64-unknown-linux-musl/rsb-agent"
  line=$(qemu-aarch64-static "$f" version) || die "the aarch64 agent does not run under qemu"
  echo "qemu smoke test: $line"
  case "$line" in
    *aarch64*) ;;
    *) die "the aarch64 agent reports the wrong architecture: $line" ;;
  esac
else
  echo "build-agents: qemu-aarch64-static not found; skipping the aarch64 smoke test (apt-get install qemu-user-static)" >&2
fi
