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
    time::Duration,
};

use rusqlite::Connection;

use crate::error::{Kind, RsbError};

pub mod baselines;
pub mod clock;
pub mod events;
pub mod forwards;
pub mod handle;
pub mod layout;
pub mod retention;
pub mod roots_lock;
pub mod sandboxes;
pub mod schema;
pub mod transfers;
pub mod watch_model;
pub mod watches;

use schema::MIGRATIONS;

pub const DB_FILE: &str = "rsb.sqlite3";

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

pub fn db_path(state_dir: &Path) -> PathBuf {
    state_dir.join(DB_FILE)
}

pub use clock::{now_ms, now_s};
pub use handle::Store;

/// What to do about a store that cannot be used (the hint of every such error).
pub const UNUSABLE_HINT: &str = "run `rsb state check`; to start afresh, move rsb.sqlite3 out of \
     the state dir (RSB_STATE_DIR): the next sync of each root is then a first sync";

/// A store error as one line. A database SQLite cannot read (not a database, damaged pages)
/// says so and how to get out, instead of reading as empty.
pub fn db_err(e: impl std::fmt::Display + 'static) -> RsbError {
    use rusqlite::ErrorCode::{DatabaseCorrupt, NotADatabase};
    let code = (&e as &dyn std::any::Any)
        .downcast_ref::<rusqlite::Error>()
        .and_then(|e| e.sqlite_error_code());
    if matches!(code, Some(DatabaseCorrupt | NotADatabase)) {
        return unusable(e);
    }
    RsbError::new(
        Kind::Internal,
        format!("state database error: {e}"),
        "check free space and permissions of the rsb state dir (RSB_STATE_DIR)",
    )
}

fn unusable(why: impl std::fmt::Display) -> RsbError {
    RsbError::new(
        Kind::Config,
        format!("the state database is unusable: {why}"),
        UNUSABLE_HINT,
    )
}

/// `PRAGMA quick_check`: every page and index readable. [`open`] runs it once per process (see
/// [`check_once`]), so page damage is an error up front and never comes out later as a missing
/// row.
pub fn check(conn: &Connection) -> Result<(), RsbError> {
    verdict(quick_check(conn).map_err(db_err)?)
}

fn quick_check(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare("PRAGMA quick_check(3)")?;
    stmt.query_map([], |r| r.get(0))?.collect()
}

/// Ok when `quick_check` said `ok`; else the problem it names. The first lines say what is
/// wrong; a row may hold several lines, and a "*** in database main ***" heading says nothing.
fn verdict(lines: Vec<String>) -> Result<(), RsbError> {
    if lines == ["ok"] {
        return Ok(());
    }
    let what = lines
        .iter()
        .flat_map(|l| l.lines())
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("*** in database"))
        .unwrap_or("the integrity check failed");
    Err(unusable(what))
}

/// [`check`] once per process and database: every path that relies on the store (a server's
/// transfers and baselines, the daemon, watches, forwards, the CLI) opens it through [`open`],
/// so damage is found before the first write, whichever path comes first, and costs one scan
/// per process. A failed check is not remembered: the next open checks again. An empty file
/// (a store being created) has nothing to check. Another process creating the store or
/// switching it to WAL can hold it for a moment: the check waits for it.
fn check_once(conn: &Connection, path: &Path) -> Result<(), RsbError> {
    static CHECKED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    if std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
        return Ok(());
    }
    let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    if checked.contains(&key) {
        return Ok(());
    }
    // Under the lock: two threads opening at once check once.
    verdict(retry_busy(|| quick_check(conn)).map_err(db_err)?)?;
    checked.push(key);
    Ok(())
}

/// `f` again while it fails with SQLite's busy or locked, for up to 5 s (the busy timeout):
/// for the statements SQLite answers at once instead of waiting for the lock.
fn retry_busy<T>(mut f: impl FnMut() -> rusqlite::Result<T>) -> rusqlite::Result<T> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match f() {
            Err(e)
                if matches!(
                    e.sqlite_error_code(),
                    Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                ) && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Lives in config, which creates the state dir before any store exists and must not depend
/// on the store.
pub use crate::config::ensure_private_dir;

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
    // Before anything writes (the journal mode, a migration): damaged pages are one error
    // here, and the damaged file is left as it was for `rsb state check` and the user.
    check_once(&conn, &path)?;
    // Switching a store that another process is creating to WAL can fail at once with "database
    // is locked" (SQLite does not wait for that lock): `rsb watchdog status` while a daemon
    // started said so. Wait for it like any other lock.
    let _: String = retry_busy(|| conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0)))
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
            "upgrade rsb, point RSB_STATE_DIR at another directory, or move rsb.sqlite3 aside \
             (the next sync of each root is then a first sync)",
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
