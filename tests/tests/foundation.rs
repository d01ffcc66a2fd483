//! Foundation acceptance tests against a real private sshd: deploy, auth, host keys,
//! multiplexing, exec semantics, dropped links, and the aarch64 agent under qemu.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rsb::{config::Auth, error::Kind};
use rsb_protocol::{ExecRequest, PingRequest};
use rsb_tests::{ChaosProxy, SshAgentProc, Sshd};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploys_once_reuses_and_replaces_a_corrupt_agent() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();

    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    assert_eq!(
        pool.last_connect_deployed("s").await,
        Some(true),
        "first connect uploads the agent"
    );
    assert_eq!(c.hello().home, sshd.home().display().to_string());
    let installed = sshd.ssh_run("ls ~/.cache/rsb/agent/*/rsb-agent").unwrap();
    assert_eq!(installed.lines().count(), 1, "{installed}");
    let path = installed.trim().to_string();
    assert!(sshd.ssh_run(&format!("stat -c %a {path}")).unwrap().trim() == "700");
    drop(c);
    pool.shutdown().await;

    // A fresh pool is what a new process has: no cached path, so it probes and must reuse.
    let pool2 = key_pool(&sshd, dir.path());
    let c2 = pool2.client("s").await.unwrap();
    assert_eq!(
        pool2.last_connect_deployed("s").await,
        Some(false),
        "second connect reuses the agent"
    );
    assert_eq!(
        c2.call(PingRequest {
            payload: b"x".to_vec()
        })
        .await
        .unwrap(),
        b"x"
    );
    pool2.shutdown().await;

    // Corrupt the installed agent (flip bytes in the middle), then connect again.
    // (A running binary cannot be written in place, so corrupt a copy and rename it over.)
    sshd.ssh_run(&format!(
        "cp {path} {path}.x && printf 'XXXXXXXX' | dd of={path}.x bs=1 seek=4096 conv=notrunc status=none && mv -f {path}.x {path}"
    ))
    .unwrap();
    let pool3 = key_pool(&sshd, dir.path());
    let c3 = pool3.client("s").await.unwrap();
    assert_eq!(
        pool3.last_connect_deployed("s").await,
        Some(true),
        "a corrupt agent is replaced"
    );
    let r = c3.call(exec("echo ok", 5000)).await.unwrap();
    assert_eq!(out(&r.stdout), "ok\n");
    pool3.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_simultaneous_first_connects_both_succeed() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = key_pool(&sshd, dir.path());
    let b = key_pool(&sshd, dir.path());
    let (ra, rb) = tokio::join!(a.client("s"), b.client("s"));
    let (ca, cb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(
        ca.call(exec("echo a", 5000)).await.unwrap().stdout.head,
        b"a\n"
    );
    assert_eq!(
        cb.call(exec("echo b", 5000)).await.unwrap().stdout.head,
        b"b\n"
    );
    let leftovers = sshd.ssh_run("ls -a ~/.cache/rsb/agent/*/").unwrap();
    assert!(
        !leftovers.contains(".tmp."),
        "no temp files left: {leftovers}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_methods_and_one_line_errors() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kh = dir.path().join("known_hosts");

    // Key with passphrase.
    let auth = Auth::KeyFile {
        path: sshd.client_key_encrypted().to_path_buf(),
        passphrase: Some(secret(sshd.client_key_passphrase())),
    };
    let p = pool_of(
        vec![sandbox("enc", target(&sshd, sshd.port(), auth, &kh))],
        dir.path(),
    );
    p.client("enc").await.expect("key with passphrase");
    p.shutdown().await;

    // Encrypted key without passphrase: a clear one-line error.
    let auth = Auth::KeyFile {
        path: sshd.client_key_encrypted().to_path_buf(),
        passphrase: None,
    };
    let p = pool_of(
        vec![sandbox("enc", target(&sshd, sshd.port(), auth, &kh))],
        dir.path(),
    );
    let e = p.client("enc").await.unwrap_err();
    assert_eq!(e.kind, Kind::Auth);
    assert!(
        e.message.contains("encrypted") && !e.message.contains('\n'),
        "{e:?}"
    );

    // An unknown key (not in authorized_keys).
    let stray = dir.path().join("stray");
    let st = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&stray)
        .status()
        .unwrap();
    assert!(st.success());
    let auth = Auth::KeyFile {
        path: stray.clone(),
        passphrase: None,
    };
    let p = pool_of(
        vec![sandbox("k", target(&sshd, sshd.port(), auth, &kh))],
        dir.path(),
    );
    let e = p.client("k").await.unwrap_err();
    assert_eq!(e.kind, Kind::Auth, "{e:?}");
    assert!(
        e.message.contains("did not accept") && !e.message.contains('\n'),
        "{e:?}"
    );

    // No explicit credential: ssh_config IdentityFiles first, then default keys.
    let auto = Auth::Auto {
        identity_files: vec![stray.clone()],
        default_keys: vec![sshd.client_key().to_path_buf()],
        passphrase: None,
        agent: Default::default(),
    };
    let p = pool_of(
        vec![sandbox("auto", target(&sshd, sshd.port(), auto, &kh))],
        dir.path(),
    );
    p.client("auto")
        .await
        .expect("auto auth falls through to a default key");
    p.shutdown().await;
    let auto = Auth::Auto {
        identity_files: vec![stray.clone()],
        default_keys: vec![],
        passphrase: None,
        agent: Default::default(),
    };
    let p = pool_of(
        vec![sandbox("auto", target(&sshd, sshd.port(), auto, &kh))],
        dir.path(),
    );
    let e = p.client("auto").await.unwrap_err();
    assert!(
        e.message.contains("rejected") && e.message.contains("stray"),
        "{e:?}"
    );

    // ssh-agent.
    let agent = SshAgentProc::start().unwrap();
    agent.add_key(sshd.client_key(), None).unwrap();
    // IdentityAgent (issue 44): the agent at a path, whatever SSH_AUTH_SOCK says (under
    // launchd it is the system's, not the user's 1Password or Secretive agent).
    let via_path = Auth::Auto {
        identity_files: vec![],
        default_keys: vec![],
        passphrase: None,
        agent: rsb::config::AgentSocket::Path(agent.sock().to_path_buf()),
    };
    let p = pool_of(
        vec![sandbox("ia", target(&sshd, sshd.port(), via_path, &kh))],
        dir.path(),
    );
    p.client("ia")
        .await
        .expect("auth through the IdentityAgent path");
    p.shutdown().await;
    // SAFETY: this test binary sets SSH_AUTH_SOCK once, before any agent auth in this test.
    unsafe { std::env::set_var("SSH_AUTH_SOCK", agent.sock()) };
    let p = pool_of(
        vec![sandbox("ag", target(&sshd, sshd.port(), Auth::Agent, &kh))],
        dir.path(),
    );
    p.client("ag").await.expect("ssh-agent auth");
    p.shutdown().await;
    // `IdentityAgent none`: the agent is not asked, though SSH_AUTH_SOCK now holds the key.
    let off = Auth::Auto {
        identity_files: vec![],
        default_keys: vec![],
        passphrase: None,
        agent: rsb::config::AgentSocket::Off,
    };
    let p = pool_of(
        vec![sandbox("off", target(&sshd, sshd.port(), off, &kh))],
        dir.path(),
    );
    let e = p.client("off").await.unwrap_err();
    assert!(e.message.contains("no password, key_file"), "{e:?}");
    p.shutdown().await;

    // Password (needs root to create the test user).
    if let Some((user, pw)) = sshd.password_user() {
        let mut t = target(&sshd, sshd.port(), Auth::Password(secret(&pw)), &kh);
        t.user = user.clone();
        let p = pool_of(vec![sandbox("pw", t)], dir.path());
        let c = p.client("pw").await.expect("password auth");
        assert_eq!(c.hello().user, user);
        p.shutdown().await;

        let mut t = target(
            &sshd,
            sshd.port(),
            Auth::Password(secret("wrong-password")),
            &kh,
        );
        t.user = user;
        let p = pool_of(vec![sandbox("pw", t)], dir.path());
        let e = p.client("pw").await.unwrap_err();
        assert_eq!(e.kind, Kind::Auth);
        assert!(e.message.contains("rejected the password"), "{e:?}");
        assert!(!e.message.contains("wrong-password") && !e.hint.contains("wrong-password"));
        assert!(!e.message.contains('\n'));
    } else {
        eprintln!("note: not root; password auth not tested");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_host_key_is_refused() {
    let mut sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kh = dir.path().join("known_hosts");
    let pool = key_pool(&sshd, dir.path());
    pool.client("s").await.unwrap();
    pool.shutdown().await;
    let recorded = std::fs::read_to_string(&kh).unwrap();
    assert!(
        recorded.contains(&format!("[127.0.0.1]:{}", sshd.port())),
        "accept-new records: {recorded}"
    );

    sshd.regenerate_host_key().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let e = pool.client("s").await.unwrap_err();
    assert_eq!(e.kind, Kind::HostKey, "{e:?}");
    assert!(
        e.message.contains("CHANGED") && e.message.contains(&kh.display().to_string()),
        "{e:?}"
    );
    assert!(e.message.contains(&format!("[127.0.0.1]:{}", sshd.port())));
    // The record was not overwritten.
    assert_eq!(std::fs::read_to_string(&kh).unwrap(), recorded);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_execs_on_one_channel() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    let futs = (0..50).map(|i| {
        let c = c.clone();
        async move {
            let cmd = format!(
                "for j in 1 2 3; do echo line-{i}-$j; done; echo err-{i} >&2; exit {}",
                i % 7
            );
            (i, c.call(exec(&cmd, 20_000)).await.unwrap())
        }
    });
    for (i, r) in futures::future::join_all(futs).await {
        assert_eq!(
            out(&r.stdout),
            format!("line-{i}-1\nline-{i}-2\nline-{i}-3\n")
        );
        assert_eq!(out(&r.stderr), format!("err-{i}\n"));
        assert_eq!(r.exit_code, Some(i % 7));
    }
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_semantics_over_ssh() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();

    // Timeout: returns promptly, flagged, and the whole process group is gone.
    let t0 = Instant::now();
    let r = c.call(exec("echo $$; sleep 30", 2000)).await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(r.timed_out);
    let pgid: i32 = out(&r.stdout).trim().parse().unwrap();
    assert!(
        !group_alive(pgid),
        "process group {pgid} survived the timeout"
    );

    // A command that exits 124 by itself is not a timeout.
    let r = c.call(exec("exit 124", 5000)).await.unwrap();
    assert_eq!((r.exit_code, r.timed_out), (Some(124), false));

    // cwd is data: spaces work, shell syntax is just a (missing) path.
    std::fs::create_dir_all("/tmp/a b").unwrap();
    let mut req = exec("pwd", 5000);
    req.cwd = Some("/tmp/a b".into());
    assert_eq!(out(&c.call(req).await.unwrap().stdout), "/tmp/a b\n");
    let marker = format!("/tmp/pwned-{}", std::process::id());
    let mut req = exec("true", 5000);
    req.cwd = Some(format!("/tmp; touch {marker}"));
    let e = c.call(req).await.unwrap_err();
    assert!(e.message.contains("/tmp; touch"), "{e:?}");
    assert!(
        !std::path::Path::new(&marker).exists(),
        "injected command ran"
    );

    // stdin is closed.
    let t0 = Instant::now();
    let r = c.call(exec("cat", 10_000)).await.unwrap();
    assert_eq!(r.exit_code, Some(0));
    assert!(t0.elapsed() < Duration::from_secs(2));

    // 10 MB of output is capped as asked.
    let mut req = exec("head -c 10000000 /dev/zero | tr '\\0' x", 30_000);
    req.max_stdout = 1000;
    let r = c.call(req).await.unwrap();
    assert_eq!(r.stdout.total, 10_000_000);
    assert_eq!(r.stdout.head.len() + r.stdout.tail.len(), 1000);

    // Invalid UTF-8 comes back byte-exact (the MCP layer flags it).
    let r = c.call(exec("printf 'a\\377b'", 5000)).await.unwrap();
    assert_eq!(r.stdout.head, b"a\xffb");
    let rendered = rsb::ops::output::render(&r.stdout);
    assert!(rendered.lossy && rendered.text == "a\u{fffd}b");
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_link_fails_in_flight_calls_fast_and_the_next_call_reconnects() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (proxy, t) = proxied_target(&sshd, dir.path());
    let pool = pool_of(vec![sandbox("s", t)], dir.path());
    let c = pool.client("s").await.unwrap();
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.call(exec("sleep 20", 60_000)).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    proxy.cut();
    let e = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("failed promptly")
        .unwrap()
        .unwrap_err();
    assert!(e.is_connection_lost(), "{e:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    // The next request reconnects transparently.
    let c = pool.client("s").await.unwrap();
    assert_eq!(
        out(&c.call(exec("echo back", 5000)).await.unwrap().stdout),
        "back\n"
    );
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_link_is_detected_by_keepalive() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (proxy, t) = proxied_target(&sshd, dir.path());
    let pool = pool_of(vec![sandbox("s", t)], dir.path());
    let c = pool.client("s").await.unwrap();
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.call(exec("sleep 60", 120_000)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    proxy.blackhole(true);
    let e = tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("detected")
        .unwrap()
        .unwrap_err();
    assert!(e.is_connection_lost(), "{e:?}");
    eprintln!("black hole detected after {:?}", t0.elapsed());
    proxy.reset();
    let c = pool.client("s").await.unwrap();
    assert_eq!(
        out(&c.call(exec("echo ok", 5000)).await.unwrap().stdout),
        "ok\n"
    );
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sftp_less_server_gets_the_agent_by_cat() {
    let sshd = Sshd::start_with(rsb_tests::SshdOptions {
        sftp: false,
        ..Default::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool.client("s").await.unwrap();
    assert_eq!(pool.last_connect_deployed("s").await, Some(true));
    assert_eq!(
        out(&c.call(exec("echo via-cat", 5000)).await.unwrap().stdout),
        "via-cat\n"
    );
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aarch64_agent_runs_under_qemu_through_the_local_transport() {
    let agent =
        rsb_tests::workspace_root().join("target/agents/aarch64-unknown-linux-musl/rsb-agent");
    let qemu = which("qemu-aarch64-static");
    let required = std::env::var("RSB_REQUIRE_AARCH64").as_deref() == Ok("1");
    if !agent.exists() || qemu.is_none() {
        assert!(
            !required,
            "aarch64 agent or qemu-aarch64-static missing but RSB_REQUIRE_AARCH64=1"
        );
        eprintln!(
            "note: skipping aarch64 test (agent built: {}, qemu: {:?})",
            agent.exists(),
            qemu
        );
        return;
    }
    let qemu = qemu.unwrap();
    let c = rsb::connect::start_local_with("arm", &qemu, &[agent.to_str().unwrap()])
        .await
        .unwrap();
    assert_eq!(c.hello().arch, "aarch64");
    assert_eq!(
        c.call(PingRequest {
            payload: b"p".to_vec()
        })
        .await
        .unwrap(),
        b"p"
    );
    let r = c.call(exec("echo hi; exit 5", 20_000)).await.unwrap();
    assert_eq!((out(&r.stdout).as_str(), r.exit_code), ("hi\n", Some(5)));
    c.close("done");
}

fn which(name: &str) -> Option<String> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| format!("{d}/{name}"))
        .find(|p| std::path::Path::new(p).is_file())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noexec_home_falls_back_to_another_directory() {
    let sshd = Sshd::start().unwrap();
    let home = sshd.home().to_path_buf();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16m,noexec,mode=755", "tmpfs"])
        .arg(&home)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("note: cannot mount a noexec tmpfs here (not root?); skipping");
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
    let _guard = Unmount(home.clone());
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let c = pool
        .client("s")
        .await
        .expect("falls back to a directory that allows exec");
    assert_eq!(
        out(&c.call(exec("echo fallback", 5000)).await.unwrap().stdout),
        "fallback\n"
    );
    let exe = std::fs::read_link(format!("/proc/{}/exe", c.hello().pid)).unwrap();
    assert!(
        !exe.starts_with(&home),
        "agent runs from {exe:?}, inside the noexec home"
    );
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsupported_platform_is_a_clear_error() {
    let fake = tempfile::tempdir().unwrap();
    let uname = fake.path().join("uname");
    std::fs::write(
        &uname,
        "#!/bin/sh\ncase \"$1\" in -s) echo Darwin;; -m) echo arm64;; *) echo Darwin;; esac\n",
    )
    .unwrap();
    std::fs::set_permissions(&uname, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:/usr/local/bin:/usr/bin:/bin", fake.path().display());
    let sshd = Sshd::start_with(rsb_tests::SshdOptions {
        set_env: vec![("PATH".into(), path)],
        ..Default::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    let e = pool.client("s").await.unwrap_err();
    assert_eq!(e.kind, Kind::Deploy, "{e:?}");
    assert!(
        e.message.contains("unsupported platform Darwin arm64"),
        "{e:?}"
    );
    assert!(!e.message.contains('\n'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_jump_reaches_the_target_through_the_jump_host() {
    let target_sshd = Sshd::start().unwrap();
    let pubkey =
        std::fs::read_to_string(format!("{}.pub", target_sshd.client_key().display())).unwrap();
    let jump = Sshd::start_with(rsb_tests::SshdOptions {
        extra_authorized_keys: vec![pubkey.trim().to_string()],
        ..Default::default()
    })
    .unwrap();
    // All traffic to the jump host passes this proxy, which proves the path taken.
    let proxy = ChaosProxy::start(jump.addr()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut t = target(
        &target_sshd,
        target_sshd.port(),
        key_auth(&target_sshd),
        &dir.path().join("known_hosts"),
    );
    t.proxy_jump = vec![hop(
        &jump,
        "127.0.0.1",
        proxy.port(),
        key_auth(&target_sshd),
        &dir.path().join("known_hosts"),
    )];
    let pool = pool_of(vec![sandbox("s", t)], dir.path());
    let c = pool.client("s").await.unwrap();
    assert_eq!(
        c.hello().home,
        target_sshd.home().display().to_string(),
        "landed on the target"
    );
    let before = proxy.bytes_forwarded().0;
    let r = c
        .call(exec("head -c 100000 /dev/zero | wc -c", 10_000))
        .await
        .unwrap();
    assert_eq!(out(&r.stdout).trim(), "100000");
    assert!(
        proxy.bytes_forwarded().0 > before,
        "the exec went through the jump host"
    );
    // Cutting the jump host's link takes the target session down with it, and the next call
    // reconnects through the jump host again.
    proxy.cut();
    let e = c.call(exec("sleep 5", 10_000)).await.unwrap_err();
    assert!(e.is_connection_lost(), "{e:?}");
    let c = pool.client("s").await.unwrap();
    assert_eq!(
        out(&c.call(exec("echo again", 5000)).await.unwrap().stdout),
        "again\n"
    );
    pool.shutdown().await;

    // A jump host that refuses the key is a one-line error naming the jump host.
    let mut t = target(
        &target_sshd,
        target_sshd.port(),
        key_auth(&target_sshd),
        &dir.path().join("known_hosts"),
    );
    let mut refused = hop(
        &jump,
        "127.0.0.1",
        jump.port(),
        key_auth(&target_sshd),
        &dir.path().join("known_hosts"),
    );
    refused.user = format!("nobody-{}", std::process::id());
    t.proxy_jump = vec![refused];
    let pool = pool_of(vec![sandbox("s", t)], dir.path());
    let e = pool.client("s").await.unwrap_err();
    assert!(
        e.message.contains("jump host") && !e.message.contains('\n'),
        "{e:?}"
    );
}
