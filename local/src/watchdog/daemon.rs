//! `rsb watchdog run`: the loop.
//!
//! One daemon per state dir ([`super::lock`]: `watchdog.lock`, which also holds its pid). Every
//! tick (1 s by default) it starts a check for each due watch that is
//! not already being checked; checks run concurrently as tasks, each network step under its
//! own deadline, so a dead host or a slow hook never delays another watch. Connections are one
//! pool per sandbox, kept between ticks; concurrent checks of one sandbox share a single
//! connect attempt (ten watches on a dead host cost one timeout per tick, not ten). A panic in
//! a check is caught and recorded as that watch's error.
//!
//! Crash safety: a check's outcome and its events are one transaction; event files and alerts
//! follow the commit, and an event is marked delivered only after them, so a daemon killed
//! between the two finishes the delivery when it starts again. Nothing is ever recorded twice.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use parking_lot::Mutex;
use rsb_protocol::{ExecRequest, JobStartRequest, JobStatusRequest, ReadFileRequest};
use rusqlite::Connection;
use serde_json::json;

pub use super::lock::{Holder, Lock, acquire_lock, lock_holder, running_daemon};
use super::{
    MAX_TEXT_CHARS, alerts,
    checks::{self, JobSeen, Observed, SlurmSeen},
    settings::{DEFAULT_HOOK_TIMEOUT, FileSettings},
};
use crate::{
    client::AgentClient,
    config::{Config, SandboxConfig},
    error::{Kind, Result, RsbError},
    pool::Pool,
    slurm::{
        SlurmOptions,
        poll::{self, Poller, Seen},
        state::judge,
        submit,
    },
    store::{
        self,
        events::{self, NewEvent, WatchEvent},
        now_ms, sandboxes,
        watch_model::Watch,
        watches,
    },
};

const STATUS_DEADLINE: Duration = Duration::from_secs(10);
const CHECKPOINT_DEADLINE: Duration = Duration::from_secs(15);
const RESUME_DEADLINE: Duration = Duration::from_secs(30);
/// An undelivered event older than this gets its file but no alert (a daemon restarted after
/// a long stop should not replay stale alarms).
const REPLAY_ALERTS_WITHIN_MS: i64 = 3_600_000;
/// Due watches started per tick (the rest wait for the next tick).
const MAX_STARTS_PER_TICK: i64 = 500;

#[derive(Debug, Clone)]
pub struct Options {
    pub state_dir: PathBuf,
    pub tick: Duration,
    /// `service`, `detached` or `foreground` (reported by `get_watchdog_status`).
    pub mode: String,
    pub hook_timeout: Duration,
    /// Exit after this long without active watches (detached daemons).
    pub idle_exit: Option<Duration>,
}

impl Options {
    pub fn new(state_dir: PathBuf) -> Options {
        Options {
            state_dir,
            tick: Duration::from_secs(1),
            mode: "foreground".into(),
            hook_timeout: DEFAULT_HOOK_TIMEOUT,
            idle_exit: None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Hosts: one pool per sandbox, kept between ticks

struct Host {
    cfg: SandboxConfig,
    pool: Arc<Pool>,
    /// The last failed connect, shared by the checks waiting for it.
    gate: tokio::sync::Mutex<Option<(Instant, RsbError)>>,
    /// One squeue per tick for every Slurm job watched on this definition (the process-wide
    /// pollers are keyed by name, and two definitions may share one).
    slurm: Arc<Poller>,
}

impl Host {
    fn new(cfg: SandboxConfig, state_dir: &Path) -> Host {
        let config = Config {
            sandboxes: vec![cfg.clone()],
            expose_advanced_tools: false,
            inline_sync_max_files: crate::config::DEFAULT_INLINE_SYNC_MAX_FILES,
            inline_sync_max_bytes: crate::config::DEFAULT_INLINE_SYNC_MAX_BYTES,
            policy: Default::default(),
            state_dir: state_dir.to_path_buf(),
            source: "watchdog".into(),
            warnings: Vec::new(),
        };
        Host {
            cfg,
            pool: Arc::new(Pool::new(Arc::new(config))),
            gate: tokio::sync::Mutex::new(None),
            slurm: Arc::new(Poller::paced_up_to(poll::DAEMON_PACE_MAX)),
        }
    }

    fn connect_deadline(&self) -> Duration {
        match &self.cfg.transport {
            crate::config::Transport::Ssh(t) => {
                (t.connect_timeout + Duration::from_secs(5)).min(Duration::from_secs(60))
            }
            crate::config::Transport::Local => Duration::from_secs(15),
        }
    }

    /// A live client; a connect that failed after `since` is reused instead of retried.
    async fn client(&self, since: Instant) -> Result<AgentClient> {
        let mut g = self.gate.lock().await;
        if let Some((at, e)) = g.as_ref()
            && *at >= since
        {
            return Err(e.clone());
        }
        let deadline = self.connect_deadline();
        let r = match tokio::time::timeout(deadline, self.pool.client(&self.cfg.name)).await {
            Ok(r) => r,
            Err(_) => Err(RsbError::new(
                Kind::Timeout,
                format!(
                    "SSH unreachable: no connection to sandbox '{}' within {}s",
                    self.cfg.name,
                    deadline.as_secs()
                ),
                "check the host and the network",
            )),
        };
        match r {
            Ok(c) => {
                *g = None;
                Ok(c)
            }
            Err(e) => {
                *g = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The daemon

pub struct Daemon {
    state_dir: PathBuf,
    /// The store, on its own thread: no check, tick or forward waits on a runtime thread for
    /// another process's write lock.
    store: store::Store,
    hosts: Mutex<HashMap<String, Arc<Host>>>,
    inflight: Mutex<HashSet<i64>>,
    /// The config file's hooks, reloaded when the file changes ([`Daemon::reload_settings`]).
    settings: Mutex<FileSettings>,
    /// The config file's (mtime, size) when `settings` were read.
    settings_stamp: Mutex<Option<(std::time::SystemTime, u64)>>,
    hook_timeout: Duration,
    /// Detached forwards (`forward_port(detach=true)`), served on the hosts' pools.
    forwards: Arc<super::forwards::Served>,
    /// When the heartbeat was last written ([`super::HEARTBEAT_EVERY`]), in the store's clock's
    /// ms ([`store::clock`]: a test runs it fast).
    last_beat: Mutex<Option<i64>>,
    /// When retention last ran ([`PRUNE_EVERY`]), as `last_beat`.
    last_prune: Mutex<Option<i64>>,
    /// One job-event subscription per sandbox with an active watch, by its key
    /// ([`Daemon::follow`]): a job's end starts its watch's check at once.
    subscriptions: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    /// Watches whose job ended while a check of theirs was running: checked again after it,
    /// since that check may have looked before the end.
    recheck: Mutex<HashSet<i64>>,
}

/// The first wait before a failed subscription is tried again; it doubles up to
/// [`FOLLOW_RETRY_MAX`] while the sandbox stays unreachable (the interval checks go on).
const FOLLOW_RETRY_FIRST: Duration = Duration::from_millis(500);
const FOLLOW_RETRY_MAX: Duration = Duration::from_secs(30);

/// How often the daemon applies the retention policy (`rsb state prune` does it at once).
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// Run until SIGTERM/SIGINT, the state dir vanishing, or (detached) a long idle spell.
pub async fn run(opts: Options) -> Result<()> {
    let _lock = acquire_lock(&opts.state_dir)?;
    let store = store::Store::open(&opts.state_dir).await?;
    let settings_stamp = config_stamp();
    let settings = load_settings();
    let d = Arc::new(Daemon {
        state_dir: opts.state_dir.clone(),
        forwards: Arc::new(super::forwards::Served::new(store.clone())),
        store,
        hosts: Mutex::new(HashMap::new()),
        inflight: Mutex::new(HashSet::new()),
        settings: Mutex::new(settings),
        settings_stamp: Mutex::new(settings_stamp),
        hook_timeout: opts.hook_timeout,
        last_beat: Mutex::new(None),
        last_prune: Mutex::new(None),
        subscriptions: Mutex::new(HashMap::new()),
        recheck: Mutex::new(HashSet::new()),
    });
    let started = json!({
        "pid": std::process::id(),
        "mode": opts.mode,
        "started_ts": store::now_s(),
        "version": env!("CARGO_PKG_VERSION"),
        "state_dir": opts.state_dir.display().to_string(),
    });
    d.db(move |c| watches::meta_set(c, "daemon", &started))
        .await?;
    tracing::info!(
        state_dir = %opts.state_dir.display(),
        mode = %opts.mode,
        "[watchdog] started (pid {})",
        std::process::id()
    );
    d.redeliver().await;

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| RsbError::internal(format!("cannot watch SIGTERM: {e}")))?;
    let mut idle_since = Instant::now();
    let db_file = store::db_path(&opts.state_dir);
    loop {
        if !db_file.exists() {
            tracing::info!("[watchdog] the state store is gone; exiting");
            break;
        }
        d.reload_settings();
        let active = d.tick(&opts).await.unwrap_or_else(|e| {
            tracing::warn!("[watchdog] tick failed: {}", e.message);
            1
        });
        if active > 0 || !d.inflight.lock().is_empty() {
            idle_since = Instant::now();
        } else if let Some(idle) = opts.idle_exit
            && idle_since.elapsed() >= idle
        {
            tracing::info!(
                "[watchdog] no active watches for {}s; exiting",
                idle.as_secs()
            );
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(opts.tick) => {}
            _ = term.recv() => { tracing::info!("[watchdog] SIGTERM; exiting"); break; }
            _ = tokio::signal::ctrl_c() => { tracing::info!("[watchdog] interrupted; exiting"); break; }
        }
    }
    // Gone means gone: no reader may take a heartbeat younger than 30 s for a live daemon
    // (liveness is the lock holder's anyway, see `service::daemon_info`).
    if let Err(e) = d.db(|c| watches::meta_delete(c, "heartbeat")).await {
        tracing::warn!("[watchdog] cannot clear the heartbeat: {}", e.message);
    }
    for (_, h) in d.subscriptions.lock().drain() {
        h.abort();
    }
    d.forwards.stop_all().await;
    let hosts: Vec<Arc<Host>> = d.hosts.lock().values().cloned().collect();
    for h in hosts {
        h.pool.shutdown().await;
    }
    d.store.close().await;
    Ok(())
}

/// The config file's hooks, or none (with a warning) when it cannot be read.
fn load_settings() -> FileSettings {
    match FileSettings::load() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("{e}; the config file's hooks are ignored");
            FileSettings::default()
        }
    }
}

/// What tells a changed config file: its mtime and size (`None` when absent).
fn config_stamp() -> Option<(std::time::SystemTime, u64)> {
    let m = std::fs::metadata(crate::config::config_file_path()).ok()?;
    Some((m.modified().ok()?, m.len()))
}

impl Daemon {
    /// Hooks added to (or removed from) the config file apply from the next alert, without a
    /// restart: one stat per tick decides.
    fn reload_settings(&self) {
        let stamp = config_stamp();
        let mut last = self.settings_stamp.lock();
        if *last == stamp {
            return;
        }
        *last = stamp;
        *self.settings.lock() = load_settings();
        tracing::info!("[watchdog] the config file changed; hooks reloaded");
    }
}

/// Run `fut` as its own task; a panic inside it becomes `Err(message)` instead of taking the
/// loop down.
pub async fn supervise<F>(fut: F) -> std::result::Result<(), String>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    match tokio::spawn(fut).await {
        Ok(()) => Ok(()),
        Err(e) if e.is_panic() => {
            let p = e.into_panic();
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("the check panicked: {msg}"))
        }
        Err(e) => Err(format!("the check was cancelled: {e}")),
    }
}

impl Daemon {
    /// Store work, on the store's thread: a query may wait out another process's write lock
    /// (the busy timeout) there, while the forwards this daemon serves and every other check
    /// go on ([`store::Store`]).
    async fn db<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.store.call(f).await
    }

    /// One tick: heartbeat, then a check task for every due watch. Returns the number of
    /// active watches.
    async fn tick(self: &Arc<Self>, opts: &Options) -> Result<i64> {
        let ms = now_ms();
        let beat_due = self
            .last_beat
            .lock()
            .is_none_or(|t| ms - t >= super::HEARTBEAT_EVERY.as_millis() as i64);
        let prune_due = self
            .last_prune
            .lock()
            .is_none_or(|t| ms - t >= PRUNE_EVERY.as_millis() as i64);
        if prune_due {
            *self.last_prune.lock() = Some(ms);
        }
        let heartbeat = json!({
            "ts": ms / 1000,
            "stale_after_s": super::HEARTBEAT_STALE_S,
            "db_path": store::db_path(&self.state_dir).display().to_string(),
            "config_path": crate::config::config_file_path().display().to_string(),
            "pid": std::process::id(),
            "mode": opts.mode,
        });
        let state_dir = self.state_dir.clone();
        let (due, active, followed) = self
            .db(move |c| {
                let c = &*c;
                if beat_due {
                    watches::meta_set(c, "heartbeat", &heartbeat)?;
                }
                if prune_due {
                    let policy = Default::default();
                    match store::retention::prune(&state_dir, c, &policy, ms / 1000) {
                        Ok(p) if p.bytes_freed > 0 => {
                            tracing::info!("[watchdog] retention: {p:?}")
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!("[watchdog] retention failed: {}", e.message),
                    }
                }
                let due = watches::due(c, ms, MAX_STARTS_PER_TICK)?;
                let active = watches::counts(c)?.get("active").copied().unwrap_or(0);
                let followed = watches::active_sandboxes(c)?;
                Ok((due, active, followed))
            })
            .await?;
        if beat_due {
            *self.last_beat.lock() = Some(ms);
        }
        let d = self.clone();
        let pool_for: super::forwards::PoolFor = Arc::new(move |fp, name| {
            let d = d.clone();
            Box::pin(async move { d.pool_for(&fp, &name).await })
        });
        let forwards = self.forwards.tick(&pool_for).await as i64;
        self.follow_sandboxes(followed);
        let mut started = 0;
        for id in due {
            if self.start_check(id, false) {
                started += 1;
            }
        }
        if started > 0 {
            let scan = json!({"ts": ms / 1000, "due_watch_count": started});
            let _ = self
                .db(move |c| watches::meta_set(c, "last_scan", &scan))
                .await;
        }
        Ok(active + forwards)
    }

    /// Start a check of watch `id` unless one is running; `again` (a job's end was just heard):
    /// if one is running, check once more after it, as it may have looked before the end.
    /// Whether a check started.
    fn start_check(self: &Arc<Self>, id: i64, again: bool) -> bool {
        if !self.inflight.lock().insert(id) {
            if again {
                self.recheck.lock().insert(id);
            }
            return false;
        }
        let d = self.clone();
        tokio::spawn(async move {
            let d2 = d.clone();
            if let Err(msg) = supervise(async move { d2.check(id).await }).await {
                tracing::error!(watch = id, "[watchdog] {msg}");
                let _ = d
                    .db(move |c| {
                        let interval = watches::get(c, id)
                            .ok()
                            .flatten()
                            .map(|w| w.interval_s)
                            .unwrap_or(60);
                        watches::record_failed_check(c, id, &msg, interval)
                    })
                    .await;
            }
            d.inflight.lock().remove(&id);
            if d.recheck.lock().remove(&id) {
                d.start_check(id, false);
            }
        });
        true
    }

    /// Hold one job-event subscription per sandbox in `wanted` (those with an active watch);
    /// end those no longer wanted.
    fn follow_sandboxes(self: &Arc<Self>, wanted: Vec<(String, String)>) {
        let mut subs = self.subscriptions.lock();
        let keys: HashSet<String> = wanted
            .iter()
            .map(|(fp, name)| sandboxes::key(fp, name).to_string())
            .collect();
        subs.retain(|k, h| {
            let keep = keys.contains(k) && !h.is_finished();
            if !keep {
                h.abort();
            }
            keep
        });
        for (fp, name) in wanted {
            let key = sandboxes::key(&fp, &name).to_string();
            if !subs.contains_key(&key) {
                let d = self.clone();
                subs.insert(key, tokio::spawn(async move { d.follow(fp, name).await }));
            }
        }
    }

    /// A job's end on this sandbox starts its watch's check the moment the agent sees it, so
    /// `completed`, alerts, webhooks and resumes follow within a second; `interval_s` stays
    /// the check for what a subscription cannot see (the connection down, the host gone).
    /// Every (re)subscription asks for every run that ended (`since_ms` 1): the agent sends
    /// each job's last end at once, so an end missed while the connection was down is checked
    /// on reconnecting. On a Slurm login node the records are the compute nodes' (the shared
    /// home, re-read by the agent every `JOB_EVENTS_RESCAN_MS` where inotify cannot see a
    /// remote write): an end starts the check, which asks the scheduler why through the
    /// shared poll, and again at its tick while Slurm is closing the job.
    async fn follow(self: Arc<Self>, fp: String, name: String) {
        let mut retry = FOLLOW_RETRY_FIRST;
        loop {
            let resolved = self.resolve(&fp, &name).await;
            if let Ok(Some(Ok(cfg))) = resolved {
                let host = self.host(sandboxes::key(&fp, &name), cfg);
                match host.client(Instant::now()).await {
                    Ok(client) => {
                        let mut ends = crate::client::JobEnds::subscribe(&client, 1);
                        loop {
                            match ends.next().await {
                                Ok(e) => {
                                    retry = FOLLOW_RETRY_FIRST;
                                    self.job_ended(&fp, &name, &e.info.name).await;
                                }
                                Err(e) => {
                                    tracing::info!(
                                        "[watchdog] job events on {name}: {}; following again",
                                        e.message
                                    );
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => tracing::debug!("[watchdog] job events on {name}: {}", e.message),
                }
            }
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(FOLLOW_RETRY_MAX);
        }
    }

    /// A run of job `job` ended on the sandbox: check its active watches now.
    async fn job_ended(self: &Arc<Self>, fp: &str, sandbox: &str, job: &str) {
        let (f, s, j) = (fp.to_string(), sandbox.to_string(), job.to_string());
        match self.db(move |c| watches::active_on(c, &f, &s, &j)).await {
            Ok(ids) => {
                for id in ids {
                    self.start_check(id, true);
                }
            }
            Err(e) => tracing::warn!("[watchdog] cannot read the watches: {}", e.message),
        }
    }

    /// A persisted sandbox's definition, as a watch or a forward connects with it: `None` when
    /// it is not stored, `Some(Err)` when it lacks a credential rsb may not store.
    async fn resolve(
        &self,
        fp: &str,
        name: &str,
    ) -> Result<Option<std::result::Result<SandboxConfig, String>>> {
        let (dir, fp, name) = (self.state_dir.clone(), fp.to_string(), name.to_string());
        self.db(move |c| sandboxes::resolve(c, &dir, &fp, &name))
            .await
    }

    /// The pool of a persisted sandbox, for a detached forward.
    async fn pool_for(&self, fp: &str, name: &str) -> std::result::Result<Arc<Pool>, String> {
        let cfg = self
            .resolve(fp, name)
            .await
            .map_err(|e| e.message)?
            .ok_or_else(|| format!("sandbox '{name}' is not in the watchdog's store"))??;
        Ok(self.host(sandboxes::key(fp, name), cfg).pool.clone())
    }

    /// The connection for one persisted definition, by its key (fingerprint): watches of two
    /// servers' different `gpu` each keep their own.
    fn host(&self, key: &str, cfg: SandboxConfig) -> Arc<Host> {
        let mut hosts = self.hosts.lock();
        if let Some(h) = hosts.get(key)
            && h.cfg == cfg
        {
            return h.clone();
        }
        let h = Arc::new(Host::new(cfg.clone(), &self.state_dir));
        if let Some(old) = hosts.insert(key.to_string(), h.clone()) {
            // The definition changed: drop the old connection off the loop.
            tokio::spawn(async move { old.pool.shutdown().await });
        }
        h
    }

    async fn check(self: Arc<Self>, id: i64) {
        let w = match self.db(move |c| watches::get(c, id)).await {
            Ok(Some(w)) if w.status == "active" => w,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(
                    watch = id,
                    "[watchdog] cannot read the watch: {}",
                    e.message
                );
                return;
            }
        };
        let since = Instant::now();
        let (obs, client) = self.observe(&w, since).await;
        // A daemon stopped between recording a resume and hearing how it went: repeat that
        // launch. The agent answers with the run its launch id started, or starts it now.
        if w.resume_intent_ms > 0
            && let Some(c) = client.clone()
        {
            self.launch_resume(w, c).await;
            return;
        }
        let mut out = checks::decide(&w, &obs, now_ms());
        // Events carry the log tail; fetch it only when there is an event to carry it.
        if let (Observed::Job(seen), Some(c)) = (&obs, &client)
            && !out.events.is_empty()
            && seen.log_tail.is_none()
            && let Some(tail) = fetch_tail(c, &w).await
        {
            let mut seen = seen.clone();
            seen.log_tail = Some(tail);
            out = checks::decide(&w, &Observed::Job(seen), now_ms());
        }
        let Some(after) = self.commit(&w, out.after, &out.events).await else {
            return;
        };
        if out.resume
            && let Some(c) = client
        {
            self.resume(after, c).await;
        }
    }

    /// Commit and deliver; the new row (with its revision) or `None` if the watch changed.
    async fn commit(&self, before: &Watch, mut after: Watch, events: &[NewEvent]) -> Option<Watch> {
        let (rev, row, events) = (before.rev, after.clone(), events.to_vec());
        let r = self
            .db(move |c| watches::commit(c, rev, &row, &events, super::checks::payload))
            .await;
        match r {
            Ok(Some(evs)) => {
                after.rev = before.rev + 1;
                for e in evs {
                    self.deliver(after.clone(), e);
                }
                Some(after)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(
                    watch = before.id,
                    "[watchdog] cannot record a check: {}",
                    e.message
                );
                None
            }
        }
    }

    /// Gather what the watch's sandbox says about the job (never parsing its log).
    async fn observe(&self, w: &Watch, since: Instant) -> (Observed, Option<AgentClient>) {
        let resolved = self.resolve(&w.sandbox_fp, &w.sandbox_name).await;
        let cfg = match resolved {
            Ok(Some(Ok(c))) => c,
            Ok(Some(Err(msg))) => return (Observed::NeedsCredentials(msg), None),
            Ok(None) => return (Observed::ConfigMissing, None),
            Err(e) => return (Observed::Error(e.message), None),
        };
        let host = self.host(sandboxes::key(&w.sandbox_fp, &w.sandbox_name), cfg);
        let client = match host.client(since).await {
            Ok(c) => c,
            Err(e) => return (Observed::Unreachable(e.message), None),
        };
        let req = JobStatusRequest {
            name: w.tmux_session.clone(),
            log_file: None,
            last_n_lines: 0,
            offset: None,
            max_bytes: 1,
        };
        let r = match tokio::time::timeout(STATUS_DEADLINE, client.call(req)).await {
            Err(_) => {
                // A silent link: drop it, so the next check reconnects instead of waiting again.
                client.close("no answer within the watchdog's deadline");
                return (
                    Observed::Unreachable(format!(
                        "SSH unreachable: no answer from sandbox '{}' within {}s",
                        w.sandbox_name,
                        STATUS_DEADLINE.as_secs()
                    )),
                    None,
                );
            }
            Ok(Err(e))
                if matches!(e.kind, Kind::ConnectionLost | Kind::Connect | Kind::Timeout) =>
            {
                return (Observed::Unreachable(e.message), None);
            }
            Ok(Err(e)) => return (Observed::Error(e.message), Some(client)),
            Ok(Ok(r)) => r,
        };
        let slurm = match self.slurm_seen(&host, &client, w, &r).await {
            Ok(s) => s,
            Err(o) => return (o, None),
        };
        let checkpoint = read_checkpoint(&client, w).await.ok();
        let info = r.info.as_ref();
        let seen = JobSeen {
            state: info.map(|i| i.state),
            exit_code: info.and_then(|i| i.exit_code),
            signal: info.and_then(|i| i.signal),
            started_ms: info.map(|i| i.started_ms).unwrap_or(0),
            log_size: r.log_size,
            log_tail: None,
            checkpoint,
            slurm,
        };
        (Observed::Job(seen), Some(client))
    }

    /// Slurm's side of a job it ran (its id is on record): one shared squeue per tick,
    /// waited for at most [`crate::slurm::poll::WAIT`], judged with the record. A record
    /// that reads as ended asks for a fresh answer (Slurm is closing the job: its end is
    /// due now); otherwise an answer as old as the watch's `interval_s` serves, within the
    /// poller's pace, so that 50 quiet watches cost one squeue per pace, not per check.
    async fn slurm_seen(
        &self,
        host: &Host,
        client: &AgentClient,
        w: &Watch,
        r: &rsb_protocol::JobStatusResult,
    ) -> std::result::Result<Option<SlurmSeen>, Observed> {
        let id =
            match tokio::time::timeout(STATUS_DEADLINE, submit::slurm_id(client, &w.tmux_session))
                .await
            {
                Ok(Ok(Some(id))) => id,
                Ok(Ok(None)) => return Ok(None),
                Ok(Err(e)) => return Err(Observed::Error(e.message)),
                Err(_) => {
                    return Err(Observed::Unreachable(format!(
                        "SSH unreachable: no answer from sandbox '{}' within {}s",
                        w.sandbox_name,
                        STATUS_DEADLINE.as_secs()
                    )));
                }
            };
        let info = r.info.as_ref();
        let recorded_end = info
            .is_some_and(|i| i.ended_ms.is_some() && i.state != rsb_protocol::JobState::Running);
        let max_age = match recorded_end {
            true => poll::FRESH,
            false => Duration::from_secs(w.interval_s.max(0) as u64),
        };
        let seen = host
            .slurm
            .states(client, std::slice::from_ref(&id), max_age)
            .await
            .remove(&id)
            .unwrap_or(Seen::Gone);
        let j = judge(&seen, recorded_end, info.is_some());
        Ok(Some(SlurmSeen {
            job_id: id,
            state: j.state,
            reason: j.reason,
            slurm_state: j.slurm_state.unwrap_or_default(),
            pending_reason: j.pending_reason.unwrap_or_default(),
            restarts: j.restarts.unwrap_or(0),
            error: j.scheduler_error.unwrap_or_default(),
        }))
    }

    /// Record the attempt and its launch id, then launch it.
    async fn resume(&self, w: Watch, client: AgentClient) {
        let launch_id = format!("w{}-{}-{}", w.id, w.resume_attempts + 1, now_ms());
        let intent = checks::resume_intent(&w, &launch_id, now_ms());
        let Some(w) = self.commit(&w, intent, &[]).await else {
            return;
        };
        self.launch_resume(w, client).await;
    }

    /// Start the recorded resume launch as a background job, with the checkpoint in
    /// `RSB_CHECKPOINT`, and record how that went. Safe to repeat: the launch id makes the
    /// agent return the run it already started.
    async fn launch_resume(&self, w: Watch, client: AgentClient) {
        let session = if w.resume_launch_session.is_empty() {
            w.resume_session()
        } else {
            w.resume_launch_session.clone()
        };
        let cwd = w.resume_cwd();
        let checkpoint = w.last_checkpoint_text.clone();
        let env = vec![
            ("RSB_CHECKPOINT".to_string(), checkpoint.clone()),
            ("RSB_RESUME_ATTEMPT".into(), w.resume_attempts.to_string()),
            ("RSB_WATCH_ID".into(), w.id.to_string()),
        ];
        // A Slurm job is resubmitted with the options it ran with: the plan's (registered with
        // it), else those its submit recorded in its spec, else the sandbox's defaults (a job
        // submitted by an rsb that did not record them).
        let slurm = match w.resume_plan.get("slurm") {
            Some(o) => Some(o.clone()),
            None => match submit::slurm_id(&client, &w.tmux_session).await {
                Ok(Some(_)) => Some(
                    match submit::submitted_options(&client, &w.tmux_session).await {
                        Some(o) => o,
                        None => serde_json::to_value(self.slurm_defaults(&w)).unwrap_or_default(),
                    },
                ),
                _ => None,
            },
        };
        if let Some(opts) = slurm {
            let r = match tokio::time::timeout(
                RESUME_DEADLINE,
                self.resubmit(&w, &client, &opts, &session, &cwd, &env),
            )
            .await
            {
                Ok(Ok(name)) => Ok(name),
                // As below: the intent stays, and the next check repeats this launch id, which
                // finds the job if sbatch took it.
                Ok(Err(e))
                    if matches!(e.kind, Kind::ConnectionLost | Kind::Connect | Kind::Timeout) =>
                {
                    return;
                }
                Err(_) => return,
                Ok(Err(e)) => Err(e.message),
            };
            return self.resumed(&w, "slurm resubmit", r, &checkpoint).await;
        }
        // A GPU job is placed again as it was first (its own GPUs when they are free): no
        // GPUs free now is this resume's failure, with what is free in its message.
        let gpus = match w.resume_plan.get(crate::gpus::PLAN_KEY).map(|v| {
            serde_json::from_value::<crate::gpus::Need>(v.clone())
                .map_err(|e| format!("resume_plan.gpus is not valid: {e}"))
        }) {
            None => None,
            Some(Err(why)) => return self.resumed(&w, "resume", Err(why), &checkpoint).await,
            Some(Ok(need)) => match crate::gpus::ask(&client, &need).await {
                Ok(ask) => Some(ask),
                Err(e)
                    if matches!(e.kind, Kind::ConnectionLost | Kind::Connect | Kind::Timeout) =>
                {
                    return;
                }
                Err(e) => {
                    return self
                        .resumed(&w, "resume", Err(e.message), &checkpoint)
                        .await;
                }
            },
        };
        // Confined as the session's own commands on that sandbox were: the client comes from a
        // pool of its persisted config, which gives it that config's confine.
        let confine = client.confine().cloned();
        let req = JobStartRequest {
            name: session,
            command: w.resume_command_to_run(),
            cwd: (!cwd.trim().is_empty()).then_some(cwd),
            log_file: w.log_file.clone(),
            env,
            prefer_tmux: true,
            // An intent from an rsb before launch ids has none: it is launched afresh.
            launch_id: (!w.resume_launch_id.is_empty()).then(|| w.resume_launch_id.clone()),
            confine,
            gpus,
        };
        let r = match tokio::time::timeout(RESUME_DEADLINE, client.call(req)).await {
            Ok(Ok(info)) => Ok(info.name),
            // The host may have started it without the answer reaching us: the intent stays,
            // and the next check repeats this launch (a new id could start it twice).
            Ok(Err(e))
                if matches!(e.kind, Kind::ConnectionLost | Kind::Connect | Kind::Timeout) =>
            {
                client.close("the resume's start got no answer");
                return;
            }
            Err(_) => {
                client.close("the resume's start got no answer");
                return;
            }
            Ok(Err(e)) => Err(e.message),
        };
        self.resumed(&w, "resume", r, &checkpoint).await;
    }

    /// A resume's outcome (the job's name, or why it did not start): audited, and the watch and
    /// its event committed.
    async fn resumed(
        &self,
        w: &Watch,
        tool: &str,
        r: std::result::Result<String, String>,
        checkpoint: &str,
    ) {
        self.audit_resume(w, tool, &r);
        let r = r.as_deref().map_err(String::as_str);
        let (after, e) = checks::resume_result(w, r, checkpoint, now_ms());
        self.commit(w, after, &[e]).await;
    }

    /// A resume or resubmit the daemon ran, on the audit record as the user's own are.
    fn audit_resume(&self, w: &Watch, tool: &str, r: &std::result::Result<String, String>) {
        let host = self
            .hosts
            .lock()
            .get(sandboxes::key(&w.sandbox_fp, &w.sandbox_name))
            .cloned();
        let Some(host) = host else {
            return;
        };
        crate::audit::record(
            host.pool.config(),
            &w.sandbox_name,
            &crate::audit::Action {
                origin: "watchdog".into(),
                tool: tool.into(),
                command: Some(w.resume_command_to_run()),
                error: r.as_ref().err().cloned(),
                detail: Some(json!({
                    "watch_id": w.id,
                    "attempt": w.resume_attempts,
                    "session": r.as_ref().ok(),
                })),
                ..Default::default()
            },
        );
    }

    /// The Slurm defaults of `w`'s stored sandbox (none when it has none).
    fn slurm_defaults(&self, w: &Watch) -> SlurmOptions {
        self.hosts
            .lock()
            .get(sandboxes::key(&w.sandbox_fp, &w.sandbox_name))
            .and_then(|h| h.cfg.slurm.clone())
            .unwrap_or_default()
    }

    /// Resume a Slurm job by submitting it again, with the options it was submitted with
    /// (the plan's `slurm`) and the intent's launch id, so a repeat finds the job instead of
    /// submitting a second one.
    async fn resubmit(
        &self,
        w: &Watch,
        client: &AgentClient,
        opts: &serde_json::Value,
        session: &str,
        cwd: &str,
        env: &[(String, String)],
    ) -> Result<String> {
        let opts: SlurmOptions = serde_json::from_value(opts.clone()).map_err(|e| {
            RsbError::invalid(
                format!("the resume plan's slurm options are not valid: {e}"),
                "fix resume_plan_json.slurm",
            )
        })?;
        opts.check()?;
        let host = self
            .hosts
            .lock()
            .get(sandboxes::key(&w.sandbox_fp, &w.sandbox_name))
            .cloned()
            .ok_or_else(|| RsbError::internal("the watch's sandbox has no connection"))?;
        let agent = host
            .pool
            .agent_path(client.sandbox())
            .ok_or_else(|| RsbError::internal("the agent's path on the login node is not known"))?;
        let home = client.hello().home.clone();
        let cwd = if cwd.trim().is_empty() {
            home.clone()
        } else {
            submit::resolve(&home, &home, cwd)
        };
        let log = submit::resolve(&home, &cwd, &w.log_file);
        let command = w.resume_command_to_run();
        let launch_id = (!w.resume_launch_id.is_empty()).then_some(w.resume_launch_id.as_str());
        let sub = submit::submit(
            &host.pool,
            client,
            &submit::Job {
                agent_path: &agent,
                options: &opts,
                name: session,
                command: &command,
                cwd: &cwd,
                log: &log,
                env,
                launch_id,
            },
        )
        .await?;
        host.slurm.register([sub.id.as_str()]);
        Ok(session.to_string())
    }

    /// Event file, then alerts (off the loop), then `delivered`.
    fn deliver(&self, w: Watch, e: WatchEvent) {
        let store = self.store.clone();
        let targets = alerts::Targets::for_watch(&w, &self.settings.lock(), self.hook_timeout);
        tokio::spawn(async move {
            deliver_one(&store, &targets, &e, true).await;
        });
    }

    /// Finish deliveries a previous daemon committed but did not complete.
    async fn redeliver(&self) {
        let pending = match self.db(|c| events::undelivered(c)).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("[watchdog] cannot read undelivered events: {}", e.message);
                return;
            }
        };
        for (e, created_ms) in pending {
            let watch_id = e.watch_id;
            let w = self
                .db(move |c| watches::get(c, watch_id))
                .await
                .ok()
                .flatten();
            let Some(w) = w else { continue };
            let targets = alerts::Targets::for_watch(&w, &self.settings.lock(), self.hook_timeout);
            let alert = now_ms() - created_ms < REPLAY_ALERTS_WITHIN_MS;
            deliver_one(&self.store, &targets, &e, alert).await;
        }
    }
}

async fn deliver_one(store: &store::Store, targets: &alerts::Targets, e: &WatchEvent, alert: bool) {
    let state_dir = store.state_dir();
    let file = match events::write_file(state_dir, e) {
        Ok(f) => f,
        Err(err) => {
            tracing::warn!(
                event = e.id,
                "[watchdog] cannot write the event file: {err}"
            );
            state_dir
                .join("events")
                .join(format!("event-{}.json", e.id))
        }
    };
    let errors = if alert {
        alerts::dispatch(targets, e, &file).await
    } else {
        Vec::new()
    };
    for err in &errors {
        tracing::warn!(watch = e.watch_id, event = e.id, "[watchdog] {err}");
    }
    let alerted = !targets.webhooks.is_empty() || !targets.commands.is_empty();
    let (watch_id, event_id, errors) = (e.watch_id, e.id, errors.join("; "));
    let recorded = store
        .call(move |c| {
            if alerted {
                // The alert's outcome is a note on the watch; the delivery is done either way.
                let _ = watches::record_error(c, watch_id, "last_alert_error", &errors);
            }
            events::mark_delivered(c, event_id)
        })
        .await;
    if let Err(err) = recorded {
        tracing::warn!(
            event = event_id,
            "[watchdog] cannot record the delivery: {}",
            err.message
        );
    }
}

async fn fetch_tail(c: &AgentClient, w: &Watch) -> Option<String> {
    let req = JobStatusRequest {
        name: w.tmux_session.clone(),
        log_file: None,
        last_n_lines: w.max_log_lines.clamp(1, 10_000) as u32,
        offset: None,
        max_bytes: MAX_TEXT_CHARS as u64,
    };
    match tokio::time::timeout(STATUS_DEADLINE, c.call(req)).await {
        Ok(Ok(r)) => Some(String::from_utf8_lossy(&r.log).into_owned()),
        _ => None,
    }
}

/// The checkpoint's text: `checkpoint_command`'s output (run in the watch's cwd), else the
/// file at `checkpoint_path`. `Err` when neither is set or the read failed.
pub async fn read_checkpoint(c: &AgentClient, w: &Watch) -> std::result::Result<String, String> {
    let cmd = w.checkpoint_command_to_run();
    if !cmd.trim().is_empty() {
        let mut req = ExecRequest::new(cmd);
        req.cwd = (!w.cwd.trim().is_empty()).then(|| w.cwd.clone());
        req.timeout_ms = CHECKPOINT_DEADLINE.as_millis() as u64;
        req.max_stdout = MAX_TEXT_CHARS as u64;
        req.max_stderr = 2_000;
        // A checkpoint command is the user's (or model's), so it is confined as the job is.
        req.confine = c.confine().cloned();
        let r = tokio::time::timeout(CHECKPOINT_DEADLINE + Duration::from_secs(5), c.call(req))
            .await
            .map_err(|_| "checkpoint_command timed out".to_string())?
            .map_err(|e| e.message)?;
        let mut out = r.stdout.head;
        out.extend_from_slice(&r.stdout.tail);
        return Ok(String::from_utf8_lossy(&out).into_owned());
    }
    if w.checkpoint_path.trim().is_empty() {
        return Err("no checkpoint configured".into());
    }
    let req = ReadFileRequest {
        path: w.checkpoint_path.clone(),
        offset: 0,
        max_bytes: MAX_TEXT_CHARS as u64,
        confine: None,
    };
    let r = tokio::time::timeout(CHECKPOINT_DEADLINE, c.call(req))
        .await
        .map_err(|_| "checkpoint read timed out".to_string())?
        .map_err(|e| e.message)?;
    Ok(String::from_utf8_lossy(&r.data).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_check_is_reported_not_fatal() {
        let r = supervise(async { panic!("boom in watch 3") }).await;
        assert_eq!(r.unwrap_err(), "the check panicked: boom in watch 3");
        assert!(supervise(async {}).await.is_ok());
    }

    /// An idle daemon commits at most one heartbeat per [`super::super::HEARTBEAT_EVERY`], so
    /// another connection's baseline cache keeps hitting while it runs (it missed every tick
    /// when the heartbeat was written each second).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_daemon_leaves_the_baseline_cache_hitting() {
        let d = tempfile::tempdir().unwrap();
        let t = crate::store::transfers::Transfers::open(d.path())
            .await
            .unwrap();
        let b: crate::store::baselines::Baseline = [("f".to_string(), [3; 32])].into();
        t.save_baseline("l", "s", "r", Arc::new(b.clone()))
            .await
            .unwrap();
        let mut opts = Options::new(d.path().to_path_buf());
        opts.tick = Duration::from_millis(20);
        opts.mode = "foreground".into();
        let daemon = tokio::spawn(run(opts));
        // The first heartbeat (and the daemon row) land at start.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (h0, m0) = t.baseline_cache_stats();
        let probe = store::open(d.path()).unwrap();
        let dv = |c: &Connection| -> i64 {
            c.query_row("PRAGMA data_version", [], |r| r.get(0))
                .unwrap()
        };
        let mut versions = std::collections::BTreeSet::new();
        // 40 no-change loads over 5 s: the heartbeat's `ts` is in seconds (SQLite skips a
        // write of identical bytes), so a heartbeat each tick changed the version every second.
        for _ in 0..40 {
            versions.insert(dv(&probe));
            assert_eq!(
                *t.load_baseline_shared("l", "s", "r")
                    .await
                    .unwrap()
                    .unwrap(),
                b
            );
            tokio::time::sleep(Duration::from_millis(125)).await;
        }
        let (h1, m1) = t.baseline_cache_stats();
        daemon.abort();
        let (hits, misses) = (h1 - h0, m1 - m0);
        println!(
            "baseline cache with a live daemon: {hits} hits, {misses} misses; {} data versions",
            versions.len()
        );
        assert!(!daemon.await.is_ok_and(|r| r.is_err()), "the daemon ran");
        assert!(
            hits * 100 >= (hits + misses) * 95,
            "{hits} hits, {misses} misses"
        );
    }

    #[test]
    fn one_daemon_per_state_dir_and_the_second_names_the_first() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(lock_holder(d.path()), None);
        let l = acquire_lock(d.path()).unwrap();
        assert_eq!(lock_holder(d.path()), Some(std::process::id() as i64));
        // flock is per open file description: a second open in this process conflicts too.
        let e = acquire_lock(d.path()).err().unwrap();
        assert!(
            e.message.contains(&format!(
                "already running for {} (pid {})",
                d.path().display(),
                std::process::id()
            )),
            "{}",
            e.message
        );
        drop(l);
        assert_eq!(lock_holder(d.path()), None);
        drop(acquire_lock(d.path()).unwrap());
    }
}
