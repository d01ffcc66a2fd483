//! Self-tests of the fixtures: if these fail, every end-to-end test built on
//! them is meaningless, so they check the properties those tests rely on
//! (isolation, fault semantics) rather than just "it starts".

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use rsb_tests::{ChaosProxy, SshAgentProc, Sshd, SshdOptions, output_with_timeout};

const T: Duration = Duration::from_secs(20);

fn run_ok(cmd: &mut Command) -> Result<String> {
    let out = output_with_timeout(cmd, T)?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn with_log<T>(sshd: &Sshd, r: Result<T>) -> Result<T> {
    r.with_context(|| format!("sshd log:\n{}", sshd.log_contents()))
}

/// Polls `cond` until true or `timeout`; tests use it instead of sleeps.
fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

fn gone_or_zombie(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

#[test]
fn home_and_tmux_dir_are_per_fixture() -> Result<()> {
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(Sshd::start);
        let b = s.spawn(Sshd::start);
        (a.join().expect("thread"), b.join().expect("thread"))
    });
    let (a, b) = (a?, b?);
    ensure!(a.port() != b.port());
    ensure!(a.home() != b.home());
    for s in [&a, &b] {
        let out = with_log(s, s.ssh_run("echo $HOME; echo $TMUX_TMPDIR; whoami"))?;
        let lines: Vec<&str> = out.lines().collect();
        ensure!(
            lines
                == [
                    s.home().to_str().unwrap(),
                    s.tmux_tmpdir().to_str().unwrap(),
                    s.user()
                ],
            "unexpected session env: {out:?}"
        );
        // Side effects under $HOME land in this fixture only.
        s.ssh_run("mkdir -p $HOME/.cache/rsb && touch $HOME/.cache/rsb/marker")?;
        ensure!(s.home().join(".cache/rsb/marker").exists());
    }
    // A tmux server started over ssh uses the fixture's socket dir.
    if Path::new("/usr/bin/tmux").exists() {
        a.ssh_run("tmux new-session -d -s t 'sleep 60' && tmux ls")?;
        let uid_dir = std::fs::read_dir(a.tmux_tmpdir())?.count();
        ensure!(
            uid_dir == 1,
            "tmux socket dir not created under TMUX_TMPDIR"
        );
        ensure!(std::fs::read_dir(b.tmux_tmpdir())?.count() == 0);
    }
    Ok(())
}

#[test]
fn extra_set_env_and_sftp_toggle() -> Result<()> {
    let on = Sshd::start_with(SshdOptions {
        set_env: vec![("RSB_TEST_X".into(), "a b/c".into())],
        ..Default::default()
    })?;
    ensure!(on.ssh_run("echo \"$RSB_TEST_X\"")?.trim() == "a b/c");
    // PATH overrides must also survive login shells, whose /etc/profile
    // resets PATH.
    let path = Sshd::start_with(SshdOptions {
        set_env: vec![("PATH".into(), "/opt/rsb-fake:/usr/bin:/bin".into())],
        ..Default::default()
    })?;
    for cmd in ["echo $PATH", "bash -lc 'echo $PATH'"] {
        let got = path.ssh_run(cmd)?;
        ensure!(
            got.trim() == "/opt/rsb-fake:/usr/bin:/bin",
            "{cmd}: {got:?}"
        );
    }
    let off = Sshd::start_with(SshdOptions {
        sftp: false,
        ..Default::default()
    })?;
    let sftp = |s: &Sshd| -> Result<bool> {
        let mut c = Command::new("sftp");
        c.args(s.ssh_options())
            .args(["-P", &s.port().to_string(), "-b", "/dev/null"])
            .arg(format!("{}@{}", s.user(), s.host()));
        Ok(output_with_timeout(&mut c, T)?.status.success())
    };
    ensure!(sftp(&on)?, "sftp should work when enabled");
    ensure!(!sftp(&off)?, "sftp should fail when disabled");
    ensure!(
        Sshd::start_with(SshdOptions {
            set_env: vec![("HOME".into(), "/tmp".into())],
            ..Default::default()
        })
        .is_err()
    );
    Ok(())
}

#[test]
fn password_user_logs_in_by_password_only() -> Result<()> {
    let s = Sshd::start()?;
    let Some((user, password)) = s.password_user() else {
        eprintln!("note: not root, skipping password auth self-test");
        return Ok(());
    };
    let out = with_log(
        &s,
        run_ok(&mut s.ssh_password_command(&user, &password, "whoami; echo $HOME")?),
    )?;
    let home = s.password_home().context("password home")?;
    ensure!(
        out.lines().collect::<Vec<_>>() == [user.as_str(), home.to_str().unwrap()],
        "unexpected: {out:?}"
    );
    run_ok(&mut s.ssh_password_command(&user, &password, "touch $HOME/ok")?)?;
    ensure!(home.join("ok").exists());
    let wrong = output_with_timeout(
        &mut s.ssh_password_command(&user, "definitely-wrong", "true")?,
        T,
    )?;
    ensure!(!wrong.status.success(), "wrong password was accepted");
    // The same account is shared by all fixtures of this process.
    let s2 = Sshd::start()?;
    ensure!(s2.password_user() == Some((user, password)));
    Ok(())
}

#[test]
fn regenerated_host_key_is_detected_on_same_port() -> Result<()> {
    let mut s = Sshd::start()?;
    let port = s.port();
    let old_line = s.host_public_key_line();
    let pinned = s.dir().join("pinned_known_hosts");
    std::fs::write(&pinned, format!("{}\n", s.known_hosts_line()))?;
    let known = format!("UserKnownHostsFile={}", pinned.display());
    let strict = |s: &Sshd| {
        let opts = [known.as_str(), "StrictHostKeyChecking=yes"];
        output_with_timeout(&mut s.ssh_command_with(s.port(), &opts, "true"), T)
    };
    ensure!(strict(&s)?.status.success(), "pinned key should verify");

    s.regenerate_host_key()?;
    ensure!(s.port() == port);
    ensure!(s.host_public_key_line() != old_line);
    with_log(&s, s.ssh_run("true"))?;
    let scan = run_ok(Command::new("ssh-keyscan").args([
        "-t",
        "ed25519",
        "-p",
        &port.to_string(),
        "127.0.0.1",
    ]))?;
    let new_key = s.host_public_key_line();
    let new_b64 = new_key.split_whitespace().nth(1).unwrap();
    ensure!(scan.contains(new_b64), "keyscan: {scan:?}");
    let out = strict(&s)?;
    ensure!(!out.status.success(), "changed host key must be rejected");
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("IDENTIFICATION HAS CHANGED"),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn kill_sessions_and_restart_drop_connections() -> Result<()> {
    let mut s = Sshd::start()?;
    for round in 0..2 {
        let mut child = s
            .ssh_command("echo started; sleep 30")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut first = [0u8; 8];
        std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first)?;
        let t0 = Instant::now();
        if round == 0 {
            s.kill_sessions();
        } else {
            s.restart()?;
        }
        let exited = wait_until(Duration::from_secs(5), || {
            matches!(child.try_wait(), Ok(Some(_)))
        });
        let _ = child.kill();
        let _ = child.wait();
        ensure!(exited, "round {round}: ssh still connected");
        ensure!(t0.elapsed() < Duration::from_secs(5));
        with_log(&s, s.ssh_run("true"))?;
    }
    Ok(())
}

#[test]
fn drop_kills_detached_session_processes() -> Result<()> {
    let s = Sshd::start()?;
    let pid: u32 = s
        .ssh_run("setsid sleep 3117 </dev/null >/dev/null 2>&1 & echo $!")?
        .trim()
        .parse()?;
    ensure!(!gone_or_zombie(pid), "detached process did not start");
    let dir = s.dir().to_path_buf();
    drop(s);
    ensure!(wait_until(Duration::from_secs(3), || gone_or_zombie(pid)));
    ensure!(!dir.exists());
    Ok(())
}

#[test]
fn chaos_proxy_relays_and_injects_faults() -> Result<()> {
    let s = Sshd::start()?;
    let p = ChaosProxy::start(s.addr())?;
    let via = |cmd: &str| s.ssh_command_via_port(p.port(), cmd);

    // Plain relay, with byte accounting.
    ensure!(run_ok(&mut via("echo via-proxy"))?.trim() == "via-proxy");
    let (up, down) = p.bytes_forwarded();
    ensure!(up > 0 && down > 0);
    ensure!(wait_until(Duration::from_secs(2), || p.connections() == 0));

    // Delay adds latency (an ssh login is several round trips).
    let timed = |c: &mut Command| -> Result<Duration> {
        let t = Instant::now();
        run_ok(c)?;
        Ok(t.elapsed())
    };
    let base = timed(&mut via("true"))?;
    p.set_delay(Duration::from_millis(100));
    let slow = timed(&mut via("true"))?;
    p.reset();
    ensure!(
        slow >= base + Duration::from_millis(400),
        "delay not visible: base {base:?}, slow {slow:?}"
    );

    // Refuse: the connection is closed at once.
    p.refuse(true);
    let t = Instant::now();
    ensure!(!output_with_timeout(&mut via("true"), T)?.status.success());
    ensure!(t.elapsed() < Duration::from_secs(5));
    p.refuse(false);

    // Blackhole on a new connection: no banner, ssh gives up on its own.
    p.blackhole(true);
    let t = Instant::now();
    let mut c = s.ssh_command_with(p.port(), &["ConnectTimeout=2"], "true");
    let out = output_with_timeout(&mut c, Duration::from_secs(15))?;
    ensure!(!out.status.success(), "ssh got through a blackhole");
    ensure!(t.elapsed() < Duration::from_secs(10));
    p.blackhole(false);
    ensure!(wait_until(Duration::from_secs(2), || p.connections() == 0));

    // Blackhole on an established connection: output is held, not lost.
    // The gap leaves room for this thread to be descheduled (a loaded CI box) between reading
    // "one" and raising the blackhole: "two" must come while it is up.
    let mut child = via("echo one; sleep 2; echo two")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut first = [0u8; 4];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first)?;
    p.blackhole(true);
    let held = !wait_until(Duration::from_secs(3), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    let (_, down_held) = p.bytes_forwarded();
    p.blackhole(false);
    let finished = wait_until(Duration::from_secs(5), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    let mut rest = String::new();
    if finished {
        std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut rest)?;
    }
    let _ = child.kill();
    let _ = child.wait();
    ensure!(held, "ssh finished while blackholed");
    ensure!(finished, "ssh did not resume after the blackhole lifted");
    ensure!(rest.trim() == "two", "lost output: {rest:?}");
    ensure!(p.bytes_forwarded().1 > down_held);

    // Cut kills an in-flight session quickly.
    let mut child = via("echo go; sleep 5")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut first = [0u8; 3];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first)?;
    ensure!(p.connections() == 1);
    let t = Instant::now();
    p.cut();
    ensure!(p.connections() == 0);
    let exited = wait_until(Duration::from_secs(2), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    let status = child.try_wait()?;
    let _ = child.kill();
    let _ = child.wait();
    ensure!(
        exited && t.elapsed() < Duration::from_secs(2),
        "cut did not end ssh"
    );
    ensure!(status.is_some_and(|s| !s.success()));

    // And the proxy keeps working afterwards.
    ensure!(run_ok(&mut via("echo again"))?.trim() == "again");
    Ok(())
}

#[test]
fn ssh_agent_holds_keys_and_authenticates() -> Result<()> {
    let s = Sshd::start()?;
    let agent = SshAgentProc::start()?;
    ensure!(agent.list_keys()?.trim().is_empty());
    agent.add_key(s.client_key(), None)?;
    agent.add_key(s.client_key_encrypted(), Some(s.client_key_passphrase()))?;
    let listed = agent.list_keys()?;
    ensure!(listed.lines().count() == 2, "ssh-add -l: {listed}");
    ensure!(listed.contains("rsb-test-client-encrypted"));
    let other = SshAgentProc::start()?;
    let t = Instant::now();
    ensure!(
        other
            .add_key(s.client_key_encrypted(), Some("wrong"))
            .is_err()
    );
    ensure!(
        t.elapsed() < Duration::from_secs(10),
        "wrong passphrase re-prompted"
    );

    // Log in through the agent alone (no -i).
    let mut c = agent.command("ssh");
    c.args(["-F", "/dev/null", "-p", &s.port().to_string()])
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
        ])
        .args(["-o", "BatchMode=yes", "-o", "LogLevel=ERROR"])
        .arg(format!("{}@{}", s.user(), s.host()))
        .arg("echo agent-ok");
    ensure!(with_log(&s, run_ok(&mut c))?.trim() == "agent-ok");
    Ok(())
}

#[test]
fn rsync_reaches_fixture() -> Result<()> {
    let s = Sshd::start()?;
    let src = s.dir().join("rsync-src");
    std::fs::create_dir(&src)?;
    std::fs::File::create(src.join("f"))?.write_all(b"hello")?;
    run_ok(
        Command::new("rsync")
            .args(["-a", "-e", &s.rsync_ssh_arg()])
            .arg(format!("{}/", src.display()))
            .arg(format!(
                "{}@{}:{}/dst/",
                s.user(),
                s.host(),
                s.home().display()
            )),
    )?;
    ensure!(std::fs::read(s.home().join("dst/f"))? == b"hello");
    Ok(())
}
