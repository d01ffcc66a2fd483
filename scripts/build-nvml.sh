#!/usr/bin/env bash
# Build the GPU sampler rsb-nvml (nvml/) for x86_64 and aarch64 Linux against glibc 2.17 with
# cargo-zigbuild, so one binary runs on any distro of the last decade (it dlopens the driver's
# libnvidia-ml.so.1, which the static musl agent cannot), and copy them to
#   ${RSB_NVML_DIR:-target/nvml}/<triple>/rsb-nvml
# Fails when a binary needs a glibc symbol newer than 2.17, and smoke-tests each (the x86_64 one
# here, the aarch64 one under qemu with the arm64 cross libc): on a machine without the NVIDIA
# driver, `rsb-nvml --count 1` must exit 3 saying the library does not load.
# Needs: cargo-zigbuild and zig (pip install ziglang cargo-zigbuild), the Rust targets
# x86_64-unknown-linux-gnu and aarch64-unknown-linux-gnu, readelf; qemu-aarch64-static and
# libc6-arm64-cross for the aarch64 smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
glibc=2.17
targets=(x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu)
out_dir=${RSB_NVML_DIR:-$root/target/nvml}
cargo_target_dir=${CARGO_TARGET_DIR:-$root/target}

die() {
  echo "build-nvml: $*" >&2
  exit 1
}

command -v cargo-zigbuild >/dev/null || die "cargo-zigbuild is not installed (pip install ziglang cargo-zigbuild)"
command -v readelf >/dev/null || die "readelf is not installed (apt-get install binutils)"
installed=$(rustup target list --installed)
for t in "${targets[@]}"; do
  grep -qx "$t" <<<"$installed" || die "Rust target $t is not installed: rustup target add $t"
done

for t in "${targets[@]}"; do
  echo "build-nvml: building $t (glibc $glibc)" >&2
  cargo-zigbuild build --locked -p rsb-nvml --profile release-agent --target "$t.$glibc" \
    --target-dir "$cargo_target_dir/nvml-build" || die "cargo zigbuild failed for $t"
  src="$cargo_target_dir/nvml-build/$t/release-agent/rsb-nvml"
  [ -f "$src" ] || die "build reported success but $src does not exist"
  # The newest glibc symbol version the binary asks for.
  newest=$(readelf --dyn-syms -W "$src" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
  if [ -n "$newest" ] && [ "$(printf '%s\n%s\n' "$newest" "$glibc" | sort -V | tail -1)" != "$glibc" ]; then
    die "$src needs glibc $newest, newer than $glibc"
  fi
  mkdir -p "$out_dir/$t"
  cp "$src" "$out_dir/$t/rsb-nvml.tmp"
  mv -f "$out_dir/$t/rsb-nvml.tmp" "$out_dir/$t/rsb-nvml"
  printf '%-26s %8d bytes  glibc >= %s  %s\n' "$t" "$(stat -c %s "$out_dir/$t/rsb-nvml")" \
    "${newest:-any}" "$out_dir/$t/rsb-nvml"
done

# The NVML path itself, against the stand-in library of nvml/tests (two GPUs, one process).
fake() {
  local what=$1 cc=$2
  shift 2
  command -v "$cc" >/dev/null || {
    echo "build-nvml: no $cc; the $what stand-in NVML check is skipped" >&2
    return
  }
  lib=$(mktemp -d)
  "$cc" -shared -fPIC -o "$lib/libnvidia-ml.so.1" nvml/tests/fake_nvml.c
  got=$(LD_LIBRARY_PATH=$lib FAKE_NVML=ok "$@" --count 1 2>&1) || die "$what: stand-in NVML: $got"
  rm -rf "$lib"
  grep -q '^0, NVIDIA Fake H100, GPU-fake-0, 37, 1024, 81920, 41, 123.45$' <<<"$got" &&
    grep -q '^4242, GPU-fake-0, 500$' <<<"$got" || die "$what: unexpected sample: $got"
  echo "build-nvml: $what reads the stand-in NVML library" >&2
}
fake x86_64 cc "$out_dir/x86_64-unknown-linux-gnu/rsb-nvml"
if command -v qemu-aarch64-static >/dev/null && [ -d /usr/aarch64-linux-gnu/lib ]; then
  fake aarch64 aarch64-linux-gnu-gcc qemu-aarch64-static -L /usr/aarch64-linux-gnu \
    "$out_dir/aarch64-unknown-linux-gnu/rsb-nvml"
fi

# The no-library path, where this machine has no NVIDIA driver.
smoke() {
  local what=$1
  shift
  set +e
  msg=$(LD_LIBRARY_PATH= "$@" --count 1 2>&1 >/dev/null)
  code=$?
  set -e
  [ "$code" = 3 ] && grep -q 'libnvidia-ml.so.1' <<<"$msg" ||
    die "$what: expected exit 3 (no NVML library), got $code: $msg"
  echo "build-nvml: $what smoke test: $msg" >&2
}
if [ -e /dev/nvidiactl ]; then
  echo "build-nvml: this machine has an NVIDIA driver; the no-library smoke test is skipped" >&2
else
  smoke x86_64 "$out_dir/x86_64-unknown-linux-gnu/rsb-nvml"
  if command -v qemu-aarch64-static >/dev/null && [ -d /usr/aarch64-linux-gnu/lib ]; then
    smoke aarch64 qemu-aarch64-static -L /usr/aarch64-linux-gnu "$out_dir/aarch64-unknown-linux-gnu/rsb-nvml"
  else
    echo "build-nvml: no qemu-aarch64-static or arm64 libc; the aarch64 smoke test is skipped" >&2
  fi
fi
