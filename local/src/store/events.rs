//! Watch events in the store: their types, the row and its file (`events/event-<id>.json`,
//! the seed's), the insert that [`super::watches::commit`] makes in its transaction, the
//! queries, and the delivery mark the daemon sets once a file and its alerts went out.
//! Retention removes a deleted row's file after the row ([`super::retention`]).

use std::path::{Path, PathBuf};

use rusqlite::{Connection, Row, Transaction, params};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::{error::Result, store::db_err};

/// The directory of event files under the state dir.
pub const DIR: &str = "events";
/// An event file's name is this, the event id and `.json`.
pub const FILE_PREFIX: &str = "event-";

// The event types: the seed's, plus `stalled`, `needs_credentials` and `gave_up`, and the
// Slurm ones: `requeued`, `timeout`, `out_of_memory`, `cancelled`, `scheduler_unreachable`.
pub const COMPLETED: &str = "completed";
pub const INTERRUPTED: &str = "interrupted";
pub const RESUME_STARTED: &str = "resume_started";
pub const RESUME_FAILED: &str = "resume_failed";
pub const SSH_UNREACHABLE: &str = "ssh_unreachable";
pub const RUNNING_RESTORED: &str = "running_restored";
pub const CONFIG_MISSING: &str = "config_missing";
pub const STALLED: &str = "stalled";
pub const NEEDS_CREDENTIALS: &str = "needs_credentials";
/// The job is interrupted and every resume attempt is used up: the watch ends (status
/// `gave_up`) instead of polling a dead job forever.
pub const GAVE_UP: &str = "gave_up";
/// Slurm put the job back in its queue (node failure or preemption with `requeue`): it
/// will run again by itself, so rsb does not resubmit it.
pub const REQUEUED: &str = "requeued";
/// Slurm ended the job at its time limit.
pub const TIMEOUT: &str = "timeout";
/// Slurm ended the job over its memory limit.
pub const OUT_OF_MEMORY: &str = "out_of_memory";
/// The job was cancelled outside rsb (`scancel`); `kill_background_task` ends the watch
/// before it kills, so it never raises this.
pub const CANCELLED: &str = "cancelled";
/// The Slurm controller did not answer: the job's state is unknown (never "lost").
pub const SCHEDULER_UNREACHABLE: &str = "scheduler_unreachable";
/// The events that report a run's end: each carries the run's `started_ms`, so a session
/// that heard the same end from the agent's stream tells it from a resumed run's.
pub const ENDS_RUN: [&str; 5] = [COMPLETED, INTERRUPTED, TIMEOUT, OUT_OF_MEMORY, CANCELLED];

/// One event row; `events/event-<id>.json` holds exactly this, indented (the seed's file).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WatchEvent {
    pub id: i64,
    pub watch_id: i64,
    pub event_type: String,
    pub summary: String,
    pub created_ts: i64,
    pub payload: Value,
}

impl WatchEvent {
    pub fn from_row(r: &Row<'_>) -> rusqlite::Result<WatchEvent> {
        Ok(WatchEvent {
            id: r.get("id")?,
            watch_id: r.get("watch_id")?,
            event_type: r.get("event_type")?,
            summary: r.get("summary")?,
            created_ts: r.get("created_ts")?,
            payload: serde_json::from_str(&r.get::<_, String>("payload_json")?)
                .unwrap_or(Value::Null),
        })
    }
}

/// An event a check decided on, before the store gives it an id and its payload.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub event_type: &'static str,
    pub summary: String,
    /// Keys added to the payload after the seed's common ones.
    pub extra: Map<String, Value>,
}

/// Insert `e` for watch `watch_id` with its `payload` (inside a check's commit).
pub(crate) fn insert(
    tx: &Transaction<'_>,
    watch_id: i64,
    e: &NewEvent,
    payload: Value,
    ms: i64,
) -> Result<WatchEvent> {
    let ts = ms / 1000;
    tx.execute(
        "INSERT INTO watch_events (watch_id, event_type, summary, payload_json, created_ts,
           created_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![
            watch_id,
            e.event_type,
            e.summary,
            payload.to_string(),
            ts,
            ms
        ],
    )
    .map_err(db_err)?;
    Ok(WatchEvent {
        id: tx.last_insert_rowid(),
        watch_id,
        event_type: e.event_type.to_string(),
        summary: e.summary.clone(),
        created_ts: ts,
        payload,
    })
}

/// Newest first; `watch_id` 0 = all watches.
pub fn list(conn: &Connection, watch_id: i64, limit: i64) -> Result<Vec<WatchEvent>> {
    let mut st = conn
        .prepare(
            "SELECT * FROM watch_events WHERE (?1 <= 0 OR watch_id = ?1) ORDER BY id DESC
             LIMIT ?2",
        )
        .map_err(db_err)?;
    let rows = st
        .query_map(params![watch_id, limit], WatchEvent::from_row)
        .map_err(db_err)?;
    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(db_err)
}

/// Events whose file or alerts may not have gone out (the daemon stopped right after their
/// commit).
pub fn undelivered(conn: &Connection) -> Result<Vec<(WatchEvent, i64)>> {
    let mut st = conn
        .prepare("SELECT * FROM watch_events WHERE delivered = 0 ORDER BY id")
        .map_err(db_err)?;
    let rows = st
        .query_map([], |r| Ok((WatchEvent::from_row(r)?, r.get("created_ms")?)))
        .map_err(db_err)?;
    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(db_err)
}

pub fn mark_delivered(conn: &Connection, event_id: i64) -> Result<()> {
    conn.execute(
        "UPDATE watch_events SET delivered = 1 WHERE id = ?1",
        params![event_id],
    )
    .map(|_| ())
    .map_err(db_err)
}

/// `<state_dir>/events`: one file per event, for hooks and users that read files.
pub fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join(DIR)
}

/// Where the file of event `id` is (whether or not it was written).
pub fn file_path(state_dir: &Path, id: i64) -> PathBuf {
    dir(state_dir).join(format!("{FILE_PREFIX}{id}.json"))
}

/// `<state_dir>/events/event-<id>.json`: the event row, indented (the seed's file), 0600.
pub fn write_file(state_dir: &Path, e: &WatchEvent) -> std::io::Result<PathBuf> {
    crate::store::ensure_private_dir(&dir(state_dir))?;
    let path = file_path(state_dir, e.id);
    let body = serde_json::to_string_pretty(&json!(e)).unwrap_or_default();
    crate::store::write_private(&path, body.as_bytes())?;
    Ok(path)
}
