//! `rsb-agent resources --json`, written by hand so the static agent does not carry serde_json.
//!
//! The shape is exactly serde's default encoding of `ResourceSnapshot` (same field names, unit
//! enum variants as strings such as `"NvidiaSmi"`), so anything holding the protocol crate can
//! read the output back with serde, and the tests do exactly that.

use rsb_protocol::{GpuInfo, GpuProcess, GpuReport, GpuSource, ResourceSnapshot};

use crate::util::json_string;

pub(crate) fn snapshot(s: &ResourceSnapshot) -> String {
    let cpu = obj(&[
        ("usage_pct", f32_req(s.cpu.usage_pct)),
        ("count", s.cpu.count.to_string()),
        ("load_1m", f64_req(s.cpu.load_1m)),
        ("load_5m", f64_req(s.cpu.load_5m)),
        ("load_15m", f64_req(s.cpu.load_15m)),
        ("interval_ms", s.cpu.interval_ms.to_string()),
    ]);
    let m = &s.memory;
    let memory = obj(&[
        ("total_bytes", m.total_bytes.to_string()),
        ("used_bytes", m.used_bytes.to_string()),
        ("available_bytes", m.available_bytes.to_string()),
        ("swap_total_bytes", m.swap_total_bytes.to_string()),
        ("swap_used_bytes", m.swap_used_bytes.to_string()),
    ]);
    let disk = match &s.disk {
        Some(d) => obj(&[
            ("path", json_string(&d.path)),
            ("total_bytes", d.total_bytes.to_string()),
            ("free_bytes", d.free_bytes.to_string()),
        ]),
        None => "null".into(),
    };
    obj(&[
        ("hostname", json_string(&s.hostname)),
        ("cpu", cpu),
        ("memory", memory),
        ("disk", disk),
        ("uptime_s", s.uptime_s.to_string()),
        ("gpu", gpu_report(&s.gpu)),
    ])
}

fn gpu_report(g: &GpuReport) -> String {
    let source = match g.source {
        GpuSource::Nvml => "Nvml",
        GpuSource::NvidiaSmi => "NvidiaSmi",
        GpuSource::None => "None",
    };
    obj(&[
        ("source", json_string(source)),
        ("gpus", arr(g.gpus.iter().map(gpu))),
        ("processes", arr(g.processes.iter().map(process))),
        (
            "note",
            g.note.as_deref().map_or_else(|| "null".into(), json_string),
        ),
        ("age_ms", g.age_ms.to_string()),
    ])
}

fn gpu(g: &GpuInfo) -> String {
    obj(&[
        ("index", g.index.to_string()),
        ("name", json_string(&g.name)),
        ("uuid", json_string(&g.uuid)),
        ("util_pct", f32_opt(g.util_pct)),
        ("mem_used_mib", u64_opt(g.mem_used_mib)),
        ("mem_total_mib", u64_opt(g.mem_total_mib)),
        ("temperature_c", f32_opt(g.temperature_c)),
        ("power_w", f32_opt(g.power_w)),
        (
            "lease",
            g.lease
                .as_ref()
                .map_or_else(|| "null".into(), |h| holder(h.pid, h.uid, &h.job, vec![])),
        ),
    ])
}

fn holder(pid: u32, uid: Option<u32>, job: &Option<String>, mut f: Vec<(&str, String)>) -> String {
    f.push(("pid", pid.to_string()));
    f.push(("uid", uid.map_or_else(|| "null".into(), |u| u.to_string())));
    f.push((
        "job",
        job.as_deref().map_or_else(|| "null".into(), json_string),
    ));
    obj(&f)
}

fn process(p: &GpuProcess) -> String {
    let f = vec![
        ("gpu_uuid", json_string(&p.gpu_uuid)),
        ("used_mem_mib", u64_opt(p.used_mem_mib)),
    ];
    holder(p.pid, p.uid, &p.job, f)
}

fn obj(fields: &[(&str, String)]) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{}:{v}", json_string(k)))
        .collect();
    format!("{{{}}}", body.join(","))
}

fn arr(items: impl Iterator<Item = String>) -> String {
    format!("[{}]", items.collect::<Vec<_>>().join(","))
}

/// Rust's float `Display` never uses exponents, so finite values are valid JSON numbers as-is
/// (and `f32` printed as `f32` keeps `12.3` from turning into `12.300000190734863`). JSON has no
/// NaN or infinity: a required field gets 0, an optional one `null`.
fn f32_req(v: f32) -> String {
    if v.is_finite() {
        v.to_string()
    } else {
        "0".into()
    }
}

fn f64_req(v: f64) -> String {
    if v.is_finite() {
        v.to_string()
    } else {
        "0".into()
    }
}

fn f32_opt(v: Option<f32>) -> String {
    match v {
        Some(v) if v.is_finite() => v.to_string(),
        _ => "null".into(),
    }
}

fn u64_opt(v: Option<u64>) -> String {
    v.map_or_else(|| "null".into(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rsb_protocol::{CpuInfo, DiskInfo, MemoryInfo};

    fn sample() -> ResourceSnapshot {
        ResourceSnapshot {
            hostname: "h\"o\\s\nt\u{1}é".into(),
            cpu: CpuInfo {
                usage_pct: 12.3,
                count: 16,
                load_1m: 0.52,
                load_5m: 1e-7,
                load_15m: 123456789.5,
                interval_ms: 1000,
            },
            memory: MemoryInfo {
                total_bytes: u64::MAX,
                used_bytes: 1,
                available_bytes: 2,
                swap_total_bytes: 0,
                swap_used_bytes: 0,
            },
            disk: Some(DiskInfo {
                path: "/home/ü \"q\"".into(),
                total_bytes: 10,
                free_bytes: 5,
            }),
            uptime_s: 99,
            gpu: GpuReport {
                source: GpuSource::NvidiaSmi,
                gpus: vec![GpuInfo {
                    index: 1,
                    name: "NVIDIA H200, NVL".into(),
                    uuid: "GPU-1".into(),
                    util_pct: None,
                    mem_used_mib: Some(3),
                    mem_total_mib: None,
                    temperature_c: Some(-0.5),
                    power_w: Some(700.25),
                    lease: Some(rsb_protocol::GpuHolder {
                        pid: 9,
                        uid: Some(1000),
                        job: Some("train \"x\"".into()),
                    }),
                }],
                processes: vec![GpuProcess {
                    pid: 4,
                    gpu_uuid: "GPU-1".into(),
                    used_mem_mib: None,
                    uid: None,
                    job: Some("j".into()),
                }],
                note: Some("tab\there".into()),
                age_ms: 7,
            },
        }
    }

    #[test]
    fn round_trips_through_serde() {
        let s = sample();
        let text = snapshot(&s);
        let back: ResourceSnapshot = serde_json::from_str(&text).expect(&text);
        assert_eq!(back, s);
        assert!(text.contains("\"usage_pct\":12.3,"), "{text}");
        assert!(text.contains("\"source\":\"NvidiaSmi\""), "{text}");

        let mut bare = ResourceSnapshot::default();
        bare.cpu.usage_pct = f32::NAN;
        bare.cpu.load_1m = f64::INFINITY;
        bare.gpu.gpus.push(GpuInfo {
            power_w: Some(f32::NAN),
            ..GpuInfo::default()
        });
        let text = snapshot(&bare);
        let back: ResourceSnapshot = serde_json::from_str(&text).expect(&text);
        assert_eq!(back.cpu.usage_pct, 0.0);
        assert_eq!(back.cpu.load_1m, 0.0);
        assert_eq!(back.gpu.gpus[0].power_w, None);
        assert_eq!(back.disk, None);
        assert_eq!(back.gpu.source, GpuSource::None);
    }
}
