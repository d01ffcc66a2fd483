//! `JobEvents`: job starts, ends and losses as they happen, from the jobs' own records.
//!
//! The wrapper replaces a job's `state` record atomically (a rename into the job's directory)
//! the moment the job ends, so on Linux an inotify watch on the jobs directory and on each
//! job's directory wakes the subscription then, and the records are read again and compared
//! with what was last seen. Nothing is polled for an end the wrapper records. Every
//! [`JOB_EVENTS_RESCAN_MS`] the records are read again anyway: a supervisor that died without
//! recording an end (a killed tmux server, an OOM kill of the wrapper) writes nothing, and is
//! seen as lost by that re-read. Where inotify is missing (not Linux, or out of watches), the
//! records are re-read every [`TICK`].

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use rsb_protocol::{
    AgentError, ErrorCode, JOB_EVENTS_RESCAN_MS, JobEvent, JobEventKind, JobEventsRequest, JobInfo,
    JobState,
};
use tokio_util::sync::CancellationToken;

use super::{Ctx, invalid, list_in, logread, validate_name};

/// Longest sleep between two checks of the cancel token (and the re-read period without
/// inotify).
const TICK: Duration = Duration::from_millis(250);
/// Longest last line sent.
const LAST_LINE_MAX: usize = 500;

/// Serve one subscription until it is cancelled (or, with `until_ended`, until every named
/// job has ended: then the jobs' records are the reply). `emit` returns false once nobody
/// listens.
pub(crate) fn events_in(
    ctx: &Ctx,
    req: &JobEventsRequest,
    cancel: &CancellationToken,
    emit: &mut dyn FnMut(JobEvent) -> bool,
) -> Result<Vec<JobInfo>, AgentError> {
    if (req.until_ended || req.output_after.is_some()) && req.names.is_empty() {
        return Err(invalid(
            "until_ended and output_after need the names of the jobs to wait for",
        ));
    }
    for n in &req.names {
        validate_name(n)?;
    }
    let mut watch = Watch::new();
    // The run last seen of each name: its start and its state.
    let mut seen: HashMap<String, (u64, JobState)> = HashMap::new();
    let mut first = true;
    let mut last_read = Instant::now();
    // `output_after`: the logs of the named jobs that run, until one grew past it (then the
    // one Output event is sent and this is None).
    let mut output_after = req.output_after;
    loop {
        if cancel.is_cancelled() {
            return Err(AgentError::new(ErrorCode::Cancelled, "request cancelled"));
        }
        let mut jobs = list_in(ctx)?;
        if !req.names.is_empty() {
            jobs.retain(|j| req.names.contains(&j.name));
        }
        if first
            && req.until_ended
            && let Some(missing) = req
                .names
                .iter()
                .find(|n| !jobs.iter().any(|j| &j.name == *n))
        {
            return Err(AgentError::new(
                ErrorCode::NotFound,
                format!("no job named `{missing}` on this host (names match exactly)"),
            ));
        }
        watch.cover(&ctx.root, jobs.iter().map(|j| j.name.as_str()));
        for j in &jobs {
            for kind in changes(seen.get(&j.name).copied(), j, first, req.since_ms) {
                let event = JobEvent {
                    kind,
                    last_line: (kind != JobEventKind::Started)
                        .then(|| last_line(j))
                        .flatten(),
                    info: j.clone(),
                };
                if !emit(event) {
                    return Err(AgentError::new(ErrorCode::Cancelled, "nobody listens"));
                }
            }
            seen.insert(j.name.clone(), (j.started_ms, j.state));
        }
        first = false;
        if req.until_ended && jobs.iter().all(|j| j.state != JobState::Running) {
            return Ok(jobs);
        }
        if let Some(after) = output_after
            && let Some(j) = grown(&jobs, after)
        {
            output_after = None;
            let event = JobEvent {
                kind: JobEventKind::Output,
                last_line: last_line(j),
                info: j.clone(),
            };
            if !emit(event) {
                return Err(AgentError::new(ErrorCode::Cancelled, "nobody listens"));
            }
        }
        // Sleep until a record changes, the next re-read, or the next cancel check.
        let rescan = Duration::from_millis(JOB_EVENTS_RESCAN_MS);
        loop {
            if cancel.is_cancelled() {
                break;
            }
            if watch.wait(TICK) || last_read.elapsed() >= rescan {
                break;
            }
            // A log's growth has no record event: its size is looked at every tick.
            if output_after.is_some_and(|after| grown(&jobs, after).is_some()) {
                break;
            }
        }
        last_read = Instant::now();
    }
}

/// What happened to a name between two reads: `before` is its last seen run (start, state).
/// On the first read only ends at or after `since_ms` are reported (what a subscriber that
/// was away missed), never starts.
fn changes(
    before: Option<(u64, JobState)>,
    now: &JobInfo,
    first: bool,
    since_ms: u64,
) -> Vec<JobEventKind> {
    let end = match now.state {
        JobState::Running => None,
        JobState::Exited => Some(JobEventKind::Ended),
        JobState::Lost => Some(JobEventKind::Lost),
    };
    if first {
        let missed = since_ms > 0 && now.ended_ms.unwrap_or(u64::MAX) >= since_ms;
        return end.filter(|_| missed).into_iter().collect();
    }
    match before {
        // A new run (or a name not seen before): its start, and its end if it is over already.
        None => std::iter::once(JobEventKind::Started).chain(end).collect(),
        Some((started, _)) if started != now.started_ms => {
            std::iter::once(JobEventKind::Started).chain(end).collect()
        }
        Some((_, JobState::Running)) => end.into_iter().collect(),
        // Already reported as ended or lost.
        Some(_) => Vec::new(),
    }
}

/// A running job among `jobs` whose log is larger than `after` bytes.
fn grown(jobs: &[JobInfo], after: u64) -> Option<&JobInfo> {
    jobs.iter().find(|j| {
        j.state == JobState::Running
            && std::fs::metadata(&j.log_file).is_ok_and(|m| m.len() > after)
    })
}

/// The last line this run printed: never the runner's own header (`== session:` …) or its
/// `EXIT_CODE=` line ([`rsb_protocol::job_output`]).
fn last_line(j: &JobInfo) -> Option<String> {
    let tail = logread::read_tail(Path::new(&j.log_file), 5, 16 * 1024, j.log_start).ok()?;
    let text = String::from_utf8_lossy(rsb_protocol::job_output(&tail.data));
    let line = text
        .lines()
        .rev()
        .map(|l| l.trim_end_matches('\r'))
        .find(|l| !l.trim().is_empty())?;
    let mut end = line.len().min(LAST_LINE_MAX);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    Some(line[..end].to_string())
}

/// Wakes the subscription when a record may have changed.
struct Watch {
    #[cfg(target_os = "linux")]
    inotify: Option<linux::Inotify>,
}

impl Watch {
    fn new() -> Watch {
        Watch {
            #[cfg(target_os = "linux")]
            inotify: linux::Inotify::new(),
        }
    }

    /// Watch the jobs directory and each named job's directory (new ones are added as they
    /// appear; a directory watched already costs nothing more).
    fn cover<'a>(&mut self, root: &Path, names: impl Iterator<Item = &'a str>) {
        #[cfg(target_os = "linux")]
        if let Some(i) = &mut self.inotify {
            i.cover(root, names);
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (root, names.count());
    }

    /// True when something changed; false after `at_most` with nothing (or without inotify,
    /// where every tick re-reads).
    fn wait(&mut self, at_most: Duration) -> bool {
        #[cfg(target_os = "linux")]
        if let Some(i) = &mut self.inotify
            && i.usable()
        {
            return i.wait(at_most);
        }
        std::thread::sleep(at_most);
        true
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::collections::HashSet;
    use std::os::fd::OwnedFd;
    use std::path::Path;
    use std::time::Duration;

    use rustix::event::{PollFd, PollFlags, Timespec};
    use rustix::fs::inotify::{self, CreateFlags, WatchFlags};
    use rustix::io::Errno;

    pub struct Inotify {
        fd: OwnedFd,
        /// Names whose directory is watched (and whether the jobs directory is).
        dirs: HashSet<String>,
        root: bool,
        /// A watch could not be added (the user's inotify limit): re-read every tick instead.
        short: bool,
    }

    impl Inotify {
        pub fn new() -> Option<Inotify> {
            let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK).ok()?;
            Some(Inotify {
                fd,
                dirs: HashSet::new(),
                root: false,
                short: false,
            })
        }

        pub fn usable(&self) -> bool {
            self.root && !self.short
        }

        pub fn cover<'a>(&mut self, root: &Path, names: impl Iterator<Item = &'a str>) {
            // A job appears as a new directory, and its records are renamed into it.
            let dir_flags = WatchFlags::CREATE
                | WatchFlags::MOVED_TO
                | WatchFlags::DELETE
                | WatchFlags::ONLYDIR;
            if !self.root {
                // No jobs directory yet: re-read every tick until there is one.
                self.root = inotify::add_watch(&self.fd, root, dir_flags).is_ok();
            }
            // A name gone from the listing lost its directory (and its watch with it): watch
            // the next directory of that name afresh.
            let names: HashSet<&str> = names.collect();
            self.dirs.retain(|d| names.contains(d.as_str()));
            for name in names {
                if self.dirs.contains(name) {
                    continue;
                }
                let flags = dir_flags | WatchFlags::CLOSE_WRITE;
                match inotify::add_watch(&self.fd, root.join(name), flags) {
                    Ok(_) => {
                        self.dirs.insert(name.to_string());
                    }
                    Err(Errno::NOSPC) => self.short = true,
                    Err(_) => {}
                }
            }
        }

        /// Waits up to `at_most` for an event; drains them all (the caller re-reads every
        /// record, so which file changed does not matter).
        pub fn wait(&mut self, at_most: Duration) -> bool {
            let timeout = Timespec {
                tv_sec: at_most.as_secs() as _,
                tv_nsec: at_most.subsec_nanos() as _,
            };
            let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(0) => return false,
                Ok(_) => {}
                Err(_) => {
                    std::thread::sleep(at_most);
                    return true;
                }
            }
            let mut buf = [0u8; 4096];
            let mut any = false;
            while let Ok(n) = rustix::io::read(&self.fd, &mut buf) {
                if n == 0 {
                    break;
                }
                any = true;
            }
            any
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The wake-up is inotify's, not a poll: with nothing changing, a wait times out (the
    /// fallback would report a change every tick); a record renamed into a job's directory,
    /// as the wrapper writes its end, wakes it within milliseconds.
    #[test]
    fn the_watch_wakes_on_a_record_rename_and_sleeps_otherwise() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("jobs");
        std::fs::create_dir_all(root.join("train")).unwrap();
        let mut w = Watch::new();
        w.cover(&root, ["train"].into_iter());
        let t = Instant::now();
        assert!(
            !w.wait(Duration::from_millis(300)),
            "woken with nothing changed"
        );
        assert!(t.elapsed() >= Duration::from_millis(250));
        let dir = root.join("train");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            std::fs::write(dir.join(".state.tmp"), "ended_ms=1\n").unwrap();
            std::fs::rename(dir.join(".state.tmp"), dir.join("state")).unwrap();
        });
        let t = Instant::now();
        let mut woke = false;
        while !woke && t.elapsed() < Duration::from_secs(5) {
            woke = w.wait(Duration::from_millis(250));
        }
        writer.join().unwrap();
        assert!(woke);
        assert!(
            t.elapsed() < Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
        // A job directory made later is watched once the listing names it.
        std::fs::create_dir_all(root.join("b")).unwrap();
        while w.wait(Duration::from_millis(50)) {}
        w.cover(&root, ["train", "b"].into_iter());
        std::fs::write(root.join("b/state"), "x").unwrap();
        assert!(w.wait(Duration::from_secs(2)));
    }
}
