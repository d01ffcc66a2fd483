//! Background jobs: `exec_bash_background`, `check_background_task`, `kill_background_task`,
//! `list_background_tasks`. The agent supervises the job; this layer applies the seed's
//! defaults and shapes its reply keys.

use rsb_protocol::{
    JobInfo, JobKillRequest, JobListRequest, JobStartRequest, JobState, JobStatusRequest,
    JobStatusResult,
};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::{
    client::AgentClient,
    error::{Result, RsbError},
};

pub const DEFAULT_LAST_N_LINES: i64 = 50;
/// A log tail never exceeds this, keeping the newest bytes (so `EXIT_CODE=` is never cut).
pub const MAX_TAIL_BYTES: u64 = 20_000;
pub const MAX_CURSOR_BYTES: i64 = 1024 * 1024;

/// The seed named unnamed jobs `bg-<unix seconds>`, which collides for two starts in one
/// second; a random suffix keeps the prefix and removes the collision.
pub fn default_session_name() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!(
        "bg-{}-{:04x}",
        now.as_secs(),
        (now.subsec_nanos() ^ std::process::id()) & 0xffff
    )
}

/// `exec_bash_background`'s reply (before any watch fields).
#[derive(Debug, Clone, Serialize)]
pub struct Started {
    pub status: &'static str,
    /// The job's name (the seed's word for it).
    pub tmux_session: String,
    pub log_file: String,
    pub sandbox: String,
    pub runner: String,
    pub pid: u32,
    /// The ended run of this name that the start moved aside: how it ended, its command and
    /// log (its record is kept in the job's history on the host).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous_run: Option<JobSummary>,
    /// Where the earlier run's output is, when there was one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The job runs unconfined although its sandbox asks for confinement (`require = false`
    /// on a host without Landlock): why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confinement: Option<String>,
    /// The UUIDs of the GPUs the job leased (its `CUDA_VISIBLE_DEVICES`), when it asked.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
    /// When the run began (ms, the host's clock): with the name, what tells this run's end
    /// from another's. Not in the tool's reply.
    #[serde(skip)]
    pub started_ms: u64,
}

/// Start `command` as a background job, confined as `confine` says (the client's
/// [`AgentClient::confine`], or what a resumed job was started with), on the GPUs `gpus`
/// offers ([`crate::gpus::ask`]).
pub async fn start(
    client: &AgentClient,
    command: &str,
    (session_name, log_file, cwd): (&str, &str, &str),
    confine: Option<rsb_protocol::Confine>,
    gpus: Option<rsb_protocol::GpuAsk>,
) -> Result<Started> {
    if command.trim().is_empty() {
        return Err(RsbError::invalid(
            "command cannot be empty",
            "pass the bash command to run in the background",
        ));
    }
    let name = if session_name.trim().is_empty() {
        default_session_name()
    } else {
        session_name.to_string()
    };
    // Empty: the agent's default, `.codex_logs/<name>.log` under the cwd, or for a confined
    // job its own directory's log (the usual place may lie outside the write roots).
    let log = log_file.trim().to_string();
    let info = client
        .call(JobStartRequest {
            name: name.clone(),
            command: command.to_string(),
            cwd: (!cwd.trim().is_empty()).then(|| cwd.to_string()),
            log_file: log,
            env: Vec::new(),
            prefer_tmux: true,
            launch_id: None,
            confine,
            gpus,
        })
        .await?;
    let note = info.previous.as_deref().map(|p| previous_note(&info, p));
    let previous_run = info.previous.as_deref().map(|p| JobSummary {
        log_file: Some(p.log_file.clone()),
        command: Some(p.command.clone()),
        ..summary(p)
    });
    Ok(Started {
        status: "started",
        tmux_session: info.name,
        log_file: info.log_file,
        sandbox: client.sandbox().to_string(),
        runner: info.runner,
        pid: info.pid,
        previous_run,
        note,
        confinement: info
            .unconfined
            .map(|why| crate::ops::exec::unconfined_note(&why, "the job runs")),
        gpus: info.gpus,
        started_ms: info.started_ms,
    })
}

/// What a reused name did to the run before: nothing is lost, and this says where it is.
fn previous_note(now: &JobInfo, p: &JobInfo) -> String {
    let ended = match (p.state, p.exit_code, p.signal) {
        (JobState::Lost, _, _) => "was lost".to_string(),
        (_, Some(c), _) => format!("exited with code {c}"),
        (_, None, Some(s)) => format!("was killed by signal {s}"),
        _ => "ended".to_string(),
    };
    let name = crate::term::shown(&p.name);
    if p.log_file == now.log_file {
        format!(
            "the earlier run of '{name}' {ended}; its output is kept in the first {} bytes of the same log, {} (check_background_task with offset=0 reads from there; the tail shows this run)",
            now.log_start,
            crate::term::shown(&now.log_file)
        )
    } else {
        format!(
            "the earlier run of '{name}' {ended}; its output is kept in {}",
            crate::term::shown(&p.log_file)
        )
    }
}

/// How a job stands, as `list_background_tasks` and `kill_background_task` report it.
#[derive(Debug, Clone, Serialize)]
pub struct JobSummary {
    pub tmux_session: String,
    pub running: bool,
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub duration_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// When it ended (ms since the epoch); for `rsb jobs prune`, not in MCP replies.
    #[serde(skip)]
    pub ended_ms: Option<u64>,
    #[serde(skip)]
    pub started_ms: u64,
}

const LOST_NOTE: &str = "the job's supervisor vanished without recording an exit (tmux session killed or host rebooted)";

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn summary(i: &JobInfo) -> JobSummary {
    let end = i.ended_ms.unwrap_or_else(|| now_ms().max(i.started_ms));
    JobSummary {
        tmux_session: i.name.clone(),
        running: i.state == JobState::Running,
        state: state_name(i.state),
        exit_code: i.exit_code,
        signal: i.signal,
        duration_s: end.saturating_sub(i.started_ms) as f64 / 1000.0,
        note: (i.state == JobState::Lost).then_some(LOST_NOTE),
        log_file: None,
        command: None,
        ended_ms: i.ended_ms,
        started_ms: i.started_ms,
    }
}

fn state_name(s: JobState) -> &'static str {
    match s {
        JobState::Running => "running",
        JobState::Exited => "exited",
        JobState::Lost => "lost",
    }
}

fn info_fields(m: &mut Map<String, Value>, i: &JobInfo) {
    if let Value::Object(o) = serde_json::to_value(summary(i)).unwrap_or_default() {
        m.extend(o);
    }
}

/// How the run `i` ended, for [`super::failure::judge`] (`slurm_state`: Slurm's word on it).
pub fn ended<'a>(i: &JobInfo, slurm_state: Option<&'a str>) -> super::failure::Ended<'a> {
    super::failure::Ended {
        exit_code: i.exit_code,
        signal: i.signal,
        slurm_state,
        oom_kill: i.oom_kill,
    }
}

/// Exit code from the last `EXIT_CODE=` line, for logs of jobs rsb has no record of.
fn parse_exit_code(tail: &str) -> Option<i32> {
    tail.lines()
        .rev()
        .find_map(|l| l.strip_prefix("EXIT_CODE="))
        .and_then(|v| v.trim().parse().ok())
}

pub fn status_request(
    name: &str,
    log_file: &str,
    last_n_lines: i64,
    offset: Option<i64>,
    max_bytes: i64,
) -> Result<JobStatusRequest> {
    if name.trim().is_empty() {
        return Err(RsbError::invalid(
            "tmux_session cannot be empty",
            "pass the name exec_bash_background returned",
        ));
    }
    if last_n_lines <= 0 || last_n_lines > 100_000 {
        return Err(RsbError::invalid(
            "last_n_lines must be between 1 and 100000",
            "ask for fewer lines",
        ));
    }
    if let Some(o) = offset
        && o < 0
    {
        return Err(RsbError::invalid(
            "offset must be zero or positive",
            "pass the next_offset of the previous call",
        ));
    }
    if max_bytes <= 0 || max_bytes > MAX_CURSOR_BYTES {
        return Err(RsbError::invalid(
            format!("max_bytes must be between 1 and {MAX_CURSOR_BYTES}"),
            "read in smaller pieces",
        ));
    }
    Ok(JobStatusRequest {
        name: name.to_string(),
        log_file: (!log_file.trim().is_empty()).then(|| log_file.to_string()),
        last_n_lines: last_n_lines as u32,
        offset: offset.map(|o| o as u64),
        max_bytes: if offset.is_some() {
            max_bytes as u64
        } else {
            MAX_TAIL_BYTES
        },
    })
}

pub fn status_reply(name: &str, cursor: bool, r: &JobStatusResult) -> Result<Value> {
    let mut m = Map::new();
    m.insert("tmux_session".into(), json!(name));
    let text = String::from_utf8_lossy(&r.log).into_owned();
    match &r.info {
        Some(i) => {
            info_fields(&mut m, i);
            m.insert("log_file".into(), json!(i.log_file));
        }
        None if r.log_found => {
            // No record, but the caller named a log: report what the log says (seed behaviour).
            m.insert("running".into(), json!(false));
            m.insert("state".into(), json!("unknown"));
            if let Some(c) = parse_exit_code(&text) {
                m.insert("exit_code".into(), json!(c));
            }
        }
        None => {
            return Err(RsbError::new(
                crate::error::Kind::Agent(rsb_protocol::ErrorCode::NotFound),
                format!("no background task named '{name}' (names match exactly)"),
                "list_background_tasks shows the tasks on this sandbox",
            ));
        }
    }
    if cursor {
        m.insert("output".into(), json!(text));
        m.insert("more".into(), json!(r.log_truncated));
        if !r.log_found {
            m.insert(
                "note".into(),
                json!("the log file is gone (deleted or moved): there is no output to read"),
            );
        }
    } else if r.log_found {
        if let Some(i) = &r.info {
            let output = String::from_utf8_lossy(rsb_protocol::job_output(&r.log));
            super::failure::put(&mut m, ended(i, None), &output);
        }
        m.insert("log_tail".into(), json!(text));
    } else {
        m.insert("log_tail".into(), json!("[log file not found]"));
    }
    m.insert("next_offset".into(), json!(r.next_offset));
    Ok(Value::Object(m))
}

pub async fn kill(client: &AgentClient, name: &str, grace_s: f64) -> Result<JobSummary> {
    if name.trim().is_empty() {
        return Err(RsbError::invalid(
            "tmux_session cannot be empty",
            "pass the task's name",
        ));
    }
    if !(0.0..=300.0).contains(&grace_s) {
        return Err(RsbError::invalid(
            "grace_s must be between 0 and 300",
            "SIGKILL follows SIGTERM after grace_s",
        ));
    }
    let i = client
        .call(JobKillRequest {
            name: name.into(),
            grace_ms: (grace_s * 1000.0) as u64,
        })
        .await
        .map_err(|e| match e.kind {
            // Not a path: the job's name.
            crate::error::Kind::Agent(rsb_protocol::ErrorCode::NotFound) => RsbError {
                hint: "names are exact; list_background_tasks (rsb jobs list) shows this sandbox's jobs".into(),
                ..e
            },
            _ => e,
        })?;
    Ok(summary(&i))
}

#[derive(Debug, Clone, Serialize)]
pub struct JobList {
    pub tasks: Vec<JobSummary>,
}

pub async fn list(client: &AgentClient) -> Result<JobList> {
    let jobs = client.call(JobListRequest).await?;
    Ok(JobList {
        tasks: jobs
            .iter()
            .map(|i| JobSummary {
                log_file: Some(i.log_file.clone()),
                command: Some(i.command.chars().take(120).collect()),
                ..summary(i)
            })
            .collect(),
    })
}
