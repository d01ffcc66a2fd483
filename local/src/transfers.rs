//! Background file transfers: a sync above the inline limits runs as a tokio task inside the
//! server process, with a durable SQLite record (`<state_dir>/rsb.sqlite3`, table
//! `transfer_tasks`) and a per-task log (`<state_dir>/transfers/transfer-<id>.log`).
//!
//! Differences from the seed (one detached OS process per task, never reaped): a task here is
//! a task of the server that started it, so `cancel_file_transfer_task` cancels it for real
//! (within a second; nothing partial is left at the destination), and a task whose server
//! died is reported as `interrupted` instead of `running` forever. A task owned by another
//! live rsb server sharing the state dir is cancelled through a flag that its owner polls.
//!
//! The table lives in the shared store ([`crate::store`]), which owns the schema and migrations.

use std::{
    collections::HashMap,
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{
    error::{Kind, Result, RsbError},
    pool::Pool,
    sync::{Progress, SyncSpec},
};

pub use crate::store::DB_FILE;
/// Progress is written to the database at most this often (plus a final write).
const PROGRESS_WRITE_EVERY: Duration = Duration::from_millis(500);
/// A progress line goes to the task log at most this often while bytes move.
const LOG_PROGRESS_EVERY: Duration = Duration::from_secs(5);
const LOG_TAIL_READ: u64 = 80_000;
const LOG_TAIL_MAX_CHARS: usize = 20_000;

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn db_err(e: impl std::fmt::Display) -> RsbError {
    RsbError::new(
        Kind::Internal,
        format!("transfer database error: {e}"),
        "check free space and permissions of the rsb state dir (RSB_STATE_DIR)",
    )
}

fn is_terminal(status: &str) -> bool {
    matches!(status, "completed" | "failed" | "cancelled" | "interrupted")
}

/// Start time of a process (clock ticks since boot), recorded next to its pid so a live owner
/// can be told from a reused pid. Empty where /proc is unavailable.
fn process_start(pid: u32) -> String {
    rsb_agent::proc::start_ticks(pid)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// Whether the recorded owner is still that process, by the agent's one identity check
/// (`rsb_agent::proc::is_alive`): a zombie is not a live owner, and neither is a process with
/// another start time that was given the same pid.
fn pid_alive(pid: i64, start: &str) -> bool {
    let Ok(pid) = u32::try_from(pid) else {
        return false;
    };
    let started = match start {
        "" => None,
        s => match s.parse() {
            Ok(t) => Some(t),
            Err(_) => return false,
        },
    };
    rsb_agent::proc::is_alive(pid, started)
}

/// `YYYY-MM-DDTHH:MM:SSZ` (UTC).
fn utc_stamp(ts: f64) -> String {
    let secs = ts as i64;
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    // Civil from days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        sod / 3600,
        (sod / 60) % 60,
        sod % 60
    )
}

fn append_log(path: &Path, line: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}

/// The last `n` lines of a log (reading at most its last 80 kB; at most 20,000 chars).
pub fn log_tail(path: &Path, n: usize) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(LOG_TAIL_READ);
    let _ = f.seek(SeekFrom::Start(start));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(n);
    let mut out = lines[from..].join("\n");
    if out.chars().count() > LOG_TAIL_MAX_CHARS {
        let skip = out.chars().count() - LOG_TAIL_MAX_CHARS;
        out = out.chars().skip(skip).collect();
    }
    out
}

fn progress_json(p: &Progress, synced_type: &str) -> Value {
    let mut v = json!({
        "phase": p.phase.as_str(),
        "files_done": p.files_done,
        "files_total": p.files_total,
        "bytes_done": p.bytes_done,
        "bytes_total": p.bytes_total,
        "current_path": p.current_path,
        "rate_bps": p.rate_bps.round(),
        "elapsed_s": (p.elapsed_s * 100.0).round() / 100.0,
    });
    if !synced_type.is_empty() {
        v["synced_type"] = json!(synced_type);
    }
    v
}

struct Live {
    cancel: CancellationToken,
    done: watch::Receiver<bool>,
    abort: tokio::task::AbortHandle,
}

/// One row of `transfer_tasks`, as the tools need it.
struct Row {
    status: String,
    pid: i64,
    owner_start: String,
    log_file: String,
    last_error: String,
    result_json: String,
    progress_json: String,
    finished_ts: f64,
    started_ts: f64,
}

pub struct Transfers {
    state_dir: PathBuf,
    db: Mutex<Connection>,
    live: Mutex<HashMap<i64, Live>>,
    my_start: String,
}

impl Transfers {
    /// Open (creating, 0600) and migrate `<state_dir>/rsb.sqlite3`.
    pub fn open(state_dir: &Path) -> Result<Transfers> {
        // The schema, its migrations and the file modes live in the shared store.
        let conn = crate::store::open(state_dir)?;
        Ok(Transfers {
            state_dir: state_dir.to_path_buf(),
            db: Mutex::new(conn),
            live: Mutex::new(HashMap::new()),
            my_start: process_start(std::process::id()),
        })
    }

    pub fn db_path(&self) -> PathBuf {
        self.state_dir.join(DB_FILE)
    }

    fn row(&self, id: i64) -> Result<Option<Row>> {
        let db = self.db.lock();
        db.query_row(
            "SELECT status, pid, owner_start, log_file, last_error, result_json, progress_json,
                    finished_ts, started_ts FROM transfer_tasks WHERE id = ?1",
            params![id],
            |r| {
                Ok(Row {
                    status: r.get(0)?,
                    pid: r.get(1)?,
                    owner_start: r.get(2)?,
                    log_file: r.get(3)?,
                    last_error: r.get(4)?,
                    result_json: r.get(5)?,
                    progress_json: r.get(6)?,
                    finished_ts: r.get(7)?,
                    started_ts: r.get(8)?,
                })
            },
        )
        .optional()
        .map_err(db_err)
    }

    fn exec(&self, sql: &str, p: impl rusqlite::Params) -> Result<()> {
        self.db.lock().execute(sql, p).map(|_| ()).map_err(db_err)
    }

    fn unknown(id: i64) -> RsbError {
        RsbError::invalid(
            format!("Unknown transfer task id: {id}"),
            "use the task_id returned by sync_local_to_remote",
        )
    }

    /// Record and start a background sync; returns the seed's background reply.
    pub fn start(
        self: &Arc<Self>,
        pool: Arc<Pool>,
        sandbox: String,
        spec: SyncSpec,
        excludes: &[String],
        exclude_file: &str,
    ) -> Result<Value> {
        let ts = now();
        let pid = std::process::id() as i64;
        let local = spec.local_path.display().to_string();
        let id = {
            let db = self.db.lock();
            db.execute(
                "INSERT INTO transfer_tasks (direction, sandbox_name, local_path, remote_path,
                   delete_extras, excludes_json, exclude_file, status, pid, owner_start,
                   progress_json, created_ts, updated_ts)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'queued', ?8, ?9, ?10, ?11, ?11)",
                params![
                    spec.direction.as_str(),
                    sandbox,
                    local,
                    spec.remote_path,
                    spec.delete_extras as i64,
                    serde_json::to_string(excludes).unwrap_or_else(|_| "[]".into()),
                    exclude_file,
                    pid,
                    self.my_start,
                    json!({"phase": "queued"}).to_string(),
                    ts,
                ],
            )
            .map_err(db_err)?;
            db.last_insert_rowid()
        };
        let dir = self.state_dir.join("transfers");
        let _ = std::fs::create_dir_all(&dir);
        let log = dir.join(format!("transfer-{id}.log"));
        let log_s = log.display().to_string();
        self.exec(
            "UPDATE transfer_tasks SET log_file = ?1 WHERE id = ?2",
            params![log_s, id],
        )?;
        for line in [
            format!("== transfer task: {id}"),
            format!("== created_at: {}", utc_stamp(ts)),
            format!("== sandbox: {sandbox}"),
            format!("== local_path: {local}"),
            format!("== remote_path: {}", spec.remote_path),
            format!(
                "[transfer] task={id} sandbox={sandbox} local={local} remote={}",
                spec.remote_path
            ),
        ] {
            append_log(&log, &line);
        }

        let cancel = CancellationToken::new();
        let (done_tx, done_rx) = watch::channel(false);
        let this = self.clone();
        let token = cancel.clone();
        let handle = tokio::spawn(async move {
            this.run_task(id, pool, sandbox, spec, token, log).await;
            this.live.lock().remove(&id);
            let _ = done_tx.send(true);
        });
        self.live.lock().insert(
            id,
            Live {
                cancel,
                done: done_rx,
                abort: handle.abort_handle(),
            },
        );
        Ok(json!({
            "mode": "background",
            "auto_switched": true,
            "task_id": id,
            "status": "queued",
            "pid": pid,
            "log_file": log_s,
        }))
    }

    async fn run_task(
        self: &Arc<Self>,
        id: i64,
        pool: Arc<Pool>,
        sandbox: String,
        spec: SyncSpec,
        cancel: CancellationToken,
        log: PathBuf,
    ) {
        let started = now();
        let _ = self.exec(
            "UPDATE transfer_tasks SET status = 'running', started_ts = ?1, updated_ts = ?1,
               progress_json = ?2 WHERE id = ?3",
            params![started, json!({"phase": "starting"}).to_string(), id],
        );
        let shared: Arc<Mutex<(Progress, u64)>> = Arc::new(Mutex::new((Progress::default(), 0)));
        let sh = shared.clone();
        let cb: crate::sync::ProgressFn = Arc::new(move |p: &Progress| {
            let mut g = sh.lock();
            g.0 = p.clone();
            g.1 += 1;
        });
        // Progress writer: at most twice a second, only when something changed; also polls the
        // cancel flag another server may have set.
        let writer = {
            let this = self.clone();
            let shared = shared.clone();
            let cancel = cancel.clone();
            let log = log.clone();
            tokio::spawn(async move {
                let mut seen = 0u64;
                let mut last_phase = String::new();
                let mut last_log = std::time::Instant::now();
                let mut tick = tokio::time::interval(PROGRESS_WRITE_EVERY);
                loop {
                    tick.tick().await;
                    let (p, n) = shared.lock().clone();
                    if n != seen {
                        seen = n;
                        let _ = this.exec(
                            "UPDATE transfer_tasks SET progress_json = ?1, updated_ts = ?2 WHERE id = ?3",
                            params![progress_json(&p, "").to_string(), now(), id],
                        );
                        let phase = p.phase.as_str().to_string();
                        if phase != last_phase || last_log.elapsed() >= LOG_PROGRESS_EVERY {
                            append_log(
                                &log,
                                &format!(
                                    "[transfer] task={id} phase={phase} files={}/{} bytes={}/{} {}",
                                    p.files_done,
                                    p.files_total,
                                    p.bytes_done,
                                    p.bytes_total,
                                    p.current_path
                                ),
                            );
                            last_phase = phase;
                            last_log = std::time::Instant::now();
                        }
                    }
                    let flagged = this
                        .db
                        .lock()
                        .query_row(
                            "SELECT cancel_requested FROM transfer_tasks WHERE id = ?1",
                            params![id],
                            |r| r.get::<_, i64>(0),
                        )
                        .unwrap_or(0);
                    if flagged != 0 {
                        cancel.cancel();
                    }
                }
            })
        };
        let res = crate::ops::sync::run(&pool, &sandbox, &spec, Some(cb), &cancel).await;
        writer.abort();
        let end = now();
        let p = shared.lock().0.clone();
        match res {
            Ok(report) => {
                let result = report.to_json();
                let mut prog = progress_json(&p, report.synced_type);
                prog["phase"] = json!("complete");
                prog["duration_s"] = json!((report.duration_s * 1000.0).round() / 1000.0);
                let _ = self.exec(
                    "UPDATE transfer_tasks SET status = 'completed', finished_ts = ?1, updated_ts = ?1,
                       result_json = ?2, progress_json = ?3, last_error = '' WHERE id = ?4",
                    params![end, result.to_string(), prog.to_string(), id],
                );
                append_log(&log, &format!("[transfer] task={id} result={result}"));
                append_log(&log, &format!("[transfer] task={id} completed"));
            }
            Err(e) if cancel.is_cancelled() => {
                let mut prog = progress_json(&p, "");
                prog["phase"] = json!("cancelled");
                let _ = self.exec(
                    "UPDATE transfer_tasks SET status = 'cancelled', finished_ts = ?1, updated_ts = ?1,
                       progress_json = ?2, last_error = '' WHERE id = ?3",
                    params![end, prog.to_string(), id],
                );
                append_log(
                    &log,
                    &format!("[transfer] task={id} cancelled ({})", e.message),
                );
            }
            Err(e) => {
                let mut prog = progress_json(&p, "");
                prog["phase"] = json!("failed");
                let _ = self.exec(
                    "UPDATE transfer_tasks SET status = 'failed', finished_ts = ?1, updated_ts = ?1,
                       progress_json = ?2, last_error = ?3 WHERE id = ?4",
                    params![end, prog.to_string(), e.message, id],
                );
                append_log(&log, &format!("[transfer] task={id} failed: {}", e.message));
                append_log(&log, &format!("[transfer] hint: {}", e.hint));
            }
        }
    }

    fn is_live(&self, id: i64) -> bool {
        self.live.lock().contains_key(&id)
    }

    /// Mark a queued/running task whose owner is gone as `interrupted`; returns the new status.
    fn settle(&self, id: i64, row: &mut Row) {
        if is_terminal(&row.status) || self.is_live(id) {
            return;
        }
        let mine = row.pid == std::process::id() as i64 && row.owner_start == self.my_start;
        if !mine && pid_alive(row.pid, &row.owner_start) {
            return;
        }
        let msg = format!(
            "the rsb server that ran this transfer (pid {}) exited before it finished",
            row.pid
        );
        let ts = now();
        let mut prog: Value = serde_json::from_str(&row.progress_json).unwrap_or(json!({}));
        prog["phase"] = json!("interrupted");
        let _ = self.exec(
            "UPDATE transfer_tasks SET status = 'interrupted', finished_ts = ?1, updated_ts = ?1,
               last_error = ?2, progress_json = ?3 WHERE id = ?4 AND status IN ('queued','running')",
            params![ts, msg, prog.to_string(), id],
        );
        append_log(
            Path::new(&row.log_file),
            &format!("[transfer] task={id} interrupted: {msg}"),
        );
        row.status = "interrupted".into();
        row.last_error = msg;
        row.progress_json = prog.to_string();
        row.finished_ts = ts;
    }

    /// `check_file_transfer_task`.
    pub fn check(&self, id: i64, last_n_lines: i64) -> Result<Value> {
        if id <= 0 {
            return Err(RsbError::invalid(
                "task_id must be positive",
                "pass the task_id returned by sync_local_to_remote",
            ));
        }
        if last_n_lines <= 0 {
            return Err(RsbError::invalid(
                "last_n_lines must be positive",
                "pass a value >= 1",
            ));
        }
        let mut row = self.row(id)?.ok_or_else(|| Self::unknown(id))?;
        self.settle(id, &mut row);
        let mut v = json!({"task_id": id, "status": row.status});
        if row.status == "running" {
            v["running"] = json!(true);
        }
        if row.status == "queued" {
            v["pending"] = json!(true);
        }
        let mut prog: Value = serde_json::from_str(&row.progress_json).unwrap_or(json!({}));
        if !is_terminal(&row.status) && row.started_ts > 0.0 && prog.get("elapsed_s").is_none() {
            prog["elapsed_s"] = json!(((now() - row.started_ts) * 100.0).round() / 100.0);
        }
        v["progress"] = prog;
        if row.status == "completed" {
            v["result"] = serde_json::from_str(&row.result_json).unwrap_or(json!({}));
        }
        if matches!(row.status.as_str(), "failed" | "interrupted") && !row.last_error.is_empty() {
            v["error"] = json!(row.last_error);
        }
        if row.status == "interrupted" {
            v["hint"] = json!(
                "run the same sync again: files already committed are skipped, and nothing partial was left"
            );
        }
        if row.finished_ts > 0.0 {
            v["finished_at"] = json!(utc_stamp(row.finished_ts));
        }
        v["log_tail"] = json!(log_tail(Path::new(&row.log_file), last_n_lines as usize));
        Ok(v)
    }

    /// The task's status once it is no longer running (for tests and the CLI), or `None`
    /// after `timeout`.
    pub async fn wait(&self, id: i64, timeout: Duration) -> Option<String> {
        let rx = self.live.lock().get(&id).map(|l| l.done.clone());
        if let Some(mut rx) = rx {
            let _ = tokio::time::timeout(timeout, rx.wait_for(|d| *d)).await;
        }
        let row = self.row(id).ok().flatten()?;
        is_terminal(&row.status).then_some(row.status)
    }

    /// `cancel_file_transfer_task`: stop the task (cooperatively, then by aborting it after
    /// `force_kill_after_s`) and report `cancelled`.
    pub async fn cancel(&self, id: i64, force_kill_after_s: f64) -> Result<Value> {
        if id <= 0 {
            return Err(RsbError::invalid(
                "task_id must be positive",
                "pass the task_id returned by sync_local_to_remote",
            ));
        }
        if force_kill_after_s.is_nan()
            || force_kill_after_s < 0.0
            || force_kill_after_s.is_infinite()
        {
            return Err(RsbError::invalid(
                "force_kill_after_s must be zero or positive",
                "pass a value >= 0",
            ));
        }
        let mut row = self.row(id)?.ok_or_else(|| Self::unknown(id))?;
        self.settle(id, &mut row);
        if is_terminal(&row.status) {
            return Ok(json!({"task_id": id, "status": row.status, "already_finished": true}));
        }
        let grace = Duration::from_secs_f64(force_kill_after_s.min(3600.0));
        let live = self
            .live
            .lock()
            .get(&id)
            .map(|l| (l.cancel.clone(), l.done.clone(), l.abort.clone()));
        if let Some((token, mut done, abort)) = live {
            token.cancel();
            let finished = tokio::time::timeout(grace, done.wait_for(|d| *d))
                .await
                .is_ok();
            let mut force_killed = false;
            if !finished {
                abort.abort();
                force_killed = true;
                self.live.lock().remove(&id);
                let ts = now();
                let _ = self.exec(
                    "UPDATE transfer_tasks SET status = 'cancelled', finished_ts = ?1, updated_ts = ?1,
                       progress_json = json_set(progress_json, '$.phase', 'cancelled')
                     WHERE id = ?2 AND status IN ('queued','running')",
                    params![ts, id],
                );
                append_log(
                    Path::new(&row.log_file),
                    &format!(
                        "[transfer] task={id} cancelled (aborted after {force_kill_after_s}s)"
                    ),
                );
            }
            let row = self.row(id)?.ok_or_else(|| Self::unknown(id))?;
            let mut v = json!({"task_id": id, "status": row.status, "terminated": true});
            if row.status != "cancelled" {
                v["already_finished"] = json!(true);
            }
            if force_killed {
                v["force_killed"] = json!(true);
            }
            return Ok(v);
        }
        // Owned by another live rsb server: raise the flag it polls, and wait for it.
        self.exec(
            "UPDATE transfer_tasks SET cancel_requested = 1, updated_ts = ?1 WHERE id = ?2",
            params![now(), id],
        )?;
        let deadline = tokio::time::Instant::now() + grace.max(Duration::from_secs(2));
        loop {
            let r = self.row(id)?.ok_or_else(|| Self::unknown(id))?;
            if is_terminal(&r.status) {
                return Ok(json!({"task_id": id, "status": r.status, "terminated": true}));
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(json!({
                    "task_id": id,
                    "status": r.status,
                    "cancel_requested": true,
                    "error": format!("the task belongs to another rsb server (pid {}); it was asked to stop", r.pid),
                }));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(0.0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_stamp(1_700_000_000.0), "2023-11-14T22:13:20Z");
        assert_eq!(utc_stamp(951_782_400.0), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn migrations_are_idempotent_and_file_is_private() {
        let d = tempfile_dir();
        let t = Transfers::open(&d).unwrap();
        drop(t);
        let t = Transfers::open(&d).unwrap();
        let v: i64 =
            t.db.lock()
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .unwrap();
        assert_eq!(v, crate::store::SCHEMA_VERSION);
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(t.db_path()).unwrap().permissions().mode();
        assert_eq!(m & 0o777, 0o600);
        assert!(
            t.check(1, 50)
                .unwrap_err()
                .message
                .contains("Unknown transfer task id: 1")
        );
        assert_eq!(
            t.check(0, 50).unwrap_err().message,
            "task_id must be positive"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn dead_owner_is_interrupted() {
        let d = tempfile_dir();
        let t = Transfers::open(&d).unwrap();
        t.exec(
            "INSERT INTO transfer_tasks (direction, sandbox_name, local_path, remote_path, status,
               pid, owner_start, created_ts, updated_ts) VALUES ('local_to_remote','s','/a','b',
               'running', 999999999, 'x', 1, 1)",
            [],
        )
        .unwrap();
        let v = t.check(1, 10).unwrap();
        assert_eq!(v["status"], "interrupted", "{v}");
        assert!(v["hint"].as_str().unwrap().contains("again"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn owner_liveness_checks_identity() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let start = process_start(pid);
        assert!(!start.is_empty(), "/proc is readable on Linux");
        assert!(pid_alive(pid.into(), &start));
        assert!(
            pid_alive(pid.into(), ""),
            "no start recorded: the pid decides"
        );
        let other: u64 = start.parse::<u64>().unwrap() + 1;
        assert!(!pid_alive(pid.into(), &other.to_string()), "a reused pid");
        assert!(!pid_alive(pid.into(), "garbage"));
        assert!(!pid_alive(0, ""));
        assert!(!pid_alive(-1, ""));
        child.kill().unwrap();
        // Killed but not reaped: a zombie owns nothing.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pid_alive(pid.into(), &start) {
            assert!(
                std::time::Instant::now() < deadline,
                "still alive after SIGKILL"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.wait().unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "rsb-transfers-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
