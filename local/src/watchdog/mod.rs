//! The watchdog: a local daemon that keeps watching long background jobs after the agent's
//! session has ended, records what happens to them as events, alerts, and resumes interrupted
//! jobs from their checkpoints.
//!
//! Its rows are the store's: a watch ([`crate::store::watch_model`]), registration, queries and
//! the one transaction that records a check's outcome and its events together, so a daemon
//! killed at any instant neither loses nor repeats one ([`crate::store::watches`]), the events,
//! their types and files ([`crate::store::events`]), and the secret-free sandbox definitions
//! the daemon connects with ([`crate::store::sandboxes`]).
//!
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

/// Keeps the last `max` characters (the end of a log or checkpoint is what matters).
pub(crate) fn clip_tail(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        s.to_string()
    } else {
        s.chars().skip(n - max).collect()
    }
}
