//! Watches in the store: registration, queries, cancel, and [`commit`], the one transaction
//! that writes a check's outcome together with its events ([`super::events`]).

use std::collections::BTreeMap;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde_json::{Map, Value};

use crate::{
    error::{Result, RsbError},
    store::{
        db_err,
        events::{self, NewEvent, WatchEvent},
        now_ms,
        watch_model::{Watch, one_line},
    },
};

/// A watch as registered (validated by `ops::watchdog`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewWatch {
    pub run_id: String,
    pub name: String,
    pub sandbox_name: String,
    /// The persisted definition the daemon connects with ([`crate::store::sandboxes`]).
    pub sandbox_fp: String,
    pub tmux_session: String,
    pub log_file: String,
    pub cwd: String,
    pub launch_command: String,
    pub resume_command: String,
    pub resume_plan: Map<String, Value>,
    pub checkpoint_path: String,
    pub checkpoint_format: String,
    pub checkpoint_command: String,
    pub interval_s: i64,
    pub max_log_lines: i64,
    pub webhook_url: String,
    pub event_command: String,
    pub auto_resume: bool,
    pub max_resume_attempts: i64,
    pub metadata: Map<String, Value>,
    pub notify_local: bool,
    pub alert_after_failures: i64,
    pub resume_delay_s: i64,
    pub stall_after_s: i64,
}

pub fn unknown_watch(id: i64) -> RsbError {
    RsbError::invalid(
        format!("Unknown watch id: {id}"),
        "list_background_watches (or `rsb watch list`) shows the watches",
    )
}

/// Insert a watch, due at once (as the seed: `next_check_ts == created_ts`).
pub fn insert(conn: &Connection, w: &NewWatch) -> Result<Watch> {
    let ms = now_ms();
    let ts = ms / 1000;
    conn.execute(
        "INSERT INTO watches (run_id, name, sandbox_name, tmux_session, log_file, cwd,
           launch_command, resume_command, resume_plan_json, checkpoint_path, checkpoint_format,
           checkpoint_command, interval_s, max_log_lines, webhook_url, event_command, auto_resume,
           max_resume_attempts, metadata_json, notify_local, alert_after_failures, resume_delay_s,
           stall_after_s, created_ts, updated_ts, next_check_ts, next_check_ms, sandbox_fp)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18,
           ?19, ?20, ?21, ?22, ?23, ?24, ?24, ?24, ?25, ?26)",
        params![
            if w.run_id.is_empty() {
                &w.tmux_session
            } else {
                &w.run_id
            },
            w.name,
            w.sandbox_name,
            w.tmux_session,
            w.log_file,
            w.cwd,
            w.launch_command,
            w.resume_command,
            Value::Object(w.resume_plan.clone()).to_string(),
            w.checkpoint_path,
            w.checkpoint_format,
            w.checkpoint_command,
            w.interval_s,
            w.max_log_lines,
            w.webhook_url,
            w.event_command,
            w.auto_resume as i64,
            w.max_resume_attempts,
            Value::Object(w.metadata.clone()).to_string(),
            w.notify_local as i64,
            w.alert_after_failures,
            w.resume_delay_s,
            w.stall_after_s,
            ts,
            ms,
            w.sandbox_fp,
        ],
    )
    .map_err(db_err)?;
    let id = conn.last_insert_rowid();
    get(conn, id)?.ok_or_else(|| RsbError::internal("a watch vanished right after its insert"))
}

pub fn get(conn: &Connection, id: i64) -> Result<Option<Watch>> {
    conn.query_row(
        "SELECT * FROM watches WHERE id = ?1",
        params![id],
        Watch::from_row,
    )
    .optional()
    .map_err(db_err)
}

pub fn require(conn: &Connection, id: i64) -> Result<Watch> {
    get(conn, id)?.ok_or_else(|| unknown_watch(id))
}

/// Newest first; `status` "" = all.
pub fn list(conn: &Connection, status: &str) -> Result<Vec<Watch>> {
    let mut st = conn
        .prepare("SELECT * FROM watches WHERE (?1 = '' OR status = ?1) ORDER BY id DESC")
        .map_err(db_err)?;
    let rows = st
        .query_map(params![status.trim()], Watch::from_row)
        .map_err(db_err)?;
    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(db_err)
}

/// Stop watching (the job itself keeps running, as the seed).
pub fn cancel(conn: &Connection, id: i64) -> Result<Watch> {
    let n = conn
        .execute(
            "UPDATE watches SET status = 'cancelled', next_check_ts = 0, next_check_ms = 0,
               updated_ts = ?2, rev = rev + 1 WHERE id = ?1",
            params![id, now_ms() / 1000],
        )
        .map_err(db_err)?;
    if n == 0 {
        return Err(unknown_watch(id));
    }
    require(conn, id)
}

/// Cancel the active watches of one job (a deliberate kill must not read as an interruption).
pub fn cancel_for_job(conn: &Connection, sandbox: &str, session: &str) -> Result<Vec<i64>> {
    let mut st = conn
        .prepare(
            "SELECT id FROM watches WHERE status = 'active' AND sandbox_name = ?1
               AND tmux_session = ?2",
        )
        .map_err(db_err)?;
    let ids: Vec<i64> = st
        .query_map(params![sandbox, session], |r| r.get(0))
        .map_err(db_err)?
        .collect::<rusqlite::Result<_>>()
        .map_err(db_err)?;
    for id in &ids {
        cancel(conn, *id)?;
    }
    Ok(ids)
}

/// Watches per status; `active`, `completed` and `cancelled` are always present.
pub fn counts(conn: &Connection) -> Result<BTreeMap<String, i64>> {
    let mut m: BTreeMap<String, i64> = ["active", "completed", "cancelled"]
        .into_iter()
        .map(|s| (s.to_string(), 0))
        .collect();
    let mut st = conn
        .prepare("SELECT status, COUNT(*) FROM watches GROUP BY status")
        .map_err(db_err)?;
    let rows = st
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .map_err(db_err)?;
    for r in rows {
        let (k, v) = r.map_err(db_err)?;
        m.insert(k, v);
    }
    Ok(m)
}

/// The active watches due at `now_ms`, soonest first.
pub fn due(conn: &Connection, now_ms: i64, limit: i64) -> Result<Vec<i64>> {
    let mut st = conn
        .prepare_cached(
            "SELECT id FROM watches WHERE status = 'active' AND next_check_ms <= ?1
             ORDER BY next_check_ms, id LIMIT ?2",
        )
        .map_err(db_err)?;
    st.query_map(params![now_ms, limit], |r| r.get(0))
        .map_err(db_err)?
        .collect::<rusqlite::Result<_>>()
        .map_err(db_err)
}

/// The sandboxes (fingerprint, name) with an active watch: where the daemon holds a job-event
/// subscription.
pub fn active_sandboxes(conn: &Connection) -> Result<Vec<(String, String)>> {
    let mut st = conn
        .prepare_cached(
            "SELECT DISTINCT sandbox_fp, sandbox_name FROM watches WHERE status = 'active'
             ORDER BY sandbox_fp, sandbox_name",
        )
        .map_err(db_err)?;
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .map_err(db_err)?
        .collect::<rusqlite::Result<_>>()
        .map_err(db_err)
}

/// The active watches of job `job` on one sandbox (fingerprint, name).
pub fn active_on(conn: &Connection, fp: &str, sandbox: &str, job: &str) -> Result<Vec<i64>> {
    let mut st = conn
        .prepare_cached(
            "SELECT id FROM watches WHERE status = 'active' AND sandbox_fp = ?1
             AND sandbox_name = ?2 AND tmux_session = ?3 ORDER BY id",
        )
        .map_err(db_err)?;
    st.query_map(params![fp, sandbox, job], |r| r.get(0))
        .map_err(db_err)?
        .collect::<rusqlite::Result<_>>()
        .map_err(db_err)
}

/// The earliest `next_check_ms` of an active watch.
pub fn next_due_ms(conn: &Connection) -> Result<Option<i64>> {
    conn.query_row(
        "SELECT MIN(next_check_ms) FROM watches WHERE status = 'active'",
        [],
        |r| r.get(0),
    )
    .map_err(db_err)
}

pub fn meta_get(conn: &Connection, key: &str) -> Result<Option<(Value, i64)>> {
    conn.query_row(
        "SELECT value, updated_ts FROM daemon_meta WHERE key = ?1",
        params![key],
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
    )
    .optional()
    .map_err(db_err)
    .map(|o| o.map(|(v, ts)| (serde_json::from_str(&v).unwrap_or(Value::Null), ts)))
}

pub fn meta_delete(conn: &Connection, key: &str) -> Result<()> {
    conn.execute("DELETE FROM daemon_meta WHERE key = ?1", params![key])
        .map(|_| ())
        .map_err(db_err)
}

pub fn meta_set(conn: &Connection, key: &str, value: &Value) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO daemon_meta (key, value, updated_ts) VALUES (?1, ?2, ?3)
         ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ts = excluded.updated_ts",
    )
    .and_then(|mut st| st.execute(params![key, value.to_string(), now_ms() / 1000]))
    .map(|_| ())
    .map_err(db_err)
}

/// Write `after` (a check's outcome for the watch read at revision `before_rev`) and insert its
/// events, in one transaction. `None` when the watch changed meanwhile (cancelled by a server,
/// say): nothing is written, and the next tick starts from the new row. `payload` builds each
/// event's payload from the watch as committed (what the payload looks like is the daemon's
/// business, that it is written with the row is the store's).
pub fn commit(
    conn: &mut Connection,
    before_rev: i64,
    after: &Watch,
    events: &[NewEvent],
    payload: impl Fn(&Watch, &NewEvent) -> Value,
) -> Result<Option<Vec<WatchEvent>>> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db_err)?;
    let ms = now_ms();
    let ts = ms / 1000;
    let last_event_ts = if events.is_empty() {
        after.last_event_ts
    } else {
        ts
    };
    let n = tx
        .execute(
            "UPDATE watches SET status = ?3, last_state = ?4, last_summary = ?5, last_error = ?6,
               last_exit_code = ?7, last_signal = ?8, last_log_digest = ?9, last_log_tail = ?10,
               last_checkpoint_text = ?11, last_checkpoint_digest = ?12,
               checkpoint_updated_ts = ?13, resume_attempts = ?14, consecutive_ssh_failures = ?15,
               ssh_alert_sent = ?16, interrupted_ts = ?17, resume_due_ts = ?18, updated_ts = ?19,
               last_checked_ts = ?20, next_check_ts = ?21, next_check_ms = ?22,
               last_event_ts = ?23, last_log_size = ?24, log_changed_ts = ?25,
               stall_alert_sent = ?26, resume_intent_ms = ?27, tmux_session = ?28,
               resume_launch_id = ?29, resume_launch_session = ?30, rev = rev + 1
             WHERE id = ?1 AND rev = ?2",
            params![
                after.id,
                before_rev,
                after.status,
                after.last_state,
                after.last_summary,
                after.last_error,
                after.last_exit_code,
                after.last_signal,
                after.last_log_digest,
                after.last_log_tail,
                after.last_checkpoint_text,
                after.last_checkpoint_digest,
                after.checkpoint_updated_ts,
                after.resume_attempts,
                after.consecutive_ssh_failures,
                after.ssh_alert_sent as i64,
                after.interrupted_ts,
                after.resume_due_ts,
                after.updated_ts.max(ts),
                after.last_checked_ts,
                after.next_check_ts,
                after.next_check_ms,
                last_event_ts,
                after.last_log_size,
                after.log_changed_ts,
                after.stall_alert_sent as i64,
                after.resume_intent_ms,
                after.tmux_session,
                after.resume_launch_id,
                after.resume_launch_session,
            ],
        )
        .map_err(db_err)?;
    if n == 0 {
        return Ok(None);
    }
    let mut snapshot = after.clone();
    snapshot.last_event_ts = last_event_ts;
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        out.push(events::insert(&tx, after.id, e, payload(&snapshot, e), ms)?);
    }
    tx.commit().map_err(db_err)?;
    Ok(Some(out))
}

/// Record an error that is not a state change (a panicked check, a failed alert).
pub fn record_error(conn: &Connection, id: i64, column: &str, msg: &str) -> Result<()> {
    let col = match column {
        "last_alert_error" => "last_alert_error",
        _ => "last_error",
    };
    conn.execute(
        &format!("UPDATE watches SET {col} = ?2, updated_ts = ?3 WHERE id = ?1"),
        params![id, one_line(msg), now_ms() / 1000],
    )
    .map(|_| ())
    .map_err(db_err)
}

/// A check that failed without an outcome (it panicked): record why, and try again next
/// interval rather than at once.
pub fn record_failed_check(conn: &Connection, id: i64, msg: &str, interval_s: i64) -> Result<()> {
    let next = now_ms() + interval_s.max(1) * 1000;
    conn.execute(
        "UPDATE watches SET last_error = ?2, last_checked_ts = ?3, next_check_ms = ?4,
           next_check_ts = ?4 / 1000, updated_ts = ?3 WHERE id = ?1",
        params![id, one_line(msg), now_ms() / 1000, next],
    )
    .map(|_| ())
    .map_err(db_err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watchdog::checks::{JobSeen, Observed, decide};

    fn new_watch() -> NewWatch {
        NewWatch {
            sandbox_name: "s".into(),
            tmux_session: "train".into(),
            log_file: "/h/train.log".into(),
            checkpoint_format: "text".into(),
            interval_s: 1,
            max_log_lines: 80,
            max_resume_attempts: 1,
            notify_local: true,
            alert_after_failures: 2,
            ..Default::default()
        }
    }

    #[test]
    fn register_list_cancel_and_events() {
        let d = tempfile::tempdir().unwrap();
        let mut c = crate::store::open(d.path()).unwrap();
        let w = insert(&c, &new_watch()).unwrap();
        assert_eq!((w.status.as_str(), w.run_id.as_str()), ("active", "train"));
        assert_eq!(w.next_check_ts, w.created_ts);
        assert_eq!(due(&c, now_ms(), 10).unwrap(), vec![w.id]);
        let exited = Observed::Job(JobSeen {
            state: Some(rsb_protocol::JobState::Exited),
            exit_code: Some(3),
            ..Default::default()
        });
        let o = decide(&w, &exited, now_ms());
        let evs = commit(
            &mut c,
            w.rev,
            &o.after,
            &o.events,
            crate::watchdog::checks::payload,
        )
        .unwrap()
        .unwrap();
        assert_eq!(evs.len(), 1);
        // The same outcome again (a stale revision) writes nothing: no repeated event.
        assert!(
            commit(
                &mut c,
                w.rev,
                &o.after,
                &o.events,
                crate::watchdog::checks::payload
            )
            .unwrap()
            .is_none()
        );
        let all = events::list(&c, 0, 20).unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].payload["exit_code"], 3);
        assert_eq!(all[0].payload["watch"]["status"], "completed");
        let f = events::write_file(d.path(), &all[0]).unwrap();
        assert_eq!(f, events::file_path(d.path(), all[0].id));
        let v: Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        assert_eq!(v["event_type"], "completed");
        assert_eq!(counts(&c).unwrap()["completed"], 1);
        let w2 = insert(&c, &new_watch()).unwrap();
        assert_eq!(cancel_for_job(&c, "s", "train").unwrap(), vec![w2.id]);
        assert_eq!(require(&c, w2.id).unwrap().status, "cancelled");
        assert_eq!(
            cancel(&c, 999).unwrap_err().message,
            "Unknown watch id: 999"
        );
        assert_eq!(list(&c, "cancelled").unwrap().len(), 1);
        assert_eq!(list(&c, "").unwrap()[0].id, w2.id, "newest first");
    }
}
