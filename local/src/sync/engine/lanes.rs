//! Lanes: extra channels for a large upload on a long link.
//!
//! One SSH channel carries at most its flow-control window per round trip (OpenSSH's sshd
//! grants 2 MiB: 20 MB/s at 100 ms, whatever the link holds), which is what bounded rsb and
//! rsync alike there. A large file's bytes are spread over a few more agents on the same host,
//! each on a channel of its own ([`AgentClient::sibling`]): the session opens the file's staged
//! copy to them ([`ApplyOp::FileShare`]) and they write into it ([`StagedWriteRequest`]), in
//! any order; the session's commit, in its `seq` order on the first channel, hashes the whole
//! staged file, so nothing a lane writes is trusted. The first channel then carries only the
//! session's own requests, so an exec there is not queued behind the file's bytes.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use rsb_protocol::{ApplyOp, StagedWriteRequest};

use crate::{
    client::AgentClient,
    error::{Result, RsbError},
    sync::compress::Compress,
};

/// Lanes are opened for an upload whose link's own round trip is at least this: below it one
/// channel's window holds more than the link carries per round trip (2 MiB per 20 ms is
/// 100 MB/s).
pub(super) const LANES_RTT: Duration = Duration::from_millis(20);
/// Extra channels opened (sshd's `MaxSessions` is 10 by default; one is always left free).
const LANES: usize = 4;
/// A large file is spread only when it sends at least this much: opening the lanes costs a
/// round trip or two.
pub(super) const LANES_MIN_BYTES: u64 = 16 * 1024 * 1024;

/// Wire bytes one lane holds in flight at most: OpenSSH's channel window (sshd grants 2 MiB).
/// More would wait in this process's buffers for the window, where the byte window's
/// controller reads the wait as a queue on the link and shrinks.
pub(super) const LANE_BYTES: u64 = 2 * 1024 * 1024;

/// How many lanes a transfer opens (0: none), over [`LANES`].
pub const ENV: &str = "RSB_SYNC_LANES";

/// The lanes of one transfer, opened when its first large enough file needs them.
pub(super) struct Lanes {
    /// How many to open (0: this transfer never spreads).
    want: usize,
    open: tokio::sync::OnceCell<Vec<AgentClient>>,
}

impl Lanes {
    /// `far`: an upload over a link whose round trip is at least [`LANES_RTT`].
    /// `RSB_SYNC_LANES` sets how many extra channels (0 turns lanes off).
    pub(super) fn new(far: bool) -> Lanes {
        let want = std::env::var(ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map_or(LANES, |n| n.min(8));
        Lanes {
            want: if far { want } else { 0 },
            open: tokio::sync::OnceCell::new(),
        }
    }

    /// The lanes to `dst`'s host, opened in parallel at the first call; empty when this
    /// transfer does not spread or no channel could be opened (the file then goes over the
    /// session's own channel, as on a short link).
    pub(super) async fn get(&self, dst: &AgentClient) -> &[AgentClient] {
        if self.want == 0 {
            return &[];
        }
        self.open
            .get_or_init(|| async {
                let tries = (0..self.want).map(|_| dst.sibling());
                let mut lanes = Vec::new();
                for got in futures::future::join_all(tries).await {
                    match got {
                        Some(Ok(c)) => lanes.push(c),
                        Some(Err(e)) => tracing::info!("{}", e.message),
                        None => {}
                    }
                }
                tracing::debug!(lanes = lanes.len(), "lanes opened");
                lanes
            })
            .await
    }
}

/// Where a shared staged file is, for [`StagedWriteRequest`]s.
pub(super) struct Shared<'a> {
    pub(super) root: &'a str,
    pub(super) staging: &'a str,
    pub(super) name: String,
    pub(super) lanes: &'a [AgentClient],
}

impl Shared<'_> {
    /// Write `ops` (one file's `FileData`) through lane `k`: each
    /// run of adjacent blocks as one request, compressed on its own when `comp` compresses here
    /// and the file's bytes still shrink (`skip` is set at the first run that does not).
    pub(super) async fn write(
        &self,
        k: usize,
        ops: Vec<ApplyOp>,
        comp: &Arc<Compress>,
        skip: &Arc<AtomicBool>,
    ) -> Result<()> {
        let lane = &self.lanes[k];
        let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
        for op in ops {
            let ApplyOp::FileData { offset, data, .. } = op else {
                return Err(RsbError::internal(
                    "a lane was given an op that is not data",
                ));
            };
            match runs.last_mut() {
                Some((at, run)) if *at + run.len() as u64 == offset => run.extend(data),
                _ => runs.push((offset, data)),
            }
        }
        let sends = runs.into_iter().map(|(offset, data)| async move {
            let (raw_len, data) = self.pack(data, comp, skip).await?;
            lane.call(StagedWriteRequest {
                root: self.root.to_string(),
                staging: self.staging.to_string(),
                name: self.name.clone(),
                offset,
                raw_len,
                data,
                confine: lane.confine().cloned(),
            })
            .await
        });
        futures::future::try_join_all(sends).await?;
        Ok(())
    }

    /// `data` as it travels: `(Some(raw length), zstd frame)` when compressing saves a tenth,
    /// else `(None, data)`.
    async fn pack(
        &self,
        data: Vec<u8>,
        comp: &Arc<Compress>,
        skip: &Arc<AtomicBool>,
    ) -> Result<(Option<u64>, Vec<u8>)> {
        if !comp.here() || skip.load(Ordering::Relaxed) {
            return Ok((None, data));
        }
        let (comp, skip) = (comp.clone(), skip.clone());
        let work = move || {
            let raw = data.len() as u64;
            match rsb_protocol::compress::compress(&data) {
                Some(z) => {
                    comp.record(raw, z.len() as u64);
                    (Some(raw), z)
                }
                None => {
                    skip.store(true, Ordering::Relaxed);
                    (None, data)
                }
            }
        };
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| RsbError::internal(format!("compressing a large file's bytes: {e}")))
    }
}
