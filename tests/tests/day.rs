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
            // The ssh config is the passwd home's unless this says otherwise: keep the user's
            // own out of the tests.
            .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
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

/// Issue 41, item 3: what left the command's session (`setsid cmd &`, or a double fork whose
/// middle process is gone) outlived a timeout and `rsb jobs kill`, and the kill said the job
/// ended. The command's leader is now a subreaper, so nothing it starts leaves its tree, and a
/// stop follows the whole tree; members that ignore SIGTERM get SIGKILL after the grace.
#[test]
fn processes_that_left_the_session_are_stopped_too() {
    let u = User::new();
    let m = marker();
    let _cleanup = KillMarked(m.clone());
    // One ignores SIGTERM (`trap` is inherited through setsid and exec).
    let script = format!(
        "setsid sleep {m}1 & (setsid sleep {m}2 &); \
         setsid sh -c \"trap '' TERM; sleep {m}3\" & sleep 100"
    );
    let o = u.run(
        &mut u.cmd(&["exec", "--timeout", "2", "--", &script]),
        Duration::from_secs(40),
    );
    assert_eq!(o.status.code(), Some(124), "{}", show(&o));
    assert_eq!(
        processes_with(&m),
        Vec::<String>::new(),
        "what left the session survived the timeout"
    );

    let m = marker();
    let _cleanup_job = KillMarked(m.clone());
    let script = format!(
        "setsid sleep {m}4 & (setsid sleep {m}5 &); \
         setsid sh -c \"trap '' TERM; sleep {m}6\" & sleep 100"
    );
    let o = u.run(
        &mut u.cmd(&["jobs", "start", "--name", "escapees", "--", &script]),
        Duration::from_secs(40),
    );
    assert!(o.status.success(), "{}", show(&o));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !["4", "5", "6"]
        .iter()
        .all(|n| !processes_with(&format!("sleep {m}{n}")).is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "the job's processes never all started: {:?}",
            processes_with(&m)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = u.run(
        &mut u.cmd(&["jobs", "kill", "escapees"]),
        Duration::from_secs(40),
    );
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        processes_with(&m),
        Vec::<String>::new(),
        "what left the job's session survived the kill: {}",
        show(&o)
    );
    let _ = &u.sshd;
}

/// Item 4: a reader that goes away (`| head -1`) used to leave `rsb exec yes` writing into a
/// closed pipe forever (ssh returns in 0.2 s), and `--json` or `completions` panicked with exit
/// 101. Now the remote command gets SIGPIPE and rsb exits as ssh does; nothing panics.
#[test]
fn a_closed_output_pipe_stops_the_remote_command() {
    let u = User::new();
    // A cold start (connect, agent start) is not part of what is measured.
    let t0 = Instant::now();
    let o = u.run(&mut u.cmd(&["exec", "true"]), Duration::from_secs(60));
    assert!(o.status.success(), "{}", show(&o));
    let baseline = t0.elapsed();

    let m = marker();
    let t0 = Instant::now();
    let o = u.run(
        &mut u.sh(&format!(
            "RSB exec 'yes {m}' | head -1; echo \"status ${{PIPESTATUS[0]}}\""
        )),
        Duration::from_secs(30),
    );
    let took = t0.elapsed();
    let out = text(&o.stdout);
    println!("`rsb exec yes | head -1`: {took:?} (a plain `rsb exec true`: {baseline:?})");
    assert!(out.starts_with(&format!("{m}\n")), "{}", show(&o));
    assert!(out.contains("status 141"), "{}", show(&o));
    assert!(
        took < baseline + Duration::from_secs(1),
        "took {took:?}, `rsb exec true` {baseline:?}"
    );
    assert_eq!(
        processes_with(&m),
        Vec::<String>::new(),
        "the remote yes lives on"
    );

    for script in [
        "RSB --json exec 'seq 1 3000000' | head -c 300 >/dev/null; echo \"status ${PIPESTATUS[0]}\"",
        "RSB completions bash | head -1 >/dev/null; echo \"status ${PIPESTATUS[0]}\"",
        "RSB jobs list | head -c 1 >/dev/null; echo \"status ${PIPESTATUS[0]}\"",
    ] {
        let o = u.run(&mut u.sh(script), Duration::from_secs(60));
        let out = text(&o.stdout);
        let err = text(&o.stderr);
        assert!(
            !err.contains("panicked") && !out.contains("status 101"),
            "{script}: {}",
            show(&o)
        );
        assert!(
            out.contains("status 0") || out.contains("status 141"),
            "{script}: {}",
            show(&o)
        );
    }
}

/// Issue 21, defect 4: a reader that pauses (`rsb exec -- cat big | (sleep 20; cat)`) stopped
/// the agent channel's reader, so after 15 s the heartbeat declared the link dead and the
/// command failed. Now only that request waits (at the agent, its command blocked on its pipe),
/// and every byte arrives when the reader comes back.
#[test]
fn a_reader_that_pauses_20_s_gets_every_byte() {
    let u = User::new();
    let len = 32u64 << 20;
    let o = u.run(
        &mut u.sh(&format!(
            "RSB exec -- 'head -c {len} /dev/zero' | (sleep 20; wc -c); echo \"status ${{PIPESTATUS[0]}}\""
        )),
        Duration::from_secs(120),
    );
    let out = text(&o.stdout);
    assert!(out.starts_with(&format!("{len}\n")), "{}", show(&o));
    assert!(out.contains("status 0"), "{}", show(&o));
}

/// Item 3: ^C (SIGINT to `rsb exec` without a terminal) used to reach the remote command as
/// SIGTERM, so `except KeyboardInterrupt: save_checkpoint()` never ran. Now it is SIGINT, then
/// SIGTERM after a grace, then a kill. `timeout --foreground` sends one SIGINT, as a terminal
/// does: without it GNU timeout signals the child and then its whole group, and that second
/// SIGINT is, rightly, a second ^C that skips the grace.
#[test]
fn ctrl_c_is_sigint_then_sigterm() {
    let u = User::new();
    let o = u.run(
        &mut u.sh(
            "timeout --foreground --preserve-status -s INT 3 RSB exec 'trap \"echo saved-on-INT; kill \\$!; exit 7\" INT; sleep 30 & wait'; \
             echo \"status $?\"",
        ),
        Duration::from_secs(60),
    );
    let out = text(&o.stdout);
    assert!(
        out.contains("saved-on-INT"),
        "the remote command saw no SIGINT: {}",
        show(&o)
    );
    assert!(out.contains("status 7"), "{}", show(&o));

    // A command that ignores SIGINT gets SIGTERM after the grace.
    let t0 = Instant::now();
    let o = u.run(
        &mut u.sh(
            "timeout --foreground --preserve-status -s INT 2 RSB exec 'trap \"\" INT; trap \"echo got-TERM; exit 9\" TERM; \
             while :; do sleep 0.1; done'; echo \"status $?\"",
        ),
        Duration::from_secs(60),
    );
    let took = t0.elapsed();
    let out = text(&o.stdout);
    assert!(
        out.contains("got-TERM") && out.contains("status 9"),
        "{}",
        show(&o)
    );
    assert!(
        took >= Duration::from_secs(6),
        "SIGTERM came before the 5 s grace: {took:?}"
    );

    // Issue 41, item 6: a command that ignores SIGINT and SIGTERM is killed after both graces,
    // rsb says at each step what it waits for, and exits 130 as the table says (it waited
    // forever before: the output printer outlived the call).
    let pidfile = u.tmp.path().join("ign.pid");
    let t0 = Instant::now();
    let o = u.run(
        &mut u.sh(&format!(
            "timeout --foreground --preserve-status -s INT 2 RSB exec 'echo $$ > {}; trap \"\" INT TERM; \
             while :; do sleep 0.1; done'; echo \"status $?\"",
            pidfile.display()
        )),
        Duration::from_secs(60),
    );
    let took = t0.elapsed();
    assert!(text(&o.stdout).contains("status 130"), "{}", show(&o));
    let err = text(&o.stderr);
    for step in [
        "sent SIGINT to the remote command; SIGTERM follows in 5 s",
        "sent SIGTERM to the remote command; SIGKILL follows in 3 s",
        "sent SIGKILL to the remote command",
    ] {
        assert!(err.contains(step), "{}", show(&o));
    }
    assert!(
        took >= Duration::from_secs(10) && took < Duration::from_secs(20),
        "{took:?}"
    );
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the remote command {pid} outlived rsb"
    );
}

/// Item 8: a sync that kept a conflicting file exited 0, so `rsb sync . gpu:proj && rsb exec
/// 'python train.py'` trained on the stale file. Now it exits 6, its own row in the table.
#[test]
fn sync_conflicts_exit_non_zero() {
    let u = User::new();
    let proj = u.tmp.path().join("proj");
    std::fs::create_dir_all(&proj).unwrap();
    std::fs::write(proj.join("train.py"), "one\n").unwrap();
    // Its contents (a trailing slash, as rsync reads it) into ~/proj.
    let p = format!("{}/", proj.display());
    let o = u.run(
        &mut u.cmd(&["sync", &p, "gpu1:proj"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    // Both sides change the file after that sync.
    std::fs::write(u.sshd.home().join("proj/train.py"), "edited on the box\n").unwrap();
    std::fs::write(proj.join("train.py"), "edited here\n").unwrap();
    let o = u.run(
        &mut u.sh(&format!(
            "RSB sync {p} gpu1:proj && RSB exec 'echo trained'"
        )),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(6), "{}", show(&o));
    assert!(
        text(&o.stderr).contains("conflict: train.py"),
        "{}",
        show(&o)
    );
    assert!(!text(&o.stdout).contains("trained"), "{}", show(&o));
    let o = u.run(
        &mut u.cmd(&["--json", "sync", &p, "gpu1:proj"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(6), "--json too: {}", show(&o));
    // --force takes the source's side: no conflict left, exit 0.
    let o = u.run(
        &mut u.cmd(&["sync", "--force", &p, "gpu1:proj"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
}

/// Item 10 (smaller ones a user met).
#[test]
fn smaller_surprises() {
    let u = User::new();
    // A bad job name is a usage error (exit 1, as the README's table says), not 4.
    for args in [
        &["jobs", "start", "--name", "a b", "--", "true"][..],
        &["jobs", "logs", "a/b"][..],
        &["jobs", "kill", "a b"][..],
    ] {
        let o = u.run(&mut u.cmd(args), Duration::from_secs(60));
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", show(&o));
    }
    // `rsb ls` and `rsb cat` take SANDBOX:PATH as `rsb sync` does.
    std::fs::create_dir_all(u.sshd.home().join("d26")).unwrap();
    std::fs::write(u.sshd.home().join("d26/a.txt"), "hello 26\n").unwrap();
    let o = u.run(
        &mut u.cmd(&["cat", "gpu1:~/d26/a.txt"]),
        Duration::from_secs(60),
    );
    assert_eq!(text(&o.stdout), "hello 26\n", "{}", show(&o));
    let o = u.run(&mut u.cmd(&["ls", "gpu1:~/d26"]), Duration::from_secs(60));
    assert!(text(&o.stdout).contains("a.txt"), "{}", show(&o));
}

fn daemon_status(u: &User) -> serde_json::Value {
    let o = u.run(
        &mut u.cmd(&["--json", "watchdog", "status"]),
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "{}", show(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&o)))
}

/// Item 5: the daemon counted as running while "the lock is held OR the heartbeat is under
/// 30 s old", so right after a SIGTERM or SIGKILL `rsb watchdog status` still said running and
/// `ensure_watchdog` answered `already_running`. Now only the lock holder, checked to be a
/// live `rsb watchdog run`, counts; the heartbeat is cleared on exit; `restart` exists.
#[test]
fn a_dead_watchdog_is_reported_dead() {
    let u = User::new();
    let _stop = common::StopDaemon(u.state());
    for sig in [libc::SIGTERM, libc::SIGKILL] {
        let mut child = u
            .cmd(&["watchdog", "run", "--mode", "foreground"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = daemon_status(&u);
            if s["daemon"]["running"] == true && s["heartbeat"].is_object() {
                assert_eq!(s["daemon"]["pid"], child.id() as i64, "{s}");
                break;
            }
            assert!(Instant::now() < deadline, "the daemon never came up: {s}");
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: a signal to the daemon this test started.
        unsafe { libc::kill(child.id() as i32, sig) };
        let _ = child.wait();
        let s = daemon_status(&u);
        assert_eq!(s["daemon"]["running"], false, "after signal {sig}: {s}");
        if sig == libc::SIGTERM {
            assert!(
                s["heartbeat"].is_null(),
                "the heartbeat is cleared on exit: {s}"
            );
        }
    }
    // `rsb watchdog restart` starts one (here: detached, no service installed) ...
    let o = u.run(
        &mut u.cmd(&["watchdog", "restart"]),
        Duration::from_secs(40),
    );
    assert!(o.status.success(), "{}", show(&o));
    let first = daemon_status(&u)["daemon"]["pid"].clone();
    assert!(first.is_i64(), "{}", show(&o));
    // ... and replaces a running one.
    let o = u.run(
        &mut u.cmd(&["watchdog", "restart"]),
        Duration::from_secs(40),
    );
    assert!(o.status.success(), "{}", show(&o));
    let s = daemon_status(&u);
    assert_eq!(s["daemon"]["running"], true, "{s}");
    assert_ne!(s["daemon"]["pid"], first, "{s}");
}

/// The passwd entry's home directory of the user running the tests (what `ssh` reads
/// `~/.ssh/config` under), from `getent`, so the test does not share rsb's code for it.
fn passwd_home() -> PathBuf {
    let uid = unsafe { libc::getuid() };
    let out = Command::new("getent")
        .args(["passwd", &uid.to_string()])
        .output()
        .unwrap();
    let line = text(&out.stdout);
    PathBuf::from(line.trim().split(':').nth(5).expect("a passwd line"))
}

/// Item 10: with no rsb configuration, `-s ALIAS` (and `rsb shell ALIAS`) takes a Host from the
/// ssh config, as `ssh ALIAS` does; an unknown name's hint mentions `ssh_config_host`; the ssh
/// config is the passwd home's (`RSB_SSH_CONFIG` overrides), never `$HOME`'s; and
/// `rsb shell HOST <<< 'cmd'` runs the login shell on stdin without a pty, as `ssh host` does,
/// instead of hanging.
#[test]
fn an_ssh_config_alias_is_a_sandbox_without_any_config() {
    let u = User::new();
    let alias = format!("rsb26-{}", rand_digits());
    let block = format!(
        "Host {alias}\n    HostName {}\n    Port {}\n    User {}\n    IdentityFile {}\n",
        u.sshd.host(),
        u.sshd.port(),
        u.sshd.user(),
        u.sshd.client_key().display()
    );
    let ssh_config = u.tmp.path().join("ssh_config");
    std::fs::write(&ssh_config, &block).unwrap();
    // No REMOTE_SANDBOX_LIST, no config file: only the ssh config.
    let bare = |args: &[&str]| {
        let mut c = u.cmd(args);
        c.env_remove("REMOTE_SANDBOX_LIST")
            .env("RSB_SSH_CONFIG", &ssh_config);
        c
    };
    let o = u.run(
        &mut bare(&["-s", &alias, "exec", "echo hi from $(id -un)"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(
        text(&o.stdout),
        format!("hi from {}\n", u.sshd.user()),
        "{}",
        show(&o)
    );
    assert!(
        !text(&o.stderr).contains("built-in `local`"),
        "{}",
        show(&o)
    );

    // `ALIAS:PATH` picks the alias as `-s ALIAS` does, for ls, cat and sync (it was read as a
    // path on the built-in `local` sandbox).
    // (Absolute: the fixture's sessions start in the passwd home, not its $HOME.)
    let remote = u.sshd.home().join("alias-file.txt").display().to_string();
    std::fs::write(&remote, "via the alias\n").unwrap();
    let o = u.run(
        &mut bare(&["cat", &format!("{alias}:{remote}")]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(text(&o.stdout), "via the alias\n", "{}", show(&o));
    let o = u.run(
        &mut bare(&["ls", &format!("{alias}:{}", u.sshd.home().display())]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(text(&o.stdout).contains("alias-file.txt"), "{}", show(&o));
    let down = u.tmp.path().join("alias-down");
    let o = u.run(
        &mut bare(&[
            "sync",
            &format!("{alias}:{remote}"),
            &down.display().to_string(),
        ]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        std::fs::read_to_string(&down)
            .or_else(|_| std::fs::read_to_string(down.join("alias-file.txt")))
            .unwrap()
            .contains("via the alias")
    );

    // `rsb shell ALIAS` with a here-string: no pty, the shell reads stdin, exits with its code
    // (the last command's at EOF, as `ssh host <<< cmd`).
    let shell = |input: &str| {
        let t = Instant::now();
        let mut c = bare(&["shell", &alias]);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(input.as_bytes()).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let o = child.wait_with_output().unwrap();
                panic!("rsb shell <<< {input:?} hung for 30 s: {}", show(&o));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let o = child.wait_with_output().unwrap();
        println!("rsb shell <<< {input:?}: {:?}", t.elapsed());
        o
    };
    let o = shell("echo hi; tty >/dev/null || echo no-tty; exit 3\n");
    assert_eq!(o.status.code(), Some(3), "{}", show(&o));
    assert_eq!(text(&o.stdout), "hi\nno-tty\n", "{}", show(&o));
    let o = shell("echo hi\n");
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(text(&o.stdout), "hi\n", "{}", show(&o));

    // An unknown name: exit 1, and the hint says how to use an ssh config Host.
    let o = u.run(
        &mut bare(&["-s", "nosuch-rsb26", "exec", "true"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("ssh_config_host"), "{}", show(&o));
    // Configured sandboxes, another name: the hint names ssh_config_host too.
    let o = u.run(
        &mut u.cmd(&["-s", &alias, "exec", "true"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(text(&o.stderr).contains("ssh_config_host"), "{}", show(&o));

    // Without RSB_SSH_CONFIG the ssh config is the passwd home's, as for `ssh`: the alias in
    // $HOME/.ssh/config is not read, and the hint names the file that was.
    std::fs::create_dir_all(u.home().join(".ssh")).unwrap();
    std::fs::write(u.home().join(".ssh/config"), &block).unwrap();
    let mut c = bare(&["-s", &alias, "exec", "true"]);
    c.env_remove("RSB_SSH_CONFIG");
    let o = u.run(&mut c, Duration::from_secs(60));
    let want = passwd_home().join(".ssh/config");
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        text(&o.stderr).contains(&want.display().to_string()),
        "the hint should name {}: {}",
        want.display(),
        show(&o)
    );

    // `~` in the ssh config is the passwd home too (the key is reachable only that way), and
    // `$HOME/.ssh/known_hosts` is not `ssh`'s: a wrong key for the host there changes nothing.
    let pw = passwd_home();
    let up = "../".repeat(pw.components().count().saturating_sub(1));
    let key = u.sshd.client_key();
    let tilde_key = format!(
        "~/{up}{}",
        key.display().to_string().trim_start_matches('/')
    );
    let alias2 = format!("{alias}-tilde");
    let block2 = format!(
        "Host {alias2}\n    HostName {}\n    Port {}\n    User {}\n    IdentityFile {tilde_key}\n",
        u.sshd.host(),
        u.sshd.port(),
        u.sshd.user(),
    );
    std::fs::write(&ssh_config, format!("{block}\n{block2}")).unwrap();
    let other = u.tmp.path().join("other_host_key");
    let made = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", show(&made));
    let other_pub = std::fs::read_to_string(other.with_extension("pub")).unwrap();
    let other_pub: Vec<&str> = other_pub.split_whitespace().take(2).collect();
    std::fs::write(
        u.home().join(".ssh/known_hosts"),
        format!(
            "[{h}]:{p} {k}\n[localhost]:{p} {k}\n",
            h = u.sshd.host(),
            p = u.sshd.port(),
            k = other_pub.join(" ")
        ),
    )
    .unwrap();
    let o = u.run(
        &mut bare(&["-s", &alias2, "exec", "echo tilde ok"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{tilde_key}: {}", show(&o));
    assert_eq!(text(&o.stdout), "tilde ok\n", "{}", show(&o));
}

/// A TCP socket bound to `127.0.0.1:port` that never listens (no `SO_REUSEADDR`): the port is
/// taken, and a connection to it is refused. Closed when dropped.
struct BoundNotListening(i32);

impl BoundNotListening {
    fn new(port: u16) -> BoundNotListening {
        // SAFETY: plain socket calls on a fresh descriptor; the sockaddr is fully initialised.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let mut a: libc::sockaddr_in = std::mem::zeroed();
            a.sin_family = libc::AF_INET as libc::sa_family_t;
            a.sin_port = port.to_be();
            a.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            let rc = libc::bind(
                fd,
                &a as *const libc::sockaddr_in as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            );
            assert_eq!(
                rc,
                0,
                "bind 127.0.0.1:{port}: {}",
                std::io::Error::last_os_error()
            );
            BoundNotListening(fd)
        }
    }
}

impl Drop for BoundNotListening {
    fn drop(&mut self) {
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(self.0) };
    }
}

/// The doctor line about detached forward `id`.
fn doctor_forward_line(u: &User, id: &str) -> String {
    let o = u.run(
        &mut u.cmd(&["doctor", "-s", "gpu1"]),
        Duration::from_secs(60),
    );
    text(&o.stdout)
        .lines()
        .find(|l| l.contains("forward:") && l.contains(id))
        .unwrap_or_else(|| panic!("no line for forward {id}: {}", show(&o)))
        .to_string()
}

/// Item 5: `rsb doctor` showed a detached forward as listening while connections to it failed.
/// Now it checks the port: a forward whose daemon died is "not served", and one whose daemon
/// lives but could not take its port back (here: another socket holds it, never listening) is
/// "recorded as listening, but the port refuses connections"; only a port that accepts is ok.
#[test]
fn doctor_calls_a_forward_listening_only_when_its_port_accepts() {
    let u = User::new();
    let _stop = common::StopDaemon(u.state());
    let target = format!("gpu1:{}", u.sshd.port());
    let o = u.run(
        &mut u.cmd(&["--json", "forward", "--detach", &target, "0"]),
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", show(&o));
    let info: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let fid = info["forward_id"].clone();
    let id = fid.to_string();
    let addr: std::net::SocketAddr = {
        // Bounded wait for the daemon to report it listening.
        let t0 = Instant::now();
        loop {
            let o = u.run(
                &mut u.cmd(&["--json", "forward", "--list"]),
                Duration::from_secs(30),
            );
            let l: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            let f = l["forwards"]
                .as_array()
                .and_then(|a| a.iter().find(|f| f["forward_id"] == fid).cloned());
            if let Some(f) = f
                && f["running"] == true
                && let Ok(a) = f["local_address"].as_str().unwrap_or_default().parse()
            {
                break a;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "never listening: {l}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let line = doctor_forward_line(&u, &id);
    println!("served: {line}");
    assert!(
        line.starts_with("ok") && line.contains("(listening,"),
        "{line}"
    );

    // The daemon dies (SIGKILL: it cleans nothing up); its row still says listening.
    let pid = daemon_status(&u)["daemon"]["pid"]
        .as_i64()
        .expect("a daemon pid");
    // SAFETY: a signal to the daemon this test started (`rsb forward --detach` spawned it).
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    while daemon_status(&u)["daemon"]["running"] == true {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the daemon lives on"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _taken = BoundNotListening::new(addr.port());
    assert!(
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err(),
        "the port still accepts"
    );
    let line = doctor_forward_line(&u, &id);
    println!("daemon dead: {line}");
    assert!(
        line.starts_with("warn") && line.contains("not served") && !line.contains("(listening,"),
        "{line}"
    );

    // A new daemon cannot take the port back (it keeps the row and retries): it runs, but the
    // port refuses connections, and doctor says so.
    let mut child = u
        .cmd(&["watchdog", "run", "--mode", "foreground"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while daemon_status(&u)["daemon"]["running"] != true {
        assert!(t0.elapsed() < Duration::from_secs(20), "no new daemon");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    let line = doctor_forward_line(&u, &id);
    println!("daemon alive, port refused: {line}");
    // SAFETY: the daemon this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    assert!(
        line.starts_with("warn") && line.contains("refuses connections"),
        "{line}"
    );
}

/// SIGKILLs, when dropped, every process whose argv holds the marker (a test's jobs), also
/// when the test fails or they ignore SIGTERM.
struct KillMarked(String);

impl Drop for KillMarked {
    fn drop(&mut self) {
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &self.0])
            .status();
    }
}

/// Issue 41, item 2: `rsb sync --delete` into a job's working directory deleted the running
/// job's default log (`.codex_logs/web.log`), and `rsb jobs logs web` then printed nothing and
/// exited 0. Now an upload never deletes or overwrites rsb's own job logs (a stale local copy
/// of the log is not sent either), and a job whose log is gone says so.
#[test]
fn an_upload_with_delete_keeps_a_running_job_s_log() {
    let u = User::new();
    let m = marker();
    let _guard = KillMarked(m.clone());
    let proj = u.tmp.path().join("proj");
    std::fs::create_dir_all(proj.join(".codex_logs")).unwrap();
    std::fs::write(proj.join("serve.py"), "print('serving')\n").unwrap();
    // Its contents (a trailing slash, as rsync reads it) into ~/proj.
    let p = format!("{}/", proj.display());
    let o = u.run(
        &mut u.cmd(&["sync", &p, "gpu1:proj"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = u.run(
        &mut u.cmd(&[
            "jobs",
            "start",
            "--name",
            "web",
            "--cwd",
            "proj",
            &format!("echo serving; sleep {m}"),
        ]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let log = u.sshd.home().join("proj/.codex_logs/web.log");
    let t0 = Instant::now();
    while !std::fs::read_to_string(&log).is_ok_and(|l| l.contains("serving")) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the job never logged"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // An extra file on the box for --delete to remove, and a stale local copy of the log.
    std::fs::write(u.sshd.home().join("proj/old.txt"), "old\n").unwrap();
    std::fs::write(proj.join(".codex_logs/web.log"), "stale copy\n").unwrap();
    let o = u.run(
        &mut u.cmd(&["sync", "--delete", "-v", &p, "gpu1:proj"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        !u.sshd.home().join("proj/old.txt").exists(),
        "--delete ran: {}",
        show(&o)
    );
    assert!(!show(&o).contains("codex_logs"), "{}", show(&o));
    let now = std::fs::read_to_string(&log).expect("the job's log is still there");
    assert!(now.contains("serving") && !now.contains("stale"), "{now:?}");
    let o = u.run(
        &mut u.cmd(&["jobs", "logs", "web"]),
        Duration::from_secs(30),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(text(&o.stdout).contains("serving"), "{}", show(&o));
    // A download brings the log home like any file; `gpu1:proj` without a trailing slash makes
    // back/proj, as rsync does.
    let back = u.tmp.path().join("back");
    let o = u.run(
        &mut u.cmd(&["sync", "gpu1:proj", &back.display().to_string()]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        std::fs::read_to_string(back.join("proj/.codex_logs/web.log"))
            .unwrap()
            .contains("serving")
    );

    // The log removed by hand: `logs` and `logs -f` say so, and exit 4, not 0 with nothing.
    std::fs::remove_file(&log).unwrap();
    for args in [&["jobs", "logs", "web"][..], &["jobs", "logs", "-f", "web"]] {
        let o = u.run(&mut u.cmd(args), Duration::from_secs(30));
        assert_eq!(o.status.code(), Some(4), "{args:?}: {}", show(&o));
        assert!(
            text(&o.stderr).contains("log") && text(&o.stderr).contains("is gone"),
            "{args:?}: {}",
            show(&o)
        );
        assert!(text(&o.stdout).is_empty(), "{}", show(&o));
    }
    let o = u.run(
        &mut u.cmd(&["jobs", "kill", "web", "--grace", "1"]),
        Duration::from_secs(30),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
}

/// Issue 41, item 1: a second `rsb jobs start --name j1` wiped the first run's log and exit
/// code. Now a name whose job runs is refused, and reusing an ended job's name keeps the
/// earlier run's output in the log (before the new run's) and says where it is and how that
/// run ended.
#[test]
fn a_reused_job_name_keeps_the_earlier_run() {
    let u = User::new();
    let m = marker();
    let _guard = KillMarked(m.clone());
    let start = |cmd: &str| {
        u.run(
            &mut u.cmd(&["jobs", "start", "--name", "j1", "--", cmd]),
            Duration::from_secs(60),
        )
    };
    let o = start("echo CRASH-TRACEBACK; exit 1");
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    // `logs -f` follows to the end and exits with the job's code.
    let o = u.run(
        &mut u.cmd(&["jobs", "logs", "-f", "j1"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(text(&o.stdout).contains("CRASH-TRACEBACK"), "{}", show(&o));

    let o = start(&format!("echo second-run; sleep {m}"));
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(
        err.contains("the earlier run of 'j1' exited with code 1; its output is kept in the first"),
        "{}",
        show(&o)
    );
    // Running now: the name is refused and the running job is untouched.
    let o = start("echo third-run");
    assert_ne!(o.status.code(), Some(0), "{}", show(&o));
    assert!(text(&o.stderr).contains("already running"), "{}", show(&o));

    let log = u.sshd.home().join(".codex_logs/j1.log");
    let t0 = Instant::now();
    let body = loop {
        let body = std::fs::read_to_string(&log).unwrap_or_default();
        if body.contains("second-run") {
            break body;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{body:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (first, second) = (
        body.find("CRASH-TRACEBACK")
            .expect("the first run's output is kept"),
        body.find("second-run").unwrap(),
    );
    assert!(first < second && body.contains("EXIT_CODE=1\n"), "{body:?}");
    assert!(!body.contains("third-run"), "{body:?}");
    // The tail is this run's alone.
    let o = u.run(&mut u.cmd(&["jobs", "logs", "j1"]), Duration::from_secs(30));
    assert!(text(&o.stdout).contains("second-run"), "{}", show(&o));
    assert!(!text(&o.stdout).contains("CRASH"), "{}", show(&o));
    let o = u.run(&mut u.cmd(&["jobs", "kill", "j1"]), Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
}

/// Issue 41, item 7: with REMOTE_HOST set, a misspelt `REMOTE_PORTT` was ignored and rsb
/// dialled port 22; `REMOTE_USER` left beside a sandbox list was ignored while `rsb config
/// check` said ok. Now the typo is a configuration error naming the variable it likely
/// means, and the leftover is named by `config check` and `doctor`.
#[test]
fn config_typos_and_leftovers_are_named() {
    let u = User::new();
    // The single-host variables, the port under `port_var`.
    let legacy = |port_var: &str| {
        let mut c = u.cmd(&["exec", "echo reached"]);
        c.env_remove("REMOTE_SANDBOX_LIST")
            .env("REMOTE_HOST", u.sshd.host())
            .env("REMOTE_USER", u.sshd.user())
            .env("REMOTE_KEY_FILE", u.sshd.client_key())
            .env(port_var, u.sshd.port().to_string());
        u.run(&mut c, Duration::from_secs(60))
    };
    let o = legacy("REMOTE_PORTT");
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(
        err.contains("REMOTE_PORTT is not a variable rsb reads"),
        "{err}"
    );
    assert!(err.contains("did you mean REMOTE_PORT?"), "{err}");
    assert!(!text(&o.stdout).contains("reached"), "{}", show(&o));
    // Spelt right, it reaches the fixture's port.
    let o = legacy("REMOTE_PORT");
    assert_eq!(text(&o.stdout), "reached\n", "{}", show(&o));

    // A leftover REMOTE_USER beside the sandbox list.
    for args in [&["config", "check"][..], &["doctor"][..]] {
        let mut c = u.cmd(args);
        c.env("REMOTE_USER", "bob");
        let o = u.run(&mut c, Duration::from_secs(60));
        let all = show(&o);
        assert!(
            all.contains("REMOTE_USER is ignored: it only completes REMOTE_HOST, and the sandboxes come from REMOTE_SANDBOX_LIST"),
            "{args:?}: {all}"
        );
    }
}

/// Issue 41, item 6: `rsb exec box hostname` ran a command called `box` (exit 127). As with
/// `ssh box hostname`, a first word naming a configured sandbox picks it unless `-s` was
/// given; alone, it gets a hint instead of a "command not found".
#[test]
fn exec_takes_the_sandbox_as_ssh_does() {
    let u = User::new();
    let run = |args: &[&str]| u.run(&mut u.cmd(args), Duration::from_secs(60));
    let o = run(&["exec", "gpu1", "echo", "on-gpu1"]);
    assert_eq!(
        (o.status.code(), text(&o.stdout)),
        (Some(0), "on-gpu1\n".into()),
        "{}",
        show(&o)
    );
    let o = run(&["exec", "gpu1", "--", "printf", "%s\\n", "a b"]);
    assert_eq!(text(&o.stdout), "a b\n", "{}", show(&o));
    let o = run(&["exec", "gpu1", "echo $HOME"]);
    assert_eq!(
        text(&o.stdout).trim(),
        u.sshd.home().display().to_string(),
        "{}",
        show(&o)
    );
    let o = run(&["exec", "gpu1"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        text(&o.stderr).contains("`gpu1` names a sandbox, not a command"),
        "{}",
        show(&o)
    );
    assert!(
        text(&o.stderr).contains("rsb exec gpu1 -- CMD"),
        "{}",
        show(&o)
    );
    // A word that names no sandbox is the command; with -s the words are the command.
    let o = run(&["exec", "echo", "gpu1"]);
    assert_eq!(text(&o.stdout), "gpu1\n", "{}", show(&o));
    let o = run(&["-s", "gpu1", "exec", "gpu1", "x"]);
    assert_eq!(o.status.code(), Some(127), "{}", show(&o));
}

/// Issue 46, item 9: a `rsb sync` killed outright (SIGKILL, an OOM kill, a closed laptop)
/// after it committed v2 of a file left the v1 baseline: a local edit to v3 was then a
/// conflict, and the sandbox kept v2. Each acknowledged batch is now journaled as it comes,
/// and the next sync folds the journal into the baseline.
#[test]
fn a_sync_killed_outright_keeps_what_it_committed() {
    let mut u = User::new();
    let proxy = rsb_tests::ChaosProxy::start(u.sshd.addr()).unwrap();
    u.list = json!([{"name": "gpu1", "host": u.sshd.host(), "port": proxy.port(),
        "user": u.sshd.user(), "key_file": u.sshd.client_key().display().to_string()}])
    .to_string();
    let proj = u.tmp.path().join("proj");
    std::fs::create_dir_all(&proj).unwrap();
    std::fs::write(proj.join("a.txt"), "v1\n").unwrap();
    let p = format!("{}/", proj.display());
    let sync = || {
        u.run(
            &mut u.cmd(&["sync", &p, "gpu1:proj"]),
            Duration::from_secs(120),
        )
    };
    let o = sync();
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));

    // v2, and a large file that keeps the run going (~10 s at 40 Mbit/s) after a.txt's batch
    // is acknowledged.
    std::fs::write(proj.join("a.txt"), "v2\n").unwrap();
    std::fs::write(proj.join("big.bin"), common::gen_bytes(5, 48 << 20)).unwrap();
    proxy.set_rate_mbit(40);
    let mut child = u.cmd(&["sync", &p, "gpu1:proj"]);
    let mut child = child
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let remote_a = u.sshd.home().join("proj/a.txt");
    let t0 = Instant::now();
    while std::fs::read(&remote_a).ok().as_deref() != Some(b"v2\n") {
        if t0.elapsed() > Duration::from_secs(60) || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a.txt v2 never reached the sandbox while the sync ran");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Its acknowledgement crosses the idle direction of the link: well within this.
    std::thread::sleep(Duration::from_secs(2));
    let running = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(running, "the sync must still be running when it is killed");
    proxy.reset();

    std::fs::write(proj.join("a.txt"), "v3\n").unwrap();
    let o = sync();
    assert_eq!(o.status.code(), Some(0), "no conflict: {}", show(&o));
    assert!(!text(&o.stderr).contains("conflict"), "{}", show(&o));
    assert_eq!(std::fs::read(&remote_a).unwrap(), b"v3\n");
    assert_eq!(
        std::fs::read(u.sshd.home().join("proj/big.bin")).unwrap(),
        std::fs::read(proj.join("big.bin")).unwrap()
    );
}
