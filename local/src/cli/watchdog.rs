//! `rsb watchdog run|install|uninstall|status` and `rsb watch list|show|events|cancel`: tables
//! for people, `--json` for scripts. These need no sandbox configuration, only the state dir.

use std::{path::Path, time::Duration};

use clap::Subcommand;
use serde::Serialize;

use rsb::{
    error::RsbError,
    ops::watchdog as ops,
    store::{events::WatchEvent, watch_model::Watch},
    term::{shown, shown_lines},
    watchdog::daemon,
};

#[derive(Debug, Subcommand)]
pub enum WatchdogCmd {
    /// Run the watchdog loop in the foreground (what the service runs); one per state dir.
    Run {
        /// How it was started, as `status` reports it: foreground, service or detached.
        #[arg(long, default_value = "foreground")]
        mode: String,
        /// Seconds between ticks (each tick checks the watches that are due).
        #[arg(long, default_value_t = 1.0)]
        loop_sleep: f64,
        /// Deadline of each webhook and event_command, in seconds.
        #[arg(long)]
        hook_timeout: Option<u64>,
        /// Exit after this many seconds without active watches (default: 600 when detached).
        #[arg(long)]
        idle_exit: Option<u64>,
    },
    /// Install and start the platform service (systemd --user or launchd).
    Install {
        /// Write and enable it, but do not start it now.
        #[arg(long)]
        no_start: bool,
    },
    /// Stop and remove the service (watches and events stay).
    Uninstall,
    /// Is a daemon running, how, and how many watches it has.
    Status,
    /// Stop the running daemon and start it again (the installed service, else detached).
    Restart,
}

#[derive(Debug, Subcommand)]
pub enum WatchCmd {
    /// List watches, newest first.
    List {
        /// Only this status: active, completed, gave_up or cancelled.
        #[arg(long, default_value = "")]
        status: String,
    },
    /// Everything about one watch.
    Show { id: i64 },
    /// Events, newest first (of one watch, or of all).
    Events {
        id: Option<i64>,
        #[arg(long, short = 'n', default_value_t = 20)]
        limit: i64,
    },
    /// Stop watching (a running job keeps running).
    Cancel { id: i64 },
}

fn print_err(json: bool, e: &RsbError) {
    if json {
        println!(
            "{}",
            serde_json::json!({"error": e.message, "hint": e.hint})
        );
    } else {
        eprintln!("rsb: {}\n  hint: {}", e.message, e.hint);
    }
}

fn out<T: Serialize>(json: bool, r: rsb::error::Result<T>, human: impl FnOnce(&T)) -> u8 {
    match r {
        Ok(v) if json => {
            println!("{}", serde_json::to_string(&v).unwrap_or_default());
            0
        }
        Ok(v) => {
            human(&v);
            0
        }
        Err(e) => {
            print_err(json, &e);
            1
        }
    }
}

pub async fn watchdog(cmd: WatchdogCmd, json: bool, state_dir: &Path) -> u8 {
    match cmd {
        WatchdogCmd::Run {
            mode,
            loop_sleep,
            hook_timeout,
            idle_exit,
        } => {
            if !(0.05..=3600.0).contains(&loop_sleep) {
                print_err(
                    json,
                    &RsbError::invalid(
                        "--loop-sleep must be between 0.05 and 3600 seconds",
                        "1 is the default",
                    ),
                );
                return 2;
            }
            // A service finding another daemon at work exits cleanly, so its manager does not
            // restart it in a loop (`Restart=on-failure`).
            if mode == "service"
                && let Some(pid) = daemon::lock_holder(state_dir)
            {
                eprintln!(
                    "rsb watchdog: pid {pid} already watches {}; this service instance exits",
                    state_dir.display()
                );
                return 0;
            }
            let mut o = daemon::Options::new(state_dir.to_path_buf());
            o.tick = Duration::from_secs_f64(loop_sleep);
            o.idle_exit = idle_exit
                .or((mode == "detached").then_some(600))
                .map(Duration::from_secs);
            if let Some(t) = hook_timeout {
                o.hook_timeout = Duration::from_secs(t.clamp(1, 3600));
            }
            o.mode = mode;
            match daemon::run(o).await {
                Ok(()) => 0,
                Err(e) => {
                    print_err(json, &e);
                    1
                }
            }
        }
        WatchdogCmd::Install { no_start } => {
            let r = with_store(state_dir, async |s| ops::install(s, !no_start, None).await).await;
            out(json, r, |r| {
                println!(
                    "installed the {} service {} ({}){}",
                    r.install.kind,
                    r.install.label,
                    r.install.plist_path,
                    if r.install.started { ", started" } else { "" }
                );
                if let Some(n) = &r.install.note {
                    println!("note: {n}");
                }
            })
        }
        WatchdogCmd::Uninstall => {
            let r = with_store(state_dir, async |s| ops::uninstall(s).await).await;
            out(json, r, |r| {
                if r.removal.removed {
                    println!("removed {}", r.removal.plist_path);
                } else {
                    println!("no service was installed ({})", r.removal.plist_path);
                }
            })
        }
        WatchdogCmd::Restart => {
            let r = ops::restart(state_dir).await;
            out(json, r, |r| {
                println!(
                    "watchdog: {} (pid {})",
                    r.detail,
                    r.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into())
                );
            })
        }
        WatchdogCmd::Status => {
            let r = with_store(state_dir, async |s| ops::status(s).await).await;
            out(json, r, |s| {
                let d = &s.daemon;
                if d.running {
                    println!(
                        "watchdog: running (pid {}, {}, heartbeat {}s ago)",
                        d.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
                        d.mode.as_deref().unwrap_or("?"),
                        d.heartbeat_age_s
                            .map(|a| a.to_string())
                            .unwrap_or_else(|| "?".into()),
                    );
                } else {
                    println!(
                        "watchdog: not running (start it with `rsb watchdog run`, or `rsb watchdog install`)"
                    );
                }
                println!(
                    "service:  {} {}",
                    s.service.kind,
                    if s.service.installed {
                        format!("installed ({})", s.service.path)
                    } else {
                        "not installed".into()
                    }
                );
                let counts: Vec<String> = s
                    .watch_counts
                    .iter()
                    .map(|(k, v)| format!("{v} {k}"))
                    .collect();
                println!("watches:  {}", counts.join(", "));
                println!("state:    {}", s.paths.state_dir);
            })
        }
    }
}

fn ago(ts: i64) -> String {
    if ts <= 0 {
        return "-".into();
    }
    let d = (rsb::store::now_s() - ts).max(0);
    match d {
        0..60 => format!("{d}s ago"),
        60..3600 => format!("{}m ago", d / 60),
        3600..86400 => format!("{}h ago", d / 3600),
        _ => format!("{}d ago", d / 86400),
    }
}

fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}

/// The fields of a watch whose text has lines of its own (`rsb watch show` indents them).
const MULTILINE_FIELDS: &[&str] = &[
    "last_log_tail",
    "last_checkpoint_text",
    "launch_command",
    "resume_command",
    "checkpoint_command",
    "event_command",
    "last_summary",
    "last_error",
    "last_alert_error",
];

/// `rsb watch cancel`, on the audit record as `cancel_background_watch` is.
async fn cancel_audited(state_dir: &Path, id: i64) -> rsb::error::Result<ops::Cancelled> {
    super::policy::caller(false)
        .act_on(
            state_dir,
            "rsb watch cancel",
            format!("watch {id}"),
            async || with_store(state_dir, async |s| ops::cancel(s, id).await).await,
            |c| c.watch.sandbox_name.clone(),
        )
        .await
}

fn watch_table(ws: &[Watch]) {
    println!(
        "{:>4}  {:<10} {:<16} {:<14} {:<24} {:>9}  SUMMARY",
        "ID", "STATUS", "STATE", "SANDBOX", "JOB", "CHECKED"
    );
    for w in ws {
        println!(
            "{:>4}  {:<10} {:<16} {:<14} {:<24} {:>9}  {}",
            w.id,
            shown(&w.status),
            cut(&shown(&w.last_state), 16),
            cut(&shown(&w.sandbox_name), 14),
            cut(&shown(w.label()), 24),
            ago(w.last_checked_ts),
            cut(&shown(&w.last_summary), 60)
        );
    }
}

fn event_table(es: &[WatchEvent]) {
    println!(
        "{:>5}  {:>5}  {:<18} {:>9}  SUMMARY",
        "ID", "WATCH", "EVENT", "WHEN"
    );
    for e in es {
        println!(
            "{:>5}  {:>5}  {:<18} {:>9}  {}",
            e.id,
            e.watch_id,
            shown(&e.event_type),
            ago(e.created_ts),
            cut(&shown(&e.summary), 80)
        );
    }
}

/// `f` with a store of this command's own (its calls wait on the store's thread, not the
/// command's), closed before the command ends so the database is left whole.
async fn with_store<T>(
    state_dir: &Path,
    f: impl AsyncFnOnce(&rsb::store::Store) -> rsb::error::Result<T>,
) -> rsb::error::Result<T> {
    let store = rsb::store::Store::new(state_dir);
    let r = f(&store).await;
    store.close().await;
    r
}

pub async fn watch(cmd: WatchCmd, json: bool, state_dir: &Path) -> u8 {
    match cmd {
        WatchCmd::List { status } => {
            let r = with_store(state_dir, async |s| ops::list(s, &status).await).await;
            out(json, r, |l| {
                if l.watches.is_empty() {
                    println!("no watches");
                } else {
                    watch_table(&l.watches);
                }
            })
        }
        WatchCmd::Show { id } => {
            let r = with_store(state_dir, async |s| ops::get(s, id).await).await;
            out(json, r, |w| {
                let w = &w.watch;
                let v = serde_json::to_value(w).unwrap_or_default();
                for (k, val) in v.as_object().into_iter().flatten() {
                    // Names and summaries are the model's and the host's: escaped. Line breaks
                    // are kept (indented below the key) only where text has lines: a log tail, a
                    // checkpoint, a command; a name, an id or a path is one line whatever it holds.
                    let shown = match val {
                        serde_json::Value::String(s) if MULTILINE_FIELDS.contains(&k.as_str()) => {
                            shown_lines(s).into_owned()
                        }
                        serde_json::Value::String(s) => shown(s).into_owned(),
                        other => other.to_string(),
                    };
                    if shown.contains('\n') {
                        println!("{k}:\n  {}", shown.trim_end().replace('\n', "\n  "));
                    } else {
                        println!("{k}: {shown}");
                    }
                }
            })
        }
        WatchCmd::Events { id, limit } => {
            let id = id.unwrap_or(0);
            let r = with_store(state_dir, async |s| ops::events(s, id, limit).await).await;
            out(json, r, |e| {
                if e.events.is_empty() {
                    println!("no events");
                } else {
                    event_table(&e.events);
                }
            })
        }
        WatchCmd::Cancel { id } => {
            let r = cancel_audited(state_dir, id).await;
            out(json, r, |c| {
                let w = &c.watch;
                // Say what was last seen of the job, not that it "keeps running": it may have
                // ended or been lost long ago.
                let sandbox = shown(&w.sandbox_name);
                let job = match w.last_state.as_str() {
                    "running" | "" | "pending" => format!("keeps running on {sandbox}"),
                    "completed" => format!(
                        "had completed on {sandbox} (exit code {})",
                        w.last_exit_code
                            .map(|c| c.to_string())
                            .unwrap_or_else(|| "?".into())
                    ),
                    other => format!(
                        "was last seen {} on {sandbox}; it is not running",
                        shown(other)
                    ),
                };
                println!(
                    "watch {} cancelled; job {} {job}",
                    w.id,
                    shown(&w.tmux_session)
                );
            })
        }
    }
}
