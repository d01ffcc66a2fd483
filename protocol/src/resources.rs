//! A load snapshot of one host, so a caller can pick the idlest machine.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResourcesRequest {
    /// Wait (up to this long) for a first real CPU interval when the sampler has just started,
    /// instead of answering with a zero-length measurement.
    pub max_wait_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuInfo {
    /// Utilisation over the last sampling interval, 0–100, across all cores.
    pub usage_pct: f32,
    pub count: u32,
    pub load_1m: f64,
    pub load_5m: f64,
    pub load_15m: f64,
    /// Length of the interval `usage_pct` was measured over (0 = not yet measured).
    pub interval_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryInfo {
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub available_bytes: u64,
    pub swap_total_bytes: u64,
    pub swap_used_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DiskInfo {
    pub path: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuSource {
    Nvml,
    NvidiaSmi,
    #[default]
    None,
}

impl GpuSource {
    pub fn as_str(self) -> &'static str {
        match self {
            GpuSource::Nvml => "nvml",
            GpuSource::NvidiaSmi => "nvidia-smi",
            GpuSource::None => "none",
        }
    }
}

/// One GPU. Fields that the driver reports as `[N/A]` are `None`, not zero.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub util_pct: Option<f32>,
    pub mem_used_mib: Option<u64>,
    pub mem_total_mib: Option<u64>,
    pub temperature_c: Option<f32>,
    pub power_w: Option<f32>,
    /// The rsb job that holds this GPU's lease (see [`crate::GpuAsk`]), at the time of the report.
    pub lease: Option<GpuHolder>,
}

/// A process on the host as rsb sees it: its user and, when it is (or runs under) an rsb job's
/// wrapper, the job's name. Read from `/proc`, so any local user can fake a job name: it is a
/// label for the report, never an authority.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuHolder {
    pub pid: u32,
    pub uid: Option<u32>,
    pub job: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub gpu_uuid: String,
    pub used_mem_mib: Option<u64>,
    /// Its user and rsb job, where `/proc` shows them.
    pub uid: Option<u32>,
    pub job: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuReport {
    pub source: GpuSource,
    pub gpus: Vec<GpuInfo>,
    pub processes: Vec<GpuProcess>,
    /// Why the data is missing or partial (nvidia-smi hung, exited non-zero, …).
    pub note: Option<String>,
    /// Age of the GPU sample.
    pub age_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResourceSnapshot {
    pub hostname: String,
    pub cpu: CpuInfo,
    pub memory: MemoryInfo,
    pub disk: Option<DiskInfo>,
    pub uptime_s: u64,
    pub gpu: GpuReport,
}
