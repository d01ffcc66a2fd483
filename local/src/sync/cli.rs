//! The sync CLI's own pieces: conflict/safety flags of `rsb sync`, and `rsb transfer …`, the
//! background transfer worker's entry (hidden; started by the server).

use clap::Args;

/// Conflict and delete-safety flags of `rsb sync`.
#[derive(Args, Debug, Clone, Default)]
pub struct SafetyArgs {
    /// Take the source's side of conflicts (destination files changed since the last sync).
    #[arg(long)]
    pub force: bool,
    /// First sync into a non-empty destination: differing files are conflicts, not replaced.
    #[arg(long)]
    pub safe: bool,
    /// Allow a --delete the guards refuse: into $HOME or /, or of more than half the
    /// destination's files.
    #[arg(long)]
    pub confirm_delete: bool,
}

impl SafetyArgs {
    pub fn options(&self) -> super::RunOptions {
        super::RunOptions {
            overwrite: self.force,
            safe: self.safe,
            confirm_delete: self.confirm_delete,
            ..Default::default()
        }
    }
}

/// One stderr line per conflict (at most 20), then how to resolve them.
pub fn print_conflicts(rep: &super::SyncReport) {
    if rep.conflicts.is_empty() {
        return;
    }
    for (rel, _, _) in rep.conflicts.iter().take(20) {
        eprintln!(
            "rsb: conflict: {} changed on the destination since the last sync; kept",
            crate::term::shown(rel)
        );
    }
    if rep.conflicts.len() > 20 {
        eprintln!("rsb: … and {} more conflicts", rep.conflicts.len() - 20);
    }
    eprintln!("  hint: sync again with --force to take the source's side");
}

/// `n word`/`n words`.
fn count(n: u64, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// The CLI's one-line summary of a sync, in human units ("sent 1 file (4.0 KiB)").
pub fn summary(rep: &super::SyncReport, upload: bool) -> String {
    use crate::term::human_bytes;
    let (from, to) = if upload {
        (&rep.local_path, &rep.remote_path)
    } else {
        (&rep.remote_path, &rep.local_path)
    };
    let (verb, bytes) = if rep.dry_run {
        ("would send", rep.bytes_planned)
    } else {
        ("sent", rep.bytes_sent)
    };
    let mut parts = vec![format!(
        "{verb} {} ({})",
        count(rep.files_transferred, "file"),
        human_bytes(bytes)
    )];
    if let Some(w) = rep.bytes_wire.filter(|_| !rep.dry_run) {
        parts[0].push_str(&format!(" as {} compressed", human_bytes(w)));
    }
    for (n, what) in [
        (rep.dirs_created, "dir created"),
        (rep.skipped_files, "unchanged"),
        (rep.attrs_updated, "attr update"),
        (rep.deleted_files + rep.deleted_dirs, "deleted"),
        (rep.skipped_special, "special skipped"),
    ] {
        if n > 0 {
            parts.push(match what {
                "dir created" => format!("{} created", count(n, "dir")),
                "attr update" => count(n, "attr update"),
                _ => format!("{n} {what}"),
            });
        }
    }
    format!(
        "{} {from} -> {to}: {}, {:.2}s",
        rep.synced_type,
        parts.join(", "),
        rep.duration_s
    )
}

/// A progress line that fits 80 columns: a spinner while scanning and planning, then a bar
/// with human units, and an ETA only once a rate is known (never a guess from the first
/// bytes).
pub fn progress_bar() -> (indicatif::ProgressBar, super::ProgressFn) {
    use indicatif::{ProgressBar, ProgressStyle};
    use std::sync::Arc;
    let bar = ProgressBar::new(0);
    let spin = ProgressStyle::with_template("{spinner} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let full = ProgressStyle::with_template(
        "{spinner} {msg:24!} [{bar:20}] {binary_bytes:>9}/{binary_total_bytes:9}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(spin.clone());
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    let b = bar.clone();
    let f: super::ProgressFn = Arc::new(move |p: &super::Progress| {
        use super::Phase;
        match p.phase {
            Phase::Transferring | Phase::Deleting if p.bytes_total > 0 => {
                b.set_style(full.clone());
                b.set_length(p.bytes_total);
                b.set_position(p.bytes_done);
                let left = p.bytes_total.saturating_sub(p.bytes_done);
                let eta = (p.rate_bps > 0.0 && p.elapsed_s >= 1.0)
                    .then(|| left as f64 / p.rate_bps)
                    .map(|s| format!(" eta {}s", s.ceil() as u64))
                    .unwrap_or_default();
                b.set_message(format!("{}/{} files{eta}", p.files_done, p.files_total));
            }
            ph => {
                b.set_style(spin.clone());
                b.set_message(match ph {
                    Phase::Transferring | Phase::Deleting => {
                        format!("{} {}/{} files", ph.as_str(), p.files_done, p.files_total)
                    }
                    Phase::Waiting => format!("waiting for another sync ({})", p.waiting_for),
                    _ => format!("{}…", ph.as_str()),
                });
            }
        }
    });
    (bar, f)
}

#[cfg(test)]
mod summary_tests {
    use super::*;

    #[test]
    fn the_summary_speaks_human() {
        let rep = crate::sync::SyncReport {
            local_path: "/l".into(),
            remote_path: "~/r".into(),
            synced_type: "directory",
            files_transferred: 1,
            bytes_sent: 4096,
            skipped_files: 3,
            duration_s: 0.5,
            ..Default::default()
        };
        assert_eq!(
            summary(&rep, true),
            "directory /l -> ~/r: sent 1 file (4.0 KiB), 3 unchanged, 0.50s"
        );
        let rep = crate::sync::SyncReport {
            dry_run: true,
            files_transferred: 2,
            bytes_planned: 3 << 20,
            dirs_created: 1,
            ..rep
        };
        assert_eq!(
            summary(&rep, false),
            "directory ~/r -> /l: would send 2 files (3.0 MiB), 1 dir created, 3 unchanged, 0.50s"
        );
    }
}
