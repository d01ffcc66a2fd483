//! The one-node Slurm test bed (`tests/slurm-testbed/`: munged, slurmctld and slurmd from
//! Debian's `slurm-wlm` on loopback, 4 CPUs, two fake GPUs, partitions `debug`, `gpu`,
//! `urgent`), started once per test binary and shared by its tests.
//!
//! `start.sh` needs root. Jobs submitted through an [`crate::Sshd`] fixture run as the user
//! the fixture logs in as (the current user; slurmd runs as root, so it can start them as
//! anyone), with the fixture's `$HOME`, which the "compute node" (this machine) sees.
//! Without root the tests that need it are skipped with a message, unless
//! `RSB_REQUIRE_SLURM=1` (CI) makes that a failure.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::{output_with_timeout, workspace_root};

pub struct SlurmBed {
    /// `/tmp/rsb-slurm/env` as written by start.sh.
    pub env: HashMap<String, String>,
}

static BED: OnceLock<Result<SlurmBed, String>> = OnceLock::new();

fn start() -> Result<SlurmBed> {
    let script = std::env::var_os("RSB_SLURM_TESTBED")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("tests/slurm-testbed/start.sh"));
    let out = output_with_timeout(Command::new("bash").arg(&script), Duration::from_secs(180))
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let dir = std::env::var("RSB_SLURM_DIR").unwrap_or_else(|_| "/tmp/rsb-slurm".into());
    let text =
        std::fs::read_to_string(format!("{dir}/env")).context("reading the test bed's env")?;
    let env = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Ok(SlurmBed { env })
}

/// The running test bed, or `None` (with a message on stderr) when it cannot run here: not
/// root and `RSB_REQUIRE_SLURM` unset. Panics when it is required and does not start.
pub fn slurm() -> Option<&'static SlurmBed> {
    let required = std::env::var_os("RSB_REQUIRE_SLURM").is_some_and(|v| v == "1");
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    if !root && !required {
        eprintln!(
            "SKIP: the Slurm test bed needs root (start.sh); set RSB_REQUIRE_SLURM=1 to fail instead"
        );
        return None;
    }
    match BED.get_or_init(|| start().map_err(|e| format!("{e:#}"))) {
        Ok(b) => Some(b),
        Err(e) => panic!("the Slurm test bed did not start: {e}"),
    }
}

impl SlurmBed {
    /// Run a Slurm client command here (as the test's user), bounded in time.
    pub fn cmd(&self, prog: &str, args: &[&str]) -> Result<String> {
        let out = output_with_timeout(Command::new(prog).args(args), Duration::from_secs(30))?;
        if !out.status.success() {
            bail!(
                "{prog} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
