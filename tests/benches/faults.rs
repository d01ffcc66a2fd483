//! Liveness and control-traffic benchmarks (issue 14), on a private sshd behind the chaos proxy:
//!
//! - exec latency (p50/p99) while a saturating upload runs on the same sandbox, on loopback and
//!   on a 10 Mbit/s link, against the same calls on an idle channel and OpenSSH's `ssh host
//!   true` (targets: p99 ≤ 50 ms on loopback);
//! - time to detect a black-holed link under a saturating 10 Mbit/s upload (target ≤ 15 s).
//!
//! Prints numbers; asserts nothing. Sizes by environment, so a short run is possible:
//! `RSB_BENCH_RUNS` (detection runs, default 3), `RSB_BENCH_SAMPLES` (exec samples per
//! configuration, default 200), `RSB_BENCH_UPLOAD_MIB` (file size, default 256),
//! `RSB_BENCH_ONLY=loopback` or `=10` (only that exec-under-upload configuration).
//!
//! `cargo bench -p rsb-tests --bench faults`

#[path = "../tests/common/mod.rs"]
mod common;

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use rsb::{
    app::App,
    config::Config,
    ops::sync::{self as ops, SyncArgs},
    sync::CancellationToken,
};
use rsb_protocol::ExecRequest;
use rsb_tests::{ChaosProxy, Sshd};

const MIB: u64 = 1024 * 1024;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn app_on(sshd: &Sshd, port: u16, state: &Path) -> Arc<App> {
    let t = common::target(
        sshd,
        port,
        common::key_auth(sshd),
        &state.join("known_hosts"),
    );
    App::new(Arc::new(Config {
        sandboxes: vec![common::sandbox("s", t)],
        expose_advanced_tools: false,
        inline_sync_max_files: 100_000,
        inline_sync_max_bytes: 1 << 40,
        policy: Default::default(),
        state_dir: state.to_path_buf(),
        source: "bench".into(),
        warnings: vec![],
    }))
}

/// Uploads `src` again and again (each time to a fresh remote directory, removed afterwards)
/// until `stop`.
async fn saturate(pool: Arc<App>, sshd_home: PathBuf, src: PathBuf, stop: Arc<AtomicBool>) {
    let mut i = 0u32;
    while !stop.load(Ordering::SeqCst) {
        let rel = format!("sat/{i}");
        let args = SyncArgs {
            local_path: src.display().to_string(),
            remote_path: rel.clone(),
            ..Default::default()
        };
        let _ = ops::sync_local_to_remote(&pool, args, None, &CancellationToken::new()).await;
        let _ = std::fs::remove_dir_all(sshd_home.join(&rel));
        i += 1;
    }
}

/// Exec round trips on `pool` while an upload saturates its link: only samples during which
/// upload bytes moved through `proxy` count.
async fn exec_under_upload(
    sshd: &Sshd,
    proxy: &ChaosProxy,
    pool: &Arc<App>,
    src: &Path,
    samples: usize,
    spacing: Duration,
) -> (Vec<Duration>, Vec<Duration>) {
    let c = pool.pool().client("s").await.expect("connect");
    let mut idle = Vec::new();
    for _ in 0..samples.min(100) {
        let t = Instant::now();
        c.call(ExecRequest::new("true")).await.unwrap();
        idle.push(t.elapsed());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let up = tokio::spawn(saturate(
        pool.clone(),
        sshd.home().to_path_buf(),
        src.to_path_buf(),
        stop.clone(),
    ));
    let mut busy = Vec::new();
    let t0 = Instant::now();
    while busy.len() < samples && t0.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(spacing).await;
        let before = proxy.bytes_forwarded().0;
        let t = Instant::now();
        let r = c.call(ExecRequest::new("true")).await;
        let took = t.elapsed();
        if r.is_err() {
            break;
        }
        if proxy.bytes_forwarded().0 > before {
            busy.push(took);
        }
    }
    stop.store(true, Ordering::SeqCst);
    let _ = tokio::time::timeout(Duration::from_secs(120), up).await;
    (idle, busy)
}

/// Seconds from black-holing a 10 Mbit/s link under a saturating upload until the upload and
/// an exec issued after the fault have both failed.
async fn detection_once(sshd: &Sshd, src: &Path, state: &Path) -> (f64, f64) {
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    proxy.set_rate_mbit(10);
    let pool = app_on(sshd, proxy.port(), state);
    let c = pool.pool().client("s").await.expect("connect");
    let args = SyncArgs {
        local_path: src.display().to_string(),
        remote_path: "detect".into(),
        ..Default::default()
    };
    let run = tokio::spawn({
        let pool = pool.clone();
        async move { ops::sync_local_to_remote(&pool, args, None, &CancellationToken::new()).await }
    });
    let t0 = Instant::now();
    while proxy.bytes_forwarded().0 < 2 * MIB && t0.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.blackhole(true);
    let t = Instant::now();
    let probe = tokio::spawn(async move { c.call(ExecRequest::new("true")).await });
    let sync_s = match tokio::time::timeout(Duration::from_secs(120), run).await {
        Ok(_) => t.elapsed().as_secs_f64(),
        Err(_) => f64::INFINITY,
    };
    let exec_s = match tokio::time::timeout(Duration::from_secs(120), probe).await {
        Ok(_) => t.elapsed().as_secs_f64(),
        Err(_) => f64::INFINITY,
    };
    proxy.reset();
    pool.shutdown().await;
    let _ = std::fs::remove_dir_all(sshd.home().join("detect"));
    (sync_s, exec_s)
}

fn main() {
    let runs = env_u64("RSB_BENCH_RUNS", 3) as usize;
    let samples = env_u64("RSB_BENCH_SAMPLES", 200) as usize;
    let upload_mib = env_u64("RSB_BENCH_UPLOAD_MIB", 256);
    let sshd = Sshd::start().expect("sshd");
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(
        src.join("big.bin"),
        common::gen_bytes(1, (upload_mib * MIB) as usize),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut ssh = Vec::new();
        for _ in 0..10 {
            let t = Instant::now();
            let o = sshd.ssh_command("true").output().unwrap();
            assert!(o.status.success());
            ssh.push(t.elapsed());
        }
        let ssh50 = pct(&mut ssh, 0.5);
        println!("ssh host true (idle)                 p50 {ssh50:8.2} ms  (n={})", ssh.len());

        let only = std::env::var("RSB_BENCH_ONLY").unwrap_or_default();
        for (label, mbit, spacing) in [
            ("loopback", None, Duration::from_millis(20)),
            ("10 Mbit/s", Some(10), Duration::from_millis(100)),
        ] {
            if !only.is_empty() && !label.starts_with(only.as_str()) {
                continue;
            }
            let proxy = ChaosProxy::start(sshd.addr()).unwrap();
            if let Some(m) = mbit {
                proxy.set_rate_mbit(m);
            }
            let state = dir.path().join(format!("state-{}", mbit.unwrap_or(0)));
            let pool = app_on(&sshd, proxy.port(), &state);
            let n = if mbit.is_some() {
                samples.min(100)
            } else {
                samples
            };
            let (mut idle, mut busy) =
                exec_under_upload(&sshd, &proxy, &pool, &src, n, spacing).await;
            let (i50, i99) = (pct(&mut idle, 0.5), pct(&mut idle, 0.99));
            let (b50, b99) = (pct(&mut busy, 0.5), pct(&mut busy, 0.99));
            println!(
                "exec {label:9} idle                  p50 {i50:8.2} ms  p99 {i99:8.2} ms  (n={})",
                idle.len()
            );
            println!(
                "exec {label:9} during upload         p50 {b50:8.2} ms  p99 {b99:8.2} ms  (n={})  p99/idle-p99 {:.1}  p50/ssh {:.3}",
                busy.len(),
                b99 / i99,
                b50 / ssh50
            );
            pool.shutdown().await;
        }

        let mut sync_s = Vec::new();
        let mut exec_s = Vec::new();
        for i in 0..runs {
            let (s, e) = detection_once(&sshd, &src, &dir.path().join(format!("d{i}"))).await;
            println!("dead link run {i}: upload failed after {s:.2} s, exec after {e:.2} s");
            sync_s.push(s);
            exec_s.push(e);
        }
        println!(
            "dead-link detection under a 10 Mbit/s upload: median upload {:.2} s, exec {:.2} s (runs={runs}, target <= 15 s)",
            median(&mut sync_s),
            median(&mut exec_s)
        );
    });
}
