//! Watchdog cost and latency, measured on real things: a real `rsb watchdog run` watching 100
//! jobs (5 s interval) on 3 sandboxes (3 private sshd fixtures), and the time from a job's exit
//! to its `completed` event.
//!
//! `cargo bench -p rsb-tests --bench watchdog` (uses target/release/rsb when it exists, else
//! target/debug/rsb, and says which). Prints; asserts nothing.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use rsb::{
    config::{Auth, Config, HostKeyPolicy, SandboxConfig, SshTarget, Transport},
    ops::{jobs, watchdog as wops},
    pool::Pool,
};
use rsb_tests::{Sshd, workspace_root};

const WATCHES: usize = 100;
const SANDBOXES: usize = 3;
const MEASURE: Duration = Duration::from_secs(60);

fn rsb_bin() -> PathBuf {
    let release = workspace_root().join("target/release/rsb");
    let debug = workspace_root().join("target/debug/rsb");
    let p = if release.exists() { release } else { debug };
    assert!(p.exists(), "build rsb first: cargo build --release --bins");
    p
}

fn sandbox(name: &str, sshd: &Sshd, known: &Path) -> SandboxConfig {
    SandboxConfig {
        name: name.into(),
        transport: Transport::Ssh(SshTarget {
            host: "127.0.0.1".into(),
            port: sshd.port(),
            user: sshd.user().into(),
            auth: Auth::KeyFile {
                path: sshd.client_key().to_path_buf(),
                passphrase: None,
            },
            proxy_jump: Vec::new(),
            host_key_policy: HostKeyPolicy::AcceptNew,
            known_hosts: vec![known.to_path_buf()],
            connect_timeout: Duration::from_secs(10),
        }),
        slurm: None,
        sudo: None,
        policy: Default::default(),
        confine: None,
    }
}

fn args(interval_s: i64) -> wops::WatchArgs {
    wops::WatchArgs {
        checkpoint_format: "text".into(),
        interval_s,
        max_log_lines: 80,
        max_resume_attempts: 1,
        notify_local: false,
        alert_after_failures: 2,
        resume_delay_s: 0,
        ..Default::default()
    }
}

async fn watch_job(
    pool: &Pool,
    state: &Path,
    sb: &str,
    name: &str,
    cmd: &str,
    interval_s: i64,
) -> i64 {
    let mut nw = wops::prepare(&args(interval_s), true, true).unwrap();
    let c = pool.client(sb).await.unwrap();
    let v = jobs::start(&c, cmd, (name, "", ""), None, None)
        .await
        .unwrap();
    wops::fill_from_job(&mut nw, name, &v.log_file, "");
    nw.sandbox_name = sb.into();
    let cfgs = pool.config().sandboxes.clone();
    let store = rsb::store::Store::new(state);
    let id = wops::register(&store, &cfgs, nw, false)
        .await
        .unwrap()
        .watch_id;
    store.close().await;
    id
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the comm: state is index 0; utime 11, stime 12.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

async fn completed_lag_ms(pool: &Pool, state: &Path, sb: &str, name: &str, interval_s: i64) -> i64 {
    let id = watch_job(pool, state, sb, name, "sleep 2; exit 0", interval_s).await;
    let c = pool.client(sb).await.unwrap();
    let t0 = Instant::now();
    loop {
        let conn = rsb::store::open(state).unwrap();
        let ev: Option<i64> = conn
            .query_row(
                "SELECT created_ms FROM watch_events WHERE watch_id = ?1 AND event_type = 'completed'",
                [id],
                |r| r.get(0),
            )
            .ok();
        if let Some(created) = ev {
            let req = jobs::status_request(name, "", 1, None, 1).unwrap();
            let ended = c.call(req).await.unwrap().info.unwrap().ended_ms.unwrap() as i64;
            return created - ended;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no completed event");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn median(mut v: Vec<i64>) -> i64 {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let bin = rsb_bin();
    println!("daemon binary: {}", bin.display());
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let known = tmp.path().join("known_hosts");
    let sshds: Vec<Sshd> = (0..SANDBOXES).map(|_| Sshd::start().unwrap()).collect();
    let sandboxes: Vec<SandboxConfig> = sshds
        .iter()
        .enumerate()
        .map(|(i, s)| sandbox(&format!("sb{i}"), s, &known))
        .collect();
    let config = Config {
        sandboxes: sandboxes.clone(),
        expose_advanced_tools: false,
        inline_sync_max_files: 200,
        inline_sync_max_bytes: 64 << 20,
        policy: Default::default(),
        state_dir: tmp.path().to_path_buf(),
        source: "bench".into(),
        warnings: vec![],
    };
    let pool = Pool::new(Arc::new(config));
    let t0 = Instant::now();
    for i in 0..WATCHES {
        let sb = format!("sb{}", i % SANDBOXES);
        watch_job(&pool, &state, &sb, &format!("w{i}"), "sleep 3600", 5).await;
    }
    println!(
        "started and registered {WATCHES} jobs in {:.1}s",
        t0.elapsed().as_secs_f64()
    );

    let log = std::fs::File::create(tmp.path().join("daemon.log")).unwrap();
    let mut child = Command::new(&bin)
        .args(["watchdog", "run", "--loop-sleep", "1"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", tmp.path())
        .env("RSB_CONFIG", tmp.path().join("none.toml"))
        .env("RSB_STATE_DIR", &state)
        .env("RSB_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let pid = child.id();
    // Warm-up: every watch checked once (connections open).
    let t0 = Instant::now();
    loop {
        let conn = rsb::store::open(&state).unwrap();
        let n: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM watches WHERE last_state = 'running'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        if n as usize >= WATCHES {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "only {n} watches checked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "warm-up: all {WATCHES} watches checked after {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (c0, w0) = (cpu_ticks(pid), Instant::now());
    let mut rss_max = 0;
    while w0.elapsed() < MEASURE {
        rss_max = rss_max.max(rss_kb(pid));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let cpu = (cpu_ticks(pid) - c0) as f64 / ticks_per_s() / w0.elapsed().as_secs_f64() * 100.0;
    println!(
        "daemon, {WATCHES} watches at 5 s over {SANDBOXES} sandboxes, {}s: CPU {cpu:.2}% of one core, RSS {:.1} MB (max) (targets: < 1 %, < 30 MB)",
        MEASURE.as_secs(),
        rss_max as f64 / 1024.0
    );

    let mut at1 = Vec::new();
    let mut at5 = Vec::new();
    for i in 0..5 {
        at1.push(completed_lag_ms(&pool, &state, "sb0", &format!("lag1-{i}"), 1).await);
        at5.push(completed_lag_ms(&pool, &state, "sb1", &format!("lag5-{i}"), 5).await);
    }
    println!(
        "job exit -> completed event (with the {WATCHES} watches running): interval 1 s: median {} ms {:?}; interval 5 s: median {} ms {:?}",
        median(at1.clone()),
        at1,
        median(at5.clone()),
        at5
    );

    let _ = child.kill();
    let _ = child.wait();
    for s in &sshds {
        let _ = s.ssh_run("tmux kill-server");
    }
    pool.shutdown().await;
}
