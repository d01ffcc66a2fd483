//! `rsb transfer run ID`: the hidden worker a server starts for a background transfer.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum TransferCmd {
    /// Run a recorded background transfer to its end (started detached by `rsb mcp`).
    Run {
        /// The task id from the server's reply.
        id: i64,
        /// A socket to an agent the server started on its own connection (set by the server).
        #[arg(long, hide = true)]
        agent_fd: Option<i32>,
    },
}

/// Exit code: 0 when the task ran (whatever its outcome, which is in its record), 1 when it
/// could not be run at all.
pub async fn transfer(cmd: TransferCmd, state_dir: &std::path::Path) -> u8 {
    match cmd {
        TransferCmd::Run { id, agent_fd } => {
            let t = match rsb::store::transfers::Transfers::open(state_dir).await {
                Ok(t) => std::sync::Arc::new(t),
                Err(e) => {
                    eprintln!("rsb transfer run: {}\n  hint: {}", e.message, e.hint);
                    return 1;
                }
            };
            match t.run_worker(id, agent_fd).await {
                Ok(()) => 0,
                Err(msg) => {
                    eprintln!("rsb transfer run: {msg}");
                    1
                }
            }
        }
    }
}
