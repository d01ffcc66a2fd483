//! The seed's 12 advanced watchdog tools, listed only when
//! `REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS` is truthy. Names, parameters and defaults are the
//! seed's; replies are `ops::watchdog`'s typed results.

use rmcp::{
    handler::server::wrapper::Parameters, schemars, schemars::JsonSchema, tool, tool_router,
};
use serde::{Deserialize, Serialize};

use super::{RsbServer, ToolResult, fail, jobs::ExecBackgroundParams, ok, reply};
use crate::{
    error::{Result, RsbError},
    ops::{action::Act, watchdog as wops},
    watchdog::settings,
};

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
fn d_20() -> i64 {
    20
}
fn d_200() -> i64 {
    200
}
fn d_20000() -> i64 {
    20_000
}

fn typed<T: Serialize>(r: Result<T>) -> ToolResult {
    match r.and_then(|v| {
        serde_json::to_value(v).map_err(|e| RsbError::internal(format!("reply encoding: {e}")))
    }) {
        Ok(v) => ok(v),
        Err(e) => fail(&e),
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallParams {
    #[serde(default = "d_true")]
    pub start_now: bool,
    /// Store the sandbox definitions (never secrets unless RSB_WATCHDOG_STORE_PASSWORDS=1).
    #[serde(default = "d_true")]
    pub persist_current_sandboxes: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WatchTaskParams {
    pub tmux_session: String,
    pub log_file: String,
    #[serde(default)]
    pub sandbox_name: String,
    #[serde(default)]
    pub run_id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub cwd: String,
    #[serde(default)]
    pub launch_command: String,
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
    /// Needs RSB_ALLOW_WATCH_HOOKS=1.
    #[serde(default)]
    pub webhook_url: String,
    /// Needs RSB_ALLOW_WATCH_HOOKS=1.
    #[serde(default)]
    pub event_command: String,
    #[serde(default)]
    pub auto_resume: bool,
    #[serde(default = "d_1")]
    pub max_resume_attempts: i64,
    #[serde(default)]
    pub metadata_json: String,
    #[serde(default = "d_true")]
    pub ensure_watchdog: bool,
    #[serde(default = "d_true")]
    pub notify_local: bool,
    #[serde(default = "d_2")]
    pub alert_after_failures: i64,
    #[serde(default = "d_300")]
    pub resume_delay_s: i64,
    /// Event when the log stops growing this long; 0 = off.
    #[serde(default)]
    pub stall_after_s: i64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecWatchParams {
    pub command: String,
    #[serde(default)]
    pub session_name: String,
    #[serde(default)]
    pub log_file: String,
    #[serde(default)]
    pub cwd: String,
    #[serde(default)]
    pub sandbox_name: String,
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
    /// Needs RSB_ALLOW_WATCH_HOOKS=1.
    #[serde(default)]
    pub webhook_url: String,
    /// Needs RSB_ALLOW_WATCH_HOOKS=1.
    #[serde(default)]
    pub event_command: String,
    #[serde(default)]
    pub auto_resume: bool,
    #[serde(default = "d_1")]
    pub max_resume_attempts: i64,
    #[serde(default)]
    pub metadata_json: String,
    #[serde(default = "d_true")]
    pub ensure_watchdog: bool,
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
    #[serde(default)]
    pub stall_after_s: i64,
    /// As exec_bash_background's `slurm`.
    #[serde(default)]
    #[schemars(schema_with = "super::jobs::slurm_schema")]
    pub slurm: Option<crate::ops::slurm::SlurmOptions>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListWatchesParams {
    /// active, completed or cancelled; "" = all.
    #[serde(default)]
    pub status: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WatchIdParams {
    pub watch_id: i64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProgressParams {
    pub watch_id: i64,
    #[serde(default = "d_true")]
    pub refresh_live: bool,
    #[serde(default = "d_80")]
    pub log_lines: i64,
    #[serde(default = "d_20000")]
    pub checkpoint_max_bytes: i64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LogParams {
    pub watch_id: i64,
    #[serde(default = "d_200")]
    pub last_n_lines: i64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointParams {
    pub watch_id: i64,
    #[serde(default = "d_20000")]
    pub max_bytes: i64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EventsParams {
    /// 0 = every watch.
    #[serde(default)]
    pub watch_id: i64,
    #[serde(default = "d_20")]
    pub limit: i64,
}

impl RsbServer {
    async fn watch(&self, id: i64) -> Result<crate::store::watch_model::Watch> {
        Ok(wops::get(&self.app.store(), id).await?.watch)
    }
}

#[tool_router(router = watchdog_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        description = "Install and start the local watchdog service: a launchd agent on macOS, a systemd --user unit on Linux (the seed's name; it is not macOS-only here)."
    )]
    async fn install_macos_watchdog(&self, Parameters(p): Parameters<InstallParams>) -> ToolResult {
        let sandboxes = &self.app.config().sandboxes;
        let persist = p.persist_current_sandboxes.then_some(&sandboxes[..]);
        typed(wops::install(&self.app.store(), p.start_now, persist).await)
    }

    #[tool(description = "Stop and remove the watchdog service (watches and events stay).")]
    async fn uninstall_macos_watchdog(&self, Parameters(_): Parameters<NoParams>) -> ToolResult {
        typed(wops::uninstall(&self.app.store()).await)
    }

    #[tool(
        description = "Watchdog daemon status: pid, heartbeat age, mode (service/detached), service, watch counts."
    )]
    async fn get_watchdog_status(&self, Parameters(_): Parameters<NoParams>) -> ToolResult {
        typed(wops::status(&self.app.store()).await)
    }

    #[tool(
        description = "Register an existing background task for watchdog monitoring, alerts and checkpoint-based auto-resume."
    )]
    async fn watch_background_task(
        &self,
        Parameters(p): Parameters<WatchTaskParams>,
        ctx: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> ToolResult {
        let args = wops::WatchArgs {
            tmux_session: p.tmux_session,
            log_file: p.log_file,
            sandbox_name: p.sandbox_name,
            run_id: p.run_id,
            name: p.name,
            cwd: p.cwd,
            launch_command: p.launch_command,
            resume_command: p.resume_command,
            resume_plan_json: p.resume_plan_json,
            checkpoint_path: p.checkpoint_path,
            checkpoint_format: p.checkpoint_format,
            checkpoint_command: p.checkpoint_command,
            interval_s: p.interval_s,
            max_log_lines: p.max_log_lines,
            webhook_url: p.webhook_url,
            event_command: p.event_command,
            auto_resume: p.auto_resume,
            max_resume_attempts: p.max_resume_attempts,
            metadata_json: p.metadata_json,
            notify_local: p.notify_local,
            alert_after_failures: p.alert_after_failures,
            resume_delay_s: p.resume_delay_s,
            codex_wakeup: false,
            codex_command: String::new(),
            stall_after_s: p.stall_after_s,
        };
        let ensure = p.ensure_watchdog;
        // One Act: the sandbox resolved once, the policy over every command the watch would
        // have the sandbox run (launch, resume, checkpoint, the plan's), one audit line.
        let checked = super::policy::commands_of(
            &[
                ("launch_command", &args.launch_command),
                ("resume_command", &args.resume_command),
                ("checkpoint_command", &args.checkpoint_command),
            ],
            &args.resume_plan_json,
        );
        let named = args.sandbox_name.clone();
        let act = Act {
            sandbox: &named,
            tool: "watch_background_task",
            command: Some(format!("watch {}", args.tmux_session)),
            cwd: (!args.cwd.is_empty()).then(|| args.cwd.clone()),
            checked,
            ..Default::default()
        };
        let r = super::policy::caller(&ctx)
            .act(self.app.pool(), act, async |sandbox| {
                let mut nw = wops::prepare(&args, settings::hooks_allowed(), false)?;
                nw.sandbox_name = sandbox;
                if !nw.cwd.is_empty() {
                    let (job, log, cwd) =
                        (nw.tmux_session.clone(), nw.log_file.clone(), nw.cwd.clone());
                    wops::fill_from_job(&mut nw, &job, &log, &cwd);
                }
                let store = self.app.store();
                let reg = wops::register(&store, &self.app.config().sandboxes, nw, ensure).await?;
                self.followed.watch(reg.watch_id);
                Ok(reg)
            })
            .await;
        reply(r)
    }

    #[tool(description = "Alias of exec_bash_background with watch=true.")]
    async fn exec_bash_background_watch(
        &self,
        Parameters(p): Parameters<ExecWatchParams>,
        ctx: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> ToolResult {
        let q = ExecBackgroundParams {
            command: p.command,
            session_name: p.session_name,
            log_file: p.log_file,
            cwd: p.cwd,
            sandbox_name: p.sandbox_name,
            gpus: 0,
            min_gpu_free_mem_gb: 0.0,
            watch: true,
            ensure_watchdog: p.ensure_watchdog,
            run_id: p.run_id,
            watch_name: p.watch_name,
            resume_command: p.resume_command,
            resume_plan_json: p.resume_plan_json,
            checkpoint_path: p.checkpoint_path,
            checkpoint_format: p.checkpoint_format,
            checkpoint_command: p.checkpoint_command,
            interval_s: p.interval_s,
            max_log_lines: p.max_log_lines,
            webhook_url: p.webhook_url,
            event_command: p.event_command,
            auto_resume: p.auto_resume,
            max_resume_attempts: p.max_resume_attempts,
            metadata_json: p.metadata_json,
            notify_local: p.notify_local,
            alert_after_failures: p.alert_after_failures,
            resume_delay_s: p.resume_delay_s,
            codex_wakeup: p.codex_wakeup,
            codex_command: p.codex_command,
            stall_after_s: p.stall_after_s,
            slurm: p.slurm,
        };
        reply(self.background(&ctx, q, "exec_bash_background_watch").await)
    }

    #[tool(description = "List registered watchdog watches, newest first.")]
    async fn list_background_watches(
        &self,
        Parameters(p): Parameters<ListWatchesParams>,
    ) -> ToolResult {
        typed(wops::list(&self.app.store(), &p.status).await)
    }

    #[tool(description = "Fetch one watchdog watch by id.")]
    async fn get_background_watch(&self, Parameters(p): Parameters<WatchIdParams>) -> ToolResult {
        typed(wops::get(&self.app.store(), p.watch_id).await)
    }

    #[tool(description = "Stored and live progress of one watch: job state, log tail, checkpoint.")]
    async fn get_background_watch_progress(
        &self,
        Parameters(p): Parameters<ProgressParams>,
    ) -> ToolResult {
        let w = match self.watch(p.watch_id).await {
            Ok(w) => w,
            Err(e) => return fail(&e),
        };
        let client = self.app.pool().client(&w.sandbox_name).await;
        typed(
            wops::progress(
                client,
                w,
                p.refresh_live,
                p.log_lines,
                p.checkpoint_max_bytes,
            )
            .await,
        )
    }

    #[tool(description = "Read the latest log tail of one watch's job.")]
    async fn read_background_watch_log(&self, Parameters(p): Parameters<LogParams>) -> ToolResult {
        let r = async {
            let w = self.watch(p.watch_id).await?;
            let c = self.app.pool().client(&w.sandbox_name).await?;
            let mut log = wops::check_task(&c, &w.tmux_session, "", p.last_n_lines).await?;
            log["watch_id"] = serde_json::json!(w.id);
            Ok(wops::LogRead { watch: w, log })
        }
        .await;
        typed(r)
    }

    #[tool(
        description = "Read the checkpoint of one watch (checkpoint_command, else checkpoint_path)."
    )]
    async fn read_background_watch_checkpoint(
        &self,
        Parameters(p): Parameters<CheckpointParams>,
    ) -> ToolResult {
        let r = async {
            let w = self.watch(p.watch_id).await?;
            if w.checkpoint_command_to_run().trim().is_empty()
                && w.checkpoint_path.trim().is_empty()
            {
                return Err(wops::no_checkpoint(w.id));
            }
            let c = self.app.pool().client(&w.sandbox_name).await?;
            wops::read_checkpoint(&c, w, p.max_bytes).await
        }
        .await;
        typed(r)
    }

    #[tool(description = "Stop watching one job (the job keeps running).")]
    async fn cancel_background_watch(
        &self,
        Parameters(p): Parameters<WatchIdParams>,
        ctx: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> ToolResult {
        let r = super::policy::caller(&ctx)
            .act_on(
                self.app.config(),
                "cancel_background_watch",
                format!("watch {}", p.watch_id),
                async || wops::cancel(&self.app.store(), p.watch_id).await,
                |c| c.watch.sandbox_name.clone(),
            )
            .await;
        typed(r)
    }

    #[tool(description = "Watchdog events, newest first, of one watch or all (watch_id=0).")]
    async fn list_background_watch_events(
        &self,
        Parameters(p): Parameters<EventsParams>,
    ) -> ToolResult {
        typed(wops::events(&self.app.store(), p.watch_id, p.limit).await)
    }
}
