//! The Slurm test bed (`tests/slurm-testbed/`: munged, slurmctld and slurmd from Debian's
//! `slurm-wlm` on loopback, one node with 4 CPUs, two fake GPUs, partitions `debug`, `gpu`,
//! `urgent`), started once per test binary and shared by its tests. With
//! `RSB_SLURM_COMPUTE_HOST` in the environment (CI sets it) the node is another host: slurmd
//! and its jobs run in their own PID/UTS/mount namespace under that name, and every restart
//! here keeps it (the variable reaches start.sh).
//!
//! `start.sh` needs root. Jobs submitted through an [`crate::Sshd`] fixture run as the user
//! the fixture logs in as (the current user; slurmd runs as root, so it can start them as
//! anyone), with the fixture's `$HOME`, which the "compute node" (this machine) sees.
//! Without root the tests that need it are skipped with a message, unless
//! `RSB_REQUIRE_SLURM=1` (CI) makes that a failure.
//!
//! The bed is shared, so every test holds its lock: [`slurm`] takes it shared, and a test
//! that disrupts the bed (a node set DOWN, the controller killed, a restart with another
//! knob) takes it exclusive with [`slurm_exclusive`], whose guard puts the bed back in its
//! default state (node idle, controller up, MinJobAge 300) when dropped, on failure too.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{output_with_timeout, workspace_root};

pub struct SlurmBed {
    /// `/tmp/rsb-slurm/env` as written by start.sh.
    pub env: HashMap<String, String>,
}

static BED: OnceLock<Result<SlurmBed, String>> = OnceLock::new();

/// The knobs a test may change; [`SlurmBed::start_with`] clears them, so the defaults apply.
const DEFAULT_KNOBS: &[(&str, &str)] = &[("RSB_SLURM_MIN_JOB_AGE", "300")];

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

/// The test bed's lock file: shared by every Slurm test, exclusive for one that disrupts it.
/// Outside the bed's own dir, which a restart may wipe.
const LOCK: &str = "/tmp/rsb-slurm-tests.lock";
/// Held (exclusive) by a disruptive test while it waits for [`LOCK`], and passed through
/// (shared) by every other test on its way in: flock has no writer preference, so without it
/// a stream of overlapping shared holders would keep a disruptive test waiting.
const GATE: &str = "/tmp/rsb-slurm-tests.gate";
/// The longest a test waits for the lock: every disruptive test is bounded well below this.
const LOCK_WAIT: Duration = Duration::from_secs(900);

/// The bed, held shared (or exclusive) for as long as this lives.
pub struct Bed {
    bed: &'static SlurmBed,
    _lock: File,
}

impl std::ops::Deref for Bed {
    type Target = SlurmBed;
    fn deref(&self) -> &SlurmBed {
        self.bed
    }
}

fn lock(exclusive: bool) -> File {
    let _gate = flock(GATE, exclusive);
    flock(LOCK, exclusive)
}

fn flock(path: &str, exclusive: bool) -> File {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open {path}: {e}"));
    let t0 = Instant::now();
    loop {
        let r = if exclusive {
            f.try_lock()
        } else {
            f.try_lock_shared()
        };
        match r {
            Ok(()) => return f,
            Err(std::fs::TryLockError::WouldBlock) => {
                assert!(
                    t0.elapsed() < LOCK_WAIT,
                    "the Slurm test bed's lock {path} was held for {} s",
                    LOCK_WAIT.as_secs()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(std::fs::TryLockError::Error(e)) => panic!("cannot lock {path}: {e}"),
        }
    }
}

/// The running test bed, held shared, or `None` (with a message on stderr) when it cannot
/// run here: not root and `RSB_REQUIRE_SLURM` unset. Panics when it is required and does
/// not start.
pub fn slurm() -> Option<Bed> {
    let bed = bed()?;
    Some(Bed {
        bed,
        _lock: lock(false),
    })
}

/// The bed held exclusive, for a test that changes it; dropping the guard restores the
/// default bed. Held before it is restored, so a failed restore is the next test's problem
/// only if it could not be fixed at all.
pub fn slurm_exclusive() -> Option<Disrupted> {
    let bed = bed()?;
    let lock = lock(true);
    // A disruptive test that was killed outright (no Drop) left the bed changed.
    bed.restore();
    Some(Disrupted(Bed { bed, _lock: lock }))
}

/// An exclusively held bed that is put back in its default state when dropped.
pub struct Disrupted(Bed);

impl std::ops::Deref for Disrupted {
    type Target = SlurmBed;
    fn deref(&self) -> &SlurmBed {
        self.0.bed
    }
}

impl Drop for Disrupted {
    fn drop(&mut self) {
        self.0.bed.restore();
    }
}

fn bed() -> Option<&'static SlurmBed> {
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

fn script(name: &str) -> PathBuf {
    let start = std::env::var_os("RSB_SLURM_TESTBED")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("tests/slurm-testbed/start.sh"));
    start.with_file_name(name)
}

impl SlurmBed {
    /// `start.sh` with `knobs` (e.g. `RSB_SLURM_MIN_JOB_AGE=10`); the default knobs are used
    /// for everything not named. A daemon still running keeps its config, so a changed knob
    /// takes [`Self::stop`] first.
    pub fn start_with(&self, knobs: &[(&str, &str)]) -> Result<()> {
        let mut c = Command::new("bash");
        c.arg(script("start.sh"));
        for (k, _) in DEFAULT_KNOBS {
            c.env_remove(k);
        }
        for (k, v) in knobs {
            c.env(k, v);
        }
        let out = output_with_timeout(&mut c, Duration::from_secs(180))?;
        if !out.status.success() {
            bail!(
                "start.sh failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// `stop.sh`: cancels every job, stops the daemons by pid.
    pub fn stop(&self) -> Result<()> {
        let out = output_with_timeout(
            Command::new("bash").arg(script("stop.sh")),
            Duration::from_secs(120),
        )?;
        if !out.status.success() {
            bail!(
                "stop.sh failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Stop slurmctld (by its recorded pid), leaving munged, slurmd and the jobs running.
    pub fn stop_controller(&self) -> Result<()> {
        let dir = self
            .env
            .get("RSB_SLURM_DIR")
            .cloned()
            .unwrap_or_else(|| "/tmp/rsb-slurm".into());
        let pid = std::fs::read_to_string(format!("{dir}/pids/slurmctld.pid"))?;
        let pid = pid.trim();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains("slurmctld") {
            bail!("pid {pid} is not our slurmctld");
        }
        // SIGTERM: slurmctld saves its state as it stops. A SIGKILL loses the jobs submitted
        // since its last save, and a restart then reuses their ids.
        let st = Command::new("kill").args(["-TERM", pid]).status()?;
        if !st.success() {
            bail!("kill {pid} failed");
        }
        let t0 = Instant::now();
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            if t0.elapsed() > Duration::from_secs(30) {
                bail!("slurmctld {pid} did not stop within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn config_value(&self, key: &str) -> Option<String> {
        let out = self.cmd("scontrol", &["show", "config"]).ok()?;
        out.lines().find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    }

    /// Back to the default bed: controller up, MinJobAge 300, the node idle. Each step is
    /// bounded; what cannot be fixed is printed (the next test will say more).
    pub fn restore(&self) {
        let up = || {
            output_with_timeout(
                Command::new("scontrol").arg("ping"),
                Duration::from_secs(30),
            )
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("UP"))
        };
        if !up()
            && let Err(e) = self.start_with(&[])
        {
            eprintln!("restoring the Slurm bed: {e:#}");
        }
        if self.config_value("MinJobAge").as_deref() != Some("300 sec")
            && let Err(e) = self.stop().and_then(|()| self.start_with(&[]))
        {
            eprintln!("restoring the Slurm bed's MinJobAge: {e:#}");
        }
        let node = self
            .env
            .get("RSB_SLURM_NODE")
            .cloned()
            .unwrap_or_else(|| "rsbnode".into());
        let t0 = Instant::now();
        loop {
            let st = self
                .cmd("sinfo", &["-h", "-n", &node, "-o", "%T"])
                .unwrap_or_default();
            let st = st.lines().next().unwrap_or("").trim().to_string();
            if ["idle", "mixed", "allocated", "completing"].contains(&st.as_str()) {
                break;
            }
            if t0.elapsed() > Duration::from_secs(30) {
                eprintln!("restoring the Slurm bed: node {node} is still '{st}'");
                break;
            }
            let _ = output_with_timeout(
                Command::new("scontrol").args([
                    "update",
                    &format!("nodename={node}"),
                    "state=resume",
                ]),
                Duration::from_secs(30),
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

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
