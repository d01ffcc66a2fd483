//! What the state dir holds ([`usage`]) and how long it keeps it ([`Policy`], [`prune`]), with
//! defaults a user never has to think about: events and logs 30 days or a size cap, finished
//! transfers 7 days, baselines of roots not synced for 90 days, the daemon log rotated at a
//! size. A persisted sandbox definition goes when no server has stored it for 90 days and no
//! watch, task or forward still names it (each config change adds one, [`super::sandboxes`]). The daemon prunes once an hour and `rsb state prune` prunes now.
//!
//! Ages are read against [`super::clock`], so a test can run the daemon's hours in seconds and
//! prune as if months had passed (`a_busy_day_stays_under_the_state_dir_bound_and_prune_brings_it_back`).
//!
//! A baseline's `updated_ts` says when its root was last synced (a no-change resync touches it
//! at most once a day, [`super::baselines::touch`]), so a root that keeps being synced keeps
//! its conflict detection however long nothing changes.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, params};
use serde::Serialize;

use crate::{
    error::Result,
    store::{DB_FILE, db_err, events, layout, now_s},
};

const DAY: i64 = 86_400;

/// How long each kind of record is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Watch events (rows and `events/*.json`) and finished watches.
    pub events_days: i64,
    /// The payloads of all watch events together are kept under this many bytes (oldest go
    /// first), whatever their age.
    pub events_max_bytes: i64,
    /// Finished transfer tasks and their `transfers/*.log`.
    pub transfers_days: i64,
    /// Baselines of roots not synced for this long.
    pub baselines_days: i64,
    /// `watchdog.log` is rotated (to `watchdog.log.1`, replacing it) above this size.
    pub daemon_log_max_bytes: u64,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            events_days: 30,
            events_max_bytes: 16 << 20,
            transfers_days: 7,
            baselines_days: 90,
            daemon_log_max_bytes: 4 << 20,
        }
    }
}

/// The documented bound on a state dir under the default policy (database, WAL, event files
/// and logs together), which the soak test holds it to.
pub const STATE_DIR_BOUND_BYTES: u64 = 50 << 20;

/// One line of `rsb state`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Entry {
    /// A file or directory of the state dir, relative to it.
    pub path: String,
    pub bytes: u64,
    /// Rows (tables) or files (directories).
    pub count: u64,
    pub what: &'static str,
}

/// What the state dir holds, file by file and table by table.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub state_dir: String,
    pub total_bytes: u64,
    pub files: Vec<Entry>,
    pub tables: Vec<Entry>,
}

fn file_size(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

fn dir_usage(dir: &Path) -> (u64, u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    rd.flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .fold((0, 0), |(b, n), m| (b + m.len(), n + 1))
}

const TABLES: &[(&str, &str, &str)] = &[
    (
        "watch_events",
        "length(payload_json) + length(summary)",
        "watch events",
    ),
    ("watches", "length(resume_plan_json) + 512", "watched jobs"),
    (
        "transfer_tasks",
        "length(progress_json) + length(result_json) + length(spec_json)",
        "background transfers",
    ),
    ("sync_baselines", "length(entries_json)", "sync baselines"),
    (
        "sync_journal",
        "length(entries_json) + 64",
        "commits of syncs killed before their end",
    ),
    (
        "sandbox_defs",
        "length(def_json)",
        "persisted sandbox definitions",
    ),
    (
        "sandboxes",
        "length(def_json)",
        "sandbox definitions from before fingerprints",
    ),
    ("forwards", "length(stats_json) + 128", "detached forwards"),
    (
        "daemon_meta",
        "length(value)",
        "daemon heartbeat and settings",
    ),
];

/// Sizes of the state dir's files, and rows (with their approximate bytes) of each table.
/// `conn` is `None` when the database could not be opened (the files are still listed).
pub fn usage(state_dir: &Path, conn: Option<&Connection>) -> Result<Usage> {
    let mut files = Vec::new();
    for (name, what) in [
        (DB_FILE.to_string(), "the store"),
        (format!("{DB_FILE}-wal"), "the store's write-ahead log"),
        (format!("{DB_FILE}-shm"), "the store's shared memory index"),
    ] {
        let p = state_dir.join(&name);
        if p.exists() {
            files.push(Entry {
                path: name,
                bytes: file_size(&p),
                count: 1,
                what,
            });
        }
    }
    for &(name, is_dir, what) in layout::ENTRIES {
        let p = state_dir.join(name);
        if !is_dir {
            if p.exists() {
                files.push(Entry {
                    path: name.to_string(),
                    bytes: file_size(&p),
                    count: 1,
                    what,
                });
            }
            continue;
        }
        let (bytes, count) = dir_usage(&p);
        if count > 0 {
            files.push(Entry {
                path: format!("{name}/"),
                bytes,
                count,
                what,
            });
        }
    }
    let mut tables = Vec::new();
    if let Some(c) = conn {
        for (t, size, what) in TABLES {
            let (count, bytes): (i64, i64) = c
                .query_row(
                    &format!("SELECT COUNT(*), COALESCE(SUM({size}), 0) FROM {t}"),
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .map_err(db_err)?;
            tables.push(Entry {
                path: (*t).to_string(),
                bytes: bytes as u64,
                count: count as u64,
                what,
            });
        }
    }
    Ok(Usage {
        state_dir: state_dir.display().to_string(),
        total_bytes: files.iter().map(|e| e.bytes).sum(),
        files,
        tables,
    })
}

/// What one [`prune`] removed.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Pruned {
    pub events: u64,
    pub event_files: u64,
    pub watches: u64,
    pub transfers: u64,
    pub transfer_logs: u64,
    pub baselines: u64,
    /// Journal rows of killed syncs whose baseline is gone or past the policy.
    pub journal: u64,
    /// `sync-locks/` files of roots not synced for as long as a baseline is kept.
    pub sync_locks: u64,
    /// Persisted sandbox definitions nothing refers to any more.
    pub sandboxes: u64,
    pub daemon_log_rotated: bool,
    /// Bytes the state dir's files shrank by (after the WAL checkpoint and vacuum).
    pub bytes_freed: u64,
}

/// Apply `policy` now (`now` in Unix seconds): delete what is past it, in the database and the
/// files that belong to the deleted rows, then give the space back (WAL checkpoint, vacuum).
pub fn prune(state_dir: &Path, conn: &Connection, policy: &Policy, now: i64) -> Result<Pruned> {
    let before = usage(state_dir, None)?.total_bytes;
    let mut out = Pruned::default();
    let tx = conn.unchecked_transaction().map_err(db_err)?;
    let ev_cut = now - policy.events_days * DAY;
    // Event ids whose files go with them: the old ones, then the oldest beyond the size cap.
    let mut gone: Vec<i64> = ids(
        &tx,
        "SELECT id FROM watch_events WHERE created_ts < ?1",
        ev_cut,
    )?;
    let mut total: i64 = tx
        .query_row(
            "SELECT COALESCE(SUM(length(payload_json) + length(summary)), 0) FROM watch_events
             WHERE created_ts >= ?1",
            [ev_cut],
            |r| r.get(0),
        )
        .map_err(db_err)?;
    if total > policy.events_max_bytes {
        let mut st = tx
            .prepare(
                "SELECT id, length(payload_json) + length(summary) FROM watch_events
                 WHERE created_ts >= ?1 ORDER BY id",
            )
            .map_err(db_err)?;
        let rows: Vec<(i64, i64)> = st
            .query_map([ev_cut], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|r| r.collect())
            .map_err(db_err)?;
        for (id, n) in rows {
            if total <= policy.events_max_bytes {
                break;
            }
            total -= n;
            gone.push(id);
        }
    }
    for id in &gone {
        tx.execute("DELETE FROM watch_events WHERE id = ?1", [id])
            .map_err(db_err)?;
    }
    out.events = gone.len() as u64;
    out.watches = tx
        .execute(
            "DELETE FROM watches WHERE status != 'active' AND updated_ts < ?1
             AND id NOT IN (SELECT watch_id FROM watch_events)",
            [ev_cut],
        )
        .map_err(db_err)? as u64;
    let tr_cut = (now - policy.transfers_days * DAY) as f64;
    let logs: Vec<String> = {
        let mut st = tx
            .prepare(
                "SELECT log_file FROM transfer_tasks WHERE status IN
                 ('completed', 'failed', 'cancelled', 'interrupted') AND finished_ts > 0
                 AND finished_ts < ?1",
            )
            .map_err(db_err)?;
        st.query_map([tr_cut], |r| r.get(0))
            .and_then(|r| r.collect())
            .map_err(db_err)?
    };
    out.transfers = tx
        .execute(
            "DELETE FROM transfer_tasks WHERE status IN
             ('completed', 'failed', 'cancelled', 'interrupted') AND finished_ts > 0
             AND finished_ts < ?1",
            [tr_cut],
        )
        .map_err(db_err)? as u64;
    out.baselines = tx
        .execute(
            "DELETE FROM sync_baselines WHERE updated_ts < ?1",
            params![now - policy.baselines_days * DAY],
        )
        .map_err(db_err)? as u64;
    // The journal of a killed sync is folded by the next load; one whose baseline is gone
    // (or that no sync of its roots came back for) would only be dropped by it.
    out.journal = tx
        .execute(
            "DELETE FROM sync_journal WHERE created_ts < ?1 OR NOT EXISTS (
               SELECT 1 FROM sync_baselines b WHERE b.local_root = sync_journal.local_root
               AND b.sandbox_name = sync_journal.sandbox_name
               AND b.remote_root = sync_journal.remote_root)",
            params![now - policy.baselines_days * DAY],
        )
        .map_err(db_err)? as u64;
    // After the rows above went, so a definition only they named goes in the same pass.
    out.sandboxes = tx
        .execute(
            "DELETE FROM sandbox_defs WHERE updated_ts < ?1
             AND fingerprint NOT IN (SELECT sandbox_fp FROM watches)
             AND fingerprint NOT IN (SELECT sandbox_fp FROM transfer_tasks)
             AND fingerprint NOT IN (SELECT sandbox_fp FROM forwards)",
            params![now - policy.baselines_days * DAY],
        )
        .map_err(db_err)? as u64;
    tx.commit().map_err(db_err)?;

    // Files only after the rows are gone: a reader never finds a row whose file was removed
    // first. Event files of deleted rows, and any older than the policy (orphans).
    for id in &gone {
        if std::fs::remove_file(events::file_path(state_dir, *id)).is_ok() {
            out.event_files += 1;
        }
    }
    out.event_files += remove_older(
        &events::dir(state_dir),
        events::FILE_PREFIX,
        policy.events_days,
        now,
    );
    let tr_dir = state_dir.join(layout::TRANSFER_LOGS);
    for log in logs.iter().filter(|l| !l.is_empty()) {
        let p = PathBuf::from(log);
        // Only a log inside this state dir's transfers/ (a row is data, not a path to trust).
        if p.parent() == Some(tr_dir.as_path()) && std::fs::remove_file(&p).is_ok() {
            out.transfer_logs += 1;
        }
    }
    out.transfer_logs += remove_older(&tr_dir, "transfer-", policy.transfers_days, now);
    out.sync_locks = super::roots_lock::prune(state_dir, policy.baselines_days, now);
    out.daemon_log_rotated = rotate_log(
        &state_dir.join(layout::DAEMON_LOG),
        policy.daemon_log_max_bytes,
    );
    // Give the space back: the WAL to the database, then the database's free pages.
    let _ = conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);");
    if out != Pruned::default() {
        let _ = conn.execute_batch("VACUUM; PRAGMA wal_checkpoint(TRUNCATE);");
    }
    out.bytes_freed = before.saturating_sub(usage(state_dir, None)?.total_bytes);
    Ok(out)
}

fn ids(conn: &Connection, sql: &str, arg: i64) -> Result<Vec<i64>> {
    let mut st = conn.prepare(sql).map_err(db_err)?;
    st.query_map([arg], |r| r.get(0))
        .and_then(|r| r.collect())
        .map_err(db_err)
}

/// Remove `dir/<prefix>*` files not modified for `days` before `now`; how many.
fn remove_older(dir: &Path, prefix: &str, days: i64, now: i64) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let cut = now - days.max(0) * DAY;
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().starts_with(prefix) {
            continue;
        }
        if let Ok(m) = e.metadata()
            && m.is_file()
            && super::clock::modified_before(&m, cut)
            && std::fs::remove_file(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

/// Copy `log` to `log.1` and truncate it when it is over `max` bytes. Truncating in place (not
/// renaming) keeps a daemon's append-mode descriptor writing to `log`.
pub fn rotate_log(log: &Path, max: u64) -> bool {
    if file_size(log) <= max {
        return false;
    }
    let old = PathBuf::from(format!("{}.1", log.display()));
    if std::fs::copy(log, &old).is_err() {
        return false;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(log)
        .and_then(|f| f.set_len(0))
        .is_ok()
}

/// Now, for callers that prune with the wall clock.
pub fn prune_now(state_dir: &Path, conn: &Connection, policy: &Policy) -> Result<Pruned> {
    prune(state_dir, conn, policy, now_s())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prune_drops_what_is_past_the_policy_and_keeps_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let c = crate::store::open(d.path()).unwrap();
        let now = 100 * DAY;
        let old = now - 31 * DAY;
        c.execute_batch(&format!(
            "INSERT INTO watches (id, run_id, name, sandbox_name, tmux_session, log_file, cwd,
               launch_command, resume_command, status, created_ts, updated_ts)
             VALUES (1, 'r', 'n', 's', 't', 'l', '', '', '', 'completed', {old}, {old}),
                    (2, 'r', 'n', 's', 't2', 'l', '', '', '', 'active', {old}, {old});
             INSERT INTO watch_events (id, watch_id, event_type, summary, payload_json, created_ts)
             VALUES (1, 1, 'completed', 'old', '{{}}', {old}),
                    (2, 2, 'interrupted', 'new', '{{}}', {now});
             INSERT INTO transfer_tasks (direction, sandbox_name, local_path, remote_path,
               status, finished_ts, created_ts, updated_ts)
             VALUES ('upload', 's', '/a', 'b', 'completed', {t_old}, 0, 0),
                    ('upload', 's', '/a', 'b', 'completed', {t_new}, 0, 0),
                    ('upload', 's', '/a', 'b', 'running', 0, 0, 0);
             INSERT INTO sync_baselines (local_root, sandbox_name, remote_root, entries_json,
               updated_ts) VALUES ('/a', 's', 'b', '{{}}', {b_old}),
                                  ('/c', 's', 'd', '{{}}', {b_new});
             INSERT INTO sync_journal (local_root, sandbox_name, remote_root, entries_json,
               created_ts) VALUES ('/a', 's', 'b', '{{}}', {now}),
                                  ('/c', 's', 'd', '{{}}', {now}),
                                  ('/c', 's', 'd', '{{}}', {b_old}),
                                  ('/e', 's', 'f', '{{}}', {now});
             UPDATE watches SET sandbox_fp = 'fp-watched' WHERE id = 2;
             INSERT INTO sandbox_defs VALUES ('fp-old', 's', '{{}}', {b_old}),
                                             ('fp-watched', 's', '{{}}', {b_old}),
                                             ('fp-new', 's', '{{}}', {b_new});",
            t_old = now - 8 * DAY,
            t_new = now - 6 * DAY,
            b_old = now - 91 * DAY,
            b_new = now - 89 * DAY,
        ))
        .unwrap();
        let ev = d.path().join("events");
        std::fs::create_dir_all(&ev).unwrap();
        std::fs::write(ev.join("event-1.json"), "{}").unwrap();
        std::fs::write(ev.join("event-2.json"), "{}").unwrap();
        let p = prune(d.path(), &c, &Policy::default(), now).unwrap();
        assert_eq!(
            (
                p.events,
                p.event_files,
                p.watches,
                p.transfers,
                p.baselines,
                p.journal,
                p.sandboxes
            ),
            (1, 1, 1, 1, 1, 3, 1),
            "{p:?}"
        );
        assert!(!ev.join("event-1.json").exists() && ev.join("event-2.json").exists());
        let n = |t: &str| -> i64 {
            c.query_row(&format!("SELECT COUNT(*) FROM {t}"), [], |r| r.get(0))
                .unwrap()
        };
        assert_eq!(
            (
                n("watches"),
                n("watch_events"),
                n("transfer_tasks"),
                n("sync_baselines"),
                n("sync_journal"),
                n("sandbox_defs")
            ),
            (1, 1, 2, 1, 1, 2),
            "the journal of a kept baseline stays while it is recent"
        );
        // Nothing left past the policy: a second prune removes nothing.
        let again = prune(d.path(), &c, &Policy::default(), now).unwrap();
        assert_eq!(
            again.events
                + again.transfers
                + again.baselines
                + again.journal
                + again.watches
                + again.sandboxes,
            0
        );
    }

    #[test]
    fn the_event_size_cap_drops_the_oldest_first() {
        let d = tempfile::tempdir().unwrap();
        let c = crate::store::open(d.path()).unwrap();
        c.execute_batch(
            "INSERT INTO watches (id, run_id, name, sandbox_name, tmux_session, log_file, cwd,
               launch_command, resume_command, status, created_ts, updated_ts)
             VALUES (1, 'r', 'n', 's', 't', 'l', '', '', '', 'active', 0, 0)",
        )
        .unwrap();
        let big = "x".repeat(1000);
        for i in 1..=10 {
            c.execute(
                "INSERT INTO watch_events (id, watch_id, event_type, summary, payload_json,
                   created_ts) VALUES (?1, 1, 'stalled', '', ?2, ?3)",
                params![i, big, 1000 + i],
            )
            .unwrap();
        }
        let policy = Policy {
            events_max_bytes: 4500,
            ..Policy::default()
        };
        let p = prune(d.path(), &c, &policy, 2000).unwrap();
        assert_eq!(p.events, 6);
        let first: i64 = c
            .query_row("SELECT MIN(id) FROM watch_events", [], |r| r.get(0))
            .unwrap();
        assert_eq!(first, 7);
    }

    #[test]
    fn a_big_daemon_log_is_rotated_in_place() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("watchdog.log");
        std::fs::write(&log, vec![b'a'; 100]).unwrap();
        assert!(!rotate_log(&log, 100));
        std::fs::write(&log, vec![b'a'; 101]).unwrap();
        assert!(rotate_log(&log, 100));
        assert_eq!(file_size(&log), 0);
        assert_eq!(file_size(&d.path().join("watchdog.log.1")), 101);
    }
}
