//! One apply session on the destination, and the guards that end it.
//!
//! The session numbers its requests as they are queued, so the agent runs them in the order
//! they were made; the guards make sure a sync that stops early (error, cancel, drop) aborts
//! its session and its helper tasks instead of leaving staging behind.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use rsb_protocol::{ApplyAbortRequest, ApplyCloseRequest, ApplyOp, ApplyRequest};

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
    next_seq: AtomicU64,
}

impl Session {
    pub(super) fn new(dst: &AgentClient, id: u64) -> Session {
        Session {
            dst: dst.clone(),
            id,
            next_seq: AtomicU64::new(0),
        }
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

    /// Apply one batch of small files, packed into one compressed op when `comp` compresses
    /// here (on a blocking thread, so batches compress in parallel). Batches of small files
    /// are independent of each other, so the order they reach the agent in, which packing
    /// may change, does not matter.
    pub(super) async fn apply_batch(
        &self,
        ops: Vec<ApplyOp>,
        info: BatchInfo,
        comp: Arc<Compress>,
    ) -> Result<BatchInfo> {
        let ops = if comp.here() {
            tokio::task::spawn_blocking(move || comp.pack(ops))
                .await
                .map_err(|e| RsbError::internal(format!("compressing a batch: {e}")))?
        } else {
            ops
        };
        self.apply(ops).await?;
        Ok(info)
    }

    /// Apply, answering with `(raw, wire)` bytes and when the request was handed to the
    /// channel.
    pub(super) async fn apply_timed(
        &self,
        ops: Vec<ApplyOp>,
        bytes: (u64, u64),
    ) -> Result<((u64, u64), Instant)> {
        let at = Instant::now();
        self.apply(ops).await?;
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
