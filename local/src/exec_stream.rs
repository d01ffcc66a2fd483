//! `rsb exec` and `rsb shell` the way `ssh host cmd` and `ssh -t host` behave: local stdin is
//! streamed to the remote command (EOF included), output is written as it arrives, and with a
//! terminal the remote side gets a pty of the local window's size, resized when it changes,
//! while the local terminal is in raw mode (restored on every way out: return, error, panic,
//! SIGTERM/SIGHUP).
//!
//! The pty is the agent's (see `agent/src/exec.rs`), not an SSH pty channel: the same request
//! path then serves the `local` sandbox and ProxyJump hosts, the command's process group is
//! stopped and reaped by the agent like any exec (timeout, cancel, orphan reaper), and no
//! second kind of channel needs its own liveness handling.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::time::Duration;

use rsb_protocol::{Chunk, ExecInput, ExecRequest, ExecResult, TtySize};
use tokio::sync::mpsc;

use crate::{client::AgentClient, error::Result};

/// Read size for local stdin; well under a frame.
const READ_PIECE: usize = 64 * 1024;

/// The exit status `ssh` would give: the remote code, 128+signal, 124 for rsb's own timeout,
/// 255 when nothing is known.
pub fn exit_code(r: &ExecResult) -> u8 {
    if r.timed_out {
        return 124;
    }
    match (r.exit_code, r.signal) {
        (Some(c), _) => c.clamp(0, 255) as u8,
        (None, Some(s)) => (128 + s).clamp(0, 255) as u8,
        _ => 255,
    }
}

/// Local stdin, read on a plain thread (a blocked read must not keep the runtime from
/// shutting down when the remote command ends first), sent as input frames; its end is `Eof`.
fn spawn_stdin_reader() -> mpsc::Receiver<ExecInput> {
    let (tx, rx) = mpsc::channel(4);
    let spawned = std::thread::Builder::new()
        .name("rsb-stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; READ_PIECE];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx
                            .blocking_send(ExecInput::Data(buf[..n].to_vec()))
                            .is_err()
                        {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = tx.blocking_send(ExecInput::Eof);
        });
    if spawned.is_err() {
        // No reader: the command sees an empty stdin rather than waiting for one.
        let (tx, rx) = mpsc::channel(1);
        let _ = tx.try_send(ExecInput::Eof);
        return rx;
    }
    rx
}

/// The local terminal's size (from stdout, else stdin), if either is a terminal.
pub fn local_size() -> Option<TtySize> {
    let get = |fd: std::os::fd::BorrowedFd<'_>| {
        rustix::termios::tcgetwinsize(fd)
            .ok()
            .filter(|w| w.ws_row > 0 && w.ws_col > 0)
            .map(|w| TtySize {
                rows: w.ws_row,
                cols: w.ws_col,
            })
    };
    get(std::io::stdout().as_fd()).or_else(|| get(std::io::stdin().as_fd()))
}

/// Raw mode on local stdin while alive; the saved settings come back on drop (also while
/// unwinding from a panic).
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> Option<RawMode> {
        use rustix::termios::{OptionalActions, tcgetattr, tcsetattr};
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return None;
        }
        let saved = tcgetattr(stdin.as_fd()).ok()?;
        let mut raw = saved.clone();
        raw.make_raw();
        tcsetattr(stdin.as_fd(), OptionalActions::Flush, &raw).ok()?;
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        use rustix::termios::{OptionalActions, tcsetattr};
        let _ = tcsetattr(std::io::stdin().as_fd(), OptionalActions::Now, &self.saved);
    }
}

/// Why a streamed exec ended without a remote result.
pub enum Interrupted {
    /// SIGTERM/SIGHUP, or ^C (without a terminal) or a closed stdout whose signals the
    /// command outlasted: the remote command was cancelled (TERM, then KILL, by the agent).
    Signal(i32),
}

/// After ^C is passed on as SIGINT, how long the command may take to act on it (save a
/// checkpoint in `except KeyboardInterrupt`) before SIGTERM follows; a second ^C skips it.
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(5);
/// After SIGPIPE (our stdout closed), how long before SIGTERM follows.
pub const PIPE_GRACE: Duration = Duration::from_secs(1);
/// After SIGTERM, how long before SIGKILL follows.
pub const TERM_GRACE: Duration = Duration::from_secs(3);
/// After SIGKILL, how long rsb waits for the command's end before it cancels the call (the
/// agent then kills what is left of its session) and exits.
pub const KILL_GRACE: Duration = Duration::from_secs(2);

/// The terminal's escalation: the first signal (INT for ^C, PIPE for a closed stdout), then
/// TERM, then KILL, then a cancel, each after its grace or at the next ^C; each step says so
/// on stderr (after ^C), so a wait is never silent.
struct Escalation {
    first: Option<i32>,
    step: u8,
    deadline: Option<tokio::time::Instant>,
}

impl Escalation {
    /// Sends the next signal, or returns the one to report once the command outlasted all.
    fn advance(&mut self, sig: i32, to_call: &mpsc::Sender<ExecInput>) -> Option<i32> {
        let first = *self.first.get_or_insert(sig);
        let now = tokio::time::Instant::now();
        match self.step {
            0 => {
                let _ = to_call.try_send(ExecInput::Signal(first));
                let grace = if first == libc::SIGPIPE {
                    PIPE_GRACE
                } else {
                    eprintln!(
                        "\r\nrsb: sent SIGINT to the remote command; SIGTERM follows in {} s (^C again: now)\r",
                        INTERRUPT_GRACE.as_secs()
                    );
                    INTERRUPT_GRACE
                };
                self.deadline = Some(now + grace);
            }
            1 => {
                let _ = to_call.try_send(ExecInput::Signal(libc::SIGTERM));
                if first != libc::SIGPIPE {
                    eprintln!(
                        "rsb: sent SIGTERM to the remote command; SIGKILL follows in {} s (^C again: now)\r",
                        TERM_GRACE.as_secs()
                    );
                }
                self.deadline = Some(now + TERM_GRACE);
            }
            2 => {
                let _ = to_call.try_send(ExecInput::Signal(libc::SIGKILL));
                if first != libc::SIGPIPE {
                    eprintln!("rsb: sent SIGKILL to the remote command\r");
                }
                self.deadline = Some(now + KILL_GRACE);
            }
            _ => return Some(first),
        }
        self.step += 1;
        None
    }
}

/// Run `req` with local stdin forwarded and output written live. With `tty`, the command gets
/// a pty sized like the local terminal (24x80 when there is none) and `TERM` is passed on.
///
/// Like `ssh host cmd`: ^C (without a raw terminal) sends SIGINT to the remote command, then
/// SIGTERM after [`INTERRUPT_GRACE`], then SIGKILL after [`TERM_GRACE`]; a closed stdout
/// (`| head -1`) sends SIGPIPE, then SIGTERM, then SIGKILL. rsb waits for the command's end
/// and exits with its status, or, once it had to kill it, as interrupted (130 for ^C); a
/// command still there [`KILL_GRACE`] after SIGKILL is cancelled.
pub async fn run(
    client: &AgentClient,
    mut req: ExecRequest,
    tty: bool,
) -> std::result::Result<Result<ExecResult>, Interrupted> {
    req.stream = true;
    req.stdin = true;
    // Output is written as it streams; the reply need not carry it again.
    req.max_stdout = 0;
    req.max_stderr = 0;
    if tty {
        req.tty = Some(local_size().unwrap_or(TtySize { rows: 24, cols: 80 }));
        if let Ok(term) = std::env::var("TERM") {
            req.env.push(("TERM".into(), term));
        }
    }
    let stdin = spawn_stdin_reader();
    let (input_tx, input_rx) = mpsc::channel(4);
    let signal_tx = input_tx.clone();
    let (out_tx, mut out_rx) = mpsc::channel::<Chunk>(64);
    let stdout_closed = std::sync::Arc::new(tokio::sync::Notify::new());
    let closed = stdout_closed.clone();
    // On a thread of its own: a write blocks while the terminal or pipe is full, and that
    // back-pressure is what slows the remote side down, as with ssh. Once the reader is gone,
    // stdout is dropped while the command is being stopped.
    let printer = tokio::task::spawn_blocking(move || {
        let mut stdout_open = true;
        while let Some(c) = out_rx.blocking_recv() {
            match c {
                Chunk::Stdout(b) if stdout_open => {
                    let mut o = std::io::stdout().lock();
                    if o.write_all(&b).and_then(|()| o.flush()).is_err() {
                        stdout_open = false;
                        closed.notify_one();
                    }
                }
                Chunk::Stderr(b) => {
                    let mut o = std::io::stderr().lock();
                    let _ = o.write_all(&b).and_then(|()| o.flush());
                }
                _ => {}
            }
        }
    });
    let raw = if tty { RawMode::enter() } else { None };
    let interrupt = !tty || raw.is_none();
    let pump = pump_input(stdin, input_tx, tty && raw.is_some());
    // Boxed, so it can be dropped (cancelling the command) before the printer is awaited: the
    // printer ends when the call's output sender does.
    let mut call = Box::pin(client.exec_with_input(req, out_tx, input_rx));
    tokio::pin!(pump);
    let mut signals = Signals::new(interrupt);
    let mut esc = Escalation {
        first: None,
        step: 0,
        deadline: None,
    };
    let mut pipe_seen = false;
    let res = loop {
        let deadline = esc.deadline;
        tokio::select! {
            r = &mut call => {
                // Ended by our SIGKILL: the user's interrupt, not the command's own status.
                if esc.step > 2 {
                    break Err(Interrupted::Signal(esc.first.unwrap_or(libc::SIGINT)));
                }
                break Ok(r);
            }
            sig = signals.next() => {
                if sig != libc::SIGINT {
                    break Err(Interrupted::Signal(sig));
                }
                if let Some(s) = esc.advance(sig, &signal_tx) {
                    break Err(Interrupted::Signal(s));
                }
            }
            () = stdout_closed.notified(), if !pipe_seen => {
                pipe_seen = true;
                if esc.step == 0 && let Some(s) = esc.advance(libc::SIGPIPE, &signal_tx) {
                    break Err(Interrupted::Signal(s));
                }
            }
            () = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {
                let first = esc.first.unwrap_or(libc::SIGINT);
                if let Some(s) = esc.advance(first, &signal_tx) {
                    break Err(Interrupted::Signal(s));
                }
            }
            () = &mut pump => unreachable!("the input pump ends only when its receiver does"),
        }
    };
    // A command that outlasted every signal: dropping the call cancels it (the agent sends
    // SIGTERM, then SIGKILL 2 s later, to its whole session).
    drop(call);
    drop(raw);
    let _ = printer.await;
    res
}

/// `rsb exec --json`: local stdin forwarded as by [`run`], the output only in the reply (head
/// and tail up to the request's caps), so `producer | rsb --json exec -- consumer` sees its
/// input as without `--json`.
pub async fn run_collected(
    client: &AgentClient,
    mut req: ExecRequest,
) -> std::result::Result<Result<ExecResult>, Interrupted> {
    req.stdin = true;
    let stdin = spawn_stdin_reader();
    let (input_tx, input_rx) = mpsc::channel(4);
    // stdin implies streamed chunks; the reply carries the output again, so they are dropped.
    let (out_tx, mut out_rx) = mpsc::channel::<Chunk>(64);
    let drain = tokio::spawn(async move { while out_rx.recv().await.is_some() {} });
    let pump = pump_input(stdin, input_tx, false);
    let call = client.exec_with_input(req, out_tx, input_rx);
    let res = tokio::select! {
        r = call => Ok(r),
        sig = termination(true) => Err(Interrupted::Signal(sig)),
        () = pump => unreachable!("the input pump ends only when its receiver does"),
    };
    let _ = drain.await;
    res
}

/// Moves stdin into the call's input and, on a terminal, window-size changes as `Resize`.
/// Never completes on its own: after stdin's end it keeps forwarding resizes.
async fn pump_input(
    mut stdin: mpsc::Receiver<ExecInput>,
    to_call: mpsc::Sender<ExecInput>,
    follow_window: bool,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut winch = if follow_window {
        signal(SignalKind::window_change()).ok()
    } else {
        None
    };
    let mut stdin_open = true;
    loop {
        tokio::select! {
            m = stdin.recv(), if stdin_open => {
                let m = m.unwrap_or(ExecInput::Eof);
                stdin_open = m != ExecInput::Eof;
                if to_call.send(m).await.is_err() {
                    break;
                }
            }
            Some(()) = async {
                match winch.as_mut() {
                    Some(w) => w.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some(size) = local_size()
                    && to_call.send(ExecInput::Resize(size)).await.is_err()
                {
                    break;
                }
            }
        }
    }
    std::future::pending().await
}

/// SIGTERM and SIGHUP, plus SIGINT when the terminal is not raw (in raw mode ^C is a byte for
/// the remote side), as a stream: ^C may come more than once.
struct Signals {
    streams: Vec<(tokio::signal::unix::Signal, i32)>,
}

impl Signals {
    fn new(with_interrupt: bool) -> Signals {
        use tokio::signal::unix::{SignalKind, signal};
        let mut kinds = vec![
            (SignalKind::terminate(), libc::SIGTERM),
            (SignalKind::hangup(), libc::SIGHUP),
        ];
        if with_interrupt {
            kinds.push((SignalKind::interrupt(), libc::SIGINT));
        }
        Signals {
            streams: kinds
                .into_iter()
                .filter_map(|(k, n)| signal(k).ok().map(|s| (s, n)))
                .collect(),
        }
    }

    /// The next signal's number.
    async fn next(&mut self) -> i32 {
        if self.streams.is_empty() {
            return std::future::pending().await;
        }
        let waits = self
            .streams
            .iter_mut()
            .map(|(s, n)| Box::pin(async move { s.recv().await.map(|_| *n).unwrap_or(0) }));
        futures::future::select_all(waits).await.0
    }
}

/// The first of [`Signals`].
async fn termination(with_interrupt: bool) -> i32 {
    Signals::new(with_interrupt).next().await
}
