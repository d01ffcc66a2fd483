//! Compression on slow links (issue 10): through a wide-area link (the chaos proxy at 20 ms
//! round trip and 50 Mbit/s) a compressible tree crosses in clearly fewer bytes than it holds,
//! incompressible files still arrive exact, and on loopback `auto` leaves compression off.
//!
//! Real parts: the private sshd, the chaos proxy, the embedded agents. Needs
//! `cargo build --workspace --bins` (agents embedded).

mod common;

use std::{path::Path, time::Duration};

use common::*;
use rsb::{
    app::App,
    sync::{CancellationToken, Direction, SyncReport, SyncSpec},
};
use rsb_tests::{ChaosProxy, Sshd};

async fn sync(pool: &App, dir: Direction, local: &Path, remote: &str) -> SyncReport {
    let spec = SyncSpec {
        direction: dir,
        local_path: local.to_path_buf(),
        remote_path: remote.into(),
        delete_extras: false,
        rules: SyncSpec::rules(vec![]),
        dry_run: false,
    };
    let cancel = CancellationToken::new();
    let run = rsb::ops::sync::run(pool, "s", &spec, None, &cancel);
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the sync finishes within 120 s")
        .expect("sync")
}

/// Text (small files and one large one, which travels in chunks) and random bytes (a small
/// file and a large one): about 9 MB, 1.5 MB of it incompressible.
fn tree(root: &Path) -> u64 {
    let mut total = 0;
    let mut put = |rel: &str, data: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
        total += data.len() as u64;
    };
    for i in 0..60u64 {
        put(
            &format!("src/d{}/f{i}.rs", i % 6),
            gen_text(i + 1, 80_000).as_bytes(),
        );
    }
    put("logs/big.log", gen_text(99, 3 << 20).as_bytes());
    put("blob/small.bin", &gen_bytes(7, 300_000));
    put("blob/large.bin", &gen_bytes(8, 1_200_000));
    put("empty.txt", b"");
    total
}

/// `sha256sum` of every file under `dir` on the fixture host, sorted by path.
fn remote_sums(sshd: &Sshd, dir: &str) -> String {
    sshd.ssh_run(&format!(
        "cd {} && find . -type f | LC_ALL=C sort | xargs sha256sum",
        shq(dir)
    ))
    .unwrap()
}

fn local_sums(dir: &Path) -> String {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("find . -type f | LC_ALL=C sort | xargs sha256sum")
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_link_sends_compressed_and_everything_arrives_exact() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    proxy.set_latency(Duration::from_millis(10));
    proxy.set_rate_mbit(50);
    let src = dir.path().join("src");
    let raw = tree(&src);
    let pool = app_on(&sshd, proxy.port(), &dir.path().join("state"));
    pool.pool().client("s").await.expect("connect");

    let before = proxy.bytes_forwarded().0;
    let r = sync(&pool, Direction::Upload, &src, "up").await;
    let crossed = proxy.bytes_forwarded().0 - before;
    eprintln!(
        "upload: {raw} bytes, {crossed} crossed the link, report {} sent / {:?} on the wire",
        r.bytes_sent, r.bytes_wire
    );
    assert_eq!(r.bytes_sent, raw);
    let wire = r.bytes_wire.expect("compression on for a 20 ms link");
    assert!(wire < raw * 6 / 10, "{wire} of {raw} bytes on the wire");
    assert!(
        crossed < raw * 6 / 10,
        "{crossed} bytes crossed the link for {raw} bytes of files"
    );
    let home = sshd.home().display().to_string();
    let up = format!("{home}/up");
    assert_eq!(remote_sums(&sshd, &up), local_sums(&src));

    // Nothing changed: the manifest of the far sandbox comes back compressed (its last
    // transfer found the link far) and still plans nothing.
    let r = sync(&pool, Direction::Upload, &src, "up").await;
    assert_eq!((r.files_transferred, r.bytes_sent), (0, 0), "{r:?}");

    // Back down through the same link, exact (the source manifest compressed).
    let down = dir.path().join("down");
    let before = proxy.bytes_forwarded().1;
    let r = sync(&pool, Direction::Download, &down, "up").await;
    let crossed = proxy.bytes_forwarded().1 - before;
    eprintln!(
        "download: {crossed} bytes crossed the link, report {:?} on the wire",
        r.bytes_wire
    );
    assert_eq!(r.bytes_sent, raw);
    assert_eq!(local_sums(&down), local_sums(&src));
    if let Some(wire) = r.bytes_wire {
        assert!(
            crossed < raw * 6 / 10,
            "download: {crossed} bytes crossed the link for {raw} bytes ({wire} reported)"
        );
    }
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_leaves_compression_off() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let raw = tree(&src);
    let pool = key_app(&sshd, dir.path());
    let r = sync(&pool, Direction::Upload, &src, "up").await;
    assert_eq!(r.bytes_sent, raw);
    assert_eq!(r.bytes_wire, None, "auto compressed on loopback");
    let up = format!("{}/up", sshd.home().display());
    assert_eq!(remote_sums(&sshd, &up), local_sums(&src));
    let down = dir.path().join("down");
    let r = sync(&pool, Direction::Download, &down, "up").await;
    assert_eq!(r.bytes_wire, None, "auto compressed on loopback");
    assert_eq!(local_sums(&down), local_sums(&src));
    pool.shutdown().await;
}
