//! `rsb jobs start|list|logs|kill|rm|prune`: background jobs supervised by the agent.

use std::{io::Write, time::Duration};

use clap::Subcommand;
use rsb::slurm::poll::FRESH;
use rsb::{
    client::AgentClient,
    error::{Kind, RsbError},
    ops::{action::Act, exec, jobs},
};
use rsb_protocol::{ErrorCode, JobEventsRequest, JobListRequest, JobState};

use super::{Ctx, exit, fail, print_json, print_table};
use rsb::term::shown;

#[derive(Debug, Subcommand)]
pub enum JobsCmd {
    /// Start a detached job; prints its name.
    Start {
        /// Job name, [A-Za-z0-9_-]{1,64} (default bg-<time>-<random>).
        #[arg(long, short)]
        name: Option<String>,
        /// Remote working directory (default the remote $HOME).
        #[arg(long)]
        cwd: Option<String>,
        /// Log file (default .codex_logs/NAME.log under the working directory).
        #[arg(long)]
        log: Option<String>,
        /// Approve a command the policy's `ask` rules hold for approval, without the question.
        #[arg(long, short = 'y')]
        yes: bool,
        /// On a Slurm login node, the job's sbatch options over the sandbox's defaults, as
        /// exec_bash_background's `slurm` (JSON: '{"partition": "gpu", "gpus": 1, "time": "2:00:00"}').
        /// A job on a Slurm sandbox is always submitted through sbatch.
        #[arg(long, value_name = "JSON")]
        slurm: Option<String>,
        /// Lease this many free GPUs (the freest; the job gets their UUIDs in
        /// CUDA_VISIBLE_DEVICES). With `-s auto`, on the sandbox that fits best.
        #[arg(long, default_value_t = 0)]
        gpus: i64,
        /// Each leased GPU has at least this much memory free (GiB).
        #[arg(long, value_name = "GIB", default_value_t = 0.0)]
        min_gpu_free_mem_gb: f64,
        /// One argument is a bash command line; several are words, boundaries kept.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// List jobs, newest first.
    #[command(visible_alias = "ls")]
    List,
    /// Show a job's log; with -f, follow it until the job ends and exit with its code.
    Logs {
        name: String,
        #[arg(long, short)]
        follow: bool,
        /// Lines of log tail to show (without -f).
        #[arg(long, short = 'n', default_value_t = 50)]
        lines: i64,
    },
    /// Stop a job: SIGTERM, then SIGKILL after the grace.
    Kill {
        name: String,
        /// Seconds between SIGTERM and SIGKILL.
        #[arg(long, default_value_t = 5.0)]
        grace: f64,
        /// Approve it without asking, where the policy's ask_actions holds "kill".
        #[arg(long, short)]
        yes: bool,
    },
    /// Forget an ended job (its record; the log file stays).
    Rm { name: String },
    /// Forget every ended job (optionally only those ended longer ago than DUR).
    Prune {
        /// Like 30s, 10m, 2h, 7d.
        #[arg(long, value_name = "DUR", value_parser = parse_duration)]
        older_than: Option<Duration>,
    },
}

/// `30s`, `10m`, `2h`, `7d`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration like 30s, 10m, 2h or 7d"))?;
    let mult = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("unknown unit `{unit}` (use s, m, h or d)")),
    };
    Ok(Duration::from_secs(n.saturating_mul(mult)))
}

/// A job whose log file is gone: said, not printed as an empty log.
fn log_gone(name: &str, info: &rsb_protocol::JobInfo) -> RsbError {
    RsbError::new(
        Kind::Agent(ErrorCode::NotFound),
        format!(
            "job `{}`'s log {} is gone (deleted or moved); nothing to show",
            shown(name),
            shown(&info.log_file)
        ),
        "`rsb jobs list` still shows the job's state and exit code",
    )
}

fn no_such_job(name: &str) -> RsbError {
    RsbError::new(
        Kind::Agent(ErrorCode::NotFound),
        format!("no job named `{name}` on this sandbox (names match exactly)"),
        "`rsb jobs list` shows the jobs on this sandbox",
    )
}

/// The agent's "not found" for a job names the job, not a path.
fn job_error(name: &str, e: RsbError) -> RsbError {
    if e.kind == Kind::Agent(ErrorCode::NotFound) {
        no_such_job(name)
    } else {
        e
    }
}

/// `rsb jobs kill`: one [`Act`] (the sandbox resolved once, the policy's `ask_actions`, one
/// audit line) around the job tools' kill ([`rsb::ops::slurm::jobs::kill_watched`]: its
/// watches cancelled first, scancel for a Slurm job); the job's line, or its error.
async fn kill(ctx: &Ctx, name: &str, grace: f64, yes: bool, json: bool) -> u8 {
    let sandbox = match ctx.resolve() {
        Ok(s) => s,
        Err(e) => return fail(json, &e),
    };
    let act = Act {
        sandbox: &sandbox,
        tool: "rsb jobs kill",
        command: Some(name.into()),
        approval: Some((
            rsb::policy::Action::Kill,
            rsb::ops::slurm::jobs::kill_what(name),
        )),
        ..Default::default()
    };
    let app = &ctx.app;
    let r = super::policy::caller(yes)
        .act(app.pool(), act, async |sandbox| {
            let client = app.pool().client(&sandbox).await?;
            rsb::ops::slurm::jobs::kill_watched(app, &client, name, grace).await
        })
        .await;
    match r {
        Ok(k) if json => {
            print_json(&k);
            exit::OK
        }
        Ok(k) => {
            let s = |key: &str| k[key].as_str().unwrap_or_default().to_string();
            // The job's outcome, and Slurm's state for a Slurm job.
            let mut outcome = match (k["exit_code"].as_i64(), k["signal"].as_i64()) {
                (Some(c), _) => c.to_string(),
                (None, Some(sig)) => format!("signal {sig}"),
                _ => "-".into(),
            };
            if k.get("slurm_state").is_some() {
                outcome = format!("{outcome} (Slurm {})", s("slurm_state"));
            }
            println!(
                "{}  {}  {}",
                shown(&s("tmux_session")),
                s("state"),
                shown(&outcome)
            );
            exit::OK
        }
        Err(e) => fail(json, &job_error(name, e)),
    }
}

pub async fn run(ctx: &Ctx, cmd: JobsCmd) -> u8 {
    let json = ctx.json;
    // A start is checked against the policy before anything connects.
    if let JobsCmd::Start {
        name,
        cwd,
        log,
        yes,
        slurm,
        gpus,
        min_gpu_free_mem_gb,
        command,
    } = cmd
    {
        let need = match rsb::gpus::Need::parse(gpus, min_gpu_free_mem_gb) {
            Ok(n) => n,
            Err(e) => return fail(json, &e),
        };
        return start(ctx, (name, cwd, log), yes, slurm, need, command).await;
    }
    if let JobsCmd::Kill { name, grace, yes } = cmd {
        return kill(ctx, &name, grace, yes, json).await;
    }
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return fail(ctx.json, &e),
    };
    let on_slurm = ctx.app.pool().slurm(client.sandbox()).is_some();
    match cmd {
        JobsCmd::Start { .. } | JobsCmd::Kill { .. } => unreachable!("handled above"),
        JobsCmd::List if ctx.app.pool().slurm(client.sandbox()).is_some() => {
            match rsb::ops::slurm::jobs::list(&client).await {
                Ok(l) if json => {
                    print_json(&l);
                    exit::OK
                }
                Ok(l) => {
                    print_table(&SLURM_COLUMNS, &slurm_rows(&l));
                    exit::OK
                }
                Err(e) => fail(json, &e),
            }
        }
        JobsCmd::List => match jobs::list(&client).await {
            Ok(l) if json => {
                print_json(&l);
                exit::OK
            }
            Ok(l) => {
                let rows: Vec<Vec<String>> = l
                    .tasks
                    .iter()
                    .map(|t| {
                        vec![
                            t.tmux_session.clone(),
                            t.state.to_string(),
                            outcome(t),
                            format!("{:.0}s", t.duration_s),
                            t.command.clone().unwrap_or_default(),
                        ]
                    })
                    .collect();
                print_table(&["NAME", "STATE", "EXIT", "DURATION", "COMMAND"], &rows);
                exit::OK
            }
            Err(e) => fail(json, &e),
        },
        JobsCmd::Logs {
            name, follow: true, ..
        } => follow_logs(&client, on_slurm, &name).await,
        JobsCmd::Logs { name, lines, .. } => {
            let r = match jobs::status_request(&name, "", lines, None, 1) {
                Ok(req) => client.call(req).await.map_err(|e| job_error(&name, e)),
                Err(e) => Err(e),
            };
            match r {
                Ok(r) if r.info.is_none() => fail(json, &no_such_job(&name)),
                Ok(r) if !r.log_found && !json => fail(
                    false,
                    &log_gone(&name, r.info.as_ref().expect("checked above")),
                ),
                Ok(r) if json => match jobs::status_reply(&name, false, &r) {
                    Ok(v) => {
                        print_json(&v);
                        exit::OK
                    }
                    Err(e) => fail(true, &e),
                },
                Ok(r) => {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&r.log);
                    let _ = o.flush();
                    exit::OK
                }
                Err(e) => fail(json, &e),
            }
        }
        JobsCmd::Rm { name } => match remove(&client, on_slurm, &name).await {
            Ok(()) if json => {
                print_json(&serde_json::json!({"removed": [name]}));
                exit::OK
            }
            Ok(()) => {
                println!("{}", shown(&name));
                exit::OK
            }
            Err(e) => fail(json, &e),
        },
        JobsCmd::Prune { older_than } => prune(&client, on_slurm, json, older_than).await,
    }
}

/// `rsb jobs start` on a Slurm login node: submitted through sbatch by the same op as
/// `exec_bash_background`, with `--slurm`'s options over the sandbox's defaults.
/// `rsb jobs start`: one [`Act`] (the sandbox resolved once, the policy, one audit line) around
/// the job tools' launch ([`rsb::ops::slurm::jobs::start_any`]), then the job's name on
/// stdout and where it runs on stderr.
async fn start(
    ctx: &Ctx,
    (name, cwd, log): (Option<String>, Option<String>, Option<String>),
    yes: bool,
    slurm: Option<String>,
    need: Option<rsb::gpus::Need>,
    command: Vec<String>,
) -> u8 {
    let json = ctx.json;
    let job: Option<rsb::ops::slurm::SlurmOptions> = match slurm
        .as_deref()
        .map(serde_json::from_str)
    {
        None => None,
        Some(Ok(o)) => Some(o),
        Some(Err(e)) => {
            let e = RsbError::invalid(
                format!("--slurm is not valid: {e}"),
                "pass a JSON object such as '{\"partition\": \"gpu\", \"gpus\": 1, \"time\": \"2:00:00\"}'",
            );
            return fail(json, &e);
        }
    };
    // `-s auto` is resolved by `targets`; any other name must be configured.
    let requested = match ctx.sandbox.as_str() {
        "auto" => ctx.sandbox.clone(),
        _ => match ctx.resolve() {
            Ok(s) => s,
            Err(e) => return fail(json, &e),
        },
    };
    let line = super::command_line(&command);
    let pool = ctx.app.pool();
    let names = (
        name.as_deref().unwrap_or(""),
        log.as_deref().unwrap_or(""),
        cwd.as_deref().unwrap_or(""),
    );
    let mut placing = match rsb::ops::sandboxes::targets(pool, &requested, need.as_ref()).await {
        Ok(p) => p,
        Err(e) => return fail(json, &e),
    };
    let mut outcome = None;
    let mut sandbox = requested;
    for host in placing.hosts.clone() {
        sandbox = host;
        let act = Act {
            sandbox: &sandbox,
            tool: "rsb jobs start",
            command: Some(line.clone()),
            cwd: cwd.clone(),
            checked: vec![("command", line.clone())],
            ..Default::default()
        };
        let r = super::policy::caller(yes)
            .act(pool, act, async |sandbox| {
                let client = pool.client(&sandbox).await?;
                let (j, n) = (job.as_ref(), need.as_ref());
                rsb::ops::slurm::jobs::start_any(pool, &client, j, false, &line, names, n)
                    .await
                    .map(|l| l.reply)
            })
            .await;
        if !placing.refused(&sandbox, &r) {
            outcome = Some(r);
            break;
        }
    }
    let v = match outcome.unwrap_or_else(|| Err(placing.none_placed())) {
        Ok(v) => v,
        Err(e) => return fail(json, &e),
    };
    if json {
        print_json(&v);
        return exit::OK;
    }
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    println!("{}", shown(&s("tmux_session")));
    if v.get("slurm_job_id").is_some() {
        eprintln!(
            "rsb: submitted to Slurm on {sandbox} (job {}); log: {}",
            shown(&s("slurm_job_id")),
            shown(&s("log_file"))
        );
    } else {
        eprintln!(
            "rsb: started on {} ({}, pid {}); log: {}",
            s("sandbox"),
            s("runner"),
            v["pid"],
            shown(&s("log_file"))
        );
        if !s("note").is_empty() {
            eprintln!("rsb: {}", s("note"));
        }
    }
    exit::OK
}

/// `rsb jobs list` on a Slurm login node: the common columns, then Slurm's.
const SLURM_COLUMNS: [&str; 11] = [
    "NAME",
    "STATE",
    "EXIT",
    "DURATION",
    "SCHEDULER",
    "SLURM_JOB_ID",
    "SLURM_STATE",
    "PENDING_REASON",
    "NODE",
    "RESTARTS",
    "COMMAND",
];

/// The rows of [`SLURM_COLUMNS`] from `list_background_tasks`' reply (the same keys), `-`
/// where a key is absent.
fn slurm_rows(l: &serde_json::Value) -> Vec<Vec<String>> {
    let cell = |t: &serde_json::Value, k: &str| match &t[k] {
        serde_json::Value::Null => "-".to_string(),
        serde_json::Value::String(s) if s.is_empty() => "-".to_string(),
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    l["tasks"]
        .as_array()
        .map(|ts| {
            ts.iter()
                .map(|t| {
                    let exit = match (&t["exit_code"], &t["signal"]) {
                        (c, _) if c.is_i64() => c.to_string(),
                        (_, s) if s.is_i64() => format!("signal {s}"),
                        _ => "-".into(),
                    };
                    let duration = t["duration_s"]
                        .as_f64()
                        .map_or("-".into(), |d| format!("{d:.0}s"));
                    vec![
                        cell(t, "tmux_session"),
                        cell(t, "state"),
                        exit,
                        duration,
                        cell(t, "scheduler"),
                        cell(t, "slurm_job_id"),
                        cell(t, "slurm_state"),
                        cell(t, "pending_reason"),
                        cell(t, "node"),
                        cell(t, "restarts"),
                        cell(t, "command"),
                    ]
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `exit 0`, `signal 9`, `lost`, or `-` while running.
fn outcome(t: &jobs::JobSummary) -> String {
    match (t.exit_code, t.signal) {
        (Some(c), _) => c.to_string(),
        (None, Some(s)) => format!("signal {s}"),
        _ if t.state == "lost" => "lost".into(),
        _ => "-".into(),
    }
}

/// Delete an ended job's record on the host. The job name travels as an environment variable,
/// never spliced into the command line; a running job is refused.
/// `slurm`: the sandbox is a Slurm login node, where a job whose record reads as running may
/// be over by Slurm's word ([`ended_by_slurm`](rsb::ops::slurm::jobs::ended_by_slurm)).
async fn remove(client: &AgentClient, slurm: bool, name: &str) -> Result<(), RsbError> {
    let req = jobs::status_request(name, "", 1, None, 1)?;
    let st = client.call(req).await.map_err(|e| job_error(name, e))?;
    let Some(info) = st.info else {
        return Err(no_such_job(name));
    };
    if info.state == JobState::Running
        && !(slurm
            && rsb::ops::slurm::jobs::ended_by_slurm(client, name, FRESH)
                .await
                .is_some())
    {
        return Err(RsbError::invalid(
            format!("job `{name}` is still running"),
            format!("stop it first with `rsb jobs kill {name}`"),
        ));
    }
    delete_record(client, &info.name).await
}

/// Delete job `name`'s record on the host, the name in the environment; the caller knows the
/// job is over.
async fn delete_record(client: &AgentClient, name: &str) -> Result<(), RsbError> {
    let mut req = exec::build_request_ms(
        r#"rm -rf -- "$HOME/.cache/rsb/jobs/$RSB_JOB_NAME""#,
        None,
        30_000,
        4096,
    )?;
    req.env.push(("RSB_JOB_NAME".into(), name.to_string()));
    let r = client.call(req).await?;
    if r.exit_code != Some(0) {
        return Err(RsbError::new(
            Kind::Agent(ErrorCode::Io),
            format!(
                "cannot remove job `{name}`: {}",
                String::from_utf8_lossy(&r.stderr.head).trim()
            ),
            "check the permissions of ~/.cache/rsb/jobs on the sandbox",
        ));
    }
    Ok(())
}

/// `slurm`: on a Slurm login node a job whose record reads as running but which Slurm says
/// is over ([`ended_by_slurm`](rsb::ops::slurm::jobs::ended_by_slurm)) is pruned too, as
/// ended when it started.
async fn prune(client: &AgentClient, slurm: bool, json: bool, older_than: Option<Duration>) -> u8 {
    let all = match client.call(JobListRequest).await {
        Ok(j) => j,
        Err(e) => return fail(json, &e),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let min_age = older_than.map(|d| d.as_millis() as u64).unwrap_or(0);
    let mut removed = Vec::new();
    for j in &all {
        let ended = j.ended_ms.unwrap_or(j.started_ms);
        if now.saturating_sub(ended) < min_age {
            continue;
        }
        let over = j.state != JobState::Running
            || (slurm
                && rsb::ops::slurm::jobs::ended_by_slurm(client, &j.name, FRESH)
                    .await
                    .is_some());
        if !over {
            continue;
        }
        if let Err(e) = delete_record(client, &j.name).await {
            return fail(json, &e);
        }
        removed.push(j.name.clone());
    }
    if json {
        print_json(&serde_json::json!({ "removed": removed }));
    } else {
        for n in &removed {
            println!("{}", shown(n));
        }
        eprintln!("rsb: removed {} ended job(s)", removed.len());
    }
    exit::OK
}

/// `rsb wait [SANDBOX] JOB`: blocks until the job ends (the agent answers the moment the job's
/// supervisor records the end; nothing is polled), prints the run's last `lines` lines, and
/// exits with the job's code (128+signal; 4 when it was lost; 124 after `timeout`).
pub async fn wait(ctx: &Ctx, name: &str, timeout: Option<Duration>, lines: i64) -> u8 {
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return fail(ctx.json, &e),
    };
    let req = JobEventsRequest {
        names: vec![name.to_string()],
        since_ms: 0,
        until_ended: true,
        output_after: None,
    };
    let call = client.call(req);
    let ended = match timeout {
        Some(t) => match tokio::time::timeout(t, call).await {
            Ok(r) => r,
            Err(_) => {
                let e = RsbError::new(
                    Kind::Timeout,
                    format!(
                        "job `{}` is still running after {:.0} s",
                        shown(name),
                        t.as_secs_f64()
                    ),
                    "wait again, or `rsb jobs kill` it",
                );
                super::fail(ctx.json, &e);
                return exit::TIMEOUT;
            }
        },
        None => call.await,
    };
    let info = match ended.map(|mut v| v.pop()) {
        Ok(Some(info)) => info,
        Ok(None) => return fail(ctx.json, &no_such_job(name)),
        Err(e) => return fail(ctx.json, &job_error(name, e)),
    };
    if lines > 0
        && let Ok(req) = jobs::status_request(name, "", lines, None, jobs::MAX_CURSOR_BYTES)
        && let Ok(r) = client.call(req).await
        && !ctx.json
    {
        let mut o = std::io::stdout().lock();
        let _ = o
            .write_all(rsb_protocol::job_output(&r.log))
            .and_then(|()| o.flush());
    }
    let took = info
        .ended_ms
        .map(|e| Duration::from_millis(e.saturating_sub(info.started_ms)));
    if ctx.json {
        print_json(&serde_json::json!({
            "name": info.name, "state": format!("{:?}", info.state).to_lowercase(),
            "exit_code": info.exit_code, "signal": info.signal,
            "started_ms": info.started_ms, "ended_ms": info.ended_ms,
        }));
    }
    let after = took.map_or(String::new(), |d| {
        format!(" after {:.1} s", d.as_secs_f64())
    });
    match (info.state, info.exit_code, info.signal) {
        (JobState::Lost, _, _) => {
            super::warn(&format!(
                "job `{}` ended without an exit record (lost: its supervisor vanished)",
                shown(name)
            ));
            exit::REMOTE
        }
        (_, Some(c), _) => {
            eprintln!("rsb: job `{}` exited {c}{after}", shown(name));
            c.clamp(0, 255) as u8
        }
        (_, None, Some(sig)) => {
            eprintln!(
                "rsb: job `{}` was killed by signal {sig}{after}",
                shown(name)
            );
            (128 + sig).clamp(0, 255) as u8
        }
        _ => exit::REMOTE,
    }
}

/// Print the log from the start, then every new byte, until the job ends (polling every
/// 0.5 s); exit with the job's code, or 128+signal. On a Slurm login node (`slurm`) the job
/// also ends when Slurm says it is over though its record never will (a wrapper killed on
/// its compute node): asked every [`SLURM_ASK_EVERY`] polls, from the shared poller.
async fn follow_logs(client: &AgentClient, slurm: bool, name: &str) -> u8 {
    let mut offset = 0i64;
    let mut polls = 0u32;
    loop {
        let req = match jobs::status_request(name, "", 1, Some(offset), jobs::MAX_CURSOR_BYTES) {
            Ok(r) => r,
            Err(e) => return fail(false, &e),
        };
        let r = match client.call(req).await {
            Ok(r) => r,
            Err(e) => return fail(false, &job_error(name, e)),
        };
        let Some(info) = r.info.as_ref() else {
            return fail(false, &no_such_job(name));
        };
        if !r.log_found {
            return fail(false, &log_gone(name, info));
        }
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(&r.log);
        let _ = o.flush();
        drop(o);
        offset = r.next_offset as i64;
        if info.state != JobState::Running && !r.log_truncated {
            return match (info.exit_code, info.signal) {
                (Some(c), _) => c.clamp(0, 255) as u8,
                (None, Some(s)) => (128 + s).clamp(0, 255) as u8,
                _ => {
                    super::warn(&format!("job `{name}` ended without an exit record (lost)"));
                    exit::REMOTE
                }
            };
        }
        polls += 1;
        if slurm
            && polls.is_multiple_of(SLURM_ASK_EVERY)
            && !r.log_truncated
            && let Some(why) =
                rsb::ops::slurm::jobs::ended_by_slurm(client, name, Duration::MAX).await
        {
            super::warn(&format!(
                "job `{name}` was ended by Slurm ({why}) before its wrapper recorded an exit"
            ));
            return exit::REMOTE;
        }
        if !r.log_truncated {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// `rsb jobs logs -f` on a Slurm login node asks Slurm every this many polls (2 s, the
/// poller's tick; the poller answers from its last poll while nothing changes, at its pace).
const SLURM_ASK_EVERY: u32 = 4;
