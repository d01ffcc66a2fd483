//! The agent client: one framed channel to one agent, many requests in flight on it.
//!
//! Requests get ids; one reader task routes replies and streamed chunks back to the waiting
//! caller by id, one writer task serialises frames. When the channel dies, every waiter is
//! failed at once with `connection lost` instead of sitting out its own timeout. Dropping a
//! call's future before it completes sends a `Cancel` for it, so an abandoned exec is killed
//! on the remote rather than left running.

use std::{
    any::Any,
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use rsb_protocol::{
    Chunk, ExecRequest, ExecResult, FileStat, FromAgent, Hello, JobInfo, JobKillRequest,
    JobStartRequest, JobStatusRequest, JobStatusResult, ListDirRequest, ListDirResult, MAGIC,
    PROTOCOL_VERSION, ReadFileRequest, ReadFileResult, Reply, Request, ResourceSnapshot,
    ResourcesRequest, StatRequest, ToAgent, decode, encode, frame_codec,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{mpsc, oneshot},
};
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::error::{Kind, Result, RsbError};

type ReplyTx = oneshot::Sender<Result<Reply>>;

struct Pending {
    reply: ReplyTx,
    chunks: Option<mpsc::Sender<Chunk>>,
}

struct Inner {
    sandbox: String,
    hello: Hello,
    out: mpsc::Sender<Bytes>,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    close_reason: Mutex<Option<String>>,
    /// Transport resources (SSH handle, child process) that must live as long as the channel.
    _keep: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Inner {
    fn fail_all(&self, reason: &str) {
        self.closed.store(true, Ordering::SeqCst);
        {
            let mut r = self.close_reason.lock().unwrap();
            if r.is_none() {
                *r = Some(reason.to_string());
            }
        }
        let drained: Vec<Pending> = self
            .pending
            .lock()
            .unwrap()
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in drained {
            let _ = p
                .reply
                .send(Err(RsbError::connection_lost(&self.sandbox, reason)));
        }
    }
}

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
        let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(256);
        let inner = Arc::new(Inner {
            sandbox: sandbox.to_string(),
            hello,
            out: out_tx,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(None),
            _keep: Mutex::new(Some(keep)),
        });

        let w_inner = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut sink = FramedWrite::new(writer, frame_codec());
            while let Some(frame) = out_rx.recv().await {
                // Batch whatever else is queued into one flush.
                let mut res = sink.feed(frame).await;
                while res.is_ok() {
                    match out_rx.try_recv() {
                        Ok(f) => res = sink.feed(f).await,
                        Err(_) => break,
                    }
                }
                if res.is_ok() {
                    res = SinkExt::<Bytes>::flush(&mut sink).await;
                }
                if let Err(e) = res {
                    if let Some(i) = w_inner.upgrade() {
                        i.fail_all(&format!("write failed: {e}"));
                    }
                    return;
                }
            }
        });

        let r_inner = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let reason = loop {
                let Some(frame) = frames.next().await else {
                    break "agent channel closed".to_string();
                };
                let buf = match frame {
                    Ok(b) => b,
                    Err(e) => break format!("read failed: {e}"),
                };
                let msg = match decode::<FromAgent>(&buf) {
                    Ok(m) => m,
                    Err(e) => break format!("malformed frame from agent: {e}"),
                };
                let Some(inner) = r_inner.upgrade() else {
                    return;
                };
                match msg {
                    FromAgent::Reply { id, body } => {
                        let p = inner.pending.lock().unwrap().remove(&id);
                        if let Some(p) = p {
                            let _ = p.reply.send(Ok(body));
                        }
                    }
                    FromAgent::Chunk { id, chunk } => {
                        let tx = inner
                            .pending
                            .lock()
                            .unwrap()
                            .get(&id)
                            .and_then(|p| p.chunks.clone());
                        if let Some(tx) = tx {
                            // A slow consumer slows this channel; consumers only print or count.
                            let _ = tx.send(chunk).await;
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

    pub fn is_alive(&self) -> bool {
        !self.inner.closed.load(Ordering::SeqCst) && !self.inner.out.is_closed()
    }

    /// Tear the channel down; in-flight calls fail with `connection lost`.
    pub fn close(&self, reason: &str) {
        self.inner.fail_all(reason);
        self.inner._keep.lock().unwrap().take();
    }

    pub async fn call(&self, body: Request) -> Result<Reply> {
        self.call_inner(body, None).await
    }

    /// Like [`call`](Self::call), forwarding streamed chunks to `chunks` as they arrive.
    pub async fn call_streaming(
        &self,
        body: Request,
        chunks: mpsc::Sender<Chunk>,
    ) -> Result<Reply> {
        self.call_inner(body, Some(chunks)).await
    }

    async fn call_inner(
        &self,
        body: Request,
        chunks: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Reply> {
        if !self.is_alive() {
            let reason = self
                .inner
                .close_reason
                .lock()
                .unwrap()
                .clone()
                .unwrap_or_else(|| "closed".into());
            return Err(RsbError::connection_lost(&self.inner.sandbox, &reason));
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let kind = body.kind();
        let frame = encode(&ToAgent::Request { id, body }).map_err(|e| {
            RsbError::invalid(
                format!("{kind} request too large: {e}"),
                "send less data per call",
            )
        })?;
        let (tx, rx) = oneshot::channel();
        self.inner
            .pending
            .lock()
            .unwrap()
            .insert(id, Pending { reply: tx, chunks });
        let mut guard = CancelOnDrop {
            inner: &self.inner,
            id,
            armed: true,
        };
        if self.inner.out.send(frame).await.is_err() {
            guard.armed = false;
            self.inner.pending.lock().unwrap().remove(&id);
            return Err(RsbError::connection_lost(
                &self.inner.sandbox,
                "writer stopped",
            ));
        }
        // A close that raced with the insert above must not leave us waiting forever.
        if self.inner.closed.load(Ordering::SeqCst)
            && let Some(p) = self.inner.pending.lock().unwrap().remove(&id)
        {
            let _ = p.reply.send(Err(RsbError::connection_lost(
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

    pub async fn ping(&self, payload: Vec<u8>) -> Result<Vec<u8>> {
        match self.call(Request::Ping { payload }).await? {
            Reply::Pong { payload } => Ok(payload),
            other => Err(unexpected("ping", &other)),
        }
    }

    pub async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        expect_exec(self.call(Request::Exec(req)).await?)
    }

    pub async fn exec_streaming(
        &self,
        req: ExecRequest,
        chunks: mpsc::Sender<Chunk>,
    ) -> Result<ExecResult> {
        expect_exec(self.call_streaming(Request::Exec(req), chunks).await?)
    }

    pub async fn stat(&self, path: &str, follow: bool) -> Result<FileStat> {
        match self
            .call(Request::Stat(StatRequest {
                path: path.into(),
                follow,
            }))
            .await?
        {
            Reply::Stat(s) => Ok(s),
            other => Err(unexpected("stat", &other)),
        }
    }

    pub async fn list_dir(&self, req: ListDirRequest) -> Result<ListDirResult> {
        match self.call(Request::ListDir(req)).await? {
            Reply::ListDir(s) => Ok(s),
            other => Err(unexpected("list_dir", &other)),
        }
    }

    pub async fn read_file(&self, req: ReadFileRequest) -> Result<ReadFileResult> {
        match self.call(Request::ReadFile(req)).await? {
            Reply::ReadFile(s) => Ok(s),
            other => Err(unexpected("read_file", &other)),
        }
    }

    pub async fn resources(&self, req: ResourcesRequest) -> Result<ResourceSnapshot> {
        match self.call(Request::Resources(req)).await? {
            Reply::Resources(s) => Ok(s),
            other => Err(unexpected("resources", &other)),
        }
    }

    pub async fn job_start(&self, req: JobStartRequest) -> Result<JobInfo> {
        match self.call(Request::JobStart(req)).await? {
            Reply::Job(j) => Ok(j),
            other => Err(unexpected("job_start", &other)),
        }
    }

    pub async fn job_status(&self, req: JobStatusRequest) -> Result<JobStatusResult> {
        match self.call(Request::JobStatus(req)).await? {
            Reply::JobStatus(j) => Ok(j),
            other => Err(unexpected("job_status", &other)),
        }
    }

    pub async fn job_kill(&self, req: JobKillRequest) -> Result<JobInfo> {
        match self.call(Request::JobKill(req)).await? {
            Reply::Job(j) => Ok(j),
            other => Err(unexpected("job_kill", &other)),
        }
    }

    pub async fn job_list(&self) -> Result<Vec<JobInfo>> {
        match self.call(Request::JobList).await? {
            Reply::JobList(j) => Ok(j),
            other => Err(unexpected("job_list", &other)),
        }
    }
}

fn expect_exec(r: Reply) -> Result<ExecResult> {
    match r {
        Reply::Exec(e) => Ok(e),
        other => Err(unexpected("exec", &other)),
    }
}

fn unexpected(what: &str, r: &Reply) -> RsbError {
    RsbError::new(
        Kind::Internal,
        format!(
            "agent answered {what} with an unexpected reply ({:?})",
            std::mem::discriminant(r)
        ),
        "the agent and rsb disagree on the protocol; reconnecting redeploys the agent",
    )
}

/// Sends `Cancel` for a request whose caller went away before the reply.
struct CancelOnDrop<'a> {
    inner: &'a Arc<Inner>,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.inner.pending.lock().unwrap().remove(&self.id);
        if let Ok(frame) = encode(&ToAgent::Cancel { id: self.id })
            && let Err(mpsc::error::TrySendError::Full(frame)) = self.inner.out.try_send(frame)
        {
            let out = self.inner.out.clone();
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = out.send(frame).await;
                });
            }
        }
    }
}
