//! Forwarding as a user asks for it: the `SANDBOX:PORT` / `SANDBOX:HOST:PORT` /
//! `SANDBOX:/path.sock` syntax, the bind address and local port rules, the typed replies the
//! CLI and the MCP tools both print, and the registry of forwards an MCP server keeps.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use parking_lot::Mutex;
use serde::Serialize;

pub use crate::forward::request::*;
use crate::{
    app::App,
    error::{Result, RsbError},
    forward::{Forward, StatsSnapshot},
    ops::action::Act,
    store::{Store, sandboxes},
    watchdog::{daemon, forwards, settings},
};

/// What a forward is and how it is doing; the reply of `forward_port`, one element of
/// `list_forwards`, and the first line of `rsb forward --json`.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardInfo {
    pub forward_id: u64,
    pub sandbox: String,
    /// What the sandbox connects to: `host:port` or a Unix socket path.
    pub target: String,
    pub local_address: String,
    pub local_url: String,
    pub running: bool,
    /// Unix time the forward started.
    pub started_at: u64,
    #[serde(flatten)]
    pub stats: StatsSnapshot,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// Served by the watchdog daemon, independent of this server's life.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub detached: bool,
    /// For a detached forward: `starting`, `listening` or `failed`, and what the daemon did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watchdog: Option<String>,
}

impl ForwardInfo {
    pub fn of(id: u64, f: &Forward) -> Self {
        ForwardInfo {
            forward_id: id,
            sandbox: f.sandbox.clone(),
            target: f.target.to_string(),
            local_address: f.local_addr.to_string(),
            local_url: f.url(),
            running: f.is_running(),
            started_at: f
                .started
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            stats: f.stats(),
            warning: exposure_warning(f.local_addr.ip()),
            detached: false,
            state: None,
            watchdog: None,
        }
    }

    fn of_row(r: &forwards::Row) -> Self {
        let addr = r.local_address.parse::<std::net::SocketAddr>().ok();
        let mut stats = r.stats.clone();
        if !r.error.is_empty() {
            stats.last_error = Some(r.error.clone());
        }
        ForwardInfo {
            forward_id: r.public_id(),
            sandbox: r.sandbox_name.clone(),
            target: r.target.clone(),
            local_address: r.local_address.clone(),
            local_url: addr.map(crate::forward::url_for).unwrap_or_default(),
            running: r.state == forwards::LISTENING,
            started_at: u64::try_from(r.created_ts).unwrap_or(0),
            stats,
            warning: addr.and_then(|a| exposure_warning(a.ip())),
            detached: true,
            state: Some(r.state.clone()),
            watchdog: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ForwardList {
    pub forwards: Vec<ForwardInfo>,
}

/// How long `detach` waits for the daemon to connect and bind before answering.
const DETACH_WAIT: Duration = Duration::from_secs(45);
/// How long `stop` waits for the daemon to free a detached forward's port.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// A forward's start as every front end asks for it ([`crate::ops::action::Caller::act`]):
/// one audit line naming its target (`localhost:8888`, a socket's path); the closure gets the
/// sandbox resolved once ([`ForwardRequest::on`]).
pub fn act<'a>(tool: &'a str, req: &'a ForwardRequest) -> Act<'a> {
    Act {
        sandbox: &req.sandbox,
        tool,
        command: Some(req.target.to_string()),
        ..Default::default()
    }
}

impl ForwardRequest {
    /// This request on `sandbox`, the name its action resolved.
    pub fn on(&self, sandbox: String) -> ForwardRequest {
        ForwardRequest {
            sandbox,
            ..self.clone()
        }
    }
}

/// Hand a forward to the watchdog daemon (starting one if none runs) and wait until it listens
/// or says why it cannot. The sandbox definitions are persisted as for a watch: without secrets
/// unless the user opted in, so a password-only sandbox is refused here with the opt-in named.
pub async fn detach(app: &App, req: &ForwardRequest) -> Result<ForwardInfo> {
    let sandbox = app.pool().resolve(&req.sandbox)?;
    let store = app.store();
    let configured = app.config().sandboxes.clone();
    let req = req.clone();
    let dir = store.state_dir().to_path_buf();
    let name = sandbox.clone();
    let id = store
        .call(move |c| {
            sandboxes::persist(c, &dir, &configured, settings::store_passwords())?;
            let fp = configured
                .iter()
                .find(|s| s.name == name)
                .map(sandboxes::fingerprint)
                .unwrap_or_default();
            if let Some(Err(msg)) = sandboxes::resolve(c, &dir, &fp, &name)? {
                return Err(RsbError::invalid(
                    format!("cannot detach a forward to '{name}': {msg}"),
                    "use a key or ssh-agent for this sandbox, or set RSB_WATCHDOG_STORE_PASSWORDS=1 \
                     to let the watchdog store its password (0600); or forward without detach",
                ));
            }
            forwards::insert(c, &name, &fp, &req.target, req.bind, req.local_port)
        })
        .await?;
    let report = match crate::ops::watchdog::ensure(&store).await {
        Ok(r) => r,
        Err(e) => {
            let _ = store.call(move |c| forwards::delete(c, id)).await;
            return Err(e);
        }
    };
    let note = match &report.install_hint {
        Some(h) => format!("{} ({h})", report.detail),
        None => report.detail.clone(),
    };
    let deadline = Instant::now() + DETACH_WAIT;
    loop {
        let row = store.call(move |c| forwards::get(c, id)).await?;
        let Some(row) = row else {
            return Err(RsbError::invalid(
                format!(
                    "detached forward {} was stopped before it started",
                    forwards::ID_OFFSET + id as u64
                ),
                "ask again",
            ));
        };
        match row.state.as_str() {
            forwards::LISTENING => {
                let mut info = ForwardInfo::of_row(&row);
                info.watchdog = Some(note);
                return Ok(info);
            }
            forwards::FAILED => {
                let _ = store.call(move |c| forwards::delete(c, id)).await;
                return Err(forwards::start_error(&row));
            }
            _ if Instant::now() >= deadline => {
                let mut info = ForwardInfo::of_row(&row);
                info.watchdog = Some(format!(
                    "{note}; the daemon has not started this forward within {}s: list_forwards shows when it does",
                    DETACH_WAIT.as_secs()
                ));
                return Ok(info);
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The detached forwards in the store (none when there is no store yet: listing never creates
/// one).
async fn detached_list(store: &Store) -> Result<Vec<ForwardInfo>> {
    if !crate::store::db_path(store.state_dir()).exists() {
        return Ok(Vec::new());
    }
    Ok(store
        .call(|c| forwards::list(c))
        .await?
        .iter()
        .filter(|r| r.state != forwards::STOPPING)
        .map(ForwardInfo::of_row)
        .collect())
}

/// Stop a detached forward: the daemon frees the port and deletes the row; without a daemon
/// nothing listens, so the row goes at once.
async fn stop_detached(store: &Store, public: u64, row_id: i64) -> Result<ForwardInfo> {
    // A lock file's holder: a read of a small file, no wait.
    let daemon_runs = daemon::lock_holder(store.state_dir()).is_some();
    let row = store
        .call(move |c| {
            let row = forwards::get(c, row_id)?;
            if row.is_some() {
                if daemon_runs {
                    forwards::request_stop(c, row_id)?;
                } else {
                    forwards::delete(c, row_id)?;
                }
            }
            Ok(row)
        })
        .await?;
    let Some(row) = row else {
        return Err(RsbError::invalid(
            format!("no forward with id {public}"),
            "list_forwards shows the running forwards",
        ));
    };
    let deadline = Instant::now() + STOP_WAIT;
    loop {
        let gone = store
            .call(move |c| Ok(forwards::get(c, row_id)?.is_none()))
            .await?;
        if gone {
            let mut info = ForwardInfo::of_row(&row);
            info.running = false;
            info.state = Some("stopped".into());
            return Ok(info);
        }
        if Instant::now() >= deadline {
            return Err(RsbError::new(
                crate::error::Kind::Timeout,
                format!(
                    "the watchdog has not stopped forward {public} within {}s",
                    STOP_WAIT.as_secs()
                ),
                "`rsb watchdog status` shows whether the daemon is alive; it stops the forward on its next tick",
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The forwards an MCP server started; they live as long as the server.
#[derive(Default)]
pub struct Forwards {
    next_id: AtomicU64,
    map: Mutex<BTreeMap<u64, Arc<Forward>>>,
}

impl Forwards {
    pub fn add(&self, f: Arc<Forward>) -> ForwardInfo {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let info = ForwardInfo::of(id, &f);
        self.map.lock().insert(id, f);
        info
    }

    /// This server's forwards, then the detached ones the watchdog serves.
    pub async fn list(&self, store: &Store) -> Result<ForwardList> {
        let mut forwards: Vec<ForwardInfo> = self
            .map
            .lock()
            .iter()
            .map(|(id, f)| ForwardInfo::of(*id, f))
            .collect();
        forwards.extend(detached_list(store).await?);
        Ok(ForwardList { forwards })
    }

    /// Stop one forward; its port is free when this returns.
    pub async fn stop(&self, store: &Store, id: u64) -> Result<ForwardInfo> {
        if let Some(row_id) = forwards::row_id(id) {
            return stop_detached(store, id, row_id).await;
        }
        let f = self.map.lock().remove(&id);
        let Some(f) = f else {
            let ids: Vec<String> = self.map.lock().keys().map(u64::to_string).collect();
            return Err(RsbError::invalid(
                format!("no forward with id {id}"),
                if ids.is_empty() {
                    "no forwards are running".to_string()
                } else {
                    format!(
                        "this server's forwards: {} (list_forwards shows detached ones too)",
                        ids.join(", ")
                    )
                },
            ));
        };
        f.stop().await;
        Ok(ForwardInfo::of(id, &f))
    }

    pub async fn stop_all(&self) {
        let all: Vec<Arc<Forward>> = std::mem::take(&mut *self.map.lock())
            .into_values()
            .collect();
        for f in all {
            f.stop().await;
        }
    }
}
