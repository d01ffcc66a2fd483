//! `rsb-agent serve`: the protocol loop on stdin/stdout.
//!
//! One reader (this loop) decodes [`ToAgent`] frames and spawns one task per request, so a
//! long exec never delays a ping. All output goes through one writer task ([`crate::responder`]).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use rsb_protocol::{
    AgentError, ApplyAbortRequest, ApplyCloseRequest, ApplyOnceRequest, ApplyOpenRequest,
    ApplyRequest, BlockHashesRequest, Call, ErrorCode, ExecInput, ExecRequest, FromAgent,
    JobKillRequest, JobListRequest, JobStartRequest, JobStatusRequest, ListDirRequest,
    ManifestRequest, PingRequest, ReadFileRequest, Reply, Request, RequestId, ResourcesRequest,
    StatRequest, ToAgent, decode, encode, frame_codec,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use crate::responder::Responder;
use crate::responder::{OutWindow, Outbox, write_frames};
use crate::{edit, exec, fs, hello, jobs, reaper, resources, search, stale, sync};

/// How long runtime shutdown waits for blocking work (a stuck NFS read, the stdin reader
/// thread) before the process exits anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);

/// Exit status for a channel that stopped making sense (malformed frame, unreadable stdin).
const EXIT_BROKEN_CHANNEL: i32 = 3;

/// Cancellation handles of in-flight requests, by id.
type Inflight = Arc<Mutex<HashMap<RequestId, Running>>>;

/// What the reader needs to reach a running request: its cancel token and, for an exec that
/// takes input, where its input frames go. The input queue is unbounded on purpose: the reader
/// must never wait on one command, and the sender's window ([`rsb_protocol::INPUT_WINDOW`])
/// bounds what can be queued.
struct Running {
    cancel: CancellationToken,
    input: Option<mpsc::UnboundedSender<ExecInput>>,
    window: Arc<OutWindow>,
}

/// Removes a request from the in-flight map however its task ends.
struct InflightGuard {
    map: Inflight,
    id: RequestId,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if let Ok(mut m) = self.map.lock() {
            m.remove(&self.id);
        }
    }
}

/// State shared by every request task of one channel, and only by them: two channels (two
/// `rsb` processes on one host, or two in-process tests) never see each other's state.
struct Shared {
    sampler: Arc<resources::Sampler>,
    /// Ended with the channel: their staging goes when it closes.
    sessions: sync::Sessions,
}

fn cancelled_error() -> AgentError {
    AgentError::new(ErrorCode::Cancelled, "request cancelled")
}

/// Run blocking work on the blocking pool; a cancel answers at once even if the work itself
/// cannot be interrupted (it then finishes in the background and its result is dropped).
async fn blocking<T, F>(cancel: &CancellationToken, f: F) -> Result<T, AgentError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, AgentError> + Send + 'static,
{
    let task = tokio::task::spawn_blocking(f);
    tokio::select! {
        r = task => r.unwrap_or_else(|e| Err(AgentError::new(ErrorCode::Internal, format!("worker failed: {e}")))),
        _ = cancel.cancelled() => Err(cancelled_error()),
    }
}

/// A change to a file runs to its end even if the caller cancels: it is short, and its
/// reply (or the file) is then the truth about what happened.
async fn to_completion<T, F>(f: F) -> Result<T, AgentError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, AgentError> + Send + 'static,
{
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(AgentError::new(
            ErrorCode::Internal,
            format!("worker failed: {e}"),
        ))
    })
}

async fn cancellable<T>(
    cancel: &CancellationToken,
    fut: impl Future<Output = Result<T, AgentError>>,
) -> Result<T, AgentError> {
    tokio::select! {
        r = fut => r,
        _ = cancel.cancelled() => Err(cancelled_error()),
    }
}

async fn handle(
    body: Request,
    cancel: CancellationToken,
    shared: Arc<Shared>,
    mut responder: Responder,
    input: Option<mpsc::UnboundedReceiver<ExecInput>>,
) {
    // Each answer is wrapped by its request type's `Call` impl, so no arm can answer with
    // another request's reply.
    let result = match body {
        Request::Ping(req) => {
            stale::saw_ping();
            Ok(PingRequest::into_reply(req.payload))
        }
        Request::Exec(req) => {
            // Input is acknowledged by chunks, so an exec that takes input streams.
            let streaming = req.stream || input.is_some();
            if streaming {
                responder.set_streaming();
            }
            let stream = streaming.then_some(&responder);
            exec::run(req, &cancel, stream, input)
                .await
                .map(ExecRequest::into_reply)
        }
        Request::Stat(req) => blocking(&cancel, move || fs::stat(&req))
            .await
            .map(StatRequest::into_reply),
        Request::ListDir(req) => {
            let token = cancel.clone();
            blocking(&cancel, move || fs::list_dir(&req, &token))
                .await
                .map(ListDirRequest::into_reply)
        }
        Request::ReadFile(req) => blocking(&cancel, move || fs::read_file(&req))
            .await
            .map(ReadFileRequest::into_reply),
        Request::Resources(req) => cancellable(&cancel, shared.sampler.snapshot(req))
            .await
            .map(ResourcesRequest::into_reply),
        Request::JobStart(req) => cancellable(&cancel, jobs::start(req))
            .await
            .map(JobStartRequest::into_reply),
        Request::JobStatus(req) => cancellable(&cancel, jobs::status(req))
            .await
            .map(JobStatusRequest::into_reply),
        Request::JobKill(req) => cancellable(&cancel, jobs::kill(req))
            .await
            .map(JobKillRequest::into_reply),
        Request::JobList(JobListRequest) => cancellable(&cancel, jobs::list())
            .await
            .map(JobListRequest::into_reply),
        Request::Manifest(req) => sync::manifest(req, &cancel, &mut responder)
            .await
            .map(ManifestRequest::into_reply),
        Request::BlockHashes(req) => {
            let token = cancel.clone();
            blocking(&cancel, move || sync::block_hashes(&req, &token))
                .await
                .map(BlockHashesRequest::into_reply)
        }
        Request::ApplyOpen(req) => sync::apply_open(&shared.sessions, req, &cancel)
            .await
            .map(ApplyOpenRequest::into_reply),
        Request::Apply(req) => sync::apply(&shared.sessions, req, &cancel)
            .await
            .map(ApplyRequest::into_reply),
        Request::ApplyClose(req) => sync::apply_close(&shared.sessions, req, &cancel)
            .await
            .map(ApplyCloseRequest::into_reply),
        Request::ApplyAbort(req) => sync::apply_abort(&shared.sessions, req, &cancel)
            .await
            .map(ApplyAbortRequest::into_reply),
        Request::ApplyOnce(req) => sync::apply_once(req, &cancel)
            .await
            .map(ApplyOnceRequest::into_reply),
        Request::StagedWrite(req) => sync::staged_write(req, &cancel)
            .await
            .map(rsb_protocol::StagedWriteRequest::into_reply),
        Request::ReadFileZ(req) => blocking(&cancel, move || sync::read_file_z(&req))
            .await
            .map(rsb_protocol::ReadFileZRequest::into_reply),
        Request::ReadText(req) => blocking(&cancel, move || edit::read_text(&req))
            .await
            .map(rsb_protocol::ReadTextRequest::into_reply),
        Request::Edit(req) => to_completion(move || edit::edit(&req))
            .await
            .map(rsb_protocol::EditRequest::into_reply),
        Request::Write(req) => to_completion(move || edit::write(&req))
            .await
            .map(rsb_protocol::WriteRequest::into_reply),
        Request::Patch(req) => to_completion(move || edit::patch(&req))
            .await
            .map(rsb_protocol::PatchRequest::into_reply),
        // The walk checks the token itself, so a cancel also stops its threads.
        Request::JobEvents(req) => {
            let token = cancel.clone();
            responder
                .stream_blocking(
                    &cancel,
                    move |emit| jobs::events(&req, &token, emit),
                    |e| rsb_protocol::Chunk::JobEvent(Box::new(e)),
                )
                .await
                .map(rsb_protocol::JobEventsRequest::into_reply)
        }
        Request::Search(req) if req.stream => {
            let token = cancel.clone();
            responder
                .stream_blocking(
                    &cancel,
                    move |emit| search::search(&req, &token, emit),
                    rsb_protocol::Chunk::Search,
                )
                .await
                .map(rsb_protocol::SearchRequest::into_reply)
        }
        Request::Search(req) => {
            let token = cancel.clone();
            blocking(&cancel, move || search::search(&req, &token, &mut |_| true))
                .await
                .map(rsb_protocol::SearchRequest::into_reply)
        }
    };
    responder.reply(result.unwrap_or_else(Reply::Error)).await;
}

/// Why the main loop stopped.
enum End {
    Eof,
    Malformed,
    OutputClosed,
    Stopped,
}

/// Serve one channel until stdin ends, a frame is malformed, or stdout goes away. Returns the
/// process exit status.
/// Must run inside a [`tokio::task::LocalSet`].
pub async fn run<R, W>(input: R, output: W, hello: rsb_protocol::Hello) -> i32
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    run_until(input, output, hello, std::future::pending()).await
}

/// [`run`], also ending (the same orderly way: commands stopped, staging removed) when `stop`
/// completes; the agent binary passes its termination signals here.
pub async fn run_until<R, W>(
    input: R,
    output: W,
    hello: rsb_protocol::Hello,
    stop: impl Future<Output = ()>,
) -> i32
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    tokio::pin!(stop);
    let (outbox, lanes) = Outbox::new();
    let output_closed = CancellationToken::new();
    let writer = {
        let output_closed = output_closed.clone();
        tokio::spawn(async move {
            let res = write_frames(output, lanes).await;
            if let Err(e) = &res
                && e.kind() != std::io::ErrorKind::BrokenPipe
            {
                eprintln!("rsb-agent: cannot write to stdout: {e}");
            }
            output_closed.cancel();
            res
        })
    };

    // Queued before anything is read, so Hello is always the first frame on the wire.
    match encode(&FromAgent::Hello(hello)) {
        Ok(frame) => {
            let _ = outbox.send_frame(frame, false).await;
        }
        Err(e) => {
            eprintln!("rsb-agent: cannot encode Hello: {e}");
            return EXIT_BROKEN_CHANNEL;
        }
    }

    let shared = Arc::new(Shared {
        sampler: resources::Sampler::new(),
        sessions: sync::Sessions::default(),
    });
    let shutdown = CancellationToken::new();
    let inflight: Inflight = Arc::default();
    let mut tasks = JoinSet::new();
    let mut reader = FramedRead::new(input, frame_codec());

    let end = loop {
        tokio::select! {
            frame = reader.next() => {
                stale::activity();
                let buf = match frame {
                    None => break End::Eof,
                    Some(Ok(buf)) => buf,
                    Some(Err(e)) => {
                        eprintln!("rsb-agent: unreadable input, closing the channel: {e}");
                        break End::Malformed;
                    }
                };
                match decode::<ToAgent>(&buf) {
                    Err(e) => {
                        eprintln!("rsb-agent: {e}; closing the channel");
                        break End::Malformed;
                    }
                    Ok(ToAgent::Cancel { id }) => {
                        let token = inflight
                            .lock()
                            .ok()
                            .and_then(|m| m.get(&id).map(|r| (r.cancel.clone(), r.window.clone())));
                        // An unknown id is a request that just finished; its reply is on the way.
                        if let Some((token, window)) = token {
                            token.cancel();
                            // Its caller may have stopped reading: it must still wind down.
                            window.open();
                        }
                    }
                    Ok(ToAgent::Credit { id, bytes }) => {
                        let window = inflight
                            .lock()
                            .ok()
                            .and_then(|m| m.get(&id).map(|r| r.window.clone()));
                        if let Some(w) = window {
                            w.credit(bytes);
                        }
                    }
                    Ok(ToAgent::Input { id, input }) => {
                        // Unknown id: the command just finished; its input has nowhere to go.
                        if let Ok(m) = inflight.lock()
                            && let Some(tx) = m.get(&id).and_then(|r| r.input.as_ref())
                        {
                            let _ = tx.send(input);
                        }
                    }
                    Ok(ToAgent::Request { id, body }) => {
                        let window = Arc::new(OutWindow::default());
                        let responder = Responder::new(id, outbox.clone(), window.clone());
                        let token = shutdown.child_token();
                        let (input_tx, input_rx) = match &body {
                            Request::Exec(r) if r.stdin || r.tty.is_some() => {
                                let (tx, rx) = mpsc::unbounded_channel();
                                (Some(tx), Some(rx))
                            }
                            _ => (None, None),
                        };
                        let fresh = match inflight.lock() {
                            Ok(mut m) => match m.entry(id) {
                                Entry::Occupied(_) => false,
                                Entry::Vacant(v) => {
                                    v.insert(Running {
                                        cancel: token.clone(),
                                        input: input_tx,
                                        window,
                                    });
                                    true
                                }
                            },
                            Err(_) => false,
                        };
                        if !fresh {
                            let err = AgentError::new(
                                ErrorCode::InvalidArgument,
                                format!("request id {id} is already in flight; ids must be unique"),
                            );
                            tasks.spawn_local(responder.reply(Reply::Error(err)));
                            continue;
                        }
                        let guard = InflightGuard { map: inflight.clone(), id };
                        let shared = shared.clone();
                        tasks.spawn_local(async move {
                            let _guard = guard;
                            handle(body, token, shared, responder, input_rx).await;
                        });
                    }
                }
            }
            _ = output_closed.cancelled() => break End::OutputClosed,
            () = &mut stop => break End::Stopped,
            Some(res) = tasks.join_next(), if !tasks.is_empty() => {
                if let Err(e) = res {
                    eprintln!("rsb-agent: a request task failed: {e}");
                }
            }
        }
    };

    // Whatever ended the loop, running commands must not outlive the channel: cancel every
    // request (exec kills its process group) and wait for their final replies; nobody will
    // credit their windows any more.
    shutdown.cancel();
    if let Ok(m) = inflight.lock() {
        for r in m.values() {
            r.window.open();
        }
    }
    while let Some(res) = tasks.join_next().await {
        if let Err(e) = res {
            eprintln!("rsb-agent: a request task failed: {e}");
        }
    }
    // Sync sessions cannot outlive the channel either: their staging goes now.
    shared.sessions.close_all().await;
    drop(outbox);
    let _ = writer.await;
    match end {
        End::Eof | End::OutputClosed | End::Stopped => 0,
        End::Malformed => EXIT_BROKEN_CHANNEL,
    }
}

/// Completes on SIGTERM, SIGHUP or SIGINT: the agent then stops its commands and exits like at
/// channel EOF, instead of dying and leaving them to init. A handler that cannot be installed
/// just never fires (the default action stays, and the reaper still covers the commands).
async fn termination() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut streams: Vec<_> = [
        SignalKind::terminate(),
        SignalKind::hangup(),
        SignalKind::interrupt(),
    ]
    .into_iter()
    .filter_map(|k| signal(k).ok())
    .collect();
    if streams.is_empty() {
        return std::future::pending().await;
    }
    let waits = streams.iter_mut().map(|s| Box::pin(s.recv()));
    // Nothing is printed: after a hangup stderr may lead nowhere.
    let _ = futures::future::select_all(waits).await;
}

/// stdin and stdout as non-blocking pipes (or sockets) driven by the runtime's own reactor:
/// frames are read and written on the runtime thread as soon as the fd is ready. tokio's
/// stdin/stdout hand every read and write to a blocking-pool thread, and during a saturating
/// upload (every CPU busy) waiting for that thread to be scheduled put up to 12 ms on an exec
/// reply and up to 3 ms between a request's arrival and its start (p99, traced per hop; 0.4
/// and 0.3 ms this way). Works on duplicates of fds 0 and 1 (both stay open). `None`, and
/// nothing changed, when either is not a pipe or socket, or when stderr shares one of them
/// (non-blocking stderr would make a diagnostic write fail): the caller then uses tokio's
/// stdin/stdout.
fn pipe_io() -> Option<(
    tokio::net::unix::pipe::Receiver,
    tokio::net::unix::pipe::Sender,
)> {
    use rustix::fs::{FileType, OFlags, fcntl_getfl, fcntl_setfl, fstat};
    use std::os::fd::AsFd;
    let (stdin, stdout, stderr) = (std::io::stdin(), std::io::stdout(), std::io::stderr());
    let id = |fd: std::os::fd::BorrowedFd<'_>| {
        let st = fstat(fd).ok()?;
        Some((FileType::from_raw_mode(st.st_mode), st.st_dev, st.st_ino))
    };
    let (i, o) = (id(stdin.as_fd())?, id(stdout.as_fd())?);
    let e = id(stderr.as_fd());
    let stream = |t: FileType| matches!(t, FileType::Fifo | FileType::Socket);
    if !stream(i.0) || !stream(o.0) || e == Some(i) || e == Some(o) {
        return None;
    }
    let input = rustix::io::fcntl_dupfd_cloexec(stdin.as_fd(), 3).ok()?;
    let output = rustix::io::fcntl_dupfd_cloexec(stdout.as_fd(), 3).ok()?;
    let saved = [fcntl_getfl(&input).ok()?, fcntl_getfl(&output).ok()?];
    // The flags belong to the open file, shared with fds 0 and 1: put them back through those
    // if anything below fails, so the fallback reads and writes blocking fds as it expects.
    let restore = || {
        let _ = fcntl_setfl(stdin.as_fd(), saved[0]);
        let _ = fcntl_setfl(stdout.as_fd(), saved[1]);
    };
    let ready = fcntl_setfl(&input, saved[0] | OFlags::NONBLOCK).is_ok()
        && fcntl_setfl(&output, saved[1] | OFlags::NONBLOCK).is_ok();
    let pair = ready.then(|| {
        Some((
            tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(input).ok()?,
            tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(output).ok()?,
        ))
    });
    match pair.flatten() {
        Some(pair) => Some(pair),
        None => {
            restore();
            None
        }
    }
}

/// `rsb-agent serve`.
pub fn main() -> i32 {
    // Before the runtime starts: hashing the binary is blocking, and Hello must carry it.
    let hello = hello::hello();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rsb-agent: cannot start the runtime: {e}");
            return 1;
        }
    };
    reaper::enable();
    // Agents of this user left behind by a cut link are stopped; off the runtime, so the Hello
    // is not delayed by their grace period.
    let _ = std::thread::Builder::new()
        .name("rsb-stale".into())
        .spawn(stale::stop_stale);
    let record = stale::Record::create();
    // A LocalSet lets request futures (exec, resources, jobs) be !Send on this single thread.
    let local = tokio::task::LocalSet::new();
    if let Some(mut record) = record {
        local.spawn_local(async move {
            loop {
                tokio::time::sleep(stale::TOUCH_EVERY).await;
                record.tick();
            }
        });
    }
    let code = local.block_on(&rt, async {
        let stop = termination();
        match pipe_io() {
            Some((input, output)) => run_until(input, output, hello, stop).await,
            None => run_until(tokio::io::stdin(), tokio::io::stdout(), hello, stop).await,
        }
    });
    // Without `pipe_io`, tokio's stdin reader thread may still sit in a blocking read (stdout
    // closed first); do not wait for it.
    rt.shutdown_timeout(SHUTDOWN_GRACE);
    code
}
