//! Resumable large files (issue 10): a sync interrupted in the middle of a large file keeps the
//! staged bytes on the destination, and the next sync of that file sends only the rest — and
//! never trusts kept bytes that no longer match the source.
//!
//! Real parts: the private sshd, the chaos proxy (rate-limited, so the cut lands near the middle
//! of the file), the embedded agents. Needs `cargo build --workspace --bins` (agents embedded).

mod common;

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use common::*;
use rsb::{
    app::App,
    error::Result,
    sync::{CancellationToken, Direction, SyncReport, SyncSpec},
};
use rsb_tests::{ChaosProxy, Sshd};

const MIB: u64 = 1024 * 1024;
const SIZE: u64 = 200 * MIB;

async fn upload(pool: &App, src: &Path, cancel: &CancellationToken) -> Result<SyncReport> {
    let spec = SyncSpec {
        direction: Direction::Upload,
        local_path: src.to_path_buf(),
        remote_path: "up".into(),
        delete_extras: false,
        rules: SyncSpec::rules(vec![]),
        dry_run: false,
    };
    rsb::ops::sync::run(pool, "s", &spec, None, cancel).await
}

/// Start an upload of `src` through `proxy` (rate-limited) and cut the link once about half of
/// the file has gone through; the sync must fail.
async fn cut_at_half(pool: &Arc<App>, proxy: &ChaosProxy, src: &Path) {
    proxy.set_rate_mbit(400);
    pool.pool().client("s").await.expect("connect");
    let before = proxy.bytes_forwarded().0;
    let task = tokio::spawn({
        let pool = pool.clone();
        let src = src.to_path_buf();
        async move { upload(&pool, &src, &CancellationToken::new()).await }
    });
    let t0 = Instant::now();
    while proxy.bytes_forwarded().0 - before < SIZE / 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "half of the upload did not go through in 240 s"
        );
        assert!(!task.is_finished(), "the upload ended before the cut");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.cut();
    let r = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the cut upload fails within 30 s")
        .unwrap();
    assert!(r.is_err(), "the cut upload must fail: {r:?}");
    proxy.reset();
    proxy.set_rate(None);
}

/// Wait (bounded) until no agent holds a staging directory of `~/up` any more: the agent of the
/// cut link has ended (it keeps its large staged files itself, or the next session does).
fn wait_released(sshd: &Sshd) {
    let up = sshd.home().join("up");
    let t0 = Instant::now();
    loop {
        let held = std::fs::read_dir(&up)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                let lock = e.path().join("lock");
                lock.exists()
                    && !std::process::Command::new("flock")
                        .args(["-n", "-E", "99"])
                        .arg(&lock)
                        .arg("true")
                        .status()
                        .is_ok_and(|s| s.success())
            });
        if !held {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the cut link's agent still holds its staging after 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What the agent kept in `~/up/.rsb-sync-staging-partial`, once it appears (bounded wait).
fn wait_kept(sshd: &Sshd) -> u64 {
    let dir = sshd.home().join("up/.rsb-sync-staging-partial");
    let t0 = Instant::now();
    loop {
        let kept: u64 = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        if kept > 0 || t0.elapsed() > Duration::from_secs(20) {
            return kept;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_upload_resumes_from_kept_bytes() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("big.bin");
    std::fs::write(&file, gen_bytes(21, SIZE as usize)).unwrap();
    let pool = app_on(&sshd, proxy.port(), &dir.path().join("state"));

    cut_at_half(&pool, &proxy, &src).await;
    wait_released(&sshd);
    // Nothing partial is visible.
    assert_eq!(sha256_remote(&sshd, "up/big.bin"), "none");

    let r = upload(&pool, &src, &CancellationToken::new())
        .await
        .expect("the second sync");
    let sent = r.bytes_sent;
    eprintln!("second sync sent {} MiB of {}", sent / MIB, SIZE / MIB);
    assert!(
        sent <= SIZE * 6 / 10,
        "the second sync sent {sent} bytes of {SIZE}: the kept bytes were not reused"
    );
    assert_eq!(
        sha256_remote(&sshd, &format!("{}/up/big.bin", sshd.home().display())),
        sha256_local(&file)
    );
    // Used up: nothing stays kept after the file is complete.
    assert!(!sshd.home().join("up/.rsb-sync-staging-partial").exists());
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_source_never_reuses_stale_kept_bytes() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("big.bin");
    let mut data = gen_bytes(22, SIZE as usize);
    std::fs::write(&file, &data).unwrap();
    let pool = app_on(&sshd, proxy.port(), &dir.path().join("state"));

    cut_at_half(&pool, &proxy, &src).await;
    wait_released(&sshd);
    // Change bytes inside the kept prefix (start and middle of it), and the length.
    data[..4096].fill(0xAB);
    let mid = (20 * MIB) as usize;
    data[mid..mid + 100_000].fill(0xCD);
    data.truncate((SIZE - 3 * MIB + 17) as usize);
    std::fs::write(&file, &data).unwrap();

    let r = upload(&pool, &src, &CancellationToken::new())
        .await
        .expect("the second sync");
    let sent = r.bytes_sent;
    eprintln!("second sync sent {} MiB", sent / MIB);
    assert_eq!(
        sha256_remote(&sshd, &format!("{}/up/big.bin", sshd.home().display())),
        sha256_local(&file),
        "the result must be the changed source, exactly"
    );
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_says_what_was_kept() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    proxy.set_rate_mbit(200);
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("big.bin");
    std::fs::write(&file, gen_bytes(23, (64 * MIB) as usize)).unwrap();
    let pool = app_on(&sshd, proxy.port(), &dir.path().join("state"));
    pool.pool().client("s").await.expect("connect");
    let cancel = CancellationToken::new();
    let before = proxy.bytes_forwarded().0;
    let task = tokio::spawn({
        let pool = pool.clone();
        let src = src.clone();
        let cancel = cancel.clone();
        async move { upload(&pool, &src, &cancel).await }
    });
    let t0 = Instant::now();
    while proxy.bytes_forwarded().0 - before < 32 * MIB {
        assert!(t0.elapsed() < Duration::from_secs(120), "upload too slow");
        assert!(!task.is_finished(), "the upload ended before the cancel");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cancel.cancel();
    let e = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("cancelled within 10 s")
        .unwrap()
        .expect_err("a cancelled sync fails");
    eprintln!("{}", e.message);
    assert!(
        e.message.starts_with("sync cancelled; kept ")
            && e.message
                .ends_with(" MiB of big.bin staged; the next sync resumes it"),
        "{e:?}"
    );
    let kept = wait_kept(&sshd);
    let said: u64 = e
        .message
        .trim_start_matches("sync cancelled; kept ")
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        said >= 8 && said * MIB <= kept,
        "said {said} MiB, kept {kept} bytes"
    );
    pool.shutdown().await;
}

/// An upload of `src/big.bin` (written with `first`) through a proxy at `mbit`, started on a
/// warm connection and followed until `after` bytes went through: the moment to change the
/// source under it. Returns the running upload and the rest of the fixture.
struct MidUpload {
    task: tokio::task::JoinHandle<Result<SyncReport>>,
    file: std::path::PathBuf,
    sshd: Sshd,
    proxy: ChaosProxy,
    pool: Arc<App>,
    _dir: tempfile::TempDir,
}

async fn upload_until(first: &[u8], mbit: u64, after: u64) -> MidUpload {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("big.bin");
    std::fs::write(&file, first).unwrap();
    let pool = app_on(&sshd, proxy.port(), &dir.path().join("state"));
    pool.pool().client("s").await.expect("connect");
    proxy.set_rate_mbit(mbit);
    let before = proxy.bytes_forwarded().0;
    let task = tokio::spawn({
        let pool = pool.clone();
        async move { upload(&pool, &src, &CancellationToken::new()).await }
    });
    let t0 = Instant::now();
    while proxy.bytes_forwarded().0 - before < after {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "{after} bytes of the upload did not go through in 120 s"
        );
        assert!(!task.is_finished(), "the upload ended before the change");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    MidUpload {
        task,
        file,
        sshd,
        proxy,
        pool,
        _dir: dir,
    }
}

/// Issue 21 defect 2: a large file rewritten in place while it was being read was committed as
/// a mix of versions (v1 up to 29 MiB, v2 after), and the sync said it succeeded. Now a file
/// whose bytes do not hash as its scan did is sent again against a fresh one-pass hash, so
/// what is committed is one version, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_rewritten_mid_read_is_never_committed_torn() {
    const LEN: usize = 48 * MIB as usize;
    let v2 = gen_bytes(32, LEN);
    let MidUpload {
        task,
        file,
        sshd,
        proxy,
        pool,
        _dir,
    } = upload_until(&gen_bytes(31, LEN), 200, 12 * MIB).await;
    // In place, as a program that rewrites its output file does (same inode, no truncate).
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        f.write_all(&v2).unwrap();
    }
    proxy.set_rate(None);
    let r = tokio::time::timeout(Duration::from_secs(120), task)
        .await
        .expect("the upload ends within 120 s")
        .unwrap()
        .expect("the upload succeeds once the file is quiet");
    eprintln!(
        "sent {} MiB for a {} MiB file; errors {:?}",
        r.bytes_sent / MIB,
        LEN as u64 / MIB,
        r.errors
    );
    assert_eq!(
        sha256_remote(&sshd, &format!("{}/up/big.bin", sshd.home().display())),
        sha256_local(&file),
        "the destination must hold the source's current version, whole"
    );
    assert!(r.errors.is_empty() && r.unsettled == 0, "{:?}", r.errors);
    assert!(
        r.bytes_sent > LEN as u64,
        "it was sent again: {}",
        r.bytes_sent
    );
    pool.shutdown().await;
}

/// The other end of defect 2: a file that never stops changing while it is sent is not
/// committed at all (the destination keeps what it had), and the report says so, so that
/// `rsb sync` exits 6 (the destination does not match) instead of 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_keeps_changing_is_reported_not_committed() {
    const LEN: usize = 24 * MIB as usize;
    let versions = [gen_bytes(41, LEN), gen_bytes(42, LEN)];
    let MidUpload {
        task,
        file,
        sshd,
        pool,
        proxy: _proxy,
        _dir,
    } = upload_until(&versions[0], 100, 4 * MIB).await;
    // Rewrite in place, alternating versions, until the sync ends (at most 120 s).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = std::thread::spawn({
        let stop = stop.clone();
        let file = file.clone();
        move || {
            use std::io::{Seek, Write};
            let t0 = Instant::now();
            let mut f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
            let mut i = 1;
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && t0.elapsed() < Duration::from_secs(120)
            {
                f.rewind().unwrap();
                f.write_all(&versions[i % 2]).unwrap();
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    });
    let r = tokio::time::timeout(Duration::from_secs(150), task)
        .await
        .expect("the upload ends within 150 s")
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    let r = r.expect("the sync itself finishes");
    eprintln!("errors {:?}, sent {} MiB", r.errors, r.bytes_sent / MIB);
    assert_eq!(r.unsettled, 1, "{:?}", r.errors);
    assert!(
        r.errors
            .iter()
            .any(|e| e.contains("big.bin: changed while it was being sent")),
        "{:?}",
        r.errors
    );
    assert_eq!(r.files_transferred, 0);
    // Nothing torn, nothing half-written: the first sync of it committed nothing.
    assert_eq!(
        sha256_remote(&sshd, &format!("{}/up/big.bin", sshd.home().display())),
        "none"
    );
    pool.shutdown().await;
}

/// Issue 21: the same for a small file (≤ 1 MiB, sent whole in one read). Its bytes were
/// committed as read, and a read that overlapped a rewrite in place (a page-by-page copy that
/// the kernel does not lock against writers) committed a mix of two versions. Now the source
/// agent reads it as one version (identity unchanged across a read that began after its last
/// change), or answers that it kept changing, and then nothing is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_file_rewritten_during_its_read_is_never_committed_torn() {
    const LEN: usize = (1 << 20) - 4096;
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("hot.bin");
    std::fs::write(&file, vec![b'a'; LEN]).unwrap();
    let pool = app_on(&sshd, sshd.port(), &dir.path().join("state"));
    let r = upload(&pool, &src, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.files_transferred, 1);
    let remote = sshd.home().join("up/hot.bin");
    // Rewritten in place, one write of the whole file at a time, alternating two versions,
    // with a pause between writes so the scan can hash it (bounded: 60 s).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = std::thread::spawn({
        let (stop, file) = (stop.clone(), file.clone());
        move || {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
            let versions = [vec![b'b'; LEN], vec![b'a'; LEN]];
            let t0 = Instant::now();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && t0.elapsed() < Duration::from_secs(60)
            {
                f.write_all_at(&versions[i % 2], 0).unwrap();
                i += 1;
                std::thread::sleep(Duration::from_micros(150));
            }
            i
        }
    });
    let (mut committed, mut unsettled, mut torn) = (0, 0, 0);
    let t0 = Instant::now();
    for _ in 0..40 {
        if t0.elapsed() > Duration::from_secs(30) {
            break;
        }
        let Ok(r) = upload(&pool, &src, &CancellationToken::new()).await else {
            continue;
        };
        committed += r.files_transferred;
        unsettled += r.unsettled;
        let got = std::fs::read(&remote).unwrap();
        if got.len() != LEN || got.iter().any(|&c| c != got[0]) {
            torn += 1;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = writer.join().unwrap();
    eprintln!("{writes} rewrites; {committed} commits, {unsettled} unsettled, {torn} torn");
    assert_eq!(torn, 0, "a mix of versions was committed");
    assert!(committed + unsettled > 0, "the file was never sent");
    // Quiet now: it is committed, exactly.
    let r = upload(&pool, &src, &CancellationToken::new())
        .await
        .unwrap();
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(
        std::fs::read(&remote).unwrap() == std::fs::read(&file).unwrap(),
        "the quiet file did not arrive: {}",
        r.to_json()
    );
    pool.shutdown().await;
}
