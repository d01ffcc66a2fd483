//! `rsb exec` like `ssh host cmd`, and `rsb shell` / `rsb exec -t` like `ssh -t`: the real `rsb`
//! binary against the private sshd fixture. stdin streaming, exit codes, a pty driven by
//! `expect`, and no orphans when the agent or rsb dies.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use rsb_tests::{Sshd, workspace_root};

/// Upper bound of any single rsb run in these tests.
const PATIENCE: Duration = Duration::from_secs(60);

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// An rsb environment (config from `REMOTE_SANDBOX_LIST`, private HOME and state) for one sshd.
struct Cli {
    tmp: tempfile::TempDir,
    list: String,
}

impl Cli {
    fn new(sshd: &Sshd) -> Cli {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("home")).unwrap();
        let list = format!(
            r#"[{{"name":"s","host":"{}","port":{},"user":"{}","key_file":"{}"}}]"#,
            sshd.host(),
            sshd.port(),
            sshd.user(),
            sshd.client_key().display()
        );
        Cli { tmp, list }
    }

    fn env(&self, cmd: &mut Command) {
        let home = self.tmp.path().join("home");
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            .env("RSB_STATE_DIR", self.tmp.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", &self.list);
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(rsb_bin());
        cmd.args(args);
        self.env(&mut cmd);
        cmd
    }

    /// Runs rsb with `input` on stdin (written from a thread, so a large input cannot deadlock
    /// against unread output), killed after [`PATIENCE`].
    fn run(&self, args: &[&str], input: Vec<u8>) -> Output {
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
        let out = wait_output(child, PATIENCE);
        writer.join().unwrap();
        out
    }
}

fn wait_output(mut child: Child, within: Duration) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if rx.recv_timeout(within).is_err() {
            // SAFETY: killing our own child that overran its time.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    });
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let read = |p: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut p) = p {
                let _ = p.read_to_end(&mut v);
            }
            v
        })
    };
    let o = read(stdout.map(|p| Box::new(p) as _));
    let e = read(stderr.map(|p| Box::new(p) as _));
    let status = child.wait().unwrap();
    let _ = tx.send(());
    Output {
        status,
        stdout: o.join().unwrap(),
        stderr: e.join().unwrap(),
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[track_caller]
fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "{:?}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// Deterministic pseudo-random bytes (xorshift64*).
fn random_bytes(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        v.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    v.truncate(len);
    v
}

fn local_sha256(data: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum is installed");
    let mut stdin = child.stdin.take().unwrap();
    let data = data.to_vec();
    let w = std::thread::spawn(move || stdin.write_all(&data).unwrap());
    let out = child.wait_with_output().unwrap();
    w.join().unwrap();
    text(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn stdin_is_streamed_to_the_remote_command() {
    let sshd = Sshd::start().unwrap();
    let cli = Cli::new(&sshd);

    let out = cli.run(&["exec", "--", "wc", "-l"], b"a\nb\n".to_vec());
    assert_ok(&out);
    assert_eq!(text(&out.stdout).trim(), "2");

    let out = cli.run(&["exec", "--", "cat"], b"x\n".to_vec());
    assert_ok(&out);
    assert_eq!(text(&out.stdout), "x\n");

    // Nothing on stdin: the command sees EOF at once instead of waiting.
    let out = cli.run(&["exec", "--", "cat"], Vec::new());
    assert_ok(&out);
    assert_eq!(text(&out.stdout), "");

    // 50 MB of random bytes, byte exact (the window and acknowledgements carry it).
    let data = random_bytes(50_000_000);
    let want = local_sha256(&data);
    let t = Instant::now();
    let out = cli.run(&["exec", "--", "sha256sum"], data);
    assert_ok(&out);
    assert_eq!(
        text(&out.stdout).split_whitespace().next(),
        Some(want.as_str())
    );
    eprintln!("50 MB through rsb exec -- sha256sum: {:?}", t.elapsed());

    // tar c . | rsb exec -- tar x -C dir
    let src = cli.tmp.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("a.txt"), "alpha\n").unwrap();
    std::fs::write(src.join("sub/b.bin"), random_bytes(300_000)).unwrap();
    let tar = Command::new("tar")
        .args(["c", "-C"])
        .arg(&src)
        .arg(".")
        .output()
        .unwrap();
    assert!(tar.status.success());
    let got = sshd.home().join(format!("untar-{}", std::process::id()));
    let dest = got.display().to_string();
    let out = cli.run(
        &[
            "exec",
            "--",
            &format!("mkdir -p '{dest}' && tar x -C '{dest}'"),
        ],
        tar.stdout,
    );
    assert_ok(&out);
    assert_eq!(std::fs::read(got.join("a.txt")).unwrap(), b"alpha\n");
    assert_eq!(
        std::fs::read(got.join("sub/b.bin")).unwrap(),
        std::fs::read(src.join("sub/b.bin")).unwrap()
    );
    let _ = std::fs::remove_dir_all(got);
}

#[test]
fn exit_codes_are_the_remote_ones() {
    let sshd = Sshd::start().unwrap();
    let cli = Cli::new(&sshd);
    for (cmd, want) in [("true", 0), ("exit 3", 3), ("kill -9 $$", 137)] {
        let out = cli.run(&["exec", "--", cmd], Vec::new());
        assert_eq!(
            out.status.code(),
            Some(want),
            "{cmd}: {}",
            text(&out.stderr)
        );
    }
    // Live output: the first line arrives long before the command ends.
    let mut child = cli
        .command(&["exec", "--", "echo first; sleep 5; echo second"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let t = Instant::now();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "first\n");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    let _ = child.kill();
    let _ = child.wait();
}

fn expect_available() -> bool {
    let ok = Path::new("/usr/bin/expect").exists();
    if !ok {
        eprintln!("skipping: /usr/bin/expect is not installed");
    }
    ok
}

/// Drives `rsb shell` on a pty of 33x101 with expect: `tty`, `stty size`, a resize, `exit 3`.
#[test]
fn shell_runs_on_a_pty_with_the_window_size_and_exits_with_its_code() {
    if !expect_available() {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let cli = Cli::new(&sshd);
    let script = format!(
        r#"
set timeout 30
spawn -noecho {rsb} shell s
stty rows 33 columns 101 < $spawn_out(slave,name)
expect {{
  -re {{[#$] $}} {{}}
  timeout {{ puts "NO-PROMPT"; exit 89 }}
}}
send "PS1='rsb''-test> '\r"
expect {{
  "rsb-test> " {{}}
  timeout {{ puts "NO-PS1"; exit 88 }}
}}
send "tty\r"
expect {{
  -re "/dev/pts/\[0-9]+" {{}}
  timeout {{ puts "NO-TTY"; exit 90 }}
}}
send "stty size\r"
expect {{
  "33 101" {{}}
  timeout {{ puts "NO-SIZE"; exit 91 }}
}}
stty rows 40 columns 120 < $spawn_out(slave,name)
sleep 0.5
send "stty size\r"
expect {{
  "40 120" {{}}
  timeout {{ puts "NO-RESIZE"; exit 92 }}
}}
send "exit 3\r"
expect eof
lassign [wait] pid spawnid os_error value
exit $value
"#,
        rsb = rsb_bin().display()
    );
    let mut cmd = Command::new("/usr/bin/expect");
    cmd.arg("-c").arg(&script);
    cli.env(&mut cmd);
    cmd.env("TERM", "xterm");
    let out = wait_output(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        PATIENCE,
    );
    let transcript = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{transcript}\nstderr: {}",
        text(&out.stderr)
    );
    assert!(transcript.contains("/dev/pts/"), "{transcript}");
}

/// `rsb exec -t` gives the command a terminal even when stdin is not one (like `ssh -t`).
#[test]
fn exec_t_allocates_a_terminal() {
    let sshd = Sshd::start().unwrap();
    let cli = Cli::new(&sshd);
    let out = cli.run(&["exec", "-t", "--", "tty; stty size; exit 4"], Vec::new());
    let stdout = text(&out.stdout).replace('\r', "");
    assert_eq!(out.status.code(), Some(4), "{stdout}{}", text(&out.stderr));
    assert!(stdout.starts_with("/dev/pts/"), "{stdout}");
    assert!(stdout.contains("\n24 80\n"), "{stdout}");
    // Without -t there is no terminal.
    let out = cli.run(&["exec", "--", "tty"], Vec::new());
    assert_eq!(text(&out.stdout).trim(), "not a tty");
}

// ---------------------------------------------------------------------------------------------
// No orphans (issue 14 case 6)

/// Any live member of group `pgid` (the fixture's sessions run on this machine)? Zombies do not
/// count: they run nothing, and an orphan's zombie lasts until init gets round to reaping it.
fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only probes.
    if unsafe { libc::kill(-pgid, 0) } != 0 {
        return false;
    }
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return true;
    };
    dir.flatten().any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            return false;
        };
        let f: Vec<&str> = rest.split_whitespace().take(3).collect();
        f.len() == 3 && f[2].parse::<i32>().ok() == Some(pgid) && f[0] != "Z"
    })
}

fn ppid_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Starts `rsb exec` of a `sleep 1000` that records its group; returns rsb and the group id.
fn start_sleeper(cli: &Cli, sshd: &Sshd, tag: &str) -> (Child, i32) {
    let file = sshd
        .home()
        .join(format!("pgid-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let child = cli
        .command(&[
            "exec",
            "--timeout",
            "3600",
            "--",
            &format!("echo $$ > {}; sleep 1000; :", file.display()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    let pgid = loop {
        if let Some(p) = std::fs::read_to_string(&file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break p;
        }
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = std::fs::remove_file(&file);
    (child, pgid)
}

fn assert_gone_within(pgid: i32, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while group_alive(pgid) {
        if Instant::now() >= deadline {
            // SAFETY: cleaning up the test's own command group.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            panic!("the remote command outlived {what} by {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_dead_agent_or_rsb_leaves_no_running_command() {
    let sshd = Sshd::start().unwrap();
    let cli = Cli::new(&sshd);
    for (what, sig) in [
        ("a SIGKILLed agent", libc::SIGKILL),
        ("a SIGTERMed agent", libc::SIGTERM),
    ] {
        let (mut rsb, pgid) = start_sleeper(&cli, &sshd, "agent");
        // bash -c leads the group; its parent is the agent.
        let agent = ppid_of(pgid);
        // SAFETY: signalling the agent the test's rsb started.
        assert_eq!(unsafe { libc::kill(agent, sig) }, 0);
        assert_gone_within(pgid, Duration::from_secs(8), what);
        let status = wait_output(rsb_take(&mut rsb), PATIENCE).status;
        assert!(!status.success(), "{what}: rsb exited {status:?}");
    }
    // rsb itself killed: its SSH connection closes, the agent sees EOF on its channel.
    let (mut rsb, pgid) = start_sleeper(&cli, &sshd, "rsb");
    rsb.kill().unwrap();
    rsb.wait().unwrap();
    assert_gone_within(pgid, Duration::from_secs(10), "a SIGKILLed rsb");
}

fn rsb_take(child: &mut Child) -> Child {
    std::mem::replace(
        child,
        Command::new("true").spawn().expect("a placeholder child"),
    )
}

// ---------------------------------------------------------------------------------------------
// Safe log reads (issue 14 case 7), through the real `rsb mcp` on a `local` sandbox

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_background_task_refuses_a_fifo_or_device_log_at_once() {
    use rmcp::{ServiceExt, model::CallToolRequestParams, transport::TokioChildProcess};
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let fifo = tmp.path().join("log.fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let mut cmd = tokio::process::Command::new(rsb_bin());
    cmd.arg("mcp")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("RSB_STATE_DIR", tmp.path().join("state"))
        .env("REMOTE_SANDBOX_LIST", r#"[{"name":"box","local":true}]"#);
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let svc = tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
        .await
        .expect("initialize timed out")
        .expect("initialize");
    for log in [fifo.display().to_string(), "/dev/zero".to_string()] {
        let args = serde_json::json!({"tmux_session": "nojob", "log_file": log});
        let serde_json::Value::Object(args) = args else {
            unreachable!()
        };
        let params =
            CallToolRequestParams::new("check_background_task".to_string()).with_arguments(args);
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(20), svc.call_tool(params))
            .await
            .unwrap_or_else(|_| panic!("check_background_task({log}) hung"))
            .unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let raw = serde_json::to_value(&r).unwrap();
        let text = raw["content"][0]["text"].as_str().unwrap_or_default();
        assert_eq!(r.is_error, Some(true), "{log}: {text}");
        assert!(text.contains("not a regular file"), "{log}: {text}");
        assert!(!text.contains("\"log_tail\""), "{log}: {text}");
    }
    let _ = svc.cancel().await;
}
