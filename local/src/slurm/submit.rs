//! Submitting a job: the record first (the spec with a fresh launch, and the caller's launch
//! id), then the batch script, then one `sbatch`. A caller that lost the reply repeats the
//! same launch id and gets the job that id already submitted; nothing is submitted twice.
//!
//! The job record is the agent's (`~/.cache/rsb/jobs/NAME/{spec,state}`); the batch script
//! execs the agent's `job-run` wrapper on the compute node, whose record, on the shared home,
//! is the truth for the exit code.

use std::time::{SystemTime, UNIX_EPOCH};

use rsb_agent::jobs::record::Record;
use rsb_protocol::ReadFileRequest;
use serde_json::{Map, Value, json};

use super::{SlurmOptions, remote};
use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
    pool::Pool,
};

pub use rsb_protocol::JOBS_ROOT;

/// Each sandbox's cluster node list, learned by its first submit in this process that needed
/// it (the path warning's "is the login node the only node?").
static NODES: std::sync::LazyLock<parking_lot::Mutex<std::collections::HashMap<String, String>>> =
    std::sync::LazyLock::new(Default::default);

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn jobs_root(home: &str) -> String {
    format!("{}/{JOBS_ROOT}", home.trim_end_matches('/'))
}

pub fn job_dir(home: &str, name: &str) -> String {
    format!("{}/{name}", jobs_root(home))
}

/// `~`, `~/x` and relative paths the way the agent resolves a job's cwd and log.
pub fn resolve(home: &str, base: &str, p: &str) -> String {
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

pub fn validate_name(name: &str) -> Result<()> {
    let ok = rsb_protocol::jobs::valid_job_name(name);
    if ok {
        Ok(())
    } else {
        Err(RsbError::invalid(
            format!("session_name {name:?} must match [A-Za-z0-9_-]{{1,64}}"),
            "pick a name of letters, digits, '_' and '-'",
        ))
    }
}

/// One job to submit; every field already checked (name, options) and resolved (paths).
pub struct Job<'a> {
    /// The agent on the shared home, which the batch script execs.
    pub agent_path: &'a str,
    /// The job's options over the sandbox's defaults, checked.
    pub options: &'a SlurmOptions,
    pub name: &'a str,
    pub command: &'a str,
    pub cwd: &'a str,
    pub log: &'a str,
    /// Put on top of the environment Slurm gives the batch script.
    pub env: &'a [(String, String)],
    /// The caller's id for this launch (the watchdog's resume intent): a repeat returns the
    /// job it submitted.
    pub launch_id: Option<&'a str>,
}

pub struct Submitted {
    pub id: String,
    /// The reply was lost and the job was found by its name and launch id.
    pub recovered: bool,
    /// The launch id had submitted it already.
    pub repeated: bool,
    /// What the submit script reported (file systems, host, nodes) for the path warning.
    pub facts: Map<String, Value>,
}

async fn read_small(client: &AgentClient, path: String) -> Result<Option<Vec<u8>>> {
    match client
        .call(ReadFileRequest {
            path,
            offset: 0,
            max_bytes: 1 << 20,
            confine: None,
        })
        .await
    {
        Ok(r) => Ok(Some(r.data)),
        Err(e) if e.kind == Kind::Agent(rsb_protocol::ErrorCode::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

async fn read_line(client: &AgentClient, path: String) -> Result<Option<String>> {
    Ok(read_small(client, path)
        .await?
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .filter(|s| !s.is_empty()))
}

/// The Slurm id of job `name`, when it was submitted through Slurm.
pub async fn slurm_id(client: &AgentClient, name: &str) -> Result<Option<String>> {
    let dir = job_dir(&client.hello().home, name);
    read_line(client, format!("{dir}/slurm_job")).await
}

/// The options job `name` was submitted with (its spec's), when it was submitted by an rsb
/// that wrote them.
pub async fn submitted_options(client: &AgentClient, name: &str) -> Option<Value> {
    let spec = spec(client, name).await.ok()??;
    serde_json::from_str(spec.get("slurm_options")?).ok()
}

/// The job's spec as submitted, when there is one.
pub async fn spec(client: &AgentClient, name: &str) -> Result<Option<Record>> {
    let dir = job_dir(&client.hello().home, name);
    Ok(read_small(client, format!("{dir}/spec"))
        .await?
        .and_then(|b| Record::parse(&b).ok()))
}

/// The id of the job named `job_name` whose comment is `comment`, recorded as the job's;
/// `Ok(None)` when Slurm lists none, an error when it could not be asked.
async fn find(
    client: &AgentClient,
    dir: &str,
    job_name: &str,
    comment: &str,
) -> Result<Option<String>> {
    let out = remote::run(
        client,
        remote::FIND,
        &[],
        vec![("RSB_JOBNAME".into(), job_name.into())],
    )
    .await?;
    if !out.ok() {
        return Err(out.failed("squeue"));
    }
    let Some(id) = out.stdout.lines().find_map(|l| {
        let (id, c) = l.trim().split_once('|')?;
        (c == comment).then(|| id.to_string())
    }) else {
        return Ok(None);
    };
    let _ = remote::run(
        client,
        remote::ADOPT,
        &[],
        vec![("RSB_D".into(), dir.into()), ("RSB_ID".into(), id.clone())],
    )
    .await;
    Ok(Some(id))
}

/// Submit `job` (the caller registers the id with its poller). With a launch id already on record for this name: its job when it has one
/// (`repeated`), the job Slurm lists under that id when its submit was cut (`recovered`),
/// else a fresh submit.
pub async fn submit(pool: &Pool, client: &AgentClient, job: &Job<'_>) -> Result<Submitted> {
    validate_name(job.name)?;
    let home = client.hello().home.clone();
    let dir = job_dir(&home, job.name);
    let job_name = format!("rsb-{}", job.name);
    let launch = format!("{}-{}-slurm", now_ms(), std::process::id());
    let token = job.launch_id.unwrap_or(&launch).to_string();
    let comment = format!("rsb:{token}");
    let done = |id: String, recovered, repeated| Submitted {
        id,
        recovered,
        repeated,
        facts: Map::new(),
    };
    if let Some(l) = job.launch_id {
        let recorded = read_line(client, format!("{dir}/launch_id")).await?;
        if recorded.as_deref() == Some(l) {
            if let Some(id) = read_line(client, format!("{dir}/slurm_job")).await? {
                return Ok(done(id, false, true));
            }
            if let Ok(Some(id)) = find(client, &dir, &job_name, &comment).await {
                return Ok(done(id, true, false));
            }
        }
    }
    let mut spec = Record::new();
    spec.set("name", job.name);
    spec.set("command", job.command);
    spec.set("cwd", job.cwd);
    spec.set("log_file", job.log);
    spec.set("prefer_tmux", "0");
    spec.set("created_ms", now_ms().to_string());
    spec.set("inherit_env", "1");
    spec.set("launch", &launch);
    spec.set("launch_id", job.launch_id.unwrap_or(""));
    // The options it was submitted with (the sandbox's defaults included), for a resume of a
    // watch that did not register them.
    spec.set(
        "slurm_options",
        serde_json::to_string(job.options).unwrap_or_default(),
    );
    for (k, v) in job.env {
        spec.push("env", format!("{k}={v}"));
    }
    // The sandbox's confinement, applied by the wrapper on the compute node, which decides
    // there whether it can (that node's kernel may differ from the login node's).
    if let Some(c) = client.confine() {
        let c = rsb_protocol::Confine {
            write: c.write.iter().map(|w| resolve(&home, &home, w)).collect(),
            read: c
                .read
                .as_ref()
                .map(|r| r.iter().map(|w| resolve(&home, &home, w)).collect()),
            ..c.clone()
        };
        rsb_agent::jobs::record::set_confine(&mut spec, &c);
    }
    let q = rsb_deploy::shell_quote;
    let root = jobs_root(&home);
    // rsb's own values only: the agent path and root are paths it chose, the name matched
    // [A-Za-z0-9_-] and the launch is digits; quoted all the same.
    let script = format!(
        "#!/bin/sh\n# rsb: Slurm batch script of job {}, launch {launch}.\n\
         # The agent's job-run wrapper runs the command; its exit status is the job's.\n\
         exec {} job-run --root {} --name {} --launch {} --runner slurm\n",
        job.name,
        q(job.agent_path),
        q(&root),
        q(job.name),
        q(&launch)
    );
    let argv = job.options.sbatch_argv(
        &job_name,
        &comment,
        &format!("{dir}/slurm-%j.out"),
        &format!("{dir}/batch.sh"),
    );
    let env = vec![
        ("RSB_D".to_string(), dir.clone()),
        ("RSB_CWD".into(), job.cwd.to_string()),
        ("RSB_LOG".into(), job.log.to_string()),
        ("RSB_AGENT".into(), job.agent_path.to_string()),
        (
            "RSB_SPEC".into(),
            String::from_utf8_lossy(&spec.render()).into_owned(),
        ),
        ("RSB_SCRIPT".into(), script),
        ("RSB_LAUNCH_ID".into(), token.clone()),
        // The cluster's nodes, once learned: sinfo is not asked again on every submit.
        (
            "RSB_NODES".into(),
            NODES
                .lock()
                .get(client.sandbox())
                .cloned()
                .unwrap_or_default(),
        ),
    ];
    let out = match remote::run(client, remote::SUBMIT, &argv, env).await {
        Ok(o) => o,
        Err(e) if matches!(e.kind, Kind::ConnectionLost | Kind::Timeout) => {
            // The submit may have happened: look, on a fresh connection when this one is gone,
            // and never submit again.
            let found = match pool.client(client.sandbox()).await {
                Ok(fresh) => find(&fresh, &dir, &job_name, &comment).await,
                Err(again) => Err(again),
            };
            return match found {
                Ok(Some(id)) => Ok(done(id, true, false)),
                Ok(None) => Err(RsbError::new(
                    e.kind,
                    format!(
                        "{}; Slurm lists no job named {job_name} with launch {token}, so it was not submitted",
                        e.message
                    ),
                    "run exec_bash_background again",
                )),
                Err(look) => Err(RsbError::new(
                    e.kind,
                    format!(
                        "{}; the job may or may not have been submitted: looking for {job_name} with launch {token} failed too ({})",
                        e.message, look.message
                    ),
                    "check_background_task(tmux_session) tells once the sandbox answers; do not submit again before",
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
    let facts: Map<String, Value> = out
        .stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), json!(v.trim())))
        .collect();
    let id = facts
        .get("id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| {
            RsbError::internal(format!("sbatch printed no job id: {:?}", out.stdout.trim()))
        })?
        .to_string();
    if let Some(n) = facts.get("nodes").and_then(Value::as_str)
        && !n.trim().is_empty()
    {
        NODES
            .lock()
            .insert(client.sandbox().to_string(), n.to_string());
    }
    let mut s = done(id, false, false);
    s.facts = facts;
    Ok(s)
}
