//! Jobs run for real here: each test gets its own `$HOME`, jobs root and tmux socket directory
//! through a [`Ctx`], so tests run in parallel without touching the real `$HOME` or any
//! process-global state. The wrapper is the `rsb-agent` binary Cargo builds next to this test
//! binary (it does so for the crate's integration tests).

use super::*;
use crate::proc::Stat;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;

const WAIT: Duration = Duration::from_secs(30);

fn agent_exe() -> PathBuf {
    let me = std::env::current_exe().unwrap();
    // target/debug/deps/rsb_agent-HASH -> target/debug/rsb-agent
    let exe = me.parent().unwrap().parent().unwrap().join("rsb-agent");
    assert!(
        exe.exists(),
        "{} missing: run the tests with `cargo test -p rsb-agent`",
        exe.display()
    );
    exe
}

struct Fixture {
    tmp: tempfile::TempDir,
    ctx: Ctx,
}

/// A context whose `$HOME` and tmux socket directory live under `base`.
fn ctx_under(base: &Path) -> Ctx {
    let home = base.join("home");
    let tmux_dir = base.join("tmux");
    for d in [&home, &tmux_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| {
            !matches!(
                k.to_str(),
                Some("TMUX" | "TMUX_PANE" | "HOME" | "TMUX_TMPDIR")
            )
        })
        .collect();
    env.push(("HOME".into(), home.clone().into()));
    env.push(("TMUX_TMPDIR".into(), tmux_dir.into()));
    Ctx {
        root: home.join(".cache/rsb/jobs"),
        home,
        exe: agent_exe(),
        env,
    }
}

impl Fixture {
    fn new() -> Fixture {
        let tmp = tempfile::Builder::new().prefix("rsbj").tempdir().unwrap();
        let ctx = ctx_under(tmp.path());
        Fixture { tmp, ctx }
    }

    fn tmux(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .args(args)
            .env_clear()
            .envs(self.ctx.env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("tmux is required for these tests")
    }

    fn start(&self, name: &str, command: &str, tmux: bool) -> Result<JobInfo, AgentError> {
        start_in(&self.ctx, req(name, command, tmux))
    }

    fn status(&self, name: &str) -> JobStatusResult {
        status_in(&self.ctx, &tail_req(name, 50, 1 << 20)).unwrap()
    }

    fn wait_done(&self, name: &str) -> JobInfo {
        let deadline = Instant::now() + WAIT;
        loop {
            let info = self.status(name).info.expect("job vanished");
            if info.state != JobState::Running {
                return info;
            }
            assert!(
                Instant::now() < deadline,
                "job {name} still running after {WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self, name: &str) -> String {
        let info = self.status(name).info.unwrap();
        String::from_utf8_lossy(&std::fs::read(&info.log_file).unwrap()).into_owned()
    }

    fn state(&self, name: &str) -> Record {
        Record::read(&self.ctx.job_dir(name).join("state")).unwrap()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // Leave no processes behind, whatever the test did.
        if let Ok(jobs) = list_in(&self.ctx) {
            for j in jobs.iter().filter(|j| j.state == JobState::Running) {
                let _ = kill_in(
                    &self.ctx,
                    &JobKillRequest {
                        name: j.name.clone(),
                        grace_ms: 0,
                    },
                );
            }
        }
        let _ = self.tmux(&["kill-server"]);
    }
}

fn req(name: &str, command: &str, tmux: bool) -> JobStartRequest {
    JobStartRequest {
        name: name.to_string(),
        command: command.to_string(),
        cwd: None,
        log_file: String::new(),
        env: Vec::new(),
        prefer_tmux: tmux,
        launch_id: None,
        confine: None,
        gpus: None,
    }
}

fn tail_req(name: &str, lines: u32, max: u64) -> JobStatusRequest {
    JobStatusRequest {
        name: name.to_string(),
        log_file: None,
        last_n_lines: lines,
        offset: None,
        max_bytes: max,
    }
}

fn pid_alive(pid: u32) -> bool {
    crate::proc::is_alive(pid, None)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn exit_code_and_lines(tmux: bool) {
    let f = Fixture::new();
    let cmd = "for i in 1 2 3; do echo $i; sleep 1; done; exit 7";
    let info = f.start("count", cmd, tmux).unwrap();
    assert_eq!(info.state, JobState::Running);
    assert_eq!(info.runner, if tmux { "tmux" } else { "setsid" });
    assert!(info.pid > 0);
    let running = f.status("count");
    assert_eq!(running.info.as_ref().unwrap().exit_code, None);
    let done = f.wait_done("count");
    assert_eq!(
        (done.state, done.exit_code, done.signal),
        (JobState::Exited, Some(7), None)
    );
    assert!(done.ended_ms.unwrap() >= done.started_ms + 2500, "{done:?}");
    let log = f.log("count");
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines[0], "== session: count");
    assert!(
        lines[1].starts_with("== started_at: 20") && lines[1].ends_with('Z'),
        "{log}"
    );
    assert_eq!(lines[2], format!("== command: {cmd}"));
    assert_eq!(&lines[3..], ["1", "2", "3", "EXIT_CODE=7"]);
    let st = f.status("count");
    assert_eq!(
        String::from_utf8_lossy(&st.log),
        log,
        "a 50-line tail holds the whole short log"
    );
    assert_eq!(
        (st.log_start, st.next_offset, st.log_size),
        (0, log.len() as u64, log.len() as u64)
    );
    assert!(st.log_found && !st.log_truncated);
    // Default log path, as the seed chose it.
    assert_eq!(
        done.log_file,
        f.ctx
            .home
            .join(".codex_logs/count.log")
            .display()
            .to_string()
    );
    assert_eq!(done.cwd, f.ctx.home.display().to_string());
}

#[test]
fn exit_code_and_output_setsid() {
    exit_code_and_lines(false);
}

#[test]
fn exit_code_and_output_tmux() {
    exit_code_and_lines(true);
}

#[test]
fn shell_errors_keep_their_exit_codes() {
    let f = Fixture::new();
    let direct = Command::new("bash")
        .args(["-c", "set -u; echo $UNSET_VAR_X"])
        .output()
        .unwrap();
    let unset_code = direct.status.code().unwrap();
    assert_ne!(unset_code, 0);
    f.start("sete", "set -e; false; echo no", false).unwrap();
    f.start("setu", "set -u; echo $UNSET_VAR_X; echo no", true)
        .unwrap();
    f.start(
        "pipe",
        "yes | head -1 >/dev/null; echo \"ps=${PIPESTATUS[0]}\"",
        false,
    )
    .unwrap();
    f.start(
        "multi",
        "echo 'it'\"'\"'s'\necho \"$(echo sub)\"\n__RSMCP_BG__\nexit 5",
        false,
    )
    .unwrap();
    let e = f.wait_done("sete");
    assert_eq!(e.exit_code, Some(1));
    assert!(!f.log("sete").contains("\nno\n"), "{}", f.log("sete"));
    assert!(f.log("sete").ends_with("EXIT_CODE=1\n"));
    let u = f.wait_done("setu");
    assert_eq!(u.exit_code, Some(unset_code));
    assert!(
        f.log("setu").contains("UNSET_VAR_X: unbound variable"),
        "{}",
        f.log("setu")
    );
    f.wait_done("pipe");
    assert!(
        f.log("pipe").contains("\nps=141\n"),
        "SIGPIPE has its default action: {}",
        f.log("pipe")
    );
    let m = f.wait_done("multi");
    assert_eq!(
        m.exit_code,
        Some(5),
        "the command runs verbatim, a heredoc marker line included"
    );
    let log = f.log("multi");
    assert!(log.contains("it's\nsub\n"), "{log}");
    assert!(
        log.contains("== command: echo 'it'\"'\"'s' echo \"$(echo sub)\" __RSMCP_BG__ exit 5\n"),
        "{log}"
    );
}

#[test]
fn five_megabytes_then_exit_three() {
    let f = Fixture::new();
    // No trailing newline: the wrapper still puts EXIT_CODE on a line of its own.
    f.start(
        "big",
        "head -c 5000000 /dev/zero | tr '\\0' x; exit 3",
        false,
    )
    .unwrap();
    let done = f.wait_done("big");
    assert_eq!(done.exit_code, Some(3));
    let st = status_in(&f.ctx, &tail_req("big", 20, 20_000)).unwrap();
    assert!(st.log_size > 5_000_000);
    assert!(st.log_truncated, "the 5 MB line exceeds the cap");
    assert!(st.log.len() <= 20_000);
    assert!(
        st.log.ends_with(b"\nEXIT_CODE=3\n") || st.log == b"EXIT_CODE=3\n",
        "{:?}",
        &st.log[st.log.len().saturating_sub(40)..]
    );
    assert_eq!(st.next_offset, st.log_size);
    assert_eq!(st.log_start + st.log.len() as u64, st.log_size);
}

#[test]
fn signals_are_reported() {
    let f = Fixture::new();
    f.start("selfkill", "echo before; kill -9 $$; echo after", false)
        .unwrap();
    let d = f.wait_done("selfkill");
    assert_eq!(
        (d.state, d.exit_code, d.signal),
        (JobState::Exited, None, Some(9))
    );
    assert!(
        f.log("selfkill").ends_with("before\nEXIT_CODE=137\n"),
        "{}",
        f.log("selfkill")
    );

    let info = f.start("term", "echo up; sleep 30", true).unwrap();
    let t0 = Instant::now();
    let k = kill_in(
        &f.ctx,
        &JobKillRequest {
            name: "term".into(),
            grace_ms: 5000,
        },
    )
    .unwrap();
    assert_eq!(
        (k.state, k.exit_code, k.signal),
        (JobState::Exited, None, Some(libc::SIGTERM)),
        "{k:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "SIGTERM was enough: {:?}",
        t0.elapsed()
    );
    assert!(!pid_alive(info.pid));
    assert!(f.log("term").ends_with("EXIT_CODE=143\n"));
    // Killing a finished job changes nothing.
    assert_eq!(
        kill_in(
            &f.ctx,
            &JobKillRequest {
                name: "term".into(),
                grace_ms: 0
            }
        )
        .unwrap(),
        k
    );

    // A job that ignores SIGTERM gets SIGKILL after the grace.
    let info = f
        .start(
            "stubborn",
            "trap '' TERM; echo up; sleep 30; echo never",
            false,
        )
        .unwrap();
    // The trap is set once `up` is in the log; a kill before that (a loaded box can take that
    // long to start bash) would find SIGTERM still fatal.
    let deadline = Instant::now() + WAIT;
    while !f.log("stubborn").contains("up\n") {
        assert!(Instant::now() < deadline, "stubborn never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    let k = kill_in(
        &f.ctx,
        &JobKillRequest {
            name: "stubborn".into(),
            grace_ms: 300,
        },
    )
    .unwrap();
    assert_eq!(
        (k.state, k.signal),
        (JobState::Exited, Some(libc::SIGKILL)),
        "{k:?}"
    );
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert!(!pid_alive(info.pid));

    let e = kill_in(
        &f.ctx,
        &JobKillRequest {
            name: "nope".into(),
            grace_ms: 0,
        },
    )
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
}

#[test]
fn tmux_session_killed_from_outside_is_lost() {
    let f = Fixture::new();
    let info = f
        .start("victim", "echo up; sleep 30; echo after-sleep", true)
        .unwrap();
    assert_eq!(info.runner, "tmux");
    let out = f.tmux(&["kill-session", "-t", "=victim"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let d = f.wait_done("victim");
    assert_eq!(d.state, JobState::Lost, "{d:?}");
    assert_eq!(d.signal, Some(libc::SIGHUP));
    assert!(!pid_alive(info.pid), "the job went down with its session");
    let log = f.log("victim");
    assert!(
        log.ends_with("\nup\nEXIT_CODE=129\n") && !log.contains("\nafter-sleep"),
        "{log}"
    );
}

#[test]
fn wrapper_killed_outright_is_lost_and_takes_the_job_along() {
    let f = Fixture::new();
    // Longer than any wait here: only the wrapper's death may end it. On Linux the kernel's
    // parent-death signal does; on a Mac (and under RSB_TEST_NO_PROCFS=1) the job's guard.
    let info = f.start("orphan", "sleep 300", false).unwrap();
    // A lost job is not the fixture's to stop: this test stops it, also when it fails.
    struct StopGroup(u32);
    impl Drop for StopGroup {
        fn drop(&mut self) {
            if let Some(g) = crate::proc::Group::new(self.0) {
                g.signal(crate::proc::Signal::KILL);
            }
        }
    }
    let _stop = StopGroup(info.pid);
    let wrapper: u32 = f.state("orphan").get_u64("wrapper_pid").unwrap() as u32;
    let pid = rustix::process::Pid::from_raw(wrapper as i32).unwrap();
    rustix::process::kill_process(pid, crate::proc::Signal::KILL).unwrap();
    wait_until("the wrapper to die", || !pid_alive(wrapper));
    let s = f.status("orphan").info.unwrap();
    assert_eq!(
        (s.state, s.exit_code, s.ended_ms),
        (JobState::Lost, None, None)
    );
    wait_until("the orphaned job to get its parent-death signal", || {
        !pid_alive(info.pid)
    });
    // Lost is final: kill reports it unchanged, and the name can be reused.
    assert_eq!(
        kill_in(
            &f.ctx,
            &JobKillRequest {
                name: "orphan".into(),
                grace_ms: 0
            }
        )
        .unwrap(),
        s
    );
    f.start("orphan", "exit 0", false).unwrap();
    assert_eq!(f.wait_done("orphan").exit_code, Some(0));
}

/// The job's guard (a Mac, or RSB_TEST_NO_PROCFS=1: no parent-death signal) is started with
/// the job and ends with it; on Linux the kernel's signal does the work and no guard runs.
#[test]
fn a_job_s_guard_runs_only_without_a_parent_death_signal_and_ends_with_the_job() {
    let f = Fixture::new();
    f.start("guarded", "sleep 1; exit 3", false).unwrap();
    let guard = f.state("guarded").get_u64("guard_pid").map(|p| p as u32);
    assert_eq!(f.wait_done("guarded").exit_code, Some(3));
    if crate::proc::parent_death_signal() {
        assert_eq!(guard, None, "a guard on Linux");
        return;
    }
    let guard = guard.expect("no guard recorded");
    wait_until("the guard to exit", || !pid_alive(guard));
}

#[test]
fn names_are_exact() {
    let f = Fixture::new();
    f.start("train-001", "sleep 5", true).unwrap();
    let st = f.status("train");
    assert_eq!(st.info, None);
    assert!(!st.log_found);
    assert_eq!(
        status_in(&f.ctx, &tail_req("train-00", 5, 100))
            .unwrap()
            .info,
        None
    );
    // `train` can start although tmux has `train-001`, and both are tracked apart.
    f.start("train", "exit 2", true).unwrap();
    assert_eq!(f.wait_done("train").exit_code, Some(2));
    assert_eq!(f.status("train-001").info.unwrap().state, JobState::Running);
}

#[test]
fn invalid_names_are_refused_with_the_rule() {
    let f = Fixture::new();
    let long = "a".repeat(65);
    for bad in [
        "a.b",
        "a:b",
        "a b",
        "a;b",
        "a/b",
        "",
        "../x",
        long.as_str(),
        "ü",
    ] {
        let e = f.start(bad, "true", false).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{bad:?}");
        assert_eq!(
            e.message,
            format!("job name '{bad}' is invalid: {NAME_RULE}")
        );
        assert_eq!(
            status_in(&f.ctx, &tail_req(bad, 1, 1)).unwrap_err().code,
            ErrorCode::InvalidArgument
        );
        let k = kill_in(
            &f.ctx,
            &JobKillRequest {
                name: bad.into(),
                grace_ms: 0,
            },
        )
        .unwrap_err();
        assert_eq!(k.code, ErrorCode::InvalidArgument);
    }
    assert!(
        !f.ctx.root.exists(),
        "nothing was created for refused names"
    );
    validate_name(&"a".repeat(64)).unwrap();
    validate_name("A-z_09").unwrap();
}

#[test]
fn duplicate_running_name_is_refused_and_the_job_untouched() {
    let f = Fixture::new();
    let first = f
        .start("dup", "echo first; sleep 2; echo done-first", true)
        .unwrap();
    let spec_before = std::fs::read(f.ctx.job_dir("dup").join("spec")).unwrap();
    let state_before = std::fs::read(f.ctx.job_dir("dup").join("state")).unwrap();
    for tmux in [true, false] {
        let e = f.start("dup", "echo second; exit 9", tmux).unwrap_err();
        assert_eq!(e.code, ErrorCode::AlreadyExists);
        assert!(e.message.contains("already running"), "{}", e.message);
    }
    assert_eq!(
        std::fs::read(f.ctx.job_dir("dup").join("spec")).unwrap(),
        spec_before
    );
    assert_eq!(
        std::fs::read(f.ctx.job_dir("dup").join("state")).unwrap(),
        state_before
    );
    let d = f.wait_done("dup");
    assert_eq!((d.exit_code, d.pid), (Some(0), first.pid));
    let log = f.log("dup");
    assert!(log.contains("first\ndone-first\nEXIT_CODE=0\n"), "{log}");
    assert!(!log.contains("second"));
}

#[test]
fn finished_names_are_reused_with_history() {
    let f = Fixture::new();
    for i in 1..=7 {
        let info = f
            .start("again", &format!("echo run {i}; exit {i}"), false)
            .unwrap();
        // The reply names the run it moved aside, and where this run's output begins.
        let prev = info.previous.as_ref().map(|p| (p.exit_code, p.state));
        let want = (i > 1).then_some((Some(i - 1), JobState::Exited));
        assert_eq!(prev, want, "run {i}");
        assert_eq!(f.wait_done("again").exit_code, Some(i));
        let log = f.log("again");
        let (before, mine) = log.split_at(info.log_start as usize);
        assert!(mine.starts_with("== session: again\n"), "{mine}");
        assert!(
            mine.ends_with(&format!("run {i}\nEXIT_CODE={i}\n")),
            "{mine}"
        );
        if i > 1 {
            let k = i - 1;
            assert!(before.ends_with(&format!("run {k}\nEXIT_CODE={k}\n")));
        }
    }
    let hist: Vec<_> = std::fs::read_dir(f.ctx.job_dir("again").join("history"))
        .unwrap()
        .collect();
    assert_eq!(hist.len(), HISTORY_KEEP);
    // The log is appended run after run, but a tail shows only the latest run.
    let st = f.status("again");
    let tail = String::from_utf8_lossy(&st.log);
    assert!(tail.starts_with("== session: again\n"), "{tail}");
    assert!(tail.ends_with("run 7\nEXIT_CODE=7\n"), "{tail}");
    assert!(!tail.contains("EXIT_CODE=6"));
    assert_eq!(f.log("again").matches("== session: again").count(), 7);
    assert_eq!(list_in(&f.ctx).unwrap().len(), 1);
}

#[test]
fn without_tmux_on_path_jobs_still_run() {
    let f = Fixture::new();
    let bin = f.tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    for tool in ["bash", "sleep", "cat"] {
        let real = crate::proc::find_on_path(tool).unwrap();
        std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
    }
    let mut ctx = f.ctx.clone();
    ctx.env.retain(|(k, _)| k != "PATH");
    ctx.env.push(("PATH".into(), bin.clone().into()));
    let info = start_in(&ctx, req("notmux", "sleep 1; echo \"$PATH\"; exit 4", true)).unwrap();
    assert_eq!(info.runner, "setsid");
    let deadline = Instant::now() + WAIT;
    let done = loop {
        let i = status_in(&ctx, &tail_req("notmux", 5, 1000))
            .unwrap()
            .info
            .unwrap();
        if i.state != JobState::Running {
            break i;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(done.exit_code, Some(4));
    assert!(f.log("notmux").contains(&format!("{}\n", bin.display())));
}

#[test]
fn a_foreign_tmux_session_with_the_name_falls_back_to_setsid() {
    let f = Fixture::new();
    let out = f.tmux(&["new-session", "-d", "-s", "occupied", "sleep", "30"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info = f.start("occupied", "exit 6", true).unwrap();
    assert_eq!(info.runner, "setsid");
    assert_eq!(f.wait_done("occupied").exit_code, Some(6));
    let wlog = std::fs::read_to_string(f.ctx.job_dir("occupied").join("wrapper.log")).unwrap();
    assert!(
        wlog.contains("duplicate session: occupied"),
        "tmux's refusal is kept: {wlog}"
    );
    let out = f.tmux(&["has-session", "-t", "=occupied"]);
    assert!(out.status.success(), "the user's own session is left alone");
}

#[test]
fn a_job_that_cannot_start_is_an_error_and_recorded() {
    let f = Fixture::new();
    let empty = f.tmp.path().join("empty-bin");
    std::fs::create_dir(&empty).unwrap();
    let mut r = req("nobash", "true", false);
    r.env = vec![("PATH".into(), empty.display().to_string())];
    let e = start_in(&f.ctx, r).unwrap_err();
    assert!(
        e.message.contains("could not start: cannot start bash"),
        "{}",
        e.message
    );
    let info = f.status("nobash").info.unwrap();
    assert_eq!((info.state, info.exit_code), (JobState::Exited, Some(127)));
    assert!(f.log("nobash").ends_with("EXIT_CODE=127\n"));
}

#[test]
fn cursor_reads_every_byte_exactly_once_while_the_job_writes() {
    let f = Fixture::new();
    let cmd = "for i in $(seq 1 400); do printf 'line %d %0200d\\n' $i 0; sleep 0.002; done; printf tail-no-newline";
    f.start("stream", cmd, false).unwrap();
    let mut got = Vec::new();
    let mut offset = 0;
    let mut reads = 0;
    let deadline = Instant::now() + WAIT;
    loop {
        let r = JobStatusRequest {
            name: "stream".into(),
            log_file: None,
            last_n_lines: 0,
            offset: Some(offset),
            max_bytes: 3000,
        };
        let st = status_in(&f.ctx, &r).unwrap();
        assert_eq!(st.log_start, offset);
        assert_eq!(st.next_offset, offset + st.log.len() as u64);
        got.extend_from_slice(&st.log);
        offset = st.next_offset;
        reads += 1;
        if st.info.unwrap().state != JobState::Running && !st.log_truncated {
            break;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(3));
    }
    let file = std::fs::read(f.status("stream").info.unwrap().log_file).unwrap();
    assert_eq!(got, file, "pieces concatenate to the log");
    assert!(reads > 10, "the reads overlapped the writes ({reads})");
    assert!(file.ends_with(b"tail-no-newline\nEXIT_CODE=0\n"));
}

#[test]
fn jobs_survive_the_process_that_started_them() {
    if std::env::var_os("RSB_JOBS_CHILD_ROOT").is_some() {
        return; // the helper's own run; see `helper_start_and_exit`
    }
    let f = Fixture::new();
    for (name, tmux) in [("survivor", false), ("survivor-t", true)] {
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "jobs::tests::helper_start_and_exit",
                "--ignored",
                "--nocapture",
            ])
            .env("RSB_JOBS_CHILD_ROOT", f.tmp.path())
            .env("RSB_JOBS_CHILD_NAME", name)
            .env("RSB_JOBS_CHILD_TMUX", if tmux { "1" } else { "0" })
            .process_group(0)
            .output()
            .unwrap();
        assert!(
            child.status.success(),
            "{}",
            String::from_utf8_lossy(&child.stdout)
        );
        let info = f.status(name).info.unwrap();
        assert_eq!(info.state, JobState::Running);
        let st = f.state(name);
        let wrapper = st.get_u64("wrapper_pid").unwrap() as u32;
        let sid = |pid: u32| Stat::read(pid).unwrap().session;
        let (my_sid, wrapper_sid, job_sid) = (sid(std::process::id()), sid(wrapper), sid(info.pid));
        assert!(
            wrapper_sid > 0 && wrapper_sid != my_sid,
            "wrapper in its own session"
        );
        assert_eq!(
            job_sid, info.pid as i32,
            "job leads its own session and group"
        );
        assert_eq!(f.wait_done(name).exit_code, Some(4));
    }
}

/// Run only by `jobs_survive_the_process_that_started_them` in a child process.
#[test]
#[ignore]
fn helper_start_and_exit() {
    let Some(root) = std::env::var_os("RSB_JOBS_CHILD_ROOT") else {
        return;
    };
    let ctx = ctx_under(Path::new(&root));
    let name = std::env::var("RSB_JOBS_CHILD_NAME").unwrap();
    let tmux = std::env::var("RSB_JOBS_CHILD_TMUX").unwrap() == "1";
    start_in(&ctx, req(&name, "sleep 2; exit 4", tmux)).unwrap();
}

#[test]
fn bad_cwd_is_an_error_before_anything_launches() {
    let f = Fixture::new();
    let mut r = req("cwdless", "touch created", false);
    r.cwd = Some("~/missing/dir".into());
    let e = start_in(&f.ctx, r.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
    assert!(e.message.contains("missing/dir"), "{}", e.message);
    assert!(
        !f.ctx.home.join("missing").exists(),
        "the seed created it; we must not"
    );
    assert!(!f.ctx.root.exists());
    std::fs::write(f.ctx.home.join("file"), "x").unwrap();
    r.cwd = Some("file".into());
    assert_eq!(
        start_in(&f.ctx, r.clone()).unwrap_err().code,
        ErrorCode::NotADirectory
    );
    r.cwd = None;
    r.command = "  ".into();
    assert_eq!(
        start_in(&f.ctx, r).unwrap_err().code,
        ErrorCode::InvalidArgument
    );
}

#[test]
fn cwd_env_and_log_paths_are_honoured() {
    let f = Fixture::new();
    std::fs::create_dir_all(f.ctx.home.join("proj")).unwrap();
    let mut r = req("where", "pwd; echo \"$GREETING\"; echo \"$HOME\"", false);
    r.cwd = Some("proj".into());
    r.log_file = "proj/logs/a.log".into();
    r.env = vec![("GREETING".into(), "hello world\nsecond line".into())];
    let info = start_in(&f.ctx, r).unwrap();
    let proj = f.ctx.home.join("proj");
    assert_eq!(info.cwd, proj.display().to_string());
    assert_eq!(info.log_file, proj.join("logs/a.log").display().to_string());
    f.wait_done("where");
    let log = f.log("where");
    assert!(
        log.contains(&format!(
            "\n{}\nhello world\nsecond line\n{}\n",
            proj.display(),
            f.ctx.home.display()
        )),
        "{log}"
    );
    // Reading another log by path (seed compatibility), relative to $HOME.
    let st = status_in(
        &f.ctx,
        &JobStatusRequest {
            name: "nojob".into(),
            log_file: Some("proj/logs/a.log".into()),
            last_n_lines: 1,
            offset: None,
            max_bytes: 100,
        },
    )
    .unwrap();
    assert_eq!(
        (st.info, st.log_found, st.log.as_slice()),
        (None, true, b"EXIT_CODE=0\n".as_slice())
    );
}

#[test]
fn log_paths_follow_the_seed_rules() {
    let home = Path::new("/home/u");
    let cases = [
        (None, "", "/home/u/.codex_logs/S.log"),
        (Some("~/proj"), "", "/home/u/proj/.codex_logs/S.log"),
        (Some("proj"), "proj/logs/a.log", "/home/u/proj/logs/a.log"),
        (Some("/abs/proj"), "logs/a.log", "/abs/proj/logs/a.log"),
        (None, "/var//log/../a.log", "/var/a.log"),
        (Some("proj"), "~/logs/a.log", "/home/u/logs/a.log"),
        (Some("/abs/proj"), "../other/a.log", "/abs/other/a.log"),
        (Some("proj"), "projx/a.log", "/home/u/proj/projx/a.log"),
        (Some("./proj/"), "proj/a.log", "/home/u/proj/a.log"),
    ];
    for (cwd, log, want) in cases {
        let resolved_cwd = match cwd {
            None => home.to_path_buf(),
            Some(c) => normalize(&home.join(expand_tilde(c, home))),
        };
        assert_eq!(
            resolve_log(log, "S", cwd, &resolved_cwd, home),
            PathBuf::from(want),
            "{cwd:?} {log:?}"
        );
    }
}

/// Run `command` under `job-run` in the foreground, as Slurm runs the batch script, and return
/// the wrapper's own exit status.
fn job_run_status(f: &Fixture, name: &str, command: &str) -> std::process::ExitStatus {
    let dir = f.ctx.job_dir(name);
    record::create_private_dir(&dir).unwrap();
    let mut spec = Record::new();
    spec.set("name", name);
    spec.set("command", command);
    spec.set("cwd", f.ctx.home.as_os_str().as_bytes());
    let log = f.ctx.home.join(format!("{name}.log"));
    spec.set("log_file", log.as_os_str().as_bytes());
    spec.set("launch", "l1");
    spec.write_atomic(&dir.join("spec")).unwrap();
    Command::new(&f.ctx.exe)
        .args(["job-run", "--root"])
        .arg(&f.ctx.root)
        .args(["--name", name, "--launch", "l1"])
        .status()
        .unwrap()
}

/// A Slurm job's confinement is decided by the wrapper on the node that runs it (its kernel
/// may differ from the login node's): a node without Landlock refuses a job that requires it
/// (127, the reason in the log and the record) and runs one that allows it, saying so in the
/// log; a node with Landlock confines the job's command.
#[test]
fn job_run_confines_on_its_node_or_refuses() {
    let f = Fixture::new();
    let (inside, outside) = (f.ctx.home.join("inside"), f.ctx.home.join("outside"));
    std::fs::create_dir_all(&inside).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::create_dir_all(f.ctx.home.join("data")).unwrap();
    let run = |name: &str, require: bool, abi: Option<&str>| {
        let dir = f.ctx.job_dir(name);
        record::create_private_dir(&dir).unwrap();
        let mut spec = Record::new();
        spec.set("name", name);
        let (o, i) = (outside.join(name), inside.join(name));
        spec.set(
            "command",
            format!(
                "touch {} || echo denied; touch {}",
                o.display(),
                i.display()
            ),
        );
        spec.set("cwd", f.ctx.home.as_os_str().as_bytes());
        // A confined job's log keeps to the write roots too.
        let log = inside.join(format!("{name}.log"));
        spec.set("log_file", log.as_os_str().as_bytes());
        spec.set("launch", "l1");
        let c = rsb_protocol::Confine {
            write: vec![inside.display().to_string()],
            read: Some(vec![f.ctx.home.join("data").display().to_string()]),
            net: None,
            require,
        };
        record::set_confine(&mut spec, &c);
        assert_eq!(record::confine_of(&spec), Some(c));
        spec.write_atomic(&dir.join("spec")).unwrap();
        let mut cmd = Command::new(&f.ctx.exe);
        cmd.args(["job-run", "--root"])
            .arg(&f.ctx.root)
            .args(["--name", name, "--launch", "l1"]);
        if let Some(abi) = abi {
            cmd.env("RSB_TEST_LANDLOCK_ABI", abi);
        }
        let st = cmd.status().unwrap();
        (
            st.code(),
            std::fs::read_to_string(log).unwrap(),
            o.exists(),
            i.exists(),
        )
    };
    let (code, log, out, ins) = run("strict", true, Some("0"));
    assert_eq!(code, Some(127), "{log}");
    assert!(log.contains("has no Landlock"), "{log}");
    assert!(!out && !ins, "the refused job ran");
    let rec = Record::read(&f.ctx.job_dir("strict").join("state")).unwrap();
    assert!(
        rec.get("error")
            .unwrap_or_default()
            .contains("has no Landlock")
    );
    let (code, log, out, ins) = run("lax", false, Some("0"));
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("rsb-agent: unconfined: "), "{log}");
    assert!(out && ins);
    if crate::confine::abi() >= 1 {
        let (code, log, out, ins) = run("confined", true, None);
        assert_eq!(code, Some(0), "{log}");
        assert!(log.contains("denied"), "{log}");
        assert!(!out && ins, "{log}");
    }
}

#[test]
fn job_run_exits_with_the_commands_status_or_signal() {
    use std::os::unix::process::ExitStatusExt;
    let f = Fixture::new();
    let st = job_run_status(&f, "three", "exit 3");
    assert_eq!(st.code(), Some(3), "{st:?}");
    let rec = Record::read(&f.ctx.job_dir("three").join("state")).unwrap();
    assert_eq!(rec.get("exit_code"), Some("3"));
    let st = job_run_status(&f, "termed", "kill -TERM $$");
    assert_eq!(st.signal(), Some(libc::SIGTERM), "{st:?}");
    let st = job_run_status(&f, "ok", "true");
    assert_eq!(st.code(), Some(0), "{st:?}");
}

#[test]
fn job_run_forwards_usr1_to_the_job() {
    let f = Fixture::new();
    let name = "usr1";
    let dir = f.ctx.job_dir(name);
    record::create_private_dir(&dir).unwrap();
    let mut spec = Record::new();
    spec.set("name", name);
    spec.set(
        "command",
        "trap 'exit 7' USR1; echo up; for i in 1 2 3 4 5 6 7 8 9 10; do sleep 1; done",
    );
    spec.set("cwd", f.ctx.home.as_os_str().as_bytes());
    let log = f.ctx.home.join("usr1.log");
    spec.set("log_file", log.as_os_str().as_bytes());
    spec.set("launch", "l1");
    spec.write_atomic(&dir.join("spec")).unwrap();
    let mut child = Command::new(&f.ctx.exe)
        .args(["job-run", "--root"])
        .arg(&f.ctx.root)
        .args(["--name", name, "--launch", "l1"])
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    // The job's own line, not the header's `== command: … echo up …`: the trap is set only
    // once the job printed it (a signal sent on the header's word killed bash before its trap).
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("\nup\n")
    {
        assert!(std::time::Instant::now() < deadline, "job never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(7), "{st:?}");
}

#[test]
fn stale_launch_does_not_run() {
    let f = Fixture::new();
    let dir = f.ctx.job_dir("stale");
    record::create_private_dir(&dir).unwrap();
    let mut spec = Record::new();
    spec.set("name", "stale");
    spec.set("command", "touch ran");
    spec.set("cwd", f.ctx.home.as_os_str().as_bytes());
    spec.set(
        "log_file",
        f.ctx.home.join("stale.log").as_os_str().as_bytes(),
    );
    spec.set("launch", "new-launch");
    spec.write_atomic(&dir.join("spec")).unwrap();
    let out = Command::new(&f.ctx.exe)
        .args(["job-run", "--root"])
        .arg(&f.ctx.root)
        .args(["--name", "stale", "--launch", "old-launch"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(!dir.join("state").exists());
    assert!(!f.ctx.home.join("ran").exists());
    let wlog = std::fs::read_to_string(dir.join("wrapper.log")).unwrap();
    assert!(
        wlog.contains("launch=old-launch error: the spec belongs to launch new-launch"),
        "{wlog}"
    );
}

#[test]
fn job_dirs_are_private_and_list_is_newest_first() {
    let f = Fixture::new();
    f.start("older", "exit 0", false).unwrap();
    f.wait_done("older");
    std::thread::sleep(Duration::from_millis(5));
    f.start("newer", "sleep 3", false).unwrap();
    let jobs = list_in(&f.ctx).unwrap();
    let names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
    assert_eq!(names, ["newer", "older"]);
    assert_eq!(jobs[0].state, JobState::Running);
    for p in [f.ctx.root.clone(), f.ctx.job_dir("older")] {
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o700,
            "{}",
            p.display()
        );
    }
    for file in ["spec", "state"] {
        let m = std::fs::metadata(f.ctx.job_dir("older").join(file)).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
    }
    let table = jobs_table(&jobs);
    assert!(table.starts_with("NAME "), "{table}");
    assert!(table.contains("newer  running  -"), "{table}");
    let json = jobs_json(&jobs);
    assert!(
        json.contains(
            "\"name\": \"older\", \"state\": \"exited\", \"exit_code\": 0, \"signal\": null"
        ),
        "{json}"
    );
    assert_eq!(jobs_json(&[]), "[]\n");
}

#[test]
fn timestamps_and_quoting() {
    assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
    assert_eq!(utc_timestamp(951_782_400_000), "2000-02-29T00:00:00Z");
    assert_eq!(utc_timestamp(1_795_996_799_999), "2026-11-29T23:59:59Z");
    assert_eq!(utc_timestamp(1_709_210_096_000), "2024-02-29T12:34:56Z");
    let tricky = "/tmp/it's a \"dir\"/$(x) `y` \\z";
    let line = [
        b"printf %s ".as_slice(),
        &rsb_rules::shell::quote(tricky.as_bytes()),
    ]
    .concat();
    let out = Command::new("sh")
        .arg("-c")
        .arg(OsStr::from_bytes(&line))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), tricky);
}

#[test]
fn log_file_that_is_not_a_regular_file_is_a_prompt_error() {
    let f = Fixture::new();
    let fifo = f.tmp.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let read = |path: &Path, offset: Option<u64>| {
        status_in(
            &f.ctx,
            &JobStatusRequest {
                name: "nojob".into(),
                log_file: Some(path.display().to_string()),
                last_n_lines: 10,
                offset,
                max_bytes: 100,
            },
        )
    };
    for offset in [None, Some(0)] {
        // A FIFO with no writer: opening it blocking would hang this thread forever.
        let t = Instant::now();
        let err = read(&fifo, offset).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert_eq!(err.code, ErrorCode::InvalidArgument, "{err:?}");
        assert!(err.message.contains("not a regular file (fifo)"), "{err}");
        assert!(!err.message.contains('\n'), "{err}");
        // A device reads as empty (/dev/null) or forever (/dev/zero): never a log.
        for dev in ["/dev/zero", "/dev/null"] {
            let err = read(Path::new(dev), offset).unwrap_err();
            assert!(
                err.message.contains(dev) && err.message.contains("not a regular file"),
                "{err}"
            );
        }
        let err = read(f.tmp.path(), offset).unwrap_err();
        assert_eq!(err.code, ErrorCode::IsADirectory, "{err:?}");
    }
}

/// A caller that lost the reply repeats the start with the same launch id: the run it started
/// is returned, running or ended, and the command ran once. A new id launches a new run once
/// the old one ended, and is refused while it runs.
#[test]
fn a_start_repeated_with_its_launch_id_runs_once() {
    let f = Fixture::new();
    let count = f.ctx.home.join("count");
    let cmd = format!("echo run >> '{}'; sleep 1", count.display());
    let with_id = |id: &str| JobStartRequest {
        launch_id: Some(id.into()),
        confine: None,
        gpus: None,
        ..req("idem", &cmd, false)
    };
    let first = start_in(&f.ctx, with_id("L1")).unwrap();
    assert_eq!(first.launch_id, "L1");
    let again = start_in(&f.ctx, with_id("L1")).unwrap();
    assert_eq!((again.pid, again.started_ms), (first.pid, first.started_ms));
    let other = start_in(&f.ctx, with_id("L2")).unwrap_err();
    assert_eq!(other.code, ErrorCode::AlreadyExists, "{other}");
    f.wait_done("idem");
    let after_end = start_in(&f.ctx, with_id("L1")).unwrap();
    assert_eq!(
        (after_end.state, after_end.started_ms),
        (JobState::Exited, first.started_ms)
    );
    assert_eq!(std::fs::read_to_string(&count).unwrap(), "run\n");
    let second = start_in(&f.ctx, with_id("L2")).unwrap();
    assert_ne!(second.started_ms, first.started_ms);
    f.wait_done("idem");
    assert_eq!(std::fs::read_to_string(&count).unwrap(), "run\nrun\n");
    // The record names the launch that made it.
    assert_eq!(f.status("idem").info.unwrap().launch_id, "L2");
}

/// A subscription on its own thread, as the agent serves one: its events with the wall-clock
/// time each arrived, and its cancel token. Dropped, it is cancelled and joined.
struct Subscription {
    rx: std::sync::mpsc::Receiver<(u64, rsb_protocol::JobEvent)>,
    cancel: tokio_util::sync::CancellationToken,
    thread: Option<std::thread::JoinHandle<Result<Vec<JobInfo>, AgentError>>>,
}

impl Subscription {
    fn new(ctx: &Ctx, req: rsb_protocol::JobEventsRequest) -> Subscription {
        let (tx, rx) = std::sync::mpsc::channel();
        let cancel = tokio_util::sync::CancellationToken::new();
        let (ctx, token) = (ctx.clone(), cancel.clone());
        let thread = std::thread::spawn(move || {
            events::events_in(&ctx, &req, &token, &mut |e| tx.send((now_ms(), e)).is_ok())
        });
        Subscription {
            rx,
            cancel,
            thread: Some(thread),
        }
    }

    fn all(names: &[&str]) -> rsb_protocol::JobEventsRequest {
        rsb_protocol::JobEventsRequest {
            names: names.iter().map(|n| n.to_string()).collect(),
            since_ms: 0,
            until_ended: false,
            output_after: None,
        }
    }

    /// Events until `done` says enough (bounded by [`WAIT`]).
    fn until(
        &self,
        mut done: impl FnMut(&[(u64, rsb_protocol::JobEvent)]) -> bool,
    ) -> Vec<(u64, rsb_protocol::JobEvent)> {
        let deadline = Instant::now() + WAIT;
        let mut got = Vec::new();
        while !done(&got) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(e) => got.push(e),
                Err(_) => panic!("events so far: {got:#?}"),
            }
        }
        got
    }

    fn stop(mut self) -> Result<Vec<JobInfo>, AgentError> {
        self.cancel.cancel();
        let t = Instant::now();
        let r = self.thread.take().unwrap().join().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "cancel took {:?}",
            t.elapsed()
        );
        r
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ends(got: &[(u64, rsb_protocol::JobEvent)]) -> usize {
    got.iter()
        .filter(|(_, e)| e.kind != rsb_protocol::JobEventKind::Started)
        .count()
}

/// Issue 40: the agent reports each end the moment the wrapper records it (inotify), not at
/// a poll: within 500 ms of `ended_ms`, once per job, with the exit code and the last line
/// the job printed; a job that printed nothing has no last line (never rsb's own header).
#[test]
fn job_events_report_each_end_at_once_and_once() {
    use rsb_protocol::JobEventKind::{Ended, Started};
    let f = Fixture::new();
    std::fs::create_dir_all(&f.ctx.root).unwrap();
    let sub = Subscription::new(&f.ctx, Subscription::all(&[]));
    let jobs = [
        ("a", "sleep 0.3; echo done-a; exit 3", 3),
        ("b", "sleep 0.7; exit 0", 0),
        ("c", "sleep 1.1; echo 'last c'", 0),
    ];
    for (name, cmd, _) in jobs {
        f.start(name, cmd, false).unwrap();
    }
    let got = sub.until(|g| ends(g) == 3);
    for (name, _, code) in jobs {
        let of: Vec<_> = got.iter().filter(|(_, e)| e.info.name == name).collect();
        let kinds: Vec<_> = of.iter().map(|(_, e)| e.kind).collect();
        assert!(
            kinds == [Started, Ended] || kinds == [Ended],
            "{name}: {kinds:?}"
        );
        let (at, end) = of.last().unwrap();
        assert_eq!(end.info.exit_code, Some(code), "{name}");
        let late = at.saturating_sub(end.info.ended_ms.unwrap());
        assert!(
            late < 500,
            "{name}'s end arrived {late} ms after it was recorded"
        );
    }
    let last = |n: &str| {
        got.iter()
            .rev()
            .find(|(_, e)| e.info.name == n)
            .unwrap()
            .1
            .last_line
            .clone()
    };
    assert_eq!(last("a").as_deref(), Some("done-a"));
    assert_eq!(last("b"), None, "b printed nothing");
    assert_eq!(last("c").as_deref(), Some("last c"));
    // Nothing more: no end twice.
    std::thread::sleep(Duration::from_millis(2_500));
    let extra: Vec<_> = sub.rx.try_iter().collect();
    assert!(extra.is_empty(), "{extra:#?}");
    assert!(matches!(sub.stop(), Err(e) if e.code == ErrorCode::Cancelled));
}

/// An end the subscriber missed (it ended before the subscription, at or after `since_ms`) is
/// reported at once; `until_ended` replies once the named job ends, or at once when it has;
/// a name not recorded is an error.
#[test]
fn job_events_since_and_until_ended() {
    let f = Fixture::new();
    let t0 = now_ms();
    f.start("early", "echo hi", false).unwrap();
    f.wait_done("early");
    let sub = Subscription::new(
        &f.ctx,
        rsb_protocol::JobEventsRequest {
            since_ms: t0,
            ..Subscription::all(&["early"])
        },
    );
    let got = sub.until(|g| !g.is_empty());
    assert_eq!(got[0].1.kind, rsb_protocol::JobEventKind::Ended);
    assert_eq!(got[0].1.last_line.as_deref(), Some("hi"));
    drop(sub);

    f.start("later", "sleep 0.5; exit 4", false).unwrap();
    let until = |names: &[&str]| rsb_protocol::JobEventsRequest {
        until_ended: true,
        ..Subscription::all(names)
    };
    let t = Instant::now();
    let infos = Subscription::new(&f.ctx, until(&["later"])).stop_when_done();
    assert_eq!(infos[0].exit_code, Some(4));
    assert!(
        t.elapsed() < Duration::from_millis(1_500),
        "{:?}",
        t.elapsed()
    );
    // Ended already: at once.
    let t = Instant::now();
    let infos = Subscription::new(&f.ctx, until(&["later"])).stop_when_done();
    assert_eq!(infos[0].exit_code, Some(4));
    assert!(t.elapsed() < Duration::from_millis(300));
    let e = Subscription::new(&f.ctx, until(&["nope"])).stop_when_done_err();
    assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
    let e = Subscription::new(&f.ctx, until(&[])).stop_when_done_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{e:?}");
}

/// `output_after` (check_background_task's wait): one Output event once the running job's
/// log passes the size, with its last line, within a tick or two; none for a job that prints
/// nothing more; the end still replies.
#[test]
fn job_events_output_after_a_size() {
    let f = Fixture::new();
    f.start(
        "talk",
        "echo one; sleep 1; echo two; sleep 1; exit 5",
        false,
    )
    .unwrap();
    wait_until("the first line", || f.log("talk").contains("one\n"));
    let size = f.status("talk").log_size;
    let sub = Subscription::new(
        &f.ctx,
        rsb_protocol::JobEventsRequest {
            until_ended: true,
            output_after: Some(size),
            ..Subscription::all(&["talk"])
        },
    );
    let got = sub.until(|g| {
        g.iter()
            .any(|(_, e)| e.kind == rsb_protocol::JobEventKind::Output)
    });
    let out = &got.last().unwrap().1;
    assert_eq!(out.last_line.as_deref(), Some("two"));
    assert_eq!(out.info.state, JobState::Running);
    let at = got.last().unwrap().0;
    let grew = std::fs::metadata(&out.info.log_file)
        .unwrap()
        .modified()
        .unwrap();
    let grew_ms = grew
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(at.saturating_sub(grew_ms) < 600, "{} ms", at - grew_ms);
    // Once: the end comes, with no second Output, and replies.
    let rest = sub.until(|g| {
        g.iter()
            .any(|(_, e)| e.kind == rsb_protocol::JobEventKind::Ended)
    });
    assert!(
        rest.iter()
            .all(|(_, e)| e.kind != rsb_protocol::JobEventKind::Output),
        "{rest:#?}"
    );
    let infos = sub.join_done().unwrap();
    assert_eq!(infos[0].exit_code, Some(5));
    let e = Subscription::new(
        &f.ctx,
        rsb_protocol::JobEventsRequest {
            output_after: Some(0),
            ..Subscription::all(&[])
        },
    )
    .join_done()
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{e:?}");
}

impl Subscription {
    fn join_done(mut self) -> Result<Vec<JobInfo>, AgentError> {
        let t = self.thread.take().unwrap();
        let deadline = Instant::now() + WAIT;
        while !t.is_finished() {
            assert!(Instant::now() < deadline, "the subscription never ended");
            std::thread::sleep(Duration::from_millis(10));
        }
        t.join().unwrap()
    }

    fn stop_when_done(self) -> Vec<JobInfo> {
        self.join_done().unwrap()
    }

    fn stop_when_done_err(self) -> AgentError {
        self.join_done().unwrap_err()
    }
}

/// A supervisor killed outright records nothing: the re-read sees the job lost within
/// [`rsb_protocol::JOB_EVENTS_RESCAN_MS`] (and a bit).
#[test]
fn job_events_see_a_lost_job_by_the_rescan() {
    let f = Fixture::new();
    f.start("orphan", "sleep 30", false).unwrap();
    let sub = Subscription::new(&f.ctx, Subscription::all(&["orphan"]));
    std::thread::sleep(Duration::from_millis(300));
    let wrapper = f.state("orphan").get_u64("wrapper_pid").unwrap() as i32;
    let t = Instant::now();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(wrapper).unwrap(),
        crate::proc::Signal::KILL,
    )
    .unwrap();
    let got = sub.until(|g| ends(g) == 1);
    assert_eq!(got[0].1.kind, rsb_protocol::JobEventKind::Lost);
    let bound = Duration::from_millis(rsb_protocol::JOB_EVENTS_RESCAN_MS + 1_000);
    assert!(t.elapsed() < bound, "lost seen after {:?}", t.elapsed());
}

/// A wrapper writes its end, then exits: a read of the record from before the write, with the
/// liveness check after the exit, read a job that ended as lost (and a watch would then
/// resume a finished job). The record is now read again once the wrapper is seen dead. Each
/// of 30 short jobs is read as fast as possible until it ends: none is ever lost.
#[test]
fn a_job_ending_while_its_record_is_read_is_never_lost() {
    const JOBS: usize = 30;
    let f = Fixture::new();
    let (mut lost, mut reads) = (0, 0);
    for i in 0..JOBS {
        let name = format!("brief{i}");
        f.start(&name, "sleep 0.05", false).unwrap();
        let deadline = Instant::now() + WAIT;
        loop {
            let info = load(&f.ctx, &name).unwrap().and_then(|j| j.info()).unwrap();
            reads += 1;
            match info.state {
                JobState::Running => {}
                JobState::Lost => {
                    lost += 1;
                    break;
                }
                JobState::Exited => break,
            }
            assert!(
                Instant::now() < deadline,
                "{name} still running after {WAIT:?}"
            );
        }
    }
    println!("{reads} reads of {JOBS} ending jobs, {lost} read as lost");
    assert_eq!(lost, 0);
    for j in list_in(&f.ctx).unwrap() {
        assert_eq!((j.state, j.exit_code), (JobState::Exited, Some(0)), "{j:?}");
    }
}

/// GPU leases: two jobs asking for 2 of the same 4 GPUs get different ones, a third finds none
/// free (Busy, no trace left), a report names each lease's job, and a lease ends with its
/// holder: a wrapper killed outright (SIGKILL) or a job that ended.
#[test]
fn gpu_leases_keep_jobs_apart_and_end_with_their_holder() {
    let f = Fixture::new();
    let tag = format!("{}-{}", std::process::id(), now_ms());
    let uuids: Vec<String> = (0..4).map(|i| format!("GPU-t{i}-{tag}")).collect();
    // A planted link in the shared directory is refused, never followed.
    let planted = format!("GPU-link-{tag}");
    let dir = Path::new(rsb_protocol::GPU_LEASE_DIR);
    let target = f.tmp.path().join("private");
    std::fs::write(&target, "x").unwrap();
    std::os::unix::fs::symlink(&target, crate::lease::lease_path(&planted).unwrap()).unwrap();
    let mut offered = vec![planted.clone()];
    offered.extend(uuids.iter().cloned());
    struct Cleanup(Vec<PathBuf>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let _cleanup = Cleanup(offered.iter().map(|u| dir.join(u)).collect());
    let mode = std::fs::symlink_metadata(dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o1777, "shared by every user, like /tmp");
    let ask = |name: &str, count: u32, tmux: bool| {
        let mut r = req(
            name,
            "echo \"$CUDA_VISIBLE_DEVICES|$CUDA_DEVICE_ORDER\"; sleep 60",
            tmux,
        );
        r.gpus = Some(rsb_protocol::GpuAsk {
            count,
            candidates: offered.clone(),
        });
        start_in(&f.ctx, r)
    };
    let a = ask("a", 2, false).unwrap();
    assert_eq!(a.gpus, uuids[..2], "in the caller's order, past the link");
    let b = ask("b", 2, true).unwrap();
    assert_eq!(b.gpus, uuids[2..]);
    wait_until("a's line", || {
        f.log("a")
            .contains(&format!("\n{},{}|PCI_BUS_ID\n", uuids[0], uuids[1]))
    });
    wait_until("b's line", || {
        f.log("b")
            .contains(&format!("\n{},{}|PCI_BUS_ID\n", uuids[2], uuids[3]))
    });
    let e = ask("c", 1, true).unwrap_err();
    assert_eq!(e.code, ErrorCode::Busy, "{e}");
    assert!(
        e.message
            .contains("1 asked, 0 of the 5 offered free (4 leased by other rsb jobs)")
            && e.message.contains(&format!("cannot lease {planted}: ")),
        "{e}"
    );
    assert_eq!(f.status("c").info, None, "a refused start leaves no run");

    let refs: Vec<&str> = uuids.iter().map(String::as_str).collect();
    let held = crate::lease::holders(&refs);
    let wrapper = |n: &str| f.state(n).get_u64("wrapper_pid").unwrap() as u32;
    let me = Some(rustix::process::getuid().as_raw());
    for (i, h) in held.iter().enumerate() {
        let (job, pid) = if i < 2 {
            ("a", wrapper("a"))
        } else {
            ("b", wrapper("b"))
        };
        let h = h
            .as_ref()
            .unwrap_or_else(|| panic!("GPU {i} shows no lease"));
        assert_eq!((h.pid, h.uid, h.job.as_deref()), (pid, me, Some(job)));
    }
    // The job itself (a child of its wrapper) is named the same way.
    assert_eq!(crate::lease::who(a.pid).job.as_deref(), Some("a"));
    assert_eq!(crate::lease::who(std::process::id()).job, None);

    // SIGKILL a's wrapper: its lease ends with it.
    let pid = rustix::process::Pid::from_raw(wrapper("a") as i32).unwrap();
    rustix::process::kill_process(pid, crate::proc::Signal::KILL).unwrap();
    wait_until("a's wrapper to die", || !pid_alive(wrapper("a")));
    assert_eq!(crate::lease::holders(&refs[..1]), vec![None]);
    let d = ask("d", 2, false).unwrap();
    assert_eq!(d.gpus, uuids[..2]);
    // b ends: its GPUs are free again.
    kill_in(
        &f.ctx,
        &JobKillRequest {
            name: "b".into(),
            grace_ms: 0,
        },
    )
    .unwrap();
    let e = ask("e", 2, false).unwrap();
    assert_eq!(e.gpus, uuids[2..]);

    let bad = |candidates: Vec<String>, count| {
        let mut r = req("x", "true", false);
        r.gpus = Some(rsb_protocol::GpuAsk { count, candidates });
        start_in(&f.ctx, r).unwrap_err()
    };
    assert_eq!(
        bad(vec!["../etc".into()], 1).code,
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        bad(vec![uuids[0].clone()], 0).code,
        ErrorCode::InvalidArgument
    );
    assert_eq!(bad(vec![uuids[0].clone()], 2).code, ErrorCode::Busy);
}
