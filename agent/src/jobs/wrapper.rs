//! `rsb-agent job-run`: the process a job runs under, in tmux or detached with setsid.
//!
//! It reads the spec `start` wrote, runs `bash -c CMD` as its child in a new session (so the
//! job is its own process group and has no terminal), copies the child's output into the
//! log, and records the end from `waitpid`. Because the exit status is the child's, the user's
//! `exit`, `set -e`, `set -u` or a last line of any length cannot lose it.
//!
//! Its own exit status is the job's (code, or the job's signal raised again), because a batch
//! scheduler such as Slurm takes the batch script's status as the job's result.
//!
//! Signals: SIGTERM, SIGINT and SIGUSR1 are forwarded to the job's group (`scancel` and
//! Slurm's `--signal=B:USR1@N` signal only the batch process, which is this one). SIGHUP is
//! caught rather than fatal: under tmux it means the session was killed from outside, so the
//! wrapper passes the hangup on to the job (as a terminal would have), keeps supervising until
//! the job ends, and records `hangup=1`, which status reports as `Lost`: the job did not end on
//! its own.
//! Nothing else sends SIGHUP: the setsid runner has no terminal, and tmux keeps its panes
//! when an SSH client disconnects.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;

use super::record::Record;
use super::{hostname, now_ms, utc_timestamp, validate_name};
use crate::proc::{self, Group, Signal};

/// How long output is still copied after the job's shell exits. Processes it left running in
/// the background may hold the pipe open forever; their later output is not captured.
pub const DRAIN: Duration = Duration::from_secs(1);

struct Opts {
    root: PathBuf,
    name: String,
    launch: String,
    runner: String,
    detach: bool,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let (mut root, mut name, mut launch, mut runner, mut detach) = (None, None, None, None, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "--root" => root = Some(PathBuf::from(value()?)),
            "--name" => name = Some(value()?),
            "--launch" => launch = Some(value()?),
            "--runner" => runner = Some(value()?),
            "--detach" => detach = true,
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    let opts = Opts {
        root: root.ok_or("--root is required")?,
        name: name.ok_or("--name is required")?,
        launch: launch.ok_or("--launch is required")?,
        runner: runner.unwrap_or_else(|| "setsid".to_string()),
        detach,
    };
    validate_name(&opts.name).map_err(|e| e.message)?;
    Ok(opts)
}

pub fn main(args: &[String]) -> i32 {
    let opts = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "rsb-agent job-run: {e}\nusage: rsb-agent job-run --root DIR --name NAME --launch ID \
                 [--runner tmux|setsid] [--detach]\n(internal: started by the agent for background jobs)"
            );
            return 2;
        }
    };
    if opts.detach {
        // Still single-threaded here, so forking is safe. The parent exits at once and is
        // reaped by whoever started it; the child is adopted by init and carries on.
        // SAFETY: the process is single-threaded here (nothing has spawned a thread yet), so
        // the child may go on running arbitrary code after fork.
        match unsafe { libc::fork() } {
            -1 => {
                let err = std::io::Error::last_os_error();
                diag(&opts, &format!("fork failed: {err}"));
                return 1;
            }
            0 => {
                // Cannot fail: the fresh child of a fork is never a group leader.
                let _ = rustix::process::setsid();
            }
            _ => return 0,
        }
    }
    match run(&opts) {
        Ok(code) => code,
        Err(msg) => {
            diag(&opts, &msg);
            1
        }
    }
}

/// Append a line to the job's `wrapper.log`, which `start` reads to explain a failed launch.
/// Under tmux the wrapper's stderr is a pane nobody watches, so it is not used.
fn diag(opts: &Opts, msg: &str) {
    let path = opts.root.join(&opts.name).join("wrapper.log");
    let line = format!(
        "{} launch={} error: {msg}\n",
        utc_timestamp(now_ms()),
        opts.launch
    );
    let written = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if written.is_err() {
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
}

/// Signals arrive on a self-pipe so the main loop can wait for output and signals in one
/// `poll`, with no work done inside the handler.
static SIGNAL_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let saved = errno::get();
    let fd = SIGNAL_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = sig as u8;
        // SAFETY: write(2) is async-signal-safe; the pipe is non-blocking so a full pipe drops
        // the byte instead of deadlocking (a pending byte already wakes the loop).
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
    errno::set(saved);
}

mod errno {
    pub fn get() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    pub fn set(v: i32) {
        // SAFETY: errno is thread-local; the location is always valid.
        unsafe { *libc::__errno_location() = v };
    }

    #[cfg(target_vendor = "apple")]
    pub fn set(v: i32) {
        // SAFETY: as above.
        unsafe { *libc::__error() = v };
    }

    #[cfg(not(any(target_os = "linux", target_os = "android", target_vendor = "apple")))]
    pub fn set(_v: i32) {}
}

/// A close-on-exec pipe, optionally non-blocking. Set with `fcntl` rather than `pipe2` so the
/// agent still builds on macOS for development; the wrapper is single-threaded, so nothing can
/// fork between the two calls.
fn pipe(nonblocking: bool) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    use rustix::io::{FdFlags, fcntl_setfd};
    let (r, w) = rustix::pipe::pipe()?;
    for fd in [&r, &w] {
        fcntl_setfd(fd, FdFlags::CLOEXEC)?;
        if nonblocking {
            fcntl_setfl(fd, fcntl_getfl(fd)? | OFlags::NONBLOCK)?;
        }
    }
    Ok((r, w))
}

fn install_signals() -> std::io::Result<OwnedFd> {
    let (r, w) = pipe(true)?;
    SIGNAL_FD.store(w.as_raw_fd(), Ordering::Relaxed);
    // The write end must live for the whole process; the handler refers to it by number.
    std::mem::forget(w);
    for sig in [
        libc::SIGTERM,
        libc::SIGINT,
        libc::SIGUSR1,
        libc::SIGHUP,
        libc::SIGCHLD,
    ] {
        // SAFETY: a zeroed sigaction plus handler and flags is a valid argument; the handler
        // only calls async-signal-safe functions. Handled (not ignored) signals revert to
        // their defaults in the job at exec.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART
                | if sig == libc::SIGCHLD {
                    libc::SA_NOCLDSTOP
                } else {
                    0
                };
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(r)
}

/// The log, plus what is needed to put `EXIT_CODE=` on a line of its own.
struct Log {
    file: File,
    last: u8,
    failed: Option<String>,
}

impl Log {
    fn write(&mut self, data: &[u8]) {
        if data.is_empty() || self.failed.is_some() {
            return;
        }
        // A full disk must not stop the job: the pipe keeps being drained, the loss is noted.
        match self.file.write_all(data) {
            Ok(()) => self.last = data[data.len() - 1],
            Err(e) => self.failed = Some(format!("writing the log failed: {e}")),
        }
    }

    fn line_start(&mut self) {
        if self.last != b'\n' {
            self.write(b"\n");
        }
    }
}

/// The tmux pane, when there is one: output is echoed there for someone who attaches. It is
/// non-blocking and best effort, so a stalled or vanished pane never holds up the job.
struct Pane {
    on: bool,
}

impl Pane {
    fn open(runner: &str) -> Pane {
        let out = std::io::stdout();
        let on = runner == "tmux" && out.is_terminal();
        if on {
            use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
            if let Ok(fl) = fcntl_getfl(&out) {
                let _ = fcntl_setfl(&out, fl | OFlags::NONBLOCK);
            }
        }
        Pane { on }
    }

    fn write(&mut self, data: &[u8]) {
        if !self.on {
            return;
        }
        // Straight to fd 1, past std's line buffer, so a partial write is never retried
        // into a pane that stopped reading.
        if let Err(e) = rustix::io::write(std::io::stdout(), data)
            && e != Errno::AGAIN
        {
            self.on = false;
        }
    }
}

fn header(name: &str, started_ms: u64, command: &str) -> String {
    let collapsed = command.split_whitespace().collect::<Vec<_>>().join(" ");
    let preview: String = collapsed.chars().take(120).collect();
    let [session, started_at, command] = rsb_protocol::LOG_HEADER;
    format!(
        "{session}{name}\n{started_at}{}\n{command}{preview}\n",
        utc_timestamp(started_ms)
    )
}

/// The job's command, started; with what of its confinement this host could not give (allowed
/// by `require = false`).
fn spawn_job(spec: &Record, cwd: &Path, out: OwnedFd) -> std::io::Result<(Child, Option<String>)> {
    let command = spec.get("command").unwrap_or_default();
    let env: Vec<(&std::ffi::OsStr, &std::ffi::OsStr)> = spec
        .get_all("env")
        .filter_map(|kv| {
            let eq = kv.iter().position(|&b| b == b'=')?;
            Some((
                std::ffi::OsStr::from_bytes(&kv[..eq]),
                std::ffi::OsStr::from_bytes(&kv[eq + 1..]),
            ))
        })
        .collect();
    // bash is looked up on the job's own PATH, by the agent's one PATH policy.
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| *k == "PATH")
        .map(|(_, v)| *v);
    let bash = proc::find_executable("bash", path).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "bash not found on the job's PATH ({})",
                path.map_or_else(
                    || format!("unset, so {}", proc::DEFAULT_PATH),
                    |p| p.to_string_lossy().into_owned()
                )
            ),
        )
    })?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(bash);
    cmd.arg0("bash").arg("-c").arg(command).current_dir(cwd);
    // A batch job (`inherit_env=1`, written by rsb's Slurm submit) starts from the environment
    // Slurm gave the batch script (SLURM_JOB_ID, CUDA_VISIBLE_DEVICES), with the spec on top.
    if spec.get("inherit_env") != Some("1") {
        cmd.env_clear();
    }
    cmd.envs(env)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    // Its own session: its own process group for kill, and no terminal, so a tmux pane
    // closing or a shell job-control signal cannot reach it except through us. If the wrapper
    // is killed outright nobody would record the end, so the job would run unsupervised and be
    // reported lost; SIGTERM ends it too. (It survives bash's exec of a single command, so it
    // usually reaches the real program.)
    proc::new_session(&mut cmd, Some(Signal::TERM));
    // Confined as `start` decided (the roots are absolute in the spec): the job's command and
    // all it starts; this wrapper, which writes the log and the record, stays outside.
    // A Slurm job's is decided here, on the compute node: it may serve another Landlock ABI
    // than the login node, or none.
    let mut unconfined = None;
    let _ruleset = match super::record::confine_of(spec) {
        Some(c) => match crate::confine::prepare(&c) {
            Ok(crate::confine::Decision::Confine(p, partial)) => {
                p.apply_in_child(&mut cmd);
                unconfined = partial;
                Some(p)
            }
            Ok(crate::confine::Decision::Unconfined(why)) => {
                unconfined = Some(why);
                None
            }
            Err(e) => return Err(Refused(e.message).into()),
        },
        None => None,
    };
    Ok((proc::spawn(&mut cmd)?, unconfined))
}

/// The job's confinement cannot be given on this host and is required: the job does not run.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

impl From<Refused> for std::io::Error {
    fn from(r: Refused) -> Self {
        std::io::Error::other(r)
    }
}

fn run(opts: &Opts) -> Result<i32, String> {
    let dir = opts.root.join(&opts.name);
    let mut spec =
        Record::read(&dir.join("spec")).map_err(|e| format!("cannot read the job spec: {e}"))?;
    if spec.get("launch") != Some(opts.launch.as_str()) {
        // Superseded by a newer launch (or abandoned by a `start` that gave up): do nothing.
        return Err(format!(
            "the spec belongs to launch {}, not this one; not starting",
            spec.get("launch").unwrap_or("?")
        ));
    }
    if spec.get("name") != Some(opts.name.as_str()) {
        return Err("the spec names another job".to_string());
    }
    let cwd = PathBuf::from(std::ffi::OsStr::from_bytes(
        spec.get_bytes("cwd").unwrap_or(b"/"),
    ));
    let log_path = PathBuf::from(std::ffi::OsStr::from_bytes(
        spec.get_bytes("log_file").unwrap_or_default(),
    ));
    let command = spec
        .get("command")
        .ok_or("the job spec has no command")?
        .to_string();
    // Hold no directory busy (an unmount of the caller's cwd must not be blocked by us).
    let _ = std::env::set_current_dir("/");
    // GPUs first, so a start that finds none free leaves no log behind. The leases are this
    // process's open files: they end when it does.
    let mut gpus = Vec::new();
    let _leases = match spec.get_u64("gpu_count") {
        Some(count) => {
            let ask: Vec<String> = spec
                .get_all("gpu")
                .map(|u| String::from_utf8_lossy(u).into())
                .collect();
            let (uuids, files) = crate::lease::take(&ask, count as usize)?;
            spec.push("env", format!("CUDA_VISIBLE_DEVICES={}", uuids.join(",")));
            spec.push("env", "CUDA_DEVICE_ORDER=PCI_BUS_ID");
            gpus = uuids;
            files
        }
        None => Vec::new(),
    };

    let sig_r = install_signals().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    // A confined job's log outside its own directory keeps to the write roots, as at start.
    let own_log = log_path == opts.root.join(&opts.name).join(rsb_protocol::CONFINED_LOG);
    let file = match super::record::confine_of(&spec).filter(|_| !own_log) {
        Some(c) => crate::confine::open_log(&c, &log_path).map_err(|e| e.message)?,
        None => std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open log {}: {e}", log_path.display()))?,
    };
    let log_offset = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut log = Log {
        file,
        last: b'\n',
        failed: None,
    };
    let mut pane = Pane::open(&opts.runner);
    let started_ms = now_ms();
    let head = header(&opts.name, started_ms, &command);
    log.write(head.as_bytes());
    pane.write(head.as_bytes());

    let mut state = Record::new();
    state.set("name", &opts.name);
    state.set("launch", &opts.launch);
    state.set("host", hostname());
    state.set("runner", &opts.runner);
    state.set("wrapper_pid", std::process::id().to_string());
    if let Some(start) = proc::start_ticks(std::process::id()) {
        state.set("wrapper_start", start.to_string());
    }
    state.set("started_ms", started_ms.to_string());
    state.set("log_offset", log_offset.to_string());
    if !gpus.is_empty() {
        state.set("gpus", gpus.join(","));
    }
    let state_path = dir.join("state");
    let save = |st: &Record| {
        st.write_atomic(&state_path)
            .map_err(|e| format!("cannot write the job state: {e}"))
    };

    // Where the kernel cannot end the job when this wrapper dies (macOS has no parent-death
    // signal), a reaper started before the job guards its group until its leader exits.
    let mut guard = None;
    if !proc::parent_death_signal() {
        match crate::reaper::Guard::start() {
            Ok(g) => guard = Some(g),
            Err(e) => log.write(
                format!("rsb-agent: cannot start the job's guard ({e}); if this wrapper is killed outright, the job runs on unsupervised\n")
                    .as_bytes(),
            ),
        }
    }
    let (out_r, out_w) = pipe(false).map_err(|e| format!("cannot create a pipe: {e}"))?;
    // The kernel's OOM counters as of the last two ticks (a second apart while the job runs):
    // only a kill counted in the last one to two seconds of the job's life can be its own.
    let mut oom = [super::oom::counts(); 2];
    let mut oom_at = Instant::now();
    let mut child = match spawn_job(&spec, &cwd, out_w) {
        Ok((c, unconfined)) => {
            if let Some(why) = unconfined {
                log.write(
                    format!("rsb-agent: unconfined: {why}; the job runs without that confinement (confine.require = false)\n")
                        .as_bytes(),
                );
            }
            c
        }
        Err(e) => {
            // Recorded as an ended job (127, like a shell that cannot find a command) so the
            // reason is in the log and the record, and `start` reports it as an error.
            let msg = match e.get_ref().and_then(|i| i.downcast_ref::<Refused>()) {
                Some(r) => r.0.clone(),
                None => format!("cannot start bash in {}: {e}", cwd.display()),
            };
            log.write(format!("rsb-agent: {msg}\n{}127\n", rsb_protocol::LOG_EXIT_CODE).as_bytes());
            state.set("pid", "0");
            state.set("pgid", "0");
            state.set("error", &msg);
            state.set("exit_code", "127");
            state.set("ended_ms", now_ms().to_string());
            save(&state)?;
            return Ok(127);
        }
    };
    let pgid = child.id();
    let group = Group::new(pgid);
    if let (Some(g), Some(group)) = (&mut guard, group) {
        match g.register(group) {
            Ok(()) => state.set("guard_pid", g.pid().to_string()),
            Err(e) => log.write(format!("rsb-agent: the job's guard is gone ({e}); if this wrapper is killed outright, the job runs on unsupervised\n").as_bytes()),
        }
    }
    state.set("pid", pgid.to_string());
    state.set("pgid", pgid.to_string());
    save(&state)?;

    let mut hangup = false;
    let mut exited: Option<std::process::ExitStatus> = None;
    let mut drain_until: Option<Instant> = None;
    let mut out_open = true;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if exited.is_none()
            && let Ok(Some(st)) = child.try_wait()
        {
            exited = Some(st);
            drain_until = Some(Instant::now() + DRAIN);
            if let Some(g) = &mut guard {
                g.release();
            }
        }
        if let Some(until) = drain_until
            && (!out_open || Instant::now() >= until)
        {
            break;
        }
        if exited.is_none() && oom_at.elapsed() >= super::oom::TICK {
            oom = [oom[1], super::oom::counts()];
            oom_at = Instant::now();
        }
        let wait = match drain_until {
            Some(until) => until
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
            None => super::oom::TICK,
        };
        let timeout = Timespec::try_from(wait).unwrap_or(Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        });
        let mut fds = [
            PollFd::new(&sig_r, PollFlags::IN),
            PollFd::new(&out_r, PollFlags::IN),
        ];
        // A closed output pipe is left out of the set.
        let watched = if out_open { 2 } else { 1 };
        match rustix::event::poll(&mut fds[..watched], Some(&timeout)) {
            Ok(_) => {}
            Err(Errno::INTR) => continue,
            Err(e) => return Err(format!("poll failed: {e}")),
        }
        let sig_ready = !fds[0].revents().is_empty();
        let out_ready = out_open && !fds[1].revents().is_empty();
        if sig_ready {
            let mut sigs = [0u8; 64];
            let got = rustix::io::read(&sig_r, &mut sigs).unwrap_or(0);
            for &s in &sigs[..got] {
                let Some(sig) = Signal::from_named_raw(i32::from(s)) else {
                    continue;
                };
                if exited.is_some() || sig == Signal::CHILD {
                    continue;
                }
                if sig == Signal::HUP {
                    hangup = true;
                    pane.on = false;
                }
                // SIGCONT after it, so a stopped job can act on what it was sent.
                if let Some(g) = group {
                    g.signal(sig);
                    g.signal(Signal::CONT);
                }
            }
        }
        if out_ready {
            match rustix::io::read(&out_r, &mut buf) {
                Ok(0) => out_open = false,
                Ok(got) => {
                    let data = &buf[..got];
                    log.write(data);
                    pane.write(data);
                }
                Err(Errno::INTR) => {}
                Err(_) => out_open = false,
            }
        }
    }
    drop(out_r);

    let status = exited.unwrap_or_else(|| std::process::ExitStatus::from_raw(0));
    let (code, signal) = match (status.code(), status.signal()) {
        (Some(c), _) => (c, None),
        (None, Some(s)) => (128 + s, Some(s)),
        (None, None) => (255, None),
    };
    log.line_start();
    let tail = format!("{}{code}\n", rsb_protocol::LOG_EXIT_CODE);
    log.write(tail.as_bytes());
    pane.write(tail.as_bytes());
    match signal {
        Some(s) => state.set("signal", s.to_string()),
        None => state.set("exit_code", code.to_string()),
    }
    // SIGKILL, the job's own or its shell's report of its command's (137), just after the
    // kernel counted an OOM kill: the OOM killer's work.
    if (signal == Some(libc::SIGKILL) || code == 128 + libc::SIGKILL)
        && let Some(k) = super::oom::since(oom[0])
    {
        state.set("oom_kill", super::oom::word(k));
    }
    if hangup {
        state.set("hangup", "1");
    }
    if let Some(e) = &log.failed {
        state.set("log_error", e);
    }
    state.set("ended_ms", now_ms().to_string());
    save(&state)?;
    // A batch scheduler (Slurm) takes this process's status as the job's result, so it is the
    // command's: its code, or its signal raised again on ourselves.
    if let Some(s) = signal {
        reraise(s);
    }
    Ok(code)
}

/// End this process by `sig` with its default action, so whoever waits on the wrapper sees the
/// job's signal. Returns only if the signal does not end a process by default (then the caller
/// exits with 128 + signal).
fn reraise(sig: i32) {
    // SAFETY: resetting a disposition to SIG_DFL, unblocking it and raising it are plain
    // syscalls with no memory handed over; core dumps are turned off first so a re-raised
    // SIGSEGV from the job does not leave a second core of the wrapper.
    unsafe {
        let off = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &off);
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(sig);
    }
}
