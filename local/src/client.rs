//! The agent client: one framed channel to one agent, many requests in flight on it.
//!
//! Requests get ids; one reader task routes replies and streamed chunks back to the waiting
//! caller by id, one writer task serialises frames. When the channel dies, every waiter is
//! failed at once with `connection lost` instead of sitting out its own timeout. Dropping a
//! call's future before it completes sends a `Cancel` for it, so an abandoned exec is killed
//! on the remote rather than left running.
//!
//! [`AgentClient::call`] is the only way to send a request: the request type names its reply
//! type ([`Call`]), so a reply of the wrong variant is one error, made here.
//!
//! Control traffic first: the writer has two lanes, and the bulk lane (the apply requests that
//! carry sync data) only gets the channel when no control frame waits, so an exec or a ping
//! waits behind at most one bulk frame, not a whole window of them.
//!
//! Liveness: a heartbeat pings the agent whenever nothing has been heard for a while, and when
//! nothing at all (frame, or any channel message the transport reports through [`Heard`]) has
//! arrived for [`DEAD_AFTER`], the channel is failed with one clear line and its transport
//! dropped, so the pool reconnects on the next call instead of waiting on a dead link.

use std::{
    any::Any,
    collections::HashMap,
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;
use rsb_protocol::{
    ApplyAbortRequest, ApplyCloseRequest, ApplyOpenRequest, ApplyRequest, Call, Chunk, ExecInput,
    ExecRequest, ExecResult, FromAgent, Hello, INPUT_WINDOW, JobEvent, JobEventKind,
    JobEventsRequest, JobInfo, MAGIC, PROTOCOL_VERSION, PingRequest, Reply, Request, ToAgent,
    decode, encode, frame_codec,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{mpsc, oneshot},
};
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::error::{Kind, Result, RsbError};

type ReplyTx = oneshot::Sender<Result<Reply>>;

/// A ping goes out when nothing has been heard from the agent for this long.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(3);
/// Nothing heard for this long (pings unanswered, no data, no window updates): the link or the
/// agent is dead, and the channel is failed.
pub const DEAD_AFTER: Duration = Duration::from_secs(15);
/// Queued bulk frames (about 1 MiB each): enough to keep a link busy, few enough that memory
/// and the wait they impose on a cancel stay small.
const BULK_LANE: usize = 8;

/// When anything last arrived from the far end. The transport touches it for messages that are
/// not agent frames (SSH window updates during an upload), so a slow but moving link is alive.
#[derive(Clone)]
pub struct Heard(Arc<(Instant, AtomicU64, Mutex<Option<String>>)>);

impl Default for Heard {
    fn default() -> Self {
        Heard(Arc::new((
            Instant::now(),
            AtomicU64::new(0),
            Mutex::new(None),
        )))
    }
}

impl Heard {
    /// Why the transport ended, when it knows better than "channel closed" (a dead link).
    pub fn set_reason(&self, why: String) {
        *self.0.2.lock() = Some(why);
    }

    pub fn touch(&self) {
        let ms = u64::try_from(self.0.0.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.1.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long since anything arrived.
    pub fn quiet(&self) -> Duration {
        self.0
            .0
            .elapsed()
            .saturating_sub(Duration::from_millis(self.0.1.load(Ordering::Relaxed)))
    }
}

/// Sync data rides the bulk lane; everything else (exec, ping, reads, job calls) overtakes it.
/// By kind, not size: one apply session's requests must stay in order on one FIFO lane.
fn is_bulk(kind: &str) -> bool {
    kind == ApplyRequest::NAME
        || kind == ApplyOpenRequest::NAME
        || kind == ApplyCloseRequest::NAME
        || kind == ApplyAbortRequest::NAME
}

/// A request waiting for its reply. A streaming one has a pump: the reader hands it the
/// request's chunks and then its reply, never waiting on the caller's consumer, and the pump
/// feeds the consumer and credits the agent as it takes each chunk
/// ([`rsb_protocol::OUTPUT_WINDOW`]). So a caller that stops reading stalls only its own
/// request; the reader, the heartbeat and every other request go on.
enum Pending {
    Direct(ReplyTx),
    /// The pump's queue, and the chunk bytes routed to it that it has not credited yet.
    Stream(mpsc::UnboundedSender<Routed>, Arc<AtomicU64>),
}

/// Whether a chunk of `n` bytes, arriving with `held` bytes of its request uncredited, is one
/// the agent's window ([`rsb_protocol::OUTPUT_WINDOW`]) lets it send: one frame alone, or
/// within the window. Credits leave here before they reach the agent, so an honest agent's
/// count is never below ours: a chunk past this bound comes from an agent that does not
/// keep the window, and would grow the client's memory without limit.
fn within_window(held: u64, n: u64) -> bool {
    held == 0 || held.saturating_add(n) <= rsb_protocol::OUTPUT_WINDOW
}

/// What the reader hands a streaming request's pump, in arrival order.
enum Routed {
    /// A chunk and the length of the frame that carried it (what the agent's window counts).
    Chunk(Chunk, u64),
    Reply(Box<Result<Reply>>),
}

impl Pending {
    /// `chunks`: the caller's consumer of streamed chunks, if the request streams.
    fn new(
        reply: ReplyTx,
        chunks: Option<mpsc::Sender<Chunk>>,
        inner: Weak<Inner>,
        id: u64,
    ) -> Self {
        let Some(consumer) = chunks else {
            return Pending::Direct(reply);
        };
        // Unbounded, and bounded all the same: the agent never has more than OUTPUT_WINDOW of
        // this request's chunks uncredited (the reader fails a request whose agent does),
        // and credit follows the consumer.
        let (tx, mut rx) = mpsc::unbounded_channel();
        let held = Arc::new(AtomicU64::new(0));
        let pump_held = held.clone();
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                match m {
                    Routed::Chunk(chunk, n) => {
                        // A consumer that went away still frees the window.
                        let _ = consumer.send(chunk).await;
                        pump_held.fetch_sub(n, Ordering::SeqCst);
                        match inner.upgrade() {
                            Some(i) => i.credit(id, n).await,
                            None => return,
                        }
                    }
                    Routed::Reply(r) => {
                        // The consumer's channel ends with the call, after every chunk.
                        drop(consumer);
                        let _ = reply.send(*r);
                        return;
                    }
                }
            }
        });
        Pending::Stream(tx, held)
    }

    /// Deliver the final reply (through the pump, behind the chunks queued there).
    fn finish(self, r: Result<Reply>) {
        match self {
            Pending::Direct(tx) => {
                let _ = tx.send(r);
            }
            Pending::Stream(tx, _) => {
                let _ = tx.send(Routed::Reply(Box::new(r)));
            }
        }
    }
}

struct Inner {
    sandbox: String,
    hello: Hello,
    out: mpsc::Sender<Bytes>,
    bulk_out: mpsc::Sender<Bytes>,
    heard: Heard,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    close_reason: Mutex<Option<String>>,
    /// The sandbox's `confine`, set once by whoever connected it ([`AgentClient::confine_to`]).
    confine: std::sync::OnceLock<rsb_protocol::Confine>,
    /// How to start another agent on the same host over a channel of its own
    /// ([`AgentClient::sibling`]), set by the transport that can (an SSH session).
    siblings: std::sync::OnceLock<Siblings>,
    /// Transport resources (SSH handle, child process) that must live as long as the channel.
    _keep: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Inner {
    fn fail_all(&self, reason: &str) {
        self.closed.store(true, Ordering::SeqCst);
        {
            let mut r = self.close_reason.lock();
            if r.is_none() {
                *r = Some(reason.to_string());
            }
        }
        let drained: Vec<Pending> = self.pending.lock().drain().map(|(_, p)| p).collect();
        for p in drained {
            p.finish(Err(RsbError::connection_lost(&self.sandbox, reason)));
        }
    }

    /// Give `bytes` of request `id`'s window back to the agent (control lane: a credit must
    /// not wait behind bulk data).
    async fn credit(&self, id: u64, bytes: u64) {
        if let Ok(frame) = encode(&ToAgent::Credit { id, bytes }) {
            let _ = self.out.send(frame).await;
        }
    }
}

/// Starts another agent on a client's host, on a channel of its own (see
/// [`AgentClient::sibling`]); `None` when the transport has no channel to spare.
pub type Siblings = Arc<
    dyn Fn()
            -> futures::future::BoxFuture<'static, Option<std::result::Result<AgentClient, String>>>
        + Send
        + Sync,
>;

/// Why the handshake failed; the deploy logic reinstalls on [`StartError::NoHello`].
#[derive(Debug)]
pub enum StartError {
    /// The channel closed or sent garbage before a valid Hello (agent missing or broken).
    NoHello(String),
    /// A Hello arrived from an agent that speaks another protocol version.
    Incompatible(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::NoHello(s) | StartError::Incompatible(s) => f.write_str(s),
        }
    }
}

#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("sandbox", &self.inner.sandbox)
            .field("alive", &self.is_alive())
            .finish()
    }
}

impl AgentClient {
    /// Read the Hello from `reader`, then start the reader and writer tasks.
    pub async fn start<R, W>(
        sandbox: &str,
        reader: R,
        writer: W,
        keep: Box<dyn Any + Send>,
        hello_timeout: Duration,
    ) -> std::result::Result<AgentClient, StartError>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        Self::start_watched(
            sandbox,
            reader,
            writer,
            keep,
            hello_timeout,
            Heard::default(),
        )
        .await
    }

    /// Like [`start`](Self::start), with `heard` also touched by the transport.
    pub async fn start_watched<R, W>(
        sandbox: &str,
        reader: R,
        writer: W,
        keep: Box<dyn Any + Send>,
        hello_timeout: Duration,
        heard: Heard,
    ) -> std::result::Result<AgentClient, StartError>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let mut frames = FramedRead::new(reader, frame_codec());
        let first = tokio::time::timeout(hello_timeout, frames.next())
            .await
            .map_err(|_| {
                StartError::NoHello(format!("no Hello from the agent within {hello_timeout:?}"))
            })?;
        let hello = match first {
            None => {
                return Err(StartError::NoHello(
                    "agent channel closed before Hello".into(),
                ));
            }
            Some(Err(e)) => {
                return Err(StartError::NoHello(format!(
                    "agent channel error before Hello: {e}"
                )));
            }
            Some(Ok(buf)) => match decode::<FromAgent>(&buf) {
                Ok(FromAgent::Hello(h)) => h,
                Ok(_) => {
                    return Err(StartError::NoHello(
                        "agent's first frame was not a Hello".into(),
                    ));
                }
                Err(e) => {
                    return Err(StartError::NoHello(format!(
                        "agent sent a malformed Hello: {e}"
                    )));
                }
            },
        };
        if hello.magic != MAGIC || hello.protocol_version != PROTOCOL_VERSION {
            return Err(StartError::Incompatible(format!(
                "agent {} speaks protocol {} (this rsb speaks {PROTOCOL_VERSION})",
                hello.agent_version, hello.protocol_version
            )));
        }
        if hello.protocol_fingerprint != rsb_protocol::PROTOCOL_FINGERPRINT {
            return Err(StartError::Incompatible(format!(
                "agent {} was built from other protocol sources (fingerprint {}, this rsb {}); \
                 rebuild the agents with scripts/build-agents.sh, then rsb",
                hello.agent_version,
                hello.protocol_fingerprint,
                rsb_protocol::PROTOCOL_FINGERPRINT
            )));
        }
        let (out_tx, out_rx) = mpsc::channel::<Bytes>(256);
        let (bulk_tx, bulk_rx) = mpsc::channel::<Bytes>(BULK_LANE);
        heard.touch();
        let inner = Arc::new(Inner {
            sandbox: sandbox.to_string(),
            hello,
            out: out_tx,
            bulk_out: bulk_tx,
            heard,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(None),
            confine: std::sync::OnceLock::new(),
            siblings: std::sync::OnceLock::new(),
            _keep: Mutex::new(Some(keep)),
        });

        let w_inner = Arc::downgrade(&inner);
        tokio::spawn(async move {
            if let Err(e) = write_frames(writer, out_rx, bulk_rx).await
                && let Some(i) = w_inner.upgrade()
            {
                i.fail_all(&format!("write failed: {e}"));
            }
        });
        tokio::spawn(heartbeat(Arc::downgrade(&inner)));

        let r_inner = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let reason = loop {
                let Some(frame) = frames.next().await else {
                    let why = r_inner.upgrade().and_then(|i| i.heard.0.2.lock().clone());
                    break why.unwrap_or_else(|| "agent channel closed".to_string());
                };
                let buf = match frame {
                    Ok(b) => b,
                    Err(e) => {
                        // A frame cut short by a dead transport: the transport's reason is the news.
                        let why = r_inner.upgrade().and_then(|i| i.heard.0.2.lock().clone());
                        break why.unwrap_or_else(|| format!("read failed: {e}"));
                    }
                };
                let msg = match decode::<FromAgent>(&buf) {
                    Ok(m) => m,
                    Err(e) => break format!("malformed frame from agent: {e}"),
                };
                let Some(inner) = r_inner.upgrade() else {
                    return;
                };
                inner.heard.touch();
                match msg {
                    FromAgent::Reply { id, body } => {
                        let p = inner.pending.lock().remove(&id);
                        if let Some(p) = p {
                            p.finish(Ok(body));
                        }
                    }
                    FromAgent::Chunk { id, chunk } => {
                        // Never waits: the request's pump takes it (see `Pending`).
                        let n = buf.len() as u64;
                        let mut overrun = None;
                        let routed = {
                            let mut pending = inner.pending.lock();
                            match pending.get(&id) {
                                Some(Pending::Stream(tx, held)) => {
                                    let before = held.fetch_add(n, Ordering::SeqCst);
                                    if within_window(before, n) {
                                        tx.send(Routed::Chunk(chunk, n)).is_ok()
                                    } else {
                                        held.fetch_sub(n, Ordering::SeqCst);
                                        overrun = pending.remove(&id).map(|p| (p, before));
                                        false
                                    }
                                }
                                _ => false,
                            }
                        };
                        if let Some((p, before)) = overrun {
                            // The agent does not keep its window: this request fails (its
                            // chunks queued so far are still delivered) and is cancelled.
                            p.finish(Err(RsbError::new(
                                Kind::Agent(rsb_protocol::ErrorCode::Io),
                                format!(
                                    "the agent on '{}' sent more output than its {} MiB window allows ({before} bytes not yet taken, {n} more)",
                                    inner.sandbox,
                                    rsb_protocol::OUTPUT_WINDOW >> 20
                                ),
                                "the agent does not follow the protocol: redeploy it (rsb doctor), or report it",
                            )));
                            if let Ok(frame) = encode(&ToAgent::Cancel { id }) {
                                let _ = inner.out.try_send(frame);
                            }
                        }
                        if !routed {
                            // Nobody takes it (the call ended): still free the agent's window.
                            let i = inner.clone();
                            tokio::spawn(async move { i.credit(id, n).await });
                        }
                    }
                    FromAgent::Hello(_) => break "agent sent a second Hello".to_string(),
                }
            };
            if let Some(i) = r_inner.upgrade() {
                tracing::debug!(sandbox = %i.sandbox, %reason, "agent channel ended");
                i.fail_all(&reason);
            }
        });

        Ok(AgentClient { inner })
    }

    pub fn hello(&self) -> &Hello {
        &self.inner.hello
    }

    pub fn sandbox(&self) -> &str {
        &self.inner.sandbox
    }

    /// Confine what is run and changed through this client to `c`: the pool sets it from the
    /// sandbox's `confine` when it connects (a later call keeps the first).
    pub fn confine_to(&self, c: rsb_protocol::Confine) {
        let _ = self.inner.confine.set(c);
    }

    /// The confinement every request that runs a command or changes files sends (`None`: the
    /// sandbox is not confined).
    pub fn confine(&self) -> Option<&rsb_protocol::Confine> {
        self.inner.confine.get()
    }

    /// The sandbox's confinement when it confines reads: every one of rsb's own reads through
    /// this client carries it ([`Request::read_confine`]).
    pub fn confine_reads(&self) -> Option<&rsb_protocol::Confine> {
        self.confine().filter(|c| c.read.is_some())
    }

    /// Let [`AgentClient::sibling`] start agents through `open` (a later call keeps the first).
    pub fn allow_siblings(&self, open: Siblings) {
        let _ = self.inner.siblings.set(open);
    }

    /// Another agent on this client's host, on a channel of its own (so with its own SSH
    /// flow-control window), the same agent binary and confined alike: a large transfer spreads
    /// over a few of these on a long link. `None` when the transport cannot open one now (a
    /// local agent, a worker's bridged agent, no channel to spare).
    pub async fn sibling(&self) -> Option<Result<AgentClient>> {
        let open = self.inner.siblings.get()?.clone();
        let c = match open().await? {
            Ok(c) => c,
            Err(m) => {
                return Some(Err(RsbError::new(
                    Kind::Connect,
                    format!("{}: another channel to the agent: {m}", self.sandbox()),
                    "the transfer goes on over one channel",
                )));
            }
        };
        if c.hello().agent_hash != self.hello().agent_hash {
            c.close("another agent binary");
            return Some(Err(RsbError::internal(format!(
                "{}: a second channel reached another agent binary",
                self.sandbox()
            ))));
        }
        if let Some(conf) = self.confine() {
            c.confine_to(conf.clone());
        }
        Some(Ok(c))
    }

    pub fn is_alive(&self) -> bool {
        !self.inner.closed.load(Ordering::SeqCst) && !self.inner.out.is_closed()
    }

    /// Tear the channel down; in-flight calls fail with `connection lost`.
    pub fn close(&self, reason: &str) {
        self.inner.fail_all(reason);
        self.inner._keep.lock().take();
    }

    /// Send `req` and wait for its answer. Dropping the future cancels the request remotely.
    pub async fn call<C: Call>(&self, req: C) -> Result<C::Reply> {
        self.call_with(|| req).await
    }

    /// Like [`call`](Self::call), building the request only once its frame has a place in the
    /// channel's queue: requests numbered inside `make` reach the agent in number order (the
    /// `seq` of apply sessions), however the callers' futures are polled.
    pub async fn call_with<C: Call>(&self, make: impl FnOnce() -> C) -> Result<C::Reply> {
        let reply = self.call_inner(C::NAME, || make().into(), None).await?;
        C::from_reply(reply).map_err(|other| self.wrong_reply(C::NAME, &other))
    }

    /// Like [`call`](Self::call), forwarding streamed chunks to `chunks` as they arrive (exec
    /// with `stream: true`, manifests). `chunks` closes when the call ends.
    pub async fn call_streaming<C: Call>(
        &self,
        req: C,
        chunks: mpsc::Sender<Chunk>,
    ) -> Result<C::Reply> {
        let reply = self
            .call_inner(C::NAME, || req.into(), Some(chunks))
            .await?;
        C::from_reply(reply).map_err(|other| self.wrong_reply(C::NAME, &other))
    }

    /// Run an exec that reads input (`req.stdin` or `req.tty`): `input` feeds it ([`ExecInput`]
    /// frames; its end sends `Eof`), output chunks go to `output` as they arrive. At most
    /// [`INPUT_WINDOW`] bytes are in flight unacknowledged, so a command that stops reading
    /// stops the sender (back-pressure up to the caller's reader) instead of filling the
    /// agent's memory. Dropping the future cancels the command remotely.
    pub async fn exec_with_input(
        &self,
        req: ExecRequest,
        output: mpsc::Sender<Chunk>,
        mut input: mpsc::Receiver<ExecInput>,
    ) -> Result<ExecResult> {
        let lost = |reason: &str| RsbError::connection_lost(&self.inner.sandbox, reason);
        if !self.is_alive() {
            let reason = self.inner.close_reason.lock().clone();
            return Err(lost(reason.as_deref().unwrap_or("closed")));
        }
        let permit = self
            .inner
            .out
            .reserve()
            .await
            .map_err(|_| lost("writer stopped"))?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = encode(&ToAgent::Request {
            id,
            body: req.into(),
        })
        .map_err(|e| RsbError::invalid(format!("exec request too large: {e}"), "send less"))?;
        let (reply_tx, mut reply_rx) = oneshot::channel();
        let (chunk_tx, mut chunks) = mpsc::channel(64);
        self.inner.pending.lock().insert(
            id,
            Pending::new(reply_tx, Some(chunk_tx), Arc::downgrade(&self.inner), id),
        );
        let mut guard = CancelOnDrop {
            inner: &self.inner,
            id,
            bulk: false,
            armed: true,
        };
        permit.send(frame);
        if self.inner.closed.load(Ordering::SeqCst)
            && let Some(p) = self.inner.pending.lock().remove(&id)
        {
            p.finish(Err(lost("closed")));
        }
        let mut in_flight: u64 = 0;
        let mut input_open = true;
        let mut eof_sent = false;
        let reply = loop {
            tokio::select! {
                r = &mut reply_rx => break r,
                Some(c) = chunks.recv() => match c {
                    Chunk::InputConsumed(n) => in_flight = in_flight.saturating_sub(n),
                    other => {
                        let _ = output.send(other).await;
                    }
                },
                // The channel stays read after `Eof`: signals (^C, a closed output pipe)
                // and resizes follow it.
                m = input.recv(), if input_open && in_flight < INPUT_WINDOW => {
                    let msg = match m {
                        Some(m) => m,
                        None => {
                            input_open = false;
                            if eof_sent {
                                continue;
                            }
                            ExecInput::Eof
                        }
                    };
                    if msg == ExecInput::Eof {
                        if eof_sent {
                            continue;
                        }
                        eof_sent = true;
                    }
                    if let ExecInput::Data(d) = &msg {
                        in_flight += d.len() as u64;
                    }
                    let Ok(frame) = encode(&ToAgent::Input { id, input: msg }) else {
                        continue;
                    };
                    if self.inner.out.send(frame).await.is_err() {
                        break Ok(Err(lost("writer stopped")));
                    }
                }
            }
        };
        guard.armed = false;
        // Chunks that preceded the reply are already queued here.
        while let Ok(c) = chunks.try_recv() {
            if !matches!(c, Chunk::InputConsumed(_)) {
                let _ = output.send(c).await;
            }
        }
        let reply = match reply {
            Ok(Ok(Reply::Error(e))) => Err(RsbError::from_agent(e)),
            Ok(r) => r,
            Err(_) => Err(lost("reply dropped")),
        }?;
        ExecRequest::from_reply(reply).map_err(|other| self.wrong_reply("exec", &other))
    }

    fn wrong_reply(&self, what: &str, got: &Reply) -> RsbError {
        RsbError::new(
            Kind::Internal,
            format!(
                "agent on {} answered {what} with a {} reply",
                self.inner.sandbox,
                got.kind()
            ),
            "the agent and rsb disagree on the protocol; reconnecting redeploys the agent",
        )
    }

    async fn call_inner(
        &self,
        kind: &'static str,
        make: impl FnOnce() -> Request,
        chunks: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Reply> {
        let lost = |reason: &str| RsbError::connection_lost(&self.inner.sandbox, reason);
        if !self.is_alive() {
            let reason = self.inner.close_reason.lock().clone();
            return Err(lost(reason.as_deref().unwrap_or("closed")));
        }
        // The place in the queue first: the frame is built and queued in one step after it, so
        // frames leave in the order their requests were built.
        let bulk = is_bulk(kind);
        let lane = if bulk {
            &self.inner.bulk_out
        } else {
            &self.inner.out
        };
        let permit = lane.reserve().await.map_err(|_| lost("writer stopped"))?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut body = make();
        // rsb's own reads keep to the sandbox's read roots, whoever asks for them.
        if let (Some(c), Some(slot)) = (self.confine_reads(), body.read_confine()) {
            slot.get_or_insert_with(|| c.clone());
        }
        let frame = encode(&ToAgent::Request { id, body }).map_err(|e| {
            RsbError::invalid(
                format!("{kind} request too large: {e}"),
                "send less data per call",
            )
        })?;
        let (tx, rx) = oneshot::channel();
        self.inner.pending.lock().insert(
            id,
            Pending::new(tx, chunks, Arc::downgrade(&self.inner), id),
        );
        let mut guard = CancelOnDrop {
            inner: &self.inner,
            id,
            bulk,
            armed: true,
        };
        permit.send(frame);
        // `RSB_LOG=rsb::requests=debug` lists every request sent (what a wait or an idle
        // daemon costs the host, counted by the tests).
        tracing::debug!(target: "rsb::requests", sandbox = %self.inner.sandbox, id, kind, "request");
        // A close that raced with the insert above must not leave us waiting forever.
        if self.inner.closed.load(Ordering::SeqCst)
            && let Some(p) = self.inner.pending.lock().remove(&id)
        {
            p.finish(Err(RsbError::connection_lost(
                &self.inner.sandbox,
                "closed",
            )));
        }
        let res = rx.await;
        guard.armed = false;
        match res {
            Ok(Ok(Reply::Error(e))) => Err(RsbError::from_agent(e)),
            Ok(r) => r,
            Err(_) => Err(RsbError::connection_lost(
                &self.inner.sandbox,
                "reply dropped",
            )),
        }
    }
}

/// Sends `Cancel` for a request whose caller went away before the reply.
struct CancelOnDrop<'a> {
    inner: &'a Arc<Inner>,
    id: u64,
    /// The lane the request went on: a cancel must not overtake its request.
    bulk: bool,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.inner.pending.lock().remove(&self.id);
        let lane = if self.bulk {
            &self.inner.bulk_out
        } else {
            &self.inner.out
        };
        if let Ok(frame) = encode(&ToAgent::Cancel { id: self.id })
            && let Err(mpsc::error::TrySendError::Full(frame)) = lane.try_send(frame)
        {
            let out = lane.clone();
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = out.send(frame).await;
                });
            }
        }
    }
}

/// Write frames until both lanes close. Control frames go first; a burst of them is flushed
/// once, when nothing else waits; a bulk frame is flushed on its own so a control frame that
/// arrives meanwhile is next.
async fn write_frames<W: AsyncWrite + Unpin>(
    writer: W,
    mut control: mpsc::Receiver<Bytes>,
    mut bulk: mpsc::Receiver<Bytes>,
) -> std::io::Result<()> {
    let mut sink = FramedWrite::new(writer, frame_codec());
    loop {
        let (frame, is_bulk) = tokio::select! {
            biased;
            Some(f) = control.recv() => (f, false),
            Some(f) = bulk.recv() => (f, true),
            else => break,
        };
        sink.feed(frame).await?;
        if is_bulk || (control.is_empty() && bulk.is_empty()) {
            SinkExt::<Bytes>::flush(&mut sink).await?;
        }
    }
    SinkExt::<Bytes>::flush(&mut sink).await
}

/// Pings the agent when the channel has been quiet for [`HEARTBEAT_EVERY`], and fails the
/// channel (dropping its transport) once nothing has been heard for [`DEAD_AFTER`]. Holds only
/// a weak reference: a client nobody uses any more is not kept alive by its heartbeat.
async fn heartbeat(inner: Weak<Inner>) {
    let pinging = Arc::new(AtomicBool::new(false));
    loop {
        tokio::time::sleep(HEARTBEAT_EVERY / 3).await;
        let Some(i) = inner.upgrade() else { return };
        if i.closed.load(Ordering::SeqCst) {
            return;
        }
        let quiet = i.heard.quiet();
        if quiet >= DEAD_AFTER {
            let client = AgentClient { inner: i };
            client.close(&format!(
                "nothing heard from the sandbox for {}s (the link or the agent is dead)",
                quiet.as_secs()
            ));
            return;
        }
        if quiet >= HEARTBEAT_EVERY && !pinging.swap(true, Ordering::SeqCst) {
            let client = AgentClient { inner: i };
            let flag = pinging.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    DEAD_AFTER,
                    client.call(PingRequest {
                        payload: Vec::new(),
                    }),
                )
                .await;
                flag.store(false, Ordering::SeqCst);
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Job ends

/// The ends of jobs on one host, as the agent sees them (a [`JobEventsRequest`] subscription):
/// each run that ended or was lost, the moment its record says so, and at once every one that
/// ended at or after `since_ms` before the subscription began. Used by the session's channel
/// push and by the watchdog daemon. Dropping it cancels the subscription on the agent.
pub struct JobEnds {
    chunks: mpsc::Receiver<Chunk>,
    call: std::pin::Pin<Box<dyn Future<Output = Result<Vec<JobInfo>>> + Send>>,
}

impl JobEnds {
    pub fn subscribe(client: &AgentClient, since_ms: u64) -> JobEnds {
        let (tx, chunks) = mpsc::channel(64);
        let req = JobEventsRequest {
            names: Vec::new(),
            since_ms,
            until_ended: false,
            output_after: None,
        };
        let client = client.clone();
        JobEnds {
            chunks,
            call: Box::pin(async move { client.call_streaming(req, tx).await }),
        }
    }

    /// The next end; an error once the subscription is over (the connection dropped, the
    /// agent failed it): nothing more comes, and a new one with `since_ms` catches up.
    pub async fn next(&mut self) -> Result<JobEvent> {
        loop {
            tokio::select! {
                // What the agent sent before the call ended is read first.
                biased;
                chunk = self.chunks.recv() => match chunk {
                    Some(Chunk::JobEvent(e))
                        if matches!(
                            e.kind,
                            JobEventKind::Ended | JobEventKind::Lost
                        ) => return Ok(*e),
                    Some(_) => {}
                    None => return Err(Self::over((&mut self.call).await)),
                },
                r = &mut self.call => return Err(Self::over(r)),
            }
        }
    }

    fn over(r: Result<Vec<JobInfo>>) -> RsbError {
        match r {
            Ok(_) => RsbError::new(
                Kind::ConnectionLost,
                "the agent ended the job-event subscription",
                "subscribe again",
            ),
            Err(e) => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 46, item 5: a request's chunks were routed however many the agent sent, so an
    /// agent that ignores its output window (a hostile host, a bug) could grow the client's
    /// memory without limit while the caller's consumer was slow. Past the window the request
    /// fails and is cancelled; what was routed stays within the window.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_that_ignores_its_window_fails_its_request() {
        const CHUNK: usize = 256 << 10;
        let (client_side, agent_side) = tokio::io::duplex(1 << 20);
        let (cr, cw) = tokio::io::split(client_side);
        let (ar, aw) = tokio::io::split(agent_side);
        let agent = tokio::spawn(async move {
            let mut out = FramedWrite::new(aw, frame_codec());
            let mut inp = FramedRead::new(ar, frame_codec());
            let hello = encode(&FromAgent::Hello(rsb_agent::hello::hello())).unwrap();
            out.send(hello).await.unwrap();
            let id = loop {
                let f = inp.next().await.unwrap().unwrap();
                if let Ok(ToAgent::Request { id, .. }) = decode::<ToAgent>(&f) {
                    break id;
                }
            };
            // 8 MiB, twice the window, without waiting for a single credit.
            for _ in 0..32 {
                let c = FromAgent::Chunk {
                    id,
                    chunk: Chunk::Stdout(vec![b'x'; CHUNK]),
                };
                out.send(encode(&c).unwrap()).await.unwrap();
            }
            // The client cancels the request (credits may come first).
            loop {
                match inp.next().await {
                    Some(Ok(f)) => {
                        if let Ok(ToAgent::Cancel { id: c }) = decode::<ToAgent>(&f) {
                            return c == id;
                        }
                    }
                    _ => return false,
                }
            }
        });
        let client = AgentClient::start("fake", cr, cw, Box::new(()), Duration::from_secs(5))
            .await
            .unwrap();
        // A consumer that takes nothing until the agent has sent everything.
        let (tx, mut rx) = mpsc::channel(1);
        let call = tokio::spawn({
            let client = client.clone();
            async move {
                client
                    .call_streaming(ExecRequest::new("yes"), tx)
                    .await
                    .map(|_| ())
            }
        });
        let cancelled = tokio::time::timeout(Duration::from_secs(20), agent)
            .await
            .expect("the client never cancelled the request")
            .unwrap();
        assert!(cancelled);
        let mut got = 0usize;
        while let Some(c) = rx.recv().await {
            if let Chunk::Stdout(b) = c {
                got += b.len();
            }
        }
        let e = call.await.unwrap().unwrap_err();
        assert!(e.message.contains("window"), "{}", e.message);
        assert!(
            got as u64 <= rsb_protocol::OUTPUT_WINDOW + CHUNK as u64,
            "{got} bytes routed to the consumer"
        );
        assert!(got > 0);
    }

    #[test]
    fn the_window_allows_one_frame_alone_or_what_fits() {
        let w = rsb_protocol::OUTPUT_WINDOW;
        assert!(within_window(0, 16 << 20), "one large frame alone");
        assert!(within_window(w - 10, 10));
        assert!(!within_window(w - 10, 11));
        assert!(!within_window(1, u64::MAX));
    }
}
