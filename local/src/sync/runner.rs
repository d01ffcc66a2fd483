//! A sync between this machine and a sandbox, as every caller runs it (the CLI, `--watch`,
//! the MCP tools and the background transfer worker): both agents connected through the
//! pool, and the last-synced baseline of the pair of roots loaded from the store and saved
//! back, which is what tells a remote edit from a conflict. One sync of a pair of roots runs
//! at a time: the others wait for its lock ([`crate::store::roots_lock`]).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::{
    error::Result,
    pool::Pool,
    store::{
        baselines::Key,
        roots_lock::{self, Attempt, RootsLock},
    },
    sync::{self, Phase, Progress, ProgressFn, RunOptions, SyncReport, SyncSpec},
};

/// The longest pause between two looks at a busy lock: a waiting sync starts within this of
/// the other's end.
const LOCK_POLL_MAX: Duration = Duration::from_millis(100);

/// Take the lock of `key`'s roots, waiting for the sync that holds it (reported as
/// [`Phase::Waiting`], with who holds it) until it ends or `cancel` fires.
pub async fn hold_roots(
    pool: &Pool,
    key: &Key,
    progress: Option<&ProgressFn>,
    cancel: &CancellationToken,
) -> Result<RootsLock> {
    let state_dir = pool.config().state_dir.clone();
    let started = Instant::now();
    let mut delay = Duration::from_millis(5);
    let mut shown = String::new();
    loop {
        match crate::store::blocking(|| roots_lock::try_lock(&state_dir, key))? {
            Attempt::Held(lock) => return Ok(lock),
            Attempt::Busy(who) => {
                if who != shown {
                    tracing::info!(
                        "waiting for another sync of {} ↔ {}:{} ({who})",
                        key.0,
                        key.1,
                        key.2
                    );
                    if let Some(p) = progress {
                        p(&Progress {
                            phase: Phase::Waiting,
                            waiting_for: who.clone(),
                            elapsed_s: started.elapsed().as_secs_f64(),
                            ..Progress::default()
                        });
                    }
                    shown = who;
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = cancel.cancelled() => return Err(sync::engine::cancelled_error()),
                }
                delay = (delay * 2).min(LOCK_POLL_MAX);
            }
        }
    }
}

/// Connect both ends and run the engine.
pub async fn run(
    pool: &Pool,
    sandbox: &str,
    spec: &SyncSpec,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<SyncReport> {
    run_with(
        pool,
        sandbox,
        spec,
        &RunOptions::default(),
        progress,
        cancel,
    )
    .await
}

/// [`run`] with options, and the last-synced baseline of this pair of roots: loaded from the
/// store for conflict detection, saved after a sync that completed, and after one that failed
/// or was cancelled for what it did commit. The roots' lock is held from that load to that
/// save (a dry run, which saves nothing, takes none).
pub async fn run_with(
    pool: &Pool,
    sandbox: &str,
    spec: &SyncSpec,
    opts: &RunOptions,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<SyncReport> {
    let (remote, local) = tokio::try_join!(pool.client(sandbox), pool.local_agent())?;
    let key = (
        spec.local_path.display().to_string(),
        sandbox.to_string(),
        sync::engine::anchor_home(&spec.remote_path),
    );
    // The baseline is what tells a remote edit from a conflict: a store that cannot be read
    // refuses the sync (never a first sync that would overwrite the edit).
    let store = Some(pool.transfers()?);
    let _held = match spec.dry_run {
        true => None,
        false => Some(hold_roots(pool, &key, progress.as_ref(), cancel).await?),
    };
    let mut opts = opts.clone();
    if opts.baseline.is_none()
        && let Some(t) = &store
    {
        opts.baseline = t.load_baseline_shared(&key.0, &key.1, &key.2)?;
    }
    let sink = std::sync::Arc::new(parking_lot::Mutex::new(None));
    opts.baseline_sink = Some(sink.clone());
    if let Some(t) = store.clone().filter(|_| !spec.dry_run) {
        let key = key.clone();
        opts.journal = Some(std::sync::Arc::new(
            move |commits: &[(String, [u8; 32])]| {
                // A commit the journal misses is only known to this run: a kill before its end
                // makes that file a conflict, as before the journal. Say so, and go on.
                if let Err(e) = t.journal_commits(&key.0, &key.1, &key.2, commits) {
                    tracing::warn!("a sync commit was not journaled: {}", e.message);
                }
            },
        ));
    }
    let mut report = match sync::run_with(&local, &remote, spec, progress, cancel, &opts).await {
        Ok(r) => r,
        Err(e) => {
            // A failed or cancelled run saves what it did commit, so an edit after the cut
            // reads as an edit, not a conflict.
            let b = sink.lock().take();
            if let (Some(t), Some(b)) = (&store, b)
                && !spec.dry_run
                && opts.baseline.as_deref() != Some(&b)
                && let Err(se) = t.save_baseline(&key.0, &key.1, &key.2, &b)
            {
                tracing::warn!("the sync baseline was not saved: {}", se.message);
            }
            return Err(e);
        }
    };
    if let (Some(t), Some(b)) = (&store, report.baseline_out.take())
        && !spec.dry_run
        && !report.handed_off
    {
        // A no-change resync leaves it as it was: no write (a 2,000-file baseline is ~150 KB),
        // only its "last synced" day, which retention goes by.
        let r = if opts.baseline.as_deref() == Some(&b) {
            t.touch_baseline(&key.0, &key.1, &key.2)
        } else {
            t.save_baseline(&key.0, &key.1, &key.2, &b)
        };
        if let Err(e) = r {
            report
                .warnings
                .push(format!("the sync baseline was not saved: {}", e.message));
        }
    }
    Ok(report)
}
