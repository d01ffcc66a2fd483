//! The fault matrix (issue 14): one test per row. Each row injects one fault into a real
//! sshd session (through the chaos proxy, or by killing a process) while a call is in flight,
//! and asserts that the call fails within a bound with a one-line error, that nothing is left
//! half-written, and that the next call works.
//!
//! "Slow" rows run on a 10 Mbit/s link (the proxy's rate limit), where the send buffer is full
//! when the fault hits; "fast" rows run on an unlimited loopback link (100 Mbit/s for deploy,
//! which would otherwise finish before the fault can land).
//!
//! Needs the embedded agents (`scripts/build-agents.sh`), `cargo build --workspace --bins`.

mod common;

use std::{
    path::Path,
    time::{Duration, Instant},
};

use common::*;
use rsb::{
    app::App,
    error::RsbError,
    ops::sync::{self as ops, SyncArgs},
    pool::Pool,
    sync::CancellationToken,
};
use rsb_protocol::ExecRequest;
use rsb_tests::{ChaosProxy, Sshd, workspace_root};

const MIB: u64 = 1024 * 1024;
/// A dead link must be noticed within the liveness bound (15 s) plus heartbeat granularity.
const DETECT_BOUND: Duration = Duration::from_secs(25);
/// A cut (FIN/RST) or a killed process is noticed at once; allow for a loaded machine.
const CUT_BOUND: Duration = Duration::from_secs(8);

#[derive(Clone, Copy, Debug)]
enum Link {
    Fast,
    Slow,
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Cut,
    Blackhole,
}

impl Fault {
    fn bound(self) -> Duration {
        match self {
            Fault::Cut => CUT_BOUND,
            Fault::Blackhole => DETECT_BOUND,
        }
    }

    fn inject(self, proxy: &ChaosProxy) {
        match self {
            Fault::Cut => proxy.cut(),
            Fault::Blackhole => proxy.blackhole(true),
        }
    }
}

fn exec(cmd: &str, timeout_ms: u64) -> ExecRequest {
    let mut r = ExecRequest::new(cmd);
    r.timeout_ms = timeout_ms;
    r.kill_grace_ms = 500;
    r
}

fn out(c: &rsb_protocol::Captured) -> String {
    let mut b = c.head.clone();
    b.extend_from_slice(&c.tail);
    String::from_utf8_lossy(&b).into_owned()
}

/// The error a user sees: non-empty, one line, with a hint.
fn assert_one_line(e: &RsbError) {
    assert!(!e.message.trim().is_empty(), "empty error: {e:?}");
    assert!(!e.message.contains('\n'), "multi-line error: {e:?}");
    assert!(!e.hint.contains('\n'), "multi-line hint: {e:?}");
}

fn set_link(proxy: &ChaosProxy, link: Link) {
    match link {
        Link::Fast => proxy.set_rate(None),
        Link::Slow => proxy.set_rate_mbit(10),
    }
}

/// Wait (bounded) until `pred` holds.
async fn wait_until(what: &str, within: Duration, pred: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !pred() {
        assert!(t0.elapsed() < within, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Await `task`, which must fail within `bound` of now; returns the error and the delay.
async fn fails_within<T: std::fmt::Debug>(
    task: tokio::task::JoinHandle<rsb::error::Result<T>>,
    bound: Duration,
    what: &str,
) -> (RsbError, Duration) {
    let t0 = Instant::now();
    let r = tokio::time::timeout(bound, task)
        .await
        .unwrap_or_else(|_| panic!("{what}: no error within {bound:?}"))
        .unwrap();
    let e = r.expect_err(&format!("{what}: must fail"));
    let took = t0.elapsed();
    assert_one_line(&e);
    eprintln!("{what}: failed after {took:?}: {}", e.message);
    (e, took)
}

/// The next call on the same pool reconnects and works.
async fn next_call_works(pool: &Pool) {
    let c = tokio::time::timeout(Duration::from_secs(30), pool.client("s"))
        .await
        .expect("reconnect within 30 s")
        .expect("reconnect");
    let r = tokio::time::timeout(Duration::from_secs(20), c.call(exec("echo again", 10_000)))
        .await
        .expect("exec after reconnect")
        .unwrap();
    assert_eq!(out(&r.stdout), "again\n");
}

/// Regular files under `dir` outside rsb's staging directories.
fn visible_files_remote(sshd: &Sshd, dir: &str) -> Vec<String> {
    sshd.ssh_run(&format!(
        "cd {} 2>/dev/null && find . -name '.rsb-sync-staging-*' -prune -o -type f -print | sort",
        shq(dir)
    ))
    .unwrap()
    .lines()
    .map(str::to_string)
    .collect()
}

fn visible_files_local(dir: &Path) -> Vec<String> {
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "cd {} 2>/dev/null && find . -name '.rsb-sync-staging-*' -prune -o -type f -print | sort",
            shq(dir.to_str().unwrap())
        ))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Link faults mid-exec
// ---------------------------------------------------------------------------------------------

async fn link_fault_mid_exec(link: Link, fault: Fault) {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    set_link(&proxy, link);
    let pool = pool_on(&sshd, proxy.port(), dir.path());
    let c = pool.client("s").await.unwrap();
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.call(exec("sleep 50", 120_000)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    fault.inject(&proxy);
    let (e, _) = fails_within(call, fault.bound(), &format!("{link:?} {fault:?} mid-exec")).await;
    assert!(e.is_connection_lost(), "{e:?}");
    proxy.reset();
    next_call_works(&pool).await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_exec_fast() {
    link_fault_mid_exec(Link::Fast, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_exec_slow() {
    link_fault_mid_exec(Link::Slow, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_exec_fast() {
    link_fault_mid_exec(Link::Fast, Fault::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_exec_slow() {
    link_fault_mid_exec(Link::Slow, Fault::Blackhole).await;
}

// ---------------------------------------------------------------------------------------------
// Link faults mid-upload: the sync and every other call on the sandbox fail within the bound
// ---------------------------------------------------------------------------------------------

async fn link_fault_mid_upload(link: Link, fault: Fault) {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    set_link(&proxy, link);
    let src = dir.path().join("up");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("big.bin");
    std::fs::write(&file, gen_bytes(11, (96 * MIB) as usize)).unwrap();
    let pool = pool_on(&sshd, proxy.port(), &dir.path().join("state"));
    let c = pool.client("s").await.unwrap();
    let args = SyncArgs {
        local_path: src.display().to_string(),
        remote_path: "up".into(),
        ..Default::default()
    };
    let run = tokio::spawn({
        let app = App::on(pool.clone());
        let args = args.clone();
        async move { ops::sync_local_to_remote(&app, args, None, &CancellationToken::new()).await }
    });
    let base = proxy.bytes_forwarded().0;
    wait_until("upload bytes", Duration::from_secs(30), || {
        proxy.bytes_forwarded().0 > base + 2 * MIB
    })
    .await;
    assert!(!run.is_finished(), "the upload ended before the fault");
    fault.inject(&proxy);
    // A call issued after the fault fails too, within the same bound: nothing waits forever
    // behind the stuck upload.
    let probe = tokio::spawn({
        let c = c.clone();
        async move { c.call(exec("echo probe", 60_000)).await }
    });
    let what = format!("{link:?} {fault:?} mid-upload");
    let (e, _) = fails_within(run, fault.bound(), &what).await;
    assert!(
        e.is_connection_lost() || e.message.contains("connection"),
        "{e:?}"
    );
    let (pe, _) = fails_within(probe, Duration::from_secs(5), &format!("{what}: exec")).await;
    assert!(pe.is_connection_lost(), "{pe:?}");
    proxy.reset();
    let rdir = sshd.home().join("up");
    let rfile = rdir.join("big.bin");
    assert_eq!(
        sha256_remote(&sshd, rfile.to_str().unwrap()),
        "none",
        "no half-written destination file"
    );
    next_call_works(&pool).await;
    // The next sync (over a direct link, to stay within the row's time) completes.
    let direct = pool_on(&sshd, sshd.port(), &dir.path().join("state2"));
    ops::sync_local_to_remote(
        &App::on(direct.clone()),
        args,
        None,
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(
        sha256_remote(&sshd, rfile.to_str().unwrap()),
        sha256_local(&file)
    );
    assert_eq!(
        visible_files_remote(&sshd, rdir.to_str().unwrap()),
        vec!["./big.bin"]
    );
    direct.shutdown().await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_upload_fast() {
    link_fault_mid_upload(Link::Fast, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_upload_slow() {
    link_fault_mid_upload(Link::Slow, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_upload_fast() {
    link_fault_mid_upload(Link::Fast, Fault::Blackhole).await;
}

/// The reproduction: a rate-limited upload, then the link goes silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_upload_slow() {
    link_fault_mid_upload(Link::Slow, Fault::Blackhole).await;
}

// ---------------------------------------------------------------------------------------------
// Link faults mid-download
// ---------------------------------------------------------------------------------------------

async fn link_fault_mid_download(link: Link, fault: Fault) {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    set_link(&proxy, link);
    let h = shq(sshd.home().to_str().unwrap());
    sshd.ssh_run(&format!(
        "mkdir -p {h}/dl && head -c 100663296 /dev/urandom > {h}/dl/big.bin"
    ))
    .unwrap();
    let rfile = sshd.home().join("dl/big.bin");
    let want = sha256_remote(&sshd, rfile.to_str().unwrap());
    let dst = dir.path().join("mirror");
    let pool = pool_on(&sshd, proxy.port(), &dir.path().join("state"));
    pool.client("s").await.unwrap();
    let args = SyncArgs {
        local_path: dst.display().to_string(),
        remote_path: "dl".into(),
        ..Default::default()
    };
    let run = tokio::spawn({
        let app = App::on(pool.clone());
        let args = args.clone();
        async move { ops::sync_remote_to_local(&app, args, None, &CancellationToken::new()).await }
    });
    let base = proxy.bytes_forwarded().1;
    let t0 = Instant::now();
    while proxy.bytes_forwarded().1 < base + 2 * MIB {
        assert!(t0.elapsed() < Duration::from_secs(30), "no download bytes");
        if run.is_finished() {
            panic!("the download ended before the fault: {:?}", run.await);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!run.is_finished(), "the download ended before the fault");
    fault.inject(&proxy);
    let (e, _) = fails_within(
        run,
        fault.bound(),
        &format!("{link:?} {fault:?} mid-download"),
    )
    .await;
    assert!(
        e.is_connection_lost() || e.message.contains("connection"),
        "{e:?}"
    );
    proxy.reset();
    assert!(
        visible_files_local(&dst).is_empty(),
        "no half-written local file: {:?}",
        visible_files_local(&dst)
    );
    next_call_works(&pool).await;
    let direct = pool_on(&sshd, sshd.port(), &dir.path().join("state2"));
    ops::sync_remote_to_local(
        &App::on(direct.clone()),
        args,
        None,
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(sha256_local(&dst.join("big.bin")), want);
    assert_eq!(visible_files_local(&dst), vec!["./big.bin"]);
    direct.shutdown().await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_download_fast() {
    link_fault_mid_download(Link::Fast, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_download_slow() {
    link_fault_mid_download(Link::Slow, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_download_fast() {
    link_fault_mid_download(Link::Fast, Fault::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_download_slow() {
    link_fault_mid_download(Link::Slow, Fault::Blackhole).await;
}

// ---------------------------------------------------------------------------------------------
// Link faults mid-deploy: no agent file under its final name is ever partial
// ---------------------------------------------------------------------------------------------

async fn link_fault_mid_deploy(mbit: u64, fault: Fault) {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    proxy.set_rate_mbit(mbit);
    let pool = pool_on(&sshd, proxy.port(), dir.path());
    let connect = tokio::spawn({
        let pool = pool.clone();
        async move { pool.client("s").await.map(|_| ()) }
    });
    // The handshake is a few KiB; past 256 KiB up, the agent is streaming.
    wait_until("agent upload", Duration::from_secs(30), || {
        proxy.bytes_forwarded().0 > 256 * 1024
    })
    .await;
    assert!(!connect.is_finished(), "the deploy ended before the fault");
    fault.inject(&proxy);
    fails_within(
        connect,
        fault.bound(),
        &format!("{mbit} Mbit/s {fault:?} mid-deploy"),
    )
    .await;
    proxy.reset();
    // Every file named rsb-agent under this fixture's home (where it deploys; /tmp is shared
    // with other tests) is a whole agent.
    let local_agent = workspace_root().join("target/agents/x86_64-unknown-linux-musl/rsb-agent");
    let want = sha256_local(&local_agent);
    let agents = || {
        sshd.ssh_run(&format!(
            "find {} -name rsb-agent -type f 2>/dev/null; true",
            shq(sshd.home().to_str().unwrap())
        ))
        .unwrap()
    };
    for f in agents().lines() {
        assert_eq!(sha256_remote(&sshd, f), want, "partial agent at {f}");
    }
    next_call_works(&pool).await;
    // The check above looked where deploys land: the reconnect's agent is there, whole.
    let after = agents();
    assert!(!after.trim().is_empty(), "no agent under the fixture home");
    for f in after.lines() {
        assert_eq!(sha256_remote(&sshd, f), want, "agent at {f}");
    }
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_deploy_fast() {
    link_fault_mid_deploy(100, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_mid_deploy_slow() {
    link_fault_mid_deploy(10, Fault::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_deploy_fast() {
    link_fault_mid_deploy(100, Fault::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_mid_deploy_slow() {
    link_fault_mid_deploy(10, Fault::Blackhole).await;
}

// ---------------------------------------------------------------------------------------------
// Process faults
// ---------------------------------------------------------------------------------------------

/// pids of the `rsb-agent` processes this fixture's sshd started (the sshd runs on this
/// machine; ancestry keeps other tests' agents, and rsb's local agents, out).
fn agent_pids(sshd: &Sshd) -> Vec<i32> {
    let root = sshd.pid().expect("sshd runs") as i32;
    let ppid = |pid: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = &stat[stat.rfind(')')? + 2..];
        rest.split_whitespace().nth(1)?.parse().ok()
    };
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() != "rsb-agent" {
            continue;
        }
        let mut p = pid;
        for _ in 0..32 {
            match ppid(p) {
                Some(q) if q == root => {
                    pids.push(pid);
                    break;
                }
                Some(q) if q > 1 => p = q,
                _ => break,
            }
        }
    }
    pids
}

async fn agent_killed_mid_exec(signal: i32) {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = pool_on(&sshd, sshd.port(), dir.path());
    let c = pool.client("s").await.unwrap();
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.call(exec("sleep 50", 120_000)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pids = agent_pids(&sshd);
    assert!(!pids.is_empty(), "no agent process found");
    for p in &pids {
        unsafe { libc::kill(*p, signal) };
    }
    if signal == libc::SIGTERM {
        // A SIGTERMed agent shuts down in order: it stops the command and may still answer
        // (cancelled, by signal 15) before its channel closes; either answer is prompt and clear.
        let r = tokio::time::timeout(CUT_BOUND, call)
            .await
            .expect("agent SIGTERM mid-exec: no answer within the bound")
            .unwrap();
        match r {
            Ok(res) => {
                assert!(res.cancelled && res.exit_code.is_none(), "{res:?}");
                // The answer comes just before the channel closes; the pool reconnects once
                // it has.
                wait_until("the agent channel closes", Duration::from_secs(10), || {
                    !c.is_alive()
                })
                .await;
            }
            Err(e) => {
                assert_one_line(&e);
                assert!(e.is_connection_lost(), "{e:?}");
            }
        }
    } else {
        let what = format!("agent signal {signal} mid-exec");
        let (e, _) = fails_within(call, CUT_BOUND, &what).await;
        assert!(e.is_connection_lost(), "{e:?}");
    }
    next_call_works(&pool).await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_sigkilled_mid_exec() {
    agent_killed_mid_exec(libc::SIGKILL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_sigtermed_mid_exec() {
    agent_killed_mid_exec(libc::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sshd_restarted_mid_exec() {
    let mut sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = pool_on(&sshd, sshd.port(), dir.path());
    let c = pool.client("s").await.unwrap();
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.call(exec("sleep 50", 120_000)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    sshd.restart().unwrap();
    let bound = CUT_BOUND.saturating_sub(t0.elapsed()) + Duration::from_secs(1);
    let (e, _) = fails_within(call, bound, "sshd restart mid-exec").await;
    assert!(e.is_connection_lost(), "{e:?}");
    next_call_works(&pool).await;
    pool.shutdown().await;
}

/// A small tmpfs as the upload's destination: the upload fails with "no space", and nothing is
/// left there (no partial file, no staging directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_disk_full_during_upload() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mnt = sshd.home().join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&mnt)
        .status();
    if !st.is_ok_and(|s| s.success()) {
        eprintln!("skipping remote_disk_full_during_upload: cannot mount a tmpfs (needs root)");
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    if let Some((uid, gid)) = Some((sshd_uid(&sshd), sshd_gid(&sshd))) {
        let _ = std::process::Command::new("chown")
            .arg(format!("{uid}:{gid}"))
            .arg(&mnt)
            .status();
    }
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("small.txt"), b"fits\n").unwrap();
    std::fs::write(src.join("big.bin"), gen_bytes(5, (8 * MIB) as usize)).unwrap();
    let pool = pool_on(&sshd, sshd.port(), &dir.path().join("state"));
    let args = SyncArgs {
        local_path: src.display().to_string(),
        remote_path: "small/dst".into(),
        ..Default::default()
    };
    let run = tokio::spawn({
        let app = App::on(pool.clone());
        let args = args.clone();
        async move { ops::sync_local_to_remote(&app, args, None, &CancellationToken::new()).await }
    });
    let (e, _) = fails_within(run, Duration::from_secs(30), "disk full upload").await;
    let m = e.message.to_lowercase();
    assert!(
        m.contains("space") || m.contains("disk") || m.contains("quota"),
        "error does not say the disk is full: {e:?}"
    );
    let left = sshd
        .ssh_run(&format!(
            "cd {} && find . -mindepth 1 | sort",
            shq(mnt.to_str().unwrap())
        ))
        .unwrap();
    for f in left.lines() {
        // A file may be there only whole (a small file committed before space ran out).
        if f.ends_with("small.txt") {
            continue;
        }
        assert!(
            f == "./dst" || f == "./dst/small.txt",
            "left behind after a disk-full upload: {f}\n{left}"
        );
    }
    next_call_works(&pool).await;
    pool.shutdown().await;
}

fn sshd_uid(sshd: &Sshd) -> u32 {
    sshd.ssh_run("id -u").unwrap().trim().parse().unwrap()
}

fn sshd_gid(sshd: &Sshd) -> u32 {
    sshd.ssh_run("id -g").unwrap().trim().parse().unwrap()
}

/// The whole tmux server dies under a running job: the job reads as not running (lost), with
/// no hang, and a new job starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tmux_server_killed_while_a_job_runs() {
    use rsb_protocol::{JobStartRequest, JobState, JobStatusRequest};
    if std::process::Command::new("tmux")
        .arg("-V")
        .output()
        .is_err()
    {
        eprintln!("skipping tmux_server_killed_while_a_job_runs: tmux is not installed");
        return;
    }
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = pool_on(&sshd, sshd.port(), dir.path());
    let c = pool.client("s").await.unwrap();
    let start = |name: &str| JobStartRequest {
        name: name.into(),
        command: "sleep 60".into(),
        cwd: None,
        log_file: format!(".codex_logs/{name}.log"),
        env: vec![],
        prefer_tmux: true,
        launch_id: None,
        confine: None,
        gpus: None,
    };
    let status = |name: &str| JobStatusRequest {
        name: name.into(),
        log_file: None,
        last_n_lines: 20,
        offset: None,
        max_bytes: 10_000,
    };
    let info = c.call(start("victim")).await.unwrap();
    if info.runner != "tmux" {
        eprintln!(
            "skipping tmux_server_killed_while_a_job_runs: the agent ran the job with {}",
            info.runner
        );
        return;
    }
    sshd.ssh_run("tmux kill-server").unwrap();
    let t0 = Instant::now();
    let state = loop {
        let r = tokio::time::timeout(Duration::from_secs(10), c.call(status("victim")))
            .await
            .expect("status answers")
            .unwrap();
        let st = r.info.expect("the job is still known").state;
        if st != JobState::Running || t0.elapsed() > Duration::from_secs(20) {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(state, JobState::Lost, "a job whose tmux server died");
    let again = c.call(start("after")).await.unwrap();
    assert_eq!(again.runner, "tmux");
    let r = c.call(status("after")).await.unwrap();
    assert_eq!(r.info.unwrap().state, JobState::Running);
    pool.shutdown().await;
}

/// `rsb mcp` SIGKILLed while it moves a file: afterwards (once whatever still runs has ended,
/// bounded) the destination holds the whole file or no file, never a partial one, and the next
/// sync completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsb_mcp_sigkilled_mid_transfer() {
    use rmcp::{ServiceExt, model::CallToolRequestParams, transport::TokioChildProcess};
    let rsb = workspace_root().join("target/debug/rsb");
    assert!(
        rsb.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        rsb.display()
    );
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    proxy.set_rate_mbit(20);
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("big.bin");
    std::fs::write(&file, gen_bytes(21, (32 * MIB) as usize)).unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let list = serde_json::json!([{
        "name": "s", "host": "127.0.0.1", "port": proxy.port(), "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(),
    }])
    .to_string();
    let mut cmd = tokio::process::Command::new(&rsb);
    cmd.arg("mcp")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("RSB_STATE_DIR", dir.path().join("state"))
        .env("REMOTE_SANDBOX_LIST", list);
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = transport.id().expect("rsb mcp pid") as i32;
    let svc = tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
        .await
        .expect("initialize in time")
        .unwrap();
    let args = serde_json::json!({"local_path": src.display().to_string(), "remote_path": "dst"});
    let serde_json::Value::Object(args) = args else {
        unreachable!()
    };
    let call = tokio::spawn(async move {
        let r = svc
            .call_tool(CallToolRequestParams::new("sync_local_to_remote").with_arguments(args))
            .await;
        (r.map(|_| ()).map_err(|e| e.to_string()), svc)
    });
    let base = proxy.bytes_forwarded().0;
    wait_until("transfer bytes", Duration::from_secs(40), || {
        proxy.bytes_forwarded().0 > base + 4 * MIB
    })
    .await;
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = tokio::time::timeout(Duration::from_secs(10), call).await;
    // A detached worker may still be finishing; wait (bounded) until no link is open.
    wait_until("transfers to end", Duration::from_secs(45), || {
        proxy.connections() == 0
    })
    .await;
    let rdir = sshd.home().join("dst");
    let files = visible_files_remote(&sshd, rdir.to_str().unwrap());
    let rfile = rdir.join("big.bin");
    match files.as_slice() {
        [] => {}
        [one] if one == "./big.bin" => assert_eq!(
            sha256_remote(&sshd, rfile.to_str().unwrap()),
            sha256_local(&file),
            "a partial file after rsb mcp was killed"
        ),
        other => panic!("unexpected files after rsb mcp was killed: {other:?}"),
    }
    eprintln!("after SIGKILL of rsb mcp the destination held {files:?}");
    proxy.reset();
    let direct = pool_on(&sshd, sshd.port(), &dir.path().join("state2"));
    let args = SyncArgs {
        local_path: src.display().to_string(),
        remote_path: "dst".into(),
        ..Default::default()
    };
    ops::sync_local_to_remote(
        &App::on(direct.clone()),
        args,
        None,
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(
        sha256_remote(&sshd, rfile.to_str().unwrap()),
        sha256_local(&file)
    );
    assert_eq!(
        visible_files_remote(&sshd, rdir.to_str().unwrap()),
        vec!["./big.bin"]
    );
    direct.shutdown().await;
}

/// Issue 21, defect 4: the reader waited on one request's chunk consumer, so a caller that
/// stopped reading (`rsb exec -- cat big | (sleep 20; cat)`) stopped the whole channel, and
/// after 15 s the heartbeat declared the link dead and every request failed. Now each request
/// has its own window: this one waits at the agent, the others go on, and when the reader
/// comes back every byte arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_stalls_only_its_own_request() {
    const LEN: u64 = 64 * MIB;
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = pool_on(&sshd, sshd.port(), &dir.path().join("state"));
    let c = pool.client("s").await.expect("connect");
    let mut req = exec(&format!("head -c {LEN} /dev/zero"), 120_000);
    req.stream = true;
    req.max_stdout = 0;
    // A consumer nobody reads for 20 s: more than the 15 s after which a silent link is dead.
    let (tx, mut rx) = tokio::sync::mpsc::channel(4);
    let big = tokio::spawn({
        let c = c.clone();
        async move { c.call_streaming(req, tx).await }
    });
    let t0 = Instant::now();
    let mut calls = 0;
    while t0.elapsed() < Duration::from_secs(20) {
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(5), c.call(exec("echo ok", 10_000)))
            .await
            .unwrap_or_else(|_| {
                panic!("an exec beside the stalled one hung, at {:?}", t0.elapsed())
            })
            .unwrap_or_else(|e| {
                panic!(
                    "an exec beside the stalled one failed at {:?}: {e}",
                    t0.elapsed()
                )
            });
        assert_eq!(out(&r.stdout), "ok\n");
        calls += 1;
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        !big.is_finished(),
        "the stalled request cannot have finished unread"
    );
    let mut got = 0u64;
    let t1 = Instant::now();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("the stream resumes")
    {
        if let rsb_protocol::Chunk::Stdout(b) = chunk {
            got += b.len() as u64;
        }
    }
    let r = big.await.unwrap().expect("the stalled request ends well");
    eprintln!(
        "{calls} execs beside it in 20 s; then {} MiB in {:?}",
        got / MIB,
        t1.elapsed()
    );
    assert_eq!((got, r.exit_code), (LEN, Some(0)));
    pool.shutdown().await;
}
