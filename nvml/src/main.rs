//! `rsb-nvml`: GPU samples from NVML, for the agent that runs it as a child.
//!
//! The agent is a static musl binary and cannot `dlopen` the driver's `libnvidia-ml.so.1`; this
//! small glibc binary can. It prints one block of samples every `--interval-ms` (until
//! `--count` blocks, or until its reader goes away), in the CSV shapes of `nvidia-smi`'s own
//! queries so the agent reads both sources with one parser, plus what only NVML has:
//!
//! ```text
//! gpus
//! 0, NVIDIA H100 80GB HBM3, GPU-…, 37, 1024, 81559, 41, 123.45
//! apps
//! 1234, GPU-…, 500
//! energy
//! GPU-…, 1234567
//! mig
//! GPU-…, MIG-…, 1024, 9984
//! end
//! ```
//!
//! (`gpus`: index, name, uuid, utilization %, memory used and total MiB, temperature C, power
//! W, `[N/A]` where NVML has no reading; `apps`: pid, GPU uuid, used MiB; `energy`: the GPU's
//! energy counter in mJ since the driver loaded; `mig`: parent uuid, MIG device uuid, memory
//! used and total MiB.) A driver call that hangs hangs only this process: the agent kills it at
//! its deadline and falls back to `nvidia-smi`.
//!
//! Exit codes: 0 done (or the reader left), 2 usage, [`NO_LIBRARY`] when libnvidia-ml.so.1
//! does not load (no NVIDIA driver here), [`INIT_FAILED`] when NVML loads but does not start
//! (driver not loaded, no permission), with one line on stderr saying why.

use std::io::Write;
use std::time::Duration;

/// libnvidia-ml.so.1 could not be loaded.
pub const NO_LIBRARY: i32 = 3;
/// NVML loaded but its init failed.
pub const INIT_FAILED: i32 = 4;

const USAGE: &str = "usage: rsb-nvml [--interval-ms N] [--count N]\n\
    (internal: run by rsb-agent to read GPUs through NVML)";

#[derive(Debug)]
struct Opts {
    interval: Duration,
    count: Option<u64>,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut opts = Opts {
        interval: Duration::from_millis(2_000),
        count: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut number = || -> Result<u64, String> {
            let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
            v.parse().map_err(|_| format!("{a}: '{v}' is not a number"))
        };
        match a.as_str() {
            "--interval-ms" => opts.interval = Duration::from_millis(number()?.max(100)),
            "--count" => opts.count = Some(number()?),
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    Ok(opts)
}

/// One GPU's readings; `None` where NVML has none.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub util_pct: Option<u32>,
    pub mem_used_mib: Option<u64>,
    pub mem_total_mib: Option<u64>,
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub energy_mj: Option<u64>,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Sample {
    pub gpus: Vec<Gpu>,
    /// pid, GPU uuid, used MiB.
    pub apps: Vec<(u32, String, Option<u64>)>,
    /// parent uuid, MIG uuid, used MiB, total MiB.
    pub mig: Vec<(String, String, Option<u64>, Option<u64>)>,
}

fn na<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "[N/A]".to_string(), |v| v.to_string())
}

/// A sample as the block the agent reads. Names and UUIDs lose any newline, so a line is
/// always one record.
pub fn block(s: &Sample) -> String {
    let clean = |t: &str| t.replace(['\n', '\r'], " ");
    let mut b = String::from("gpus\n");
    for g in &s.gpus {
        let power = g
            .power_mw
            .map(|mw| format!("{:.2}", f64::from(mw) / 1000.0));
        b.push_str(&format!(
            "{}, {}, {}, {}, {}, {}, {}, {}\n",
            g.index,
            clean(&g.name),
            clean(&g.uuid),
            na(g.util_pct),
            na(g.mem_used_mib),
            na(g.mem_total_mib),
            na(g.temperature_c),
            na(power)
        ));
    }
    b.push_str("apps\n");
    for (pid, uuid, used) in &s.apps {
        b.push_str(&format!("{pid}, {}, {}\n", clean(uuid), na(*used)));
    }
    b.push_str("energy\n");
    for g in s.gpus.iter().filter(|g| g.energy_mj.is_some()) {
        b.push_str(&format!("{}, {}\n", clean(&g.uuid), na(g.energy_mj)));
    }
    b.push_str("mig\n");
    for (parent, uuid, used, total) in &s.mig {
        let (p, u) = (clean(parent), clean(uuid));
        b.push_str(&format!("{p}, {u}, {}, {}\n", na(*used), na(*total)));
    }
    b.push_str("end\n");
    b
}

#[cfg(target_os = "linux")]
mod nvml {
    use super::{Gpu, Sample};
    use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
    use nvml_wrapper::enums::device::UsedGpuMemory;
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::{Device, Nvml};

    const MIB: u64 = 1 << 20;

    pub fn init() -> Result<Nvml, (i32, String)> {
        Nvml::init().map_err(|e| match e {
            NvmlError::LibloadingError(e) => (
                super::NO_LIBRARY,
                format!("cannot load libnvidia-ml.so.1 (no NVIDIA driver here?): {e}"),
            ),
            e => (super::INIT_FAILED, format!("NVML did not start: {e}")),
        })
    }

    fn used(m: &UsedGpuMemory) -> Option<u64> {
        match m {
            UsedGpuMemory::Used(b) => Some(b / MIB),
            UsedGpuMemory::Unavailable => None,
        }
    }

    fn mig_devices(d: &Device, parent: &str, s: &mut Sample) {
        let Ok(max) = d.mig_device_count() else {
            return;
        };
        for i in 0..max {
            if let Ok(m) = d.mig_device_by_index(i)
                && let Ok(uuid) = m.uuid()
            {
                let mem = m.memory_info().ok();
                s.mig.push((
                    parent.to_string(),
                    uuid,
                    mem.as_ref().map(|m| m.used / MIB),
                    mem.as_ref().map(|m| m.total / MIB),
                ));
            }
        }
    }

    /// Every GPU's readings; a reading NVML refuses is `None`, a GPU it cannot open is left out.
    pub fn sample(nvml: &Nvml) -> Result<Sample, String> {
        let count = nvml
            .device_count()
            .map_err(|e| format!("device count: {e}"))?;
        let mut s = Sample::default();
        for i in 0..count {
            let Ok(d) = nvml.device_by_index(i) else {
                continue;
            };
            let Ok(uuid) = d.uuid() else {
                continue;
            };
            let mem = d.memory_info().ok();
            s.gpus.push(Gpu {
                index: d.index().unwrap_or(i),
                name: d.name().unwrap_or_default(),
                uuid: uuid.clone(),
                util_pct: d.utilization_rates().ok().map(|u| u.gpu),
                mem_used_mib: mem.as_ref().map(|m| m.used / MIB),
                mem_total_mib: mem.as_ref().map(|m| m.total / MIB),
                temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
                power_mw: d.power_usage().ok(),
                energy_mj: d.total_energy_consumption().ok(),
            });
            for p in d.running_compute_processes().unwrap_or_default() {
                s.apps.push((p.pid, uuid.clone(), used(&p.used_gpu_memory)));
            }
            if d.mig_mode().is_ok_and(|m| m.current == 1) {
                mig_devices(&d, &uuid, &mut s);
            }
        }
        Ok(s)
    }
}

#[cfg(target_os = "linux")]
fn run(opts: &Opts) -> i32 {
    let nvml = match nvml::init() {
        Ok(n) => n,
        Err((code, why)) => {
            let _ = writeln!(std::io::stderr(), "rsb-nvml: {why}");
            return code;
        }
    };
    let mut out = std::io::stdout().lock();
    let mut done = 0;
    loop {
        let text = match nvml::sample(&nvml) {
            Ok(s) => block(&s),
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "rsb-nvml: {e}");
                return INIT_FAILED;
            }
        };
        // The reader went away (the agent ended): so do we.
        if out
            .write_all(text.as_bytes())
            .and_then(|_| out.flush())
            .is_err()
        {
            return 0;
        }
        done += 1;
        if opts.count.is_some_and(|c| done >= c) {
            return 0;
        }
        std::thread::sleep(opts.interval);
    }
}

#[cfg(not(target_os = "linux"))]
fn run(_: &Opts) -> i32 {
    let _ = writeln!(
        std::io::stderr(),
        "rsb-nvml: NVML is read on Linux hosts only"
    );
    NO_LIBRARY
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match parse(&args) {
        Ok(opts) => run(&opts),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "rsb-nvml: {e}\n{USAGE}");
            2
        }
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_nvidia_smi_s_csv_plus_what_only_nvml_has() {
        let s = Sample {
            gpus: vec![
                Gpu {
                    index: 0,
                    name: "NVIDIA H100\n80GB".into(),
                    uuid: "GPU-a".into(),
                    util_pct: Some(37),
                    mem_used_mib: Some(1024),
                    mem_total_mib: Some(81559),
                    temperature_c: Some(41),
                    power_mw: Some(123_450),
                    energy_mj: Some(99),
                },
                Gpu {
                    index: 1,
                    uuid: "GPU-b".into(),
                    ..Gpu::default()
                },
            ],
            apps: vec![(1234, "GPU-a".into(), Some(500)), (7, "GPU-b".into(), None)],
            mig: vec![("GPU-a".into(), "MIG-c".into(), Some(1), Some(9984))],
        };
        assert_eq!(
            block(&s),
            "gpus\n0, NVIDIA H100 80GB, GPU-a, 37, 1024, 81559, 41, 123.45\n\
             1, , GPU-b, [N/A], [N/A], [N/A], [N/A], [N/A]\n\
             apps\n1234, GPU-a, 500\n7, GPU-b, [N/A]\n\
             energy\nGPU-a, 99\nmig\nGPU-a, MIG-c, 1, 9984\nend\n"
        );
    }

    #[test]
    fn arguments() {
        let a = |v: &[&str]| parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let o = a(&["--interval-ms", "10", "--count", "3"]).unwrap();
        assert_eq!((o.interval, o.count), (Duration::from_millis(100), Some(3)));
        assert!(a(&["--count"]).unwrap_err().contains("needs a value"));
        assert!(a(&["--count", "x"]).unwrap_err().contains("not a number"));
        assert!(a(&["--bogus"]).unwrap_err().contains("unknown argument"));
    }
}
