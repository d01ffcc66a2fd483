//! Issue 23: safe sudo. `exec_bash(sudo=true)` on the sshd fixture's password user, whom the
//! test gives a sudoers entry: the command runs as root, and the password (from the sandbox's
//! `sudo_password_env`) is in no process's argv or environment on the host, nor in the audit
//! log or rsb's own log. Needs root (for the sudoers entry and the password user) and sudo,
//! which `.ci/run` installs.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use rmcp::{
    RoleClient, ServiceExt, model::CallToolRequestParams, service::RunningService,
    transport::TokioChildProcess,
};
use rsb_tests::{Sshd, workspace_root};

mod common;
use serde_json::{Value, json};

/// The variable the sandbox's `sudo_password_env` names.
const VAR: &str = "SANDBOX_SUDO_PW";

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(p.exists(), "run `cargo build --workspace --bins` first");
    p
}

/// Removes the test's sudoers entry however the test ends.
struct SudoersEntry(PathBuf);

impl Drop for SudoersEntry {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

struct Server {
    svc: RunningService<RoleClient, ()>,
    pid: u32,
}

async fn server(tmp: &Path, list: &str, password: &str) -> Server {
    let home = tmp.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(tmp.join("rsb-mcp.log"))
        .unwrap();
    let mut cmd = tokio::process::Command::new(rsb_bin());
    cmd.arg("mcp")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("RSB_STATE_DIR", tmp.join("state"))
        .env("RSB_LOG", "debug")
        .env("REMOTE_SANDBOX_LIST", list)
        .env(VAR, password);
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(log)
        .spawn()
        .expect("spawn rsb mcp");
    let pid = transport.id().unwrap();
    let svc = tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
        .await
        .expect("MCP initialize timed out")
        .expect("MCP initialize");
    Server { svc, pid }
}

/// `(isError, JSON body or {"text": …})`.
async fn call(s: &rmcp::Peer<RoleClient>, args: Value) -> (bool, Value) {
    call_tool(s, "exec_bash", args).await
}

async fn call_tool(s: &rmcp::Peer<RoleClient>, tool: &str, args: Value) -> (bool, Value) {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
    let r = tokio::time::timeout(Duration::from_secs(60), s.call_tool(params))
        .await
        .expect("the tool did not answer within 60 s")
        .expect("protocol error");
    let raw = serde_json::to_value(&r).unwrap();
    let text = raw["content"][0]["text"].as_str().unwrap_or_default();
    let v = serde_json::from_str(text).unwrap_or(json!({ "text": text }));
    (r.is_error == Some(true), v)
}

/// Every process's command line and environment that holds `needle`, but the server's own
/// (the user put the password in its environment), and whether a sudo exec was seen running.
fn where_on_the_host(needle: &str, server: u32) -> (Vec<String>, bool) {
    let mut found = Vec::new();
    let mut saw_sudo = false;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == server {
            continue;
        }
        for part in ["cmdline", "environ"] {
            let Ok(bytes) = std::fs::read(e.path().join(part)) else {
                continue;
            };
            let text = String::from_utf8_lossy(&bytes);
            if part == "cmdline" && text.contains("rsb-sudo") {
                saw_sudo = true;
            }
            if text.contains(needle) {
                found.push(format!("{pid} {part}: {}", text.replace('\0', " ")));
            }
        }
    }
    (found, saw_sudo)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sudo_runs_as_root_and_the_password_is_nowhere_else() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root, for a sudoers entry and the fixture's password user");
        return;
    }
    assert!(
        Command::new("sudo")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success()),
        "sudo is not installed (.ci/run installs it)"
    );
    let sshd = Sshd::start().unwrap();
    let (user, pw) = sshd.password_user().expect("root gets a password user");
    let entry = PathBuf::from(format!("/etc/sudoers.d/rsb-test-{user}"));
    std::fs::write(&entry, format!("{user} ALL=(ALL) ALL\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o440)).unwrap();
    let _entry = SudoersEntry(entry);
    let tmp = tempfile::tempdir().unwrap();
    let list = |with_sudo: bool| {
        let mut e = json!({"name": "p", "host": sshd.host(), "port": sshd.port(),
                           "user": user, "password": pw});
        if with_sudo {
            e["sudo_password_env"] = VAR.into();
        }
        Value::Array(vec![e]).to_string()
    };

    let s = server(tmp.path(), &list(true), &pw).await;
    let _stop = common::StopDaemon(tmp.path().join("state"));
    // A watched job starts the watchdog, detached: it outlives the session, and its
    // environment must not hold the variable sudo_password_env names.
    let (err, v) = call_tool(
        s.svc.peer(),
        "exec_bash_background",
        json!({"command": "sleep 30", "session_name": "sudo-watched"}),
    )
    .await;
    assert!(!err, "{v}");
    let t0 = std::time::Instant::now();
    let daemon = loop {
        if let Some(pid) = rsb::watchdog::daemon::lock_holder(&tmp.path().join("state")) {
            break pid;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no watchdog: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let environ = std::fs::read(format!("/proc/{daemon}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        !environ.contains(VAR) && !environ.contains(pw.as_str()),
        "the watchdog's environment holds {VAR}"
    );
    assert!(environ.contains("RSB_STATE_DIR="), "{environ}");
    let (err, v) = call(s.svc.peer(), json!({"command": "id -u", "sudo": true})).await;
    assert!(!err, "{v}");
    assert_eq!(
        (v["exit_code"].as_i64(), v["stdout"].as_str()),
        (Some(0), Some("0\n")),
        "{v}"
    );
    let (err, v) = call(s.svc.peer(), json!({"command": "id -u"})).await;
    assert!(
        !err && v["stdout"] != "0\n",
        "without sudo the user is not root: {v}"
    );

    // While a sudo command runs, no process on the host holds the password in its argv or
    // environment (the agent wrote it into sudo's stdin pipe).
    let slow = tokio::spawn({
        let peer = s.svc.peer().clone();
        async move { call(&peer, json!({"command": "sleep 3; id -u", "sudo": true})).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (found, saw_sudo) = where_on_the_host(&pw, s.pid);
    assert!(saw_sudo, "the scan ran while the sudo command did");
    assert!(
        found.is_empty(),
        "the password is visible on the host: {found:?}"
    );
    let (err, v) = slow.await.unwrap();
    assert!(!err && v["stdout"] == "0\n", "{v}");

    // The command's own output and code are kept, and sudo's are not its; a command that
    // reads stdin gets EOF, never the password.
    let (err, v) = call(
        s.svc.peer(),
        json!({"command": "echo out; echo err >&2; exit 3", "sudo": true}),
    )
    .await;
    assert!(!err, "{v}");
    assert_eq!(
        (
            v["exit_code"].as_i64(),
            v["stdout"].as_str(),
            v["stderr"].as_str()
        ),
        (Some(3), Some("out\n"), Some("err\n")),
        "{v}"
    );
    let (err, v) = call(
        s.svc.peer(),
        json!({"command": "cat; echo end", "sudo": true}),
    )
    .await;
    assert!(!err && v["stdout"] == "end\n", "{v}");
    let _ = s.svc.cancel().await;

    // A wrong password is one clear error naming the variable, and nothing runs.
    let marker = tmp.path().join("ran");
    let s = server(tmp.path(), &list(true), "not-the-password").await;
    let (err, v) = call(
        s.svc.peer(),
        json!({"command": format!("touch {}", marker.display()), "sudo": true}),
    )
    .await;
    assert!(err, "{v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(msg.contains("sudo on 'p' did not run the command"), "{v}");
    assert!(v["hint"].as_str().unwrap_or_default().contains(VAR), "{v}");
    assert!(!marker.exists(), "the command ran with a wrong password");
    let _ = s.svc.cancel().await;

    // A sandbox without sudo_password_env says what to set.
    let s = server(tmp.path(), &list(false), &pw).await;
    let (err, v) = call(s.svc.peer(), json!({"command": "id -u", "sudo": true})).await;
    assert!(err, "{v}");
    assert!(
        v["hint"]
            .as_str()
            .unwrap_or_default()
            .contains("sudo_password_env"),
        "{v}"
    );
    let _ = s.svc.cancel().await;

    // Neither the audit log nor rsb's own log holds the password.
    let (audit, _) = common::audit_log(&tmp.path().join("state"));
    assert!(audit.contains("exec_bash(sudo)"), "{audit}");
    assert!(
        !audit.contains(pw.as_str()),
        "the audit log holds the password"
    );
    let log = std::fs::read_to_string(tmp.path().join("rsb-mcp.log")).unwrap();
    assert!(!log.contains(pw.as_str()), "rsb's log holds the password");
}
