//! Stale agents: an agent whose link was cut without a FIN (its sshd has not noticed yet) keeps
//! running, holding its commands, sync sessions and staging locks, for as long as the kernel
//! keeps the dead TCP connection. The next `serve` of the same user finds and stops it.
//!
//! Each serving agent keeps a record `<pid>` in a private per-user directory
//! (`$XDG_RUNTIME_DIR/rsb/agents`, else `~/.cache/rsb/agents`): its pid, its start time (the
//! /proc identity, so a reused pid is never taken for it) and whether its client sends
//! heartbeats. The record's mtime is touched while the channel shows life (a frame read or a
//! flush completed). rsb pings an idle channel every few seconds, so a live channel is never
//! quiet for long, while a cut one is: nothing arrives and output cannot be flushed.
//!
//! A record is judged only when its agent has seen heartbeats (several pings a few seconds
//! apart): a client that does not send them (an older rsb) may legitimately be idle for hours,
//! and its agent is never stopped. A stale agent gets SIGTERM (it then stops its commands and
//! removes its staging like at EOF), and SIGKILL after a grace if it is stuck writing to the
//! dead link (its reaper still stops its commands; its locks go with the process).

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crate::proc::{self, Signal};

/// Quiet for this long while its client heartbeats: the channel is dead.
pub const STALE_AFTER: Duration = Duration::from_secs(60);
/// The record is touched at most this often.
pub const TOUCH_EVERY: Duration = Duration::from_secs(5);
/// Pings at most this far apart count towards "the client heartbeats".
const PING_GAP: Duration = Duration::from_secs(15);
/// That many such pings in a row.
const PINGS_FOR_HEARTBEAT: u32 = 3;
/// SIGTERM → SIGKILL.
const GRACE: Duration = Duration::from_secs(3);

/// Bumped on every frame read and every flush: "the channel showed life".
static ACTIVITY: AtomicU64 = AtomicU64::new(0);
static HEARTBEAT: AtomicBool = AtomicBool::new(false);
static PINGS: Mutex<(Option<Instant>, u32)> = Mutex::new((None, 0));

pub fn activity() {
    ACTIVITY.fetch_add(1, Ordering::Relaxed);
}

/// Called for every ping request.
pub fn saw_ping() {
    let Ok(mut p) = PINGS.lock() else { return };
    let now = Instant::now();
    p.1 = match p.0 {
        Some(last) if now.duration_since(last) <= PING_GAP => p.1 + 1,
        _ => 1,
    };
    p.0 = Some(now);
    if p.1 >= PINGS_FOR_HEARTBEAT {
        HEARTBEAT.store(true, Ordering::Relaxed);
    }
}

/// The per-user directory, created private; `None` when it cannot be made safe.
fn dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p.is_dir())
        .map(|p| p.join("rsb"))
        .or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .map(|h| h.join(".cache/rsb"))
        })?;
    let dir = base.join("agents");
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir);
    let meta = std::fs::symlink_metadata(&dir).ok()?;
    let me = rustix::process::geteuid().as_raw();
    (meta.is_dir() && meta.uid() == me && meta.permissions().mode() & 0o077 == 0).then_some(dir)
}

/// This agent's record; removed on drop.
pub struct Record {
    path: PathBuf,
    me: u32,
    start: u64,
    heartbeat_written: bool,
    seen: u64,
}

impl Record {
    pub fn create() -> Option<Record> {
        let me = std::process::id();
        let start = proc::start_ticks(me)?;
        let path = dir()?.join(me.to_string());
        let mut r = Record {
            path,
            me,
            start,
            heartbeat_written: false,
            seen: ACTIVITY.load(Ordering::Relaxed),
        };
        r.write().ok()?;
        Some(r)
    }

    fn write(&mut self) -> std::io::Result<()> {
        let hb = u8::from(self.heartbeat_written);
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, format!("{} {} {hb}\n", self.me, self.start))?;
        std::fs::rename(&tmp, &self.path)
    }

    /// Refresh the record if the channel showed life since the last call.
    pub fn tick(&mut self) {
        let now = ACTIVITY.load(Ordering::Relaxed);
        if HEARTBEAT.load(Ordering::Relaxed) && !self.heartbeat_written {
            self.heartbeat_written = true;
            let _ = self.write();
        } else if now != self.seen {
            let _ = std::fs::File::options()
                .append(true)
                .open(&self.path)
                .and_then(|f| f.set_modified(SystemTime::now()));
        }
        self.seen = now;
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Parsed record: pid, start ticks, heartbeat flag, age.
fn read_record(path: &Path) -> Option<(u32, u64, bool, Duration)> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let mut f = text.split_ascii_whitespace();
    let pid = f.next()?.parse().ok()?;
    let start = f.next()?.parse().ok()?;
    let hb = f.next()? == "1";
    let age = meta.modified().ok()?.elapsed().unwrap_or_default();
    Some((pid, start, hb, age))
}

/// Is `pid` (with this start time) an `rsb-agent serve`?
fn is_serving_agent(pid: u32, start: u64) -> bool {
    if !proc::is_alive(pid, Some(start)) {
        return false;
    }
    let Some(args) = proc::args(pid) else {
        return false;
    };
    args.len() >= 2 && args[0].ends_with(b"rsb-agent") && args[1] == b"serve"
}

/// Stop every stale agent of this user (blocking; run off the runtime). Returns how many.
pub fn stop_stale() -> usize {
    stop_stale_in(dir().as_deref(), STALE_AFTER)
}

pub fn stop_stale_in(dir: Option<&Path>, stale_after: Duration) -> usize {
    let Some(dir) = dir else { return 0 };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let me = std::process::id();
    let mut stopped = 0;
    for e in entries.flatten() {
        let path = e.path();
        let Some((pid, start, hb, age)) = read_record(&path) else {
            continue;
        };
        if pid == me {
            continue;
        }
        if !proc::is_alive(pid, Some(start)) {
            // Its agent is gone (killed outright): the record is litter.
            let _ = std::fs::remove_file(&path);
            continue;
        }
        if !hb || age < stale_after || !is_serving_agent(pid, start) {
            continue;
        }
        let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
            continue;
        };
        let _ = rustix::process::kill_process(p, Signal::TERM);
        let deadline = Instant::now() + GRACE;
        while proc::is_alive(pid, Some(start)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if proc::is_alive(pid, Some(start)) {
            let _ = rustix::process::kill_process(p, Signal::KILL);
        }
        let _ = std::fs::remove_file(&path);
        stopped += 1;
    }
    stopped
}
