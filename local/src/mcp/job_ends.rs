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
//!
//! An unwatched Slurm job is followed by [`follow_slurm`] instead: its end is what Slurm and
//! the record say together, as `check_background_task` judges it (a watched one's end comes
//! from its watch).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::followed::Followed;
use super::push::{Message, run_ended, slurm_ended};
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

/// Report the ends of this session's unwatched Slurm jobs on `sandbox` to `out` until none
/// is left there or `ct` is cancelled. Their processes run on compute nodes, so the agent's
/// stream cannot see one die that never recorded its end (cancelled while pending, out of
/// memory, a wrapper killed on its node): each tick reads each job as
/// `check_background_task` does (its record, and Slurm's row from the shared poller at its
/// pace, so following costs no squeue of its own) and reports the ones that are over.
pub(super) async fn follow_slurm(
    pool: Arc<Pool>,
    sandbox: String,
    followed: Arc<Followed>,
    out: mpsc::Sender<Message>,
    ct: CancellationToken,
) {
    let mut retry = RETRY_FIRST;
    loop {
        let jobs = followed.slurm_jobs(&sandbox);
        if jobs.is_empty() {
            return;
        }
        let wait = match slurm_ends(&pool, &sandbox, &jobs, &followed, &out).await {
            Ok(Heard::SessionGone) => return,
            Ok(Heard::Asked) => {
                retry = RETRY_FIRST;
                crate::slurm::poll::TICK
            }
            Err(e) => {
                tracing::info!("Slurm job ends on {sandbox}: {e}; asking again");
                let r = retry;
                retry = (retry * 2).min(RETRY_MAX);
                r
            }
        };
        tokio::select! {
            _ = ct.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

enum Heard {
    Asked,
    /// The channel's loop is gone: the session ended.
    SessionGone,
}

/// One look at `jobs` (name, Slurm id): each one over is reported once.
async fn slurm_ends(
    pool: &Pool,
    sandbox: &str,
    jobs: &[(String, String)],
    followed: &Followed,
    out: &mpsc::Sender<Message>,
) -> Result<Heard, String> {
    let client = pool.client(sandbox).await.map_err(|e| e.message)?;
    for (name, id) in jobs {
        let req = crate::ops::jobs::status_request(name, "", 5, None, 16 * 1024)
            .map_err(|e| e.message)?;
        let v = crate::ops::slurm::jobs::status(&client, id, &req, false, Duration::MAX)
            .await
            .map_err(|e| e.message)?;
        if v["running"] == serde_json::json!(false)
            && followed.take_slurm(sandbox, name)
            && out.send(slurm_ended(sandbox, name, id, &v)).await.is_err()
        {
            return Ok(Heard::SessionGone);
        }
    }
    Ok(Heard::Asked)
}

/// Why the run `e` reports the end of failed, read from its log's tail; `None` when it did
/// not fail, or the name already holds another run.
async fn failure(
    client: &crate::client::AgentClient,
    e: &rsb_protocol::JobEvent,
) -> Option<&'static str> {
    use crate::ops::{failure, jobs};
    let end = jobs::ended(&e.info, None);
    if !end.failed() {
        return None;
    }
    let req = jobs::status_request(&e.info.name, "", 200, None, 1).ok()?;
    let r = client.call(req).await.ok()?;
    if r.info.as_ref()?.started_ms != e.info.started_ms {
        return None;
    }
    let output = String::from_utf8_lossy(rsb_protocol::job_output(&r.log));
    failure::judge(end, &output).map(|f| f.reason.name())
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
            && out
                .send(run_ended(sandbox, &e, watch_id, failure(&client, &e).await))
                .await
                .is_err()
        {
            // The channel's loop is gone: the session ended.
            return Ok(());
        }
        if followed.first_started(sandbox).is_none() {
            return Ok(());
        }
    }
}
