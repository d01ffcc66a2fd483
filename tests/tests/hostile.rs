//! Hostile neighbours and hostile input (issue 14): another local user planting an agent in
//! rsb's install path, secrets reaching the `local` sandbox's commands, and malformed JSON-RPC
//! on `rsb mcp`'s stdin.
//!
//! Needs the `rsb` binary (`cargo build --workspace --bins`). The planted-agent tests need root
//! (to create a second local user); they print why they skip otherwise.

mod common;

use std::{
    os::unix::fs::{PermissionsExt, chown},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use common::*;
use rmcp::{
    ServiceExt,
    model::CallToolRequestParams,
    service::{RoleClient, RunningService},
    transport::TokioChildProcess,
};
use rsb::{
    config::{Auth, SandboxConfig},
    connect::Connection,
};
use rsb_tests::{Sshd, SshdOptions, other_local_user, workspace_root};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// `rsb mcp` with a controlled environment (no config file, state in `tmp`) plus `env`.
fn rsb_mcp_command(tmp: &Path, env: &[(&str, &str)]) -> tokio::process::Command {
    let home = tmp.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let mut cmd = tokio::process::Command::new(rsb_bin());
    cmd.arg("mcp")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("XDG_DATA_HOME", home.join(".local/share"))
        .env("RSB_STATE_DIR", tmp.join("state"))
        .env("RSB_LOG", "debug");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

async fn call(svc: &RunningService<RoleClient, ()>, tool: &str, args: Value) -> Value {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
    let r = tokio::time::timeout(Duration::from_secs(90), svc.call_tool(params))
        .await
        .unwrap_or_else(|_| panic!("{tool} did not answer within 90 s"))
        .unwrap_or_else(|e| panic!("{tool} failed at the protocol level: {e}"));
    assert_ne!(r.is_error, Some(true), "{tool} failed: {r:?}");
    let raw = serde_json::to_value(&r).unwrap();
    serde_json::from_str(raw["content"][0]["text"].as_str().unwrap_or_default()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Secrets stay in the server
// ---------------------------------------------------------------------------------------------

const LIST_SECRET: &str = "list-S3cr3t-pw";
const ENV_SECRET: &str = "env-S3cr3t-pw";
const LEGACY_SECRET: &str = "legacy-S3cr3t-pw";
const PASSPHRASE_SECRET: &str = "legacy-S3cr3t-passphrase";

/// `exec_bash("env")` on a local sandbox, and the environment of every agent `rsb mcp` started
/// (the sandbox's and the sync engine's), hold neither rsb's secrets nor its variable names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_children_never_see_rsb_secrets_or_configuration() {
    let tmp = tempfile::tempdir().unwrap();
    let list = json!([
        {"name": "box", "local": true},
        {"name": "pw", "host": "127.0.0.1", "user": "nobody", "password": LIST_SECRET},
        {"name": "pe", "host": "127.0.0.1", "user": "nobody", "password_env": "MY_BOX_PW"},
    ])
    .to_string();
    let cmd = rsb_mcp_command(
        tmp.path(),
        &[
            ("REMOTE_SANDBOX_LIST", &list),
            ("MY_BOX_PW", ENV_SECRET),
            ("REMOTE_PASSWORD", LEGACY_SECRET),
            ("REMOTE_KEY_PASSPHRASE", PASSPHRASE_SECRET),
            ("RSB_HOST_KEY_POLICY", "accept-new"),
            ("SSH_ASKPASS", "/bin/false"),
            ("COPY_OF_PW", ENV_SECRET),
            ("MY_INNOCENT_VAR", "still-here"),
            ("RSB_SYNC_FSYNC", "0"),
        ],
    );
    let stderr = std::fs::File::create(tmp.path().join("stderr")).unwrap();
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(stderr)
        .spawn()
        .unwrap();
    let svc = tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
        .await
        .expect("initialize timed out")
        .expect("initialize");

    // Start the local sync agent too: a one-file upload into the local sandbox.
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("f.txt"), "x").unwrap();
    let dst = tmp.path().join("dst");
    call(
        &svc,
        "sync_local_to_remote",
        json!({"local_path": src, "remote_path": dst, "sandbox_name": "box"}),
    )
    .await;
    assert!(dst.join("f.txt").exists());

    let env = call(&svc, "exec_bash", json!({"command": "env"})).await;
    let env = env["stdout"].as_str().unwrap().to_string();
    assert!(env.contains("MY_INNOCENT_VAR=still-here"), "{env}");
    assert!(
        env.contains("RSB_SYNC_FSYNC=0"),
        "the agent's own variables pass: {env}"
    );

    // Every child of `rsb mcp` (this sandbox's agent is our parent; its parent is rsb mcp).
    let dump = r#"m=$(awk '{print $4}' /proc/$PPID/stat); n=0
for s in /proc/[0-9]*/stat; do
  read -r pid _ _ pp _ < "$s" 2>/dev/null || continue
  [ "$pp" = "$m" ] || continue
  n=$((n+1)); echo "== child $pid: $(tr '\0' ' ' < /proc/$pid/cmdline)"
  tr '\0' '\n' < /proc/$pid/environ
done; echo "children=$n""#;
    let children = call(&svc, "exec_bash", json!({"command": dump})).await;
    let children = children["stdout"].as_str().unwrap().to_string();
    assert!(
        children.contains("children=2"),
        "the sandbox agent and the sync agent: {children}"
    );
    for text in [&env, &children] {
        for needle in [
            LIST_SECRET,
            ENV_SECRET,
            LEGACY_SECRET,
            PASSPHRASE_SECRET,
            "REMOTE_SANDBOX_LIST",
            "REMOTE_PASSWORD",
            "REMOTE_KEY_PASSPHRASE",
            "MY_BOX_PW",
            "COPY_OF_PW",
            "RSB_HOST_KEY_POLICY",
            "RSB_STATE_DIR",
            "RSB_LOG",
            "SSH_ASKPASS",
        ] {
            assert!(!text.contains(needle), "{needle} reached a child:\n{text}");
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), svc.cancel()).await;
}

// ---------------------------------------------------------------------------------------------
// Malformed JSON-RPC
// ---------------------------------------------------------------------------------------------

struct Raw {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Raw {
    async fn send(&mut self, bytes: &[u8]) {
        self.stdin.write_all(bytes).await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// The next line `rsb mcp` writes, as JSON; a missing reply fails within 20 s.
    async fn reply(&mut self, after: &str) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(20), self.stdout.next_line())
            .await
            .unwrap_or_else(|_| panic!("no reply within 20 s after {after}"))
            .unwrap()
            .unwrap_or_else(|| panic!("rsb mcp closed stdout after {after}"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    async fn expect_error(&mut self, bytes: &[u8], what: &str, code: i64) {
        self.send(bytes).await;
        let v = self.reply(what).await;
        assert_eq!(v["jsonrpc"], "2.0", "{what}: {v}");
        assert_eq!(v["id"], Value::Null, "{what}: {v}");
        assert_eq!(v["error"]["code"], code, "{what}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: {v}"
        );
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "rsb mcp exited after {what}"
        );
    }

    fn peak_rss_kib(&self) -> u64 {
        let pid = self.child.id().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

/// Deep nesting, invalid UTF-8, a truncated object, a bare number and a 100 MB line each get a
/// JSON-RPC error (id null), memory stays bounded, and a valid request still works afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_malformed_line_gets_a_json_rpc_error_and_serving_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = rsb_mcp_command(tmp.path(), &[]);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(tmp.path().join("stderr")).unwrap())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut raw = Raw {
        child,
        stdin,
        stdout,
    };

    let deep = format!("{}{}\n", "[".repeat(100_000), "]".repeat(100_000));
    raw.expect_error(deep.as_bytes(), "nesting before initialize", -32700)
        .await;

    raw.send(
        concat!(
            r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","#,
            r#""capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#,
            "\n"
        )
        .as_bytes(),
    )
    .await;
    let init = raw.reply("initialize").await;
    assert_eq!(init["id"], 1, "{init}");
    assert!(init["result"]["serverInfo"].is_object(), "{init}");
    raw.send(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}\n")
        .await;
    let baseline_kib = raw.peak_rss_kib();

    let obj_deep = format!("{}1{}\n", "{\"a\":".repeat(100_000), "}".repeat(100_000));
    raw.expect_error(obj_deep.as_bytes(), "objects nested 100,000 deep", -32700)
        .await;
    raw.expect_error(deep.as_bytes(), "arrays nested 100,000 deep", -32700)
        .await;
    raw.expect_error(
        b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"tools/list\xff\xfe\"}\n",
        "invalid UTF-8",
        -32700,
    )
    .await;
    raw.expect_error(
        b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"tools/li\n",
        "a truncated object",
        -32700,
    )
    .await;
    raw.expect_error(b"42\n", "a bare number", -32600).await;
    raw.expect_error(
        b"{\"hello\":\"world\"}\n",
        "an object that is no request",
        -32600,
    )
    .await;

    // A 100 MB line: answered, and never buffered whole.
    let chunk = vec![b'x'; 1 << 20];
    raw.send(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"ping\",\"params\":{\"pad\":\"")
        .await;
    for _ in 0..100 {
        raw.send(&chunk).await;
    }
    raw.send(b"\"}}\n").await;
    let v = raw.reply("a 100 MB line").await;
    assert_eq!(v["error"]["code"], -32600, "{v}");
    assert_eq!(v["id"], Value::Null, "{v}");
    let peak_kib = raw.peak_rss_kib();
    eprintln!(
        "rsb mcp peak RSS: {baseline_kib} KiB after initialize, {peak_kib} KiB after a 100 MB line"
    );
    assert!(
        peak_kib < baseline_kib + 64 * 1024,
        "a 100 MB line grew rsb mcp from {baseline_kib} KiB to {peak_kib} KiB"
    );

    raw.send(b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"tools/list\"}\n")
        .await;
    let v = raw.reply("tools/list").await;
    assert_eq!(v["id"], 5, "{v}");
    assert!(
        v["result"]["tools"]
            .as_array()
            .is_some_and(|t| !t.is_empty()),
        "{v}"
    );

    // Closing stdin ends the server cleanly.
    drop(raw.stdin);
    let status = tokio::time::timeout(Duration::from_secs(20), raw.child.wait())
        .await
        .expect("rsb mcp did not exit after stdin closed")
        .unwrap();
    assert!(status.success(), "{status}");
}

// ---------------------------------------------------------------------------------------------
// Agent install directories that only their owner controls
// ---------------------------------------------------------------------------------------------

fn shipped_agent() -> rsb_deploy::AgentBinary {
    rsb_deploy::agent_for(rsb_deploy::host_triple().expect("a Linux x86_64/aarch64 host"))
        .expect("rsb built with its agents (scripts/build-agents.sh)")
}

/// A directory anyone may write a marker into (sticky, like /tmp).
fn marker_dir() -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix("rsb-hostile-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    d
}

/// What another user plants: `<root>/agent/<ver>-<hash>/rsb-agent`, a wrapper that records
/// that it ran and then runs the real agent (so the Hello hash is right), owned by `owner`.
fn plant_wrapper(root: &Path, owner: Option<(u32, u32)>, mode: u32, marker: &Path) -> PathBuf {
    let agent = shipped_agent();
    let dir = root.join("agent").join(agent.dir_name());
    std::fs::create_dir_all(&dir).unwrap();
    let real = dir.join("real-agent");
    let _ = std::fs::remove_file(&real);
    std::fs::write(&real, &**agent.bytes).unwrap();
    let wrapper = dir.join("rsb-agent.planted");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"planted wrapper ran as uid $(id -u)\" >> '{}'\nexec '{}' \"$@\"\n",
            marker.display(),
            real.display()
        ),
    )
    .unwrap();
    for f in [&real, &wrapper] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::rename(&wrapper, dir.join("rsb-agent")).unwrap();
    if let Some((uid, gid)) = owner {
        for p in [
            root.to_path_buf(),
            root.join("agent"),
            dir.clone(),
            real,
            dir.join("rsb-agent"),
        ] {
            chown(&p, Some(uid), Some(gid)).unwrap();
        }
    }
    for p in [root.to_path_buf(), root.join("agent"), dir.clone()] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    dir.join("rsb-agent")
}

fn exe_of(conn: &Connection) -> PathBuf {
    std::fs::read_link(format!("/proc/{}/exe", conn.client.hello().pid)).unwrap()
}

async fn echo(conn: &Connection) -> String {
    let mut r = rsb_protocol::ExecRequest::new("echo ok");
    r.timeout_ms = 10_000;
    let out = conn.client.call(r).await.unwrap();
    String::from_utf8_lossy(&out.stdout.head).into_owned()
}

fn owner_and_mode(p: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.uid(), m.mode() & 0o7777)
}

/// Removes `/tmp/rsb-<uid>` and the private `/tmp/rsb-<uid>.*` directories of the victim
/// (a per-process test account, so nobody else's) before and after each scenario.
struct TmpRoots(u32);

impl TmpRoots {
    fn clear(&self) {
        let prefix = format!("rsb-{}", self.0);
        for e in std::fs::read_dir("/tmp").unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == prefix || name.starts_with(&format!("{prefix}.")) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

impl Drop for TmpRoots {
    fn drop(&mut self) {
        self.clear();
    }
}

/// The scenarios share the victim's `/tmp/rsb-<uid>`, so they run one at a time.
static VICTIM_TMP: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Victim {
    sshd: Sshd,
    sandbox: SandboxConfig,
    uid: u32,
    _kh: tempfile::TempDir,
}

/// The fixture's password user as the victim, with `~/.cache` unusable (a file) and no
/// `$XDG_RUNTIME_DIR`, so rsb must fall back to /tmp. `None` (with the reason printed) when
/// not root.
fn victim(test: &str) -> Option<Victim> {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("{test}: skipped, creating a second local user needs root (CI runs as root)");
        return None;
    }
    let sshd = Sshd::start_with(SshdOptions {
        set_env: vec![("XDG_RUNTIME_DIR".into(), String::new())],
        ..Default::default()
    })
    .unwrap();
    let Some((user, password)) = sshd.password_user() else {
        eprintln!("{test}: skipped, the fixture has no password user (see stderr)");
        return None;
    };
    let (uid, _) = sshd.password_user_ids().unwrap();
    let home = sshd.password_home().unwrap().to_path_buf();
    std::fs::write(home.join(".cache"), "not a directory").unwrap();
    let kh = tempfile::tempdir().unwrap();
    let mut t = target(
        &sshd,
        sshd.port(),
        Auth::Password(secret(&password)),
        &kh.path().join("known_hosts"),
    );
    t.user = user;
    Some(Victim {
        sshd,
        sandbox: sandbox("victim", t),
        uid,
        _kh: kh,
    })
}

/// Issue 14, case 2: another user pre-creates `/tmp/rsb-<uid>/agent/<ver>-<hash>/rsb-agent` as
/// a wrapper. rsb must refuse that directory (naming the owner), never run the wrapper, and
/// deploy into a private directory instead, which later connects find again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrapper_planted_by_another_user_in_tmp_never_runs() {
    let Some(v) = victim("a_wrapper_planted_by_another_user_in_tmp_never_runs") else {
        return;
    };
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (see above)");
        return;
    };
    let _one = VICTIM_TMP.lock().await;
    let roots = TmpRoots(v.uid);
    roots.clear();
    let markers = marker_dir();
    let marker = markers.path().join("ran");
    let planted_root = PathBuf::from(format!("/tmp/rsb-{}", v.uid));
    plant_wrapper(
        &planted_root,
        Some((attacker.uid, attacker.gid)),
        0o777,
        &marker,
    );

    let conn = rsb::connect::connect(&v.sandbox, None)
        .await
        .unwrap_or_else(|e| panic!("deploy must still succeed somewhere safe: {e:?}"));
    assert_eq!(echo(&conn).await, "ok\n");
    assert!(
        !marker.exists(),
        "the planted wrapper ran: {}",
        std::fs::read_to_string(&marker).unwrap_or_default()
    );
    let private_prefix = format!("/tmp/rsb-{}.", v.uid);
    assert!(
        conn.agent_path.starts_with(&private_prefix),
        "{}",
        conn.agent_path
    );
    assert_eq!(exe_of(&conn), PathBuf::from(&conn.agent_path));
    let private_root: PathBuf = Path::new(&conn.agent_path)
        .ancestors()
        .nth(3)
        .unwrap()
        .into();
    assert_eq!(owner_and_mode(&private_root), (v.uid, 0o700));
    let notices = conn.notices.join("\n");
    assert!(
        notices.contains(&format!(
            "not using /tmp/rsb-{}/agent/{} for rsb-agent",
            v.uid,
            shipped_agent().dir_name()
        )) || notices.contains(&format!("not using /tmp/rsb-{} for rsb-agent", v.uid)),
        "{notices}"
    );
    assert!(
        notices.contains(&format!("owned by uid {}", attacker.uid)),
        "the notice names the other owner: {notices}"
    );
    conn.client.close("done");

    // A fresh connect (nothing cached for the path) reuses the private directory.
    let again = rsb::connect::connect(&v.sandbox, None).await.unwrap();
    assert_eq!(again.agent_path, conn.agent_path);
    assert!(!again.deployed, "the private directory is found again");
    assert_eq!(echo(&again).await, "ok\n");
    // And the reconnect fast path, with the path known.
    let fast = rsb::connect::connect(&v.sandbox, Some(&again.agent_path))
        .await
        .unwrap();
    assert_eq!(echo(&fast).await, "ok\n");
    assert!(!marker.exists(), "the planted wrapper ran");
    again.client.close("done");
    fast.client.close("done");
    drop(v.sshd);
}

/// Issue 14, case 2, denial of service: another user pre-creates `/tmp/rsb-<uid>` with mode 755,
/// which once made every deploy fail. rsb says why it skips it and deploys privately.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tmp_dir_taken_by_another_user_does_not_stop_the_deploy() {
    let Some(v) = victim("a_tmp_dir_taken_by_another_user_does_not_stop_the_deploy") else {
        return;
    };
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (see above)");
        return;
    };
    let _one = VICTIM_TMP.lock().await;
    let roots = TmpRoots(v.uid);
    roots.clear();
    let taken = PathBuf::from(format!("/tmp/rsb-{}", v.uid));
    std::fs::create_dir(&taken).unwrap();
    chown(&taken, Some(attacker.uid), Some(attacker.gid)).unwrap();
    std::fs::set_permissions(&taken, std::fs::Permissions::from_mode(0o755)).unwrap();

    let conn = rsb::connect::connect(&v.sandbox, None)
        .await
        .unwrap_or_else(|e| panic!("a taken /tmp/rsb-<uid> must not stop the deploy: {e:?}"));
    assert!(conn.deployed);
    assert_eq!(echo(&conn).await, "ok\n");
    assert!(
        conn.agent_path.starts_with(&format!("/tmp/rsb-{}.", v.uid)),
        "{}",
        conn.agent_path
    );
    let notices = conn.notices.join("\n");
    assert!(
        notices.contains(&format!(
            "not using /tmp/rsb-{} for rsb-agent: /tmp/rsb-{} is owned by uid {}, not by {}",
            v.uid, v.uid, attacker.uid, v.uid
        )),
        "{notices}"
    );
    assert!(
        std::fs::read_dir(&taken).unwrap().next().is_none(),
        "nothing was created inside the other user's directory"
    );
    conn.client.close("done");
}

/// An agent directory that others may write to is refused, even when it is the user's own
/// (`~/.cache/rsb/agent/<v>` made 777); a wrapper planted there never runs, and rsb deploys in
/// the next root. Runs as any user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_agent_directory_is_refused_and_its_agent_never_runs() {
    let xdg = tempfile::tempdir().unwrap();
    let sshd = Sshd::start_with(SshdOptions {
        set_env: vec![("XDG_RUNTIME_DIR".into(), xdg.path().display().to_string())],
        ..Default::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let t = target(&sshd, sshd.port(), key_auth(&sshd), &dir.path().join("kh"));
    let sb = sandbox("s", t);
    let first = rsb::connect::connect(&sb, None).await.unwrap();
    let cache_root = sshd.home().join(".cache/rsb");
    assert!(
        first
            .agent_path
            .starts_with(&cache_root.display().to_string()),
        "{}",
        first.agent_path
    );
    first.client.close("done");

    let markers = marker_dir();
    let marker = markers.path().join("ran");
    plant_wrapper(&cache_root, None, 0o777, &marker);
    let conn = rsb::connect::connect(&sb, None).await.unwrap();
    assert_eq!(echo(&conn).await, "ok\n");
    assert!(
        !marker.exists(),
        "the wrapper in a world-writable directory ran"
    );
    assert!(
        conn.agent_path
            .starts_with(&xdg.path().canonicalize().unwrap().display().to_string()),
        "{}",
        conn.agent_path
    );
    let notices = conn.notices.join("\n");
    assert!(
        notices.contains("is writable by group or others (mode 777)"),
        "{notices}"
    );
    conn.client.close("done");
}

/// The agent file is hashed before it runs, not only trusted to report its own hash: a
/// same-owner, mode-700 wrapper that ends up running the real agent is replaced, never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_agent_is_hashed_before_it_runs() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let t = target(&sshd, sshd.port(), key_auth(&sshd), &dir.path().join("kh"));
    let sb = sandbox("s", t);
    let first = rsb::connect::connect(&sb, None).await.unwrap();
    first.client.close("done");
    let cache_root = sshd.home().join(".cache/rsb");
    let markers = marker_dir();
    let marker = markers.path().join("ran");
    let planted = plant_wrapper(&cache_root, None, 0o700, &marker);
    assert_eq!(planted, PathBuf::from(&first.agent_path));

    for known in [None, Some(first.agent_path.as_str())] {
        let conn = rsb::connect::connect(&sb, known).await.unwrap();
        assert_eq!(echo(&conn).await, "ok\n");
        assert!(
            !marker.exists(),
            "the wrapper ran (known path {known:?}): {}",
            std::fs::read_to_string(&marker).unwrap_or_default()
        );
        assert_eq!(exe_of(&conn), planted);
        assert!(conn.deployed || known.is_some(), "the wrapper is replaced");
        conn.client.close("done");
        // Plant it again for the fast path (a known agent path).
        plant_wrapper(&cache_root, None, 0o700, &marker);
    }
}

// ---------------------------------------------------------------------------------------------
// Case 3 by a real second user: staging swapped in a shared writable directory
// ---------------------------------------------------------------------------------------------

/// The attacker, run as the other local user: whenever a staging directory shows up in `dest`,
/// try to overwrite the files staged in it, then move it away and put a symlink to their own
/// directory in its place. Bounded by time, a stop file and a loop count; prints what it did.
const ATTACKER: &str = r#"
import os, sys, time
dest, evil, stop = sys.argv[1:4]
t0 = time.time(); swaps = replaced = refused = rounds = 0
while time.time() - t0 < 90 and rounds < 200000 and not os.path.exists(stop):
    rounds += 1
    try:
        names = os.listdir(dest)
    except OSError:
        names = []
    for name in names:
        p = os.path.join(dest, name)
        if not name.startswith('.rsb-sync-staging-') or os.path.islink(p):
            continue
        try:
            for f in os.listdir(p)[:20]:
                fp = os.path.join(p, f)
                try:
                    os.unlink(fp)
                    with open(fp, 'w') as fh:
                        fh.write('substituted\n')
                    replaced += 1
                except OSError:
                    refused += 1
        except OSError:
            refused += 1
        try:
            os.rename(p, os.path.join(dest, 'moved-%d' % rounds))
            os.symlink(evil, p)
            swaps += 1
        except OSError:
            refused += 1
    time.sleep(0.002)
print('swaps=%d replaced=%d refused=%d rounds=%d' % (swaps, replaced, refused, rounds))
"#;

/// Issue 14, case 3, with the attacker a different local user (not root, not the syncing
/// user): a 1,500-file upload into a mode-777 directory without the sticky bit, while they
/// swap the staging directory for a link to their own directory and try to replace staged
/// files. The sync either stops with one clear line or every committed file holds exactly the
/// source's bytes; nothing lands in their directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_swapping_the_staging_directory_cannot_substitute_files() {
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (creating one needs root; CI runs as root)");
        return;
    };
    let sshd = Sshd::start().unwrap();
    let proxy = rsb_tests::ChaosProxy::start(sshd.addr()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // Shared area the attacker can reach: /tmp/x (755, ours) / shared (777, no sticky).
    let area = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(area.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dest = area.path().join("shared");
    std::fs::create_dir(&dest).unwrap();
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o777)).unwrap();
    // Their own directory, outside the destination, with their own files.
    let evil = area.path().join("theirs");
    std::fs::create_dir(&evil).unwrap();
    for i in 0..20 {
        std::fs::write(evil.join(format!("f{i:04}")), "substituted\n").unwrap();
    }
    let script = area.path().join("attack.py");
    std::fs::write(&script, ATTACKER).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    chown(&evil, Some(attacker.uid), Some(attacker.gid)).unwrap();
    for e in std::fs::read_dir(&evil).unwrap().flatten() {
        chown(e.path(), Some(attacker.uid), Some(attacker.gid)).unwrap();
    }
    let src = tmp.path().join("many");
    std::fs::create_dir(&src).unwrap();
    let body = |i: usize| format!("real {i}\n").repeat(400);
    for i in 0..1500 {
        std::fs::write(src.join(format!("f{i:04}")), body(i)).unwrap();
    }

    let list = json!([{"name": "s", "host": sshd.host(), "port": proxy.port(),
        "user": sshd.user(), "key_file": sshd.client_key().display().to_string()}])
    .to_string();
    let (transport, _) = TokioChildProcess::builder(rsb_mcp_command(
        tmp.path(),
        &[("REMOTE_SANDBOX_LIST", &list)],
    ))
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let svc = ().serve(transport).await.expect("initialize");
    // Connect and deploy before the race, so the attacker meets the sync itself.
    call(&svc, "exec_bash", json!({"command": "true"})).await;
    proxy.set_delay(Duration::from_millis(2));

    let stop = area.path().join("stop");
    // setpriv drops root's supplementary groups too, which `Command::uid` would keep.
    let attack = std::process::Command::new("/usr/bin/setpriv")
        .arg(format!("--reuid={}", attacker.uid))
        .arg(format!("--regid={}", attacker.gid))
        .arg("--clear-groups")
        .arg("/usr/bin/python3")
        .arg(&script)
        .arg(&dest)
        .arg(&evil)
        .arg(&stop)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("setpriv and python3 (util-linux, python3)");
    let args = json!({"local_path": src.display().to_string(),
                      "remote_path": dest.display().to_string()});
    let Value::Object(args) = args else {
        unreachable!()
    };
    let r = tokio::time::timeout(
        Duration::from_secs(240),
        svc.call_tool(CallToolRequestParams::new("sync_local_to_remote").with_arguments(args)),
    )
    .await
    .expect("the sync answers within 240 s")
    .expect("a tool reply");
    let text = serde_json::to_value(&r).unwrap()["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    // 1,500 files go to the background: follow the task to its end (bounded).
    let (failed, error) = match v["task_id"].as_i64() {
        Some(id) if r.is_error != Some(true) => {
            let t0 = std::time::Instant::now();
            loop {
                let s = call(&svc, "check_file_transfer_task", json!({"task_id": id})).await;
                let status = s["status"].as_str().unwrap_or_default().to_string();
                if !matches!(status.as_str(), "queued" | "running") {
                    eprintln!("transfer {id}: {status} {}", s["error"]);
                    break (
                        status != "completed",
                        s["error"].as_str().unwrap_or_default().to_string(),
                    );
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(240),
                    "the transfer ends: {s}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        _ => (
            r.is_error == Some(true),
            v["error"].as_str().unwrap_or(&text).to_string(),
        ),
    };
    std::fs::write(&stop, "").unwrap();
    let out = tokio::task::spawn_blocking(move || attack.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let did = String::from_utf8_lossy(&out.stdout).trim().to_string();
    eprintln!(
        "attacker: {did} {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    eprintln!("sync failed: {failed}; error: {error}");
    assert!(out.status.success(), "the attacker script ran: {did}");
    let swaps: u64 = did
        .split_whitespace()
        .find_map(|w| w.strip_prefix("swaps="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        swaps >= 1,
        "the attacker never got to swap the staging directory: {did}"
    );
    if failed {
        assert!(
            !error.is_empty() && !error.contains('\n'),
            "one line: {error:?}"
        );
        assert!(
            error.contains("tampered") || error.contains("staging"),
            "the error says what happened: {error}"
        );
    }
    // Every file that is in place holds our bytes, whatever the outcome.
    let mut committed = 0;
    for e in std::fs::read_dir(&dest).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(i) = name.strip_prefix('f').and_then(|n| n.parse::<usize>().ok()) else {
            continue;
        };
        let meta = std::fs::symlink_metadata(e.path()).unwrap();
        assert!(meta.file_type().is_file(), "{name} is a regular file");
        assert_eq!(
            std::fs::read_to_string(e.path()).unwrap(),
            body(i),
            "{name} holds someone else's bytes"
        );
        committed += 1;
    }
    if !failed {
        assert_eq!(committed, 1500, "a successful sync committed everything");
    }
    // Nothing of ours landed in their directory, and their files are untouched.
    let theirs: Vec<_> = std::fs::read_dir(&evil).unwrap().flatten().collect();
    assert_eq!(theirs.len(), 20, "their directory gained files");
    for e in theirs {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::read_to_string(e.path()).unwrap(), "substituted\n");
        assert_eq!(e.metadata().unwrap().uid(), attacker.uid);
    }
    eprintln!("committed {committed} of 1500 files, all with their own bytes");
    let _ = svc.cancel().await;
}

// ---------------------------------------------------------------------------------------------
// Issue 21, defect 3: a parent directory swapped for a symlink while a sync commits into it
// ---------------------------------------------------------------------------------------------

/// The attacker, run as the other local user: swap `dest/sub` for a symlink to `target` for
/// 20 ms at a time, putting the real directory back for 40–80 ms in between. Bounded by time, a stop file
/// and a loop count; prints how often the link was in place.
const SWAPPER: &str = r#"
import os, random, sys, time
dest, target, stop, secs = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sub = os.path.join(dest, 'sub'); hold = os.path.join(dest, 'sub-held-by-attacker')
t0 = time.time(); swaps = fail = rounds = 0
while time.time() - t0 < secs and rounds < 100000 and not os.path.exists(stop):
    rounds += 1
    try:
        os.rename(sub, hold)
    except OSError:
        fail += 1
        time.sleep(0.005)
        continue
    try:
        os.symlink(target, sub)
        swaps += 1
        time.sleep(0.02)
        os.unlink(sub)
    except OSError:
        fail += 1
    try:
        os.rename(hold, sub)
    except OSError:
        fail += 1
    time.sleep(random.uniform(0.04, 0.08))
print('swaps=%d fail=%d rounds=%d' % (swaps, fail, rounds))
"#;

/// `setpriv` as the other local user, with no supplementary groups and a clean environment:
/// append the program and its arguments.
fn attacker_command(attacker: &rsb_tests::LocalUser) -> std::process::Command {
    let mut c = std::process::Command::new("/usr/bin/setpriv");
    c.arg(format!("--reuid={}", attacker.uid))
        .arg(format!("--regid={}", attacker.gid))
        .arg("--clear-groups")
        .env_clear()
        .env("PATH", "/usr/bin:/bin");
    c
}

/// One upload of `src` into `dest` (on the same host, through the sshd) while the other user
/// runs [`SWAPPER`] against `dest/sub`, repeated for a few seconds (a single swap rarely lands).
/// Returns each sync's error, if it failed.
async fn sync_while_swapped(
    attacker: &rsb_tests::LocalUser,
    area: &Path,
    src: &Path,
    dest: &Path,
    target: &Path,
    delete_extras: bool,
    reset: &dyn Fn(),
) -> Vec<Option<String>> {
    let sshd = Sshd::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let pool = app_on(&sshd, sshd.port(), state.path());
    pool.pool().client("s").await.expect("connect");
    let script = area.join("swap.py");
    std::fs::write(&script, SWAPPER).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut outcomes = Vec::new();
    let t0 = std::time::Instant::now();
    for round in 0..10 {
        if t0.elapsed() > Duration::from_secs(60) {
            break;
        }
        reset();
        let stop = area.join(format!("stop-{round}"));
        let swapper = attacker_command(attacker)
            .arg("/usr/bin/python3")
            .arg(&script)
            .arg(dest)
            .arg(target)
            .arg(&stop)
            .arg("20")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("setpriv and python3 (util-linux, python3)");
        let spec = rsb::sync::SyncSpec {
            direction: rsb::sync::Direction::Upload,
            local_path: src.to_path_buf(),
            remote_path: dest.display().to_string(),
            delete_extras,
            rules: rsb::sync::SyncSpec::rules(vec![]),
            dry_run: false,
        };
        // Let the swaps start (python's start-up) before the sync does.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let synced = std::time::Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(120),
            rsb::ops::sync::run(
                &pool,
                "s",
                &spec,
                None,
                &rsb::sync::CancellationToken::new(),
            ),
        )
        .await
        .expect("the sync ends within 120 s");
        std::fs::write(&stop, "").unwrap();
        let out = tokio::task::spawn_blocking(move || swapper.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        let did = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let e = r.err().map(|e| e.message);
        eprintln!(
            "round {round}: sync of {:?}, attacker {did}; sync error: {e:?}",
            synced.elapsed()
        );
        assert!(out.status.success(), "the swapper ran: {did}");
        outcomes.push(e);
    }
    pool.shutdown().await;
    outcomes
}

/// `/tmp/<x>` (0755, ours) holding `shared` (0777 without the sticky bit): a destination the
/// other user can write, as a shared scratch or project directory on a cluster.
fn shared_area() -> (tempfile::TempDir, PathBuf) {
    let area = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(area.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dest = area.path().join("shared");
    std::fs::create_dir(&dest).unwrap();
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o777)).unwrap();
    (area, dest)
}

/// A refusal says that the destination changed under the sync, in one line.
fn assert_refusal_names_tampering(outcomes: &[Option<String>]) {
    for e in outcomes.iter().flatten() {
        assert!(!e.contains('\n'), "one line: {e:?}");
        // Refused by the plan, from a scan that saw the link or the moved directory, before
        // any change; or refused while committing, saying the destination changed.
        assert!(
            e.contains("nothing was changed")
                || e.contains("tampered")
                || e.contains("since the sync looked"),
            "the error says the destination changed under the sync: {e}"
        );
    }
}

/// Writes: 3,000 files go into `dest/sub` of a shared (mode 777) directory while another user
/// swaps `sub` for a link to their own directory. The issue measured 507–759 of 3,000 files
/// landing in the attacker's directory; with the agent before the fix this test saw dozens.
/// Now every write goes through the directory that was checked: none lands there, and every
/// file in `sub` holds its own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_swapped_for_a_link_never_redirects_a_sync_s_writes() {
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (creating one needs root; CI runs as root)");
        return;
    };
    let (area, dest) = shared_area();
    let evil = area.path().join("theirs");
    std::fs::create_dir(&evil).unwrap();
    std::fs::write(evil.join("keep"), "theirs\n").unwrap();
    chown(&evil, Some(attacker.uid), Some(attacker.gid)).unwrap();
    chown(evil.join("keep"), Some(attacker.uid), Some(attacker.gid)).unwrap();
    std::fs::set_permissions(&evil, std::fs::Permissions::from_mode(0o777)).unwrap();
    let src = area.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    let body = |i: usize| format!("ours {i}\n").repeat(60);
    for i in 0..3000 {
        std::fs::write(src.join(format!("sub/f{i:04}")), body(i)).unwrap();
    }
    let reset = || {
        let _ = std::fs::remove_dir_all(dest.join("sub"));
        let _ = std::fs::remove_file(dest.join("sub"));
        let _ = std::fs::remove_dir_all(dest.join("sub-held-by-attacker"));
        std::fs::create_dir(dest.join("sub")).unwrap();
    };
    let outcomes =
        sync_while_swapped(attacker, area.path(), &src, &dest, &evil, false, &reset).await;
    assert_refusal_names_tampering(&outcomes);
    let theirs: Vec<String> = std::fs::read_dir(&evil)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        theirs,
        ["keep"],
        "the victim's files landed in the attacker's directory"
    );
    for e in std::fs::read_dir(dest.join("sub")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let i: usize = name.trim_start_matches('f').parse().unwrap();
        assert_eq!(
            std::fs::read_to_string(e.path()).unwrap(),
            body(i),
            "{name}"
        );
    }
    let ok = outcomes.iter().filter(|e| e.is_none()).count();
    eprintln!(
        "{ok} of {} syncs completed; none wrote outside sub",
        outcomes.len()
    );
}

/// Deletes: `delete_extras` removes 1,000 extra files from `dest/sub` while another user swaps
/// `sub` for a link to a directory of the victim's own outside the root, holding files of the
/// same names. The issue measured 1,605–1,704 such files deleted; with the agent before the fix
/// this test saw 857 of its 1,000 deleted. Now none is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_swapped_for_a_link_never_redirects_a_sync_s_deletes() {
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (creating one needs root; CI runs as root)");
        return;
    };
    let (area, dest) = shared_area();
    // The victim's own files, outside the root, named as the extras are.
    let mine = area.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    for i in 0..1000 {
        std::fs::write(mine.join(format!("e{i:04}")), "precious\n").unwrap();
    }
    let src = area.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("sub/kept"), "kept\n").unwrap();
    // Files both sides hold, so the deletes are not "every file" (the mass-delete guard).
    std::fs::create_dir_all(src.join("common")).unwrap();
    for i in 0..1200 {
        std::fs::write(src.join(format!("common/c{i:04}")), "same\n").unwrap();
    }
    let reset = || {
        if !dest.join("common").exists() {
            std::fs::create_dir(dest.join("common")).unwrap();
            for i in 0..1200 {
                std::fs::write(dest.join(format!("common/c{i:04}")), "same\n").unwrap();
            }
        }
        let _ = std::fs::remove_dir_all(dest.join("sub"));
        let _ = std::fs::remove_file(dest.join("sub"));
        let _ = std::fs::remove_dir_all(dest.join("sub-held-by-attacker"));
        std::fs::create_dir(dest.join("sub")).unwrap();
        for i in 0..1000 {
            std::fs::write(dest.join(format!("sub/e{i:04}")), "extra\n").unwrap();
        }
    };
    let outcomes =
        sync_while_swapped(attacker, area.path(), &src, &dest, &mine, true, &reset).await;
    assert_refusal_names_tampering(&outcomes);
    let left = std::fs::read_dir(&mine).unwrap().count();
    assert_eq!(left, 1000, "files outside the root were deleted");
    let ok = outcomes.iter().filter(|e| e.is_none()).count();
    eprintln!(
        "{ok} of {} syncs completed; nothing outside the root deleted",
        outcomes.len()
    );
}

/// Watches a directory for new files (inotify through ctypes) and opens each staged
/// `.rsb-*` file the moment it appears, as a co-tenant would, keeping every descriptor it
/// gets. At the end it reads what each held descriptor sees now: a staged file that was
/// later renamed into place shows the new content.
const OPENER: &str = r#"
import ctypes, os, select, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
d, stop, secs = sys.argv[1].encode(), sys.argv[2], float(sys.argv[3])
fd = libc.inotify_init1(os.O_NONBLOCK)
assert fd >= 0, 'inotify_init1'
assert libc.inotify_add_watch(fd, d, 0x100) >= 0, 'inotify_add_watch'
print('ready', flush=True)
held = []; seen = denied = gone = 0
t0 = time.time()
while time.time() - t0 < secs and not os.path.exists(stop):
    r, _, _ = select.select([fd], [], [], 0.05)
    if not r:
        continue
    buf = os.read(fd, 65536)
    i = 0
    while i + 16 <= len(buf):
        _, _, _, n = struct.unpack_from('iIII', buf, i)
        name = buf[i + 16:i + 16 + n].rstrip(b'\0'); i += 16 + n
        if b'.rsb-' not in name:
            continue
        seen += 1
        try:
            held.append(os.open(os.path.join(d, name), os.O_RDONLY))
        except PermissionError:
            denied += 1
        except FileNotFoundError:
            gone += 1
leaked = 0
for h in held:
    os.lseek(h, 0, 0)
    if b'SECRET' in os.read(h, 1 << 20):
        leaked += 1
print('seen=%d denied=%d gone=%d held=%d leaked=%d' % (seen, denied, gone, len(held), leaked))
"#;

/// Issue 50, case 3: the file a change stages is never readable by anyone else while it is
/// written. 20 edits and writes of the victim's 0600 `notes.txt` in a shared (0777) directory,
/// while another user opens every staged file the moment inotify reports it: before the fix
/// the staged file was created 0666 & umask and the co-tenant held descriptors that read the
/// new secret (4–7 of 10 edits in the issue); now every open is refused, and the file keeps
/// its mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_co_tenant_never_opens_a_staged_edit_of_a_private_file() {
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (creating one needs root; CI runs as root)");
        return;
    };
    let (area, dest) = shared_area();
    let notes = dest.join("notes.txt");
    std::fs::write(&notes, "private: nothing yet\n").unwrap();
    std::fs::set_permissions(&notes, std::fs::Permissions::from_mode(0o600)).unwrap();
    let script = area.path().join("open.py");
    std::fs::write(&script, OPENER).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let stop = area.path().join("stop");
    let mut opener = tokio::process::Command::from(attacker_command(attacker))
        .arg("/usr/bin/python3")
        .arg(&script)
        .arg(&dest)
        .arg(&stop)
        .arg("60")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("setpriv and python3 (util-linux, python3)");
    let mut lines = BufReader::new(opener.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("the opener starts within 20 s")
        .unwrap();
    assert_eq!(ready.as_deref(), Some("ready"));

    let sshd = Sshd::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let pool = pool_on(&sshd, sshd.port(), state.path());
    let client = pool.client("s").await.expect("connect");
    let path = notes.display().to_string();
    let mut current = "private: nothing yet\n".to_string();
    for i in 0..20 {
        let next = format!("private: SECRET-{i}\n");
        if i % 2 == 0 {
            let req =
                rsb::ops::edit::write_request(&path, Some(&next), None, "", false, false).unwrap();
            client.call(req).await.expect("write_remote_file");
        } else {
            let req =
                rsb::ops::edit::edit_request(&path, current.trim_end(), next.trim_end(), false, "")
                    .unwrap();
            client.call(req).await.expect("edit_remote_file");
        }
        current = next;
        // Give the opener its chance at each staged file.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pool.shutdown().await;
    std::fs::write(&stop, "").unwrap();
    let report = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("the opener reports within 20 s")
        .unwrap()
        .unwrap_or_default();
    let _ = opener.wait().await;
    eprintln!("co-tenant: {report}");
    let count = |k: &str| -> u32 {
        report
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{k} in {report:?}"))
    };
    assert!(
        count("seen") >= 20,
        "the co-tenant saw every staged file: {report}"
    );
    assert_eq!(
        count("held"),
        0,
        "the co-tenant opened a staged file: {report}"
    );
    assert_eq!(count("leaked"), 0, "{report}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), current);
    assert_eq!(owner_and_mode(&notes), (0, 0o600));
}

/// A command run as the other local user (no shell: argv as given).
fn as_attacker(attacker: &rsb_tests::LocalUser, argv: &[&str]) {
    let st = attacker_command(attacker)
        .args(argv)
        .status()
        .expect("setpriv (util-linux)");
    assert!(st.success(), "{argv:?} as the other user");
}

/// Write `name` in `dir` only if `dir` itself is a directory, not a link (skipped otherwise).
fn write_in_dir_nofollow(dir: &Path, name: &str, data: &[u8]) {
    use std::os::unix::ffi::OsStrExt;
    let d = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    unsafe {
        let fd = libc::open(
            d.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return;
        }
        let f = libc::openat(
            fd,
            n.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o644,
        );
        if f >= 0 {
            libc::write(f, data.as_ptr().cast(), data.len());
            libc::close(f);
        }
        libc::close(fd);
    }
}

/// The victim's private directory beside the shared one: `private/notes.txt` (0600).
fn private_notes(area: &Path) -> PathBuf {
    let private = area.join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let notes = private.join("notes.txt");
    std::fs::write(&notes, "shared line\nPRIVATE\n").unwrap();
    std::fs::set_permissions(&notes, std::fs::Permissions::from_mode(0o600)).unwrap();
    notes
}

/// Issue 50, case 1: edits, writes and patch deletes of `shared/sub/notes.txt` while the
/// other user swaps `sub` for a link to the victim's private directory (which holds a
/// `notes.txt` of its own, matching the edit). Before the fix the first edit replaced the
/// private file with the shared one's content and mode 0644. Now every change goes through
/// the directory it read from, and the attacker's link is never followed: the private file
/// keeps its bytes and mode, and nothing new appears beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_swapped_for_a_link_never_redirects_an_edit() {
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (creating one needs root; CI runs as root)");
        return;
    };
    let (area, dest) = shared_area();
    let private = private_notes(area.path());
    let before = std::fs::read(&private).unwrap();
    let sub = dest.join("sub");
    let shared = sub.join("notes.txt");
    std::fs::create_dir(&sub).unwrap();
    let script = area.path().join("swap.py");
    std::fs::write(&script, SWAPPER).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let stop = area.path().join("stop");
    let swapper = tokio::process::Command::from(attacker_command(attacker))
        .arg("/usr/bin/python3")
        .arg(&script)
        .arg(&dest)
        .arg(private.parent().unwrap())
        .arg(&stop)
        .arg("30")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("setpriv and python3");
    let sshd = Sshd::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let pool = pool_on(&sshd, sshd.port(), state.path());
    let client = pool.client("s").await.expect("connect");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let path = shared.display().to_string();
    let (mut ok, mut refused) = (0, 0);
    let t0 = std::time::Instant::now();
    for i in 0..200 {
        if t0.elapsed() > Duration::from_secs(6) {
            break;
        }
        // The shared file, recreated if a delete removed it (only while `sub` is in place:
        // the test must not write through the attacker's link itself).
        write_in_dir_nofollow(&sub, "notes.txt", b"shared line\n");
        let r = match i % 3 {
            0 => client
                .call(
                    rsb::ops::edit::edit_request(
                        &path,
                        "shared line",
                        &format!("edit {i}"),
                        false,
                        "",
                    )
                    .unwrap(),
                )
                .await
                .map(|_| ()),
            1 => client
                .call(
                    rsb::ops::edit::write_request(
                        &path,
                        Some(&format!("write {i}\n")),
                        None,
                        "",
                        false,
                        false,
                    )
                    .unwrap(),
                )
                .await
                .map(|_| ()),
            _ => client
                .call(
                    rsb::ops::edit::parse_patch(&format!(
                        "*** Begin Patch\n*** Delete File: {path}\n*** End Patch\n"
                    ))
                    .unwrap(),
                )
                .await
                .map(|_| ()),
        };
        match r {
            Ok(()) => ok += 1,
            Err(_) => refused += 1,
        }
    }
    std::fs::write(&stop, "").unwrap();
    let out = swapper.wait_with_output().await.unwrap();
    pool.shutdown().await;
    eprintln!(
        "{ok} changes done, {refused} refused; swapper: {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    assert!(ok > 0, "no change went through at all");
    assert_eq!(
        std::fs::read(&private).unwrap(),
        before,
        "the private file changed"
    );
    assert_eq!(owner_and_mode(&private), (0, 0o600));
    let beside: Vec<String> = std::fs::read_dir(private.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        beside,
        ["notes.txt"],
        "files appeared in the private directory"
    );
}

/// Issue 50, case 2: a link planted by the other user in a sticky world-writable directory
/// (as `/tmp`) at the path the model names is not followed: `write_remote_file` and
/// `edit_remote_file` refuse in one line naming the link and its owner, an `apply_patch`
/// Delete removes the link and never its target. A link of the user's own there is followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_link_in_a_shared_directory_is_never_followed() {
    let Some(attacker) = other_local_user() else {
        eprintln!("skipped: no second local user (creating one needs root; CI runs as root)");
        return;
    };
    let area = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(area.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let private = private_notes(area.path());
    let before = std::fs::read(&private).unwrap();
    let tmp = area.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let link = tmp.join("notes.txt");
    as_attacker(
        attacker,
        &[
            "/bin/ln",
            "-s",
            &private.display().to_string(),
            &link.display().to_string(),
        ],
    );
    let sshd = Sshd::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let pool = pool_on(&sshd, sshd.port(), state.path());
    let client = pool.client("s").await.expect("connect");
    let path = link.display().to_string();
    let e = client
        .call(
            rsb::ops::edit::write_request(&path, Some("owned\n"), None, "", false, false).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        e.message.contains("refusing to follow the symlink")
            && e.message.contains(&format!("uid {}", attacker.uid))
            && !e.message.contains('\n'),
        "{}",
        e.message
    );
    let e = client
        .call(rsb::ops::edit::edit_request(&path, "PRIVATE", "owned", false, "").unwrap())
        .await
        .unwrap_err();
    assert!(e.message.contains("refusing to follow"), "{}", e.message);
    assert_eq!(std::fs::read(&private).unwrap(), before);
    // Delete File removes the link itself.
    client
        .call(
            rsb::ops::edit::parse_patch(&format!(
                "*** Begin Patch\n*** Delete File: {path}\n*** End Patch\n"
            ))
            .unwrap(),
        )
        .await
        .expect("the link is deleted");
    assert!(
        std::fs::symlink_metadata(&link).is_err(),
        "the link is gone"
    );
    assert_eq!(
        std::fs::read(&private).unwrap(),
        before,
        "its target is kept"
    );
    // The user's own link in the same directory is followed, and stays a link.
    std::os::unix::fs::symlink(&private, &link).unwrap();
    client
        .call(rsb::ops::edit::edit_request(&path, "PRIVATE", "MINE", false, "").unwrap())
        .await
        .expect("the user's own link is followed");
    assert_eq!(
        std::fs::read_to_string(&private).unwrap(),
        "shared line\nMINE\n"
    );
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(owner_and_mode(&private), (0, 0o600));
    // A missing directory: the error names the parameter that creates it (issue 41, item 8),
    // and make_dirs creates it through the same held directories.
    let deep = tmp.join("new/dir/x.txt").display().to_string();
    let e = client
        .call(rsb::ops::edit::write_request(&deep, Some("x\n"), None, "", false, false).unwrap())
        .await
        .unwrap_err();
    assert!(e.message.contains("make_dirs=true"), "{}", e.message);
    client
        .call(rsb::ops::edit::write_request(&deep, Some("x\n"), None, "", false, true).unwrap())
        .await
        .expect("make_dirs creates the directories");
    assert_eq!(std::fs::read_to_string(&deep).unwrap(), "x\n");
    pool.shutdown().await;
}
