//! Background jobs over real SSH: exit codes survive `exit`/`set -e`, exact names, jobs outlive
//! a cut connection and the process that started them, work without tmux, and cursor reads.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rsb::ops::jobs;
use rsb_protocol::{JobStartRequest, JobState, JobStatusRequest};
use rsb_tests::{Sshd, SshdOptions};

fn start_req(name: &str, cmd: &str) -> JobStartRequest {
    JobStartRequest {
        name: name.into(),
        command: cmd.into(),
        cwd: None,
        log_file: format!(".codex_logs/{name}.log"),
        env: vec![],
        prefer_tmux: true,
        launch_id: None,
        confine: None,
        gpus: None,
    }
}

fn status_req(name: &str) -> JobStatusRequest {
    JobStatusRequest {
        name: name.into(),
        log_file: None,
        last_n_lines: 50,
        offset: None,
        max_bytes: 20_000,
    }
}

/// Poll until the job is no longer running (bounded).
async fn wait_done(
    c: &rsb::client::AgentClient,
    name: &str,
    limit: Duration,
) -> rsb_protocol::JobStatusResult {
    let t0 = Instant::now();
    loop {
        let r = c.call(status_req(name)).await.unwrap();
        if r.info
            .as_ref()
            .is_some_and(|i| i.state != JobState::Running)
            || t0.elapsed() > limit
        {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A memory cgroup this test made (root only): its directory and how to write its limit.
struct MemCgroup(std::path::PathBuf);

impl MemCgroup {
    /// v1's memory hierarchy, else v2's, with a limit of `bytes`; `None` when this machine does
    /// not let the test make one (not root, no writable memory controller).
    fn new(bytes: u64) -> Option<MemCgroup> {
        let name = format!("rsb-oom-{}", std::process::id());
        let (dir, limit) = if std::path::Path::new("/sys/fs/cgroup/memory").is_dir() {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else {
            ("/sys/fs/cgroup", "memory.max")
        };
        let cg = std::path::Path::new(dir).join(name);
        std::fs::create_dir(&cg).ok()?;
        let cg = MemCgroup(cg);
        std::fs::write(cg.0.join(limit), bytes.to_string()).ok()?;
        Some(cg)
    }

    fn add(&self, pid: u32) {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for MemCgroup {
    /// Kill what is left in it (bounded), then remove it.
    fn drop(&mut self) {
        for _ in 0..50 {
            let procs = std::fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default();
            if procs.trim().is_empty() {
                break;
            }
            for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A job in a memory cgroup that allocates past the cgroup's limit is killed by the kernel's
/// OOM killer; the agent saw the SIGKILL and the cgroup's OOM kill counter grow, so
/// `failure_reason` is `host_oom`. A job of the same cgroup killed later by a plain SIGKILL is
/// `signal`: the counter's growth just before the end, not the signal, is the evidence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_killed_by_its_cgroup_memory_limit_is_host_oom() {
    let Some(cg) = MemCgroup::new(160 << 20) else {
        eprintln!("note: cannot make a memory cgroup here (needs root and cgroup memory); skipped");
        return;
    };
    let sshd = Sshd::start().unwrap();
    // The sshd and everything it starts from now on (the agent, the job's wrapper and the job)
    // run under the limit, as a job under systemd-run or Slurm's cgroup does.
    cg.add(sshd.pid().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    let hog = "echo allocating; python3 -c \"b = b'x' * (1 << 30); print(len(b))\"";
    c.call(start_req("hog", hog)).await.unwrap();
    let info = c.call(start_req("victim", "sleep 60")).await.unwrap();
    let r = wait_done(&c, "hog", Duration::from_secs(60)).await;
    let v = jobs::status_reply("hog", false, &r).unwrap();
    println!("hog: {v}");
    assert_eq!(v["failure_reason"], "host_oom", "{v}");
    assert!(
        v["failure_detail"]
            .as_str()
            .unwrap_or_default()
            .contains("memory cgroup reached its limit"),
        "{v}"
    );
    // Past the window (two of the wrapper's one-second ticks), the hog's kill is not the
    // victim's.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    unsafe { libc::kill(info.pid as i32, libc::SIGKILL) };
    let r = wait_done(&c, "victim", Duration::from_secs(30)).await;
    let v = jobs::status_reply("victim", false, &r).unwrap();
    assert_eq!(v["failure_reason"], "signal", "{v}");
    pool.shutdown().await;
    drop(sshd);
    drop(cg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_are_never_lost() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    let cases = [
        (
            "count",
            "for i in 1 2 3; do echo $i; sleep 1; done; exit 7",
            7,
        ),
        ("sete", "set -e; false; echo unreachable", 1),
        // bash -c exits 127 on an unbound variable under set -u; the point is that it is recorded.
        ("setu", "set -u; echo $NOT_SET_ANYWHERE", 127),
        ("big", "head -c 5000000 /dev/zero | tr '\\0' y; exit 3", 3),
    ];
    for (name, cmd, _) in &cases {
        c.call(start_req(name, cmd)).await.unwrap();
    }
    for (name, _, code) in &cases {
        let r = wait_done(&c, name, Duration::from_secs(30)).await;
        let info = r.info.unwrap();
        assert_eq!(
            (info.state, info.exit_code),
            (JobState::Exited, Some(*code)),
            "{name}"
        );
        let tail = String::from_utf8_lossy(&r.log);
        assert!(
            tail.trim_end().ends_with(&format!("EXIT_CODE={code}")),
            "{name}: {tail}"
        );
        if *name == "count" {
            assert!(tail.contains("1\n2\n3\n"), "{tail}");
        }
    }
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_exact_validated_and_never_clobbered() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    c.call(start_req("train-001", "sleep 20")).await.unwrap();
    let r = c.call(status_req("train")).await.unwrap();
    assert!(r.info.is_none(), "prefix must not match");
    let e = jobs::status_reply("train", false, &r).unwrap_err();
    assert!(
        e.message.contains("no background task named 'train'"),
        "{e:?}"
    );
    for bad in ["a.b", "a:b", "a b", "a;b", "../x", ""] {
        let e = c.call(start_req(bad, "true")).await.unwrap_err();
        assert!(
            e.message.contains("invalid") || e.message.contains("empty"),
            "{bad}: {e:?}"
        );
    }
    let log_before = sshd.ssh_run("cat ~/.codex_logs/train-001.log").unwrap();
    let e = c
        .call(start_req("train-001", "echo clobber"))
        .await
        .unwrap_err();
    assert!(e.message.contains("train-001"), "{e:?}");
    let info = c.call(status_req("train-001")).await.unwrap().info.unwrap();
    assert_eq!(info.state, JobState::Running);
    assert_eq!(info.command, "sleep 20");
    assert_eq!(
        sshd.ssh_run("cat ~/.codex_logs/train-001.log").unwrap(),
        log_before
    );
    let k = c
        .call(rsb_protocol::JobKillRequest {
            name: "train-001".into(),
            grace_ms: 1000,
        })
        .await
        .unwrap();
    assert_eq!((k.state, k.signal), (JobState::Exited, Some(15)));
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_survives_a_cut_connection_and_a_new_process_reads_its_exit_code() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (proxy, t) = proxied_target(&sshd, dir.path());
    let pool = pool_of(vec![sandbox("s", t.clone())], dir.path());
    let c = pool.client("s").await.unwrap();
    c.call(start_req("survivor", "sleep 3; echo finished; exit 5"))
        .await
        .unwrap();
    proxy.cut();
    drop(pool); // the "server" that started the job is gone

    tokio::time::sleep(Duration::from_secs(4)).await;
    let pool2 = pool_of(vec![sandbox("s", t)], dir.path());
    let c2 = pool2.client("s").await.unwrap();
    let r = wait_done(&c2, "survivor", Duration::from_secs(20)).await;
    let info = r.info.unwrap();
    assert_eq!((info.state, info.exit_code), (JobState::Exited, Some(5)));
    assert!(String::from_utf8_lossy(&r.log).contains("finished\nEXIT_CODE=5"));
    pool2.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_without_tmux_and_report_a_killed_tmux_session_as_lost() {
    // PATH without tmux (everything else of /usr/bin): the agent falls back to setsid.
    let fake = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir("/usr/bin").unwrap().flatten() {
        let name = entry.file_name();
        if name != "tmux" {
            std::os::unix::fs::symlink(entry.path(), fake.path().join(&name)).unwrap();
        }
    }
    let opts = SshdOptions {
        set_env: vec![("PATH".into(), fake.path().display().to_string())],
        ..Default::default()
    };
    let sshd = Sshd::start_with(opts).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    let info = c
        .call(start_req("notmux", "sleep 1; exit 4"))
        .await
        .unwrap();
    assert_eq!(info.runner, "setsid");
    let r = wait_done(&c, "notmux", Duration::from_secs(20)).await;
    assert_eq!(r.info.unwrap().exit_code, Some(4));
    pool.shutdown().await;

    // With tmux: killing the session from outside makes the job "lost".
    let sshd = Sshd::start().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    let info = c.call(start_req("victim", "sleep 60")).await.unwrap();
    assert_eq!(info.runner, "tmux");
    sshd.ssh_run("tmux kill-session -t =victim").unwrap();
    let r = wait_done(&c, "victim", Duration::from_secs(20)).await;
    assert_eq!(r.info.unwrap().state, JobState::Lost);
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursor_reads_return_each_byte_exactly_once() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    c.call(start_req(
        "writer",
        "for i in $(seq 1 200); do echo line-$i; sleep 0.01; done",
    ))
    .await
    .unwrap();
    let mut got = Vec::new();
    let mut offset = 0u64;
    let t0 = Instant::now();
    loop {
        let mut req = status_req("writer");
        req.offset = Some(offset);
        req.max_bytes = 97; // odd size: pieces end mid-line
        let r = c.call(req).await.unwrap();
        assert_eq!(r.log_start, offset);
        got.extend_from_slice(&r.log);
        offset = r.next_offset;
        let done = r
            .info
            .as_ref()
            .is_some_and(|i| i.state != JobState::Running);
        if (done && !r.log_truncated) || t0.elapsed() > Duration::from_secs(30) {
            break;
        }
    }
    let whole = sshd.ssh_run("cat ~/.codex_logs/writer.log").unwrap();
    assert_eq!(String::from_utf8(got).unwrap(), whole);
    pool.shutdown().await;
}

/// Issue 49: a job that ends non-zero says why, from evidence: the framework's CUDA
/// out-of-memory message (a Python exception named as PyTorch names it), a write into a full
/// filesystem (a 64 KiB tmpfs in a mount namespace, or /dev/full where namespaces are off:
/// both ENOSPC from the kernel), a segfault, an uncaught Python exception; a plain `exit 1`
/// stays unknown and a success has no reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_says_why_from_evidence() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    let cuda = "python3 - <<'PY'\nprint('epoch 1 loss 0.9', flush=True)\nclass OutOfMemoryError(RuntimeError): pass\nOutOfMemoryError.__module__ = 'torch.cuda'\nraise OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.15 GiB total capacity)')\nPY";
    let disk = "d=$(mktemp -d); if unshare -rm true 2>/dev/null; then unshare -rm sh -c \"mount -t tmpfs -o size=64k none $d && dd if=/dev/zero of=$d/ckpt bs=4k count=100\"; else dd if=/dev/zero of=/dev/full bs=4k count=1; fi";
    let cases = [
        (
            "cuda",
            cuda,
            Some("cuda_oom"),
            Some("torch.cuda.OutOfMemoryError: CUDA out of memory"),
        ),
        (
            "disk",
            disk,
            Some("disk_full"),
            Some("No space left on device"),
        ),
        (
            "segv",
            "python3 -c 'import ctypes; ctypes.string_at(0)'",
            Some("signal"),
            Some("(SIGSEGV)"),
        ),
        (
            "exc",
            "python3 -c \"raise ValueError('bad lr')\"",
            Some("python_exception"),
            Some("ValueError: bad lr"),
        ),
        ("plain", "echo step; exit 1", Some("unknown"), None),
        ("fine", "echo done", None, None),
    ];
    for (name, cmd, _, _) in &cases {
        c.call(start_req(name, cmd)).await.unwrap();
    }
    for (name, _, reason, detail) in &cases {
        let r = wait_done(&c, name, Duration::from_secs(30)).await;
        let v = jobs::status_reply(name, false, &r).unwrap();
        println!("{name}: {} {}", v["failure_reason"], v["failure_detail"]);
        assert_eq!(v["failure_reason"].as_str(), *reason, "{name}: {v}");
        match detail {
            Some(d) => assert!(
                v["failure_detail"].as_str().unwrap_or_default().contains(d),
                "{name}: {v}"
            ),
            None => assert!(v.get("failure_detail").is_none(), "{name}: {v}"),
        }
    }
    pool.shutdown().await;
}
