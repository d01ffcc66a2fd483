//! A job's end, the moment the agent sees it: one subscription to the agent's job events
//! ([`JobEnds`]) per sandbox where this session started a job that has not ended,
//! watched or not. Each end of one of those runs becomes a channel push, claimed through
//! [`Followed::take_job`] so that the store's report of a watched job's end (which the
//! [`channel`](super::channel) scan reads) and the stream's are never both sent.
//!
//! The subscription asks for every end since the earliest unreported start, so an end that
//! came before it connected, or while its connection was down, is reported when it
//! (re)connects. It ends itself when nothing is left to hear about on its sandbox; the
//! channel's loop starts another when the session starts a job there again.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::channel::{Followed, Message, run_ended};
use crate::client::JobEnds;
use crate::pool::Pool;

/// The first wait before reconnecting a subscription that failed; it doubles up to
/// [`RETRY_MAX`] while the sandbox stays unreachable.
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Report the ends of this session's jobs on `sandbox` to `out` until none is left there or
/// `ct` is cancelled.
pub(super) async fn follow(
    pool: Arc<Pool>,
    sandbox: String,
    followed: Arc<Followed>,
    out: mpsc::Sender<Message>,
    ct: CancellationToken,
) {
    let mut retry = RETRY_FIRST;
    while let Some(since_ms) = followed.first_started(&sandbox) {
        let ended = tokio::select! {
            _ = ct.cancelled() => return,
            r = subscribe(&pool, &sandbox, since_ms, &followed, &out) => r,
        };
        match ended {
            Ok(()) => return,
            Err(e) => {
                tracing::info!("job events on {sandbox}: {e}; reconnecting");
                tokio::select! {
                    _ = ct.cancelled() => return,
                    _ = tokio::time::sleep(retry) => {}
                }
                retry = (retry * 2).min(RETRY_MAX);
            }
        }
    }
}

/// One subscription: `Ok` once nothing is left to hear about on the sandbox (dropping it
/// cancels it on the agent), `Err` when the connection or the request failed.
async fn subscribe(
    pool: &Pool,
    sandbox: &str,
    since_ms: u64,
    followed: &Followed,
    out: &mpsc::Sender<Message>,
) -> Result<(), String> {
    let client = pool.client(sandbox).await.map_err(|e| e.message)?;
    let mut ends = JobEnds::subscribe(&client, since_ms);
    loop {
        let e = ends.next().await.map_err(|e| e.message)?;
        let key = (sandbox.to_string(), e.info.name.clone(), e.info.started_ms);
        if let Some(watch_id) = followed.take_job(&key)
            && out.send(run_ended(sandbox, &e, watch_id)).await.is_err()
        {
            // The channel's loop is gone: the session ended.
            return Ok(());
        }
        if followed.first_started(sandbox).is_none() {
            return Ok(());
        }
    }
}
