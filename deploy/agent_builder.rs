//! How `build.rs` builds the static musl agent for one triple on this machine: a pure function
//! of the host, the triple and what is on PATH, so the choice is unit-tested (deploy's lib
//! includes this file under `cfg(test)`).
//!
//! - Linux with the C compiler `.cargo/musl-lld.toml` names for the triple (`gcc`, or
//!   `aarch64-linux-gnu-gcc`; blake3 compiles C and assembly): `cargo build` with rust-lld.
//! - Otherwise, with `cargo-zigbuild` and zig (a Mac has no musl gcc; zig is its C compiler and
//!   linker for musl): `cargo-zigbuild zigbuild`. `RSB_AGENTS_WITH_ZIG=1` picks it on Linux too.
//! - Otherwise the error names what to install.

/// The nested build to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentBuilder {
    /// `cargo build --config .cargo/musl-lld.toml`.
    MuslGcc,
    /// `cargo-zigbuild zigbuild`.
    Zig,
}

/// The C compiler `.cargo/musl-lld.toml` sets for `triple`.
pub fn musl_cc(triple: &str) -> &'static str {
    if triple.starts_with("aarch64") {
        "aarch64-linux-gnu-gcc"
    } else {
        "gcc"
    }
}

/// `on_path(prog)`: whether `prog` is installed; `zig` stands for zig itself (a `zig` binary,
/// or the `ziglang` Python package cargo-zigbuild also finds).
pub fn choose(
    host: &str,
    triple: &str,
    force_zig: bool,
    on_path: &dyn Fn(&str) -> bool,
) -> Result<AgentBuilder, String> {
    let zig = on_path("cargo-zigbuild") && on_path("zig");
    let cc = musl_cc(triple);
    if !force_zig && host.contains("-linux-") && on_path(cc) {
        return Ok(AgentBuilder::MuslGcc);
    }
    if zig {
        return Ok(AgentBuilder::Zig);
    }
    let zig_hint =
        "pip install ziglang cargo-zigbuild (or brew install zig && cargo install cargo-zigbuild)";
    Err(if force_zig {
        format!("RSB_AGENTS_WITH_ZIG=1 but zig or cargo-zigbuild is missing ({zig_hint})")
    } else if host.contains("-linux-") {
        let apt = if triple.starts_with("aarch64") {
            "apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
        } else {
            "apt-get install gcc"
        };
        format!("no C compiler for blake3 ({cc}: {apt}; or zig: {zig_hint})")
    } else {
        format!("{host} has no musl C toolchain; the agents are built with zig there ({zig_hint})")
    })
}
