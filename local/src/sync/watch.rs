//! `rsb sync --watch LOCAL SANDBOX:REMOTE`: keep a sandbox in step with a local tree while it
//! is edited.
//!
//! Flow: the watcher (`notify`: inotify / FSEvents, else polling) is armed *before* the initial
//! full sync, so nothing edited during it is missed. Its events go into a channel; a burst is
//! collected until the tree has been quiet for [`WatchOptions::debounce`] (or
//! [`WatchOptions::max_burst`] has passed since the burst's first event, so a process that
//! never stops writing still gets synced), then the whole burst is sent as one ordinary sync
//! ([`super::runner::run`]: the same excludes, conflict checks, staging and atomic renames
//! as a one-shot `rsb sync`). Each sync rescans both sides, so a burst never needs its event
//! list to be complete or ordered: a `git checkout` storm of renames and deletes, or an
//! inotify queue overflow, costs one rescan and leaves the remote identical. Events on excluded
//! paths (`.git/…`, `node_modules/…`, the user's excludes) do not start a sync.
//!
//! The debounce exists so that a file is not sent half-written and a storm is sent once. A
//! small burst whose every written file has been closed again (inotify's `IN_CLOSE_WRITE`;
//! a rename carries its file's state to the new name) is whole already: it ends after the
//! shorter [`WatchOptions::settle`] of quiet instead. An editor's save is write, close,
//! rename within a millisecond, so it reaches the sandbox about `settle` plus one request
//! after the save. Backends that report no closes (polling, FSEvents), a file still open for
//! writing, a burst past [`FAST_MAX_PATHS`] paths and a lost-event rescan all wait out the full
//! debounce, as before.
//!
//! Small bursts take a fast path instead: the remote state is known from the last sync (its
//! baseline, `rel` → blake3, kept in the store), so the files the burst names are read and
//! hashed here and sent with `ApplyOnce`, one request that opens a staging session, checks a
//! precondition per path (the destination still holds the baseline's content, or nothing),
//! commits each file by the usual verify-and-rename and closes: one round trip, no manifests.
//! Anything the fast path is unsure of falls back to the full sync: a rescan (queue
//! overflow), more than [`FAST_MAX_PATHS`] paths (a rename storm), a directory, a symlink, a
//! file over [`FAST_MAX_BYTES`], `--gitignore` (the agents' walk reads those files), or a
//! failed precondition, where the full sync then reports the conflict as ever.
//!
//! A sync that fails on the link (connection lost, reconnect refused, timeout) is retried with
//! exponential backoff until it succeeds; events that arrive meanwhile are folded into the
//! retry, which is a full resync. Any other failure (a type conflict, the delete guard) is
//! reported once and waits for the next change. Cancelling (Ctrl-C) stops the loop; a sync in
//! flight is aborted by the engine, which leaves only whole files.

use std::{
    collections::{BTreeSet, HashMap},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use notify::{EventKind, RecursiveMode, Watcher, event::AccessKind};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use rsb_protocol::{ApplyOnceRequest, ApplyOp};

use super::{Direction, SyncReport, SyncSpec, engine::anchor_home};
use crate::{
    app::App,
    client::AgentClient,
    error::{Kind, Result, RsbError},
    pool::Pool,
};

/// A burst naming more paths than this is synced in full (a checkout, a generator).
pub const FAST_MAX_PATHS: usize = 64;
/// …and one whose files hold more than this (they ride one request).
pub const FAST_MAX_BYTES: u64 = 1024 * 1024;

/// Timing of the watch loop.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// A burst ends once no event arrived for this long.
    pub debounce: Duration,
    /// …or this long, when every file written in the (small) burst has been closed again.
    pub settle: Duration,
    /// …or once this long has passed since its first event.
    pub max_burst: Duration,
    /// Use the polling watcher (with this interval) instead of the OS's notifications.
    pub poll: Option<Duration>,
    /// First and last delay between retries of a sync that failed on the link.
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// `--confirm-delete`: deletes the mass-delete guard refuses are intended. Without it the
    /// guard applies to every burst, not only the initial sync: an accidental `rm -rf` of the
    /// local tree is refused (a `failed` event), not mirrored.
    pub confirm_delete: bool,
    /// Compression asked for (`rsb sync -w -z`), over `RSB_SYNC_COMPRESS`.
    pub compress: Option<crate::sync::compress::Mode>,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            debounce: Duration::from_millis(50),
            settle: Duration::from_millis(20),
            max_burst: Duration::from_secs(1),
            poll: None,
            retry_min: Duration::from_millis(250),
            retry_max: Duration::from_secs(8),
            confirm_delete: false,
            compress: None,
        }
    }
}

/// What the loop reports, one per line in the CLI.
#[derive(Debug)]
pub enum WatchEvent {
    /// The watcher is armed; `backend` is `"native"` or `"poll"`.
    Watching { backend: &'static str },
    /// One sync finished: the initial one (`burst == 0`) or the one for a burst of `changes`
    /// events (0 after a link-failure resync with no new events).
    Synced {
        burst: u64,
        changes: usize,
        report: Box<SyncReport>,
        elapsed: Duration,
        /// Sent by the one-request fast path (else a full sync).
        fast: bool,
        /// Why the fast path was tried and given up for a full sync.
        fallback: Option<String>,
        /// How the burst ended: `"settled"` (every written file closed, the short wait),
        /// `"quiet"` (the debounce), `"cap"` (`max_burst`); empty for the initial sync.
        ended: &'static str,
    },
    /// A sync failed on the link; the next attempt (a full resync) follows after `delay`.
    Retrying {
        attempt: u32,
        delay: Duration,
        error: RsbError,
    },
    /// A sync failed for a reason a retry would not fix; the loop waits for the next change.
    Failed { error: RsbError },
}

impl WatchEvent {
    /// One JSON object, for `rsb --json sync --watch`.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            WatchEvent::Watching { backend } => json!({"event": "watching", "backend": backend}),
            WatchEvent::Synced {
                burst,
                changes,
                report,
                elapsed,
                fast,
                fallback,
                ended,
            } => {
                let mut v = json!({
                    "event": "synced",
                    "burst": burst,
                    "changes": changes,
                    "path": if *fast { "fast" } else { "full" },
                    "files": report.files_transferred,
                    "bytes": report.bytes_sent,
                    "deleted": report.deleted_files + report.deleted_dirs,
                    "unchanged": report.skipped_files,
                    "ms": elapsed.as_secs_f64() * 1000.0,
                });
                if let Some(why) = fallback {
                    v["fallback"] = json!(why);
                }
                if !ended.is_empty() {
                    v["ended"] = json!(ended);
                }
                if !report.conflicts.is_empty() {
                    v["conflicts"] = json!(
                        report
                            .conflicts
                            .iter()
                            .take(100)
                            .map(|c| c.0.as_str())
                            .collect::<Vec<_>>()
                    );
                    v["conflict_count"] = json!(report.conflicts.len());
                }
                v
            }
            WatchEvent::Retrying {
                attempt,
                delay,
                error,
            } => json!({
                "event": "retrying",
                "attempt": attempt,
                "delay_ms": delay.as_millis() as u64,
                "error": error.message,
            }),
            WatchEvent::Failed { error } => {
                json!({"event": "failed", "error": error.message, "hint": error.hint})
            }
        }
    }

    /// One human line (no trailing newline).
    pub fn line(&self) -> String {
        match self {
            WatchEvent::Watching { backend } => {
                format!("watching ({backend} events); Ctrl-C stops")
            }
            WatchEvent::Synced {
                burst,
                changes,
                report,
                elapsed,
                fast,
                ..
            } => {
                let what = if *burst == 0 {
                    "initial sync".to_string()
                } else if *fast {
                    format!("burst {burst} ({changes} events, fast)")
                } else {
                    format!("burst {burst} ({changes} events)")
                };
                let conflicts = match report.conflicts.len() {
                    0 => String::new(),
                    n => format!(", {n} conflicts kept"),
                };
                format!(
                    "{what}: {} files, {} bytes, {} deleted, {} unchanged{conflicts}, {} ms",
                    report.files_transferred,
                    report.bytes_sent,
                    report.deleted_files + report.deleted_dirs,
                    report.skipped_files,
                    elapsed.as_millis()
                )
            }
            WatchEvent::Retrying {
                attempt,
                delay,
                error,
            } => format!(
                "sync failed on the link ({}); retry {attempt} in {:.1}s",
                error.message,
                delay.as_secs_f64()
            ),
            WatchEvent::Failed { error } => {
                format!("sync failed: {} (hint: {})", error.message, error.hint)
            }
        }
    }
}

/// Would a retry fix this? Link-level failures only.
fn link_error(e: &RsbError) -> bool {
    matches!(
        e.kind,
        Kind::ConnectionLost | Kind::Connect | Kind::Timeout | Kind::Deploy
    )
}

/// What an event says about a file's writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    /// Bytes may still be coming: a create or a data change not yet followed by a close, and
    /// whatever a backend reports without saying (polling, FSEvents).
    Open,
    /// A writer closed the file.
    Closed,
    /// Nothing about content: a directory made, a path removed, attributes, a rename's ends.
    None,
}

/// A filesystem event reduced to what the loop needs.
enum Change {
    /// A path changed (relative to the watched root when under it).
    Path(PathBuf, Writer),
    /// `from` was renamed to `to` inside the tree (both ends also arrive as paths): an open
    /// writer's file now has the new name.
    Renamed { from: PathBuf, to: PathBuf },
    /// The watcher lost events (queue overflow) or failed: rescan.
    Rescan,
}

/// How many events may wait between the watcher's thread and the burst loop (a path each:
/// a few MB at most). A full queue drops events and the loop's next read is a rescan, as an
/// overflow of the kernel's own queue is.
const CHANGE_QUEUE: usize = 16_384;

/// The watcher's end of the event queue: never waits (it runs on notify's thread).
#[derive(Clone)]
struct ChangeTx {
    tx: mpsc::Sender<Change>,
    lost: Arc<AtomicBool>,
}

impl ChangeTx {
    fn send(&self, c: Change) {
        if let Err(mpsc::error::TrySendError::Full(_)) = self.tx.try_send(c) {
            self.lost.store(true, Ordering::SeqCst);
        }
    }
}

/// The loop's end: a rescan first whenever events were dropped.
struct ChangeRx {
    rx: mpsc::Receiver<Change>,
    lost: Arc<AtomicBool>,
}

impl ChangeRx {
    async fn recv(&mut self) -> Option<Change> {
        // Set only while the queue is full, so never while this waits on an empty one.
        if self.lost.swap(false, Ordering::SeqCst) {
            return Some(Change::Rescan);
        }
        self.rx.recv().await
    }
}

fn change_queue(capacity: usize) -> (ChangeTx, ChangeRx) {
    let (tx, rx) = mpsc::channel(capacity);
    let lost = Arc::new(AtomicBool::new(false));
    (
        ChangeTx {
            tx,
            lost: lost.clone(),
        },
        ChangeRx { rx, lost },
    )
}

impl Writer {
    fn of(kind: &EventKind) -> Writer {
        use notify::event::{AccessMode, CreateKind, ModifyKind};
        match kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => Writer::Closed,
            EventKind::Create(CreateKind::Folder)
            | EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Metadata(_) | ModifyKind::Name(_)) => Writer::None,
            _ => Writer::Open,
        }
    }
}

/// Files written and not closed since, across bursts: a burst that ends at the
/// [`WatchOptions::max_burst`] cap while a writer is busy still knows about it in the next.
struct Writers {
    /// The backend reports closes (inotify). Polling and FSEvents do not, and a modification
    /// time they see says nothing about whether the writer is done: always the full debounce.
    closes: bool,
    open: std::collections::HashSet<PathBuf>,
    /// Events were lost: nothing is known to be closed until the next rescan has passed.
    unknown: bool,
}

/// Beyond this many open writers (a generator holding thousands of files) the set is dropped
/// and bursts wait the full debounce until a rescan.
const MAX_WRITERS: usize = 4096;

impl Writers {
    fn note(&mut self, c: &Change) {
        match c {
            Change::Path(p, Writer::Open) => {
                if self.open.len() >= MAX_WRITERS {
                    self.unknown = true;
                    self.open.clear();
                }
                if !self.unknown {
                    self.open.insert(p.clone());
                }
            }
            Change::Path(p, Writer::Closed) => {
                self.open.remove(p);
            }
            Change::Path(..) => {}
            Change::Renamed { from, to } => {
                if self.open.remove(from) {
                    self.open.insert(to.clone());
                }
            }
            Change::Rescan => {
                self.unknown = true;
                self.open.clear();
            }
        }
    }

    fn new(closes: bool) -> Writers {
        Writers {
            closes,
            open: Default::default(),
            unknown: false,
        }
    }

    fn settled(&self) -> bool {
        self.closes && !self.unknown && self.open.is_empty()
    }
}

/// The watcher and the receiving end of its events. Dropping it stops the watcher.
struct Armed {
    _watcher: Box<dyn Watcher + Send>,
    rx: ChangeRx,
    backend: &'static str,
    writers: Writers,
    /// With `--gitignore`: the tree's `.gitignore` files, so what they ignore starts no burst.
    gitignores: Option<Gitignores>,
}

impl Armed {
    /// The next event, with the writers' state brought up to date; `None` when the watcher
    /// stopped. Events on paths the sync ignores neither count nor hold a burst open.
    async fn recv(&mut self, root: &Path, rules: &rsb_rules::Rules) -> Option<Option<Change>> {
        let c = self.rx.recv().await?;
        let mut gi = self.gitignores.as_mut();
        let relevant = match &c {
            Change::Path(p, _) => relevant(root, rules, gi, p),
            Change::Renamed { from, to } => {
                relevant(root, rules, gi.as_deref_mut(), from) || relevant(root, rules, gi, to)
            }
            Change::Rescan => {
                if let Some(g) = gi {
                    g.dirs.clear();
                }
                true
            }
        };
        if !relevant {
            return Some(None);
        }
        self.writers.note(&c);
        Some(Some(c))
    }
}

fn arm(root: &Path, opts: &WatchOptions) -> Result<Armed> {
    let (tx, rx) = change_queue(CHANGE_QUEUE);
    let handler = move |res: notify::Result<notify::Event>| match res {
        Ok(ev) => {
            if ev.need_rescan() {
                tx.send(Change::Rescan);
                return;
            }
            // Reads (including the local agent's own reads for a sync) are not changes.
            if let EventKind::Access(a) = ev.kind
                && !matches!(a, AccessKind::Close(notify::event::AccessMode::Write))
            {
                return;
            }
            if let EventKind::Modify(notify::event::ModifyKind::Name(
                notify::event::RenameMode::Both,
            )) = ev.kind
                && let [from, to] = &ev.paths[..]
            {
                tx.send(Change::Renamed {
                    from: from.clone(),
                    to: to.clone(),
                });
                return;
            }
            let writer = Writer::of(&ev.kind);
            for p in ev.paths {
                tx.send(Change::Path(p, writer));
            }
        }
        Err(_) => {
            tx.send(Change::Rescan);
        }
    };
    // A single file is watched through its directory: editors save by writing a new file
    // and renaming it over the old one, which ends a watch on the file itself.
    let (target, mode) = if root.is_dir() {
        (root.to_path_buf(), RecursiveMode::Recursive)
    } else {
        let parent = root
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        (parent.to_path_buf(), RecursiveMode::NonRecursive)
    };
    let watch_err = |e: notify::Error| {
        RsbError::invalid(
            format!("cannot watch {}: {e}", target.display()),
            "on Linux, raise fs.inotify.max_user_watches, or pass --poll",
        )
    };
    if opts.poll.is_none() {
        let h = handler.clone();
        match notify::recommended_watcher(h).and_then(|mut w| {
            w.watch(&target, mode)?;
            Ok(w)
        }) {
            Ok(w) => {
                return Ok(Armed {
                    _watcher: Box::new(w),
                    rx,
                    backend: "native",
                    writers: Writers::new(cfg!(target_os = "linux")),
                    gitignores: None,
                });
            }
            // Out of inotify watches or instances, an unsupported file system: poll instead.
            Err(e) => tracing::warn!("native file watching failed ({e}); polling instead"),
        }
    }
    let cfg = notify::Config::default()
        .with_poll_interval(opts.poll.unwrap_or(Duration::from_millis(500)))
        .with_compare_contents(false);
    let mut w = notify::PollWatcher::new(handler, cfg).map_err(watch_err)?;
    w.watch(&target, mode).map_err(watch_err)?;
    Ok(Armed {
        _watcher: Box::new(w),
        rx,
        backend: "poll",
        writers: Writers::new(false),
        gitignores: None,
    })
}

/// The `.gitignore` files of a watched tree, read on demand per directory, as the walk of a
/// `--gitignore` sync applies them (see `rsb_rules::Rules::excluded_in`).
#[derive(Default)]
struct Gitignores {
    /// Directory (`rel`, `""` for the root) → its `.gitignore`, `None` when it has none
    /// readable. All of it is forgotten when any `.gitignore` changes (or events were lost):
    /// re-reading a few small files is cheaper than tracking which layer fed which answer.
    dirs: HashMap<String, Option<rsb_rules::Layer>>,
}

/// A `.gitignore` larger than this is not read (as the sync's own reads bound it).
const GITIGNORE_MAX: u64 = 1 << 20;

impl Gitignores {
    /// The layers of `rel`'s ancestors (the root's included).
    fn above(&mut self, root: &Path, rel: &str) -> Vec<rsb_rules::Layer> {
        let mut dirs = vec![""];
        dirs.extend(rel.match_indices('/').map(|(i, _)| &rel[..i]));
        dirs.iter()
            .filter_map(|d| {
                self.dirs
                    .entry(d.to_string())
                    .or_insert_with(|| {
                        let f = root.join(d).join(".gitignore");
                        let m = std::fs::metadata(&f).ok()?;
                        if !m.is_file() || m.len() > GITIGNORE_MAX {
                            return None;
                        }
                        let text = std::fs::read(&f).ok()?;
                        let text = String::from_utf8_lossy(&text);
                        Some(rsb_rules::Layer::parse(d, text.lines()).0)
                    })
                    .clone()
            })
            .collect()
    }
}

/// Does a change at `path` matter to the sync of `root` under `rules` (and, with
/// `--gitignore`, the tree's `.gitignore` files)?
fn relevant(
    root: &Path,
    rules: &rsb_rules::Rules,
    gitignores: Option<&mut Gitignores>,
    path: &Path,
) -> bool {
    if root.is_file() || !root.exists() {
        return path == root;
    }
    let Ok(rel) = path.strip_prefix(root) else {
        return false;
    };
    let Some(rel) = rel.to_str() else {
        return true;
    };
    if rel.is_empty() {
        return true;
    }
    // Directory-only patterns (`build/`) need the kind. Not knowing whether a vanished path
    // was a directory, it is skipped only when excluded either way (a needless sync is cheap;
    // a missed one is not).
    let kinds: &[bool] = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => &[true],
        Ok(_) => &[false],
        Err(_) => &[false, true],
    };
    let Some(g) = gitignores else {
        return !kinds.iter().all(|&d| rules.excluded_path(rel, d));
    };
    if rel == ".gitignore" || rel.ends_with("/.gitignore") {
        // What the tree ignores changed: forget, and let the sync decide on this one.
        g.dirs.clear();
        return !rules.excluded_path(rel, false);
    }
    let layers = g.above(root, rel);
    !kinds
        .iter()
        .all(|&d| rules.excluded_path_in(&layers, rel, d))
}

/// What the watch loop knows of the remote after a full sync of a directory: enough for the
/// fast path.
struct Known {
    /// The remote root, expanded (as the last sync reported it).
    remote_root: String,
    /// `rel` → blake3 that both sides held after the last sync (the store's baseline).
    baseline: HashMap<String, [u8; 32]>,
}

/// The paths of one burst (relative to nothing: as notify gave them).
#[derive(Default)]
struct Burst {
    events: usize,
    paths: BTreeSet<PathBuf>,
    /// Events were lost, or there were too many paths: only a full sync will do.
    rescan: bool,
    /// See [`WatchEvent::Synced::ended`].
    ended: &'static str,
}

impl Burst {
    fn add(&mut self, c: Change) {
        self.events += 1;
        match c {
            Change::Rescan => self.rescan = true,
            // Both ends also arrive as paths.
            Change::Renamed { .. } => self.events -= 1,
            Change::Path(..) if self.rescan => {}
            Change::Path(p, _) => {
                self.paths.insert(p);
                if self.paths.len() > FAST_MAX_PATHS {
                    self.rescan = true;
                    self.paths.clear();
                }
            }
        }
    }
}

/// Watch `spec.local_path` and upload every burst of changes until `cancel` fires. The first
/// sync (the whole tree) happens before any burst. Returns `Err` only when the watcher cannot
/// start or the initial sync fails for a reason a retry would not fix.
pub async fn watch(
    app: &App,
    sandbox: &str,
    spec: &SyncSpec,
    opts: &WatchOptions,
    cancel: &CancellationToken,
    mut on: impl FnMut(WatchEvent),
) -> Result<()> {
    if spec.direction != Direction::Upload {
        return Err(RsbError::invalid(
            "--watch uploads only: the watched side must be the local one",
            "rsb sync --watch LOCAL SANDBOX:REMOTE",
        ));
    }
    if spec.dry_run {
        return Err(RsbError::invalid(
            "--watch cannot be combined with --dry-run",
            "run `rsb sync -n LOCAL SANDBOX:REMOTE` once to see what would change",
        ));
    }
    // The fast path deletes and writes without the engine: it filters by the same rules.
    let spec = &SyncSpec {
        rules: spec.effective_rules(),
        ..spec.clone()
    };
    let rules = rsb_rules::Rules::for_sync(spec.rules.default_excludes, &spec.rules.lines)
        .map_err(|e| RsbError::invalid(e.to_string(), "patterns use gitignore syntax"))?;
    let root = spec.local_path.clone();
    let key = (
        root.display().to_string(),
        sandbox.to_string(),
        anchor_home(&spec.remote_path),
    );
    // Refuse up front: every burst's sync needs the store (see `runner::run_with`).
    let store = Some(app.transfers().await?);
    let pool = app.pool();
    let mut armed = arm(&root, opts)?;
    armed.gitignores = spec.rules.gitignore.then(Gitignores::default);
    on(WatchEvent::Watching {
        backend: armed.backend,
    });

    let mut burst_no = 0u64;
    let mut burst = Burst::default();
    let mut known: Option<Known> = None;
    loop {
        if cancel.is_cancelled() {
            return Ok(());
        }
        // A small burst over a known remote: one request.
        let mut fallback = None;
        // `.gitignore` files (`--gitignore`) are read by the agents' walk alone: such a tree
        // always takes the full path.
        if burst_no > 0
            && !burst.rescan
            && !spec.rules.gitignore
            && let Some(k) = known.as_mut()
        {
            let started = Instant::now();
            // Under the roots' lock, from the store's baseline: another sync of these roots
            // (a manual one, a background transfer) may have run since the last burst, and
            // the save below must not put back what it replaced.
            let held = match crate::store::roots_lock::try_lock(&pool.config().state_dir, &key) {
                Ok(crate::store::roots_lock::Attempt::Held(l)) => Some(l),
                _ => None,
            };
            let fresh = match (&held, &store) {
                (Some(_), Some(t)) => t
                    .load_baseline_shared(&key.0, &key.1, &key.2)
                    .await
                    .ok()
                    .flatten(),
                _ => None,
            };
            let r = match fresh {
                Some(b) => {
                    if *b != k.baseline {
                        k.baseline = (*b).clone();
                    }
                    tokio::select! {
                        r = fast_sync(pool, sandbox, &root, &rules, spec.delete_extras, k, &burst.paths) => r,
                        _ = cancel.cancelled() => return Ok(()),
                    }
                }
                None if held.is_none() => Ok(Fast::Fallback(
                    "another sync of these roots is running; a full sync waits for it".into(),
                )),
                None => Ok(Fast::Fallback("the baseline is not in the store".into())),
            };
            match r {
                Ok(Fast::Done(mut report)) => {
                    report.duration_s = started.elapsed().as_secs_f64();
                    on(WatchEvent::Synced {
                        burst: burst_no,
                        changes: burst.events,
                        report,
                        elapsed: started.elapsed(),
                        fast: true,
                        fallback: None,
                        ended: burst.ended,
                    });
                    // After the line: the save is not part of the latency a user sees.
                    if let Some(t) = &store
                        && let Err(e) = t
                            .save_baseline(
                                &key.0,
                                &key.1,
                                &key.2,
                                std::sync::Arc::new(k.baseline.clone()),
                            )
                            .await
                    {
                        tracing::warn!("the sync baseline was not saved: {}", e.message);
                        known = None;
                    }
                    drop(held);
                    burst = next_burst(&mut armed, &root, &rules, opts, cancel).await?;
                    burst_no += 1;
                    continue;
                }
                Ok(Fast::Fallback(why)) => fallback = Some(why),
                // The full sync below meets the same failure and retries it.
                Err(e) => fallback = Some(e.message),
            }
        }
        known = None;
        // One full sync for the burst (the initial one first), retried while the link fails.
        let mut attempt = 0u32;
        loop {
            let started = Instant::now();
            let run_opts = options(opts);
            let r = tokio::select! {
                r = super::runner::run_with(app, sandbox, spec, &run_opts, None, cancel) => r,
                _ = cancel.cancelled() => return Ok(()),
            };
            match r {
                Ok(report) => {
                    let elapsed = started.elapsed();
                    let baseline = match (&store, report.synced_type == "directory") {
                        (Some(t), true) => {
                            t.load_baseline(&key.0, &key.1, &key.2).await.ok().flatten()
                        }
                        _ => None,
                    };
                    known = baseline.map(|baseline| Known {
                        remote_root: report.remote_path.clone(),
                        baseline,
                    });
                    on(WatchEvent::Synced {
                        burst: burst_no,
                        changes: burst.events,
                        report: Box::new(report),
                        elapsed,
                        fast: false,
                        fallback: fallback.take(),
                        ended: burst.ended,
                    });
                    break;
                }
                Err(_) if cancel.is_cancelled() => return Ok(()),
                Err(error) if link_error(&error) => {
                    attempt += 1;
                    let delay = opts
                        .retry_min
                        .saturating_mul(1 << (attempt - 1).min(16))
                        .min(opts.retry_max);
                    on(WatchEvent::Retrying {
                        attempt,
                        delay,
                        error,
                    });
                    // Events keep arriving while we wait; the retry (a full resync) covers them.
                    let wake = tokio::time::sleep(delay);
                    tokio::pin!(wake);
                    loop {
                        tokio::select! {
                            _ = &mut wake => break,
                            _ = cancel.cancelled() => return Ok(()),
                            c = armed.recv(&root, &rules) => match c {
                                Some(Some(_)) => burst.events += 1,
                                Some(None) => {}
                                None => return Err(RsbError::internal("the file watcher stopped")),
                            },
                        }
                    }
                }
                Err(error) if burst_no == 0 => return Err(error),
                Err(error) => {
                    on(WatchEvent::Failed { error });
                    break;
                }
            }
        }
        burst = next_burst(&mut armed, &root, &rules, opts, cancel).await?;
        burst_no += 1;
    }
}

/// Wait for the first relevant change, then collect until the tree is quiet for the debounce,
/// or for the settle time once every written file is closed again (or the burst is too
/// long). On a cancel it returns what it has; the caller checks `cancel`.
async fn next_burst(
    armed: &mut Armed,
    root: &Path,
    rules: &rsb_rules::Rules,
    opts: &WatchOptions,
    cancel: &CancellationToken,
) -> Result<Burst> {
    let mut burst = Burst::default();
    let first = loop {
        let c = tokio::select! {
            c = armed.recv(root, rules) => c,
            _ = cancel.cancelled() => return Ok(burst),
        };
        match c {
            None => return Err(RsbError::internal("the file watcher stopped")),
            Some(None) => {}
            Some(Some(c)) => {
                burst.add(c);
                break Instant::now();
            }
        }
    };
    loop {
        let wait = if !burst.rescan && armed.writers.settled() {
            opts.settle.min(opts.debounce)
        } else {
            opts.debounce
        };
        let quiet = tokio::time::sleep(wait);
        let cap = tokio::time::sleep_until((first + opts.max_burst).into());
        tokio::select! {
            _ = quiet => {
                burst.ended = if wait < opts.debounce { "settled" } else { "quiet" };
                break;
            }
            _ = cap => {
                burst.ended = "cap";
                break;
            }
            _ = cancel.cancelled() => break,
            c = armed.recv(root, rules) => match c {
                None => return Err(RsbError::internal("the file watcher stopped")),
                Some(None) => {}
                Some(Some(c)) => burst.add(c),
            },
        }
    }
    // A rescan is over once its burst is: the sync rescans both sides.
    if burst.rescan {
        armed.writers.unknown = false;
    }
    Ok(burst)
}

/// What the fast path did.
enum Fast {
    Done(Box<SyncReport>),
    /// Not for the fast path (or its precondition failed): why, for the line.
    Fallback(String),
}

/// The one request a small burst becomes, and what it changes in the baseline.
#[derive(Debug, Default)]
struct FastPlan {
    expect: Vec<(String, Option<[u8; 32]>)>,
    ops: Vec<ApplyOp>,
    dir_mtimes: Vec<(String, i64)>,
    /// Files sent, with their content hash.
    sent: Vec<(String, [u8; 32])>,
    bytes: u64,
    deleted: Vec<String>,
    /// Gone here, kept there (no `--delete`): no longer in the baseline.
    forgotten: Vec<String>,
    /// Files whose content the remote has already (attributes only).
    unchanged: u64,
}

/// `rel` of `path` under `root`, `/`-separated; `None` when outside it, the root itself, or
/// not UTF-8.
fn rel_of(root: &Path, path: &Path) -> Option<String> {
    let rel = path.strip_prefix(root).ok()?;
    let parts: Option<Vec<&str>> = rel.components().map(|c| c.as_os_str().to_str()).collect();
    let rel = parts?.join("/");
    (!rel.is_empty()).then_some(rel)
}

fn parent_of(rel: &str) -> &str {
    rel.rsplit_once('/').map_or("", |(d, _)| d)
}

fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    m.mtime()
        .saturating_mul(1_000_000_000)
        .saturating_add(m.mtime_nsec())
}

/// Turn a burst's paths into one `ApplyOnce`, reading and hashing the files here. `Err` says
/// why this burst needs a full sync instead.
fn plan_fast(
    root: &Path,
    rules: &rsb_rules::Rules,
    delete_extras: bool,
    baseline: &HashMap<String, [u8; 32]>,
    paths: &BTreeSet<PathBuf>,
) -> std::result::Result<FastPlan, String> {
    let mut p = FastPlan::default();
    let mut parents = BTreeSet::new();
    for path in paths {
        let Some(rel) = rel_of(root, path) else {
            return Err(format!(
                "{} is not a plain path under the root",
                path.display()
            ));
        };
        let meta = match std::fs::symlink_metadata(path) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("{rel}: {e}")),
        };
        match meta {
            None => {
                if rules.excluded_path(&rel, false) {
                    continue;
                }
                match (baseline.get(&rel), delete_extras) {
                    (Some(h), true) => {
                        p.expect.push((rel.clone(), Some(*h)));
                        p.ops.push(ApplyOp::Delete { rel: rel.clone() });
                        p.deleted.push(rel);
                    }
                    (Some(_), false) => p.forgotten.push(rel),
                    // Never synced as a file (an editor's temporary, say); with `--delete`, a
                    // directory or symlink of that name there would have to go: not ours.
                    (None, true) => p.expect.push((rel, None)),
                    (None, false) => {}
                }
            }
            Some(m) if m.is_file() => {
                if rules.excluded_path(&rel, false) {
                    continue;
                }
                let size = m.len();
                if p.bytes + size > FAST_MAX_BYTES {
                    return Err(format!("more than {FAST_MAX_BYTES} bytes changed"));
                }
                // One version of it, as a full sync reads one (a writer rewriting it in
                // place mid-read would give a mix): else the full sync says it kept changing.
                let read = match rsb_agent::sync::read_one_version(path, 0, FAST_MAX_BYTES) {
                    Ok(r) => r,
                    // Gone between the stat and the read: the next burst has it.
                    Err(e) => return Err(format!("{rel}: {e}")),
                };
                if read.truncated || p.bytes + read.data.len() as u64 > FAST_MAX_BYTES {
                    return Err(format!("more than {FAST_MAX_BYTES} bytes changed"));
                }
                if !read.settled {
                    return Err(format!("{rel} kept changing while it was read"));
                }
                let data = read.data;
                // What is committed is what was read, hashed here: never a torn file.
                let hash = *blake3::hash(&data).as_bytes();
                let base = baseline.get(&rel).copied();
                p.expect.push((rel.clone(), base));
                parents.insert(parent_of(&rel).to_string());
                if base == Some(hash) {
                    // Same content (a touch, or sent by the last full sync already): the
                    // attributes alone, as a full sync would.
                    p.ops.push(ApplyOp::SetAttr {
                        rel: rel.clone(),
                        mode: Some(m.mode() & 0o7777),
                        mtime_ns: Some(mtime_ns(&m)),
                    });
                    p.unchanged += 1;
                    continue;
                }
                p.bytes += data.len() as u64;
                p.ops.push(ApplyOp::FileCommit {
                    rel: rel.clone(),
                    size: data.len() as u64,
                    mode: m.mode() & 0o7777,
                    mtime_ns: mtime_ns(&m),
                    hash,
                });
                p.ops.insert(
                    p.ops.len() - 1,
                    ApplyOp::FileData {
                        rel: rel.clone(),
                        offset: 0,
                        data,
                    },
                );
                p.sent.push((rel, hash));
            }
            Some(m) if m.is_dir() && rules.excluded_path(&rel, true) => {}
            Some(m) if m.is_dir() => return Err(format!("directory {rel} changed")),
            Some(_) => return Err(format!("{rel} is not a regular file")),
        }
    }
    for rel in &p.deleted {
        parents.insert(parent_of(rel).to_string());
    }
    // Writing into a directory moves its mtime: put back the local one, as a full sync does.
    for dir in parents {
        let path = if dir.is_empty() {
            root.to_path_buf()
        } else {
            root.join(&dir)
        };
        if let Ok(m) = std::fs::symlink_metadata(&path)
            && m.is_dir()
        {
            p.dir_mtimes.push((dir, mtime_ns(&m)));
        }
    }
    Ok(p)
}

/// The fast path for one burst. `Err` only for link failures (the full sync retries those).
async fn fast_sync(
    pool: &Pool,
    sandbox: &str,
    root: &Path,
    rules: &rsb_rules::Rules,
    delete_extras: bool,
    known: &mut Known,
    paths: &BTreeSet<PathBuf>,
) -> Result<Fast> {
    let plan = match plan_fast(root, rules, delete_extras, &known.baseline, paths) {
        // Many deletes: the full sync's mass-delete guard decides (it knows the share).
        Ok(p) if p.deleted.len() > crate::sync::plan::MASS_DELETE_MIN_FILES => {
            return Ok(Fast::Fallback(format!(
                "{} deletes: the mass-delete guard weighs them",
                p.deleted.len()
            )));
        }
        Ok(p) => p,
        Err(why) => return Ok(Fast::Fallback(why)),
    };
    let mut report = SyncReport {
        direction: Some(Direction::Upload),
        local_path: root.display().to_string(),
        remote_path: known.remote_root.clone(),
        synced_type: "directory",
        delete_extras,
        files_transferred: plan.sent.len() as u64,
        bytes_sent: plan.bytes,
        bytes_planned: plan.bytes,
        deleted_files: plan.deleted.len() as u64,
        skipped_files: plan.unchanged,
        ..SyncReport::default()
    };
    if !plan.expect.is_empty() || !plan.ops.is_empty() {
        let remote: AgentClient = pool.client(sandbox).await?;
        let req = ApplyOnceRequest {
            root: known.remote_root.clone(),
            expect: plan.expect,
            ops: plan.ops,
            dir_mtimes: plan.dir_mtimes,
            confine: remote.confine().cloned(),
        };
        match remote.call(req).await {
            Ok(r) => report.warnings = r.warnings,
            Err(e) if link_error(&e) => return Err(e),
            Err(e) => return Ok(Fast::Fallback(e.message)),
        }
    }
    for (rel, h) in plan.sent {
        known.baseline.insert(rel, h);
    }
    for rel in plan.deleted.iter().chain(&plan.forgotten) {
        known.baseline.remove(rel);
    }
    Ok(Fast::Done(Box::new(report)))
}

/// Every burst meets every delete guard ($HOME, `/`, the share of the destination), as the
/// initial sync does: a burst that deletes most of the mirror is as likely an accident (`rm
/// -rf` in the wrong terminal) as a `git checkout`, and only the user can tell
/// (`--confirm-delete`).
fn options(opts: &WatchOptions) -> crate::sync::RunOptions {
    crate::sync::RunOptions {
        confirm_delete: opts.confirm_delete,
        compress: opts.compress,
        ..Default::default()
    }
}

/// `rsb sync --watch`: run [`watch`] until Ctrl-C, one line per event (JSON with `--json`);
/// `Ok` after Ctrl-C, else the error that stopped it (the initial sync's, a bad argument's),
/// which the caller reports.
pub async fn run_cli(
    app: &App,
    sandbox: &str,
    spec: &SyncSpec,
    json: bool,
    opts: WatchOptions,
) -> Result<()> {
    let cancel = CancellationToken::new();
    let c2 = cancel.clone();
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            c2.cancel();
        }
    });
    let target = format!(
        "{} -> {}:{}",
        spec.local_path.display(),
        sandbox,
        spec.remote_path
    );
    let r = watch(app, sandbox, spec, &opts, &cancel, |ev| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = if json {
            writeln!(out, "{}", ev.to_json())
        } else {
            match &ev {
                WatchEvent::Watching { .. } => writeln!(out, "{target}: {}", ev.line()),
                WatchEvent::Synced { report, .. } => {
                    super::cli::print_conflicts(report);
                    writeln!(out, "{}", ev.line())
                }
                _ => {
                    eprintln!("rsb: warning: {}", ev.line());
                    Ok(())
                }
            }
        };
        let _ = out.flush();
    })
    .await;
    ctrl_c.abort();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The watcher's thread never waits and the queue never grows past its bound: events that
    /// do not fit are dropped, and the loop reads a rescan before what is left.
    #[tokio::test]
    async fn a_full_event_queue_drops_events_and_the_loop_rescans() {
        let (tx, mut rx) = change_queue(4);
        for i in 0..10 {
            tx.send(Change::Path(PathBuf::from(format!("/t/{i}")), Writer::None));
        }
        assert!(matches!(rx.recv().await, Some(Change::Rescan)));
        let mut kept = Vec::new();
        while let Ok(c) = rx.rx.try_recv() {
            if let Change::Path(p, _) = c {
                kept.push(p);
            }
        }
        assert_eq!(kept.len(), 4, "{kept:?}");
        // Once the loss was reported, reads go on from the queue: no second rescan.
        tx.send(Change::Path(PathBuf::from("/t/next"), Writer::None));
        assert!(matches!(rx.recv().await, Some(Change::Path(..))));
    }

    #[test]
    fn a_burst_settles_only_when_every_written_file_is_closed() {
        use notify::event::{AccessMode, CreateKind, DataChange, ModifyKind, RenameMode};
        let p = |s: &str| PathBuf::from(s);
        let ev = |kind: EventKind, path: &str| Change::Path(p(path), Writer::of(&kind));
        let mut w = Writers::new(true);
        assert!(w.settled());
        // An editor's save: write a temporary file, close it, rename it over the original.
        w.note(&ev(EventKind::Create(CreateKind::File), "/t/a.swp"));
        w.note(&ev(
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            "/t/a.swp",
        ));
        assert!(!w.settled(), "written and still open");
        w.note(&ev(
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            "/t/a.swp",
        ));
        assert!(w.settled());
        w.note(&Change::Renamed {
            from: p("/t/a.swp"),
            to: p("/t/a"),
        });
        assert!(w.settled());
        // A rename of a file still being written carries its writer to the new name.
        w.note(&ev(EventKind::Create(CreateKind::File), "/t/b.part"));
        w.note(&Change::Renamed {
            from: p("/t/b.part"),
            to: p("/t/b"),
        });
        w.note(&ev(
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            "/t/b.part",
        ));
        assert!(
            !w.settled(),
            "the close of another name says nothing of /t/b"
        );
        w.note(&ev(
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            "/t/b",
        ));
        assert!(w.settled());
        // Directories, removals and attributes never hold a burst open.
        w.note(&ev(EventKind::Create(CreateKind::Folder), "/t/d"));
        w.note(&ev(
            EventKind::Remove(notify::event::RemoveKind::File),
            "/t/c",
        ));
        w.note(&ev(
            EventKind::Modify(ModifyKind::Name(RenameMode::From)),
            "/t/e",
        ));
        assert!(w.settled());
        // What a backend reports without saying (polling: `Any`) is a writer not known done.
        w.note(&ev(EventKind::Modify(ModifyKind::Any), "/t/f"));
        assert!(!w.settled());
        // Lost events: nothing is known closed until the rescan burst is over.
        let mut w = Writers::new(true);
        w.note(&Change::Rescan);
        w.note(&ev(
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            "/t/a",
        ));
        assert!(!w.settled());
        // Backends without close events (polling, FSEvents) never settle.
        assert!(!Writers::new(false).settled());
    }

    #[test]
    fn with_gitignore_what_the_tree_ignores_starts_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("sub/deep")).unwrap();
        std::fs::write(root.join(".gitignore"), "*.tmp\nbuild/\n").unwrap();
        std::fs::write(root.join("sub/.gitignore"), "!keep.tmp\ncache/\n").unwrap();
        let rules = rsb_rules::Rules::for_sync(true, &[]).unwrap();
        let mut g = Gitignores::default();
        let rel = |g: &mut Gitignores, p: &str| relevant(root, &rules, Some(g), &root.join(p));
        assert!(!rel(&mut g, "a.tmp"));
        assert!(!rel(&mut g, "build/out.o"));
        assert!(
            !rel(&mut g, "sub/deep/x.tmp"),
            "a parent's pattern applies below"
        );
        assert!(rel(&mut g, "sub/keep.tmp"), "a nested `!` re-includes");
        assert!(!rel(&mut g, "sub/cache/blob"));
        assert!(
            rel(&mut g, "cache/blob"),
            "sub/.gitignore does not apply at the root"
        );
        assert!(rel(&mut g, "src/main.rs"));
        // Without --gitignore the same paths are changes.
        assert!(relevant(root, &rules, None, &root.join("a.tmp")));
        // A changed .gitignore is itself relevant and is re-read.
        std::fs::write(root.join(".gitignore"), "build/\n").unwrap();
        assert!(rel(&mut g, ".gitignore"));
        assert!(rel(&mut g, "a.tmp"));
    }

    #[test]
    fn excluded_changes_do_not_start_a_sync() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let rules = rsb_rules::Rules::for_sync(true, &["*.log".to_string()]).unwrap();
        assert!(relevant(root, &rules, None, &root.join("src/main.rs")));
        assert!(relevant(root, &rules, None, &root.join("gone")));
        assert!(!relevant(root, &rules, None, &root.join(".git/index")));
        assert!(!relevant(
            root,
            &rules,
            None,
            &root.join("web/node_modules/x/y.js")
        ));
        assert!(!relevant(root, &rules, None, &root.join("out/run.log")));
        assert!(!relevant(root, &rules, None, Path::new("/elsewhere/file")));
    }

    #[test]
    fn lines_name_files_bytes_and_ms() {
        let ev = WatchEvent::Synced {
            burst: 3,
            changes: 7,
            report: Box::new(SyncReport {
                files_transferred: 2,
                bytes_sent: 10,
                ..SyncReport::default()
            }),
            elapsed: Duration::from_millis(42),
            fast: true,
            fallback: None,
            ended: "settled",
        };
        assert_eq!(
            ev.line(),
            "burst 3 (7 events, fast): 2 files, 10 bytes, 0 deleted, 0 unchanged, 42 ms"
        );
        assert_eq!(ev.to_json()["files"], 2);
        assert_eq!(ev.to_json()["path"], "fast");
    }

    fn paths(root: &Path, rels: &[&str]) -> BTreeSet<PathBuf> {
        rels.iter().map(|r| root.join(r)).collect()
    }

    #[test]
    fn a_small_burst_becomes_one_request_with_preconditions() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("src")).unwrap();
        std::fs::write(root.join("src/a.py"), b"new").unwrap();
        std::fs::write(root.join("b.txt"), b"fresh").unwrap();
        let rules = rsb_rules::Rules::for_sync(true, &[]).unwrap();
        let old = [1u8; 32];
        let gone = [2u8; 32];
        let baseline: HashMap<String, [u8; 32]> = [
            ("src/a.py".to_string(), old),
            ("src/c.py".to_string(), gone),
        ]
        .into();
        let p = plan_fast(
            root,
            &rules,
            true,
            &baseline,
            &paths(
                root,
                &[
                    "src/a.py",
                    "b.txt",
                    "src/c.py",
                    "src/.a.py.swp",
                    ".git/index",
                ],
            ),
        )
        .unwrap();
        let want_expect: Vec<(String, Option<[u8; 32]>)> = vec![
            ("b.txt".into(), None),
            ("src/.a.py.swp".into(), None),
            ("src/a.py".into(), Some(old)),
            ("src/c.py".into(), Some(gone)),
        ];
        let mut got = p.expect.clone();
        got.sort();
        assert_eq!(got, want_expect);
        assert_eq!(p.sent.len(), 2);
        assert_eq!(p.deleted, vec!["src/c.py".to_string()]);
        assert_eq!(p.bytes, 8);
        // Data before its commit, for each file; the parents' mtimes restored.
        let kinds: Vec<&str> = p
            .ops
            .iter()
            .map(|o| match o {
                ApplyOp::FileData { .. } => "data",
                ApplyOp::FileCommit { .. } => "commit",
                ApplyOp::Delete { .. } => "delete",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["data", "commit", "data", "commit", "delete"]);
        let dirs: Vec<&str> = p.dir_mtimes.iter().map(|d| d.0.as_str()).collect();
        assert_eq!(dirs, ["", "src"]);
        // Without --delete, a vanished file is only forgotten.
        let p = plan_fast(root, &rules, false, &baseline, &paths(root, &["src/c.py"])).unwrap();
        assert!(p.ops.is_empty() && p.expect.is_empty());
        assert_eq!(p.forgotten, vec!["src/c.py".to_string()]);
    }

    #[test]
    fn directories_symlinks_and_big_files_take_the_full_path() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("new")).unwrap();
        std::os::unix::fs::symlink("x", root.join("link")).unwrap();
        std::fs::write(root.join("big"), vec![0u8; FAST_MAX_BYTES as usize + 1]).unwrap();
        let rules = rsb_rules::Rules::for_sync(true, &[]).unwrap();
        let none = HashMap::new();
        for rel in ["new", "link", "big"] {
            assert!(
                plan_fast(root, &rules, true, &none, &paths(root, &[rel])).is_err(),
                "{rel}"
            );
        }
        let mut b = Burst::default();
        for i in 0..=FAST_MAX_PATHS {
            b.add(Change::Path(root.join(format!("f{i}")), Writer::Closed));
        }
        assert!(b.rescan && b.paths.is_empty());
    }
}
