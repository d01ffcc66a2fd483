//! `rsb transfer …`: the background transfer worker's entry (hidden; started by the server).

use clap::Subcommand;

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
