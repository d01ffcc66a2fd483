//! `list_sandboxes`, `select_sandbox` (including `"auto"`), `get_active_sandbox`.
//!
//! Every sandbox is queried in parallel with its own deadline, so one dead host costs the
//! caller at most that deadline, not the sum over hosts.

use std::{sync::Arc, time::Duration};

use futures::future::join_all;
use rsb_protocol::{PingRequest, ResourceSnapshot, ResourcesRequest};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::{
    error::{Kind, Result, RsbError},
    gpus,
    ops::resources::{Resources, idle_score, resources},
    pool::Pool,
};

/// Deadline for getting a client: connect, authenticate and deploy if needed; instant when the
/// pool already holds a connection. `rsb doctor` waits this long; a probe only [`PROBE_WAIT`].
pub fn connect_deadline(pool: &Pool, name: &str) -> Duration {
    let connect = pool
        .sandbox_config(name)
        .and_then(|c| match &c.transport {
            crate::config::Transport::Ssh(t) => Some(t.connect_timeout),
            crate::config::Transport::Local => None,
        })
        .unwrap_or(Duration::from_secs(10));
    // Two connect phases (TCP+kex, auth) plus a possible first deploy.
    connect * 2 + Duration::from_secs(10)
}

/// How long the ping plus (optionally) the resources request may take once a client is in hand.
/// A live agent answers both in milliseconds; the agent caps a resources request's wait for its
/// first CPU interval at [`RESOURCES_MAX_WAIT`], and the rest is room for a few slow round trips.
/// Without this separate bound a warm connection whose link went silent (no FIN, no RST) held
/// the whole listing until SSH keep-alives gave up (about 12 s), or the connect deadline.
pub const ROUND_TRIP_DEADLINE: Duration = Duration::from_secs(3);
const RESOURCES_MAX_WAIT: Duration = Duration::from_millis(1000);

/// The longest one sandbox can hold up `list_sandboxes` / `select_sandbox("auto")`.
pub fn probe_deadline(pool: &Pool, name: &str) -> Duration {
    PROBE_WAIT.min(connect_deadline(pool, name)) + ROUND_TRIP_DEADLINE
}

/// How old a sandbox's last resources sample may be for `list_sandboxes` to answer with it
/// instead of asking the agent again. The agent itself refreshes its CPU reading once a second,
/// so a round trip could return a reading of about this age anyway; the reply says how old each
/// sample is (`resources.sample_age_ms`).
pub const RESOURCES_FRESH: Duration = Duration::from_secs(1);

/// What a `local` sandbox is, in the words every surface uses.
pub const THIS_MACHINE_NOTE: &str =
    "this machine: commands run on the computer rsb itself runs on, not on a remote host over SSH";

pub struct Probe {
    pub name: String,
    pub alive: bool,
    pub error: Option<RsbError>,
    pub resources: Option<std::result::Result<ResourceSnapshot, RsbError>>,
    /// How long ago the resources sample arrived, when it was not fetched for this call.
    pub sample_age: Option<Duration>,
}

fn no_answer(name: &str, what: &str, after: Duration) -> RsbError {
    RsbError::new(
        Kind::Timeout,
        format!(
            "sandbox '{name}' did not {what} within {}s",
            after.as_secs_f64()
        ),
        "the host may be down, black-holed, or accept TCP without speaking SSH; other sandboxes are unaffected; a slow host needs a larger connect_timeout_s in its sandbox entry",
    )
}

/// A failure from [`FAILURE_MEMORY`], as a listing reports it.
fn remembered(why: &str, age: Duration) -> RsbError {
    RsbError::new(
        Kind::Connect,
        format!(
            "{why} (remembered from {}s ago; retried {}s after the failure)",
            age.as_secs(),
            FAILURE_MEMORY.as_secs()
        ),
        "exec_bash on this sandbox connects again at once",
    )
}

/// A probe that stopped waiting while the connect goes on.
fn still_connecting(pool: &Pool, name: &str, waited: Duration) -> RsbError {
    let timeout = pool
        .sandbox_config(name)
        .and_then(|c| match &c.transport {
            crate::config::Transport::Ssh(t) => Some(t.connect_timeout),
            crate::config::Transport::Local => None,
        })
        .unwrap_or_default();
    RsbError::new(
        Kind::Timeout,
        format!(
            "sandbox '{name}' did not connect within the probe's {}s (its connect_timeout_s is {}s)",
            waited.as_secs(),
            timeout.as_secs()
        ),
        "the host may be down, black-holed, or accept TCP without speaking SSH; other sandboxes are unaffected; the MCP server keeps connecting in the background (a slow host is connected by a later call), and `rsb doctor` waits the whole connect_timeout_s",
    )
}

/// How long a failed probe is remembered: listings and `select_sandbox("auto")` in that time
/// answer with its reason at once instead of waiting on the same hung host again (a port that
/// accepts TCP and never speaks SSH held every listing for the whole connect timeout).
pub const FAILURE_MEMORY: Duration = Duration::from_secs(30);

/// How long a probe (`list_sandboxes(check_resources=true)`, `select_sandbox("auto")`,
/// `get_active_sandbox`) waits for a connection. Short and of its own, not `connect_timeout_s`
/// (15 s by default): a port that accepts TCP and never speaks SSH held every listing for that
/// long. A cold connect with the agent's first upload takes under 2 s on a LAN (100 sandboxes at
/// once: 1.7 s), so a host still connecting after this is reported as such, and its connect goes
/// on in the background under its own deadline: a slow host is connected by the next call, and
/// a hung one's real error replaces the probe's.
pub const PROBE_WAIT: Duration = Duration::from_secs(5);

/// Check one sandbox, optionally sampling its resources, within its deadlines: [`PROBE_WAIT`]
/// for getting a client (the connect itself runs on under [`connect_deadline`]), then
/// [`ROUND_TRIP_DEADLINE`] for the round trips on it.
pub async fn probe(pool: &Arc<Pool>, name: &str, with_resources: bool) -> Probe {
    let dead = |e: RsbError| Probe {
        name: name.into(),
        alive: false,
        error: Some(e.clone()),
        resources: with_resources.then_some(Err(e)),
        sample_age: None,
    };
    if let Some((why, age)) = pool.recent_failure(name, FAILURE_MEMORY) {
        return dead(remembered(&why, age));
    }
    let dead = |e: RsbError| {
        pool.remember_failure(name, &e.message);
        dead(e)
    };
    let connect = connect_deadline(pool, name);
    // Spawned, so that giving up waiting does not cancel the connect.
    let dial = {
        let (pool, name) = (pool.clone(), name.to_string());
        tokio::spawn(async move {
            let r = match tokio::time::timeout(connect, pool.client_with_generation(&name)).await {
                Ok(r) => r,
                Err(_) => Err(no_answer(&name, "connect", connect)),
            };
            if let Err(e) = &r {
                pool.remember_failure(&name, &e.message);
            }
            r
        })
    };
    let wait = PROBE_WAIT.min(connect);
    let (client, generation) = match tokio::time::timeout(wait, dial).await {
        Ok(Ok(Ok(c))) => c,
        Ok(Ok(Err(e))) => return dead(e),
        Ok(Err(join)) => {
            return dead(RsbError::new(
                Kind::Internal,
                format!("connecting to sandbox '{name}' failed inside rsb: {join}"),
                "the next call connects again; please report this",
            ));
        }
        Err(_) => return dead(still_connecting(pool, name, wait)),
    };
    // The ping and the resources request go out together: one round trip, not two.
    let ping = client.call(PingRequest {
        payload: Vec::new(),
    });
    let round_trips = async {
        if !with_resources {
            return ping.await.map(|_| None);
        }
        let sample = client.call(ResourcesRequest {
            max_wait_ms: RESOURCES_MAX_WAIT.as_millis() as u64,
        });
        let (ping, sample) = tokio::join!(ping, sample);
        ping?;
        // A failed resources request on a live agent is that sandbox's resources error, not
        // a dead connection.
        Ok::<_, RsbError>(Some(sample))
    };
    match tokio::time::timeout(ROUND_TRIP_DEADLINE, round_trips).await {
        Ok(Ok(resources)) => {
            if let Some(Ok(s)) = &resources {
                pool.store_sample(name, generation, s);
            }
            Probe {
                name: name.into(),
                alive: true,
                error: None,
                resources,
                sample_age: None,
            }
        }
        Ok(Err(e)) => dead(e),
        Err(_) => dead(no_answer(name, "answer", ROUND_TRIP_DEADLINE)),
    }
}

/// [`probe`], answered without any I/O when the sandbox's connection is up and its last sample
/// is younger than [`RESOURCES_FRESH`]: a live channel fails within the heartbeat's bound when
/// its link dies, so "connected, sampled under a second ago" is as good as a ping.
pub async fn probe_fresh(pool: &Arc<Pool>, name: &str, with_resources: bool) -> Probe {
    if with_resources && let Some((s, age)) = pool.fresh_sample(name, RESOURCES_FRESH) {
        return Probe {
            name: name.into(),
            alive: true,
            error: None,
            resources: Some(Ok(s)),
            sample_age: Some(age),
        };
    }
    probe(pool, name, with_resources).await
}

/// Every sandbox at once, each within its own deadline (no fan-out bound here: one dead host
/// must never queue another behind it; the connect step bounds its own handshakes per host).
pub async fn probe_all(pool: &Arc<Pool>, with_resources: bool) -> Vec<Probe> {
    join_all(pool.names().iter().map(|n| probe(pool, n, with_resources))).await
}

/// A failure as MCP replies carry it.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorReply {
    pub error: String,
    pub hint: String,
}

impl From<&RsbError> for ErrorReply {
    fn from(e: &RsbError) -> Self {
        ErrorReply {
            error: e.message.clone(),
            hint: e.hint.clone(),
        }
    }
}

/// A sandbox's resources, or why they could not be sampled.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum ResourcesOrError {
    Ok(Box<Resources>),
    Err(ErrorReply),
}

/// One row of `list_sandboxes` / `rsb sandboxes`.
#[derive(Debug, Clone, Serialize)]
pub struct SandboxStatus {
    pub name: String,
    pub host: String,
    pub port: u16,
    pub user: String,
    pub is_active: bool,
    /// A `local` sandbox runs commands on this machine, the one rsb runs on: said in every
    /// row so a model (or a user with a misconfigured server) never mistakes it for a remote.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub this_machine: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<&'static str>,
    pub connection_alive: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connection_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesOrError>,
    /// The Landlock ABI the host's kernel serves (0: none), when it was reached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub landlock_abi: Option<u32>,
    /// A confined sandbox's `confine`, and whether this host enforces it
    /// (`ConfineRules::status_on`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confine: Option<String>,
    /// A Slurm login node's partitions, GPUs and queue (`crate::ops::slurm::resources`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slurm: Option<Value>,
    /// What the first connect noticed about the host: a Slurm login node not declared
    /// `scheduler = "slurm"`, and how to declare it (`crate::slurm::discover`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SandboxList {
    pub active_sandbox: Option<String>,
    pub sandboxes: Vec<SandboxStatus>,
}

/// How deep a listing looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// A ping to each (connecting as needed, within [`PROBE_WAIT`]).
    Probe,
    /// A ping and a resources sample from each.
    Resources,
}

pub async fn list(pool: &Arc<Pool>, depth: Listing) -> SandboxList {
    let active = pool.active();
    let probes = join_all(pool.names().iter().map(|n| async move {
        match depth {
            Listing::Probe => probe(pool, n, false).await,
            Listing::Resources => probe_fresh(pool, n, true).await,
        }
    }))
    .await;
    let sandboxes = probes
        .iter()
        .map(|p| {
            let (host, port, user) = pool.describe(&p.name);
            let this_machine = pool.is_local(&p.name);
            let landlock_abi = p.alive.then(|| pool.landlock_abi(&p.name)).flatten();
            SandboxStatus {
                name: p.name.clone(),
                host,
                port,
                user,
                is_active: active.as_deref() == Some(p.name.as_str()),
                this_machine,
                note: this_machine.then_some(THIS_MACHINE_NOTE),
                connection_alive: p.alive,
                connection_error: p.error.as_ref().map(|e| e.message.clone()),
                resources: p.resources.as_ref().map(|r| match r {
                    Ok(s) => {
                        let mut r = resources(s);
                        r.sample_age_ms = Some(
                            p.sample_age
                                .map_or(0, |a| u64::try_from(a.as_millis()).unwrap_or(u64::MAX)),
                        );
                        ResourcesOrError::Ok(Box::new(r))
                    }
                    Err(e) => ResourcesOrError::Err(e.into()),
                }),
                landlock_abi,
                confine: pool
                    .sandbox_config(&p.name)
                    .and_then(|c| c.confine.as_ref())
                    .map(|c| c.status_on(landlock_abi)),
                slurm: None,
                hint: pool.hint(&p.name),
            }
        })
        .collect::<Vec<_>>();
    let mut sandboxes = sandboxes;
    if depth == Listing::Resources {
        for row in sandboxes.iter_mut().filter(|r| r.connection_alive) {
            if pool.slurm(&row.name).is_some() {
                row.slurm = Some(match slurm_resources(pool, &row.name).await {
                    Ok(r) => serde_json::to_value(r).unwrap_or_default(),
                    Err(e) => json!({"error": e.message, "hint": e.hint}),
                });
            }
        }
    }
    SandboxList {
        active_sandbox: active,
        sandboxes,
    }
}

async fn slurm_resources(
    pool: &Arc<Pool>,
    name: &str,
) -> Result<crate::ops::slurm::resources::SlurmResources> {
    let c = pool.client(name).await?;
    crate::ops::slurm::resources::get(&c).await
}

/// The idlest reachable sandbox and its idle score (a Slurm login node scores as its
/// cluster's free GPUs and CPUs), with the others as `name score` or why they are not
/// candidates.
pub async fn idlest(pool: &Arc<Pool>) -> Result<(String, f64, Vec<String>)> {
    let probes = probe_all(pool, true).await;
    let mut scored: Vec<(String, f64)> = Vec::new();
    let mut others: Vec<String> = Vec::new();
    for p in &probes {
        if p.alive
            && pool.slurm(&p.name).is_some()
            && let Ok(r) = slurm_resources(pool, &p.name).await
        {
            // A cluster is as idle as its free GPUs and CPUs, not as its login node.
            scored.push((p.name.clone(), r.idle_score));
            continue;
        }
        match &p.resources {
            Some(Ok(s)) => scored.push((p.name.clone(), idle_score(s))),
            // Reachable, but its agent could not sample: not a candidate, and not "down".
            Some(Err(e)) if p.alive => {
                others.push(format!("{} has no resource data ({})", p.name, e.message))
            }
            _ => others.push(format!("{} unreachable", p.name)),
        }
    }
    scored.sort_by(|a, b| b.1.total_cmp(&a.1));
    let Some((best, score)) = scored.first().cloned() else {
        return Err(RsbError::new(
            Kind::Connect,
            "sandbox \"auto\": no sandbox is reachable",
            "list_sandboxes shows each sandbox's connection error",
        ));
    };
    let mut rest: Vec<String> = scored
        .iter()
        .skip(1)
        .map(|(n, s)| format!("{n} {s}"))
        .collect();
    rest.extend(others);
    Ok((best, score, rest))
}

/// `"auto"` picks the idlest reachable sandbox (unless a sandbox is literally named `auto`).
pub async fn select(pool: &Arc<Pool>, name: &str) -> Result<Value> {
    if name == "auto" && pool.sandbox_config("auto").is_none() {
        let (best, score, rest) = idlest(pool).await?;
        pool.select(&best)?;
        return Ok(json!({
            "active_sandbox": best,
            "status": "selected",
            "idle_score": score,
            "reason": format!(
                "idlest reachable sandbox (idle_score {score}{})",
                if rest.is_empty() { String::new() } else { format!("; others: {}", rest.join(", ")) }
            ),
        }));
    }
    pool.select(name)?;
    Ok(json!({"active_sandbox": name, "status": "selected"}))
}

pub async fn get_active(pool: &Arc<Pool>) -> Value {
    let Some(active) = pool.active() else {
        return json!({"active_sandbox": Value::Null, "error": "No active sandbox configured"});
    };
    let p = probe(pool, &active, false).await;
    let (host, port, user) = pool.describe(&active);
    let mut m = Map::new();
    m.insert("active_sandbox".into(), json!(active));
    m.insert("host".into(), json!(host));
    m.insert("port".into(), json!(port));
    m.insert("user".into(), json!(user));
    if pool.is_local(&active) {
        m.insert("this_machine".into(), json!(true));
        m.insert("note".into(), json!(THIS_MACHINE_NOTE));
    }
    m.insert("connection_alive".into(), json!(p.alive));
    if let Some(e) = p.error {
        m.insert("connection_error".into(), json!(e.message));
    }
    Value::Object(m)
}

/// `sandbox_name: "auto"` with GPUs: every reachable sandbox that is not a Slurm login node
/// (Slurm places its own jobs) with at least `need.count` candidates, best first: most free
/// memory over its best `count` GPUs, then the idlest. Too few anywhere: a Busy error that
/// says what is free where.
pub async fn gpu_hosts(pool: &Arc<Pool>, need: &gpus::Need) -> Result<Vec<String>> {
    let probes = probe_all(pool, true).await;
    let mut fit: Vec<(String, u64, f64)> = Vec::new();
    let mut seen = Vec::new();
    for p in probes {
        if pool.slurm(&p.name).is_some() {
            seen.push(format!(
                "{} is a Slurm login node (name it to submit)",
                p.name
            ));
            continue;
        }
        let r = match p.resources {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                seen.push(format!("{}: {}", p.name, e.message));
                continue;
            }
            None => continue,
        };
        let c = gpus::candidates(&r.gpu, need);
        if c.len() >= need.count as usize {
            let free = c[..need.count as usize]
                .iter()
                .filter_map(|g| gpus::free_mib(g))
                .sum();
            fit.push((p.name.clone(), free, idle_score(&r)));
        } else {
            seen.push(format!("{} has {}", p.name, gpus::describe(&r.gpu, need)));
        }
    }
    if fit.is_empty() {
        let where_ = match seen.is_empty() {
            true => "no sandbox is configured".to_string(),
            false => seen.join("; "),
        };
        return Err(gpus::too_few(need, &where_));
    }
    fit.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then(a.0.cmp(&b.0)));
    Ok(fit.into_iter().map(|(name, ..)| name).collect())
}

/// Where to try a start on the sandbox `name`: that sandbox, or for `"auto"` (unless a
/// sandbox is named so) every fitting one, best first: with `need`, those [`gpu_hosts`] ranks;
/// without, the idlest. A caller tries them in order while [`gpus::Placing::refused`] says to go on:
/// the one path of `exec_bash_background` and `rsb jobs start`.
pub async fn targets(
    pool: &Arc<Pool>,
    name: &str,
    need: Option<&gpus::Need>,
) -> Result<gpus::Placing> {
    if name != "auto" || pool.sandbox_config("auto").is_some() {
        return Ok(gpus::Placing::new(vec![name.to_string()]));
    }
    let hosts = match need {
        Some(need) => gpu_hosts(pool, need).await?,
        None => vec![idlest(pool).await?.0],
    };
    Ok(gpus::Placing::new(hosts))
}
