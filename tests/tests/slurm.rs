//! Issue 22: a Slurm login node as a sandbox. `rsb mcp` runs as a child process driven by
//! rmcp's client; the sandbox is a private sshd fixture on loopback whose host is also the
//! one node of the real Slurm test bed (`tests/slurm-testbed/`, started once per binary).
//! Skipped (with a message) without root unless `RSB_REQUIRE_SLURM=1`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rmcp::{
    RoleClient, ServiceExt, model::CallToolRequestParams, service::RunningService,
    transport::TokioChildProcess,
};

#[path = "common/listener.rs"]
mod listener;
use listener::Listener;
use rsb_tests::{
    ChaosProxy, Sshd, SshdOptions,
    slurm::{slurm, slurm_exclusive},
    workspace_root,
};
use serde_json::{Value, json};

struct Mcp {
    /// A client that takes channel notifications, as Claude Code does.
    svc: RunningService<RoleClient, Listener>,
    listener: Listener,
    /// The `REMOTE_SANDBOX_LIST` it runs with, for the CLI beside it.
    list: String,
    home: PathBuf,
    state: PathBuf,
    _tmp: tempfile::TempDir,
}

/// A real `rsb watchdog run` on the server's state dir, SIGKILLed when dropped.
struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Mcp {
    async fn start(sshd: &Sshd, slurm_defaults: Value) -> Mcp {
        Self::start_entry(sshd, json!({"scheduler": "slurm", "slurm": slurm_defaults})).await
    }

    /// As [`start`](Self::start), for a client that does not take channel notifications:
    /// the server then follows no job on its own, and asks Slurm only when asked.
    async fn start_unfollowed(sshd: &Sshd, slurm_defaults: Value) -> Mcp {
        let extra = json!({"scheduler": "slurm", "slurm": slurm_defaults});
        Self::start_listening(sshd, extra, false).await
    }

    /// A server whose one sandbox, `cluster`, is the fixture plus `extra` keys.
    async fn start_entry(sshd: &Sshd, extra: Value) -> Mcp {
        Self::start_listening(sshd, extra, true).await
    }

    /// `listen`: the client declares the channel.
    async fn start_listening(sshd: &Sshd, extra: Value, listen: bool) -> Mcp {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("home");
        std::fs::create_dir_all(&home).unwrap();
        let mut entry = json!({
            "name": "cluster", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
            "key_file": sshd.client_key().display().to_string(),
        });
        for (k, v) in extra.as_object().unwrap() {
            entry[k] = v.clone();
        }
        let list = json!([entry]);
        let bin = workspace_root().join("target/debug/rsb");
        assert!(bin.exists(), "build rsb first: cargo build -p rsb");
        let mut cmd = tokio::process::Command::new(bin);
        cmd.arg("mcp")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
            .env("RSB_STATE_DIR", tmp.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", list.to_string())
            // The watchdog's tools (watch_background_task) too.
            .env("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1");
        let (transport, _) = TokioChildProcess::builder(cmd).spawn().unwrap();
        let listener = Listener {
            declare: listen,
            ..Listener::default()
        };
        let svc = tokio::time::timeout(Duration::from_secs(20), listener.clone().serve(transport))
            .await
            .expect("MCP initialize timed out")
            .unwrap();
        Mcp {
            svc,
            listener,
            list: list.to_string(),
            state: tmp.path().join("state"),
            home,
            _tmp: tmp,
        }
    }

    /// The watchdog daemon for this server's watches, ticking every second.
    fn daemon(&self) -> Daemon {
        let log = std::fs::File::create(self.home.join("daemon.log")).unwrap();
        let child = std::process::Command::new(workspace_root().join("target/debug/rsb"))
            .args(["watchdog", "run", "--loop-sleep", "1"])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &self.home)
            .env("XDG_CONFIG_HOME", self.home.join(".config"))
            .env("XDG_DATA_HOME", self.home.join(".local/share"))
            .env("RSB_SSH_CONFIG", self.home.join(".ssh/config"))
            .env("RSB_STATE_DIR", &self.state)
            .env("RSB_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Daemon(child)
    }

    /// `rsb ARGS` with this server's configuration and state: (exit code, stdout).
    fn cli(&self, args: &[&str]) -> (Option<i32>, String) {
        let out = rsb_tests::output_with_timeout(
            std::process::Command::new(workspace_root().join("target/debug/rsb"))
                .args(args)
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .env("HOME", &self.home)
                .env("XDG_CONFIG_HOME", self.home.join(".config"))
                .env("RSB_SSH_CONFIG", self.home.join(".ssh/config"))
                .env("RSB_STATE_DIR", &self.state)
                .env("REMOTE_SANDBOX_LIST", &self.list),
            Duration::from_secs(60),
        )
        .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// The channel pushes about job `name` so far: (when it arrived, its params).
    fn pushes(&self, name: &str) -> Vec<(Instant, Value)> {
        self.listener
            .got
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, m, p)| {
                m == "notifications/claude/channel" && p["meta"]["session_name"] == name
            })
            .map(|(t, _, p)| (*t, p.clone()))
            .collect()
    }

    /// Wait (bounded) for the first push about job `name`.
    async fn until_pushed(&self, name: &str, secs: u64) -> (Instant, Value) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(p) = self.pushes(name).into_iter().next() {
                return p;
            }
            assert!(Instant::now() < deadline, "{name}: no push within {secs} s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.home.join("daemon.log")).unwrap_or_default()
    }

    /// Submit `command` as job `name` with a watch that resumes it by `resume` (checked
    /// every second, resumed at once, once).
    async fn submit_watched(&self, name: &str, command: &str, slurm: Value, resume: bool) -> Value {
        let s = self
            .ok(
                "exec_bash_background",
                json!({"command": command, "session_name": name, "slurm": slurm,
                       "watch": true, "ensure_watchdog": false, "interval_s": 1,
                       "auto_resume": resume, "resume_delay_s": 0, "max_resume_attempts": 1,
                       "resume_command": "echo resumed-$RSB_RESUME_ATTEMPT; exit 0",
                       "checkpoint_path": "ck.txt", "notify_local": false}),
            )
            .await;
        assert!(s["watch_id"].as_i64().is_some(), "{s}");
        assert!(s.get("watch_error").is_none(), "{s}");
        s
    }

    fn watch(&self, id: i64) -> rsb::store::watch_model::Watch {
        let c = rsb::store::open(&self.state).unwrap();
        rsb::store::watches::require(&c, id).unwrap()
    }

    fn events(&self, id: i64) -> Vec<rsb::store::events::WatchEvent> {
        let c = rsb::store::open(&self.state).unwrap();
        let mut e = rsb::store::events::list(&c, id, 100).unwrap();
        e.sort_by_key(|e| e.id);
        e
    }

    /// Wait (bounded) until the watch's events satisfy `pred`.
    async fn until_events(
        &self,
        id: i64,
        secs: u64,
        pred: impl Fn(&[rsb::store::events::WatchEvent]) -> bool,
    ) -> Vec<rsb::store::events::WatchEvent> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let e = self.events(id);
            if pred(&e) {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "watch {id}: events not as expected in {secs} s: {:?}\nwatch: {:?}\ndaemon log:\n{}",
                types(&e),
                self.watch(id),
                self.daemon_log()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// (isError, parsed JSON or the text as a string)
    async fn call(&self, tool: &str, args: Value) -> (bool, Value) {
        // 90 s, and the wait a call asks for.
        let secs = 90 + args["wait_s"].as_u64().unwrap_or(0);
        let Value::Object(args) = args else { panic!() };
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
        let r = tokio::time::timeout(Duration::from_secs(secs), self.svc.call_tool(params))
            .await
            .unwrap_or_else(|_| panic!("{tool} did not answer within {secs} s"))
            .unwrap();
        let raw = serde_json::to_value(&r).unwrap();
        let text = raw["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (r.is_error == Some(true), v)
    }

    async fn ok(&self, tool: &str, args: Value) -> Value {
        let (err, v) = self.call(tool, args.clone()).await;
        assert!(!err, "{tool}({args}) failed: {v}");
        v
    }

    async fn submit(&self, name: &str, command: &str, slurm: Value) -> Value {
        self.ok(
            "exec_bash_background",
            json!({"command": command, "session_name": name, "watch": false, "slurm": slurm}),
        )
        .await
    }

    async fn check(&self, name: &str) -> Value {
        self.ok("check_background_task", json!({"tmux_session": name}))
            .await
    }

    /// Poll until `pred` holds, at most `secs`.
    async fn until(&self, name: &str, secs: u64, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.check(name).await;
            if pred(&v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: condition not met in {secs} s: {v}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Put `tool` in `bin` as a shell script running `body(the real tool's path)`.
fn wrap(bin: &std::path::Path, tool: &str, body: impl Fn(&str) -> String) {
    use std::os::unix::fs::PermissionsExt;
    let real = [format!("/usr/bin/{tool}"), format!("/bin/{tool}")]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| panic!("no {tool} on this machine"));
    let script = bin.join(tool);
    std::fs::write(&script, format!("#!/bin/sh\n{}\n", body(&real))).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// An sshd whose sessions find `bin`'s wrappers first on PATH.
fn sshd_with_path(bin: &std::path::Path) -> Sshd {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    Sshd::start_with(SshdOptions {
        set_env: vec![("PATH".into(), path)],
        ..Default::default()
    })
    .unwrap()
}

fn types(e: &[rsb::store::events::WatchEvent]) -> Vec<String> {
    e.iter().map(|e| e.event_type.clone()).collect()
}

fn has(e: &[rsb::store::events::WatchEvent], t: &str) -> bool {
    e.iter().any(|e| e.event_type == t)
}

/// The time a job wrote into `marker` with `date +%s.%N` as it ended.
fn ended_at(marker: &std::path::Path) -> f64 {
    let text = std::fs::read_to_string(marker).unwrap();
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {text:?}: {e}", marker.display()))
}

fn finished(v: &Value) -> bool {
    v["running"] == json!(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_exit_code_is_the_commands_and_comes_from_the_record() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let s = mcp
        .submit(
            "exit3",
            "echo out-$SLURM_JOB_ID; echo rsb-vars=$(env | grep -c '^RSB_'); \
             scontrol show job $SLURM_JOB_ID | grep -o 'Requeue=[0-9]'; exit 3",
            json!({}),
        )
        .await;
    assert_eq!(s["scheduler"], "slurm", "{s}");
    let id = s["slurm_job_id"].as_str().unwrap().to_string();
    let v = mcp.until("exit3", 60, finished).await;
    assert_eq!(v["state"], "exited", "{v}");
    assert_eq!(v["exit_code"], 3, "{v}");
    assert_eq!(v["slurm_state"], "FAILED", "{v}");
    assert_eq!(v["slurm_job_id"], id.as_str());
    assert_eq!(v["node"], "rsbnode", "{v}");
    // The job ran under Slurm (its environment reached the command).
    assert!(
        v["log_tail"]
            .as_str()
            .unwrap()
            .contains(&format!("out-{id}")),
        "{v}"
    );
    // Issue 43: rsb's submit variables (the spec, the batch script) stayed in the job's
    // environment, and with `requeue` unset the site's default applied.
    let tail = v["log_tail"].as_str().unwrap();
    assert!(tail.contains("rsb-vars=0"), "{v}");
    assert!(tail.contains("Requeue=0"), "{v}");
    let l = mcp.ok("list_background_tasks", json!({})).await;
    let t = l["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tmux_session"] == "exit3")
        .unwrap_or_else(|| panic!("{l}"));
    assert_eq!(t["exit_code"], 3, "{t}");
    assert_eq!(t["scheduler"], "slurm", "{t}");
    assert_eq!(t["restarts"], 0, "{t}");
    assert_eq!(v["restarts"], 0, "{v}");
    // `rsb jobs list` shows Slurm's columns for it.
    let (code, out) = mcp.cli(&["jobs", "list"]);
    assert_eq!(code, Some(0), "{out}");
    let mut lines = out.lines();
    let head: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        head,
        [
            "NAME",
            "STATE",
            "EXIT",
            "DURATION",
            "SCHEDULER",
            "SLURM_JOB_ID",
            "SLURM_STATE",
            "PENDING_REASON",
            "NODE",
            "RESTARTS",
            "COMMAND"
        ],
        "{out}"
    );
    let row: Vec<&str> = lines
        .find(|l| l.starts_with("exit3 "))
        .unwrap_or_else(|| panic!("{out}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..10],
        [
            "exit3",
            "exited",
            "3",
            row[3],
            "slurm",
            id.as_str(),
            "FAILED",
            "-",
            "rsbnode",
            "0"
        ],
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_scancel_from_outside_is_cancelled_and_kill_verifies() {
    let Some(bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let s = mcp.submit("outside", "sleep 300", json!({})).await;
    let id = s["slurm_job_id"].as_str().unwrap().to_string();
    mcp.until("outside", 60, |v| v["state"] == "running").await;
    bed.cmd("scancel", &[&id]).unwrap();
    let v = mcp.until("outside", 60, finished).await;
    assert_eq!(v["reason"], "cancelled", "{v}");
    assert_eq!(v["slurm_state"], "CANCELLED", "{v}");

    // kill_background_task: scancel, then squeue says it ended.
    mcp.submit("tokill", "sleep 300", json!({})).await;
    mcp.until("tokill", 60, |v| v["state"] == "running").await;
    let k = mcp
        .ok("kill_background_task", json!({"tmux_session": "tokill"}))
        .await;
    assert_eq!(k["running"], false, "{k}");
    assert_eq!(k["reason"], "cancelled", "{k}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_three_two_gpu_jobs_one_runs_two_pend_on_resources_and_resources_report_it() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({"partition": "gpu"})).await;
    let l = mcp
        .ok("list_sandboxes", json!({"check_resources": true}))
        .await;
    let r = &l["sandboxes"][0]["slurm"];
    let parts: Vec<&str> = r["partitions"]
        .as_array()
        .unwrap_or_else(|| panic!("{l}"))
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(parts, ["debug", "gpu", "urgent"], "{r}");
    assert_eq!(r["gpus_total"], 2, "{r}");

    for n in ["g1", "g2", "g3"] {
        let s = mcp
            .submit(
                n,
                "echo CUDA=$CUDA_VISIBLE_DEVICES; sleep 120",
                json!({"gpus": 2}),
            )
            .await;
        assert_eq!(s["scheduler"], "slurm", "{s}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let states = loop {
        let mut v = Vec::new();
        for n in ["g1", "g2", "g3"] {
            v.push(mcp.check(n).await);
        }
        let running = v.iter().filter(|x| x["state"] == "running").count();
        // Slurm gives `Resources` to the first job that waits for the GPUs and `Priority` to
        // the ones queued behind it in the same partition (its scheduler stops at the first
        // blocked job); this test bed shows exactly that, so either counts as waiting for
        // resources, and at least one must say Resources.
        let waiting: Vec<&Value> = v.iter().filter(|x| x["state"] == "pending").collect();
        let pending = waiting
            .iter()
            .filter(|x| x["pending_reason"] == "Resources" || x["pending_reason"] == "Priority")
            .count();
        let resources = waiting.iter().any(|x| x["pending_reason"] == "Resources");
        if running == 1 && pending == 2 && resources {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "not 1 running + 2 pending(Resources): {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // RUNNING comes before the batch script's first line reaches the log (the job's wrapper
    // still starting, on a loaded machine): wait for the line, bounded.
    let name = states.iter().find(|x| x["state"] == "running").unwrap()["tmux_session"]
        .as_str()
        .unwrap()
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let run = mcp.check(&name).await;
        if run["log_tail"]
            .as_str()
            .unwrap_or_default()
            .contains("CUDA=0,1")
        {
            break;
        }
        assert!(Instant::now() < deadline, "no CUDA=0,1 in the log: {run}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for n in ["g1", "g2", "g3"] {
        let k = mcp
            .ok("kill_background_task", json!({"tmux_session": n}))
            .await;
        assert_eq!(k["running"], false, "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_hostile_options_reach_sbatch_as_one_argument_or_are_refused() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let marker = sshd.home().join("pwned");
    let m = marker.display().to_string();
    let hostile = [
        json!({"partition": format!("debug; touch {m}")}),
        json!({"partition": format!("debug' $(touch {m}) '")}),
        json!({"partition": format!("debug\ntouch {m}")}),
        json!({"sbatch_args": [format!("--constraint=x\"; touch {m}; \"")]}),
        json!({"sbatch_args": [format!("touch {m}")]}),
        json!({"sbatch_args": ["--output=/tmp/elsewhere"]}),
        json!({"sbatch_args": ["--wrap=touch /tmp/x"]}),
    ];
    for (i, opts) in hostile.iter().enumerate() {
        let (err, v) = mcp
            .call(
                "exec_bash_background",
                json!({"command": "true", "session_name": format!("h{i}"), "watch": false, "slurm": opts}),
            )
            .await;
        assert!(err, "{opts} should be refused: {v}");
        let e = v["error"].as_str().unwrap_or_default();
        assert!(!e.is_empty() && !e.contains('\n'), "{v}");
    }
    // A hostile job name is refused before anything runs.
    let (err, _) = mcp
        .call(
            "exec_bash_background",
            json!({"command": "true", "session_name": "a;touch x", "watch": false}),
        )
        .await;
    assert!(err);
    assert!(!marker.exists(), "a hostile value was executed");
}

/// Polling cost: many jobs, one squeue per tick, counted by a wrapper on the login node's PATH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_many_jobs_cost_one_squeue_per_tick() {
    let Some(_bed) = slurm() else { return };
    let bin = tempfile::tempdir().unwrap();
    let count = bin.path().join("count");
    let sinfo_count = bin.path().join("sinfo-count");
    // Each call of squeue (and sinfo) is logged, then the real one runs.
    for (tool, log) in [("squeue", &count), ("sinfo", &sinfo_count)] {
        wrap(bin.path(), tool, |real| {
            format!("echo \"$*\" >> {}\nexec {real} \"$@\"", log.display())
        });
    }
    let sshd = sshd_with_path(bin.path());
    let mcp = Mcp::start(&sshd, json!({"sbatch_args": ["--hold"]})).await;
    const N: usize = 30;
    for i in 0..N {
        mcp.submit(&format!("p{i}"), "true", json!({})).await;
    }
    // Issue 43: the cluster's node list (for the path warning: the bed's home is on a local
    // file system) is asked once, not per submit.
    let sinfos = std::fs::read_to_string(&sinfo_count)
        .unwrap_or_default()
        .lines()
        .count();
    assert_eq!(sinfos, 1, "sinfo calls for {N} submits");
    let before = std::fs::read_to_string(&count)
        .unwrap_or_default()
        .lines()
        .count();
    let t0 = Instant::now();
    let all: Vec<Value> = futures::future::join_all(
        (0..N).map(|i| mcp.check(Box::leak(format!("p{i}").into_boxed_str()))),
    )
    .await;
    let elapsed = t0.elapsed();
    let after = std::fs::read_to_string(&count)
        .unwrap_or_default()
        .lines()
        .count();
    for v in &all {
        assert_eq!(v["state"], "pending", "{v}");
        assert_eq!(v["pending_reason"], "JobHeldUser", "{v}");
    }
    let ticks = elapsed.as_secs_f64() / 2.0;
    eprintln!(
        "{N} checks took {:.2} s and cost {} squeue calls",
        elapsed.as_secs_f64(),
        after - before
    );
    assert!(
        (after - before) as f64 <= ticks.ceil().max(1.0),
        "{} squeue calls for {N} checks in {:.2} s",
        after - before,
        elapsed.as_secs_f64()
    );
    // list_background_tasks shows them all through one squeue.
    let b = std::fs::read_to_string(&count).unwrap().lines().count();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let l = mcp.ok("list_background_tasks", json!({})).await;
    assert_eq!(l["tasks"].as_array().unwrap().len(), N, "{l}");
    let a = std::fs::read_to_string(&count).unwrap().lines().count();
    assert!(a - b <= 1, "list cost {} squeue calls", a - b);
    for i in 0..N {
        mcp.ok(
            "kill_background_task",
            json!({"tmux_session": format!("p{i}")}),
        )
        .await;
    }
    // Issue 43: an ended job's final state is kept, never asked again (as submitit does):
    // three more ticks of checks of all of them cost no squeue call.
    let b = std::fs::read_to_string(&count).unwrap().lines().count();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let all: Vec<Value> = futures::future::join_all(
            (0..N).map(|i| mcp.check(Box::leak(format!("p{i}").into_boxed_str()))),
        )
        .await;
        for v in &all {
            assert_eq!(v["slurm_state"], "CANCELLED", "{v}");
        }
    }
    let a = std::fs::read_to_string(&count).unwrap().lines().count();
    assert_eq!(a - b, 0, "ended jobs were polled again");
}

/// The time limit squeue shows for job `id` (`%l`), as the sandbox's own squeue prints it.
async fn time_limit(mcp: &Mcp, id: &str) -> String {
    let v = mcp
        .ok(
            "exec_bash",
            json!({"command": format!("squeue -h -j {id} -o %l")}),
        )
        .await;
    v["stdout"].as_str().unwrap_or_default().trim().to_string()
}

/// Issue 43: `rsb jobs start` on a Slurm login node submits through sbatch, as
/// exec_bash_background does (a Slurm id, with --slurm's options), never tmux on the login
/// node; `rsb jobs kill` cancels it through scancel, and Slurm says CANCELLED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_rsb_jobs_start_submits_and_kill_cancels() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let (code, out) = mcp.cli(&[
        "--json",
        "jobs",
        "start",
        "--name",
        "clij",
        "--slurm",
        r#"{"time": "0:05:00", "job_name_suffix": 1}"#,
        "--",
        "sleep 300",
    ]);
    assert_eq!(
        code,
        Some(1),
        "an unknown --slurm key is a usage error: {out}"
    );
    let (code, out) = mcp.cli(&[
        "--json",
        "jobs",
        "start",
        "--name",
        "clij",
        "--slurm",
        r#"{"time": "0:05:00"}"#,
        "--",
        "sleep 300",
    ]);
    assert_eq!(code, Some(0), "{out}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["scheduler"], "slurm", "{v}");
    let id = v["slurm_job_id"].as_str().unwrap().to_string();
    let running = mcp
        .until("clij", 60, |v| v["slurm_state"] == "RUNNING")
        .await;
    assert_eq!(running["slurm_job_id"], id.as_str(), "{running}");
    // --slurm's time limit reached sbatch.
    assert_eq!(time_limit(&mcp, &id).await, "5:00");
    let (code, out) = mcp.cli(&["jobs", "kill", "clij"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("clij") && out.contains("CANCELLED"), "{out}");
    let v = mcp.until("clij", 30, finished).await;
    assert_eq!(v["slurm_state"], "CANCELLED", "{v}");
    // exec_bash_background_watch takes the same options.
    let w = mcp
        .ok(
            "exec_bash_background_watch",
            json!({"command": "sleep 300", "session_name": "wslurm", "slurm": {"time": "0:03:00"},
                   "ensure_watchdog": false, "notify_local": false}),
        )
        .await;
    let wid = w["slurm_job_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{w}"))
        .to_string();
    assert_eq!(time_limit(&mcp, &wid).await, "3:00");
    mcp.ok("kill_background_task", json!({"tmux_session": "wslurm"}))
        .await;
    // --slurm on a sandbox that is not a login node is refused.
    let plain = Mcp::start_entry(&sshd, json!({})).await;
    let (code, _) = plain.cli(&["jobs", "start", "--slurm", "{}", "--", "true"]);
    assert_eq!(code, Some(1));
}

/// Issue 43: a submit whose reply is lost (the connection cut after sbatch submitted the job,
/// before its answer came back) is looked up by its launch id on a fresh connection: the reply
/// names the job it found, and nothing is submitted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_a_submit_whose_reply_is_lost_is_found_on_a_fresh_connection() {
    let Some(_bed) = slurm() else { return };
    let bin = tempfile::tempdir().unwrap();
    let mark = bin.path().join("submitted");
    // The real sbatch, then a pause before its answer goes back.
    wrap(bin.path(), "sbatch", |real| {
        format!(
            "{real} \"$@\"; rc=$?\ntouch {}\nsleep 5\nexit $rc",
            mark.display()
        )
    });
    let sshd = sshd_with_path(bin.path());
    let proxy = ChaosProxy::start(format!("127.0.0.1:{}", sshd.port()).parse().unwrap()).unwrap();
    let mcp = Mcp::start_entry(
        &sshd,
        json!({"scheduler": "slurm", "slurm": {}, "port": proxy.port()}),
    )
    .await;
    mcp.ok("exec_bash", json!({"command": "true"})).await;
    let cutter = {
        let mark = mark.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !mark.exists() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            proxy.cut();
            proxy
        })
    };
    let v = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "sleep 60", "session_name": "lost", "watch": false}),
        )
        .await;
    let _proxy = cutter.await.unwrap();
    assert!(mark.exists(), "sbatch never ran");
    assert!(
        v["note"]
            .as_str()
            .unwrap_or_default()
            .contains("reply was lost"),
        "{v}"
    );
    let id = v["slurm_job_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string();
    let q = mcp
        .ok(
            "exec_bash",
            json!({"command": "squeue -h -n rsb-lost -o %i"}),
        )
        .await;
    assert_eq!(
        q["stdout"].as_str().unwrap_or_default().trim(),
        id,
        "one job: {q}"
    );
    mcp.ok("kill_background_task", json!({"tmux_session": "lost"}))
        .await;
}

/// Issue 48: on a confined sandbox a Slurm job's command is confined by the agent's wrapper on
/// the compute node: it changes nothing outside the roots (rm, python), reads nothing outside
/// the read roots, writes inside them, and the wrapper still writes the log outside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_a_confined_jobs_command_keeps_to_the_write_roots() {
    let Some(_bed) = slurm() else { return };
    // SAFETY: a null attribute with size 0 and the version flag only asks for the ABI.
    let abi = unsafe { libc::syscall(444, std::ptr::null::<u8>(), 0usize, 1u32) };
    assert!(
        abi >= 2,
        "this test needs Landlock ABI 2 or later (this kernel: {abi})"
    );
    let sshd = Sshd::start().unwrap();
    let h = sshd.home().to_path_buf();
    std::fs::create_dir_all(h.join("scratch")).unwrap();
    std::fs::create_dir_all(h.join("data")).unwrap();
    std::fs::create_dir_all(h.join("outside/dir")).unwrap();
    std::fs::write(h.join("outside/keep.txt"), "keep me\n").unwrap();
    std::fs::write(h.join("data/in.txt"), "data\n").unwrap();
    let before = std::fs::read(h.join("outside/keep.txt")).unwrap();
    let mcp = Mcp::start_entry(
        &sshd,
        json!({"scheduler": "slurm", "slurm": {},
               "confine": {"write": ["~/scratch"], "read": ["~/data"]}}),
    )
    .await;
    // Reads too keep to the roots (and the system's directories, where python3 lives).
    mcp.submit(
        "confined",
        "rm -rf ~/outside; python3 -c \"import os; os.remove(os.path.expanduser('~/outside/keep.txt'))\"; \
         cat ~/outside/keep.txt > ~/scratch/stolen.txt; cat ~/data/in.txt > ~/scratch/read.txt; \
         echo inside > ~/scratch/job.txt; echo job-done",
        json!({}),
    )
    .await;
    let v = mcp.until("confined", 60, finished).await;
    let tail = v["log_tail"].as_str().unwrap_or_default();
    assert!(tail.contains("job-done"), "{v}");
    assert!(tail.contains("Permission denied"), "{v}");
    assert_eq!(std::fs::read(h.join("outside/keep.txt")).unwrap(), before);
    assert!(h.join("outside/dir").is_dir());
    assert_eq!(
        std::fs::read_to_string(h.join("scratch/job.txt")).unwrap(),
        "inside\n"
    );
    assert_eq!(
        std::fs::read_to_string(h.join("scratch/read.txt")).unwrap(),
        "data\n"
    );
    assert_eq!(
        std::fs::read_to_string(h.join("scratch/stolen.txt")).unwrap(),
        ""
    );
}

/// `--time=0:01` (Slurm rounds to one minute and checks the limit about every 30 s): the job
/// ends as timeout, with the command's own end on record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_time_limit_is_reported_as_timeout() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    mcp.submit("late", "sleep 600", json!({"time": "0:01"}))
        .await;
    let v = mcp.until("late", 150, finished).await;
    assert_eq!(v["reason"], "timeout", "{v}");
    assert_eq!(v["slurm_state"], "TIMEOUT", "{v}");
    assert_eq!(v["state"], "exited", "{v}");
    // Issue 49: why it failed, in Slurm's word.
    assert_eq!(v["failure_reason"], "time_limit", "{v}");
}

/// Discovery (issue 22): `rsb doctor` on a host where sbatch and sinfo answer tells a sandbox
/// not declared `scheduler = "slurm"` how to declare it, and reports a declared one's
/// partitions; either way it reports the host's tools.
#[test]
fn doctor_notices_a_login_node_and_reports_its_partitions() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let doctor = |declared: bool| -> (Option<i32>, Vec<Value>) {
        let mut e = json!({"name": "login", "host": sshd.host(), "port": sshd.port(),
                           "user": sshd.user(),
                           "key_file": sshd.client_key().display().to_string()});
        if declared {
            e["scheduler"] = "slurm".into();
        }
        let out = std::process::Command::new(workspace_root().join("target/debug/rsb"))
            .args(["--json", "doctor"])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
            .env("RSB_STATE_DIR", tmp.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", Value::Array(vec![e]).to_string())
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        let checks = v["checks"].as_array().unwrap().clone();
        (
            out.status.code(),
            checks
                .into_iter()
                .filter(|c| c["sandbox"] == "login")
                .collect(),
        )
    };
    let check = |cs: &[Value], name: &str| -> Value {
        cs.iter()
            .find(|c| c["check"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} check in {cs:?}"))
    };
    let (code, cs) = doctor(false);
    assert_eq!(code, Some(0), "{cs:?}");
    let s = check(&cs, "slurm");
    assert_eq!(s["verdict"], "warn", "{s}");
    let d = s["detail"].as_str().unwrap();
    assert!(
        d.contains("scheduler = \"slurm\"") && d.contains("gpu"),
        "{d}"
    );
    assert_eq!(check(&cs, "host")["verdict"], "ok");
    let (code, cs) = doctor(true);
    assert_eq!(code, Some(0), "{cs:?}");
    let s = check(&cs, "slurm");
    assert_eq!(s["verdict"], "ok", "{s}");
    assert!(
        s["detail"]
            .as_str()
            .unwrap()
            .starts_with("partitions: debug*"),
        "{s}"
    );
}

/// A node set DOWN ends a `--no-requeue` job as NODE_FAIL: the watchdog calls it interrupted
/// and resumes it by its plan, resubmitting once (the launch id); the same node failure
/// with `requeue=true` is Slurm's own restart: resuming, and never resubmitted by rsb.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_node_down_interrupts_and_resubmits_or_is_requeued_by_slurm_alone() {
    let Some(bed) = slurm_exclusive() else { return };
    let node = bed.env["RSB_SLURM_NODE"].clone();
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let _daemon = mcp.daemon();
    let a = mcp
        .submit_watched("nd-norq", "sleep 300", json!({"requeue": false}), true)
        .await;
    let b = mcp
        .submit_watched("nd-rq", "sleep 300", json!({"requeue": true}), true)
        .await;
    // Issue 43: a job submitted unwatched and watched afterwards (its plan has no options)
    // is resubmitted with the options it was submitted with, read from its spec.
    let c = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "sleep 300", "session_name": "nd-late", "watch": false,
                   "slurm": {"requeue": false, "time": "0:07:00"}}),
        )
        .await;
    // Issue 49: an unwatched job on the node that goes down says why it failed.
    let p = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "sleep 300", "session_name": "nd-plain", "watch": false,
                   "slurm": {"requeue": false}}),
        )
        .await;
    assert_eq!(p["status"], "started", "{p}");
    let wc = mcp
        .ok(
            "watch_background_task",
            json!({"tmux_session": "nd-late", "log_file": c["log_file"], "interval_s": 1,
                   "auto_resume": true, "resume_delay_s": 0, "max_resume_attempts": 1,
                   "resume_command": "sleep 300", "checkpoint_path": "ck.txt",
                   "ensure_watchdog": false, "notify_local": false}),
        )
        .await["watch_id"]
        .as_i64()
        .unwrap();
    let (wa, wb) = (
        a["watch_id"].as_i64().unwrap(),
        b["watch_id"].as_i64().unwrap(),
    );
    let (ida, idb) = (
        a["slurm_job_id"].as_str().unwrap().to_string(),
        b["slurm_job_id"].as_str().unwrap().to_string(),
    );
    mcp.until("nd-norq", 60, |v| v["state"] == "running").await;
    mcp.until("nd-rq", 60, |v| v["state"] == "running").await;
    mcp.until("nd-late", 60, |v| v["state"] == "running").await;
    mcp.until("nd-plain", 60, |v| v["state"] == "running").await;
    // The daemon saw them running before the failure.
    for w in [wa, wb, wc] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while mcp.watch(w).last_state != "running" {
            assert!(Instant::now() < deadline, "{:?}", mcp.watch(w));
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let down = Instant::now();
    bed.cmd(
        "scontrol",
        &[
            "update",
            &format!("nodename={node}"),
            "state=down",
            "reason=rsb-test",
        ],
    )
    .unwrap();

    // --no-requeue: interrupted (node_fail), then resubmitted once.
    let e = mcp
        .until_events(wa, 60, |e| {
            has(e, "interrupted") && has(e, "resume_started")
        })
        .await;
    let took = down.elapsed();
    let i = e.iter().find(|e| e.event_type == "interrupted").unwrap();
    assert_eq!(i.payload["job_state"], "node_fail", "{:?}", i.payload);
    assert_eq!(i.payload["slurm_state"], "NODE_FAIL", "{:?}", i.payload);
    assert_eq!(i.payload["slurm_job_id"], ida.as_str());
    let v = mcp
        .until("nd-plain", 60, |v| v["slurm_state"] == "NODE_FAIL")
        .await;
    assert_eq!(v["state"], "interrupted", "{v}");
    assert_eq!(v["failure_reason"], "node_fail", "{v}");
    let v = mcp.check("nd-norq").await;
    let resubmitted = v["slurm_job_id"].as_str().unwrap().to_string();
    assert_ne!(resubmitted, ida, "resumed by a new Slurm job: {v}");
    eprintln!(
        "node DOWN -> interrupted + resubmitted in {:.1} s",
        took.as_secs_f64()
    );
    mcp.until_events(wc, 60, |e| has(e, "resume_started")).await;
    let v = mcp.check("nd-late").await;
    let late = v["slurm_job_id"].as_str().unwrap().to_string();
    assert_ne!(late, c["slurm_job_id"].as_str().unwrap(), "{v}");
    let limit = mcp
        .ok(
            "exec_bash",
            json!({"command": format!("squeue -h -j {late} -o %l")}),
        )
        .await;
    assert_eq!(
        limit["stdout"].as_str().unwrap_or_default().trim(),
        "7:00",
        "resubmitted with its time limit: {limit}"
    );

    // requeue=true: resuming by Slurm's own restart; rsb does not resubmit.
    let e = mcp.until_events(wb, 60, |e| has(e, "requeued")).await;
    let r = e.iter().find(|e| e.event_type == "requeued").unwrap();
    assert_eq!(r.payload["slurm_job_id"], idb.as_str(), "{:?}", r.payload);
    // Slurm may list the requeued job as PENDING a moment before its Restarts count goes up
    // (seen once: Priority, Restarts=0): resuming either way, since it had run.
    let v = mcp
        .until("nd-rq", 30, |v| {
            v["restarts"] == 1 || v["state"] != "resuming"
        })
        .await;
    assert_eq!(v["state"], "resuming", "{v}");
    assert_eq!(v["restarts"], 1, "{v}");
    assert_eq!(v["slurm_job_id"], idb.as_str(), "{v}");
    let (_, out) = mcp.cli(&["--json", "jobs", "list"]);
    let l: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let t = l["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tmux_session"] == "nd-rq")
        .cloned()
        .unwrap_or_else(|| panic!("{l}"));
    assert_eq!(
        (t["state"].clone(), t["restarts"].clone()),
        (json!("resuming"), json!(1)),
        "{t}"
    );
    // Several more checks of both watches: still one resubmit of the first, none of the
    // second, whatever the record of its killed first run says.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(mcp.watch(wb).last_state, "resuming");
    assert!(
        !has(&mcp.events(wb), "resume_started"),
        "{:?}",
        types(&mcp.events(wb))
    );
    assert!(
        !has(&mcp.events(wb), "interrupted"),
        "{:?}",
        types(&mcp.events(wb))
    );
    let starts = mcp
        .events(wa)
        .iter()
        .filter(|e| e.event_type == "resume_started")
        .count();
    assert_eq!(starts, 1, "{:?}", types(&mcp.events(wa)));
    assert_eq!(mcp.check("nd-rq").await["slurm_job_id"], idb.as_str());

    // The node back: the resubmitted job runs its resume command and completes.
    bed.restore();
    let e = mcp.until_events(wa, 90, |e| has(e, "completed")).await;
    let c = e.iter().find(|e| e.event_type == "completed").unwrap();
    assert_eq!(c.payload["exit_code"], 0, "{:?}", c.payload);
    assert_eq!(c.payload["slurm_job_id"], resubmitted.as_str());
    let v = mcp.check("nd-norq").await;
    assert!(v["log_tail"].as_str().unwrap().contains("resumed-1"), "{v}");
    mcp.ok("kill_background_task", json!({"tmux_session": "nd-rq"}))
        .await;
}

/// A job of a higher-tier partition (`urgent`) preempts a `--no-requeue` job: interrupted
/// (preempted), never completed, in the tool's reply and in the watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_preemption_is_interrupted_never_completed() {
    let Some(_bed) = slurm_exclusive() else {
        return;
    };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let _daemon = mcp.daemon();
    let low = mcp
        .submit_watched(
            "low",
            "sleep 300",
            json!({"partition": "debug", "cpus": 2, "requeue": false}),
            false,
        )
        .await;
    let w = low["watch_id"].as_i64().unwrap();
    mcp.until("low", 60, |v| v["state"] == "running").await;
    mcp.submit(
        "high",
        "sleep 300",
        json!({"partition": "urgent", "cpus": 3}),
    )
    .await;
    let v = mcp.until("low", 90, finished).await;
    assert_eq!(v["state"], "interrupted", "{v}");
    assert_eq!(v["reason"], "preempted", "{v}");
    assert_eq!(v["slurm_state"], "PREEMPTED", "{v}");
    let e = mcp.until_events(w, 30, |e| has(e, "interrupted")).await;
    assert!(!has(&e, "completed"), "{:?}", types(&e));
    let i = e.iter().find(|e| e.event_type == "interrupted").unwrap();
    assert_eq!(i.payload["job_state"], "preempted", "{:?}", i.payload);
    mcp.until("high", 60, |v| v["state"] == "running").await;
    mcp.ok("kill_background_task", json!({"tmux_session": "high"}))
        .await;
}

/// MinJobAge=10: the job is purged before rsb ever polls it, and still gets its exit code,
/// from the wrapper's record, in the check's reply and in its watch (the daemon starts after
/// the purge). The bed is restarted with the knob, and back without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_a_job_purged_before_the_first_poll_gets_its_code_from_the_record() {
    let Some(bed) = slurm_exclusive() else { return };
    // start.sh leaves running daemons (and their config) alone: a new knob needs a stop.
    bed.stop().unwrap();
    bed.start_with(&[("RSB_SLURM_MIN_JOB_AGE", "10")]).unwrap();
    let age = bed.cmd("scontrol", &["show", "config"]).unwrap();
    assert!(
        age.lines()
            .any(|l| l.starts_with("MinJobAge") && l.contains("10 sec")),
        "the bed did not take MinJobAge=10"
    );
    let sshd = Sshd::start().unwrap();
    // A session that follows its jobs' ends would ask Slurm before the purge.
    let mcp = Mcp::start_unfollowed(&sshd, json!({})).await;
    let s = mcp
        .submit_watched("purged", "exit 5", json!({}), false)
        .await;
    let w = s["watch_id"].as_i64().unwrap();
    let id = s["slurm_job_id"].as_str().unwrap().to_string();
    // Not through rsb: wait until the controller no longer knows the job.
    let t0 = Instant::now();
    loop {
        let out = std::process::Command::new("squeue")
            .args(["-h", "-t", "all", "-j", &id, "-o", "%T"])
            .output()
            .unwrap();
        if !out.status.success() || out.stdout.trim_ascii().is_empty() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "job {id} never purged"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "job {id} purged {:.0} s after its submit",
        t0.elapsed().as_secs_f64()
    );
    let v = mcp.check("purged").await;
    assert_eq!(v["state"], "exited", "{v}");
    assert_eq!(v["exit_code"], 5, "{v}");
    assert_eq!(v["running"], false, "{v}");
    assert!(
        v.get("slurm_state").is_none(),
        "Slurm had nothing to say: {v}"
    );
    let _daemon = mcp.daemon();
    let e = mcp.until_events(w, 30, |e| has(e, "completed")).await;
    let c = e.iter().find(|e| e.event_type == "completed").unwrap();
    assert_eq!(c.payload["exit_code"], 5, "{:?}", c.payload);
    assert_eq!(mcp.watch(w).status, "completed");
}

/// The controller stopped while a job ends: `scheduler_unreachable` (in the reply, within
/// its own bound, and as the watch's state), never lost or final; after the restart, the
/// right end (FAILED, exit 4) in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_controller_down_is_scheduler_unreachable_then_the_right_end() {
    let Some(bed) = slurm_exclusive() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let _daemon = mcp.daemon();
    let s = mcp
        .submit_watched("ctl", "sleep 6; exit 4", json!({}), true)
        .await;
    let w = s["watch_id"].as_i64().unwrap();
    mcp.until("ctl", 60, |v| v["state"] == "running").await;
    bed.stop_controller().unwrap();
    let killed = Instant::now();
    // The first answer that says so comes from the first poll after the stop, still held by
    // squeue (9-18 s): a submit now is refused at once, in one line, instead of waiting on
    // sbatch for the whole of its timeout.
    let deadline = Instant::now() + Duration::from_secs(30);
    while mcp.check("ctl").await["state"] != "scheduler_unreachable" {
        assert!(Instant::now() < deadline, "never scheduler_unreachable");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let t = Instant::now();
    let (err, r) = mcp
        .call(
            "exec_bash_background",
            json!({"command": "true", "session_name": "while-down", "watch": false}),
        )
        .await;
    assert!(err, "{r}");
    let msg = r["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("controller is not answering") && !msg.contains('\n'),
        "{r}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    // Every call answers within the poll's bound, controller or not.
    let mut slowest = Duration::ZERO;
    let deadline = Instant::now() + Duration::from_secs(60);
    let v = loop {
        let t = Instant::now();
        let v = mcp.check("ctl").await;
        slowest = slowest.max(t.elapsed());
        if v["state"] == "scheduler_unreachable" && v["exit_code"] == 4 {
            break v;
        }
        assert_ne!(v["state"], "lost", "{v}");
        assert!(Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(v["running"], false, "{v}");
    assert!(v["scheduler_error"].as_str().is_some(), "{v}");
    assert!(
        slowest < Duration::from_secs(8),
        "a check took {slowest:?} while the controller was down"
    );
    let e = mcp
        .until_events(w, 60, |e| has(e, "scheduler_unreachable"))
        .await;
    assert!(
        !has(&e, "completed") && !has(&e, "interrupted"),
        "{:?}",
        types(&e)
    );
    assert_eq!(mcp.watch(w).status, "active");
    eprintln!(
        "controller down {:.0} s; slowest check {:.2} s",
        killed.elapsed().as_secs_f64(),
        slowest.as_secs_f64()
    );
    bed.restore();
    let v = mcp
        .until("ctl", 120, |v| v["slurm_state"] == "FAILED")
        .await;
    assert_eq!(
        (v["state"].clone(), v["exit_code"].clone()),
        (json!("exited"), json!(4)),
        "{v}"
    );
    let e = mcp.until_events(w, 60, |e| has(e, "completed")).await;
    let c = e.iter().find(|e| e.event_type == "completed").unwrap();
    assert_eq!(c.payload["exit_code"], 4, "{:?}", c.payload);
    assert!(
        !has(&e, "interrupted") && !has(&e, "resume_started"),
        "{:?}",
        types(&e)
    );
}

/// `--mem=50M` and a command that needs far more: OUT_OF_MEMORY. This bed enforces memory
/// through a cgroup (task/cgroup) where the kernel gives it a writable tree; without one it
/// can only kill the job (FAILED 0:9, JobLaunchFailure) and Slurm never says OUT_OF_MEMORY,
/// so then the test expects that and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_over_the_memory_limit_is_out_of_memory() {
    let Some(bed) = slurm() else { return };
    let cgroup = bed.env.get("RSB_SLURM_CGROUP").cloned().unwrap_or_default();
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let _daemon = mcp.daemon();
    let s = mcp
        .submit_watched(
            "oom",
            "s=$(head -c 400000000 /dev/zero | tr '\\0' x); echo ${#s}",
            json!({"mem": "50M"}),
            true,
        )
        .await;
    let w = s["watch_id"].as_i64().unwrap();
    let v = mcp.until("oom", 90, finished).await;
    if cgroup == "none" {
        eprintln!("no writable cgroup here: Slurm kills the job without saying OUT_OF_MEMORY");
        assert_eq!(v["slurm_state"], "FAILED", "{v}");
        return;
    }
    assert_eq!(v["slurm_state"], "OUT_OF_MEMORY", "{v}");
    assert_eq!(v["reason"], "out_of_memory", "{v}");
    let e = mcp.until_events(w, 30, |e| has(e, "out_of_memory")).await;
    assert!(!has(&e, "resume_started"), "not resumed: {:?}", types(&e));
    assert_eq!(mcp.watch(w).status, "completed");
}

/// A watched job's end reaches the watch within a tick or two, and the check tool sees it
/// within the poll's tick plus 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_a_watched_jobs_end_is_seen_within_a_tick_and_two_seconds() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let _daemon = mcp.daemon();
    let marker = sshd.home().join("ended-at");
    let m = marker.display().to_string();
    let s = mcp
        .submit_watched(
            "quick",
            &format!("sleep 3; date +%s.%N > {m}; exit 7"),
            json!({}),
            true,
        )
        .await;
    let w = s["watch_id"].as_i64().unwrap();
    let v = mcp.until("quick", 60, finished).await;
    let seen_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert_eq!(
        v["exit_code"],
        7,
        "{v}; the watch's events: {:?}",
        mcp.events(w)
            .iter()
            .map(|e| format!("{}: {}", e.event_type, e.summary))
            .collect::<Vec<_>>()
    );
    let ended = ended_at(&marker);
    let lag = seen_at - ended;
    let e = mcp.until_events(w, 30, |e| has(e, "completed")).await;
    let c = e.iter().find(|e| e.event_type == "completed").unwrap();
    assert_eq!(c.payload["exit_code"], 7);
    let watch_lag = c.created_ts as f64 - ended;
    eprintln!("job end -> check_background_task {lag:.2} s; -> watch event {watch_lag:.1} s");
    // 0.5 s between this test's polls on top of the 2 s tick, plus 2 s.
    assert!(lag <= 2.0 + 2.0 + 0.5, "the end showed {lag:.2} s late");
    assert!(
        watch_lag <= 6.0,
        "the watch saw the end {watch_lag:.1} s late"
    );
}

/// Issue 40's Slurm part: at default settings (no `interval_s`: 300 s) a Slurm job's end
/// reaches its watch within seconds. The daemon follows job ends on the login node too (the
/// wrapper's record on the shared home, written on the compute node), and the check it starts
/// asks Slurm why through the shared poll, again at its tick while Slurm closes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_a_jobs_end_reaches_its_watch_within_seconds_at_default_settings() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let _daemon = mcp.daemon();
    let marker = sshd.home().join("ended-at");
    let m = marker.display().to_string();
    let s = mcp
        .ok(
            "exec_bash_background",
            json!({"command": format!("sleep 4; date +%s.%N > {m}; exit 6"),
                   "session_name": "default", "watch": true, "ensure_watchdog": false,
                   "notify_local": false}),
        )
        .await;
    let w = s["watch_id"].as_i64().unwrap_or_else(|| panic!("{s}"));
    assert_eq!(mcp.watch(w).interval_s, 300, "the default interval");
    let e = mcp.until_events(w, 60, |e| has(e, "completed")).await;
    let c = e.iter().find(|e| e.event_type == "completed").unwrap();
    assert_eq!(c.payload["exit_code"], 6, "{:?}", c.payload);
    let ended = ended_at(&marker);
    // created_ts is whole seconds.
    let lag = c.created_ts as f64 - ended;
    eprintln!("job end -> watch event {lag:.1} s at interval_s 300");
    assert!(lag <= 5.0, "the watch saw the end {lag:.1} s late");
}

/// The job's processes as root sees them here: those whose environment names Slurm job `id`
/// and whose command line holds `word`.
fn job_processes(id: &str, word: &str) -> Vec<u32> {
    let want = format!("SLURM_JOB_ID={id}");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let read = |f: &str| std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default();
            let env = read("environ");
            let cmd = read("cmdline");
            env.split(|b| *b == 0).any(|v| v == want.as_bytes())
                && cmd.split(|b| *b == 0).any(|a| a == word.as_bytes())
        })
        .collect()
}

/// Issue 43, a real cluster's shape: the job's wrapper is SIGKILLed on the compute node
/// (on the two-host bed, another host: its record says so and nothing on the login node can
/// see its pid), so it never writes its end. Slurm's word ends the job: the reply and the
/// watch agree within two ticks, none stays `running`, and `rsb jobs logs -f` and `rsb jobs
/// rm` return instead of waiting on a record that will never end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_a_wrapper_killed_on_the_compute_node_ends_the_job_and_its_watch() {
    let Some(bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let _daemon = mcp.daemon();
    let s = mcp
        .submit_watched(
            "wrapkill",
            "echo on-$(hostname); sleep 300",
            json!({}),
            false,
        )
        .await;
    let id = s["slurm_job_id"].as_str().unwrap().to_string();
    let w = s["watch_id"].as_i64().unwrap();
    // A second, unwatched, for `rsb jobs prune`.
    let s2 = mcp.submit("wrapkill2", "sleep 300", json!({})).await;
    let id2 = s2["slurm_job_id"].as_str().unwrap().to_string();
    mcp.until("wrapkill2", 60, |v| v["state"] == "running")
        .await;
    let v = mcp
        .until("wrapkill", 60, |v| {
            v["state"] == "running" && v["log_tail"].as_str().is_some_and(|t| t.contains("on-"))
        })
        .await;
    let host = bed
        .env
        .get("RSB_SLURM_NODE_HOST")
        .cloned()
        .unwrap_or_default();
    if bed.env.get("RSB_SLURM_TWO_HOSTS").map(String::as_str) == Some("1") {
        // The shape this test is for: the job ran on the compute host, not the login node.
        let login = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        assert_ne!(host, login);
        assert!(
            v["log_tail"]
                .as_str()
                .unwrap()
                .contains(&format!("on-{host}")),
            "{v}"
        );
    }
    let kill_wrapper = |id: &str| {
        let wrappers = job_processes(id, "job-run");
        assert_eq!(wrappers.len(), 1, "the wrapper of job {id}: {wrappers:?}");
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(wrappers[0] as i32).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
    };
    kill_wrapper(&id2);
    let killed_at = Instant::now();
    kill_wrapper(&id);
    let v = mcp.until("wrapkill", 30, finished).await;
    let reply_lag = killed_at.elapsed();
    assert_ne!(v["state"], "running", "{v}");
    assert_eq!(v["slurm_state"], "FAILED", "{v}");
    let e = mcp
        .until_events(w, 30, |e| has(e, "failed") || has(e, "interrupted"))
        .await;
    let watch_lag = killed_at.elapsed();
    assert!(!has(&e, "completed"), "{:?}", types(&e));
    let watch = mcp.watch(w);
    assert_ne!(watch.last_state, "running", "{watch:?}");
    eprintln!(
        "wrapper killed -> check_background_task {:.1} s, -> watch {:.1} s",
        reply_lag.as_secs_f64(),
        watch_lag.as_secs_f64()
    );
    // Two 2 s poll ticks, and the test's own 0.5 s and 0.25 s polls.
    assert!(reply_lag < Duration::from_secs(5), "{reply_lag:?}");
    // The CLI on the same job: both return, and say what they know.
    let t0 = Instant::now();
    let (code, out) = mcp.cli(&["jobs", "logs", "-f", "wrapkill"]);
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "logs -f took {:?}",
        t0.elapsed()
    );
    // No exit code exists (the wrapper died before recording one): 4, as for a lost job.
    assert_eq!(code, Some(4), "{out}");
    assert!(out.contains(&format!("on-{host}")), "{out}");
    let (code, out) = mcp.cli(&["jobs", "rm", "wrapkill"]);
    assert_eq!(code, Some(0), "{out}");
    mcp.until("wrapkill2", 30, finished).await;
    let (code, out) = mcp.cli(&["jobs", "prune"]);
    assert_eq!((code, out.as_str()), (Some(0), "wrapkill2\n"), "{out}");
    let (_, list) = mcp.cli(&["jobs", "list"]);
    assert!(!list.contains("wrapkill"), "{list}");
}

/// First-connect discovery: a sandbox not declared `scheduler = "slurm"` whose host answers
/// sbatch and sinfo gets the hint (in `list_sandboxes` and the server's log) from a probe
/// run once, after its first connect and off its path; a declared one gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_first_connect_notices_an_undeclared_login_node_in_the_background() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    // The agent's first deploy to this home, so both timings below are of a warm connect.
    Mcp::start(&sshd, json!({}))
        .await
        .ok("exec_bash", json!({"command": "true"}))
        .await;
    let mut firsts = Vec::new();
    for declared in [false, true] {
        let mcp = if declared {
            Mcp::start(&sshd, json!({})).await
        } else {
            Mcp::start_entry(&sshd, json!({})).await
        };
        let t0 = Instant::now();
        mcp.ok("exec_bash", json!({"command": "true"})).await;
        firsts.push(t0.elapsed());
        let deadline = Instant::now() + Duration::from_secs(if declared { 3 } else { 20 });
        let row = loop {
            let l = mcp.ok("list_sandboxes", json!({})).await;
            let row = l["sandboxes"][0].clone();
            if row.get("hint").is_some() || Instant::now() >= deadline {
                break row;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if declared {
            assert!(row.get("hint").is_none(), "{row}");
        } else {
            let h = row["hint"]
                .as_str()
                .unwrap_or_else(|| panic!("no hint: {row}"));
            assert!(
                h.contains("scheduler = \"slurm\"") && h.contains("debug"),
                "{h}"
            );
        }
    }
    eprintln!(
        "first exec_bash (connect included): {:.0} ms undeclared (probe in the background), {:.0} ms declared (no probe)",
        firsts[0].as_secs_f64() * 1000.0,
        firsts[1].as_secs_f64() * 1000.0
    );
}

/// Mark watch `id` as a daemon killed mid-resume leaves it: attempt counted, intent recorded
/// with `launch_id` for job `session`.
fn cut_resume(state: &std::path::Path, id: i64, launch_id: &str, session: &str) {
    let n = rsb::store::open(state)
        .unwrap()
        .execute(
            "UPDATE watches SET resume_attempts = 1, resume_intent_ms = ?2,
               resume_launch_id = ?3, resume_launch_session = ?4, last_state = 'resuming'
             WHERE id = ?1",
            (id, rsb::store::now_ms(), launch_id, session),
        )
        .unwrap();
    assert_eq!(n, 1);
}

/// The Slurm jobs whose comment carries `launch_id` (as root, not through rsb).
fn jobs_of_launch(launch_id: &str) -> Vec<String> {
    let out = std::process::Command::new("squeue")
        .args(["-h", "-t", "all", "-o", "%i|%k"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().split_once('|'))
        .filter(|(_, c)| *c == format!("rsb:{launch_id}"))
        .map(|(i, _)| i.to_string())
        .collect()
}

/// A Slurm resume cut by a daemon kill is repeated with its launch id and submitted once: the
/// repeat after a cut between sbatch and the record (no `slurm_job` file) finds the job by its
/// name and comment, records it again, and submits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_a_resume_cut_by_a_daemon_kill_is_submitted_once() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let s = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "sleep 300", "session_name": "cutj", "watch": true,
                   "ensure_watchdog": false, "interval_s": 1, "auto_resume": true,
                   "resume_delay_s": 0, "max_resume_attempts": 3,
                   "resume_command": "echo run >> ran.txt; sleep 3",
                   "resume_plan_json": json!({"tmux_session": "cutj-r"}).to_string(),
                   "checkpoint_path": "ck.txt", "notify_local": false}),
        )
        .await;
    let w = s["watch_id"].as_i64().unwrap();
    let launch = format!("LS{}", rsb::store::now_ms());
    cut_resume(&mcp.state, w, &launch, "cutj-r");
    let daemon = mcp.daemon();
    mcp.until_events(w, 30, |e| has(e, "resume_started")).await;
    drop(daemon);
    let first = jobs_of_launch(&launch);
    assert_eq!(first.len(), 1, "{first:?}");
    // The cut: sbatch took the job, its id never reached the record.
    let record = sshd.home().join(".cache/rsb/jobs/cutj-r/slurm_job");
    std::fs::remove_file(&record).unwrap();
    cut_resume(&mcp.state, w, &launch, "cutj-r");
    let _daemon = mcp.daemon();
    let deadline = Instant::now() + Duration::from_secs(30);
    while mcp.watch(w).resume_intent_ms != 0 {
        assert!(
            Instant::now() < deadline,
            "{:?}\n{}",
            mcp.watch(w),
            mcp.daemon_log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(jobs_of_launch(&launch), first, "submitted again");
    assert_eq!(
        std::fs::read_to_string(&record).unwrap().trim(),
        first[0],
        "the found job is recorded again"
    );
    let e = mcp.until_events(w, 60, |e| has(e, "completed")).await;
    assert!(!has(&e, "resume_failed"), "{:?}", types(&e));
    let ran = std::fs::read_to_string(sshd.home().join("ran.txt")).unwrap();
    assert_eq!(ran, "run\n", "the resume command ran once");
    mcp.ok("kill_background_task", json!({"tmux_session": "cutj"}))
        .await;
}

/// Slurm jobs a test submitted, cancelled with `scancel` when dropped (also on failure).
struct Cancel(Vec<String>);

impl Drop for Cancel {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let _ = rsb_tests::output_with_timeout(
                std::process::Command::new("scancel").args(&self.0),
                Duration::from_secs(30),
            );
        }
    }
}

/// The squeue calls a counting wrapper logged: (time, pid of the agent that ran it).
fn squeue_calls(log: &std::path::Path) -> Vec<(f64, String)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (t, who) = l.split_once(' ')?;
            Some((t.parse().ok()?, who.to_string()))
        })
        .collect()
}

/// Issue 43, polling like submitit: 50 watched jobs at default settings (`interval_s` 300, the
/// daemon's 1 s loop), quiet for 10 minutes (pending on a begin time an hour away), with a
/// `check_background_task(wait_s=110)` among them, cost fewer than 60 squeue calls, and each
/// process (the MCP server, the daemon: one agent each) asks at most once per 2 s tick. Before
/// the pace, the wait alone cost ~55 calls. `RSB_SLURM_QUIET_S` shortens the 600 s window
/// while iterating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_fifty_quiet_watches_cost_under_sixty_squeue_calls_in_ten_minutes() {
    let Some(_bed) = slurm() else { return };
    let window = Duration::from_secs(
        std::env::var("RSB_SLURM_QUIET_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600),
    );
    let bin = tempfile::tempdir().unwrap();
    let log = bin.path().join("calls");
    // Each squeue call logs its time and the agent that ran it (the first rsb-agent above it).
    for tool in ["squeue", "sacct"] {
        wrap(bin.path(), tool, |real| {
            format!(
                "p=$PPID; n=0\n\
                 while [ \"$p\" -gt 1 ] && [ $n -lt 20 ]; do\n\
                   case \"$(cat /proc/$p/comm)\" in rsb-agent*) break;; esac\n\
                   p=$(cut -d' ' -f4 /proc/$p/stat); n=$((n+1))\n\
                 done\n\
                 echo \"$(date +%s.%N) $p\" >> {}\n\
                 exec {real} \"$@\"",
                log.display()
            )
        });
    }
    let sshd = sshd_with_path(bin.path());
    let mcp = Mcp::start(&sshd, json!({"sbatch_args": ["--begin=now+1hour"]})).await;
    const N: usize = 50;
    let mut cancel = Cancel(Vec::new());
    for i in 0..N {
        let s = mcp
            .ok(
                "exec_bash_background",
                json!({"command": "true", "session_name": format!("q{i}"), "watch": true,
                       "ensure_watchdog": false, "notify_local": false}),
            )
            .await;
        assert!(s["watch_id"].as_i64().is_some(), "{s}");
        cancel
            .0
            .push(s["slurm_job_id"].as_str().unwrap().to_string());
    }
    let watches: Vec<i64> = {
        let c = rsb::store::open(&mcp.state).unwrap();
        rsb::store::watches::list(&c, "")
            .unwrap()
            .iter()
            .map(|w| w.id)
            .collect()
    };
    assert_eq!(watches.len(), N);
    let t0 = Instant::now();
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let _daemon = mcp.daemon();
    // A minute in, the model waits on one of them.
    tokio::time::sleep(Duration::from_secs(60).min(window / 4)).await;
    let epoch = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let (w0, wait_from) = (Instant::now(), epoch());
    let v = mcp
        .ok(
            "check_background_task",
            json!({"tmux_session": "q0", "wait_s": 110}),
        )
        .await;
    let wait_to = epoch();
    assert_eq!(v["state"], "pending", "{v}");
    assert!(w0.elapsed() >= Duration::from_secs(100), "{v}");
    // The wait asks at the pace: 2, 4, 8, 16, 32, 60 s apart.
    let during: Vec<f64> = squeue_calls(&log)
        .into_iter()
        .map(|(t, _)| t)
        .filter(|t| (wait_from..=wait_to).contains(t))
        .collect();
    eprintln!(
        "check_background_task(wait_s=110) cost {} squeue calls, at {:?} s",
        during.len(),
        during
            .iter()
            .map(|t| (t - wait_from).round())
            .collect::<Vec<_>>()
    );
    assert!(
        during.len() <= 8,
        "{} squeue calls during a 110 s wait",
        during.len()
    );
    let left = window.saturating_sub(t0.elapsed());
    tokio::time::sleep(left).await;
    let calls: Vec<(f64, String)> = squeue_calls(&log)
        .into_iter()
        .filter(|(t, _)| *t >= start)
        .collect();
    let mut by: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    for (t, who) in &calls {
        by.entry(who).or_default().push(*t);
    }
    let c = rsb::store::open(&mcp.state).unwrap();
    let checked: Vec<i64> = watches
        .iter()
        .map(|id| {
            rsb::store::watches::require(&c, *id)
                .unwrap()
                .last_checked_ts
        })
        .collect();
    eprintln!(
        "{N} quiet watches over {} s: {} squeue calls ({}); watches last checked {:?} s ago",
        window.as_secs(),
        calls.len(),
        by.iter()
            .map(|(w, t)| format!("agent {w}: {}", t.len()))
            .collect::<Vec<_>>()
            .join(", "),
        checked
            .iter()
            .map(|t| start as i64 + t0.elapsed().as_secs() as i64 - t)
            .collect::<std::collections::BTreeSet<_>>()
    );
    // The daemon did check them all, each within its interval, and all still pend.
    for (id, ts) in watches.iter().zip(&checked) {
        assert!(*ts >= start as i64, "watch {id} was never checked");
        let w = rsb::store::watches::require(&c, *id).unwrap();
        assert_eq!(w.status, "active", "{w:?}");
    }
    assert!(
        calls.len() < 60,
        "{} squeue calls in {} s for {N} quiet watches",
        calls.len(),
        window.as_secs()
    );
    assert!(by.len() <= 2, "squeue run by more than two agents: {by:?}");
    for (who, times) in &by {
        for pair in times.windows(2) {
            assert!(
                pair[1] - pair[0] >= 1.9,
                "agent {who} asked squeue twice within a tick: {times:?}"
            );
        }
    }
}

/// Issue 40 for Slurm: an unwatched job's end reaches a session that listens on the channel,
/// once, from the shared poller and the record: a command's exit code within seconds of its
/// end, and a job cancelled outside rsb while it pended (no record at all: only Slurm knows),
/// with Slurm's state. No daemon runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_an_unwatched_jobs_end_is_pushed_to_the_session() {
    let Some(_bed) = slurm() else { return };
    let sshd = Sshd::start().unwrap();
    let mcp = Mcp::start(&sshd, json!({})).await;
    let marker = mcp.home.join("ended");
    let s = mcp
        .submit(
            "pushed",
            &format!(
                "sleep 1; echo last-words; date +%s.%N > {}; exit 3",
                marker.display()
            ),
            json!({}),
        )
        .await;
    let held = mcp
        .submit("held", "echo never", json!({"sbatch_args": ["--hold"]}))
        .await;
    let mut cancel = Cancel(vec![
        s["slurm_job_id"].as_str().unwrap().to_string(),
        held["slurm_job_id"].as_str().unwrap().to_string(),
    ]);
    assert!(s.get("watch_id").is_none(), "{s}");
    let (at, p) = mcp.until_pushed("pushed", 60).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let lag = now - at.elapsed().as_secs_f64() - ended_at(&marker);
    eprintln!("an unwatched Slurm job's end reached the session {lag:.2} s after it ended");
    let content = p["content"].as_str().unwrap();
    assert!(content.contains("failed (exit 3)"), "{p}");
    assert!(content.contains("last line: last-words"), "{p}");
    assert_eq!(p["meta"]["exit_code"], "3", "{p}");
    assert_eq!(p["meta"]["event"], "completed", "{p}");
    assert_eq!(p["meta"]["slurm_job_id"], s["slurm_job_id"], "{p}");
    // Two poll ticks of the record and Slurm closing the job.
    assert!(lag < 6.0, "pushed {lag:.2} s after the end: {p}");
    // Cancelled while it pended, outside rsb: only Slurm can say.
    let id = cancel.0.pop().unwrap();
    let out = rsb_tests::output_with_timeout(
        std::process::Command::new("scancel").arg(&id),
        Duration::from_secs(30),
    )
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (_, p) = mcp.until_pushed("held", 90).await;
    assert_eq!(p["meta"]["event"], "cancelled", "{p}");
    assert_eq!(p["meta"]["slurm_state"], "CANCELLED", "{p}");
    assert!(p["meta"].get("exit_code").is_none(), "{p}");
    assert!(p["content"].as_str().unwrap().contains("cancelled"), "{p}");
    // Each end once.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(mcp.pushes("pushed").len(), 1);
    assert_eq!(mcp.pushes("held").len(), 1);
    drop(cancel);
}
