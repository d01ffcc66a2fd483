//! One rules engine for every sync (issue 11), against a real private sshd: a directory sync
//! (decided by an agent's walk) and a single-file sync (decided by `rsb` before it connects)
//! read the same exclude line the same way, escapes included, and a line the engine refuses is
//! the same one-line error in both, in both directions, with nothing written.
//!
//! Needs the embedded agents (`scripts/build-agents.sh`) and `cargo build -p rsb-agent` (the
//! local end of a sync is `target/debug/rsb-agent`).

mod common;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use common::*;
use rsb::{
    app::App,
    ops::sync::{self as ops, SyncArgs},
    sync::{CancellationToken, Direction, SyncSpec},
};
use rsb_tests::Sshd;
use serde_json::Value;

/// Names a backslash escape decides: `foo\*bar` is the literal name `foo*bar` (not `foo/*bar`,
/// which is what rewriting `\` to `/` made of it), `\#notes.txt` a name starting with `#` (not
/// a comment). `fooXbar` would match an unescaped `foo*bar`.
const EXCLUDES: &[&str] = &["foo\\*bar", "\\#notes.txt"];
const EXCLUDED: &[&str] = &["foo*bar", "#notes.txt", "d/foo*bar", "d/#notes.txt"];
const KEPT: &[&str] = &["fooXbar", "keep.txt", "d/fooXbar", "d/notes.txt"];

fn make_tree(root: &Path) {
    for rel in EXCLUDED.iter().chain(KEPT) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, rel.as_bytes()).unwrap();
    }
}

fn args(local: &Path, remote: &str, excludes: &[&str]) -> SyncArgs {
    SyncArgs {
        local_path: local.display().to_string(),
        remote_path: remote.to_string(),
        excludes: excludes.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

async fn upload(pool: &Arc<App>, a: SyncArgs) -> rsb::error::Result<Value> {
    ops::sync_local_to_remote(pool, a, None, &CancellationToken::new()).await
}

async fn download(pool: &Arc<App>, a: SyncArgs) -> rsb::error::Result<Value> {
    ops::sync_remote_to_local(pool, a, None, &CancellationToken::new()).await
}

/// What a single-file sync reply says happened to the file: `Some(true)` skipped as excluded,
/// `Some(false)` transferred.
fn single_skipped(reply: &Value, moved_key: &str) -> bool {
    assert_eq!(reply["synced_type"], "file", "{reply}");
    let skipped = reply["skipped_files"].as_u64().unwrap();
    let moved = reply[moved_key].as_u64().unwrap();
    assert_eq!(skipped + moved, 1, "{reply}");
    skipped == 1
}

fn pool(sshd: &Sshd, dir: &Path) -> Arc<App> {
    key_app(sshd, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_exclude_means_the_same_for_a_directory_and_a_single_file() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pool = pool(&sshd, tmp.path());
    let src = tmp.path().join("src");
    make_tree(&src);

    // Upload: the directory, then each file alone.
    let r = upload(&pool, args(&src, "up", EXCLUDES)).await.unwrap();
    println!("directory upload: {r}");
    let up = sshd.home().join("up");
    for rel in KEPT {
        assert!(up.join(rel).is_file(), "{rel} kept by the directory upload");
    }
    for rel in EXCLUDED {
        assert!(
            !up.join(rel).exists(),
            "{rel} excluded by the directory upload"
        );
    }
    for rel in EXCLUDED.iter().chain(KEPT) {
        let r = upload(&pool, args(&src.join(rel), "single_up/", EXCLUDES))
            .await
            .unwrap();
        let in_dir = EXCLUDED.contains(rel);
        assert_eq!(
            single_skipped(&r, "uploaded_files"),
            in_dir,
            "single-file upload of {rel} disagrees with the directory upload: {r}"
        );
        let name = Path::new(rel).file_name().unwrap();
        assert_eq!(
            sshd.home().join("single_up").join(name).exists(),
            !in_dir,
            "{rel}"
        );
    }

    // Download: the remote copy of the whole tree, then each file alone, named relative to the
    // remote home so that its parent directories are candidates too.
    make_tree(&sshd.home().join("remote_src"));
    let dl = tmp.path().join("dl");
    let r = download(&pool, args(&dl, "remote_src", EXCLUDES))
        .await
        .unwrap();
    println!("directory download: {r}");
    for rel in KEPT {
        assert!(
            dl.join(rel).is_file(),
            "{rel} kept by the directory download"
        );
    }
    for rel in EXCLUDED {
        assert!(
            !dl.join(rel).exists(),
            "{rel} excluded by the directory download"
        );
    }
    let single_dl = tmp.path().join("single_dl");
    std::fs::create_dir_all(&single_dl).unwrap();
    for rel in EXCLUDED.iter().chain(KEPT) {
        let remote = format!("remote_src/{rel}");
        let r = download(&pool, args(&single_dl, &remote, EXCLUDES))
            .await
            .unwrap();
        let in_dir = EXCLUDED.contains(rel);
        assert_eq!(
            single_skipped(&r, "downloaded_files"),
            in_dir,
            "single-file download of {rel} disagrees with the directory download: {r}"
        );
    }
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pattern_the_engine_rejects_fails_every_sync_with_the_same_error() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pool = pool(&sshd, tmp.path());
    let src = tmp.path().join("src");
    make_tree(&src);
    make_tree(&sshd.home().join("remote_src"));
    let file = src.join("keep.txt");

    for (bad, reason) in [
        (
            "[z-a]",
            "invalid range in a character class (end before start)",
        ),
        ("x\\", "dangling backslash at the end"),
        ("[[:nope:]]", "unknown [:class:] in a character class"),
        ("logs/[ab", "unclosed character class (missing `]`)"),
    ] {
        let want = format!("invalid exclude pattern {bad:?}: {reason}");
        // `*.txt` excludes the single file: the `ignore` crate used to decide that alone and
        // skip the file without a word about the line it had dropped.
        let excludes = ["*.txt", bad];
        let dl = tmp.path().join("dl");
        let cases: Vec<(&str, rsb::error::Result<Value>)> = vec![
            (
                "directory upload",
                upload(&pool, args(&src, "up", &excludes)).await,
            ),
            (
                "single-file upload",
                upload(&pool, args(&file, "up/", &excludes)).await,
            ),
            (
                "directory download",
                download(&pool, args(&dl, "remote_src", &excludes)).await,
            ),
            (
                "single-file download",
                download(&pool, args(&dl, "remote_src/keep.txt", &excludes)).await,
            ),
        ];
        for (what, r) in cases {
            let e = r.expect_err(&format!("{what} accepted {bad:?}"));
            assert_eq!(e.message, want, "{what}");
            assert!(!e.hint.is_empty(), "{what}: no hint");
        }
        assert!(!sshd.home().join("up").exists(), "{bad:?}: an upload wrote");
        assert!(!dl.exists(), "{bad:?}: a download wrote");

        // The engine itself, without the tools' checks: an agent refuses the directory's rules,
        // and `rsb` refuses the single file's, in the same words.
        let spec = |local: &Path, remote: &str, dir: Direction| SyncSpec {
            direction: dir,
            local_path: local.to_path_buf(),
            remote_path: remote.to_string(),
            delete_extras: false,
            rules: SyncSpec::rules(excludes.iter().map(|s| s.to_string()).collect()),
            dry_run: false,
        };
        let engine_cases: [(&str, PathBuf, &str, Direction); 4] = [
            (
                "engine directory upload",
                src.clone(),
                "up",
                Direction::Upload,
            ),
            (
                "engine single-file upload",
                file.clone(),
                "up/",
                Direction::Upload,
            ),
            (
                "engine directory download",
                dl.clone(),
                "remote_src",
                Direction::Download,
            ),
            (
                "engine single-file download",
                dl.clone(),
                "remote_src/keep.txt",
                Direction::Download,
            ),
        ];
        for (what, local, remote, dir) in engine_cases {
            let e = ops::run(
                &pool,
                "s",
                &spec(&local, remote, dir),
                None,
                &CancellationToken::new(),
            )
            .await
            .expect_err(&format!("{what} accepted {bad:?}"));
            assert_eq!(e.message, want, "{what}");
        }
        assert!(
            !sshd.home().join("up").exists(),
            "{bad:?}: the engine wrote"
        );
        assert!(!dl.exists(), "{bad:?}: the engine wrote");
    }
    pool.shutdown().await;
}
