//! The sync engine's plan execution between two in-process agents: what lands on disk and what
//! the report counts.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;

use rsb::sync::{self, CancellationToken, Direction, SyncReport, SyncSpec};
use rsb_protocol::sync::STAGING_PREFIX;

use crate::harness::Agent;

/// Deterministic bytes (xorshift), so a changed block is really different.
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn write(root: &Path, rel: &str, data: &[u8], mode: u32) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(&p, data).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
}

/// The source tree: nested dirs, small files, one file taking the large path (> 1 MiB, several
/// pipelined requests), an empty file, a private file, a read-only dir, a symlink, and entries
/// the default excludes keep out.
fn source(root: &Path) {
    write(root, "README.md", b"# project\n", 0o644);
    write(root, "empty", b"", 0o644);
    write(root, "secret.key", b"k", 0o600);
    write(root, "src/main.rs", b"fn main() {}\n", 0o644);
    write(root, "src/lib/util.rs", &bytes(10_000, 1), 0o644);
    write(root, "run.sh", b"#!/bin/sh\necho hi\n", 0o755);
    write(root, "data/big.bin", &bytes(3 * 1024 * 1024 + 17, 2), 0o644);
    write(root, "ro/inside.txt", b"in a read-only dir", 0o444);
    fs::set_permissions(root.join("ro"), fs::Permissions::from_mode(0o555)).unwrap();
    symlink("src/main.rs", root.join("link")).unwrap();
    write(root, ".git/HEAD", b"ref: refs/heads/main\n", 0o644);
    write(root, "node_modules/x/index.js", b"x", 0o644);
    write(root, "cache.pyc", b"x", 0o644);
}

/// Everything under `root` (staging excluded): kind, mode, size, content hash or link target,
/// and mtime for files and links.
fn tree(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        let mut entries: Vec<_> = fs::read_dir(dir).unwrap().flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
            let m = fs::symlink_metadata(&p).unwrap();
            let mode = m.mode() & 0o7777;
            let v = if m.file_type().is_symlink() {
                format!("link -> {}", fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                walk(root, &p, out);
                format!("dir {mode:o}")
            } else {
                let h = blake3::hash(&fs::read(&p).unwrap());
                format!(
                    "file {mode:o} {} {} mtime {}",
                    m.len(),
                    &h.to_hex()[..16],
                    m.mtime() * 1_000_000_000 + m.mtime_nsec()
                )
            };
            out.insert(rel, v);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn without_excluded(mut t: BTreeMap<String, String>) -> BTreeMap<String, String> {
    t.retain(|rel, _| {
        !(rel.starts_with(".git") || rel.starts_with("node_modules") || rel.ends_with(".pyc"))
    });
    t
}

async fn upload(src: &Path, dst: &Path, delete_extras: bool) -> SyncReport {
    let local = Agent::start("local").await;
    let remote = Agent::start("remote").await;
    let spec = SyncSpec {
        direction: Direction::Upload,
        local_path: src.to_path_buf(),
        remote_path: dst.to_str().unwrap().to_string(),
        delete_extras,
        rules: SyncSpec::rules(Vec::new()),
        dry_run: false,
    };
    let report = sync::run(
        &local.client,
        &remote.client,
        &spec,
        None,
        &CancellationToken::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("sync failed: {e:?}"));
    let staging: Vec<_> = fs::read_dir(dst)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(STAGING_PREFIX))
        .collect();
    assert!(staging.is_empty(), "staging left behind: {staging:?}");
    report
}

/// The mtime of the destination's root is restored too, like `rsync -a`.
fn root_mtime(p: &Path) -> i64 {
    let m = fs::metadata(p).unwrap();
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

fn unlock(root: &Path) {
    // Tempdir cleanup needs write permission on the read-only directory.
    for r in [root.join("ro")] {
        if r.exists() {
            fs::set_permissions(&r, fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_into_an_empty_dir_copies_the_tree_exactly() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    source(&src);
    fs::create_dir(&dst).unwrap();
    let r = upload(&src, &dst, false).await;

    assert_eq!(tree(&dst), without_excluded(tree(&src)));
    assert_eq!(root_mtime(&dst), root_mtime(&src));
    assert_eq!(r.synced_type, "directory");
    assert_eq!(r.dirs_created, 4, "data, ro, src, src/lib: {r:?}");
    // 8 files and the symlink.
    assert_eq!(r.files_transferred, 9, "{r:?}");
    assert_eq!(r.skipped_files, 0, "{r:?}");
    assert_eq!(
        (r.deleted_files, r.deleted_dirs, r.attrs_updated),
        (0, 0, 0)
    );
    let file_bytes: u64 = [10, 0, 1, 13, 10_000, 18, 3 * 1024 * 1024 + 17, 18]
        .iter()
        .sum();
    assert_eq!(r.bytes_sent, file_bytes, "{r:?}");
    assert_eq!(r.bytes_planned, file_bytes);
    assert_eq!(r.delta_files, 0);
    assert!(r.errors.is_empty(), "{:?}", r.errors);

    // Nothing changed: a second run sends nothing.
    let again = upload(&src, &dst, false).await;
    assert_eq!(
        (
            again.files_transferred,
            again.dirs_created,
            again.bytes_sent
        ),
        (0, 0, 0),
        "{again:?}"
    );
    assert_eq!(again.skipped_files, 9);
    assert_eq!(tree(&dst), without_excluded(tree(&src)));
    unlock(&src);
    unlock(&dst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_into_a_partly_different_dir_changes_only_the_difference() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    source(&src);
    // A large file that differs in one block is sent as a block delta.
    let big = bytes(9 * 1024 * 1024, 3);
    write(&src, "data/huge.bin", &big, 0o644);
    let mut old_big = big.clone();
    old_big[5 * 1024 * 1024..5 * 1024 * 1024 + 10].copy_from_slice(b"0123456789");
    // The destination starts as a copy of the source…
    fs::create_dir(&dst).unwrap();
    let first = upload(&src, &dst, false).await;
    assert_eq!(first.files_transferred, 10, "{first:?}");
    // …then drifts: changed content, a lost file, a changed mode, extras, an old big file.
    write(&dst, "src/main.rs", b"fn main() { changed(); }\n", 0o644);
    fs::remove_file(dst.join("README.md")).unwrap();
    fs::set_permissions(dst.join("run.sh"), fs::Permissions::from_mode(0o644)).unwrap();
    write(&dst, "extra.txt", b"only on the destination", 0o644);
    write(&dst, "old/stale/file", b"gone soon", 0o644);
    fs::write(dst.join("data/huge.bin"), &old_big).unwrap();
    // Excluded on both sides: delete_extras must not touch it.
    write(&dst, "node_modules/keep.js", b"keep", 0o644);

    let r = upload(&src, &dst, true).await;
    let mut want = without_excluded(tree(&src));
    let got = tree(&dst);
    assert_eq!(
        got.get("node_modules/keep.js").map(|s| &s[..9]),
        Some("file 644 "),
        "an excluded entry was deleted"
    );
    let mut got = without_excluded(got);
    got.remove("node_modules");
    want.remove("node_modules");
    assert_eq!(got, want);
    assert_eq!(
        r.files_transferred, 3,
        "main.rs, README.md, huge.bin: {r:?}"
    );
    assert_eq!(r.delta_files, 1, "{r:?}");
    assert_eq!(r.attrs_updated, 1, "run.sh's mode: {r:?}");
    assert_eq!(r.deleted_files, 2, "extra.txt, old/stale/file: {r:?}");
    assert_eq!(r.deleted_dirs, 2, "old/stale, old: {r:?}");
    assert_eq!(r.dirs_created, 0, "{r:?}");
    // The delta sends the changed 256 KiB block, not 9 MiB.
    let small = b"fn main() {}\n".len() + b"# project\n".len();
    assert_eq!(r.bytes_sent, 256 * 1024 + small as u64, "{r:?}");
    assert_eq!(r.skipped_files, 7, "{r:?}");
    unlock(&src);
    unlock(&dst);
}
