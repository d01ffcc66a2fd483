//! The watchdog as a user sees it: registration (the seed's checks, done before any job is
//! launched), the status payload, and the live reads of the advanced tools. Results are typed
//! and serialise to the seed's reply keys, plus rsb's additions; the MCP tools and the CLI
//! share them.

use std::{collections::BTreeMap, path::Path};

use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::{
    client::AgentClient,
    config::SandboxConfig,
    error::{Result, RsbError},
    ops::{exec, fs, jobs},
    store::{
        Store,
        events::{self, WatchEvent},
        sandboxes,
        watch_model::Watch,
        watches::{self, NewWatch},
    },
    watchdog::{
        HEARTBEAT_STALE_S, alerts,
        service::{self, DaemonInfo, EnsureReport, InstallInfo, Removal, ServiceStatus},
        settings,
    },
};

/// Work that runs the service manager (systemctl, launchctl) or waits for the daemon's lock:
/// on the blocking pool, never a runtime thread.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RsbError::internal(format!("the watchdog service task failed: {e}")))?
}

/// The daemon of the store's state dir: its heartbeat row, read through the store, and its
/// lock.
pub async fn daemon_info(store: &Store) -> Result<DaemonInfo> {
    let hb = store.call(|c| watches::meta_get(c, "heartbeat")).await?;
    let dir = store.state_dir().to_path_buf();
    off_runtime(move || Ok(service::daemon_info(hb, &dir))).await
}

/// [`service::ensure`] for the store's state dir, off the runtime.
pub async fn ensure(store: &Store) -> Result<EnsureReport> {
    let info = daemon_info(store).await?;
    let dir = store.state_dir().to_path_buf();
    off_runtime(move || service::ensure(info, &dir)).await
}

/// [`service::restart`] (`rsb watchdog restart`), off the runtime.
pub async fn restart(state_dir: &Path) -> Result<EnsureReport> {
    let dir = state_dir.to_path_buf();
    off_runtime(move || service::restart(&dir)).await
}

// ---------------------------------------------------------------------------------------------
// Status

#[derive(Debug, Clone, Serialize)]
pub struct Paths {
    /// The user's config file (its `[watchdog]` table); the seed's key.
    pub config_path: String,
    pub db_path: String,
    pub state_dir: String,
    pub events_dir: String,
    pub log_file: String,
}

/// `get_watchdog_status`: the seed's keys (`paths`, `launchd`, `heartbeat`, `heartbeat_stale`,
/// `watch_counts`), plus `daemon` (pid, heartbeat age, mode) and `service`.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub paths: Paths,
    pub launchd: Value,
    pub heartbeat: Option<Value>,
    pub heartbeat_stale: bool,
    pub watch_counts: BTreeMap<String, i64>,
    pub daemon: DaemonInfo,
    pub service: ServiceStatus,
}

/// The store's rows (heartbeat, watch counts) through the store; the service and the daemon's
/// lock off the runtime.
pub async fn status(store: &Store) -> Result<Status> {
    let (hb, counts) = store
        .call(|c| Ok((watches::meta_get(c, "heartbeat")?, watches::counts(c)?)))
        .await?;
    let state_dir = store.state_dir().to_path_buf();
    off_runtime(move || Ok(status_of(hb, counts, &state_dir))).await
}

fn status_of(
    hb: Option<(Value, i64)>,
    watch_counts: BTreeMap<String, i64>,
    state_dir: &Path,
) -> Status {
    let now = crate::store::now_s();
    let stale = hb
        .as_ref()
        .and_then(|(v, _)| v["ts"].as_i64())
        .is_none_or(|ts| now - ts > HEARTBEAT_STALE_S);
    Status {
        paths: Paths {
            config_path: crate::config::config_file_path().display().to_string(),
            db_path: crate::store::db_path(state_dir).display().to_string(),
            state_dir: state_dir.display().to_string(),
            events_dir: events::dir(state_dir).display().to_string(),
            log_file: state_dir.join(crate::store::layout::DAEMON_LOG).display().to_string(),
        },
        launchd: service::launchd_status(),
        daemon: service::daemon_info(hb.clone(), state_dir),
        heartbeat: hb.map(|(value, updated_ts)| {
            json!({"key": "heartbeat", "value": value, "updated_ts": updated_ts})
        }),
        heartbeat_stale: stale,
        watch_counts,
        service: service::service_status(state_dir),
    }
}

/// The installed user service (systemd unit or launchd plist), read from its file alone: for
/// `rsb doctor`, which needs no store for it.
pub fn service(state_dir: &Path) -> service::ServiceStatus {
    service::service_status(state_dir)
}

// ---------------------------------------------------------------------------------------------
// Registration

/// The watch parameters of `watch_background_task` / `exec_bash_background(watch=true)`.
#[derive(Debug, Clone, Default)]
pub struct WatchArgs {
    pub tmux_session: String,
    pub log_file: String,
    pub sandbox_name: String,
    pub run_id: String,
    pub name: String,
    pub cwd: String,
    pub launch_command: String,
    pub resume_command: String,
    pub resume_plan_json: String,
    pub checkpoint_path: String,
    pub checkpoint_format: String,
    pub checkpoint_command: String,
    pub interval_s: i64,
    pub max_log_lines: i64,
    pub webhook_url: String,
    pub event_command: String,
    pub auto_resume: bool,
    pub max_resume_attempts: i64,
    pub metadata_json: String,
    pub notify_local: bool,
    pub alert_after_failures: i64,
    pub resume_delay_s: i64,
    pub codex_wakeup: bool,
    pub codex_command: String,
    pub stall_after_s: i64,
}

fn json_object(v: &str, label: &str) -> Result<Map<String, Value>> {
    if v.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str::<Value>(v) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(RsbError::invalid(
            format!("{label} must decode to a JSON object"),
            "pass {\"key\": ...}",
        )),
        Err(e) => Err(RsbError::invalid(
            format!("{label} is not valid JSON: {e}"),
            "pass a JSON object",
        )),
    }
}

fn plan_str<'a>(plan: &'a Map<String, Value>, k: &str) -> &'a str {
    plan.get(k).and_then(Value::as_str).unwrap_or("")
}

/// Every check of the seed's registration, plus rsb's hook gate, before anything starts.
/// `launching`: the job is about to be started by this call (its name and log come later).
pub fn prepare(a: &WatchArgs, hooks_allowed: bool, launching: bool) -> Result<NewWatch> {
    if !launching {
        if a.tmux_session.trim().is_empty() {
            return Err(RsbError::invalid(
                "tmux_session cannot be empty",
                "pass the job name exec_bash_background returned",
            ));
        }
        if a.log_file.trim().is_empty() {
            return Err(RsbError::invalid(
                "log_file cannot be empty",
                "pass the log_file exec_bash_background returned",
            ));
        }
    }
    let pos = |v: i64, n: &str| {
        if v > 0 {
            Ok(())
        } else {
            Err(RsbError::invalid(
                format!("{n} must be positive"),
                "pass a value >= 1",
            ))
        }
    };
    let nonneg = |v: i64, n: &str| {
        if v >= 0 {
            Ok(())
        } else {
            Err(RsbError::invalid(
                format!("{n} must be zero or positive"),
                "pass a value >= 0",
            ))
        }
    };
    pos(a.interval_s, "interval_s")?;
    pos(a.max_log_lines, "max_log_lines")?;
    nonneg(a.max_resume_attempts, "max_resume_attempts")?;
    pos(a.alert_after_failures, "alert_after_failures")?;
    nonneg(a.resume_delay_s, "resume_delay_s")?;
    nonneg(a.stall_after_s, "stall_after_s")?;
    let metadata = json_object(&a.metadata_json, "metadata_json")?;
    let mut plan = json_object(&a.resume_plan_json, "resume_plan_json")?;

    let wants_hooks = !a.event_command.trim().is_empty()
        || !a.webhook_url.trim().is_empty()
        || a.codex_wakeup
        || !a.codex_command.trim().is_empty();
    if wants_hooks && !hooks_allowed {
        let which: Vec<&str> = [
            ("event_command", !a.event_command.trim().is_empty()),
            ("webhook_url", !a.webhook_url.trim().is_empty()),
            ("codex_wakeup", a.codex_wakeup),
            ("codex_command", !a.codex_command.trim().is_empty()),
        ]
        .into_iter()
        .filter_map(|(n, set)| set.then_some(n))
        .collect();
        return Err(RsbError::invalid(
            format!(
                "{} run commands or send data on this machine, so a tool call may not set them \
                 unless the server was started with {}=1",
                which.join(", "),
                settings::ALLOW_HOOKS_VAR
            ),
            "put webhook_url / event_command in the [watchdog] table of your rsb config file, \
             or start rsb with RSB_ALLOW_WATCH_HOOKS=1",
        ));
    }
    if !a.webhook_url.trim().is_empty() {
        alerts::check_webhook_url(&a.webhook_url)
            .map_err(|e| RsbError::invalid(e, "pass an http:// URL"))?;
    }
    let event_command = if a.event_command.trim().is_empty() && a.codex_wakeup {
        alerts::codex_event_command(&a.codex_command)
    } else {
        a.event_command.clone()
    };

    // The seed's resume plan: explicit values override the plan's.
    let set = |plan: &mut Map<String, Value>, k: &str, v: &str, overwrite: bool| {
        if !v.trim().is_empty() && (overwrite || !plan.contains_key(k)) {
            plan.insert(k.into(), json!(v));
        }
    };
    set(&mut plan, "launch_command", &a.launch_command, false);
    set(&mut plan, "cwd", &a.cwd, false);
    set(&mut plan, "resume_command", &a.resume_command, true);
    set(&mut plan, "checkpoint_path", &a.checkpoint_path, true);
    set(&mut plan, "checkpoint_command", &a.checkpoint_command, true);
    let fmt = if a.checkpoint_format.trim().is_empty() {
        plan_str(&plan, "checkpoint_format").to_string()
    } else {
        a.checkpoint_format.trim().to_string()
    };
    let fmt = if fmt.is_empty() { "text".into() } else { fmt };
    plan.insert("checkpoint_format".into(), json!(fmt));
    if a.auto_resume {
        if plan_str(&plan, "resume_command").trim().is_empty() {
            return Err(RsbError::invalid(
                "auto_resume=True requires resume_command or resume_plan_json.resume_command",
                "pass the command that resumes the job from its checkpoint",
            ));
        }
        if plan_str(&plan, "checkpoint_path").trim().is_empty()
            && plan_str(&plan, "checkpoint_command").trim().is_empty()
        {
            return Err(RsbError::invalid(
                "auto_resume=True requires checkpoint_path or resume_plan_json.checkpoint_path",
                "pass checkpoint_path (or checkpoint_command) so the resume can read where it stopped",
            ));
        }
    }
    if !launching {
        set(&mut plan, "tmux_session", &a.tmux_session, false);
    }
    Ok(NewWatch {
        run_id: a.run_id.trim().to_string(),
        name: a.name.clone(),
        sandbox_name: a.sandbox_name.clone(),
        // Set by `register`, which knows the server's definition of the sandbox.
        sandbox_fp: String::new(),
        tmux_session: a.tmux_session.trim().to_string(),
        log_file: a.log_file.trim().to_string(),
        cwd: a.cwd.clone(),
        launch_command: a.launch_command.clone(),
        resume_command: plan_str(&plan, "resume_command").to_string(),
        checkpoint_path: plan_str(&plan, "checkpoint_path").to_string(),
        checkpoint_format: fmt,
        checkpoint_command: plan_str(&plan, "checkpoint_command").to_string(),
        resume_plan: plan,
        interval_s: a.interval_s,
        max_log_lines: a.max_log_lines,
        webhook_url: a.webhook_url.trim().to_string(),
        event_command,
        auto_resume: a.auto_resume,
        max_resume_attempts: a.max_resume_attempts,
        metadata,
        notify_local: a.notify_local,
        alert_after_failures: a.alert_after_failures,
        resume_delay_s: a.resume_delay_s,
        stall_after_s: a.stall_after_s,
    })
}

/// After the launch: the job's real name, log and cwd; a relative checkpoint path is taken
/// relative to the job's cwd (where the job writes it).
pub fn fill_from_job(w: &mut NewWatch, name: &str, log_file: &str, cwd: &str) {
    w.tmux_session = name.to_string();
    w.log_file = log_file.to_string();
    if !cwd.is_empty() {
        w.cwd = cwd.to_string();
    }
    if w.run_id.is_empty() {
        w.run_id = name.to_string();
    }
    w.resume_plan
        .entry("tmux_session")
        .or_insert_with(|| json!(name));
    if !w.cwd.is_empty() {
        w.resume_plan.insert("cwd".into(), json!(w.cwd));
    }
    let cp = w.checkpoint_path.trim();
    if !cp.is_empty() && !cp.starts_with('/') && !cp.starts_with('~') && !w.cwd.is_empty() {
        w.checkpoint_path = Path::new(&w.cwd).join(cp).display().to_string();
        w.resume_plan
            .insert("checkpoint_path".into(), json!(w.checkpoint_path));
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PersistedInfo {
    pub config_path: String,
    pub sandbox_count: usize,
}

#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Setup {
    Ensured(EnsureReport),
    Failed { warning: String },
}

/// `watch_background_task`'s reply: the seed's keys, plus `watch_warning` when the daemon will
/// not be able to reach the sandbox without a stored secret.
#[derive(Debug, Clone, Serialize)]
pub struct Registered {
    pub watch: Watch,
    pub watch_id: i64,
    pub watch_query_id: i64,
    pub persisted_sandboxes: PersistedInfo,
    pub watchdog_setup: Option<Setup>,
    pub status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watch_warning: Option<String>,
}

/// Persist the server's sandbox definitions (no secrets unless opted in), insert the watch and
/// (with `ensure`) make sure a daemon runs.
pub async fn register(
    store: &Store,
    configured: &[SandboxConfig],
    mut w: NewWatch,
    ensure_daemon: bool,
) -> Result<Registered> {
    w.sandbox_fp = configured
        .iter()
        .find(|s| s.name == w.sandbox_name)
        .map(sandboxes::fingerprint)
        .unwrap_or_default();
    let (dir, configured) = (store.state_dir().to_path_buf(), configured.to_vec());
    let (count, warning, watch) = store
        .call(move |c| {
            let count = sandboxes::persist(c, &dir, &configured, settings::store_passwords())?;
            let warning =
                sandboxes::resolve(c, &dir, &w.sandbox_fp, &w.sandbox_name)?.and_then(|r| r.err());
            Ok((count, warning, watches::insert(c, &w)?))
        })
        .await?;
    let setup = match ensure_daemon {
        true => Some(match ensure(store).await {
            Ok(r) => Setup::Ensured(r),
            Err(e) => Setup::Failed {
                warning: format!("{} ({})", e.message, e.hint),
            },
        }),
        false => None,
    };
    Ok(Registered {
        watch_id: watch.id,
        watch_query_id: watch.id,
        watch,
        persisted_sandboxes: PersistedInfo {
            config_path: crate::store::db_path(store.state_dir())
                .display()
                .to_string(),
            sandbox_count: count,
        },
        watchdog_setup: setup,
        status: status(store).await?,
        watch_warning: warning,
    })
}

// ---------------------------------------------------------------------------------------------
// Queries

#[derive(Debug, Clone, Serialize)]
pub struct WatchList {
    pub watches: Vec<Watch>,
    pub status: Status,
}

#[derive(Debug, Clone, Serialize)]
pub struct OneWatch {
    pub watch: Watch,
}

#[derive(Debug, Clone, Serialize)]
pub struct Cancelled {
    pub watch: Watch,
    pub status: Status,
}

#[derive(Debug, Clone, Serialize)]
pub struct Events {
    pub events: Vec<WatchEvent>,
}

pub async fn list(store: &Store, status_filter: &str) -> Result<WatchList> {
    let filter = status_filter.to_string();
    Ok(WatchList {
        watches: store.call(move |c| watches::list(c, &filter)).await?,
        status: status(store).await?,
    })
}

pub async fn get(store: &crate::store::Store, id: i64) -> Result<OneWatch> {
    let watch = store.call(move |c| watches::require(c, id)).await?;
    Ok(OneWatch { watch })
}

/// Stop watching `session` on `sandbox` (a deliberate kill is not an interruption); the ids of
/// the watches cancelled. No store yet means no watches: none is created to say so.
pub async fn cancel_for_job(
    store: &crate::store::Store,
    sandbox: &str,
    session: &str,
) -> Result<Vec<i64>> {
    if !crate::store::db_path(store.state_dir()).exists() {
        return Ok(Vec::new());
    }
    let (sandbox, session) = (sandbox.to_string(), session.to_string());
    store
        .call(move |c| watches::cancel_for_job(c, &sandbox, &session))
        .await
}

pub async fn cancel(store: &Store, id: i64) -> Result<Cancelled> {
    let watch = store.call(move |c| watches::cancel(c, id)).await?;
    Ok(Cancelled {
        watch,
        status: status(store).await?,
    })
}

pub async fn events(store: &Store, watch_id: i64, limit: i64) -> Result<Events> {
    if limit <= 0 {
        return Err(RsbError::invalid(
            "limit must be positive",
            "pass a value >= 1",
        ));
    }
    let limit = limit.min(MAX_LISTED_EVENTS);
    let mut events = store
        .call(move |c| events::list(c, watch_id, limit))
        .await?;
    for e in &mut events {
        compact_payload(&mut e.payload);
    }
    Ok(Events { events })
}

/// Most events one listing returns.
pub const MAX_LISTED_EVENTS: i64 = 200;
/// Longest text kept per payload field in a listing (its end: logs and checkpoints end there).
pub const LISTED_TEXT_CHARS: usize = 1000;

/// A listing's copy of an event payload: each event carried the whole watch row (log tail and
/// checkpoint up to 20,000 characters each) twice over, so `limit=20` came to tens of KB of a
/// model's context. The listing keeps the watch's identity and state and the last
/// [`LISTED_TEXT_CHARS`] of each text; the full event stays in `events/event-<id>.json`.
fn compact_payload(p: &mut Value) {
    const WATCH_KEYS: [&str; 8] = [
        "id",
        "status",
        "last_state",
        "sandbox_name",
        "tmux_session",
        "resume_attempts",
        "max_resume_attempts",
        "last_exit_code",
    ];
    if let Some(Value::Object(w)) = p.get_mut("watch") {
        w.retain(|k, _| WATCH_KEYS.contains(&k.as_str()));
    }
    if let Value::Object(m) = p {
        for v in m.values_mut() {
            if let Value::String(s) = v
                && s.chars().count() > LISTED_TEXT_CHARS
            {
                let tail = crate::watchdog::clip_tail(s, LISTED_TEXT_CHARS);
                *s = format!("...{tail}");
            }
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct InstallReply {
    pub install: InstallInfo,
    pub persisted_sandboxes: Option<PersistedInfo>,
    pub status: Status,
}

#[derive(Debug, Clone, Serialize)]
pub struct UninstallReply {
    pub removal: Removal,
    pub status: Status,
}

/// Install (and start) the platform service; the sandboxes are persisted only after the
/// platform check passed (the seed wrote credentials first, then failed).
pub async fn install(
    store: &Store,
    start: bool,
    persist: Option<&[SandboxConfig]>,
) -> Result<InstallReply> {
    let dir = store.state_dir().to_path_buf();
    let install = off_runtime(move || service::install(&dir, start)).await?;
    let persisted = match persist {
        Some(s) => {
            let (dir, s) = (store.state_dir().to_path_buf(), s.to_vec());
            let count = store
                .call(move |c| sandboxes::persist(c, &dir, &s, settings::store_passwords()))
                .await?;
            Some(PersistedInfo {
                config_path: crate::store::db_path(store.state_dir())
                    .display()
                    .to_string(),
                sandbox_count: count,
            })
        }
        None => None,
    };
    Ok(InstallReply {
        install,
        persisted_sandboxes: persisted,
        status: status(store).await?,
    })
}

pub async fn uninstall(store: &Store) -> Result<UninstallReply> {
    let removal = off_runtime(service::uninstall).await?;
    Ok(UninstallReply {
        removal,
        status: status(store).await?,
    })
}

// ---------------------------------------------------------------------------------------------
// Live reads (the MCP server's own connection to the watch's sandbox)

#[derive(Debug, Clone, Serialize)]
pub struct Checkpoint {
    pub raw: String,
    pub format: String,
    pub parsed: Option<Value>,
}

pub fn checkpoint_of(raw: String, format: &str) -> Checkpoint {
    let parsed = (format.eq_ignore_ascii_case("json") && !raw.trim().is_empty())
        .then(|| serde_json::from_str(&raw).ok())
        .flatten();
    Checkpoint {
        raw,
        format: format.to_string(),
        parsed,
    }
}

/// `check_background_task` for a watch: its job, its sandbox; explicit values override.
pub async fn check_task(
    c: &AgentClient,
    job: &str,
    log_file: &str,
    last_n_lines: i64,
) -> Result<Value> {
    let req = jobs::status_request(job, log_file, last_n_lines, None, 1)?;
    let r = c.call(req).await?;
    jobs::status_reply(job, false, &r)
}

#[derive(Debug, Clone, Serialize)]
pub struct CheckpointRead {
    pub watch: Watch,
    pub checkpoint: Checkpoint,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command_result: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_result: Option<Value>,
}

pub fn no_checkpoint(id: i64) -> RsbError {
    RsbError::invalid(
        format!("Watch {id} does not define checkpoint_path or checkpoint_command"),
        "register the watch with checkpoint_path or checkpoint_command",
    )
}

/// The seed's live checkpoint read: the command (in the watch's cwd, 30 s), else the file.
pub async fn read_checkpoint(c: &AgentClient, w: Watch, max_bytes: i64) -> Result<CheckpointRead> {
    if max_bytes <= 0 {
        return Err(RsbError::invalid(
            "max_bytes must be positive",
            "pass a value >= 1",
        ));
    }
    let cmd = w.checkpoint_command_to_run();
    if !cmd.trim().is_empty() {
        let cwd = (!w.cwd.is_empty()).then_some(w.cwd.as_str());
        let mut req = exec::build_request(&cmd, cwd, 30, max_bytes.min(exec::MAX_OUTPUT_CHARS))?;
        // The user's (or model's) command, confined as the job is.
        req.confine = c.confine().cloned();
        let r = c.call(req).await?;
        let reply = exec::confined_reply(&r, 30, c.confine());
        let raw = reply.stdout.clone().unwrap_or_default();
        let reply = serde_json::to_value(reply).unwrap_or_default();
        return Ok(CheckpointRead {
            checkpoint: checkpoint_of(raw, &w.checkpoint_format),
            watch: w,
            command_result: Some(reply),
            file_result: None,
        });
    }
    if w.checkpoint_path.trim().is_empty() {
        return Err(no_checkpoint(w.id));
    }
    let req = fs::read_request(&w.checkpoint_path, max_bytes, 0, 0)?;
    let r = c.call(req).await?;
    let reply = fs::read_reply(&r, false, false);
    let raw = reply.content.clone();
    let reply = serde_json::to_value(reply).unwrap_or_default();
    Ok(CheckpointRead {
        checkpoint: checkpoint_of(raw, &w.checkpoint_format),
        watch: w,
        command_result: None,
        file_result: Some(reply),
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct Stored {
    pub last_state: String,
    pub last_summary: String,
    pub last_error: String,
    pub last_log_tail: String,
    pub checkpoint: Checkpoint,
}

#[derive(Debug, Clone, Serialize)]
pub struct Live {
    pub task: Option<Value>,
    pub checkpoint: Option<Checkpoint>,
    pub errors: Vec<Value>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub watch: Watch,
    pub stored: Stored,
    pub live: Live,
}

/// `get_background_watch_progress`. `client` is `Err` when the sandbox is unreachable: the
/// stored part still answers, and the error lands in `live.errors`.
pub async fn progress(
    client: Result<AgentClient>,
    w: Watch,
    refresh_live: bool,
    log_lines: i64,
    checkpoint_max_bytes: i64,
) -> Result<Progress> {
    if log_lines <= 0 {
        return Err(RsbError::invalid(
            "log_lines must be positive",
            "pass a value >= 1",
        ));
    }
    let stored = Stored {
        last_state: w.last_state.clone(),
        last_summary: w.last_summary.clone(),
        last_error: w.last_error.clone(),
        last_log_tail: w.last_log_tail.clone(),
        checkpoint: checkpoint_of(w.last_checkpoint_text.clone(), &w.checkpoint_format),
    };
    let mut live = Live {
        task: None,
        checkpoint: None,
        errors: Vec::new(),
    };
    let has_checkpoint =
        !w.checkpoint_command_to_run().trim().is_empty() || !w.checkpoint_path.trim().is_empty();
    match client {
        Err(e) => {
            if refresh_live {
                live.errors
                    .push(json!({"kind": "task", "error": e.message}));
            }
            if has_checkpoint {
                live.errors
                    .push(json!({"kind": "checkpoint", "error": e.message}));
            }
        }
        Ok(c) => {
            if refresh_live {
                match check_task(&c, &w.tmux_session, "", log_lines).await {
                    Ok(v) => live.task = Some(v),
                    Err(e) => live
                        .errors
                        .push(json!({"kind": "task", "error": e.message})),
                }
            }
            if has_checkpoint {
                match read_checkpoint(&c, w.clone(), checkpoint_max_bytes).await {
                    Ok(r) => live.checkpoint = Some(r.checkpoint),
                    Err(e) => live
                        .errors
                        .push(json!({"kind": "checkpoint", "error": e.message})),
                }
            }
        }
    }
    Ok(Progress {
        watch: w,
        stored,
        live,
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct LogRead {
    pub watch: Watch,
    pub log: Value,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> WatchArgs {
        WatchArgs {
            tmux_session: "train".into(),
            log_file: "/h/t.log".into(),
            sandbox_name: "s".into(),
            checkpoint_format: "text".into(),
            interval_s: 300,
            max_log_lines: 80,
            max_resume_attempts: 1,
            notify_local: true,
            alert_after_failures: 2,
            resume_delay_s: 300,
            ..Default::default()
        }
    }

    #[test]
    fn the_seeds_checks_and_wording() {
        let e = |a: WatchArgs| prepare(&a, false, false).unwrap_err().message;
        assert_eq!(
            e(WatchArgs {
                tmux_session: "".into(),
                ..args()
            }),
            "tmux_session cannot be empty"
        );
        assert_eq!(
            e(WatchArgs {
                interval_s: 0,
                ..args()
            }),
            "interval_s must be positive"
        );
        assert_eq!(
            e(WatchArgs {
                max_resume_attempts: -1,
                ..args()
            }),
            "max_resume_attempts must be zero or positive"
        );
        assert_eq!(
            e(WatchArgs {
                metadata_json: "[1]".into(),
                ..args()
            }),
            "metadata_json must decode to a JSON object"
        );
        assert_eq!(
            e(WatchArgs {
                auto_resume: true,
                resume_command: "x".into(),
                ..args()
            }),
            "auto_resume=True requires checkpoint_path or resume_plan_json.checkpoint_path"
        );
        assert_eq!(
            e(WatchArgs {
                auto_resume: true,
                ..args()
            }),
            "auto_resume=True requires resume_command or resume_plan_json.resume_command"
        );
        // The plan satisfies both.
        let w = prepare(
            &WatchArgs {
                auto_resume: true,
                resume_plan_json: r#"{"resume_command": "go", "checkpoint_path": "ck"}"#.into(),
                ..args()
            },
            false,
            false,
        )
        .unwrap();
        assert_eq!(
            (w.resume_command.as_str(), w.checkpoint_path.as_str()),
            ("go", "ck")
        );
        assert_eq!(w.resume_plan["tmux_session"], "train");
    }

    #[test]
    fn hooks_from_a_tool_call_need_the_opt_in() {
        for a in [
            WatchArgs {
                event_command: "touch /tmp/x".into(),
                ..args()
            },
            WatchArgs {
                webhook_url: "http://127.0.0.1:1/".into(),
                ..args()
            },
            WatchArgs {
                codex_wakeup: true,
                ..args()
            },
        ] {
            let e = prepare(&a, false, false).unwrap_err();
            assert!(
                e.message.contains("RSB_ALLOW_WATCH_HOOKS=1"),
                "{}",
                e.message
            );
            assert!(prepare(&a, true, false).is_ok());
        }
        let https = WatchArgs {
            webhook_url: "https://x/".into(),
            ..args()
        };
        assert!(prepare(&https, true, false).is_ok());
        let e = prepare(
            &WatchArgs {
                webhook_url: "ftp://x/".into(),
                ..args()
            },
            true,
            false,
        )
        .unwrap_err();
        assert!(e.message.contains("http:// or https://"), "{}", e.message);
        let w = prepare(
            &WatchArgs {
                codex_wakeup: true,
                ..args()
            },
            true,
            false,
        )
        .unwrap();
        assert!(w.event_command.contains("'codex' exec"));
    }

    #[test]
    fn a_relative_checkpoint_is_the_jobs() {
        let mut w = prepare(
            &WatchArgs {
                checkpoint_path: "ck.json".into(),
                ..args()
            },
            false,
            true,
        )
        .unwrap();
        fill_from_job(&mut w, "bg-1", "/h/p/.codex_logs/bg-1.log", "/h/p");
        assert_eq!(w.checkpoint_path, "/h/p/ck.json");
        assert_eq!(w.run_id, "bg-1");
    }
}
