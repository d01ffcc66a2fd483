//! Jobs driven through the real binary with a private `$HOME`: over `rsb-agent serve` the way
//! rsb drives them (including a job outliving the agent that started it), and the `job-run`
//! wrapper and `rsb-agent jobs` listing directly. Edge cases of start/status/kill are in the
//! unit tests (`src/jobs/tests.rs`), which call them with their own jobs root.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use rsb_protocol::{
    FromAgent, JobInfo, JobKillRequest, JobStartRequest, JobState, JobStatusRequest,
    JobStatusResult, Reply, Request, ToAgent, decode, encode,
};

const AGENT: &str = env!("CARGO_BIN_EXE_rsb-agent");

fn agent(home: &Path, args: &[&str]) -> Output {
    Command::new(AGENT)
        .args(args)
        .env("HOME", home)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A spec in the documented record format (`key=value`, `\n` escaped), as `start` writes it.
fn write_spec(home: &Path, name: &str, command: &str, launch: &str) -> (PathBuf, PathBuf) {
    let root = home.join(".cache/rsb/jobs");
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let log = home.join("logs").join(format!("{name}.log"));
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    let spec = format!(
        "format=1\nname={name}\ncommand={}\ncwd={}\nlog_file={}\nlaunch={launch}\nenv=PATH={}\nenv=HOME={}\n",
        command.replace('\\', "\\\\").replace('\n', "\\n"),
        home.display(),
        log.display(),
        std::env::var("PATH").unwrap(),
        home.display(),
    );
    std::fs::write(dir.join("spec"), spec).unwrap();
    (root, log)
}

fn read_state(home: &Path, name: &str) -> String {
    std::fs::read_to_string(home.join(".cache/rsb/jobs").join(name).join("state"))
        .unwrap_or_default()
}

#[test]
fn jobs_lists_nothing_in_an_empty_home() {
    let home = tempfile::tempdir().unwrap();
    let out = agent(home.path(), &["jobs"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "no jobs\n");
    let out = agent(home.path(), &["jobs", "--json"]);
    assert_eq!(text(&out.stdout), "[]\n");
    let out = agent(home.path(), &["jobs", "--bogus"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unknown argument '--bogus'"));
}

#[test]
fn wrapper_records_the_exit_code_the_log_and_the_listing() {
    let home = tempfile::tempdir().unwrap();
    let (root, log) = write_spec(
        home.path(),
        "hand",
        "echo hi\nprintf 'no newline'; exit 7",
        "L1",
    );
    let root = root.to_str().unwrap();
    let out = agent(
        home.path(),
        &[
            "job-run", "--root", root, "--name", "hand", "--launch", "L1",
        ],
    );
    // The wrapper exits as its job did, so a batch scheduler sees the job's own status.
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    let state = read_state(home.path(), "hand");
    assert!(state.contains("\nexit_code=7\n"), "{state}");
    assert!(state.contains("\nrunner=setsid\n"), "{state}");
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.starts_with("== session: hand\n== started_at: "),
        "{log}"
    );
    assert!(
        log.contains("\n== command: echo hi printf 'no newline'; exit 7\nhi\n"),
        "{log}"
    );
    assert!(log.ends_with("\nno newline\nEXIT_CODE=7\n"), "{log}");

    let out = agent(home.path(), &["jobs", "--json"]);
    let json = text(&out.stdout);
    assert!(
        json.contains("\"name\": \"hand\", \"state\": \"exited\", \"exit_code\": 7, \"signal\": null, \"runner\": \"setsid\""),
        "{json}"
    );
    let out = agent(home.path(), &["jobs"]);
    let table = text(&out.stdout);
    let row = table.lines().nth(1).unwrap_or_default();
    assert!(
        row.starts_with("hand ") && row.contains(" exited ") && row.contains(" 7 "),
        "{table}"
    );
}

#[test]
fn detached_wrapper_returns_at_once_and_the_job_finishes() {
    let home = tempfile::tempdir().unwrap();
    let (root, _log) = write_spec(home.path(), "bg", "sleep 1; exit 3", "L2");
    let root = root.to_str().unwrap();
    let t0 = Instant::now();
    // Null stdio, as `start` gives it: a pipe would be inherited by the detached wrapper.
    let status = Command::new(AGENT)
        .args([
            "job-run", "--root", root, "--name", "bg", "--launch", "L2", "--detach",
        ])
        .env("HOME", home.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        t0.elapsed() < Duration::from_millis(900),
        "did not wait for the job: {:?}",
        t0.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !read_state(home.path(), "bg").contains("ended_ms=") {
        assert!(
            Instant::now() < deadline,
            "job never finished: {}",
            read_state(home.path(), "bg")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(read_state(home.path(), "bg").contains("\nexit_code=3\n"));
}

#[test]
fn wrapper_refuses_bad_arguments() {
    let home = tempfile::tempdir().unwrap();
    let out = agent(home.path(), &["job-run"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("usage: rsb-agent job-run"));
    let out = agent(
        home.path(),
        &[
            "job-run", "--root", "/tmp", "--name", "a.b", "--launch", "x",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("job name 'a.b' is invalid"),
        "{}",
        text(&out.stderr)
    );
    // A missing spec is reported in wrapper.log, which `start` reads to explain the failure.
    let root = home.path().join("jobs");
    std::fs::create_dir_all(root.join("gone")).unwrap();
    let out = agent(
        home.path(),
        &[
            "job-run",
            "--root",
            root.to_str().unwrap(),
            "--name",
            "gone",
            "--launch",
            "x",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let wlog = std::fs::read_to_string(root.join("gone/wrapper.log")).unwrap();
    assert!(
        wlog.contains("launch=x error: cannot read the job spec"),
        "{wlog}"
    );
}

#[test]
fn listing_into_a_closed_pipe_does_not_panic() {
    let home = tempfile::tempdir().unwrap();
    let (root, _) = write_spec(home.path(), "one", "true", "L3");
    let out = agent(
        home.path(),
        &[
            "job-run",
            "--root",
            root.to_str().unwrap(),
            "--name",
            "one",
            "--launch",
            "L3",
        ],
    );
    assert!(out.status.success());
    let out = Command::new("sh")
        .args(["-c", "\"$0\" jobs | true; \"$0\" jobs --json | true", AGENT])
        .env("HOME", home.path())
        .output()
        .unwrap();
    assert!(
        !text(&out.stderr).contains("panicked"),
        "{}",
        text(&out.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// Over `rsb-agent serve`

const PATIENCE: Duration = Duration::from_secs(30);

/// A serve process with a private `$HOME`, tmux socket directory and `PATH`.
struct Serve {
    child: Child,
    stdin: Option<ChildStdin>,
    frames: Receiver<FromAgent>,
    next_id: u64,
}

impl Serve {
    fn start(home: &Path, path: &str) -> Serve {
        Serve::start_exe(Path::new(AGENT), home, path)
    }

    fn start_exe(exe: &Path, home: &Path, path: &str) -> Serve {
        let mut child = Command::new(exe)
            .arg("serve")
            .env_clear()
            .env("HOME", home)
            .env("PATH", path)
            .env("TMUX_TMPDIR", home.join("tmux"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let (tx, frames) = mpsc::channel();
        std::thread::spawn(move || {
            loop {
                let mut len = [0u8; 4];
                if out.read_exact(&mut len).is_err() {
                    break;
                }
                let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
                if out.read_exact(&mut body).is_err() {
                    break;
                }
                if tx.send(decode::<FromAgent>(&body).unwrap()).is_err() {
                    break;
                }
            }
        });
        let hello = frames.recv_timeout(PATIENCE).expect("no Hello");
        assert!(matches!(hello, FromAgent::Hello(_)), "{hello:?}");
        Serve {
            child,
            stdin,
            frames,
            next_id: 1,
        }
    }

    fn call(&mut self, body: Request) -> Reply {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode(&ToAgent::Request { id, body }).unwrap();
        let w = self.stdin.as_mut().unwrap();
        w.write_all(&(frame.len() as u32).to_be_bytes()).unwrap();
        w.write_all(&frame).unwrap();
        w.flush().unwrap();
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self
                .frames
                .recv_timeout(left)
                .expect("no reply from the agent")
            {
                FromAgent::Reply { id: i, body } if i == id => return body,
                _ => {}
            }
        }
    }

    fn start_job(&mut self, req: JobStartRequest) -> JobInfo {
        match self.call(Request::JobStart(req)) {
            Reply::Job(info) => info,
            other => panic!("start: {other:?}"),
        }
    }

    fn status(&mut self, name: &str, offset: Option<u64>) -> JobStatusResult {
        let req = JobStatusRequest {
            name: name.into(),
            log_file: None,
            last_n_lines: 50,
            offset,
            max_bytes: 1 << 20,
        };
        match self.call(Request::JobStatus(req)) {
            Reply::JobStatus(r) => r,
            other => panic!("status: {other:?}"),
        }
    }

    fn wait_done(&mut self, name: &str) -> JobStatusResult {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let st = self.status(name, None);
            if st.info.as_ref().expect("job is recorded").state != JobState::Running {
                return st;
            }
            assert!(Instant::now() < deadline, "{name} still running");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.stdin = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `PATH` holding only what the jobs below need, so tmux can be present or absent on purpose.
fn private_path(home: &Path, with_tmux: bool) -> String {
    let bin = home.join(if with_tmux { "bin-tmux" } else { "bin" });
    std::fs::create_dir_all(&bin).unwrap();
    let mut tools = vec!["bash", "sleep", "cat"];
    if with_tmux {
        tools.push("tmux");
    }
    for tool in tools {
        let real = std::env::split_paths(&std::env::var_os("PATH").unwrap())
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("{tool} is needed on PATH for these tests"));
        std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
    }
    bin.display().to_string()
}

fn kill_tmux_server(home: &Path, path: &str) {
    let _ = Command::new("tmux")
        .arg("kill-server")
        .env("TMUX_TMPDIR", home.join("tmux"))
        .env("PATH", path)
        .env_remove("TMUX")
        .output();
}

fn job_outlives_the_agent_that_started_it(with_tmux: bool) {
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir(home.path().join("tmux")).unwrap();
    let path = private_path(home.path(), with_tmux);
    let mut first = Serve::start(home.path(), &path);
    let info = first.start_job(JobStartRequest {
        name: "e2e".into(),
        command: "echo start; sleep 2; echo done; exit 7".into(),
        cwd: None,
        log_file: "logs/e2e.log".into(),
        env: vec![("MARK".into(), "m".into())],
        prefer_tmux: true,
        launch_id: None,
        confine: None,
        gpus: None,
    });
    assert_eq!(info.state, JobState::Running);
    assert_eq!(info.runner, if with_tmux { "tmux" } else { "setsid" });
    // The agent dies hard mid-job, as when the SSH connection or rsb is killed.
    drop(first);

    let mut second = Serve::start(home.path(), &path);
    let st = second.wait_done("e2e");
    let done = st.info.unwrap();
    assert_eq!(
        (done.state, done.exit_code, done.signal),
        (JobState::Exited, Some(7), None)
    );
    assert_eq!(
        done.log_file,
        home.path().join("logs/e2e.log").display().to_string()
    );
    let log = String::from_utf8_lossy(&st.log);
    assert!(log.ends_with("start\ndone\nEXIT_CODE=7\n"), "{log}");
    match second.call(Request::JobList(rsb_protocol::JobListRequest)) {
        Reply::JobList(jobs) => assert_eq!(jobs, vec![done.clone()]),
        other => panic!("list: {other:?}"),
    }
    let out = agent(home.path(), &["jobs"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("e2e "),
        "{out:?}"
    );

    // Kill through serve, and a cursor read that picks up exactly where it left off.
    let info = second.start_job(JobStartRequest {
        name: "victim".into(),
        command: "echo ready; sleep 60".into(),
        cwd: Some("~".into()),
        log_file: String::new(),
        env: Vec::new(),
        prefer_tmux: true,
        launch_id: None,
        confine: None,
        gpus: None,
    });
    let deadline = Instant::now() + PATIENCE;
    let mut got = Vec::new();
    let mut offset = 0;
    while !String::from_utf8_lossy(&got).contains("ready\n") {
        let st = second.status("victim", Some(offset));
        got.extend_from_slice(&st.log);
        offset = st.next_offset;
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = match second.call(Request::JobKill(JobKillRequest {
        name: "victim".into(),
        grace_ms: 2000,
    })) {
        Reply::Job(i) => i,
        other => panic!("kill: {other:?}"),
    };
    assert_eq!(
        (killed.state, killed.signal, killed.pid),
        (JobState::Exited, Some(15), info.pid)
    );
    let rest = second.status("victim", Some(offset));
    got.extend_from_slice(&rest.log);
    assert_eq!(got, std::fs::read(&killed.log_file).unwrap());
    assert!(got.ends_with(b"ready\nEXIT_CODE=143\n"));
    drop(second);
    kill_tmux_server(home.path(), &path);
}

#[test]
fn serve_job_outlives_its_agent_with_tmux() {
    job_outlives_the_agent_that_started_it(true);
}

#[test]
fn serve_job_outlives_its_agent_without_tmux() {
    job_outlives_the_agent_that_started_it(false);
}

#[test]
fn serve_reports_job_errors_as_data() {
    let home = tempfile::tempdir().unwrap();
    let path = private_path(home.path(), false);
    let mut serve = Serve::start(home.path(), &path);
    let bad = |name: &str| JobStartRequest {
        name: name.into(),
        command: "true".into(),
        cwd: None,
        log_file: String::new(),
        env: Vec::new(),
        prefer_tmux: false,
        launch_id: None,
        confine: None,
        gpus: None,
    };
    match serve.call(Request::JobStart(bad("a.b"))) {
        Reply::Error(e) => {
            assert_eq!(e.code, rsb_protocol::ErrorCode::InvalidArgument);
            assert!(e.message.contains("A-Z a-z 0-9 _ -"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    let st = serve.status("never-started", None);
    assert_eq!((st.info, st.log_found), (None, false));
    match serve.call(Request::JobKill(JobKillRequest {
        name: "never-started".into(),
        grace_ms: 0,
    })) {
        Reply::Error(e) => assert_eq!(e.code, rsb_protocol::ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
}

/// Two rsb servers deploying to one host at once: the second renames its (identical,
/// content-addressed) copy over the binary the first agent runs from, which Linux then names
/// `PATH (deleted)`. The first agent still starts jobs under both runners (it once handed tmux
/// that name, and every start timed out).
#[test]
fn an_agent_whose_binary_was_replaced_by_an_identical_copy_still_starts_jobs() {
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir(home.path().join("tmux")).unwrap();
    let bin = home.path().join("agent");
    std::fs::create_dir(&bin).unwrap();
    let exe = bin.join("rsb-agent");
    std::fs::copy(AGENT, &exe).unwrap();
    let mut serve = Serve::start_exe(&exe, home.path(), &private_path(home.path(), true));
    std::fs::copy(AGENT, bin.join("rsb-agent.tmp")).unwrap();
    std::fs::rename(bin.join("rsb-agent.tmp"), &exe).unwrap();
    let pid = serve.child.id();
    let link = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert!(link.to_string_lossy().ends_with(" (deleted)"), "{link:?}");
    for (name, tmux) in [("replaced-t", true), ("replaced-s", false)] {
        let info = serve.start_job(JobStartRequest {
            name: name.into(),
            command: "echo ran".into(),
            cwd: None,
            log_file: String::new(),
            env: Vec::new(),
            prefer_tmux: tmux,
            launch_id: None,
            confine: None,
            gpus: None,
        });
        assert_eq!(info.runner, if tmux { "tmux" } else { "setsid" });
        let st = serve.wait_done(name);
        assert_eq!(st.info.unwrap().exit_code, Some(0));
        assert!(String::from_utf8_lossy(&st.log).contains("ran\n"));
    }
}
