//! Running background transfers: a sync above the inline limits runs in a detached worker
//! process (`rsb transfer run <id>`, its own session, stdio to the task log) with a durable
//! record in the store (`store::transfers`). The worker outlives the server that started it: a
//! client that closes or restarts `rsb mcp` does not stop an upload.
//!
//! The worker rebuilds the sync from `spec_json` and connects with the sandbox definition the
//! server persisted (the secret-free form, [`crate::store::sandboxes`]). A sandbox that needs
//! a secret rsb may not store (a password, without `RSB_WATCHDOG_STORE_PASSWORDS=1`) runs its
//! transfer inside the server instead, as a tokio task, and the reply says so.
//!
//! `pid` in a reply is the worker's. Cancel raises the record's flag and sends SIGTERM; the
//! worker stops within a second and records `cancelled` (nothing partial is left at the
//! destination).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{
    app::App,
    error::{Kind, Result, RsbError},
    pool::Pool,
    store::transfers::{
        End, Live, NewTask, Transfers, append_log, is_terminal, now, pid_alive, process_start,
        utc_stamp,
    },
    sync::{Direction, Progress, RunOptions, SyncRules, SyncSpec},
};

/// Progress is written to the database at most this often (plus a final write).
const PROGRESS_WRITE_EVERY: Duration = Duration::from_millis(500);
/// A progress line goes to the task log at most this often while bytes move.
const LOG_PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// Where a worker finds its end of the socket pair to the agent its server starts for it.
const WORKER_AGENT_FD: i32 = 3;

static WORKERS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Called by the `rsb` binary at start: its own executable can run `rsb transfer run <id>`.
/// A process that uses this library otherwise (a test binary) runs transfers in-process,
/// since re-executing it would not reach the worker.
pub fn enable_workers() {
    WORKERS.store(true, std::sync::atomic::Ordering::Relaxed);
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
    if !p.waiting_for.is_empty() {
        v["waiting_for"] = json!(p.waiting_for);
    }
    v
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

impl Transfers {
    /// Record and start a background sync; returns the seed's background reply. The sync runs
    /// in a detached worker process when the sandbox can be persisted without a secret rsb may
    /// not store; otherwise inside this server, and the reply's `note` says so.
    pub async fn start(
        self: &Arc<Self>,
        app: Arc<App>,
        sandbox: String,
        spec: SyncSpec,
        opts: &RunOptions,
        excludes: &[String],
        exclude_file: &str,
    ) -> Result<Value> {
        let ts = now();
        let local = spec.local_path.display().to_string();
        let mut task = TaskSpec::from_spec(&spec, opts);
        if let Some(crate::config::Transport::Ssh(t)) =
            app.pool().sandbox_config(&sandbox).map(|c| &c.transport)
        {
            task.agent = crate::connect::verified_agent(t);
        }
        let spec_json = serde_json::to_string(&task).map_err(|e| {
            RsbError::new(
                Kind::Internal,
                format!("the transfer task cannot be recorded: {e}"),
                "report this as an rsb bug",
            )
        })?;
        let sandbox_fp = app
            .pool()
            .sandbox_config(&sandbox)
            .map(crate::store::sandboxes::fingerprint)
            .unwrap_or_default();
        let id = self
            .record(&NewTask {
                direction: spec.direction.as_str(),
                sandbox: &sandbox,
                sandbox_fp: &sandbox_fp,
                local_path: &local,
                remote_path: &spec.remote_path,
                delete_extras: spec.delete_extras,
                excludes,
                exclude_file,
                spec_json: &spec_json,
                created_ts: ts,
            })
            .await?;
        let r = self
            .start_recorded(id, ts, app, sandbox, spec, task.options(), task.agent)
            .await;
        self.started(id);
        r
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_recorded(
        self: &Arc<Self>,
        id: i64,
        ts: f64,
        app: Arc<App>,
        sandbox: String,
        spec: SyncSpec,
        opts: RunOptions,
        agent: Option<crate::connect::VerifiedAgent>,
    ) -> Result<Value> {
        let local = spec.local_path.display().to_string();
        let log = self.create_log(id).await?;
        let log_s = log.display().to_string();
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
            self.persist_sandbox(app.pool(), &sandbox).await
        } else {
            Err("this process is not the rsb executable, which runs workers".to_string())
        };
        let why_in_process = match persisted {
            // The worker's agent rides this server's warm connection while the server lives
            // (no SSH handshake, no probe: ~100 ms less per background sync); it reconnects by
            // itself if the server goes first.
            Ok(()) => match self.spawn_worker(id, &log, agent.is_some()) {
                Ok((pid, bridge)) => {
                    let _ = self.set_owner(id, pid, &process_start(pid)).await;
                    append_log(&log, &format!("[transfer] task={id} worker pid={pid}"));
                    if let (Some(ours), Some(a)) = (bridge, agent) {
                        let (log, pool) = (log.clone(), app.pool().clone());
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
        self.mark_in_process(id).await?;
        append_log(
            &log,
            &format!("[transfer] task={id} runs inside the server: {why_in_process}"),
        );

        let cancel = CancellationToken::new();
        let (done_tx, done_rx) = watch::channel(false);
        let this = self.clone();
        let token = cancel.clone();
        let handle = tokio::spawn(async move {
            this.run_task(id, app, sandbox, spec, opts, token, log, false)
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
    async fn persist_sandbox(&self, pool: &Pool, sandbox: &str) -> std::result::Result<(), String> {
        use crate::store::sandboxes;
        let cfg = pool
            .sandbox_config(sandbox)
            .ok_or_else(|| format!("sandbox '{sandbox}' is not configured"))?
            .clone();
        let (dir, name) = (self.state_dir.clone(), sandbox.to_string());
        let resolved = self
            .store()
            .call(move |db| {
                sandboxes::persist(
                    db,
                    &dir,
                    std::slice::from_ref(&cfg),
                    sandboxes::store_passwords(),
                )?;
                sandboxes::resolve(db, &dir, &sandboxes::fingerprint(&cfg), &name)
            })
            .await
            .map_err(|e| e.message)?;
        resolved
            .ok_or_else(|| format!("sandbox '{sandbox}' could not be stored"))?
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
            // The user's compression and lanes overrides (withheld from other children as
            // RSB_ vars).
            .envs(
                [crate::sync::compress::ENV, crate::sync::engine::lanes::ENV]
                    .into_iter()
                    .filter_map(|k| std::env::var_os(k).map(|v| (k, v))),
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
        app: Arc<App>,
        sandbox: String,
        spec: SyncSpec,
        opts: RunOptions,
        cancel: CancellationToken,
        log: PathBuf,
        bridged: bool,
    ) {
        let started = now();
        let _ = self.mark_running(id, started).await;
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
                        let _ = this.write_progress(id, &progress_json(&p, "")).await;
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
                    let flagged = this.cancel_requested(id).await;
                    if flagged {
                        cancel.cancel();
                    }
                }
            })
        };
        let mut res =
            super::runner::run_with(&app, &sandbox, &spec, &opts, Some(cb.clone()), &cancel).await;
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
            res = super::runner::run_with(&app, &sandbox, &spec, &opts, Some(cb), &cancel).await;
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
        // The result is on the audit record, written by whoever ran it (this server or the
        // detached worker): what moved, or why not.
        crate::audit::record(
            app.config(),
            &sandbox,
            &crate::audit::Action {
                origin: "transfer".into(),
                tool: "background sync".into(),
                command: Some(format!("task {id}")),
                duration_ms: Some(((end - started).max(0.0) * 1000.0) as u64),
                error: res.as_ref().err().map(|e| {
                    if cancel.is_cancelled() {
                        format!("cancelled: {}", e.message)
                    } else {
                        e.message.clone()
                    }
                }),
                detail: res
                    .as_ref()
                    .ok()
                    .and_then(|r| crate::audit::reply_summary(&r.to_json())),
                ..Default::default()
            },
        );
        match res {
            Ok(report) => {
                let result = report.to_json();
                let mut prog = progress_json(&p, report.synced_type);
                prog["phase"] = json!("complete");
                prog["duration_s"] = json!((report.duration_s * 1000.0).round() / 1000.0);
                let _ = self.finish(id, End::Completed(&result), &prog, end).await;
                append_log(&log, &format!("[transfer] task={id} result={result}"));
                append_log(&log, &format!("[transfer] task={id} completed"));
            }
            Err(e) if cancel.is_cancelled() => {
                let mut prog = progress_json(&p, "");
                prog["phase"] = json!("cancelled");
                let _ = self.finish(id, End::Cancelled, &prog, end).await;
                append_log(
                    &log,
                    &format!("[transfer] task={id} cancelled ({})", e.message),
                );
            }
            Err(e) => {
                let mut prog = progress_json(&p, "");
                prog["phase"] = json!("failed");
                let _ = self.finish(id, End::Failed(&e.message), &prog, end).await;
                append_log(&log, &format!("[transfer] task={id} failed: {}", e.message));
                append_log(&log, &format!("[transfer] hint: {}", e.hint));
            }
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
        use crate::store::sandboxes;
        let crate::store::transfers::Claimed {
            sandbox,
            sandbox_fp,
            spec_json,
            log_file,
        } = self
            .claim(id)
            .await
            .map_err(|e| e.message)?
            .ok_or_else(|| format!("transfer task {id} is unknown or not queued"))?;
        let log = PathBuf::from(log_file);
        let spec: TaskSpec = match serde_json::from_str(&spec_json) {
            Ok(s) => s,
            Err(e) => {
                let msg = format!("unreadable task record: {e}");
                return Err(self.fail_claimed_logged(id, &log, msg).await);
            }
        };
        let (dir, fp, name) = (self.state_dir.clone(), sandbox_fp, sandbox.clone());
        let resolved = self
            .store()
            .call(move |db| sandboxes::resolve(db, &dir, &fp, &name))
            .await;
        let cfg = match resolved {
            Ok(Some(Ok(c))) => c,
            Ok(Some(Err(msg))) => return Err(self.fail_claimed_logged(id, &log, msg).await),
            _ => {
                let msg = format!("sandbox '{sandbox}' is not stored in the state dir");
                return Err(self.fail_claimed_logged(id, &log, msg).await);
            }
        };
        if let (crate::config::Transport::Ssh(t), Some(a)) = (&cfg.transport, &spec.agent) {
            crate::connect::trust_verified_agent(t, a);
        }
        let cfg_transport = cfg.transport.clone();
        let config = crate::config::Config {
            sandboxes: vec![cfg],
            expose_advanced_tools: false,
            inline_sync_max_files: crate::config::DEFAULT_INLINE_SYNC_MAX_FILES,
            inline_sync_max_bytes: crate::config::DEFAULT_INLINE_SYNC_MAX_BYTES,
            policy: Default::default(),
            state_dir: self.state_dir.clone(),
            source: "transfer worker".into(),
            warnings: Vec::new(),
        };
        // This worker's one store connection is the one it claimed the task with.
        let app = App::with_transfers(Arc::new(Pool::new(Arc::new(config))), self.clone());
        let pool = app.pool();
        let mut bridged = false;
        let target = match &cfg_transport {
            crate::config::Transport::Ssh(t) => Some(t.clone()),
            crate::config::Transport::Local => None,
        };
        if let (Some(fd), Some(a), Some(t)) = (agent_fd, &spec.agent, &target) {
            match bridged_stream(fd) {
                Some(s) => match crate::connect::adopt_bridged(&sandbox, t, s, a).await {
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
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(t) => t,
                    Err(e) => {
                        let msg = format!("cannot handle SIGTERM: {e}");
                        return Err(self.fail_claimed_logged(id, &log, msg).await);
                    }
                };
            tokio::spawn(async move {
                if term.recv().await.is_some() {
                    cancel.cancel();
                }
            })
        };
        self.run_task(
            id,
            app.clone(),
            sandbox,
            spec.to_spec(),
            spec.options(),
            cancel,
            log,
            bridged,
        )
        .await;
        on_term.abort();
        app.shutdown().await;
        Ok(())
    }

    /// A claimed task that cannot run: recorded as failed and said in its log; returns `msg`.
    async fn fail_claimed_logged(&self, id: i64, log: &Path, msg: String) -> String {
        let _ = self.fail_claimed(id, &msg).await;
        append_log(log, &format!("[transfer] task={id} failed: {msg}"));
        msg
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
        let mut row = self.row(id).await?.ok_or_else(|| Self::unknown(id))?;
        self.settle(id, &mut row).await;
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
                let _ = self.mark_cancelled(id).await;
                append_log(
                    Path::new(&row.log_file),
                    &format!(
                        "[transfer] task={id} cancelled (aborted after {force_kill_after_s}s)"
                    ),
                );
            }
            let row = self.row(id).await?.ok_or_else(|| Self::unknown(id))?;
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
        self.request_cancel(id).await?;
        // A pid is signalled only with the start time that names its process: without one
        // (a row from an rsb that could not read it) the flag is all the worker gets.
        let worker =
            !row.in_process && !row.owner_start.is_empty() && pid_alive(row.pid, &row.owner_start);
        if worker {
            signal(row.pid, libc::SIGTERM);
        }
        let deadline = tokio::time::Instant::now() + grace.max(Duration::from_secs(2));
        loop {
            let mut r = self.row(id).await?.ok_or_else(|| Self::unknown(id))?;
            self.settle(id, &mut r).await;
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
                    let _ = self.mark_cancelled(id).await;
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
    use super::*;

    fn state_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "rsb-cancel-{tag}-{}-{}",
            std::process::id(),
            now().to_bits()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A running worker task whose owner is `pid` with start `start`.
    async fn worker_task(t: &Transfers, pid: u32, start: &str) -> i64 {
        let id = t.record(&NewTask::for_test()).await.unwrap();
        t.create_log(id).await.unwrap();
        t.set_owner(id, pid, start).await.unwrap();
        t.mark_running(id, now()).await.unwrap();
        t.started(id);
        id
    }

    fn still_runs(child: &mut std::process::Child) -> bool {
        child.try_wait().unwrap().is_none()
    }

    #[tokio::test]
    async fn cancel_never_signals_a_reused_pid() {
        let d = state_dir("reused");
        let t = Transfers::open(&d).await.unwrap();
        // An unrelated process now holds the pid the dead worker had.
        let mut stranger = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let real: u64 = process_start(stranger.id()).parse().unwrap();
        let id = worker_task(&t, stranger.id(), &(real + 1).to_string()).await;
        let v = t.cancel(id, 0.2).await.unwrap();
        assert_eq!(v["status"], "interrupted", "{v}");
        assert_eq!(v["already_finished"], true, "{v}");
        std::thread::sleep(Duration::from_millis(100));
        assert!(still_runs(&mut stranger), "the stranger was signalled");
        let row = t.row(id).await.unwrap().unwrap();
        assert!(
            row.last_error.contains("exited before it finished"),
            "{}",
            row.last_error
        );

        // No start time recorded: the pid alone is never enough to signal.
        let id = worker_task(&t, stranger.id(), "").await;
        let v = t.cancel(id, 0.0).await.unwrap();
        assert_eq!(v["cancel_requested"], true, "{v}");
        assert!(still_runs(&mut stranger), "signalled on a bare pid");
        assert!(
            t.cancel_requested(id).await,
            "the flag is raised for a live worker to see"
        );

        stranger.kill().unwrap();
        stranger.wait().unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn cancel_stops_the_worker_it_recorded() {
        let d = state_dir("real");
        let t = Transfers::open(&d).await.unwrap();
        // A "worker" that ignores the flag: only the signal stops it.
        let mut worker = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let id = worker_task(&t, worker.id(), &process_start(worker.id())).await;
        let cancelling = t.cancel(id, 0.0);
        let (v, status) = tokio::join!(cancelling, async {
            tokio::task::spawn_blocking(move || worker.wait().unwrap())
                .await
                .unwrap()
        });
        let v = v.unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM), "{v}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
