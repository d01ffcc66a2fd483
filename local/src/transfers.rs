//! Background file transfers: a sync above the inline limits runs in a detached worker process
//! (`rsb transfer run <id>`, its own session, stdio to the task log), with a durable SQLite
//! record (`<state_dir>/rsb.sqlite3`, table `transfer_tasks`) and a per-task log
//! (`<state_dir>/transfers/transfer-<id>.log`). The worker outlives the server that started it:
//! a client that closes or restarts `rsb mcp` does not stop an upload, and any later server
//! reads the task's progress and result from the record.
//!
//! The worker rebuilds the sync from `spec_json` and connects with the sandbox definition the
//! server persisted (the watchdog's secret-free form, [`crate::watchdog::sandboxes`]). A
//! sandbox that needs a secret rsb may not store (a password, without
//! `RSB_WATCHDOG_STORE_PASSWORDS=1`) runs its transfer inside the server instead, as a tokio
//! task, and the reply says so.
//!
//! `pid` in a reply is the worker's. Cancel raises the record's flag and sends SIGTERM; the
//! worker stops within a second and records `cancelled` (nothing partial is left at the
//! destination). A task whose process died (SIGKILL, a crash, a reboot) is reported as
//! `interrupted`, by the same /proc identity check the agent uses for its jobs.
//!
//! The table lives in the shared store ([`crate::store`]), which owns the schema and migrations.

use std::{
    collections::{HashMap, HashSet},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{
    error::{Kind, Result, RsbError},
    pool::Pool,
    sync::{Direction, Progress, RunOptions, SyncRules, SyncSpec},
};

pub use crate::store::DB_FILE;
/// Progress is written to the database at most this often (plus a final write).
const PROGRESS_WRITE_EVERY: Duration = Duration::from_millis(500);
/// A progress line goes to the task log at most this often while bytes move.
const LOG_PROGRESS_EVERY: Duration = Duration::from_secs(5);
const LOG_TAIL_READ: u64 = 80_000;
const LOG_TAIL_MAX_CHARS: usize = 20_000;
/// Where a worker finds its end of the socket pair to the agent its server starts for it.
const WORKER_AGENT_FD: i32 = 3;

static WORKERS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Called by the `rsb` binary at start: its own executable can run `rsb transfer run <id>`.
/// A process that uses this library otherwise (a test binary) runs transfers in-process,
/// since re-executing it would not reach the worker.
pub fn enable_workers() {
    WORKERS.store(true, std::sync::atomic::Ordering::Relaxed);
}

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
/// can be told from a reused pid (from /proc on Linux, libproc on macOS). Empty where the
/// process table cannot be read.
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
pub fn utc_stamp(ts: f64) -> String {
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
    in_process: bool,
}

/// What a worker needs to run the same sync again (`transfer_tasks.spec_json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TaskSpec {
    upload: bool,
    local_path: PathBuf,
    remote_path: String,
    delete_extras: bool,
    rules: SyncRules,
    #[serde(default)]
    overwrite: bool,
    #[serde(default)]
    safe: bool,
    #[serde(default)]
    confirm_delete: bool,
    /// The agent the server verified on the host (see [`crate::connect::VerifiedAgent`]).
    #[serde(default)]
    agent: Option<crate::connect::VerifiedAgent>,
}

impl TaskSpec {
    fn from_spec(s: &SyncSpec, o: &RunOptions) -> TaskSpec {
        TaskSpec {
            upload: s.direction == Direction::Upload,
            local_path: s.local_path.clone(),
            remote_path: s.remote_path.clone(),
            delete_extras: s.delete_extras,
            rules: s.rules.clone(),
            overwrite: o.overwrite,
            safe: o.safe,
            confirm_delete: o.confirm_delete,
            agent: None,
        }
    }

    fn options(&self) -> RunOptions {
        RunOptions {
            overwrite: self.overwrite,
            safe: self.safe,
            confirm_delete: self.confirm_delete,
            ..RunOptions::default()
        }
    }

    fn to_spec(&self) -> SyncSpec {
        SyncSpec {
            direction: if self.upload {
                Direction::Upload
            } else {
                Direction::Download
            },
            local_path: self.local_path.clone(),
            remote_path: self.remote_path.clone(),
            delete_extras: self.delete_extras,
            rules: self.rules.clone(),
            dry_run: false,
        }
    }
}

pub struct Transfers {
    state_dir: PathBuf,
    db: Mutex<Connection>,
    live: Mutex<HashMap<i64, Live>>,
    /// Tasks recorded but whose worker is not started yet (not `interrupted` meanwhile).
    spawning: Mutex<HashSet<i64>>,
    my_start: String,
    /// How far into each task's log this server has already replied: a poll returns the log
    /// header and tail once, then only the lines written since (a model polling a long
    /// transfer should not pay for the same header every time).
    log_seen: Mutex<HashMap<i64, u64>>,
    /// Baselines as last read or written here, with the `PRAGMA data_version` of that moment:
    /// while it reads the same, no other connection committed anything, so the copy is the
    /// row (a no-change resync of 2,000 files then skips ~150 KB of JSON, ~2 ms).
    baselines: Mutex<HashMap<BaselineKey, (i64, Arc<Baseline>)>>,
    /// Loads answered from `baselines` and loads that read the row (the cache's hit rate).
    baseline_hits: std::sync::atomic::AtomicU64,
    baseline_misses: std::sync::atomic::AtomicU64,
}

use crate::store::baselines::{self, Baseline, Key as BaselineKey, data_version};

impl Transfers {
    /// Open (creating, 0600) and migrate `<state_dir>/rsb.sqlite3`.
    pub fn open(state_dir: &Path) -> Result<Transfers> {
        // The schema, its migrations and the file modes live in the shared store.
        let conn = crate::store::open(state_dir)?;
        // Page damage is an error here, not a missing task or baseline later.
        crate::store::check(&conn)?;
        Ok(Transfers {
            state_dir: state_dir.to_path_buf(),
            db: Mutex::new(conn),
            live: Mutex::new(HashMap::new()),
            spawning: Mutex::new(HashSet::new()),
            my_start: process_start(std::process::id()),
            log_seen: Mutex::new(HashMap::new()),
            baselines: Mutex::new(HashMap::new()),
            baseline_hits: Default::default(),
            baseline_misses: Default::default(),
        })
    }

    pub fn db_path(&self) -> PathBuf {
        self.state_dir.join(DB_FILE)
    }

    fn row(&self, id: i64) -> Result<Option<Row>> {
        let db = self.db.lock();
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

    /// Record and start a background sync; returns the seed's background reply. The sync runs
    /// in a detached worker process when the sandbox can be persisted without a secret rsb may
    /// not store; otherwise inside this server, and the reply's `note` says so.
    pub fn start(
        self: &Arc<Self>,
        pool: Arc<Pool>,
        sandbox: String,
        spec: SyncSpec,
        opts: &RunOptions,
        excludes: &[String],
        exclude_file: &str,
    ) -> Result<Value> {
        let ts = now();
        let my_pid = std::process::id() as i64;
        let local = spec.local_path.display().to_string();
        let mut task = TaskSpec::from_spec(&spec, opts);
        if let Some(crate::config::Transport::Ssh(t)) =
            pool.sandbox_config(&sandbox).map(|c| &c.transport)
        {
            task.agent = crate::connect::verified_agent(t);
        }
        let spec_json = serde_json::to_string(&task).map_err(db_err)?;
        let id = {
            let db = self.db.lock();
            db.execute(
                "INSERT INTO transfer_tasks (direction, sandbox_name, local_path, remote_path,
                   delete_extras, excludes_json, exclude_file, status, pid, owner_start,
                   progress_json, created_ts, updated_ts, spec_json)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'queued', ?8, ?9, ?10, ?11, ?11, ?12)",
                params![
                    spec.direction.as_str(),
                    sandbox,
                    local,
                    spec.remote_path,
                    spec.delete_extras as i64,
                    serde_json::to_string(excludes).unwrap_or_else(|_| "[]".into()),
                    exclude_file,
                    my_pid,
                    self.my_start,
                    json!({"phase": "queued"}).to_string(),
                    ts,
                    spec_json,
                ],
            )
            .map_err(db_err)?;
            let id = db.last_insert_rowid();
            // Before the lock goes: a concurrent check must not read it as `interrupted`.
            self.spawning.lock().insert(id);
            id
        };
        let r = self.start_recorded(id, ts, pool, sandbox, spec, task.options(), task.agent);
        self.spawning.lock().remove(&id);
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn start_recorded(
        self: &Arc<Self>,
        id: i64,
        ts: f64,
        pool: Arc<Pool>,
        sandbox: String,
        spec: SyncSpec,
        opts: RunOptions,
        agent: Option<crate::connect::VerifiedAgent>,
    ) -> Result<Value> {
        let local = spec.local_path.display().to_string();
        let dir = self.state_dir.join("transfers");
        let _ = crate::store::ensure_private_dir(&dir);
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

        let persisted = if WORKERS.load(std::sync::atomic::Ordering::Relaxed) {
            self.persist_sandbox(&pool, &sandbox)
        } else {
            Err("this process is not the rsb executable, which runs workers".to_string())
        };
        let why_in_process = match persisted {
            // The worker's agent rides this server's warm connection while the server lives
            // (no SSH handshake, no probe: ~100 ms less per background sync); it reconnects by
            // itself if the server goes first.
            Ok(()) => match self.spawn_worker(id, &log, agent.is_some()) {
                Ok((pid, bridge)) => {
                    append_log(&log, &format!("[transfer] task={id} worker pid={pid}"));
                    if let (Some(ours), Some(a)) = (bridge, agent) {
                        let log = log.clone();
                        tokio::spawn(async move {
                            let carried = match pool.live_session(&sandbox).await {
                                Some(ssh) => match tokio::net::UnixStream::from_std(ours) {
                                    Ok(s) => {
                                        crate::connect::bridge_agent(&ssh, &sandbox, &a, s).await
                                    }
                                    Err(e) => Err(e.to_string()),
                                },
                                None => Err("it is not connected".into()),
                            };
                            if let Err(e) = carried {
                                append_log(
                                    &log,
                                    &format!(
                                        "[transfer] task={id} the server's connection cannot carry the worker ({e})"
                                    ),
                                );
                            }
                        });
                    }
                    return Ok(json!({
                        "mode": "background",
                        "auto_switched": true,
                        "task_id": id,
                        "status": "queued",
                        "pid": pid,
                        "log_file": log_s,
                    }));
                }
                Err(e) => format!("the transfer worker could not be started ({e})"),
            },
            Err(msg) => msg,
        };
        self.exec(
            "UPDATE transfer_tasks SET in_process = 1 WHERE id = ?1",
            params![id],
        )?;
        append_log(
            &log,
            &format!("[transfer] task={id} runs inside the server: {why_in_process}"),
        );

        let cancel = CancellationToken::new();
        let (done_tx, done_rx) = watch::channel(false);
        let this = self.clone();
        let token = cancel.clone();
        let handle = tokio::spawn(async move {
            this.run_task(id, pool, sandbox, spec, opts, token, log, false)
                .await;
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
            "pid": std::process::id(),
            "log_file": log_s,
            "note": format!(
                "this transfer runs inside the MCP server and stops if the server exits: {why_in_process}"
            ),
        }))
    }

    /// Store the sandbox's secret-free definition (plus its secret only on the user's opt-in),
    /// or say in one line why a worker could not connect with what is stored.
    fn persist_sandbox(&self, pool: &Pool, sandbox: &str) -> std::result::Result<(), String> {
        use crate::watchdog::{sandboxes, settings};
        let cfg = pool
            .sandbox_config(sandbox)
            .ok_or_else(|| format!("sandbox '{sandbox}' is not configured"))?;
        let db = self.db.lock();
        sandboxes::persist(
            &db,
            &self.state_dir,
            std::slice::from_ref(cfg),
            settings::store_passwords(),
        )
        .map_err(|e| e.message)?;
        let def = sandboxes::load(&db, sandbox)
            .map_err(|e| e.message)?
            .ok_or_else(|| format!("sandbox '{sandbox}' could not be stored"))?;
        def.to_config(sandboxes::read_secrets(&self.state_dir).get(sandbox))
            .map(|_| ())
    }

    /// Start `rsb transfer run <id>` in its own session, stdio to the task log, with the
    /// environment every child gets ([`crate::connect::child_env`]) plus the state dir. With
    /// `bridge`, the worker also gets one end of a socket pair as fd 3 (`--agent-fd 3`), and
    /// the other end is returned (non-blocking) for the agent this server starts for it.
    fn spawn_worker(
        &self,
        id: i64,
        log: &Path,
        bridge: bool,
    ) -> std::io::Result<(u32, Option<std::os::unix::net::UnixStream>)> {
        use std::os::unix::{fs::OpenOptionsExt, io::AsRawFd, process::CommandExt};
        let pair = if bridge {
            let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
            ours.set_nonblocking(true)?;
            Some((ours, theirs))
        } else {
            None
        };
        let theirs_fd = pair.as_ref().map(|(_, t)| t.as_raw_fd());
        let exe = std::env::current_exe()?;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(log)?;
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["transfer", "run", &id.to_string()]);
        if theirs_fd.is_some() {
            cmd.args(["--agent-fd", &WORKER_AGENT_FD.to_string()]);
        }
        cmd.env_clear()
            .envs(crate::connect::child_env())
            .env("RSB_STATE_DIR", &self.state_dir)
            // The user's compression override (withheld from other children as an RSB_ var).
            .envs(
                std::env::var_os(crate::sync::compress::ENV)
                    .map(|v| (crate::sync::compress::ENV, v)),
            )
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // dup2 and fcntl are async-signal-safe too; the copy at fd 3 is inheritable.
                if let Some(fd) = theirs_fd {
                    let r = if fd == WORKER_AGENT_FD {
                        libc::fcntl(fd, libc::F_SETFD, 0)
                    } else {
                        libc::dup2(fd, WORKER_AGENT_FD)
                    };
                    if r < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        // The worker holds its end now; ours is the only one left here.
        let bridge = pair.map(|(ours, _theirs)| ours);
        let pid = child.id();
        let _ = self.exec(
            "UPDATE transfer_tasks SET pid = ?1, owner_start = ?2 WHERE id = ?3",
            params![pid as i64, process_start(pid), id],
        );
        // Reaped here while this server lives (a zombie would read as dead anyway); once the
        // server exits, init adopts the worker.
        std::thread::Builder::new()
            .name(format!("rsb-transfer-{id}-reaper"))
            .spawn(move || {
                let _ = child.wait();
            })?;
        Ok((pid, bridge))
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_task(
        self: &Arc<Self>,
        id: i64,
        pool: Arc<Pool>,
        sandbox: String,
        spec: SyncSpec,
        opts: RunOptions,
        cancel: CancellationToken,
        log: PathBuf,
        bridged: bool,
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
        let mut res =
            crate::ops::sync::run_with(&pool, &sandbox, &spec, &opts, Some(cb.clone()), &cancel)
                .await;
        // The server whose connection carried the agent went away: connect directly and run
        // the same sync again, which skips what already arrived (staged large files resume).
        if bridged
            && !cancel.is_cancelled()
            && matches!(&res, Err(e) if matches!(e.kind, Kind::ConnectionLost | Kind::Connect))
        {
            append_log(
                &log,
                &format!(
                    "[transfer] task={id} the server's connection ended; reconnecting and resuming"
                ),
            );
            let before = shared.lock().0.clone();
            res =
                crate::ops::sync::run_with(&pool, &sandbox, &spec, &opts, Some(cb), &cancel).await;
            // The task's report covers both runs: the files the rerun found in place beyond
            // those the first run's plan already found unchanged are the first run's (counted
            // so, not by its acknowledgements, which the cut may have lost).
            if let Ok(r) = &mut res
                && matches!(
                    before.phase,
                    crate::sync::Phase::Transferring | crate::sync::Phase::Deleting
                )
            {
                let first = r.skipped_files.saturating_sub(before.files_unchanged);
                r.files_transferred += first;
                r.skipped_files -= first;
                r.bytes_sent += before.bytes_done;
                r.dirs_created += before.dirs_done;
            }
        }
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

    /// The last-synced content of (local root, sandbox, remote root); `None` only when no
    /// sync of it completed. A store or row that cannot be read is an error (a sync must refuse
    /// rather than run as a first sync and overwrite a remote edit).
    pub fn load_baseline(
        &self,
        local: &str,
        sandbox: &str,
        remote: &str,
    ) -> Result<Option<Baseline>> {
        Ok(self
            .load_baseline_shared(local, sandbox, remote)?
            .map(|b| b.as_ref().clone()))
    }

    /// [`Transfers::load_baseline`] without a copy, from memory while the store is unchanged.
    pub fn load_baseline_shared(
        &self,
        local: &str,
        sandbox: &str,
        remote: &str,
    ) -> Result<Option<Arc<Baseline>>> {
        let key = (local.to_string(), sandbox.to_string(), remote.to_string());
        let db = self.db.lock();
        let version = data_version(&db);
        use std::sync::atomic::Ordering::Relaxed;
        if let Some((v, b)) = self.baselines.lock().get(&key)
            && Some(*v) == version
        {
            self.baseline_hits.fetch_add(1, Relaxed);
            return Ok(Some(b.clone()));
        }
        self.baseline_misses.fetch_add(1, Relaxed);
        let Some(b) = baselines::load(&db, &key)? else {
            return Ok(None);
        };
        let b = Arc::new(b);
        if let Some(v) = version {
            self.baselines.lock().insert(key, (v, b.clone()));
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
    pub fn touch_baseline(&self, local: &str, sandbox: &str, remote: &str) -> Result<()> {
        let key = (local.to_string(), sandbox.to_string(), remote.to_string());
        baselines::touch(&self.db.lock(), &key, crate::store::now_s())
    }

    pub fn save_baseline(
        &self,
        local: &str,
        sandbox: &str,
        remote: &str,
        entries: &HashMap<String, [u8; 32]>,
    ) -> Result<()> {
        let key = (local.to_string(), sandbox.to_string(), remote.to_string());
        let db = self.db.lock();
        // Read before the write: a commit by another connection after it changes the version.
        let version = data_version(&db);
        let written = baselines::save(&db, &key, entries);
        let mut cache = self.baselines.lock();
        match (written, version) {
            (Ok(_), Some(v)) => {
                cache.insert(key, (v, Arc::new(entries.clone())));
                Ok(())
            }
            (Ok(_), None) => {
                cache.remove(&key);
                Ok(())
            }
            (Err(e), _) => {
                cache.remove(&key);
                Err(e)
            }
        }
    }

    fn is_live(&self, id: i64) -> bool {
        self.live.lock().contains_key(&id)
    }

    /// Mark a queued/running task whose owner is gone as `interrupted`; returns the new status.
    fn settle(&self, id: i64, row: &mut Row) {
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
    pub async fn hold_reply(&self, id: i64, budget: Duration) -> Option<Value> {
        let start = tokio::time::Instant::now();
        loop {
            let mut row = self.row(id).ok().flatten()?;
            self.settle(id, &mut row);
            if is_terminal(&row.status) {
                return self.check(id, 20).ok();
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
            let done = part("bytes_done", "bytes_total").max(part("files_done", "files_total"));
            if elapsed >= Duration::from_millis(300)
                && done > 0.0
                && elapsed.as_secs_f64() / done > budget.as_secs_f64() * 1.25
            {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
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
            let mut row = self.row(id).ok().flatten()?;
            self.settle(id, &mut row);
            if is_terminal(&row.status) {
                return Some(row.status);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `rsb transfer run <id>`: the detached worker. Claims the queued task, connects with the
    /// persisted sandbox definition, runs the sync and records its end. SIGTERM (what cancel
    /// sends) and the record's cancel flag both stop it cleanly.
    pub async fn run_worker(
        self: &Arc<Self>,
        id: i64,
        agent_fd: Option<i32>,
    ) -> std::result::Result<(), String> {
        use crate::watchdog::sandboxes;
        let me = std::process::id() as i64;
        let (sandbox, spec_json, log_file): (String, String, String) = self
            .db
            .lock()
            .query_row(
                "SELECT sandbox_name, spec_json, log_file FROM transfer_tasks WHERE id = ?1",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("unknown transfer task id: {id}"))?;
        let claimed = self
            .db
            .lock()
            .execute(
                "UPDATE transfer_tasks SET pid = ?1, owner_start = ?2, in_process = 0
                 WHERE id = ?3 AND status = 'queued'",
                params![me, self.my_start, id],
            )
            .map_err(|e| e.to_string())?;
        if claimed == 0 {
            return Err(format!("transfer task {id} is not queued"));
        }
        let log = PathBuf::from(log_file);
        let fail = |this: &Self, msg: String| {
            let ts = now();
            let _ = this.exec(
                "UPDATE transfer_tasks SET status = 'failed', finished_ts = ?1, updated_ts = ?1,
                   last_error = ?2, progress_json = json_set(progress_json, '$.phase', 'failed')
                 WHERE id = ?3",
                params![ts, msg, id],
            );
            append_log(&log, &format!("[transfer] task={id} failed: {msg}"));
            msg
        };
        let spec: TaskSpec = match serde_json::from_str(&spec_json) {
            Ok(s) => s,
            Err(e) => return Err(fail(self, format!("unreadable task record: {e}"))),
        };
        let def = match sandboxes::load(&self.db.lock(), &sandbox) {
            Ok(Some(d)) => d,
            _ => {
                return Err(fail(
                    self,
                    format!("sandbox '{sandbox}' is not stored in the state dir"),
                ));
            }
        };
        let cfg = match def.to_config(sandboxes::read_secrets(&self.state_dir).get(&sandbox)) {
            Ok(c) => c,
            Err(msg) => return Err(fail(self, msg)),
        };
        if let (crate::config::Transport::Ssh(t), Some(a)) = (&cfg.transport, &spec.agent) {
            crate::connect::trust_verified_agent(t, a);
        }
        let config = crate::config::Config {
            sandboxes: vec![cfg],
            expose_advanced_tools: false,
            inline_sync_max_files: crate::config::DEFAULT_INLINE_SYNC_MAX_FILES,
            inline_sync_max_bytes: crate::config::DEFAULT_INLINE_SYNC_MAX_BYTES,
            state_dir: self.state_dir.clone(),
            source: "transfer worker".into(),
            warnings: Vec::new(),
        };
        let pool = Arc::new(Pool::new(Arc::new(config)));
        let mut bridged = false;
        if let (Some(fd), Some(a)) = (agent_fd, &spec.agent) {
            match bridged_stream(fd) {
                Some(s) => match crate::connect::adopt_bridged(&sandbox, s, a).await {
                    Some(conn) => {
                        pool.adopt(&sandbox, conn).await;
                        bridged = true;
                        append_log(
                            &log,
                            &format!(
                                "[transfer] task={id} agent started on the server's connection"
                            ),
                        );
                    }
                    None => append_log(
                        &log,
                        &format!("[transfer] task={id} no agent from the server; connecting"),
                    ),
                },
                None => append_log(
                    &log,
                    &format!("[transfer] task={id} fd {fd} is not a socket; connecting"),
                ),
            }
        }
        let cancel = CancellationToken::new();
        let on_term = {
            let cancel = cancel.clone();
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .map_err(|e| fail(self, format!("cannot handle SIGTERM: {e}")))?;
            tokio::spawn(async move {
                if term.recv().await.is_some() {
                    cancel.cancel();
                }
            })
        };
        self.run_task(
            id,
            pool.clone(),
            sandbox,
            spec.to_spec(),
            spec.options(),
            cancel,
            log,
            bridged,
        )
        .await;
        on_term.abort();
        pool.shutdown().await;
        Ok(())
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
        // A worker (or another live server's task): raise the flag it polls, signal a worker,
        // and wait for it to record its end.
        self.exec(
            "UPDATE transfer_tasks SET cancel_requested = 1, updated_ts = ?1 WHERE id = ?2",
            params![now(), id],
        )?;
        let worker = !row.in_process && pid_alive(row.pid, &row.owner_start);
        if worker {
            signal(row.pid, libc::SIGTERM);
        }
        let deadline = tokio::time::Instant::now() + grace.max(Duration::from_secs(2));
        loop {
            let mut r = self.row(id)?.ok_or_else(|| Self::unknown(id))?;
            self.settle(id, &mut r);
            if is_terminal(&r.status) {
                let mut v = json!({"task_id": id, "status": r.status, "terminated": true});
                if r.status != "cancelled" {
                    v["already_finished"] = json!(true);
                }
                return Ok(v);
            }
            if tokio::time::Instant::now() >= deadline {
                if worker && pid_alive(r.pid, &r.owner_start) {
                    signal(r.pid, libc::SIGKILL);
                    let ts = now();
                    let _ = self.exec(
                        "UPDATE transfer_tasks SET status = 'cancelled', finished_ts = ?1,
                           updated_ts = ?1,
                           progress_json = json_set(progress_json, '$.phase', 'cancelled')
                         WHERE id = ?2 AND status IN ('queued','running')",
                        params![ts, id],
                    );
                    append_log(
                        Path::new(&r.log_file),
                        &format!(
                            "[transfer] task={id} cancelled (worker killed after {force_kill_after_s}s)"
                        ),
                    );
                    return Ok(json!({
                        "task_id": id, "status": "cancelled", "terminated": true, "force_killed": true,
                    }));
                }
                return Ok(json!({
                    "task_id": id,
                    "status": r.status,
                    "cancel_requested": true,
                    "error": format!("the task belongs to another rsb server (pid {}); it was asked to stop", r.pid),
                }));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The worker's end of its server's socket pair, when `fd` is a socket (a stray number is not
/// taken over).
fn bridged_stream(fd: i32) -> Option<tokio::net::UnixStream> {
    use std::os::unix::io::FromRawFd;
    // SAFETY: fstat on any fd number is sound; it only reads its type.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    // SAFETY: the server passed this socket to this process for this purpose only; nothing
    // else here owns it.
    let s = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    s.set_nonblocking(true).ok()?;
    tokio::net::UnixStream::from_std(s).ok()
}

/// Send `sig` to a worker whose identity was just checked.
fn signal(pid: i64, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid)
        && pid > 0
    {
        // SAFETY: kill has no memory effects; a vanished pid yields ESRCH, ignored.
        unsafe {
            libc::kill(pid, sig);
        }
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

    #[test]
    fn a_baseline_is_read_from_memory_until_another_connection_commits() {
        let d = tempfile_dir();
        let a = Transfers::open(&d).unwrap();
        let b = Transfers::open(&d).unwrap();
        let one: Baseline = [("x".to_string(), [1; 32])].into();
        let two: Baseline = [("x".to_string(), [2; 32])].into();
        assert!(a.load_baseline_shared("l", "s", "r").unwrap().is_none());
        a.save_baseline("l", "s", "r", &one).unwrap();
        let first = a.load_baseline_shared("l", "s", "r").unwrap().unwrap();
        assert_eq!(*first, one);
        // Nothing else committed: the same copy, no read.
        assert!(Arc::ptr_eq(
            &first,
            &a.load_baseline_shared("l", "s", "r").unwrap().unwrap()
        ));
        // Another connection (a worker) writes the row: the next load reads it.
        b.save_baseline("l", "s", "r", &two).unwrap();
        assert_eq!(
            *a.load_baseline_shared("l", "s", "r").unwrap().unwrap(),
            two
        );
        assert_eq!(b.load_baseline("l", "s", "r").unwrap().unwrap(), two);
        let _ = std::fs::remove_dir_all(&d);
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
