//! Sync acceptance tests (issue 5) against a real private sshd: exact trees both ways
//! (checked independently with plain `ssh` + `find`/`sha256sum`), incremental resyncs, block
//! deltas, a connection cut mid-transfer, a cancelled background transfer, delete_extras and
//! its guard, single-file targets.
//!
//! Needs the embedded agents (`scripts/build-agents.sh`) and `cargo build -p rsb-agent` (the
//! local end of a sync is `target/debug/rsb-agent`).

mod common;

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use common::*;
use rsb::{
    app::App,
    config::{Config, SandboxConfig},
    ops::sync::{self as ops, SyncArgs},
    sync::{CancellationToken, Direction, SyncReport, SyncSpec},
};
use rsb_tests::{ChaosProxy, Sshd};

const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Trees and checks
// ---------------------------------------------------------------------------------------------

fn write(p: &Path, data: &[u8]) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// 2,000 small files in nested dirs, plus everything awkward: exec bits, symlinks (file, dir,
/// dangling), a FIFO, nested node_modules and .git, unicode and space names, an empty dir.
fn make_tree(root: &Path) {
    for a in 0..10 {
        for b in 0..10 {
            for c in 0..20 {
                let p = root.join(format!("d{a}/sub {b}/f{c}.txt"));
                write(
                    &p,
                    format!("file {a} {b} {c}\n").repeat(1 + (c % 7)).as_bytes(),
                );
            }
        }
    }
    write(&root.join("run.sh"), b"#!/bin/sh\necho hi\n");
    chmod(&root.join("run.sh"), 0o755);
    write(&root.join("d0/tool"), b"binary-ish \x00\x01\x02");
    chmod(&root.join("d0/tool"), 0o750);
    write(
        &root.join("ünï cødé/naïve file.txt"),
        "héllo wörld\n".as_bytes(),
    );
    write(&root.join("with space/a b c.md"), b"spaces\n");
    std::os::unix::fs::symlink("run.sh", root.join("link_to_file")).unwrap();
    std::os::unix::fs::symlink("d1", root.join("link_to_dir")).unwrap();
    std::os::unix::fs::symlink("does/not/exist", root.join("dangling")).unwrap();
    std::fs::create_dir_all(root.join("emptydir")).unwrap();
    write(&root.join(".git/HEAD"), b"ref: refs/heads/main\n");
    write(
        &root.join("web/node_modules/pkg/m.js"),
        b"module.exports = 1\n",
    );
    write(&root.join("d2/node_modules/x/y.js"), b"y\n");
    write(&root.join("d3/.git/config"), b"[core]\n");
    write(&root.join("pkg/__pycache__/m.pyc"), b"\x00pyc");
    write(&root.join("pkg/m.py"), b"print(1)\n");
    let fifo = std::ffi::CString::new(root.join("a_fifo").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
}

/// `find` listing (type, mode, path, link target) plus sha256 of every file, excluding what
/// the default rules exclude and special files. Runs `script` in `dir` via `run`.
const LISTING: &str = r#"find . -mindepth 1 \( -name .git -o -name node_modules -o -name __pycache__ -o -name '*.pyc' -o -name '.rsb-sync-staging-*' -o -type p \) -prune -o -printf '%y %m %p %l\n' | LC_ALL=C sort; find . \( -name .git -o -name node_modules -o -name __pycache__ -o -name '.rsb-sync-staging-*' \) -prune -o -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum"#;

fn local_listing(dir: &Path) -> String {
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("cd {} && {LISTING}", shq(dir.to_str().unwrap())))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn remote_listing(sshd: &Sshd, dir: &str) -> String {
    sshd.ssh_run(&format!("cd {} && {LISTING}", shq(dir)))
        .unwrap()
}

fn assert_same(what: &str, a: &str, b: &str) {
    if a != b {
        let al: Vec<&str> = a.lines().collect();
        let bl: Vec<&str> = b.lines().collect();
        let only_a: Vec<&&str> = al.iter().filter(|l| !bl.contains(l)).take(10).collect();
        let only_b: Vec<&&str> = bl.iter().filter(|l| !al.contains(l)).take(10).collect();
        panic!(
            "{what}: trees differ\n only in source: {only_a:#?}\n only in destination: {only_b:#?}"
        );
    }
}

fn staging_left(sshd: &Sshd, dir: &str) -> String {
    sshd.ssh_run(&format!(
        "find {} -maxdepth 2 -name '.rsb-sync-staging-*' 2>/dev/null; true",
        shq(dir)
    ))
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Driving the engine
// ---------------------------------------------------------------------------------------------

fn spec(dir: Direction, local: &Path, remote: &str, delete: bool, lines: &[&str]) -> SyncSpec {
    SyncSpec {
        direction: dir,
        local_path: local.to_path_buf(),
        remote_path: remote.to_string(),
        delete_extras: delete,
        rules: SyncSpec::rules(lines.iter().map(|s| s.to_string()).collect()),
        dry_run: false,
    }
}

async fn sync(pool: &App, s: &SyncSpec) -> rsb::error::Result<SyncReport> {
    let r = ops::run(pool, "s", s, None, &CancellationToken::new()).await;
    if let Ok(r) = &r {
        println!(
            "{:?} {} -> {}: {}",
            s.direction,
            s.local_path.display(),
            s.remote_path,
            r.to_json()
        );
    }
    r
}

/// Run a sync through `proxy` and cut the link once `after` bytes were acknowledged; the sync
/// must fail.
async fn sync_and_cut(pool: &Arc<App>, s: &SyncSpec, proxy: &ChaosProxy, after: u64) -> String {
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let d2 = done.clone();
    let cb: rsb::sync::ProgressFn = Arc::new(move |p: &rsb::sync::Progress| {
        d2.store(p.bytes_done, std::sync::atomic::Ordering::Relaxed);
    });
    let run = {
        let pool = pool.clone();
        let s = s.clone();
        tokio::spawn(
            async move { ops::run(&pool, "s", &s, Some(cb), &CancellationToken::new()).await },
        )
    };
    let t0 = Instant::now();
    while done.load(std::sync::atomic::Ordering::Relaxed) < after {
        if run.is_finished() {
            let r = run.await.unwrap();
            panic!(
                "the sync ended before the cut, at {} bytes: {:?}",
                done.load(std::sync::atomic::Ordering::Relaxed),
                r.map(|r| r.to_json())
            );
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.cut();
    let e = run.await.unwrap().unwrap_err();
    e.message
}

fn pool_with(sshd: &Sshd, port: u16, state: &Path, max_files: u64, max_bytes: u64) -> Arc<App> {
    let t = target(sshd, port, key_auth(sshd), &state.join("known_hosts"));
    let sandboxes: Vec<SandboxConfig> = vec![sandbox("s", t)];
    App::new(Arc::new(Config {
        sandboxes,
        expose_advanced_tools: false,
        inline_sync_max_files: max_files,
        inline_sync_max_bytes: max_bytes,
        policy: Default::default(),
        state_dir: state.to_path_buf(),
        source: "test".into(),
        warnings: vec![],
    }))
}

fn remote(sshd: &Sshd, rel: &str) -> PathBuf {
    sshd.home().join(rel)
}

// ---------------------------------------------------------------------------------------------
// Upload
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_tree_exact_incremental_deletes_and_conflicts() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    make_tree(&src);
    let pool = pool_with(&sshd, sshd.port(), tmp.path(), 200, 64 * MIB);
    let dst = remote(&sshd, "dst");
    let dst_s = dst.to_str().unwrap().to_string();

    // First sync: everything, exactly.
    let t0 = Instant::now();
    let r = sync(&pool, &spec(Direction::Upload, &src, "dst", false, &[]))
        .await
        .unwrap();
    println!("first upload of 2,000+ files: {:?}", t0.elapsed());
    assert_eq!(r.synced_type, "directory");
    assert!(r.files_transferred >= 2000 + 8, "{}", r.to_json());
    assert_eq!(r.skipped_special, 1, "the FIFO is skipped and counted");
    assert_same(
        "first upload",
        &local_listing(&src),
        &remote_listing(&sshd, &dst_s),
    );
    let l = remote_listing(&sshd, &dst_s);
    assert!(l.contains("f 755 ./run.sh"), "exec bit kept");
    assert!(l.contains("f 750 ./d0/tool"));
    assert!(
        l.contains("l 777 ./dangling does/not/exist"),
        "dangling symlink kept as a symlink"
    );
    assert!(l.contains("l 777 ./link_to_dir d1"));
    assert!(!dst.join(".git").exists() && !dst.join("web/node_modules").exists());
    assert!(
        !dst.join("d2/node_modules").exists(),
        "nested node_modules excluded"
    );
    assert!(!dst.join("d3/.git").exists(), "nested .git excluded");
    assert!(!dst.join("pkg/__pycache__").exists() && dst.join("pkg/m.py").exists());
    assert!(staging_left(&sshd, &dst_s).is_empty());

    // No change: nothing moves.
    let t0 = Instant::now();
    let r = sync(&pool, &spec(Direction::Upload, &src, "dst", false, &[]))
        .await
        .unwrap();
    println!("no-change resync: {:?}", t0.elapsed());
    assert_eq!(
        (r.files_transferred, r.bytes_sent, r.dirs_created),
        (0, 0, 0),
        "{}",
        r.to_json()
    );
    assert!(r.skipped_files >= 2000);

    // One modified file: one file moves.
    write(&src.join("d4/sub 4/f4.txt"), b"changed content\n");
    let r = sync(&pool, &spec(Direction::Upload, &src, "dst", false, &[]))
        .await
        .unwrap();
    assert_eq!(r.files_transferred, 1, "{}", r.to_json());
    assert_eq!(r.bytes_sent, 16);
    // A mode change alone: attributes only.
    chmod(&src.join("d5/sub 5/f5.txt"), 0o600);
    let r = sync(&pool, &spec(Direction::Upload, &src, "dst", false, &[]))
        .await
        .unwrap();
    assert_eq!(
        (r.files_transferred, r.attrs_updated, r.bytes_sent),
        (0, 1, 0),
        "{}",
        r.to_json()
    );
    assert_same(
        "incremental",
        &local_listing(&src),
        &remote_listing(&sshd, &dst_s),
    );

    // delete_extras: extras go, excluded remote files stay (even inside an extra dir).
    write(&dst.join("old/stale.txt"), b"stale");
    write(&dst.join("old/deep/x"), b"x");
    write(&dst.join("keep.log"), b"log");
    write(&dst.join("gone/keep2.log"), b"log");
    write(&dst.join("extra.txt"), b"e");
    let r = sync(
        &pool,
        &spec(Direction::Upload, &src, "dst", true, &["*.log"]),
    )
    .await
    .unwrap();
    assert_eq!(r.deleted_files, 3, "{}", r.to_json());
    assert!(dst.join("keep.log").exists(), "excluded file kept");
    assert!(
        dst.join("gone/keep2.log").exists(),
        "excluded file inside an extra dir kept"
    );
    assert!(!dst.join("old").exists() && !dst.join("extra.txt").exists());
    let json = r.to_json();
    for k in [
        "mode",
        "local_path",
        "remote_path",
        "synced_type",
        "uploaded_dirs",
        "uploaded_files",
        "skipped_files",
        "deleted_dirs",
        "deleted_files",
        "delete_extras",
        "duration_s",
    ] {
        assert!(json.get(k).is_some(), "seed key {k} missing: {json}");
    }
    std::fs::remove_dir_all(dst.join("gone")).unwrap();
    std::fs::remove_file(dst.join("keep.log")).unwrap();
    assert_same(
        "delete_extras",
        &local_listing(&src),
        &remote_listing(&sshd, &dst_s),
    );

    // Mass-delete guard: an empty source would delete every destination file.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = sync(&pool, &spec(Direction::Upload, &empty, "dst", true, &[]))
        .await
        .unwrap_err();
    assert!(
        e.message.contains("would delete every file"),
        "{}",
        e.message
    );
    assert_same(
        "guard changed nothing",
        &local_listing(&src),
        &remote_listing(&sshd, &dst_s),
    );

    // Type conflict: reported before anything changes.
    std::fs::remove_file(dst.join("run.sh")).unwrap();
    std::fs::create_dir_all(dst.join("run.sh")).unwrap();
    write(&src.join("new-before-conflict.txt"), b"n");
    let e = sync(&pool, &spec(Direction::Upload, &src, "dst", false, &[]))
        .await
        .unwrap_err();
    assert!(
        e.message
            .contains("run.sh is a directory on the destination but a file on the source"),
        "{}",
        e.message
    );
    assert!(
        !dst.join("new-before-conflict.txt").exists(),
        "nothing changed"
    );
    pool.shutdown().await;
}

/// A no-change resync names the manifests it holds and the agents send none back; a change
/// behind rsb's back (same size, mtime put back) still reaches the next sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_manifest_never_hides_a_change() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pool = pool_with(&sshd, sshd.port(), tmp.path(), 200, 64 * MIB);
    let src = tmp.path().join("src");
    for i in 0..50 {
        write(
            &src.join(format!("d{}/f{i}.txt", i % 5)),
            format!("file {i}\n").as_bytes(),
        );
    }
    let up = spec(Direction::Upload, &src, "held", false, &[]);
    let r = sync(&pool, &up).await.unwrap();
    assert_eq!(r.files_transferred, 50);
    // The first resync learns both trees as they are now; the next one is answered by digest.
    sync(&pool, &up).await.unwrap();
    let r = sync(&pool, &up).await.unwrap();
    assert_eq!((r.files_transferred, r.skipped_files), (0, 50));
    assert_eq!(r.manifests_unchanged, (true, true));

    // Someone edits a remote file in place and puts its mtime back.
    let f = remote(&sshd, "held/d3/f3.txt");
    let mtime = std::fs::metadata(&f).unwrap().modified().unwrap();
    std::fs::write(&f, "FILE 3\n").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let down = tmp.path().join("down");
    let r = sync(&pool, &spec(Direction::Download, &down, "held", false, &[]))
        .await
        .unwrap();
    assert!(!r.manifests_unchanged.0, "the remote tree changed: {r:?}");
    assert_eq!(
        std::fs::read_to_string(down.join("d3/f3.txt")).unwrap(),
        "FILE 3\n"
    );
    // And the upload sees it as a change on the destination since its last sync (the held
    // manifest is the download's, which already had it).
    let r = sync(&pool, &up).await.unwrap();
    assert_eq!(r.conflicts.len(), 1, "{r:?}");
    assert_eq!(
        std::fs::read_to_string(&f).unwrap(),
        "FILE 3\n",
        "kept as it is"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_file_targets() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pool = pool_with(&sshd, sshd.port(), tmp.path(), 200, 64 * MIB);
    let a = tmp.path().join("a.txt");
    write(&a, b"alpha\n");
    chmod(&a, 0o751);
    std::fs::create_dir_all(remote(&sshd, "existing")).unwrap();

    let up = |r: &str| spec(Direction::Upload, &a, r, false, &[]);
    let r = sync(&pool, &up("existing")).await.unwrap();
    assert_eq!((r.synced_type, r.files_transferred), ("file", 1));
    assert_eq!(
        std::fs::read(remote(&sshd, "existing/a.txt")).unwrap(),
        b"alpha\n"
    );
    let mode = std::fs::metadata(remote(&sshd, "existing/a.txt"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o751);
    // The seed's bug: a missing `newdir/` became a file named newdir.
    sync(&pool, &up("newdir/")).await.unwrap();
    assert!(remote(&sshd, "newdir").is_dir());
    assert_eq!(
        std::fs::read(remote(&sshd, "newdir/a.txt")).unwrap(),
        b"alpha\n"
    );
    sync(&pool, &up("exact/b.txt")).await.unwrap();
    assert_eq!(
        std::fs::read(remote(&sshd, "exact/b.txt")).unwrap(),
        b"alpha\n"
    );
    sync(&pool, &up("~/tilde.txt")).await.unwrap();
    assert!(remote(&sshd, "tilde.txt").is_file());
    // Unchanged: skipped.
    let r = sync(&pool, &up("existing")).await.unwrap();
    assert_eq!(
        (r.files_transferred, r.skipped_files, r.bytes_sent),
        (0, 1, 0)
    );
    // Excluded single file.
    let env = tmp.path().join(".env");
    write(&env, b"SECRET=1");
    let r = sync(
        &pool,
        &spec(Direction::Upload, &env, "existing", false, &[".env"]),
    )
    .await
    .unwrap();
    assert_eq!((r.skipped_files, r.files_transferred), (1, 0));
    assert!(!remote(&sshd, "existing/.env").exists());
    // delete_extras with a file: the seed's error (from the tool layer).
    let e = ops::sync_local_to_remote(
        &pool,
        SyncArgs {
            local_path: a.display().to_string(),
            remote_path: "existing".into(),
            delete_extras: true,
            ..Default::default()
        },
        None,
        &CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        e.message,
        "delete_extras is only supported when local_path is a directory"
    );
    let e = ops::sync_local_to_remote(
        &pool,
        SyncArgs {
            local_path: tmp.path().join("nope").display().to_string(),
            remote_path: ".".into(),
            ..Default::default()
        },
        None,
        &CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        e.message,
        format!(
            "local_path does not exist: {}",
            tmp.path().join("nope").display()
        )
    );

    // Downloads: into an existing dir, into `out/` (missing), to an exact name.
    let down = |l: &Path, r: &str| spec(Direction::Download, l, r, false, &[]);
    let out_dir = tmp.path().join("dl");
    std::fs::create_dir_all(&out_dir).unwrap();
    sync(&pool, &down(&out_dir, "existing/a.txt"))
        .await
        .unwrap();
    assert_eq!(std::fs::read(out_dir.join("a.txt")).unwrap(), b"alpha\n");
    let mut slash = tmp.path().join("out").into_os_string();
    slash.push("/");
    let r = sync(&pool, &down(Path::new(&slash), "existing/a.txt"))
        .await
        .unwrap();
    assert_eq!(r.files_transferred, 1);
    assert_eq!(
        std::fs::read(tmp.path().join("out/a.txt")).unwrap(),
        b"alpha\n"
    );
    sync(
        &pool,
        &down(&tmp.path().join("named.txt"), "existing/a.txt"),
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(tmp.path().join("named.txt")).unwrap(),
        b"alpha\n"
    );
    let e = sync(&pool, &down(&out_dir, "missing.txt"))
        .await
        .unwrap_err();
    assert!(
        e.message
            .contains("remote_path does not exist: missing.txt"),
        "{}",
        e.message
    );
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Download
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_tree_exact_incremental_and_tilde() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pool = pool_with(&sshd, sshd.port(), tmp.path(), 200, 64 * MIB);
    // The "remote" tree lives in the fixture's home (same machine).
    let rsrc = remote(&sshd, "proj");
    make_tree(&rsrc);
    let rsrc_s = rsrc.to_str().unwrap().to_string();

    let local = tmp.path().join("mirror");
    let t0 = Instant::now();
    let r = sync(
        &pool,
        &spec(Direction::Download, &local, "proj", false, &[]),
    )
    .await
    .unwrap();
    println!("download of 2,000+ files: {:?}", t0.elapsed());
    assert!(r.files_transferred >= 2008);
    let json = r.to_json();
    for k in [
        "remote_path",
        "local_path",
        "synced_type",
        "created_dirs",
        "downloaded_files",
        "skipped_files",
        "duration_s",
    ] {
        assert!(json.get(k).is_some(), "seed key {k} missing: {json}");
    }
    assert_same(
        "download",
        &remote_listing(&sshd, &rsrc_s),
        &local_listing(&local),
    );
    let r = sync(
        &pool,
        &spec(Direction::Download, &local, "proj", false, &[]),
    )
    .await
    .unwrap();
    assert_eq!(
        (r.files_transferred, r.bytes_sent),
        (0, 0),
        "{}",
        r.to_json()
    );
    write(&rsrc.join("d9/sub 9/f9.txt"), b"remote change\n");
    let r = sync(
        &pool,
        &spec(Direction::Download, &local, "proj", false, &[]),
    )
    .await
    .unwrap();
    assert_eq!(r.files_transferred, 1);
    assert_same(
        "download resync",
        &remote_listing(&sshd, &rsrc_s),
        &local_listing(&local),
    );

    // `~` in the local path is expanded locally (the seed created ./~/...).
    let home = PathBuf::from(std::env::var("HOME").unwrap());
    let name = format!("rsb-sync-test-{}", std::process::id());
    let v = ops::sync_remote_to_local(
        &pool,
        SyncArgs {
            local_path: format!("~/{name}"),
            remote_path: "proj/d1".into(),
            sandbox: "s".into(),
            ..Default::default()
        },
        None,
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    let target = home.join(&name);
    let ok = target.join("sub 0/f0.txt").is_file();
    let _ = std::fs::remove_dir_all(&target);
    assert!(ok, "~ expanded to {}: {v}", target.display());
    assert_eq!(v["downloaded_files"], 200);
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Large files: first upload, no-change, 1 MiB delta, a cut mid-transfer
// ---------------------------------------------------------------------------------------------

/// A run cut after it committed a file saves the baseline of what it did commit: a local
/// edit after the cut is an edit, not a conflict, and the sandbox gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_run_saves_the_baseline_of_what_it_committed() {
    let sshd = Sshd::start().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src.join("a.txt"), b"v1\n");
    // One state dir (and so one baseline store) for the direct pool and the one through the
    // proxy.
    let state = tmp.path().join("state");
    let direct = pool_with(&sshd, sshd.port(), &state, 100_000, 1 << 40);
    let sp = spec(Direction::Upload, &src, "cutbase", false, &[]);
    sync(&direct, &sp).await.unwrap();
    // v2, and a large file that keeps the run going after a.txt's batch committed.
    write(&src.join("a.txt"), b"v2\n");
    write(&src.join("big.bin"), &gen_bytes(5, (48 * MIB) as usize));
    let slow = pool_with(&sshd, proxy.port(), &state, 100_000, 1 << 40);
    proxy.set_rate_mbit(100);
    let e = sync_and_cut(&slow, &sp, &proxy, 8 * MIB).await;
    println!("cut: {e}");
    assert_eq!(
        std::fs::read(remote(&sshd, "cutbase/a.txt")).unwrap(),
        b"v2\n",
        "a.txt committed before the cut"
    );
    proxy.reset();
    write(&src.join("a.txt"), b"v3\n");
    let r = sync(&direct, &sp).await.unwrap();
    assert!(r.conflicts.is_empty(), "{}", r.to_json());
    assert_eq!(
        std::fs::read(remote(&sshd, "cutbase/a.txt")).unwrap(),
        b"v3\n"
    );
}

/// Issue 47: a long fat link (100 ms round trip, no rate limit). A large file's upload window
/// stayed where it started (three 256 KiB requests in flight, 9 MB/s) and a download had at
/// most 2 MiB in flight (the SSH library's channel window, and 8 reads): rsb took 1.8x and 1.7x
/// as long as `rsync -a` through the same proxy. Then one SSH channel bounded the upload
/// (sshd's 2 MiB window per round trip, as for rsync: 1.03x); it now spreads over lanes (more
/// channels to the host), while an exec on the session's own channel is not held up behind
/// the bytes. Measured against rsync in the same run, so a slow machine slows both. Then a
/// spread upload cut halfway resumes from what the lanes had staged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_link_is_kept_full_both_ways() {
    let sshd = Sshd::start().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    proxy.set_latency(Duration::from_millis(50));
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("far");
    let file = src.join("model.bin");
    write(&file, &gen_bytes(11, (64 * MIB) as usize));
    let pool = pool_with(&sshd, proxy.port(), &tmp.path().join("state"), 100, 1 << 40);
    pool.pool().client("s").await.unwrap();
    pool.pool().local_agent().await.unwrap();

    // An exec every 100 ms while the file goes up: its round trips.
    let c = pool.pool().client("s").await.unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = tokio::spawn({
        let done = done.clone();
        async move {
            let mut rtts = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) && rtts.len() < 300 {
                let t = Instant::now();
                c.call(rsb_protocol::ExecRequest::new("true"))
                    .await
                    .unwrap();
                rtts.push(t.elapsed());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            rtts
        }
    });
    let t = Instant::now();
    sync(&pool, &spec(Direction::Upload, &src, "far/rsb", false, &[]))
        .await
        .unwrap();
    let up = t.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut rtts = probe.await.unwrap();
    rtts.sort();
    let (p50, worst) = (rtts[rtts.len() / 2], rtts[rtts.len() - 1]);
    println!(
        "exec during the upload: {} calls, p50 {p50:.0?}, slowest {worst:.0?}",
        rtts.len()
    );
    let r_up = sshd.rsync(
        &["-a"],
        Some(proxy.port()),
        &format!("{}/", src.display()),
        &sshd.rsync_remote("far/rsync"),
    );
    let want = sha256_local(&file);
    assert_eq!(
        sha256_remote(&sshd, remote(&sshd, "far/rsb/model.bin").to_str().unwrap()),
        want
    );

    let down_dir = tmp.path().join("down");
    let t = Instant::now();
    sync(
        &pool,
        &spec(Direction::Download, &down_dir, "far/rsb", false, &[]),
    )
    .await
    .unwrap();
    let down = t.elapsed();
    let r_dir = tmp.path().join("down-rsync");
    std::fs::create_dir_all(&r_dir).unwrap();
    let r_down = sshd.rsync(
        &["-a"],
        Some(proxy.port()),
        &sshd.rsync_remote("far/rsync"),
        &format!("{}/", r_dir.display()),
    );
    assert_eq!(sha256_local(&down_dir.join("model.bin")), want);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "64 MiB at 100 ms: upload rsb {up:.2?} rsync {r_up:.2?} ({:.2}x), download rsb \
         {down:.2?} rsync {r_down:.2?} ({:.2}x)",
        ratio(up, r_up),
        ratio(down, r_down)
    );
    // Measured here (debug build, 64 MiB, so the start's round trips weigh): upload 1.03x over
    // one channel, 0.46-0.54x over four lanes; download 0.40x. Exec during the upload: p50
    // about one round trip.
    assert!(
        ratio(up, r_up) < 0.75,
        "upload {:.2}x rsync",
        ratio(up, r_up)
    );
    assert!(
        ratio(down, r_down) < 0.8,
        "download {:.2}x rsync",
        ratio(down, r_down)
    );
    assert!(
        p50 < Duration::from_millis(400),
        "exec behind the upload: p50 {p50:?}"
    );

    // A spread upload cut halfway: the next one sends about the other half.
    let sp = spec(Direction::Upload, &src, "far/cut", false, &[]);
    let e = sync_and_cut(&pool, &sp, &proxy, 32 * MIB).await;
    println!("cut halfway: {e}");
    proxy.reset();
    proxy.set_latency(Duration::from_millis(50));
    let r = sync(&pool, &sp).await.unwrap();
    println!("after the cut: bytes_sent {}", r.bytes_sent);
    assert!(
        r.bytes_sent <= 40 * MIB,
        "resumed from what the lanes staged: sent {} bytes",
        r.bytes_sent
    );
    assert_eq!(
        sha256_remote(&sshd, remote(&sshd, "far/cut/model.bin").to_str().unwrap()),
        want
    );
    assert!(staging_left(&sshd, remote(&sshd, "far/cut").to_str().unwrap()).is_empty());
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_file_delta_and_cut_connection() {
    let sshd = Sshd::start().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("big");
    let file = src.join("model.bin");
    let mut data = gen_bytes(7, (200 * MIB) as usize);
    write(&file, &data);
    let rfile = remote(&sshd, "big/model.bin");
    let rfile_s = rfile.to_str().unwrap().to_string();

    // A cut during the first transfer: the destination has no file, never a partial one.
    let slow = pool_with(&sshd, proxy.port(), &tmp.path().join("slow"), 200, 64 * MIB);
    proxy.set_delay(Duration::from_millis(2));
    let sp = spec(Direction::Upload, &src, "big", false, &[]);
    let e = sync_and_cut(&slow, &sp, &proxy, 16 * MIB).await;
    println!("cut during first upload: {e}");
    assert_eq!(sha256_remote(&sshd, &rfile_s), "none", "no partial file");
    proxy.reset();

    // Next sync completes, resuming from what the cut one kept staged.
    let pool = pool_with(&sshd, sshd.port(), tmp.path(), 200, 64 * MIB);
    let t0 = Instant::now();
    let r = sync(&pool, &sp).await.unwrap();
    println!(
        "200 MiB upload: {:?}, bytes_sent {}",
        t0.elapsed(),
        r.bytes_sent
    );
    assert!(
        r.bytes_sent <= 200 * MIB && r.bytes_sent >= 150 * MIB,
        "bytes_sent {}",
        r.bytes_sent
    );
    assert_eq!(sha256_remote(&sshd, &rfile_s), sha256_local(&file));
    assert!(staging_left(&sshd, remote(&sshd, "big").to_str().unwrap()).is_empty());

    // No change.
    let t0 = Instant::now();
    let r = sync(&pool, &sp).await.unwrap();
    println!("200 MiB no-change: {:?}", t0.elapsed());
    assert_eq!((r.files_transferred, r.bytes_sent), (0, 0));

    // 1 MiB changed in place (not block aligned): about 1 MiB goes.
    let off = (77 * MIB + 12345) as usize;
    data[off..off + MIB as usize].copy_from_slice(&gen_bytes(99, MIB as usize));
    write(&file, &data);
    let t0 = Instant::now();
    let r = sync(&pool, &sp).await.unwrap();
    println!(
        "1 MiB in-place change of 200 MiB: {:?}, bytes_sent {} ({:.2} MiB)",
        t0.elapsed(),
        r.bytes_sent,
        r.bytes_sent as f64 / MIB as f64
    );
    assert_eq!((r.files_transferred, r.delta_files), (1, 1));
    assert!(r.bytes_sent < 3 * MIB, "bytes_sent {}", r.bytes_sent);
    let old_hash = sha256_local(&file);
    assert_eq!(sha256_remote(&sshd, &rfile_s), old_hash);

    // A cut while the new version streams: the old version stays, whole.
    let data2 = gen_bytes(8, (200 * MIB) as usize);
    write(&file, &data2);
    drop(data);
    proxy.set_delay(Duration::from_millis(2));
    let e = sync_and_cut(&slow, &sp, &proxy, 16 * MIB).await;
    println!("cut during an update: {e}");
    assert_eq!(
        sha256_remote(&sshd, &rfile_s),
        old_hash,
        "old version, never partial"
    );
    proxy.reset();
    let r = sync(&pool, &sp).await.unwrap();
    assert_eq!(r.files_transferred, 1);
    assert_eq!(sha256_remote(&sshd, &rfile_s), sha256_local(&file));
    assert!(staging_left(&sshd, remote(&sshd, "big").to_str().unwrap()).is_empty());
    slow.shutdown().await;
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Background transfers
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_transfer_progress_cancel_and_rerun() {
    let sshd = Sshd::start().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("bg");
    let file = src.join("data.bin");
    write(&file, &gen_bytes(3, (96 * MIB) as usize));
    write(&src.join("small.txt"), b"small\n");
    // Anything above 1 MiB goes to the background.
    let pool = pool_with(&sshd, proxy.port(), &tmp.path().join("state"), 200, MIB);
    proxy.set_delay(Duration::from_millis(2));
    let args = SyncArgs {
        local_path: src.display().to_string(),
        remote_path: "bg".into(),
        ..Default::default()
    };
    let v = ops::sync_local_to_remote(&pool, args.clone(), None, &CancellationToken::new())
        .await
        .unwrap();
    println!("background start: {v}");
    assert_eq!(v["mode"], "background");
    assert_eq!(v["auto_switched"], true);
    let id = v["task_id"].as_i64().unwrap();
    assert!(Path::new(v["log_file"].as_str().unwrap()).is_file());
    let transfers = pool.transfers().await.unwrap();
    // Wait until bytes are moving.
    let t0 = Instant::now();
    // The first poll carries the log header; later ones only the lines written since.
    let first = transfers.check(id, 50).await.unwrap();
    assert!(
        first["log_tail"]
            .as_str()
            .unwrap()
            .starts_with(&format!("== transfer task: {id}")),
        "{first}"
    );
    assert!(first.get("log_new_lines_only").is_none(), "{first}");
    loop {
        let c = transfers.check(id, 50).await.unwrap();
        if c["progress"]["bytes_done"].as_u64().unwrap_or(0) > 4 * MIB {
            println!("running: {c}");
            assert_eq!(c["status"], "running");
            assert_eq!(c["running"], true);
            assert_eq!(c["log_new_lines_only"], true, "{c}");
            assert!(
                !c["log_tail"]
                    .as_str()
                    .unwrap()
                    .contains("== transfer task:"),
                "the header came again: {c}"
            );
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no progress: {c}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let t0 = Instant::now();
    let c = transfers.cancel(id, 5.0).await.unwrap();
    let took = t0.elapsed();
    println!("cancel: {c} in {took:?}");
    assert_eq!(c["status"], "cancelled", "{c}");
    assert!(took < Duration::from_secs(1), "cancel took {took:?}");
    let c = transfers.check(id, 50).await.unwrap();
    assert_eq!(c["status"], "cancelled");
    assert_eq!(c["progress"]["phase"], "cancelled");
    assert!(c["log_tail"].as_str().unwrap().contains("cancelled"));
    let again = transfers.cancel(id, 5.0).await.unwrap();
    assert_eq!(again["already_finished"], true);
    assert_eq!(
        sha256_remote(&sshd, remote(&sshd, "bg/data.bin").to_str().unwrap()),
        "none",
        "nothing partial"
    );
    // The next sync works (a new background task, fast link) and reports completion.
    proxy.reset();
    let v = ops::sync_local_to_remote(&pool, args, None, &CancellationToken::new())
        .await
        .unwrap();
    let id2 = v["task_id"].as_i64().unwrap();
    assert_eq!(
        transfers
            .wait(id2, Duration::from_secs(120))
            .await
            .as_deref(),
        Some("completed")
    );
    let c = transfers.check(id2, 5).await.unwrap();
    println!("completed: {c}");
    // small.txt may have been committed before the cancel: files already committed stay.
    assert!(c["result"]["uploaded_files"].as_u64().unwrap() >= 1, "{c}");
    assert_eq!(c["progress"]["phase"], "complete");
    assert!(
        c["log_tail"]
            .as_str()
            .unwrap()
            .ends_with(&format!("[transfer] task={id2} completed"))
    );
    assert_eq!(
        sha256_remote(&sshd, remote(&sshd, "bg/data.bin").to_str().unwrap()),
        sha256_local(&file)
    );
    assert!(staging_left(&sshd, remote(&sshd, "bg").to_str().unwrap()).is_empty());
    // Errors with the seed's words.
    assert_eq!(
        transfers.check(0, 50).await.unwrap_err().message,
        "task_id must be positive"
    );
    assert_eq!(
        transfers.check(9999, 50).await.unwrap_err().message,
        "Unknown transfer task id: 9999"
    );
    assert_eq!(
        transfers.cancel(id2, -1.0).await.unwrap_err().message,
        "force_kill_after_s must be zero or positive"
    );
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// The MCP tools, through `rsb mcp`
// ---------------------------------------------------------------------------------------------

struct McpSync {
    svc: rmcp::service::RunningService<rmcp::RoleClient, ()>,
    _tmp: tempfile::TempDir,
}

impl McpSync {
    async fn start(sshd: &Sshd, env: &[(&str, &str)]) -> McpSync {
        use rmcp::ServiceExt;
        let bin = rsb_tests::workspace_root().join("target/debug/rsb");
        assert!(bin.exists(), "build it: cargo build --workspace --bins");
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("home");
        std::fs::create_dir_all(&home).unwrap();
        let list = serde_json::json!([{
            "name": "s", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
            "key_file": sshd.client_key().display().to_string(),
        }]);
        let mut cmd = tokio::process::Command::new(bin);
        cmd.arg("mcp")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("RSB_STATE_DIR", tmp.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", list.to_string());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let (transport, _) = rmcp::transport::TokioChildProcess::builder(cmd)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let svc = ().serve(transport).await.unwrap();
        McpSync { svc, _tmp: tmp }
    }

    async fn call(&self, tool: &str, args: serde_json::Value) -> (bool, serde_json::Value) {
        let serde_json::Value::Object(args) = args else {
            panic!()
        };
        let p = rmcp::model::CallToolRequestParams::new(tool.to_string()).with_arguments(args);
        let r = tokio::time::timeout(Duration::from_secs(120), self.svc.call_tool(p))
            .await
            .unwrap()
            .unwrap();
        let raw = serde_json::to_value(&r).unwrap();
        let text = raw["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        (
            r.is_error == Some(true),
            serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
        )
    }

    async fn ok(&self, tool: &str, args: serde_json::Value) -> serde_json::Value {
        let (e, v) = self.call(tool, args.clone()).await;
        assert!(!e, "{tool}({args}) failed: {v}");
        v
    }

    async fn err(&self, tool: &str, args: serde_json::Value) -> String {
        let (e, v) = self.call(tool, args.clone()).await;
        assert!(e, "{tool}({args}) should fail: {v}");
        assert!(v["hint"].is_string(), "{v}");
        v["error"].as_str().unwrap().to_string()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_sync_tools_inline_background_and_errors() {
    use serde_json::json;
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mcp = McpSync::start(
        &sshd,
        &[("REMOTE_SANDBOX_INLINE_SYNC_MAX_BYTES", "1048576")],
    )
    .await;
    let src = tmp.path().join("proj");
    write(&src.join("a.txt"), b"a");
    write(&src.join("sub/b.txt"), b"b");
    write(&src.join("run.sh"), b"#!/bin/sh\n");
    chmod(&src.join("run.sh"), 0o755);
    write(&src.join("notes.md"), b"md");
    write(&src.join(".git/HEAD"), b"x");

    // Inline, with `excludes` JSON-encoded in a string (the seed's quirk).
    let v = mcp
        .ok(
            "sync_local_to_remote",
            json!({"local_path": src, "remote_path": "m1", "excludes": "[\"*.md\"]"}),
        )
        .await;
    assert_eq!(v["mode"], "inline", "{v}");
    assert_eq!(v["uploaded_files"], 3, "{v}");
    assert_eq!(v["uploaded_dirs"], 1, "{v}");
    assert!(remote(&sshd, "m1/sub/b.txt").is_file());
    assert!(!remote(&sshd, "m1/notes.md").exists() && !remote(&sshd, "m1/.git").exists());
    let v = mcp
        .ok(
            "sync_local_to_remote",
            json!({"local_path": src, "remote_path": "m1", "excludes": ["*.md"]}),
        )
        .await;
    assert_eq!(
        (v["uploaded_files"].as_u64(), v["skipped_files"].as_u64()),
        (Some(0), Some(3))
    );

    // Download back.
    let down = tmp.path().join("down");
    let v = mcp
        .ok(
            "sync_remote_to_local",
            json!({"remote_path": "m1", "local_path": down}),
        )
        .await;
    assert_eq!(v["downloaded_files"], 3, "{v}");
    assert_eq!(
        std::fs::metadata(down.join("run.sh"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );

    // The seed's validation messages.
    let missing = tmp.path().join("missing");
    assert_eq!(
        mcp.err("sync_local_to_remote", json!({"local_path": missing}))
            .await,
        format!("local_path does not exist: {}", missing.display())
    );
    let ex = tmp.path().join("nope.txt");
    assert_eq!(
        mcp.err(
            "sync_local_to_remote",
            json!({"local_path": src, "exclude_file": ex})
        )
        .await,
        format!("exclude_file does not exist: {}", ex.display())
    );
    assert_eq!(
        mcp.err(
            "sync_local_to_remote",
            json!({"local_path": src.join("a.txt"), "delete_extras": true})
        )
        .await,
        "delete_extras is only supported when local_path is a directory"
    );
    assert_eq!(
        mcp.err("check_file_transfer_task", json!({"task_id": 0}))
            .await,
        "task_id must be positive"
    );
    assert_eq!(
        mcp.err("check_file_transfer_task", json!({"task_id": 42}))
            .await,
        "Unknown transfer task id: 42"
    );
    assert_eq!(
        mcp.err(
            "cancel_file_transfer_task",
            json!({"task_id": 1, "force_kill_after_s": -1.0})
        )
        .await,
        "force_kill_after_s must be zero or positive"
    );

    // Above 1 MiB: background; check until done; cancel after the fact.
    write(&src.join("big.bin"), &gen_bytes(11, (3 * MIB) as usize));
    let v = mcp
        .ok(
            "sync_local_to_remote",
            json!({"local_path": src, "remote_path": "m2"}),
        )
        .await;
    assert_eq!(
        (v["mode"].as_str(), v["auto_switched"].as_bool()),
        (Some("background"), Some(true)),
        "{v}"
    );
    let id = v["task_id"].as_i64().unwrap();
    let t0 = Instant::now();
    let done = loop {
        let c = mcp
            .ok(
                "check_file_transfer_task",
                json!({"task_id": id, "last_n_lines": 5}),
            )
            .await;
        if c["status"] == "completed" || c["status"] == "failed" {
            break c;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{c}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["result"]["uploaded_files"], 5, "{done}");
    assert!(
        done["log_tail"]
            .as_str()
            .unwrap()
            .ends_with(&format!("[transfer] task={id} completed"))
    );
    let c = mcp
        .ok("cancel_file_transfer_task", json!({"task_id": id}))
        .await;
    assert_eq!(
        (c["status"].as_str(), c["already_finished"].as_bool()),
        (Some("completed"), Some(true))
    );
    assert_eq!(
        sha256_remote(&sshd, remote(&sshd, "m2/big.bin").to_str().unwrap()),
        sha256_local(&src.join("big.bin"))
    );
    let _ = mcp.svc.cancel().await;
}

// ---------------------------------------------------------------------------------------------
// Commit by descriptor (issue 14 case 3)
// ---------------------------------------------------------------------------------------------

/// Someone who can write the destination directory swaps the staging directory for a link to
/// their own directory while a sync runs: the sync stops with a clear error, and every file
/// it committed holds the source's bytes (nothing staged in their directory is ever renamed
/// into place).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_staging_directory_aborts_the_sync() {
    let sshd = Sshd::start().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("many");
    let body = |i: usize| format!("real {i}\n").repeat(400);
    for i in 0..1500 {
        write(&src.join(format!("f{i:04}")), body(i).as_bytes());
    }
    let pool = pool_with(
        &sshd,
        proxy.port(),
        &tmp.path().join("state"),
        1 << 20,
        1 << 40,
    );
    let dest = remote(&sshd, "shared");
    std::fs::create_dir_all(&dest).unwrap();
    chmod(&dest, 0o777);
    proxy.set_delay(Duration::from_millis(2));
    let sp = spec(Direction::Upload, &src, "shared", false, &[]);
    let run = {
        let pool = pool.clone();
        tokio::spawn(
            async move { ops::run(&pool, "s", &sp, None, &CancellationToken::new()).await },
        )
    };
    // The staging directory appears once the first batch arrives.
    let t0 = Instant::now();
    let staging = loop {
        let found = std::fs::read_dir(&dest).unwrap().flatten().find(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".rsb-sync-staging-")
        });
        if let Some(e) = found {
            break e.path();
        }
        assert!(
            !run.is_finished(),
            "the sync ended before its staging was seen"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no staging directory"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let evil = dest.join("evil");
    std::fs::create_dir_all(&evil).unwrap();
    for i in 0..20 {
        write(&evil.join(format!("f{i}")), b"substituted\n");
    }
    std::fs::rename(&staging, dest.join("moved-away")).unwrap();
    std::os::unix::fs::symlink(&evil, &staging).unwrap();
    let e = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the sync ends")
        .unwrap()
        .expect_err("a tampered staging directory must fail the sync");
    println!("tampered: {}", e.message);
    assert!(e.message.contains("tampered"), "{}", e.message);
    let mut committed = 0;
    for entry in std::fs::read_dir(&dest).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(i) = name.strip_prefix('f').and_then(|n| n.parse::<usize>().ok()) {
            assert_eq!(
                std::fs::read_to_string(entry.path()).unwrap(),
                body(i),
                "{name} holds someone else's bytes"
            );
            committed += 1;
        }
    }
    assert!(committed < 1500, "the sync went on after the swap");
    // Their directory got nothing of ours.
    assert_eq!(std::fs::read_dir(&evil).unwrap().count(), 20);
    pool.shutdown().await;
}

/// Issue 14 case 7: a first sync into a directory this user may write but does not own commits
/// every file, and the root's mtime (which only its owner may set) is a warning, not a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_owned_by_someone_else_gets_a_warning_not_a_failure() {
    let sshd = Sshd::start().unwrap();
    let Some((user, pw)) = sshd.password_user() else {
        eprintln!("SKIP: not root, so there is no second user to sync as");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    chmod(tmp.path(), 0o755);
    let shared = tmp.path().join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    chmod(&shared, 0o777);
    let src = tmp.path().join("src");
    for i in 0..3 {
        write(&src.join(format!("f{i}")), format!("{i}\n").as_bytes());
    }
    let mut t = target(
        &sshd,
        sshd.port(),
        rsb::config::Auth::Password(secret(&pw)),
        &tmp.path().join("known_hosts"),
    );
    t.user = user;
    let pool = app_of(vec![sandbox("s", t)], &tmp.path().join("state"));
    let sp = spec(
        Direction::Upload,
        &src,
        shared.to_str().unwrap(),
        false,
        &[],
    );
    let r = sync(&pool, &sp)
        .await
        .expect("the files are committed: no failure");
    assert_eq!(r.files_transferred, 3);
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert!(
        r.warnings[0].starts_with("could not set the mtime of .: it belongs to uid 0"),
        "{}",
        r.warnings[0]
    );
    assert!(r.to_json()["warnings"].is_array());
    assert_eq!(std::fs::read_to_string(shared.join("f2")).unwrap(), "2\n");
    pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// gitignore: true (issue 10)
// ---------------------------------------------------------------------------------------------

/// A tree with `.gitignore` files at three depths, a `!` re-include, an anchored pattern in a
/// nested file, and a deeper file overriding its parent's re-include.
fn make_gitignored_tree(root: &Path) {
    write(&root.join(".gitignore"), b"*.log\n/build/\ntmp/\n");
    write(&root.join("a.txt"), b"a\n");
    write(&root.join("a.log"), b"log\n");
    write(&root.join("build/out.o"), b"o\n");
    write(&root.join("src/build/keep.c"), b"c\n");
    write(&root.join("src/tmp/x"), b"x\n");
    write(
        &root.join("src/.gitignore"),
        b"# nested\n!keep.log\ngen/\n/local.txt\n",
    );
    write(&root.join("src/keep.log"), b"kept\n");
    write(&root.join("src/other.log"), b"no\n");
    write(&root.join("src/local.txt"), b"no\n");
    write(&root.join("src/sub/local.txt"), b"yes\n");
    write(&root.join("src/gen/g.rs"), b"gen\n");
    write(&root.join("src/deep/.gitignore"), b"keep.log\n");
    write(&root.join("src/deep/keep.log"), b"no\n");
    write(&root.join("src/deep/d.txt"), b"d\n");
}

/// What git would keep of [`make_gitignored_tree`].
const GITIGNORED_KEPT: &[&str] = &[
    ".gitignore",
    "a.txt",
    "src/.gitignore",
    "src/build/keep.c",
    "src/deep/.gitignore",
    "src/deep/d.txt",
    "src/keep.log",
    "src/sub/local.txt",
];

const FILES: &str =
    "find . -type f ! -path './.rsb-sync-staging-*' | sed 's|^\\./||' | LC_ALL=C sort";

fn local_files(dir: &Path) -> Vec<String> {
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("cd {} && {FILES}", shq(dir.to_str().unwrap())))
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn remote_files(sshd: &Sshd, dir: &str) -> Vec<String> {
    sshd.ssh_run(&format!("cd {} && {FILES}", shq(dir)))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gitignore_nested_files_both_directions() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pool = pool_with(&sshd, sshd.port(), tmp.path(), 200, 64 * MIB);
    let gitignored = |dir, local: &Path, remote: &str, delete| {
        let mut s = spec(dir, local, remote, delete, &[]);
        s.rules.gitignore = true;
        s
    };

    // Upload with --delete into a destination holding extras: those the source's .gitignore
    // files leave out are kept; the others go. The destination's own .gitignore (which would
    // hide every .txt) is not what decides: the source's files are.
    let src = tmp.path().join("src-tree");
    make_gitignored_tree(&src);
    let dst = remote(&sshd, "gi-up");
    write(&dst.join(".gitignore"), b"*.txt\n");
    write(&dst.join("stale.txt"), b"stale\n");
    write(&dst.join("build/remote-only.o"), b"keep me\n");
    write(&dst.join("src/other.log"), b"remote log\n");
    let r = sync(&pool, &gitignored(Direction::Upload, &src, "gi-up", true))
        .await
        .unwrap();
    assert_eq!(
        r.files_transferred,
        GITIGNORED_KEPT.len() as u64,
        "{}",
        r.to_json()
    );
    let mut want: Vec<String> = GITIGNORED_KEPT.iter().map(|s| s.to_string()).collect();
    want.extend(["build/remote-only.o".into(), "src/other.log".into()]);
    want.sort();
    assert_eq!(remote_files(&sshd, dst.to_str().unwrap()), want);
    assert_eq!(
        std::fs::read(dst.join("src/other.log")).unwrap(),
        b"remote log\n",
        "an ignored destination file is left as it is"
    );
    // A resync changes nothing.
    let r = sync(&pool, &gitignored(Direction::Upload, &src, "gi-up", true))
        .await
        .unwrap();
    assert_eq!(r.files_transferred + r.deleted_files, 0, "{}", r.to_json());
    // Off (the default), the same tree goes whole (default excludes only).
    let r = sync(&pool, &spec(Direction::Upload, &src, "gi-off", false, &[]))
        .await
        .unwrap();
    assert_eq!(r.files_transferred, 15, "{}", r.to_json());

    // Download: the remote tree's .gitignore files decide; exactly what git keeps arrives.
    let rsrc = remote(&sshd, "gi-down");
    make_gitignored_tree(&rsrc);
    let local = tmp.path().join("down");
    sync(
        &pool,
        &gitignored(Direction::Download, &local, "gi-down", false),
    )
    .await
    .unwrap();
    assert_eq!(local_files(&local), GITIGNORED_KEPT);

    // The tools' path: `gitignore: true` in the arguments of sync_local_to_remote.
    let args = SyncArgs {
        local_path: src.to_str().unwrap().into(),
        remote_path: "gi-tool".into(),
        gitignore: true,
        ..Default::default()
    };
    let v = ops::sync_local_to_remote(&pool, args, None, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(v["mode"], "inline", "{v}");
    assert_eq!(
        remote_files(&sshd, remote(&sshd, "gi-tool").to_str().unwrap()),
        GITIGNORED_KEPT
    );

    // A single file is decided by the .gitignore beside it, with the same engine.
    let one = |rel: &str, on: bool| {
        let mut s = spec(Direction::Upload, &src.join(rel), "gi-single/", false, &[]);
        s.rules.gitignore = on;
        s
    };
    let r = sync(&pool, &one("src/local.txt", true)).await.unwrap();
    assert_eq!((r.files_transferred, r.skipped_files), (0, 1));
    let r = sync(&pool, &one("src/keep.log", true)).await.unwrap();
    assert_eq!(r.files_transferred, 1);
    let r = sync(&pool, &one("src/local.txt", false)).await.unwrap();
    assert_eq!(r.files_transferred, 1);
}
