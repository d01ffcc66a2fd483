//! The state store (issue 20) against a real private sshd: a store that cannot be used makes a
//! sync refuse with one line and a hint, and never run as a first sync that overwrites a remote
//! edit.

mod common;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use common::*;
use rsb::{
    ops::sync as ops,
    pool::Pool,
    store,
    sync::{CancellationToken, Direction, SyncSpec},
};
use rsb_tests::Sshd;

fn up(local: &Path, remote: &str) -> SyncSpec {
    SyncSpec {
        direction: Direction::Upload,
        local_path: local.to_path_buf(),
        remote_path: remote.to_string(),
        delete_extras: false,
        rules: SyncSpec::rules(vec![]),
        dry_run: false,
    }
}

async fn sync(pool: &Pool, s: &SyncSpec) -> rsb::error::Result<rsb::sync::SyncReport> {
    ops::run(pool, "s", s, None, &CancellationToken::new()).await
}

/// The ways a state dir's database is found unusable in the field.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Cut to half its length (a full disk, a copy interrupted).
    Truncated,
    /// Overwritten with random bytes.
    Garbage,
    /// Migrated by a later rsb.
    NewerVersion,
    /// One page in the middle zeroed (header intact: SQLite opens it).
    Page,
}

fn damage(db: &Path, how: Damage) {
    let bytes = std::fs::read(db).unwrap();
    assert!(bytes.len() >= 4 * 4096, "a store of {} bytes", bytes.len());
    match how {
        Damage::Truncated => std::fs::write(db, &bytes[..bytes.len() / 2]).unwrap(),
        Damage::Garbage => std::fs::write(db, gen_bytes(20, bytes.len())).unwrap(),
        Damage::NewerVersion => {
            let c = store::open(db.parent().unwrap()).unwrap();
            c.execute_batch(&format!(
                "PRAGMA user_version = {}",
                store::SCHEMA_VERSION + 1
            ))
            .unwrap();
        }
        Damage::Page => {
            let page = 4096;
            let pages = bytes.len() / page;
            let mut b = bytes.clone();
            // Every page but the header's: the tables' roots and rows are all gone.
            for p in 1..pages {
                b[p * page..(p + 1) * page].fill(0xA5);
            }
            std::fs::write(db, b).unwrap();
        }
    }
}

/// Sync a tree, edit one remote file, damage the store, sync again: the second sync must fail
/// with the store named in one line and `rsb state check` in the hint, and leave the remote
/// edit as it is (with a working store it is a conflict; without one it was overwritten).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_store_refuses_the_sync_and_keeps_the_remote_edit() {
    let sshd = Sshd::start().unwrap();
    for how in [
        Damage::Truncated,
        Damage::Garbage,
        Damage::NewerVersion,
        Damage::Page,
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let src = tmp.path().join("src");
        for i in 0..200 {
            let p = src.join(format!("d{}/f{i}.txt", i % 7));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, format!("file {i} {}\n", "x".repeat(100))).unwrap();
        }
        let rel = format!("store-{how:?}");
        let s = up(&src, &rel);
        {
            let pool: Arc<Pool> = pool_on(&sshd, sshd.port(), &state);
            sync(&pool, &s).await.unwrap();
            pool.shutdown().await;
        }
        let edited: PathBuf = sshd.home().join(&rel).join("d3/f3.txt");
        std::fs::write(&edited, "REMOTE EDIT\n").unwrap();
        std::fs::write(src.join("d3/f3.txt"), "local edit\n").unwrap();
        let db = store::db_path(&state);
        for suffix in ["-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
        }
        damage(&db, how);

        let pool = pool_on(&sshd, sshd.port(), &state);
        let r = sync(&pool, &s).await;
        let e = match r {
            Ok(r) => panic!(
                "{how:?}: the sync ran on an unusable store: {}",
                r.to_json()
            ),
            Err(e) => e,
        };
        println!("{how:?}: {} ({})", e.message, e.hint);
        assert!(
            e.message.contains("state database") && !e.message.contains('\n'),
            "{how:?}: {}",
            e.message
        );
        assert!(
            e.hint.contains("rsb state check") || e.hint.contains("rsb.sqlite3"),
            "{how:?}: {}",
            e.hint
        );
        assert_eq!(
            std::fs::read_to_string(&edited).unwrap(),
            "REMOTE EDIT\n",
            "{how:?}: the remote edit was overwritten"
        );
        pool.shutdown().await;
    }
}
