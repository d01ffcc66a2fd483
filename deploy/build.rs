//! Builds the static musl agents and embeds them into `rsb`, so that `cargo build` (and
//! `cargo install --path local`) alone yields an `rsb` that can deploy to x86_64 and aarch64
//! hosts.
//!
//! For each triple this runs a nested `cargo build -p rsb-agent --profile release-agent
//! --target <triple> --config .cargo/musl-lld.toml` with its own target dir
//! (`<target>/agents-build`, so it never waits on the outer cargo's lock) and an environment
//! cleared of what the outer cargo set for *this* build script (rustflags, cfgs, clippy's
//! workspace wrapper, the jobserver; a user's `RUSTC_WRAPPER` such as sccache stays). Cargo
//! reruns this script only when the agent's sources change (`agent/`, `protocol/`, `rules/`,
//! the lock file, the profiles), so an ordinary edit to
//! `local/` costs nothing; when it does rerun, the nested cargo is itself incremental.
//! `scripts/build-agents.sh` runs the same nested build first (same target dir, same flags),
//! so in CI this script finds everything fresh.
//!
//! Where there is no musl gcc (a Mac) the agents are built with `cargo-zigbuild zigbuild`
//! instead (see `agent_builder.rs`). A triple that cannot be built (musl target not installed,
//! neither a C compiler nor zig) is a `cargo:warning` naming what to install, never an error:
//! `rsb` then serves the `local` sandbox and names the missing agent at deploy time. Overrides:
//! - `RSB_AGENTS_WITH_ZIG=1`: build with `cargo-zigbuild` even where musl gcc is installed.
//! - `RSB_EMBED_AGENTS_DIR=DIR`: embed prebuilt `DIR/<triple>/rsb-agent`, build nothing.
//! - `RSB_BUILD_AGENTS=0`: build nothing; embed `<workspace>/target/agents/<triple>/rsb-agent`
//!   when present (the layout of `scripts/build-agents.sh`).

mod agent_builder;

use agent_builder::AgentBuilder;
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

const TRIPLES: [&str; 2] = ["x86_64-unknown-linux-musl", "aarch64-unknown-linux-musl"];
const MAX_BYTES: u64 = 2 * 1024 * 1024;

fn main() {
    println!("cargo:rerun-if-env-changed=RSB_EMBED_AGENTS_DIR");
    println!("cargo:rerun-if-env-changed=RSB_AGENTS_WITH_ZIG");
    println!("cargo:rerun-if-env-changed=RSB_BUILD_AGENTS");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest.parent().unwrap().to_path_buf();
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());

    let agents: Vec<(&str, PathBuf)> = if let Some(dir) = env::var_os("RSB_EMBED_AGENTS_DIR") {
        prebuilt(&PathBuf::from(dir))
    } else if env::var("RSB_BUILD_AGENTS").is_ok_and(|v| v == "0") {
        prebuilt(&workspace.join("target/agents"))
    } else {
        build_all(&workspace, &out_dir)
    };

    let mut out = String::from("pub(crate) static EMBEDDED: &[(&str, &[u8])] = &[\n");
    for (t, p) in &agents {
        let abs = fs::canonicalize(p).unwrap();
        out.push_str(&format!(
            "    ({t:?}, include_bytes!({:?})),\n",
            abs.display().to_string()
        ));
    }
    out.push_str("];\n");
    fs::write(out_dir.join("embedded.rs"), out).unwrap();
}

/// `dir/<triple>/rsb-agent` for each triple present.
fn prebuilt(dir: &Path) -> Vec<(&'static str, PathBuf)> {
    TRIPLES
        .iter()
        .filter_map(|t| {
            let p = dir.join(t).join("rsb-agent");
            println!("cargo:rerun-if-changed={}", p.display());
            fs::metadata(&p)
                .is_ok_and(|m| m.is_file() && m.len() > 0)
                .then_some((*t, p))
        })
        .collect()
}

/// The outer build's target dir: the nearest ancestor of OUT_DIR that cargo tagged.
fn target_dir(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| out_dir.to_path_buf())
}

fn build_all(workspace: &Path, out_dir: &Path) -> Vec<(&'static str, PathBuf)> {
    for src in [
        "agent/src",
        "agent/Cargo.toml",
        "protocol/src",
        "protocol/Cargo.toml",
        "rules/src",
        "rules/Cargo.toml",
        "Cargo.lock",
        "Cargo.toml",
        ".cargo/musl-lld.toml",
        "deploy/agent_builder.rs",
    ] {
        println!("cargo:rerun-if-changed={}", workspace.join(src).display());
    }
    let target = target_dir(out_dir);
    let build_dir = target.join("agents-build");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let sysroot = Command::new(env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()))
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let mut built = Vec::new();
    for t in TRIPLES {
        let bin = build_dir.join(t).join("release-agent").join("rsb-agent");
        // Deleting the output reruns this script.
        println!("cargo:rerun-if-changed={}", bin.display());
        let chosen = missing_prerequisite(t, sysroot.as_deref()).map_or_else(
            || {
                let host = env::var("HOST").unwrap_or_default();
                let force = env::var("RSB_AGENTS_WITH_ZIG").is_ok_and(|v| v == "1");
                agent_builder::choose(&host, t, force, &|p| match p {
                    "zig" => on_path("zig") || python_has_ziglang(),
                    p => on_path(p),
                })
            },
            Err,
        );
        let builder = match chosen {
            Ok(b) => b,
            Err(why) => {
                // A path that never exists: cargo reruns this script on every build until the
                // prerequisite is installed, then embeds the agent without a source change.
                println!(
                    "cargo:rerun-if-changed={}",
                    build_dir.join(t).join("prerequisite-missing").display()
                );
                println!(
                    "cargo:warning=rsb-agent for {t} is not embedded: {why}; rsb can still use the local sandbox and hosts whose agent is embedded"
                );
                continue;
            }
        };
        let mut cmd = match builder {
            AgentBuilder::MuslGcc => {
                let mut c = Command::new(&cargo);
                c.args(["build", "--config", ".cargo/musl-lld.toml"]);
                c
            }
            AgentBuilder::Zig => {
                let mut c = Command::new("cargo-zigbuild");
                c.arg("zigbuild");
                c
            }
        };
        cmd.current_dir(workspace)
            .args(["-p", "rsb-agent"])
            .args(["--profile", "release-agent", "--target", t, "--target-dir"])
            .arg(&build_dir);
        scrub(&mut cmd);
        match cmd.output() {
            Ok(o) if o.status.success() && bin.is_file() => {
                let size = fs::metadata(&bin).map(|m| m.len()).unwrap_or(0);
                if size > MAX_BYTES {
                    println!(
                        "cargo:warning=rsb-agent for {t} is {size} bytes, over the {MAX_BYTES}-byte budget"
                    );
                }
                publish(&target, t, &bin);
                built.push((t, bin));
            }
            Ok(o) => {
                let err = String::from_utf8_lossy(&o.stderr);
                let tail: Vec<&str> = err.lines().rev().take(3).collect();
                println!(
                    "cargo:warning=building rsb-agent for {t} failed; it is not embedded (run scripts/build-agents.sh for details): {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                );
            }
            Err(e) => println!("cargo:warning=cannot run cargo to build rsb-agent for {t}: {e}"),
        }
    }
    built
}

/// The Rust target for `triple` when it is missing, said as how to get it (the C toolchain is
/// [`agent_builder::choose`]'s).
fn missing_prerequisite(triple: &str, sysroot: Option<&Path>) -> Option<String> {
    if let Some(s) = sysroot
        && !s.join("lib/rustlib").join(triple).join("lib").is_dir()
    {
        return Some(format!(
            "the Rust target is not installed (rustup target add {triple})"
        ));
    }
    None
}

/// zig as the `ziglang` Python package (`pip install ziglang`), which cargo-zigbuild runs
/// through `python3 -m ziglang` when no `zig` is on PATH.
fn python_has_ziglang() -> bool {
    Command::new("python3")
        .args(["-c", "import ziglang"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn on_path(prog: &str) -> bool {
    env::var_os("PATH").is_some_and(|p| env::split_paths(&p).any(|d| d.join(prog).is_file()))
}

/// Remove what the outer cargo set for this build script, so the nested build is an ordinary
/// one (and its fingerprints match `scripts/build-agents.sh`'s).
fn scrub(cmd: &mut Command) {
    for (k, _) in env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        let drop = k.starts_with("CARGO_CFG_")
            || k.starts_with("CARGO_FEATURE_")
            || k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_MANIFEST_")
            || k.starts_with("CARGO_BUILD_")
            || k.starts_with("DEP_")
            || matches!(
                k,
                "CARGO_ENCODED_RUSTFLAGS"
                    | "CARGO_ENCODED_RUSTDOCFLAGS"
                    | "CARGO_TARGET_DIR"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_MAKEFLAGS"
                    | "MAKEFLAGS"
                    | "MFLAGS"
                    | "RUSTFLAGS"
                    | "RUSTDOCFLAGS"
                    | "RUSTC_WORKSPACE_WRAPPER"
                    | "RUSTC_LINKER"
                    | "OUT_DIR"
                    | "TARGET"
                    | "HOST"
                    | "NUM_JOBS"
                    | "OPT_LEVEL"
                    | "DEBUG"
                    | "PROFILE"
                    | "CARGO_CRATE_NAME"
            );
        if drop {
            cmd.env_remove(k);
        }
    }
}

/// Also leave a copy at `<target>/agents/<triple>/rsb-agent`, where the tests and
/// `RSB_AGENT_DIR` users look (copy, then rename: never a half-written file).
fn publish(target: &Path, triple: &str, bin: &Path) {
    let dir = target.join("agents").join(triple);
    let dst = dir.join("rsb-agent");
    if fs::read(&dst).ok() == fs::read(bin).ok() {
        return;
    }
    let tmp = dir.join("rsb-agent.tmp");
    let ok = fs::create_dir_all(&dir).is_ok()
        && fs::copy(bin, &tmp).is_ok()
        && fs::rename(&tmp, &dst).is_ok();
    if !ok {
        println!(
            "cargo:warning=could not copy the {triple} agent to {}",
            dst.display()
        );
    }
}
