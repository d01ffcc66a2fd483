//! Runs a sync between a source and a destination agent: scan both concurrently, plan, then
//! stream the changes into a staging session on the destination.
//!
//! Ordering: every request of an apply session carries a sequence number, taken when the request
//! is sent, and the agent runs them in that order; still, this engine does not lean on that more
//! than it must. Directories are created first (awaited), then small
//! files (whole, data and commit in one request, many files per request), symlinks and
//! attribute fixes stream through a window of requests while large files go one at a time,
//! each with its own window of `FileData` requests; a large file's first request is awaited
//! before the rest (it creates the staged file) and its `FileCommit` is sent only once every
//! data request has been acknowledged. Deletes come last, deepest first, then `ApplyClose`
//! restores directory mtimes. Source bytes are read with pipelined `ReadFile` requests (small
//! files by a reader task that starts before the directories are created).
//!
//! A sync that fails, is cancelled or is dropped aborts its session (the staging dir goes);
//! files already committed stay, and nothing partial is ever visible. The destination keeps the
//! staged bytes of a large file it was receiving; the next sync of that file resumes from them.
//!
//! This module scans and plans ([`run_with`], `execute`); below it, `transfer` moves the
//! bytes, `window` sizes a large file's flight, `progress` reports and builds the baseline,
//! `session` holds the apply session and its guards, `agent` wraps the requests, and `paths`
//! resolves roots and single-file rules.

mod agent;
pub mod lanes;
mod paths;
mod progress;
mod session;
mod transfer;
mod window;

use std::{sync::Arc, time::Duration};

use parking_lot::Mutex;
use rsb_protocol::{
    ApplyOpenRequest, ErrorCode, FileKind, ManifestEntry, SyncRules, sync::PARTIAL_MIN,
};
use tokio_util::sync::CancellationToken;

use agent::{manifest, ping, stat_opt};
use paths::{Roots, basename, single_file_gitignored, split_parent};
pub use paths::{compile_rules, single_file_excluded};
use progress::{Tracker, tmark};
use session::{Session, SessionGuard, abort};
use transfer::Ctx;

use super::{
    Direction, Phase, ProgressFn, SyncReport, SyncSpec,
    compress::{Compress, Mode},
    join_rel,
    plan::{self, Plan, PlanOptions},
};
use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
};

/// Files up to this size travel whole inside a batch (data and commit in one request).
const SMALL_MAX: u64 = 1024 * 1024;
/// A batch is sent once it holds this much file data (compressed or not: the upload stream
/// gives each piece all earlier ones as context, so its size does not change the ratio)…
const BATCH_BYTES: usize = 1024 * 1024;
/// …or this many ops.
const BATCH_OPS: usize = 512;
/// Apply requests in flight for small batches, and for one large file (see [`window`]).
const SMALL_WINDOW: usize = 8;
const LARGE_WINDOW: usize = 8;
/// Concurrent `ReadFile` requests for small files.
const SMALL_READS: usize = 32;
/// Concurrent `ReadFile` requests for one large file.
const LARGE_READS: usize = 16;
/// `FileData` chunks per request for large files (4 × 256 KiB = 1 MiB), at most.
const CHUNKS_PER_REQUEST: usize = 4;
/// Ops per request for metadata-only batches (mkdir, delete).
const META_OPS: usize = 2000;
/// More ping pairs (sequential) before a slow-looking round trip turns compression on: the
/// link's delay is a floor that every sample shows, a loaded host's stall is not. Each costs a
/// round trip of a far link before its transfer starts, so one, and none when the sandbox's
/// last transfer already found the link far.
const RTT_CONFIRM: usize = 1;
/// How long a failed or cancelled sync waits for `ApplyAbort` (removes its staging dir).
const CLEANUP_TIMEOUT: Duration = Duration::from_millis(500);

pub fn cancelled_error() -> RsbError {
    RsbError::new(
        Kind::Agent(ErrorCode::Cancelled),
        "sync cancelled",
        "files already committed stay; nothing partial was left; run the sync again to finish",
    )
}

/// The cancel error, saying what of an interrupted large file the destination kept.
fn cancelled_keeping(kept: Option<(String, u64)>) -> RsbError {
    let mut e = cancelled_error();
    if let Some((rel, bytes)) = kept.filter(|k| k.1 >= PARTIAL_MIN) {
        e.message = format!(
            "sync cancelled; kept {} MiB of {} staged; the next sync resumes it",
            bytes / (1024 * 1024),
            basename(&rel)
        );
    }
    e
}

/// Remote paths are relative to the remote `$HOME` (as the seed resolved them), not to
/// wherever the agent process happens to run.
pub use rsb_rules::path::anchor_home;

/// What a planned sync would send, for [`RunOptions::gate`].
#[derive(Debug, Clone, Copy, Default)]
pub struct PlanSize {
    /// Files and symlinks to write.
    pub files: u64,
    /// Bytes of the files to write (whole files; deltas send less).
    pub bytes: u64,
    /// Files and directories to delete.
    pub deletions: u64,
}

/// Decides after the plan whether this call runs it (`true`) or hands it off (`false`: the
/// report comes back with `handed_off` and nothing changed).
pub type PlanGate = Arc<dyn Fn(&PlanSize) -> bool + Send + Sync>;

/// Options beyond the [`SyncSpec`] (all off by default).
#[derive(Clone, Default)]
pub struct RunOptions {
    pub gate: Option<PlanGate>,
    /// Confirms a `delete_extras` the guards refuse: into `$HOME` or `/`, or deleting more
    /// than half of the destination's files.
    pub confirm_delete: bool,
    /// The last-synced content of this pair of roots (`rel` → blake3), for conflicts.
    pub baseline: Option<Arc<std::collections::HashMap<String, [u8; 32]>>>,
    /// Take the source's side of conflicts.
    pub overwrite: bool,
    /// Without a baseline, treat differing destination files as conflicts.
    pub safe: bool,
    /// Fill [`SyncReport::actions`] for a real run too (`rsb sync -v`), not only a dry run.
    pub list_actions: bool,
    /// Where a run that fails or is cancelled after planning leaves its baseline (what it
    /// did commit), for the caller to store as a completed run's
    /// [`SyncReport::baseline_out`] is.
    pub baseline_sink: Option<BaselineSink>,
    /// Compression asked for by this call (`rsb sync -z`); wins over `RSB_SYNC_COMPRESS`.
    pub compress: Option<Mode>,
    /// Where each acknowledged batch's commits go as they come (the store's journal), so a
    /// run killed outright, which saves no baseline, still leaves what it committed. Called
    /// only when there is a baseline to lay them over (see [`RunOptions::baseline_sink`]).
    pub journal: Option<CommitJournal>,
}

/// Records commits acknowledged by the destination: `(rel, blake3)` ([`RunOptions::journal`]).
pub type CommitJournal = Arc<dyn Fn(&[(String, [u8; 32])]) + Send + Sync>;

/// Where a failed run leaves the baseline of what it committed ([`RunOptions::baseline_sink`]).
pub type BaselineSink = Arc<Mutex<Option<std::collections::HashMap<String, [u8; 32]>>>>;

/// Run one sync. `local` is the local agent, `remote` the sandbox's; `spec.direction` decides
/// which is the source.
pub async fn run(
    local: &AgentClient,
    remote: &AgentClient,
    spec: &SyncSpec,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<SyncReport> {
    run_with(
        local,
        remote,
        spec,
        progress,
        cancel,
        &RunOptions::default(),
    )
    .await
}

/// [`run`] with [`RunOptions`].
pub async fn run_with(
    local: &AgentClient,
    remote: &AgentClient,
    spec: &SyncSpec,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
    opts: &RunOptions,
) -> Result<SyncReport> {
    let compress_mode = match opts.compress {
        Some(m) => m,
        None => Mode::from_env()?,
    };
    let spec = &SyncSpec {
        rules: spec.effective_rules(),
        ..spec.clone()
    };
    let tracker = Arc::new(
        Tracker::new(progress)
            .with_journal(opts.journal.clone().filter(|_| opts.baseline.is_some())),
    );
    let local_str = spec.local_path.to_string_lossy().into_owned();
    let remote_str = anchor_home(&spec.remote_path);
    let (src, dst, src_given, dst_given) = match spec.direction {
        Direction::Upload => (local, remote, local_str.clone(), remote_str),
        Direction::Download => (remote, local, remote_str, local_str.clone()),
    };
    // As the user wrote them, for messages.
    let (src_shown, dst_shown) = match spec.direction {
        Direction::Upload => (local_str.clone(), spec.remote_path.clone()),
        Direction::Download => (spec.remote_path.clone(), local_str.clone()),
    };
    let mut report = SyncReport {
        direction: Some(spec.direction),
        local_path: local_str.clone(),
        remote_path: spec.remote_path.clone(),
        delete_extras: spec.delete_extras,
        dry_run: spec.dry_run,
        ..Default::default()
    };
    tracker.phase(Phase::Scanning);

    let work = async {
        let src_root_given = if src_given.len() > 1 {
            src_given.trim_end_matches('/').to_string()
        } else {
            src_given.clone()
        };
        // Round trips are the cost of a sync that finds nothing to change on a far link, so
        // the source's manifest is asked for beside its stat (a directory and a file are
        // scanned by the same request), and a directory's destination is not stat'ed: its
        // manifest says what the root is. Not with gitignore, whose single-file check comes
        // first, nor for a file the rules exclude (it would be hashed for nothing).
        let mz = compress_mode.manifest(remote.sandbox());
        let (zsrc, zdst) = match spec.direction {
            Direction::Upload => (false, mz),
            Direction::Download => (mz, false),
        };
        let speculate =
            !spec.rules.gitignore && !single_file_excluded(&spec.rules, &src_shown).unwrap_or(true);
        let src_scan = async {
            if speculate {
                Some(manifest(src, &src_root_given, &spec.rules, zsrc).await)
            } else {
                None
            }
        };
        let (src_stat, src_scan) = tokio::join!(stat_opt(src, &src_root_given), src_scan);
        let src_stat = src_stat?;
        let mut src_scan = src_scan;
        let mut src_manifest = async || match src_scan.take() {
            Some(r) => r,
            None => manifest(src, &src_root_given, &spec.rules, zsrc).await,
        };
        let (what_src, what_dst) = match spec.direction {
            Direction::Upload => ("local_path", "remote_path"),
            Direction::Download => ("remote_path", "local_path"),
        };
        let src_stat = src_stat.ok_or_else(|| {
            RsbError::new(
                Kind::Agent(ErrorCode::NotFound),
                format!("{what_src} does not exist: {src_shown}"),
                "check the path (remote paths are relative to the remote $HOME; ~ is expanded)",
            )
        })?;
        match src_stat.kind {
            FileKind::Dir => {
                report.synced_type = "directory";
                if spec.delete_extras && !opts.confirm_delete {
                    refuse_home_delete(dst, &dst_given, &dst_shown, what_dst).await?;
                }
                let dst_ref = &dst_given;
                let dst_fut =
                    |rules: SyncRules| async move { manifest(dst, dst_ref, &rules, zdst).await };
                let ((ssum, sents), (dsum, dents)) = if spec.rules.gitignore {
                    // The destination's walk applies the source's .gitignore files, so the
                    // source is scanned first.
                    let s = src_manifest().await?;
                    let rules = SyncRules {
                        gitignore_files: Some(s.0.gitignore_files.clone()),
                        ..spec.rules.clone()
                    };
                    (s, dst_fut(rules).await?)
                } else {
                    tokio::try_join!(src_manifest(), dst_fut(spec.rules.clone()))?
                };
                // A missing root (or a dangling symlink, which stat reads as missing) is
                // created by the apply session, as before.
                let (dsum, dents) = match dsum.root_kind {
                    Some(FileKind::Dir) => (dsum, dents),
                    None | Some(FileKind::Symlink) => Default::default(),
                    Some(_) => {
                        return Err(RsbError::invalid(
                            format!(
                                "{what_dst} {dst_shown} is a file on the destination but a directory on the source; nothing was changed"
                            ),
                            "remove it or rename it, or choose another destination",
                        ));
                    }
                };
                tracker.phase(Phase::Planning);
                tmark(
                    &tracker,
                    &format!(
                        "scanned (unchanged manifests: source {}, destination {})",
                        ssum.unchanged, dsum.unchanged
                    ),
                );
                let roots = Roots {
                    src: ssum.root.clone(),
                    dst: if dsum.root.is_empty() {
                        dst_given.clone()
                    } else {
                        dsum.root.clone()
                    },
                    single: false,
                };
                set_paths(&mut report, spec.direction, &roots.src, &roots.dst);
                report.manifests_unchanged = (ssum.unchanged, dsum.unchanged);
                report.skipped_special = ssum.skipped_special_count;
                report
                    .errors
                    .extend(ssum.errors.iter().map(|e| format!("source {e}")));
                report
                    .errors
                    .extend(dsum.errors.iter().map(|e| format!("destination {e}")));
                let unreadable = ssum
                    .errors
                    .iter()
                    .map(|e| e.split_once(": ").map(|(r, _)| r).unwrap_or(e).to_string())
                    .collect();
                let mut plan = plan::plan(
                    &sents,
                    &dents,
                    &PlanOptions {
                        delete_extras: spec.delete_extras,
                        unreadable,
                        dest_name: roots.dst.clone(),
                        confirm_delete: opts.confirm_delete,
                        baseline: opts.baseline.clone(),
                        overwrite: opts.overwrite,
                        safe: opts.safe,
                    },
                )?;
                // The root's own mtime, when anything inside it changes (as rsync -a does).
                if !plan.is_empty() {
                    plan.dir_mtimes.push((String::new(), src_stat.mtime_ns));
                }
                *tracker.base.lock() = Some(baseline_planned(&sents, &plan, opts));
                execute(
                    src,
                    dst,
                    spec,
                    &roots,
                    plan,
                    &tracker,
                    &mut report,
                    cancel,
                    opts,
                    compress_mode,
                )
                .await
            }
            FileKind::File | FileKind::Symlink => {
                report.synced_type = "file";
                if spec.delete_extras {
                    return Err(RsbError::invalid(
                        "delete_extras is only supported when local_path is a directory",
                        "pass delete_extras=false to sync a single file",
                    ));
                }
                if single_file_excluded(&spec.rules, &src_shown)?
                    || single_file_gitignored(src, &spec.rules, &src_root_given).await?
                {
                    report.skipped_files = 1;
                    return Ok(());
                }
                let dst_kind = stat_opt(dst, &dst_given).await?.map(|s| s.kind);
                let name = basename(&src_root_given).to_string();
                let into_dir = dst_kind == Some(FileKind::Dir)
                    || dst_given.ends_with('/')
                    || matches!(dst_given.as_str(), "." | "/" | "~" | "");
                let base = dst_given.trim_end_matches('/');
                let target = if !into_dir {
                    dst_given.clone()
                } else if base.is_empty() {
                    format!("/{name}")
                } else {
                    join_rel(base, &name)
                };
                let ((ssum, sents), (dsum, dents)) =
                    tokio::try_join!(src_manifest(), manifest(dst, &target, &spec.rules, zdst))?;
                tracker.phase(Phase::Planning);
                tmark(&tracker, "scanned");
                if dsum.root_kind == Some(FileKind::Dir) {
                    return Err(RsbError::invalid(
                        format!(
                            "{what_dst} points to a directory, expected a file target: {target}"
                        ),
                        "pass the directory itself (or a path ending in /) to sync the file into it",
                    ));
                }
                let (parent, fname) = split_parent(if dsum.root.is_empty() {
                    &target
                } else {
                    &dsum.root
                });
                let roots = Roots {
                    src: if ssum.root.is_empty() {
                        src_root_given.clone()
                    } else {
                        ssum.root.clone()
                    },
                    dst: parent,
                    single: true,
                };
                set_paths(
                    &mut report,
                    spec.direction,
                    &roots.src,
                    &roots.dst_path(&fname),
                );
                let rename = |v: Vec<ManifestEntry>| -> Vec<ManifestEntry> {
                    v.into_iter()
                        .filter(|e| e.rel.is_empty())
                        .map(|mut e| {
                            e.rel = fname.clone();
                            e
                        })
                        .collect()
                };
                let sents = rename(sents);
                if sents.is_empty() {
                    // The agent excluded or skipped the root (a FIFO, say).
                    report.skipped_files = 1;
                    report.skipped_special = ssum.skipped_special_count;
                    return Ok(());
                }
                let plan = plan::plan(
                    &sents,
                    &rename(dents),
                    &PlanOptions {
                        baseline: opts.baseline.clone(),
                        overwrite: opts.overwrite,
                        safe: opts.safe,
                        ..PlanOptions::default()
                    },
                )?;
                *tracker.base.lock() = Some(baseline_planned(&sents, &plan, opts));
                execute(
                    src,
                    dst,
                    spec,
                    &roots,
                    plan,
                    &tracker,
                    &mut report,
                    cancel,
                    opts,
                    compress_mode,
                )
                .await
            }
            other => Err(RsbError::invalid(
                format!("{what_src} must be a file or directory: {src_shown} ({other:?})"),
                "sync regular files, directories and symlinks only",
            )),
        }
    };
    let res = tokio::select! {
        r = work => r,
        _ = cancel.cancelled() => Err(cancelled_keeping(tracker.large.lock().clone())),
    };
    if let Err(e) = res {
        // What this run did before it failed, exactly: a worker that runs the sync again
        // adds it to the rerun's report.
        tracker.update(true, |_| {});
        // And the baseline of what did commit: an edit made after this cut is then an edit,
        // not a conflict. A first sync (no baseline) leaves none: its next run is a first sync
        // again, which detects no conflicts, rather than one whose empty baseline makes every
        // destination file it did not reach a conflict.
        if let Some(sink) = opts
            .baseline_sink
            .as_ref()
            .filter(|_| opts.baseline.is_some())
        {
            *sink.lock() = tracker.baseline();
        }
        return Err(e);
    }
    report.baseline_out = tracker.baseline();
    report.duration_s = tracker.start.elapsed().as_secs_f64();
    tmark(&tracker, "closed");
    tracker.phase(Phase::Complete);
    Ok(report)
}

/// The content both sides agree on before this plan commits anything: the source's files
/// that need no transfer (the destination holds the same bytes); conflicts and the files
/// about to be sent keep their old baseline (conflicts stay conflicts until resolved; a file
/// sent gets the hash its commit carries once acknowledged, [`Tracker::baseline`]).
fn baseline_planned(
    sents: &[ManifestEntry],
    plan: &Plan,
    opts: &RunOptions,
) -> std::collections::HashMap<String, [u8; 32]> {
    let kept: std::collections::HashSet<&str> = plan
        .conflicts
        .iter()
        .map(|c| c.rel.as_str())
        .chain(plan.files.iter().map(|f| f.rel.as_str()))
        .collect();
    let mut out = std::collections::HashMap::new();
    let old = |rel: &str| opts.baseline.as_ref().and_then(|b| b.get(rel)).copied();
    for e in sents {
        if e.kind != FileKind::File {
            continue;
        }
        let Some(h) = e.hash else {
            // Not hashed (it kept changing during the scan): skipped, so the destination
            // still holds what the last sync left, and the entry stays. Dropping it made the
            // next sync read the destination's copy as a change made there: a conflict.
            if let Some(old) = old(&e.rel) {
                out.insert(e.rel.clone(), old);
            }
            continue;
        };
        if kept.contains(e.rel.as_str()) {
            if let Some(old) = old(&e.rel) {
                out.insert(e.rel.clone(), old);
            }
        } else {
            out.insert(e.rel.clone(), h);
        }
    }
    out
}

/// `delete_extras` into the destination's `$HOME` or `/` needs `confirm_delete`: one
/// mistyped path there would delete everything the source lacks.
async fn refuse_home_delete(
    dst: &AgentClient,
    dst_given: &str,
    dst_shown: &str,
    what_dst: &str,
) -> Result<()> {
    let home = stat_opt(dst, "~").await?.map(|s| s.path);
    let resolved = match dst_given {
        "~" => home.clone().unwrap_or_default(),
        g if g.starts_with("~/") => match &home {
            Some(h) => format!("{}/{}", h.trim_end_matches('/'), &g[2..]),
            None => g.to_string(),
        },
        g => g.to_string(),
    };
    let norm = rsb_rules::path::normalize(std::path::Path::new(&resolved));
    let is_home = home
        .as_deref()
        .is_some_and(|h| rsb_rules::path::normalize(std::path::Path::new(h)) == norm);
    if is_home || norm == std::path::Path::new("/") {
        let which = if is_home { "the home directory" } else { "/" };
        return Err(RsbError::invalid(
            format!(
                "delete_extras into {which} ({what_dst} {dst_shown:?} resolves to {}) is refused: it would delete everything there that the source lacks",
                norm.display()
            ),
            "pass a subdirectory as the destination, or confirm_delete: true (CLI --confirm-delete) if you mean it",
        ));
    }
    Ok(())
}

fn set_paths(report: &mut SyncReport, dir: Direction, src: &str, dst: &str) {
    match dir {
        Direction::Upload => {
            report.local_path = src.to_string();
            report.remote_path = dst.to_string();
        }
        Direction::Download => {
            report.remote_path = src.to_string();
            report.local_path = dst.to_string();
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn execute(
    src: &AgentClient,
    dst: &AgentClient,
    spec: &SyncSpec,
    roots: &Roots,
    plan: Plan,
    tracker: &Arc<Tracker>,
    report: &mut SyncReport,
    cancel: &CancellationToken,
    opts: &RunOptions,
    compress_mode: Mode,
) -> Result<()> {
    report.skipped_files += plan.unchanged;
    report.conflicts = plan
        .conflicts
        .iter()
        .map(|c| (c.rel.clone(), c.source_hash, c.dest_hash))
        .collect();
    report
        .errors
        .extend(plan.errors.iter().map(|e| format!("source {e}")));
    report.dirs_created = plan.mkdirs.len() as u64;
    report.files_transferred = (plan.files.len() + plan.symlinks.len()) as u64;
    report.attrs_updated = plan.attrs.len() as u64;
    report.deleted_files = plan.delete_files.len() as u64;
    report.deleted_dirs = plan.delete_dirs.len() as u64;
    report.delta_files = plan.files.iter().filter(|f| f.delta).count() as u64;
    report.bytes_planned = plan.bytes_total();
    if let Some(gate) = &opts.gate {
        let size = PlanSize {
            files: report.files_transferred,
            bytes: report.bytes_planned,
            deletions: report.deleted_files + report.deleted_dirs,
        };
        if !spec.dry_run && !gate(&size) {
            report.handed_off = true;
            *tracker.base.lock() = None;
            return Ok(());
        }
    }
    if spec.dry_run || opts.list_actions {
        report.actions = plan.actions();
    }
    if spec.dry_run {
        return Ok(());
    }
    if plan.is_empty() {
        return Ok(());
    }
    tracker.update(true, |p| {
        p.phase = Phase::Transferring;
        p.files_total = (plan.files.len() + plan.symlinks.len()) as u64;
        p.files_unchanged = plan.unchanged;
        p.bytes_total = plan.bytes_total();
    });
    let (remote, local) = match spec.direction {
        Direction::Upload => (dst, src),
        Direction::Download => (src, dst),
    };
    let open = dst.call(ApplyOpenRequest {
        root: roots.dst.clone(),
        create_root: true,
        confine: dst.confine().cloned(),
    });
    // The link's own delay, for the compression decision, measured beside the open (which
    // costs a round trip anyway): the remote agent's round trip less the local agent's, taken
    // at the same moment (the same client and agent code, no link), so that a loaded host or
    // a debug build, slow on both, does not read as a far link. A slow-looking link is
    // measured again: its delay is a floor every sample shows, a stall of the host is not.
    let (opened, r0, l0) = tokio::join!(open, ping(remote), ping(local));
    let opened = opened?;
    let (mut r_min, mut l_min) = (r0, l0);
    let link = |r: Duration, l: Duration| r.saturating_sub(l);
    // A far sample needs no second one when this sandbox's last transfer found the link far
    // too (that decision was confirmed): a round trip less per transfer on a far link.
    let known_far = compress_mode.manifest(remote.sandbox());
    for _ in 0..RTT_CONFIRM {
        if compress_mode != Mode::Auto || !compress_mode.decide(link(r_min, l_min)) || known_far {
            break;
        }
        let (r, l) = tokio::join!(ping(remote), ping(local));
        (r_min, l_min) = (r_min.min(r), l_min.min(l));
    }
    let rtt = link(r_min, l_min);
    let compress_on = compress_mode.decide(rtt);
    if compress_mode == Mode::Auto {
        super::compress::remember(remote.sandbox(), compress_on);
    }
    tracing::debug!(?r_min, ?l_min, compress_on, "link measured");
    if std::env::var_os("RSB_SYNC_TIMING").is_some() {
        eprintln!(
            "[sync timing] round trip remote {r_min:?}, local {l_min:?}: compression {compress_on}"
        );
    }
    let comp = Arc::new(Compress::new(
        compress_on,
        spec.direction == Direction::Download,
    ));
    // Whatever happens from here (error, cancel, this future dropped), the session is aborted
    // so its staging dir goes; a session left open would keep its staging until the
    // connection ends.
    let mut guard = SessionGuard {
        dst: dst.clone(),
        session: opened.session,
        armed: true,
    };
    let session = Session::new(dst, &opened, comp.clone())?;
    tmark(tracker, "opened");
    // A destination root that did not exist was only known as given (`~/x`): show it expanded.
    if !roots.single {
        let shown = match spec.direction {
            Direction::Upload => &mut report.remote_path,
            Direction::Download => &mut report.local_path,
        };
        if *shown == roots.dst {
            *shown = opened.root.clone();
        }
    }
    let ctx = Ctx {
        src,
        session: &session,
        roots,
        tracker: tracker.clone(),
        bytes_sent: Mutex::new(0),
        comp: comp.clone(),
        changed: Mutex::new(Vec::new()),
        lanes: lanes::Lanes::new(spec.direction == Direction::Upload && rtt >= lanes::LANES_RTT),
    };
    let res = tokio::select! {
        r = ctx.transfer(&plan, report) => r,
        _ = cancel.cancelled() => Err(cancelled_keeping(tracker.large.lock().clone())),
    };
    report.bytes_sent = *ctx.bytes_sent.lock();
    let changed = std::mem::take(&mut *ctx.changed.lock());
    report.files_transferred = report
        .files_transferred
        .saturating_sub(changed.len() as u64);
    report.unsettled += changed.len() as u64;
    report.errors.extend(changed);
    if comp.on() {
        let (raw, wire) = comp.saved();
        report.bytes_wire = Some(report.bytes_sent.saturating_sub(raw) + wire);
    }
    match res {
        Ok(()) => {
            tmark(tracker, "transferred");
            guard.armed = false;
            let closed = session.close(plan.dir_mtimes.clone()).await?;
            report.warnings.extend(closed.warnings);
            Ok(())
        }
        Err(e) => {
            // Abort now, waiting a little (the agent lets the running batch finish); if that
            // takes longer, the abort finishes in the background.
            guard.armed = false;
            if dst.is_alive() {
                let h = tokio::spawn(abort(dst.clone(), session.id));
                let _ = tokio::time::timeout(CLEANUP_TIMEOUT, h).await;
            }
            Err(e)
        }
    }
}
