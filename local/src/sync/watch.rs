//! `rsb sync --watch LOCAL SANDBOX:REMOTE`: keep a sandbox in step with a local tree while it
//! is edited.
//!
//! Flow: the watcher (`notify`: inotify / FSEvents, else polling) is armed *before* the initial
//! full sync, so nothing edited during it is missed. Its events go into a channel; a burst is
//! collected until the tree has been quiet for [`WatchOptions::debounce`] (or
//! [`WatchOptions::max_burst`] has passed since the burst's first event, so a process that
//! never stops writing still gets synced), then the whole burst is sent as one ordinary sync
//! ([`crate::ops::sync::run`]: the same excludes, conflict checks, staging and atomic renames
//! as a one-shot `rsb sync`). Each sync rescans both sides, so a burst never needs its event
//! list to be complete or ordered: a `git checkout` storm of renames and deletes, or an
//! inotify queue overflow, costs one rescan and leaves the remote identical. Events on excluded
//! paths (`.git/…`, `node_modules/…`, the user's excludes) do not start a sync.
//!
//! A sync that fails on the link (connection lost, reconnect refused, timeout) is retried with
//! exponential backoff until it succeeds; events that arrive meanwhile are folded into the
//! retry, which is a full resync. Any other failure (a type conflict, the delete guard) is
//! reported once and waits for the next change. Cancelling (Ctrl-C) stops the loop; a sync in
//! flight is aborted by the engine, which leaves only whole files.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use notify::{EventKind, RecursiveMode, Watcher, event::AccessKind};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Direction, SyncReport, SyncSpec};
use crate::{
    error::{Kind, Result, RsbError},
    pool::Pool,
};

/// Timing of the watch loop.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// A burst ends once no event arrived for this long.
    pub debounce: Duration,
    /// …or once this long has passed since its first event.
    pub max_burst: Duration,
    /// Use the polling watcher (with this interval) instead of the OS's notifications.
    pub poll: Option<Duration>,
    /// First and last delay between retries of a sync that failed on the link.
    pub retry_min: Duration,
    pub retry_max: Duration,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            debounce: Duration::from_millis(50),
            max_burst: Duration::from_secs(1),
            poll: None,
            retry_min: Duration::from_millis(250),
            retry_max: Duration::from_secs(8),
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
            } => json!({
                "event": "synced",
                "burst": burst,
                "changes": changes,
                "files": report.files_transferred,
                "bytes": report.bytes_sent,
                "deleted": report.deleted_files + report.deleted_dirs,
                "unchanged": report.skipped_files,
                "ms": elapsed.as_secs_f64() * 1000.0,
            }),
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
            } => {
                let what = if *burst == 0 {
                    "initial sync".to_string()
                } else {
                    format!("burst {burst} ({changes} events)")
                };
                format!(
                    "{what}: {} files, {} bytes, {} deleted, {} unchanged, {} ms",
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

/// A filesystem event reduced to what the loop needs.
enum Change {
    /// A path changed (relative to the watched root when under it).
    Path(PathBuf),
    /// The watcher lost events (queue overflow) or failed: rescan.
    Rescan,
}

/// The watcher and the receiving end of its events. Dropping it stops the watcher.
struct Armed {
    _watcher: Box<dyn Watcher + Send>,
    rx: mpsc::UnboundedReceiver<Change>,
    backend: &'static str,
}

fn arm(root: &Path, opts: &WatchOptions) -> Result<Armed> {
    let (tx, rx) = mpsc::unbounded_channel();
    let handler = move |res: notify::Result<notify::Event>| match res {
        Ok(ev) => {
            if ev.need_rescan() {
                let _ = tx.send(Change::Rescan);
                return;
            }
            // Reads (including the local agent's own reads for a sync) are not changes.
            if let EventKind::Access(a) = ev.kind
                && !matches!(a, AccessKind::Close(notify::event::AccessMode::Write))
            {
                return;
            }
            for p in ev.paths {
                let _ = tx.send(Change::Path(p));
            }
        }
        Err(_) => {
            let _ = tx.send(Change::Rescan);
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
    })
}

/// Does a change at `path` matter to the sync of `root` under `rules`?
fn relevant(root: &Path, rules: &rsb_rules::Rules, path: &Path) -> bool {
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
    // Not knowing whether a vanished path was a directory, it is skipped only when excluded
    // either way (a needless sync is cheap; a missed one is not).
    !(rules.excluded_path(rel, false) && rules.excluded_path(rel, true))
}

/// Watch `spec.local_path` and upload every burst of changes until `cancel` fires. The first
/// sync (the whole tree) happens before any burst. Returns `Err` only when the watcher cannot
/// start or the initial sync fails for a reason a retry would not fix.
pub async fn watch(
    pool: &Pool,
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
    let rules = rsb_rules::Rules::for_sync(spec.rules.default_excludes, &spec.rules.lines)
        .map_err(|e| RsbError::invalid(e.to_string(), "patterns use gitignore syntax"))?;
    let root = spec.local_path.clone();
    let mut armed = arm(&root, opts)?;
    on(WatchEvent::Watching {
        backend: armed.backend,
    });

    let mut burst = 0u64;
    let mut changes = 0usize;
    loop {
        // One sync for the burst (the initial one first), retried while the link fails.
        let mut attempt = 0u32;
        loop {
            let started = Instant::now();
            let run_opts = options(burst);
            let r = tokio::select! {
                r = crate::ops::sync::run_with(pool, sandbox, spec, &run_opts, None, cancel) => r,
                _ = cancel.cancelled() => return Ok(()),
            };
            match r {
                Ok(report) => {
                    on(WatchEvent::Synced {
                        burst,
                        changes,
                        report: Box::new(report),
                        elapsed: started.elapsed(),
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
                            c = armed.rx.recv() => match c {
                                Some(_) => changes += 1,
                                None => return Err(RsbError::internal("the file watcher stopped")),
                            },
                        }
                    }
                }
                Err(error) if burst == 0 => return Err(error),
                Err(error) => {
                    on(WatchEvent::Failed { error });
                    break;
                }
            }
        }

        // Wait for the first relevant change…
        let first = loop {
            let c = tokio::select! {
                c = armed.rx.recv() => c,
                _ = cancel.cancelled() => return Ok(()),
            };
            match c {
                None => return Err(RsbError::internal("the file watcher stopped")),
                Some(Change::Rescan) => break Instant::now(),
                Some(Change::Path(p)) if relevant(&root, &rules, &p) => break Instant::now(),
                Some(Change::Path(_)) => {}
            }
        };
        changes = 1;
        // …then collect until quiet (or the burst is too long).
        loop {
            let quiet = tokio::time::sleep(opts.debounce);
            let cap = tokio::time::sleep_until((first + opts.max_burst).into());
            tokio::select! {
                _ = quiet => break,
                _ = cap => break,
                _ = cancel.cancelled() => return Ok(()),
                c = armed.rx.recv() => match c {
                    None => return Err(RsbError::internal("the file watcher stopped")),
                    Some(Change::Path(p)) if !relevant(&root, &rules, &p) => {}
                    Some(_) => changes += 1,
                },
            }
        }
        burst += 1;
    }
}

/// `rsb sync --watch`: run [`watch`] until Ctrl-C, one line per event (JSON with `--json`).
/// Exit status: 0 after Ctrl-C, 1 when the initial sync fails, 2 for bad arguments.
/// The initial sync meets every delete guard ($HOME, `/`, the share of the destination); once
/// it has, the destination is the mirror the user asked for, and a burst that deletes most of
/// it (a `git checkout` of another branch) is that mirror following the tree, not an accident.
fn options(burst: u64) -> crate::sync::RunOptions {
    crate::sync::RunOptions {
        confirm_delete: burst > 0,
        ..Default::default()
    }
}

pub async fn run_cli(pool: &Pool, sandbox: &str, spec: &SyncSpec, json: bool, poll: bool) -> u8 {
    let cancel = CancellationToken::new();
    let c2 = cancel.clone();
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            c2.cancel();
        }
    });
    let opts = WatchOptions {
        poll: poll.then_some(Duration::from_millis(500)),
        ..WatchOptions::default()
    };
    let target = format!(
        "{} -> {}:{}",
        spec.local_path.display(),
        sandbox,
        spec.remote_path
    );
    let r = watch(pool, sandbox, spec, &opts, &cancel, |ev| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = if json {
            writeln!(out, "{}", ev.to_json())
        } else {
            match &ev {
                WatchEvent::Watching { .. } => writeln!(out, "{target}: {}", ev.line()),
                WatchEvent::Synced { .. } => writeln!(out, "{}", ev.line()),
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
    match r {
        Ok(()) => 0,
        Err(e) => {
            if json {
                println!("{}", json!({"error": e.message, "hint": e.hint}));
            } else {
                eprintln!("rsb: {}\n  hint: {}", e.message, e.hint);
            }
            if e.kind == Kind::InvalidArgument {
                2
            } else {
                1
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excluded_changes_do_not_start_a_sync() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let rules = rsb_rules::Rules::for_sync(true, &["*.log".to_string()]).unwrap();
        assert!(relevant(root, &rules, &root.join("src/main.rs")));
        assert!(relevant(root, &rules, &root.join("gone")));
        assert!(!relevant(root, &rules, &root.join(".git/index")));
        assert!(!relevant(
            root,
            &rules,
            &root.join("web/node_modules/x/y.js")
        ));
        assert!(!relevant(root, &rules, &root.join("out/run.log")));
        assert!(!relevant(root, &rules, Path::new("/elsewhere/file")));
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
        };
        assert_eq!(
            ev.line(),
            "burst 3 (7 events): 2 files, 10 bytes, 0 deleted, 0 unchanged, 42 ms"
        );
        assert_eq!(ev.to_json()["files"], 2);
    }
}
