//! A sync between this machine and a sandbox, as every caller runs it (the CLI, `--watch`,
//! the MCP tools and the background transfer worker): both agents connected through the
//! pool, and the last-synced baseline of the pair of roots loaded from the store and saved
//! back, which is what tells a remote edit from a conflict. One sync of a pair of roots runs
//! at a time: the others wait for its lock ([`crate::store::roots_lock`]).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;

use crate::{
    app::App,
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
        // A non-blocking lock of a small file: no wait to keep off the runtime.
        match roots_lock::try_lock(&state_dir, key)? {
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
    app: &App,
    sandbox: &str,
    spec: &SyncSpec,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<SyncReport> {
    run_with(app, sandbox, spec, &RunOptions::default(), progress, cancel).await
}

/// [`run`] with options, and the last-synced baseline of this pair of roots: loaded from the
/// store for conflict detection, saved after a sync that completed, and after one that failed
/// or was cancelled for what it did commit. The roots' lock is held from that load to that
/// save (a dry run, which saves nothing, takes none).
pub async fn run_with(
    app: &App,
    sandbox: &str,
    spec: &SyncSpec,
    opts: &RunOptions,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<SyncReport> {
    let pool = app.pool();
    let (remote, local) = tokio::try_join!(pool.client(sandbox), pool.local_agent())?;
    let key = (
        spec.local_path.display().to_string(),
        sandbox.to_string(),
        sync::engine::anchor_home(&spec.remote_path),
    );
    // The baseline is what tells a remote edit from a conflict: a store that cannot be read
    // refuses the sync (never a first sync that would overwrite the edit).
    let store = Some(app.transfers().await?);
    let _held = match spec.dry_run {
        true => None,
        false => Some(hold_roots(pool, &key, progress.as_ref(), cancel).await?),
    };
    let mut opts = opts.clone();
    if opts.baseline.is_none()
        && let Some(t) = &store
    {
        opts.baseline = t.load_baseline_shared(&key.0, &key.1, &key.2).await?;
    }
    let sink = Arc::new(parking_lot::Mutex::new(None));
    opts.baseline_sink = Some(sink.clone());
    let journal = store
        .clone()
        .filter(|_| !spec.dry_run)
        .map(|t| JournalWriter::start(t, key.clone()));
    if let Some(j) = &journal {
        opts.journal = Some(j.sink());
    }
    let ran = sync::run_with(&local, &remote, spec, progress, cancel, &opts).await;
    // Every journal write lands before the baseline is saved (a later one would lay this
    // run's commits over the saved baseline).
    if let Some(j) = journal {
        j.finish().await;
    }
    let mut report = match ran {
        Ok(r) => r,
        Err(e) => {
            // A failed or cancelled run saves what it did commit, so an edit after the cut
            // reads as an edit, not a conflict.
            let b = sink.lock().take();
            if let (Some(t), Some(b)) = (&store, b)
                && !spec.dry_run
                && opts.baseline.as_deref() != Some(&b)
                && let Err(se) = t.save_baseline(&key.0, &key.1, &key.2, Arc::new(b)).await
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
            t.touch_baseline(&key.0, &key.1, &key.2).await
        } else {
            t.save_baseline(&key.0, &key.1, &key.2, Arc::new(b)).await
        };
        if let Err(e) = r {
            report
                .warnings
                .push(format!("the sync baseline was not saved: {}", e.message));
        }
    }
    Ok(report)
}

/// The journal of a running sync ([`RunOptions::journal`]). The engine hands over each
/// acknowledged batch's commits without waiting (it calls from its own task, and a store held
/// by another process must not stall the transfer); one task writes them to the store in the
/// order they came. Held in memory meanwhile: at most the run's commits, which the engine
/// holds anyway. A kill of the process can land between an acknowledgement and its journal
/// write (one store call, well under a millisecond unless the store is held): such a file is
/// then a conflict on the next sync, as a commit the journal missed always was.
struct JournalWriter {
    shared: Arc<JournalShared>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct JournalShared {
    pending: parking_lot::Mutex<Vec<(String, [u8; 32])>>,
    wake: tokio::sync::Notify,
    closed: std::sync::atomic::AtomicBool,
}

impl JournalWriter {
    fn start(t: Arc<crate::store::transfers::Transfers>, key: Key) -> JournalWriter {
        let shared = Arc::new(JournalShared::default());
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let batch = std::mem::take(&mut *s.pending.lock());
                if batch.is_empty() {
                    if s.closed.load(std::sync::atomic::Ordering::Acquire) {
                        return;
                    }
                    s.wake.notified().await;
                    continue;
                }
                // A commit the journal misses is only known to this run: a kill before its
                // end makes that file a conflict, as before the journal. Say so, and go on.
                if let Err(e) = t.journal_commits(&key.0, &key.1, &key.2, batch).await {
                    tracing::warn!("a sync commit was not journaled: {}", e.message);
                }
            }
        });
        JournalWriter { shared, task }
    }

    /// What the engine calls with each batch of commits.
    fn sink(&self) -> sync::engine::CommitJournal {
        let s = self.shared.clone();
        Arc::new(move |commits: &[(String, [u8; 32])]| {
            s.pending.lock().extend_from_slice(commits);
            s.wake.notify_one();
        })
    }

    /// Every commit handed over is written (or its failure said).
    async fn finish(mut self) {
        self.close();
        let _ = (&mut self.task).await;
    }

    fn close(&self) {
        self.shared
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.shared.wake.notify_one();
    }
}

impl Drop for JournalWriter {
    /// A run dropped midway (its caller cancelled): the task writes what it has and ends.
    fn drop(&mut self) {
        self.close();
    }
}
