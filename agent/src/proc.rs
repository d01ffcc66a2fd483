//! Process control in one place: finding a program on PATH, spawning it in its own process group
//! or session, waiting with a deadline, stopping the whole group and confirming it is gone, and
//! telling a live process from a zombie or from a stranger that was given a reused pid.
//!
//! exec, jobs, the GPU sampler and `rsb`'s durable transfer records all need these. Separate
//! copies had drifted apart: the Hello's tmux check took any file, exec's bash lookup fell back
//! to directories the job runner never searched, and the job runner took relative PATH entries
//! the GPU sampler refused; the /proc parsers disagreed about dying (`X`) processes; only exec
//! confirmed that a killed group was gone. One module gives them one set of rules.
//!
//! Everything here blocks (it is called from plain threads or `spawn_blocking`) except
//! [`terminate`], which must reap a tokio child while it waits.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use rustix::process::Signal;
use rustix::process::{Pid, kill_process_group, test_kill_process, test_kill_process_group};

/// Poll interval while waiting for a process or a group to go.
const POLL: Duration = Duration::from_millis(20);
/// How long a killed group may take to vanish before [`output_with_deadline`] moves on.
const KILL_VERIFY: Duration = Duration::from_secs(1);
/// How long an exited child's pipes may take to close once the deadline has passed.
const PIPE_GRACE: Duration = Duration::from_millis(200);

// ---------------------------------------------------------------------------------------------
// PATH

/// The search path when `PATH` is unset, which happens to an agent started by `ssh host cmd`
/// with an empty environment. It is what musl's `execvp` uses in that case.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Find `name` the way every part of the agent does (one policy, so the Hello's capabilities,
/// the job runner and the GPU sampler never disagree about what is installed):
/// - `name` must be a bare program name: one with a `/` would be resolved against the cwd;
/// - `path_var` is the PATH to search; unset (`None`) means [`DEFAULT_PATH`]. A set PATH is
///   authoritative: a caller who took a program off PATH does not get it back from elsewhere;
/// - empty and relative entries are skipped: POSIX reads them as the current directory, and the
///   agent's cwd is not a place to pick programs from;
/// - a candidate must be a regular file (after following symlinks) that this process may
///   execute (`access(X_OK)`), so directories and files without an execute bit for us are
///   passed over, as `execvp` would pass them over.
pub fn find_executable(name: &str, path_var: Option<&OsStr>) -> Option<PathBuf> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return None;
    }
    search_dirs(path_var)
        .map(|dir| dir.join(name))
        .find(|p| is_executable_file(p))
}

/// [`find_executable`] on the agent's own PATH.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    find_executable(name, std::env::var_os("PATH").as_deref())
}

/// The directories [`find_executable`] looks in, in order.
fn search_dirs(path_var: Option<&OsStr>) -> impl Iterator<Item = PathBuf> + '_ {
    let var = path_var.unwrap_or(OsStr::new(DEFAULT_PATH));
    std::env::split_paths(var).filter(|d| d.is_absolute())
}

fn is_executable_file(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file())
        && rustix::fs::access(p, rustix::fs::Access::EXEC_OK).is_ok()
}

// ---------------------------------------------------------------------------------------------
// /proc/<pid>/stat

/// The fields of `/proc/<pid>/stat` that process control needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// `R`, `S`, `D`, `T`, `Z` (zombie), `X` (dead), …
    pub state: u8,
    pub ppid: u32,
    pub pgrp: i32,
    pub session: i32,
    /// When the process started, in clock ticks since boot. With the pid it names one process
    /// for the life of the system: a reused pid has a later start time.
    pub start_ticks: u64,
}

impl Stat {
    /// Parses the text of `/proc/<pid>/stat`. The command name (field 2) may hold spaces and
    /// parentheses, so the fields are counted from its last `)`.
    pub fn parse(data: &[u8]) -> Option<Stat> {
        let close = data.iter().rposition(|&b| b == b')')?;
        let rest = std::str::from_utf8(&data[close + 1..]).ok()?;
        let mut f = rest.split_ascii_whitespace();
        let state = *f.next()?.as_bytes().first()?;
        let ppid = f.next()?.parse().ok()?;
        let pgrp = f.next()?.parse().ok()?;
        let session = f.next()?.parse().ok()?;
        // Fields 7 to 21 (tty … itrealvalue) are skipped; starttime is field 22.
        let start_ticks = f.nth(15)?.parse().ok()?;
        Some(Stat {
            state,
            ppid,
            pgrp,
            session,
            start_ticks,
        })
    }

    /// `None` when the process does not exist (or /proc is not mounted). macOS has no /proc:
    /// libproc's `proc_bsdinfo` says the same (see [`darwin`]). Elsewhere no process table is
    /// read: [`is_alive`] falls back to existence.
    pub fn read(pid: u32) -> Option<Stat> {
        if macos_source() {
            return darwin::bsdinfo(pid).map(|b| b.stat());
        }
        #[cfg(any(target_os = "linux", target_os = "android"))]
        return Stat::parse(&procfs(&format!("/proc/{pid}/stat"))?);
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        None
    }

    /// Exited but not yet reaped (`Z`), or being torn down (`X`). Such a process runs nothing and
    /// holds no pipe; on a host whose init does not reap orphans it stays like this forever, so
    /// it must never count as alive.
    pub fn is_dead(&self) -> bool {
        matches!(self.state, b'Z' | b'X')
    }
}

/// Whether the process table can be read ([`Stat::read`], [`args`]): /proc on Linux (always
/// mounted on a real host), libproc and `sysctl` on macOS.
pub fn proc_available() -> bool {
    if macos_source() {
        return true;
    }
    static MOUNTED: OnceLock<bool> = OnceLock::new();
    *MOUNTED.get_or_init(|| Path::new("/proc/self/stat").exists())
}

/// A file under /proc, for the Linux readers: `None` under `RSB_TEST_NO_PROCFS=1`, as on a
/// Mac, so a reader used where the Mac's calls belong finds nothing there too.
#[cfg_attr(target_vendor = "apple", allow(dead_code))]
fn procfs(path: &str) -> Option<Vec<u8>> {
    if procfs_disabled() {
        return None;
    }
    std::fs::read(path).ok()
}

/// Whether the process table is read through macOS's calls ([`darwin`]): on a Mac, and on
/// Linux in test builds under `RSB_TEST_NO_PROCFS=1` (see [`procfs_disabled`]).
fn macos_source() -> bool {
    cfg!(target_vendor = "apple") || procfs_disabled()
}

/// `RSB_TEST_NO_PROCFS=1`, honoured by test builds only (debug assertions; a release agent
/// ignores it): the agent reads nothing under /proc for its process table, as on a Mac, and
/// takes the Mac's path instead, whose libproc and `sysctl` calls [`darwin`] then answers
/// from the kernel's table in the Mac's shapes (start times in µs, `SZOMB`, the argument
/// buffer of `KERN_PROCARGS2`). So the agent's process tests run the Mac's decisions on Linux
/// in CI, and code that takes /proc for granted (as 21b0de8 and dccdc35 together did) fails
/// there (issue 44).
fn procfs_disabled() -> bool {
    #[cfg(debug_assertions)]
    {
        static OFF: OnceLock<bool> = OnceLock::new();
        *OFF.get_or_init(|| std::env::var_os("RSB_TEST_NO_PROCFS").is_some_and(|v| v == "1"))
    }
    #[cfg(not(debug_assertions))]
    false
}

/// The argument vector of a process, from `/proc/<pid>/cmdline`; `None` when it is gone. A
/// zombie, or a process in the middle of an exec, has an empty one (`[[]]`).
#[cfg(not(target_vendor = "apple"))]
pub fn args(pid: u32) -> Option<Vec<Vec<u8>>> {
    if macos_source() {
        return darwin::parse_procargs2(&darwin::procargs2(pid)?);
    }
    let data = procfs(&format!("/proc/{pid}/cmdline"))?;
    let data = data.strip_suffix(b"\0").unwrap_or(&data);
    Some(data.split(|&b| b == 0).map(<[u8]>::to_vec).collect())
}

/// The argument vector of a process, from `sysctl(KERN_PROCARGS2)`; `None` when it is gone
/// or not ours to read (macOS shows another user's arguments to no one but root).
#[cfg(target_vendor = "apple")]
pub fn args(pid: u32) -> Option<Vec<Vec<u8>>> {
    darwin::parse_procargs2(&darwin::procargs2(pid)?)
}

/// The process table of macOS, read through libproc (`proc_pidinfo`, `proc_listpids`) and
/// `sysctl`, in place of Linux's /proc. The parsing is plain functions of the bytes and fields
/// those calls return, so it is unit-tested on Linux too; only the calls are macOS-only.
#[cfg_attr(not(target_vendor = "apple"), allow(dead_code))]
pub mod darwin {
    use super::Stat;

    /// `p_stat` values of `<sys/proc.h>` (also in the libc crate, for apple only).
    pub const SIDL: u32 = 1;
    pub const SRUN: u32 = 2;
    pub const SSLEEP: u32 = 3;
    pub const SSTOP: u32 = 4;
    pub const SZOMB: u32 = 5;

    /// The fields of libproc's `proc_bsdinfo` (`PROC_PIDTBSDINFO`) that [`Stat`] needs.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct BsdInfo {
        pub status: u32,
        pub ppid: u32,
        pub pgid: u32,
        /// From `getsid`: `proc_bsdinfo` has no session id.
        pub sid: i32,
        pub start_tvsec: u64,
        pub start_tvusec: u64,
    }

    impl BsdInfo {
        /// The same [`Stat`] Linux reads from /proc. The start time is microseconds since the
        /// epoch here (clock ticks since boot on Linux): either way an opaque value that, with
        /// the pid, names one process, since a reused pid starts later.
        pub fn stat(&self) -> Stat {
            let state = match self.status {
                // Being created is as alive as running: it will run.
                SIDL | SRUN => b'R',
                SSLEEP => b'S',
                SSTOP => b'T',
                SZOMB => b'Z',
                _ => b'?',
            };
            Stat {
                state,
                ppid: self.ppid,
                pgrp: i32::try_from(self.pgid).unwrap_or(-1),
                session: self.sid,
                start_ticks: self
                    .start_tvsec
                    .saturating_mul(1_000_000)
                    .saturating_add(self.start_tvusec),
            }
        }
    }

    /// Splits the buffer `sysctl(KERN_PROCARGS2)` fills: `argc` (a native-endian i32), the
    /// executable path NUL-terminated and NUL-padded, then `argc` NUL-terminated arguments
    /// (the environment follows; it is not read). `None` when it is shorter than it says.
    pub fn parse_procargs2(buf: &[u8]) -> Option<Vec<Vec<u8>>> {
        let argc = usize::try_from(i32::from_ne_bytes(buf.get(..4)?.try_into().ok()?)).ok()?;
        let rest = &buf[4..];
        let path_end = rest.iter().position(|&b| b == 0)?;
        let rest = &rest[path_end..];
        let start = rest.iter().position(|&b| b != 0).unwrap_or(rest.len());
        let mut rest = &rest[start..];
        let mut args = Vec::with_capacity(argc.min(256));
        for _ in 0..argc {
            let end = rest.iter().position(|&b| b == 0)?;
            args.push(rest[..end].to_vec());
            rest = &rest[end + 1..];
        }
        Some(args)
    }

    #[cfg(target_vendor = "apple")]
    pub fn bsdinfo(pid: u32) -> Option<BsdInfo> {
        let raw = libc::c_int::try_from(pid).ok().filter(|&p| p > 0)?;
        // SAFETY: proc_bsdinfo is plain old data, valid when zeroed.
        let mut info: libc::proc_bsdinfo = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::proc_bsdinfo>() as libc::c_int;
        // SAFETY: the buffer is a live proc_bsdinfo of `size` bytes.
        let n = unsafe {
            libc::proc_pidinfo(
                raw,
                libc::PROC_PIDTBSDINFO,
                0,
                (&mut info as *mut libc::proc_bsdinfo).cast(),
                size,
            )
        };
        if n != size {
            return None;
        }
        // SAFETY: getsid takes any pid; -1 (gone, or another session we may not ask about)
        // only leaves the session unknown.
        let sid = unsafe { libc::getsid(raw) };
        Some(BsdInfo {
            status: info.pbi_status,
            ppid: info.pbi_ppid,
            pgid: info.pbi_pgid,
            sid,
            start_tvsec: info.pbi_start_tvsec,
            start_tvusec: info.pbi_start_tvusec,
        })
    }

    /// Every pid on the system (`proc_listpids(PROC_ALL_PIDS)`); `None` if the call fails.
    #[cfg(target_vendor = "apple")]
    pub fn all_pids() -> Option<Vec<u32>> {
        /// `<sys/proc_info.h>`; the libc crate does not define it.
        const PROC_ALL_PIDS: u32 = 1;
        let mut buf = vec![0 as libc::c_int; 1024];
        loop {
            let bytes =
                libc::c_int::try_from(buf.len() * std::mem::size_of::<libc::c_int>()).ok()?;
            // SAFETY: the buffer holds `bytes` bytes of c_int.
            let n =
                unsafe { libc::proc_listpids(PROC_ALL_PIDS, 0, buf.as_mut_ptr().cast(), bytes) };
            let n = usize::try_from(n).ok()? / std::mem::size_of::<libc::c_int>();
            // A full buffer may have been cut short: ask again with more room (bounded).
            if n < buf.len() || buf.len() >= 1 << 20 {
                buf.truncate(n);
                return Some(
                    buf.into_iter()
                        .filter_map(|p| u32::try_from(p).ok().filter(|&p| p > 0))
                        .collect(),
                );
            }
            buf.resize(buf.len() * 4, 0);
        }
    }

    /// The raw `KERN_PROCARGS2` buffer of `pid`.
    #[cfg(target_vendor = "apple")]
    pub fn procargs2(pid: u32) -> Option<Vec<u8>> {
        let raw = libc::c_int::try_from(pid).ok().filter(|&p| p > 0)?;
        let mut argmax: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>();
        let mut mib = [libc::CTL_KERN, libc::KERN_ARGMAX];
        // SAFETY: mib names an int, and `argmax`/`len` describe an int-sized buffer.
        let rc = unsafe {
            libc::sysctl(
                mib.as_mut_ptr(),
                2,
                (&mut argmax as *mut libc::c_int).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        if rc != 0 || argmax <= 0 {
            return None;
        }
        let mut buf = vec![0u8; usize::try_from(argmax).ok()?];
        let mut len = buf.len();
        let mut mib = [libc::CTL_KERN, libc::KERN_PROCARGS2, raw];
        // SAFETY: `buf` holds `len` bytes; the kernel writes at most that and updates `len`.
        let rc = unsafe {
            libc::sysctl(
                mib.as_mut_ptr(),
                3,
                buf.as_mut_ptr().cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        if rc != 0 {
            return None;
        }
        buf.truncate(len);
        Some(buf)
    }

    /// Linux only, for `RSB_TEST_NO_PROCFS=1` (see [`super::procfs_disabled`]): libproc's and
    /// `sysctl`'s answers, made from the kernel's own table as the Mac's kernel makes them,
    /// in their shapes (status codes, start time in seconds and µs, the session from
    /// `getsid`, the `KERN_PROCARGS2` buffer), so the parsing and deciding above them run as
    /// on a Mac. Nothing else in the agent reads /proc in that mode.
    #[cfg(not(target_vendor = "apple"))]
    pub fn bsdinfo(pid: u32) -> Option<BsdInfo> {
        let raw = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
        let s = Stat::parse(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)?;
        // SAFETY: as on the Mac (libc, since rustix's getsid cannot return session 0, which
        // the kernel's own threads and a container's init have).
        let sid = unsafe { libc::getsid(raw) };
        // Clock ticks since boot, at the usual 100 per second.
        Some(BsdInfo {
            status: match s.state {
                b'R' => SRUN,
                b'T' | b't' => SSTOP,
                b'Z' | b'X' => SZOMB,
                _ => SSLEEP,
            },
            ppid: s.ppid,
            pgid: u32::try_from(s.pgrp).ok()?,
            sid,
            start_tvsec: s.start_ticks / 100,
            start_tvusec: s.start_ticks % 100 * 10_000,
        })
    }

    /// See [`bsdinfo`]: every pid, as `proc_listpids(PROC_ALL_PIDS)` gives them.
    #[cfg(not(target_vendor = "apple"))]
    pub fn all_pids() -> Option<Vec<u32>> {
        super::read_pids()
    }

    /// See [`bsdinfo`]: `argc`, the executable's path (NUL-padded), the arguments and the
    /// environment, as `KERN_PROCARGS2` lays them out; `None` where they cannot be read (the
    /// Mac shows no one else's).
    #[cfg(not(target_vendor = "apple"))]
    pub fn procargs2(pid: u32) -> Option<Vec<u8>> {
        use std::os::unix::ffi::OsStrExt;
        let args = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let path = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        let argc = args.iter().filter(|&&b| b == 0).count();
        let mut buf = i32::try_from(argc).ok()?.to_ne_bytes().to_vec();
        buf.extend_from_slice(path.as_os_str().as_bytes());
        buf.extend_from_slice(&[0; 4]);
        buf.extend_from_slice(&args);
        buf.extend_from_slice(b"RSB_EMULATED=1\0");
        Some(buf)
    }
}

/// A pid as the kernel's signed type; `None` for 0 and for values no process can have.
fn pid_of(pid: u32) -> Option<Pid> {
    Pid::from_raw(i32::try_from(pid).ok()?)
}

/// The start time of a live process, for recording next to its pid (see [`is_alive`]).
/// `None` when it is gone, a zombie, or /proc is unavailable.
pub fn start_ticks(pid: u32) -> Option<u64> {
    Stat::read(pid)
        .filter(|s| !s.is_dead())
        .map(|s| s.start_ticks)
}

/// Whether `pid` is a live process and, when `started` is given, still the one that started
/// at that time. A pid alone is not enough: after a reboot or a long uptime the number is handed
/// to another process, which would make a dead owner look alive forever. Zombies are not alive.
///
/// Without /proc (development builds on other systems) neither identity nor zombies can be
/// told; existence alone (signal 0, where "not permitted" still means it exists) decides.
pub fn is_alive(pid: u32, started: Option<u64>) -> bool {
    let Some(p) = pid_of(pid) else {
        return false;
    };
    match Stat::read(pid) {
        Some(s) => !s.is_dead() && started.is_none_or(|t| t == s.start_ticks),
        None if proc_available() => false,
        None => !matches!(test_kill_process(p), Err(rustix::io::Errno::SRCH)),
    }
}

/// Send `sig` to `pid` only if it is still the process that started at `started` (see
/// [`is_alive`]); false when it is gone or another process has its pid. On Linux the process
/// is pinned by a pidfd before its start time is checked, so the signal cannot reach a process
/// that took the pid in between; elsewhere (or before Linux 5.3) the check and the signal are
/// two steps, a window of microseconds.
pub fn signal_exact(pid: u32, started: Option<u64>, sig: Signal) -> bool {
    let Some(p) = pid_of(pid) else {
        return false;
    };
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Ok(fd) = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) {
        return is_alive(pid, started) && rustix::process::pidfd_send_signal(&fd, sig).is_ok();
    }
    is_alive(pid, started) && rustix::process::kill_process(p, sig).is_ok()
}

// ---------------------------------------------------------------------------------------------
// Spawning

/// Put the child in a new process group of its own, so [`Group`] can signal everything it
/// starts (a shell's pipeline, a wrapper's helpers) and nothing else.
pub fn new_group(cmd: &mut Command) -> &mut Command {
    cmd.process_group(0)
}

/// Make the child the leader of a new session, hence of a new process group, with no
/// controlling terminal: neither a closing SSH connection nor a terminal's job control reaches
/// it. `parent_death` (Linux only, see [`parent_death_signal`]) is sent to the child when the
/// thread that spawned it exits, so a supervisor killed outright does not leave its work
/// running unsupervised.
///
/// On Linux the child is also made a child subreaper (kept across its exec): what it starts
/// stays its descendant even after leaving the session (`setsid cmd &`) or losing its parent
/// (a double fork), since such orphans are handed to it rather than to init. [`Group`] follows
/// descendants, so a stop reaches them. The shell reaps the orphans it is handed as it reaps
/// its own children.
pub fn new_session(cmd: &mut Command, parent_death: Option<Signal>) -> &mut Command {
    // Decided here: the closure below may call nothing that reads the environment.
    let parent_death = parent_death.filter(|_| parent_death_signal());
    // SAFETY: the closure runs between fork and exec and makes only the setsid and prctl
    // system calls (rustix issues them directly), which are async-signal-safe; it allocates
    // nothing and touches no lock or memory shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::setsid()?;
            keep_descendants()?;
            #[cfg(any(target_os = "linux", target_os = "android"))]
            if let Some(sig) = parent_death {
                rustix::process::set_parent_process_death_signal(Some(sig))?;
            }
            #[cfg(not(any(target_os = "linux", target_os = "android")))]
            let _ = parent_death;
            Ok(())
        })
    }
}

/// Whether the kernel sends a child a signal when its parent dies (Linux's
/// `PR_SET_PDEATHSIG`, see [`new_session`]). macOS has none, and a test build under
/// `RSB_TEST_NO_PROCFS=1` takes the Mac's path: a supervisor there guards its child with a
/// reaper instead (`reaper::Guard`).
pub fn parent_death_signal() -> bool {
    cfg!(any(target_os = "linux", target_os = "android")) && !procfs_disabled()
}

/// Make the calling process a child subreaper (see [`new_session`]); for `pre_exec` closures,
/// so it makes one system call and allocates nothing. A kernel without it (before 3.4) leaves
/// descendants to be followed while their parents live. Elsewhere there is no such thing.
pub fn keep_descendants() -> io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    match rustix::process::set_child_subreaper(Some(Pid::INIT)) {
        Ok(()) | Err(rustix::io::Errno::INVAL) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// Spawns `cmd`, retrying a few times on ETXTBSY: an executable written a moment ago can
/// briefly fail that way while another thread's fork still holds its write descriptor. That
/// clears within milliseconds, so a retry is cheaper than a spurious failure.
pub fn spawn(cmd: &mut Command) -> io::Result<Child> {
    let mut attempt = 0;
    loop {
        match cmd.spawn() {
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::TXTBSY.raw_os_error()) => {
                attempt += 1;
                if attempt == 3 {
                    return Err(e);
                }
                std::thread::sleep(POLL);
            }
            other => return other,
        }
    }
}

/// Waits for the child to exit until `deadline`; `Ok(None)` means it is still running (it is
/// neither signalled nor reaped). Polls with a backoff from 1 ms to [`POLL`], so a quick child
/// costs about a millisecond and a slow one little CPU.
pub fn wait_deadline(child: &mut Child, deadline: Instant) -> io::Result<Option<ExitStatus>> {
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(POLL);
    }
}

/// SIGKILLs the child's group (when it leads one) and the child, then reaps it. Safe against
/// pid reuse because the child is not reaped before the kill, so its pid, which is also the
/// group id, cannot belong to anyone else yet. Returns whether the group was seen gone within
/// `verify` (members other than the child may take a moment to die).
pub fn kill_and_reap(child: &mut Child, verify: Duration) -> bool {
    let mut run = Group::new(child.id()).map(Group::track);
    if let Some(r) = &mut run {
        r.signal(Signal::KILL);
    }
    let _ = child.kill();
    let _ = child.wait();
    run.is_none_or(|mut r| r.wait_gone(Instant::now() + verify, &mut || true))
}

/// Why [`output_with_deadline`] has no output to give.
#[derive(Debug)]
pub enum RunError {
    /// The program could not be started.
    Spawn(io::Error),
    /// Waiting failed (or no thread could be started to read a pipe); the child was killed.
    Wait(io::Error),
    /// The deadline passed first; the child's group was killed and the child reaped.
    TimedOut,
    /// The child exited, but something it started still held its output open past the
    /// deadline; that group member was killed.
    OutputHeld(ExitStatus),
}

/// Runs `cmd` in a new process group with stdin closed and returns its output, taking at most
/// `max_output` bytes of each stream and never more than `timeout` (plus a short grace for the
/// pipes to close). On a timeout the whole group is killed, so a wrapper script's `sleep` or a
/// helper the program forked cannot keep running, or keep the pipes open, after we gave up.
pub fn output_with_deadline(
    cmd: &mut Command,
    timeout: Duration,
    max_output: u64,
) -> Result<std::process::Output, RunError> {
    use std::io::Read;
    use std::process::Stdio;

    let deadline = Instant::now() + timeout;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn(new_group(cmd)).map_err(RunError::Spawn)?;
    let (tx, rx) = std::sync::mpsc::channel::<(bool, Vec<u8>)>();
    // Both pipes are drained on their own threads: reading one while the child blocks on the
    // other (full pipe) would look like a hang.
    let pipes: [(bool, Option<Box<dyn Read + Send>>); 2] = [
        (true, child.stdout.take().map(|p| Box::new(p) as _)),
        (false, child.stderr.take().map(|p| Box::new(p) as _)),
    ];
    for (is_stdout, pipe) in pipes {
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name("rsb-child-pipe".into())
            .spawn(move || {
                let mut buf = Vec::new();
                if let Some(pipe) = pipe {
                    let _ = pipe.take(max_output).read_to_end(&mut buf);
                }
                let _ = tx.send((is_stdout, buf));
            });
        if let Err(e) = spawned {
            kill_and_reap(&mut child, KILL_VERIFY);
            return Err(RunError::Wait(e));
        }
    }
    drop(tx);

    let status = match wait_deadline(&mut child, deadline) {
        Ok(Some(status)) => status,
        Ok(None) => {
            kill_and_reap(&mut child, KILL_VERIFY);
            return Err(RunError::TimedOut);
        }
        Err(e) => {
            kill_and_reap(&mut child, KILL_VERIFY);
            return Err(RunError::Wait(e));
        }
    };
    let (mut stdout, mut stderr) = (None, None);
    for _ in 0..2 {
        // A little grace past the deadline: the child has exited, its pipes close right away.
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(PIPE_GRACE);
        match rx.recv_timeout(wait) {
            Ok((true, buf)) => stdout = Some(buf),
            Ok((false, buf)) => stderr = Some(buf),
            Err(_) => break,
        }
    }
    match (stdout, stderr) {
        (Some(stdout), Some(stderr)) => Ok(std::process::Output {
            status,
            stdout,
            stderr,
        }),
        _ => {
            // A member of the child's group still holds a pipe, so the group id cannot have
            // been reused, and killing the group frees the reader threads.
            if let Some(group) = Group::new(child.id()) {
                group.signal(Signal::KILL);
            }
            Err(RunError::OutputHeld(status))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Process groups

/// What process control reads and signals: the system ([`Os`]), or in tests a scripted table
/// that behaves as macOS's does. What belongs to a run, what is still alive and when SIGKILL
/// is due are decided on top of it ([`Tracked`]), once for every system, so the Mac's
/// decisions run in Linux's tests.
pub trait Source {
    /// Every process the table lists, with its stat (zombies included), or `None` where no
    /// table can be read.
    fn table(&self) -> Option<Vec<(u32, Stat)>>;
    /// Send `sig` to every member of process group `pgid`; `None` only asks whether it has one
    /// (signal 0). `SRCH` when it has none.
    fn signal_group(&self, pgid: Pid, sig: Option<Signal>) -> rustix::io::Result<()>;
    /// Send `sig` to one process.
    fn signal_process(&self, pid: Pid, sig: Signal) -> rustix::io::Result<()>;
}

/// The system's process table (/proc on Linux, libproc on macOS) and `kill(2)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Os;

impl Source for Os {
    fn table(&self) -> Option<Vec<(u32, Stat)>> {
        let pids = if macos_source() {
            darwin::all_pids()?
        } else if proc_available() {
            linux_pids()?
        } else {
            return None;
        };
        Some(
            pids.into_iter()
                .filter_map(|pid| Some((pid, Stat::read(pid)?)))
                .collect(),
        )
    }

    fn signal_group(&self, pgid: Pid, sig: Option<Signal>) -> rustix::io::Result<()> {
        match sig {
            Some(sig) => kill_process_group(pgid, sig),
            None => test_kill_process_group(pgid),
        }
    }

    fn signal_process(&self, pid: Pid, sig: Signal) -> rustix::io::Result<()> {
        rustix::process::kill_process(pid, sig)
    }
}

/// Every pid /proc lists (none under `RSB_TEST_NO_PROCFS=1`, as on a Mac).
fn linux_pids() -> Option<Vec<u32>> {
    if procfs_disabled() {
        return None;
    }
    read_pids()
}

fn read_pids() -> Option<Vec<u32>> {
    let dir = std::fs::read_dir("/proc").ok()?;
    Some(
        dir.flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect(),
    )
}

impl<S: Source + ?Sized> Source for &S {
    fn table(&self) -> Option<Vec<(u32, Stat)>> {
        (**self).table()
    }

    fn signal_group(&self, pgid: Pid, sig: Option<Signal>) -> rustix::io::Result<()> {
        (**self).signal_group(pgid, sig)
    }

    fn signal_process(&self, pid: Pid, sig: Signal) -> rustix::io::Result<()> {
        (**self).signal_process(pid, sig)
    }
}

/// The live members of run `id` in `table`: its process group, the session it leads, every
/// live process of `known` that still has the start time it was seen with (a member whose
/// parent died was handed to init, out of the tree), and every descendant of these. What left
/// the session (`setsid`, a double fork) is a descendant: [`new_session`] made the leader a
/// subreaper, so while it lives nothing it started can leave its tree.
fn run_members(id: i32, table: &[(u32, Stat)], known: &BTreeMap<u32, Stat>) -> BTreeMap<u32, Stat> {
    let mut found: BTreeMap<u32, Stat> = table
        .iter()
        .filter(|(pid, s)| {
            !s.is_dead()
                && (s.pgrp == id
                    || s.session == id
                    || known
                        .get(pid)
                        .is_some_and(|k| k.start_ticks == s.start_ticks))
        })
        .map(|&(pid, s)| (pid, s))
        .collect();
    // One pass per generation (a child's pid is usually above its parent's, so most trees
    // take one); bounded by the table's size.
    for _ in 0..table.len() {
        let before = found.len();
        for &(pid, s) in table {
            if !s.is_dead() && !found.contains_key(&pid) && found.contains_key(&s.ppid) {
                found.insert(pid, s);
            }
        }
        if found.len() == before {
            break;
        }
    }
    found
}

/// A process group, named by its leader's pid. Ids 0 and 1 are refused: signalling "group 0"
/// means the caller's own group, and group 1 is init's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group(Pid);

/// How [`Group::terminate_blocking`] or [`terminate`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// Everything was gone within the grace after SIGTERM.
    ByTerm,
    /// SIGKILL was needed, and afterwards everything was gone.
    ByKill,
    /// These pids were still alive when the time after SIGKILL ran out.
    Unconfirmed(Vec<u32>),
}

impl Group {
    pub fn new(pgid: u32) -> Option<Group> {
        (pgid > 1).then(|| pid_of(pgid)).flatten().map(Group)
    }

    pub fn id(self) -> u32 {
        self.0.as_raw_nonzero().get() as u32
    }

    /// Follow this group's run (see [`Tracked`]) from now on.
    pub fn track(self) -> Tracked {
        self.track_in(Os)
    }

    /// [`Group::track`] through another [`Source`] than the system (tests).
    pub fn track_in<S: Source>(self, src: S) -> Tracked<S> {
        Tracked {
            group: self,
            known: BTreeMap::new(),
            readable: true,
            src,
        }
    }

    /// Signal every member as it is now (see [`Tracked::signal`]).
    pub fn signal(self, sig: Signal) {
        self.track().signal(sig);
    }

    /// True while any member still runs (see [`Tracked::is_alive`]).
    pub fn is_alive(self) -> bool {
        self.track().is_alive()
    }

    /// The pids of the members that still run, for an error that names them.
    pub fn survivors(self) -> Vec<u32> {
        let mut t = self.track();
        t.is_alive();
        t.survivors()
    }

    /// SIGTERM the group (with SIGCONT, so a stopped member can act on it), wait up to `grace`
    /// for it to go, SIGKILL what is left, and wait up to `verify` to see it gone. `settled` is
    /// the caller's own part of "gone" (jobs wait for the wrapper to record the end); it is
    /// polled together with the group. For a group whose leader is not our child: a child of
    /// ours must be reaped meanwhile, which is what [`terminate`] does.
    pub fn terminate_blocking(
        self,
        grace: Duration,
        verify: Duration,
        settled: impl FnMut() -> bool,
    ) -> Stopped {
        self.track().stop(grace, verify, settled)
    }
}

/// A group's run followed through a stop: its process group, the session its leader started
/// (exec commands and jobs are session leaders) whatever groups its members moved to (GNU
/// `timeout`, `setpgid`, job control), and every descendant of theirs, including those that
/// left the session with `setsid` or a double fork (see [`run_members`]). Each member is
/// remembered by pid and start time, so one cut from the tree by its parent's death (when the
/// leader itself was killed first) is still followed, and a reused pid is never taken for it.
///
/// What a member asks another process to start (a tmux server, `systemd-run`, `at`) is that
/// process's descendant, not the run's, and is not followed.
#[derive(Debug)]
pub struct Tracked<S: Source = Os> {
    group: Group,
    known: BTreeMap<u32, Stat>,
    /// False where no process table can be read: the group alone is then signalled, and the
    /// kernel's "no such group" decides whether it is gone.
    readable: bool,
    src: S,
}

impl<S: Source> Tracked<S> {
    fn id(&self) -> i32 {
        self.group.0.as_raw_nonzero().get()
    }

    /// Read the process table and update the members. False when it cannot be read.
    fn refresh(&mut self) -> bool {
        let table = self.src.table();
        self.look(table)
    }

    /// Update the members from one reading of the process table (`None`: unreadable). The
    /// decision is the same for /proc (Linux) and libproc (macOS) readings, so tests feed it
    /// tables of either shape.
    fn look(&mut self, table: Option<Vec<(u32, Stat)>>) -> bool {
        let Some(table) = table else {
            self.readable = false;
            return false;
        };
        self.known = run_members(self.id(), &table, &self.known);
        true
    }

    /// Signal every member: the process group at once, then each member outside it by pid.
    /// A member of the group is not signalled twice (a second SIGINT can mean "quit now" to
    /// it). A group that is already gone is not an error: there is nothing left to signal,
    /// which is what the caller wanted.
    pub fn signal(&mut self, sig: Signal) {
        // The table is read first: a leader killed by this signal hands what it started to
        // init at once, out of the tree.
        let readable = self.refresh();
        let _ = self.src.signal_group(self.group.0, Some(sig));
        if !readable {
            return;
        }
        let id = self.id();
        for (&pid, st) in &self.known {
            if st.pgrp != id
                && let Some(p) = pid_of(pid)
            {
                let _ = self.src.signal_process(p, sig);
            }
        }
    }

    /// True while any member still runs. Zombies do not count (see [`Stat::is_dead`]). Where no
    /// process table can be read, the kernel's answer for the group decides.
    pub fn is_alive(&mut self) -> bool {
        if self.refresh() {
            return !self.known.is_empty();
        }
        !matches!(
            self.src.signal_group(self.group.0, None),
            Err(rustix::io::Errno::SRCH)
        )
    }

    /// The members that ran at the last look, sorted; empty where no table can be read.
    pub fn survivors(&self) -> Vec<u32> {
        if !self.readable {
            return Vec::new();
        }
        self.known.keys().copied().collect()
    }

    /// Polls until no member runs and `settled()` holds, or `deadline` passes.
    fn wait_gone(&mut self, deadline: Instant, settled: &mut dyn FnMut() -> bool) -> bool {
        loop {
            if !self.is_alive() && settled() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep(POLL.min(deadline - now));
        }
    }

    /// SIGTERM the run (with SIGCONT, so a stopped member can act on it), wait up to `grace`
    /// for it to go, SIGKILL what is left, and wait up to `verify` to see it gone (see
    /// [`Group::terminate_blocking`]).
    pub fn stop(
        &mut self,
        grace: Duration,
        verify: Duration,
        mut settled: impl FnMut() -> bool,
    ) -> Stopped {
        self.signal(Signal::TERM);
        self.signal(Signal::CONT);
        if self.wait_gone(Instant::now() + grace, &mut settled) {
            return Stopped::ByTerm;
        }
        self.signal(Signal::KILL);
        if self.wait_gone(Instant::now() + verify, &mut settled) {
            Stopped::ByKill
        } else {
            Stopped::Unconfirmed(self.survivors())
        }
    }
}

/// "pids 12, 13" for an error about what outlived SIGKILL.
pub fn pid_list(pids: &[u32]) -> String {
    pids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// [`Tracked::is_alive`] off the runtime's threads (it reads the whole process table).
async fn run_alive(run: &mut Tracked) -> bool {
    let mut moved = std::mem::replace(run, run.group.track());
    match tokio::task::spawn_blocking(move || {
        let alive = moved.is_alive();
        (moved, alive)
    })
    .await
    {
        Ok((back, alive)) => {
            *run = back;
            alive
        }
        Err(_) => true,
    }
}

/// Reaps the leader (a tokio child) and waits for the whole run to go, up to `deadline`.
/// `status` keeps the leader's exit once it has been collected.
async fn wait_run_gone(
    leader: &mut tokio::process::Child,
    run: &mut Tracked,
    status: &mut Option<Option<ExitStatus>>,
    deadline: tokio::time::Instant,
) -> bool {
    loop {
        let tick = (tokio::time::Instant::now() + POLL).min(deadline);
        if status.is_some() {
            if !run_alive(run).await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep_until(tick).await;
        } else {
            tokio::select! {
                s = leader.wait() => *status = Some(s.ok()),
                _ = tokio::time::sleep_until(tick) => {
                    if tokio::time::Instant::now() >= deadline {
                        return false;
                    }
                }
            }
        }
    }
}

/// [`Group::terminate_blocking`] for a group led by a tokio child of this process, which is
/// reaped while waiting (an unreaped leader would be a zombie, and its exit status is wanted).
/// Returns the leader's exit status when it was collected in time, and how the run ended.
pub async fn terminate(
    leader: &mut tokio::process::Child,
    group: Group,
    grace: Duration,
    verify: Duration,
) -> (Option<ExitStatus>, Stopped) {
    let mut status = None;
    let mut run = group.track();
    run.signal(Signal::TERM);
    run.signal(Signal::CONT);
    let now = tokio::time::Instant::now;
    let stopped = if wait_run_gone(leader, &mut run, &mut status, now() + grace).await {
        Stopped::ByTerm
    } else {
        run.signal(Signal::KILL);
        if wait_run_gone(leader, &mut run, &mut status, now() + verify).await {
            Stopped::ByKill
        } else {
            Stopped::Unconfirmed(run.survivors())
        }
    };
    (status.flatten(), stopped)
}

/// SIGKILLs a group when dropped while armed: a future dropped mid-flight (the agent shutting
/// down with a request running) must not leave the group behind, and `kill_on_drop` alone
/// reaches only the leader.
pub struct KillOnDrop {
    group: Group,
    armed: bool,
}

impl KillOnDrop {
    pub fn new(group: Group) -> Self {
        KillOnDrop { group, armed: true }
    }

    /// The group finished on its own terms: leave whatever it still runs alone.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.group.signal(Signal::KILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;

    const PATIENCE: Duration = Duration::from_secs(10);

    fn bsd(status: u32, sec: u64, usec: u64) -> darwin::BsdInfo {
        darwin::BsdInfo {
            status,
            ppid: 1,
            pgid: 4242,
            sid: 4200,
            start_tvsec: sec,
            start_tvusec: usec,
        }
    }

    #[test]
    fn macos_bsdinfo_maps_to_the_stat_linux_reads_from_proc() {
        let s = bsd(darwin::SSLEEP, 1_764_750_000, 123_456).stat();
        assert_eq!(
            s,
            Stat {
                state: b'S',
                ppid: 1,
                pgrp: 4242,
                session: 4200,
                start_ticks: 1_764_750_000_123_456,
            }
        );
        assert!(!s.is_dead());
        for (status, state, dead) in [
            (darwin::SIDL, b'R', false),
            (darwin::SRUN, b'R', false),
            (darwin::SSTOP, b'T', false),
            (darwin::SZOMB, b'Z', true),
        ] {
            let s = bsd(status, 1, 0).stat();
            assert_eq!((s.state, s.is_dead()), (state, dead), "p_stat {status}");
        }
    }

    #[test]
    fn macos_start_time_tells_a_reused_pid_apart_within_one_second() {
        // Same pid, same second, another process: the microseconds differ.
        let first = bsd(darwin::SRUN, 1_764_750_000, 10).stat().start_ticks;
        let reused = bsd(darwin::SRUN, 1_764_750_000, 11).stat().start_ticks;
        assert_ne!(first, reused);
        assert!(reused > first);
    }

    fn procargs2(argc: i32, path: &[u8], pad: usize, args: &[&[u8]], env: &[&[u8]]) -> Vec<u8> {
        let mut b = argc.to_ne_bytes().to_vec();
        b.extend_from_slice(path);
        b.extend(std::iter::repeat_n(0u8, 1 + pad));
        for a in args.iter().chain(env) {
            b.extend_from_slice(a);
            b.push(0);
        }
        b
    }

    #[test]
    fn macos_procargs2_yields_the_argument_vector_without_path_or_environment() {
        let buf = procargs2(
            3,
            b"/Users/me/.rsb/agent/rsb-agent",
            5,
            &[b"rsb-agent", b"serve", b"with space"],
            &[b"PATH=/usr/bin", b"HOME=/Users/me"],
        );
        assert_eq!(
            darwin::parse_procargs2(&buf).unwrap(),
            vec![
                b"rsb-agent".to_vec(),
                b"serve".to_vec(),
                b"with space".to_vec()
            ]
        );
        // An empty argument is kept, as /proc/<pid>/cmdline keeps it.
        let buf = procargs2(2, b"/bin/x", 0, &[b"x", b""], &[]);
        assert_eq!(
            darwin::parse_procargs2(&buf).unwrap(),
            vec![b"x".to_vec(), Vec::new()]
        );
    }

    #[test]
    fn macos_procargs2_shorter_than_it_claims_is_refused() {
        let mut buf = procargs2(2, b"/bin/x", 3, &[b"x", b"job-run"], &[]);
        buf.pop(); // the last argument loses its terminator
        assert_eq!(darwin::parse_procargs2(&buf), None);
        assert_eq!(
            darwin::parse_procargs2(&procargs2(-1, b"/x", 0, &[], &[])),
            None
        );
        assert_eq!(darwin::parse_procargs2(&[1, 0]), None);
    }

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + PATIENCE;
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(POLL);
        }
    }

    fn read_pid(path: &Path) -> u32 {
        let mut pid = None;
        wait_for("the pid file", || {
            pid = std::fs::read_to_string(path)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            pid.is_some()
        });
        pid.unwrap()
    }

    #[test]
    fn a_group_ignoring_sigterm_is_killed_after_the_grace_and_seen_gone() {
        let dir = tempfile::tempdir().unwrap();
        let bg = dir.path().join("bg.pid");
        // The ignored TERM is inherited by both sleeps; the background one also outlives the
        // leader's view, so only a group-wide SIGKILL ends it.
        let script = format!(
            "trap '' TERM; sleep 30 & echo $! > '{}'; sleep 30",
            bg.display()
        );
        let mut child = spawn(new_group(&mut sh(&script))).unwrap();
        let group = Group::new(child.id()).unwrap();
        let bg_pid = read_pid(&bg);
        assert!(group.is_alive());
        let grace = Duration::from_millis(300);
        let t = Instant::now();
        let stopped = group.terminate_blocking(grace, Duration::from_secs(5), || true);
        assert_eq!(stopped, Stopped::ByKill);
        assert!(
            t.elapsed() >= grace,
            "SIGKILL before the grace: {:?}",
            t.elapsed()
        );
        // Verified gone although the leader is still an unreaped zombie of ours.
        assert!(!group.is_alive());
        assert!(!is_alive(bg_pid, None), "the background member survived");
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(Signal::KILL.as_raw()));
    }

    /// A process table row: pid, state, ppid, group, session, start.
    fn row(pid: u32, state: u8, ppid: u32, pgrp: i32, session: i32, start: u64) -> (u32, Stat) {
        (
            pid,
            Stat {
                state,
                ppid,
                pgrp,
                session,
                start_ticks: start,
            },
        )
    }

    /// The decision of what belongs to a run, on tables as a stop sees them one after another
    /// (no process is started or signalled: the same logic runs for Linux's /proc and macOS's
    /// libproc readings).
    #[test]
    fn a_run_s_members_are_decided_from_the_table_alone() {
        let group = Group::new(100).unwrap();
        let mut run = group.track();
        // 100 leads; 101 is in its group; 102 left by setsid and started 103; 104 is a zombie
        // child; 105 moved to a group of its own inside the session; 200 is a stranger.
        let first = vec![
            row(100, b'S', 50, 100, 100, 1000),
            row(101, b'R', 100, 100, 100, 1001),
            row(102, b'S', 100, 102, 102, 1002),
            row(103, b'S', 102, 102, 102, 1003),
            row(104, b'Z', 100, 100, 100, 1004),
            row(105, b'S', 100, 105, 100, 1005),
            row(200, b'S', 1, 200, 200, 900),
        ];
        assert!(run.look(Some(first)));
        assert_eq!(run.survivors(), vec![100, 101, 102, 103, 105]);
        // The leader died: 102 went to init, out of the tree and the session, and started
        // 106; 103 was given pid-reuse's worst case: a stranger now has its pid.
        let second = vec![
            row(101, b'S', 1, 100, 100, 1001),
            row(102, b'S', 1, 102, 102, 1002),
            row(103, b'S', 1, 300, 300, 5000),
            row(106, b'S', 102, 102, 102, 1006),
            row(105, b'S', 1, 105, 100, 1005),
            row(200, b'S', 1, 200, 200, 900),
        ];
        assert!(run.look(Some(second)));
        assert_eq!(run.survivors(), vec![101, 102, 105, 106]);
        // A fresh look at the same table no longer finds 102 and 106.
        let mut fresh = group.track();
        assert!(fresh.look(Some(vec![
            row(101, b'S', 1, 100, 100, 1001),
            row(102, b'S', 1, 102, 102, 1002),
            row(106, b'S', 102, 102, 102, 1006),
        ])));
        assert_eq!(fresh.survivors(), vec![101]);
        // Everything exited or is a zombie: gone.
        assert!(run.look(Some(vec![
            row(102, b'Z', 1, 102, 102, 1002),
            row(200, b'S', 1, 200, 200, 900),
        ])));
        assert_eq!(run.survivors(), Vec::<u32>::new());
        // An unreadable table: nothing is claimed.
        assert!(!run.look(None));
        assert_eq!(run.survivors(), Vec::<u32>::new());
    }

    /// The same decision on rows as macOS's libproc gives them (`proc_bsdinfo` mapped by
    /// `BsdInfo::stat`): a zombie by `SZOMB`, start times in microseconds.
    #[test]
    fn a_run_s_members_from_a_macos_shaped_table() {
        let bsd_row = |pid: u32, status: u32, ppid: u32, pgid: u32, sid: i32, usec: u64| {
            let info = darwin::BsdInfo {
                status,
                ppid,
                pgid,
                sid,
                start_tvsec: 1_764_750_000,
                start_tvusec: usec,
            };
            (pid, info.stat())
        };
        let mut run = Group::new(700).unwrap().track();
        let table = vec![
            bsd_row(700, darwin::SSLEEP, 1, 700, 700, 1),
            bsd_row(701, darwin::SRUN, 700, 700, 700, 2),
            bsd_row(702, darwin::SSLEEP, 700, 702, 702, 3),
            bsd_row(703, darwin::SZOMB, 700, 700, 700, 4),
            bsd_row(704, darwin::SIDL, 702, 702, 702, 5),
            bsd_row(800, darwin::SSLEEP, 1, 800, 800, 6),
        ];
        assert!(run.look(Some(table)));
        assert_eq!(run.survivors(), vec![700, 701, 702, 704]);
    }

    /// One process of [`FakeMac`]: its `proc_bsdinfo`, whether it ignores SIGTERM, and the
    /// stranger that is given its pid the moment it exits (pid reuse at its worst).
    #[derive(Debug, Clone)]
    struct FakeProc {
        pid: u32,
        info: darwin::BsdInfo,
        ignores_term: bool,
        reused_by: Option<darwin::BsdInfo>,
    }

    /// A process table that behaves as macOS's: rows come from `proc_bsdinfo` through
    /// [`darwin::BsdInfo::stat`] (no /proc), an exited process is a zombie (`SZOMB`) until its
    /// parent reaps it, and what it leaves behind is handed to launchd (pid 1): macOS has no
    /// subreaper. Every signal is logged with when it was sent.
    #[derive(Debug, Default)]
    struct FakeMac {
        procs: std::sync::Mutex<Vec<FakeProc>>,
        log: std::sync::Mutex<Vec<(String, Signal, Instant)>>,
    }

    impl FakeMac {
        /// A process: pid, parent, group, session, start (µs past a fixed second), ignores TERM.
        fn with(self, pid: u32, ppid: u32, pgid: u32, sid: i32, usec: u64, ignores: bool) -> Self {
            self.procs.lock().unwrap().push(FakeProc {
                pid,
                info: darwin::BsdInfo {
                    status: darwin::SSLEEP,
                    ppid,
                    pgid,
                    sid,
                    start_tvsec: 1_764_750_000,
                    start_tvusec: usec,
                },
                ignores_term: ignores,
                reused_by: None,
            });
            self
        }

        /// When `pid` exits, a stranger that started `usec` later takes its pid at once.
        fn reused(self, pid: u32, usec: u64) -> Self {
            for p in self
                .procs
                .lock()
                .unwrap()
                .iter_mut()
                .filter(|p| p.pid == pid)
            {
                p.reused_by = Some(darwin::BsdInfo {
                    status: darwin::SRUN,
                    ppid: 1,
                    pgid: pid,
                    sid: pid as i32,
                    start_tvusec: p.info.start_tvusec + usec,
                    ..p.info
                });
            }
            self
        }

        fn deliver(&self, procs: &mut [FakeProc], i: usize, sig: Signal) {
            let p = &mut procs[i];
            let exits = sig == Signal::KILL || (sig == Signal::TERM && !p.ignores_term);
            if !exits || p.info.status == darwin::SZOMB {
                return;
            }
            let pid = p.pid;
            match p.reused_by.take() {
                Some(stranger) => {
                    p.info = stranger;
                    p.ignores_term = true;
                }
                None => p.info.status = darwin::SZOMB,
            }
            for c in procs.iter_mut().filter(|c| c.info.ppid == pid) {
                c.info.ppid = 1;
            }
        }

        /// The signals sent, as `group 700` / `pid 702` and the signal.
        fn sent(&self) -> Vec<(String, Signal)> {
            let log = self.log.lock().unwrap();
            log.iter().map(|(to, sig, _)| (to.clone(), *sig)).collect()
        }

        /// Whether `pid` is listed and not a zombie.
        fn runs(&self, pid: u32) -> bool {
            let procs = self.procs.lock().unwrap();
            procs
                .iter()
                .any(|p| p.pid == pid && p.info.status != darwin::SZOMB)
        }
    }

    impl Source for FakeMac {
        fn table(&self) -> Option<Vec<(u32, Stat)>> {
            let procs = self.procs.lock().unwrap();
            Some(procs.iter().map(|p| (p.pid, p.info.stat())).collect())
        }

        fn signal_group(&self, pgid: Pid, sig: Option<Signal>) -> rustix::io::Result<()> {
            let pgid = pgid.as_raw_nonzero().get() as u32;
            let mut procs = self.procs.lock().unwrap();
            let members: Vec<usize> = (0..procs.len())
                .filter(|&i| procs[i].info.pgid == pgid)
                .collect();
            if members.is_empty() {
                return Err(rustix::io::Errno::SRCH);
            }
            if let Some(sig) = sig {
                let mut log = self.log.lock().unwrap();
                log.push((format!("group {pgid}"), sig, Instant::now()));
                for i in members {
                    self.deliver(&mut procs, i, sig);
                }
            }
            Ok(())
        }

        fn signal_process(&self, pid: Pid, sig: Signal) -> rustix::io::Result<()> {
            let pid = pid.as_raw_nonzero().get() as u32;
            let mut procs = self.procs.lock().unwrap();
            let i = procs
                .iter()
                .position(|p| p.pid == pid)
                .ok_or(rustix::io::Errno::SRCH)?;
            let mut log = self.log.lock().unwrap();
            log.push((format!("pid {pid}"), sig, Instant::now()));
            self.deliver(&mut procs, i, sig);
            Ok(())
        }
    }

    /// `RSB_TEST_NO_PROCFS=1` takes the Mac's path (libproc's shapes, /proc unread by the
    /// Linux readers); without it Linux's /proc is read. A run under the variable where the
    /// build ignores it (a release build) fails here rather than passing as a Linux run.
    #[test]
    fn the_process_table_comes_from_the_source_the_mode_says() {
        let me = std::process::id();
        let stat = Stat::read(me).unwrap();
        if cfg!(target_vendor = "apple") {
            assert!(macos_source());
            assert_eq!(Some(stat), darwin::bsdinfo(me).map(|b| b.stat()));
        } else {
            let from_proc = Stat::parse(&std::fs::read("/proc/self/stat").unwrap()).unwrap();
            linux_mode(stat, from_proc);
        }
        // libc, not rustix: a process whose session leader lives outside its pid namespace (a
        // container's, as in CI) is in session 0, which rustix's getsid cannot return.
        // SAFETY: getsid(0) asks about the calling process and has no other effect.
        assert_eq!(stat.session, unsafe { libc::getsid(0) });
        let argv: Vec<Vec<u8>> = std::env::args_os()
            .map(std::os::unix::ffi::OsStringExt::into_vec)
            .collect();
        assert_eq!(args(me), Some(argv));
    }

    fn linux_mode(stat: Stat, from_proc: Stat) {
        let me = std::process::id();
        if std::env::var_os("RSB_TEST_NO_PROCFS").is_some_and(|v| v == "1") {
            assert!(procfs_disabled() && macos_source());
            assert_eq!(procfs("/proc/self/stat"), None);
            assert_eq!(Some(stat), darwin::bsdinfo(me).map(|b| b.stat()));
            assert_eq!(
                stat.start_ticks,
                from_proc.start_ticks * 10_000,
                "µs, not ticks"
            );
        } else {
            assert!(!macos_source());
            assert_eq!(stat, from_proc);
        }
    }

    const FAKE_GRACE: Duration = Duration::from_millis(150);

    /// Issue 44: on macOS every group read as dead right after SIGTERM, so a member ignoring it
    /// was never SIGKILLed. Through a macOS-shaped source: the leader obeys, a group member
    /// and a child that left the session (`setsid`) ignore TERM; both are SIGKILLed after the
    /// grace, not before, and then seen gone.
    #[test]
    fn macos_a_member_ignoring_term_is_killed_after_the_grace() {
        let mac = FakeMac::default()
            .with(700, 50, 700, 700, 1, false)
            .with(701, 700, 700, 700, 2, true)
            .with(702, 701, 702, 702, 3, true)
            .with(800, 1, 800, 800, 4, true);
        let mut run = Group::new(700).unwrap().track_in(&mac);
        assert!(run.is_alive());
        let start = Instant::now();
        assert_eq!(run.stop(FAKE_GRACE, FAKE_GRACE, || true), Stopped::ByKill);
        let sent = mac.sent();
        let kills: Vec<_> = sent.iter().filter(|(_, s)| *s == Signal::KILL).collect();
        assert_eq!(
            kills,
            [
                &("group 700".to_string(), Signal::KILL),
                &("pid 702".to_string(), Signal::KILL)
            ],
            "{sent:?}"
        );
        let log = mac.log.lock().unwrap();
        let first_kill = log.iter().find(|(_, s, _)| *s == Signal::KILL).unwrap().2;
        assert!(first_kill - start >= FAKE_GRACE, "SIGKILL before the grace");
        drop(log);
        assert!(
            sent.contains(&("pid 702".to_string(), Signal::TERM)),
            "{sent:?}"
        );
        assert!(!mac.runs(700) && !mac.runs(701) && !mac.runs(702));
        assert!(mac.runs(800), "a stranger was signalled");
        assert!(!run.is_alive());
        assert!(run.survivors().is_empty());
    }

    /// A member that exits on SIGTERM and whose pid a stranger takes within the same second
    /// (the start time differs by microseconds): the stranger is not a member, is never
    /// signalled, and is not named among the survivors.
    #[test]
    fn macos_a_reused_pid_is_never_taken_for_the_member() {
        let mac = FakeMac::default()
            .with(700, 50, 700, 700, 10, true)
            .with(702, 700, 702, 702, 20, false)
            .reused(702, 5);
        let mut run = Group::new(700).unwrap().track_in(&mac);
        assert!(run.is_alive());
        assert_eq!(run.survivors(), vec![700, 702]);
        assert_eq!(run.stop(FAKE_GRACE, FAKE_GRACE, || true), Stopped::ByKill);
        let to_702: Vec<_> = mac
            .sent()
            .into_iter()
            .filter(|(to, _)| to == "pid 702")
            .collect();
        assert_eq!(to_702, [("pid 702".to_string(), Signal::TERM)]);
        assert!(mac.runs(702), "the stranger with the reused pid was killed");
        assert!(!mac.runs(700));
        assert!(!run.is_alive(), "the stranger kept the run alive");
    }

    /// The leader exited and was reaped (it is not in the table at all) while a member of its
    /// group and a child that left the session still run, handed to launchd: the run is
    /// alive, both are named, and both are stopped.
    #[test]
    fn macos_a_group_whose_leader_exited_is_alive_while_members_run() {
        let mac = FakeMac::default()
            .with(701, 1, 700, 700, 2, true)
            .with(703, 701, 703, 703, 3, true);
        let mut run = Group::new(700).unwrap().track_in(&mac);
        assert!(run.is_alive(), "a group without its leader read as dead");
        assert_eq!(run.survivors(), vec![701, 703]);
        assert_eq!(run.stop(FAKE_GRACE, FAKE_GRACE, || true), Stopped::ByKill);
        assert!(!mac.runs(701) && !mac.runs(703));
        assert!(!run.is_alive());
        // Nothing left at all: the group is gone for the kernel too.
        let gone = FakeMac::default();
        let mut run = Group::new(700).unwrap().track_in(&gone);
        assert!(!run.is_alive());
        assert_eq!(run.stop(FAKE_GRACE, FAKE_GRACE, || true), Stopped::ByTerm);
        assert!(gone.sent().is_empty());
    }

    /// SIGKILLs the listed pids when dropped, so a failed test leaves nothing running.
    struct KillPids(Vec<u32>);

    impl Drop for KillPids {
        fn drop(&mut self) {
            for &pid in &self.0 {
                if let Some(p) = pid_of(pid) {
                    let _ = rustix::process::kill_process(p, Signal::KILL);
                }
            }
        }
    }

    /// Starts a session leader that starts two processes outside its session, both ignoring
    /// SIGTERM: one by `setsid`, one by `setsid` in a subshell that exits at once (a double
    /// fork, so its parent is gone). The leader ignores SIGTERM too when `leader_stays`.
    /// Returns the leader and both pids.
    fn leader_with_escapees(dir: &Path, leader_stays: bool) -> (Child, u32, u32) {
        let (a, b) = (dir.join("a.pid"), dir.join("b.pid"));
        let script = format!(
            "{}setsid sh -c 'trap \"\" TERM; echo $$ > \"$0\"; exec sleep 30' '{}' & \
             (setsid sh -c 'trap \"\" TERM; exec sleep 30' & echo $! > '{}'); sleep 30",
            if leader_stays { "trap '' TERM; " } else { "" },
            a.display(),
            b.display()
        );
        let child = spawn(new_session(&mut sh(&script), None)).unwrap();
        (child, read_pid(&a), read_pid(&b))
    }

    #[test]
    fn members_that_left_the_session_are_followed_and_killed() {
        for leader_stays in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let (mut child, a, b) = leader_with_escapees(dir.path(), leader_stays);
            let _cleanup = KillPids(vec![a, b, child.id()]);
            let leader = child.id();
            for pid in [a, b] {
                let st = Stat::read(pid).unwrap();
                assert_ne!(st.session, leader as i32, "{pid} left the session");
            }
            // The double-forked one was handed to the leader, not to init: the leader is a
            // subreaper, so it stays in the tree.
            wait_for("the orphan to be handed to the leader", || {
                Stat::read(b).is_some_and(|s| s.ppid == leader)
            });
            let group = Group::new(leader).unwrap();
            let found = group.survivors();
            assert!(
                found.contains(&a) && found.contains(&b) && found.contains(&leader),
                "{found:?}"
            );
            // When the leader obeys SIGTERM, it dies first and hands both to init: they are
            // still followed, since they were seen before the signal.
            let stopped = group.terminate_blocking(
                Duration::from_millis(300),
                Duration::from_secs(5),
                || true,
            );
            assert_eq!(stopped, Stopped::ByKill, "leader_stays {leader_stays}");
            assert!(!is_alive(a, None), "the setsid member survived");
            assert!(!is_alive(b, None), "the double-forked member survived");
            child.wait().unwrap();
        }
    }

    #[test]
    fn a_member_cut_from_the_tree_by_its_leader_s_death_is_still_followed() {
        let dir = tempfile::tempdir().unwrap();
        let (mut child, a, b) = leader_with_escapees(dir.path(), true);
        let _cleanup = KillPids(vec![a, b, child.id()]);
        let group = Group::new(child.id()).unwrap();
        let mut run = group.track();
        assert!(run.is_alive());
        // The leader dies alone: its members go to init (or the test's own subreaper), out
        // of the tree and out of the session, where a fresh look no longer finds them.
        child.kill().unwrap();
        child.wait().unwrap();
        wait_for("the members to be handed on", || {
            [a, b]
                .iter()
                .all(|&p| Stat::read(p).is_some_and(|s| s.ppid != group.id()))
        });
        // (The leader's own `sleep` is still in its session, so a fresh look finds that.)
        let fresh = group.survivors();
        assert!(!fresh.contains(&a) && !fresh.contains(&b), "{fresh:?}");
        assert!(run.is_alive());
        let followed = run.survivors();
        assert!(
            followed.contains(&a) && followed.contains(&b),
            "the run that saw them lost them: {followed:?}"
        );
        run.signal(Signal::KILL);
        wait_for("both to be killed", || {
            !is_alive(a, None) && !is_alive(b, None)
        });
        wait_for("the run to be gone", || !run.is_alive());
    }

    #[test]
    fn a_group_that_obeys_sigterm_stops_within_the_grace() {
        let mut child = spawn(new_group(&mut sh("sleep 30"))).unwrap();
        let group = Group::new(child.id()).unwrap();
        let stopped = group.terminate_blocking(PATIENCE, Duration::from_secs(1), || true);
        assert_eq!(stopped, Stopped::ByTerm);
        assert_eq!(child.wait().unwrap().signal(), Some(Signal::TERM.as_raw()));
    }

    #[test]
    fn terminate_reaps_a_tokio_leader_and_reports_its_status() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        rt.block_on(async {
            let mut cmd = tokio::process::Command::new("/bin/sh");
            // The marker is written after the trap, so SIGTERM cannot arrive before it is set.
            let script = format!("trap '' TERM; echo $$ > '{}'; sleep 30", ready.display());
            cmd.args(["-c", &script])
                .stdin(Stdio::null())
                .kill_on_drop(true);
            new_group(cmd.as_std_mut());
            let mut child = cmd.spawn().unwrap();
            let group = Group::new(child.id().unwrap()).unwrap();
            read_pid(&ready);
            let mut guard = KillOnDrop::new(group);
            let (status, stopped) = terminate(
                &mut child,
                group,
                Duration::from_millis(200),
                Duration::from_secs(5),
            )
            .await;
            guard.disarm();
            assert_eq!(stopped, Stopped::ByKill);
            assert_eq!(status.and_then(|s| s.signal()), Some(Signal::KILL.as_raw()));
            assert!(!group.is_alive());
        });
    }

    #[test]
    fn kill_on_drop_kills_the_group() {
        let mut child = spawn(new_group(&mut sh("sleep 30"))).unwrap();
        let group = Group::new(child.id()).unwrap();
        drop(KillOnDrop::new(group));
        assert_eq!(child.wait().unwrap().signal(), Some(Signal::KILL.as_raw()));
        let mut disarmed = KillOnDrop::new(group);
        disarmed.disarm();
    }

    #[test]
    fn groups_that_would_address_others_are_refused() {
        assert_eq!(Group::new(0), None);
        assert_eq!(Group::new(1), None);
        assert_eq!(Group::new(u32::MAX), None);
        assert_eq!(Group::new(4242).map(Group::id), Some(4242));
    }

    #[test]
    fn identity_rejects_a_reused_pid_and_a_zombie() {
        let me = std::process::id();
        let start = start_ticks(me).expect("/proc/self/stat is readable");
        assert!(is_alive(me, None));
        assert!(is_alive(me, Some(start)));
        // Same pid, another start time: the recorded process is gone and the pid reused.
        assert!(!is_alive(me, Some(start + 1)));
        assert!(!is_alive(0, None));
        assert!(!is_alive(u32::MAX, None));

        // A child that exited but is not reaped yet is a zombie: not alive, whatever its start.
        let mut child = spawn(&mut sh("exit 0")).unwrap();
        let pid = child.id();
        let recorded = Stat::read(pid).map(|s| s.start_ticks);
        wait_for("the child to become a zombie", || {
            Stat::read(pid).is_some_and(|s| s.is_dead())
        });
        assert!(!is_alive(pid, None));
        assert!(!is_alive(pid, recorded));
        assert_eq!(start_ticks(pid), None);
        child.wait().unwrap();
        assert!(!is_alive(pid, None), "reaped");
    }

    #[test]
    fn signal_exact_spares_a_process_that_is_not_the_recorded_one() {
        let mut child = spawn(&mut sh("sleep 30")).unwrap();
        let _cleanup = KillPids(vec![child.id()]);
        let pid = child.id();
        let start = start_ticks(pid).unwrap();
        // Another start time: the pid now names another process, which is left alone.
        assert!(!signal_exact(pid, Some(start + 1), Signal::KILL));
        assert!(is_alive(pid, Some(start)));
        assert!(signal_exact(pid, Some(start), Signal::KILL));
        assert_eq!(child.wait().unwrap().signal(), Some(Signal::KILL.as_raw()));
        assert!(!signal_exact(pid, Some(start), Signal::KILL), "reaped");
        assert!(!signal_exact(0, None, Signal::KILL));
    }

    #[test]
    fn stat_parsing_survives_awkward_command_names() {
        let line =
            b"4242 (a) b (c) d) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 0 0";
        assert_eq!(
            Stat::parse(line),
            Some(Stat {
                state: b'S',
                ppid: 1,
                pgrp: 4242,
                session: 4242,
                start_ticks: 987654,
            })
        );
        assert_eq!(Stat::parse(b"1 (x) Z 0 1 1"), None, "truncated");
        assert_eq!(Stat::parse(b"no parenthesis"), None);
        // spawn returns once the exec has begun, and a read in the middle of an exec sees an
        // empty command line (the new argument pages are not set up yet; `[[]]` from /proc,
        // `[]` from the Mac's KERN_PROCARGS2): wait for it.
        // (`; :` keeps sh from exec'ing sleep, which would change the command line again.)
        let mut child = spawn(Command::new("/bin/sh").args(["-c", "sleep 30; :", "a b"])).unwrap();
        let mut argv = Vec::new();
        wait_for("the command line", || {
            argv = args(child.id()).unwrap();
            argv.iter().any(|a| !a.is_empty())
        });
        assert_eq!(argv, [&b"/bin/sh"[..], b"-c", b"sleep 30; :", b"a b"]);
        child.kill().unwrap();
        child.wait().unwrap();
        let me = Stat::read(std::process::id()).unwrap();
        assert!(!me.is_dead());
        assert_eq!(Some(me.start_ticks), start_ticks(std::process::id()));
    }

    fn write_file(path: &Path, mode: u32) {
        std::fs::write(path, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn path_policy() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            tmp.path().join("a"),
            tmp.path().join("b"),
            tmp.path().join("c"),
        );
        for d in [&a, &b, &c] {
            std::fs::create_dir(d).unwrap();
        }
        write_file(&a.join("tool"), 0o644); // not executable
        std::fs::create_dir(b.join("tool")).unwrap(); // a directory, though it has x bits
        write_file(&c.join("tool"), 0o755);
        let path = std::env::join_paths([&a, &b, &c]).unwrap();
        assert_eq!(find_executable("tool", Some(&path)), Some(c.join("tool")));
        let only_bad = std::env::join_paths([&a, &b]).unwrap();
        assert_eq!(find_executable("tool", Some(&only_bad)), None);

        // Empty and relative entries are never searched (they would mean the cwd).
        let mut messy = b"::rel/dir:.:".to_vec();
        messy.extend_from_slice(c.as_os_str().as_bytes());
        messy.push(b':');
        let messy = OsStr::from_bytes(&messy);
        let dirs: Vec<PathBuf> = search_dirs(Some(messy)).collect();
        assert_eq!(dirs, vec![c.clone()]);
        assert_eq!(find_executable("tool", Some(messy)), Some(c.join("tool")));

        // A set PATH is authoritative, even when empty; an unset one means the default.
        assert_eq!(find_executable("sh", Some(OsStr::new(""))), None);
        let sh = find_executable("sh", None).expect("sh in the default PATH");
        assert!(sh.starts_with("/usr") || sh.starts_with("/bin"), "{sh:?}");
        let default: Vec<PathBuf> = search_dirs(None).collect();
        assert_eq!(
            default,
            ["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from)
        );

        // Only bare names: anything with a slash would be resolved against the cwd.
        for bad in ["", ".", "..", "c/tool", "/bin/sh"] {
            assert_eq!(find_executable(bad, Some(&path)), None, "{bad:?}");
        }
    }

    #[test]
    fn wait_deadline_returns_none_while_running_and_kill_and_reap_ends_it() {
        let mut child = spawn(new_group(&mut sh("sleep 30"))).unwrap();
        let t = Instant::now();
        let r = wait_deadline(&mut child, t + Duration::from_millis(100)).unwrap();
        assert!(r.is_none());
        assert!(t.elapsed() >= Duration::from_millis(100));
        let group = Group::new(child.id()).unwrap();
        assert!(kill_and_reap(&mut child, Duration::from_secs(5)));
        assert!(!group.is_alive());
        let mut quick = spawn(&mut sh("exit 3")).unwrap();
        let status = wait_deadline(&mut quick, Instant::now() + PATIENCE).unwrap();
        assert_eq!(status.and_then(|s| s.code()), Some(3));
    }

    #[test]
    fn output_with_deadline_captures_caps_and_kills_on_timeout() {
        let out = output_with_deadline(
            &mut sh_piped("printf out; printf err >&2; exit 2"),
            PATIENCE,
            1024,
        )
        .unwrap();
        assert_eq!(
            (out.stdout.as_slice(), out.stderr.as_slice()),
            (&b"out"[..], &b"err"[..])
        );
        assert_eq!(out.status.code(), Some(2));
        let out =
            output_with_deadline(&mut sh_piped("head -c 100000 /dev/zero"), PATIENCE, 10).unwrap();
        assert_eq!(out.stdout.len(), 10, "capped");

        let dir = tempfile::tempdir().unwrap();
        let bg = dir.path().join("bg.pid");
        let script = format!("sleep 30 & echo $! > '{}'; sleep 30", bg.display());
        let t = Instant::now();
        let r = output_with_deadline(&mut sh_piped(&script), Duration::from_millis(500), 1024);
        assert!(matches!(r, Err(RunError::TimedOut)), "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            !is_alive(read_pid(&bg), None),
            "the background sleep outlived the timeout"
        );

        // The shell exits at once, but its background child keeps stdout open.
        let script = format!("sleep 30 & echo $! > '{}'", bg.display());
        let r = output_with_deadline(&mut sh_piped(&script), Duration::from_millis(300), 1024);
        assert!(
            matches!(r, Err(RunError::OutputHeld(s)) if s.success()),
            "{r:?}"
        );
        let held = read_pid(&bg);
        wait_for("the pipe holder to be killed", || !is_alive(held, None));

        let r = output_with_deadline(&mut Command::new("/nonexistent/x"), PATIENCE, 1);
        assert!(matches!(r, Err(RunError::Spawn(_))), "{r:?}");
    }

    fn sh_piped(script: &str) -> Command {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(script);
        cmd
    }

    #[test]
    fn new_session_makes_a_session_leader() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("sid");
        let mut cmd = sh(&format!("sleep 30 & echo $! > '{}'; wait", out.display()));
        let mut child = spawn(new_session(&mut cmd, Some(Signal::TERM))).unwrap();
        let pid = child.id();
        let bg = read_pid(&out);
        let stat = Stat::read(pid).unwrap();
        assert_eq!((stat.session, stat.pgrp), (pid as i32, pid as i32));
        assert_eq!(Stat::read(bg).map(|s| s.session), Some(pid as i32));
        assert!(kill_and_reap(&mut child, Duration::from_secs(5)));
        assert!(!is_alive(bg, None));
    }
}
