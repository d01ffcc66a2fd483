#!/usr/bin/env bash
# Builds one release archive of `rsb` for TARGET with the Linux agents of AGENTS_DIR
# (`<dir>/<triple>/rsb-agent`, as scripts/build-agents.sh leaves them in target/agents)
# embedded, so every platform's rsb carries byte-identical agents. Writes
# dist/rsb-<version>-<target>.tar.gz and its .sha256. Used by .github/workflows/release.yml.
#
#   scripts/release.sh TARGET AGENTS_DIR [--dry-run]
#
# --dry-run checks the inputs (both agents present and within the 2 MiB budget, the Rust
# target installed) and prints the commands without running them.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  echo "usage: scripts/release.sh TARGET AGENTS_DIR [--dry-run]" >&2
  exit 2
fi
target=$1 agents=$2 dry=${3:-}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
for t in x86_64-unknown-linux-musl aarch64-unknown-linux-musl; do
  a="$agents/$t/rsb-agent"
  [ -s "$a" ] || { echo "release: $a is missing (run scripts/build-agents.sh)" >&2; exit 1; }
  size=$(wc -c <"$a")
  [ "$size" -le $((2 * 1024 * 1024)) ] || { echo "release: $a is $size bytes, over 2 MiB" >&2; exit 1; }
done
rustup target list --installed | grep -qx "$target" ||
  { echo "release: the Rust target $target is not installed (rustup target add $target)" >&2; exit 1; }
name="rsb-$version-$target"
run() {
  if [ "$dry" = --dry-run ]; then printf '+'; printf ' %q' "$@"; echo; else "$@"; fi
}
run env RSB_EMBED_AGENTS_DIR="$(cd "$agents" && pwd)" \
  cargo build --release --locked -p rsb --bin rsb --target "$target"
run mkdir -p "dist/$name"
run cp "target/$target/release/rsb" README.md "dist/$name/"
run tar -C dist -czf "dist/$name.tar.gz" "$name"
if command -v sha256sum >/dev/null; then sum=(sha256sum); else sum=(shasum -a 256); fi
if [ "$dry" = --dry-run ]; then
  echo "+ (cd dist && ${sum[*]} $name.tar.gz > $name.tar.gz.sha256)"
else
  (cd dist && "${sum[@]}" "$name.tar.gz" >"$name.tar.gz.sha256")
fi
echo "release: dist/$name.tar.gz" >&2
