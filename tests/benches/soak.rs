//! Soak and scale through the real `rsb mcp` (issue 14):
//!
//! - soak: `RSB_SOAK_EXECS` `exec_bash` calls (default 10,000) and `RSB_SOAK_SYNCS` small
//!   uploads (default 500) through one server; RSS and open fds of rsb and of the remote agent
//!   sampled after a warm-up and at the end (target: ≤ 10 % growth);
//! - scale: `list_sandboxes(check_resources=true)` over `RSB_SWEEP_SANDBOXES` sandboxes (default
//!   100, all pointing at the same sshd under different names), cold and warm (targets: cold
//!   ≤ 2 s, warm ≤ 50 ms), against one `ssh host true` for scale.
//!
//! Prints numbers; asserts only that the calls succeed.
//!
//! `cargo bench -p rsb-tests --bench soak` (short: `RSB_SOAK_EXECS=1000 RSB_SOAK_SYNCS=50`;
//! sweep only: `RSB_SOAK_EXECS=0`; soak only: `RSB_SWEEP_SANDBOXES=0`; `RSB_SWEEP_RUNS` fresh
//! servers for the medians (3); `RSB_SOAK_BIN=debug` measures the debug `rsb`).

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use rmcp::{
    RoleClient, ServiceExt, model::CallToolRequestParams, service::RunningService,
    transport::TokioChildProcess,
};
use rsb_tests::{Sshd, workspace_root};
use serde_json::{Value, json};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The release rsb when it was built (unless `RSB_SOAK_BIN=debug`), else the debug one.
fn rsb_bin() -> PathBuf {
    let release = workspace_root().join("target/release/rsb");
    if release.exists() && std::env::var("RSB_SOAK_BIN").as_deref() != Ok("debug") {
        return release;
    }
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

struct Server {
    svc: RunningService<RoleClient, ()>,
    pid: i32,
    _home: tempfile::TempDir,
}

async fn start(list: &Value) -> Server {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(rsb_bin());
    cmd.arg("mcp")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("XDG_CONFIG_HOME", home.path().join(".config"))
        .env("RSB_STATE_DIR", home.path().join("state"))
        .env("REMOTE_SANDBOX_LIST", list.to_string());
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = transport.id().expect("pid") as i32;
    let svc = ().serve(transport).await.expect("initialize");
    Server {
        svc,
        pid,
        _home: home,
    }
}

impl Server {
    async fn call(&self, tool: &str, args: Value) -> Value {
        let Value::Object(args) = args else {
            panic!("arguments must be an object")
        };
        let r = self
            .svc
            .call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args))
            .await
            .unwrap_or_else(|e| panic!("{tool}: {e}"));
        let raw = serde_json::to_value(&r).unwrap();
        let text = raw["content"][0]["text"].as_str().unwrap_or_default();
        assert!(r.is_error != Some(true), "{tool} failed: {text}");
        serde_json::from_str(text).unwrap_or(Value::Null)
    }
}

fn entry(name: &str, sshd: &Sshd) -> Value {
    json!({"name": name, "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
           "key_file": sshd.client_key().display().to_string()})
}

/// (RSS in KiB, open fds) of a process, summed over `pids`.
fn usage(pids: &[i32]) -> (u64, u64) {
    let mut rss = 0;
    let mut fds = 0;
    for pid in pids {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        rss += status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        fds += std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count() as u64)
            .unwrap_or(0);
    }
    (rss, fds)
}

/// Descendant processes of `root` named `comm` (the sshd and rsb run on this machine).
fn descendants_named(root: i32, comm: &str) -> Vec<i32> {
    let ppid = |pid: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = &stat[stat.rfind(')')? + 2..];
        rest.split_whitespace().nth(1)?.parse().ok()
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let c = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if c.trim() != comm {
            continue;
        }
        let mut p = pid;
        for _ in 0..32 {
            match ppid(p) {
                Some(q) if q == root => {
                    out.push(pid);
                    break;
                }
                Some(q) if q > 1 => p = q,
                _ => break,
            }
        }
    }
    out
}

fn growth(a: u64, b: u64) -> f64 {
    if a == 0 {
        return f64::NAN;
    }
    (b as f64 / a as f64 - 1.0) * 100.0
}

async fn soak(sshd: &Sshd, src: &Path) {
    let execs = env_u64("RSB_SOAK_EXECS", 10_000);
    let syncs = env_u64("RSB_SOAK_SYNCS", 500);
    let server = start(&json!([entry("s", sshd)])).await;
    let sshd_pid = sshd.pid().expect("sshd pid") as i32;
    let exec = |i: u64| json!({"command": format!("echo {i}"), "timeout_s": 30});
    let sync = || json!({"local_path": src.display().to_string(), "remote_path": "soak"});
    // Warm-up: connect, deploy, first sync (starts the local agent), allocator settles.
    let warm = (execs / 20).max(50);
    for i in 0..warm {
        server.call("exec_bash", exec(i)).await;
    }
    for _ in 0..(syncs / 20).max(5) {
        server.call("sync_local_to_remote", sync()).await;
    }
    let agents = || descendants_named(sshd_pid, "rsb-agent");
    let (rsb0, agent0) = (usage(&[server.pid]), usage(&agents()));
    let t0 = Instant::now();
    let every = (execs / syncs.max(1)).max(1);
    let mut done_syncs = 0;
    for i in 0..execs {
        let v = server.call("exec_bash", exec(i)).await;
        assert_eq!(
            v["stdout"].as_str().map(str::trim),
            Some(i.to_string().as_str())
        );
        if i % every == 0 && done_syncs < syncs {
            std::fs::write(src.join("changing.txt"), format!("{i}\n")).unwrap();
            server.call("sync_local_to_remote", sync()).await;
            done_syncs += 1;
        }
    }
    let took = t0.elapsed();
    let (rsb1, agent1) = (usage(&[server.pid]), usage(&agents()));
    println!(
        "soak: {execs} exec_bash + {done_syncs} syncs through one rsb mcp in {:.1} s ({:.2} ms per exec incl. syncs)",
        took.as_secs_f64(),
        took.as_secs_f64() * 1000.0 / execs.max(1) as f64
    );
    println!(
        "soak: rsb mcp   RSS {} -> {} KiB ({:+.1} %), fds {} -> {} ({:+.1} %)",
        rsb0.0,
        rsb1.0,
        growth(rsb0.0, rsb1.0),
        rsb0.1,
        rsb1.1,
        growth(rsb0.1, rsb1.1)
    );
    println!(
        "soak: rsb-agent RSS {} -> {} KiB ({:+.1} %), fds {} -> {} ({:+.1} %)  (remote agents, summed)",
        agent0.0,
        agent1.0,
        growth(agent0.0, agent1.0),
        agent0.1,
        agent1.1,
        growth(agent0.1, agent1.1)
    );
    let _ = server.svc.cancel().await;
}

/// One cold `list_sandboxes(check_resources=true)` in a fresh `rsb mcp`, then `warm` more.
async fn sweep_once(list: &Value, warm_iters: usize) -> (Duration, usize, Vec<Duration>, usize) {
    let server = start(list).await;
    let args = json!({"check_resources": true});
    let alive = |v: &Value| {
        v["sandboxes"]
            .as_array()
            .map(|a| a.iter().filter(|s| s["connection_alive"] == true).count())
            .unwrap_or(0)
    };
    let t = Instant::now();
    let v = server.call("list_sandboxes", args.clone()).await;
    let cold = t.elapsed();
    let cold_alive = alive(&v);
    if let Some(e) = v["sandboxes"]
        .as_array()
        .and_then(|a| a.iter().find_map(|s| s["connection_error"].as_str()))
    {
        println!("sweep: first connection error: {e}");
    }
    let mut warm = Vec::new();
    let mut warm_alive = 0;
    for _ in 0..warm_iters {
        let t = Instant::now();
        let v = server.call("list_sandboxes", args.clone()).await;
        warm.push(t.elapsed());
        warm_alive = alive(&v);
    }
    warm.sort();
    let _ = server.svc.cancel().await;
    (cold, cold_alive, warm, warm_alive)
}

async fn sweep(sshd: &Sshd, fresh_host: bool) {
    let n = env_u64("RSB_SWEEP_SANDBOXES", 100);
    let list = Value::Array((0..n).map(|i| entry(&format!("s{i:03}"), sshd)).collect());
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let ssh = || {
        let t = Instant::now();
        let o = sshd.ssh_command("true").output().unwrap();
        assert!(o.status.success());
        t.elapsed()
    };
    // The first server may have to upload the agent (a fresh host); the later ones find it.
    let (cold1, alive1, _, _) = sweep_once(&list, 0).await;
    let ssh1 = ssh();
    println!(
        "list_sandboxes(check_resources) over {n} sandboxes, first rsb mcp{}: cold {:.0} ms ({alive1} alive); ssh host true {:.0} ms",
        if fresh_host {
            " (uploads the agent)"
        } else {
            ""
        },
        ms(cold1),
        ms(ssh1)
    );
    let runs = env_u64("RSB_SWEEP_RUNS", 3).max(1);
    let mut colds = Vec::new();
    let mut warms = Vec::new();
    let mut sshs = Vec::new();
    let mut alive = (0, 0);
    for _ in 0..runs {
        let (cold, ca, warm, wa) = sweep_once(&list, 5).await;
        colds.push(cold);
        warms.push(warm[warm.len() / 2]);
        sshs.push(ssh());
        alive = (ca, wa);
    }
    colds.sort();
    warms.sort();
    sshs.sort();
    let (cold, warm, ssh) = (
        colds[colds.len() / 2],
        warms[warms.len() / 2],
        sshs[sshs.len() / 2],
    );
    println!(
        "list_sandboxes(check_resources) over {n} sandboxes (agent installed), medians of {runs} fresh servers: cold {:.0} ms ({} alive), warm {:.1} ms ({} alive) (targets: cold <= 2000 ms, warm <= 50 ms); ssh host true {:.0} ms, cold/ssh {:.1}",
        ms(cold),
        alive.0,
        ms(warm),
        alive.1,
        ms(ssh),
        cold.as_secs_f64() / ssh.as_secs_f64()
    );
    println!(
        "sweep: cold runs {:?} ms, warm medians {:?} ms",
        colds.iter().map(|d| ms(*d).round()).collect::<Vec<_>>(),
        warms
            .iter()
            .map(|d| (ms(*d) * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    );
}

fn main() {
    let sshd = Sshd::start().expect("sshd");
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("small");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..20 {
        std::fs::write(src.join(format!("f{i}.txt")), format!("file {i}\n")).unwrap();
    }
    println!("rsb binary: {}", rsb_bin().display());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let soaked = env_u64("RSB_SOAK_EXECS", 10_000) > 0;
        if soaked {
            soak(&sshd, &src).await;
        }
        if env_u64("RSB_SWEEP_SANDBOXES", 100) > 0 {
            sweep(&sshd, !soaked).await;
        }
    });
}
