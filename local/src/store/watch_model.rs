//! A watch, as stored and as replied (its events are [`super::events`]). The reply keys are the seed's (every column
//! of `watches`, with `metadata_json`/`resume_plan_json` decoded into `metadata`/`resume_plan`
//! objects and the flags as booleans), plus rsb's additions after them.

use rusqlite::Row;
use serde::Serialize;
use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Watch {
    pub id: i64,
    pub run_id: String,
    pub name: String,
    pub sandbox_name: String,
    /// Which persisted definition of `sandbox_name` this watch was registered with.
    pub sandbox_fp: String,
    pub tmux_session: String,
    pub log_file: String,
    pub cwd: String,
    pub launch_command: String,
    pub resume_command: String,
    pub resume_plan: Map<String, Value>,
    pub checkpoint_path: String,
    pub checkpoint_format: String,
    pub checkpoint_command: String,
    pub interval_s: i64,
    pub max_log_lines: i64,
    /// `active | completed | cancelled` (the seed's vocabulary).
    pub status: String,
    /// `"" | running | completed | interrupted | resuming | ssh_unreachable | config_missing |
    /// needs_credentials | error`.
    pub last_state: String,
    pub last_summary: String,
    pub last_error: String,
    pub last_exit_code: Option<i64>,
    pub last_log_digest: String,
    pub last_log_tail: String,
    pub last_checkpoint_text: String,
    pub last_checkpoint_digest: String,
    pub checkpoint_updated_ts: i64,
    pub webhook_url: String,
    pub event_command: String,
    pub auto_resume: bool,
    pub resume_attempts: i64,
    pub max_resume_attempts: i64,
    pub alert_after_failures: i64,
    pub consecutive_ssh_failures: i64,
    pub ssh_alert_sent: bool,
    pub notify_local: bool,
    pub resume_delay_s: i64,
    pub interrupted_ts: i64,
    pub resume_due_ts: i64,
    pub metadata: Map<String, Value>,
    pub created_ts: i64,
    pub updated_ts: i64,
    pub last_checked_ts: i64,
    pub next_check_ts: i64,
    pub last_event_ts: i64,
    // rsb's additions.
    /// The signal that ended the job, when one did.
    pub last_signal: Option<i64>,
    /// Seconds without log growth before a `stalled` event; 0 = off.
    pub stall_after_s: i64,
    /// Log size at the last check (-1 before the first).
    pub last_log_size: i64,
    pub log_changed_ts: i64,
    pub stall_alert_sent: bool,
    /// The last alert (webhook, event_command) that failed, and why; "" when the last worked.
    pub last_alert_error: String,
    #[serde(skip)]
    pub next_check_ms: i64,
    #[serde(skip)]
    pub resume_intent_ms: i64,
    /// While a resume is being started: the launch id the agent stores with it, and the job
    /// name it starts under. A daemon that stopped mid-start repeats exactly this launch; the
    /// agent answers with the run that id started, if any, so nothing compares two clocks.
    #[serde(skip)]
    pub resume_launch_id: String,
    #[serde(skip)]
    pub resume_launch_session: String,
    #[serde(skip)]
    pub rev: i64,
}

fn json_object(s: &str) -> Map<String, Value> {
    match serde_json::from_str(s) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

impl Watch {
    pub fn from_row(r: &Row<'_>) -> rusqlite::Result<Watch> {
        let b = |k: &str| -> rusqlite::Result<bool> { Ok(r.get::<_, i64>(k)? != 0) };
        Ok(Watch {
            id: r.get("id")?,
            run_id: r.get("run_id")?,
            name: r.get("name")?,
            sandbox_name: r.get("sandbox_name")?,
            sandbox_fp: r.get("sandbox_fp")?,
            tmux_session: r.get("tmux_session")?,
            log_file: r.get("log_file")?,
            cwd: r.get("cwd")?,
            launch_command: r.get("launch_command")?,
            resume_command: r.get("resume_command")?,
            resume_plan: json_object(&r.get::<_, String>("resume_plan_json")?),
            checkpoint_path: r.get("checkpoint_path")?,
            checkpoint_format: r.get("checkpoint_format")?,
            checkpoint_command: r.get("checkpoint_command")?,
            interval_s: r.get("interval_s")?,
            max_log_lines: r.get("max_log_lines")?,
            status: r.get("status")?,
            last_state: r.get("last_state")?,
            last_summary: r.get("last_summary")?,
            last_error: r.get("last_error")?,
            last_exit_code: r.get("last_exit_code")?,
            last_log_digest: r.get("last_log_digest")?,
            last_log_tail: r.get("last_log_tail")?,
            last_checkpoint_text: r.get("last_checkpoint_text")?,
            last_checkpoint_digest: r.get("last_checkpoint_digest")?,
            checkpoint_updated_ts: r.get("checkpoint_updated_ts")?,
            webhook_url: r.get("webhook_url")?,
            event_command: r.get("event_command")?,
            auto_resume: b("auto_resume")?,
            resume_attempts: r.get("resume_attempts")?,
            max_resume_attempts: r.get("max_resume_attempts")?,
            alert_after_failures: r.get("alert_after_failures")?,
            consecutive_ssh_failures: r.get("consecutive_ssh_failures")?,
            ssh_alert_sent: b("ssh_alert_sent")?,
            notify_local: b("notify_local")?,
            resume_delay_s: r.get("resume_delay_s")?,
            interrupted_ts: r.get("interrupted_ts")?,
            resume_due_ts: r.get("resume_due_ts")?,
            metadata: json_object(&r.get::<_, String>("metadata_json")?),
            created_ts: r.get("created_ts")?,
            updated_ts: r.get("updated_ts")?,
            last_checked_ts: r.get("last_checked_ts")?,
            next_check_ts: r.get("next_check_ts")?,
            last_event_ts: r.get("last_event_ts")?,
            last_signal: r.get("last_signal")?,
            stall_after_s: r.get("stall_after_s")?,
            last_log_size: r.get("last_log_size")?,
            log_changed_ts: r.get("log_changed_ts")?,
            stall_alert_sent: b("stall_alert_sent")?,
            last_alert_error: r.get("last_alert_error")?,
            next_check_ms: r.get("next_check_ms")?,
            resume_intent_ms: r.get("resume_intent_ms")?,
            resume_launch_id: r.get("resume_launch_id")?,
            resume_launch_session: r.get("resume_launch_session")?,
            rev: r.get("rev")?,
        })
    }

    /// The name a person knows the watch by: its name, else its run id, else its job.
    pub fn label(&self) -> &str {
        [&self.name, &self.run_id, &self.tmux_session]
            .into_iter()
            .find(|s| !s.is_empty())
            .map(String::as_str)
            .unwrap_or("")
    }

    /// What the seed puts under `payload.watch` in every event.
    pub fn payload_snapshot(&self) -> Value {
        serde_json::json!({
            "id": self.id,
            "run_id": self.run_id,
            "name": self.name,
            "sandbox_name": self.sandbox_name,
            "tmux_session": self.tmux_session,
            "log_file": self.log_file,
            "checkpoint_path": self.checkpoint_path,
            "resume_attempts": self.resume_attempts,
            "max_resume_attempts": self.max_resume_attempts,
            "auto_resume": self.auto_resume,
            "status": self.status,
            "last_state": self.last_state,
        })
    }

    /// The command a resume runs: the plan's, else the watch's, else the original launch
    /// (the seed's order).
    pub fn resume_command_to_run(&self) -> String {
        let plan = self
            .resume_plan
            .get("resume_command")
            .and_then(Value::as_str)
            .unwrap_or("");
        [plan, &self.resume_command, &self.launch_command]
            .into_iter()
            .find(|s| !s.trim().is_empty())
            .unwrap_or("")
            .to_string()
    }

    pub fn checkpoint_command_to_run(&self) -> String {
        let plan = self
            .resume_plan
            .get("checkpoint_command")
            .and_then(Value::as_str)
            .unwrap_or("");
        if plan.trim().is_empty() {
            self.checkpoint_command.clone()
        } else {
            plan.to_string()
        }
    }

    /// The job name a resume runs under (the plan may name another session).
    pub fn resume_session(&self) -> String {
        self.resume_plan
            .get("tmux_session")
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
            .unwrap_or(&self.tmux_session)
            .to_string()
    }

    pub fn resume_cwd(&self) -> String {
        self.resume_plan
            .get("cwd")
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
            .unwrap_or(&self.cwd)
            .to_string()
    }
}

/// One line: newlines and other control characters become spaces (summaries, errors).
pub fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .trim()
        .to_string()
}
