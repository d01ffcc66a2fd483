//! Issue 26: "a user's day without surprises". Each test reproduces one defect a new user met,
//! through the real `rsb` binary against a private sshd on loopback, and fails before its fix.
//!
//! Needs the `rsb` binary: `cargo build --workspace --bins`.

mod common;

use std::{
    path::PathBuf,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use rsb_tests::{Sshd, output_with_timeout, workspace_root};
use serde_json::json;

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// A user's environment: a sandbox `gpu1` on the fixture, state and home in a temp dir.
struct User {
    sshd: Sshd,
    tmp: tempfile::TempDir,
    list: String,
}

impl User {
    fn new() -> User {
        let sshd = Sshd::start().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("home")).unwrap();
        let list = json!([{"name": "gpu1", "host": sshd.host(), "port": sshd.port(),
            "user": sshd.user(), "key_file": sshd.client_key().display().to_string()}])
        .to_string();
        User { sshd, tmp, list }
    }

    fn home(&self) -> PathBuf {
        self.tmp.path().join("home")
    }

    fn state(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    /// `rsb ARGS` in this user's environment.
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(rsb_bin());
        c.args(args);
        self.env(&mut c);
        c
    }

    /// `bash -c SCRIPT` in this user's environment, `RSB` standing for the binary.
    #[allow(dead_code)]
    fn sh(&self, script: &str) -> Command {
        let mut c = Command::new("bash");
        c.arg("-c")
            .arg(script.replace("RSB", &rsb_bin().display().to_string()));
        self.env(&mut c);
        c
    }

    fn env(&self, c: &mut Command) {
        let home = self.home();
        c.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            .env("RSB_STATE_DIR", self.state())
            .env("REMOTE_SANDBOX_LIST", &self.list)
            .stdin(Stdio::null());
    }

    fn run(&self, c: &mut Command, limit: Duration) -> Output {
        output_with_timeout(c, limit).unwrap_or_else(|e| panic!("{c:?}: {e}"))
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn show(o: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        text(&o.stdout),
        text(&o.stderr)
    )
}

/// A marker no other process on this box carries in its argv: a sleep length.
fn marker() -> String {
    format!("9{}.{}", std::process::id() % 10, rand_digits())
}

fn rand_digits() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        % 1_000_000
        + 1_000_000
}

/// `ps` lines (pid and args) of live processes whose argv holds `needle`.
fn processes_with(needle: &str) -> Vec<String> {
    let out = Command::new("ps")
        .args(["-e", "-o", "pid=,stat=,args="])
        .output()
        .unwrap();
    text(&out.stdout)
        .lines()
        .filter(|l| {
            l.contains(needle) && !l.split_whitespace().nth(1).unwrap_or("").starts_with('Z')
        })
        .map(str::to_string)
        .collect()
}

/// `ps -s SID`: the live processes of a session.
fn session_members(sid: &str) -> Vec<String> {
    let out = Command::new("ps")
        .args(["-s", sid, "-o", "pid=,stat=,args="])
        .output()
        .unwrap();
    text(&out.stdout)
        .lines()
        .filter(|l| !l.split_whitespace().nth(1).unwrap_or("").starts_with('Z'))
        .map(str::to_string)
        .collect()
}

/// Item 2: GNU `timeout` makes its own process group, so killing only the command's group
/// after a timeout or a kill left `timeout` and its `sleep` running (on a GPU box: a process
/// holding GPU memory after the user was told it stopped). Now the whole session goes.
#[test]
fn timeout_and_kill_stop_the_whole_session() {
    let u = User::new();
    let m = marker();
    // The command prints its session id first; both `timeout`s make groups of their own.
    let script =
        format!("ps -o sid= -p $$; timeout 100 sleep {m}1 & timeout 100 sleep {m}2 & wait");
    let t0 = Instant::now();
    let o = u.run(
        &mut u.cmd(&["exec", "--timeout", "2", "--", &script]),
        Duration::from_secs(40),
    );
    assert_eq!(o.status.code(), Some(124), "{}", show(&o));
    println!("exec --timeout 2 returned in {:?}", t0.elapsed());
    let sid = text(&o.stdout).trim().to_string();
    assert!(sid.parse::<u32>().is_ok(), "{}", show(&o));
    assert_eq!(
        processes_with(&m),
        Vec::<String>::new(),
        "survivors after the timeout"
    );
    assert_eq!(
        session_members(&sid),
        Vec::<String>::new(),
        "ps -s {sid} after the timeout"
    );

    // The same through a background job and `rsb jobs kill`.
    let m = marker();
    let script =
        format!("ps -o sid= -p $$; timeout 100 sleep {m}3 & timeout 100 sleep {m}4 & wait");
    let o = u.run(
        &mut u.cmd(&["jobs", "start", "--name", "sess", "--", &script]),
        Duration::from_secs(40),
    );
    assert!(o.status.success(), "{}", show(&o));
    let deadline = Instant::now() + Duration::from_secs(20);
    let sid = loop {
        let o = u.run(
            &mut u.cmd(&["jobs", "logs", "sess"]),
            Duration::from_secs(20),
        );
        let sid = text(&o.stdout)
            .lines()
            .map(str::trim)
            .find(|l| l.parse::<u32>().is_ok())
            .map(str::to_string);
        if let Some(sid) = sid
            && processes_with(&m).len() >= 2
        {
            break sid;
        }
        assert!(
            Instant::now() < deadline,
            "the job never started: {}",
            show(&o)
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let o = u.run(
        &mut u.cmd(&["jobs", "kill", "sess"]),
        Duration::from_secs(40),
    );
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        processes_with(&m),
        Vec::<String>::new(),
        "survivors after the kill"
    );
    assert_eq!(
        session_members(&sid),
        Vec::<String>::new(),
        "ps -s {sid} after the kill"
    );
    let _ = &u.sshd;
}
