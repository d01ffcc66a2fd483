//! Background job tools. The watch-related parameters of the seed are accepted and validated
//! so existing callers keep working; rsb's agent supervises the job itself, and the reply says
//! plainly that no local watch was registered.

use rmcp::{
    handler::server::wrapper::Parameters, schemars, schemars::JsonSchema, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, reply};
use crate::{error::RsbError, ops::jobs};

fn d_true() -> bool {
    true
}
fn d_text() -> String {
    "text".into()
}
fn d_300() -> i64 {
    300
}
fn d_80() -> i64 {
    80
}
fn d_1() -> i64 {
    1
}
fn d_2() -> i64 {
    2
}
fn d_last_n() -> i64 {
    jobs::DEFAULT_LAST_N_LINES
}
fn d_cursor_bytes() -> i64 {
    65_536
}
fn d_grace() -> f64 {
    5.0
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // The watch fields are accepted for seed compatibility; rsb has no local watchdog yet.
pub struct ExecBackgroundParams {
    pub command: String,
    /// Job name [A-Za-z0-9_-]{1,64}; "" = bg-<time>.
    #[serde(default)]
    pub session_name: String,
    /// "" = .codex_logs/<name>.log under cwd (or $HOME).
    #[serde(default)]
    pub log_file: String,
    #[serde(default)]
    pub cwd: String,
    #[serde(default)]
    pub sandbox_name: String,
    #[serde(default = "d_true")]
    pub watch: bool,
    #[serde(default = "d_true")]
    pub ensure_watchdog: bool,
    #[serde(default)]
    pub run_id: String,
    #[serde(default)]
    pub watch_name: String,
    #[serde(default)]
    pub resume_command: String,
    #[serde(default)]
    pub resume_plan_json: String,
    #[serde(default)]
    pub checkpoint_path: String,
    #[serde(default = "d_text")]
    pub checkpoint_format: String,
    #[serde(default)]
    pub checkpoint_command: String,
    #[serde(default = "d_300")]
    pub interval_s: i64,
    #[serde(default = "d_80")]
    pub max_log_lines: i64,
    #[serde(default)]
    pub webhook_url: String,
    #[serde(default)]
    pub event_command: String,
    #[serde(default)]
    pub auto_resume: bool,
    #[serde(default = "d_1")]
    pub max_resume_attempts: i64,
    #[serde(default)]
    pub metadata_json: String,
    #[serde(default = "d_true")]
    pub notify_local: bool,
    #[serde(default = "d_2")]
    pub alert_after_failures: i64,
    #[serde(default = "d_300")]
    pub resume_delay_s: i64,
    #[serde(default)]
    pub codex_wakeup: bool,
    #[serde(default)]
    pub codex_command: String,
}

impl ExecBackgroundParams {
    /// The seed's pre-launch checks, so a bad call fails before anything starts.
    fn validate(&self) -> Result<(), RsbError> {
        let pos = |v: i64, n: &str| {
            (v > 0).then_some(()).ok_or_else(|| {
                RsbError::invalid(format!("{n} must be positive"), "pass a value >= 1")
            })
        };
        let nonneg = |v: i64, n: &str| {
            (v >= 0).then_some(()).ok_or_else(|| {
                RsbError::invalid(format!("{n} must be zero or positive"), "pass a value >= 0")
            })
        };
        pos(self.interval_s, "interval_s")?;
        pos(self.max_log_lines, "max_log_lines")?;
        nonneg(self.max_resume_attempts, "max_resume_attempts")?;
        pos(self.alert_after_failures, "alert_after_failures")?;
        nonneg(self.resume_delay_s, "resume_delay_s")?;
        for (v, n) in [
            (&self.metadata_json, "metadata_json"),
            (&self.resume_plan_json, "resume_plan_json"),
        ] {
            if !v.trim().is_empty() {
                match serde_json::from_str::<serde_json::Value>(v) {
                    Ok(serde_json::Value::Object(_)) => {}
                    Ok(_) => {
                        return Err(RsbError::invalid(
                            format!("{n} must decode to a JSON object"),
                            "pass {\"key\": ...}",
                        ));
                    }
                    Err(e) => {
                        return Err(RsbError::invalid(
                            format!("{n} is not valid JSON: {e}"),
                            "pass a JSON object",
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckBackgroundParams {
    #[serde(default)]
    pub tmux_session: String,
    /// Read this log instead of the task's own.
    #[serde(default)]
    pub log_file: String,
    #[serde(default)]
    pub watch_id: i64,
    #[serde(default = "d_last_n")]
    pub last_n_lines: i64,
    /// Byte cursor: return output from here (pass back next_offset) instead of log_tail.
    #[serde(default)]
    pub offset: Option<i64>,
    /// Cap for cursor reads.
    #[serde(default = "d_cursor_bytes")]
    pub max_bytes: i64,
    #[serde(default)]
    pub sandbox_name: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KillBackgroundParams {
    pub tmux_session: String,
    /// SIGTERM, then SIGKILL after this many seconds.
    #[serde(default = "d_grace")]
    pub grace_s: f64,
    #[serde(default)]
    pub sandbox_name: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListBackgroundParams {
    #[serde(default)]
    pub sandbox_name: String,
}

#[tool_router(router = jobs_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        description = "Start a long command detached (survives disconnects). Output and a final EXIT_CODE=<n> line go to log_file. Poll with check_background_task."
    )]
    async fn exec_bash_background(
        &self,
        Parameters(p): Parameters<ExecBackgroundParams>,
    ) -> ToolResult {
        if let Err(e) = p.validate() {
            return fail(&e);
        }
        let client = match self.pool.client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        let mut r = jobs::start(&client, &p.command, &p.session_name, &p.log_file, &p.cwd).await;
        if let Ok(v) = &mut r
            && p.watch
        {
            v["watch_note"] = serde_json::json!(
                "no local watch registered: rsb's agent records the exit code itself; poll check_background_task"
            );
        }
        reply(r)
    }

    #[tool(
        description = "Status of a background task: running, exit_code, log_tail (or output from byte offset)."
    )]
    async fn check_background_task(
        &self,
        Parameters(p): Parameters<CheckBackgroundParams>,
    ) -> ToolResult {
        if p.watch_id > 0 && p.tmux_session.is_empty() {
            return fail(&RsbError::invalid(
                format!(
                    "Unknown watch id: {} (rsb has no local watches)",
                    p.watch_id
                ),
                "pass tmux_session, the name exec_bash_background returned",
            ));
        }
        let req = match jobs::status_request(
            &p.tmux_session,
            &p.log_file,
            p.last_n_lines,
            p.offset,
            p.max_bytes,
        ) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let client = match self.pool.client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        let cursor = p.offset.is_some();
        reply(
            client
                .call(req)
                .await
                .and_then(|r| jobs::status_reply(&p.tmux_session, cursor, &r)),
        )
    }

    #[tool(description = "Stop a background task (SIGTERM, then SIGKILL) and report how it ended.")]
    async fn kill_background_task(
        &self,
        Parameters(p): Parameters<KillBackgroundParams>,
    ) -> ToolResult {
        let client = match self.pool.client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        reply(jobs::kill(&client, &p.tmux_session, p.grace_s).await)
    }

    #[tool(description = "List background tasks on a sandbox.")]
    async fn list_background_tasks(
        &self,
        Parameters(p): Parameters<ListBackgroundParams>,
    ) -> ToolResult {
        let client = match self.pool.client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        reply(jobs::list(&client).await)
    }
}
