//! `exec`: run `bash -c CMD` to completion with a timeout the agent enforces itself.
//!
//! The command runs in its own process group so that a timeout or cancel can stop everything it
//! started (`killpg`), not just bash. stdin is /dev/null unless the caller asked to feed it, so a
//! command that reads input (`cat`) from the MCP tool ends at once instead of hanging until its
//! timeout. Output is kept within caps while being read, so a command printing gigabytes costs
//! the agent no more memory than the caps.
//!
//! Input (`rsb exec` like `ssh host cmd`): with `stdin` the command's stdin is a pipe, written
//! from the request's input frames with the pipe's own back-pressure, and each written piece is
//! acknowledged so the caller's window reopens. With `tty` the command runs on a pseudo-terminal
//! the agent allocates (a new session whose controlling terminal it is, like sshd does), input
//! and output go through the master side, and a resize sets the terminal's window size (the
//! kernel then sends SIGWINCH to the foreground job).

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use rsb_protocol::{
    AgentError, Captured, Chunk, ErrorCode, ExecInput, ExecRequest, ExecResult, MAX_CHUNK,
    MAX_FRAME, TtySize,
};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::process::Child;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::proc::{self, Group, KillOnDrop, Stopped};
use crate::responder::Responder;
use crate::util::{expand_home, path_string};

/// After the main process ends, how long output may keep arriving before the reply goes out.
/// Background children (`sleep 100 &`) inherit the pipes and would otherwise hold the reply
/// until they exit.
const DRAIN: Duration = Duration::from_millis(200);
/// Most output taken from a pipe after the drain deadline: what was already buffered in it
/// (64 KiB by default, 1 MiB at most for an unprivileged user). Bounded because a background
/// process may keep writing.
const SWEEP_MAX: usize = 1 << 20;
/// Read size; also the largest streamed chunk, well under [`MAX_CHUNK`].
const READ_BUF: usize = 64 * 1024;
/// Per-stream cap, so that stdout and stderr at their caps still fit one reply frame.
const MAX_CAP: u64 = (MAX_FRAME as u64 - 64 * 1024) / 2;
/// Longest SIGTERM grace honoured. An agent shutting down (stdin EOF) waits for it, so an
/// absurd value must not keep a dead session's agent alive for hours.
const MAX_GRACE: Duration = Duration::from_secs(60);
/// How long to wait for the group to vanish after SIGKILL before replying anyway.
const KILL_VERIFY: Duration = Duration::from_secs(1);

const _: () = assert!(READ_BUF <= MAX_CHUNK);

/// Output within a cap: the first ⌈cap/2⌉ bytes and a ring of the last ⌊cap/2⌋. While the total
/// fits the cap nothing is dropped, and [`Capture::finish`] joins the two into `head`.
struct Capture {
    head: Vec<u8>,
    head_cap: usize,
    tail: VecDeque<u8>,
    tail_cap: usize,
    total: u64,
}

impl Capture {
    fn new(cap: u64) -> Self {
        let cap = cap.min(MAX_CAP) as usize;
        Self {
            head: Vec::new(),
            head_cap: cap.div_ceil(2),
            tail: VecDeque::new(),
            tail_cap: cap / 2,
            total: 0,
        }
    }

    fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        let take = (self.head_cap - self.head.len()).min(data.len());
        self.head.extend_from_slice(&data[..take]);
        data = &data[take..];
        if data.is_empty() || self.tail_cap == 0 {
            return;
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
        } else {
            let excess = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
            self.tail.drain(..excess);
            self.tail.extend(data);
        }
    }

    fn finish(self) -> Captured {
        let mut head = self.head;
        let tail: Vec<u8> = self.tail.into();
        if self.total <= (self.head_cap + self.tail_cap) as u64 {
            head.extend_from_slice(&tail);
            Captured {
                head,
                tail: Vec::new(),
                total: self.total,
            }
        } else {
            Captured {
                head,
                tail,
                total: self.total,
            }
        }
    }
}

/// Read one pipe into a capture (and stream it) until EOF, or until [`DRAIN`] after `done`.
///
/// The drain deadline bounds only the wait for *new* output. A chunk already read is streamed
/// even if the writer is backed up (the reply waits behind it anyway), and whatever already sits
/// in the pipe when the deadline passes is swept up, so a slow client costs no output.
async fn read_pipe<P: AsyncRead + AsFd + Unpin>(
    pipe: Option<P>,
    cap: u64,
    mut stream: Option<&Responder>,
    wrap: fn(Vec<u8>) -> Chunk,
    done: &CancellationToken,
) -> Captured {
    let mut capture = Capture::new(cap);
    let Some(mut pipe) = pipe else {
        return capture.finish();
    };
    let stop = async {
        done.cancelled().await;
        tokio::time::sleep(DRAIN).await;
    };
    tokio::pin!(stop);
    let mut buf = vec![0u8; READ_BUF];
    let mut stopped = false;
    loop {
        let n = tokio::select! {
            r = pipe.read(&mut buf) => match r {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            _ = &mut stop => {
                stopped = true;
                break;
            }
        };
        capture.push(&buf[..n]);
        forward(&mut stream, wrap, &buf[..n]).await;
    }
    if stopped {
        set_nonblocking(pipe.as_fd());
        let mut swept = 0;
        while swept < SWEEP_MAX {
            let Some(n) = read_available(pipe.as_fd(), &mut buf) else {
                break;
            };
            capture.push(&buf[..n]);
            forward(&mut stream, wrap, &buf[..n]).await;
            swept += n;
        }
    }
    capture.finish()
}

/// Stream a piece of output; once the channel is gone, stop trying (capturing goes on).
async fn forward(stream: &mut Option<&Responder>, wrap: fn(Vec<u8>) -> Chunk, data: &[u8]) {
    if let Some(s) = stream
        && s.chunk(wrap(data.to_vec())).await.is_err()
    {
        *stream = None;
    }
}

/// tokio already keeps child pipes non-blocking; the sweep must never block on a pipe that a
/// background process holds open, so it does not rely on that.
fn set_nonblocking(fd: BorrowedFd<'_>) {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    if let Ok(flags) = fcntl_getfl(fd)
        && !flags.contains(OFlags::NONBLOCK)
    {
        let _ = fcntl_setfl(fd, flags | OFlags::NONBLOCK);
    }
}

/// One non-blocking read of bytes already in the pipe;
/// `None` at EOF, when nothing is buffered, or on error.
fn read_available(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Option<usize> {
    rustix::io::read(fd, buf).ok().filter(|&n| n > 0)
}

/// Why supervision ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ending {
    Exited,
    TimedOut,
    Cancelled,
}

/// Wait for the command's own end, the timeout, or a cancel; stop the group in the latter two.
/// `done` fires once the main process is finished, which starts the bounded pipe drain.
/// Returns when the command ended, so the pipe drain is not counted in its duration.
async fn supervise(
    child: &mut Child,
    group: Group,
    req: &ExecRequest,
    cancel: &CancellationToken,
    done: &CancellationToken,
) -> (Option<ExitStatus>, Ending, Instant, Vec<u32>) {
    let timer = async {
        if req.timeout_ms == 0 {
            std::future::pending::<()>().await
        } else {
            tokio::time::sleep(Duration::from_millis(req.timeout_ms)).await
        }
    };
    let ending = tokio::select! {
        s = child.wait() => {
            done.cancel();
            return (s.ok(), Ending::Exited, Instant::now(), Vec::new());
        }
        _ = timer => Ending::TimedOut,
        _ = cancel.cancelled() => Ending::Cancelled,
    };
    let grace = Duration::from_millis(req.kill_grace_ms).min(MAX_GRACE);
    let (status, stopped) = proc::terminate(child, group, grace, KILL_VERIFY).await;
    let survivors = match stopped {
        Stopped::Unconfirmed(pids) => pids,
        Stopped::ByTerm | Stopped::ByKill => Vec::new(),
    };
    done.cancel();
    (status, ending, Instant::now(), survivors)
}

fn invalid(msg: impl Into<String>) -> AgentError {
    AgentError::new(ErrorCode::InvalidArgument, msg)
}

fn check_env(env: &[(String, String)]) -> Result<(), AgentError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(invalid(format!(
                "exec: invalid environment variable name {k:?}"
            )));
        }
        if v.contains('\0') {
            return Err(invalid(format!(
                "exec: the value of {k} contains a NUL byte"
            )));
        }
    }
    Ok(())
}

/// The master side of a pseudo-terminal, non-blocking and registered with the runtime; shared
/// by the output reader and the input writer.
struct Pty(Rc<AsyncFd<OwnedFd>>);

impl Pty {
    /// A new terminal of `size`; returns the master and the opened slave.
    fn open(size: TtySize) -> std::io::Result<(Pty, OwnedFd)> {
        use rustix::pty::{OpenptFlags, grantpt, ptsname, unlockpt};
        let master = openpt_cloexec(OpenptFlags::RDWR | OpenptFlags::NOCTTY)?;
        grantpt(&master)?;
        unlockpt(&master)?;
        let name = ptsname(&master, Vec::new())?;
        let slave = rustix::fs::open(
            name.as_c_str(),
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?;
        set_winsize(master.as_fd(), size);
        set_nonblocking(master.as_fd());
        // SAFETY: `master` is an open descriptor owned by the AsyncFd from here on; OwnedFd
        // always reports the same descriptor and closes it only when the AsyncFd drops it.
        let registered = unsafe { AsyncFd::register(master) }?;
        Ok((Pty(Rc::new(registered)), slave))
    }
}

/// `posix_openpt` with close-on-exec: Linux takes `O_CLOEXEC` in the call itself; macOS's
/// takes only `O_RDWR | O_NOCTTY`, so there `FD_CLOEXEC` is set right after, before this
/// function returns the descriptor to anything that could spawn.
fn openpt_cloexec(flags: rustix::pty::OpenptFlags) -> std::io::Result<OwnedFd> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        Ok(rustix::pty::openpt(
            flags | rustix::pty::OpenptFlags::CLOEXEC,
        )?)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let fd = rustix::pty::openpt(flags)?;
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)?;
        Ok(fd)
    }
}

fn set_winsize(fd: BorrowedFd<'_>, size: TtySize) {
    let ws = rustix::termios::Winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let _ = rustix::termios::tcsetwinsize(fd, ws);
}

impl AsFd for Pty {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.get_ref().as_fd()
    }
}

impl AsyncRead for Pty {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            let mut guard = std::task::ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut *unfilled)?)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // EIO: every slave descriptor is closed, which is the terminal's end of file.
                Ok(Err(e)) if e.raw_os_error() == Some(rustix::io::Errno::IO.raw_os_error()) => {
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl Pty {
    async fn write_all(&self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.0.writable().await?;
            match guard.try_io(|fd| Ok(rustix::io::write(fd.get_ref(), data)?)) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }
}

/// Where input frames go.
enum Sink {
    Pipe(Option<tokio::process::ChildStdin>),
    Pty(Pty),
}

/// Feed input frames to the command until it ends. Every data frame is acknowledged, also when
/// it could not be written (the command closed its stdin), so the caller never stalls on a
/// window that cannot reopen.
async fn feed_input(
    mut input: UnboundedReceiver<ExecInput>,
    group: Group,
    mut sink: Sink,
    stream: Option<&Responder>,
    done: &CancellationToken,
) {
    loop {
        let next = tokio::select! {
            m = input.recv() => m,
            _ = done.cancelled() => return,
        };
        let Some(msg) = next else { return };
        match msg {
            ExecInput::Data(data) => {
                let written = async {
                    match &mut sink {
                        Sink::Pipe(Some(pipe)) => {
                            if pipe.write_all(&data).await.is_err() {
                                // EPIPE: the command will read no more; later data is dropped.
                                sink = Sink::Pipe(None);
                            }
                        }
                        Sink::Pipe(None) => {}
                        Sink::Pty(pty) => {
                            let _ = pty.write_all(&data).await;
                        }
                    }
                };
                tokio::select! {
                    () = written => {}
                    _ = done.cancelled() => return,
                }
                if let Some(s) = stream
                    && s.chunk(Chunk::InputConsumed(data.len() as u64))
                        .await
                        .is_err()
                {
                    return;
                }
            }
            ExecInput::Eof => match &mut sink {
                Sink::Pipe(pipe) => *pipe = None,
                // A terminal has no end of file of its own: its EOF character ends a read.
                Sink::Pty(pty) => {
                    let _ = pty.write_all(&[4]).await;
                }
            },
            ExecInput::Resize(size) => {
                if let Sink::Pty(pty) = &sink {
                    set_winsize(pty.as_fd(), size);
                }
            }
            ExecInput::Signal(n) => {
                if let Some(sig) = proc::Signal::from_named_raw(n) {
                    group.signal(sig);
                }
            }
        }
    }
}

/// Make the child a session leader with the terminal on its stdin as controlling terminal
/// (what a login via sshd gets), so job control and ^C work inside it.
fn controlling_terminal(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: runs between fork and exec and makes only the setsid and ioctl system calls
    // (issued directly by rustix), which are async-signal-safe; nothing is allocated. The
    // command is a subreaper, as `proc::new_session` makes it.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::setsid()?;
            crate::proc::keep_descendants()?;
            let stdin = BorrowedFd::borrow_raw(0);
            rustix::process::ioctl_tiocsctty(stdin)?;
            Ok(())
        });
    }
}

/// Run one exec request. `stream` is given when the caller asked for live output (always, when
/// there is `input`: acknowledgements are chunks).
pub async fn run(
    req: ExecRequest,
    cancel: &CancellationToken,
    stream: Option<&Responder>,
    input: Option<UnboundedReceiver<ExecInput>>,
) -> Result<ExecResult, AgentError> {
    if req.command.contains('\0') {
        return Err(invalid("exec: the command contains a NUL byte"));
    }
    check_env(&req.env)?;
    let bash = proc::find_on_path("bash").ok_or_else(|| {
        AgentError::new(
            ErrorCode::NotFound,
            format!(
                "exec: bash not found on the agent's PATH ({}); install bash or fix PATH",
                std::env::var("PATH")
                    .unwrap_or_else(|_| format!("unset, so {}", proc::DEFAULT_PATH))
            ),
        )
    })?;

    // Built before the fork, so a root that cannot be opened is reported by name and nothing
    // runs; applied last in the child, after the session is set up.
    let confined = match &req.confine {
        None => None,
        Some(c) => Some(crate::confine::prepare(c)?),
    };
    let mut cmd = tokio::process::Command::new(&bash);
    cmd.arg("-c").arg(&req.command).kill_on_drop(true);
    let pty = match req.tty {
        Some(size) => {
            let (pty, slave) = Pty::open(size).map_err(|e| {
                AgentError::new(
                    ErrorCode::Io,
                    format!("exec: cannot allocate a pseudo-terminal: {e}"),
                )
            })?;
            let dup = |fd: &OwnedFd| {
                fd.try_clone().map_err(|e| {
                    AgentError::new(ErrorCode::Io, format!("exec: pseudo-terminal: {e}"))
                })
            };
            cmd.stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(slave));
            // setsid makes the new process group; `new_group` would make setsid fail.
            controlling_terminal(cmd.as_std_mut());
            Some(pty)
        }
        None => {
            cmd.stdin(if req.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            // A session of its own, not only a group: what the command starts in groups of
            // its own (GNU `timeout`, job control) stays in the session, so a timeout or a
            // cancel reaches it (see `Group::signal`).
            proc::new_session(cmd.as_std_mut(), None);
            None
        }
    };
    if let Some(cwd) = &req.cwd {
        let dir = expand_home(cwd);
        let checked = dir.clone();
        // The cwd is checked before spawning so a bad one is reported by name and the
        // command never runs somewhere unintended.
        tokio::task::spawn_blocking(move || crate::fs::require_dir(&checked, "cwd"))
            .await
            .map_err(|e| {
                AgentError::new(ErrorCode::Internal, format!("exec: cwd check failed: {e}"))
            })??;
        cmd.current_dir(dir);
    }
    for (k, v) in &req.env {
        cmd.env(k, v);
    }
    let unconfined = match &confined {
        Some(crate::confine::Decision::Confine(p, partial)) => {
            p.apply_in_child(cmd.as_std_mut());
            partial.clone()
        }
        Some(crate::confine::Decision::Unconfined(why)) => Some(why.clone()),
        None => None,
    };

    // The orphan reaper runs before the command does, so registering it below is quick.
    crate::reaper::ready();
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        let mut err = AgentError::from_io(&e, "exec: cannot start", &path_string(&bash));
        // The error may come from entering the cwd (no search permission), so name it too.
        err.message = match &req.cwd {
            Some(cwd) => format!("exec: cannot start {} in {cwd}: {e}", bash.display()),
            None => format!("exec: cannot start {}: {e}", bash.display()),
        };
        err
    })?;
    // The parent's copies of the slave went with `cmd`'s stdio; drop it now so the master sees
    // EIO once the command and its children have closed the terminal.
    drop(cmd);
    let Some(group) = child.id().and_then(Group::new) else {
        return Err(AgentError::new(
            ErrorCode::Internal,
            "exec: the child exited before it could be tracked",
        ));
    };
    // Known to the reaper until this request ends, so a SIGKILLed agent leaves no orphans.
    let _registered = crate::reaper::register(group);
    // Dropped mid-flight (the agent shutting down with the request running): kill the group.
    let mut guard = KillOnDrop::new(group);
    let done = CancellationToken::new();
    let (stdout, stderr, sink) = match pty {
        Some(pty) => {
            let writer = Pty(pty.0.clone());
            (Output::Pty(pty), None, Sink::Pty(writer))
        }
        None => (
            child.stdout.take().map_or(Output::None, Output::Pipe),
            child.stderr.take(),
            Sink::Pipe(child.stdin.take()),
        ),
    };
    let feeding = async {
        match input {
            Some(input) => feed_input(input, group, sink, stream, &done).await,
            None => drop(sink),
        }
    };

    let ((status, ending, ran, survivors), out, err, ()) = tokio::join!(
        supervise(&mut child, group, &req, cancel, &done),
        read_output(stdout, req.max_stdout, stream, &done),
        read_pipe(stderr, req.max_stderr, stream, Chunk::Stderr, &done),
        feeding,
    );
    // Finished on its own terms: anything still running was started in the background on
    // purpose (`server &`) and is left alone.
    guard.disarm();
    let duration_ms = ran.duration_since(start).as_millis().min(u64::MAX as u128) as u64;

    Ok(ExecResult {
        exit_code: status.and_then(|s| s.code()),
        signal: status.and_then(|s| s.signal()),
        timed_out: ending == Ending::TimedOut,
        cancelled: ending == Ending::Cancelled,
        duration_ms,
        stdout: out,
        stderr: err,
        survivors,
        unconfined,
    })
}

/// The command's stdout: a pipe, or the terminal's master side.
enum Output {
    None,
    Pipe(tokio::process::ChildStdout),
    Pty(Pty),
}

async fn read_output(
    out: Output,
    cap: u64,
    stream: Option<&Responder>,
    done: &CancellationToken,
) -> Captured {
    match out {
        Output::None => {
            read_pipe(
                None::<tokio::process::ChildStdout>,
                cap,
                stream,
                Chunk::Stdout,
                done,
            )
            .await
        }
        Output::Pipe(p) => read_pipe(Some(p), cap, stream, Chunk::Stdout, done).await,
        Output::Pty(p) => read_pipe(Some(p), cap, stream, Chunk::Stdout, done).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture(cap: u64, pieces: &[&[u8]]) -> Captured {
        let mut c = Capture::new(cap);
        for p in pieces {
            c.push(p);
        }
        c.finish()
    }

    #[test]
    fn capture_keeps_everything_within_the_cap_in_head() {
        let c = capture(10, &[b"abc", b"defg", b"hij"]);
        assert_eq!(c.head, b"abcdefghij");
        assert!(c.tail.is_empty());
        assert_eq!(c.total, 10);
        assert!(!c.truncated());
    }

    #[test]
    fn capture_keeps_head_and_tail_beyond_the_cap() {
        let c = capture(5, &[b"abc", b"defg", b"hij"]);
        assert_eq!(c.head, b"abc");
        assert_eq!(c.tail, b"ij");
        assert_eq!(c.total, 10);
        assert_eq!(c.omitted(), 5);
        // A single large piece replaces the whole ring.
        let c = capture(4, &[b"0123456789"]);
        assert_eq!(
            (c.head.as_slice(), c.tail.as_slice()),
            (&b"01"[..], &b"89"[..])
        );
        // Many small pieces rotate the ring.
        let bytes: Vec<u8> = (0..100u8).collect();
        let pieces: Vec<&[u8]> = bytes.chunks(3).collect();
        let c = capture(11, &pieces);
        assert_eq!(c.head, (0..6u8).collect::<Vec<_>>());
        assert_eq!(c.tail, (95..100u8).collect::<Vec<_>>());
    }

    #[test]
    fn capture_with_zero_cap_only_counts() {
        let c = capture(0, &[b"abc"]);
        assert!(c.head.is_empty() && c.tail.is_empty());
        assert_eq!(c.total, 3);
    }

    #[test]
    fn env_names_are_validated() {
        assert!(check_env(&[("A".into(), "1".into())]).is_ok());
        assert!(check_env(&[("".into(), "1".into())]).is_err());
        assert!(check_env(&[("A=B".into(), "1".into())]).is_err());
        assert!(check_env(&[("A".into(), "x\0y".into())]).is_err());
    }
}
