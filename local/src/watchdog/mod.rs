//! The watchdog: a local daemon that keeps watching long background jobs after the agent's
//! session has ended, records what happens to them as events, alerts, and resumes interrupted
//! jobs from their checkpoints.
//!
//! - [`model`]: a watch and an event as stored and as replied (the seed's keys plus rsb's).
//! - [`db`]: registration, queries and the one transaction that records a check's outcome and
//!   its events together (so a daemon killed at any instant neither loses nor repeats one).
//! - [`sandboxes`]: the secret-free sandbox definitions the daemon connects with.
//! - [`checks`]: the state machine, a pure function from (watch, what the agent said) to
//!   (updates, events, resume).
//! - [`lock`]: one daemon per state dir, and who holds it.
//! - [`daemon`]: `rsb watchdog run`, the loop: heartbeat, concurrent checks with
//!   deadlines, connections reused between ticks.
//! - [`forwards`]: detached port forwards the daemon serves (`forward_port(detach=true)`).
//! - [`alerts`]: desktop notification, webhook, `event_command`, each off the loop with a
//!   timeout.
//! - [`service`]: systemd --user unit / launchd agent, and `ensure_watchdog`.
//! - [`settings`]: the opt-ins (environment) and the `[watchdog]` table of the user's config.
//! - [`cli`]: `rsb watchdog …` and `rsb watch …`.

pub mod alerts;
pub mod checks;
pub mod daemon;
pub mod forwards;
pub mod lock;
pub mod service;
pub mod settings;

/// The watch tables and the persisted sandboxes live in the store layer; these names keep
/// `watchdog::db` and `watchdog::sandboxes` paths working for callers.
pub use crate::store::{sandboxes, watches as db};

/// The watch model is the store's; watchdog code names it from here.
pub use crate::store::watch_model::{self as model, NewEvent, Watch, WatchEvent, one_line};

/// The seed's defaults (`DEFAULT_WATCH_INTERVAL_S`, `DEFAULT_MAX_LOG_LINES`, …).
pub const DEFAULT_INTERVAL_S: i64 = 300;
pub const DEFAULT_MAX_LOG_LINES: i64 = 80;
pub const DEFAULT_ALERT_AFTER_FAILURES: i64 = 2;
pub const DEFAULT_RESUME_DELAY_S: i64 = 300;
/// A heartbeat older than this is reported stale (`heartbeat_stale`: a live daemon whose loop
/// is stuck). Whether a daemon runs at all is decided by its lock holder, never by this row:
/// the loop beats at most every [`HEARTBEAT_EVERY`], and the row is cleared when the daemon
/// exits.
pub const HEARTBEAT_STALE_S: i64 = 30;
/// How often the daemon writes its heartbeat. Not every tick: an idle daemon should not write
/// the state file every second (each commit is a write and an fsync of the WAL).
pub const HEARTBEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
/// Checkpoint text and log tails kept per watch (the seed's 20,000 characters).
pub const MAX_TEXT_CHARS: usize = 20_000;

/// The event types: the seed's, plus `stalled`, `needs_credentials` and `gave_up`, and the
/// Slurm ones: `requeued`, `timeout`, `out_of_memory`, `cancelled`, `scheduler_unreachable`.
pub mod event {
    pub const COMPLETED: &str = "completed";
    pub const INTERRUPTED: &str = "interrupted";
    pub const RESUME_STARTED: &str = "resume_started";
    pub const RESUME_FAILED: &str = "resume_failed";
    pub const SSH_UNREACHABLE: &str = "ssh_unreachable";
    pub const RUNNING_RESTORED: &str = "running_restored";
    pub const CONFIG_MISSING: &str = "config_missing";
    pub const STALLED: &str = "stalled";
    pub const NEEDS_CREDENTIALS: &str = "needs_credentials";
    /// The job is interrupted and every resume attempt is used up: the watch ends (status
    /// `gave_up`) instead of polling a dead job forever.
    pub const GAVE_UP: &str = "gave_up";
    /// Slurm put the job back in its queue (node failure or preemption with `requeue`): it
    /// will run again by itself, so rsb does not resubmit it.
    pub const REQUEUED: &str = "requeued";
    /// Slurm ended the job at its time limit.
    pub const TIMEOUT: &str = "timeout";
    /// Slurm ended the job over its memory limit.
    pub const OUT_OF_MEMORY: &str = "out_of_memory";
    /// The job was cancelled outside rsb (`scancel`); `kill_background_task` ends the watch
    /// before it kills, so it never raises this.
    pub const CANCELLED: &str = "cancelled";
    /// The Slurm controller did not answer: the job's state is unknown (never "lost").
    pub const SCHEDULER_UNREACHABLE: &str = "scheduler_unreachable";
    /// The events that report a run's end: each carries the run's `started_ms`, so a session
    /// that heard the same end from the agent's stream tells it from a resumed run's.
    pub const ENDS_RUN: [&str; 5] = [COMPLETED, INTERRUPTED, TIMEOUT, OUT_OF_MEMORY, CANCELLED];
}

/// Keeps the last `max` characters (the end of a log or checkpoint is what matters).
pub(crate) fn clip_tail(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        s.to_string()
    } else {
        s.chars().skip(n - max).collect()
    }
}
