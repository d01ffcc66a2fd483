//! End-to-end checks of `rsb-agent resources`: the real binary, a PATH we control, and fake
//! `nvidia-smi` scripts standing in for the driver's good, hung and broken moods.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rsb_protocol::{GpuSource, ResourceSnapshot};

/// Writing an executable while another test thread forks can leave the file "busy" (ETXTBSY)
/// for the exec: script writes take this lock exclusively, spawns take it shared.
static SPAWN_LOCK: RwLock<()> = RwLock::new(());

/// The agent's override of its nvidia-smi deadline; cleared unless a test sets it.
const SMI_TIMEOUT_ENV: &str = "RSB_NVIDIA_SMI_TIMEOUT_MS";

const GOOD_SMI: &str = r#"[ "$2" = "--format=csv,noheader,nounits" ] && [ $# -eq 2 ] || { echo "bad args: $*" >&2; exit 2; }
case "$1" in
--query-gpu=index,name,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw)
  echo '0, NVIDIA H200 NVL, GPU-11111111-aaaa, 37, 1024, 143771, 41, 123.45'
  echo '1, NVIDIA A100-SXM4-80GB, GPU-22222222-bbbb, [N/A], 0, 81920, [Not Supported], 61.20' ;;
--query-compute-apps=pid,gpu_uuid,used_memory)
  echo '4242, GPU-11111111-aaaa, 1000'
  echo '4343, GPU-22222222-bbbb, [N/A]' ;;
*) echo "unknown query $1" >&2; exit 2 ;;
esac"#;

/// A temp dir holding a fake `nvidia-smi` with `body`, and a PATH that finds it first (the rest
/// of PATH only supplies `sleep` and friends to the script).
fn fake_smi(body: &str) -> (tempfile::TempDir, OsString) {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("nvidia-smi");
    {
        let _guard = SPAWN_LOCK.write().unwrap_or_else(|e| e.into_inner());
        std::fs::write(&exe, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path =
        std::env::join_paths([dir.path(), Path::new("/usr/bin"), Path::new("/bin")]).unwrap();
    (dir, path)
}

/// Runs `rsb-agent resources ARGS` with exactly this PATH, killing it if it outlives `limit` so
/// that a hang fails the test instead of stalling the suite.
fn run_agent(
    args: &[&str],
    path: &OsString,
    env: &[(&str, &str)],
    limit: Duration,
) -> (Output, Duration) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rsb-agent"));
    cmd.arg("resources")
        .args(args)
        .env_remove(SMI_TIMEOUT_ENV)
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = {
        let _guard = SPAWN_LOCK.read().unwrap_or_else(|e| e.into_inner());
        cmd.spawn().unwrap()
    };
    let (mut out_pipe, mut err_pipe) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out_pipe.read_to_end(&mut buf);
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = err_pipe.read_to_end(&mut buf);
        buf
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rsb-agent resources {args:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let elapsed = start.elapsed();
    let output = Output {
        status,
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    };
    (output, elapsed)
}

fn snapshot(path: &OsString, env: &[(&str, &str)]) -> (ResourceSnapshot, Duration) {
    let (out, elapsed) = run_agent(&["--json"], path, env, Duration::from_secs(20));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let snap = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    (snap, elapsed)
}

fn empty_path() -> (tempfile::TempDir, OsString) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().as_os_str().to_owned();
    (dir, path)
}

#[test]
fn two_gpus_with_placeholders_and_their_processes() {
    let (_dir, path) = fake_smi(GOOD_SMI);
    let (snap, _) = snapshot(&path, &[]);
    let g = &snap.gpu;
    assert_eq!(g.source, GpuSource::NvidiaSmi, "{g:?}");
    assert_eq!(g.note, None);
    assert!(g.age_ms < 5000, "{}", g.age_ms);
    assert_eq!(g.gpus.len(), 2);
    let (a, b) = (&g.gpus[0], &g.gpus[1]);
    assert_eq!(
        (a.index, a.name.as_str(), a.uuid.as_str()),
        (0, "NVIDIA H200 NVL", "GPU-11111111-aaaa")
    );
    assert_eq!(
        (a.util_pct, a.mem_used_mib, a.mem_total_mib),
        (Some(37.0), Some(1024), Some(143771))
    );
    assert_eq!((a.temperature_c, a.power_w), (Some(41.0), Some(123.45)));
    assert_eq!((b.index, b.name.as_str()), (1, "NVIDIA A100-SXM4-80GB"));
    assert_eq!(b.util_pct, None, "[N/A] must not read as 0 %");
    assert_eq!(b.temperature_c, None, "[Not Supported] must not read as 0");
    assert_eq!((b.mem_used_mib, b.power_w), (Some(0), Some(61.2)));
    assert_eq!(g.processes.len(), 2);
    for (p, gpu) in g.processes.iter().zip([a, b]) {
        assert_eq!(p.gpu_uuid, gpu.uuid, "each process maps onto its GPU");
    }
    assert_eq!(
        (g.processes[0].pid, g.processes[0].used_mem_mib),
        (4242, Some(1000))
    );
    assert_eq!(
        (g.processes[1].pid, g.processes[1].used_mem_mib),
        (4343, None)
    );

    // The host part is real, and CPU % was measured over a real interval.
    assert!(snap.cpu.interval_ms >= 200, "{:?}", snap.cpu);
    assert!(snap.cpu.count >= 1 && snap.memory.total_bytes > 0 && snap.uptime_s > 0);
    assert!(!snap.hostname.is_empty());
}

#[test]
fn table_shows_gpus_with_their_processes() {
    let (_dir, path) = fake_smi(GOOD_SMI);
    let (out, _) = run_agent(&[], &path, &[], Duration::from_secs(20));
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in\n{text}"))
    };
    assert!(lines[at("cpu ")].contains("cores"), "{text}");
    assert!(lines[at("gpus ")].contains("2 via nvidia-smi"), "{text}");
    let gpu0 = at("[0] NVIDIA H200 NVL");
    let gpu1 = at("[1] NVIDIA A100-SXM4-80GB");
    assert!(
        lines[gpu0].contains("util 37 %") && lines[gpu0].contains("1024 / 143771 MiB"),
        "{text}"
    );
    assert!(
        lines[gpu1].contains("util n/a") && lines[gpu1].contains("temp n/a"),
        "{text}"
    );
    assert_eq!(
        at("pid 4242"),
        gpu0 + 1,
        "process listed under its GPU:\n{text}"
    );
    assert_eq!(
        at("pid 4343"),
        gpu1 + 1,
        "process listed under its GPU:\n{text}"
    );
}

#[test]
fn hung_nvidia_smi_is_killed_at_the_deadline() {
    let (dir, path) =
        fake_smi("[ -e \"$0.sleep\" ] && exit 0\nsleep 30 &\necho $! > \"$0.sleep\"\nwait");
    let (snap, elapsed) = snapshot(&path, &[(SMI_TIMEOUT_ENV, "500")]);
    assert!(
        elapsed < Duration::from_millis(2500),
        "took {elapsed:?} with a 500 ms deadline"
    );
    assert_eq!(snap.gpu.source, GpuSource::None);
    assert!(snap.gpu.gpus.is_empty() && snap.gpu.processes.is_empty());
    assert_eq!(
        snap.gpu.note.as_deref(),
        Some("nvidia-smi timed out after 500 ms")
    );

    // The whole group went, not just the shell: its `sleep 30` must not linger.
    let pid = std::fs::read_to_string(dir.path().join("nvidia-smi.sleep")).unwrap();
    let stat = format!("/proc/{}/stat", pid.trim());
    let by = Instant::now() + Duration::from_secs(3);
    let gone = || {
        std::fs::read_to_string(&stat).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
    };
    while !gone() && Instant::now() < by {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        gone(),
        "sleep {} from the hung nvidia-smi is still running",
        pid.trim()
    );
}

#[test]
fn failing_nvidia_smi_reports_none_with_a_note() {
    let (_dir, path) = fake_smi(
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.\"\nexit 9",
    );
    let (snap, _) = snapshot(&path, &[]);
    assert_eq!(snap.gpu.source, GpuSource::None);
    assert!(snap.gpu.gpus.is_empty());
    let note = snap.gpu.note.unwrap_or_default();
    assert!(
        note.starts_with("nvidia-smi exited with code 9: NVIDIA-SMI has failed because"),
        "{note}"
    );
}

#[test]
fn no_nvidia_smi_means_no_gpus_and_no_fuss() {
    let (_dir, path) = empty_path();
    let (snap, elapsed) = snapshot(&path, &[]);
    assert_eq!(snap.gpu.source, GpuSource::None);
    assert!(snap.gpu.gpus.is_empty());
    assert_eq!(snap.gpu.note, None);
    assert!(snap.cpu.interval_ms >= 200);
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
}

/// Busy threads, one per CPU, each stopping by itself after `max` even if the test panics.
fn burn(cpus: u32, max: Duration) -> (Arc<AtomicBool>, Vec<std::thread::JoinHandle<()>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let handles = (0..cpus.clamp(1, 64))
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) && start.elapsed() < max {
                    for i in 0..10_000u64 {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
                    }
                }
            })
        })
        .collect();
    (stop, handles)
}

#[test]
fn busy_cpus_raise_cpu_usage() {
    let (_dir, path) = empty_path();
    let (idle, _) = snapshot(&path, &[]);
    let (stop, handles) = burn(idle.cpu.count, Duration::from_secs(8));
    std::thread::sleep(Duration::from_millis(200));
    let (busy, _) = snapshot(&path, &[]);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    eprintln!(
        "cpu usage: baseline {:.1} %, busy {:.1} %",
        idle.cpu.usage_pct, busy.cpu.usage_pct
    );
    assert!(busy.cpu.usage_pct > 30.0, "busy {:?}", busy.cpu);
    // On a box already loaded by other work the baseline can be near 100 % too; the rise is
    // only checked when there was room for one.
    if idle.cpu.usage_pct < 50.0 {
        assert!(
            busy.cpu.usage_pct > idle.cpu.usage_pct + 15.0,
            "baseline {:?}, busy {:?}",
            idle.cpu,
            busy.cpu
        );
    }
}

#[test]
fn closed_stdout_is_an_error_not_a_panic() {
    let (_dir, path) = empty_path();
    let mut child = {
        let _guard = SPAWN_LOCK.read().unwrap_or_else(|e| e.into_inner());
        Command::new(env!("CARGO_BIN_EXE_rsb-agent"))
            .args(["resources", "--json"])
            .env("PATH", &path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(1), "{status:?} {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn arguments() {
    let (_dir, path) = empty_path();
    let (out, _) = run_agent(&["--help"], &path, &[], Duration::from_secs(5));
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("--json"));
    let (out, _) = run_agent(&["--jsn"], &path, &[], Duration::from_secs(5));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument '--jsn'"));
}
