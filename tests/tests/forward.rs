//! Port forwarding (issue 13) against real sshd fixtures: `rsb forward` (the real binary)
//! serving an HTTP server started in the sandbox, a cut link, a Unix socket target, the MCP
//! tools, the `local` sandbox and a ProxyJump chain.
//!
//! Needs the `rsb` binary (`cargo build --workspace --bins`) and python3, which serves HTTP
//! in the sandbox.

mod common;
#[path = "common/forward.rs"]
mod fwd;

use std::{
    net::SocketAddr,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use common::*;
use fwd::*;
use rmcp::{ServiceExt, model::CallToolRequestParams, transport::TokioChildProcess};
use rsb::{
    config::{SandboxConfig, Transport},
    forward::{LocalPort, Target},
    ops::forward::{self as ops_fwd, ForwardRequest},
};
use rsb_tests::{ChaosProxy, Sshd};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: usize = 1024 * 1024;

fn skip_without_python(test: &str) -> bool {
    if python3() {
        return false;
    }
    eprintln!("SKIP {test}: python3 is not installed (it serves HTTP in the sandbox)");
    true
}

/// A served directory with `n` small files `f<i>.txt` whose content names them.
fn small_files(root: &Path, n: usize) {
    std::fs::create_dir_all(root).unwrap();
    for i in 0..n {
        std::fs::write(root.join(format!("f{i}.txt")), small_body(i)).unwrap();
    }
}

fn small_body(i: usize) -> String {
    format!("file {i}\n").repeat(1 + i % 50)
}

async fn get_small(addr: SocketAddr, i: usize) -> Result<(), String> {
    let (code, body) = http_get(addr, &format!("/f{i}.txt")).await?;
    if code != 200 || body != small_body(i).as_bytes() {
        return Err(format!("f{i}: status {code}, {} bytes", body.len()));
    }
    Ok(())
}

/// 100 requests at once, each checked byte for byte.
async fn hundred_parallel(addr: SocketAddr) {
    let tasks: Vec<_> = (0..100)
        .map(|i| tokio::spawn(async move { get_small(addr, i).await }))
        .collect();
    let mut bad = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            bad.push(e);
        }
    }
    assert!(
        bad.is_empty(),
        "{} of 100 requests failed: {bad:?}",
        bad.len()
    );
}

/// Is anything listening on `addr`? (A refused connect means the port is free.)
async fn refused(addr: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr)).await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

fn is_event(v: &Value, e: &str) -> bool {
    v["event"] == e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsb_forward_serves_parallel_requests_and_a_100mb_download() {
    if skip_without_python("rsb_forward_serves_parallel_requests_and_a_100mb_download") {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let www = sshd.home().join("www");
    small_files(&www, 100);
    let big = gen_bytes(42, 100 * MIB);
    std::fs::write(www.join("big.bin"), &big).unwrap();
    let want = blake3::hash(&big);
    drop(big);

    let env = RsbEnv::new(&[entry("s", &sshd, sshd.port())]);
    let (http, port) = http_server(&env, "s", &www);
    let mut f = RsbForward::spawn(&env, &[&format!("s:{port}"), "0"]);
    assert!(f.addr.ip().is_loopback(), "bound to {}", f.addr);
    assert_eq!(f.listening["target"], format!("localhost:{port}"));
    assert!(f.listening.get("warning").is_none(), "{}", f.listening);

    hundred_parallel(f.addr).await;

    let t0 = Instant::now();
    let mut h = blake3::Hasher::new();
    let (code, len) = http_get_with(f.addr, "/big.bin", Duration::from_secs(120), |b| {
        h.update(b);
    })
    .await
    .unwrap();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "100 MiB through rsb forward (debug build): {secs:.2}s, {:.0} MiB/s",
        100.0 / secs
    );
    assert_eq!((code, len), (200, (100 * MIB) as u64));
    assert_eq!(h.finalize(), want, "the download differs from the file");

    // One open and one close line per connection; none failed.
    let closes = f.wait_count(|v| is_event(v, "close"), 101, 10);
    assert_eq!(closes, 101);
    assert_eq!(f.count(|v| is_event(v, "open")), 101);
    assert_eq!(f.count(|v| v.get("error").is_some()), 0);
    let big_close = f.wait_event(
        |v| is_event(v, "close") && v["bytes_received"].as_u64() > Some((100 * MIB) as u64),
        5,
    );
    assert!(big_close["duration_s"].as_f64().unwrap() > 0.0);

    // Ctrl-C stops it: exit 0, a summary line, and the port is free again.
    let st = f.interrupt();
    assert!(st.success(), "rsb forward exited with {st}");
    let stopped = f.wait_event(|v| is_event(v, "stopped"), 5);
    assert_eq!(stopped["connections_total"], 101, "{stopped}");
    assert!(
        refused(f.addr).await,
        "{} still accepts after Ctrl-C",
        f.addr
    );
    drop(http);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsb_forward_survives_a_cut_link() {
    if skip_without_python("rsb_forward_survives_a_cut_link") {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let www = sshd.home().join("www");
    small_files(&www, 100);
    std::fs::write(www.join("big.bin"), gen_bytes(7, 64 * MIB)).unwrap();

    // The HTTP server is started on a direct connection; the forward goes through the proxy.
    let direct = RsbEnv::new(&[entry("s", &sshd, sshd.port())]);
    let (http, port) = http_server(&direct, "s", &www);
    let env = RsbEnv::new(&[entry("s", &sshd, proxy.port())]);
    let mut f = RsbForward::spawn(&env, &[&format!("s:{port}"), "0"]);
    get_small(f.addr, 1).await.unwrap();

    // A download in flight: read a little, stop reading so it stalls, then cut the link.
    let mut s = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    s.write_all(b"GET /big.bin HTTP/1.0\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0usize;
    while got < 64 * 1024 {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("the download never started")
            .unwrap();
        assert!(n > 0, "the download ended early");
        got += n;
    }
    let cut_at = Instant::now();
    proxy.cut();

    // The in-flight connection ends (reset or short), it does not hang.
    let rest = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => got += n,
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the in-flight connection hung after the cut");
    assert!(
        got < 64 * MIB,
        "the whole file arrived despite the cut ({rest:?})"
    );
    println!("in-flight download ended after the cut with {got} bytes: {rest:?}");

    // New connections are served again within a few seconds, without restarting anything.
    let mut last = String::new();
    let mut recovered = None;
    for _ in 0..100 {
        match get_small(f.addr, 2).await {
            Ok(()) => {
                recovered = Some(cut_at.elapsed());
                break;
            }
            Err(e) => last = e,
        }
        if cut_at.elapsed() > Duration::from_secs(20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let recovered = recovered.unwrap_or_else(|| panic!("never served again after the cut: {last}"));
    println!("served again {:.2}s after the cut", recovered.as_secs_f64());
    assert!(
        recovered < Duration::from_secs(5),
        "took {recovered:?} to serve again"
    );
    hundred_parallel(f.addr).await;
    f.wait_event(|v| is_event(v, "reconnected"), 5);
    assert!(
        f.count(|v| is_event(v, "close") && v.get("error").is_some()) >= 1,
        "the cut download's close line carries no error"
    );
    assert!(
        proxy.connections() >= 1,
        "no new SSH connection through the proxy"
    );

    // An outage: the host refuses connections for a while. A request made meanwhile waits,
    // backing off, and is served once the host is back; nobody restarts anything.
    proxy.refuse(true);
    proxy.cut();
    let addr = f.addr;
    let waiting = tokio::spawn(async move {
        let t = Instant::now();
        (get_small(addr, 5).await, t.elapsed())
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !waiting.is_finished(),
        "the request did not wait for the link"
    );
    proxy.refuse(false);
    let (r, took) = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the waiting request never finished")
        .unwrap();
    r.unwrap();
    println!("a request made during a 2 s outage was served after {took:.2?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    let downs = f.count(|v| is_event(v, "link_down"));
    assert!(downs >= 1, "no link_down line during the outage");
    assert!(
        downs <= 20,
        "{downs} link_down lines: the backoff does not hold"
    );
    f.interrupt();
    drop(http);
}

const UNIX_ECHO: &str = r#"
import socketserver, sys
class H(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(b"echo " + line)
class S(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 1024
srv = S(sys.argv[1], H)
print("ready", flush=True)
srv.serve_forever()
"#;

/// Connect, send `msg`, half-close, read everything back (bounded).
async fn roundtrip(addr: SocketAddr, msg: &str) -> Result<String, String> {
    let work = async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(msg.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        s.shutdown().await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(15), work)
        .await
        .map_err(|_| "no answer within 15 s".to_string())?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsb_forward_reaches_a_unix_socket() {
    if skip_without_python("rsb_forward_reaches_a_unix_socket") {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let dir = sshd.home().join("sock");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("echo.py"), UNIX_ECHO).unwrap();
    let sock = dir.join("echo.sock");
    let env = RsbEnv::new(&[entry("s", &sshd, sshd.port())]);
    let job = Job::start(
        &env,
        "s",
        "echo",
        &dir,
        &format!("exec python3 -u echo.py '{}'", sock.display()),
    );
    job.wait_line("ready", Duration::from_secs(20));

    let mut f = RsbForward::spawn(&env, &[&format!("s:{}", sock.display())]);
    assert_eq!(f.listening["target"], sock.display().to_string());
    for i in 0..5 {
        assert_eq!(
            roundtrip(f.addr, &format!("hello {i}\n")).await.unwrap(),
            format!("echo hello {i}\n")
        );
    }
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let a = f.addr;
            tokio::spawn(async move { roundtrip(a, &format!("p{i}\nq{i}\n")).await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap().unwrap(), format!("echo p{i}\necho q{i}\n"));
    }
    f.interrupt();

    // A socket that does not exist: the connection is closed at once and the line says why.
    let mut f = RsbForward::spawn(
        &env,
        &[&format!("s:{}", dir.join("missing.sock").display())],
    );
    let r = roundtrip(f.addr, "x\n").await;
    assert!(
        matches!(&r, Ok(s) if s.is_empty()) || r.is_err(),
        "got an answer from a missing socket: {r:?}"
    );
    let line = f.wait_event(|v| is_event(v, "close"), 10);
    assert!(
        line["error"]
            .as_str()
            .is_some_and(|e| e.contains("missing.sock")),
        "{line}"
    );
    f.interrupt();
    drop(job);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsb_forward_rejects_bad_arguments_with_hints() {
    let env = RsbEnv::new(&[json!({"name": "s", "local": true})]);
    for (args, want) in [
        (vec!["nope:80"], "unknown sandbox 'nope'"),
        (vec!["s:0"], "not a port"),
        (vec!["s:~/x.sock"], "not absolute"),
        (vec!["s:80", "--bind", "example.org"], "not an IP address"),
        (
            vec!["s:80", "--bind", "0.0.0.0"],
            "would let other machines",
        ),
        (vec!["s:80", "--bind", "::"], "would let other machines"),
    ] {
        let out = rsb_tests::output_with_timeout(
            env.command().arg("forward").args(&args),
            Duration::from_secs(20),
        )
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "usage (exit table): {args:?}: {err}"
        );
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(err.contains("hint:"), "{args:?}: {err}");
    }
    // A local port that is taken is an error when asked for explicitly.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p = taken.local_addr().unwrap().port().to_string();
    let out = rsb_tests::output_with_timeout(
        env.command().args(["forward", "s:80", &p]),
        Duration::from_secs(20),
    )
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "usage (exit table): {err}");
    assert!(
        err.contains("cannot listen on") && err.contains("hint:"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// MCP
// ---------------------------------------------------------------------------------------------

const FORWARD_TOOLS: [&str; 3] = ["forward_port", "list_forwards", "stop_forward"];

async fn mcp(env: &RsbEnv, advanced: bool) -> rmcp::service::RunningService<rmcp::RoleClient, ()> {
    let mut cmd = tokio::process::Command::from(env.command());
    cmd.arg("mcp");
    if advanced {
        cmd.env("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1");
    }
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
        .await
        .expect("MCP initialize timed out")
        .unwrap()
}

async fn call(
    svc: &rmcp::service::RunningService<rmcp::RoleClient, ()>,
    tool: &str,
    args: Value,
) -> (bool, Value) {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        svc.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args)),
    )
    .await
    .unwrap_or_else(|_| panic!("{tool} did not answer within 60 s"))
    .unwrap();
    let raw = serde_json::to_value(&r).unwrap();
    let text = raw["content"][0]["text"].as_str().unwrap_or_default();
    (
        r.is_error == Some(true),
        serde_json::from_str(text).unwrap_or(Value::Null),
    )
}

async fn tools_list(
    svc: &rmcp::service::RunningService<rmcp::RoleClient, ()>,
) -> (Vec<String>, usize) {
    let tools = svc.list_all_tools().await.unwrap();
    let v = serde_json::to_value(&tools).unwrap();
    let names = v
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    (names, serde_json::to_string(&v).unwrap().len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_forward_port_works_and_stop_forward_frees_the_port() {
    if skip_without_python("mcp_forward_port_works_and_stop_forward_frees_the_port") {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let www = sshd.home().join("www");
    small_files(&www, 100);
    let env = RsbEnv::new(&[entry("s", &sshd, sshd.port())]);
    let (http, port) = http_server(&env, "s", &www);

    // The default list stays as it was; the advanced flag adds the three tools.
    let plain = mcp(&env, false).await;
    let (names, default_bytes) = tools_list(&plain).await;
    for t in FORWARD_TOOLS {
        assert!(!names.iter().any(|n| n == t), "{t} is in the default list");
    }
    let _ = plain.cancel().await;
    let svc = mcp(&env, true).await;
    let (names, advanced_bytes) = tools_list(&svc).await;
    for t in FORWARD_TOOLS {
        assert!(
            names.iter().any(|n| n == t),
            "{t} missing with the advanced flag"
        );
    }
    println!(
        "tools/list: default {default_bytes} B, with advanced tools {advanced_bytes} B (+{} B)",
        advanced_bytes - default_bytes
    );
    // The default list's size budget is asserted once, in mcp.rs
    // (`tools_list_matches_the_seed_and_fits_the_budget`); here only that the forwarding
    // tools add to the advanced list and not to the default one.
    assert!(advanced_bytes > default_bytes);

    let (err, v) = call(&svc, "forward_port", json!({"remote_port": port})).await;
    assert!(!err, "{v}");
    let url = v["local_url"].as_str().unwrap();
    let addr: SocketAddr = v["local_address"].as_str().unwrap().parse().unwrap();
    assert!(addr.ip().is_loopback(), "{v}");
    assert_eq!(url, format!("http://{addr}/"));
    let id = v["forward_id"].as_u64().unwrap();
    get_small(addr, 3).await.unwrap();
    hundred_parallel(addr).await;

    let (err, v) = call(&svc, "list_forwards", json!({})).await;
    assert!(!err, "{v}");
    let list = v["forwards"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{v}");
    assert_eq!(list[0]["forward_id"], id);
    assert_eq!(list[0]["target"], format!("localhost:{port}"));
    assert_eq!(list[0]["connections_total"], 101, "{v}");
    assert_eq!(list[0]["connections_failed"], 0, "{v}");

    let (err, v) = call(&svc, "stop_forward", json!({"forward_id": id})).await;
    assert!(!err, "{v}");
    assert_eq!(v["running"], false, "{v}");
    assert!(
        refused(addr).await,
        "{addr} still accepts after stop_forward"
    );
    let (err, v) = call(&svc, "stop_forward", json!({"forward_id": id})).await;
    assert!(
        err && v["error"].as_str().unwrap().contains("no forward"),
        "{v}"
    );
    let (_, v) = call(&svc, "list_forwards", json!({})).await;
    assert_eq!(v["forwards"], json!([]));

    // Bad requests are errors with hints, and start nothing.
    for args in [
        json!({}),
        json!({"remote_port": port, "socket_path": "/x.sock"}),
        json!({"remote_port": 70000}),
        json!({"remote_port": port, "bind": "example.org"}),
        json!({"remote_port": port, "bind": "0.0.0.0"}),
        json!({"remote_port": port, "sandbox_name": "nope"}),
    ] {
        let (err, v) = call(&svc, "forward_port", args.clone()).await;
        assert!(err && v["hint"].is_string(), "{args}: {v}");
    }

    // A forward still running when the server ends goes with it.
    let (err, v) = call(&svc, "forward_port", json!({"remote_port": port})).await;
    assert!(!err, "{v}");
    let addr: SocketAddr = v["local_address"].as_str().unwrap().parse().unwrap();
    get_small(addr, 4).await.unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(10), svc.cancel()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !refused(addr).await {
        assert!(Instant::now() < deadline, "{addr} outlived the MCP server");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(http);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_forward_outlives_the_mcp_server_and_stops_on_request() {
    if skip_without_python("a_detached_forward_outlives_the_mcp_server_and_stops_on_request") {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let www = sshd.home().join("www");
    small_files(&www, 100);
    let env = RsbEnv::new(&[entry("s", &sshd, sshd.port())]);
    let state = env.dir.path().join("state");
    let _daemon = common::StopDaemon(state.clone());
    let (http, port) = http_server(&env, "s", &www);

    let svc = mcp(&env, true).await;
    let (err, v) = call(
        &svc,
        "forward_port",
        json!({"remote_port": port, "local_port": 0, "detach": true}),
    )
    .await;
    assert!(!err, "{v}");
    assert_eq!(v["detached"], true, "{v}");
    assert_eq!(v["running"], true, "{v}");
    assert_eq!(v["state"], "listening", "{v}");
    assert!(
        v["watchdog"].is_string(),
        "the reply says what the daemon did: {v}"
    );
    let id = v["forward_id"].as_u64().unwrap();
    assert!(
        id > 1_000_000,
        "detached ids never collide with a server's own: {v}"
    );
    let addr: SocketAddr = v["local_address"].as_str().unwrap().parse().unwrap();
    assert!(addr.ip().is_loopback(), "{v}");
    get_small(addr, 1).await.unwrap();

    // The server goes; the forward stays, and a new server sees it.
    let _ = tokio::time::timeout(Duration::from_secs(10), svc.cancel()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    get_small(addr, 2).await.unwrap();
    hundred_parallel(addr).await;
    let svc = mcp(&env, true).await;
    // The daemon writes counters back every tick (1 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    let listed = loop {
        let (err, v) = call(&svc, "list_forwards", json!({})).await;
        assert!(!err, "{v}");
        let list = v["forwards"].as_array().unwrap().clone();
        assert_eq!(list.len(), 1, "{v}");
        if list[0]["connections_total"].as_u64() >= Some(102) || Instant::now() >= deadline {
            break list[0].clone();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(listed["forward_id"], id, "{listed}");
    assert_eq!(listed["running"], true, "{listed}");
    assert_eq!(listed["connections_total"], 102, "{listed}");

    // The CLI sees it too.
    let out = env.run(&["forward", "--list"]);
    assert!(
        out.contains(&id.to_string()) && out.contains("listening"),
        "{out}"
    );

    let (err, v) = call(&svc, "stop_forward", json!({"forward_id": id})).await;
    assert!(!err, "{v}");
    assert_eq!(v["running"], false, "{v}");
    assert!(
        refused(addr).await,
        "{addr} still accepts after stop_forward"
    );
    let (_, v) = call(&svc, "list_forwards", json!({})).await;
    assert_eq!(v["forwards"], json!([]), "{v}");
    let (err, v) = call(&svc, "stop_forward", json!({"forward_id": id})).await;
    assert!(
        err && v["error"].as_str().unwrap().contains("no forward"),
        "{v}"
    );

    // A port that is taken: the daemon's error comes back in one line, and nothing is left.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let (err, v) = call(
        &svc,
        "forward_port",
        json!({"remote_port": port, "local_port": taken_port, "detach": true}),
    )
    .await;
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(
        err && msg.contains("could not start") && !msg.contains('\n'),
        "{v}"
    );
    assert!(v["hint"].is_string(), "{v}");
    let (_, v) = call(&svc, "list_forwards", json!({})).await;
    assert_eq!(v["forwards"], json!([]), "{v}");
    let _ = tokio::time::timeout(Duration::from_secs(10), svc.cancel()).await;
    drop(http);
}

// ---------------------------------------------------------------------------------------------
// The engine in-process: the `local` sandbox and a ProxyJump chain
// ---------------------------------------------------------------------------------------------

/// A TCP echo server on loopback (prefixes "echo "), for targets that need no sandbox job.
async fn tcp_echo() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(echo(s));
        }
    });
    addr
}

async fn unix_echo(path: &Path) {
    let l = tokio::net::UnixListener::bind(path).unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(echo(s));
        }
    });
}

async fn echo<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut s: S) {
    let mut buf = Vec::new();
    if s.read_to_end(&mut buf).await.is_ok() {
        let _ = s.write_all(b"echo ").await;
        let _ = s.write_all(&buf).await;
    }
}

/// Start a forward in-process (any free local port on loopback).
async fn start(
    pool: &Arc<rsb::pool::Pool>,
    sandbox: &str,
    target: Target,
) -> Arc<rsb::forward::Forward> {
    let req = ForwardRequest {
        sandbox: sandbox.into(),
        target,
        bind: "127.0.0.1".parse().unwrap(),
        local_port: LocalPort::Any,
    };
    ops_fwd::start(pool, &req, None).await.unwrap()
}

fn loopback(port: u16) -> Target {
    Target::Tcp {
        host: "127.0.0.1".into(),
        port,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_sandbox_relays_tcp_and_unix_without_ssh() {
    let dir = tempfile::tempdir().unwrap();
    let local = SandboxConfig {
        name: "local".into(),
        transport: Transport::Local,
        slurm: None,
        sudo: None,
        policy: Default::default(),
        confine: None,
    };
    let pool = pool_of(vec![local], dir.path());
    let echo_addr = tcp_echo().await;
    let sock = dir.path().join("echo.sock");
    unix_echo(&sock).await;

    let tcp = start(&pool, "", loopback(echo_addr.port())).await;
    let unix = start(
        &pool,
        "local",
        Target::Unix {
            path: sock.display().to_string(),
        },
    )
    .await;
    // 1 MiB each way, so the relay's half-close and counting are exercised, not just a line.
    let payload = "x".repeat(MIB);
    assert_eq!(
        roundtrip(tcp.local_addr, &payload).await.unwrap(),
        format!("echo {payload}")
    );
    assert_eq!(roundtrip(unix.local_addr, "hi").await.unwrap(), "echo hi");
    let s = tcp.stats();
    assert_eq!((s.connections_total, s.connections_failed), (1, 0));
    assert_eq!(s.bytes_sent, MIB as u64);
    assert_eq!(s.bytes_received, MIB as u64 + 5);

    // The local sandbox never started an agent or an SSH session for this.
    assert!(pool.ssh_session("local").await.unwrap().is_none());

    // Nothing listens on the target: the client is closed, the failure counted.
    let gone = start(&pool, "local", loopback(free_port())).await;
    let r = roundtrip(gone.local_addr, "x").await;
    assert!(matches!(&r, Ok(s) if s.is_empty()) || r.is_err(), "{r:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while gone.stats().connections_failed == 0 {
        assert!(Instant::now() < deadline, "the failure was not counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gone.stats().last_error.unwrap().contains("127.0.0.1"));

    for f in [tcp, unix, gone] {
        f.stop().await;
        assert!(refused(f.local_addr).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_goes_through_a_proxyjump_chain() {
    let jump = Sshd::start().unwrap();
    let target_sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kh = dir.path().join("known_hosts");
    let mut t = target(
        &target_sshd,
        target_sshd.port(),
        key_auth(&target_sshd),
        &kh,
    );
    t.proxy_jump = vec![hop(&jump, "127.0.0.1", jump.port(), key_auth(&jump), &kh)];
    let pool = pool_of(vec![sandbox("s", t)], dir.path());
    let echo_addr = tcp_echo().await;

    let f = start(&pool, "s", loopback(echo_addr.port())).await;
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let a = f.local_addr;
            tokio::spawn(async move { roundtrip(a, &format!("m{i}")).await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap().unwrap(), format!("echo m{i}"));
    }
    // The jump host logged the hop's login and relayed to the target's sshd.
    assert!(
        jump.log_contents().contains("Accepted publickey"),
        "the jump host was not used:\n{}",
        jump.log_contents()
    );
    f.stop().await;
}

/// Issue 21, defect 4, through `rsb mcp`: a forwarded client that stops reading (a paused
/// download) made `exec_bash` fail at 15–16 s, because russh acknowledges channel data as it
/// arrives and its session loop then waits on that channel's full buffer, stalling every
/// channel of the connection, the agent's included. Now a forward has an SSH connection of its
/// own: its stalled client stalls only that forward, and the download resumes when read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_client_that_stops_reading_does_not_stall_exec() {
    let sshd = Sshd::start().unwrap();
    // On the sandbox's side (this machine): a service that sends up to 256 MiB to its client.
    const LEN: usize = 256 << 20;
    let fire = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = fire.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::Write;
        if let Some(Ok(mut s)) = fire.incoming().next() {
            let block = vec![7u8; 1 << 20];
            for _ in 0..LEN >> 20 {
                if s.write_all(&block).is_err() {
                    break;
                }
            }
        }
    });
    let env = RsbEnv::new(&[entry("s", &sshd, sshd.port())]);
    let svc = mcp(&env, true).await;
    let (err, v) = call(&svc, "exec_bash", json!({"command": "echo warm"})).await;
    assert!(!err, "{v}");
    let (err, v) = call(&svc, "forward_port", json!({"remote_port": port})).await;
    assert!(!err, "{v}");
    let addr: SocketAddr = v["local_address"].as_str().unwrap().parse().unwrap();
    // Connected, and not read for 20 s (past the 15 s after which a silent link is dead).
    let mut paused = tokio::net::TcpStream::connect(addr).await.unwrap();
    let t0 = Instant::now();
    let mut calls = 0;
    while t0.elapsed() < Duration::from_secs(20) {
        let t = Instant::now();
        let (err, v) = call(&svc, "exec_bash", json!({"command": "echo ok"})).await;
        assert!(
            !err && v["stdout"] == "ok\n",
            "exec_bash beside a paused forward failed at {:?}: {v}",
            t0.elapsed()
        );
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "exec_bash took {:?} at {:?}",
            t.elapsed(),
            t0.elapsed()
        );
        calls += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The paused download goes on where it stopped.
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0usize;
    let t1 = Instant::now();
    while got < 64 << 20 {
        let n = tokio::time::timeout(Duration::from_secs(30), paused.read(&mut buf))
            .await
            .expect("the forwarded stream resumes")
            .unwrap();
        assert!(n > 0, "the forwarded stream ended after {got} bytes");
        assert!(buf[..n].iter().all(|&b| b == 7));
        got += n;
    }
    eprintln!(
        "{calls} exec_bash calls beside a paused forward in 20 s; then 64 MiB in {:?}",
        t1.elapsed()
    );
    drop(paused);
    let _ = svc.cancel().await;
}
