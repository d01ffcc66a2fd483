//! What a sandbox's CPU, memory, disk and GPUs look like to a caller choosing where to run:
//! the agent's raw snapshot shaped into the seed's keys, and the idle score.

use rsb_protocol::ResourceSnapshot;
use serde::Serialize;

const MIB: f64 = 1024.0 * 1024.0;

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
    /// How long ago rsb received this sample from the agent: 0 when it was fetched for this
    /// reply, more when a recent one was reused (`list_sandboxes` reuses samples under 1 s old).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample_age_ms: Option<u64>,
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
    pub uuid: String,
    /// The rsb job whose lease holds this GPU (placement skips it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leased_by: Option<Holder>,
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
    #[serde(flatten)]
    pub who: Holder,
}

/// A process's user and, when it runs under an rsb job, the job's name (from the host's
/// `/proc`: a label, not an authority).
#[derive(Debug, Clone, Serialize)]
pub struct Holder {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
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
            uuid: g.uuid.clone(),
            leased_by: g.lease.as_ref().map(|l| Holder {
                pid: Some(l.pid),
                uid: l.uid,
                job: l.job.clone(),
            }),
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
                    who: Holder {
                        pid: None,
                        uid: p.uid,
                        job: p.job.clone(),
                    },
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
        sample_age_ms: None,
    }
}
