//! Background jobs on a Slurm sandbox: the job tools' submit, status, kill and list, with the
//! same names, parameters and reply keys as on any host, plus `scheduler`, `slurm_job_id`,
//! `slurm_state`, `pending_reason`, `node` and `reason`.
//!
//! State: the wrapper's record (written on the compute node, read by the login node's agent)
//! decides the exit code; squeue decides pending / running / why it ended. A job Slurm no
//! longer lists (purged after MinJobAge) is still reported from the record.

use std::time::{SystemTime, UNIX_EPOCH};

use rsb_agent::jobs::record::Record;
use rsb_protocol::{JobState, JobStatusRequest, ReadFileRequest};
use serde_json::{Map, Value, json};

use super::{
    SlurmOptions,
    poll::{self, Row, Seen},
    remote,
};
use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
    ops::jobs as ojobs,
};

const JOBS_ROOT: &str = ".cache/rsb/jobs";
/// How long kill waits for Slurm to report the job ended (KillWait is 30 s by default).
const KILL_VERIFY_S: u64 = 40;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn job_dir(home: &str, name: &str) -> String {
    format!("{}/{JOBS_ROOT}/{name}", home.trim_end_matches('/'))
}

/// `~`, `~/x` and relative paths the way the agent resolves a job's cwd and log.
fn resolve(home: &str, base: &str, p: &str) -> String {
    let p = p.trim();
    if p == "~" {
        home.to_string()
    } else if let Some(rest) = p.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{}/{p}", base.trim_end_matches('/'))
    }
}

fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(RsbError::invalid(
            format!("session_name {name:?} must match [A-Za-z0-9_-]{{1,64}}"),
            "pick a name of letters, digits, '_' and '-'",
        ))
    }
}

/// Submit `command` as a Slurm batch job. The spec (with a fresh launch id) is written before
/// sbatch runs; when the reply to the submit is lost, the job is looked up by its name and
/// the launch id in its comment, and never submitted a second time.
#[allow(clippy::too_many_arguments)]
pub async fn start(
    client: &AgentClient,
    agent_path: &str,
    defaults: &SlurmOptions,
    job: &SlurmOptions,
    command: &str,
    session_name: &str,
    log_file: &str,
    cwd: &str,
) -> Result<Value> {
    if command.trim().is_empty() {
        return Err(RsbError::invalid(
            "command cannot be empty",
            "pass the bash command to run in the background",
        ));
    }
    if command.contains('\0') {
        return Err(RsbError::invalid(
            "command contains a NUL byte",
            "remove it",
        ));
    }
    let opts = job.over(defaults);
    opts.check()?;
    let name = if session_name.trim().is_empty() {
        ojobs::default_session_name()
    } else {
        session_name.to_string()
    };
    validate_name(&name)?;
    let home = client.hello().home.clone();
    let cwd = if cwd.trim().is_empty() {
        home.clone()
    } else {
        resolve(&home, &home, cwd)
    };
    let log = if log_file.trim().is_empty() {
        format!("{cwd}/.codex_logs/{name}.log")
    } else {
        resolve(&home, &cwd, log_file)
    };
    let dir = job_dir(&home, &name);
    let root = format!("{}/{JOBS_ROOT}", home.trim_end_matches('/'));
    let launch = format!("{}-{}-slurm", now_ms(), std::process::id());
    let mut spec = Record::new();
    spec.set("name", &name);
    spec.set("command", command);
    spec.set("cwd", &cwd);
    spec.set("log_file", &log);
    spec.set("prefer_tmux", "0");
    spec.set("created_ms", now_ms().to_string());
    spec.set("inherit_env", "1");
    spec.set("launch", &launch);
    let q = rsb_deploy::shell_quote;
    // rsb's own values only: the agent path and root are paths it chose, the name matched
    // [A-Za-z0-9_-] and the launch id is digits; quoted all the same.
    let script = format!(
        "#!/bin/sh\n# rsb: Slurm batch script of job {name}, launch {launch}.\n\
         # The agent's job-run wrapper runs the command; its exit status is the job's.\n\
         exec {} job-run --root {} --name {} --launch {} --runner slurm\n",
        q(agent_path),
        q(&root),
        q(&name),
        q(&launch)
    );
    let job_name = format!("rsb-{name}");
    let comment = format!("rsb:{launch}");
    let argv = opts.sbatch_argv(
        &job_name,
        &comment,
        &format!("{dir}/slurm-%j.out"),
        &format!("{dir}/batch.sh"),
    );
    let env = vec![
        ("RSB_D".to_string(), dir.clone()),
        ("RSB_CWD".into(), cwd.clone()),
        ("RSB_LOG".into(), log.clone()),
        ("RSB_AGENT".into(), agent_path.to_string()),
        (
            "RSB_SPEC".into(),
            String::from_utf8_lossy(&spec.render()).into_owned(),
        ),
        ("RSB_SCRIPT".into(), script),
    ];
    let out = match remote::run(client, remote::SUBMIT, &argv, env).await {
        Ok(o) => o,
        Err(e) if matches!(e.kind, Kind::ConnectionLost | Kind::Timeout) => {
            // The submit may have happened: look, never submit again.
            return match find(client, &job_name, &comment).await {
                Some(id) => Ok(started(client, &name, &log, &id, None, true)),
                None => Err(RsbError::new(
                    e.kind,
                    format!(
                        "{}; no Slurm job named {job_name} with launch {launch} was found, so it was not submitted",
                        e.message
                    ),
                    "run exec_bash_background again",
                )),
            };
        }
        Err(e) => return Err(e),
    };
    let err_line = || {
        out.stderr
            .trim()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect::<Vec<_>>()
            .join(" | ")
    };
    match out.code {
        Some(0) => {}
        Some(17) => {
            return Err(RsbError::new(
                Kind::Agent(rsb_protocol::ErrorCode::AlreadyExists),
                err_line(),
                "pick another session_name, or kill the running job first",
            ));
        }
        Some(30) => {
            return Err(RsbError::invalid(
                format!("sbatch refused the job: {}", err_line()),
                "check the partition, gpus, mem and time against sinfo (list_sandboxes with check_resources)",
            ));
        }
        _ => {
            return Err(RsbError::invalid(
                format!("submitting the job failed: {}", err_line()),
                "check cwd and log_file",
            ));
        }
    }
    let kv: Map<String, Value> = out
        .stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), json!(v.trim())))
        .collect();
    let id = kv
        .get("id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| {
            RsbError::internal(format!("sbatch printed no job id: {:?}", out.stdout.trim()))
        })?
        .to_string();
    poll::poller(client.sandbox()).register([id.as_str()]);
    Ok(started(client, &name, &log, &id, path_warning(&kv), false))
}

/// Is the job's record (and the agent) on a path the compute node sees? A network file system
/// is; a local one is only when the login node is the cluster's only node.
fn path_warning(kv: &Map<String, Value>) -> Option<String> {
    let s = |k: &str| kv.get(k).and_then(Value::as_str).unwrap_or_default();
    let shared = |fs: &str| {
        [
            "nfs", "lustre", "gpfs", "beegfs", "cifs", "smb", "fuse", "ceph", "panfs", "wekafs",
        ]
        .iter()
        .any(|n| fs.to_ascii_lowercase().contains(n))
    };
    let nodes: Vec<&str> = s("nodes").split_whitespace().collect();
    let only_here = !nodes.is_empty() && nodes.iter().all(|n| *n == s("host"));
    let local: Vec<String> = [("job directory", s("fs")), ("agent", s("agent_fs"))]
        .iter()
        .filter(|(_, fs)| !shared(fs))
        .map(|(w, fs)| format!("the {w} is on {fs}"))
        .collect();
    (!only_here && !local.is_empty()).then(|| {
        format!(
            "{}, which may not be shared with the compute nodes ({}): if the job never starts, put $HOME on the shared file system",
            local.join(" and "),
            nodes.join(" ")
        )
    })
}

fn started(
    client: &AgentClient,
    name: &str,
    log: &str,
    id: &str,
    warning: Option<String>,
    recovered: bool,
) -> Value {
    let mut v = json!({
        "status": "started",
        "tmux_session": name,
        "log_file": log,
        "sandbox": client.sandbox(),
        "runner": "slurm",
        "pid": 0,
        "scheduler": "slurm",
        "slurm_job_id": id,
    });
    if let Some(w) = warning {
        v["path_warning"] = json!(w);
    }
    if recovered {
        v["note"] =
            json!("the submit's reply was lost; the job was found by its name and launch id");
    }
    v
}

/// The id of the job named `job_name` whose comment is `comment`.
async fn find(client: &AgentClient, job_name: &str, comment: &str) -> Option<String> {
    let out = remote::run(
        client,
        remote::FIND,
        &[],
        vec![("RSB_JOBNAME".into(), job_name.into())],
    )
    .await
    .ok()?;
    out.stdout.lines().find_map(|l| {
        let (id, c) = l.trim().split_once('|')?;
        (c == comment).then(|| id.to_string())
    })
}

async fn read_small(client: &AgentClient, path: String) -> Result<Option<Vec<u8>>> {
    match client
        .call(ReadFileRequest {
            path,
            offset: 0,
            max_bytes: 1 << 20,
        })
        .await
    {
        Ok(r) => Ok(Some(r.data)),
        Err(e) if e.kind == Kind::Agent(rsb_protocol::ErrorCode::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The Slurm id of job `name`, when it was submitted through Slurm.
pub async fn slurm_id(client: &AgentClient, name: &str) -> Result<Option<String>> {
    let dir = job_dir(&client.hello().home, name);
    Ok(read_small(client, format!("{dir}/slurm_job"))
        .await?
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .filter(|s| !s.is_empty()))
}

/// What a Slurm state means for the job: (rsb state, finished, reason).
pub fn meaning(state: &str) -> (&'static str, bool, Option<&'static str>) {
    match state {
        "PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" => ("pending", false, None),
        "RUNNING" | "CONFIGURING" | "COMPLETING" | "SIGNALING" | "STAGE_OUT" | "RESIZING" => {
            ("running", false, None)
        }
        "SUSPENDED" | "STOPPED" => ("suspended", false, None),
        "COMPLETED" => ("exited", true, None),
        "FAILED" | "BOOT_FAIL" | "DEADLINE" => ("exited", true, None),
        "TIMEOUT" => ("exited", true, Some("timeout")),
        "OUT_OF_MEMORY" => ("exited", true, Some("out_of_memory")),
        "CANCELLED" => ("exited", true, Some("cancelled")),
        "NODE_FAIL" => ("interrupted", true, Some("node_fail")),
        "PREEMPTED" => ("interrupted", true, Some("preempted")),
        _ => ("unknown", false, None),
    }
}

/// Put Slurm's view over a reply already holding the record's (`ops::jobs` keys).
fn overlay(m: &mut Map<String, Value>, id: &str, seen: &Seen, recorded_end: bool) {
    m.insert("scheduler".into(), json!("slurm"));
    m.insert("runner".into(), json!("slurm"));
    m.insert("slurm_job_id".into(), json!(id));
    let set = |m: &mut Map<String, Value>, state: &str, running: bool| {
        m.insert("state".into(), json!(state));
        m.insert("running".into(), json!(running));
    };
    match seen {
        Seen::Row(Row {
            state,
            reason,
            node,
            ..
        }) => {
            m.insert("slurm_state".into(), json!(state));
            if !node.is_empty() && node != "(null)" {
                m.insert("node".into(), json!(node));
            }
            let (word, finished, why) = meaning(state);
            if let Some(w) = why {
                m.insert("reason".into(), json!(w));
            }
            if word == "pending" {
                m.insert("pending_reason".into(), json!(reason));
                // Back in the queue after it ran: Slurm requeued it (node failure, preemption).
                let ran = m.contains_key("started_ms") || recorded_end;
                set(m, if ran { "resuming" } else { "pending" }, true);
            } else if recorded_end && !finished {
                // The command ended (its code is on record) but Slurm has not closed the job
                // yet (COMPLETING, epilog): why it ended is known only once Slurm says so.
                set(m, "completing", true);
            } else if recorded_end {
                // The record has the exit code; Slurm only adds why.
                if word == "interrupted" {
                    set(m, word, false);
                }
            } else if finished {
                set(m, word, false);
            } else {
                set(m, word, true);
            }
        }
        Seen::Gone => {
            if !recorded_end {
                // Purged by the controller and nothing on record: it never reported.
                m.insert("slurm_state".into(), json!("unknown"));
                set(m, "lost", false);
                m.insert(
                    "note".into(),
                    json!("Slurm no longer knows this job and its wrapper recorded no end (it never started, or was killed before it could record)"),
                );
            }
        }
        Seen::Unreachable(e) => {
            if !recorded_end {
                set(m, "scheduler_unreachable", true);
            }
            m.insert("scheduler_error".into(), json!(e));
        }
    }
}

/// `check_background_task` for a Slurm job: the agent's record and log, then Slurm's view.
pub async fn status(
    client: &AgentClient,
    id: &str,
    req: &JobStatusRequest,
    cursor: bool,
) -> Result<Value> {
    let r = client.call(req.clone()).await?;
    let recorded_end = r
        .info
        .as_ref()
        .is_some_and(|i| i.ended_ms.is_some() && i.state != JobState::Running);
    let seen = poll::poller(client.sandbox())
        .states(client, &[id.to_string()])
        .await
        .remove(id)
        .unwrap_or(Seen::Gone);
    let mut v = if r.info.is_some() || r.log_found {
        ojobs::status_reply(&req.name, cursor, &r)?
    } else {
        pending_reply(client, &req.name, cursor, r.next_offset).await?
    };
    if let Value::Object(m) = &mut v {
        if let Some(i) = &r.info {
            m.insert("started_ms".into(), json!(i.started_ms));
        }
        overlay(m, id, &seen, recorded_end);
        m.remove("started_ms");
    }
    Ok(v)
}

/// A job the wrapper has not started yet: what its spec says.
async fn pending_reply(
    client: &AgentClient,
    name: &str,
    cursor: bool,
    next_offset: u64,
) -> Result<Value> {
    let dir = job_dir(&client.hello().home, name);
    let spec = read_small(client, format!("{dir}/spec"))
        .await?
        .and_then(|b| Record::parse(&b).ok());
    let text = |k: &str| {
        spec.as_ref()
            .and_then(|s| s.get_bytes(k))
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    };
    let created = spec
        .as_ref()
        .and_then(|s| s.get_u64("created_ms"))
        .unwrap_or_else(now_ms);
    let mut m = Map::new();
    m.insert("tmux_session".into(), json!(name));
    m.insert("running".into(), json!(true));
    m.insert("state".into(), json!("pending"));
    m.insert(
        "duration_s".into(),
        json!(now_ms().saturating_sub(created) as f64 / 1000.0),
    );
    m.insert("log_file".into(), json!(text("log_file")));
    if cursor {
        m.insert("output".into(), json!(""));
        m.insert("more".into(), json!(false));
    } else {
        m.insert("log_tail".into(), json!("[log file not found]"));
    }
    m.insert("next_offset".into(), json!(next_offset));
    Ok(Value::Object(m))
}

/// `kill_background_task`: scancel, then squeue until Slurm reports the end (scancel of an
/// unknown id returns 0, so its status proves nothing).
pub async fn kill(client: &AgentClient, name: &str, id: &str) -> Result<Value> {
    let out = remote::run(client, remote::SCANCEL, &[id.to_string()], Vec::new()).await?;
    if !out.ok() {
        return Err(RsbError::new(
            Kind::Agent(rsb_protocol::ErrorCode::Io),
            format!(
                "scancel {id} failed: {}",
                out.stderr.trim().lines().last().unwrap_or("no message")
            ),
            "check `scontrol ping` on the login node",
        ));
    }
    let poller = poll::poller(client.sandbox());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(KILL_VERIFY_S);
    let req = ojobs::status_request(name, "", 5, None, 1)?;
    loop {
        poller.invalidate();
        let v = status(client, id, &req, false).await?;
        let done = v.get("running") == Some(&json!(false));
        if done || std::time::Instant::now() >= deadline {
            let mut v = v;
            if let Value::Object(m) = &mut v {
                m.remove("log_tail");
                m.remove("next_offset");
                if !done {
                    m.insert(
                        "note".into(),
                        json!(format!(
                            "scancel was sent but Slurm still lists the job after {KILL_VERIFY_S} s"
                        )),
                    );
                }
            }
            return Ok(v);
        }
        tokio::time::sleep(poll::TICK).await;
    }
}

/// `list_background_tasks`: the agent's jobs, with every Slurm job (pending ones too) shown
/// through one squeue for all of them.
pub async fn list(client: &AgentClient) -> Result<Value> {
    let base = ojobs::list(client).await?;
    let root = format!("{}/{JOBS_ROOT}", client.hello().home.trim_end_matches('/'));
    let out = remote::run(
        client,
        remote::INVENTORY,
        &[],
        vec![("RSB_ROOT".into(), root)],
    )
    .await?;
    let mut ids: Vec<(String, String)> = Vec::new();
    let mut cur: Option<String> = None;
    for l in out.stdout.lines() {
        if let Some(n) = l.strip_prefix('@') {
            cur = Some(n.to_string());
        } else if let Some(n) = cur.take() {
            ids.push((n, l.trim().to_string()));
        }
    }
    let idv: Vec<String> = ids.iter().map(|(_, i)| i.clone()).collect();
    let seen = if idv.is_empty() {
        Default::default()
    } else {
        poll::poller(client.sandbox()).states(client, &idv).await
    };
    let mut tasks: Vec<Value> = Vec::new();
    for t in &base.tasks {
        let mut v = serde_json::to_value(t).unwrap_or_default();
        if let Some((_, id)) = ids.iter().find(|(n, _)| *n == t.tmux_session)
            && let Value::Object(m) = &mut v
        {
            let ended = t.ended_ms.is_some() && t.state != "running";
            m.insert("started_ms".into(), json!(t.started_ms));
            overlay(m, id, seen.get(id).unwrap_or(&Seen::Gone), ended);
            m.remove("started_ms");
        }
        tasks.push(v);
    }
    for (name, id) in &ids {
        if base.tasks.iter().any(|t| &t.tmux_session == name) {
            continue;
        }
        let mut m = Map::new();
        m.insert("tmux_session".into(), json!(name));
        m.insert("running".into(), json!(true));
        m.insert("state".into(), json!("pending"));
        overlay(&mut m, id, seen.get(id).unwrap_or(&Seen::Gone), false);
        tasks.push(Value::Object(m));
    }
    Ok(json!({ "tasks": tasks }))
}
