//! `edit_remote_file` round trips end to end through `rsb mcp`, as a client sees them, on
//! loopback and through the chaos proxy at 20 ms RTT (issue 24 target: p50 ≤ 2 RTT + 5 ms),
//! next to OpenSSH `ssh host true` and `ssh host sed -i …` on the same sshd in the same run.
//!
//! The RTT printed is measured, not assumed: a TCP ping-pong on loopback, and the same through a
//! second chaos proxy with the same latency in front of an echo server. `(p50 - loopback p50) /
//! RTT` estimates how many network round trips one edit costs (the goal allows two; one agent
//! request is one).
//!
//! Run: `cargo build --release -p rsb --bin rsb && cargo bench -p rsb-tests --bench edit`.
//! Uses `target/release/rsb` when it exists, else `target/debug/rsb` (not representative).

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use rmcp::{ServiceExt, model::CallToolRequestParams, transport::TokioChildProcess};
use rsb_tests::{ChaosProxy, Sshd, output_with_timeout, workspace_root};
use serde_json::{Value, json};

const EDITS: usize = 30;
const WARMUP: usize = 3;
const SSH_N: usize = 15;
const ONE_WAY: Duration = Duration::from_millis(10);

struct Stats {
    p50: f64,
    p90: f64,
}

fn stats(mut ms: Vec<f64>) -> Stats {
    ms.sort_by(f64::total_cmp);
    let pct = |p: f64| ms[((ms.len() as f64 * p).ceil() as usize).clamp(1, ms.len()) - 1];
    Stats {
        p50: pct(0.50),
        p90: pct(0.90),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn rsb_bin() -> (PathBuf, &'static str) {
    let root = workspace_root();
    let release = root.join("target/release/rsb");
    if release.exists() {
        return (release, "release");
    }
    (
        root.join("target/debug/rsb"),
        "debug (NOT representative; build --release)",
    )
}

/// A one-connection echo server on loopback; returns its address.
fn echo_server() -> SocketAddr {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming().take(4) {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut b = [0u8; 64];
                while let Ok(n) = s.read(&mut b) {
                    if n == 0 || s.write_all(&b[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// Median of 20 one-byte ping-pongs to `addr`.
fn tcp_rtt(addr: SocketAddr) -> f64 {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut v = Vec::new();
    let mut b = [0u8; 1];
    for _ in 0..20 {
        let t = Instant::now();
        s.write_all(b"x").unwrap();
        s.read_exact(&mut b).unwrap();
        v.push(ms(t.elapsed()));
    }
    stats(v).p50
}

/// `ssh host CMD` timed `SSH_N` times through `port`.
fn ssh_stats(sshd: &Sshd, port: u16, cmd: &str) -> Stats {
    let mut v = Vec::new();
    for i in 0..SSH_N + 1 {
        let t = Instant::now();
        let out = output_with_timeout(
            &mut sshd.ssh_command_via_port(port, cmd),
            Duration::from_secs(60),
        )
        .expect("ssh");
        assert!(out.status.success(), "{cmd}: {out:?}");
        if i > 0 {
            v.push(ms(t.elapsed()));
        }
    }
    stats(v)
}

fn file_text() -> String {
    let mut s = String::new();
    for i in 0..200 {
        s.push_str(&format!("    let value_{i} = compute({i}, &config)?;\n"));
        if i == 100 {
            s.push_str("    let counter = 0;\n");
        }
    }
    s
}

struct Row {
    name: &'static str,
    rtt: f64,
    edit: Stats,
    ssh_true: Stats,
    ssh_sed: Stats,
}

fn main() {
    if std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && !"edit".contains(a.as_str()))
    {
        return;
    }
    let sshd = Sshd::start().expect("start the sshd fixture");
    let home = sshd.home().to_path_buf();
    let dir = home.join("editbench");
    std::fs::create_dir_all(&dir).unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).expect("proxy");
    proxy.set_latency(ONE_WAY);
    let echo = echo_server();
    let echo_proxy = ChaosProxy::start(echo).expect("echo proxy");
    echo_proxy.set_latency(ONE_WAY);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (bin, kind) = rsb_bin();
    println!("rsb binary: {} [{kind}]", bin.display());
    let key = sshd.client_key().display().to_string();
    let list = json!([
        {"name": "lo", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(), "key_file": key},
        {"name": "wan", "host": sshd.host(), "port": proxy.port(), "user": sshd.user(), "key_file": key},
    ]);
    let state = tempfile::tempdir().unwrap();
    let client = rt.block_on(async {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.arg("mcp")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", state.path())
            .env("RSB_STATE_DIR", state.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", list.to_string());
        let (transport, _) = TokioChildProcess::builder(cmd)
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn rsb mcp");
        ().serve(transport).await.expect("MCP initialize")
    });
    let edit = |sandbox: &str, path: &str, old: &str, new: &str| -> f64 {
        let Value::Object(args) = json!({"sandbox_name": sandbox, "remote_path": path,
            "old_string": old, "new_string": new})
        else {
            unreachable!()
        };
        rt.block_on(async {
            let t = Instant::now();
            let r = client
                .call_tool(CallToolRequestParams::new("edit_remote_file").with_arguments(args))
                .await
                .expect("edit_remote_file");
            let took = ms(t.elapsed());
            assert_ne!(r.is_error, Some(true), "{r:?}");
            took
        })
    };

    let mut rows = Vec::new();
    for (name, sandbox, port, rtt_addr) in [
        ("loopback", "lo", sshd.port(), echo),
        ("20 ms RTT", "wan", proxy.port(), echo_proxy.addr()),
    ] {
        let file = format!("editbench/{sandbox}.txt");
        let local: &Path = &home.join(&file);
        std::fs::write(local, file_text()).unwrap();
        let mut n = 0usize;
        let step = |n: &mut usize| {
            let t = edit(
                sandbox,
                &file,
                &format!("let counter = {n};"),
                &format!("let counter = {};", *n + 1),
            );
            *n += 1;
            t
        };
        for _ in 0..WARMUP {
            step(&mut n);
        }
        let samples: Vec<f64> = (0..EDITS).map(|_| step(&mut n)).collect();
        let after = std::fs::read_to_string(local).unwrap();
        assert_eq!(
            after,
            file_text().replace("let counter = 0;", &format!("let counter = {n};")),
            "every edit landed"
        );
        let sed = format!(
            "sed -i 's/let counter = [0-9]*;/let counter = 7;/' {}",
            home.join(&file).display()
        );
        rows.push(Row {
            name,
            rtt: tcp_rtt(rtt_addr),
            edit: stats(samples),
            ssh_true: ssh_stats(&sshd, port, "true"),
            ssh_sed: ssh_stats(&sshd, port, &sed),
        });
    }
    rt.block_on(async {
        let _ = client.cancel().await;
    });

    println!();
    println!(
        "| link | RTT (ms) | edit p50 (ms) | edit p90 (ms) | goal 2 RTT + 5 ms | ssh true p50 | ssh sed -i p50 | edit/ssh-sed | round trips ≈ | target |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let base = rows[0].edit.p50;
    let mut all = true;
    for r in &rows {
        let goal = 2.0 * r.rtt + 5.0;
        let met = r.edit.p50 <= goal;
        all &= met;
        let trips = if r.rtt >= 1.0 {
            format!("{:.1}", (r.edit.p50 - base) / r.rtt)
        } else {
            "-".into()
        };
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.3}x | {trips} | {} |",
            r.name,
            r.rtt,
            r.edit.p50,
            r.edit.p90,
            goal,
            r.ssh_true.p50,
            r.ssh_sed.p50,
            r.edit.p50 / r.ssh_sed.p50,
            if met { "MET" } else { "MISSED" }
        );
    }
    println!(
        "target edit p50 <= 2 RTT + 5 ms (n={EDITS} each): {}",
        if all { "MET" } else { "MISSED" }
    );
}
