//! Sync as an MCP client sees it (issue 10): `sync_local_to_remote` / `sync_remote_to_local`
//! through a real `rsb mcp` (rmcp client, child-process transport), timed from the call to the
//! reply, plus every `check_file_transfer_task` poll the reply makes the client do (a plan
//! that runs in the background costs its polling too; polls are 50 ms apart, a fast client's
//! rate). The reference is `rsync -a -e ssh` on the same sshd in the same run. Medians of
//! `RSB_BENCH_REPS` (default 3; 5 for the no-change row). Prints the table; asserts only that
//! each sync did what it should.
//!
//! Run: `cargo build --release -p rsb-agent -p rsb --bins && cargo bench -p rsb-tests --bench
//! mcp_sync`. Uses `target/release/rsb` when built (else debug: numbers not representative).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/forward.rs"]
mod fwd;
use common::small_tree;

use std::time::{Duration, Instant};

use rmcp::{
    RoleClient, ServiceExt, model::CallToolRequestParams, service::RunningService,
    transport::TokioChildProcess,
};
use rsb_tests::Sshd;
use serde_json::{Value, json};

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1000.0
}

fn rsync(sshd: &Sshd, src: &str, dst: &str) -> Duration {
    sshd.rsync(&["-a"], None, src, dst)
}

type Client = RunningService<RoleClient, ()>;

async fn call(client: &Client, tool: &'static str, args: Value) -> Value {
    let Value::Object(args) = args else {
        unreachable!()
    };
    let r = client
        .call_tool(CallToolRequestParams::new(tool).with_arguments(args))
        .await
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    let v = serde_json::to_value(&r).unwrap();
    let text = v["content"][0]["text"].as_str().unwrap_or_default();
    assert_ne!(r.is_error, Some(true), "{tool} failed: {text}");
    serde_json::from_str(text).unwrap_or_else(|_| json!({ "text": text }))
}

/// One sync tool call, polled to completion when it went to the background. Returns the time
/// the client spent, whether it was inline, and the final reply.
async fn sync(client: &Client, tool: &'static str, args: Value) -> (Duration, bool, Value) {
    let t = Instant::now();
    let mut v = call(client, tool, args).await;
    let inline = v.get("task_id").is_none();
    if let Some(id) = v.get("task_id").cloned() {
        for _ in 0..6000 {
            let s = call(
                client,
                "check_file_transfer_task",
                json!({"task_id": id, "last_n_lines": 1}),
            )
            .await;
            match s["status"].as_str() {
                Some("completed") => {
                    v = s;
                    break;
                }
                Some("queued" | "running") => tokio::time::sleep(Duration::from_millis(50)).await,
                other => panic!("transfer ended {other:?}: {s}"),
            }
        }
    }
    if std::env::var_os("RSB_BENCH_VERBOSE").is_some() {
        eprintln!(
            "{tool}: {:.1} ms, inline {inline}: {v}",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    (t.elapsed(), inline, v)
}

fn main() {
    if std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && !"mcp_sync".contains(a.as_str()))
    {
        return;
    }
    let reps: usize = std::env::var("RSB_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let sshd = Sshd::start().expect("sshd");
    let tmp = tempfile::tempdir().unwrap();
    let small = tmp.path().join("small");
    small_tree(&small);
    let small_s = format!("{}/", small.display());
    let remote = |rel: &str| {
        format!(
            "{}@127.0.0.1:{}/",
            sshd.user(),
            sshd.home().join(rel).display()
        )
    };
    let mut env = fwd::RsbEnv::new(&[fwd::entry("s", &sshd, sshd.port())]);
    env.bin = fwd::rsb_bin_release_if_built();
    println!("rsb binary: {}", env.bin.display());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut cmd = env.command();
        cmd.arg("mcp");
        for var in ["RSB_SYNC_TIMING", "RSB_SYNC_COMPRESS"] {
            if let Some(v) = std::env::var_os(var) {
                cmd.env(var, v);
            }
        }
        let cmd = tokio::process::Command::from(cmd);
        let (transport, _) = TokioChildProcess::builder(cmd)
            // RSB_BENCH_VERBOSE shows the server's log (and RSB_SYNC_TIMING's marks).
            .stderr(if std::env::var_os("RSB_BENCH_VERBOSE").is_some() {
                std::process::Stdio::inherit()
            } else {
                std::process::Stdio::null()
            })
            .spawn()
            .expect("spawn rsb mcp");
        let client = ().serve(transport).await.expect("MCP initialize");
        // Warm, as a server in use is: connect, deploy, local agent.
        call(&client, "exec_bash", json!({"command": "true", "sandbox_name": "s"})).await;
        let local = small.display().to_string();
        let up = |rel: String| {
            json!({"local_path": local, "remote_path": rel, "sandbox_name": "s"})
        };
        println!("sync through rsb mcp vs rsync -a -e ssh (median of {reps}; same sshd, same run)");
        let mut rows = Vec::new();
        let mut row = |name: &str, rsb: f64, rs: f64, inline: String, target: &str| {
            println!(
                "  {name:<30} rsb {rsb:>8.1} ms   rsync {rs:>8.1} ms   ratio {:>5.2}x   {inline:<12} (target {target})",
                rsb / rs
            );
            rows.push((name.to_string(), rsb, rs, inline, target.to_string()));
        };

        let (mut r, mut s, mut inl) = (Vec::new(), Vec::new(), 0);
        for i in 0..reps {
            let (d, inline, v) = sync(&client, "sync_local_to_remote", up(format!("m{i}/rsb"))).await;
            assert!(v.to_string().contains("2000") || !inline, "{v}");
            r.push(d);
            inl += inline as usize;
            s.push(rsync(&sshd, &small_s, &remote(&format!("m{i}/rsync"))));
        }
        row("2,000-file first upload", median(r), median(s), format!("{inl}/{reps} inline"), "<= 0.8x");

        let n = reps.max(5);
        let (mut r, mut s, mut inl) = (Vec::new(), Vec::new(), 0);
        for _ in 0..n {
            let (d, inline, v) = sync(&client, "sync_local_to_remote", up("m0/rsb".into())).await;
            assert!(inline, "a no-change resync must be inline: {v}");
            r.push(d);
            inl += inline as usize;
            s.push(rsync(&sshd, &small_s, &remote("m0/rsync")));
        }
        row("2,000-file no-change resync", median(r), median(s), format!("{inl}/{n} inline"), "<= 0.1x");

        let (mut r, mut s, mut inl) = (Vec::new(), Vec::new(), 0);
        for i in 0..reps {
            let dst = tmp.path().join(format!("down{i}"));
            let (d, inline, _) = sync(
                &client,
                "sync_remote_to_local",
                json!({"remote_path": "m0/rsb", "local_path": format!("{}/rsb", dst.display()), "sandbox_name": "s"}),
            )
            .await;
            r.push(d);
            inl += inline as usize;
            s.push(rsync(&sshd, &remote("m0/rsync"), &format!("{}/rsync/", dst.display())));
        }
        row("2,000-file first download", median(r), median(s), format!("{inl}/{reps} inline"), "<= 0.8x");
        let _ = client.cancel().await;
    });
}
