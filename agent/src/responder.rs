//! The agent's output side: one writer task fed by two bounded lanes, and the [`Responder`]
//! through which a request sends its chunks and its one reply.
//!
//! Small frames (replies, pongs, stats) take the control lane and overtake queued bulk frames
//! (large replies and the whole stream of a streaming request), so a big transfer delays a
//! small answer by at most the frame being written. Bounded lanes give back-pressure: a
//! request whose output cannot be written waits instead of growing memory. Each streaming
//! request also has its own credit window ([`OutWindow`]), so a caller that stops reading one
//! request stops only that one.

use std::sync::Arc;

use bytes::Bytes;
use futures::SinkExt;
use rsb_protocol::{
    AgentError, Chunk, ErrorCode, FromAgent, Reply, RequestId, encode, frame_codec,
};
use tokio::io::AsyncWrite;
use tokio::sync::mpsc;
use tokio_util::codec::FramedWrite;
use tokio_util::sync::CancellationToken;

use crate::stale;

/// Frames up to this size take the control lane.
const SMALL_FRAME: usize = 64 * 1024;
/// Queued small frames; enough for many concurrent replies without waiting on each other.
const CONTROL_LANE: usize = 64;
/// Queued bulk frames; a bulk frame may be 16 MiB, so this also bounds memory held in the queue.
const BULK_LANE: usize = 4;

/// The writer's two input lanes. Cloning is cheap; the writer ends when every clone is gone.
#[derive(Clone)]
pub struct Outbox {
    control: mpsc::Sender<Bytes>,
    bulk: mpsc::Sender<Bytes>,
}

/// The writer's ends of an [`Outbox`]'s lanes.
pub struct Lanes {
    control: mpsc::Receiver<Bytes>,
    bulk: mpsc::Receiver<Bytes>,
}

/// The writer is gone (stdout closed or failing); nothing more can be delivered.
#[derive(Debug)]
pub struct Closed;

impl Outbox {
    /// An outbox and the writer's ends of its two lanes, for [`write_frames`].
    pub fn new() -> (Outbox, Lanes) {
        let (control, control_rx) = mpsc::channel(CONTROL_LANE);
        let (bulk, bulk_rx) = mpsc::channel(BULK_LANE);
        (
            Outbox { control, bulk },
            Lanes {
                control: control_rx,
                bulk: bulk_rx,
            },
        )
    }

    pub async fn send_frame(&self, frame: Bytes, bulk: bool) -> Result<(), Closed> {
        let lane = if bulk || frame.len() > SMALL_FRAME {
            &self.bulk
        } else {
            &self.control
        };
        lane.send(frame).await.map_err(|_| Closed)
    }
}

/// One request's window of streamed chunk bytes ([`rsb_protocol::OUTPUT_WINDOW`]): a chunk
/// waits while the caller has not credited enough back, so a caller that stops reading this
/// request stops only this request. A cancel or the channel's end opens it for good, so a
/// request stuck on it can still wind down.
#[derive(Default)]
pub struct OutWindow {
    state: std::sync::Mutex<(u64, bool)>,
    notify: tokio::sync::Notify,
}

impl OutWindow {
    async fn acquire(&self, n: u64) {
        loop {
            {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let (in_flight, open) = &mut *st;
                // One frame larger than the window still goes, alone.
                if *open || *in_flight == 0 || *in_flight + n <= rsb_protocol::OUTPUT_WINDOW {
                    *in_flight += n;
                    return;
                }
            }
            // One waiter per window (a request sends its chunks in order); `notify_one` keeps
            // a permit when the credit comes before this wait starts.
            self.notify.notified().await;
        }
    }

    pub fn credit(&self, n: u64) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.0 = st.0.saturating_sub(n);
        drop(st);
        self.notify.notify_one();
    }

    pub fn open(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.notify.notify_one();
    }
}

/// Sends the frames of one request. Streaming requests send everything, final reply included,
/// on the bulk lane: one lane is FIFO, so the reply can never overtake the request's chunks.
pub struct Responder {
    id: RequestId,
    outbox: Outbox,
    window: Arc<OutWindow>,
    streaming: bool,
    replied: bool,
}

impl Responder {
    pub fn new(id: RequestId, outbox: Outbox, window: Arc<OutWindow>) -> Self {
        Self {
            id,
            outbox,
            window,
            streaming: false,
            replied: false,
        }
    }

    /// Route this request's frames through the bulk lane. Called before the first chunk, since
    /// lane order is what keeps the final reply behind the chunks.
    pub fn set_streaming(&mut self) {
        self.streaming = true;
    }

    /// Send streamed output. Waits while this request's window is used up (its caller is not
    /// reading) or the writer is backed up: that is the back-pressure that stops a fast
    /// producer. Fails only when the channel is gone.
    pub async fn chunk(&self, chunk: Chunk) -> Result<(), Closed> {
        debug_assert!(
            self.streaming,
            "chunks must be announced with set_streaming"
        );
        let frame = encode(&FromAgent::Chunk { id: self.id, chunk }).map_err(|e| {
            eprintln!("rsb-agent: request {}: cannot encode chunk: {e}", self.id);
            Closed
        })?;
        self.window.acquire(frame.len() as u64).await;
        self.outbox.send_frame(frame, true).await
    }

    /// Runs `job` on a blocking thread and sends each batch it hands to its `emit` as a chunk
    /// of this request (`to_chunk`), in order, under the request's window: a caller that stops
    /// reading stops the job. `emit` returns false once nobody listens (a cancel, a closed
    /// channel), and the job should stop then. A cancel answers at once.
    pub async fn stream_blocking<T, B>(
        &mut self,
        cancel: &CancellationToken,
        job: impl FnOnce(&mut (dyn FnMut(B) -> bool + Send)) -> Result<T, AgentError> + Send + 'static,
        to_chunk: impl Fn(B) -> Chunk,
    ) -> Result<T, AgentError>
    where
        T: Send + 'static,
        B: Send + 'static,
    {
        self.set_streaming();
        let cancelled = || AgentError::new(ErrorCode::Cancelled, "request cancelled");
        let (tx, mut rx) = mpsc::channel::<B>(2);
        let job = tokio::task::spawn_blocking(move || job(&mut |b| tx.blocking_send(b).is_ok()));
        loop {
            let batch = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(cancelled()),
                b = rx.recv() => b,
            };
            let Some(batch) = batch else { break };
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(cancelled()),
                r = self.chunk(to_chunk(batch)) => if r.is_err() {
                    return Err(AgentError::new(ErrorCode::Io, "the channel closed"));
                },
            }
        }
        job.await.unwrap_or_else(|e| {
            Err(AgentError::new(
                ErrorCode::Internal,
                format!("worker failed: {e}"),
            ))
        })
    }

    pub async fn reply(mut self, body: Reply) {
        self.replied = true;
        let frame = match encode(&FromAgent::Reply { id: self.id, body }) {
            Ok(f) => f,
            Err(e) => {
                let err =
                    AgentError::new(ErrorCode::Internal, format!("cannot send the reply: {e}"));
                match encode(&FromAgent::Reply {
                    id: self.id,
                    body: Reply::Error(err),
                }) {
                    Ok(f) => f,
                    Err(_) => return,
                }
            }
        };
        // A closed channel means the agent is shutting down; the reply has nowhere to go.
        let _ = self.outbox.send_frame(frame, self.streaming).await;
    }
}

impl Drop for Responder {
    /// A request task that ends without replying (a panic in a debug build) must still answer,
    /// or its caller waits forever. Best effort: if the lane is full the frame is dropped.
    fn drop(&mut self) {
        if self.replied {
            return;
        }
        let err = AgentError::new(
            ErrorCode::Internal,
            "the agent failed while handling this request",
        );
        if let Ok(frame) = encode(&FromAgent::Reply {
            id: self.id,
            body: Reply::Error(err),
        }) {
            let lane = if self.streaming {
                &self.outbox.bulk
            } else {
                &self.outbox.control
            };
            let _ = lane.try_send(frame);
        }
    }
}

/// Write frames until every sender is gone. Small frames go first; a burst of small frames is
/// flushed once, when nothing else is queued.
pub async fn write_frames<W: AsyncWrite + Unpin>(output: W, lanes: Lanes) -> std::io::Result<()> {
    let Lanes {
        mut control,
        mut bulk,
    } = lanes;
    let mut sink = FramedWrite::new(output, frame_codec());
    loop {
        let (frame, is_bulk) = tokio::select! {
            biased;
            Some(f) = control.recv() => (f, false),
            Some(f) = bulk.recv() => (f, true),
            else => break,
        };
        sink.feed(frame).await?;
        // A bulk frame is written out before the next frame is taken: buffering it would let a
        // second bulk frame leave its queue ahead of a control frame that arrives meanwhile.
        if is_bulk || (control.is_empty() && bulk.is_empty()) {
            SinkExt::<Bytes>::flush(&mut sink).await?;
            stale::activity();
        }
    }
    SinkExt::<Bytes>::flush(&mut sink).await
}
