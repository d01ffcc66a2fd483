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
    store::{self, layout::DAEMON_LOCK},
};

/// The held lock; released when dropped (or when the process dies, however it dies).
pub struct Lock(#[allow(dead_code)] File);

fn open_lock_file(state_dir: &Path) -> std::io::Result<File> {
    store::roots_lock::open_lock_file(&state_dir.join(DAEMON_LOCK))
}

/// What the lock file says of the daemon holding it: its pid and, since the pid alone can be
/// handed to another process after the daemon died, its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub pid: i64,
    /// `None` in a file written by an older rsb, or where the process table cannot be read.
    pub start: Option<u64>,
}

impl Holder {
    /// This process, as the lock file records it.
    fn me() -> Holder {
        let pid = std::process::id();
        Holder {
            pid: i64::from(pid),
            start: rsb_agent::proc::start_ticks(pid),
        }
    }

    /// `PID START` (or `PID`), the lock file's text.
    fn line(&self) -> String {
        match self.start {
            Some(s) => format!("{} {s}", self.pid),
            None => self.pid.to_string(),
        }
    }

    fn parse(text: &str) -> Option<Holder> {
        let mut f = text.split_ascii_whitespace();
        let pid = f.next()?.parse().ok()?;
        let start = match f.next() {
            Some(s) => Some(s.parse().ok()?),
            None => None,
        };
        Some(Holder { pid, start })
    }

    /// Whether this is a live `rsb watchdog run`: the same process that wrote the lock (its
    /// start time), whose command line says so (from /proc on Linux, `KERN_PROCARGS2` on
    /// macOS). Where the process table cannot be read, being alive must do.
    pub fn is_daemon(&self) -> bool {
        let Ok(p) = u32::try_from(self.pid) else {
            return false;
        };
        if p <= 1 || !rsb_agent::proc::is_alive(p, self.start) {
            return false;
        }
        match rsb_agent::proc::args(p) {
            Some(args) => args.iter().any(|a| a == b"watchdog") && args.iter().any(|a| a == b"run"),
            None => !rsb_agent::proc::proc_available(),
        }
    }

    /// Send `sig` to the daemon if it is still the process that wrote the lock (see
    /// `rsb_agent::proc::signal_exact`): never to a process that took its pid since.
    pub fn signal(&self, sig: rsb_agent::proc::Signal) -> bool {
        u32::try_from(self.pid)
            .is_ok_and(|p| p > 1 && rsb_agent::proc::signal_exact(p, self.start, sig))
    }
}

fn read_holder(f: &mut File) -> Option<Holder> {
    let mut s = String::new();
    f.rewind().ok()?;
    f.read_to_string(&mut s).ok()?;
    Holder::parse(&s)
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
                write!(f, "{}", Holder::me().line()).map_err(store::db_err)?;
                f.flush().map_err(store::db_err)?;
                return Ok(Lock(f));
            }
            Err(TryLockError::Error(e)) => return Err(store::db_err(e)),
            Err(TryLockError::WouldBlock) => {}
        }
        if Instant::now() >= deadline {
            let pid = read_holder(&mut f)
                .map(|h| h.pid.to_string())
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

/// The pid of the daemon holding the lock of `state_dir`, if one does (see [`holder`]).
pub fn lock_holder(state_dir: &Path) -> Option<i64> {
    holder(state_dir).map(|h| h.pid)
}

/// What the lock file says of the daemon holding the lock of `state_dir`, if one does. A
/// shared probe fails only under the daemon's exclusive lock, and is let go at once. A holder
/// whose file cannot be read yet (it is written right after the lock is taken) has pid 0.
pub fn holder(state_dir: &Path) -> Option<Holder> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .open(state_dir.join(DAEMON_LOCK))
        .ok()?;
    match f.try_lock_shared() {
        Ok(()) => {
            let _ = f.unlock();
            None
        }
        Err(TryLockError::WouldBlock) => Some(read_holder(&mut f).unwrap_or(Holder {
            pid: 0,
            start: None,
        })),
        Err(TryLockError::Error(_)) => None,
    }
}

/// The daemon serving `state_dir`: the lock's holder, if it is a live `rsb watchdog run` and
/// the very process that took the lock.
pub fn running_daemon(state_dir: &Path) -> Option<Holder> {
    holder(state_dir).filter(Holder::is_daemon)
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
        let text = std::fs::read_to_string(d.path().join(DAEMON_LOCK)).unwrap();
        assert_eq!(Holder::parse(&text), Some(Holder::me()));
        drop(again);
    }

    #[test]
    fn only_a_watchdog_command_line_with_its_start_time_is_a_daemon() {
        let at = |pid: i64, start: Option<u64>| Holder { pid, start };
        assert!(!at(0, None).is_daemon());
        assert!(!at(1, None).is_daemon());
        assert!(!at(-5, None).is_daemon());
        // This test binary is alive but is not `… watchdog run`.
        assert!(!at(std::process::id() as i64, None).is_daemon());
        let mut fake = std::process::Command::new("sh")
            .args(["-c", "sleep 30; :", "watchdog", "run"])
            .spawn()
            .unwrap();
        let pid = fake.id() as i64;
        // sh's own argv holds both words (the `:` keeps sh from exec'ing sleep). Until
        // the child has exec'd it still carries this binary's argv, so wait for that, bounded.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !at(pid, None).is_daemon() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let start = rsb_agent::proc::start_ticks(fake.id());
        assert!(start.is_some());
        assert!(
            at(pid, None).is_daemon(),
            "a lock file without a start time"
        );
        assert!(at(pid, start).is_daemon());
        // The pid with another start time: the daemon that wrote it died and the pid went
        // to a process that merely looks like one. It is neither reported nor signalled.
        let reused = at(pid, start.map(|s| s + 1));
        assert!(!reused.is_daemon());
        assert!(!reused.signal(rsb_agent::proc::Signal::KILL));
        assert!(at(pid, start).is_daemon(), "spared");
        assert!(at(pid, start).signal(rsb_agent::proc::Signal::KILL));
        fake.wait().unwrap();
        assert!(!at(pid, start).is_daemon(), "a reaped pid is gone");
    }

    #[test]
    fn the_lock_file_records_pid_and_start_time() {
        let d = tempfile::tempdir().unwrap();
        let held = acquire_lock(d.path()).unwrap();
        let me = std::process::id();
        let text = std::fs::read_to_string(d.path().join(DAEMON_LOCK)).unwrap();
        let start = rsb_agent::proc::start_ticks(me).unwrap();
        assert_eq!(text, format!("{me} {start}"));
        assert_eq!(
            holder(d.path()),
            Some(Holder {
                pid: me as i64,
                start: Some(start)
            })
        );
        drop(held);
        // An older rsb wrote the pid alone; a damaged file names nobody.
        assert_eq!(
            Holder::parse("4242\n"),
            Some(Holder {
                pid: 4242,
                start: None
            })
        );
        assert_eq!(Holder::parse("4242 x"), None);
        assert_eq!(Holder::parse(""), None);
    }
}
