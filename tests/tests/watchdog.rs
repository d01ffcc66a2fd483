//! The watchdog against real things (issue 9): a real `rsb watchdog run` process at a 1 s
//! interval, real jobs on the private sshd fixture, faults through the chaos proxy, a webhook
//! into a local HTTP server, and `rsb mcp` driven by rmcp's client.
//!
//! Needs the `rsb` binary: `cargo build --workspace --bins` (agents built first).

mod common;

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use common::*;
use rmcp::{ServiceExt, model::CallToolRequestParams, transport::TokioChildProcess};
use rsb::{
    ops::{jobs, watchdog as wops},
    pool::Pool,
    store::{
        events::{self, WatchEvent},
        watches,
    },
};
use rsb_tests::{Sshd, workspace_root};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Harness

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// A real `rsb watchdog run`, SIGKILLed (and reaped, bounded) when dropped.
struct Daemon {
    child: Option<Child>,
    log: PathBuf,
}

/// The environment every rsb child gets: nothing of the developer's (config, agent, keys).
/// `rsb ARGS` with this test's home and state dir; must succeed; its stdout.
fn cli_ok(home: &Path, state: &Path, a: &[&str]) -> String {
    let mut cmd = Command::new(rsb_bin());
    cmd.args(a);
    base_env(&mut cmd, home, state);
    let out = rsb_tests::output_with_timeout(&mut cmd, Duration::from_secs(20)).unwrap();
    assert!(
        out.status.success(),
        "rsb {a:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn base_env(cmd: &mut Command, home: &Path, state: &Path) {
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("XDG_DATA_HOME", home.join(".local/share"))
        .env("RSB_CONFIG", home.join("rsb.toml"))
        .env("RSB_STATE_DIR", state)
        .env("RSB_LOG", "info");
}

impl Daemon {
    fn start(home: &Path, state: &Path, extra: &[&str]) -> Daemon {
        Daemon::start_env(home, state, extra, &[])
    }

    /// [`Daemon::start`] with more environment (over [`base_env`]).
    fn start_env(home: &Path, state: &Path, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let log = home.join(format!("daemon-{}.log", unique_n()));
        let f = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(rsb_bin());
        cmd.args(["watchdog", "run", "--loop-sleep", "1"])
            .args(extra);
        base_env(&mut cmd, home, state);
        cmd.envs(env.iter().copied());
        cmd.stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f);
        let child = cmd.spawn().expect("spawn rsb watchdog run");
        let d = Daemon {
            child: Some(child),
            log,
        };
        // Bounded wait for its lock: then it is up.
        let t0 = Instant::now();
        while rsb::watchdog::daemon::lock_holder(state).is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "the daemon did not start:\n{}",
                d.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if c.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

fn unique_n() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Default watch arguments at the test's pace: checked every second.
fn args() -> wops::WatchArgs {
    wops::WatchArgs {
        checkpoint_format: "text".into(),
        interval_s: 1,
        max_log_lines: 80,
        max_resume_attempts: 1,
        notify_local: false,
        alert_after_failures: 2,
        resume_delay_s: 0,
        ..Default::default()
    }
}

/// Start `cmd` as job `name` on `sandbox` and register its watch (as exec_bash_background does).
async fn watch_job(
    pool: &Pool,
    state: &Path,
    sandbox: &str,
    name: &str,
    cmd: &str,
    a: wops::WatchArgs,
) -> i64 {
    let mut nw = wops::prepare(&a, true, true).unwrap();
    let c = pool.client(sandbox).await.unwrap();
    let v = jobs::start(&c, cmd, (name, "", ""), None, None)
        .await
        .unwrap();
    let req = jobs::status_request(name, "", 1, None, 1).unwrap();
    let cwd = c.call(req).await.unwrap().info.unwrap().cwd;
    wops::fill_from_job(&mut nw, name, &v.log_file, &cwd);
    nw.launch_command = cmd.into();
    nw.sandbox_name = sandbox.into();
    let cfgs = pool.config().sandboxes.clone();
    let store = rsb::store::Store::new(state);
    let id = wops::register(&store, &cfgs, nw, false)
        .await
        .unwrap()
        .watch_id;
    store.close().await;
    id
}

fn events_of(state: &Path, watch_id: i64) -> Vec<WatchEvent> {
    let c = rsb::store::open(state).unwrap();
    let mut e = events::list(&c, watch_id, 1000).unwrap();
    e.reverse();
    e
}

fn types(es: &[WatchEvent]) -> Vec<String> {
    es.iter().map(|e| e.event_type.clone()).collect()
}

fn watch(state: &Path, id: i64) -> rsb::store::watch_model::Watch {
    watches::require(&rsb::store::open(state).unwrap(), id).unwrap()
}

/// Poll (bounded) until `pred` holds for the watch's events; returns them.
async fn wait_events(
    state: &Path,
    id: i64,
    within: Duration,
    what: &str,
    pred: impl Fn(&[WatchEvent]) -> bool,
) -> Vec<WatchEvent> {
    let t0 = Instant::now();
    loop {
        let e = events_of(state, id);
        if pred(&e) {
            return e;
        }
        assert!(
            t0.elapsed() < within,
            "watch {id}: {what} did not happen within {within:?}; events {:?}; watch {:?}",
            types(&e),
            watch(state, id).last_summary
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn has(t: &str) -> impl Fn(&[WatchEvent]) -> bool + '_ {
    move |e| e.iter().any(|e| e.event_type == t)
}

// ---------------------------------------------------------------------------------------------
// 1. Exit codes, an interruption resumed from its checkpoint, no resume after an exit

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exits_complete_interruptions_resume_with_their_checkpoint() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());

    let exit3 = watch_job(&pool, &state, "s", "exit3", "sleep 1; exit 3", args()).await;
    std::fs::write(sshd.home().join("ck.json"), "{\"step\": 3}").unwrap();
    let resumed_file = sshd.home().join("resumed.txt");
    let victim = watch_job(
        &pool,
        &state,
        "s",
        "victim",
        "echo started; sleep 120",
        wops::WatchArgs {
            auto_resume: true,
            resume_command: "printf '%s' \"$RSB_CHECKPOINT\" > resumed.txt; echo resumed".into(),
            checkpoint_path: "ck.json".into(),
            checkpoint_format: "json".into(),
            ..args()
        },
    )
    .await;
    let clean = watch_job(
        &pool,
        &state,
        "s",
        "clean",
        "sleep 1; exit 0",
        wops::WatchArgs {
            auto_resume: true,
            resume_command: "touch should-not-exist".into(),
            checkpoint_path: "ck.json".into(),
            ..args()
        },
    )
    .await;
    let stall = watch_job(
        &pool,
        &state,
        "s",
        "quiet",
        "echo once; sleep 120",
        wops::WatchArgs {
            stall_after_s: 2,
            ..args()
        },
    )
    .await;

    let daemon = Daemon::start(tmp.path(), &state, &[]);

    let e = wait_events(
        &state,
        exit3,
        Duration::from_secs(20),
        "completed",
        has("completed"),
    )
    .await;
    assert_eq!(types(&e), ["completed"]);
    assert_eq!(e[0].payload["exit_code"], 3);
    assert_eq!(e[0].payload["watch"]["status"], "completed");
    assert!(
        e[0].payload["log_tail"]
            .as_str()
            .unwrap()
            .contains("EXIT_CODE=3"),
        "{}",
        e[0].payload
    );
    // The event file is the seed's: the row, indented, 0600.
    let f = state.join(format!("events/event-{}.json", e[0].id));
    let t0 = Instant::now();
    while !f.exists() && t0.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let file: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
    for k in [
        "id",
        "watch_id",
        "event_type",
        "summary",
        "created_ts",
        "payload",
    ] {
        assert!(file.get(k).is_some(), "{k} missing in {file}");
    }
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // Running first, then the tmux session killed from outside: interrupted, resumed.
    wait_events(
        &state,
        victim,
        Duration::from_secs(20),
        "first check",
        |_| watch(&state, victim).last_state == "running",
    )
    .await;
    sshd.ssh_run("tmux kill-session -t =victim").unwrap();
    let e = wait_events(
        &state,
        victim,
        Duration::from_secs(30),
        "interrupted, resume_started, completed",
        has("completed"),
    )
    .await;
    assert_eq!(
        types(&e),
        ["interrupted", "resume_started", "completed"],
        "{e:#?}"
    );
    assert_eq!(e[1].payload["resume_attempt"], 1);
    assert_eq!(e[1].payload["checkpoint"], "{\"step\": 3}");
    assert_eq!(
        std::fs::read_to_string(&resumed_file).unwrap(),
        "{\"step\": 3}",
        "the resume command ran with the checkpoint it read"
    );
    let w = watch(&state, victim);
    assert_eq!((w.resume_attempts, w.status.as_str()), (1, "completed"));
    assert_eq!(w.last_checkpoint_text, "{\"step\": 3}");

    // Exit 0 with auto_resume on: completed, never resumed.
    let e = wait_events(
        &state,
        clean,
        Duration::from_secs(20),
        "completed",
        has("completed"),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(types(&events_of(&state, clean)), ["completed"]);
    assert_eq!(e[0].payload["exit_code"], 0);
    assert!(!sshd.home().join("should-not-exist").exists());
    assert_eq!(watch(&state, clean).resume_attempts, 0);

    // A quiet log: one `stalled`, not one per tick.
    wait_events(
        &state,
        stall,
        Duration::from_secs(20),
        "stalled",
        has("stalled"),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(types(&events_of(&state, stall)), ["stalled"]);

    drop(daemon);
    pool.shutdown().await;
}

/// A watched GPU job whose run was interrupted is resumed on GPUs leased again (its resume
/// plan keeps what it asked: `gpus`), not on every GPU of the host: the resume sees one GPU's
/// UUID in CUDA_VISIBLE_DEVICES. A fake nvidia-smi serves two idle GPUs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_gpu_job_is_resumed_on_leased_gpus() {
    let tmp = tempfile::tempdir().unwrap();
    let tag = unique_n();
    let uuids = [format!("GPU-w0-{tag}"), format!("GPU-w1-{tag}")];
    let _leases = rsb_tests::gpu::Leases(uuids.to_vec());
    let smi = rsb_tests::gpu::fake_smi(&[(&uuids[0], 0, 0), (&uuids[1], 0, 0)], &[]);
    let (sshd, _bin) = rsb_tests::gpu::gpu_host(&smi);
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let c = pool.client("s").await.unwrap();

    // As exec_bash_background(gpus=1, watch=true, auto_resume=true) starts and registers it.
    let need = rsb::gpus::Need {
        count: 1,
        min_free_mib: None,
    };
    let ask = rsb::gpus::ask(&c, &need).await.unwrap();
    let cmd = "echo \"FIRST CVD=$CUDA_VISIBLE_DEVICES\"; sleep 120";
    let v = jobs::start(&c, cmd, ("gpujob", "", ""), None, Some(ask))
        .await
        .unwrap();
    assert_eq!(v.gpus.len(), 1, "{v:?}");
    let a = wops::WatchArgs {
        auto_resume: true,
        resume_command: "echo \"RESUMED CVD=$CUDA_VISIBLE_DEVICES\"; sleep 120".into(),
        checkpoint_path: "ck.txt".into(),
        ..args()
    };
    std::fs::write(sshd.home().join("ck.txt"), "step 1").unwrap();
    let mut nw = wops::prepare(&a, true, true).unwrap();
    let req = jobs::status_request("gpujob", "", 1, None, 1).unwrap();
    let cwd = c.call(req).await.unwrap().info.unwrap().cwd;
    wops::fill_from_job(&mut nw, "gpujob", &v.log_file, &cwd);
    nw.launch_command = cmd.into();
    nw.sandbox_name = "s".into();
    nw.resume_plan
        .insert(rsb::gpus::PLAN_KEY.into(), json!(need));
    let store = rsb::store::Store::new(&state);
    let cfgs = pool.config().sandboxes.clone();
    let id = wops::register(&store, &cfgs, nw, false)
        .await
        .unwrap()
        .watch_id;
    store.close().await;

    let daemon = Daemon::start(tmp.path(), &state, &[]);
    wait_events(&state, id, Duration::from_secs(20), "first check", |_| {
        watch(&state, id).last_state == "running"
    })
    .await;
    sshd.ssh_run("tmux kill-session -t =gpujob").unwrap();
    let e = wait_events(
        &state,
        id,
        Duration::from_secs(30),
        "resume_started",
        has("resume_started"),
    )
    .await;
    assert_eq!(types(&e), ["interrupted", "resume_started"], "{e:#?}");
    let log_path = Path::new(&v.log_file).to_path_buf();
    let t0 = Instant::now();
    let log = loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if log.contains("RESUMED CVD=") || t0.elapsed() > Duration::from_secs(20) {
            break log;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let resumed = log
        .lines()
        .find_map(|l| l.strip_prefix("RESUMED CVD="))
        .unwrap_or_else(|| panic!("no resumed line: {log}"));
    assert!(
        uuids.iter().any(|u| u == resumed),
        "one leased GPU, not all: {log}"
    );
    let info = c
        .call(jobs::status_request("gpujob", "", 1, None, 1).unwrap())
        .await
        .unwrap()
        .info
        .unwrap();
    assert_eq!(info.gpus, [resumed.to_string()], "{info:?}");
    let _ = jobs::kill(&c, "gpujob", 0.0).await;
    drop(daemon);
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 2. An outage: one ssh_unreachable, then running_restored; dead hosts do not delay live ones

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_alerts_once_and_recovers() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (proxy, mut t) = proxied_target(&sshd, tmp.path());
    t.connect_timeout = Duration::from_secs(3);
    let pool = pool_of(vec![sandbox("flaky", t)], tmp.path());
    let id = watch_job(&pool, &state, "flaky", "longrun", "sleep 300", args()).await;
    pool.shutdown().await;

    let daemon = Daemon::start(tmp.path(), &state, &[]);
    wait_events(&state, id, Duration::from_secs(20), "running", |_| {
        watch(&state, id).last_state == "running"
    })
    .await;
    // The host goes away: established connections die, new ones are refused.
    proxy.refuse(true);
    proxy.cut();
    let e = wait_events(
        &state,
        id,
        Duration::from_secs(40),
        "ssh_unreachable",
        has("ssh_unreachable"),
    )
    .await;
    assert_eq!(types(&e), ["ssh_unreachable"]);
    let w = watch(&state, id);
    assert!(w.consecutive_ssh_failures >= 2, "{w:?}");
    // Several more failed checks: still one event.
    let n = w.consecutive_ssh_failures;
    wait_events(
        &state,
        id,
        Duration::from_secs(40),
        "more failed checks",
        |_| watch(&state, id).consecutive_ssh_failures >= n + 3,
    )
    .await;
    assert_eq!(types(&events_of(&state, id)), ["ssh_unreachable"]);

    proxy.refuse(false);
    let e = wait_events(
        &state,
        id,
        Duration::from_secs(40),
        "running_restored",
        has("running_restored"),
    )
    .await;
    assert_eq!(types(&e), ["ssh_unreachable", "running_restored"]);
    let w = watch(&state, id);
    assert_eq!(
        (w.status.as_str(), w.last_state.as_str()),
        ("active", "running")
    );
    assert_eq!(w.consecutive_ssh_failures, 0);
    // It carries on: still checked every second.
    let checked = w.last_checked_ts;
    wait_events(&state, id, Duration::from_secs(10), "another check", |_| {
        watch(&state, id).last_checked_ts > checked
    })
    .await;
    drop(daemon);
    sshd.ssh_run("tmux kill-session -t =longrun").ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_watches_on_a_dead_host_do_not_delay_a_live_one() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    // The dead host answers nothing at all (black hole): every connect runs to its timeout.
    let (proxy, mut dead) = proxied_target(&sshd, tmp.path());
    dead.connect_timeout = Duration::from_secs(3);
    let live = target(
        &sshd,
        sshd.port(),
        key_auth(&sshd),
        &tmp.path().join("known_hosts"),
    );
    let pool = pool_of(
        vec![sandbox("live", live), sandbox("dead", dead)],
        tmp.path(),
    );
    let mut dead_ids = Vec::new();
    for i in 0..10 {
        dead_ids
            .push(watch_job(&pool, &state, "dead", &format!("d{i}"), "sleep 300", args()).await);
    }
    pool.shutdown().await;
    proxy.blackhole(true);
    proxy.cut();
    let live_id = watch_job(&pool, &state, "live", "quick", "sleep 4; exit 7", args()).await;
    let c = pool.client("live").await.unwrap();

    let daemon = Daemon::start(tmp.path(), &state, &[]);
    let e = wait_events(
        &state,
        live_id,
        Duration::from_secs(30),
        "completed",
        has("completed"),
    )
    .await;
    let req = jobs::status_request("quick", "", 1, None, 1).unwrap();
    let ended_ms = c.call(req).await.unwrap().info.unwrap().ended_ms.unwrap() as i64;
    let c2 = rsb::store::open(&state).unwrap();
    let created_ms: i64 = c2
        .query_row(
            "SELECT created_ms FROM watch_events WHERE id = ?1",
            [e[0].id],
            |r| r.get(0),
        )
        .unwrap();
    let lag = created_ms - ended_ms;
    println!("live job exit -> completed event: {lag} ms, with 10 watches on a black-holed host");
    // One check interval plus slack; a dead connect alone takes 3 s + the daemon's 5 s margin.
    assert!(lag < 3_000, "the live watch waited {lag} ms");
    // Meanwhile the dead watches are failing, each on its own deadline.
    wait_events(
        &state,
        dead_ids[9],
        Duration::from_secs(40),
        "dead failures",
        |_| watch(&state, dead_ids[9]).consecutive_ssh_failures >= 1,
    )
    .await;
    drop(daemon);
    sshd.ssh_run("for s in d0 d1 d2 d3 d4 d5 d6 d7 d8 d9; do tmux kill-session -t =$s; done")
        .ok();
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 3. Alerts: a webhook receives the JSON; a bad URL and a hanging command are recorded

/// (request head, body) of each request the test server received.
type Requests = Arc<Mutex<Vec<(String, String)>>>;

/// One HTTP request's head and body (by its Content-Length); an empty head when none came.
fn read_request(r: &mut impl BufRead) -> (String, String) {
    let mut head = String::new();
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        head.push_str(&line);
    }
    let mut body = vec![0u8; len];
    let _ = r.read_exact(&mut body);
    (head, String::from_utf8_lossy(&body).into_owned())
}

/// A one-thread HTTP server on 127.0.0.1 recording each request.
fn http_server() -> (u16, Requests) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten().take(100) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut r = BufReader::new(s.try_clone().unwrap());
            g.lock().unwrap().push(read_request(&mut r));
            let mut s = s;
            let _ = s.write_all(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n");
        }
    });
    (port, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_deliver_and_bad_hooks_are_recorded_without_stalling_the_loop() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let (port, got) = http_server();

    let hooked = watch_job(
        &pool,
        &state,
        "s",
        "hooked",
        "sleep 1; exit 2",
        wops::WatchArgs {
            webhook_url: format!("http://127.0.0.1:{port}/rsb"),
            ..args()
        },
    )
    .await;
    let hanging = watch_job(
        &pool,
        &state,
        "s",
        "hanging",
        "exit 0",
        wops::WatchArgs {
            event_command: "sleep 600".into(),
            ..args()
        },
    )
    .await;
    // A bad URL is refused at registration; a row that has one anyway (an older rsb, a hand
    // edit) must not stop the daemon.
    assert!(
        wops::prepare(
            &wops::WatchArgs {
                webhook_url: "notaurl".into(),
                ..args()
            },
            true,
            true
        )
        .unwrap_err()
        .message
        .contains("http://")
    );
    let bad = watch_job(&pool, &state, "s", "badurl", "exit 0", args()).await;
    rsb::store::open(&state)
        .unwrap()
        .execute(
            "UPDATE watches SET webhook_url = 'notaurl' WHERE id = ?1",
            [bad],
        )
        .unwrap();

    let daemon = Daemon::start(tmp.path(), &state, &["--hook-timeout", "8"]);
    let e = wait_events(
        &state,
        hooked,
        Duration::from_secs(20),
        "completed",
        has("completed"),
    )
    .await;
    let t0 = Instant::now();
    while got.lock().unwrap().is_empty() && t0.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (head, body) = got.lock().unwrap()[0].clone();
    assert!(head.starts_with("POST /rsb HTTP/1.1"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v, json!(e[0]), "the body is the event row");
    assert_eq!(v["payload"]["exit_code"], 2);

    // While the hanging command waits for its 8 s deadline, a new job's completion is
    // recorded within its interval: the hook runs off the loop.
    wait_events(
        &state,
        hanging,
        Duration::from_secs(20),
        "completed",
        has("completed"),
    )
    .await;
    let hung_at = Instant::now();
    let later = watch_job(&pool, &state, "s", "later", "exit 4", args()).await;
    wait_events(
        &state,
        later,
        Duration::from_secs(5),
        "completed",
        has("completed"),
    )
    .await;
    assert!(
        hung_at.elapsed() < Duration::from_secs(5),
        "the loop waited for the hook"
    );
    let t0 = Instant::now();
    loop {
        let err = watch(&state, hanging).last_alert_error;
        if err.contains("did not finish within 8s") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "hanging event_command not recorded: {err:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let t0 = Instant::now();
    loop {
        let err = watch(&state, bad).last_alert_error;
        if err.contains("invalid webhook_url") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "bad webhook not recorded: {err:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(daemon.log_text().contains("invalid webhook_url"));
    drop(daemon);
    pool.shutdown().await;
}

/// Each request's body, with when it came.
type TimedBodies = Arc<Mutex<Vec<(std::time::SystemTime, String)>>>;

/// A one-thread HTTP server on 127.0.0.1 recording each request's body and when it came.
fn timed_http_server() -> (u16, TimedBodies) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten().take(100) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut r = BufReader::new(s.try_clone().unwrap());
            let (_, body) = read_request(&mut r);
            g.lock().unwrap().push((std::time::SystemTime::now(), body));
            let mut s = s;
            let _ = s.write_all(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n");
        }
    });
    (port, got)
}

/// Issue 40, acceptance: with no MCP server and no `interval_s` (the default 300 s), the
/// daemon records `completed` and posts its webhook within 2 s of a job's end (p95 over 10
/// jobs): its job-event subscription starts the check the moment the agent sees the end. Each
/// job's last line is when it ended (ms; the host is loopback, one clock), which the webhook's
/// log tail carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_default_settings_an_end_is_recorded_and_posted_within_two_seconds() {
    const JOBS: usize = 10;
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let (port, got) = timed_http_server();
    let daemon = Daemon::start(tmp.path(), &state, &[]);
    let mut ids = Vec::new();
    for i in 0..JOBS {
        let id = watch_job(
            &pool,
            &state,
            "s",
            &format!("e{i}"),
            &format!("sleep {}; date +%s%3N", 1 + i % 3),
            wops::WatchArgs {
                interval_s: rsb::watchdog::DEFAULT_INTERVAL_S,
                webhook_url: format!("http://127.0.0.1:{port}/rsb"),
                ..args()
            },
        )
        .await;
        ids.push(id);
    }
    let t0 = Instant::now();
    while got.lock().unwrap().len() < JOBS {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{} of {JOBS} webhooks within 30 s:\n{}",
            got.lock().unwrap().len(),
            daemon.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut lags = Vec::new();
    for (at, body) in got.lock().unwrap().iter() {
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["event_type"], "completed", "{v}");
        assert_eq!(v["payload"]["exit_code"], 0, "{v}");
        let tail = v["payload"]["log_tail"].as_str().unwrap_or_default();
        let ended_ms: u128 = tail
            .lines()
            .rev()
            .find_map(|l| l.parse().ok())
            .unwrap_or_else(|| panic!("no end time in {tail:?}"));
        let heard = at
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis();
        lags.push(heard.saturating_sub(ended_ms) as u64);
    }
    lags.sort();
    let p95 = lags[(lags.len() * 95).div_ceil(100) - 1];
    println!(
        "job end → webhook posted by the daemon: p50 {} ms, p95 {p95} ms, max {} ms over {} jobs",
        lags[lags.len() / 2],
        lags[lags.len() - 1],
        lags.len()
    );
    assert!(p95 <= 2_000, "p95 {p95} ms: {lags:?}");
    for id in ids {
        assert_eq!(types(&events_of(&state, id)), ["completed"], "watch {id}");
        assert_eq!(watch(&state, id).status, "completed");
    }
    drop(daemon);
    pool.shutdown().await;
}

/// Issue 40: a job that ends while the daemon's connection is cut (chaos proxy) is recorded
/// once the connection is back, once, with no interval check due (300 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_during_a_cut_is_recorded_on_reconnecting_once() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (proxy, mut t) = proxied_target(&sshd, tmp.path());
    t.connect_timeout = Duration::from_secs(3);
    let pool = pool_of(vec![sandbox("flaky", t)], tmp.path());
    let daemon = Daemon::start(tmp.path(), &state, &[]);
    let id = watch_job(
        &pool,
        &state,
        "flaky",
        "cutoff",
        "sleep 4; echo finished",
        wops::WatchArgs {
            interval_s: rsb::watchdog::DEFAULT_INTERVAL_S,
            ..args()
        },
    )
    .await;
    pool.shutdown().await;
    wait_events(&state, id, Duration::from_secs(20), "running", |_| {
        watch(&state, id).last_state == "running"
    })
    .await;
    // The daemon's subscription is up (a tick after the watch); then the host goes away
    // while the job ends.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.refuse(true);
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        events_of(&state, id).is_empty(),
        "nothing can be known during the cut"
    );
    let back = Instant::now();
    proxy.refuse(false);
    let e = wait_events(
        &state,
        id,
        Duration::from_secs(40),
        "completed",
        has("completed"),
    )
    .await;
    println!("recorded {:?} after the link came back", back.elapsed());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(types(&events_of(&state, id)), ["completed"]);
    assert_eq!(e[0].payload["exit_code"], 0);
    assert!(
        e[0].payload["log_tail"]
            .as_str()
            .unwrap_or_default()
            .contains("finished")
    );
    drop(daemon);
}

/// Issue 40, acceptance: the subscriptions cost nothing while nothing ends. 50 watched jobs
/// on 3 sandboxes, default interval (300 s): once every watch was checked, the daemon sends no
/// request to any agent for 60 s but heartbeats (`ping`), counted from its
/// `RSB_LOG=rsb::requests=debug` lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_daemon_sends_nothing_but_heartbeats() {
    const JOBS: usize = 50;
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let t = target(
        &sshd,
        sshd.port(),
        key_auth(&sshd),
        &tmp.path().join("known_hosts"),
    );
    let names = ["a", "b", "c"];
    let pool = pool_of(
        names.iter().map(|n| sandbox(n, t.clone())).collect(),
        tmp.path(),
    );
    let mut ids = Vec::new();
    for i in 0..JOBS {
        let id = watch_job(
            &pool,
            &state,
            names[i % 3],
            &format!("idle{i}"),
            "sleep 600",
            wops::WatchArgs {
                interval_s: rsb::watchdog::DEFAULT_INTERVAL_S,
                ..args()
            },
        )
        .await;
        ids.push(id);
    }
    let daemon = Daemon::start_env(
        tmp.path(),
        &state,
        &[],
        &[("RSB_LOG", "info,rsb::requests=debug")],
    );
    let result = async {
        let t0 = Instant::now();
        while !ids
            .iter()
            .all(|&id| watch(&state, id).last_state == "running")
        {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{}",
                daemon.log_text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The subscriptions start a tick after the watches' sandboxes are seen.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let requests = || -> Vec<String> {
            daemon
                .log_text()
                .lines()
                .filter(|l| l.contains("rsb::requests"))
                .map(str::to_string)
                .collect()
        };
        let before = requests();
        let subscribed = before
            .iter()
            .filter(|l| l.contains("kind=\"job_events\""))
            .count();
        assert_eq!(subscribed, 3, "one subscription per sandbox: {before:#?}");
        tokio::time::sleep(Duration::from_secs(60)).await;
        let during = requests()[before.len()..].to_vec();
        let pings = during
            .iter()
            .filter(|l| l.contains("kind=\"ping\""))
            .count();
        println!(
            "60 s idle with {JOBS} watches on 3 sandboxes ({subscribed} subscriptions): {} requests, {pings} pings",
            during.len()
        );
        assert_eq!(during.len(), pings, "{during:#?}");
    };
    let outcome = tokio::time::timeout(Duration::from_secs(180), result).await;
    drop(daemon);
    for i in 0..JOBS {
        if let Ok(c) = pool.client(names[i % 3]).await {
            let _ = jobs::kill(&c, &format!("idle{i}"), 0.0).await;
        }
    }
    pool.shutdown().await;
    outcome.expect("the test ran past 180 s");
}

/// Issue 26, item 5: hooks added to the config file were read only when the daemon started.
/// Now a running daemon picks up a changed `[watchdog]` table on its next tick: a job that ends
/// after the edit runs the new `event_command`, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_added_to_the_config_file_apply_without_a_restart() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let config = tmp.path().join("rsb.toml"); // RSB_CONFIG (base_env)
    std::fs::write(&config, "[watchdog]\nnotify_local = false\n").unwrap();
    let daemon = Daemon::start(tmp.path(), &state, &[]);
    // Let it read the file as it was (a tick), then add a hook.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let marker = tmp.path().join("hook-ran.txt");
    std::fs::write(
        &config,
        format!(
            "[watchdog]\nnotify_local = false\nevent_command = \"echo $RSMCP_EVENT_TYPE >> {}\"\n",
            marker.display()
        ),
    )
    .unwrap();
    let id = watch_job(&pool, &state, "s", "after-edit", "sleep 1; exit 5", args()).await;
    wait_events(&state, id, Duration::from_secs(20), "an event", |e| {
        !e.is_empty()
    })
    .await;
    let t0 = Instant::now();
    while !marker.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the hook added to the config file never ran; events {:?}; daemon log:\n{}",
            types(&events_of(&state, id)),
            daemon.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ran = std::fs::read_to_string(&marker).unwrap();
    println!("hook ran for: {ran:?}");
    assert!(!ran.trim().is_empty(), "{ran:?}");
    assert!(
        daemon.log_text().contains("hooks reloaded"),
        "{}",
        daemon.log_text()
    );
    drop(daemon);
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 4. SIGKILL mid-tick: no watch lost, no event repeated

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_tick_loses_nothing_and_repeats_nothing() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let mut ids = Vec::new();
    for i in 0..12 {
        let cmd = format!("sleep {}.{}; exit {i}", i / 3, i % 10);
        ids.push(watch_job(&pool, &state, "s", &format!("k{i}"), &cmd, args()).await);
    }
    // Kill the daemon repeatedly while checks are in flight, then let one finish the work.
    for round in 0..4 {
        let mut d = Daemon::start(tmp.path(), &state, &[]);
        tokio::time::sleep(Duration::from_millis(700 + 250 * round)).await;
        // SAFETY: kill of our own child.
        unsafe { libc::kill(d.pid() as i32, libc::SIGKILL) };
        d.kill();
    }
    let daemon = Daemon::start(tmp.path(), &state, &[]);
    for (i, id) in ids.iter().enumerate() {
        let e = wait_events(
            &state,
            *id,
            Duration::from_secs(30),
            "completed",
            has("completed"),
        )
        .await;
        assert_eq!(types(&e), ["completed"], "watch {id} (k{i})");
        assert_eq!(e[0].payload["exit_code"], i as i64);
        assert_eq!(watch(&state, *id).status, "completed");
    }
    // Every event also got its file (a delivery cut by the kill is finished on restart).
    let t0 = Instant::now();
    loop {
        let pending: i64 = rsb::store::open(&state)
            .unwrap()
            .query_row(
                "SELECT COUNT(*) FROM watch_events WHERE delivered = 0",
                [],
                |r| r.get(0),
            )
            .unwrap();
        if pending == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{pending} undelivered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all = events_of(&state, 0);
    assert_eq!(all.len(), ids.len(), "{:?}", types(&all));
    for e in &all {
        assert!(state.join(format!("events/event-{}.json", e.id)).exists());
    }
    drop(daemon);
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 5. One daemon per state dir; the CLI; credentials that are not stored

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_daemon_per_state_dir_cli_tables_and_needs_credentials() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let id = watch_job(&pool, &state, "s", "clitest", "sleep 1; exit 0", args()).await;
    // A password-only sandbox, persisted without its password (no opt-in).
    let mut pw = target(
        &sshd,
        sshd.port(),
        rsb::config::Auth::Password(secret("S3cr3t-pw!")),
        &tmp.path().join("known_hosts"),
    );
    pw.user = "nobody".into();
    let pw_cfg = vec![sandbox("pw", pw)];
    let mut nw = wops::prepare(
        &wops::WatchArgs {
            tmux_session: "x".into(),
            log_file: "x.log".into(),
            ..args()
        },
        false,
        false,
    )
    .unwrap();
    nw.sandbox_name = "pw".into();
    let store = rsb::store::Store::new(&state);
    let reg = wops::register(&store, &pw_cfg, nw, false).await.unwrap();
    store.close().await;
    assert!(
        reg.watch_warning
            .as_deref()
            .unwrap_or("")
            .starts_with("needs credentials"),
        "{:?}",
        reg.watch_warning
    );
    let pw_id = reg.watch_id;

    let daemon = Daemon::start(tmp.path(), &state, &[]);
    // A second daemon on the same state dir refuses, naming the first.
    let mut cmd = Command::new(rsb_bin());
    cmd.args(["watchdog", "run"]);
    base_env(&mut cmd, tmp.path(), &state);
    let out = rsb_tests::output_with_timeout(&mut cmd, Duration::from_secs(20)).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!(
            "already running for {} (pid {})",
            state.display(),
            daemon.pid()
        )),
        "{err}"
    );

    wait_events(
        &state,
        id,
        Duration::from_secs(20),
        "completed",
        has("completed"),
    )
    .await;
    let e = wait_events(
        &state,
        pw_id,
        Duration::from_secs(20),
        "needs_credentials",
        has("needs_credentials"),
    )
    .await;
    assert!(
        e[0].summary.contains("RSB_WATCHDOG_STORE_PASSWORDS"),
        "{}",
        e[0].summary
    );
    assert!(!e[0].summary.contains('\n'));
    assert_eq!(watch(&state, pw_id).last_state, "needs_credentials");

    let cli = |a: &[&str]| cli_ok(tmp.path(), &state, a);
    let t = cli(&["watch", "list"]);
    assert!(t.lines().next().unwrap().contains("STATUS"), "{t}");
    assert!(t.contains("clitest") && t.contains("completed"), "{t}");
    let j: Value = serde_json::from_str(&cli(&["--json", "watch", "list"])).unwrap();
    assert_eq!(j["watches"].as_array().unwrap().len(), 2);
    let t = cli(&["watch", "events", &id.to_string()]);
    assert!(t.contains("completed"), "{t}");
    let t = cli(&["watch", "show", &pw_id.to_string()]);
    assert!(t.contains("last_state: needs_credentials"), "{t}");
    let t = cli(&["watch", "cancel", &pw_id.to_string()]);
    assert!(t.contains("cancelled"), "{t}");
    let s: Value = serde_json::from_str(&cli(&["--json", "watchdog", "status"])).unwrap();
    assert_eq!(s["daemon"]["running"], true);
    assert_eq!(s["daemon"]["pid"], daemon.pid() as i64);
    assert_eq!(s["daemon"]["mode"], "foreground");
    assert_eq!(s["watch_counts"]["cancelled"], 1);
    assert!(s["daemon"]["heartbeat_age_s"].as_i64().unwrap() <= 5);
    // The secret never reached the store.
    drop(daemon);
    let db = std::fs::read(rsb::store::db_path(&state)).unwrap();
    assert!(!db.windows(10).any(|w| w == b"S3cr3t-pw!"));
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 6. Service files

#[test]
fn the_systemd_unit_and_the_launchd_plist_are_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = rsb_bin();
    let state = tmp.path().join("state dir");
    let unit = rsb::watchdog::service::unit_text(&bin, &state, "/usr/bin:/bin", None);
    let unit_path = tmp.path().join("rsb-watchdog.service");
    std::fs::write(&unit_path, &unit).unwrap();
    assert!(unit.contains("Restart=on-failure"));
    assert!(unit.contains("loginctl enable-linger"));
    assert!(unit.contains(&format!(
        "ExecStart=\"{}\" watchdog run --mode service",
        bin.display()
    )));
    match Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit_path)
        .output()
    {
        Ok(o) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            assert!(
                o.status.success(),
                "systemd-analyze verify:\n{text}\n{unit}"
            );
            assert!(
                !text.contains("rsb-watchdog.service:"),
                "warnings about the unit:\n{text}"
            );
        }
        Err(e) => eprintln!("skipping systemd-analyze verify: not available ({e})"),
    }

    let plist = rsb::watchdog::service::plist_text(&bin, &state, "/usr/bin:/bin", None).unwrap();
    let doc = roxmltree::Document::parse_with_options(
        &plist,
        roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        },
    )
    .expect("the plist is well-formed XML");
    let dict = doc
        .root_element()
        .children()
        .find(|n| n.has_tag_name("dict"))
        .unwrap();
    let elems: Vec<roxmltree::Node> = dict.children().filter(|n| n.is_element()).collect();
    let value = |key: &str| -> roxmltree::Node {
        let i = elems
            .iter()
            .position(|n| n.has_tag_name("key") && n.text() == Some(key))
            .unwrap_or_else(|| panic!("no {key} in the plist"));
        elems[i + 1]
    };
    assert_eq!(value("Label").text(), Some("com.rsb.watchdog"));
    // KeepAlive after a failure only: `<dict><key>SuccessfulExit</key><false/></dict>`.
    let keep: Vec<roxmltree::Node> = value("KeepAlive")
        .children()
        .filter(|n| n.is_element())
        .collect();
    assert_eq!(keep.len(), 2);
    assert_eq!(keep[0].text(), Some("SuccessfulExit"));
    assert!(keep[1].has_tag_name("false"));
    assert_eq!(value("ThrottleInterval").text(), Some("10"));
    assert!(value("RunAtLoad").has_tag_name("true"));
    let args: Vec<&str> = value("ProgramArguments")
        .children()
        .filter(|n| n.has_tag_name("string"))
        .filter_map(|n| n.text())
        .collect();
    assert_eq!(args[0], bin.display().to_string());
    assert!(Path::new(args[0]).is_absolute());
    assert_eq!(&args[1..], ["watchdog", "run", "--mode", "service"]);
    let env: Vec<&str> = value("EnvironmentVariables")
        .children()
        .filter(|n| n.is_element())
        .filter_map(|n| n.text())
        .collect();
    assert_eq!(
        env,
        [
            "PATH",
            "/usr/bin:/bin",
            "RSB_STATE_DIR",
            &state.display().to_string()
        ]
    );
    assert!(
        value("StandardErrorPath")
            .text()
            .unwrap()
            .ends_with("watchdog.log")
    );
}

#[test]
fn install_without_a_user_service_manager_says_so_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let mut probe = Command::new("systemctl");
    probe.args(["--user", "show-environment"]);
    base_env(&mut probe, tmp.path(), &state);
    if probe.output().is_ok_and(|o| o.status.success()) {
        eprintln!("skipping: this machine has a user systemd; `install` would really install");
        return;
    }
    let mut cmd = Command::new(rsb_bin());
    cmd.args(["watchdog", "install"]);
    base_env(&mut cmd, tmp.path(), &state);
    let out = rsb_tests::output_with_timeout(&mut cmd, Duration::from_secs(30)).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "message + hint: {err}");
    assert!(lines[0].contains("no user service manager"), "{err}");
    assert!(lines[1].contains("rsb watchdog run"), "{err}");
    assert!(!tmp.path().join(".config/systemd").exists());
}

// ---------------------------------------------------------------------------------------------
// 7. Through MCP: the opt-in for hooks, the advanced tools, a detached daemon

struct Mcp {
    svc: rmcp::service::RunningService<rmcp::RoleClient, ()>,
}

impl Mcp {
    async fn start(home: &Path, state: &Path, list: &str, hooks: bool) -> Mcp {
        let mut cmd = tokio::process::Command::new(rsb_bin());
        cmd.arg("mcp")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("RSB_STATE_DIR", state)
            .env("REMOTE_SANDBOX_LIST", list)
            .env("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "yes");
        if hooks {
            cmd.env("RSB_ALLOW_WATCH_HOOKS", "1");
        }
        let (transport, _) = TokioChildProcess::builder(cmd)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let svc = tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
            .await
            .unwrap()
            .unwrap();
        Mcp { svc }
    }

    async fn call(&self, tool: &str, args: Value) -> (bool, Value) {
        let Value::Object(a) = args else { panic!() };
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            self.svc
                .call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(a)),
        )
        .await
        .unwrap()
        .unwrap();
        let raw = serde_json::to_value(&r).unwrap();
        let text = raw["content"][0]["text"].as_str().unwrap_or_default();
        (
            r.is_error == Some(true),
            serde_json::from_str(text).unwrap_or(Value::Null),
        )
    }

    async fn ok(&self, tool: &str, args: Value) -> Value {
        let (err, v) = self.call(tool, args.clone()).await;
        assert!(!err, "{tool}({args}) failed: {v}");
        v
    }
}

/// SIGKILL a detached daemon the test made the server spawn (bounded wait for it to go).
fn kill_pid(pid: i64) {
    if pid <= 1 {
        return;
    }
    // SAFETY: a pid the server reported for the daemon it spawned for this test.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    while unsafe { libc::kill(pid as i32, 0) } == 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 48: a watch's checkpoint command is the user's (or the model's), so on a confined
/// sandbox it is confined as the job is: it reads and writes inside the roots, and a write
/// outside fails with the reply's confinement line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_command_is_confined_as_its_job() {
    // SAFETY: a null attribute with size 0 and the version flag only asks for the ABI.
    let abi = unsafe { libc::syscall(444, std::ptr::null::<u8>(), 0usize, 1u32) };
    assert!(
        abi >= 2,
        "this test needs Landlock ABI 2 or later (this kernel: {abi})"
    );
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(sshd.home().join("scratch")).unwrap();
    let list = json!([{
        "name": "s", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(),
        "confine": {"write": ["~/scratch"]},
    }])
    .to_string();
    let mcp = Mcp::start(&home, &tmp.path().join("state"), &list, false).await;
    let v = mcp
        .ok(
            "watch_background_task",
            json!({"tmux_session": "none", "log_file": "scratch/none.log",
                   "checkpoint_command": "echo 7 > ~/scratch/cp; touch ~/escaped; cat ~/scratch/cp",
                   "ensure_watchdog": false, "notify_local": false}),
        )
        .await;
    let id = v["watch_id"].as_i64().unwrap();
    let r = mcp
        .ok("read_background_watch_checkpoint", json!({"watch_id": id}))
        .await;
    assert_eq!(r["checkpoint"]["raw"], "7\n", "{r}");
    let cmd = &r["command_result"];
    assert!(
        cmd["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("Permission denied"),
        "{r}"
    );
    assert!(
        !sshd.home().join("escaped").exists(),
        "the checkpoint command ran unconfined"
    );
    assert!(sshd.home().join("scratch/cp").exists());
    let _ = mcp.svc.cancel().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_hooks_need_the_opt_in_and_the_advanced_tools_work() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let state = tmp.path().join("state");
    let list = json!([{
        "name": "s", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(),
    }])
    .to_string();
    let env_file = sshd.home().join("hook-env.txt");
    let hook = format!("env | grep ^RSMCP_ | sort > {}", env_file.display());

    // Without the opt-in: refused before anything starts.
    let mcp = Mcp::start(&home, &state, &list, false).await;
    let tools = mcp.svc.list_all_tools().await.unwrap();
    assert_eq!(
        tools.len(),
        33,
        "17 default + 12 watchdog + 3 forwarding + apply_patch advanced tools"
    );
    for t in [
        "install_macos_watchdog",
        "uninstall_macos_watchdog",
        "get_watchdog_status",
        "watch_background_task",
        "exec_bash_background_watch",
        "list_background_watches",
        "get_background_watch",
        "get_background_watch_progress",
        "read_background_watch_log",
        "read_background_watch_checkpoint",
        "cancel_background_watch",
        "list_background_watch_events",
    ] {
        assert!(tools.iter().any(|x| x.name == t), "{t} missing");
    }
    // The seed's parameters and defaults (inventory §1.2), plus rsb's stall_after_s (and
    // exec_bash_background_watch's slurm, as exec_bash_background's).
    let spec: [(&str, &[&str], Value); 12] = [
        (
            "install_macos_watchdog",
            &[],
            json!({"start_now": true, "persist_current_sandboxes": true}),
        ),
        ("uninstall_macos_watchdog", &[], json!({})),
        ("get_watchdog_status", &[], json!({})),
        (
            "watch_background_task",
            &["tmux_session", "log_file"],
            json!({"sandbox_name": "", "run_id": "", "name": "", "cwd": "", "launch_command": "",
                   "resume_command": "", "resume_plan_json": "", "checkpoint_path": "",
                   "checkpoint_format": "text", "checkpoint_command": "", "interval_s": 300,
                   "max_log_lines": 80, "webhook_url": "", "event_command": "", "auto_resume": false,
                   "max_resume_attempts": 1, "metadata_json": "", "ensure_watchdog": true,
                   "notify_local": true, "alert_after_failures": 2, "resume_delay_s": 300,
                   "stall_after_s": 0}),
        ),
        (
            "exec_bash_background_watch",
            &["command"],
            json!({"session_name": "", "log_file": "", "cwd": "", "sandbox_name": "", "run_id": "",
                   "watch_name": "", "resume_command": "", "resume_plan_json": "",
                   "checkpoint_path": "", "checkpoint_format": "text", "checkpoint_command": "",
                   "interval_s": 300, "max_log_lines": 80, "webhook_url": "", "event_command": "",
                   "auto_resume": false, "max_resume_attempts": 1, "metadata_json": "",
                   "ensure_watchdog": true, "notify_local": true, "alert_after_failures": 2,
                   "resume_delay_s": 300, "codex_wakeup": false, "codex_command": "",
                   "stall_after_s": 0, "slurm": null}),
        ),
        ("list_background_watches", &[], json!({"status": ""})),
        ("get_background_watch", &["watch_id"], json!({})),
        (
            "get_background_watch_progress",
            &["watch_id"],
            json!({"refresh_live": true, "log_lines": 80, "checkpoint_max_bytes": 20000}),
        ),
        (
            "read_background_watch_log",
            &["watch_id"],
            json!({"last_n_lines": 200}),
        ),
        (
            "read_background_watch_checkpoint",
            &["watch_id"],
            json!({"max_bytes": 20000}),
        ),
        ("cancel_background_watch", &["watch_id"], json!({})),
        (
            "list_background_watch_events",
            &[],
            json!({"watch_id": 0, "limit": 20}),
        ),
    ];
    for (name, required, defaults) in spec {
        let t = tools.iter().find(|t| t.name == name).unwrap();
        let schema = Value::Object((*t.input_schema).clone());
        let mut req: Vec<&str> = schema["required"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        req.sort();
        let mut want = required.to_vec();
        want.sort();
        assert_eq!(req, want, "{name} required");
        let props = schema["properties"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            props.len(),
            required.len() + defaults.as_object().unwrap().len(),
            "{name} parameters: {:?}",
            props.keys().collect::<Vec<_>>()
        );
        for (k, d) in defaults.as_object().unwrap() {
            assert_eq!(&props[k]["default"], d, "{name}.{k}");
        }
    }
    let install = tools
        .iter()
        .find(|t| t.name == "install_macos_watchdog")
        .unwrap();
    assert!(
        install
            .description
            .as_deref()
            .unwrap_or("")
            .contains("systemd")
    );
    let (err, v) = mcp
        .call(
            "exec_bash_background",
            json!({"command": "touch started-anyway", "session_name": "refused", "event_command": hook}),
        )
        .await;
    assert!(err, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("RSB_ALLOW_WATCH_HOOKS=1"),
        "{v}"
    );
    let (err, v) = mcp
        .call(
            "watch_background_task",
            json!({"tmux_session": "x", "log_file": "x.log", "webhook_url": "http://127.0.0.1:9/"}),
        )
        .await;
    assert!(
        err && v["error"].as_str().unwrap().contains("webhook_url"),
        "{v}"
    );
    let v = mcp.ok("list_background_tasks", json!({})).await;
    assert_eq!(v["tasks"], json!([]), "nothing started");
    let (err, v) = mcp
        .call("list_background_watch_events", json!({"limit": 0}))
        .await;
    assert!(err && v["error"] == "limit must be positive", "{v}");
    let (err, v) = mcp
        .call(
            "watch_background_task",
            json!({"tmux_session": "x", "log_file": "x.log", "metadata_json": "[1]"}),
        )
        .await;
    assert!(
        err && v["error"] == "metadata_json must decode to a JSON object",
        "{v}"
    );
    let _ = mcp.svc.cancel().await;

    // With it: the watch runs the command with the seed's variables, through a daemon the
    // server spawned (detached, in its own session).
    let mcp = Mcp::start(&home, &state, &list, true).await;
    let v = mcp
        .ok(
            "exec_bash_background",
            json!({"command": "sleep 1; exit 6", "session_name": "hooked", "interval_s": 1,
                   "notify_local": false, "event_command": hook}),
        )
        .await;
    let watch_id = v["watch_id"]
        .as_i64()
        .unwrap_or_else(|| panic!("no watch_id: {v}"));
    let setup = &v["watchdog_setup"];
    assert_eq!(setup["action"], "spawned_detached", "{v}");
    assert!(
        setup["install_hint"]
            .as_str()
            .unwrap()
            .contains("rsb watchdog install")
    );
    let pid = setup["pid"].as_i64().unwrap();
    let result = async {
        let t0 = Instant::now();
        let env = loop {
            if let Ok(s) = std::fs::read_to_string(&env_file)
                && s.lines().count() >= 8
            {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the event_command never ran"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        for k in [
            "RSMCP_EVENT_FILE=",
            "RSMCP_EVENT_JSON=",
            "RSMCP_EVENT_TYPE=completed",
            &format!("RSMCP_WATCH_ID={watch_id}"),
            "RSMCP_SANDBOX_NAME=s",
            "RSMCP_TMUX_SESSION=hooked",
            "RSMCP_LOG_FILE=",
            "RSMCP_SUGGESTED_PROMPT=",
        ] {
            assert!(env.contains(k), "{k} missing in\n{env}");
        }

        let st = mcp.ok("get_watchdog_status", json!({})).await;
        assert_eq!(st["daemon"]["running"], true, "{st}");
        assert_eq!(st["daemon"]["mode"], "detached");
        assert_eq!(st["heartbeat_stale"], false);
        assert_eq!(st["launchd"]["loaded"], false);
        let c = mcp
            .ok("check_background_task", json!({"watch_id": watch_id}))
            .await;
        assert_eq!(
            (c["exit_code"].as_i64(), c["watch_id"].as_i64()),
            (Some(6), Some(watch_id))
        );
        let w = mcp
            .ok("get_background_watch", json!({"watch_id": watch_id}))
            .await;
        assert_eq!(w["watch"]["status"], "completed");
        assert!(w["watch"]["metadata"].is_object() && w["watch"]["resume_plan"].is_object());
        let ev = mcp
            .ok(
                "list_background_watch_events",
                json!({"watch_id": watch_id}),
            )
            .await;
        assert_eq!(ev["events"][0]["event_type"], "completed");
        assert_eq!(ev["events"][0]["payload"]["exit_code"], 6);
        let (err, v) = mcp
            .call(
                "read_background_watch_checkpoint",
                json!({"watch_id": watch_id}),
            )
            .await;
        assert!(
            err && v["error"]
                .as_str()
                .unwrap()
                .contains("does not define checkpoint_path")
        );
        let log = mcp
            .ok(
                "read_background_watch_log",
                json!({"watch_id": watch_id, "last_n_lines": 5}),
            )
            .await;
        assert!(
            log["log"]["log_tail"]
                .as_str()
                .unwrap()
                .contains("EXIT_CODE=6"),
            "{log}"
        );

        // A watched job killed on purpose is not an interruption: its watch is cancelled first.
        std::fs::write(sshd.home().join("ck.txt"), "epoch 2").unwrap();
        let v = mcp
            .ok(
                "exec_bash_background_watch",
                json!({"command": "sleep 300", "session_name": "victim", "interval_s": 1,
                       "notify_local": false, "checkpoint_path": "ck.txt"}),
            )
            .await;
        let vid = v["watch_id"].as_i64().unwrap();
        assert_eq!(v["watchdog_setup"]["action"], "already_running", "{v}");
        let p = mcp
            .ok("get_background_watch_progress", json!({"watch_id": vid}))
            .await;
        assert_eq!(p["live"]["task"]["running"], true, "{p}");
        assert_eq!(p["live"]["checkpoint"]["raw"], "epoch 2", "{p}");
        let k = mcp
            .ok(
                "kill_background_task",
                json!({"tmux_session": "victim", "grace_s": 1}),
            )
            .await;
        assert_eq!(k["cancelled_watches"], json!([vid]), "{k}");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let ev = mcp
            .ok("list_background_watch_events", json!({"watch_id": vid}))
            .await;
        assert_eq!(
            ev["events"],
            json!([]),
            "no interrupted/resume for a deliberate kill"
        );
        let l = mcp
            .ok("list_background_watches", json!({"status": "cancelled"}))
            .await;
        assert_eq!(l["watches"][0]["id"], vid);

        // `rsb jobs kill` is the same action: the watch goes first (it used to be left
        // active, and the daemon took the kill for an interruption and resumed the job).
        let v = mcp
            .ok(
                "exec_bash_background_watch",
                json!({"command": "sleep 300", "session_name": "victim2", "interval_s": 1,
                       "notify_local": false, "checkpoint_path": "ck.txt"}),
            )
            .await;
        let vid2 = v["watch_id"].as_i64().unwrap();
        let mut cmd = Command::new(rsb_bin());
        cmd.args(["--json", "jobs", "kill", "victim2", "--grace", "1"])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("RSB_STATE_DIR", &state)
            .env("REMOTE_SANDBOX_LIST", &list);
        let out = rsb_tests::output_with_timeout(&mut cmd, Duration::from_secs(30)).unwrap();
        let k: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        assert_eq!(k["cancelled_watches"], json!([vid2]), "{k}");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let ev = mcp
            .ok("list_background_watch_events", json!({"watch_id": vid2}))
            .await;
        assert_eq!(
            ev["events"],
            json!([]),
            "no interrupted/resume after rsb jobs kill"
        );
    };
    // Whatever happens, the detached daemon goes.
    let r = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(result)).await;
    kill_pid(pid);
    let _ = mcp.svc.cancel().await;
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
}

// ---------------------------------------------------------------------------------------------
// Issue 26, item 6: a watch whose resume attempts are used up ends as `gave_up`

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_with_no_resume_attempt_left_gives_up_and_says_so() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let id = watch_job(
        &pool,
        &state,
        "s",
        "doomed",
        "yes abcdefghij | head -c 40000; echo; sleep 120",
        wops::WatchArgs {
            auto_resume: true,
            resume_command: "sleep 120".into(),
            checkpoint_path: "doomed-ck.txt".into(),
            ..args()
        },
    )
    .await;
    std::fs::write(sshd.home().join("doomed-ck.txt"), "epoch 1").unwrap();
    let daemon = Daemon::start(tmp.path(), &state, &[]);
    wait_events(&state, id, Duration::from_secs(20), "running", |_| {
        watch(&state, id).last_state == "running"
    })
    .await;
    sshd.ssh_run("tmux kill-session -t =doomed").unwrap();
    wait_events(&state, id, Duration::from_secs(30), "resume_started", |e| {
        has("resume_started")(e) && watch(&state, id).last_state == "running"
    })
    .await;
    // The resumed job is lost too; its one attempt is spent.
    let session = watch(&state, id).tmux_session;
    sshd.ssh_run(&format!("tmux kill-session -t ={session}"))
        .unwrap();
    let e = wait_events(
        &state,
        id,
        Duration::from_secs(30),
        "gave_up",
        has("gave_up"),
    )
    .await;
    assert_eq!(
        types(&e),
        ["interrupted", "resume_started", "interrupted", "gave_up"],
        "{e:#?}"
    );
    let w = watch(&state, id);
    assert_eq!(w.status, "gave_up", "{w:?}");
    // Terminal: no more checks, no more events.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(events_of(&state, id).len(), e.len());
    // `rsb watch cancel` tells the truth about the job.
    let mut cmd = Command::new(rsb_bin());
    cmd.args(["watch", "cancel", &id.to_string()]);
    base_env(&mut cmd, tmp.path(), &state);
    let out = rsb_tests::output_with_timeout(&mut cmd, Duration::from_secs(20)).unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    assert!(
        !said.contains("keeps running") && said.contains("not running"),
        "{said}"
    );
    // The daemon's resume and the cancel are on the audit record, as the user's own actions.
    let (audit, lines) = common::audit_log(&state);
    assert!(
        lines.iter().any(|l| l["origin"] == "watchdog"
            && l["tool"] == "resume"
            && l["detail"]["watch_id"] == id),
        "{audit}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["tool"] == "rsb watch cancel" && l["command"] == format!("watch {id}")),
        "{audit}"
    );
    // Item 10: a listing of events is bounded (each carried the watch row with its 20,000
    // character log tail, so 11 events came to 32 KB).
    let mut cmd = Command::new(rsb_bin());
    cmd.args(["--json", "watch", "events", &id.to_string(), "-n", "20"]);
    base_env(&mut cmd, tmp.path(), &state);
    let out = rsb_tests::output_with_timeout(&mut cmd, Duration::from_secs(20)).unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["events"].as_array().map(Vec::len), Some(4), "{v}");
    println!("4 events listed in {} bytes", out.stdout.len());
    assert!(out.stdout.len() < 12_000, "{} bytes", out.stdout.len());
    drop(daemon);
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Issue 21, defect 5: a resume cut by the daemon's death is repeated by its launch id

/// Mark watch `id` as a daemon killed mid-resume leaves it: attempt counted, intent recorded
/// with `launch_id` for job `session`, at `intent_ms` on the daemon's clock.
fn cut_resume(state: &Path, id: i64, launch_id: &str, session: &str, intent_ms: i64) {
    let n = rsb::store::open(state)
        .unwrap()
        .execute(
            "UPDATE watches SET resume_attempts = 1, resume_intent_ms = ?2,
               resume_launch_id = ?3, resume_launch_session = ?4, last_state = 'resuming'
             WHERE id = ?1",
            (id, intent_ms, launch_id, session),
        )
        .unwrap();
    assert_eq!(n, 1);
}

/// Before: the restarted daemon compared the resumed job's start time on the host with its own
/// intent time (±1 s), on the watch's old job. A host clock an hour behind read a running
/// resume as "did not start", and a resume plan with its own session was never looked at, so
/// the next attempt ran the command again or failed on the running one. Now the intent holds
/// the launch id and job name, and the daemon repeats exactly that launch: the agent answers
/// with the run it started, or starts it then. Each resume command runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_cut_by_a_daemon_kill_runs_once_whatever_the_clocks_say() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let resumable = |tag: &str| wops::WatchArgs {
        auto_resume: true,
        max_resume_attempts: 3,
        resume_command: format!("echo run >> ran-{tag}.txt; sleep 2"),
        resume_plan_json: json!({"tmux_session": format!("{tag}-r")}).to_string(),
        checkpoint_path: "ck.txt".into(),
        ..args()
    };
    let before = watch_job(&pool, &state, "s", "cutb", "sleep 120", resumable("cutb")).await;
    let after = watch_job(&pool, &state, "s", "cuta", "sleep 120", resumable("cuta")).await;
    for s in ["cutb", "cuta"] {
        sshd.ssh_run(&format!("tmux kill-session -t ={s}")).unwrap();
    }
    let an_hour_ahead = rsb::store::now_ms() + 3_600_000;
    // Cut before the launch reached the host.
    cut_resume(&state, before, "LB", "cutb-r", an_hour_ahead);
    // Cut after the host started it, before the answer was recorded.
    cut_resume(&state, after, "LA", "cuta-r", an_hour_ahead);
    let c = pool.client("s").await.unwrap();
    let started = c
        .call(rsb_protocol::JobStartRequest {
            name: "cuta-r".into(),
            command: "echo run >> ran-cuta.txt; sleep 2".into(),
            cwd: None,
            log_file: String::new(),
            env: Vec::new(),
            prefer_tmux: true,
            launch_id: Some("LA".into()),
            confine: None,
            gpus: None,
        })
        .await
        .unwrap();

    let daemon = Daemon::start(tmp.path(), &state, &[]);
    for (id, tag) in [(before, "cutb"), (after, "cuta")] {
        let e = wait_events(
            &state,
            id,
            Duration::from_secs(40),
            "resume_started, completed",
            has("completed"),
        )
        .await;
        assert_eq!(types(&e), ["resume_started", "completed"], "{tag}: {e:#?}");
        let w = watch(&state, id);
        assert_eq!(
            (w.tmux_session.as_str(), w.resume_attempts),
            (format!("{tag}-r").as_str(), 1),
            "{tag}"
        );
        assert!(w.resume_launch_id.is_empty() && w.resume_intent_ms == 0);
        let ran = std::fs::read_to_string(sshd.home().join(format!("ran-{tag}.txt"))).unwrap();
        assert_eq!(ran, "run\n", "{tag}: the resume command ran once");
    }
    let st = c
        .call(jobs::status_request("cuta-r", "", 1, None, 1).unwrap())
        .await
        .unwrap()
        .info
        .unwrap();
    assert_eq!(
        (st.started_ms, st.launch_id.as_str()),
        (started.started_ms, "LA"),
        "the run the test started is the one the watch followed"
    );
    drop(daemon);
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Issue 23: https webhooks, checked against a test CA; a server that is down is retried

/// A test CA (PEM written to `ca_file`) and an https server on 127.0.0.1 signed by it, answering
/// 204 to each request, recording (head, body).
fn https_server(ca_file: &Path) -> (u16, Requests) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    std::fs::write(ca_file, ca_cert.pem()).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let cfg = Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap(),
    );
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    std::thread::spawn(move || {
        for tcp in l.incoming().flatten().take(50) {
            let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
            let conn = rustls::ServerConnection::new(cfg.clone()).unwrap();
            let tls = rustls::StreamOwned::new(conn, tcp);
            let mut r = BufReader::new(tls);
            let (head, body) = read_request(&mut r);
            if head.is_empty() {
                continue; // a handshake that failed
            }
            g.lock().unwrap().push((head, body));
            let mut tls = r.into_inner();
            let _ = tls.write_all(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n");
            let _ = tls.flush();
            tls.conn.send_close_notify();
            let _ = tls.flush();
        }
    });
    (port, got)
}

/// Before: `https://` was refused at registration ("rsb has no TLS client"), though nearly
/// every real webhook is https. Now the event reaches an https endpoint whose certificate a
/// test CA signed (trusted through `SSL_CERT_FILE`, as for curl), the same endpoint without
/// that CA is refused as untrusted, and a server that is down is tried three times inside the
/// hook's deadline, then recorded once, while the daemon's other watches go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_webhooks_are_verified_and_a_down_server_is_retried() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = key_pool(&sshd, tmp.path());
    let ca = tmp.path().join("test-ca.pem");
    let (port, got) = https_server(&ca);
    // A port nothing listens on: connections are refused at once.
    let down = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let hooked = |url: String| wops::WatchArgs {
        webhook_url: url,
        ..args()
    };
    let ok = watch_job(
        &pool,
        &state,
        "s",
        "tls-ok",
        "sleep 1; exit 4",
        hooked(format!("https://127.0.0.1:{port}/rsb?token=t0p")),
    )
    .await;
    let gone = watch_job(
        &pool,
        &state,
        "s",
        "tls-down",
        "sleep 1; exit 5",
        hooked(format!("https://127.0.0.1:{down}/rsb")),
    )
    .await;
    let plain = watch_job(&pool, &state, "s", "tls-none", "sleep 1; exit 6", args()).await;

    let log = tmp.path().join("https-daemon.log");
    let mut cmd = Command::new(rsb_bin());
    cmd.args([
        "watchdog",
        "run",
        "--loop-sleep",
        "1",
        "--hook-timeout",
        "8",
    ]);
    base_env(&mut cmd, tmp.path(), &state);
    cmd.env("SSL_CERT_FILE", &ca)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(log.with_extension("err")).unwrap());
    let mut child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    // The unhooked watch is not held up by the retries.
    wait_events(
        &state,
        plain,
        Duration::from_secs(20),
        "completed",
        has("completed"),
    )
    .await;
    let e = wait_events(
        &state,
        ok,
        Duration::from_secs(20),
        "completed",
        has("completed"),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while got.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the https webhook never arrived");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (head, body) = got.lock().unwrap()[0].clone();
    assert!(head.starts_with("POST /rsb?token=t0p HTTP/1.1"), "{head}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["id"], e[0].id, "{body}");
    assert_eq!(v["payload"]["exit_code"], 4, "{body}");
    // The down server: three tries (about 1 + 3 s of backoff), then one recorded failure that
    // names the server, never the URL's token.
    let deadline = Instant::now() + Duration::from_secs(30);
    let err = loop {
        let w = watch(&state, gone);
        if !w.last_alert_error.is_empty() {
            break w.last_alert_error;
        }
        assert!(Instant::now() < deadline, "no alert error recorded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("down server after {:?}: {err}", t0.elapsed());
    assert!(
        err.contains(&format!("cannot reach 127.0.0.1:{down}")),
        "{err}"
    );
    let _ = child.kill();
    let _ = child.wait();

    // Without the test CA the same endpoint is not trusted: an error, nothing delivered.
    let before = got.lock().unwrap().len();
    let r = rsb::watchdog::alerts::post_json(
        &format!("https://127.0.0.1:{port}/x"),
        "{}",
        Duration::from_secs(5),
    )
    .await;
    assert!(r.is_err(), "{r:?}");
    assert!(
        format!("{r:?}").to_lowercase().contains("certificate"),
        "{r:?}"
    );
    assert_eq!(got.lock().unwrap().len(), before);
    pool.shutdown().await;
}

/// Issue 50, case 6: `rsb watch list|show|cancel` printed a watch's name and job name raw, so
/// ESC, BEL and CR LF chosen by the model reached the terminal (a retitled window, a forged
/// row). Every such field is escaped; `--json` keeps the exact text.
#[test]
fn watch_commands_escape_a_hostile_name() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let hostile = "x\x1b]0;owned\x07\r\n   9  completed  forged";
    let mut nw = wops::prepare(
        &wops::WatchArgs {
            name: hostile.into(),
            ..args()
        },
        true,
        true,
    )
    .unwrap();
    wops::fill_from_job(&mut nw, hostile, "/tmp/none.log", "/tmp");
    nw.sandbox_name = "s".into();
    let id = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = rsb::store::Store::new(&state);
        let id = wops::register(&store, &[], nw, false)
            .await
            .unwrap()
            .watch_id;
        store.close().await;
        id
    });
    let cli = |a: &[&str]| cli_ok(tmp.path(), &state, a);
    let clean = |t: &str| {
        assert!(
            !t.chars().any(|c| c.is_control() && c != '\n'),
            "a control character was printed: {t:?}"
        );
        assert!(!t.contains("\n   9  completed"), "a forged row: {t:?}");
    };
    let t = cli(&["watch", "list"]);
    clean(&t);
    assert_eq!(t.lines().count(), 2, "{t:?}");
    assert!(t.contains("\\u{1b}]0;owned"), "{t:?}");
    let t = cli(&["watch", "show", &id.to_string()]);
    clean(&t);
    assert!(t.contains("name: x\\u{1b}]0;owned"), "{t:?}");
    let t = cli(&["watch", "cancel", &id.to_string()]);
    clean(&t);
    assert_eq!(t.lines().count(), 1, "{t:?}");
    let j: Value = serde_json::from_str(&cli(&["--json", "watch", "list"])).unwrap();
    assert_eq!(j["watches"][0]["name"], hostile);
}

// ---------------------------------------------------------------------------------------------
// The state dir's bound (issue 46, item 1)

/// Every file under `dir`, in bytes (what `du --apparent-size` says).
/// Files under `dir`, at any depth.
fn files_under(dir: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(_) => n += 1,
                Err(_) => {}
            }
        }
    }
    n
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => n += m.len(),
                Err(_) => {}
            }
        }
    }
    n
}

/// The daemon's heartbeat time (its clock's seconds), once it wrote one.
fn heartbeat_ts(state: &Path) -> Option<i64> {
    let c = rsb::store::open(state).ok()?;
    let (v, _) = watches::meta_get(&c, "heartbeat").ok()??;
    v["ts"].as_i64()
}

/// A user's busy day, sized by `RSB_SOAK` (`full`: 300 syncs of 100 roots, 200 watched jobs
/// that each print 80 lines of 200 characters, two hours of daemon ticks; else a fifth of the
/// syncs and jobs, still two hours): the state dir stays under its documented bound all along,
/// and 60 days on, `rsb state prune` takes the watches, their events and their files away.
/// The daemon's clock runs at 240x (`RSB_TEST_CLOCK`, debug builds), so two hours of its ticks
/// (heartbeats, checks, the hourly retention) take 30 s; `rsb state prune` runs 60 days ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_day_stays_under_the_state_dir_bound_and_prune_brings_it_back() {
    let full = std::env::var("RSB_SOAK").is_ok_and(|v| v == "full");
    let (syncs, jobs) = if full { (300, 200) } else { (60, 40) };
    let roots = syncs / 3;
    const SIMULATED_S: i64 = 7_200;
    const RATE: i64 = 240;
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let pool = pool_on(&sshd, sshd.port(), &state);
    let app = rsb::app::App::on(pool.clone());
    let t0 = Instant::now();
    let daemon = Daemon::start_env(
        tmp.path(),
        &state,
        &[],
        &[("RSB_TEST_CLOCK", &format!("0*{RATE}"))],
    );
    let mut max_du = 0u64;
    let sample = |max: &mut u64| *max = (*max).max(dir_bytes(&state));
    let mut ids = Vec::new();
    for i in 0..jobs {
        let id = watch_job(
            &pool,
            &state,
            "s",
            &format!("soak{i}"),
            "for i in $(seq 80); do printf '%0200d\\n' $i; done",
            wops::WatchArgs {
                interval_s: rsb::watchdog::DEFAULT_INTERVAL_S,
                ..args()
            },
        )
        .await;
        ids.push(id);
    }
    let jobs_s = t0.elapsed().as_secs_f64();
    // Each root synced three times, a file changed between the runs.
    let src = tmp.path().join("src");
    for i in 0..syncs {
        let root = src.join(format!("r{}", i % roots));
        if i < roots {
            std::fs::create_dir_all(&root).unwrap();
            for f in 0..20 {
                std::fs::write(
                    root.join(format!("f{f}.txt")),
                    format!("{i} {f}\n").repeat(40),
                )
                .unwrap();
            }
        }
        std::fs::write(root.join("changing.txt"), format!("run {i}\n")).unwrap();
        let args = rsb::ops::sync::SyncArgs {
            local_path: root.display().to_string(),
            remote_path: format!("soak/r{}", i % roots),
            ..Default::default()
        };
        let r = rsb::ops::sync::sync_local_to_remote(
            &app,
            args,
            None,
            &rsb::sync::CancellationToken::new(),
        )
        .await;
        assert!(r.is_ok(), "sync {i}: {r:?}");
        if i % 20 == 0 {
            sample(&mut max_du);
        }
    }
    let syncs_s = t0.elapsed().as_secs_f64() - jobs_s;
    // Every job's end recorded, then the daemon's two hours.
    for &id in &ids {
        wait_events(
            &state,
            id,
            Duration::from_secs(60),
            "completed",
            has("completed"),
        )
        .await;
    }
    let first = loop {
        if let Some(ts) = heartbeat_ts(&state) {
            break ts;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no heartbeat");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let started = rsb::store::now_s().min(first);
    let bound = Duration::from_secs((SIMULATED_S / RATE) as u64 + 60);
    let ticking = Instant::now();
    while heartbeat_ts(&state).is_none_or(|ts| ts < started + SIMULATED_S) {
        assert!(
            ticking.elapsed() < bound,
            "the daemon's clock did not reach two hours within {bound:?}:\n{}",
            daemon.log_text()
        );
        sample(&mut max_du);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    sample(&mut max_du);
    drop(daemon);
    app.shutdown().await;

    let rsb_json = |args: &[&str], clock: Option<&str>| -> Value {
        let mut cmd = Command::new(rsb_bin());
        cmd.arg("--json").args(args);
        base_env(&mut cmd, tmp.path(), &state);
        if let Some(c) = clock {
            cmd.env("RSB_TEST_CLOCK", c);
        }
        let out = rsb_tests::output_with_timeout(&mut cmd, Duration::from_secs(60)).unwrap();
        assert!(
            out.status.success(),
            "rsb {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let table = |u: &Value, t: &str| -> u64 {
        u["usage"]["tables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["path"] == t)
            .map_or(0, |e| e["count"].as_u64().unwrap())
    };
    let before = rsb_json(&["state"], None);
    let du_before = dir_bytes(&state);
    let bound_bytes = rsb::store::retention::STATE_DIR_BOUND_BYTES;
    println!(
        "soak ({}): {jobs} watched jobs in {jobs_s:.1} s, {syncs} syncs of {roots} roots in \
         {syncs_s:.1} s, {SIMULATED_S} s of daemon ticks; state dir at most {max_du} bytes \
         (bound {bound_bytes}), {du_before} at the end, of which `rsb state` counts {}",
        if full { "full" } else { "suite" },
        before["usage"]["total_bytes"]
    );
    assert!(max_du < bound_bytes, "{max_du} bytes: {before}");
    // `rsb state` accounts for everything the day left in the state dir.
    let listed: Vec<&str> = before["usage"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    for entry in std::fs::read_dir(&state).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_dir = entry.file_type().unwrap().is_dir();
        let files = files_under(&entry.path());
        if is_dir && files == 0 {
            continue;
        }
        let shown = if is_dir { format!("{name}/") } else { name };
        assert!(
            listed.contains(&shown.as_str()),
            "{shown} is in the state dir but not in `rsb state`: {listed:?}"
        );
    }
    assert_eq!(table(&before, "watches"), jobs as u64, "{before}");
    assert!(table(&before, "watch_events") >= jobs as u64, "{before}");
    assert_eq!(table(&before, "sync_baselines"), roots as u64, "{before}");

    // Sixty days on.
    let pruned = rsb_json(&["state", "prune"], Some(&format!("{}", 60 * 86_400)));
    let after = rsb_json(&["state"], None);
    let du_after = dir_bytes(&state);
    println!("60 days on: pruned {pruned}; state dir {du_before} -> {du_after} bytes");
    assert_eq!(pruned["watches"], jobs as u64, "{pruned}");
    assert_eq!(table(&after, "watches"), 0, "{after}");
    assert_eq!(table(&after, "watch_events"), 0, "{after}");
    assert!(!state.join("events").exists() || dir_bytes(&state.join("events")) == 0);
    // Baselines are kept for 90 days of no sync: conflict detection survives a holiday.
    assert_eq!(table(&after, "sync_baselines"), roots as u64, "{after}");
    assert!(du_after < du_before, "{du_before} -> {du_after}");
}
