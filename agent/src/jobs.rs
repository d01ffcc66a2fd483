//! Background jobs: started detached, supervised by `rsb-agent job-run`, recorded on disk, and
//! readable later from any connection.
//!
//! The Python server pasted the user's command into a tmux script and parsed `EXIT_CODE=` back
//! out of the log, so `exit`, `set -e` or a long last line lost the exit code, tmux's prefix
//! matching mixed up `train` and `train-001`, and a duplicate name overwrote a running job's
//! script. Here the agent itself is the supervisor: the wrapper (see [`wrapper`]) runs
//! `bash -c CMD` as a child, so the exit status comes from `waitpid`, never from the log, and
//! the job is identified by its directory and the wrapper's pid, never by a tmux session name.
//!
//! # On disk
//! `$HOME/.cache/rsb/jobs/<name>/` (mode 700) holds:
//! - `spec`: written by `start` before launching: name, command, cwd, log file, the job's
//!   environment, and a launch id the wrapper must match (so a late wrapper from an abandoned
//!   launch exits instead of running the job twice);
//! - `state`: written only by the wrapper: host, runner, wrapper pid and its kernel start
//!   time, the job's pid (= its process group), start time and the log offset where this run
//!   begins; at the end also `ended_ms`, `exit_code` or `signal`, and `hangup=1` when the
//!   tmux session was closed under it;
//! - `lock`: `flock`ed by `start` so two connections cannot launch the same name at once;
//! - `wrapper.log`: the wrapper's own diagnostics (never the job's output);
//! - `history/<started_ms>/`: see [`start`].
//!
//! Both records use the `key=value` format in [`record`] and are replaced atomically.

mod events;
mod logread;
mod oom;
pub mod record;
mod wrapper;

#[cfg(test)]
mod tests;

use std::ffi::{OsStr, OsString};
use std::fs::{File, TryLockError};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rsb_protocol::{
    AgentError, ErrorCode, JobInfo, JobKillRequest, JobStartRequest, JobState, JobStatusRequest,
    JobStatusResult,
};
use rsb_rules::path::{expand_tilde, normalize};

use record::Record;
use rustix::io::Errno;

use crate::proc;
use crate::util::json_string;

/// Appended to every name error so the caller can fix the name without reading docs.
const NAME_RULE: &str = "use 1-64 characters from A-Z a-z 0-9 _ -";
/// How long `start` waits for the wrapper to record the job as running. Generous, because a
/// loaded host may take a while to start a tmux server, but bounded so a broken wrapper is an
/// error rather than a hang.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `kill` waits after SIGKILL for the wrapper to record the end (it drains the
/// job's output pipe for at most [`wrapper::DRAIN`] first).
const KILL_SETTLE: Duration = Duration::from_secs(5);
/// Longest grace `kill` honours, so a typo cannot park a request for days.
const MAX_GRACE: Duration = Duration::from_secs(600);
/// How long a launcher that overran [`START_TIMEOUT`] may take to vanish after SIGKILL.
const KILL_VERIFY: Duration = Duration::from_secs(1);
/// Finished records kept per name.
const HISTORY_KEEP: usize = 5;
/// Largest log slice one status reply carries; well under the 16 MiB frame limit.
const LOG_CAP: u64 = 8 << 20;
/// Poll interval for the on-disk handshakes.
const POLL: Duration = Duration::from_millis(20);

/// Where jobs live and what they inherit. The public functions build it from the process
/// (`$HOME`, the running agent binary, its environment); tests build their own so they never
/// touch the real `$HOME` or mutate process-global state.
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    pub root: PathBuf,
    pub home: PathBuf,
    /// The binary run as `job-run`.
    pub exe: PathBuf,
    /// The environment a job starts from (before its request's `env`), and the one the tmux
    /// client runs with. Snapshotting it means both runners give the job the agent's
    /// environment, like `exec` does, instead of whatever an older tmux server was started with.
    pub env: Vec<(OsString, OsString)>,
}

impl Ctx {
    fn from_process() -> Result<Ctx, AgentError> {
        let home = std::env::var_os("HOME")
            .filter(|h| Path::new(h).is_absolute())
            .map(PathBuf::from)
            .ok_or_else(|| internal("$HOME is not set to an absolute path"))?;
        let exe = crate::util::own_exe()
            .map_err(|e| internal(format!("cannot find the agent binary: {e}")))?;
        Ok(Ctx {
            root: home.join(rsb_protocol::JOBS_ROOT),
            home,
            exe,
            env: std::env::vars_os().collect(),
        })
    }

    fn env_var(&self, key: &str) -> Option<&OsStr> {
        self.env
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_os_str())
    }

    fn job_dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }
}

fn internal(msg: impl Into<String>) -> AgentError {
    AgentError::new(ErrorCode::Internal, msg)
}

fn invalid(msg: impl Into<String>) -> AgentError {
    AgentError::new(ErrorCode::InvalidArgument, msg)
}

/// Run blocking file and process work off the async executor.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce(&Ctx) -> Result<T, AgentError> + Send + 'static,
) -> Result<T, AgentError> {
    tokio::task::spawn_blocking(move || f(&Ctx::from_process()?))
        .await
        .map_err(|e| internal(format!("jobs: worker failed: {e}")))?
}

/// Start a job and return once its wrapper has recorded it as running.
///
/// A name whose job is still running is refused (`AlreadyExists`) and that job, its record
/// and its log are left untouched. A finished job's name may be reused: its record (`spec`,
/// `state`, `wrapper.log`) moves to `<name>/history/<started_ms>/`, the newest
/// [`HISTORY_KEEP`] such records are kept, and the log file itself is appended to (a new
/// `== session:` header marks the new run; status tails start at that header, so the previous
/// run's `EXIT_CODE=` is never mistaken for this one's). The reply carries that ended run as
/// `previous` and this run's `log_start`, so a caller can say where the earlier output is.
pub async fn start(req: JobStartRequest) -> Result<JobInfo, AgentError> {
    blocking(move |ctx| start_in(ctx, req)).await
}

/// Report a job (exact name) and a slice of its log.
pub async fn status(req: JobStatusRequest) -> Result<JobStatusResult, AgentError> {
    blocking(move |ctx| status_in(ctx, &req)).await
}

/// SIGTERM the job's process group, SIGKILL it after `grace_ms`, and return how it ended.
pub async fn kill(req: JobKillRequest) -> Result<JobInfo, AgentError> {
    blocking(move |ctx| kill_in(ctx, &req)).await
}

/// Job starts, ends and losses as they happen (see [`events`]); runs on the calling (blocking)
/// thread until cancelled, or until the named jobs have ended with `until_ended`.
pub fn events(
    req: &rsb_protocol::JobEventsRequest,
    cancel: &tokio_util::sync::CancellationToken,
    emit: &mut dyn FnMut(rsb_protocol::JobEvent) -> bool,
) -> Result<Vec<JobInfo>, AgentError> {
    events::events_in(&Ctx::from_process()?, req, cancel, emit)
}

/// Every recorded job, newest first.
pub async fn list() -> Result<Vec<JobInfo>, AgentError> {
    blocking(list_in).await
}

/// `rsb-agent jobs [--json]`
pub fn cli_main(args: &[String]) -> i32 {
    let mut json = false;
    for a in args {
        match a.as_str() {
            "--json" => json = true,
            "-h" | "--help" => {
                let _ = writeln!(std::io::stdout(), "usage: rsb-agent jobs [--json]");
                return 0;
            }
            other => {
                let _ = writeln!(
                    std::io::stderr(),
                    "rsb-agent jobs: unknown argument '{other}'"
                );
                return 2;
            }
        }
    }
    let jobs = match Ctx::from_process().and_then(|ctx| list_in(&ctx)) {
        Ok(j) => j,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "rsb-agent jobs: {e}");
            return 1;
        }
    };
    let text = if json {
        jobs_json(&jobs)
    } else {
        jobs_table(&jobs)
    };
    let mut out = std::io::stdout().lock();
    // A closed pipe (`rsb-agent jobs | head`) is not an error worth a message.
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => 0,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
        Err(_) => 1,
    }
}

/// `rsb-agent job-run --root DIR --name N --launch ID --runner tmux|setsid [--detach]`
pub fn job_run_main(args: &[String]) -> i32 {
    wrapper::main(args)
}

// ---------------------------------------------------------------------------------------------
// Names and paths

/// See [`rsb_protocol::jobs::valid_job_name`].
fn validate_name(name: &str) -> Result<(), AgentError> {
    let ok = rsb_protocol::jobs::valid_job_name(name);
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "job name '{name}' is invalid: {NAME_RULE}"
        )))
    }
}

/// The job's working directory: `~` expanded, relative to `$HOME`, none means `$HOME`. It must
/// already be a directory: the seed created a missing cwd and ran the job in an empty one.
fn resolve_cwd(raw: Option<&str>, home: &Path) -> Result<PathBuf, AgentError> {
    let raw = raw.unwrap_or("").trim();
    let path = if raw.is_empty() {
        home.to_path_buf()
    } else {
        normalize(&home.join(expand_tilde(raw, home)))
    };
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => Ok(path),
        Ok(_) => Err(AgentError::new(
            ErrorCode::NotADirectory,
            format!("cwd {} is not a directory", path.display()),
        )),
        Err(e) => Err(AgentError::from_io(&e, "cwd", &path.display().to_string())),
    }
}

/// The log path, as the seed resolved it (seed-inventory §3.4): empty means
/// `.codex_logs/<name>.log`; `~` expanded; absolute as given; otherwise relative to the cwd
/// (or `$HOME` without one). One seed rule is kept for compatibility: with a relative cwd
/// such as `proj`, a log `proj/logs/a.log` means `$HOME/proj/logs/a.log`, not
/// `$HOME/proj/proj/logs/a.log`, because callers wrote the log relative to `$HOME`.
/// Unlike the seed, the result is always normalised.
fn resolve_log(raw: &str, name: &str, raw_cwd: Option<&str>, cwd: &Path, home: &Path) -> PathBuf {
    let raw = raw.trim();
    let log = if raw.is_empty() {
        PathBuf::from(format!(".codex_logs/{name}.log"))
    } else {
        expand_tilde(raw, home)
    };
    if log.is_absolute() {
        return normalize(&log);
    }
    let log = normalize(&log);
    let raw_cwd = raw_cwd.unwrap_or("").trim();
    if !raw_cwd.is_empty() && !raw_cwd.starts_with('/') && !raw_cwd.starts_with('~') {
        let rel_cwd = normalize(Path::new(raw_cwd));
        if !rel_cwd.as_os_str().is_empty()
            && let Ok(rest) = log.strip_prefix(&rel_cwd)
        {
            return normalize(&cwd.join(rest));
        }
    }
    normalize(&cwd.join(log))
}

/// Create the log's directory and make sure the log can be opened for appending, so a bad
/// path is reported by `start` instead of by a job that silently writes nowhere.
fn prepare_log(log: &Path) -> Result<(), AgentError> {
    let shown = log.display().to_string();
    if let Some(parent) = log.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| AgentError::from_io(&e, "log directory", &parent.display().to_string()))?;
    }
    if log.is_dir() {
        return Err(AgentError::new(
            ErrorCode::IsADirectory,
            format!("log file {shown} is a directory"),
        ));
    }
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .map(drop)
        .map_err(|e| AgentError::from_io(&e, "log file", &shown))
}

// ---------------------------------------------------------------------------------------------
// Records

/// A job's two records. `state` is `None` between writing the spec and the wrapper's first
/// write, or after a launch that never came up; such a job is not reported.
struct Job {
    spec: Record,
    state: Option<Record>,
    /// The wrapper was seen gone after the state was read ([`load`]): without an end in the
    /// record, the run is lost.
    wrapper_gone: bool,
}

fn read_optional(path: &Path) -> Result<Option<Record>, AgentError> {
    match Record::read(path) {
        Ok(r) => Ok(Some(r)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(AgentError::from_io(
            &e,
            "job record",
            &path.display().to_string(),
        )),
    }
}

/// Read both records of one launch. They are two files, so a `start` reusing the name can
/// replace them between the two reads; the launch id both carry detects that, and the read
/// is retried, so an old command is never paired with a new run's state.
fn load(ctx: &Ctx, name: &str) -> Result<Option<Job>, AgentError> {
    load_dir(&ctx.job_dir(name))
}

fn load_dir(dir: &Path) -> Result<Option<Job>, AgentError> {
    for _ in 0..3 {
        let Some(spec) = read_optional(&dir.join("spec"))? else {
            return Ok(None);
        };
        let mut state = read_optional(&dir.join("state"))?;
        // A wrapper writes its end, then exits. Read before that write and judged after the
        // exit, a job that ended would read as lost (and a watch would resume it): liveness
        // is judged once, here, and once the wrapper is seen gone the record is read again,
        // which then holds any end it wrote.
        let mut wrapper_gone = false;
        if let Some(st) = &state
            && st.get("ended_ms").is_none()
            && !wrapper_alive(st)
        {
            wrapper_gone = true;
            state = read_optional(&dir.join("state"))?;
        }
        match state {
            Some(st) if st.get("launch") != spec.get("launch") => std::thread::sleep(POLL),
            state => {
                return Ok(Some(Job {
                    spec,
                    state,
                    wrapper_gone,
                }));
            }
        }
    }
    Ok(None)
}

impl Job {
    /// `None` without a state record. The state is derived on every read, never stored, so a
    /// record cannot claim "running" for a wrapper that died.
    fn info(&self) -> Option<JobInfo> {
        let st = self.state.as_ref()?;
        let ended_ms = st.get_u64("ended_ms");
        let state = if ended_ms.is_some() {
            if st.get("hangup") == Some("1") {
                JobState::Lost
            } else {
                JobState::Exited
            }
        } else if self.wrapper_gone {
            JobState::Lost
        } else {
            JobState::Running
        };
        let text = |r: &Record, k: &str| {
            String::from_utf8_lossy(r.get_bytes(k).unwrap_or_default()).into_owned()
        };
        Some(JobInfo {
            name: text(&self.spec, "name"),
            command: text(&self.spec, "command"),
            cwd: text(&self.spec, "cwd"),
            log_file: text(&self.spec, "log_file"),
            runner: text(st, "runner"),
            pid: st.get_u64("pid").unwrap_or(0) as u32,
            started_ms: st.get_u64("started_ms").unwrap_or(0),
            state,
            exit_code: st.get_i32("exit_code"),
            signal: st.get_i32("signal"),
            oom_kill: st.get("oom_kill").and_then(oom::from_word),
            ended_ms,
            launch_id: text(&self.spec, "launch_id"),
            log_start: self.spec.get_u64("log_start").unwrap_or(0),
            previous: None,
            unconfined: None,
            gpus: text(st, "gpus")
                .split(',')
                .filter(|u| !u.is_empty())
                .map(str::to_string)
                .collect(),
        })
    }

    fn started_ms(&self) -> u64 {
        self.state
            .as_ref()
            .and_then(|s| s.get_u64("started_ms"))
            .or_else(|| self.spec.get_u64("created_ms"))
            .unwrap_or(0)
    }
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// Is the recorded wrapper still that same wrapper? A pid alone is not enough: after a reboot
/// or a long time the number is reused, which would make a dead job look alive forever. The
/// kernel start time recorded by the wrapper pins the exact process (see [`proc::is_alive`]);
/// the command line check covers records written where the start time was not available.
fn wrapper_alive(st: &Record) -> bool {
    if st.get("host").is_some_and(|h| h != hostname()) {
        // Recorded on another host sharing this $HOME (NFS): nothing here can tell, and
        // calling a running job lost could get it restarted twice.
        return true;
    }
    let Some(pid) = st
        .get_u64("wrapper_pid")
        .and_then(|p| u32::try_from(p).ok())
    else {
        return false;
    };
    if !proc::is_alive(pid, st.get_u64("wrapper_start")) {
        return false;
    }
    if !proc::proc_available() {
        // Existence is all that can be known here.
        return true;
    }
    let Some(args) = proc::args(pid) else {
        return false;
    };
    let name = st.get_bytes("name").unwrap_or_default();
    args.iter().any(|a| a == b"job-run")
        && args.windows(2).any(|w| w[0] == b"--name" && w[1] == name)
}

/// An exclusive `flock` held for the life of the value. Closing the file releases it, also
/// when the holder dies, so a crashed `start` never wedges a name.
struct DirLock {
    _file: File,
}

impl DirLock {
    fn acquire(path: &Path, timeout: Duration) -> Result<DirLock, AgentError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(|e| AgentError::from_io(&e, "job lock", &path.display().to_string()))?;
        let deadline = Instant::now() + timeout;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(DirLock { _file: file }),
                Err(TryLockError::WouldBlock) => {}
                Err(TryLockError::Error(err)) => match Errno::from_io_error(&err) {
                    Some(Errno::INTR) => {}
                    // Some network filesystems have no lock daemon; the running-job check
                    // below still refuses duplicates, only the narrow race between two starts
                    // remains.
                    Some(Errno::NOLCK | Errno::OPNOTSUPP) => return Ok(DirLock { _file: file }),
                    _ => {
                        return Err(AgentError::from_io(
                            &err,
                            "job lock",
                            &path.display().to_string(),
                        ));
                    }
                },
            }
            if Instant::now() >= deadline {
                return Err(AgentError::new(
                    ErrorCode::AlreadyExists,
                    format!(
                        "another start of this job is still in progress ({})",
                        path.display()
                    ),
                ));
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Move a finished job's record to `history/<started_ms>/` and prune to [`HISTORY_KEEP`].
fn archive(dir: &Path, job: &Job) -> Result<(), AgentError> {
    let io = |e: std::io::Error, p: &Path| {
        AgentError::from_io(&e, "job history", &p.display().to_string())
    };
    let hist = dir.join("history");
    record::create_private_dir(&hist).map_err(|e| io(e, &hist))?;
    let stamp = job.started_ms();
    let mut target = hist.join(stamp.to_string());
    let mut n = 1;
    while target.exists() {
        target = hist.join(format!("{stamp}-{n}"));
        n += 1;
    }
    record::create_private_dir(&target).map_err(|e| io(e, &target))?;
    for f in ["spec", "state", "wrapper.log"] {
        match std::fs::rename(dir.join(f), target.join(f)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e, &dir.join(f))),
        }
    }
    let mut entries: Vec<(u64, String)> = std::fs::read_dir(&hist)
        .map_err(|e| io(e, &hist))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let ms = name.split('-').next()?.parse().ok()?;
            Some((ms, name))
        })
        .collect();
    entries.sort();
    let excess = entries.len().saturating_sub(HISTORY_KEEP);
    for (_, name) in &entries[..excess] {
        let _ = std::fs::remove_dir_all(hist.join(name));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// start

fn check_text(what: &str, s: &str) -> Result<(), AgentError> {
    if s.contains('\0') {
        Err(invalid(format!("{what} contains a NUL byte")))
    } else {
        Ok(())
    }
}

pub(crate) fn start_in(ctx: &Ctx, req: JobStartRequest) -> Result<JobInfo, AgentError> {
    validate_name(&req.name)?;
    if req.command.trim().is_empty() {
        return Err(invalid("command cannot be empty"));
    }
    check_text("command", &req.command)?;
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(invalid(format!("environment name '{k}' is invalid")));
        }
        check_text("environment value", v)?;
    }
    check_text("cwd", req.cwd.as_deref().unwrap_or(""))?;
    check_text("log_file", &req.log_file)?;
    let launch_id = req.launch_id.as_deref().unwrap_or("");
    check_text("launch_id", launch_id)?;
    if let Some(ask) = &req.gpus {
        if ask.count == 0 || ask.candidates.len() > 64 {
            return Err(invalid("gpus: ask for 1 or more, of at most 64 candidates"));
        }
        if let Some(bad) = ask.candidates.iter().find(|u| !crate::lease::valid_uuid(u)) {
            return Err(invalid(format!("'{bad}' is not a GPU UUID")));
        }
        if ask.candidates.len() < ask.count as usize {
            return Err(AgentError::new(
                ErrorCode::Busy,
                format!(
                    "{}{} asked, {} offered",
                    crate::lease::BUSY,
                    ask.count,
                    ask.candidates.len()
                ),
            ));
        }
    }
    // Everything that can be wrong with the request is found before anything launches.
    let cwd = resolve_cwd(req.cwd.as_deref(), &ctx.home)?;
    let log = match &req.confine {
        // A confined job's log is one of rsb's own writes: by default in the job's own
        // directory, else beneath a write root (checked, and opened, as the wrapper will).
        Some(_) if req.log_file.trim().is_empty() => {
            ctx.job_dir(&req.name).join(rsb_protocol::CONFINED_LOG)
        }
        _ => resolve_log(
            &req.log_file,
            &req.name,
            req.cwd.as_deref(),
            &cwd,
            &ctx.home,
        ),
    };
    let own_log = log == ctx.job_dir(&req.name).join(rsb_protocol::CONFINED_LOG);
    let log_confine = req.confine.as_ref().filter(|_| !own_log);

    record::create_private_dir(&ctx.root)
        .map_err(|e| AgentError::from_io(&e, "jobs directory", &ctx.root.display().to_string()))?;
    let dir = ctx.job_dir(&req.name);
    record::create_private_dir(&dir)
        .map_err(|e| AgentError::from_io(&e, "job directory", &dir.display().to_string()))?;
    let _lock = DirLock::acquire(&dir.join("lock"), START_TIMEOUT + Duration::from_secs(5))?;

    let old = load(ctx, &req.name)?;
    // The same launch asked for again (its caller lost the reply, or died before reading it):
    // the run it started is the answer, running or ended. A launch that never came up has no
    // info, and is launched now.
    if let Some(info) = old.as_ref().and_then(Job::info)
        && !launch_id.is_empty()
        && info.launch_id == launch_id
    {
        return Ok(info);
    }
    if let Some(info) = old.as_ref().and_then(Job::info)
        && info.state == JobState::Running
    {
        return Err(AgentError::new(
            ErrorCode::AlreadyExists,
            format!(
                "job '{}' is already running (pid {}, log {}); pick another name or kill it first",
                req.name, info.pid, info.log_file
            ),
        ));
    }
    // Confinement is decided here, so a host that cannot give it refuses before anything
    // launches; the wrapper builds the same ruleset again from the spec's absolute roots.
    let mut unconfined = None;
    let mut confined = None;
    if let Some(c) = &req.confine {
        match crate::confine::prepare(c)? {
            crate::confine::Decision::Confine(p, partial) => {
                unconfined = partial;
                let absolute = |roots: &[String]| {
                    let roots = roots.iter().map(|w| crate::util::expand_home(w));
                    roots.map(|r| r.to_string_lossy().into_owned()).collect()
                };
                confined = Some(rsb_protocol::Confine {
                    write: absolute(&c.write),
                    read: c.read.as_deref().map(absolute),
                    net: p.net,
                    require: c.require,
                });
            }
            crate::confine::Decision::Unconfined(why) => unconfined = Some(why),
        }
    }
    // Only now touch the filesystem for the new run: a refused duplicate leaves no trace.
    match log_confine {
        Some(c) => drop(crate::confine::open_log(c, &log)?),
        None => prepare_log(&log)?,
    }
    let log_start = std::fs::metadata(&log).map_or(0, |m| m.len());
    let mut previous = None;
    match old {
        Some(old) if old.state.is_some() => {
            previous = old.info().map(Box::new);
            archive(&dir, &old)?;
        }
        // A spec without a state is a launch that never came up: nothing to keep.
        Some(_) => {
            let _ = std::fs::remove_file(dir.join("spec"));
        }
        None => {}
    }

    let mut spec = Record::new();
    spec.set("name", &req.name);
    spec.set("command", &req.command);
    spec.set("cwd", cwd.as_os_str().as_bytes());
    spec.set("log_file", log.as_os_str().as_bytes());
    spec.set("prefer_tmux", if req.prefer_tmux { "1" } else { "0" });
    spec.set("launch_id", launch_id);
    spec.set("created_ms", now_ms().to_string());
    spec.set("log_start", log_start.to_string());
    // What this host enforces (a net rule it cannot apply, allowed to go, is not written).
    if let Some(c) = &confined {
        record::set_confine(&mut spec, c);
    }
    if let Some(ask) = &req.gpus {
        spec.set("gpu_count", ask.count.to_string());
        for uuid in &ask.candidates {
            spec.push("gpu", uuid);
        }
    }
    let mut env: Vec<(OsString, OsString)> = ctx.env.clone();
    for (k, v) in &req.env {
        env.retain(|(ek, _)| ek.as_bytes() != k.as_bytes());
        env.push((k.into(), v.into()));
    }
    for (k, v) in &env {
        let mut kv = k.as_bytes().to_vec();
        kv.push(b'=');
        kv.extend_from_slice(v.as_bytes());
        spec.push("env", kv);
    }

    let launch = format!("{}-{}", now_ms(), std::process::id());
    let tmux = if req.prefer_tmux {
        proc::find_executable("tmux", ctx.env_var("PATH"))
    } else {
        None
    };
    let started = |id: &str| {
        finish_start(&dir, &req.name, id).map(|mut info| {
            info.previous = previous.clone();
            info.unconfined = unconfined.clone();
            info
        })
    };
    let mut tmux_failure = None;
    if let Some(tmux) = tmux {
        let id = format!("{launch}-t");
        write_spec(&dir, &mut spec, &id)?;
        match launch_tmux(ctx, &dir, &tmux, &req.name, &id) {
            Ok(()) => return started(&id),
            // A stale or foreign tmux session with this name, or a broken tmux, is no reason
            // to refuse the job: fall back to the setsid runner (the result names the runner).
            Err(e) => tmux_failure = Some(e),
        }
    }
    let id = format!("{launch}-s");
    write_spec(&dir, &mut spec, &id)?;
    launch_setsid(ctx, &dir, &req.name, &id).map_err(|e| match tmux_failure {
        Some(t) => internal(format!("{e} (tmux also failed: {t})")),
        None => internal(e),
    })?;
    started(&id)
}

/// Write the spec with this launch's id. A wrapper from an earlier, abandoned launch reads a
/// different id and exits without running anything.
fn write_spec(dir: &Path, spec: &mut Record, id: &str) -> Result<(), AgentError> {
    spec.set("launch", id);
    let path = dir.join("spec");
    spec.write_atomic(&path)
        .map_err(|e| AgentError::from_io(&e, "job spec", &path.display().to_string()))
}

fn wrapper_args(ctx: &Ctx, name: &str, id: &str, runner: &str) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec![
        ctx.exe.clone().into(),
        "job-run".into(),
        "--root".into(),
        ctx.root.clone().into(),
        "--name".into(),
        name.into(),
        "--launch".into(),
        id.into(),
        "--runner".into(),
        runner.into(),
    ];
    if runner == "setsid" {
        v.push("--detach".into());
    }
    v
}

/// tmux 3.0 and later exec a multi-word command directly; older ones join it into a shell
/// string. The version decides whether the wrapper's argv must be quoted.
fn tmux_takes_argv(tmux: &Path, env: &[(OsString, OsString)]) -> bool {
    let out = Command::new(tmux)
        .arg("-V")
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output();
    let Ok(out) = out else { return false };
    let text = String::from_utf8_lossy(&out.stdout);
    let digits: String = text
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    match digits.parse::<u32>() {
        Ok(major) => major >= 3,
        // "tmux master" and friends are development builds: new.
        Err(_) => text.contains("master") || text.contains("next"),
    }
}

fn launch_tmux(ctx: &Ctx, dir: &Path, tmux: &Path, name: &str, id: &str) -> Result<(), String> {
    let argv = wrapper_args(ctx, name, id, "tmux");
    let (stderr, from) = launcher_stderr(dir)?;
    let mut cmd = Command::new(tmux);
    cmd.env_clear()
        .envs(ctx.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .args(["new-session", "-d", "-s", name]);
    if tmux_takes_argv(tmux, &ctx.env) {
        cmd.args(&argv);
    } else {
        let mut line = b"exec".to_vec();
        for a in &argv {
            line.push(b' ');
            // tmux before 3.0 runs its command through a shell.
            line.extend_from_slice(&rsb_rules::shell::quote(a.as_bytes()));
        }
        cmd.arg(OsStr::from_bytes(&line));
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", tmux.display()))?;
    match wait_launcher(child, "tmux new-session")? {
        s if s.success() => Ok(()),
        s => Err(format!(
            "tmux new-session failed ({s}): {}",
            appended_since(dir, from)
        )),
    }
}

/// Start the wrapper in a new session with no terminal, so neither the SSH connection closing
/// nor the agent exiting reaches it. The wrapper forks once more (`--detach`) and this child
/// exits at once, so the agent reaps it and never accumulates zombies. Its stdio must not be
/// a pipe of ours: the detached wrapper would hold it open for the job's whole life.
fn launch_setsid(ctx: &Ctx, dir: &Path, name: &str, id: &str) -> Result<(), String> {
    let argv = wrapper_args(ctx, name, id, "setsid");
    let (stderr, from) = launcher_stderr(dir)?;
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .envs(ctx.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    proc::new_session(&mut cmd, None);
    let child =
        proc::spawn(&mut cmd).map_err(|e| format!("cannot run {}: {e}", ctx.exe.display()))?;
    match wait_launcher(child, "the job wrapper")? {
        s if s.success() => Ok(()),
        s => Err(format!(
            "the job wrapper exited with {s}: {}",
            appended_since(dir, from)
        )),
    }
}

/// A launcher's stderr goes to `wrapper.log` (a file, never a pipe: a tmux server or the
/// detached wrapper it starts could keep a pipe open, and reading it would then hang). The
/// returned length lets an error quote only what this launch wrote.
fn launcher_stderr(dir: &Path) -> Result<(File, u64), String> {
    let path = dir.join("wrapper.log");
    let file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    Ok((file, len))
}

fn appended_since(dir: &Path, from: u64) -> String {
    let data = std::fs::read(dir.join("wrapper.log")).unwrap_or_default();
    let new = data.get(from as usize..).unwrap_or_default();
    let text = String::from_utf8_lossy(new);
    let text = text.trim();
    if text.is_empty() {
        "no message".to_string()
    } else {
        text.lines().collect::<Vec<_>>().join(" | ")
    }
}

/// Launchers return quickly (tmux once the session exists, the wrapper once it has forked);
/// one that does not is killed rather than waited for.
fn wait_launcher(
    mut child: std::process::Child,
    what: &str,
) -> Result<std::process::ExitStatus, String> {
    match proc::wait_deadline(&mut child, Instant::now() + START_TIMEOUT) {
        Ok(Some(status)) => Ok(status),
        Ok(None) => {
            proc::kill_and_reap(&mut child, KILL_VERIFY);
            Err(format!(
                "{what} did not return within {} s",
                START_TIMEOUT.as_secs()
            ))
        }
        Err(e) => {
            proc::kill_and_reap(&mut child, KILL_VERIFY);
            Err(format!("waiting for {what}: {e}"))
        }
    }
}

fn wrapper_log_hint(dir: &Path) -> String {
    let text = std::fs::read(dir.join("wrapper.log")).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let tail: Vec<&str> = text.lines().rev().take(5).collect();
    if tail.is_empty() {
        String::new()
    } else {
        let lines: Vec<&str> = tail.into_iter().rev().collect();
        format!("; wrapper log: {}", lines.join(" | "))
    }
}

/// Wait for the wrapper of launch `id` to write its state, or to report why it could not.
fn finish_start(dir: &Path, name: &str, id: &str) -> Result<JobInfo, AgentError> {
    let deadline = Instant::now() + START_TIMEOUT;
    let marker = format!("launch={id} error: ");
    loop {
        if let Some(st) = read_optional(&dir.join("state"))?
            && st.get("launch") == Some(id)
        {
            if let Some(err) = st.get("error") {
                return Err(AgentError::new(
                    ErrorCode::Io,
                    format!("job '{name}' could not start: {err}"),
                ));
            }
            // Both records, read as any status read does (a job that ends at once is not
            // taken for lost).
            return load_dir(dir)?
                .and_then(|job| job.info())
                .ok_or_else(|| internal("job state vanished"));
        }
        let wlog = std::fs::read(dir.join("wrapper.log")).unwrap_or_default();
        let wlog = String::from_utf8_lossy(&wlog);
        if let Some(line) = wlog.lines().find(|l| l.contains(&marker)) {
            let msg = line.split_once(&marker).map(|(_, m)| m).unwrap_or(line);
            let _ = std::fs::remove_file(dir.join("spec"));
            let code = match msg.starts_with(crate::lease::BUSY) {
                true => ErrorCode::Busy,
                false => ErrorCode::Internal,
            };
            let msg = format!("job '{name}' could not start: {msg}");
            return Err(AgentError::new(code, msg));
        }
        if Instant::now() >= deadline {
            // Remove the spec so a wrapper that comes up late finds nothing to run.
            let _ = std::fs::remove_file(dir.join("spec"));
            return Err(internal(format!(
                "job '{name}' did not report running within {} s{}",
                START_TIMEOUT.as_secs(),
                wrapper_log_hint(dir)
            )));
        }
        std::thread::sleep(POLL);
    }
}

// ---------------------------------------------------------------------------------------------
// status, kill, list

pub(crate) fn status_in(ctx: &Ctx, req: &JobStatusRequest) -> Result<JobStatusResult, AgentError> {
    validate_name(&req.name)?;
    let job = load(ctx, &req.name)?;
    let info = job.as_ref().and_then(Job::info);
    let override_log = req
        .log_file
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty());
    let (path, floor) = match (override_log, &info) {
        (Some(p), _) => {
            check_text("log_file", p)?;
            (normalize(&ctx.home.join(expand_tilde(p, &ctx.home))), 0)
        }
        (None, Some(i)) => {
            let floor = job
                .as_ref()
                .and_then(|j| j.state.as_ref())
                .and_then(|s| s.get_u64("log_offset"));
            (PathBuf::from(&i.log_file), floor.unwrap_or(0))
        }
        (None, None) => {
            return Ok(JobStatusResult {
                info: None,
                log_found: false,
                log: Vec::new(),
                log_start: 0,
                next_offset: req.offset.unwrap_or(0),
                log_size: 0,
                log_truncated: false,
            });
        }
    };
    let cap = if req.max_bytes == 0 {
        LOG_CAP
    } else {
        req.max_bytes.min(LOG_CAP)
    };
    let read = match req.offset {
        Some(off) => logread::read_cursor(&path, off, cap),
        None => logread::read_tail(&path, req.last_n_lines, cap, floor),
    };
    let slice =
        read.map_err(|e| AgentError::from_io(&e, "log file", &path.display().to_string()))?;
    Ok(JobStatusResult {
        info,
        log_found: slice.found,
        log: slice.data,
        log_start: slice.start,
        next_offset: slice.next_offset,
        log_size: slice.size,
        log_truncated: slice.truncated,
    })
}

pub(crate) fn kill_in(ctx: &Ctx, req: &JobKillRequest) -> Result<JobInfo, AgentError> {
    validate_name(&req.name)?;
    let not_found = || AgentError::new(ErrorCode::NotFound, format!("no job named '{}'", req.name));
    let job = load(ctx, &req.name)?.ok_or_else(not_found)?;
    let info = job.info().ok_or_else(not_found)?;
    if info.state != JobState::Running {
        return Ok(info);
    }
    let st = job.state.as_ref().ok_or_else(not_found)?;
    if let Some(h) = st.get("host").filter(|h| *h != hostname()) {
        return Err(AgentError::new(
            ErrorCode::Unsupported,
            format!("job '{}' runs on host {h}; kill it from there", req.name),
        ));
    }
    let pgid = st.get_u64("pgid").unwrap_or(0);
    let group = u32::try_from(pgid)
        .ok()
        .and_then(proc::Group::new)
        .ok_or_else(|| {
            internal(format!(
                "job '{}' is running but its record names no process group ({pgid})",
                req.name
            ))
        })?;
    // The job is signalled directly, not through the wrapper: the wrapper then sees its child
    // end by this signal and records it. Done means both: no member of the group runs (a
    // background process that ignores SIGTERM gets SIGKILL too) and the end is on record.
    let grace = Duration::from_millis(req.grace_ms).min(MAX_GRACE);
    let mut last = Ok(None);
    let stopped = group.terminate_blocking(grace, KILL_SETTLE, || {
        last = load(ctx, &req.name).map(|j| j.and_then(|j| j.info()));
        match &last {
            Ok(Some(i)) => i.state != JobState::Running,
            Ok(None) => false,
            Err(_) => true,
        }
    });
    match (stopped, last?) {
        (proc::Stopped::ByTerm | proc::Stopped::ByKill, Some(done)) => Ok(done),
        (proc::Stopped::Unconfirmed(pids), Some(done)) if done.state != JobState::Running => {
            Err(internal(format!(
                "job '{}' ended, but processes it started still run {} s after SIGKILL: pids {}",
                req.name,
                KILL_SETTLE.as_secs(),
                proc::pid_list(&pids)
            )))
        }
        _ => Err(internal(format!(
            "job '{}' (process group {pgid}) was sent SIGKILL but its wrapper has not recorded an end after {} s",
            req.name,
            KILL_SETTLE.as_secs()
        ))),
    }
}

pub(crate) fn list_in(ctx: &Ctx) -> Result<Vec<JobInfo>, AgentError> {
    let entries = match std::fs::read_dir(&ctx.root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(AgentError::from_io(
                &e,
                "jobs directory",
                &ctx.root.display().to_string(),
            ));
        }
    };
    let mut jobs = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if validate_name(&name).is_err() {
            continue;
        }
        // One unreadable record must not hide every other job.
        if let Ok(Some(info)) = load(ctx, &name).map(|j| j.and_then(|j| j.info())) {
            jobs.push(info);
        }
    }
    jobs.sort_by(|a, b| {
        b.started_ms
            .cmp(&a.started_ms)
            .then_with(|| a.name.cmp(&b.name))
    });
    Ok(jobs)
}

// ---------------------------------------------------------------------------------------------
// CLI output

/// `YYYY-MM-DDTHH:MM:SSZ` (the seed's `date -u +%Y-%m-%dT%H:%M:%SZ`), without a date crate.
pub(crate) fn utc_timestamp(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn state_word(s: JobState) -> &'static str {
    match s {
        JobState::Running => "running",
        JobState::Exited => "exited",
        JobState::Lost => "lost",
    }
}

fn exit_word(j: &JobInfo) -> String {
    match (j.exit_code, j.signal) {
        (_, Some(sig)) => format!("signal {sig}"),
        (Some(c), None) => c.to_string(),
        (None, None) => "-".to_string(),
    }
}

fn jobs_table(jobs: &[JobInfo]) -> String {
    if jobs.is_empty() {
        return "no jobs\n".to_string();
    }
    let header = ["NAME", "STATE", "EXIT", "RUNNER", "STARTED", "LOG"];
    let rows: Vec<[String; 6]> = jobs
        .iter()
        .map(|j| {
            [
                j.name.clone(),
                state_word(j.state).to_string(),
                exit_word(j),
                j.runner.clone(),
                utc_timestamp(j.started_ms),
                j.log_file.clone(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[&str]| {
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        out.push('\n');
    };
    line(&header);
    for r in &rows {
        line(&r.each_ref().map(String::as_str));
    }
    out
}

fn json_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "null".to_string(), |v| v.to_string())
}

fn jobs_json(jobs: &[JobInfo]) -> String {
    let mut out = String::from("[");
    for (i, j) in jobs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("\n  {\"name\": ");
        out.push_str(&json_string(&j.name));
        out.push_str(&format!(", \"state\": \"{}\"", state_word(j.state)));
        out.push_str(&format!(", \"exit_code\": {}", json_opt(j.exit_code)));
        out.push_str(&format!(", \"signal\": {}", json_opt(j.signal)));
        out.push_str(", \"runner\": ");
        out.push_str(&json_string(&j.runner));
        out.push_str(&format!(", \"pid\": {}", j.pid));
        out.push_str(&format!(", \"started_ms\": {}", j.started_ms));
        out.push_str(&format!(", \"ended_ms\": {}", json_opt(j.ended_ms)));
        out.push_str(", \"cwd\": ");
        out.push_str(&json_string(&j.cwd));
        out.push_str(", \"log_file\": ");
        out.push_str(&json_string(&j.log_file));
        out.push_str(", \"command\": ");
        out.push_str(&json_string(&j.command));
        out.push('}');
    }
    out.push_str(if jobs.is_empty() { "]\n" } else { "\n]\n" });
    out
}
