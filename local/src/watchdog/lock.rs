//! The daemon lock: one `rsb watchdog run` per state dir.
//!
//! `watchdog.lock` is held with an exclusive advisory lock (`File::try_lock`, flock on
//! Unix) for the daemon's life and holds its pid. The kernel drops the lock however the
//! daemon dies, so "is a daemon running" is answered by the lock and never by a pid file or
//! a heartbeat row, which outlive a crash.

use std::{
    fs::{File, TryLockError},
    io::{Read, Seek, Write},
    path::Path,
    time::{Duration, Instant},
};

use crate::{
    error::{Kind, Result, RsbError},
    store,
};

pub const LOCK_FILE: &str = "watchdog.lock";

/// The held lock; released when dropped (or when the process dies, however it dies).
pub struct Lock(#[allow(dead_code)] File);

fn open_lock_file(state_dir: &Path) -> std::io::Result<File> {
    store::roots_lock::open_lock_file(&state_dir.join(LOCK_FILE))
}

fn read_pid(f: &mut File) -> Option<i64> {
    let mut s = String::new();
    f.rewind().ok()?;
    f.read_to_string(&mut s).ok()?;
    s.trim().parse().ok()
}

/// Take the daemon lock, retrying briefly (a status probe may hold it for an instant);
/// `Err` names the pid that holds it.
pub fn acquire_lock(state_dir: &Path) -> Result<Lock> {
    store::ensure_private_dir(state_dir).map_err(|e| {
        RsbError::new(
            Kind::Config,
            format!("cannot create {}: {}", state_dir.display(), e.kind()),
            "set RSB_STATE_DIR to a writable directory",
        )
    })?;
    let mut f = open_lock_file(state_dir).map_err(store::db_err)?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match f.try_lock() {
            Ok(()) => {
                f.set_len(0).map_err(store::db_err)?;
                f.rewind().map_err(store::db_err)?;
                write!(f, "{}", std::process::id()).map_err(store::db_err)?;
                f.flush().map_err(store::db_err)?;
                return Ok(Lock(f));
            }
            Err(TryLockError::Error(e)) => return Err(store::db_err(e)),
            Err(TryLockError::WouldBlock) => {}
        }
        if Instant::now() >= deadline {
            let pid = read_pid(&mut f)
                .map(|p| p.to_string())
                .unwrap_or_else(|| "unknown".into());
            return Err(RsbError::new(
                Kind::Config,
                format!(
                    "a watchdog is already running for {} (pid {pid})",
                    state_dir.display()
                ),
                "only one runs per state dir; stop it first, or set RSB_STATE_DIR to another directory",
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pid of the daemon holding the lock of `state_dir`, if one does. A shared probe
/// fails only under the daemon's exclusive lock, and is let go at once.
pub fn lock_holder(state_dir: &Path) -> Option<i64> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .open(state_dir.join(LOCK_FILE))
        .ok()?;
    match f.try_lock_shared() {
        Ok(()) => {
            let _ = f.unlock();
            None
        }
        Err(TryLockError::WouldBlock) => Some(read_pid(&mut f).unwrap_or(0)),
        Err(TryLockError::Error(_)) => None,
    }
}

/// Whether `pid` is a live `rsb watchdog run`: the lock file names a pid, and a pid can be
/// reused, so its command line must say so (from /proc on Linux, `KERN_PROCARGS2` on macOS).
/// Where the process table cannot be read, being alive must do.
pub fn is_daemon_pid(pid: i64) -> bool {
    let Ok(p) = u32::try_from(pid) else {
        return false;
    };
    if p <= 1 || !rsb_agent::proc::is_alive(p, None) {
        return false;
    }
    match rsb_agent::proc::args(p) {
        Some(args) => args.iter().any(|a| a == b"watchdog") && args.iter().any(|a| a == b"run"),
        None => !rsb_agent::proc::proc_available(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_names_its_holder_and_goes_with_it() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(lock_holder(d.path()), None, "no lock file yet");
        let held = acquire_lock(d.path()).unwrap();
        assert_eq!(lock_holder(d.path()), Some(std::process::id() as i64));
        // The probe let its shared lock go: the holder is still reported, and still alone.
        assert_eq!(lock_holder(d.path()), Some(std::process::id() as i64));
        drop(held);
        assert_eq!(lock_holder(d.path()), None);
        // A released lock is taken again, and the pid is rewritten, not appended.
        let again = acquire_lock(d.path()).unwrap();
        let text = std::fs::read_to_string(d.path().join(LOCK_FILE)).unwrap();
        assert_eq!(text, std::process::id().to_string());
        drop(again);
    }

    #[test]
    fn only_a_watchdog_command_line_is_a_daemon_pid() {
        assert!(!is_daemon_pid(0));
        assert!(!is_daemon_pid(1));
        assert!(!is_daemon_pid(-5));
        // This test binary is alive but is not `… watchdog run`.
        assert!(!is_daemon_pid(std::process::id() as i64));
        let mut fake = std::process::Command::new("sh")
            .args(["-c", "sleep 30; :", "watchdog", "run"])
            .spawn()
            .unwrap();
        // sh's own argv holds both words (the `:` keeps sh from exec'ing sleep). Until
        // the child has exec'd it still carries this binary's argv, so wait for that, bounded.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !is_daemon_pid(fake.id() as i64) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(is_daemon_pid(fake.id() as i64));
        fake.kill().unwrap();
        fake.wait().unwrap();
        assert!(!is_daemon_pid(fake.id() as i64), "a reaped pid is gone");
    }
}
