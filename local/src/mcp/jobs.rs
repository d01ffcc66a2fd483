//! Background job tools. `exec_bash_background(watch=true)` (the seed's default) also registers
//! a watchdog watch and returns its `watch_id`; every watch parameter is validated before the
//! job starts, so a bad call starts nothing.

use rmcp::{
    RoleServer, handler::server::wrapper::Parameters, schemars, schemars::JsonSchema,
    service::RequestContext, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, reply, wait, with_progress_msg};
use crate::{
    error::RsbError,
    gpus,
    ops::{action::Act, jobs, sandboxes, slurm, watchdog as wops},
    watchdog::settings,
};

/// The `slurm` parameter as a model reads it: one object whose keys and types are listed in
/// its description. The derived schema (a `$defs` entry with each key's `type: [T, "null"]` and
/// doc line) cost 1,000 B of every tools/list, and a typed `properties` map still 560 B, for a
/// parameter only Slurm sandboxes use; the keys are sbatch's own option names. serde still
/// refuses unknown keys and wrong types with a message that names them.
pub(super) fn slurm_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": SLURM_KEYS,
    })
}

/// `name,name: type` groups, `; `-separated (a unit test reads them back against the options).
const SLURM_KEYS: &str = "Slurm only. partition,gres,mem,time,account,qos,constraint: \
    string; gpus,cpus,signal_before_timeout_s: integer; requeue: boolean; sbatch_args: array";

/// `check_background_task(wait_s)` on a Slurm job: re-ask each tick until the state or the
/// log size changes, or `wait` passes. The log is read each tick; Slurm is asked through the
/// shared poller, fresh at first, then at its pace (2 s, doubling while nothing changes: a
/// 110 s wait costs 6 squeue calls, not 55).
async fn slurm_wait(
    client: &crate::client::AgentClient,
    id: &str,
    req: &rsb_protocol::JobStatusRequest,
    cursor: bool,
    wait: std::time::Duration,
) -> Result<serde_json::Value, RsbError> {
    if !wait.is_zero() {
        slurm::poll::poller(client.sandbox()).hurry();
    }
    let first = slurm::jobs::status(client, id, req, cursor, slurm::poll::FRESH).await?;
    let deadline = tokio::time::Instant::now() + wait;
    let key = |v: &serde_json::Value| (v["state"].clone(), v["next_offset"].clone());
    let mut last = first;
    while tokio::time::Instant::now() < deadline && last["running"] == serde_json::json!(true) {
        tokio::time::sleep(slurm::poll::TICK.min(deadline - tokio::time::Instant::now())).await;
        let next = slurm::jobs::status(client, id, req, cursor, std::time::Duration::MAX).await?;
        let changed = key(&next) != key(&last);
        last = next;
        if changed {
            break;
        }
    }
    Ok(last)
}

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

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBackgroundParams {
    /// Run by bash -c.
    pub command: String,
    /// [A-Za-z0-9_-]{1,64}; ""=bg-<time>.
    #[serde(default)]
    pub session_name: String,
    /// ""=.codex_logs/<name>.log under cwd/$HOME.
    #[serde(default)]
    pub log_file: String,
    /// ~ ok; ""=$HOME.
    #[serde(default)]
    pub cwd: String,
    /// ""=active sandbox; auto=best fit
    #[serde(default)]
    pub sandbox_name: String,
    /// Lease N free GPUs.
    #[serde(default)]
    pub gpus: i64,
    /// GiB free per GPU.
    #[serde(default)]
    pub min_gpu_free_mem_gb: f64,
    /// Register a watch.
    #[serde(default = "d_true")]
    pub watch: bool,
    /// Start the watchdog.
    #[serde(default = "d_true")]
    pub ensure_watchdog: bool,
    /// Run label.
    #[serde(default)]
    pub run_id: String,
    /// Watch label.
    #[serde(default)]
    pub watch_name: String,
    /// For auto_resume.
    #[serde(default)]
    pub resume_command: String,
    /// JSON resume plan.
    #[serde(default)]
    pub resume_plan_json: String,
    /// Resumes get it as RSB_CHECKPOINT.
    #[serde(default)]
    pub checkpoint_path: String,
    /// text or json.
    #[serde(default = "d_text")]
    pub checkpoint_format: String,
    /// Prints the checkpoint.
    #[serde(default)]
    pub checkpoint_command: String,
    /// Check period (s).
    #[serde(default = "d_300")]
    pub interval_s: i64,
    /// Log lines per event.
    #[serde(default = "d_80")]
    pub max_log_lines: i64,
    /// Needs RSB_ALLOW_WATCH_HOOKS=1.
    #[serde(default)]
    pub webhook_url: String,
    /// Local command per event.
    #[serde(default)]
    pub event_command: String,
    /// Resume on interruption only.
    #[serde(default)]
    pub auto_resume: bool,
    /// Resume limit.
    #[serde(default = "d_1")]
    pub max_resume_attempts: i64,
    /// JSON object kept.
    #[serde(default)]
    pub metadata_json: String,
    /// Desktop notifications.
    #[serde(default = "d_true")]
    pub notify_local: bool,
    /// Failures before ssh_unreachable.
    #[serde(default = "d_2")]
    pub alert_after_failures: i64,
    /// Wait (s) before resuming.
    #[serde(default = "d_300")]
    pub resume_delay_s: i64,
    /// Needs RSB_ALLOW_WATCH_HOOKS=1.
    #[serde(default)]
    pub codex_wakeup: bool,
    /// codex binary.
    #[serde(default)]
    pub codex_command: String,
    /// Silence (s) before "stalled"; 0=off.
    #[serde(default)]
    pub stall_after_s: i64,
    #[serde(default)]
    #[schemars(schema_with = "slurm_schema")]
    pub slurm: Option<crate::ops::slurm::SlurmOptions>,
}

impl ExecBackgroundParams {
    pub(super) fn watch_args(&self) -> wops::WatchArgs {
        wops::WatchArgs {
            tmux_session: String::new(),
            log_file: String::new(),
            sandbox_name: self.sandbox_name.clone(),
            run_id: self.run_id.clone(),
            name: self.watch_name.clone(),
            cwd: self.cwd.clone(),
            launch_command: self.command.clone(),
            resume_command: self.resume_command.clone(),
            resume_plan_json: self.resume_plan_json.clone(),
            checkpoint_path: self.checkpoint_path.clone(),
            checkpoint_format: self.checkpoint_format.clone(),
            checkpoint_command: self.checkpoint_command.clone(),
            interval_s: self.interval_s,
            max_log_lines: self.max_log_lines,
            webhook_url: self.webhook_url.clone(),
            event_command: self.event_command.clone(),
            auto_resume: self.auto_resume,
            max_resume_attempts: self.max_resume_attempts,
            metadata_json: self.metadata_json.clone(),
            notify_local: self.notify_local,
            alert_after_failures: self.alert_after_failures,
            resume_delay_s: self.resume_delay_s,
            codex_wakeup: self.codex_wakeup,
            codex_command: self.codex_command.clone(),
            stall_after_s: self.stall_after_s,
        }
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckBackgroundParams {
    /// Job name.
    #[serde(default)]
    pub tmux_session: String,
    /// Log to read instead.
    #[serde(default)]
    pub log_file: String,
    /// Or a watch of the job.
    #[serde(default)]
    pub watch_id: i64,
    /// Lines of log_tail.
    #[serde(default = "d_last_n")]
    pub last_n_lines: i64,
    /// Byte cursor (next_offset).
    #[serde(default)]
    pub offset: Option<i64>,
    /// Cursor read cap.
    #[serde(default = "d_cursor_bytes")]
    pub max_bytes: i64,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
    /// ≤110: wait for its end or new output.
    #[serde(default)]
    pub wait_s: f64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KillBackgroundParams {
    /// Job name.
    pub tmux_session: String,
    /// Seconds from SIGTERM to SIGKILL.
    #[serde(default = "d_grace")]
    pub grace_s: f64,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListBackgroundParams {
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
}

#[tool_router(router = jobs_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(destructive_hint = true, open_world_hint = true),
        description = "Run a long command detached; poll check_background_task."
    )]
    async fn exec_bash_background(
        &self,
        Parameters(p): Parameters<ExecBackgroundParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        reply(self.background(&ctx, p, "exec_bash_background").await)
    }

    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "Status and log of a background task."
    )]
    async fn check_background_task(
        &self,
        Parameters(p): Parameters<CheckBackgroundParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let wait = match wait::wait_duration(p.wait_s) {
            Ok(w) => w,
            Err(e) => return fail(&e),
        };
        let (mut session, mut sandbox) = (p.tmux_session.clone(), p.sandbox_name.clone());
        if p.watch_id > 0 {
            // The watch names the job and its sandbox; explicit arguments override (seed).
            let got = wops::get(&self.app.store(), p.watch_id).await;
            match got {
                Ok(w) => {
                    if session.is_empty() {
                        session = w.watch.tmux_session;
                    }
                    if sandbox.is_empty() {
                        sandbox = w.watch.sandbox_name;
                    }
                }
                Err(e) => return fail(&e),
            }
        }
        let req = match jobs::status_request(
            &session,
            &p.log_file,
            p.last_n_lines,
            p.offset,
            p.max_bytes,
        ) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let client = match self.app.pool().client(&sandbox).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        let cursor = p.offset.is_some();
        if self.app.pool().slurm(client.sandbox()).is_some() {
            match slurm::jobs::slurm_id(&client, &req.name).await {
                Ok(Some(id)) => {
                    let mut r = slurm_wait(&client, &id, &req, cursor, wait).await;
                    if let Ok(v) = &mut r
                        && p.watch_id > 0
                    {
                        v["watch_id"] = serde_json::json!(p.watch_id);
                    }
                    return reply(r);
                }
                Ok(None) => {}
                Err(e) => return fail(&e),
            }
        }
        let mut r = if wait.is_zero() {
            client.call(req).await
        } else {
            // Ask once; if it runs, wait for its end or more output (progress meanwhile
            // carries the last line), then answer with what the caller asked for.
            let last = wait::LastLine::default();
            let line = last.clone();
            let waited = async {
                let first = client.call(req.clone()).await?;
                wait::until_change(&client, &req, &first, wait, &last).await?;
                client.call(req).await
            };
            let mut out = None;
            let r = with_progress_msg(&ctx, move |secs| line.message("waiting", secs), async {
                out = Some(waited.await);
                super::ok(())
            })
            .await;
            match out {
                Some(o) => o,
                // Cancelled by the client.
                None => return r,
            }
        }
        .and_then(|r| jobs::status_reply(&session, cursor, &r));
        if let Ok(v) = &mut r
            && p.watch_id > 0
        {
            v["watch_id"] = serde_json::json!(p.watch_id);
        }
        reply(r)
    }

    #[tool(
        annotations(
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        ),
        description = "Stop a background task."
    )]
    async fn kill_background_task(
        &self,
        Parameters(p): Parameters<KillBackgroundParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let act = Act {
            sandbox: &p.sandbox_name,
            tool: "kill_background_task",
            command: Some(p.tmux_session.clone()),
            approval: Some((
                crate::policy::Action::Kill,
                slurm::jobs::kill_what(&p.tmux_session),
            )),
            ..Default::default()
        };
        let app = &self.app;
        let r = super::policy::caller(&ctx)
            .act(app.pool(), act, async |sandbox| {
                let client = app.pool().client(&sandbox).await?;
                slurm::jobs::kill_watched(app, &client, &p.tmux_session, p.grace_s).await
            })
            .await;
        reply(r)
    }

    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "List background tasks."
    )]
    async fn list_background_tasks(
        &self,
        Parameters(p): Parameters<ListBackgroundParams>,
    ) -> ToolResult {
        let client = match self.app.pool().client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        if self.app.pool().slurm(client.sandbox()).is_some() {
            return reply(slurm::jobs::list(&client).await);
        }
        reply(jobs::list(&client).await)
    }
}

impl RsbServer {
    /// `exec_bash_background` and `exec_bash_background_watch`: one [`Act`] (the sandbox
    /// resolved once; the policy over every command the call would have the sandbox run: the
    /// job's, its resume and checkpoint commands, the plan's too; one audit line), then
    /// [`RsbServer::start_background`]; for `sandbox_name: "auto"`, on the sandbox
    /// [`sandboxes::targets`] picks (another one after a Busy answer, with its own act).
    pub(super) async fn background(
        &self,
        ctx: &RequestContext<RoleServer>,
        p: ExecBackgroundParams,
        tool: &str,
    ) -> Result<serde_json::Value, RsbError> {
        let need = gpus::Need::parse(p.gpus, p.min_gpu_free_mem_gb)?;
        let mut placing =
            sandboxes::targets(self.app.pool(), &p.sandbox_name, need.as_ref()).await?;
        for host in placing.hosts.clone() {
            let on = ExecBackgroundParams {
                sandbox_name: host.clone(),
                ..p.clone()
            };
            let r = self.background_on(ctx, on, need, tool).await;
            if !placing.refused(&host, &r) {
                return r;
            }
        }
        Err(placing.none_placed())
    }

    /// [`RsbServer::background`] on the sandbox `p` names.
    async fn background_on(
        &self,
        ctx: &RequestContext<RoleServer>,
        p: ExecBackgroundParams,
        need: Option<gpus::Need>,
        tool: &str,
    ) -> Result<serde_json::Value, RsbError> {
        let checked = super::policy::commands_of(
            &[
                ("command", &p.command),
                ("resume_command", &p.resume_command),
                ("checkpoint_command", &p.checkpoint_command),
            ],
            &p.resume_plan_json,
        );
        let named = p.sandbox_name.clone();
        let act = Act {
            sandbox: &named,
            tool,
            command: Some(p.command.clone()),
            cwd: (!p.cwd.is_empty()).then(|| p.cwd.clone()),
            checked,
            ..Default::default()
        };
        super::policy::caller(ctx)
            .act(self.app.pool(), act, async |sandbox| {
                self.start_background(p, need, sandbox).await
            })
            .await
    }

    /// Start a background job on `sandbox` and, with `watch`, register its watch: validation
    /// first (nothing starts on a bad call), then the launch, then the registration.
    async fn start_background(
        &self,
        p: ExecBackgroundParams,
        need: Option<gpus::Need>,
        sandbox: String,
    ) -> Result<serde_json::Value, RsbError> {
        let hooks = !p.watch || settings::hooks_allowed();
        let prepared = wops::prepare(&p.watch_args(), hooks, true)?;
        let pool = self.app.pool();
        let client = pool.client(&sandbox).await?;
        let launched = slurm::jobs::start_any(
            pool,
            &client,
            p.slurm.as_ref(),
            prepared.resume_plan.contains_key("slurm"),
            &p.command,
            (&p.session_name, &p.log_file, &p.cwd),
            need.as_ref(),
        )
        .await?;
        let v = launched.reply;
        let (name, log) = (
            v["tmux_session"].as_str().unwrap_or_default().to_string(),
            v["log_file"].as_str().unwrap_or_default().to_string(),
        );
        let mut nw = prepared;
        if let Some(options) = &launched.slurm {
            // The resume resubmits with the same options (the plan's own, when it has them).
            nw.resume_plan
                .entry("slurm")
                .or_insert_with(|| serde_json::to_value(options).unwrap_or_default());
        } else if let Some(need) = &need {
            // The resume leases as many GPUs as this run did (its own, when they are free).
            nw.resume_plan
                .entry(gpus::PLAN_KEY)
                .or_insert_with(|| serde_json::to_value(need).unwrap_or_default());
        }
        // The job's resolved cwd (where a relative checkpoint_path lives).
        let cwd = match (p.watch, &launched.slurm) {
            (false, _) => String::new(),
            (true, Some(_)) => slurm::jobs::cwd_of(&client, &name).await,
            (true, None) => match jobs::status_request(&name, "", 1, None, 1) {
                Ok(req) => client
                    .call(req)
                    .await
                    .ok()
                    .and_then(|r| r.info)
                    .map(|i| i.cwd)
                    .unwrap_or_default(),
                Err(_) => String::new(),
            },
        };
        let v = self
            .register_watch(v, &p, nw, sandbox.clone(), &name, &log, &cwd)
            .await?;
        let watch_id = v["watch_id"].as_i64().unwrap_or(0);
        match launched.started_ms {
            // Its end is pushed from the agent's stream, watched or not.
            Some(started_ms) => self.followed.job(&sandbox, &name, started_ms, watch_id),
            // A Slurm job: an unwatched one's end is pushed from the shared poller, a watched
            // one's from its watch.
            None if watch_id == 0 => {
                let id = v["slurm_job_id"].as_str().unwrap_or_default();
                self.followed.slurm_job(&sandbox, &name, id);
            }
            None => {}
        }
        Ok(v)
    }

    /// With `watch`, register the watch of a job just started and add its keys to `v`.
    #[allow(clippy::too_many_arguments)]
    async fn register_watch(
        &self,
        mut v: serde_json::Value,
        p: &ExecBackgroundParams,
        prepared: crate::store::watches::NewWatch,
        sandbox: String,
        name: &str,
        log: &str,
        cwd: &str,
    ) -> Result<serde_json::Value, RsbError> {
        if !p.watch {
            return Ok(v);
        }
        let mut nw = prepared;
        wops::fill_from_job(&mut nw, name, log, cwd);
        nw.sandbox_name = sandbox;
        let configured = &self.app.config().sandboxes;
        let r = wops::register(&self.app.store(), configured, nw, p.ensure_watchdog).await;
        match r {
            Ok(reg) => {
                self.followed.watch(reg.watch_id);
                v["watch_id"] = serde_json::json!(reg.watch_id);
                if let Some(s) = reg.watchdog_setup {
                    v["watchdog_setup"] = serde_json::to_value(s).unwrap_or_default();
                }
                if let Some(w) = reg.watch_warning {
                    v["watch_warning"] = serde_json::json!(w);
                }
            }
            // The job runs; say plainly that it is not watched (the seed swallowed this).
            Err(e) => v["watch_error"] = serde_json::json!(format!("{} ({})", e.message, e.hint)),
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written `slurm` schema names every key of [`crate::ops::slurm::SlurmOptions`] with
    /// the type its derived schema gives it, so a key added to the options appears here or
    /// fails this test.
    #[test]
    fn the_slurm_schema_matches_the_options_it_describes() {
        let derived = serde_json::to_value(schemars::schema_for!(crate::ops::slurm::SlurmOptions))
            .expect("a schema serializes");
        let mut written: Vec<(String, String)> = SLURM_KEYS
            .split_once(". ")
            .expect("a lead sentence")
            .1
            .split("; ")
            .flat_map(|group| {
                let (names, ty) = group.split_once(": ").expect("names: type");
                names
                    .split(',')
                    .map(move |n| (n.trim().to_string(), ty.trim().to_string()))
            })
            .collect();
        written.sort();
        let props = |v: &serde_json::Value| -> Vec<(String, String)> {
            let mut out: Vec<(String, String)> = v["properties"]
                .as_object()
                .expect("properties")
                .iter()
                .map(|(k, p)| {
                    // The derived schema spells an Option as ["T", "null"]; keep the T.
                    let ty = match &p["type"] {
                        serde_json::Value::Array(a) => a
                            .iter()
                            .filter(|t| t.as_str() != Some("null"))
                            .map(|t| t.as_str().unwrap_or_default().to_string())
                            .collect::<Vec<_>>()
                            .join(","),
                        t => t.as_str().unwrap_or_default().to_string(),
                    };
                    (k.clone(), ty)
                })
                .collect();
            out.sort();
            out
        };
        assert_eq!(written, props(&derived));
        let mut generator = schemars::SchemaGenerator::default();
        let schema = serde_json::to_value(slurm_schema(&mut generator)).expect("serializes");
        assert_eq!(schema["description"], SLURM_KEYS);
    }
}
