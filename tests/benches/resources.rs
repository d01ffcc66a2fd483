//! `list_sandboxes(check_resources=true)` latency: warm over 3 sandboxes (target p50 ≤ 20 ms;
//! the Python server took 288 ms), and a cold + warm sweep over 20 sandboxes, each a separate
//! private sshd on a loopback port. Prints numbers; asserts only sanity (every sandbox answered).
//!
//! `cargo bench -p rsb-tests --bench resources`
//!
//! The 3 hosts run a fake `nvidia-smi` that takes 300 ms per call, like a real one on a busy
//! multi-GPU box: the warm numbers show the reply never waits for it (the agent samples in the
//! background).

#[path = "../tests/common/mod.rs"]
mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rsb::{ops::sandboxes, pool::Pool};
use rsb_tests::{Sshd, SshdOptions};
use serde_json::Value;

const WARMUP: usize = 5;
const ITERS_3: usize = 50;
const HOSTS_SWEEP: usize = 20;
const ITERS_SWEEP: usize = 20;

const SLOW_SMI: &str = "#!/bin/sh\n\
    sleep 0.3\n\
    case \"$*\" in\n\
    *--query-gpu=*)\n\
    echo '0, NVIDIA Fake A100, GPU-aaaa, 37, 20480, 81920, 41, 123.45'\n\
    echo '1, NVIDIA Fake A100, GPU-bbbb, [N/A], 2048, 81920, 35, [N/A]' ;;\n\
    *--query-compute-apps=*) echo '4242, GPU-aaaa, 500' ;;\n\
    esac\n";

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    ms(v[i])
}

/// Starts `n` fixtures, a few at a time (each runs ssh-keygen three times).
fn start_sshds(n: usize, opts: &SshdOptions) -> Vec<Sshd> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let batch = (n - out.len()).min(4);
        let started: Vec<Sshd> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..batch)
                .map(|_| s.spawn(|| Sshd::start_with(opts.clone())))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("thread").expect("sshd"))
                .collect()
        });
        out.extend(started);
    }
    out
}

fn pool_over(sshds: &[Sshd], dir: &Path) -> Arc<Pool> {
    let kh = dir.join("known_hosts");
    let sbs = sshds
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut t = common::target(s, s.port(), common::key_auth(s), &kh);
            t.connect_timeout = Duration::from_secs(10);
            common::sandbox(&format!("s{i:02}"), t)
        })
        .collect();
    common::pool_of(sbs, dir)
}

/// Every sandbox alive with numbers: a benchmark of error replies would be meaningless.
fn check_all(v: &Value, n: usize) {
    let list = v["sandboxes"].as_array().expect("sandboxes");
    assert_eq!(list.len(), n);
    for s in list {
        assert_eq!(s["connection_alive"], true, "{s:#}");
        assert!(s["resources"]["idle_score"].is_number(), "{s:#}");
    }
}

async fn timed_list(pool: &Arc<Pool>, resources: bool) -> (Value, Duration) {
    let t = Instant::now();
    // Without resources: a ping to each (what `rsb sandboxes` does), the round trip measured.
    let depth = if resources {
        sandboxes::Listing::Resources
    } else {
        sandboxes::Listing::Probe
    };
    let v = serde_json::to_value(sandboxes::list(pool, depth).await).unwrap();
    (v, t.elapsed())
}

async fn warm_series(pool: &Arc<Pool>, n: usize, iters: usize, resources: bool) -> Vec<Duration> {
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        let (r, d) = timed_list(pool, resources).await;
        if resources {
            check_all(&r, n);
        }
        v.push(d);
    }
    v
}

fn main() {
    let started = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // --- 3 sandboxes, each with a slow (300 ms) two-GPU nvidia-smi ---------------------------
    let fakebin = tempfile::tempdir().unwrap();
    std::fs::set_permissions(fakebin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let smi = fakebin.path().join("nvidia-smi");
    std::fs::write(&smi, SLOW_SMI).unwrap();
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    let opts = SshdOptions {
        set_env: vec![(
            "PATH".into(),
            format!("{}:/usr/bin:/bin", fakebin.path().display()),
        )],
        ..Default::default()
    };
    let three = start_sshds(3, &opts);
    let dir3 = tempfile::tempdir().unwrap();
    rt.block_on(async {
        let pool = pool_over(&three, dir3.path());
        let (v, cold) = timed_list(&pool, true).await;
        check_all(&v, 3);
        let gpus = v["sandboxes"][0]["resources"]["gpu"]
            .as_array()
            .map_or(0, Vec::len);
        assert_eq!(gpus, 2, "the fake nvidia-smi was used: {v:#}");
        println!(
            "3 sandboxes: cold list(check_resources) (connect+deploy+first sample): {:.1} ms",
            ms(cold)
        );
        let _ = warm_series(&pool, 3, WARMUP, true).await;
        let mut warm = warm_series(&pool, 3, ITERS_3, true).await;
        let mut plain = warm_series(&pool, 3, ITERS_3, false).await;
        let (p50, p99, max) = (
            pct(&mut warm, 0.5),
            pct(&mut warm, 0.99),
            ms(*warm.iter().max().unwrap()),
        );
        println!(
            "3 sandboxes: warm list(check_resources=true)  p50 {p50:.3} ms  p99 {p99:.3} ms  max {max:.3} ms  (n={ITERS_3}; target p50 <= 20 ms, Python 288 ms)"
        );
        println!(
            "3 sandboxes: warm list(check_resources=false) p50 {:.3} ms  p99 {:.3} ms  (n={ITERS_3})",
            pct(&mut plain, 0.5),
            pct(&mut plain, 0.99)
        );
        println!(
            "3 sandboxes: p50 vs target: {}",
            if p50 <= 20.0 { "MET" } else { "MISSED" }
        );
        pool.shutdown().await;
    });
    drop(three);

    // --- 20 sandboxes, 20 separate sshds -----------------------------------------------------
    let t = Instant::now();
    let many = start_sshds(HOSTS_SWEEP, &SshdOptions::default());
    println!(
        "{HOSTS_SWEEP} sandboxes: started {HOSTS_SWEEP} sshd fixtures in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let dir20 = tempfile::tempdir().unwrap();
    rt.block_on(async {
        let pool = pool_over(&many, dir20.path());
        let (v, cold) = timed_list(&pool, true).await;
        check_all(&v, HOSTS_SWEEP);
        println!(
            "{HOSTS_SWEEP} sandboxes: cold list(check_resources) (20 connects+deploys in parallel): {:.1} ms",
            ms(cold)
        );
        let _ = warm_series(&pool, HOSTS_SWEEP, 2, true).await;
        let mut warm = warm_series(&pool, HOSTS_SWEEP, ITERS_SWEEP, true).await;
        println!(
            "{HOSTS_SWEEP} sandboxes: warm list(check_resources=true)  p50 {:.3} ms  p99 {:.3} ms  (n={ITERS_SWEEP})",
            pct(&mut warm, 0.5),
            pct(&mut warm, 0.99)
        );
        pool.shutdown().await;
    });
    drop(many);
    println!("total bench time {:.1} s", started.elapsed().as_secs_f64());
}
