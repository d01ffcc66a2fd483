#!/usr/bin/env bash
# Proves that scripts/check-darwin.sh guards the Mac (issue 44): plants a Linux-only call (the
# parent-death signal's prctl, outside any cfg) into a scratch copy of the working tree, and
# expects the darwin type-check of the agent there to refuse exactly that call. Exits 0 when it
# does, 1 when the plant went unnoticed or the check failed for another reason. The working
# tree is never touched. Needs what check-darwin.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git ls-files -z | xargs -0 tar cf - | tar xf - -C "$scratch"
cat >>"$scratch/agent/src/proc.rs" <<'RUST'

/// Planted by scripts/plant-darwin.sh: Linux only, outside any cfg.
pub fn planted_linux_only() -> std::io::Result<()> {
    Ok(rustix::process::set_parent_process_death_signal(None)?)
}
RUST
target=aarch64-apple-darwin
# The repository's target dir: the dependencies are built once (the copy's own crates get
# artifacts of their own, since their path differs).
if out=$(cd "$scratch" && CARGO_TARGET_DIR="$repo/target" RSB_BUILD_AGENTS=0 \
  cargo-zigbuild clippy --locked -p rsb-agent --target "$target" -- -D warnings 2>&1); then
  echo "plant-darwin: a Linux-only call passed the $target check unnoticed" >&2
  exit 1
fi
if ! grep -q "cannot find function .set_parent_process_death_signal. in module .rustix::process." <<<"$out"; then
  echo "plant-darwin: the $target check failed, but not on the planted call:" >&2
  tail -20 <<<"$out" >&2
  exit 1
fi
echo "plant-darwin: the planted Linux-only call is refused for $target" >&2
