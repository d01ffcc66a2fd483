//! ProxyJump chains resolved from a real `~/.ssh/config`, against real sshds: every hop keeps its
//! own user, key and host-key settings, and IPv6 literals work as hops.

use std::{collections::HashMap, path::Path, sync::Arc};

use rsb::{
    config::{Config, Transport},
    pool::Pool,
};
use rsb_protocol::ExecRequest;
use rsb_tests::{Sshd, SshdOptions, sshd::ipv6_loopback_available};

fn exec(cmd: &str) -> ExecRequest {
    let mut r = ExecRequest::new(cmd);
    r.timeout_ms = 10_000;
    r
}

fn stdout(c: &rsb_protocol::Captured) -> String {
    let mut b = c.head.clone();
    b.extend_from_slice(&c.tail);
    String::from_utf8_lossy(&b).into_owned()
}

/// Loads the configuration the way `rsb` does, from a private home whose `.ssh/config` is
/// `ssh_config`, with one sandbox `s` naming the ssh_config alias `alias`.
fn pool_from_ssh_config(home: &Path, ssh_config: &str, alias: &str) -> Pool {
    let cfg = home.join(".ssh/config");
    std::fs::create_dir_all(cfg.parent().unwrap()).unwrap();
    std::fs::write(&cfg, ssh_config).unwrap();
    let vars: HashMap<&str, String> = HashMap::from([
        (
            "REMOTE_SANDBOX_LIST",
            format!(r#"[{{"name":"s","ssh_config_host":"{alias}"}}]"#),
        ),
        ("RSB_STATE_DIR", home.join("state").display().to_string()),
    ]);
    let env = move |k: &str| vars.get(k).cloned();
    let config = Config::from_sources(&env, None, Some(&cfg), home, home).expect("config loads");
    Pool::new(Arc::new(config))
}

fn accepted(sshd: &Sshd, user: &str) -> bool {
    sshd.log_contents()
        .contains(&format!("Accepted publickey for {user} "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hops_each_with_its_own_user_and_key() {
    let target = Sshd::start().unwrap();
    let me = target.user().to_string();
    // Each sshd accepts only its own fixture's keys, so every hop must present its own key.
    // AllowUsers makes each hop insist on its own user as well.
    let (j1_user, j1_opts) = match target.password_user() {
        Some((name, _)) => (
            name.clone(),
            SshdOptions {
                extra_config: vec![format!("AllowUsers {name}")],
                ..Default::default()
            },
        ),
        None => {
            eprintln!(
                "two_hops_each_with_its_own_user_and_key: not root, so no second system user; \
                 both hops log in as {me} and differ by key only"
            );
            (me.clone(), SshdOptions::default())
        }
    };
    let j1 = Sshd::start_with(j1_opts).unwrap();
    let j2 = Sshd::start_with(SshdOptions {
        extra_config: vec![format!("AllowUsers {me}")],
        ..Default::default()
    })
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let ssh_config = |j2_identity: &str| {
        format!(
            "\
Host rsb-target
    HostName 127.0.0.1
    Port {tp}
    User {me}
    IdentityFile {tk}
    ProxyJump rsb-j1,rsb-j2

Host rsb-j1
    HostName 127.0.0.1
    Port {p1}
    User {j1_user}
    IdentityFile {k1}

Host rsb-j2
    HostName 127.0.0.1
    Port {p2}
    User {me}
{j2_identity}",
            tp = target.port(),
            tk = target.client_key().display(),
            p1 = j1.port(),
            k1 = j1.client_key().display(),
            p2 = j2.port(),
        )
    };
    let pool = pool_from_ssh_config(
        home.path(),
        &ssh_config(&format!("    IdentityFile {}\n", j2.client_key().display())),
        "rsb-target",
    );
    let c = pool.client("s").await.expect("connects through both hops");
    assert_eq!(c.hello().home, target.home().display().to_string());
    let r = c.call(exec("echo via-two-hops")).await.unwrap();
    assert_eq!(stdout(&r.stdout), "via-two-hops\n");
    assert!(accepted(&j1, &j1_user), "{}", j1.log_contents());
    assert!(accepted(&j2, &me), "{}", j2.log_contents());
    assert!(accepted(&target, &me), "{}", target.log_contents());
    pool.shutdown().await;

    // Without its own IdentityFile the second hop falls back to the target's key, which it
    // does not accept: the error names that hop.
    let home = tempfile::tempdir().unwrap();
    let pool = pool_from_ssh_config(home.path(), &ssh_config(""), "rsb-target");
    let e = pool.client("s").await.unwrap_err();
    let j2_addr = format!("jump host {me}@127.0.0.1:{}", j2.port());
    assert!(
        e.message.contains(&j2_addr) && !e.message.contains('\n'),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_literal_hop_checks_its_host_key_in_bracket_form() {
    if !ipv6_loopback_available() {
        eprintln!("an_ipv6_literal_hop_checks_its_host_key_in_bracket_form: skipped, no ::1 here");
        return;
    }
    let v6 = || SshdOptions {
        ipv6: true,
        ..Default::default()
    };
    let target = Sshd::start_with(v6()).unwrap();
    let jump = Sshd::start_with(v6()).unwrap();
    let me = target.user().to_string();
    let home = tempfile::tempdir().unwrap();
    // Strict checking for the hop: only a `[::1]:port` line in its own file lets it through.
    let jump_known = home.path().join("jump_known_hosts");
    std::fs::write(
        &jump_known,
        format!("{}\n", jump.known_hosts_line_for("::1")),
    )
    .unwrap();
    let ssh_config = format!(
        "\
Host rsb-v6
    HostName ::1
    Port {tp}
    User {me}
    IdentityFile {tk}
    ProxyJump {me}@[::1]:{jp}

Host ::1
    IdentityFile {jk}
    StrictHostKeyChecking yes
    UserKnownHostsFile {jkh}
",
        tp = target.port(),
        tk = target.client_key().display(),
        jp = jump.port(),
        jk = jump.client_key().display(),
        jkh = jump_known.display(),
    );
    let pool = pool_from_ssh_config(home.path(), &ssh_config, "rsb-v6");
    let Some(Transport::Ssh(t)) = pool.sandbox_config("s").map(|s| &s.transport) else {
        panic!("an ssh sandbox");
    };
    assert_eq!(t.address(), format!("{me}@[::1]:{}", target.port()));
    let c = pool
        .client("s")
        .await
        .expect("connects through the IPv6 hop");
    let r = c.call(exec("echo via-v6")).await.unwrap();
    assert_eq!(stdout(&r.stdout), "via-v6\n");
    assert!(
        jump.log_contents()
            .contains(&format!("Accepted publickey for {me} from ::1 port")),
        "the hop was reached over IPv6: {}",
        jump.log_contents()
    );
    assert!(
        target
            .log_contents()
            .contains(&format!("Accepted publickey for {me} from ::1 port")),
        "the jump host forwarded to ::1: {}",
        target.log_contents()
    );
    // The target's new key was recorded under its IPv6 name, in the form ssh reads back.
    let learned = std::fs::read_to_string(home.path().join("state/known_hosts")).unwrap();
    assert!(
        learned
            .lines()
            .any(|l| l.starts_with(&format!("[::1]:{} ", target.port()))),
        "{learned}"
    );
    pool.shutdown().await;

    // The same hop with a known_hosts file that does not know it is refused (strict).
    std::fs::write(&jump_known, "").unwrap();
    let home2 = tempfile::tempdir().unwrap();
    let pool = pool_from_ssh_config(home2.path(), &ssh_config, "rsb-v6");
    let e = pool.client("s").await.unwrap_err();
    assert!(
        e.message
            .contains(&format!("host key for [::1]:{} is unknown", jump.port())),
        "{e:?}"
    );
}
