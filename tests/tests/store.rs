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
    app::App,
    ops::sync as ops,
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

async fn sync(pool: &App, s: &SyncSpec) -> rsb::error::Result<rsb::sync::SyncReport> {
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
            let pool: Arc<App> = app_on(&sshd, sshd.port(), &state);
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

        let pool = app_on(&sshd, sshd.port(), &state);
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

/// Issue 46, item 4: `store::check` ran only where transfers open, so the daemon, watches and
/// forwards used a store with damaged pages (missing rows read as "none"). Every path now
/// opens through `store::open`, which checks the pages once per process before anything is
/// written: one error naming `rsb state check`, and the damaged file is left byte for byte.
#[test]
fn every_path_that_relies_on_the_store_refuses_damaged_pages_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    {
        let c = store::open(&state).unwrap();
        for i in 0..100 {
            c.execute(
                "INSERT INTO sync_baselines (local_root, sandbox_name, remote_root,
                   entries_json, updated_ts) VALUES (?1, 's', 'r', ?2, 0)",
                [format!("/l{i}"), "x".repeat(400)],
            )
            .unwrap();
        }
    }
    let db = store::db_path(&state);
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    // The last pages hold the rows just written: the damage is in sync_baselines only, so
    // the tables a watch or a forward reads still answer, and only a check finds it.
    let mut bytes = std::fs::read(&db).unwrap();
    let pages = bytes.len() / 4096;
    assert!(pages > 8, "{pages} pages");
    bytes[(pages - 3) * 4096..].fill(0xA5);
    std::fs::write(&db, &bytes).unwrap();
    let before = std::fs::read(&db).unwrap();
    let bin = rsb_tests::workspace_root().join("target/debug/rsb");
    for args in [
        &["watch", "list"][..],
        &["watch", "events"],
        &["forward", "--list"],
        &[
            "watchdog",
            "run",
            "--mode",
            "foreground",
            "--idle-exit",
            "1",
        ],
        &["state", "check"],
    ] {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(args)
            .env_clear()
            .env("HOME", &home)
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RSB_STATE_DIR", &state);
        let o =
            rsb_tests::output_with_timeout(&mut cmd, std::time::Duration::from_secs(30)).unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        println!("rsb {}: {:?}\n{err}", args.join(" "), o.status.code());
        assert!(
            !o.status.success(),
            "rsb {}: succeeded on damaged pages",
            args.join(" ")
        );
        assert!(
            err.contains("state database is unusable") && err.contains("rsb state check"),
            "rsb {}: {err}",
            args.join(" ")
        );
        assert!(
            std::fs::read(&db).unwrap() == before,
            "rsb {} changed the damaged file",
            args.join(" ")
        );
    }
}
