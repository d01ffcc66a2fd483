//! MCP-level acceptance tests (issue 3): `rsb mcp` runs as a child process, driven by rmcp's
//! own client over stdio, against real private sshd fixtures.
//!
//! Needs the `rsb` binary: `cargo build --workspace --bins` (the agents must have been built
//! first with `scripts/build-agents.sh`, since `rsb` embeds them).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use base64::Engine as _;
use rmcp::{
    ClientHandler, RoleClient, ServiceExt,
    model::{CallToolRequest, CallToolRequestParams, ClientRequest, ProgressNotificationParam},
    service::{NotificationContext, PeerRequestOptions, RunningService},
    transport::TokioChildProcess,
};
use rsb_tests::gpu::{fake_smi, gpu_host};
use rsb_tests::{Sshd, workspace_root};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// The tools `rsb mcp` exposes by default (no advanced flag).
/// The seed's twelve defaults plus rsb's `kill_background_task`, `list_background_tasks`,
/// `edit_remote_file`, `write_remote_file` and `search_remote_files`.
const DEFAULT_TOOLS: [&str; 17] = [
    "list_sandboxes",
    "select_sandbox",
    "get_active_sandbox",
    "exec_bash",
    "exec_bash_background",
    "check_background_task",
    "kill_background_task",
    "list_background_tasks",
    "list_remote_files",
    "read_remote_file",
    "edit_remote_file",
    "write_remote_file",
    "search_remote_files",
    "sync_local_to_remote",
    "check_file_transfer_task",
    "cancel_file_transfer_task",
    "sync_remote_to_local",
];

/// The seed's twelve default tools take 9,243 B of compact JSON (name, description,
/// inputSchema: the part a model reads); rsb's set may grow by 650 B for each default tool
/// it adds for coding agents (issue 24: edit_remote_file, write_remote_file,
/// search_remote_files), and by 90 B so that `expected_hash` and `safe` say what they do
/// (issue 41: "A read's hash; else refuse" and "First sync: diffs conflict" said too little),
/// and by 200 B for GPU placement (issue 49 allows 300: exec_bash_background's `gpus`,
/// `min_gpu_free_mem_gb` and `sandbox_name: "auto"`).
const SCHEMA_BUDGET_BYTES: usize = 9_243 + 650 * 3 + 90 + 200;

/// The part of a tools/list a model reads, as compact JSON: each tool's name, description
/// and inputSchema (annotations are hints for the client).
fn model_part(tools: &Value) -> String {
    let part: Vec<Value> = tools
        .as_array()
        .unwrap()
        .iter()
        .map(|t| json!({"name": t["name"], "description": t["description"], "inputSchema": t["inputSchema"]}))
        .collect();
    serde_json::to_string(&part).unwrap()
}

/// A password that must never appear in any reply or log line.
const FAKE_SECRET: &str = "S3cr3t-pw!";

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// Counts progress notifications from the server.
#[derive(Clone, Default)]
struct Counter {
    progress: Arc<AtomicUsize>,
    /// Each progress notification's arrival and message.
    messages: Arc<std::sync::Mutex<Vec<(Instant, String)>>>,
}

impl ClientHandler for Counter {
    fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.messages
            .lock()
            .unwrap()
            .push((Instant::now(), params.message.unwrap_or_default()));
        self.progress.fetch_add(1, Ordering::SeqCst);
        std::future::ready(())
    }
}

/// One tool reply: `isError`, the text block, and that text parsed as JSON (or `Null`).
#[derive(Debug, Clone)]
struct Reply {
    is_error: bool,
    text: String,
    v: Value,
}

impl Reply {
    fn s(&self, key: &str) -> &str {
        self.v[key].as_str().unwrap_or_default()
    }
}

struct Mcp {
    svc: RunningService<RoleClient, Counter>,
    progress: Arc<AtomicUsize>,
    messages: Arc<std::sync::Mutex<Vec<(Instant, String)>>>,
    stderr_path: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Mcp {
    /// `rsb mcp` with `REMOTE_SANDBOX_LIST=list` and an otherwise controlled environment: no
    /// config file, no ssh config, no agent, state in a temp dir, debug logs to a file.
    async fn start(list: &str) -> Mcp {
        Mcp::start_env(&[("REMOTE_SANDBOX_LIST", list)]).await
    }

    /// [`Mcp::start`] with more environment (`REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS`, say).
    async fn start_with(list: &str, env: &[(&str, &str)]) -> Mcp {
        let mut vars = vec![("REMOTE_SANDBOX_LIST", list)];
        vars.extend_from_slice(env);
        Mcp::start_env(&vars).await
    }

    /// [`Mcp::start`] with `vars` as the only configuration.
    async fn start_env(vars: &[(&str, &str)]) -> Mcp {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("home");
        std::fs::create_dir_all(&home).unwrap();
        let stderr_path = tmp.path().join("rsb-mcp.stderr");
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut cmd = tokio::process::Command::new(rsb_bin());
        cmd.arg("mcp")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            // The ssh config is the passwd home's unless this says otherwise: keep the user's
            // own out of the tests.
            .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
            .env("RSB_STATE_DIR", tmp.path().join("state"))
            .env("RSB_LOG", "debug")
            .envs(vars.iter().copied());
        let (transport, _) = TokioChildProcess::builder(cmd)
            .stderr(stderr)
            .spawn()
            .expect("spawn rsb mcp");
        let counter = Counter::default();
        let progress = counter.progress.clone();
        let messages = counter.messages.clone();
        let svc = tokio::time::timeout(Duration::from_secs(20), counter.serve(transport))
            .await
            .expect("MCP initialize timed out")
            .unwrap_or_else(|e| {
                panic!(
                    "MCP initialize failed: {e}; server stderr:\n{}",
                    std::fs::read_to_string(&stderr_path).unwrap_or_default()
                )
            });
        Mcp {
            svc,
            progress,
            messages,
            stderr_path,
            _tmp: tmp,
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The requests tool calls have sent to agents (`rsb::requests` debug lines in a call's
    /// `serve_inner` span; the server's own background work, such as the first connect's
    /// Slurm probe, is not a call's).
    fn call_requests(&self) -> Vec<String> {
        self.stderr()
            .lines()
            .filter(|l| l.contains("rsb::requests") && l.contains("serve_inner"))
            .map(str::to_string)
            .collect()
    }

    /// The server's `RSB_STATE_DIR`.
    fn state_dir(&self) -> PathBuf {
        self._tmp.path().join("state")
    }

    /// A tool call; `Err` is a protocol-level error (not a tool result).
    async fn try_call(&self, tool: &str, args: Value) -> Result<Reply, String> {
        let Value::Object(args) = args else {
            panic!("arguments must be an object")
        };
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
        let r = tokio::time::timeout(Duration::from_secs(90), self.svc.call_tool(params))
            .await
            .unwrap_or_else(|_| panic!("{tool} did not answer within 90 s"))
            .map_err(|e| e.to_string())?;
        let raw = serde_json::to_value(&r).unwrap();
        let text = raw["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let v = serde_json::from_str(&text).unwrap_or(Value::Null);
        Ok(Reply {
            is_error: r.is_error == Some(true),
            text,
            v,
        })
    }

    async fn call(&self, tool: &str, args: Value) -> Reply {
        self.try_call(tool, args.clone())
            .await
            .unwrap_or_else(|e| panic!("{tool}({args}) failed at the protocol level: {e}"))
    }

    /// A call that must succeed (`isError` false).
    async fn ok(&self, tool: &str, args: Value) -> Value {
        let r = self.call(tool, args.clone()).await;
        assert!(!r.is_error, "{tool}({args}) failed: {}", r.text);
        r.v
    }

    /// A call that must fail with `isError: true` and a JSON `{"error", "hint"}` body.
    async fn err(&self, tool: &str, args: Value) -> Reply {
        let r = self.call(tool, args.clone()).await;
        assert!(r.is_error, "{tool}({args}) should fail: {}", r.text);
        r
    }

    async fn close(mut self) -> String {
        let _ = tokio::time::timeout(Duration::from_secs(10), self.svc.close()).await;
        self.stderr()
    }
}

fn key_entry(name: &str, sshd: &Sshd) -> Value {
    json!({
        "name": name, "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(),
    })
}

fn pw_entry(name: &str, sshd: &Sshd, user: &str, password: &str) -> Value {
    json!({"name": name, "host": sshd.host(), "port": sshd.port(), "user": user, "password": password})
}

/// A loopback port nobody listens on (bound, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A sandbox on a closed port, with a password that must never leak.
fn dead_entry(name: &str, port: u16) -> Value {
    json!({"name": name, "host": "127.0.0.1", "port": port, "user": "nobody",
           "password": FAKE_SECRET, "connect_timeout_s": 3})
}

fn list(entries: &[Value]) -> String {
    Value::Array(entries.to_vec()).to_string()
}

fn unique(prefix: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{n}", std::process::id())
}

fn home(sshd: &Sshd) -> String {
    sshd.home().display().to_string()
}

fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for s in secrets {
        assert!(!text.contains(s), "a secret leaked into {what}:\n{text}");
    }
}

/// Is any process of group `pgid` alive (the fixture's sessions run on this machine)?
fn group_alive(pgid: i32) -> bool {
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// `check_background_task` of a job once it has ended: a wait also returns on new output, so
/// it is asked again (at most 30 s in all) until the job is no longer running. The last reply
/// carries the whole tail.
async fn job_end(mcp: &Mcp, name: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = mcp
            .ok(
                "check_background_task",
                json!({"tmux_session": name, "wait_s": 10}),
            )
            .await;
        if v["running"] == false || Instant::now() >= deadline {
            return v;
        }
    }
}

async fn wait_for_file(p: &Path, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(s) = std::fs::read_to_string(p)
            && s.ends_with('\n')
        {
            return s;
        }
        assert!(Instant::now() < deadline, "{} never appeared", p.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_group_gone(pgid: i32, within: Duration) -> Duration {
    let start = Instant::now();
    while group_alive(pgid) {
        assert!(
            start.elapsed() < within,
            "process group {pgid} still alive {within:?} after the cancel"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

// ---------------------------------------------------------------------------------------------
// 1. tools/list: names, parameters, defaults, schema budget
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_list_matches_the_seed_and_fits_the_budget() {
    let mcp = Mcp::start(&list(&[dead_entry("dead", closed_port())])).await;
    let tools = mcp.svc.list_all_tools().await.unwrap();
    let arr = serde_json::to_value(&tools).unwrap();
    let compact = model_part(&arr);
    println!(
        "tools/list: {} tools, {} bytes of compact JSON read by a model (budget {SCHEMA_BUDGET_BYTES}), {} with annotations",
        tools.len(),
        compact.len(),
        serde_json::to_string(&arr).unwrap().len()
    );
    for t in arr.as_array().unwrap() {
        println!(
            "  {:<24} {:>5} bytes",
            t["name"].as_str().unwrap(),
            serde_json::to_string(t).unwrap().len()
        );
    }
    assert!(
        compact.len() <= SCHEMA_BUDGET_BYTES,
        "tools array is {} bytes, over the {SCHEMA_BUDGET_BYTES} budget",
        compact.len()
    );

    let names: BTreeSet<&str> = arr
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, DEFAULT_TOOLS.into_iter().collect::<BTreeSet<_>>());

    let tool = |n: &str| -> Value {
        arr.as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == n)
            .cloned()
            .unwrap()
    };
    for n in DEFAULT_TOOLS {
        let t = tool(n);
        let d = t["description"].as_str().unwrap_or_default();
        assert!(d.len() >= 20, "{n} needs a useful description: {d:?}");
        assert!(t.get("outputSchema").is_none(), "{n} has an output schema");
        assert_eq!(t["inputSchema"]["type"], "object", "{n}");
    }

    // (tool, required params, [(param, default)])
    type Spec = (&'static str, Vec<&'static str>, Vec<(&'static str, Value)>);
    let spec: Vec<Spec> = vec![
        (
            "list_sandboxes",
            vec![],
            vec![("check_resources", json!(false))],
        ),
        ("select_sandbox", vec!["sandbox_name"], vec![]),
        ("get_active_sandbox", vec![], vec![]),
        (
            "exec_bash",
            vec!["command"],
            vec![
                ("cwd", Value::Null),
                ("timeout_s", json!(120)),
                ("max_output_chars", json!(20000)),
                ("sandbox_name", json!("")),
                ("sudo", json!(false)),
            ],
        ),
        (
            "exec_bash_background",
            vec!["command"],
            vec![
                ("session_name", json!("")),
                ("log_file", json!("")),
                ("cwd", json!("")),
                ("sandbox_name", json!("")),
                ("watch", json!(true)),
                ("ensure_watchdog", json!(true)),
                ("run_id", json!("")),
                ("watch_name", json!("")),
                ("resume_command", json!("")),
                ("resume_plan_json", json!("")),
                ("checkpoint_path", json!("")),
                ("checkpoint_format", json!("text")),
                ("checkpoint_command", json!("")),
                ("interval_s", json!(300)),
                ("max_log_lines", json!(80)),
                ("webhook_url", json!("")),
                ("event_command", json!("")),
                ("auto_resume", json!(false)),
                ("max_resume_attempts", json!(1)),
                ("metadata_json", json!("")),
                ("notify_local", json!(true)),
                ("alert_after_failures", json!(2)),
                ("resume_delay_s", json!(300)),
                ("codex_wakeup", json!(false)),
                ("codex_command", json!("")),
            ],
        ),
        (
            "check_background_task",
            vec![],
            vec![
                ("tmux_session", json!("")),
                ("log_file", json!("")),
                ("watch_id", json!(0)),
                ("last_n_lines", json!(50)),
                ("sandbox_name", json!("")),
            ],
        ),
        (
            "list_remote_files",
            vec![],
            vec![
                ("remote_path", json!(".")),
                ("recursive", json!(false)),
                ("max_entries", json!(200)),
                ("sandbox_name", json!("")),
            ],
        ),
        (
            "read_remote_file",
            vec!["remote_path"],
            vec![("max_bytes", json!(200000)), ("sandbox_name", json!(""))],
        ),
        (
            "edit_remote_file",
            vec!["new_string", "old_string", "remote_path"],
            vec![],
        ),
        ("write_remote_file", vec!["remote_path"], vec![]),
        (
            "search_remote_files",
            vec!["pattern"],
            vec![
                ("remote_path", json!("")),
                ("head_limit", json!(100)),
                ("sandbox_name", json!("")),
            ],
        ),
        (
            "sync_local_to_remote",
            vec![],
            vec![
                ("local_path", json!(".")),
                ("remote_path", json!(".")),
                ("delete_extras", json!(false)),
                ("excludes", Value::Null),
                ("exclude_file", Value::Null),
                ("sandbox_name", json!("")),
            ],
        ),
        (
            "sync_remote_to_local",
            vec![],
            vec![
                ("remote_path", json!(".")),
                ("local_path", json!("./remote_mirror")),
                ("excludes", Value::Null),
                ("exclude_file", Value::Null),
                ("sandbox_name", json!("")),
            ],
        ),
        (
            "check_file_transfer_task",
            vec!["task_id"],
            vec![("last_n_lines", json!(50))],
        ),
        (
            "cancel_file_transfer_task",
            vec!["task_id"],
            vec![("force_kill_after_s", json!(5.0))],
        ),
        (
            "sync_local_to_remote",
            vec![],
            vec![
                ("local_path", json!(".")),
                ("remote_path", json!(".")),
                ("delete_extras", json!(false)),
                ("excludes", Value::Null),
                ("exclude_file", Value::Null),
                ("sandbox_name", json!("")),
            ],
        ),
        (
            "sync_remote_to_local",
            vec![],
            vec![
                ("remote_path", json!(".")),
                ("local_path", json!("./remote_mirror")),
                ("excludes", Value::Null),
                ("exclude_file", Value::Null),
                ("sandbox_name", json!("")),
            ],
        ),
        (
            "check_file_transfer_task",
            vec!["task_id"],
            vec![("last_n_lines", json!(50))],
        ),
        (
            "cancel_file_transfer_task",
            vec!["task_id"],
            vec![("force_kill_after_s", json!(5.0))],
        ),
    ];
    for (name, required, defaults) in spec {
        let schema = &tool(name)["inputSchema"];
        let props = schema["properties"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        let mut req: Vec<&str> = schema["required"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap()).collect())
            .unwrap_or_default();
        req.sort();
        assert_eq!(req, required, "{name}: required parameters");
        for r in &required {
            assert!(props.contains_key(*r), "{name}: missing parameter {r}");
        }
        for (p, d) in &defaults {
            let prop = props
                .get(*p)
                .unwrap_or_else(|| panic!("{name}: missing parameter {p}"));
            assert_eq!(&prop["default"], d, "{name}.{p} default: {prop}");
        }
        if name == "get_active_sandbox" {
            assert!(props.is_empty(), "{name} takes no parameters: {schema}");
        }
    }
    // Integer parameters are integers, not strings.
    for (t, p) in [
        ("exec_bash", "timeout_s"),
        ("exec_bash", "max_output_chars"),
        ("list_remote_files", "max_entries"),
        ("read_remote_file", "max_bytes"),
        ("check_background_task", "last_n_lines"),
        ("check_file_transfer_task", "task_id"),
        ("check_file_transfer_task", "last_n_lines"),
        ("cancel_file_transfer_task", "task_id"),
    ] {
        assert_eq!(
            tool(t)["inputSchema"]["properties"][p]["type"],
            "integer",
            "{t}.{p}"
        );
    }
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 2. Several sandboxes: key auth, password auth, unreachable
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_select_override_and_unreachable() {
    let s1 = Sshd::start().unwrap();
    let s2 = Sshd::start().unwrap();
    let pw = s1.password_user();
    let mut entries = vec![key_entry("a", &s1), key_entry("b", &s2)];
    match &pw {
        Some((u, p)) => entries.push(pw_entry("pw", &s1, u, p)),
        None => eprintln!("NOTE: not root; skipping the password-auth sandbox"),
    }
    entries.push(dead_entry("dead", closed_port()));
    let mcp = Mcp::start(&list(&entries)).await;
    let mut secrets = vec![FAKE_SECRET.to_string()];
    if let Some((_, p)) = &pw {
        secrets.push(p.clone());
    }
    let secrets: Vec<&str> = secrets.iter().map(String::as_str).collect();
    let mut replies = String::new();

    // Probe them, with resources.
    let t = Instant::now();
    let r = mcp
        .call("list_sandboxes", json!({"check_resources": true}))
        .await;
    let took = t.elapsed();
    println!("list_sandboxes (first connect + deploy to each) took {took:?}");
    assert!(!r.is_error, "{}", r.text);
    replies.push_str(&r.text);
    assert!(
        took < Duration::from_secs(30),
        "list_sandboxes took {took:?}"
    );
    assert_eq!(r.v["active_sandbox"], "a");
    let sbs = r.v["sandboxes"].as_array().unwrap();
    assert_eq!(sbs.len(), entries.len());
    for sb in sbs {
        let name = sb["name"].as_str().unwrap();
        assert_eq!(sb["is_active"], json!(name == "a"), "{sb}");
        assert!(sb["host"].is_string() && sb["port"].is_u64() && sb["user"].is_string());
        if name == "dead" {
            assert_eq!(sb["connection_alive"], false, "{sb}");
            let e = sb["connection_error"].as_str().unwrap();
            assert!(!e.is_empty() && !e.contains('\n'), "{sb}");
        } else {
            assert_eq!(sb["connection_alive"], true, "{sb}");
            assert!(sb.get("connection_error").is_none(), "{sb}");
        }
    }
    // Warm now: the dead one must not slow the whole list down.
    let t = Instant::now();
    let r = mcp.call("list_sandboxes", json!({})).await;
    println!("list_sandboxes (warm) took {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(5));
    replies.push_str(&r.text);

    // select → exec lands on the selected sandbox.
    let v = mcp.ok("select_sandbox", json!({"sandbox_name": "b"})).await;
    assert_eq!(v, json!({"active_sandbox": "b", "status": "selected"}));
    let cmd = "hostname; echo $HOME";
    let v = mcp.ok("exec_bash", json!({"command": cmd})).await;
    let out = v["stdout"].as_str().unwrap();
    assert_eq!(out.lines().nth(1), Some(home(&s2).as_str()), "{v}");

    // A per-call override does not change the active sandbox.
    let v = mcp
        .ok("exec_bash", json!({"command": cmd, "sandbox_name": "a"}))
        .await;
    assert_eq!(
        v["stdout"].as_str().unwrap().lines().nth(1),
        Some(home(&s1).as_str())
    );
    let v = mcp.ok("get_active_sandbox", json!({})).await;
    assert_eq!(v["active_sandbox"], "b", "{v}");
    assert_eq!(v["connection_alive"], true, "{v}");
    assert_eq!(v["port"], s2.port());
    assert_eq!(v["user"], s2.user());
    let v = mcp.ok("exec_bash", json!({"command": "echo $HOME"})).await;
    assert_eq!(v["stdout"], format!("{}\n", home(&s2)));

    // Password auth.
    if let Some((user, _)) = &pw {
        let v = mcp
            .ok(
                "exec_bash",
                json!({"command": "id -un; echo $HOME", "sandbox_name": "pw"}),
            )
            .await;
        let want = format!("{user}\n{}\n", s1.password_home().unwrap().display());
        assert_eq!(v["stdout"], want, "{v}");
        replies.push_str(&v.to_string());
    }

    // Unknown sandbox: an error that lists the available names.
    for (tool, args) in [
        ("select_sandbox", json!({"sandbox_name": "nope"})),
        (
            "exec_bash",
            json!({"command": "true", "sandbox_name": "nope"}),
        ),
        ("list_remote_files", json!({"sandbox_name": "nope"})),
    ] {
        let r = mcp.err(tool, args).await;
        assert!(r.s("error").contains("nope"), "{}", r.text);
        for n in ["a", "b", "dead"] {
            assert!(
                r.text.contains(&format!("\"{n}\"")) || r.s("error").contains(n),
                "{tool}: available names missing: {}",
                r.text
            );
        }
        replies.push_str(&r.text);
    }
    let v = mcp.ok("get_active_sandbox", json!({})).await;
    assert_eq!(v["active_sandbox"], "b");

    // The unreachable sandbox: a per-call error, active unchanged.
    let r = mcp
        .err(
            "exec_bash",
            json!({"command": "true", "sandbox_name": "dead"}),
        )
        .await;
    assert!(
        !r.s("error").is_empty() && !r.s("hint").is_empty(),
        "{}",
        r.text
    );
    replies.push_str(&r.text);
    // select does not test the connection (seed); get_active_sandbox then reports it.
    mcp.ok("select_sandbox", json!({"sandbox_name": "dead"}))
        .await;
    let v = mcp.ok("get_active_sandbox", json!({})).await;
    assert_eq!(v["active_sandbox"], "dead");
    assert_eq!(v["connection_alive"], false, "{v}");
    assert!(v["connection_error"].is_string(), "{v}");
    replies.push_str(&v.to_string());

    assert_no_secret("replies", &replies, &secrets);
    let log = mcp.close().await;
    assert_no_secret("the server log", &log, &secrets);
}

// ---------------------------------------------------------------------------------------------
// 3. exec_bash semantics through MCP
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_bash_semantics() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;

    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "echo hi; echo err >&2; exit 3"}),
        )
        .await;
    assert_eq!(v["exit_code"], 3);
    assert_eq!(v["stdout"], "hi\n");
    assert_eq!(v["stderr"], "err\n");
    assert!(v.get("timed_out").is_none(), "{v}");

    let v = mcp.ok("exec_bash", json!({"command": "true"})).await;
    assert_eq!(v["exit_code"], 0);
    assert!(
        v.get("stdout").is_none() && v.get("stderr").is_none(),
        "{v}"
    );

    // A real timeout: the whole group is killed, promptly.
    let t = Instant::now();
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "sleep 29.5; echo never", "timeout_s": 2}),
        )
        .await;
    let took = t.elapsed();
    println!("timeout_s=2 on sleep took {took:?}");
    assert_eq!(v["timed_out"], true, "{v}");
    assert_eq!(v["exit_code"], 124, "{v}");
    assert!(v["stderr"].as_str().unwrap().contains("[TIMEOUT]"), "{v}");
    assert!(v.get("stdout").is_none(), "{v}");
    assert!(took < Duration::from_secs(3), "timeout took {took:?}");
    let left = sshd.ssh_run("pgrep -f 'sleep 2[9].5' || true").unwrap();
    assert!(left.trim().is_empty(), "sleep survived the timeout: {left}");

    // A command that ignores SIGTERM is SIGKILLed after the grace period (the seed left it).
    let t = Instant::now();
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "trap '' TERM; sleep 28.5; echo never", "timeout_s": 1}),
        )
        .await;
    let took = t.elapsed();
    println!("timeout_s=1 on a TERM-ignoring sleep took {took:?}");
    assert_eq!(v["timed_out"], true, "{v}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
    let left = sshd.ssh_run("pgrep -f 'sleep 2[8].5' || true").unwrap();
    assert!(left.trim().is_empty(), "sleep survived SIGKILL: {left}");

    // `exit 124` is not a timeout.
    let v = mcp.ok("exec_bash", json!({"command": "exit 124"})).await;
    assert_eq!(v["exit_code"], 124);
    assert!(v.get("timed_out").is_none(), "{v}");

    // stdin is closed: `cat` returns at once.
    let t = Instant::now();
    let v = mcp
        .ok("exec_bash", json!({"command": "cat", "timeout_s": 10}))
        .await;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "cat took {:?}",
        t.elapsed()
    );

    // cwd: spaces, ~, and no injection.
    let spaced = sshd.home().join("dir with space");
    std::fs::create_dir_all(&spaced).unwrap();
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "pwd", "cwd": spaced.display().to_string()}),
        )
        .await;
    assert_eq!(v["stdout"], format!("{}\n", spaced.display()));
    let v = mcp
        .ok("exec_bash", json!({"command": "pwd", "cwd": "~"}))
        .await;
    assert_eq!(v["stdout"], format!("{}\n", home(&sshd)));
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "pwd", "cwd": "~/dir with space"}),
        )
        .await;
    assert_eq!(v["stdout"], format!("{}\n", spaced.display()));
    let pwned = std::env::temp_dir().join(unique("pwned"));
    let r = mcp
        .err(
            "exec_bash",
            json!({"command": "echo ran", "cwd": format!("/tmp; touch {}", pwned.display())}),
        )
        .await;
    assert!(!r.s("error").is_empty(), "{}", r.text);
    assert!(!r.text.contains("ran\\n"), "{}", r.text);
    assert!(!pwned.exists(), "cwd was interpreted by a shell");
    let r = mcp
        .err(
            "exec_bash",
            json!({"command": "echo ran", "cwd": "/nonexistent-dir-xyz"}),
        )
        .await;
    assert!(r.s("error").contains("nonexistent-dir-xyz"), "{}", r.text);

    // Output caps: max_output_chars is honoured, head and tail kept, flagged.
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "seq 1 200000", "max_output_chars": 1000}),
        )
        .await;
    let out = v["stdout"].as_str().unwrap();
    assert_eq!(v["stdout_truncated"], true, "{v}");
    assert!(out.starts_with("1\n2\n3\n"), "{out}");
    assert!(out.ends_with("199999\n200000\n"), "{out}");
    assert!(out.contains("truncated"), "{out}");
    let marker = out.lines().find(|l| l.contains("truncated")).unwrap().len() + 2;
    assert!(
        out.chars().count() <= 1000 + marker,
        "{} chars for max_output_chars=1000",
        out.chars().count()
    );
    // The default cap (20000) applies to a huge output.
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "seq 1 300000; seq 1 300000 >&2"}),
        )
        .await;
    assert_eq!(v["stdout_truncated"], true);
    assert_eq!(v["stderr_truncated"], true);
    assert!(v["stdout"].as_str().unwrap().chars().count() <= 20_000 + 64);
    assert!(v["stderr"].as_str().unwrap().chars().count() <= 20_000 + 64);
    // Small outputs are not flagged.
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "printf 1234567890", "max_output_chars": 10}),
        )
        .await;
    assert_eq!(v["stdout"], "1234567890");
    assert!(v.get("stdout_truncated").is_none(), "{v}");

    // Invalid UTF-8 is flagged, valid multi-byte text is not.
    let v = mcp
        .ok("exec_bash", json!({"command": r"printf 'a\xffb'"}))
        .await;
    assert_eq!(v["invalid_utf8"], true, "{v}");
    assert_eq!(v["stdout"], "a\u{fffd}b");
    let v = mcp
        .ok("exec_bash", json!({"command": "printf 'wörld ✓'"}))
        .await;
    assert_eq!(v["stdout"], "wörld ✓");
    assert!(v.get("invalid_utf8").is_none(), "{v}");

    // Multi-line commands run as one script (no `cd X &&` guarding only line one).
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "x=1\necho $((x+1))", "cwd": "/"}),
        )
        .await;
    assert_eq!(v["stdout"], "2\n");
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 4. Concurrency
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_across_two_sandboxes() {
    let s1 = Sshd::start().unwrap();
    let s2 = Sshd::start().unwrap();
    let mcp = Arc::new(Mcp::start(&list(&[key_entry("a", &s1), key_entry("b", &s2)])).await);
    // Warm both (connect + deploy) so the measurement is about execution.
    for n in ["a", "b"] {
        mcp.ok("exec_bash", json!({"command": "true", "sandbox_name": n}))
            .await;
    }

    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let mcp = mcp.clone();
        let sb = if i % 2 == 0 { "a" } else { "b" };
        tasks.push(tokio::spawn(async move {
            let v = mcp
                .ok(
                    "exec_bash",
                    json!({"command": format!("sleep 1; echo {i}; echo $HOME"), "sandbox_name": sb}),
                )
                .await;
            (i, sb, v)
        }));
    }
    for task in tasks {
        let (i, sb, v) = task.await.unwrap();
        let h = if sb == "a" { home(&s1) } else { home(&s2) };
        assert_eq!(v["stdout"], format!("{i}\n{h}\n"), "call {i}");
    }
    let took = t.elapsed();
    println!("20 concurrent `sleep 1` calls across two sandboxes: {took:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");

    // A slow call never blocks another one.
    let slow = {
        let mcp = mcp.clone();
        tokio::spawn(async move { mcp.ok("exec_bash", json!({"command": "sleep 3"})).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    mcp.ok("select_sandbox", json!({"sandbox_name": "a"})).await;
    mcp.ok("exec_bash", json!({"command": "echo quick"})).await;
    println!("select + exec while a 3 s exec runs: {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    slow.await.unwrap();
}

/// A store that another process holds locked never stalls `exec_bash` (issue 20). exec needs
/// no database; what does (here four small syncs, as many as the runtime has threads and
/// more, each saving its baseline at its end, and the tools that read or write the store
/// beside: kill_background_task cancels the job's watches, list_forwards, check_background_task
/// by watch id, check_file_transfer_task) waits out the other process's write lock on the
/// store's own thread ([`rsb::store::Store`]), so the exec calls made meanwhile run at their
/// usual speed. Before `store::blocking`, the four syncs held both runtime threads for the
/// whole hold, and an exec waited for it; until issue 45 the last four touched SQLite on a
/// runtime thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_held_by_another_process_never_stalls_exec_bash() {
    let s = Sshd::start().unwrap();
    // The advanced surface: list_forwards is one of the store's readers.
    let mcp = Arc::new(
        Mcp::start_with(
            &list(&[key_entry("a", &s)]),
            &[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1")],
        )
        .await,
    );
    let tmp = tempfile::tempdir().unwrap();
    let trees: Vec<PathBuf> = (0..4)
        .map(|i| {
            let t = tmp.path().join(format!("t{i}"));
            std::fs::create_dir_all(&t).unwrap();
            std::fs::write(t.join("f.txt"), format!("tree {i}\n")).unwrap();
            t
        })
        .collect();
    let sync = |i: usize| json!({"local_path": trees[i].display().to_string(), "remote_path": format!("held/t{i}")});
    // Warm: the connection, the local agent and the store (a first sync of each tree).
    for i in 0..4 {
        mcp.ok("sync_local_to_remote", sync(i)).await;
    }
    let time_exec = async || {
        let t = Instant::now();
        mcp.ok("exec_bash", json!({"command": "true"})).await;
        t.elapsed()
    };
    let mut before = Vec::new();
    for _ in 0..20 {
        before.push(time_exec().await);
    }

    // The deliberate writer: another connection holds the write lock for 3 s.
    let hold = Duration::from_secs(3);
    let dir = mcp.state_dir();
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let c = rsb::store::open(&dir).unwrap();
        c.execute_batch(
            "BEGIN IMMEDIATE; CREATE TABLE IF NOT EXISTS test_hold (x);
             INSERT INTO test_hold VALUES (1);",
        )
        .unwrap();
        locked_tx.send(Instant::now()).unwrap();
        std::thread::sleep(hold);
        c.execute_batch("ROLLBACK").unwrap();
    });
    let locked_at = locked_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // Each tree changed: each sync sends a file and then saves its baseline, a write.
    for (i, t) in trees.iter().enumerate() {
        std::fs::write(t.join("f.txt"), format!("tree {i}, edited\n")).unwrap();
    }
    let waiters: Vec<_> = (0..4)
        .map(|i| {
            let mcp = mcp.clone();
            let args = sync(i);
            tokio::spawn(async move {
                let t = Instant::now();
                let r = mcp.call("sync_local_to_remote", args).await;
                (t.elapsed(), r)
            })
        })
        .collect();
    let store_tools: Vec<_> = [
        (
            "kill_background_task",
            json!({"tmux_session": "no-such-job", "grace_s": 0}),
        ),
        ("list_forwards", json!({})),
        ("check_background_task", json!({"watch_id": 987_654})),
        ("check_file_transfer_task", json!({"task_id": 987_654})),
    ]
    .into_iter()
    .map(|(tool, args)| {
        let mcp = mcp.clone();
        tokio::spawn(async move { (tool, mcp.call(tool, args).await) })
    })
    .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut during = Vec::new();
    while locked_at.elapsed() < hold - Duration::from_millis(300) && during.len() < 500 {
        during.push(time_exec().await);
    }
    holder.join().unwrap();
    let mut waited = Vec::new();
    for w in waiters {
        let (took, r) = w.await.unwrap();
        assert!(!r.is_error, "{}", r.text);
        waited.push(took);
    }
    for t in store_tools {
        let (tool, r) = t.await.unwrap();
        println!("{tool} during the hold: {}", r.text);
        match tool {
            "list_forwards" => assert!(!r.is_error, "{tool}: {}", r.text),
            "kill_background_task" => {}
            _ => assert!(
                r.is_error && r.text.contains("987654"),
                "{tool}: {}",
                r.text
            ),
        }
    }
    for i in 0..4 {
        assert_eq!(
            std::fs::read_to_string(s.home().join(format!("held/t{i}/f.txt"))).unwrap(),
            format!("tree {i}, edited\n")
        );
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (b_med, b_max) = (median(&mut before), *before.iter().max().unwrap());
    let (d_med, d_max) = (median(&mut during), *during.iter().max().unwrap());
    println!(
        "exec_bash before the hold: median {b_med:?}, max {b_max:?} (20 calls); during it: \
         median {d_med:?}, max {d_max:?} ({} calls); the syncs took {waited:?}",
        during.len()
    );
    // The hold was real: every sync waited for it to end.
    assert!(
        waited.iter().all(|w| *w >= Duration::from_secs(2)),
        "the lock did not hold them: {waited:?}"
    );
    assert!(
        during.len() >= 10,
        "only {} exec calls in the hold",
        during.len()
    );
    let ms = Duration::from_millis;
    assert!(d_med <= b_med + ms(10), "median {d_med:?} vs {b_med:?}");
    // A 2-core machine's scheduler noise aside, no call waited on the store (~3 s).
    assert!(d_max <= b_max + ms(100), "max {d_max:?} vs {b_max:?}");
}

// ---------------------------------------------------------------------------------------------
// 5. Cancellation
// ---------------------------------------------------------------------------------------------

fn call_request(tool: &str, args: Value) -> ClientRequest {
    let Value::Object(args) = args else {
        unreachable!()
    };
    ClientRequest::CallToolRequest(CallToolRequest::new(
        CallToolRequestParams::new(tool.to_string()).with_arguments(args),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_call_leaves_no_remote_process() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    mcp.ok("exec_bash", json!({"command": "true"})).await;

    // (a) An explicit `notifications/cancelled` (RequestHandle::cancel).
    let pidfile = sshd.home().join(unique("cancel-a"));
    let cmd = format!("echo $$ > '{}'; sleep 60", pidfile.display());
    let handle = mcp
        .svc
        .peer()
        .send_cancellable_request(
            call_request("exec_bash", json!({"command": cmd})),
            PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    let pgid: i32 = wait_for_file(&pidfile, Duration::from_secs(20))
        .await
        .trim()
        .parse()
        .unwrap();
    assert!(group_alive(pgid));
    handle.cancel(Some("test cancels".into())).await.unwrap();
    let gone = wait_group_gone(pgid, Duration::from_secs(5)).await;
    println!("explicit cancel: process group gone after {gone:?}");

    // (b) Dropping the call future (rmcp sends `notifications/cancelled` on drop).
    let pidfile = sshd.home().join(unique("cancel-b"));
    let cmd = format!("echo $$ > '{}'; sleep 60", pidfile.display());
    let call = mcp.try_call("exec_bash", json!({"command": cmd}));
    let waiter = wait_for_file(&pidfile, Duration::from_secs(20));
    let pid = tokio::select! {
        _ = call => panic!("the call returned before being cancelled"),
        s = waiter => s,
    };
    let pgid: i32 = pid.trim().parse().unwrap();
    let gone = wait_group_gone(pgid, Duration::from_secs(5)).await;
    println!("dropped call: process group gone after {gone:?}");

    // The server and the connection are still fine.
    let v = mcp.ok("exec_bash", json!({"command": "echo ok"})).await;
    assert_eq!(v["stdout"], "ok\n");
    // Only this test's processes: other tests on this machine may run their own `sleep 60`.
    let left = sshd.ssh_run("pgrep -af 'cancel-[ab]' || true").unwrap();
    assert!(!left.contains("sleep 60"), "{left}");
    // Each cancelled call left its start line on the audit record before it ran, and its
    // end says it did not finish.
    let audit = audit_text(&mcp);
    let lines: Vec<Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for which in ["cancel-a", "cancel-b"] {
        let of: Vec<&Value> = lines
            .iter()
            .filter(|l| l["command"].as_str().unwrap_or_default().contains(which))
            .collect();
        assert_eq!(of[0]["event"], "start", "{which}: {audit}");
        assert!(
            of.iter().skip(1).all(|l| l["event"] == "end"
                && l["error"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("did not finish")),
            "{which}: {audit}"
        );
    }
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 6. Progress
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_exec_sends_progress() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    // rmcp's client puts a progress token on every request it sends.
    mcp.ok("exec_bash", json!({"command": "echo warm"})).await;
    assert_eq!(
        mcp.progress.load(Ordering::SeqCst),
        0,
        "a quick call sends no progress"
    );
    let v = mcp
        .ok("exec_bash", json!({"command": "sleep 5; echo done"}))
        .await;
    assert_eq!(v["stdout"], "done\n");
    let n = mcp.progress.load(Ordering::SeqCst);
    println!("progress notifications during a 5 s exec: {n}");
    assert!(n >= 1, "no progress notification during a 5 s exec");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        mcp.progress.load(Ordering::SeqCst),
        n,
        "progress kept coming after the call finished"
    );
    mcp.close().await;
}

/// Issue 23: every progress notification of a long exec_bash carries the command's last
/// output line, and they come at the default cadence (nothing configured), far inside the
/// 30 s a client's idle timeout allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_carries_the_last_output_line() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    mcp.ok("exec_bash", json!({"command": "echo warm"})).await;
    let t0 = Instant::now();
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "for i in 1 2 3 4 5 6 7 8; do echo line$i; sleep 1; done; printf 'step 1\\rstep 2'; sleep 3"}),
        )
        .await;
    let t1 = Instant::now();
    assert!(
        v["stdout"].as_str().unwrap().starts_with("line1\nline2\n"),
        "{v}"
    );
    let msgs = mcp.messages.lock().unwrap().clone();
    println!("{msgs:?}");
    assert!(msgs.len() >= 4, "too few progress notifications: {msgs:?}");
    let mut times = vec![t0];
    times.extend(msgs.iter().map(|(t, _)| *t));
    times.push(t1);
    let gap = times.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    println!("largest gap between progress notifications: {gap:?}");
    assert!(gap <= Duration::from_secs(30), "a gap of {gap:?}");
    assert!(
        gap <= Duration::from_secs(4),
        "the default cadence is 2 s, got a gap of {gap:?}"
    );
    for (_, m) in &msgs {
        assert!(m.starts_with("exec_bash: running for "), "{m}");
    }
    // Once the first line is out, each message names the latest one.
    let with_line: Vec<&String> = msgs
        .iter()
        .map(|(_, m)| m)
        .filter(|m| m.contains("last line: "))
        .collect();
    assert!(with_line.len() >= 3, "{msgs:?}");
    assert!(
        with_line
            .iter()
            .any(|m| m.contains("last line: line3") || m.contains("last line: line4")),
        "{msgs:?}"
    );
    assert!(
        msgs.last().unwrap().1.ends_with("last line: step 2"),
        "{msgs:?}"
    );
    // Each exec_bash is on the audit record, with the client's name as origin.
    let audit = mcp._tmp.path().join("state/audit");
    let text: String = std::fs::read_dir(&audit)
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    // The end lines (each command also has its start line before it ran).
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["event"] == "end")
        .collect();
    assert_eq!(text.lines().count(), 4, "{text}");
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(lines[0]["command"], "echo warm");
    assert_eq!(lines[1]["tool"], "exec_bash");
    assert_eq!(lines[1]["exit_code"], 0);
    assert!(
        lines[1]["origin"].as_str().unwrap().starts_with("mcp:"),
        "{text}"
    );
    assert!(
        lines[1]["duration_ms"].as_u64().unwrap() >= 11_000,
        "{text}"
    );
    mcp.close().await;
}

/// Issue 23: `check_background_task(wait_s)` answers as soon as the job ends (measured against
/// the job's own last instruction), as soon as it prints more, else at wait_s; more than 110 s
/// is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_background_task_waits_for_the_end_or_new_output() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    let e = mcp
        .err(
            "check_background_task",
            json!({"tmux_session": "x", "wait_s": 111}),
        )
        .await;
    assert!(
        e.s("error").contains("wait_s must be between 0 and 110"),
        "{}",
        e.text
    );

    // The end: the job's last act prints the time; the reply must follow within 100 ms.
    let mut lags = Vec::new();
    for i in 0..3 {
        let name = format!("{}-end{i}", unique("wait"));
        mcp.ok(
            "exec_bash_background",
            json!({"command": "sleep 2; date +%s%N", "session_name": name, "watch": false}),
        )
        .await;
        let t0 = Instant::now();
        let before = mcp.call_requests().len();
        let v = mcp
            .ok(
                "check_background_task",
                json!({"tmux_session": name, "wait_s": 60}),
            )
            .await;
        // Issue 40: the wait is one request to the agent, between a status read on each side
        // (it asked every 50 ms before).
        let asked = mcp.call_requests()[before..].to_vec();
        assert!(asked.len() <= 3, "{asked:#?}");
        let now_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i128;
        assert_eq!(v["running"], false, "{v}");
        assert_eq!(v["exit_code"], 0, "{v}");
        assert!(t0.elapsed() < Duration::from_secs(10), "{v}");
        let ended: i128 = v["log_tail"]
            .as_str()
            .unwrap()
            .lines()
            .find_map(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("no timestamp in {v}"));
        lags.push(Duration::from_nanos((now_ns - ended).max(0) as u64));
    }
    lags.sort();
    println!("reply after the job's end: {lags:?} (median {:?})", lags[1]);
    assert!(lags[1] <= Duration::from_millis(100), "{lags:?}");

    // New output ends the wait too; a running job's reply says so.
    let name = unique("wait-out");
    mcp.ok(
        "exec_bash_background",
        json!({"command": "sleep 1.5; echo hello-wait; sleep 30", "session_name": name, "watch": false}),
    )
    .await;
    let t0 = Instant::now();
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": name, "wait_s": 60}),
        )
        .await;
    let took = t0.elapsed();
    assert_eq!(v["running"], true, "{v}");
    assert!(
        v["log_tail"].as_str().unwrap().contains("hello-wait"),
        "{v}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");

    // Nothing happens: the wait ends at wait_s.
    let t0 = Instant::now();
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": name, "wait_s": 1.5}),
        )
        .await;
    let took = t0.elapsed();
    assert_eq!(v["running"], true, "{v}");
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(4),
        "{took:?}"
    );
    mcp.ok(
        "kill_background_task",
        json!({"tmux_session": name, "grace_s": 0}),
    )
    .await;
    // Job starts and the kill are on the audit record.
    let audit = mcp._tmp.path().join("state/audit");
    let text: String = std::fs::read_dir(&audit)
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    let tools: Vec<String> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["tool"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        tools
            .iter()
            .filter(|t| *t == "exec_bash_background")
            .count(),
        4,
        "{text}"
    );
    assert!(
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .any(|v| v["tool"] == "kill_background_task" && v["command"] == name.as_str()),
        "{text}"
    );
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 1b. every parameter described, annotations per tool (issue 12)
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_parameter_is_described_and_every_tool_annotated() {
    let mcp = Mcp::start(&list(&[dead_entry("dead", closed_port())])).await;
    let tools = serde_json::to_value(mcp.svc.list_all_tools().await.unwrap()).unwrap();
    let compact = model_part(&tools);
    let tools = tools.as_array().unwrap();
    println!(
        "tools/list: {} bytes of compact JSON (budget {SCHEMA_BUDGET_BYTES})",
        compact.len()
    );
    assert!(
        compact.len() <= SCHEMA_BUDGET_BYTES,
        "{} bytes",
        compact.len()
    );
    let mut checked = 0;
    for t in tools {
        let name = t["name"].as_str().unwrap();
        // The listed schema is compact: nothing a model does not need.
        let schema = t["inputSchema"].as_object().unwrap();
        assert!(!schema.contains_key("$schema"), "{name}: {schema:?}");
        let no_params = serde_json::Map::new();
        let props = schema.get("properties").and_then(Value::as_object);
        for (param, p) in props.unwrap_or(&no_params) {
            let d = p["description"].as_str().unwrap_or_default();
            assert!(
                d.len() >= 8,
                "{name}.{param} needs a short description, has {d:?}"
            );
            assert!(p.get("format").is_none(), "{name}.{param}: {p}");
            checked += 1;
        }
    }
    // Every parameter of every default tool, the sync tools' 26 included.
    assert!(checked >= 70, "only {checked} parameters checked");

    // (tool, readOnly, destructive, idempotent, openWorld); None = not stated (the default:
    // for a tool that is not read-only, destructive).
    type Hints = (&'static str, Option<bool>, Option<bool>, Option<bool>, bool);
    let expected: [Hints; 17] = [
        ("list_sandboxes", Some(true), None, None, false),
        ("get_active_sandbox", Some(true), None, None, false),
        ("select_sandbox", None, Some(false), Some(true), false),
        ("exec_bash", None, Some(true), None, true),
        ("exec_bash_background", None, Some(true), None, true),
        ("check_background_task", Some(true), None, None, false),
        ("list_background_tasks", Some(true), None, None, false),
        ("kill_background_task", None, Some(true), Some(true), false),
        ("list_remote_files", Some(true), None, None, false),
        ("read_remote_file", Some(true), None, None, false),
        // An edit made twice is not the edit made once; a write is.
        ("edit_remote_file", None, Some(true), None, false),
        ("write_remote_file", None, Some(true), Some(true), false),
        ("search_remote_files", Some(true), None, None, false),
        // Upload may delete (delete_extras) and replace; a download replaces local files
        // (never deletes); running either again changes nothing more.
        ("sync_local_to_remote", None, Some(true), Some(true), false),
        ("sync_remote_to_local", None, None, Some(true), false),
        ("check_file_transfer_task", Some(true), None, None, false),
        (
            "cancel_file_transfer_task",
            None,
            Some(true),
            Some(true),
            false,
        ),
    ];
    assert_eq!(expected.len(), tools.len(), "a hint row per default tool");
    for (name, ro, destructive, idempotent, open) in expected {
        let t = tools.iter().find(|t| t["name"] == name).unwrap();
        let a = &t["annotations"];
        assert_eq!(a["readOnlyHint"].as_bool(), ro, "{name}: {a}");
        assert_eq!(a["destructiveHint"].as_bool(), destructive, "{name}: {a}");
        assert_eq!(a["idempotentHint"].as_bool(), idempotent, "{name}: {a}");
        assert_eq!(a["openWorldHint"].as_bool(), Some(open), "{name}: {a}");
    }
    // What parameters mean is said where a model looks for it.
    let desc = |tool: &str, param: &str| -> String {
        let t = tools.iter().find(|t| t["name"] == tool).unwrap();
        t["inputSchema"]["properties"][param]["description"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    assert!(desc("kill_background_task", "tmux_session").contains("Job name"));
    assert!(desc("list_remote_files", "remote_path").contains("$HOME"));
    assert!(desc("read_remote_file", "sandbox_name").contains("active sandbox"));
    assert!(desc("read_remote_file", "offset").contains("1-based"));
    assert!(desc("edit_remote_file", "expected_hash").contains("hash"));
    assert!(desc("write_remote_file", "expected_hash").contains("hash"));
    for tool in ["sync_local_to_remote", "sync_remote_to_local"] {
        assert!(desc(tool, "remote_path").contains("$HOME"), "{tool}");
        assert!(desc(tool, "local_path").contains("cwd"), "{tool}");
        assert!(desc(tool, "excludes").contains("gitignore"), "{tool}");
        assert!(desc(tool, "gitignore").contains(".gitignore"), "{tool}");
    }
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 7. read_remote_file
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_remote_file_text_binary_errors_and_limits() {
    let sshd = Sshd::start().unwrap();
    let h = sshd.home();
    std::fs::write(h.join("text.txt"), "hello\nwörld\n").unwrap();
    let bin: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    std::fs::write(h.join("bin.dat"), &bin).unwrap();
    std::fs::write(h.join("nul.txt"), "abc\0def").unwrap();
    std::fs::write(h.join("a.txt"), "a\n").unwrap();
    std::fs::write(h.join("ten.txt"), "0123456789").unwrap();
    std::fs::write(h.join("e.txt"), "é").unwrap();
    std::fs::write(h.join("empty.txt"), "").unwrap();
    std::fs::create_dir_all(h.join("adir")).unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    let p = |n: &str| h.join(n).display().to_string();

    let v = mcp
        .ok("read_remote_file", json!({"remote_path": p("text.txt")}))
        .await;
    assert_eq!(v["content"], "hello\nwörld\n");
    assert_eq!(v["size"], 13);
    assert_eq!(v["truncated"], false);
    assert!(v.get("encoding").is_none(), "{v}");
    let v = mcp
        .ok("read_remote_file", json!({"remote_path": "~/text.txt"}))
        .await;
    assert_eq!(v["content"], "hello\nwörld\n");

    // Binary: base64, decodes to the exact bytes.
    let v = mcp
        .ok("read_remote_file", json!({"remote_path": p("bin.dat")}))
        .await;
    assert_eq!(v["encoding"], "base64", "{v}");
    let got = base64::engine::general_purpose::STANDARD
        .decode(v["content"].as_str().unwrap())
        .unwrap();
    assert_eq!(got, bin);
    assert_eq!(v["size"], bin.len());
    assert_eq!(v["truncated"], false);
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": p("bin.dat"), "max_bytes": 300}),
        )
        .await;
    let got = base64::engine::general_purpose::STANDARD
        .decode(v["content"].as_str().unwrap())
        .unwrap();
    assert_eq!(got, bin[..300]);
    assert_eq!(v["truncated"], true);

    // Valid UTF-8 with a NUL byte is binary to a model: base64, said so by `encoding`.
    let v = mcp
        .ok("read_remote_file", json!({"remote_path": p("nul.txt")}))
        .await;
    assert_eq!(v["encoding"], "base64", "{v}");
    assert_eq!(v["content"], "YWJjAGRlZg==", "{v}");
    assert_eq!(v["returned_bytes"], 7, "{v}");

    // max_bytes is exact; size is the file's size.
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": p("a.txt"), "max_bytes": 1}),
        )
        .await;
    assert_eq!(v["content"], "a");
    assert_eq!(v["truncated"], true);
    assert_eq!(v["size"], 2);
    for (max, content, truncated) in [
        (10, "0123456789", false),
        (11, "0123456789", false),
        (9, "012345678", true),
    ] {
        let v = mcp
            .ok(
                "read_remote_file",
                json!({"remote_path": p("ten.txt"), "max_bytes": max}),
            )
            .await;
        assert_eq!(v["content"], content, "max_bytes={max}");
        assert_eq!(v["truncated"], truncated, "max_bytes={max}");
        assert_eq!(v["size"], 10);
    }
    // A multi-byte char cut by max_bytes is dropped, not mangled or base64'd.
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": p("e.txt"), "max_bytes": 1}),
        )
        .await;
    assert_eq!(v["content"], "", "{v}");
    assert_eq!(v["truncated"], true);
    assert!(v.get("encoding").is_none(), "{v}");
    let v = mcp
        .ok("read_remote_file", json!({"remote_path": p("empty.txt")}))
        .await;
    assert_eq!(v["size"], 0);
    assert_eq!(v["truncated"], false);

    // Clear errors, never a hang (a FIFO with no writer).
    let st = std::process::Command::new("mkfifo")
        .arg(h.join("fifo"))
        .status()
        .unwrap();
    assert!(st.success());
    let t = Instant::now();
    let r = mcp
        .err("read_remote_file", json!({"remote_path": p("fifo")}))
        .await;
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(!r.s("error").is_empty(), "{}", r.text);
    let r = mcp
        .err("read_remote_file", json!({"remote_path": p("missing.txt")}))
        .await;
    assert!(r.s("error").contains("missing.txt"), "{}", r.text);
    assert!(!r.s("hint").is_empty());
    let r = mcp
        .err("read_remote_file", json!({"remote_path": p("adir")}))
        .await;
    assert!(
        r.s("error").to_lowercase().contains("directory"),
        "{}",
        r.text
    );
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 8. list_remote_files
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_remote_files_limits_and_paths() {
    let sshd = Sshd::start().unwrap();
    let h = sshd.home();
    let deep = h.join("deep");
    let mut d = deep.clone();
    for i in 0..6 {
        d = d.join(format!("d{i}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("f.txt"), "x").unwrap();
    }
    let three = h.join("three");
    std::fs::create_dir_all(three.join("sub")).unwrap();
    std::fs::write(three.join("a.txt"), "ab").unwrap();
    std::fs::write(three.join("b.txt"), "").unwrap();
    std::fs::create_dir_all(h.join("emptydir")).unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    let ds = |p: &Path| p.display().to_string();

    // Recursive: exactly max_entries of a deep tree (the seed returned 6 for 5).
    let v = mcp
        .ok(
            "list_remote_files",
            json!({"remote_path": ds(&deep), "recursive": true, "max_entries": 5}),
        )
        .await;
    assert_eq!(v["entries"].as_array().unwrap().len(), 5, "{v}");
    assert_eq!(v["truncated"], true);
    let v = mcp
        .ok(
            "list_remote_files",
            json!({"remote_path": ds(&deep), "recursive": true}),
        )
        .await;
    assert_eq!(v["entries"].as_array().unwrap().len(), 12, "{v}");
    assert_eq!(v["truncated"], false);

    // Exactly N entries with max N: not truncated (the seed said truncated).
    for recursive in [false, true] {
        let v = mcp
            .ok(
                "list_remote_files",
                json!({"remote_path": ds(&three), "recursive": recursive, "max_entries": 3}),
            )
            .await;
        assert_eq!(v["entries"].as_array().unwrap().len(), 3, "{v}");
        assert_eq!(v["truncated"], false, "recursive={recursive}: {v}");
        let v = mcp
            .ok(
                "list_remote_files",
                json!({"remote_path": ds(&three), "recursive": recursive, "max_entries": 2}),
            )
            .await;
        assert_eq!(v["entries"].as_array().unwrap().len(), 2, "{v}");
        assert_eq!(v["truncated"], true, "{v}");
    }

    // Entry shape and paths.
    let v = mcp
        .ok("list_remote_files", json!({"remote_path": ds(&three)}))
        .await;
    let entries = v["entries"].as_array().unwrap();
    let a = entries
        .iter()
        .find(|e| e["path"] == format!("{}/a.txt", three.display()))
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(a["is_dir"], false);
    assert_eq!(a["size"], 2);
    assert!(a["mtime"].is_i64() || a["mtime"].is_u64(), "{a}");
    let sub = entries
        .iter()
        .find(|e| e["path"] == format!("{}/sub", three.display()))
        .unwrap();
    assert_eq!(sub["is_dir"], true);

    // `~` and `~/x` list with absolute paths.
    let v = mcp
        .ok("list_remote_files", json!({"remote_path": "~"}))
        .await;
    let hs = home(&sshd);
    let paths: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert!(paths.contains(&format!("{hs}/three").as_str()), "{paths:?}");
    assert!(
        paths.iter().all(|p| p.starts_with(&format!("{hs}/"))),
        "{paths:?}"
    );
    let v = mcp
        .ok("list_remote_files", json!({"remote_path": "~/three"}))
        .await;
    assert!(
        v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["path"] == format!("{hs}/three/a.txt")),
        "{v}"
    );

    let v = mcp
        .ok(
            "list_remote_files",
            json!({"remote_path": ds(&h.join("emptydir"))}),
        )
        .await;
    assert_eq!(v["truncated"], false);
    assert!(
        v.get("entries")
            .is_none_or(|e| e.as_array().unwrap().is_empty()),
        "{v}"
    );
    let r = mcp
        .err(
            "list_remote_files",
            json!({"remote_path": ds(&h.join("nope"))}),
        )
        .await;
    assert!(r.s("error").contains("nope"), "{}", r.text);
    let r = mcp
        .err(
            "list_remote_files",
            json!({"remote_path": ds(&three.join("a.txt"))}),
        )
        .await;
    assert!(!r.s("error").is_empty(), "{}", r.text);
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 9. Hostile and malformed input
// ---------------------------------------------------------------------------------------------

/// What a row of the bad-input table must produce.
enum Want {
    /// `isError: true`, a one-line `error` containing this (case-insensitive).
    Err(&'static str),
    /// `isError: true` or a JSON-RPC error (e.g. an unknown tool name).
    AnyErr,
    /// A correct result: `key` equals `value`.
    Ok(&'static str, Value),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_table() {
    let sshd = Sshd::start().unwrap();
    let h = sshd.home();
    std::fs::create_dir_all(h.join("d")).unwrap();
    std::fs::write(h.join("b.txt"), "B").unwrap();
    std::fs::write(h.join("q'\"x.txt"), "Q").unwrap();
    let hs = home(&sshd);
    let mut entries = vec![key_entry("s", &sshd), dead_entry("dead", closed_port())];
    let pw = sshd.password_user();
    if let Some((u, p)) = &pw {
        entries.push(pw_entry("pw", &sshd, u, p));
    }
    let mcp = Mcp::start(&list(&entries)).await;
    let mut secrets = vec![FAKE_SECRET.to_string()];
    if let Some((_, p)) = &pw {
        secrets.push(p.clone());
    }
    let secrets: Vec<&str> = secrets.iter().map(String::as_str).collect();
    let e = |tool: &'static str, args: Value, want: &'static str| (tool, args, Want::Err(want));

    #[rustfmt::skip]
    let rows: Vec<(&str, Value, Want)> = vec![
        // Limits: negative, zero, huge, wrong type.
        e("exec_bash", json!({"command": "true", "timeout_s": -1}), "timeout_s"),
        e("exec_bash", json!({"command": "true", "timeout_s": 0}), "timeout_s"),
        e("exec_bash", json!({"command": "true", "timeout_s": 10_000_000_000i64}), "timeout_s"),
        e("exec_bash", json!({"command": "true", "timeout_s": 1e30}), "timeout_s"),
        e("exec_bash", json!({"command": "true", "timeout_s": u64::MAX}), "timeout_s"),
        e("exec_bash", json!({"command": "true", "timeout_s": "abc"}), "timeout_s"),
        e("exec_bash", json!({"command": "true", "max_output_chars": 0}), "max_output_chars"),
        e("exec_bash", json!({"command": "true", "max_output_chars": -5}), "max_output_chars"),
        e("exec_bash", json!({"command": "true", "max_output_chars": 1i64 << 40}), "max_output_chars"),
        e("list_remote_files", json!({"remote_path": "~", "max_entries": 0}), "max_entries"),
        e("list_remote_files", json!({"remote_path": "~", "max_entries": -1}), "max_entries"),
        e("list_remote_files", json!({"remote_path": "~", "max_entries": 1i64 << 40}), "max_entries"),
        e("read_remote_file", json!({"remote_path": "~/b.txt", "max_bytes": 0}), "max_bytes"),
        e("read_remote_file", json!({"remote_path": "~/b.txt", "max_bytes": -1}), "max_bytes"),
        e("read_remote_file", json!({"remote_path": "~/b.txt", "max_bytes": 1i64 << 50}), "max_bytes"),
        e("check_background_task", json!({"tmux_session": "x", "last_n_lines": 0}), "last_n_lines"),
        // Commands.
        e("exec_bash", json!({"command": ""}), "command"),
        e("exec_bash", json!({"command": " \n\t "}), "command"),
        e("exec_bash", json!({"command": "echo a\u{0}b"}), "nul"),
        e("exec_bash", json!({}), "command"),
        e("exec_bash", json!({"command": 5}), "command"),
        // Paths.
        e("read_remote_file", json!({"remote_path": ""}), "remote_path"),
        e("list_remote_files", json!({"remote_path": "  "}), "remote_path"),
        e("read_remote_file", json!({"remote_path": "~/b\u{0}.txt"}), "nul"),
        e("read_remote_file", json!({"remote_path": "~/no\nsuch\nfile"}), "no"),
        e("read_remote_file", json!({"remote_path": "~/no'such\"file"}), "no"),
        e("read_remote_file", json!({"remote_path": "~/d"}), "directory"),
        e("read_remote_file", json!({"remote_path": "~/../../../../../../nonexistent-rsb/../x"}), "x"),
        e("exec_bash", json!({"command": "pwd", "cwd": "/tmp\n/etc"}), "cwd"),
        e("exec_bash", json!({"command": "pwd", "cwd": "/tmp'\"; id"}), "tmp"),
        // Unknown/extra arguments, unknown names.
        e("exec_bash", json!({"command": "true", "bogus": 1}), "bogus"),
        e("list_sandboxes", json!({"check_resources": "yes"}), "check_resources"),
        e("exec_bash", json!({"command": "true", "sandbox_name": "../s"}), "available"),
        e("select_sandbox", json!({"sandbox_name": " s"}), "s"),
        e("exec_bash", json!({"command": "true", "sandbox_name": "dead"}), ""),
        // Jobs.
        e("exec_bash_background", json!({"command": "true", "session_name": "a.b"}), "a.b"),
        e("exec_bash_background", json!({"command": "   "}), "command"),
        e("exec_bash_background", json!({"command": "true", "interval_s": 0}), "interval_s"),
        e("exec_bash_background", json!({"command": "true", "metadata_json": "[1]"}), "metadata_json"),
        e("check_background_task", json!({}), "tmux_session"),
        e("check_background_task", json!({"watch_id": 99999}), "99999"),
        e("kill_background_task", json!({"tmux_session": "x", "grace_s": -1}), "grace_s"),
        e("check_file_transfer_task", json!({"task_id": "abc"}), "task_id"),
        e("sync_local_to_remote", json!({"delete_extras": "yes"}), "delete_extras"),
        ("no_such_tool", json!({}), Want::AnyErr),
        // Legitimate but odd: a correct result, never a different file.
        ("read_remote_file", json!({"remote_path": "~/d/../b.txt"}), Want::Ok("content", json!("B"))),
        ("read_remote_file", json!({"remote_path": format!("{hs}/d/../d/../b.txt")}), Want::Ok("content", json!("B"))),
        ("read_remote_file", json!({"remote_path": "~/q'\"x.txt"}), Want::Ok("content", json!("Q"))),
        ("exec_bash", json!({"command": "pwd", "cwd": "~/d/.."}), Want::Ok("stdout", json!(format!("{hs}\n")))),
        ("exec_bash", json!({"command": "echo \"$1\" '$(id)'"}), Want::Ok("stdout", json!(" $(id)\n"))),
        ("list_remote_files", json!({"remote_path": "~/d/.."}), Want::Ok("truncated", json!(false))),
    ];
    let n_err = rows.iter().filter(|r| !matches!(r.2, Want::Ok(..))).count();
    assert!(n_err >= 20, "the table needs at least 20 error rows");
    println!("bad-input table: {} rows ({n_err} errors)", rows.len());

    let mut all = String::new();
    for (tool, args, want) in rows {
        let r = mcp.try_call(tool, args.clone()).await;
        let row = format!("{tool}({args})");
        match (want, r) {
            (Want::AnyErr, Err(e)) => {
                println!("  ok  {row} -> protocol error: {e}");
                all.push_str(&e);
            }
            (Want::AnyErr, Ok(r)) => {
                assert!(r.is_error, "{row} should fail: {}", r.text);
                all.push_str(&r.text);
            }
            (Want::Err(needle), r) => {
                let r =
                    r.unwrap_or_else(|e| panic!("{row}: protocol error instead of isError: {e}"));
                assert!(r.is_error, "{row} should be isError: {}", r.text);
                // Domain errors are JSON {"error","hint"}; argument errors from rmcp are text.
                let msg = if r.v.is_object() {
                    assert!(r.v["hint"].is_string(), "{row}: no hint: {}", r.text);
                    r.s("error").to_string()
                } else {
                    r.text.clone()
                };
                assert!(!msg.trim().is_empty(), "{row}: empty error");
                assert!(!msg.contains('\n'), "{row}: multi-line error: {msg:?}");
                assert!(
                    msg.to_lowercase().contains(&needle.to_lowercase()),
                    "{row}: error should mention {needle:?}: {msg}"
                );
                println!("  ok  {row} -> {msg}");
                all.push_str(&r.text);
            }
            (Want::Ok(key, value), r) => {
                let r = r.unwrap_or_else(|e| panic!("{row}: protocol error: {e}"));
                assert!(!r.is_error, "{row} should succeed: {}", r.text);
                assert_eq!(r.v[key], value, "{row}: {}", r.text);
                println!("  ok  {row} -> {key} = {value}");
                all.push_str(&r.text);
            }
        }
    }
    // Nothing was created by the hostile cwd, and the server is healthy.
    let v = mcp.ok("exec_bash", json!({"command": "echo alive"})).await;
    assert_eq!(v["stdout"], "alive\n");
    let v = mcp.ok("list_sandboxes", json!({})).await;
    all.push_str(&v.to_string());
    assert_no_secret("replies", &all, &secrets);
    let log = mcp.close().await;
    assert_no_secret("the server log", &log, &secrets);
}

/// A malformed `REMOTE_SANDBOX_LIST` holding a password: the server still starts, every tool
/// replies `isError` with a config error, and the password appears nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_sandbox_list_never_leaks_the_password() {
    let bad = format!(r#"[{{"name":"x","host":"h","user":"u","password":"{FAKE_SECRET}""#);
    let also_bad = format!(
        r#"[{{"name":"x","host":"h","user":"u","password":"{FAKE_SECRET}","port":"p{FAKE_SECRET}"}}]"#
    );
    for list in [bad, also_bad] {
        let mcp = Mcp::start(&list).await;
        let tools = mcp.svc.list_all_tools().await.unwrap();
        assert_eq!(
            tools.len(),
            DEFAULT_TOOLS.len(),
            "the tools are still listed"
        );
        let mut all = String::new();
        // The config error comes before any argument check, so `{}` is enough.
        for tool in DEFAULT_TOOLS {
            let r = mcp.err(tool, json!({})).await;
            let msg = r.s("error");
            assert!(
                msg.contains("REMOTE_SANDBOX_LIST") && !msg.contains('\n'),
                "{tool}: {}",
                r.text
            );
            all.push_str(&r.text);
        }
        // list_sandboxes also carries the seed's diagnostics (which variables are set).
        let r = mcp.err("list_sandboxes", json!({}));
        let r = r.await;
        let v: Value = serde_json::from_str(&r.text).unwrap();
        assert_eq!(
            v["diagnostics"]["REMOTE_SANDBOX_LIST_set"], true,
            "{}",
            r.text
        );
        assert_eq!(v["diagnostics"]["REMOTE_HOST_set"], false, "{}", r.text);
        assert_eq!(v["sandboxes"], json!([]), "{}", r.text);
        all.push_str(&r.text);
        let first = all.split("}{").next().unwrap_or_default();
        println!("config error reply: {first}}}");
        assert_no_secret("replies", &all, &[FAKE_SECRET]);
        let log = mcp.close().await;
        assert_no_secret("the server log", &log, &[FAKE_SECRET]);
    }
}

/// Issue 26, item 1: a typo'd `REMOTE_HOSTNAME` (no config file) used to serve the built-in
/// `local` sandbox without a word, so the model's `exec_bash` ran on the user's workstation.
/// Now every call answers with the configuration error, and a genuine `local` (nothing
/// configured at all) is marked as this machine in the listing, the instructions and the
/// session's first reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misconfigured_environment_never_runs_commands_here() {
    let marker = tempfile::tempdir().unwrap();
    let touched = marker.path().join("ran-here");
    let cmd = format!("touch {}", touched.display());
    for vars in [
        vec![("REMOTE_HOSTNAME", "127.0.0.1")],
        vec![("REMOTE_HOST", "")],
        vec![("REMOTE_USER", "me")],
    ] {
        let mcp = Mcp::start_env(&vars).await;
        let r = mcp.err("exec_bash", json!({"command": cmd})).await;
        assert!(r.s("error").contains(vars[0].0), "{vars:?}: {}", r.text);
        if vars[0].0 == "REMOTE_HOSTNAME" {
            assert!(
                r.s("hint").contains("did you mean REMOTE_HOST?"),
                "{}",
                r.text
            );
        }
        let r = mcp.err("list_sandboxes", json!({})).await;
        assert_eq!(r.v["sandboxes"], json!([]), "{}", r.text);
        assert!(
            !touched.exists(),
            "{vars:?}: the command ran on this machine"
        );
        mcp.close().await;
    }

    // Nothing configured: `local` it is, and every surface says it is this machine.
    let mcp = Mcp::start_env(&[]).await;
    let info = mcp.svc.peer_info().expect("initialize result");
    let instructions = info.instructions.clone().unwrap_or_default();
    assert!(
        instructions.contains("`local` is THIS machine"),
        "{instructions}"
    );
    let first = mcp.ok("get_active_sandbox", json!({})).await;
    assert!(
        first["notice"]
            .as_str()
            .unwrap_or_default()
            .contains("THIS machine"),
        "the first reply says so: {first}"
    );
    assert_eq!(first["this_machine"], true, "{first}");
    let list = mcp.ok("list_sandboxes", json!({})).await;
    let row = &list["sandboxes"][0];
    assert_eq!(row["name"], "local", "{list}");
    assert_eq!(row["this_machine"], true, "{list}");
    assert!(
        row["note"]
            .as_str()
            .unwrap_or_default()
            .starts_with("this machine"),
        "{list}"
    );
    assert!(
        list.get("notice").is_none(),
        "only the first reply carries the notice: {list}"
    );
    // Item 10: relative paths on `local` mean $HOME, as on a remote sandbox, not the
    // server's own working directory.
    let v = mcp
        .ok("exec_bash", json!({"command": "pwd; echo $HOME"}))
        .await;
    let out = v["stdout"].as_str().unwrap_or_default().to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{v}");
    assert_eq!(lines[0], lines[1], "local runs in $HOME: {v}");
    mcp.close().await;
}

/// Issue 26, item 7: a port that accepts TCP and never speaks SSH held every `list_sandboxes`
/// (and `select_sandbox("auto")`) for the whole connect timeout (15 s by default). Now a probe
/// waits a short deadline of its own (not `connect_timeout_s`), probes of several sandboxes run
/// at once, and a failure is remembered for a while, with its reason in the row, naming
/// `connect_timeout_s` (issue 42 item 1: every listing probes, as the seed's did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_host_slows_only_the_first_listing() {
    let sshd = Sshd::start().unwrap();
    // Accepts connections and holds them, silent (bounded: 16 connections, the test's lifetime).
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = hung.local_addr().unwrap().port();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let h2 = held.clone();
    std::thread::spawn(move || {
        for s in hung.incoming().take(16).flatten() {
            h2.lock().unwrap().push(s);
        }
    });
    let dials = || held.lock().unwrap().len();
    // Two hung sandboxes with the default connect_timeout_s (15 s): probed one after the other,
    // or each for its connect timeout, they would hold the first probing listing for 30 s.
    let hung_entry = |name: &str| {
        json!({"name": name, "host": "127.0.0.1", "port": port, "user": "nobody",
               "key_file": sshd.client_key().display().to_string()})
    };
    let entries = vec![
        key_entry("live", &sshd),
        hung_entry("hung"),
        hung_entry("hung2"),
    ];
    let mcp = Mcp::start(&list(&entries)).await;
    let row = |v: &Value, n: &str| {
        v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == n)
            .cloned()
            .unwrap()
    };

    // The first listing probes every sandbox (the seed's contract: connection_alive is each
    // one's health), all at once, each within the short probe deadline: the live one is up,
    // both hung hosts are down within one deadline, not two connect timeouts.
    let t = Instant::now();
    let v = mcp.ok("list_sandboxes", json!({})).await;
    let took = t.elapsed();
    println!("first listing: {took:?}: {v}");
    assert!(took < Duration::from_secs(8), "took {took:?}: {v}");
    assert!(dials() >= 2, "the hung hosts were probed: {v}");
    assert_eq!(row(&v, "live")["connection_alive"], true, "{v}");
    assert!(row(&v, "live")["resources"].is_null(), "{v}");
    for n in ["hung", "hung2"] {
        let r = row(&v, n);
        assert_eq!(r["connection_alive"], false, "{v}");
        assert!(
            r["connection_error"]
                .as_str()
                .unwrap()
                .contains("connect_timeout_s"),
            "{v}"
        );
    }

    // Later: the live row from its pooled connection, the hung ones from memory; all at once.
    for (tool, args) in [
        ("list_sandboxes", json!({})),
        ("list_sandboxes", json!({"check_resources": true})),
        ("select_sandbox", json!({"sandbox_name": "auto"})),
        ("get_active_sandbox", json!({})),
    ] {
        let t = Instant::now();
        let v = mcp.ok(tool, args.clone()).await;
        let took = t.elapsed();
        println!("{tool}({args}) again: {took:?}");
        assert!(
            took < Duration::from_millis(1500),
            "{tool}({args}) took {took:?}: {v}"
        );
        if tool == "list_sandboxes" {
            assert_eq!(row(&v, "live")["connection_alive"], true, "{v}");
            if args["check_resources"] == true {
                assert!(
                    row(&v, "live")["resources"]["idle_score"].is_number(),
                    "{v}"
                );
            }
            let e = row(&v, "hung")["connection_error"]
                .as_str()
                .unwrap()
                .to_string();
            assert!(
                e.contains("remembered") && e.contains("connect_timeout_s"),
                "{v}"
            );
        } else {
            assert_eq!(v["active_sandbox"], "live", "{v}");
        }
    }
    // The active sandbox on a hung host: get_active_sandbox answers from memory too.
    mcp.ok("select_sandbox", json!({"sandbox_name": "hung"}))
        .await;
    let t = Instant::now();
    let v = mcp.ok("get_active_sandbox", json!({})).await;
    assert!(t.elapsed() < Duration::from_millis(1500), "{v}");
    assert_eq!(v["connection_alive"], false, "{v}");

    // `rsb sandboxes` is the health check, one process per run with nothing to remember: it
    // probes every sandbox, in parallel, each within the same short deadline, so two hung
    // hosts cost one deadline, not two connect timeouts.
    let home = mcp._tmp.path().join("home");
    let mut c = std::process::Command::new(rsb_bin());
    c.args(["--json", "sandboxes"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("XDG_DATA_HOME", home.join(".local/share"))
        .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
        .env("RSB_STATE_DIR", mcp._tmp.path().join("cli-state"))
        .env("REMOTE_SANDBOX_LIST", list(&entries));
    let t = Instant::now();
    let o = rsb_tests::output_with_timeout(&mut c, Duration::from_secs(60)).unwrap();
    let took = t.elapsed();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    println!("rsb sandboxes with two hung hosts: {took:?}");
    // Two sandboxes down: the health check fails (exit 3), after the listing.
    assert_eq!(o.status.code(), Some(3), "{out}");
    assert!(took < Duration::from_secs(8), "took {took:?}: {out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(row(&v, "live")["connection_alive"], true, "{v}");
    for n in ["hung", "hung2"] {
        let r = row(&v, n);
        assert_eq!(r["connection_alive"], false, "{v}");
        assert!(
            r["connection_error"]
                .as_str()
                .unwrap()
                .contains("connect_timeout_s"),
            "{v}"
        );
    }
    mcp.close().await;
}

/// Issue 42 item 1: `list_sandboxes` says every sandbox is up when it is, on the first call; a
/// sandbox whose sshd is stopped (SIGSTOP: it accepts TCP and never answers) is down within
/// the probe deadline, and the next listing does not wait on it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_sandboxes_reports_each_sandboxs_health_on_the_first_call() {
    let live: Vec<Sshd> = (0..3).map(|_| Sshd::start().unwrap()).collect();
    let stopped = Sshd::start().unwrap();
    let mut entries: Vec<Value> = live
        .iter()
        .enumerate()
        .map(|(i, s)| key_entry(&format!("live{i}"), s))
        .collect();
    let mcp = Mcp::start(&list(&entries)).await;
    let t = Instant::now();
    let v = mcp.ok("list_sandboxes", json!({})).await;
    println!("3 live, first listing: {:?}", t.elapsed());
    for r in v["sandboxes"].as_array().unwrap() {
        assert_eq!(r["connection_alive"], true, "{v}");
        assert!(r["connection_error"].is_null(), "{v}");
    }
    let v = mcp.ok("get_active_sandbox", json!({})).await;
    assert_eq!(v["connection_alive"], true, "{v}");
    mcp.close().await;

    // A fourth whose sshd is stopped.
    entries.push(key_entry("stopped", &stopped));
    let pid = stopped.pid().expect("the fixture's sshd pid") as i32;
    struct Cont(i32);
    impl Drop for Cont {
        fn drop(&mut self) {
            // SAFETY: a signal to the test's own sshd.
            unsafe { libc::kill(self.0, libc::SIGCONT) };
        }
    }
    // SAFETY: a signal to the test's own sshd; resumed by `_cont` however the test ends.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let _cont = Cont(pid);
    let mcp = Mcp::start(&list(&entries)).await;
    let t = Instant::now();
    let v = mcp.ok("list_sandboxes", json!({})).await;
    let first = t.elapsed();
    let t = Instant::now();
    let v2 = mcp.ok("list_sandboxes", json!({})).await;
    let second = t.elapsed();
    println!("3 live + 1 stopped: first {first:?}, second {second:?}");
    for v in [&v, &v2] {
        for r in v["sandboxes"].as_array().unwrap() {
            let up = r["name"] != "stopped";
            assert_eq!(r["connection_alive"], up, "{v}");
        }
    }
    assert!(
        first <= Duration::from_millis(6500),
        "first listing {first:?}: {v}"
    );
    assert!(
        second <= Duration::from_millis(100),
        "second listing {second:?}: {v2}"
    );
    mcp.close().await;
}

/// Issue 26, item 9: a client that strips the environment (Codex passes only `HOME, PATH, SHELL,
/// LANG, TERM` and its `env_vars`) starts a server without `SSH_AUTH_SOCK` or `RSB_STATE_DIR`,
/// while `rsb doctor` in the user's shell has both and says all is well. Now the server records
/// the names (never values) of the variables that steer it and its paths, and doctor names the
/// differences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_names_how_the_servers_environment_differs() {
    let list = list(&[dead_entry("dead", closed_port())]);
    // As Codex starts it: no SSH_AUTH_SOCK; and a state dir of its own.
    let mcp = Mcp::start(&list).await;
    let home = mcp._tmp.path().join("home");
    let server_state = mcp._tmp.path().join("state");
    mcp.ok("get_active_sandbox", json!({})).await;
    let doctor = |state: &Path, agent: Option<&Path>| {
        let mut c = std::process::Command::new(rsb_bin());
        c.arg("doctor")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
            .env("RSB_STATE_DIR", state)
            .env("REMOTE_SANDBOX_LIST", &list);
        if let Some(a) = agent {
            c.env("SSH_AUTH_SOCK", a);
        }
        let o = rsb_tests::output_with_timeout(&mut c, Duration::from_secs(60)).unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        println!("rsb doctor:\n{out}");
        out
    };
    // The user's shell: an ssh-agent, and another state dir.
    let agent = mcp._tmp.path().join("agent.sock");
    let shell_state = mcp._tmp.path().join("shell-state");
    let out = doctor(&shell_state, Some(&agent));
    let line = out
        .lines()
        .find(|l| l.contains("mcp env") && l.starts_with("warn"))
        .unwrap_or_else(|| panic!("no mcp env warning:\n{out}"));
    assert!(line.contains("without SSH_AUTH_SOCK"), "{line}");
    assert!(line.contains("another state dir"), "{line}");
    assert!(line.contains(&server_state.display().to_string()), "{line}");
    // The same environment as the server's: no warning about it.
    let out = doctor(&server_state, None);
    assert!(
        out.lines().any(|l| l.contains("mcp env")
            && l.starts_with("ok")
            && l.contains("has this environment")),
        "{out}"
    );
    // Names and paths only: no value of any variable is recorded.
    for dir in [server_state.clone(), home.join(".local/share/rsb")] {
        let rec = std::fs::read_to_string(dir.join("mcp-env.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert!(rec.contains("REMOTE_SANDBOX_LIST"), "{rec}");
        assert_no_secret(
            "the recorded environment",
            &rec,
            &[FAKE_SECRET, "127.0.0.1"],
        );
    }
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 10. Reconnect
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_the_connection_is_dropped() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    let v = mcp.ok("exec_bash", json!({"command": "echo one"})).await;
    assert_eq!(v["stdout"], "one\n");

    sshd.kill_sessions();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let v = mcp.ok("exec_bash", json!({"command": "echo two"})).await;
    assert_eq!(v["stdout"], "two\n");
    let v = mcp.ok("get_active_sandbox", json!({})).await;
    assert_eq!(v["connection_alive"], true, "{v}");

    // Dropped mid-command: a clear connection error, then the next call works again.
    let call = mcp.call("exec_bash", json!({"command": "echo before; sleep 5"}));
    let kill = async {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        sshd.kill_sessions();
    };
    let (r, ()) = tokio::join!(call, kill);
    assert!(r.is_error, "{}", r.text);
    assert_eq!(r.v["connection_error"], true, "{}", r.text);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let v = mcp.ok("exec_bash", json!({"command": "echo three"})).await;
    assert_eq!(v["stdout"], "three\n");
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// 10. Reading by lines, editing and writing (issue 24)
// ---------------------------------------------------------------------------------------------

/// The content hash every read reply carries: blake3, first 16 bytes, hex.
fn content_hash(data: &[u8]) -> String {
    blake3::hash(data).as_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn mode_of(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_remote_file_by_lines_with_numbers_and_hash() {
    let sshd = Sshd::start().unwrap();
    let h = sshd.home();
    let ten: String = (1..=10).map(|i| format!("line {i}\n")).collect();
    std::fs::write(h.join("ten.txt"), &ten).unwrap();
    std::fs::write(h.join("crlf.txt"), "a\r\nb\r\nc").unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;

    // The seed's byte form keeps its keys and gains the hash.
    let v = mcp
        .ok("read_remote_file", json!({"remote_path": "~/ten.txt"}))
        .await;
    assert_eq!(v["content"], ten.as_str());
    assert_eq!(v["hash"], content_hash(ten.as_bytes()), "{v}");
    assert!(v.get("first_line").is_none(), "{v}");
    assert!(v.get("next").is_none(), "{v}");
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "max_bytes": 3}),
        )
        .await;
    assert_eq!(v["content"], "lin");
    assert_eq!(
        v["hash"],
        content_hash(ten.as_bytes()),
        "the whole file's hash: {v}"
    );
    // A truncated read says how to read on (issue 41, item 8); a whole one does not.
    assert!(
        v["next"].as_str().unwrap().contains("offset=1 continues"),
        "{v}"
    );

    // By lines: offset is 1-based, limit counts lines, the reply says where it is.
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "offset": 3, "limit": 2}),
        )
        .await;
    assert_eq!(v["content"], "line 3\nline 4\n", "{v}");
    assert_eq!(
        (
            &v["first_line"],
            &v["lines"],
            &v["total_lines"],
            &v["truncated"]
        ),
        (&json!(3), &json!(2), &json!(10), &json!(true)),
        "{v}"
    );
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "offset": 9, "numbered": true}),
        )
        .await;
    assert_eq!(v["content"], "     9\tline 9\n    10\tline 10\n", "{v}");
    assert_eq!(v["truncated"], false, "{v}");
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "numbered": true, "limit": 1}),
        )
        .await;
    assert_eq!(v["content"], "     1\tline 1\n", "{v}");
    // max_bytes still caps a line read, at a line boundary.
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "offset": 1, "max_bytes": 10}),
        )
        .await;
    assert_eq!(v["content"], "line 1\n", "{v}");
    assert_eq!(v["truncated"], true, "{v}");
    assert!(
        v["next"].as_str().unwrap().contains("offset=2 continues"),
        "{v}"
    );
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "offset": 2, "limit": 1}),
        )
        .await;
    assert_eq!(v["content"], "line 2\n", "{v}");
    assert!(
        v["next"].as_str().unwrap().contains("offset=3 continues"),
        "{v}"
    );
    // A job name that does not exist is not a path (issue 41, item 8).
    let r = mcp
        .err(
            "kill_background_task",
            json!({"tmux_session": "no-such-job"}),
        )
        .await;
    assert!(r.s("hint").contains("list_background_tasks"), "{}", r.text);
    assert!(!r.s("hint").contains("path"), "{}", r.text);
    // Past the end: nothing, and nothing more.
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "offset": 11}),
        )
        .await;
    assert_eq!(
        (&v["content"], &v["truncated"]),
        (&json!(""), &json!(false))
    );
    // CRLF lines and a last line without a newline come back as they are.
    let v = mcp
        .ok(
            "read_remote_file",
            json!({"remote_path": "~/crlf.txt", "offset": 2}),
        )
        .await;
    assert_eq!(v["content"], "b\r\nc", "{v}");
    assert_eq!(v["total_lines"], 3, "{v}");

    let r = mcp
        .err(
            "read_remote_file",
            json!({"remote_path": "~/ten.txt", "offset": -1}),
        )
        .await;
    assert!(r.s("error").contains("offset"), "{}", r.text);
    mcp.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edit_remote_file_contract() {
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().to_path_buf();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd), key_entry("t", &sshd)])).await;
    let f = h.join("code.rs");
    let src = "fn main() {\n    let x = 1;\n    println!(\"{x}\");\n}\n";
    std::fs::write(&f, src).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o751)).unwrap();
    }
    let edit = |args: Value| {
        let mut a = json!({"remote_path": "~/code.rs"});
        a.as_object_mut()
            .unwrap()
            .extend(args.as_object().unwrap().clone());
        a
    };

    // Unique: replaced in place, mode kept, hash/lines/diff replied.
    let v = mcp
        .ok(
            "edit_remote_file",
            edit(json!({"old_string": "let x = 1;", "new_string": "let x = 2;\n    let y = 3;"})),
        )
        .await;
    let now = std::fs::read_to_string(&f).unwrap();
    assert_eq!(
        now,
        "fn main() {\n    let x = 2;\n    let y = 3;\n    println!(\"{x}\");\n}\n"
    );
    assert_eq!(v["hash"], content_hash(now.as_bytes()), "{v}");
    assert_eq!(v["replacements"], 1, "{v}");
    assert_eq!(v["changed_lines"], json!(["2-3"]), "{v}");
    assert_eq!(
        v["diff"],
        "@@ -1,4 +1,5 @@\n fn main() {\n-    let x = 1;\n+    let x = 2;\n+    let y = 3;\n     println!(\"{x}\");\n }\n",
        "{v}"
    );
    assert_eq!(mode_of(&f), 0o751);
    let hash_now = v["hash"].as_str().unwrap().to_string();

    // Ambiguous: the count, and nothing written; replace_all then replaces each.
    std::fs::write(&f, "a = 1\na = 1\na = 1\n").unwrap();
    let r = mcp
        .err(
            "edit_remote_file",
            edit(json!({"old_string": "a = 1", "new_string": "b"})),
        )
        .await;
    assert!(r.s("error").contains("occurs 3 times"), "{}", r.text);
    assert!(r.s("hint").contains("replace_all"), "{}", r.text);
    assert_eq!(
        std::fs::read_to_string(&f).unwrap(),
        "a = 1\na = 1\na = 1\n"
    );
    let v = mcp
        .ok(
            "edit_remote_file",
            edit(json!({"old_string": "a = 1", "new_string": "b", "replace_all": true})),
        )
        .await;
    assert_eq!(v["replacements"], 3, "{v}");
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "b\nb\nb\n");

    // Missing, and a near miss in indentation: the hint names the line and its number.
    std::fs::write(&f, src).unwrap();
    let r = mcp
        .err(
            "edit_remote_file",
            edit(json!({"old_string": "qqq zzz", "new_string": "x"})),
        )
        .await;
    assert!(r.s("error").contains("not found"), "{}", r.text);
    let r = mcp
        .err(
            "edit_remote_file",
            edit(json!({"old_string": "let x = 1;\nprintln!(\"{x}\");", "new_string": "x"})),
        )
        .await;
    assert!(r.s("hint").contains("line 2:"), "{}", r.text);
    assert!(r.s("hint").contains("    let x = 1;"), "{}", r.text);
    assert_eq!(std::fs::read_to_string(&f).unwrap(), src);

    // A precondition that no longer holds writes nothing and names the current hash.
    let stale = content_hash(src.as_bytes());
    std::fs::write(&f, "changed under us\n").unwrap();
    let r = mcp
        .err(
            "edit_remote_file",
            edit(json!({"old_string": "changed", "new_string": "x", "expected_hash": stale})),
        )
        .await;
    let current = content_hash(b"changed under us\n");
    assert!(r.s("error").contains(&current), "{}", r.text);
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "changed under us\n");
    assert_ne!(hash_now, current);
    let v = mcp
        .ok(
            "edit_remote_file",
            edit(
                json!({"old_string": "changed", "new_string": "edited", "expected_hash": current}),
            ),
        )
        .await;
    assert_eq!(v["hash"], content_hash(b"edited under us\n"), "{v}");

    // CRLF and a missing trailing newline are kept, even for an old_string written with \n.
    std::fs::write(h.join("crlf.txt"), "one\r\ntwo\r\nthree").unwrap();
    mcp.ok(
        "edit_remote_file",
        json!({"remote_path": "~/crlf.txt", "old_string": "one\ntwo", "new_string": "1\n2"}),
    )
    .await;
    assert_eq!(
        std::fs::read(h.join("crlf.txt")).unwrap(),
        b"1\r\n2\r\nthree"
    );

    // Not UTF-8: refused clearly, untouched.
    std::fs::write(h.join("latin1.txt"), b"caf\xe9\n").unwrap();
    let r = mcp
        .err(
            "edit_remote_file",
            json!({"remote_path": "~/latin1.txt", "old_string": "caf", "new_string": "x"}),
        )
        .await;
    assert!(r.s("error").contains("not UTF-8"), "{}", r.text);
    assert!(r.s("hint").contains("content_base64"), "{}", r.text);
    assert_eq!(std::fs::read(h.join("latin1.txt")).unwrap(), b"caf\xe9\n");

    // Through a symlink: the target changes, the link stays a link.
    std::fs::create_dir_all(h.join("real")).unwrap();
    std::fs::write(h.join("real/t.txt"), "target\n").unwrap();
    std::os::unix::fs::symlink("real/t.txt", h.join("link.txt")).unwrap();
    let v = mcp
        .ok(
            "edit_remote_file",
            json!({"remote_path": "~/link.txt", "old_string": "target", "new_string": "edited"}),
        )
        .await;
    assert!(v["path"].as_str().unwrap().ends_with("real/t.txt"), "{v}");
    assert!(
        std::fs::symlink_metadata(h.join("link.txt"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(
        std::fs::read_to_string(h.join("real/t.txt")).unwrap(),
        "edited\n"
    );

    // Bad input: one line and a hint each.
    for (args, want) in [
        (json!({"old_string": "", "new_string": "x"}), "old_string"),
        (json!({"old_string": "a", "new_string": "a"}), "equals"),
        (
            json!({"old_string": "a", "new_string": "b", "expected_hash": "xyz"}),
            "32 hex",
        ),
    ] {
        let r = mcp.err("edit_remote_file", edit(args)).await;
        assert!(r.s("error").contains(want), "{}", r.text);
        assert!(!r.s("hint").is_empty(), "{}", r.text);
    }
    let r = mcp
        .err(
            "edit_remote_file",
            json!({"remote_path": "~/nope.txt", "old_string": "a", "new_string": "b"}),
        )
        .await;
    assert!(r.s("error").contains("nope.txt"), "{}", r.text);

    // Two edits at once with the same expected hash, through two agents (sandboxes s and t
    // are two channels, two agents) and through one: exactly one wins, the other is told.
    // The file is large enough (8 MiB) that reading, hashing and staging it takes the agent
    // milliseconds, so without the lock both edits would read the old file and both succeed.
    let filler = "x".repeat(8 << 20);
    for round in 0..6 {
        let body = format!("round {round}\n{filler}");
        std::fs::write(&f, &body).unwrap();
        let hash = content_hash(body.as_bytes());
        let (s1, s2) = if round % 2 == 0 {
            ("s", "t")
        } else {
            ("s", "s")
        };
        let a = json!({"remote_path": "~/code.rs", "old_string": "round", "new_string": "A",
                       "expected_hash": hash, "sandbox_name": s1});
        let b = json!({"remote_path": "~/code.rs", "old_string": "round", "new_string": "B",
                       "expected_hash": hash, "sandbox_name": s2});
        let (ra, rb) = tokio::join!(
            mcp.call("edit_remote_file", a),
            mcp.call("edit_remote_file", b)
        );
        assert!(
            ra.is_error != rb.is_error,
            "round {round}: exactly one must win: {} / {}",
            ra.text,
            rb.text
        );
        let (won, lost) = if ra.is_error { (&rb, &ra) } else { (&ra, &rb) };
        let now = std::fs::read_to_string(&f).unwrap();
        assert_eq!(won.s("hash"), content_hash(now.as_bytes()));
        assert!(lost.s("error").contains("changed since"), "{}", lost.text);
        assert!(lost.s("error").contains(won.s("hash")), "{}", lost.text);
    }
    mcp.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edit_and_write_report_permission_denied() {
    use std::os::unix::fs::PermissionsExt;
    let sshd = Sshd::start().unwrap();
    // As root the check needs another user: the fixture's password user, on files root owns.
    let is_root = unsafe { libc::geteuid() } == 0;
    let (entry, dir) = if is_root {
        let Some((u, p)) = sshd.password_user() else {
            println!("SKIP: root without the fixture's password user");
            return;
        };
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        (pw_entry("s", &sshd, &u, &p), d)
    } else {
        (
            key_entry("s", &sshd),
            tempfile::tempdir_in(sshd.home()).unwrap(),
        )
    };
    let f = dir.path().join("ro.txt");
    std::fs::write(&f, "keep\n").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o444)).unwrap();
    if !is_root {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    }
    let mcp = Mcp::start(&list(&[entry])).await;
    let path = f.display().to_string();
    let r = mcp
        .err(
            "edit_remote_file",
            json!({"remote_path": path, "old_string": "keep", "new_string": "x"}),
        )
        .await;
    assert!(r.s("error").contains("permission denied"), "{}", r.text);
    assert!(r.s("error").contains("ro.txt"), "{}", r.text);
    let r = mcp
        .err(
            "write_remote_file",
            json!({"remote_path": dir.path().join("new.txt").display().to_string(), "content": "x"}),
        )
        .await;
    assert!(r.s("error").contains("permission denied"), "{}", r.text);
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "keep\n");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    mcp.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_remote_file_is_atomic_and_conditional() {
    use std::os::unix::fs::PermissionsExt;
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().to_path_buf();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;

    // A new file (parents made on request) gets the umask's mode; the reply names its hash.
    let v = mcp
        .ok(
            "write_remote_file",
            json!({"remote_path": "~/new/dir/a.txt", "content": "hi\n", "make_dirs": true}),
        )
        .await;
    assert_eq!(
        std::fs::read_to_string(h.join("new/dir/a.txt")).unwrap(),
        "hi\n"
    );
    assert_eq!(v["hash"], content_hash(b"hi\n"), "{v}");
    assert_eq!(v["created"], true, "{v}");
    assert_eq!(mode_of(&h.join("new/dir/a.txt")) & 0o600, 0o600);
    let r = mcp
        .err(
            "write_remote_file",
            json!({"remote_path": "~/missing/a.txt", "content": "hi\n"}),
        )
        .await;
    assert!(r.s("error").contains("missing"), "{}", r.text);
    assert!(r.s("hint").contains("make_dirs: true"), "{}", r.text);

    // Bytes, create_only, expected_hash; an existing file's mode is kept.
    let f = h.join("w.bin");
    std::fs::write(&f, b"old").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
    let r = mcp
        .err(
            "write_remote_file",
            json!({"remote_path": "~/w.bin", "content": "x", "create_only": true}),
        )
        .await;
    assert!(r.s("error").contains("already exists"), "{}", r.text);
    let r = mcp
        .err(
            "write_remote_file",
            json!({"remote_path": "~/w.bin", "content": "x", "expected_hash": content_hash(b"other")}),
        )
        .await;
    assert!(r.s("error").contains(&content_hash(b"old")), "{}", r.text);
    assert_eq!(std::fs::read(&f).unwrap(), b"old");
    let bytes: Vec<u8> = (0..=255u8).collect();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
    mcp.ok(
        "write_remote_file",
        json!({"remote_path": "~/w.bin", "content_base64": b64, "expected_hash": content_hash(b"old")}),
    )
    .await;
    assert_eq!(std::fs::read(&f).unwrap(), bytes);
    assert_eq!(mode_of(&f), 0o640);

    // FIFOs, directories and both/neither content forms are refused.
    assert!(
        std::process::Command::new("mkfifo")
            .arg(h.join("fifo"))
            .status()
            .unwrap()
            .success()
    );
    let r = mcp
        .err(
            "write_remote_file",
            json!({"remote_path": "~/fifo", "content": "x"}),
        )
        .await;
    assert!(r.s("error").contains("fifo"), "{}", r.text);
    let r = mcp
        .err(
            "write_remote_file",
            json!({"remote_path": "~/new", "content": "x"}),
        )
        .await;
    assert!(r.s("error").contains("directory"), "{}", r.text);
    let r = mcp
        .err(
            "write_remote_file",
            json!({"remote_path": "~/w.bin", "content": "x", "content_base64": "eA=="}),
        )
        .await;
    assert!(r.s("error").contains("exactly one"), "{}", r.text);

    // A reader polling the file while it is rewritten never sees a partial file: each read is
    // one whole version (1 MiB of a single byte).
    let big = h.join("big.txt");
    let version = |c: u8| vec![c; 1 << 20];
    std::fs::write(&big, version(b'a')).unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (done, big) = (done.clone(), big.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut reads = 0;
            while !done.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(120) {
                let d = std::fs::read(&big).unwrap();
                assert_eq!(d.len(), 1 << 20, "a partial file after {reads} reads");
                assert!(
                    d.iter().all(|&b| b == d[0]),
                    "a mixed file after {reads} reads"
                );
                reads += 1;
            }
            reads
        })
    };
    for i in 0..20u8 {
        let c = b'a' + (i % 26);
        let text = String::from_utf8(version(c)).unwrap();
        mcp.ok(
            "write_remote_file",
            json!({"remote_path": "~/big.txt", "content": text}),
        )
        .await;
    }
    done.store(true, Ordering::SeqCst);
    let reads = reader.join().unwrap();
    assert!(reads > 20, "the reader ran only {reads} times");
    mcp.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_patch_checks_every_hunk_before_writing() {
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().to_path_buf();
    let mcp = Mcp::start_with(
        &list(&[key_entry("s", &sshd)]),
        &[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1")],
    )
    .await;
    let files = [
        ("p/a.rs", "fn a() {\n    1\n}\n"),
        ("p/b.rs", "fn b() {\n    2\n}\n"),
        ("p/c.rs", "fn c() {\n    3\n}\n"),
    ];
    std::fs::create_dir_all(h.join("p")).unwrap();
    for (p, t) in files {
        std::fs::write(h.join(p), t).unwrap();
    }
    let patch = |c_old: &str| {
        format!(
            "*** Begin Patch\n*** Update File: p/a.rs\n@@ fn a() {{\n-    1\n+    10\n*** Update File: p/b.rs\n-    2\n+    20\n*** Update File: p/c.rs\n-    {c_old}\n+    30\n*** End Patch\n"
        )
    };
    // One bad hunk (c.rs has no "    4"): no file changes, and the error names file and hunk.
    let r = mcp.err("apply_patch", json!({"patch": patch("4")})).await;
    assert!(r.s("error").contains("hunk 1 of ~/p/c.rs"), "{}", r.text);
    assert!(r.s("error").contains("no file was changed"), "{}", r.text);
    for (p, t) in files {
        assert_eq!(
            std::fs::read_to_string(h.join(p)).unwrap(),
            t,
            "{p} changed"
        );
    }
    // The good patch changes all three; add, move and delete in one more.
    let v = mcp.ok("apply_patch", json!({"patch": patch("3")})).await;
    assert_eq!(v["files"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(
        std::fs::read_to_string(h.join("p/a.rs")).unwrap(),
        "fn a() {\n    10\n}\n"
    );
    assert_eq!(
        std::fs::read_to_string(h.join("p/c.rs")).unwrap(),
        "fn c() {\n    30\n}\n"
    );
    assert_eq!(
        v["files"][2]["hash"],
        content_hash(b"fn c() {\n    30\n}\n"),
        "{v}"
    );
    mcp.ok(
        "apply_patch",
        json!({"patch": "*** Begin Patch\n*** Add File: p/new.txt\n+new\n*** Update File: p/b.rs\n*** Move to: p/moved.rs\n-    20\n+    21\n*** Delete File: p/a.rs\n*** End Patch"}),
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(h.join("p/new.txt")).unwrap(),
        "new\n"
    );
    assert_eq!(
        std::fs::read_to_string(h.join("p/moved.rs")).unwrap(),
        "fn b() {\n    21\n}\n"
    );
    assert!(!h.join("p/b.rs").exists() && !h.join("p/a.rs").exists());
    // A malformed patch names its line.
    let r = mcp
        .err(
            "apply_patch",
            json!({"patch": "*** Begin Patch\n*** Update File: p/c.rs\n?x\n*** End Patch"}),
        )
        .await;
    assert!(r.s("error").contains("line 3"), "{}", r.text);
    mcp.close().await;
}

/// Issue 42 item 2: patches Codex applies, rsb applies. Add and Move into directories that do
/// not exist yet; padded markers and hunk headers; a hunk ending in a blank line before the
/// next one (retried without it); ASCII quotes and dashes against typographic ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_patch_takes_what_codex_takes() {
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().to_path_buf();
    let mcp = Mcp::start_with(
        &list(&[key_entry("s", &sshd)]),
        &[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1")],
    )
    .await;
    let d = unique("codex");
    std::fs::create_dir_all(h.join(&d)).unwrap();
    std::fs::write(
        h.join(format!("{d}/doc.md")),
        "# Title\n\nIt\u{2019}s \u{201C}fine\u{201D} \u{2014} really.\n\nend\n",
    )
    .unwrap();
    std::fs::write(
        h.join(format!("{d}/lib.py")),
        "def f():\n    return 1\n\ndef g():\n    return 2\n",
    )
    .unwrap();
    let patch = format!(
        " *** Begin Patch \n\
         *** Add File: {d}/pkg/sub/new.py \n\
         +x = 1\n\
         *** Update File: {d}/doc.md\n\
         *** Move to: {d}/docs/guide/doc.md\n\
         @@ # Title\n\
         -It's \"fine\" - really.\n\
         +It is fine.\n\
         *** Update File: {d}/lib.py\n  \
         @@  def f():  \n\
         -    return 1\n\
         +    return 10\n\
         \n\
         @@ def g():\n\
         -    return 2\n\
         +    return 20\n\
         \x20*** End Patch \n"
    );
    let v = mcp.ok("apply_patch", json!({"patch": patch})).await;
    assert_eq!(v["files"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(
        std::fs::read_to_string(h.join(format!("{d}/pkg/sub/new.py"))).unwrap(),
        "x = 1\n"
    );
    assert_eq!(
        std::fs::read_to_string(h.join(format!("{d}/docs/guide/doc.md"))).unwrap(),
        "# Title\n\nIt is fine.\n\nend\n"
    );
    assert!(!h.join(format!("{d}/doc.md")).exists());
    assert_eq!(
        std::fs::read_to_string(h.join(format!("{d}/lib.py"))).unwrap(),
        "def f():\n    return 10\n\ndef g():\n    return 20\n"
    );
    // A patch that cannot apply leaves no directory it would have made.
    let r = mcp
        .err(
            "apply_patch",
            json!({"patch": format!("*** Begin Patch\n*** Add File: {d}/made/here/x.txt\n+x\n*** Update File: {d}/lib.py\n-nothing like this\n+y\n*** End Patch\n")}),
        )
        .await;
    assert!(r.s("error").contains("no file was changed"), "{}", r.text);
    assert!(!h.join(format!("{d}/made")).exists());
    mcp.close().await;
}

/// Issue 42 item 3: an edit keeps the file what it was. A file with another hard link, or an
/// extended attribute, is written in place (both names see the change, the attribute stays,
/// `in_place: true`); a plain file is replaced by an atomic rename (`in_place` absent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_keep_hard_links_and_extended_attributes() {
    use std::os::unix::fs::MetadataExt;
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().join(unique("ident"));
    std::fs::create_dir_all(&h).unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    std::fs::write(h.join("a.txt"), "one\n").unwrap();
    std::fs::hard_link(h.join("a.txt"), h.join("b.txt")).unwrap();
    let ino = std::fs::metadata(h.join("a.txt")).unwrap().ino();
    let v = mcp
        .ok(
            "edit_remote_file",
            json!({"remote_path": h.join("a.txt").display().to_string(), "old_string": "one", "new_string": "ONE"}),
        )
        .await;
    assert_eq!(v["in_place"], true, "{v}");
    let m = std::fs::metadata(h.join("a.txt")).unwrap();
    assert_eq!((m.nlink(), m.ino()), (2, ino), "{v}");
    assert_eq!(std::fs::read_to_string(h.join("b.txt")).unwrap(), "ONE\n");

    std::fs::write(h.join("x.txt"), "one\n").unwrap();
    let x = h.join("x.txt");
    // rustix spells setxattr(2) for Linux and macOS alike (macOS adds a position argument).
    if rustix::fs::setxattr(&x, "user.rsb", b"kept", rustix::fs::XattrFlags::empty()).is_ok() {
        let v = mcp
            .ok(
                "write_remote_file",
                json!({"remote_path": h.join("x.txt").display().to_string(), "content": "two\n"}),
            )
            .await;
        assert_eq!(v["in_place"], true, "{v}");
        let mut buf = [0u8; 16];
        let n = rustix::fs::getxattr(&x, "user.rsb", &mut buf[..]).unwrap_or(0);
        assert_eq!(&buf[..n], b"kept", "the attribute survives the write");
        assert_eq!(std::fs::read_to_string(h.join("x.txt")).unwrap(), "two\n");
    } else {
        eprintln!("the file system has no user attributes: that part skipped");
    }

    std::fs::write(h.join("p.txt"), "one\n").unwrap();
    let ino = std::fs::metadata(h.join("p.txt")).unwrap().ino();
    let v = mcp
        .ok(
            "edit_remote_file",
            json!({"remote_path": h.join("p.txt").display().to_string(), "old_string": "one", "new_string": "two"}),
        )
        .await;
    assert!(v["in_place"].is_null(), "{v}");
    assert_ne!(
        std::fs::metadata(h.join("p.txt")).unwrap().ino(),
        ino,
        "replaced"
    );
    mcp.close().await;
}

/// A patch that could not finish does not start: a Delete this user may not do (a directory
/// that is not theirs) is refused before the Update before it writes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_patch_checks_removals_before_the_first_write() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root, for a second user");
        return;
    }
    let sshd = Sshd::start().unwrap();
    let Some((user, pw)) = sshd.password_user() else {
        eprintln!("skipped: the fixture has no password user");
        return;
    };
    let (uid, gid) = sshd.password_user_ids().unwrap();
    let mine = sshd.password_home().unwrap().join(unique("pc"));
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("a.txt"), "one\n").unwrap();
    for p in [&mine, &mine.join("a.txt")] {
        std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
    }
    // Root's directory, readable by all, writable by root alone.
    let theirs = tempfile::Builder::new()
        .prefix("rsb-pc-")
        .tempdir_in("/tmp")
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(theirs.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // The file itself is writable by all: only its directory forbids removing it.
    std::fs::write(theirs.path().join("r.txt"), "root's\n").unwrap();
    std::fs::set_permissions(
        theirs.path().join("r.txt"),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    let mcp = Mcp::start_with(
        &list(&[pw_entry("p", &sshd, &user, &pw)]),
        &[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1")],
    )
    .await;
    let patch = format!(
        "*** Begin Patch\n*** Update File: {}\n-one\n+ONE\n*** Delete File: {}\n*** End Patch\n",
        mine.join("a.txt").display(),
        theirs.path().join("r.txt").display()
    );
    let r = mcp.err("apply_patch", json!({"patch": patch})).await;
    assert!(
        r.s("error").contains("permission denied") && r.s("error").contains("no file was changed"),
        "{}",
        r.text
    );
    // Found by the check before any write (a failure while writing would be rolled back).
    assert!(
        r.s("error").contains("r.txt") && r.s("error").contains("its directory does not let"),
        "{}",
        r.text
    );
    assert_eq!(
        std::fs::read_to_string(mine.join("a.txt")).unwrap(),
        "one\n"
    );
    assert!(theirs.path().join("r.txt").exists());
    let left: Vec<_> = std::fs::read_dir(&mine)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        left,
        [std::ffi::OsString::from("a.txt")],
        "nothing staged or kept is left"
    );
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// search_remote_files
// ---------------------------------------------------------------------------------------------

/// A tree with everything ripgrep decides about: nested `.gitignore`s with a `!` re-include,
/// `.ignore`, `.git`, `node_modules`, hidden files, binary and oversized files, CRLF lines, a
/// non-UTF-8 name, a symlink, and a few hundred ordinary files.
fn search_tree(root: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let w = |rel: &str, text: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    w(".git/HEAD", b"ref: needle\n");
    w(".gitignore", b"*.log\nbuild/\nnode_modules/\n!keep.log\n");
    w("sub/.gitignore", b"secret.txt\n");
    w("sub/secret.txt", b"needle hidden by sub/.gitignore\n");
    w(
        "sub/a.py",
        b"import os\nneedle = 1\n\nprint(needle)  # needle twice\n",
    );
    w("node_modules/pkg/index.js", b"needle in node_modules\n");
    w("build/out.txt", b"needle in build\n");
    w("app.log", b"needle in a log\n");
    w("keep.log", b"needle in the kept log\n");
    w(".hidden.txt", b"needle hidden\n");
    w(".config/x.txt", b"needle in a hidden dir\n");
    w(".ignore", b"by_dot_ignore.txt\n");
    w("by_dot_ignore.txt", b"needle\n");
    w("binary.bin", b"needle\0\x01\x02needle\n");
    w("crlf.txt", b"needle first\r\nsecond\r\nthird NEEDLE\r\n");
    w("noeol.txt", b"no newline at the end: needle");
    w("a.txt", b"needle at the top\n");
    w("a/b.txt", b"needle below a\n");
    let big = "needle in a large file\n".repeat(800_000); // ~18 MB > the 16 MiB cap
    w("big.txt", big.as_bytes());
    std::fs::write(
        root.join(std::ffi::OsStr::from_bytes(b"caf\xe9.txt")),
        b"needle in a latin-1 name\n",
    )
    .unwrap();
    std::os::unix::fs::symlink("sub/a.py", root.join("link.py")).unwrap();
    for i in 0..300u64 {
        let mut text = rsb_tests_gen(i);
        if i % 3 == 0 {
            text.push_str(&format!("line with needle {i}\nand neeedle {i}\n"));
        }
        w(&format!("src/m{}/f{i}.rs", i % 7), text.as_bytes());
    }
}

/// Deterministic text for the search tree (a few lines per file).
fn rsb_tests_gen(seed: u64) -> String {
    (0..(seed % 5 + 2))
        .map(|k| format!("fn f{seed}_{k}() {{ let x = {}; }}\n", seed * 31 + k))
        .collect()
}

/// What `rg` prints for the same query, run in `home/proj` (ripgrep anchors `-g` globs at its
/// cwd; search anchors them at `remote_path`), with `proj/` put before each path, `\r`
/// dropped before line ends (search replies strip it) and names read lossily.
fn rg_lines(home: &std::path::Path, args: &[&str]) -> Vec<String> {
    rg_lines_in(home, "proj", args)
}

/// rg run in `home/rel` (the search's root as its working directory, the way rg applies
/// its parents' anchored ignore patterns), its paths given from `home`.
fn rg_lines_in(home: &std::path::Path, rel: &str, args: &[&str]) -> Vec<String> {
    let out = std::process::Command::new("rg")
        .current_dir(home.join(rel))
        .args([
            "--no-config",
            "--no-heading",
            "--color",
            "never",
            "--max-filesize",
            "16M",
            "--sort",
            "path",
        ])
        .args(args)
        .output()
        .expect("rg is installed (.ci/run installs ripgrep)");
    assert!(out.status.code().unwrap_or(9) <= 1, "rg failed: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .replace("\r\n", "\n")
        .lines()
        .map(|l| {
            if l == "--" {
                l.to_string()
            } else {
                format!("{rel}/{l}")
            }
        })
        .collect()
}

/// The page's lines without the "N more" marker.
fn page_lines(v: &Value) -> Vec<String> {
    v["output"]
        .as_str()
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('['))
        .map(String::from)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_finds_exactly_what_rg_finds() {
    let sshd = Sshd::start().unwrap();
    let home = sshd.home().to_path_buf();
    search_tree(&home.join("proj"));
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    let cases: Vec<(Value, Vec<&str>)> = vec![
        (json!({"pattern": "needle"}), vec!["-n", "needle"]),
        (json!({"pattern": "ne+dle\\b"}), vec!["-n", "ne+dle\\b"]),
        (
            json!({"pattern": "NEEDLE", "ignore_case": true}),
            vec!["-n", "-i", "NEEDLE"],
        ),
        (
            json!({"pattern": "_1() { let", "literal": true}),
            vec!["-n", "-F", "_1() { let"],
        ),
        (
            json!({"pattern": "needle", "glob": "*.py"}),
            vec!["-n", "-g", "*.py", "needle"],
        ),
        (
            json!({"pattern": "needle", "glob": "!*.txt !src/**"}),
            vec!["-n", "-g", "!*.txt", "-g", "!src/**", "needle"],
        ),
        (
            json!({"pattern": "needle", "glob": "*.{py,log}"}),
            vec!["-n", "-g", "*.{py,log}", "needle"],
        ),
        (
            json!({"pattern": "needle", "no_ignore": true}),
            vec!["-n", "--no-ignore", "needle"],
        ),
        (
            json!({"pattern": "needle", "output_mode": "files_with_matches"}),
            vec!["-l", "needle"],
        ),
        (
            json!({"pattern": "needle", "output_mode": "count"}),
            vec!["-c", "needle"],
        ),
        (
            json!({"pattern": "needle", "context": 1, "glob": "!src/**"}),
            vec!["-n", "-C", "1", "-g", "!src/**", "needle"],
        ),
        (json!({"pattern": "fn f1\\d_"}), vec!["-n", "fn f1\\d_"]),
    ];
    for (mut args, rg_args) in cases {
        args["remote_path"] = json!("proj");
        args["head_limit"] = json!(5000);
        let v = mcp.ok("search_remote_files", args.clone()).await;
        let want = rg_lines(&home, &rg_args);
        assert!(!want.is_empty(), "rg found nothing for {rg_args:?}");
        assert_eq!(page_lines(&v), want, "search {args} vs rg {rg_args:?}");
        assert_eq!(v["more"], 0, "{args}");
        assert_eq!(v["complete"], true, "{args}");
        if args.get("context").is_none() {
            assert_eq!(v["total"], want.len() as u64, "{args}");
        }
    }
    // The binary and the oversized file were met and skipped, and said so.
    let v = mcp
        .ok(
            "search_remote_files",
            json!({"pattern": "needle", "remote_path": "proj"}),
        )
        .await;
    assert_eq!(v["skipped_binary"], 1, "{v}");
    assert_eq!(v["skipped_large"], 1, "{v}");
    // A file as the root, and errors with a hint.
    let v = mcp
        .ok(
            "search_remote_files",
            json!({"pattern": "needle", "remote_path": "proj/sub/a.py"}),
        )
        .await;
    assert_eq!(
        page_lines(&v),
        [
            "proj/sub/a.py:2:needle = 1",
            "proj/sub/a.py:4:print(needle)  # needle twice"
        ]
    );
    for (args, words) in [
        (json!({"pattern": "(unclosed"}), "invalid regex"),
        (json!({"pattern": "a\\nb"}), "line break"),
        (
            json!({"pattern": "x", "remote_path": "no/such/dir"}),
            "No such file",
        ),
        (
            json!({"pattern": "x", "output_mode": "lines"}),
            "output_mode",
        ),
        (json!({"pattern": "x", "head_limit": 0}), "head_limit"),
    ] {
        let r = mcp.err("search_remote_files", args.clone()).await;
        assert!(r.s("error").contains(words), "{args}: {}", r.text);
        assert!(!r.s("hint").is_empty(), "{args}: {}", r.text);
    }
    mcp.close().await;
}

/// The walk's less common paths against rg: a repository nested below a root that is in none
/// (its `.gitignore` and `.git/info/exclude` apply inside it only; a `.gitignore` outside any
/// repository does not), `.rgignore`, and files deeper than the walk keeps directories open
/// (70 levels: files there are opened by path, not relative to a directory descriptor).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_of_nested_repos_rgignore_and_deep_dirs_matches_rg() {
    let sshd = Sshd::start().unwrap();
    let home = sshd.home().to_path_buf();
    let root = home.join("proj");
    let w = |rel: &str, text: &str| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    w(".gitignore", "notgit.txt\n");
    w(
        "notgit.txt",
        "needle: a .gitignore outside a repository does not apply\n",
    );
    w(".rgignore", "rg_only.txt\n");
    w("rg_only.txt", "needle hidden by .rgignore\n");
    w("inner/.git/HEAD", "ref: x\n");
    w("inner/.git/info/exclude", "excluded.txt\n");
    w("inner/.gitignore", "gen/\n");
    w("inner/gen/x.txt", "needle in an ignored dir\n");
    w("inner/excluded.txt", "needle excluded by info/exclude\n");
    w("inner/kept.txt", "needle kept\n");
    w(
        "inner/sub/notgit.txt",
        "needle: the outer .gitignore is not the repository's\n",
    );
    let mut deep = String::from("deep");
    for i in 0..70 {
        deep.push_str(&format!("/d{i}"));
        if (60..70).contains(&i) || i % 20 == 0 {
            w(&format!("{deep}/f.txt"), &format!("needle at depth {i}\n"));
        }
    }
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    for (mut args, rg_args) in [
        (json!({"pattern": "needle"}), vec!["-n", "needle"]),
        (
            json!({"pattern": "needle", "output_mode": "count"}),
            vec!["-c", "needle"],
        ),
        (
            json!({"pattern": "needle", "no_ignore": true}),
            vec!["-n", "--no-ignore", "needle"],
        ),
    ] {
        args["remote_path"] = json!("proj");
        args["head_limit"] = json!(5000);
        let v = mcp.ok("search_remote_files", args.clone()).await;
        let want = rg_lines(&home, &rg_args);
        assert!(
            want.iter().any(|l| l.contains("/d69/f.txt")),
            "rg reached the bottom: {want:?}"
        );
        assert_eq!(page_lines(&v), want, "search {args} vs rg {rg_args:?}");
        assert_eq!(v["complete"], true, "{args}");
    }
    mcp.close().await;
}

/// The root's parents' ignore files, as rg reads them: `.ignore` and `.rgignore` up to `/`
/// (anchored lines relative to their own directory), the git ones only from the repository's
/// top down, so a `.gitignore` above the repository does not reach into it, and outside any
/// repository none applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_applies_the_parents_ignore_files_as_rg_does() {
    let sshd = Sshd::start().unwrap();
    let home = sshd.home().to_path_buf();
    let w = |rel: &str, text: &str| {
        let p = home.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    w(
        "proj/.ignore",
        "ign_parent.txt\n/a/b/anch.txt\na/b/c/anch2.txt\n",
    );
    w("proj/.rgignore", "rg_parent.txt\n");
    w("proj/.gitignore", "git_above.txt\n");
    w("proj/a/.git/HEAD", "ref: x\n");
    w("proj/a/.gitignore", "git_top.txt\n/b/c/top_anch.txt\n");
    for f in [
        "ign_parent",
        "rg_parent",
        "git_above",
        "git_top",
        "kept",
        "anch",
        "c/ign_parent",
        "c/anch2",
        "c/top_anch",
        "c/anch",
    ] {
        w(&format!("proj/a/b/{f}.txt"), "needle\n");
    }
    for f in ["ign_parent", "rg_parent", "git_above", "kept"] {
        w(&format!("proj/z/{f}.txt"), "needle\n");
    }
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    for (root, want_kept) in [
        ("proj/a/b", &["git_above.txt", "kept.txt", "c/anch.txt"][..]),
        ("proj/z", &["git_above.txt", "kept.txt"][..]),
    ] {
        let args = json!({"pattern": "needle", "remote_path": root,
                          "output_mode": "files_with_matches", "head_limit": 100});
        let v = mcp.ok("search_remote_files", args).await;
        let want = rg_lines_in(&home, root, &["-l", "needle"]);
        assert_eq!(page_lines(&v), want, "search of {root} vs rg");
        let mut kept: Vec<String> = want_kept.iter().map(|f| format!("{root}/{f}")).collect();
        kept.sort();
        assert_eq!(want, kept, "what rg keeps at {root}");
    }
    mcp.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_pages_are_exact() {
    let sshd = Sshd::start().unwrap();
    let home = sshd.home().to_path_buf();
    search_tree(&home.join("proj"));
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    for mode in ["content", "files_with_matches", "count"] {
        let q = |offset: u64, limit: u64| {
            json!({"pattern": "needle", "remote_path": "proj", "output_mode": mode,
                   "offset": offset, "head_limit": limit})
        };
        let all = mcp.ok("search_remote_files", q(0, 5000)).await;
        let total = all["total"].as_u64().unwrap();
        assert!(total > 20, "{mode}: {all}");
        let mut paged = Vec::new();
        let mut offset = 0;
        // Bounded: at most total/7 + 1 pages.
        for _ in 0..=(total / 7 + 1) {
            let v = mcp.ok("search_remote_files", q(offset, 7)).await;
            assert_eq!(v["total"], total, "{mode}");
            let shown = v["shown"].as_u64().unwrap();
            assert_eq!(v["more"], total - offset - shown, "{mode} at {offset}");
            let out = v["output"].as_str().unwrap();
            if v["more"].as_u64().unwrap() > 0 {
                assert!(
                    out.ends_with(&format!(
                        "[{} more {}; offset={} continues]\n",
                        total - offset - shown,
                        if mode == "content" {
                            "matching lines"
                        } else {
                            "files"
                        },
                        offset + shown
                    )),
                    "{out}"
                );
            }
            paged.extend(page_lines(&v));
            offset += shown;
            if v["more"] == 0 {
                break;
            }
        }
        assert_eq!(offset, total, "{mode}");
        assert_eq!(paged, page_lines(&all), "{mode}");
    }
    mcp.close().await;
}

/// CPU ticks (user + system) of this fixture's `rsb-agent serve` processes: the ones whose
/// Send a cancellable search and return once the agent is busy with it (its CPU time grew by
/// more than 0.5 s in 1.5 s).
async fn busy_search(
    mcp: &Mcp,
    sshd: &Sshd,
    args: Value,
) -> rmcp::service::RequestHandle<rmcp::RoleClient> {
    let idle = agent_ticks(sshd.home());
    let handle = mcp
        .svc
        .peer()
        .send_cancellable_request(
            call_request("search_remote_files", args),
            PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let busy = agent_ticks(sshd.home());
    assert!(
        busy > idle + 50,
        "the search was not running: {idle} → {busy} ticks"
    );
    handle
}

/// `HOME` is the fixture's home, so other tests' agents are not counted.
fn agent_ticks(home: &Path) -> u64 {
    let want = format!("HOME={}", home.display());
    let mut total = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let p = e.path();
        let Ok(cmd) = std::fs::read(p.join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if !cmd.contains("rsb-agent") || !cmd.contains("serve") {
            continue;
        }
        let Ok(env) = std::fs::read(p.join("environ")) else {
            continue;
        };
        if !env.split(|b| *b == 0).any(|v| v == want.as_bytes()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(p.join("stat")) else {
            continue;
        };
        // Fields after the `(comm)`: utime and stime are the 12th and 13th.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after.split(' ').collect();
        total += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    total
}

/// A client's cancel stops a search of a 500k-file tree within 1 s: the agent's walk and
/// matcher threads stop (its CPU time stops growing), not just the reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_search_of_a_huge_tree_stops_within_a_second() {
    let sshd = Sshd::start().unwrap();
    // tmpfs, and hard links to one 16 KB file: 500k names cost ~100 MB of dentries, not disk.
    let base = if Path::new("/dev/shm").is_dir() {
        "/dev/shm"
    } else {
        "/tmp"
    };
    let tree = tempfile::Builder::new()
        .prefix("rsb-search-huge")
        .tempdir_in(base)
        .unwrap();
    let one = tree.path().join("one.txt");
    let line = "lorem ipsum dolor sit amet 12345 consectetur adipiscing\n";
    std::fs::write(&one, line.repeat(16 * 1024 / line.len())).unwrap();
    let t = Instant::now();
    for d in 0..500 {
        let dir = tree.path().join(format!("d{d}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..1000 {
            std::fs::hard_link(&one, dir.join(format!("f{f}.txt"))).unwrap();
        }
    }
    println!("500,000 links in {:?}", t.elapsed());
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    mcp.ok("exec_bash", json!({"command": "true"})).await;
    // No literal for the prefilter: every line goes through the regex, so the whole search
    // would take far longer than the test (it would end at the 30 s deadline).
    let args =
        json!({"pattern": "[a-c]{3}[0-9]{2}q", "remote_path": tree.path().display().to_string()});
    let handle = busy_search(&mcp, &sshd, args).await;
    handle.cancel(Some("test cancels".into())).await.unwrap();
    let cancelled = Instant::now();
    // Bounded: 30 samples of 100 ms.
    let mut last = agent_ticks(sshd.home());
    let mut stopped = None;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = agent_ticks(sshd.home());
        if now <= last + 1 {
            stopped = Some(cancelled.elapsed());
            break;
        }
        last = now;
    }
    let stopped = stopped.expect("the agent kept searching 3 s after the cancel");
    println!("search stopped {stopped:?} after the cancel");
    assert!(stopped <= Duration::from_secs(1), "{stopped:?}");
    // Still idle a second later, and the channel answers.
    let a = agent_ticks(sshd.home());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(agent_ticks(sshd.home()) <= a + 2, "the search resumed");
    let v = mcp.ok("exec_bash", json!({"command": "echo ok"})).await;
    assert_eq!(v["stdout"], "ok\n");
    mcp.close().await;
}

/// Issue 41, item 1, through MCP at default settings: a second `exec_bash_background` named
/// `train` answered `started` and the first run's log and exit code were gone. Now the reply
/// says how the earlier run ended and where its output is, a cursor read from 0 returns it,
/// the tail is the new run's, and a name in use by a running job is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_job_name_keeps_the_earlier_run_through_mcp() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    let name = unique("train");
    let v = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "echo CRASH-TRACEBACK; exit 1", "session_name": name}),
        )
        .await;
    assert!(v.get("previous_run").is_none(), "{v}");
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": name, "wait_s": 30}),
        )
        .await;
    assert_eq!(v["exit_code"], 1, "{v}");
    let marker = format!("second-run-{}", unique("m"));
    let v = mcp
        .ok(
            "exec_bash_background",
            json!({"command": format!("echo {marker}; sleep 60"), "session_name": name}),
        )
        .await;
    assert_eq!(v["previous_run"]["exit_code"], 1, "{v}");
    assert_eq!(v["previous_run"]["state"], "exited", "{v}");
    assert!(
        v["previous_run"]["command"]
            .as_str()
            .unwrap()
            .contains("CRASH"),
        "{v}"
    );
    let note = v["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("exited with code 1") && note.contains("offset=0"),
        "{v}"
    );
    let e = mcp
        .err(
            "exec_bash_background",
            json!({"command": "echo third", "session_name": name}),
        )
        .await;
    assert!(e.s("error").contains("already running"), "{}", e.text);
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": name, "wait_s": 10}),
        )
        .await;
    let tail = v["log_tail"].as_str().unwrap();
    assert!(tail.contains(&marker) && !tail.contains("CRASH"), "{v}");
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": name, "offset": 0}),
        )
        .await;
    let all = v["output"].as_str().unwrap();
    let (crash, second) = (all.find("CRASH-TRACEBACK"), all.find(&marker));
    assert!(
        matches!((crash, second), (Some(a), Some(b)) if a < b),
        "{v}"
    );
    assert!(
        all.contains("EXIT_CODE=1\n") && !all.contains("third"),
        "{v}"
    );
    mcp.ok("kill_background_task", json!({"tmux_session": name}))
        .await;
    mcp.close().await;
}

/// Issue 50: a 2 MiB one-line file (minified code) and a pattern with no literal to prefilter,
/// which regex-lite needs ~45 s for on that line and cannot be interrupted inside: the reply
/// still comes by the 30 s deadline + 1 s, marked incomplete; after a cancel the agent uses
/// under 0.5 s of CPU in the next 5 s; and an unbounded pattern that would take too long on
/// the line is refused for that line at once, in the counts and in one error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_of_one_huge_line_keeps_its_deadline_and_its_cancel() {
    let sshd = Sshd::start().unwrap();
    let dir = sshd.home().join(unique("longline"));
    std::fs::create_dir_all(&dir).unwrap();
    let letters: String = (0..2 << 20)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    std::fs::write(dir.join("min.js"), &letters).unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    mcp.ok("exec_bash", json!({"command": "true"})).await;
    let root = dir.display().to_string();
    let args = json!({"pattern": "(?:[a-z]{1,30}){1,30}[0-9]", "remote_path": root});

    // The deadline.
    let t = Instant::now();
    let v = mcp.ok("search_remote_files", args.clone()).await;
    let took = t.elapsed();
    println!("one 2 MiB line: reply after {took:?}: {v}");
    assert!(took <= Duration::from_secs(31), "{took:?}");
    assert_eq!(v["complete"], false, "{v}");
    assert!(v["output"].as_str().unwrap().contains("deadline"), "{v}");

    // The cancel.
    let handle = busy_search(&mcp, &sshd, args).await;
    handle.cancel(Some("test cancels".into())).await.unwrap();
    let at = agent_ticks(sshd.home());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let used = agent_ticks(sshd.home()) - at;
    println!("CPU in the 5 s after the cancel: {used} ticks");
    // Ticks are 1/100 s (USER_HZ).
    assert!(used < 50, "{used} ticks after the cancel");

    // Unbounded (`+`): the line is skipped after a short probe, and said so.
    let t = Instant::now();
    let v = mcp
        .ok(
            "search_remote_files",
            json!({"pattern": "(?:[a-z]{1,30}){1,30}[0-9]+", "remote_path": root}),
        )
        .await;
    println!("unbounded: {:?}: {v}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(v["skipped_slow_lines"], 1, "{v}");
    let errors = v["errors"].to_string();
    assert!(
        errors.contains("min.js: line 1 (2097152 bytes) not searched"),
        "{v}"
    );
    assert!(
        v["output"]
            .as_str()
            .unwrap()
            .contains("1 long line not searched"),
        "{v}"
    );
    mcp.close().await;
}

/// Every change through MCP is on the record (issue 23): writes, edits, patches (a refused
/// one too), forwards started and stopped, watch changes. Each line names the tool, the
/// sandbox and the path or target, and none holds the content that was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_change_is_audited_without_the_content() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start_with(
        &list(&[key_entry("s", &sshd)]),
        &[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1")],
    )
    .await;
    let body = "written-content-7Qx\n";
    mcp.ok(
        "write_remote_file",
        json!({"remote_path": "au/f.txt", "content": body, "make_dirs": true}),
    )
    .await;
    mcp.ok(
        "edit_remote_file",
        json!({"remote_path": "au/f.txt", "old_string": "7Qx", "new_string": "edited-content-9Zy"}),
    )
    .await;
    mcp.err(
        "edit_remote_file",
        json!({"remote_path": "au/f.txt", "old_string": "not there", "new_string": "x"}),
    )
    .await;
    mcp.ok(
        "apply_patch",
        json!({"patch": "*** Begin Patch\n*** Add File: au/g.txt\n+patched-content-3Kw\n*** End Patch\n"}),
    )
    .await;
    let f = mcp.ok("forward_port", json!({"remote_port": 9})).await;
    let id = f["forward_id"].as_u64().unwrap();
    mcp.ok("stop_forward", json!({"forward_id": id})).await;
    assert_eq!(
        std::fs::read_to_string(sshd.home().join("au/f.txt")).unwrap(),
        "written-content-edited-content-9Zy\n"
    );
    // A call whose `_meta` carries the client's tool-use id (as Claude Code's does).
    let mut params = CallToolRequestParams::new("exec_bash")
        .with_arguments(json!({"command": "true"}).as_object().unwrap().clone());
    params.meta = Some(rmcp::model::RequestMetaObject(rmcp::model::MetaObject(
        json!({"claudecode/toolUseId": "toolu_01AuditTie"})
            .as_object()
            .unwrap()
            .clone(),
    )));
    let r = mcp.svc.call_tool(params).await.unwrap();
    assert_ne!(r.is_error, Some(true));

    let dir = mcp.state_dir().join("audit");
    let text: String = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|f| std::fs::read_to_string(f.path()).unwrap())
        .collect();
    for secret in ["7Qx\n", "edited-content-9Zy", "patched-content-3Kw"] {
        assert!(
            !text.contains(secret),
            "content {secret:?} in the audit log:\n{text}"
        );
    }
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("torn line {l:?}: {e}")))
        .collect();
    let of = |tool: &str| -> Vec<&Value> { lines.iter().filter(|l| l["tool"] == tool).collect() };
    // Each line names the MCP session and the request, so it can be tied to the transcript.
    let session = lines[0]["session"]
        .as_str()
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(session.len(), 16, "{text}");
    assert!(lines.iter().all(|l| l["session"] == session), "{text}");
    // One request per action (a command's start and end lines share theirs).
    let requests: std::collections::HashSet<&str> = lines
        .iter()
        .filter(|l| l["event"] != "start")
        .map(|l| l["request"].as_str().unwrap())
        .collect();
    let ends = lines.iter().filter(|l| l["event"] != "start").count();
    assert_eq!(requests.len(), ends, "one request per action: {text}");
    let x = of("exec_bash");
    assert_eq!(x.len(), 2, "{text}");
    assert_eq!(
        (&x[0]["event"], &x[1]["event"]),
        (&json!("start"), &json!("end"))
    );
    assert_eq!(x[0]["request"], x[1]["request"], "{text}");
    assert!(
        x.iter().all(|l| l["tool_use"] == "toolu_01AuditTie"),
        "{text}"
    );
    assert!(lines.iter().filter(|l| l["tool_use"].is_string()).count() == 2);
    let w = of("write_remote_file");
    assert_eq!(w.len(), 1, "{text}");
    assert_eq!(w[0]["sandbox"], "s");
    assert_eq!(w[0]["command"], "au/f.txt");
    assert_eq!(w[0]["bytes"], body.len());
    assert!(
        w[0]["origin"].as_str().unwrap().starts_with("mcp"),
        "{}",
        w[0]
    );
    let e = of("edit_remote_file");
    assert_eq!(e.len(), 2, "{text}");
    assert!(
        e[0]["error"].is_null() && e[1]["error"].is_string(),
        "{text}"
    );
    let p = of("apply_patch");
    assert_eq!(p.len(), 1, "{text}");
    assert!(
        p[0]["command"].as_str().unwrap().ends_with("au/g.txt"),
        "{}",
        p[0]
    );
    let fw = of("forward_port");
    assert_eq!(fw.len(), 1, "{text}");
    assert!(
        fw[0]["command"].as_str().unwrap().ends_with(":9"),
        "{}",
        fw[0]
    );
    assert_eq!(fw[0]["detail"]["forward_id"], id, "{}", fw[0]);
    assert_eq!(of("stop_forward").len(), 1, "{text}");
    for l in lines.iter().filter(|l| l["event"] != "start") {
        assert!(l["duration_ms"].is_u64(), "{l}");
    }
    mcp.close().await;
}

/// Issue 41, item 2: a job whose log file is gone says so. Through the cursor
/// (`offset`) the reply had `output: ""` and nothing else, as if the job printed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_log_is_gone_says_so() {
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&list(&[key_entry("s", &sshd)])).await;
    let name = unique("gone");
    let log = sshd.home().join(format!("{name}.log"));
    mcp.ok(
        "exec_bash_background",
        json!({"command": "echo printed", "session_name": name, "watch": false,
               "log_file": log.display().to_string()}),
    )
    .await;
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": name, "wait_s": 20}),
        )
        .await;
    assert_eq!(v["running"], false, "{v}");
    assert!(v["log_tail"].as_str().unwrap().contains("printed"), "{v}");
    assert!(v.get("note").is_none(), "{v}");
    std::fs::remove_file(&log).unwrap();
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": name, "offset": 0}),
        )
        .await;
    assert_eq!(v["output"], "", "{v}");
    assert!(
        v["note"]
            .as_str()
            .is_some_and(|n| n.contains("log file is gone")),
        "{v}"
    );
    let v = mcp
        .ok("check_background_task", json!({"tmux_session": name}))
        .await;
    assert_eq!(v["log_tail"], "[log file not found]", "{v}");
    mcp.close().await;
}

/// The Landlock ABI of this kernel (0: none).
#[cfg(target_os = "linux")]
fn landlock_abi() -> i64 {
    // SAFETY: a null attribute with size 0 and the version flag only asks for the ABI.
    unsafe { libc::syscall(444, std::ptr::null::<u8>(), 0usize, 1u32) }.max(0)
}

#[cfg(not(target_os = "linux"))]
fn landlock_abi() -> i64 {
    0
}

/// An sshd whose agents see Landlock ABI `abi` (`None`: the kernel's own).
fn sshd_serving_abi(abi: Option<&str>) -> Sshd {
    Sshd::start_with(rsb_tests::SshdOptions {
        set_env: abi
            .map(|a| vec![("RSB_TEST_LANDLOCK_ABI".to_string(), a.to_string())])
            .unwrap_or_default(),
        ..Default::default()
    })
    .unwrap()
}

/// These tests enforce for real: a kernel without the ABI they need fails them, loudly.
fn need_landlock(abi: i64, what: &str) {
    let have = landlock_abi();
    assert!(
        have >= abi,
        "this kernel serves Landlock ABI {have} (< {abi}): the confinement tests need {what}"
    );
}

/// Issue 48, first step: with `confine.write = [scratch]`, commands through `exec_bash` change
/// nothing outside the scratch root however they are spelled or whatever they are written in,
/// and work as usual inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_bash_is_confined_by_the_kernel_to_its_write_roots() {
    need_landlock(2, "Linux 5.19+ with landlock enabled");
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().to_path_buf();
    std::fs::create_dir_all(h.join("scratch")).unwrap();
    std::fs::create_dir_all(h.join("outside/dir")).unwrap();
    std::fs::write(h.join("outside/keep.txt"), "keep me\n").unwrap();
    std::fs::write(h.join("outside/dir/a.txt"), "a\n").unwrap();
    let before = tree_state(&h.join("outside"));
    let mut entry = key_entry("box", &sshd);
    entry["confine"] = json!({"write": ["~/scratch"]});
    let mcp = Mcp::start(&list(&[entry])).await;
    // A build inside the root works as usual (the compiler's temporaries go there too).
    std::fs::write(
        h.join("scratch/unl.c"),
        "#include <stdio.h>\n#include <unistd.h>\nint main(int c, char **v) {\n  for (int i = 1; i < c; i++)\n    if (unlink(v[i]) != 0) { perror(v[i]); return 1; }\n  return 0;\n}\n",
    )
    .unwrap();
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "mkdir -p ~/scratch/tmp && TMPDIR=~/scratch/tmp cc -o ~/scratch/unl ~/scratch/unl.c && echo built"}),
        )
        .await;
    assert_eq!(v["stdout"], "built\n", "{v}");
    // Spellings a policy that reads bash misses, and programs that are not bash at all.
    let attacks = [
        "rm -rf ~/outside",
        "echo x > ~/outside/keep.txt",
        ": > ~/outside/keep.txt",
        "truncate -s 0 ~/outside/keep.txt",
        "$'\\x72\\x6d' -rf ~/outside",
        "eval \"r\"\"m -rf ~/outside/dir\"",
        "x=rm; $x -f ~/outside/keep.txt",
        "find ~/outside -delete",
        "mv ~/outside/keep.txt ~/scratch/stolen.txt",
        "ln -s /etc/passwd ~/outside/link",
        "cp /etc/hostname ~/outside/dir/",
        "mkdir ~/outside/new",
        "python3 -c \"import shutil, os; shutil.rmtree(os.path.expanduser('~/outside'))\"",
        "perl -e 'unlink \"$ENV{HOME}/outside/keep.txt\" or die \"$!\\n\"'",
        "cd ~/outside && sh -c 'rm dir/a.txt'",
        "touch ~/new-in-home",
        "~/scratch/unl ~/outside/keep.txt ~/outside/dir/a.txt",
        "rsync -a --delete ~/scratch/tmp/ ~/outside/",
    ];
    for cmd in attacks {
        let v = mcp.ok("exec_bash", json!({"command": cmd})).await;
        assert_ne!(v["exit_code"], 0, "{cmd} succeeded: {v}");
        assert!(
            v["confinement"]
                .as_str()
                .unwrap_or_default()
                .contains("only under ~/scratch"),
            "{cmd}: the reply should say the command is confined: {v}"
        );
    }
    // Each failed confined command is on the audit record with its confinement line.
    let audit = audit_text(&mcp);
    let denied = audit
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["event"] == "end" && v["tool"] == "exec_bash")
        .filter(|v| {
            v["detail"]["confinement"]
                .as_str()
                .is_some_and(|c| c.contains("only under ~/scratch"))
        })
        .count();
    assert_eq!(denied, attacks.len(), "{audit}");
    // A background job: its command and everything it starts are confined; its wrapper still
    // writes the log (outside the root).
    let job = "rm -rf ~/outside; python3 -c \"import os; os.remove(os.path.expanduser('~/outside/keep.txt'))\"; \
        (sleep 0.2; rm -f ~/outside/dir/a.txt) & wait; echo inside > ~/scratch/job.txt; echo job-done";
    mcp.ok(
        "exec_bash_background",
        json!({"command": job, "session_name": "confined-job", "watch": false}),
    )
    .await;
    let v = job_end(&mcp, "confined-job").await;
    assert_eq!(v["running"], false, "{v}");
    let tail = v["log_tail"].as_str().unwrap_or_default();
    assert!(tail.contains("job-done"), "{v}");
    assert!(tail.contains("Permission denied"), "{v}");
    assert_eq!(
        std::fs::read_to_string(h.join("scratch/job.txt")).unwrap(),
        "inside\n"
    );
    assert_eq!(
        tree_state(&h.join("outside")),
        before,
        "a file outside the root changed"
    );
    assert!(!h.join("new-in-home").exists());
    // Inside the root, work goes on as usual: a repository, renames, deletes, /dev/null.
    let inside = "cd ~/scratch && git init -q repo && cd repo && echo hi > a && git add a \
        && git -c user.email=t@t -c user.name=t commit -qm first && mkdir -p d/e && mv a d/e/ \
        && rm -rf d && ls -a > /dev/null && echo done";
    let v = mcp.ok("exec_bash", json!({"command": inside})).await;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"], "done\n");
    assert!(v.get("confinement").is_none(), "{v}");
    // A package installed into the root by pip (offline, from a wheel made there).
    let pip = r#"cd ~/scratch && python3 -c "import zipfile; z = zipfile.ZipFile('demo-1.0-py3-none-any.whl', 'w'); z.writestr('demo/__init__.py', 'X = 42\n'); z.writestr('demo-1.0.dist-info/METADATA', 'Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n'); z.writestr('demo-1.0.dist-info/WHEEL', 'Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n'); z.writestr('demo-1.0.dist-info/RECORD', ''); z.close()" && TMPDIR=~/scratch/tmp python3 -m pip install -q --no-index --no-cache-dir --disable-pip-version-check --target site demo-1.0-py3-none-any.whl && PYTHONPATH=site python3 -c 'import demo; print(demo.X)'"#;
    let v = mcp.ok("exec_bash", json!({"command": pip})).await;
    assert_eq!(v["stdout"], "42\n", "{v}");
    // sudo cannot gain root under no_new_privs: refused, never run unconfined.
    let r = mcp
        .err("exec_bash", json!({"command": "id", "sudo": true}))
        .await;
    assert!(r.text.contains("no_new_privs"), "{}", r.text);
    mcp.close().await;

    // A root that does not exist is named, and nothing runs.
    let mut entry = key_entry("box", &sshd);
    entry["confine"] = json!({"write": ["~/nope"]});
    let mcp = Mcp::start(&list(&[entry])).await;
    let r = mcp
        .err("exec_bash", json!({"command": "touch ~/scratch/ran"}))
        .await;
    assert!(r.text.contains("~/nope cannot be opened"), "{}", r.text);
    assert!(!h.join("scratch/ran").exists());
    mcp.close().await;
}

/// Issue 48: with `confine.read`, a command reads and executes only beneath the read roots,
/// the write roots and the system's directories: a secret elsewhere in the home (a key, another
/// project) is out of its reach by any spelling, in `exec_bash` and in a background job, and
/// programs from the system still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confined_reads_keep_commands_from_the_rest_of_the_host() {
    need_landlock(1, "Linux 5.13+ with landlock enabled");
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().to_path_buf();
    for d in ["scratch", "data", "private"] {
        std::fs::create_dir_all(h.join(d)).unwrap();
    }
    std::fs::write(h.join("data/in.txt"), "data\n").unwrap();
    std::fs::write(h.join("private/key"), "SECRET\n").unwrap();
    std::os::unix::fs::symlink(h.join("private/key"), h.join("data/link")).unwrap();
    let mut entry = key_entry("box", &sshd);
    entry["confine"] = json!({"write": ["~/scratch"], "read": ["~/data"]});
    let mcp = Mcp::start(&list(&[entry])).await;
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "cat ~/data/in.txt && echo w > ~/scratch/w && cat ~/scratch/w && python3 -c 'print(6 * 7)' && ls /usr/bin | grep -c '^ls$'"}),
        )
        .await;
    assert_eq!(v["stdout"], "data\nw\n42\n1\n", "{v}");
    let attacks = [
        "cat ~/private/key",
        "cat ~/data/link",
        "cd ~/data && cat ../private/key",
        "ls ~/private",
        "python3 -c \"print(open(__import__('os').path.expanduser('~/private/key')).read())\"",
        "cp ~/private/key ~/scratch/stolen",
        "tar -cf ~/scratch/home.tar -C ~ private",
    ];
    for cmd in attacks {
        let v = mcp.ok("exec_bash", json!({"command": cmd})).await;
        assert_ne!(v["exit_code"], 0, "{cmd} succeeded: {v}");
        assert!(
            !v["stdout"].as_str().unwrap_or_default().contains("SECRET"),
            "{cmd}: {v}"
        );
        let line = v["confinement"].as_str().unwrap_or_default();
        assert!(
            line.contains("commands and rsb read only under ~/data, the write roots"),
            "{cmd}: the reply should say reads are confined: {v}"
        );
    }
    mcp.ok(
        "exec_bash_background",
        json!({"command": "cat ~/private/key > ~/scratch/job.txt; cat ~/data/in.txt >> ~/scratch/job.txt; echo job-done", "session_name": "reader", "watch": false}),
    )
    .await;
    let v = job_end(&mcp, "reader").await;
    assert!(
        v["log_tail"]
            .as_str()
            .unwrap_or_default()
            .contains("job-done"),
        "{v}"
    );
    assert_eq!(
        std::fs::read_to_string(h.join("scratch/job.txt")).unwrap(),
        "data\n"
    );
    assert!(!h.join("scratch/stolen").exists());
    let tar = std::fs::read(h.join("scratch/home.tar")).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&tar).contains("SECRET"));
    let v = mcp.ok("list_sandboxes", json!({})).await;
    let line = v["sandboxes"][0]["confine"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains("commands and rsb read only under ~/data"),
        "{v}"
    );
    mcp.close().await;
}

/// Issue 48: with `confine.read`, rsb's own reads keep to the read roots as commands do:
/// `read_remote_file`, `list_remote_files`, `search_remote_files` and a sync down are refused
/// outside them with one line naming the roots, whatever the path spells (`..`, a symlink in a
/// root that points out), and work inside them, on the system's files and on rsb's job logs;
/// with the kernel, and without it (the agent's own check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsb_own_reads_keep_to_the_read_roots() {
    need_landlock(1, "Linux 5.13+ with landlock enabled");
    for abi in [None, Some("0")] {
        let sshd = sshd_serving_abi(abi);
        let h = sshd.home().to_path_buf();
        for d in ["scratch", "data/sub", "private"] {
            std::fs::create_dir_all(h.join(d)).unwrap();
        }
        std::fs::write(h.join("data/in.txt"), "data needle\n").unwrap();
        std::fs::write(h.join("private/key"), "SECRET needle\n").unwrap();
        std::fs::write(h.join(".bashrc"), "SECRET rc\n").unwrap();
        std::os::unix::fs::symlink(h.join("private/key"), h.join("data/link")).unwrap();
        std::os::unix::fs::symlink(h.join("private"), h.join("data/dirlink")).unwrap();
        let mut entry = key_entry("box", &sshd);
        entry["confine"] = json!({"write": ["~/scratch"], "read": ["~/data"], "require": false});
        let mcp = Mcp::start(&list(&[entry])).await;
        let refused = |r: &Reply, what: &str| {
            assert!(
                r.text.contains("outside this sandbox's readable roots (~/data, ~/scratch, the system's directories"),
                "{what} ({abi:?}): {}",
                r.text
            );
            assert!(!r.text.contains("SECRET"), "{what}: {}", r.text);
            assert!(
                r.text.contains("confine.read"),
                "{what}: the hint: {}",
                r.text
            );
        };
        for path in [
            "~/private/key",
            "~/data/link",
            "~/data/../private/key",
            "~/data/dirlink/key",
            "~/.bashrc",
            "/tmp",
        ] {
            let r = mcp
                .err("read_remote_file", json!({"remote_path": path}))
                .await;
            refused(&r, path);
        }
        for path in ["~/private", "~/data/dirlink", "~"] {
            let r = mcp
                .err("list_remote_files", json!({"remote_path": path}))
                .await;
            refused(&r, path);
        }
        for path in ["~/private", "~/data/dirlink", "~"] {
            let r = mcp
                .err(
                    "search_remote_files",
                    json!({"pattern": "needle", "remote_path": path}),
                )
                .await;
            refused(&r, path);
        }
        let local = tempfile::tempdir().unwrap();
        let r = mcp
            .err(
                "sync_remote_to_local",
                json!({"remote_path": "~/private", "local_path": local.path().join("p").display().to_string()}),
            )
            .await;
        refused(&r, "sync private");
        assert!(!local.path().join("p/key").exists());
        // Inside the roots, and the system's files, all work as usual.
        let v = mcp
            .ok("read_remote_file", json!({"remote_path": "~/data/in.txt"}))
            .await;
        assert_eq!(v["content"], "data needle\n", "{v}");
        let v = mcp
            .ok("read_remote_file", json!({"remote_path": "/etc/passwd"}))
            .await;
        assert!(
            v["content"].as_str().unwrap_or_default().contains("root:"),
            "{v}"
        );
        let v = mcp
            .ok("list_remote_files", json!({"remote_path": "~/data"}))
            .await;
        assert!(v.to_string().contains("in.txt"), "{v}");
        let v = mcp
            .ok(
                "search_remote_files",
                json!({"pattern": "needle", "remote_path": "~/data"}),
            )
            .await;
        assert!(v.to_string().contains("data needle"), "{v}");
        assert!(!v.to_string().contains("SECRET"), "{v}");
        mcp.ok(
            "sync_remote_to_local",
            json!({"remote_path": "~/data", "local_path": local.path().join("d").display().to_string()}),
        )
        .await;
        assert_eq!(
            std::fs::read_to_string(local.path().join("d/in.txt")).unwrap(),
            "data needle\n"
        );
        // The links come down as links, never as what they point at.
        assert!(
            local
                .path()
                .join("d/link")
                .symlink_metadata()
                .unwrap()
                .is_symlink()
        );
        // A confined job's log is by default in rsb's own directory for the job (the usual
        // `<cwd>/.codex_logs/` may lie outside the write roots), and readable there.
        mcp.ok(
            "exec_bash_background",
            json!({"command": "echo logged", "session_name": "logger", "watch": false}),
        )
        .await;
        let v = job_end(&mcp, "logger").await;
        assert!(
            v["log_tail"]
                .as_str()
                .unwrap_or_default()
                .contains("logged"),
            "{v}"
        );
        let log = v["log_file"].as_str().unwrap_or_default().to_string();
        assert!(log.ends_with(".cache/rsb/jobs/logger/output.log"), "{v}");
        let v = mcp
            .ok("read_remote_file", json!({"remote_path": log}))
            .await;
        assert!(
            v["content"].as_str().unwrap_or_default().contains("logged"),
            "{v}"
        );
        // A log asked for outside the write roots is refused before anything runs: the job's
        // output, which the model writes, would otherwise land in ~/.bashrc.
        std::os::unix::fs::symlink(h.join(".bashrc"), h.join("scratch/rc.log")).unwrap();
        for log in ["~/.bashrc", "~/scratch/rc.log", "~/scratch/../.bashrc"] {
            let r = mcp
                .err(
                    "exec_bash_background",
                    json!({"command": "echo pwned", "session_name": "rc", "log_file": log, "watch": false}),
                )
                .await;
            assert!(
                r.text
                    .contains("outside this sandbox's writable roots (~/scratch)"),
                "{log}: {}",
                r.text
            );
        }
        assert_eq!(
            std::fs::read_to_string(h.join(".bashrc")).unwrap(),
            "SECRET rc\n"
        );
        mcp.close().await;
    }
}

/// A host that cannot confine fails closed; `require = false` runs unconfined and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_without_landlock_refuses_confined_commands_unless_allowed() {
    let sshd = sshd_serving_abi(Some("0"));
    let h = sshd.home().to_path_buf();
    std::fs::create_dir_all(h.join("scratch")).unwrap();
    let mut strict = key_entry("strict", &sshd);
    strict["confine"] = json!({"write": ["~/scratch"]});
    let mut lax = key_entry("lax", &sshd);
    lax["confine"] = json!({"write": ["~/scratch"], "require": false});
    let mcp = Mcp::start(&list(&[strict, lax])).await;
    let r = mcp
        .err(
            "exec_bash",
            json!({"command": "touch ~/ran-strict", "sandbox_name": "strict"}),
        )
        .await;
    assert!(r.text.contains("has no Landlock"), "{}", r.text);
    assert!(r.text.contains("require = false"), "{}", r.text);
    assert!(!h.join("ran-strict").exists(), "the command ran unconfined");
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "touch ~/ran-lax && echo ok", "sandbox_name": "lax"}),
        )
        .await;
    assert_eq!(v["stdout"], "ok\n", "{v}");
    assert!(
        v["confinement"]
            .as_str()
            .unwrap_or_default()
            .starts_with("unconfined: "),
        "{v}"
    );
    assert!(h.join("ran-lax").exists());
    // Background jobs alike: refused before anything launches, or started and said so.
    let r = mcp
        .err(
            "exec_bash_background",
            json!({"command": "touch ~/job-strict", "session_name": "js", "sandbox_name": "strict", "watch": false}),
        )
        .await;
    assert!(r.text.contains("has no Landlock"), "{}", r.text);
    let v = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "true", "session_name": "jl", "sandbox_name": "lax", "watch": false}),
        )
        .await;
    assert!(
        v["confinement"]
            .as_str()
            .unwrap_or_default()
            .starts_with("unconfined: "),
        "{v}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(!h.join("job-strict").exists(), "the refused job ran");
    mcp.close().await;

    // A kernel with file rules but no TCP rules (ABI 3): a net rule fails closed, or, allowed,
    // the files stay confined and the reply names what is not.
    if landlock_abi() < 3 {
        return;
    }
    let sshd = sshd_serving_abi(Some("3"));
    let h = sshd.home().to_path_buf();
    std::fs::create_dir_all(h.join("scratch")).unwrap();
    let mut strict = key_entry("strict", &sshd);
    strict["confine"] = json!({"write": ["~/scratch"], "net": "none"});
    let mut lax = key_entry("lax", &sshd);
    lax["confine"] = json!({"write": ["~/scratch"], "net": "none", "require": false});
    let mcp = Mcp::start(&list(&[strict, lax])).await;
    let r = mcp
        .err(
            "exec_bash",
            json!({"command": "touch ~/scratch/ran", "sandbox_name": "strict"}),
        )
        .await;
    assert!(r.text.contains("TCP rules need ABI 4"), "{}", r.text);
    assert!(!h.join("scratch/ran").exists());
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "touch ~/scratch/ran && touch ~/outside", "sandbox_name": "lax"}),
        )
        .await;
    assert_ne!(v["exit_code"], 0, "{v}");
    assert!(h.join("scratch/ran").exists() && !h.join("outside").exists());
    assert!(
        v["confinement"]
            .as_str()
            .unwrap_or_default()
            .contains("unconfined: the network"),
        "{v}"
    );
    mcp.close().await;
}

/// Every line of the server's audit record so far.
fn audit_text(mcp: &Mcp) -> String {
    std::fs::read_dir(mcp._tmp.path().join("state/audit"))
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect()
}

/// Hashes of every file and the names of every directory and link under `root`.
fn tree_state(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let what = if meta.is_dir() {
                stack.push(p.clone());
                "dir".to_string()
            } else if meta.is_symlink() {
                format!("-> {}", std::fs::read_link(&p).unwrap().display())
            } else {
                blake3::hash(&std::fs::read(&p).unwrap())
                    .to_hex()
                    .to_string()
            };
            out.push((p.display().to_string(), what));
        }
    }
    out.sort();
    out
}

/// Issue 48: rsb's own writes keep to the write roots as commands do. write_remote_file,
/// edit_remote_file, apply_patch and a sync into the sandbox are refused outside them, through
/// symlinks planted inside them too, with one line naming the roots, and nothing outside
/// changes; inside, they work as usual. Checked with the kernel (a confined worker thread)
/// and without it (`RSB_TEST_LANDLOCK_ABI=0`: the agent's descriptor check alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsb_own_writes_keep_to_the_write_roots() {
    for abi in [None, Some("0")] {
        let sshd = sshd_serving_abi(abi);
        let h = sshd.home().to_path_buf();
        std::fs::create_dir_all(h.join("scratch")).unwrap();
        std::fs::create_dir_all(h.join("outside")).unwrap();
        std::fs::write(h.join("outside/keep.txt"), "keep me\n").unwrap();
        std::fs::write(h.join(".bashrc"), "# mine\n").unwrap();
        std::os::unix::fs::symlink("../outside", h.join("scratch/dirlink")).unwrap();
        std::os::unix::fs::symlink("../outside/keep.txt", h.join("scratch/filelink")).unwrap();
        let watched = |h: &Path| {
            (
                tree_state(&h.join("outside")),
                std::fs::read(h.join(".bashrc")).unwrap(),
            )
        };
        let before = watched(&h);
        let mut entry = key_entry("box", &sshd);
        entry["confine"] = json!({"write": ["~/scratch"], "require": false});
        let mcp = Mcp::start_with(
            &list(&[entry]),
            &[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1")],
        )
        .await;
        let refused = |r: &Reply, what: &str| {
            assert!(
                r.text
                    .contains("outside this sandbox's writable roots (~/scratch)"),
                "{what} ({abi:?}): {}",
                r.text
            );
            assert!(
                r.text.contains("confine.write"),
                "{what}: the hint: {}",
                r.text
            );
        };
        for (path, make_dirs) in [
            ("outside/new.txt", false),
            ("outside/deep/er/new.txt", true),
            ("scratch/dirlink/new.txt", false),
            ("scratch/dirlink/deep/new.txt", true),
            ("scratch/filelink", false),
            ("scratch/../outside/keep.txt", false),
            (".bashrc", false),
            ("/tmp/rsb-confine-never.txt", false),
        ] {
            let r = mcp
                .err(
                    "write_remote_file",
                    json!({"remote_path": path, "content": "x\n", "make_dirs": make_dirs}),
                )
                .await;
            refused(&r, path);
        }
        assert!(!Path::new("/tmp/rsb-confine-never.txt").exists());
        for path in [
            "outside/keep.txt",
            "scratch/filelink",
            "scratch/dirlink/keep.txt",
        ] {
            let r = mcp
                .err(
                    "edit_remote_file",
                    json!({"remote_path": path, "old_string": "keep", "new_string": "lost"}),
                )
                .await;
            refused(&r, path);
        }
        // Inside the root: as usual.
        mcp.ok(
            "write_remote_file",
            json!({"remote_path": "scratch/a/b.txt", "content": "one\n", "make_dirs": true}),
        )
        .await;
        mcp.ok(
            "edit_remote_file",
            json!({"remote_path": "~/scratch/a/b.txt", "old_string": "one", "new_string": "two"}),
        )
        .await;
        // A patch with one file outside changes none; a move out of the root is refused.
        let r = mcp
            .err(
                "apply_patch",
                json!({"patch": "*** Begin Patch\n*** Add File: scratch/p.txt\n+p\n*** Update File: outside/keep.txt\n@@\n-keep me\n+lost\n*** End Patch"}),
            )
            .await;
        refused(&r, "patch");
        assert!(!h.join("scratch/p.txt").exists());
        let r = mcp
            .err(
                "apply_patch",
                json!({"patch": "*** Begin Patch\n*** Update File: scratch/a/b.txt\n*** Move to: outside/moved.txt\n@@\n-two\n+three\n*** End Patch"}),
            )
            .await;
        refused(&r, "move");
        mcp.ok(
            "apply_patch",
            json!({"patch": "*** Begin Patch\n*** Update File: scratch/a/b.txt\n*** Move to: scratch/c.txt\n@@\n-two\n+three\n*** End Patch"}),
        )
        .await;
        assert_eq!(
            std::fs::read_to_string(h.join("scratch/c.txt")).unwrap(),
            "three\n"
        );
        // Syncs into the sandbox: the destination root must be beneath a write root.
        let tmp = tempfile::tempdir().unwrap();
        let proj = tmp.path().join("proj");
        std::fs::create_dir_all(&proj).unwrap();
        std::fs::write(proj.join("f.txt"), "f\n").unwrap();
        for remote in ["outside/up", "scratch/dirlink/up", "~"] {
            let r = mcp
                .err(
                    "sync_local_to_remote",
                    json!({"local_path": proj.display().to_string(), "remote_path": remote}),
                )
                .await;
            refused(&r, remote);
        }
        mcp.ok(
            "sync_local_to_remote",
            json!({"local_path": proj.display().to_string(), "remote_path": "scratch/up"}),
        )
        .await;
        assert_eq!(
            std::fs::read_to_string(h.join("scratch/up/f.txt")).unwrap(),
            "f\n"
        );
        assert_eq!(
            watched(&h),
            before,
            "something outside the root changed ({abi:?})"
        );
        assert!(!h.join("f.txt").exists());
        // Every refusal is on the audit record with its line.
        let audit = audit_text(&mcp);
        let refusals = audit
            .lines()
            .filter(|l| l.contains("outside this sandbox's writable roots"))
            .count();
        assert_eq!(refusals, 8 + 3 + 2 + 3, "{audit}");
        // The listing says what is confined and whether this host enforces it.
        let v = mcp.ok("list_sandboxes", json!({})).await;
        let row = &v["sandboxes"][0];
        let line = row["confine"].as_str().unwrap_or_default();
        assert!(line.contains("only under ~/scratch"), "{row}");
        let served = if abi.is_some() { 0 } else { landlock_abi() };
        assert_eq!(row["landlock_abi"], served, "{row}");
        if served > 0 {
            assert!(
                line.contains(&format!("(Landlock ABI {served}: files")),
                "{row}"
            );
        } else {
            assert!(
                line.contains("cannot enforce any confinement: commands run without it"),
                "{row}"
            );
        }
        mcp.close().await;
    }
}

/// Issue 48: `net` keeps a confined command to its TCP ports (ABI 4), and scoping (ABI 6)
/// keeps it from signalling the agent or another job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confined_commands_keep_to_their_ports_and_cannot_signal_outside() {
    need_landlock(6, "Linux 6.12+ for net and scoping");
    let sshd = Sshd::start().unwrap();
    std::fs::create_dir_all(sshd.home().join("scratch")).unwrap();
    let open = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (p1, p2) = (
        open.local_addr().unwrap().port(),
        other.local_addr().unwrap().port(),
    );
    let sandbox = |name: &str, net: Value| {
        let mut e = key_entry(name, &sshd);
        e["confine"] = json!({"write": ["~/scratch"], "net": net});
        e
    };
    let mcp = Mcp::start(&list(&[
        sandbox("nonet", json!("none")),
        sandbox("oneport", json!([p1.to_string()])),
        key_entry("free", &sshd),
    ]))
    .await;
    let connect = |port: u16| format!("exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected");
    for (sb, port, ok) in [
        ("nonet", p1, false),
        ("oneport", p1, true),
        ("oneport", p2, false),
        ("free", p2, true),
    ] {
        let v = mcp
            .ok(
                "exec_bash",
                json!({"command": connect(port), "sandbox_name": sb}),
            )
            .await;
        assert_eq!(v["exit_code"] == 0, ok, "{sb} to port {port}: {v}");
    }
    // The agent (the command's parent) and another confined job are outside its domain.
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "kill -0 $PPID", "sandbox_name": "oneport"}),
        )
        .await;
    assert_ne!(v["exit_code"], 0, "{v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("not permitted"),
        "{v}"
    );
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": "kill -0 $PPID", "sandbox_name": "free"}),
        )
        .await;
    assert_eq!(v["exit_code"], 0, "{v}");
    let job = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "sleep 60", "session_name": "victim", "sandbox_name": "oneport", "watch": false}),
        )
        .await;
    let pid = job["pid"].as_u64().unwrap();
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": format!("kill {pid}"), "sandbox_name": "oneport"}),
        )
        .await;
    assert_ne!(v["exit_code"], 0, "{v}");
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": "victim", "sandbox_name": "oneport"}),
        )
        .await;
    assert_eq!(v["running"], true, "{v}");
    mcp.ok(
        "kill_background_task",
        json!({"tmux_session": "victim", "sandbox_name": "oneport"}),
    )
    .await;
    drop((open, other));
    mcp.close().await;
}

// ---------------------------------------------------------------------------------------------
// GPU placement (issue 49): two hosts with fake nvidia-smi, two `rsb mcp` servers
// ---------------------------------------------------------------------------------------------

/// The wrapper (the lease's holder) of the job whose process group is `pgid`: its parent.
fn parent_of(pid: u64) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = stat.rsplit_once(')').unwrap().1;
    after.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `exec_bash_background(gpus=2, sandbox_name="auto")` from two `rsb mcp` servers at once: host
/// `a` (4 GPUs, two busy) is the only one with two free, so exactly one start lands there, on
/// exactly those two (freest first, their UUIDs in CUDA_VISIBLE_DEVICES), and the other gets a
/// clear error saying what is free where. A lease whose holder is SIGKILLed ends, and the GPUs
/// are placed again; `gpus=1` lands on `b`'s one free GPU; leases show in list_sandboxes.
#[tokio::test(flavor = "multi_thread")]
async fn gpus_are_placed_on_the_freest_host_and_never_twice() {
    let tag = unique("g");
    let a: Vec<String> = (0..4).map(|i| format!("GPU-a{i}-{tag}")).collect();
    let b: Vec<String> = (0..2).map(|i| format!("GPU-b{i}-{tag}")).collect();
    let _leases = rsb_tests::gpu::Leases(a.iter().chain(&b).cloned().collect());
    // a: GPU 1 has 1,000 MiB used, GPU 3 none: GPU 3 is offered first.
    let (host_a, _bin_a) = gpu_host(&fake_smi(
        &[
            (&a[0], 70_000, 90),
            (&a[1], 1_000, 0),
            (&a[2], 60_000, 95),
            (&a[3], 0, 0),
        ],
        &[&a[0], &a[2]],
    ));
    let (host_b, _bin_b) = gpu_host(&fake_smi(&[(&b[0], 0, 0), (&b[1], 50_000, 80)], &[&b[1]]));
    let entries = list(&[key_entry("a", &host_a), key_entry("b", &host_b)]);
    let (one, two) = tokio::join!(Mcp::start(&entries), Mcp::start(&entries));
    let start = |name: &'static str, gpus: u32| {
        json!({
            "command": "echo \"CVD=$CUDA_VISIBLE_DEVICES ORDER=$CUDA_DEVICE_ORDER\"; sleep 60",
            "session_name": name, "sandbox_name": "auto", "gpus": gpus, "watch": false,
        })
    };
    let (r1, r2) = tokio::join!(
        one.call("exec_bash_background", start("train1", 2)),
        two.call("exec_bash_background", start("train2", 2))
    );
    eprintln!("one: {}\ntwo: {}", r1.text, r2.text);
    assert!(
        r1.is_error != r2.is_error,
        "exactly one placement: {r1:?} {r2:?}"
    );
    let (won, lost, winner, loser, job) = match r1.is_error {
        false => (r1, r2, &one, &two, "train1"),
        true => (r2, r1, &two, &one, "train2"),
    };
    assert_eq!(won.s("sandbox"), "a", "{}", won.text);
    assert_eq!(
        won.v["gpus"],
        json!([a[3], a[1]]),
        "freest first: {}",
        won.text
    );
    let msg = lost.v["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("free") && (msg.contains("a has 0 of 4 free") || msg.contains("GPUs busy")),
        "the refusal says what is free where: {}",
        lost.text
    );
    assert!(!lost.v["hint"].as_str().unwrap_or_default().is_empty());
    let deadline = Instant::now() + Duration::from_secs(20);
    let log = loop {
        let log = std::fs::read_to_string(won.s("log_file")).unwrap_or_default();
        if log.contains("CVD=") || Instant::now() > deadline {
            break log;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let line = format!("CVD={},{} ORDER=PCI_BUS_ID", a[3], a[1]);
    assert!(log.contains(&line), "the job sees exactly its GPUs: {log}");

    // The other server sees the lease, named by job (a listing may answer with a sample
    // up to 1 s old: sample_age_ms).
    let deadline = Instant::now() + Duration::from_secs(5);
    let row = loop {
        let v = loser
            .ok("list_sandboxes", json!({"check_resources": true}))
            .await;
        let rows = v["sandboxes"].as_array().unwrap();
        let row = rows.iter().find(|s| s["name"] == "a").unwrap().clone();
        if row["resources"]["gpu"][3].get("leased_by").is_some() || Instant::now() > deadline {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let gpus = row["resources"]["gpu"].as_array().unwrap();
    assert_eq!(gpus[3]["leased_by"]["job"], job, "{row}");
    assert_eq!(gpus[1]["leased_by"]["job"], job, "{row}");
    assert!(gpus[0].get("leased_by").is_none(), "{row}");

    // One GPU: only b has one free now.
    let v = loser.ok("exec_bash_background", start("small", 1)).await;
    assert_eq!(
        (v["sandbox"].as_str(), &v["gpus"]),
        (Some("b"), &json!([b[0]])),
        "{v}"
    );

    // SIGKILL the winner's wrapper: its lease ends with it, and the GPUs are placed again.
    let wrapper = parent_of(won.v["pid"].as_u64().unwrap());
    assert_eq!(unsafe { libc::kill(wrapper, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let again = loop {
        let r = loser.call("exec_bash_background", start("again", 2)).await;
        if !r.is_error || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        !again.is_error,
        "placed again after its holder died: {}",
        again.text
    );
    assert_eq!(again.v["gpus"], json!([a[3], a[1]]), "{}", again.text);
    for (mcp, name, sandbox) in [
        (loser, "again", "a"),
        (loser, "small", "b"),
        (winner, job, "a"),
    ] {
        let _ = mcp
            .call(
                "kill_background_task",
                json!({"tmux_session": name, "sandbox_name": sandbox, "grace_s": 0}),
            )
            .await;
    }
    one.close().await;
    two.close().await;
}
