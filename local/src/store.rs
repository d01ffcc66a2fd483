//! The one SQLite store of the state dir (`<state_dir>/rsb.sqlite3`), shared by the MCP server,
//! the watchdog daemon and the CLI: background transfer tasks, watches, watch events, daemon
//! heartbeat and the persisted (secret-free) sandbox definitions the daemon connects with.
//!
//! Every process opens its own connection: WAL (readers never block the writer), a busy
//! timeout (two writers wait instead of failing), and `PRAGMA user_version` migrations from
//! one ordered list that only ever grows, so a database written by any older rsb upgrades in
//! place. The database and its `-wal`/`-shm` files are 0600 in a 0700 directory: they hold
//! commands, log tails and checkpoints, which can be as private as the code they come from.

use std::{
    io::Write,
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use rusqlite::Connection;

use crate::error::{Kind, RsbError};

pub const DB_FILE: &str = "rsb.sqlite3";

/// Schema versions, in order; entry `i` moves `user_version` from `i` to `i + 1`. Never edit or
/// reorder an entry: databases in the field have run it. Add a new entry instead.
const MIGRATIONS: &[&str] = &[
    // 1: background transfers (was transfers.rs's own list; existing databases are at 1).
    "CREATE TABLE IF NOT EXISTS transfer_tasks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        direction TEXT NOT NULL,
        sandbox_name TEXT NOT NULL,
        local_path TEXT NOT NULL,
        remote_path TEXT NOT NULL,
        delete_extras INTEGER NOT NULL DEFAULT 0,
        excludes_json TEXT NOT NULL DEFAULT '[]',
        exclude_file TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'queued',
        pid INTEGER NOT NULL DEFAULT 0,
        owner_start TEXT NOT NULL DEFAULT '',
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        log_file TEXT NOT NULL DEFAULT '',
        started_ts REAL NOT NULL DEFAULT 0,
        finished_ts REAL NOT NULL DEFAULT 0,
        last_error TEXT NOT NULL DEFAULT '',
        result_json TEXT NOT NULL DEFAULT '{}',
        progress_json TEXT NOT NULL DEFAULT '{}',
        created_ts REAL NOT NULL,
        updated_ts REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS idx_transfer_tasks_status ON transfer_tasks(status, id DESC);",
    // 2: the watchdog. The seed's columns keep their names (its replies expose them), plus
    // rsb's: stall detection, millisecond scheduling, a resume-intent marker (so a daemon
    // killed while starting a resume neither loses nor repeats it), `rev` for optimistic
    // updates (a cancel from the server is never overwritten by a daemon's late check), and
    // `delivered` on events (alerts of an event committed just before a crash still go out).
    "CREATE TABLE IF NOT EXISTS watches (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL DEFAULT '',
        name TEXT NOT NULL DEFAULT '',
        sandbox_name TEXT NOT NULL,
        tmux_session TEXT NOT NULL,
        log_file TEXT NOT NULL,
        cwd TEXT NOT NULL DEFAULT '',
        launch_command TEXT NOT NULL DEFAULT '',
        resume_command TEXT NOT NULL DEFAULT '',
        resume_plan_json TEXT NOT NULL DEFAULT '{}',
        checkpoint_path TEXT NOT NULL DEFAULT '',
        checkpoint_format TEXT NOT NULL DEFAULT 'text',
        checkpoint_command TEXT NOT NULL DEFAULT '',
        interval_s INTEGER NOT NULL DEFAULT 300,
        max_log_lines INTEGER NOT NULL DEFAULT 80,
        status TEXT NOT NULL DEFAULT 'active',
        last_state TEXT NOT NULL DEFAULT '',
        last_summary TEXT NOT NULL DEFAULT '',
        last_error TEXT NOT NULL DEFAULT '',
        last_exit_code INTEGER,
        last_signal INTEGER,
        last_log_digest TEXT NOT NULL DEFAULT '',
        last_log_tail TEXT NOT NULL DEFAULT '',
        last_checkpoint_text TEXT NOT NULL DEFAULT '',
        last_checkpoint_digest TEXT NOT NULL DEFAULT '',
        checkpoint_updated_ts INTEGER NOT NULL DEFAULT 0,
        webhook_url TEXT NOT NULL DEFAULT '',
        event_command TEXT NOT NULL DEFAULT '',
        auto_resume INTEGER NOT NULL DEFAULT 0,
        resume_attempts INTEGER NOT NULL DEFAULT 0,
        max_resume_attempts INTEGER NOT NULL DEFAULT 1,
        alert_after_failures INTEGER NOT NULL DEFAULT 2,
        consecutive_ssh_failures INTEGER NOT NULL DEFAULT 0,
        ssh_alert_sent INTEGER NOT NULL DEFAULT 0,
        notify_local INTEGER NOT NULL DEFAULT 1,
        resume_delay_s INTEGER NOT NULL DEFAULT 300,
        interrupted_ts INTEGER NOT NULL DEFAULT 0,
        resume_due_ts INTEGER NOT NULL DEFAULT 0,
        metadata_json TEXT NOT NULL DEFAULT '{}',
        created_ts INTEGER NOT NULL,
        updated_ts INTEGER NOT NULL,
        last_checked_ts INTEGER NOT NULL DEFAULT 0,
        next_check_ts INTEGER NOT NULL DEFAULT 0,
        last_event_ts INTEGER NOT NULL DEFAULT 0,
        stall_after_s INTEGER NOT NULL DEFAULT 0,
        last_log_size INTEGER NOT NULL DEFAULT -1,
        log_changed_ts INTEGER NOT NULL DEFAULT 0,
        stall_alert_sent INTEGER NOT NULL DEFAULT 0,
        last_alert_error TEXT NOT NULL DEFAULT '',
        next_check_ms INTEGER NOT NULL DEFAULT 0,
        resume_intent_ms INTEGER NOT NULL DEFAULT 0,
        rev INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX IF NOT EXISTS idx_watches_due ON watches(status, next_check_ms);
    CREATE TABLE IF NOT EXISTS watch_events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        watch_id INTEGER NOT NULL,
        event_type TEXT NOT NULL,
        summary TEXT NOT NULL,
        payload_json TEXT NOT NULL,
        created_ts INTEGER NOT NULL,
        created_ms INTEGER NOT NULL DEFAULT 0,
        delivered INTEGER NOT NULL DEFAULT 0,
        FOREIGN KEY(watch_id) REFERENCES watches(id)
    );
    CREATE INDEX IF NOT EXISTS idx_watch_events_watch ON watch_events(watch_id, created_ts DESC);
    CREATE INDEX IF NOT EXISTS idx_watch_events_pending ON watch_events(delivered, id);
    CREATE TABLE IF NOT EXISTS daemon_meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL,
        updated_ts INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS sandboxes (
        name TEXT PRIMARY KEY,
        def_json TEXT NOT NULL,
        updated_ts INTEGER NOT NULL
    );",
    // 3: transfers run in a detached worker (`rsb transfer run <id>`), which rebuilds the sync
    // from `spec_json`; `in_process` marks a task kept inside its server (a password sandbox
    // whose secret may not be stored). `sync_baselines` holds the last-synced manifest of each
    // (local root, sandbox, remote root), so a destination file changed since is a conflict.
    "ALTER TABLE transfer_tasks ADD COLUMN spec_json TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE transfer_tasks ADD COLUMN in_process INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE IF NOT EXISTS sync_baselines (
        local_root TEXT NOT NULL,
        sandbox_name TEXT NOT NULL,
        remote_root TEXT NOT NULL,
        entries_json TEXT NOT NULL,
        updated_ts INTEGER NOT NULL,
        PRIMARY KEY (local_root, sandbox_name, remote_root)
    );",
    // 4: forwards served by the watchdog daemon (`forward_port(detach=true)`).
    "CREATE TABLE IF NOT EXISTS forwards (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_name TEXT NOT NULL,
        target TEXT NOT NULL,
        bind TEXT NOT NULL,
        local_port TEXT NOT NULL,
        state TEXT NOT NULL,
        local_address TEXT NOT NULL DEFAULT '',
        error TEXT NOT NULL DEFAULT '',
        stats_json TEXT NOT NULL DEFAULT '',
        daemon_pid INTEGER NOT NULL DEFAULT 0,
        created_ts INTEGER NOT NULL,
        updated_ts INTEGER NOT NULL
    )",
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

pub fn db_path(state_dir: &Path) -> PathBuf {
    state_dir.join(DB_FILE)
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn now_s() -> i64 {
    now_ms() / 1000
}

pub fn db_err(e: impl std::fmt::Display) -> RsbError {
    RsbError::new(
        Kind::Internal,
        format!("state database error: {e}"),
        "check free space and permissions of the rsb state dir (RSB_STATE_DIR)",
    )
}

/// Creates `dir` (and parents) 0700, tightening an existing one that others can read.
pub fn ensure_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mode = std::fs::metadata(dir)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically (a 0600 temp file in the same directory, fsynced, then
/// renamed), so a reader never sees a half-written file and it is never world-readable.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}-{}", std::process::id(), now_ms()));
    let r = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Open (creating, 0600) and migrate the store of `state_dir`.
pub fn open(state_dir: &Path) -> Result<Connection, RsbError> {
    ensure_private_dir(state_dir).map_err(|e| {
        RsbError::new(
            Kind::Config,
            format!(
                "cannot create the state directory {}: {}",
                state_dir.display(),
                e.kind()
            ),
            "set RSB_STATE_DIR to a writable directory",
        )
    })?;
    let path = db_path(state_dir);
    {
        // Create the file 0600 before SQLite does (it would use the umask).
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path);
    }
    let conn = Connection::open(&path).map_err(db_err)?;
    conn.busy_timeout(Duration::from_secs(5)).map_err(db_err)?;
    let _: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(db_err)?;
    // WAL makes NORMAL durable against process crashes (only a power loss can drop the last
    // commits), and it spares the daemon an fsync per tick.
    conn.execute_batch("PRAGMA synchronous=NORMAL;")
        .map_err(db_err)?;
    migrate(&conn)?;
    private_files(&path);
    Ok(conn)
}

fn migrate(conn: &Connection) -> Result<(), RsbError> {
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(db_err)?;
    if version > SCHEMA_VERSION {
        return Err(RsbError::new(
            Kind::Config,
            format!(
                "the state database is from a newer rsb (schema {version}, this rsb knows {SCHEMA_VERSION})"
            ),
            "upgrade rsb, or point RSB_STATE_DIR at another directory",
        ));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
        // IMMEDIATE: two processes opening a fresh store at once serialise here, and the
        // second sees the first's user_version instead of re-running the step.
        let r = conn.execute_batch("BEGIN IMMEDIATE;").and_then(|_| {
            let v: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
            if v > i as i64 {
                return conn.execute_batch("COMMIT;");
            }
            conn.execute_batch(&format!("{sql}; PRAGMA user_version = {}; COMMIT;", i + 1))
        });
        if let Err(e) = r {
            let _ = conn.execute_batch("ROLLBACK;");
            return Err(db_err(e));
        }
    }
    Ok(())
}

/// SQLite creates `-wal`/`-shm` with the umask; tighten them (and the database) to 0600.
fn private_files(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for suffix in ["", "-wal", "-shm"] {
        let p = PathBuf::from(format!("{}{suffix}", path.display()));
        if let Ok(m) = std::fs::metadata(&p)
            && m.permissions().mode() & 0o077 != 0
        {
            let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn fresh_store_is_private_and_at_the_latest_version() {
        let d = tmp();
        let state = d.path().join("state");
        let c = open(&state).unwrap();
        let v: i64 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        c.execute(
            "INSERT INTO daemon_meta (key, value, updated_ts) VALUES ('k', '{}', 1)",
            [],
        )
        .unwrap();
        assert_eq!(
            std::fs::metadata(&state).unwrap().permissions().mode() & 0o777,
            0o700
        );
        for suffix in ["", "-wal", "-shm"] {
            let p = PathBuf::from(format!("{}{suffix}", db_path(&state).display()));
            if p.exists() {
                // The -wal/-shm of an open connection are created after open: reopen tightens.
                drop(open(&state).unwrap());
                assert_eq!(
                    std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
                    0o600,
                    "{}",
                    p.display()
                );
            }
        }
    }

    #[test]
    fn a_version_1_database_upgrades_and_keeps_its_transfers() {
        let d = tmp();
        let path = db_path(d.path());
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch(&format!("{}; PRAGMA user_version = 1;", MIGRATIONS[0]))
                .unwrap();
            c.execute(
                "INSERT INTO transfer_tasks (direction, sandbox_name, local_path, remote_path,
                   created_ts, updated_ts) VALUES ('local_to_remote', 's', '/a', 'b', 1, 1)",
                [],
            )
            .unwrap();
        }
        let c = open(d.path()).unwrap();
        let n: i64 = c
            .query_row("SELECT COUNT(*) FROM transfer_tasks", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 1);
        let n: i64 = c
            .query_row("SELECT COUNT(*) FROM watches", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0);
        drop(c);
        // Reopening is a no-op.
        let c = open(d.path()).unwrap();
        let v: i64 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
    }

    #[test]
    fn a_newer_database_is_refused_not_damaged() {
        let d = tmp();
        drop(open(d.path()).unwrap());
        Connection::open(db_path(d.path()))
            .unwrap()
            .execute_batch("PRAGMA user_version = 999;")
            .unwrap();
        let e = open(d.path()).unwrap_err();
        assert!(e.message.contains("newer rsb"), "{}", e.message);
    }

    #[test]
    fn private_writes_are_atomic_and_0600() {
        let d = tmp();
        let p = d.path().join("x.json");
        write_private(&p, b"one").unwrap();
        write_private(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
