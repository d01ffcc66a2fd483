//! The sync CLI's own pieces: conflict/safety flags of `rsb sync`, and `rsb transfer …`, the
//! background transfer worker's entry (hidden; started by the server).

use clap::{Args, Subcommand};

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
        eprintln!("rsb: conflict: {rel} changed on the destination since the last sync; kept");
    }
    if rep.conflicts.len() > 20 {
        eprintln!("rsb: … and {} more conflicts", rep.conflicts.len() - 20);
    }
    eprintln!("  hint: sync again with --force to take the source's side");
}

#[derive(Subcommand)]
pub enum TransferCmd {
    /// Run a recorded background transfer to its end (started detached by `rsb mcp`).
    Run {
        /// The task id from the server's reply.
        id: i64,
    },
}

/// Exit code: 0 when the task ran (whatever its outcome, which is in its record), 1 when it
/// could not be run at all.
pub async fn transfer(cmd: TransferCmd, state_dir: &std::path::Path) -> u8 {
    match cmd {
        TransferCmd::Run { id } => {
            let t = match crate::transfers::Transfers::open(state_dir) {
                Ok(t) => std::sync::Arc::new(t),
                Err(e) => {
                    eprintln!("rsb transfer run: {}\n  hint: {}", e.message, e.hint);
                    return 1;
                }
            };
            match t.run_worker(id).await {
                Ok(()) => 0,
                Err(msg) => {
                    eprintln!("rsb transfer run: {msg}");
                    1
                }
            }
        }
    }
}
