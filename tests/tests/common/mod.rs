//! Helpers shared by the integration tests: sandbox configs pointing at a fixture sshd.
#![allow(dead_code)]

use std::{path::Path, sync::Arc, time::Duration};

use rsb::{
    app::App,
    config::{Auth, Config, Hop, HostKeyPolicy, SandboxConfig, Secret, SshTarget, Transport},
    pool::Pool,
};
use rsb_tests::Sshd;

pub fn target(sshd: &Sshd, port: u16, auth: Auth, known_hosts: &Path) -> SshTarget {
    SshTarget {
        host: "127.0.0.1".into(),
        port,
        user: sshd.user().to_string(),
        auth,
        proxy_jump: Vec::new(),
        host_key_policy: HostKeyPolicy::AcceptNew,
        known_hosts: vec![known_hosts.to_path_buf()],
        connect_timeout: Duration::from_secs(10),
    }
}

/// A ProxyJump hop to `sshd` (or whatever listens on `host:port` in front of it).
pub fn hop(sshd: &Sshd, host: &str, port: u16, auth: Auth, known_hosts: &Path) -> Hop {
    Hop {
        host: host.into(),
        port,
        user: sshd.user().to_string(),
        auth,
        host_key_policy: HostKeyPolicy::AcceptNew,
        known_hosts: vec![known_hosts.to_path_buf()],
    }
}

pub fn key_auth(sshd: &Sshd) -> Auth {
    Auth::KeyFile {
        path: sshd.client_key().to_path_buf(),
        passphrase: None,
    }
}

pub fn sandbox(name: &str, t: SshTarget) -> SandboxConfig {
    SandboxConfig {
        name: name.into(),
        transport: Transport::Ssh(t),
        slurm: None,
        sudo: None,
        policy: Default::default(),
        confine: None,
    }
}

/// The seed's defaults, with state under `state`.
pub fn config_of(sandboxes: Vec<SandboxConfig>, state: &Path) -> Config {
    Config {
        sandboxes,
        expose_advanced_tools: false,
        inline_sync_max_files: 200,
        inline_sync_max_bytes: 64 << 20,
        policy: Default::default(),
        state_dir: state.to_path_buf(),
        source: "test".into(),
        warnings: vec![],
    }
}

pub fn pool_of(sandboxes: Vec<SandboxConfig>, state: &Path) -> Arc<Pool> {
    Arc::new(Pool::new(Arc::new(config_of(sandboxes, state))))
}

/// One key-auth sandbox `s` reached on `port` (the fixture's or a chaos proxy's), with every
/// sync inline: a fault must hit the call the test waits on.
pub fn pool_on(sshd: &Sshd, port: u16, state: &Path) -> Arc<Pool> {
    let t = target(sshd, port, key_auth(sshd), &state.join("known_hosts"));
    Arc::new(Pool::new(Arc::new(Config {
        inline_sync_max_files: 100_000,
        inline_sync_max_bytes: 1 << 40,
        policy: Default::default(),
        ..config_of(vec![sandbox("s", t)], state)
    })))
}

/// A pool with one key-auth sandbox named `s` on `sshd`.
pub fn key_pool(sshd: &Sshd, dir: &Path) -> Arc<Pool> {
    let t = target(sshd, sshd.port(), key_auth(sshd), &dir.join("known_hosts"));
    pool_of(vec![sandbox("s", t)], dir)
}

/// [`pool_of`] with the store: what a sync needs (its baseline, a background transfer).
pub fn app_of(sandboxes: Vec<SandboxConfig>, state: &Path) -> Arc<App> {
    App::on(pool_of(sandboxes, state))
}

/// [`pool_on`] with the store.
pub fn app_on(sshd: &Sshd, port: u16, state: &Path) -> Arc<App> {
    App::on(pool_on(sshd, port, state))
}

/// [`key_pool`] with the store.
pub fn key_app(sshd: &Sshd, dir: &Path) -> Arc<App> {
    App::on(key_pool(sshd, dir))
}

pub fn secret(s: &str) -> Secret {
    Secret::new(s)
}

/// Is any process of process group `pgid` alive on this machine (the sshd runs here)?
pub fn group_alive(pgid: i32) -> bool {
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// Deterministic pseudo-random bytes (xorshift64*), fast enough for 200 MiB.
pub fn gen_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut x = seed | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    out
}

/// Deterministic source-code-like text of about `len` bytes: indented lines of identifiers
/// (common ones far more often than rare ones, as in real code), small numbers and
/// punctuation, with some lines repeating a recent one with a word changed, so deflate finds
/// what it finds in real source trees (a ratio of about three), not the runs of a zero file.
pub fn gen_text(seed: u64, len: usize) -> String {
    const WORDS: &[&str] = &[
        "self", "let", "fn", "if", "return", "mut", "data", "len", "the", "value", "match", "else",
        "for", "in", "result", "error", "Ok", "Err", "Some", "None", "pub", "use", "struct",
        "impl", "while", "const", "config", "buffer", "offset", "index", "count", "path", "file",
        "reader", "writer", "session", "request", "reply", "handle", "stream", "chunk", "frame",
        "window", "rate", "queue", "token", "parse", "encode", "decode", "state", "event", "timer",
        "cache", "hash", "entry", "node", "tree", "list", "map", "key", "item", "sum", "max",
        "min", "retry", "deadline", "manifest", "staging",
    ];
    const PUNCT: &[&str] = &[
        "(", ")", " = ", ", ", ";", ".", " {", "}", " -> ", "::", " + ",
    ];
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 16
    };
    // Skewed towards the first words: the product of two uniform draws.
    let word = |r: u64| {
        let a = (r % 64) as usize;
        let b = ((r >> 6) % 64) as usize;
        WORDS[(a * b / 64) % WORDS.len()]
    };
    let mut out = String::with_capacity(len + 128);
    let mut recent: Vec<String> = Vec::new();
    while out.len() < len {
        let r = next();
        let line = if r % 10 < 3 && !recent.is_empty() {
            let old = &recent[(r / 10) as usize % recent.len()];
            old.replacen(word(r >> 20), word(r >> 32), 1)
        } else {
            let mut l = " ".repeat((r % 4) as usize * 4);
            for _ in 0..(3 + next() % 8) {
                let r = next();
                match r % 8 {
                    0 => l.push_str(&format!("{}", r % 1000)),
                    1 | 2 => l.push_str(PUNCT[(r / 8) as usize % PUNCT.len()]),
                    3 => {
                        l.push_str(word(r >> 3));
                        l.push('_');
                        l.push_str(word(r >> 15));
                    }
                    _ => {
                        l.push_str(word(r >> 3));
                        l.push(' ');
                    }
                }
            }
            l
        };
        out.push_str(&line);
        out.push('\n');
        if recent.len() < 32 {
            recent.push(line);
        } else {
            recent[(r >> 40) as usize % 32] = line;
        }
    }
    out
}

/// A key-auth target for `sshd` reached through a fresh chaos proxy, for fault tests.
pub fn proxied_target(sshd: &Sshd, dir: &Path) -> (rsb_tests::ChaosProxy, SshTarget) {
    let proxy = rsb_tests::ChaosProxy::start(sshd.addr()).unwrap();
    let t = target(sshd, proxy.port(), key_auth(sshd), &dir.join("known_hosts"));
    (proxy, t)
}

/// Single-quoted for a POSIX shell (test fixtures only; rsb itself never splices user data).
pub fn shq(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// sha256 of a file on the fixture host, or `none` when it is missing.
pub fn sha256_remote(sshd: &Sshd, path: &str) -> String {
    sshd.ssh_run(&format!("sha256sum {} 2>/dev/null || echo none", shq(path)))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// sha256 of a local file, or `none` when it is missing.
pub fn sha256_local(path: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("none")
        .to_string()
}

/// 2,000 small files (30–300 bytes) in 100 nested directories.
pub fn small_tree(root: &Path) {
    for a in 0..10 {
        for b in 0..10 {
            let d = root.join(format!("d{a}/sub{b}"));
            std::fs::create_dir_all(&d).unwrap();
            for c in 0..20 {
                std::fs::write(
                    d.join(format!("f{c}.txt")),
                    format!("file {a} {b} {c}\n").repeat(1 + c % 20),
                )
                .unwrap();
            }
        }
    }
}

/// Stops the watchdog daemon a test started (the lock in `state` names its pid) when the test
/// ends, pass or fail, waiting (bounded) until the lock is free.
pub struct StopDaemon(pub std::path::PathBuf);

impl Drop for StopDaemon {
    fn drop(&mut self) {
        let Some(pid) = rsb::watchdog::daemon::lock_holder(&self.0) else {
            return;
        };
        // SAFETY: a signal to the daemon this test started (the lock names its pid).
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        let t0 = std::time::Instant::now();
        while rsb::watchdog::daemon::lock_holder(&self.0).is_some()
            && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The audit log under the state dir `state`: every month file oldest first, as text and as
/// parsed lines (none when there is no log yet).
pub fn audit_log(state: &Path) -> (String, Vec<serde_json::Value>) {
    let mut files: Vec<_> = std::fs::read_dir(state.join("audit"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    let text: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect();
    let lines = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("torn line {l:?}: {e}")))
        .collect();
    (text, lines)
}
