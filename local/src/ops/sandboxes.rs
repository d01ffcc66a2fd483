//! `list_sandboxes`, `select_sandbox` (including `"auto"`), `get_active_sandbox`.
//!
//! Every sandbox is queried in parallel with its own deadline, so one dead host costs the
//! caller at most that deadline, not the sum over hosts.

use std::time::Duration;

use futures::future::join_all;
use rsb_protocol::{PingRequest, ResourceSnapshot, ResourcesRequest};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::{
    error::{Kind, Result, RsbError},
    pool::Pool,
};

const MIB: f64 = 1024.0 * 1024.0;

/// Deadline for getting a client: connect, authenticate and deploy if needed; instant when the
/// pool already holds a connection.
fn connect_deadline(pool: &Pool, name: &str) -> Duration {
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
    connect_deadline(pool, name) + ROUND_TRIP_DEADLINE
}

pub struct Probe {
    pub name: String,
    pub alive: bool,
    pub error: Option<RsbError>,
    pub resources: Option<std::result::Result<ResourceSnapshot, RsbError>>,
}

fn no_answer(name: &str, what: &str, after: Duration) -> RsbError {
    RsbError::new(
        Kind::Timeout,
        format!(
            "sandbox '{name}' did not {what} within {}s",
            after.as_secs_f64()
        ),
        "the host may be down or the network black-holed; other sandboxes are unaffected",
    )
}

/// Check one sandbox, optionally sampling its resources, within its deadlines: one for getting
/// a client ([`connect_deadline`]), one for the round trips on it ([`ROUND_TRIP_DEADLINE`]).
pub async fn probe(pool: &Pool, name: &str, with_resources: bool) -> Probe {
    let dead = |e: RsbError| Probe {
        name: name.into(),
        alive: false,
        error: Some(e.clone()),
        resources: with_resources.then_some(Err(e)),
    };
    let connect = connect_deadline(pool, name);
    let client = match tokio::time::timeout(connect, pool.client(name)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return dead(e),
        Err(_) => return dead(no_answer(name, "connect", connect)),
    };
    let round_trips = async {
        client
            .call(PingRequest {
                payload: Vec::new(),
            })
            .await?;
        if !with_resources {
            return Ok(None);
        }
        // A failed resources request on a live agent is that sandbox's resources error, not
        // a dead connection.
        Ok(Some(
            client
                .call(ResourcesRequest {
                    max_wait_ms: RESOURCES_MAX_WAIT.as_millis() as u64,
                })
                .await,
        ))
    };
    match tokio::time::timeout(ROUND_TRIP_DEADLINE, round_trips).await {
        Ok(Ok(resources)) => Probe {
            name: name.into(),
            alive: true,
            error: None,
            resources,
        },
        Ok(Err(e)) => dead(e),
        Err(_) => dead(no_answer(name, "answer", ROUND_TRIP_DEADLINE)),
    }
}

pub async fn probe_all(pool: &Pool, with_resources: bool) -> Vec<Probe> {
    join_all(pool.names().iter().map(|n| probe(pool, n, with_resources))).await
}

/// The seed's idle score: 0 = fully busy, 1 = idle. CPU is real utilisation over the last
/// sampling interval (the seed used load average / cores, which lags by minutes).
pub fn idle_score(s: &ResourceSnapshot) -> f64 {
    let cpu = (s.cpu.usage_pct as f64 / 100.0).clamp(0.0, 1.0);
    let mem = mem_used_pct(s) / 100.0;
    let utils: Vec<f64> = s
        .gpu
        .gpus
        .iter()
        .filter_map(|g| g.util_pct)
        .map(|u| u as f64)
        .collect();
    let gpu = if utils.is_empty() {
        0.0
    } else {
        (utils.iter().sum::<f64>() / utils.len() as f64 / 100.0).clamp(0.0, 1.0)
    };
    let score = (1.0 - cpu) * 0.4 + (1.0 - mem.clamp(0.0, 1.0)) * 0.4 + (1.0 - gpu) * 0.2;
    (score * 1000.0).round() / 1000.0
}

fn mem_used_pct(s: &ResourceSnapshot) -> f64 {
    let t = s.memory.total_bytes as f64;
    if t <= 0.0 {
        return 0.0;
    }
    let used = s
        .memory
        .total_bytes
        .saturating_sub(s.memory.available_bytes) as f64;
    ((used / t * 100.0) * 10.0).round() / 10.0
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// The agent's GPU readings are f32; widened as they are, 123.45 W would print as
/// 123.44999694824219.
fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Seed keys (`cpu.load_*`, `memory.*_mb`, `gpu[]`, `idle_score`) plus real CPU %, swap,
/// disk, GPU names/temperature/power/processes and where the GPU data came from.
#[derive(Debug, Clone, Serialize)]
pub struct Resources {
    pub cpu: Cpu,
    pub memory: Memory,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<Disk>,
    pub gpu: Vec<Gpu>,
    pub gpu_source: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_note: Option<String>,
    pub uptime_s: u64,
    /// 0 = fully busy, 1 = idle.
    pub idle_score: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Cpu {
    pub usage_pct: f64,
    pub load_1m: f64,
    pub load_5m: f64,
    pub load_15m: f64,
    pub count: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    pub total_mb: u64,
    pub used_mb: u64,
    pub free_mb: u64,
    pub used_pct: f64,
    pub swap_total_mb: u64,
    pub swap_used_mb: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Disk {
    pub path: String,
    pub total_gb: f64,
    pub free_gb: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub util_pct: Option<f64>,
    pub mem_used_mb: Option<u64>,
    pub mem_total_mb: Option<u64>,
    pub mem_used_pct: Option<f64>,
    pub temperature_c: Option<f64>,
    pub power_w: Option<f64>,
    pub processes: Vec<GpuProcess>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub mem_used_mb: Option<u64>,
}

pub fn resources(s: &ResourceSnapshot) -> Resources {
    let total = s.memory.total_bytes;
    let used = total.saturating_sub(s.memory.available_bytes);
    let gpu = s
        .gpu
        .gpus
        .iter()
        .map(|g| Gpu {
            index: g.index,
            name: g.name.clone(),
            util_pct: g.util_pct.map(|v| round1(v as f64)),
            mem_used_mb: g.mem_used_mib,
            mem_total_mb: g.mem_total_mib,
            mem_used_pct: match (g.mem_used_mib, g.mem_total_mib) {
                (Some(u), Some(t)) if t > 0 => Some(round1(u as f64 / t as f64 * 100.0)),
                _ => None,
            },
            temperature_c: g.temperature_c.map(|v| round1(v as f64)),
            power_w: g.power_w.map(|v| round2(v as f64)),
            processes: s
                .gpu
                .processes
                .iter()
                .filter(|p| p.gpu_uuid == g.uuid)
                .map(|p| GpuProcess {
                    pid: p.pid,
                    mem_used_mb: p.used_mem_mib,
                })
                .collect(),
        })
        .collect();
    Resources {
        cpu: Cpu {
            usage_pct: round1(s.cpu.usage_pct as f64),
            load_1m: s.cpu.load_1m,
            load_5m: s.cpu.load_5m,
            load_15m: s.cpu.load_15m,
            count: s.cpu.count,
        },
        memory: Memory {
            total_mb: (total as f64 / MIB).round() as u64,
            used_mb: (used as f64 / MIB).round() as u64,
            free_mb: (s.memory.available_bytes as f64 / MIB).round() as u64,
            used_pct: mem_used_pct(s),
            swap_total_mb: (s.memory.swap_total_bytes as f64 / MIB).round() as u64,
            swap_used_mb: (s.memory.swap_used_bytes as f64 / MIB).round() as u64,
        },
        disk: s.disk.as_ref().map(|d| Disk {
            path: d.path.clone(),
            total_gb: round1(d.total_bytes as f64 / 1e9),
            free_gb: round1(d.free_bytes as f64 / 1e9),
        }),
        gpu,
        gpu_source: s.gpu.source.as_str(),
        gpu_note: s.gpu.note.clone(),
        uptime_s: s.uptime_s,
        idle_score: idle_score(s),
    }
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
    pub connection_alive: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connection_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesOrError>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SandboxList {
    pub active_sandbox: Option<String>,
    pub sandboxes: Vec<SandboxStatus>,
}

pub async fn list(pool: &Pool, check_resources: bool) -> SandboxList {
    let active = pool.active();
    let probes = probe_all(pool, check_resources).await;
    let sandboxes = probes
        .iter()
        .map(|p| {
            let (host, port, user) = pool.describe(&p.name);
            SandboxStatus {
                name: p.name.clone(),
                host,
                port,
                user,
                is_active: active.as_deref() == Some(p.name.as_str()),
                connection_alive: p.alive,
                connection_error: p.error.as_ref().map(|e| e.message.clone()),
                resources: p.resources.as_ref().map(|r| match r {
                    Ok(s) => ResourcesOrError::Ok(Box::new(resources(s))),
                    Err(e) => ResourcesOrError::Err(e.into()),
                }),
            }
        })
        .collect();
    SandboxList {
        active_sandbox: active,
        sandboxes,
    }
}

/// `"auto"` picks the idlest reachable sandbox (unless a sandbox is literally named `auto`).
pub async fn select(pool: &Pool, name: &str) -> Result<Value> {
    if name == "auto" && pool.sandbox_config("auto").is_none() {
        let probes = probe_all(pool, true).await;
        let mut scored: Vec<(String, f64)> = Vec::new();
        let mut others: Vec<String> = Vec::new();
        for p in &probes {
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
                "select_sandbox(\"auto\"): no sandbox is reachable",
                "list_sandboxes shows each sandbox's connection error",
            ));
        };
        pool.select(&best)?;
        let mut rest: Vec<String> = scored
            .iter()
            .skip(1)
            .map(|(n, s)| format!("{n} {s}"))
            .collect();
        rest.extend(others);
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

pub async fn get_active(pool: &Pool) -> Value {
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
    m.insert("connection_alive".into(), json!(p.alive));
    if let Some(e) = p.error {
        m.insert("connection_error".into(), json!(e.message));
    }
    Value::Object(m)
}
