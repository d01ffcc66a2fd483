//! Host load for `Resources` requests and `rsb-agent resources`, so callers can pick the idlest host.
//!
//! CPU % only means something as the difference between two readings of the kernel's counters,
//! and `nvidia-smi` can take seconds (or hang). Both are therefore read by background threads that
//! start on the first request, and a request just copies the latest readings: it is answered in
//! microseconds and never waits on nvidia-smi. Only a cold start waits (briefly, bounded by the
//! request) for the first real CPU interval, so no caller sees a meaningless 0 %. The threads stop
//! after a quiet spell, so an idle agent costs nothing, and start again on the next request.
//!
//! Plain threads rather than tokio tasks: the work is blocking (/proc reads, statvfs on a possibly
//! slow `$HOME` mount, child processes), and this way it can never stall the agent's
//! single-threaded protocol loop, whatever runtime that loop uses.

mod gpu;
mod json;

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rsb_protocol::{
    AgentError, CpuInfo, DiskInfo, ErrorCode, GpuReport, GpuSource, MemoryInfo, ResourceSnapshot,
    ResourcesRequest,
};
use sysinfo::System;
use tokio::sync::Notify;

/// Environment override for the nvidia-smi deadline; tests set it low to exercise the hang path.
pub const SMI_TIMEOUT_ENV: &str = "RSB_NVIDIA_SMI_TIMEOUT_MS";
/// The longest a request may wait for a first interval, whatever it asks for: a caller fanning
/// out over many hosts wants a fast answer more than a perfect one.
const MAX_REQUEST_WAIT: Duration = Duration::from_millis(1500);

#[derive(Debug, Clone)]
struct Config {
    /// The first CPU interval after a (re)start. Short, because a request is waiting for it; it
    /// must stay ≥ sysinfo's MINIMUM_CPU_UPDATE_INTERVAL (200 ms) or sysinfo ignores the refresh.
    first_interval: Duration,
    cpu_period: Duration,
    gpu_period: Duration,
    smi_timeout: Duration,
    /// Stop sampling when no request has come for this long.
    idle_stop: Duration,
    /// PATH to search for nvidia-smi; `None` reads the agent's PATH at each pass, so an
    /// nvidia-smi installed while the agent runs is picked up. Tests pass their own.
    path: Option<OsString>,
}

impl Config {
    fn from_env() -> Config {
        let smi_ms = std::env::var(SMI_TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        Config {
            first_interval: Duration::from_millis(250),
            cpu_period: Duration::from_secs(1),
            gpu_period: Duration::from_secs(2),
            smi_timeout: Duration::from_millis(smi_ms.unwrap_or(3000).clamp(1, 600_000)),
            idle_stop: Duration::from_secs(60),
            path: None,
        }
    }
}

/// Background sampler shared by all requests on one agent.
pub struct Sampler {
    shared: Arc<Shared>,
}

struct Shared {
    cfg: Config,
    state: Mutex<State>,
    /// Cuts the sampler threads' sleeps short when the `Sampler` is dropped.
    wake: Condvar,
    /// Wakes requests waiting for a first interval. `Notify` works from plain threads and
    /// needs no runtime on the sending side.
    updated: Notify,
}

#[derive(Default)]
struct State {
    shutdown: bool,
    last_request: Option<Instant>,
    cpu_running: bool,
    gpu_running: bool,
    host: Option<HostSample>,
    gpu: Option<GpuSample>,
    gpu_started: Option<Instant>,
}

#[derive(Clone)]
struct HostSample {
    hostname: String,
    cpu: CpuInfo,
    memory: MemoryInfo,
    disk: Option<DiskInfo>,
    uptime_s: u64,
}

struct GpuSample {
    report: GpuReport,
    at: Instant,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn idle(&self, st: &State) -> bool {
        st.last_request
            .is_none_or(|t| t.elapsed() > self.cfg.idle_stop)
    }

    /// Sleeps until `until`; false when the sampler was dropped meanwhile.
    fn nap(&self, until: Instant) -> bool {
        let mut st = self.lock();
        // Each round waits for the remaining time; the cap only guards against a storm of
        // spurious wake-ups.
        for _ in 0..1000 {
            if st.shutdown {
                return false;
            }
            let now = Instant::now();
            if now >= until {
                return true;
            }
            st = match self.wake.wait_timeout(st, until - now) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        !st.shutdown
    }
}

impl Sampler {
    pub fn new() -> Arc<Sampler> {
        Self::with_config(Config::from_env())
    }

    fn with_config(cfg: Config) -> Arc<Sampler> {
        Arc::new(Sampler {
            shared: Arc::new(Shared {
                cfg,
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
                updated: Notify::new(),
            }),
        })
    }

    pub async fn snapshot(&self, req: ResourcesRequest) -> Result<ResourceSnapshot, AgentError> {
        let wait = Duration::from_millis(req.max_wait_ms).min(MAX_REQUEST_WAIT);
        self.snapshot_waiting(wait).await
    }

    /// Takes a snapshot, waiting up to `wait` on a cold start for the first CPU interval and the
    /// first GPU pass. The CLI uses a longer wait than requests may ask for.
    async fn snapshot_waiting(&self, wait: Duration) -> Result<ResourceSnapshot, AgentError> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started + wait);
        {
            let mut st = self.shared.lock();
            st.last_request = Some(started);
            start_if_stopped(&self.shared, &mut st)?;
        }
        // Every wake-up is either a fresh sample or the deadline; samples come every ≥ 250 ms,
        // so this cap is never what ends the wait.
        for _ in 0..64 {
            let mut notified = std::pin::pin!(self.shared.updated.notified());
            notified.as_mut().enable();
            {
                let st = self.shared.lock();
                let ready =
                    st.host.as_ref().is_some_and(|h| h.cpu.interval_ms > 0) && st.gpu.is_some();
                if ready || tokio::time::Instant::now() >= deadline {
                    return Ok(assemble(&st));
                }
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
        Ok(assemble(&self.shared.lock()))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
    }
}

/// Starts whichever sampler thread is not running. A restart after an idle stop throws the old
/// readings away: minutes-old numbers must not be handed out as current.
///
/// The first CPU reading (and the nvidia-smi PATH lookup) happen right here, synchronously: they
/// are a few /proc reads and stat calls, and they mean even a zero-wait request gets real
/// memory, load and disk figures and a settled "no GPU" answer.
fn start_if_stopped(shared: &Arc<Shared>, st: &mut State) -> Result<(), AgentError> {
    if !st.cpu_running {
        let mut sys = System::new().map_err(|e| {
            AgentError::new(
                ErrorCode::Unsupported,
                format!("resources: cannot read system information: {e}"),
            )
        })?;
        let first_read = Instant::now();
        sys.refresh_cpu_usage();
        sys.refresh_memory();
        st.host = Some(read_host(&sys, None));
        let thread_shared = Arc::clone(shared);
        std::thread::Builder::new()
            .name("rsb-cpu-sampler".into())
            .spawn(move || cpu_loop(&thread_shared, sys, first_read))
            .map_err(|e| {
                AgentError::new(
                    ErrorCode::Internal,
                    format!("resources: cannot start the sampler: {e}"),
                )
            })?;
        st.cpu_running = true;
    }
    if !st.gpu_running {
        let now = Instant::now();
        st.gpu_started = Some(now);
        st.gpu = None;
        if gpu::find_smi(
            shared
                .cfg
                .path
                .clone()
                .or_else(|| std::env::var_os("PATH"))
                .as_deref(),
        )
        .is_none()
        {
            st.gpu = Some(GpuSample {
                report: GpuReport::default(),
                at: now,
            });
        }
        let thread_shared = Arc::clone(shared);
        match std::thread::Builder::new()
            .name("rsb-gpu-sampler".into())
            .spawn(move || gpu_loop(&thread_shared))
        {
            Ok(_) => st.gpu_running = true,
            // CPU data is still worth answering with; the next request tries again.
            Err(e) => {
                let note = format!("cannot start the GPU sampler: {e}");
                st.gpu = Some(GpuSample {
                    report: GpuReport {
                        note: Some(note),
                        ..GpuReport::default()
                    },
                    at: now,
                });
            }
        }
    }
    Ok(())
}

fn cpu_loop(shared: &Shared, mut sys: System, mut last_read: Instant) {
    let mut period = shared.cfg.first_interval;
    // Runs as long as requests keep coming; each round sleeps a period, and the idle check ends it.
    loop {
        if !shared.nap(last_read + period) {
            return;
        }
        let now = Instant::now();
        sys.refresh_cpu_usage();
        sys.refresh_memory();
        let host = read_host(&sys, Some(now - last_read));
        last_read = now;
        let mut st = shared.lock();
        st.host = Some(host);
        shared.updated.notify_waiters();
        if st.shutdown || shared.idle(&st) {
            st.cpu_running = false;
            return;
        }
        period = shared.cfg.cpu_period;
    }
}

fn gpu_loop(shared: &Shared) {
    loop {
        let path = shared.cfg.path.clone().or_else(|| std::env::var_os("PATH"));
        let report = gpu::sample(path.as_deref(), shared.cfg.smi_timeout);
        let done = Instant::now();
        {
            let mut st = shared.lock();
            st.gpu = Some(GpuSample { report, at: done });
            shared.updated.notify_waiters();
            if st.shutdown || shared.idle(&st) {
                st.gpu_running = false;
                return;
            }
        }
        if !shared.nap(done + shared.cfg.gpu_period) {
            return;
        }
    }
}

/// One reading of everything but the GPUs. `interval` is what the CPU % was measured over;
/// `None` for the very first reading, which has no previous one to compare with.
fn read_host(sys: &System, interval: Option<Duration>) -> HostSample {
    let (usage_pct, interval_ms) = match interval {
        Some(d) => {
            let pct = sys.global_cpu_usage();
            let pct = if pct.is_finite() {
                pct.clamp(0.0, 100.0)
            } else {
                0.0
            };
            (pct, u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1))
        }
        None => (0.0, 0),
    };
    let load = System::load_average().ok();
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "/".into());
    HostSample {
        hostname: System::host_name().unwrap_or_default(),
        cpu: CpuInfo {
            usage_pct,
            count: u32::try_from(sys.cpus().len()).unwrap_or(u32::MAX),
            load_1m: load.as_ref().map_or(0.0, |l| l.one),
            load_5m: load.as_ref().map_or(0.0, |l| l.five),
            load_15m: load.as_ref().map_or(0.0, |l| l.fifteen),
            interval_ms,
        },
        memory: MemoryInfo {
            total_bytes: sys.total_memory(),
            used_bytes: sys.used_memory(),
            available_bytes: sys.available_memory(),
            swap_total_bytes: sys.total_swap(),
            swap_used_bytes: sys.used_swap(),
        },
        disk: disk_of(Path::new(&home)),
        uptime_s: System::uptime().unwrap_or(0),
    }
}

/// Size and space of the filesystem holding `path`. "Free" is what an unprivileged user can
/// still write (`f_bavail`), not the root-reserved total, since that is what a job will get.
fn disk_of(path: &Path) -> Option<DiskInfo> {
    let vfs = rustix::fs::statvfs(path).ok()?;
    let unit = if vfs.f_frsize > 0 {
        vfs.f_frsize
    } else {
        vfs.f_bsize
    };
    Some(DiskInfo {
        path: path.to_string_lossy().into_owned(),
        total_bytes: vfs.f_blocks.saturating_mul(unit),
        free_bytes: vfs.f_bavail.saturating_mul(unit),
    })
}

fn assemble(st: &State) -> ResourceSnapshot {
    let host = st.host.clone().unwrap_or_else(|| HostSample {
        hostname: String::new(),
        cpu: CpuInfo::default(),
        memory: MemoryInfo::default(),
        disk: None,
        uptime_s: 0,
    });
    let gpu = match &st.gpu {
        Some(sample) => GpuReport {
            age_ms: u64::try_from(sample.at.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..sample.report.clone()
        },
        None => {
            let waited = st.gpu_started.map_or(0, |t| t.elapsed().as_millis());
            GpuReport {
                note: Some(format!(
                    "nvidia-smi has not answered yet ({waited} ms since GPU sampling started)"
                )),
                ..GpuReport::default()
            }
        }
    };
    let mut gpu = gpu;
    annotate(&mut gpu);
    ResourceSnapshot {
        hostname: host.hostname,
        cpu: host.cpu,
        memory: host.memory,
        disk: host.disk,
        uptime_s: host.uptime_s,
        gpu,
    }
}

/// Leases and process owners are read at each report, not with the (older) GPU sample: a
/// placement right after another must see its lease.
fn annotate(g: &mut GpuReport) {
    if g.gpus.is_empty() {
        return;
    }
    let uuids: Vec<&str> = g.gpus.iter().map(|x| x.uuid.as_str()).collect();
    let leases = crate::lease::holders(&uuids);
    for (gpu, lease) in g.gpus.iter_mut().zip(leases) {
        gpu.lease = lease;
    }
    for p in &mut g.processes {
        let who = crate::lease::who(p.pid);
        (p.uid, p.job) = (who.uid, who.job);
    }
}

const CLI_USAGE: &str = "usage: rsb-agent resources [--json]\n\
    \n\
    Print this host's CPU, memory, disk and GPU load, measured over a short interval.\n\
    \x20 --json    one JSON object (the protocol's ResourceSnapshot) instead of a table\n";

/// `rsb-agent resources [--json]`
pub fn cli_main(args: &[String]) -> i32 {
    let mut as_json = false;
    for arg in args {
        match arg.as_str() {
            "--json" => as_json = true,
            "-h" | "--help" => return write_out(CLI_USAGE),
            other => {
                let _ = write!(
                    std::io::stderr().lock(),
                    "rsb-agent resources: unknown argument '{other}'\n\n{CLI_USAGE}"
                );
                return 2;
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr().lock(),
                "rsb-agent resources: cannot start a runtime: {e}"
            );
            return 1;
        }
    };
    let sampler = Sampler::new();
    // A person asked once and will not ask again, so wait for nvidia-smi too: both queries may
    // run into their deadline before the first GPU pass is done.
    let wait =
        MAX_REQUEST_WAIT.max(sampler.shared.cfg.smi_timeout * 2 + Duration::from_millis(500));
    let snap = match runtime.block_on(sampler.snapshot_waiting(wait)) {
        Ok(snap) => snap,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr().lock(),
                "rsb-agent resources: {}",
                e.message
            );
            return 1;
        }
    };
    if as_json {
        write_out(&format!("{}\n", json::snapshot(&snap)))
    } else {
        write_out(&table(&snap))
    }
}

/// Writes to stdout without `println!`, which panics (and with panic=abort, aborts) when the
/// reader has gone away, e.g. `rsb-agent resources | head -1`.
fn write_out(text: &str) -> i32 {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => 0,
        Err(_) => 1,
    }
}

fn table(s: &ResourceSnapshot) -> String {
    use std::fmt::Write as _;
    let mut t = String::new();
    let c = &s.cpu;
    let m = &s.memory;
    let _ = writeln!(t, "host      {}", s.hostname);
    let _ = writeln!(t, "uptime    {}", human_duration(s.uptime_s));
    let measured = if c.interval_ms > 0 {
        format!("over {} ms", c.interval_ms)
    } else {
        "not measured yet".into()
    };
    let _ = writeln!(
        t,
        "cpu       {:.1} % ({measured}), {} cores",
        c.usage_pct, c.count
    );
    let _ = writeln!(
        t,
        "load      {:.2} {:.2} {:.2}",
        c.load_1m, c.load_5m, c.load_15m
    );
    let _ = writeln!(
        t,
        "memory    {} used of {} ({} available)",
        human_bytes(m.used_bytes),
        human_bytes(m.total_bytes),
        human_bytes(m.available_bytes)
    );
    let _ = writeln!(
        t,
        "swap      {} used of {}",
        human_bytes(m.swap_used_bytes),
        human_bytes(m.swap_total_bytes)
    );
    match &s.disk {
        Some(d) => {
            let _ = writeln!(
                t,
                "disk      {} free of {} ({})",
                human_bytes(d.free_bytes),
                human_bytes(d.total_bytes),
                d.path
            );
        }
        None => {
            let _ = writeln!(t, "disk      unknown");
        }
    }
    let g = &s.gpu;
    match g.source {
        GpuSource::None => {
            let _ = writeln!(t, "gpus      none found");
        }
        source => {
            let _ = writeln!(
                t,
                "gpus      {} via {} ({} ms old)",
                g.gpus.len(),
                source.as_str(),
                g.age_ms
            );
        }
    }
    let opt = |v: Option<String>| v.unwrap_or_else(|| "n/a".into());
    for gpu in &g.gpus {
        let mem = match (gpu.mem_used_mib, gpu.mem_total_mib) {
            (None, None) => "n/a".to_string(),
            (used, total) => format!(
                "{} / {} MiB",
                opt(used.map(|v| v.to_string())),
                opt(total.map(|v| v.to_string()))
            ),
        };
        let _ = writeln!(
            t,
            "  [{}] {}  util {}  mem {}  temp {}  power {}  {}",
            gpu.index,
            gpu.name,
            opt(gpu.util_pct.map(|v| format!("{v:.0} %"))),
            mem,
            opt(gpu.temperature_c.map(|v| format!("{v:.0} C"))),
            opt(gpu.power_w.map(|v| format!("{v:.1} W"))),
            gpu.uuid
        );
        if let Some(l) = &gpu.lease {
            let _ = writeln!(t, "      leased by {}", holder(l.pid, l.uid, &l.job));
        }
        for p in g.processes.iter().filter(|p| p.gpu_uuid == gpu.uuid) {
            let _ = writeln!(
                t,
                "      {}  {}",
                holder(p.pid, p.uid, &p.job),
                opt(p.used_mem_mib.map(|v| format!("{v} MiB")))
            );
        }
    }
    for p in g
        .processes
        .iter()
        .filter(|p| !g.gpus.iter().any(|gpu| gpu.uuid == p.gpu_uuid))
    {
        let mem = opt(p.used_mem_mib.map(|v| format!("{v} MiB")));
        let _ = writeln!(t, "  pid {} on {}  {}", p.pid, p.gpu_uuid, mem);
    }
    if let Some(note) = &g.note {
        let _ = writeln!(t, "gpu note  {note}");
    }
    t
}

fn holder(pid: u32, uid: Option<u32>, job: &Option<String>) -> String {
    let mut t = format!("pid {pid}");
    if let Some(u) = uid {
        t.push_str(&format!(" uid {u}"));
    }
    if let Some(j) = job {
        t.push_str(&format!(" job {j}"));
    }
    t
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn human_duration(secs: u64) -> String {
    let (d, h, m) = (secs / 86_400, secs % 86_400 / 3600, secs % 3600 / 60);
    if d > 0 {
        format!("{d}d {h:02}h {m:02}m")
    } else {
        format!("{h}h {m:02}m")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn test_config(path: Option<OsString>) -> Config {
        Config {
            first_interval: Duration::from_millis(250),
            cpu_period: Duration::from_millis(300),
            gpu_period: Duration::from_millis(300),
            smi_timeout: Duration::from_millis(500),
            idle_stop: Duration::from_secs(60),
            path,
        }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    fn req(ms: u64) -> ResourcesRequest {
        ResourcesRequest { max_wait_ms: ms }
    }

    /// A directory holding only a fake nvidia-smi with `body`, as a PATH value.
    fn fake_smi(body: &str) -> (tempfile::TempDir, OsString) {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("nvidia-smi");
        std::fs::write(&exe, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path =
            std::env::join_paths([dir.path(), Path::new("/usr/bin"), Path::new("/bin")]).unwrap();
        (dir, path)
    }

    #[test]
    fn cold_waits_for_a_real_interval_then_warm_is_instant() {
        let empty = tempfile::tempdir().unwrap();
        let sampler = Sampler::with_config(test_config(Some(empty.path().into())));
        let rt = runtime();
        let t0 = Instant::now();
        let cold = rt.block_on(sampler.snapshot(req(1500))).unwrap();
        let cold_ms = t0.elapsed().as_secs_f64() * 1e3;
        assert!(cold.cpu.interval_ms >= 200, "{:?}", cold.cpu);
        assert!((200.0..1500.0).contains(&cold_ms), "cold {cold_ms} ms");
        assert!(cold.cpu.count >= 1);
        assert!(cold.memory.total_bytes > 0 && cold.memory.used_bytes <= cold.memory.total_bytes);
        assert!(
            cold.disk
                .as_ref()
                .is_some_and(|d| d.total_bytes > 0 && d.free_bytes <= d.total_bytes)
        );
        assert!(cold.uptime_s > 0);
        assert_eq!(cold.gpu.source, GpuSource::None);
        assert_eq!(cold.gpu.note, None);

        let mut warm = Vec::new();
        for _ in 0..200 {
            let t = Instant::now();
            let snap = rt.block_on(sampler.snapshot(req(1500))).unwrap();
            warm.push(t.elapsed());
            assert!(snap.cpu.interval_ms > 0);
        }
        warm.sort();
        let (warm_median, warm_max) = (warm[100], warm[199]);
        eprintln!(
            "snapshot latency: cold {cold_ms:.1} ms, warm median {warm_median:?}, max {warm_max:?}"
        );
        // The median shows the copy-out cost; the max only has to stay well under a sampling
        // period (300 ms here) to show no request waited for a sample, scheduler hiccups allowed.
        assert!(
            warm_median < Duration::from_millis(2),
            "warm median {warm_median:?}"
        );
        assert!(
            warm_max < Duration::from_millis(200),
            "warm max {warm_max:?}"
        );

        // The background thread keeps measuring: a later snapshot has a new reading.
        std::thread::sleep(Duration::from_millis(700));
        let later = rt.block_on(sampler.snapshot(req(0))).unwrap();
        let iv = later.cpu.interval_ms;
        assert!(
            (290..700).contains(&iv),
            "periodic interval ≈ 300 ms: {:?}",
            later.cpu
        );
    }

    #[test]
    fn zero_wait_answers_at_once_without_pretending_to_have_measured() {
        let empty = tempfile::tempdir().unwrap();
        let sampler = Sampler::with_config(test_config(Some(empty.path().into())));
        let t = Instant::now();
        let snap = runtime().block_on(sampler.snapshot(req(0))).unwrap();
        // interval 0 proves it did not wait for the first 250 ms interval; the time bound only
        // catches a gross stall (it is loose for busy test machines).
        assert_eq!(snap.cpu.interval_ms, 0);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(
            snap.memory.total_bytes > 0,
            "memory is read synchronously on start"
        );
    }

    #[test]
    fn stops_when_idle_and_restarts_fresh() {
        let (dir, path) = fake_smi(
            "case \"$1\" in --query-gpu*) [ -e \"$0.slow\" ] && sleep 0.3; echo '0, G, GPU-x, 1, 2, 3, 4, 5' ;; esac",
        );
        let mut cfg = test_config(Some(path));
        cfg.idle_stop = Duration::from_millis(800);
        let sampler = Sampler::with_config(cfg);
        let rt = runtime();
        let first = rt.block_on(sampler.snapshot(req(1500))).unwrap();
        assert_eq!(first.gpu.gpus.len(), 1);
        assert!(sampler.shared.lock().cpu_running);
        // Idle stop + one CPU period + one GPU period, with slack for a busy box.
        let stop_by = Instant::now() + Duration::from_secs(6);
        while Instant::now() < stop_by {
            let st = sampler.shared.lock();
            if !st.cpu_running && !st.gpu_running {
                break;
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(50));
        }
        {
            let st = sampler.shared.lock();
            assert!(
                !st.cpu_running && !st.gpu_running,
                "sampler still running after idle stop"
            );
        }
        // Let the last pre-stop GPU sample age well past what a fresh one can be, and make the
        // next pass slower than the first CPU interval, so a kept old sample would be served.
        std::fs::write(dir.path().join("nvidia-smi.slow"), "").unwrap();
        std::thread::sleep(Duration::from_millis(700));
        let again = rt.block_on(sampler.snapshot(req(1500))).unwrap();
        assert!(sampler.shared.lock().cpu_running);
        let iv = again.cpu.interval_ms;
        assert!(
            (200..1000).contains(&iv),
            "fresh first interval: {:?}",
            again.cpu
        );
        // The pre-stop GPU sample is ≥ 700 ms old by now; a restart must not serve it.
        assert_eq!(again.gpu.gpus.len(), 1);
        assert!(
            again.gpu.age_ms < 600,
            "stale GPU sample after restart: {:?}",
            again.gpu
        );
    }

    #[test]
    fn dropping_the_sampler_ends_its_threads() {
        let empty = tempfile::tempdir().unwrap();
        let sampler = Sampler::with_config(test_config(Some(empty.path().into())));
        runtime().block_on(sampler.snapshot(req(1500))).unwrap();
        let shared = Arc::clone(&sampler.shared);
        drop(sampler);
        let by = Instant::now() + Duration::from_secs(3);
        while Arc::strong_count(&shared) > 1 && Instant::now() < by {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            Arc::strong_count(&shared),
            1,
            "sampler threads still hold the state"
        );
    }

    #[test]
    fn gpus_and_processes_from_a_fake_nvidia_smi() {
        let (_dir, path) = fake_smi(
            r#"[ "$2" = "--format=csv,noheader,nounits" ] || exit 2
case "$1" in
--query-gpu=index,name,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw)
  echo '0, NVIDIA H200, GPU-aaaa, 37, 1024, 143771, 41, 123.45'
  echo '1, NVIDIA H200, GPU-bbbb, [N/A], 0, 143771, 30, 80.5' ;;
--query-compute-apps=pid,gpu_uuid,used_memory)
  echo '4242, GPU-aaaa, 1000'
  echo '4343, GPU-bbbb, 20' ;;
*) exit 2 ;;
esac"#,
        );
        let sampler = Sampler::with_config(test_config(Some(path)));
        let snap = runtime().block_on(sampler.snapshot(req(1500))).unwrap();
        let g = snap.gpu;
        assert_eq!(g.source, GpuSource::NvidiaSmi, "{g:?}");
        assert_eq!(g.note, None);
        assert_eq!(g.gpus.len(), 2);
        assert_eq!(g.gpus[0].util_pct, Some(37.0));
        assert_eq!(g.gpus[1].util_pct, None);
        assert_eq!(g.gpus[1].power_w, Some(80.5));
        let pids: Vec<(u32, &str)> = g
            .processes
            .iter()
            .map(|p| (p.pid, p.gpu_uuid.as_str()))
            .collect();
        assert_eq!(pids, [(4242, "GPU-aaaa"), (4343, "GPU-bbbb")]);
        assert!(g.age_ms < 1500);
    }

    #[test]
    fn hung_nvidia_smi_is_killed_and_reported_without_blocking_requests() {
        let (dir, path) = fake_smi("[ -e \"$0.pid\" ] || echo $$ > \"$0.pid\"; sleep 30");
        let mut cfg = test_config(Some(path));
        cfg.smi_timeout = Duration::from_millis(1000);
        let sampler = Sampler::with_config(cfg);
        let rt = runtime();
        let t = Instant::now();
        // A request waits only as long as it asked, never for nvidia-smi's own deadline.
        let early = rt.block_on(sampler.snapshot(req(300))).unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(900),
            "{:?}",
            t.elapsed()
        );
        assert!(
            early.cpu.interval_ms > 0,
            "the CPU part is ready: {:?}",
            early.cpu
        );
        assert_eq!(early.gpu.source, GpuSource::None);
        let note = early.gpu.note.as_deref().unwrap_or("");
        assert!(note.contains("not answered yet"), "{:?}", early.gpu);
        let late = rt.block_on(sampler.snapshot(req(1500))).unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(2500),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(late.gpu.source, GpuSource::None);
        assert!(late.gpu.gpus.is_empty());
        assert_eq!(
            late.gpu.note.as_deref(),
            Some("nvidia-smi timed out after 1000 ms")
        );
        let pid_file = dir.path().join("nvidia-smi.pid");
        let pid: u32 = std::fs::read_to_string(pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let alive = crate::proc::is_alive(pid, None);
        assert!(!alive, "the hung nvidia-smi is still running");
    }

    #[test]
    fn failing_nvidia_smi_gives_none_with_the_reason() {
        let (_dir, path) = fake_smi(
            "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9",
        );
        let report = gpu::sample(Some(&path), Duration::from_secs(3));
        assert_eq!(report.source, GpuSource::None);
        assert!(report.gpus.is_empty());
        assert_eq!(
            report.note.as_deref(),
            Some(
                "nvidia-smi exited with code 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
            )
        );
    }

    #[test]
    fn process_query_failure_keeps_fresh_gpus() {
        let (_dir, path) = fake_smi(
            "case \"$1\" in --query-gpu*) echo '0, G, GPU-x, 1, 2, 3, 4, 5' ;; *) echo boom >&2; exit 3 ;; esac",
        );
        let report = gpu::sample(Some(&path), Duration::from_secs(3));
        assert_eq!(report.source, GpuSource::NvidiaSmi);
        assert_eq!(report.gpus.len(), 1);
        assert!(report.processes.is_empty());
        assert_eq!(
            report.note.as_deref(),
            Some("GPU processes unavailable: nvidia-smi exited with code 3: boom")
        );
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_duration(90_061), "1d 01h 01m");
        assert_eq!(human_duration(3_660), "1h 01m");
    }
}
