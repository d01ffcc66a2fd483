//! Background jobs on a Slurm sandbox: the job tools' submit, status, kill and list, with the
//! same names, parameters and reply keys as on any host, plus `scheduler`, `slurm_job_id`,
//! `slurm_state`, `pending_reason`, `node` and `reason`.
//!
//! State: the wrapper's record (written on the compute node, read by the login node's agent)
//! decides the exit code; squeue decides pending / running / why it ended. A job Slurm no
//! longer lists (purged after MinJobAge) is still reported from the record.

use rsb_protocol::{JobState, JobStatusRequest};
use serde_json::{Map, Value, json};

pub use crate::slurm::{state::meaning, submit::slurm_id};
use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
    ops::jobs as ojobs,
    slurm::{
        SlurmOptions,
        poll::{self, Seen},
        remote,
        state::judge,
        submit::{self, jobs_root, now_ms, resolve, validate_name},
    },
};

/// How long kill waits for Slurm to report the job ended (KillWait is 30 s by default).
const KILL_VERIFY_S: u64 = 40;

/// Submit `command` as a Slurm batch job ([`submit::submit`]): checks and paths here, the
/// record and sbatch there.
#[allow(clippy::too_many_arguments)]
pub async fn start(
    pool: &crate::pool::Pool,
    client: &AgentClient,
    agent_path: &str,
    defaults: &SlurmOptions,
    job: &SlurmOptions,
    command: &str,
    session_name: &str,
    log_file: &str,
    cwd: &str,
    env: &[(String, String)],
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
    // A controller known to be down would hold sbatch (and the lookup after it) for the
    // whole of each call's 25 s: say so at once instead.
    if let Some(why) = poll::poller(client.sandbox()).down() {
        return Err(RsbError::new(
            Kind::Timeout,
            format!("the Slurm controller is not answering ({why}), so nothing was submitted"),
            "submit again once `scontrol ping` answers on the login node",
        ));
    }
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
    let log = if log_file.trim().is_empty() && client.confine().is_some() {
        // A confined job's log, rsb's own write: in the job's own directory (the agent's
        // wrapper refuses one outside the write roots).
        format!(
            "{}/{}",
            crate::slurm::submit::job_dir(&home, &name),
            rsb_protocol::CONFINED_LOG
        )
    } else if log_file.trim().is_empty() {
        format!("{cwd}/.codex_logs/{name}.log")
    } else {
        resolve(&home, &cwd, log_file)
    };
    let sub = submit::submit(
        pool,
        client,
        &submit::Job {
            agent_path,
            options: &opts,
            name: &name,
            command,
            cwd: &cwd,
            log: &log,
            env,
            launch_id: None,
        },
    )
    .await?;
    poll::poller(client.sandbox()).register([sub.id.as_str()]);
    Ok(started(
        client,
        &name,
        &log,
        &sub.id,
        path_warning(&sub.facts),
        sub.recovered,
    ))
}

/// The cwd a submitted job runs in, from its spec ("" when it cannot be read).
pub async fn cwd_of(client: &AgentClient, name: &str) -> String {
    submit::spec(client, name)
        .await
        .ok()
        .flatten()
        .and_then(|s| s.get("cwd").map(str::to_string))
        .unwrap_or_default()
}

/// Is the job's record (and the agent) on a path the compute node sees? A network file system
/// is; a local one is only when the login node is the cluster's only node.
fn path_warning(kv: &Map<String, Value>) -> Option<String> {
    let s = |k: &str| kv.get(k).and_then(Value::as_str).unwrap_or_default();
    let nodes: Vec<&str> = s("nodes").split_whitespace().collect();
    let only_here = !nodes.is_empty() && nodes.iter().all(|n| *n == s("host"));
    // The submit script decides which file systems are shared (`fs_shared`, one list there).
    let local: Vec<String> = [
        ("job directory", s("fs"), s("fs_shared")),
        ("agent", s("agent_fs"), s("agent_fs_shared")),
    ]
    .iter()
    .filter(|(_, _, shared)| *shared != "yes")
    .map(|(w, fs, _)| format!("the {w} is on {fs}"))
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

/// Put Slurm's view ([`judge`]) over a reply already holding the record's (`ops::jobs` keys).
fn overlay(m: &mut Map<String, Value>, id: &str, seen: &Seen, recorded_end: bool) {
    m.insert("scheduler".into(), json!("slurm"));
    m.insert("runner".into(), json!("slurm"));
    m.insert("slurm_job_id".into(), json!(id));
    let ran = m.contains_key("started_ms");
    let j = judge(seen, recorded_end, ran);
    if let (Some(state), Some(running)) = (j.state, j.running) {
        m.insert("state".into(), json!(state));
        m.insert("running".into(), json!(running));
    }
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            m.insert(k.into(), v);
        }
    };
    put("slurm_state", j.slurm_state.map(Value::from));
    put("reason", j.reason.map(Value::from));
    put("pending_reason", j.pending_reason.map(Value::from));
    put("node", j.node.map(Value::from));
    put("restarts", j.restarts.map(Value::from));
    put("scheduler_error", j.scheduler_error.map(Value::from));
    match j.state {
        Some("lost") => {
            m.insert(
                "note".into(),
                json!("Slurm no longer knows this job and its wrapper recorded no end (it never started, or was killed before it could record)"),
            );
        }
        Some("scheduler_unreachable") if recorded_end => {
            m.insert(
                "note".into(),
                json!("the command's end is on record, but only the Slurm controller can say how the job ended (timeout, preemption, requeue); ask again once it answers"),
            );
        }
        _ => {}
    }
}

/// `check_background_task` for a Slurm job: the agent's record and log, then Slurm's view
/// from a poll at most `max_age` old (or the pace's: [`poll::Poller::states`]); a fresh one
/// when the record reads as ended (Slurm is closing the job: its end is due now).
pub async fn status(
    client: &AgentClient,
    id: &str,
    req: &JobStatusRequest,
    cursor: bool,
    max_age: std::time::Duration,
) -> Result<Value> {
    let r = client.call(req.clone()).await?;
    let recorded_end = r
        .info
        .as_ref()
        .is_some_and(|i| i.ended_ms.is_some() && i.state != JobState::Running);
    let max_age = match recorded_end {
        true => poll::FRESH,
        false => max_age,
    };
    let seen = poll::poller(client.sandbox())
        .states(client, &[id.to_string()], max_age)
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
        // Slurm's word on how it ended comes first (preempted, node_fail, out of memory).
        if let (Some(i), false, true) = (&r.info, cursor, r.log_found) {
            let state = m
                .get("slurm_state")
                .and_then(Value::as_str)
                .map(str::to_owned);
            let output = String::from_utf8_lossy(rsb_protocol::job_output(&r.log));
            crate::ops::failure::put(m, ojobs::ended(i, state.as_deref()), &output);
        }
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
    let spec = submit::spec(client, name).await?;
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

/// What [`start_any`] started.
#[derive(Debug, Clone)]
pub struct Launched {
    /// The tools' reply (the job's name, log, runner; `slurm_job_id` for a Slurm job).
    pub reply: Value,
    /// Submitted to Slurm: the options it went with (the job's over the sandbox's defaults),
    /// which a resume resubmits with.
    pub slurm: Option<SlurmOptions>,
    /// Started by the agent: when the run began (ms, the host's clock), which tells its end
    /// from another run's of the same name.
    pub started_ms: Option<u64>,
}

/// Start `command` as a background job on `client`'s sandbox, the one path of
/// `exec_bash_background` and `rsb jobs start`: through sbatch on a Slurm login node (the
/// sandbox's defaults under the job's `job` options), else the agent's wrapper, confined as
/// the sandbox says. `job` (or `slurm_asked`, a resume plan's own options) on a sandbox that is
/// not a login node is an error before anything starts.
pub async fn start_any(
    pool: &crate::pool::Pool,
    client: &AgentClient,
    job: Option<&SlurmOptions>,
    slurm_asked: bool,
    command: &str,
    (name, log, cwd): (&str, &str, &str),
    gpus: Option<&crate::gpus::Need>,
) -> Result<Launched> {
    let sandbox = client.sandbox();
    if let Some(defaults) = pool.slurm(sandbox) {
        let agent = pool
            .agent_path(sandbox)
            .ok_or_else(|| RsbError::internal("the agent's path on the login node is not known"))?;
        let mut job = job.cloned().unwrap_or_default();
        // Slurm places GPUs itself (and sets CUDA_VISIBLE_DEVICES): `gpus` is its --gpus.
        if let Some(need) = gpus {
            if need.min_free_mib.is_some() {
                return Err(RsbError::invalid(
                    "min_gpu_free_mem_gb does not apply on a Slurm login node: Slurm picks the GPUs",
                    "drop it, and ask Slurm for the GPU model with slurm.gres or slurm.constraint",
                ));
            }
            job.gpus = job.gpus.or(Some(need.count));
        }
        let reply = start(
            pool,
            client,
            &agent,
            &defaults,
            &job,
            command,
            name,
            log,
            cwd,
            &[],
        )
        .await?;
        return Ok(Launched {
            reply,
            slurm: Some(job.over(&defaults)),
            started_ms: None,
        });
    }
    if job.is_some() || slurm_asked {
        return Err(RsbError::invalid(
            format!("sandbox '{sandbox}' is not a Slurm login node, so Slurm options do not apply"),
            "declare it with scheduler = \"slurm\" in the config, or drop the Slurm options",
        ));
    }
    let ask = match gpus {
        Some(need) => Some(crate::gpus::ask(client, need).await?),
        None => None,
    };
    let confine = client.confine().cloned();
    let leased = ask.is_some();
    let started = ojobs::start(client, command, (name, log, cwd), confine, ask).await;
    if leased {
        pool.forget_sample(sandbox);
    }
    let started = started?;
    Ok(Launched {
        reply: serde_json::to_value(&started).unwrap_or_default(),
        slurm: None,
        started_ms: Some(started.started_ms),
    })
}

/// Stop the job `name` on `client`'s sandbox, the one path of `kill_background_task` and
/// `rsb jobs kill`: on a Slurm login node (`slurm`), a job with a Slurm id on record is
/// cancelled through scancel (its processes run on a compute node the agent cannot reach);
/// any other job gets the agent's kill (SIGTERM, then SIGKILL after `grace_s`).
pub async fn kill_any(
    client: &AgentClient,
    slurm: bool,
    name: &str,
    grace_s: f64,
) -> Result<Value> {
    let id = match slurm {
        true => slurm_id(client, name).await.ok().flatten(),
        false => None,
    };
    match id {
        Some(id) => kill(client, name, &id).await,
        None => ojobs::kill(client, name, grace_s)
            .await
            .map(|k| serde_json::to_value(k).unwrap_or_default()),
    }
}

/// What a kill of job `name` does, for the policy's question and its audit line (the same
/// words from every front end; the sandbox is added by [`crate::ops::action::Caller::act`]).
pub fn kill_what(name: &str) -> String {
    format!(
        "stopping the background task '{}'",
        crate::term::shown(name)
    )
}

/// `kill_background_task` and `rsb jobs kill`: the job's watches are cancelled first (a
/// deliberate kill is not an interruption: the watchdog neither alerts nor resumes it), then
/// [`kill_any`]; the reply names the watches it cancelled. A store that cannot be read does not
/// stop the kill (it is said in rsb's log).
pub async fn kill_watched(
    app: &crate::app::App,
    client: &AgentClient,
    name: &str,
    grace_s: f64,
) -> Result<Value> {
    let cancelled =
        match crate::ops::watchdog::cancel_for_job(&app.store(), client.sandbox(), name).await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!("cannot cancel the watches of {name}: {}", e.message);
                Vec::new()
            }
        };
    let on_slurm = app.pool().slurm(client.sandbox()).is_some();
    let mut v = kill_any(client, on_slurm, name, grace_s).await?;
    if !cancelled.is_empty() {
        v["cancelled_watches"] = json!(cancelled);
    }
    Ok(v)
}

/// Whether Slurm says job `name` is over while its record still reads as running: the
/// wrapper was killed before it recorded an end, on a compute node where nothing on the login
/// node can see it die. Slurm's word is final: `Some("FAILED, job 7")` (or `purged, job 7`),
/// else `None` (still running, no Slurm id on record, or the controller did not answer). For
/// `rsb jobs logs -f`, `rm` and `prune`, which would otherwise wait on that record forever.
/// Slurm's answer is at most `max_age` old, or the pace's ([`poll::Poller::states`]).
pub async fn ended_by_slurm(
    client: &AgentClient,
    name: &str,
    max_age: std::time::Duration,
) -> Option<String> {
    let id = slurm_id(client, name).await.ok().flatten()?;
    let seen = poll::poller(client.sandbox())
        .states(client, std::slice::from_ref(&id), max_age)
        .await
        .remove(&id)
        .unwrap_or(Seen::Gone);
    let j = judge(&seen, false, true);
    (j.running == Some(false)).then(|| {
        let state = j.slurm_state.filter(|s| s != "unknown");
        format!("{}, job {id}", state.as_deref().unwrap_or("purged"))
    })
}

/// `kill_background_task`: scancel, then squeue until Slurm reports the end (scancel of an
/// unknown id returns 0, so its status proves nothing).
pub async fn kill(client: &AgentClient, name: &str, id: &str) -> Result<Value> {
    let out = remote::run(client, remote::SCANCEL, &[id.to_string()], Vec::new()).await?;
    if !out.ok() {
        return Err(out.failed(&format!("scancel {id}")));
    }
    let poller = poll::poller(client.sandbox());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(KILL_VERIFY_S);
    let req = ojobs::status_request(name, "", 5, None, 1)?;
    loop {
        poller.invalidate();
        let v = status(client, id, &req, false, poll::FRESH).await?;
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
    let root = jobs_root(&client.hello().home);
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
        poll::poller(client.sandbox())
            .states(client, &idv, poll::FRESH)
            .await
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
