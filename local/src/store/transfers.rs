//! Background transfer tasks in the store: the `transfer_tasks` table, each task's log
//! (`<state_dir>/transfers/transfer-<id>.log`), the tasks this process runs itself, and the
//! in-memory cache of sync baselines. A task's record is what outlives the server that started
//! it: any later server reads its progress and result from here.
//!
//! What runs a task (the worker process `rsb transfer run <id>`, or a task inside a server)
//! is `sync::transfers`, which calls down into this module. A task whose process died
//! (SIGKILL, a crash, a reboot) is reported as `interrupted`, by the same process identity
//! check the agent uses for its jobs (pid and start time, never the pid alone).

use std::{
    collections::{HashMap, HashSet},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use parking_lot::Mutex;
use rusqlite::{OptionalExtension, params};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error::{Kind, Result, RsbError};

pub use crate::store::DB_FILE;
const LOG_TAIL_READ: u64 = 80_000;
const LOG_TAIL_MAX_CHARS: usize = 20_000;

pub(crate) fn now() -> f64 {
    super::clock::now_f64()
}

pub(crate) fn db_err(e: impl std::fmt::Display) -> RsbError {
    RsbError::new(
        Kind::Internal,
        format!("transfer database error: {e}"),
        "check free space and permissions of the rsb state dir (RSB_STATE_DIR)",
    )
}

pub(crate) fn is_terminal(status: &str) -> bool {
    matches!(status, "completed" | "failed" | "cancelled" | "interrupted")
}

/// Start time of a process (clock ticks since boot), recorded next to its pid so a live owner
/// can be told from a reused pid (from /proc on Linux, libproc on macOS). Empty where the
/// process table cannot be read.
pub(crate) fn process_start(pid: u32) -> String {
    rsb_agent::proc::start_ticks(pid)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// Whether the recorded owner is still that process, by the agent's one identity check
/// (`rsb_agent::proc::is_alive`): a zombie is not a live owner, and neither is a process with
/// another start time that was given the same pid.
pub(crate) fn pid_alive(pid: i64, start: &str) -> bool {
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

/// `YYYY-MM-DDTHH:MM:SSZ` (UTC), to the second. A time chrono cannot represent (far outside
/// any clock rsb reads) is written as the epoch rather than failing a reply over a stamp.
pub fn utc_stamp(ts: f64) -> String {
    chrono::DateTime::from_timestamp(ts.floor() as i64, 0)
        .unwrap_or_default()
        .format("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

pub(crate) fn append_log(path: &Path, line: &str) {
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

/// The last `n` lines of a log after byte `from` (the whole log when `None`), and the offset
/// just past its last complete line, where the next call starts. A log shorter than `from`
/// (rewritten) is read from its start. Reads at most the last 80 kB; at most 20,000 chars.
pub fn log_since(path: &Path, from: Option<u64>, n: usize) -> (String, u64) {
    let Ok(mut f) = std::fs::File::open(path) else {
        return (String::new(), from.unwrap_or(0));
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let from = from.filter(|o| *o <= len).unwrap_or(0);
    let start = from.max(len.saturating_sub(LOG_TAIL_READ));
    let _ = f.seek(SeekFrom::Start(start));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    // Only whole lines: a line still being written is returned by the next call.
    let whole = buf.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    buf.truncate(whole);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    let first = lines.len().saturating_sub(n);
    let mut out = lines[first..].join("\n");
    if out.chars().count() > LOG_TAIL_MAX_CHARS {
        let skip = out.chars().count() - LOG_TAIL_MAX_CHARS;
        out = out.chars().skip(skip).collect();
    }
    (out, start + whole as u64)
}

/// How often a held reply reads the task's progress while nothing else wakes it.
const HOLD_PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// A task log's changes, as a wake-up: a watch on the file (inotify, FSEvents), dropped with
/// this. `None` where the file cannot be watched (the caller's timer is then all it has).
struct LogChanges {
    changed: Arc<tokio::sync::Notify>,
    _watcher: notify::RecommendedWatcher,
}

impl LogChanges {
    fn watch(path: &Path) -> Option<LogChanges> {
        use notify::Watcher;
        let changed = Arc::new(tokio::sync::Notify::new());
        let wake = changed.clone();
        let mut w = notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
            if r.is_ok() {
                wake.notify_one();
            }
        })
        .ok()?;
        w.watch(path, notify::RecursiveMode::NonRecursive).ok()?;
        Some(LogChanges {
            changed,
            _watcher: w,
        })
    }
}

pub(crate) struct Live {
    pub(crate) cancel: CancellationToken,
    pub(crate) done: watch::Receiver<bool>,
    pub(crate) abort: tokio::task::AbortHandle,
}

/// One row of `transfer_tasks`, as the tools need it.
pub(crate) struct Row {
    pub(crate) status: String,
    pub(crate) pid: i64,
    pub(crate) owner_start: String,
    pub(crate) log_file: String,
    pub(crate) last_error: String,
    pub(crate) result_json: String,
    pub(crate) progress_json: String,
    pub(crate) finished_ts: f64,
    pub(crate) started_ts: f64,
    pub(crate) in_process: bool,
}

pub struct Transfers {
    pub(crate) state_dir: PathBuf,
    db: crate::store::Store,
    pub(crate) live: Mutex<HashMap<i64, Live>>,
    /// Tasks recorded but whose worker is not started yet (not `interrupted` meanwhile).
    /// Shared with the store's thread, which marks a task as it records it.
    spawning: Arc<Mutex<HashSet<i64>>>,
    my_start: String,
    /// How far into each task's log this server has already replied: a poll returns the log
    /// header and tail once, then only the lines written since (a model polling a long
    /// transfer should not pay for the same header every time).
    log_seen: Mutex<HashMap<i64, u64>>,
    /// Baselines as last read or written here, with their row's generation: while the row has
    /// the same generation, the copy is the row (a no-change resync of 2,000 files then skips
    /// ~150 KB of JSON, ~2 ms), whatever else other connections commit meanwhile.
    baselines: Mutex<HashMap<BaselineKey, (i64, Arc<Baseline>)>>,
    /// Loads answered from `baselines` and loads that read the row (the cache's hit rate).
    baseline_hits: std::sync::atomic::AtomicU64,
    baseline_misses: std::sync::atomic::AtomicU64,
}

use super::baselines::{self, Baseline, Key as BaselineKey};

impl Transfers {
    /// Open (creating, 0600) and migrate `<state_dir>/rsb.sqlite3`, on a store thread of its
    /// own.
    pub async fn open(state_dir: &Path) -> Result<Transfers> {
        Ok(Transfers::on(crate::store::Store::open(state_dir).await?))
    }

    /// The tasks of `store`'s database. Page damage is an error of `store`'s first call
    /// (`store::open` checks), not a missing task or baseline later.
    pub fn on(store: crate::store::Store) -> Transfers {
        Transfers {
            state_dir: store.state_dir().to_path_buf(),
            db: store,
            live: Mutex::new(HashMap::new()),
            spawning: Default::default(),
            my_start: process_start(std::process::id()),
            log_seen: Mutex::new(HashMap::new()),
            baselines: Mutex::new(HashMap::new()),
            baseline_hits: Default::default(),
            baseline_misses: Default::default(),
        }
    }

    /// The store this registry writes through (for the other store modules a runner calls).
    pub fn store(&self) -> &crate::store::Store {
        &self.db
    }

    pub fn db_path(&self) -> PathBuf {
        self.state_dir.join(DB_FILE)
    }

    pub(crate) async fn row(&self, id: i64) -> Result<Option<Row>> {
        self.db
            .call(move |db| {
                db.query_row(
                "SELECT status, pid, owner_start, log_file, last_error, result_json, progress_json,
                    finished_ts, started_ts, in_process FROM transfer_tasks WHERE id = ?1",
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
                        in_process: r.get::<_, i64>(9)? != 0,
                    })
                },
            )
            .optional()
            .map_err(db_err)
            })
            .await
    }

    pub(crate) async fn exec(
        &self,
        sql: &'static str,
        p: impl rusqlite::Params + Send + 'static,
    ) -> Result<()> {
        self.db
            .call(move |db| db.execute(sql, p).map(|_| ()).map_err(db_err))
            .await
    }

    pub(crate) fn unknown(id: i64) -> RsbError {
        RsbError::invalid(
            format!("Unknown transfer task id: {id}"),
            "use the task_id returned by sync_local_to_remote",
        )
    }

    /// The last-synced content of (local root, sandbox, remote root); `None` only when no
    /// sync of it completed. A store or row that cannot be read is an error (a sync must refuse
    /// rather than run as a first sync and overwrite a remote edit).
    pub async fn load_baseline(
        &self,
        local: &str,
        sandbox: &str,
        remote: &str,
    ) -> Result<Option<Baseline>> {
        Ok(self
            .load_baseline_shared(local, sandbox, remote)
            .await?
            .map(|b| b.as_ref().clone()))
    }

    /// [`Transfers::load_baseline`] without a copy, from memory while the store is unchanged.
    /// A journal left by a sync of these roots that never ended is folded in first.
    pub async fn load_baseline_shared(
        &self,
        local: &str,
        sandbox: &str,
        remote: &str,
    ) -> Result<Option<Arc<Baseline>>> {
        use std::sync::atomic::Ordering::Relaxed;
        let key: BaselineKey = (local.to_string(), sandbox.to_string(), remote.to_string());
        // A sync of these roots killed outright left what it committed in the journal.
        let k = key.clone();
        let current = self
            .db
            .call(move |db| {
                baselines::fold(db, &k)?;
                baselines::generation(db, &k)
            })
            .await?;
        if let Some(g) = current.filter(|&g| g != 0)
            && let Some((cached, b)) = self.baselines.lock().get(&key)
            && *cached == g
        {
            self.baseline_hits.fetch_add(1, Relaxed);
            return Ok(Some(b.clone()));
        }
        self.baseline_misses.fetch_add(1, Relaxed);
        // The row as it is now, with its own generation: another connection may have saved
        // it since the generation above was read.
        let loaded = match current {
            Some(_) => {
                let k = key.clone();
                self.db
                    .call(move |db| baselines::load_with_generation(db, &k))
                    .await?
            }
            None => None,
        };
        let Some((g, b)) = loaded else {
            self.baselines.lock().remove(&key);
            return Ok(None);
        };
        let b = Arc::new(b);
        let mut cache = self.baselines.lock();
        if g != 0 {
            cache.insert(key, (g, b.clone()));
        } else {
            cache.remove(&key);
        }
        Ok(Some(b))
    }

    /// (hits, misses) of the in-memory baseline cache since this store was opened.
    pub fn baseline_cache_stats(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.baseline_hits.load(Relaxed),
            self.baseline_misses.load(Relaxed),
        )
    }

    /// See [`baselines::touch`]: a root synced without a change keeps its baseline.
    pub async fn touch_baseline(&self, local: &str, sandbox: &str, remote: &str) -> Result<()> {
        let key = (local.to_string(), sandbox.to_string(), remote.to_string());
        self.db
            .call(move |db| baselines::touch(db, &key, crate::store::now_s()))
            .await
    }

    /// A running sync of (local root, sandbox, remote root) committed `commits`: see
    /// [`baselines::journal`]. The baseline itself, and so the cache, is unchanged until the
    /// run saves it or a later load folds the journal in.
    pub async fn journal_commits(
        &self,
        local: &str,
        sandbox: &str,
        remote: &str,
        commits: Vec<(String, [u8; 32])>,
    ) -> Result<()> {
        let key = (local.to_string(), sandbox.to_string(), remote.to_string());
        self.db
            .call(move |db| baselines::journal(db, &key, &commits))
            .await
    }

    pub async fn save_baseline(
        &self,
        local: &str,
        sandbox: &str,
        remote: &str,
        entries: Arc<Baseline>,
    ) -> Result<()> {
        let key: BaselineKey = (local.to_string(), sandbox.to_string(), remote.to_string());
        let (k, e) = (key.clone(), entries.clone());
        let written = self.db.call(move |db| baselines::save(db, &k, &e)).await;
        let mut cache = self.baselines.lock();
        match written {
            Ok(g) => {
                cache.insert(key, (g, entries));
                Ok(())
            }
            Err(e) => {
                cache.remove(&key);
                Err(e)
            }
        }
    }

    fn is_live(&self, id: i64) -> bool {
        self.live.lock().contains_key(&id)
    }

    /// Mark a queued/running task whose owner is gone as `interrupted`; returns the new status.
    pub(crate) async fn settle(&self, id: i64, row: &mut Row) {
        if is_terminal(&row.status) || self.is_live(id) || self.spawning.lock().contains(&id) {
            return;
        }
        let mine = row.pid == std::process::id() as i64 && row.owner_start == self.my_start;
        if !mine && pid_alive(row.pid, &row.owner_start) {
            return;
        }
        let msg = if row.in_process {
            format!(
                "the rsb server that ran this transfer (pid {}) exited before it finished",
                row.pid
            )
        } else {
            format!(
                "the transfer worker (pid {}) exited before it finished",
                row.pid
            )
        };
        let ts = now();
        let mut prog: Value = serde_json::from_str(&row.progress_json).unwrap_or(json!({}));
        prog["phase"] = json!("interrupted");
        let _ = self
            .exec(
                "UPDATE transfer_tasks SET status = 'interrupted', finished_ts = ?1, updated_ts = ?1,
               last_error = ?2, progress_json = ?3 WHERE id = ?4 AND status IN ('queued','running')",
                (ts, msg.clone(), prog.to_string(), id),
            )
            .await;
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
    pub async fn check(&self, id: i64, last_n_lines: i64) -> Result<Value> {
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
        let mut row = self.row(id).await?.ok_or_else(|| Self::unknown(id))?;
        self.settle(id, &mut row).await;
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
        // A finished task's last lines are its verdict: always returned whole.
        let seen = if is_terminal(&row.status) {
            None
        } else {
            self.log_seen.lock().get(&id).copied()
        };
        let (tail, end) = log_since(Path::new(&row.log_file), seen, last_n_lines as usize);
        self.log_seen.lock().insert(id, end);
        v["log_tail"] = json!(tail);
        if seen.is_some() {
            v["log_new_lines_only"] = json!(true);
        }
        Ok(v)
    }

    /// Hold a background sync's reply (at most `budget`) for a worker about to finish: a plan
    /// just over the inline limits then answers with its result and the client polls nothing
    /// (a model's poll is a whole turn). The transfer itself runs in its detached worker all
    /// the same, so it outlives the server. Gives up early once the worker's progress predicts
    /// an end well past the budget. `Some(check_file_transfer_task's reply)` once it ended.
    ///
    /// Woken by the task's end, not by polling its row: a worker records its end and then
    /// writes it to the task's log, whose change wakes this (inotify, FSEvents); an in-process
    /// run's end is its own signal. The row is read again at most every
    /// [`HOLD_PROGRESS_EVERY`] meanwhile, for the progress the prediction goes by.
    pub async fn hold_reply(&self, id: i64, budget: Duration) -> Option<Value> {
        let start = tokio::time::Instant::now();
        let mut done = self.live.lock().get(&id).map(|l| l.done.clone());
        let (mut log, mut watched): (Option<LogChanges>, bool) = (None, false);
        loop {
            let mut row = self.row(id).await.ok().flatten()?;
            self.settle(id, &mut row).await;
            if is_terminal(&row.status) {
                return self.check(id, 20).await.ok();
            }
            let elapsed = start.elapsed();
            if elapsed >= budget {
                return None;
            }
            let p: Value = serde_json::from_str(&row.progress_json).unwrap_or(Value::Null);
            let part = |done: &str, total: &str| match p[total].as_f64() {
                Some(t) if t > 0.0 => p[done].as_f64().unwrap_or(0.0) / t,
                _ => 0.0,
            };
            let share = part("bytes_done", "bytes_total").max(part("files_done", "files_total"));
            if elapsed >= Duration::from_millis(300)
                && share > 0.0
                && elapsed.as_secs_f64() / share > budget.as_secs_f64() * 1.25
            {
                return None;
            }
            if !watched && !row.log_file.is_empty() {
                watched = true;
                if let Some(l) = LogChanges::watch(Path::new(&row.log_file)) {
                    // An end written before the watch began is read now, not after a wait.
                    log = Some(l);
                    continue;
                }
            }
            let wait = HOLD_PROGRESS_EVERY.min(budget - elapsed);
            let ended = tokio::select! {
                _ = tokio::time::sleep(wait) => false,
                _ = async { log.as_ref()?.changed.notified().await; Some(()) }, if log.is_some() => false,
                _ = async { done.as_mut()?.wait_for(|d| *d).await.ok() }, if done.is_some() => true,
            };
            if ended {
                // The in-process run ended (its row says how): this signal has nothing more.
                done = None;
            }
        }
    }

    /// The task's status once it is no longer running (for tests and the CLI), or `None`
    /// after `timeout`.
    pub async fn wait(&self, id: i64, timeout: Duration) -> Option<String> {
        let rx = self.live.lock().get(&id).map(|l| l.done.clone());
        if let Some(mut rx) = rx {
            let _ = tokio::time::timeout(timeout, rx.wait_for(|d| *d)).await;
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut row = self.row(id).await.ok().flatten()?;
            self.settle(id, &mut row).await;
            if is_terminal(&row.status) {
                return Some(row.status);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A task as recorded before anything runs (`queued`, owned by this process).
pub struct NewTask<'a> {
    pub direction: &'a str,
    pub sandbox: &'a str,
    /// The persisted definition a worker connects with ([`crate::store::sandboxes`]).
    pub sandbox_fp: &'a str,
    pub local_path: &'a str,
    pub remote_path: &'a str,
    pub delete_extras: bool,
    pub excludes: &'a [String],
    pub exclude_file: &'a str,
    /// What a worker needs to run the same sync again (the runner's own format).
    pub spec_json: &'a str,
    pub created_ts: f64,
}

#[cfg(test)]
impl NewTask<'static> {
    /// An upload task of sandbox `s`, for tests.
    pub(crate) fn for_test() -> NewTask<'static> {
        NewTask {
            direction: "local_to_remote",
            sandbox: "s",
            sandbox_fp: "",
            local_path: "/a",
            remote_path: "b",
            delete_extras: false,
            excludes: &[],
            exclude_file: "",
            spec_json: "{}",
            created_ts: now(),
        }
    }
}

/// What a worker needs of the task it claimed.
pub struct Claimed {
    pub sandbox: String,
    pub sandbox_fp: String,
    pub spec_json: String,
    pub log_file: String,
}

/// How a task ended, as its runner records it.
pub enum End<'a> {
    Completed(&'a Value),
    Cancelled,
    Failed(&'a str),
}

/// The task writes the runner makes, each one statement: the table and its states stay this
/// module's, whoever runs the task.
impl Transfers {
    /// Record a queued task owned by this process, and hold it as "being started" until
    /// [`Transfers::started`]: a concurrent check must not read it as `interrupted`.
    pub async fn record(&self, t: &NewTask<'_>) -> Result<i64> {
        let text = [
            t.direction,
            t.sandbox,
            t.local_path,
            t.remote_path,
            t.exclude_file,
            t.spec_json,
            t.sandbox_fp,
        ]
        .map(str::to_string);
        let excludes = serde_json::to_string(t.excludes).unwrap_or_else(|_| "[]".into());
        let (delete_extras, created_ts) = (t.delete_extras as i64, t.created_ts);
        let (owner, spawning) = (self.my_start.clone(), self.spawning.clone());
        self.db
            .call(move |db| {
                let [direction, sandbox, local, remote, exclude_file, spec, fp] = text;
                db.execute(
                    "INSERT INTO transfer_tasks (direction, sandbox_name, local_path, remote_path,
               delete_extras, excludes_json, exclude_file, status, pid, owner_start,
               progress_json, created_ts, updated_ts, spec_json, sandbox_fp)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'queued', ?8, ?9, ?10, ?11, ?11, ?12, ?13)",
                    params![
                        direction,
                        sandbox,
                        local,
                        remote,
                        delete_extras,
                        excludes,
                        exclude_file,
                        std::process::id() as i64,
                        owner,
                        json!({"phase": "queued"}).to_string(),
                        created_ts,
                        spec,
                        fp,
                    ],
                )
                .map_err(db_err)?;
                let id = db.last_insert_rowid();
                // On the store's thread, before any later call reads the row.
                spawning.lock().insert(id);
                Ok(id)
            })
            .await
    }

    /// The task has a worker or a live in-process run now (or failed to get one).
    pub fn started(&self, id: i64) {
        self.spawning.lock().remove(&id);
    }

    /// Create the task's log (0600, in the 0700 `transfers/` dir) and record its path.
    pub async fn create_log(&self, id: i64) -> Result<PathBuf> {
        let dir = self.state_dir.join(super::layout::TRANSFER_LOGS);
        let _ = super::ensure_private_dir(&dir);
        let log = dir.join(format!("transfer-{id}.log"));
        self.exec(
            "UPDATE transfer_tasks SET log_file = ?1 WHERE id = ?2",
            (log.display().to_string(), id),
        )
        .await?;
        Ok(log)
    }

    pub async fn mark_in_process(&self, id: i64) -> Result<()> {
        self.exec(
            "UPDATE transfer_tasks SET in_process = 1 WHERE id = ?1",
            (id,),
        )
        .await
    }

    /// The worker process that owns the task, by pid and start time.
    pub async fn set_owner(&self, id: i64, pid: u32, start: &str) -> Result<()> {
        self.exec(
            "UPDATE transfer_tasks SET pid = ?1, owner_start = ?2 WHERE id = ?3",
            (pid as i64, start.to_string(), id),
        )
        .await
    }

    pub async fn mark_running(&self, id: i64, started_ts: f64) -> Result<()> {
        self.exec(
            "UPDATE transfer_tasks SET status = 'running', started_ts = ?1, updated_ts = ?1,
               progress_json = ?2 WHERE id = ?3",
            (started_ts, json!({"phase": "starting"}).to_string(), id),
        )
        .await
    }

    pub async fn write_progress(&self, id: i64, progress: &Value) -> Result<()> {
        self.exec(
            "UPDATE transfer_tasks SET progress_json = ?1, updated_ts = ?2 WHERE id = ?3",
            (progress.to_string(), now(), id),
        )
        .await
    }

    /// Whether any server asked the task to stop (the flag a worker polls).
    pub async fn cancel_requested(&self, id: i64) -> bool {
        self.db
            .call(move |db| {
                db.query_row(
                    "SELECT cancel_requested FROM transfer_tasks WHERE id = ?1",
                    params![id],
                    |r| r.get::<_, i64>(0),
                )
                .map_err(db_err)
            })
            .await
            .is_ok_and(|f| f != 0)
    }

    pub async fn request_cancel(&self, id: i64) -> Result<()> {
        self.exec(
            "UPDATE transfer_tasks SET cancel_requested = 1, updated_ts = ?1 WHERE id = ?2",
            (now(), id),
        )
        .await
    }

    /// Record the end of a run with its final progress.
    pub async fn finish(&self, id: i64, end: End<'_>, progress: &Value, ts: f64) -> Result<()> {
        let (status, result, error) = match end {
            End::Completed(r) => ("completed", r.to_string(), ""),
            End::Cancelled => ("cancelled", String::new(), ""),
            End::Failed(e) => ("failed", String::new(), e),
        };
        self.exec(
            "UPDATE transfer_tasks SET status = ?1, finished_ts = ?2, updated_ts = ?2,
               result_json = CASE WHEN ?3 = '' THEN result_json ELSE ?3 END,
               progress_json = ?4, last_error = ?5 WHERE id = ?6",
            (
                status,
                ts,
                result,
                progress.to_string(),
                error.to_string(),
                id,
            ),
        )
        .await
    }

    /// A task stopped by force (its run aborted, or its worker killed): `cancelled`, unless it
    /// recorded an end of its own first.
    pub async fn mark_cancelled(&self, id: i64) -> Result<()> {
        self.exec(
            "UPDATE transfer_tasks SET status = 'cancelled', finished_ts = ?1, updated_ts = ?1,
               progress_json = json_set(progress_json, '$.phase', 'cancelled')
             WHERE id = ?2 AND status IN ('queued','running')",
            (now(), id),
        )
        .await
    }

    /// A worker takes its queued task, or gets `None` when the task is unknown or not queued
    /// (another worker took it, or it was cancelled meanwhile).
    pub async fn claim(&self, id: i64) -> Result<Option<Claimed>> {
        let owner = self.my_start.clone();
        self.db
            .call(move |db| {
                let claimed = db
                    .execute(
                        "UPDATE transfer_tasks SET pid = ?1, owner_start = ?2, in_process = 0
                 WHERE id = ?3 AND status = 'queued'",
                        params![std::process::id() as i64, owner, id],
                    )
                    .map_err(db_err)?;
                if claimed == 0 {
                    return Ok(None);
                }
                db.query_row(
                    "SELECT sandbox_name, sandbox_fp, spec_json, log_file FROM transfer_tasks
                     WHERE id = ?1",
                    params![id],
                    |r| {
                        Ok(Claimed {
                            sandbox: r.get(0)?,
                            sandbox_fp: r.get(1)?,
                            spec_json: r.get(2)?,
                            log_file: r.get(3)?,
                        })
                    },
                )
                .optional()
                .map_err(db_err)
            })
            .await
    }

    /// A claimed task that could not run at all.
    pub async fn fail_claimed(&self, id: i64, msg: &str) -> Result<()> {
        self.exec(
            "UPDATE transfer_tasks SET status = 'failed', finished_ts = ?1, updated_ts = ?1,
               last_error = ?2, progress_json = json_set(progress_json, '$.phase', 'failed')
             WHERE id = ?3",
            (now(), msg.to_string(), id),
        )
        .await
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_poll_returns_the_header_once_then_only_new_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("t.log");
        std::fs::write(&log, "header 1\nheader 2\nline a\npart").unwrap();
        let (first, at) = log_since(&log, None, 50);
        assert_eq!(first, "header 1\nheader 2\nline a");
        // Nothing new (the partial line waits until it is whole).
        assert_eq!(log_since(&log, Some(at), 50), (String::new(), at));
        std::fs::write(&log, "header 1\nheader 2\nline a\npartial done\nline b\n").unwrap();
        let (next, at2) = log_since(&log, Some(at), 50);
        assert_eq!(next, "partial done\nline b");
        assert_eq!(at2, std::fs::metadata(&log).unwrap().len());
        // `n` still bounds what comes back; a rewritten (shorter) log starts over.
        assert_eq!(log_since(&log, Some(at), 1).0, "line b");
        std::fs::write(&log, "new\n").unwrap();
        assert_eq!(log_since(&log, Some(at2), 50).0, "new");
    }

    use super::*;

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(0.0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_stamp(1_700_000_000.0), "2023-11-14T22:13:20Z");
        assert_eq!(utc_stamp(951_782_400.0), "2000-02-29T00:00:00Z");
        // Fractions round down, like the seed's `time.strftime` of a float.
        assert_eq!(utc_stamp(1_700_000_000.999), "2023-11-14T22:13:20Z");
        assert_eq!(utc_stamp(f64::NAN), "1970-01-01T00:00:00Z");
    }

    #[tokio::test]
    async fn migrations_are_idempotent_and_file_is_private() {
        let d = tempfile_dir();
        let t = Transfers::open(&d).await.unwrap();
        drop(t);
        let t = Transfers::open(&d).await.unwrap();
        let v: i64 =
            t.db.call(|c| {
                c.query_row("PRAGMA user_version", [], |r| r.get(0))
                    .map_err(db_err)
            })
            .await
            .unwrap();
        assert_eq!(v, crate::store::SCHEMA_VERSION);
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(t.db_path()).unwrap().permissions().mode();
        assert_eq!(m & 0o777, 0o600);
        assert!(
            t.check(1, 50)
                .await
                .unwrap_err()
                .message
                .contains("Unknown transfer task id: 1")
        );
        assert_eq!(
            t.check(0, 50).await.unwrap_err().message,
            "task_id must be positive"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn dead_owner_is_interrupted() {
        let d = tempfile_dir();
        let t = Transfers::open(&d).await.unwrap();
        t.exec(
            "INSERT INTO transfer_tasks (direction, sandbox_name, local_path, remote_path, status,
               pid, owner_start, created_ts, updated_ts) VALUES ('local_to_remote','s','/a','b',
               'running', 999999999, 'x', 1, 1)",
            (),
        )
        .await
        .unwrap();
        let v = t.check(1, 10).await.unwrap();
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

    #[tokio::test]
    async fn a_baseline_is_read_from_memory_until_another_connection_saves_it() {
        let d = tempfile_dir();
        let a = Transfers::open(&d).await.unwrap();
        let b = Transfers::open(&d).await.unwrap();
        let one: Baseline = [("x".to_string(), [1; 32])].into();
        let two: Baseline = [("x".to_string(), [2; 32])].into();
        assert!(
            a.load_baseline_shared("l", "s", "r")
                .await
                .unwrap()
                .is_none()
        );
        a.save_baseline("l", "s", "r", Arc::new(one.clone()))
            .await
            .unwrap();
        let first = a
            .load_baseline_shared("l", "s", "r")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(*first, one);
        // The row is unchanged: the same copy, no read.
        assert!(Arc::ptr_eq(
            &first,
            &a.load_baseline_shared("l", "s", "r")
                .await
                .unwrap()
                .unwrap()
        ));
        // Another connection (a worker) writes the row: the next load reads it.
        b.save_baseline("l", "s", "r", Arc::new(two.clone()))
            .await
            .unwrap();
        assert_eq!(
            *a.load_baseline_shared("l", "s", "r")
                .await
                .unwrap()
                .unwrap(),
            two
        );
        assert_eq!(b.load_baseline("l", "s", "r").await.unwrap().unwrap(), two);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Issue 46, item 2: the cache was keyed on the file's `PRAGMA data_version`, so any
    /// commit (a daemon checking its watches, a worker's progress) emptied it. Now each row's
    /// generation decides: 100 no-change loads while another connection commits to other
    /// tables every 10 ms (far busier than 20 watches checked each second) hit >= 95 %.
    #[tokio::test]
    async fn the_baseline_cache_hits_while_other_tables_take_commits() {
        let d = tempfile_dir();
        let t = Transfers::open(&d).await.unwrap();
        let b: Baseline = (0..2_000)
            .map(|i| (format!("src/f{i}.rs"), [i as u8; 32]))
            .collect();
        t.save_baseline("l", "s", "r", Arc::new(b)).await.unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (d, stop) = (d.clone(), stop.clone());
            std::thread::spawn(move || {
                let c = crate::store::open(&d).unwrap();
                let mut commits = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && commits < 10_000 {
                    c.execute(
                        "INSERT INTO daemon_meta (key, value, updated_ts) VALUES ('probe', ?1, 0)
                         ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                        [commits.to_string()],
                    )
                    .unwrap();
                    commits += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                commits
            })
        };
        let (h0, m0) = t.baseline_cache_stats();
        for _ in 0..100 {
            assert_eq!(
                t.load_baseline_shared("l", "s", "r")
                    .await
                    .unwrap()
                    .unwrap()
                    .len(),
                2_000
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let (h1, m1) = t.baseline_cache_stats();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let commits = writer.join().unwrap();
        let (hits, misses) = (h1 - h0, m1 - m0);
        println!("baseline cache: {hits} hits, {misses} misses during {commits} other commits");
        assert!(commits >= 20, "the writer barely ran: {commits} commits");
        assert!(hits >= 95, "{hits} hits, {misses} misses in 100 loads");
        // A save by another connection is seen at once, and a deleted row is no baseline.
        let other = Transfers::open(&d).await.unwrap();
        let two: Baseline = [("x".to_string(), [2; 32])].into();
        other
            .save_baseline("l", "s", "r", Arc::new(two.clone()))
            .await
            .unwrap();
        assert_eq!(
            *t.load_baseline_shared("l", "s", "r")
                .await
                .unwrap()
                .unwrap(),
            two
        );
        crate::store::open(&d)
            .unwrap()
            .execute("DELETE FROM sync_baselines", [])
            .unwrap();
        assert!(
            t.load_baseline_shared("l", "s", "r")
                .await
                .unwrap()
                .is_none()
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Issue 45, step 2: a held reply is woken by the worker's end (the line it writes to the
    /// task's log after recording it), not by the next read of the row: here the end comes
    /// 150 ms after a row read, which a timer alone would see only 100 ms later.
    #[tokio::test]
    async fn a_held_reply_wakes_when_the_worker_writes_its_end() {
        let d = tempfile_dir();
        let server = Transfers::open(&d).await.unwrap();
        // The worker: another connection, and a live process as the task's owner.
        let worker = Transfers::open(&d).await.unwrap();
        let mut owner = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let id = server.record(&NewTask::for_test()).await.unwrap();
        let log = server.create_log(id).await.unwrap();
        append_log(&log, "== transfer task");
        server
            .set_owner(id, owner.id(), &process_start(owner.id()))
            .await
            .unwrap();
        server.mark_running(id, now()).await.unwrap();
        server.started(id);
        let t0 = tokio::time::Instant::now();
        let ended = tokio::spawn(async move {
            // Row reads at 0 and 250 ms (plus the first one after the watch starts): the end
            // lands between two of them.
            tokio::time::sleep(Duration::from_millis(400)).await;
            worker
                .finish(id, End::Completed(&json!({"ok": 1})), &json!({}), now())
                .await
                .unwrap();
            append_log(&log, &format!("[transfer] task={id} completed"));
            tokio::time::Instant::now()
        });
        let r = server.hold_reply(id, Duration::from_secs(5)).await;
        let replied = tokio::time::Instant::now();
        let end = ended.await.unwrap();
        owner.kill().unwrap();
        owner.wait().unwrap();
        let r = r.expect("the reply waited for the end");
        assert_eq!(r["status"], "completed", "{r}");
        let late = replied - end;
        println!(
            "held reply: {:?} after the end ({:?} in all)",
            late,
            replied - t0
        );
        assert!(
            late < Duration::from_millis(60),
            "woken {late:?} after the end"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "rsb-transfers-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
