//! No orphans when the agent dies outright: a small watcher process kills the process groups of
//! the agent's unfinished exec commands once the agent is gone.
//!
//! An agent that ends normally (channel EOF, SIGTERM, SIGHUP) stops its commands itself (see
//! `serve`). A SIGKILLed agent can do nothing, and `PR_SET_PDEATHSIG` reaches only the process
//! it is set on (bash), not the pipeline bash forks. So the first exec starts
//! `rsb-agent reaper`, the agent's own binary in a session of its own, whose stdin is a pipe
//! from the agent: the agent writes `+PGID START` when a command's group starts and `-PGID`
//! when it finished on its own terms (its background children are then left alone on purpose).
//! The pipe's write end is close-on-exec and held only by the agent, so EOF on it means the
//! agent is gone, however it died; the reaper then stops every group still registered
//! (SIGTERM, a grace, SIGKILL) and exits. An agent that exits normally deregisters everything
//! first, so its reaper finds nothing to do.
//!
//! Pid reuse: a group id stays reserved while any member lives, so a registered group that
//! still has members is ours. Only a group that emptied and whose id was handed to a new
//! leader could be a stranger; that new leader has another start time than the one recorded,
//! and such a group is left alone.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::proc::{self, Group, Signal, Stat, Tracked};

/// How long the groups get to act on SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(2);
/// How long to wait for the groups to vanish after SIGKILL.
const VERIFY: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(20);

struct Watcher {
    child: Child,
    stdin: ChildStdin,
}

/// `None` until the first registration, or for good when no watcher can be started (the agent
/// then works as before, with only its own shutdown to stop its commands).
static WATCHER: Mutex<Option<Watcher>> = Mutex::new(None);
/// Set by `rsb-agent serve` only: the library is also run in-process by tests, where
/// `/proc/self/exe` is the test binary, not an agent.
static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turn the watcher on for this process (the real agent binary).
pub fn enable() {
    ENABLED.store(true, std::sync::atomic::Ordering::SeqCst);
}

fn start() -> std::io::Result<Watcher> {
    let exe = crate::util::own_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("reaper")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Its own session: a hangup or a signal sent to the agent's process group or terminal
    // does not take the watcher along with the agent.
    proc::new_session(&mut cmd, None);
    let mut child = proc::spawn(&mut cmd)?;
    let stdin = child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("no stdin pipe"))?;
    Ok(Watcher { child, stdin })
}

/// Start the watcher now if it is not running, so that the [`register`] right after a spawn
/// is one pipe write: a watcher started by the registration itself (a fork and exec) left the
/// new command unregistered for that long, and an agent SIGKILLed then orphaned it.
pub fn ready() {
    if let Ok(mut w) = WATCHER.lock() {
        running(&mut w);
    }
}

/// The watcher, started (again, if it died) when needed; `None` when disabled or it cannot be.
fn running(w: &mut Option<Watcher>) -> Option<&mut Watcher> {
    if !ENABLED.load(std::sync::atomic::Ordering::SeqCst) {
        return None;
    }
    if w.as_mut()
        .is_some_and(|w| matches!(w.child.try_wait(), Ok(Some(_))))
    {
        // It died (killed by someone): start another for the groups registered from now on.
        *w = None;
    }
    if w.is_none() {
        match start() {
            Ok(s) => *w = Some(s),
            Err(e) => {
                eprintln!("rsb-agent: cannot start the orphan reaper: {e}");
                return None;
            }
        }
    }
    w.as_mut()
}

fn send(line: &str) {
    let Ok(mut w) = WATCHER.lock() else { return };
    // A line is far below PIPE_BUF and the reaper reads all the time, so this does not block
    // the runtime in practice.
    if let Some(watcher) = running(&mut w)
        && watcher.stdin.write_all(line.as_bytes()).is_err()
    {
        *w = None;
    }
}

/// A group registered with the watcher until [`Registration::release`] or drop.
pub struct Registration {
    group: Group,
}

/// Register a freshly started group whose leader is `group.id()`.
pub fn register(group: Group) -> Registration {
    send(&added(group));
    Registration { group }
}

impl Drop for Registration {
    fn drop(&mut self) {
        send(&removed(self.group.id()));
    }
}

/// The line that registers `group` with a reaper: `+PGID START`.
fn added(group: Group) -> String {
    let start = proc::start_ticks(group.id()).unwrap_or(0);
    format!("+{} {start}\n", group.id())
}

/// The line that deregisters group `id`: `-PGID`.
fn removed(id: u32) -> String {
    format!("-{id}\n")
}

/// A reaper of one group for a process that is not the agent: a job's wrapper on a system
/// without a parent-death signal (macOS; see [`proc::parent_death_signal`]). The wrapper
/// starts it before the job, registers the job's group once it runs, and releases it the
/// moment the job's leader exited. If the wrapper dies first, however it dies, the pipe reads
/// EOF with the group registered and the reaper stops it (SIGTERM, a grace, SIGKILL), so the
/// job never runs on without its supervisor.
pub struct Guard {
    child: Child,
    /// The pipe's write end: only this process holds it (close-on-exec).
    stdin: Option<ChildStdin>,
    registered: Option<u32>,
}

impl Guard {
    /// Start the reaper (this process's own binary, `rsb-agent`).
    pub fn start() -> std::io::Result<Guard> {
        let Watcher { child, stdin } = start()?;
        Ok(Guard {
            child,
            stdin: Some(stdin),
            registered: None,
        })
    }

    /// The reaper's pid, for the job's record.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn send(&mut self, line: &str) -> std::io::Result<()> {
        match &mut self.stdin {
            Some(w) => w.write_all(line.as_bytes()),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        }
    }

    /// Guard `group` from now on.
    pub fn register(&mut self, group: Group) -> std::io::Result<()> {
        self.send(&added(group))?;
        self.registered = Some(group.id());
        Ok(())
    }

    /// The job's leader exited: its group is no longer stopped when this process dies (what
    /// it left running in the background is left alone, as the parent-death signal leaves it).
    pub fn release(&mut self) {
        if let Some(id) = self.registered.take() {
            let _ = self.send(&removed(id));
        }
    }
}

impl Drop for Guard {
    /// Close the pipe. With nothing registered the reaper exits at once and is reaped here;
    /// with the group still registered (this process gives up on a running job) it stops the
    /// group on its own, and is left to do so.
    fn drop(&mut self) {
        drop(self.stdin.take());
        if self.registered.is_none() {
            let _ = proc::wait_deadline(&mut self.child, Instant::now() + Duration::from_secs(1));
        }
    }
}

/// `rsb-agent reaper`: read registrations until EOF, then stop what is still registered.
pub fn main() -> i32 {
    // The agent's death must not be mistaken for a reason to stop: only EOF decides.
    let mut groups: HashMap<u32, u64> = HashMap::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        if let Some(rest) = line.strip_prefix('+') {
            let mut f = rest.split_ascii_whitespace();
            if let (Some(Ok(pgid)), Some(Ok(start))) =
                (f.next().map(str::parse), f.next().map(str::parse))
            {
                groups.insert(pgid, start);
            }
        } else if let Some(Ok(pgid)) = line.strip_prefix('-').map(str::parse::<u32>) {
            groups.remove(&pgid);
        }
    }
    let ours: Vec<Group> = groups
        .into_iter()
        .filter(|&(pgid, start)| is_ours(pgid, start))
        .filter_map(|(pgid, _)| Group::new(pgid))
        .collect();
    stop_all(&ours);
    0
}

/// See the module notes on pid reuse.
fn is_ours(pgid: u32, start: u64) -> bool {
    match Stat::read(pgid) {
        // The leader still runs (or is a zombie awaiting init): ours if it is the same process.
        Some(s) => s.is_dead() || start == 0 || s.start_ticks == start,
        // The leader is gone; members that remain keep the id reserved.
        None => true,
    }
}

fn stop_all(groups: &[Group]) {
    if groups.is_empty() {
        return;
    }
    // Each run is followed from before the first signal, so what its leader's death cuts
    // from the tree is still known (see `proc::Tracked`).
    let mut runs: Vec<Tracked> = groups.iter().map(|g| g.track()).collect();
    for r in &mut runs {
        r.signal(Signal::TERM);
        r.signal(Signal::CONT);
    }
    if wait_all_gone(&mut runs, Instant::now() + GRACE) {
        return;
    }
    for r in &mut runs {
        r.signal(Signal::KILL);
    }
    wait_all_gone(&mut runs, Instant::now() + VERIFY);
}

fn wait_all_gone(runs: &mut [Tracked], deadline: Instant) -> bool {
    loop {
        // Every run looks each time (no short cut), so each keeps up with its members.
        let alive = runs.iter_mut().fold(false, |any, r| r.is_alive() | any);
        if !alive {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}
