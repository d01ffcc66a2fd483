//! GPU placement (`exec_bash_background(gpus=N)`, `rsb jobs start --gpus N`, a watched GPU
//! job's resume): which of a host's GPUs a job may have, freest first (`ops::sandboxes` picks
//! the host for `sandbox_name: "auto"` from these). Below the watchdog, which places a resume.
//! What makes a choice exclusive is the lease the job's wrapper takes on the host
//! ([`rsb_protocol::GpuAsk`]): this layer only offers candidates in order, so two placements
//! racing for the same GPUs get different ones or a Busy error, never the same.

use rsb_protocol::{ErrorCode, GpuAsk, GpuInfo, GpuReport, ResourceSnapshot, ResourcesRequest};

use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
};

/// At most this many GPUs for one job (the agent's limit on candidates).
pub const MAX_GPUS: u32 = 64;

/// What a job asks of a host's GPUs; a watch keeps it as its resume plan's `gpus`, so a
/// resume is placed as the run it replaces was.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Need {
    pub count: u32,
    /// Each GPU must have at least this much memory free (MiB).
    #[serde(default)]
    pub min_free_mib: Option<u64>,
}

/// The resume plan's key for a job's [`Need`].
pub const PLAN_KEY: &str = "gpus";

impl Need {
    /// From the tools' `gpus` and `min_gpu_free_mem_gb` (0 = no GPUs / no minimum).
    pub fn parse(gpus: i64, min_free_gb: f64) -> Result<Option<Need>> {
        if !(0..=i64::from(MAX_GPUS)).contains(&gpus) {
            return Err(RsbError::invalid(
                format!("gpus must be 0 to {MAX_GPUS}, not {gpus}"),
                "ask for the number of GPUs the job needs (0: none)",
            ));
        }
        if !min_free_gb.is_finite() || min_free_gb < 0.0 {
            return Err(RsbError::invalid(
                format!("min_gpu_free_mem_gb must be 0 or more, not {min_free_gb}"),
                "give the GPU memory (GiB) each GPU must have free, or 0 for no minimum",
            ));
        }
        if gpus == 0 {
            return match min_free_gb > 0.0 {
                true => Err(RsbError::invalid(
                    "min_gpu_free_mem_gb needs gpus",
                    "ask for gpus: N as well",
                )),
                false => Ok(None),
            };
        }
        Ok(Some(Need {
            count: gpus as u32,
            min_free_mib: (min_free_gb > 0.0).then(|| (min_free_gb * 1024.0).ceil() as u64),
        }))
    }
}

pub fn free_mib(g: &GpuInfo) -> Option<u64> {
    Some(g.mem_total_mib?.saturating_sub(g.mem_used_mib?))
}

/// Why `g` is not offered now; `None` when it is.
fn unfit(g: &GpuInfo, r: &GpuReport, need: &Need) -> Option<String> {
    if let Some(l) = &g.lease {
        return Some(match &l.job {
            Some(job) => format!("leased by job {job}"),
            None => format!("leased by pid {}", l.pid),
        });
    }
    let procs = r.processes.iter().filter(|p| p.gpu_uuid == g.uuid).count();
    if procs > 0 {
        let s = if procs == 1 { "" } else { "es" };
        return Some(format!("in use by {procs} process{s}"));
    }
    if g.uuid.is_empty() {
        return Some("has no UUID".into());
    }
    match (need.min_free_mib, free_mib(g)) {
        (Some(min), Some(free)) if free < min => {
            Some(format!("{:.1} GiB free", free as f64 / 1024.0))
        }
        (Some(_), None) => Some("free memory unknown".into()),
        _ => None,
    }
}

/// The GPUs of `r` a job may have: no lease, no process, enough memory free; most free memory
/// first, then least utilised, then by index.
pub fn candidates<'a>(r: &'a GpuReport, need: &Need) -> Vec<&'a GpuInfo> {
    let mut c: Vec<&GpuInfo> = r
        .gpus
        .iter()
        .filter(|g| unfit(g, r, need).is_none())
        .collect();
    let util = |g: &GpuInfo| g.util_pct.unwrap_or(100.0);
    c.sort_by(|a, b| {
        free_mib(b)
            .cmp(&free_mib(a))
            .then(util(a).total_cmp(&util(b)))
            .then(a.index.cmp(&b.index))
    });
    c
}

/// One host's GPUs as a refusal names them: `1 of 4 free (GPU 0 in use by 1 process, …)`.
pub fn describe(r: &GpuReport, need: &Need) -> String {
    if r.gpus.is_empty() {
        return match &r.note {
            Some(note) => format!("no GPU data ({note})"),
            None => "no NVIDIA GPUs".into(),
        };
    }
    let busy: Vec<String> = r
        .gpus
        .iter()
        .filter_map(|g| Some(format!("GPU {} {}", g.index, unfit(g, r, need)?)))
        .collect();
    let mut t = format!("{} of {} free", candidates(r, need).len(), r.gpus.len());
    if !busy.is_empty() {
        t.push_str(&format!(" ({})", busy.join(", ")));
    }
    t
}

/// Too few GPUs: the error every placement refusal is.
pub fn too_few(need: &Need, where_: &str) -> RsbError {
    let min = need
        .min_free_mib
        .map(|m| format!(" with {:.1} GiB free", m as f64 / 1024.0))
        .unwrap_or_default();
    RsbError::new(
        Kind::Agent(ErrorCode::Busy),
        format!("no {} free GPU(s){min}: {where_}", need.count),
        "wait for a job to end (list_background_tasks), ask for fewer GPUs, or name another sandbox",
    )
}

/// How long a placement waits for a host's first GPU sample (a cold agent runs nvidia-smi).
const FIRST_SAMPLE_WAIT_MS: u64 = 3_000;

async fn report(client: &AgentClient) -> Result<ResourceSnapshot> {
    client
        .call(ResourcesRequest {
            max_wait_ms: FIRST_SAMPLE_WAIT_MS,
        })
        .await
}

/// The ask for `need` on `client`'s host, from a fresh report; too few: a Busy error that
/// says what is free there.
pub async fn ask(client: &AgentClient, need: &Need) -> Result<GpuAsk> {
    let r = report(client).await?;
    let c = candidates(&r.gpu, need);
    if c.len() < need.count as usize {
        let where_ = format!("{} has {}", client.sandbox(), describe(&r.gpu, need));
        return Err(too_few(need, &where_));
    }
    Ok(GpuAsk {
        count: need.count,
        candidates: c.iter().map(|g| g.uuid.clone()).collect(),
    })
}

/// The sandboxes a start may go to, and the Busy answers of those tried.
pub struct Placing {
    pub hosts: Vec<String>,
    refusals: Vec<String>,
}

impl Placing {
    /// A start to try on `hosts`, in order.
    pub fn new(hosts: Vec<String>) -> Placing {
        Placing {
            hosts,
            refusals: Vec::new(),
        }
    }

    /// Whether `host`'s answer `r` sends the start on to the next sandbox: a Busy answer
    /// (another placement leased its GPUs since the probe) when there is one.
    pub fn refused<T>(&mut self, host: &str, r: &Result<T>) -> bool {
        match r {
            Err(e) if e.kind == Kind::Agent(ErrorCode::Busy) && self.hosts.len() > 1 => {
                self.refusals.push(format!("{host}: {}", e.message));
                true
            }
            _ => false,
        }
    }

    /// Every sandbox answered Busy.
    pub fn none_placed(self) -> RsbError {
        RsbError::new(
            Kind::Agent(ErrorCode::Busy),
            format!(
                "no sandbox could place the job: {}",
                self.refusals.join("; ")
            ),
            "wait for a job to end (list_background_tasks), or ask for fewer GPUs",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rsb_protocol::{GpuHolder, GpuProcess};

    fn gpu(index: u32, used: u64, util: f32) -> GpuInfo {
        GpuInfo {
            index,
            name: "H100".into(),
            uuid: format!("GPU-{index}"),
            util_pct: Some(util),
            mem_used_mib: Some(used),
            mem_total_mib: Some(81_920),
            ..GpuInfo::default()
        }
    }

    #[test]
    fn candidates_skip_leased_and_used_gpus_and_put_the_freest_first() {
        let mut r = GpuReport {
            gpus: vec![
                gpu(0, 100, 0.0),
                gpu(1, 0, 50.0),
                gpu(2, 0, 10.0),
                gpu(3, 0, 0.0),
            ],
            ..GpuReport::default()
        };
        r.gpus[3].lease = Some(GpuHolder {
            pid: 7,
            uid: Some(1000),
            job: Some("train".into()),
        });
        r.processes.push(GpuProcess {
            pid: 9,
            gpu_uuid: "GPU-1".into(),
            ..GpuProcess::default()
        });
        let need = Need {
            count: 2,
            min_free_mib: None,
        };
        let order: Vec<u32> = candidates(&r, &need).iter().map(|g| g.index).collect();
        assert_eq!(order, [2, 0], "GPU 2 has more free memory than GPU 0");
        assert_eq!(
            describe(&r, &need),
            "2 of 4 free (GPU 1 in use by 1 process, GPU 3 leased by job train)"
        );
        let big = Need {
            count: 1,
            min_free_mib: Some(81_900),
        };
        assert_eq!(candidates(&r, &big).len(), 1);
        assert!(
            describe(&r, &big).contains("GPU 0 79.9 GiB free"),
            "{}",
            describe(&r, &big)
        );
        r.gpus[2].mem_used_mib = None;
        assert!(describe(&r, &big).contains("GPU 2 free memory unknown"));
        assert_eq!(describe(&GpuReport::default(), &need), "no NVIDIA GPUs");
    }

    #[test]
    fn the_tools_numbers_are_checked() {
        assert_eq!(Need::parse(0, 0.0).unwrap(), None);
        assert_eq!(
            Need::parse(2, 1.5).unwrap(),
            Some(Need {
                count: 2,
                min_free_mib: Some(1536)
            })
        );
        for (n, gb) in [(-1, 0.0), (65, 0.0), (1, -1.0), (1, f64::NAN), (0, 2.0)] {
            let e = Need::parse(n, gb).unwrap_err();
            assert_eq!(e.kind, Kind::InvalidArgument, "{n} {gb}: {e}");
        }
    }
}
