//! One apply session on the destination, and the guards that end it.
//!
//! The session numbers its requests as they are queued, so the agent runs them in the order
//! they were made; the guards make sure a sync that stops early (error, cancel, drop) aborts
//! its session and its helper tasks instead of leaving staging behind.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Instant,
};

use rsb_protocol::{
    ApplyAbortRequest, ApplyCloseRequest, ApplyOp, ApplyOpened, ApplyRequest,
    compress::{MAX_RAW, SAVE_DIV, StreamEncoder},
};

use super::progress::BatchInfo;
use crate::{
    client::AgentClient,
    error::{Result, RsbError},
    sync::{compress::Compress, plan::BLOCK_SIZE},
};

/// An open apply session on the destination.
///
/// Its requests are numbered at the moment the client queues their frames, so they reach the
/// agent in number order, and the agent runs them in that order: pipelined batches cannot
/// overtake each other, however their futures or the agent's tasks are scheduled.
pub(super) struct Session {
    pub(super) dst: AgentClient,
    pub(super) id: u64,
    /// The destination root and the session's staging directory in it, as the agent said.
    pub(super) root: String,
    pub(super) staging: String,
    next_seq: AtomicU64,
    comp: Arc<Compress>,
    /// The session's upload stream, when this process compresses. Its lock is held from
    /// compressing a piece until the piece's request is numbered, so stream order is `seq`
    /// order, which is the order the agent decodes in.
    stream: Option<Arc<tokio::sync::Mutex<StreamEncoder>>>,
}

impl Session {
    pub(super) fn new(
        dst: &AgentClient,
        opened: &ApplyOpened,
        comp: Arc<Compress>,
    ) -> Result<Session> {
        let stream = if comp.here() {
            let enc = StreamEncoder::new()
                .map_err(|e| RsbError::internal(format!("starting the upload stream: {e}")))?;
            Some(Arc::new(tokio::sync::Mutex::new(enc)))
        } else {
            None
        };
        Ok(Session {
            dst: dst.clone(),
            id: opened.session,
            root: opened.root.clone(),
            staging: opened.staging.clone(),
            next_seq: AtomicU64::new(0),
            comp,
            stream,
        })
    }

    fn seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) async fn apply(&self, ops: Vec<ApplyOp>) -> Result<u32> {
        let req = || ApplyRequest {
            session: self.id,
            seq: self.seq(),
            ops,
        };
        Ok(self.dst.call_with(req).await?.applied)
    }

    /// Take over what an interrupted sync of `rel` left staged: the hashes of its blocks.
    pub(super) async fn resume(&self, rel: &str) -> Result<Vec<[u8; 32]>> {
        let req = || ApplyRequest {
            session: self.id,
            seq: self.seq(),
            ops: vec![ApplyOp::FileResume {
                rel: rel.to_string(),
                block_size: BLOCK_SIZE,
            }],
        };
        Ok(self.dst.call_with(req).await?.resumed)
    }

    /// Open `rel`'s staged copy to other channels ([`ApplyOp::FileShare`]): its name in the
    /// staging directory.
    pub(super) async fn share(&self, rel: &str) -> Result<String> {
        let req = || ApplyRequest {
            session: self.id,
            seq: self.seq(),
            ops: vec![ApplyOp::FileShare {
                rel: rel.to_string(),
            }],
        };
        let mut r = self.dst.call_with(req).await?;
        r.shared.pop().ok_or_else(|| {
            RsbError::internal(format!("the agent did not say where {rel} is staged"))
        })
    }

    /// Apply `ops` as the next piece of the upload stream when this process compresses
    /// (else as they are): `(applied, bytes on the wire)`. `skip` is a large file's memory
    /// that a piece of it did not shrink by a tenth, after which its bytes travel raw.
    async fn send(&self, ops: Vec<ApplyOp>, skip: Option<&AtomicBool>) -> Result<(u32, u64)> {
        let stream = match &self.stream {
            Some(s) if !skip.is_some_and(|s| s.load(Ordering::Relaxed)) => s,
            _ => {
                let wire = data_bytes(&ops);
                return Ok((self.apply(ops).await?, wire));
            }
        };
        let turn = stream.clone().lock_owned().await;
        // Encoding and compressing take a few ms per MiB: off the runtime.
        let work = move || {
            let mut turn = turn;
            let raw = match rsb_protocol::codec::encode(&ops) {
                Ok(raw) if raw.len() <= MAX_RAW => raw,
                _ => return (turn, Err(ops)),
            };
            let piece = turn.piece(&raw).map(|(pos, data)| (pos, raw.len(), data));
            (turn, Ok(piece))
        };
        let (turn, piece) = tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| RsbError::internal(format!("compressing the upload stream: {e}")))?;
        let (pos, raw_len, data) = match piece {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                return Err(RsbError::internal(format!(
                    "compressing the upload stream: {e}"
                )));
            }
            // Too large for one piece (never made by the batching): as it is.
            Err(ops) => {
                drop(turn);
                let wire = data_bytes(&ops);
                return Ok((self.apply(ops).await?, wire));
            }
        };
        let wire = data.len() as u64;
        self.comp.record(raw_len as u64, wire);
        if let Some(s) = skip.filter(|_| data.len() > raw_len - raw_len / SAVE_DIV) {
            s.store(true, Ordering::Relaxed);
        }
        let ops = vec![ApplyOp::Stream {
            pos,
            raw_len: raw_len as u64,
            data,
        }];
        let req = move || {
            let req = ApplyRequest {
                session: self.id,
                seq: self.seq(),
                ops,
            };
            // Numbered: the next piece may be made.
            drop(turn);
            req
        };
        Ok((self.dst.call_with(req).await?.applied, wire))
    }

    /// Apply one batch of small files (through the upload stream when compressing).
    pub(super) async fn apply_batch(
        &self,
        ops: Vec<ApplyOp>,
        info: BatchInfo,
    ) -> Result<BatchInfo> {
        self.send(ops, None).await?;
        Ok(info)
    }

    /// Apply a large file's chunks, answering with `(raw, wire)` bytes and when the request
    /// was handed to the channel. `(raw, wire)` are the ones given, which the window counted
    /// when it was sent.
    pub(super) async fn apply_timed(
        &self,
        ops: Vec<ApplyOp>,
        bytes: (u64, u64),
        skip: Arc<AtomicBool>,
    ) -> Result<((u64, u64), Instant)> {
        let at = Instant::now();
        self.send(ops, Some(&skip)).await?;
        Ok((bytes, at))
    }

    /// Finish the session after every batch (directory mtimes last).
    pub(super) async fn close(
        &self,
        dir_mtimes: Vec<(String, i64)>,
    ) -> Result<rsb_protocol::ApplyResult> {
        let req = || ApplyCloseRequest {
            session: self.id,
            seq: self.seq(),
            dir_mtimes,
        };
        self.dst.call_with(req).await
    }
}

/// File bytes in `ops`: what they cost on the wire uncompressed (near enough).
fn data_bytes(ops: &[ApplyOp]) -> u64 {
    ops.iter()
        .map(|o| match o {
            ApplyOp::FileData { data, .. } => data.len() as u64,
            _ => 0,
        })
        .sum()
}

/// Give up a session out of order: batches not yet run fail, the staging dir goes.
pub(super) async fn abort(dst: AgentClient, session: u64) -> Result<()> {
    dst.call(ApplyAbortRequest { session }).await
}

/// Aborts a helper task when the sync stops (or is dropped) before it finishes.
pub(super) struct AbortOnDrop<T>(pub(super) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Aborts an apply session (dropping what was staged) when the sync stops early.
pub(super) struct SessionGuard {
    pub(super) dst: AgentClient,
    pub(super) session: u64,
    pub(super) armed: bool,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if !self.armed || !self.dst.is_alive() {
            return;
        }
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(abort(self.dst.clone(), self.session));
        }
    }
}
