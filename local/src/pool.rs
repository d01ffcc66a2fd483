//! The sandbox pool: one lazily opened connection and one agent channel per sandbox, the
//! active sandbox, and name resolution with errors that list what exists.
//!
//! Each sandbox has its own async mutex held only while connecting, so concurrent callers on
//! one sandbox share a single connect, and a slow sandbox never blocks another.

use std::{
    collections::HashMap,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use parking_lot::RwLock;
use tokio::sync::Mutex;

use crate::{
    client::AgentClient,
    config::{Config, SandboxConfig, Transport},
    connect::{self, Connection},
    error::{Kind, Result, RsbError},
};

/// How long [`Pool::shutdown`] waits for a slot's lock before leaving it to the process exit.
pub(crate) const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_millis(300);

struct Slot {
    cfg: SandboxConfig,
    conn: Mutex<Option<Connection>>,
    /// Where the agent ran last time, to skip the probe on reconnect.
    agent_path: parking_lot::Mutex<Option<String>>,
    /// The last resources sample this slot's agent sent, when it arrived, and which connection
    /// sent it (a reconnect makes it stale at once).
    sample: parking_lot::Mutex<Option<Sample>>,
    /// Bumped on every new connection.
    generation: std::sync::atomic::AtomicU64,
    /// The last failed probe (`list_sandboxes`, `select_sandbox("auto")`): when, and why.
    /// Cleared by a new connection.
    failure: parking_lot::Mutex<Option<(Instant, String)>>,
    /// Whether this slot's first connection was handed to [`Pool::on_first_connect`]'s hook.
    discovered: std::sync::atomic::AtomicBool,
    /// What that hook found (a hint for the user), once it has answered.
    hint: parking_lot::Mutex<Option<String>>,
}

impl Slot {
    /// Give `conn`'s client this sandbox's `confine`, before anyone else sees it.
    fn confine(&self, conn: &Connection) {
        if let Some(c) = &self.cfg.confine {
            conn.client.confine_to(c.request());
        }
    }
}

struct Sample {
    at: Instant,
    /// [`Slot::generation`] of the connection that sent it.
    generation: u64,
    snapshot: rsb_protocol::ResourceSnapshot,
}

pub struct Pool {
    config: Arc<Config>,
    order: Vec<String>,
    slots: HashMap<String, Arc<Slot>>,
    active: RwLock<Option<String>>,
    /// rsb's own agent as a child process: the local end of every sync (started lazily).
    local: Mutex<Option<Connection>>,
    /// Run once per sandbox, in the background, after its first connect (see
    /// [`Pool::on_first_connect`]).
    first_connect: parking_lot::Mutex<Option<FirstConnect>>,
}

/// A look at a sandbox after its first connect; `Some(hint)` is kept for the listing.
pub type FirstConnect = Arc<
    dyn Fn(
            AgentClient,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send>>
        + Send
        + Sync,
>;

/// Result of a liveness check for `list_sandboxes` / `get_active_sandbox`.
#[derive(Debug, Clone)]
pub struct Health {
    pub alive: bool,
    pub error: Option<RsbError>,
}

impl Pool {
    pub fn new(config: Arc<Config>) -> Pool {
        let order: Vec<String> = config.sandboxes.iter().map(|s| s.name.clone()).collect();
        let slots = config
            .sandboxes
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    Arc::new(Slot {
                        cfg: s.clone(),
                        conn: Mutex::new(None),
                        agent_path: parking_lot::Mutex::new(None),
                        sample: parking_lot::Mutex::new(None),
                        generation: Default::default(),
                        failure: Default::default(),
                        discovered: Default::default(),
                        hint: Default::default(),
                    }),
                )
            })
            .collect();
        let active = RwLock::new(order.first().cloned());
        Pool {
            config,
            order,
            slots,
            active,
            local: Mutex::new(None),
            first_connect: parking_lot::Mutex::new(None),
        }
    }

    /// Run `f` once per sandbox not declared `scheduler = "slurm"`, on a task of its own
    /// after that sandbox's first connect, so the connect never waits for it; what it
    /// returns is [`Pool::hint`]. The hook is set from above (the server), because what it
    /// looks for lives above the pool.
    pub fn on_first_connect(&self, f: FirstConnect) {
        *self.first_connect.lock() = Some(f);
    }

    /// What the first-connect hook found for `name`, once it has answered.
    pub fn hint(&self, name: &str) -> Option<String> {
        self.slots.get(name)?.hint.lock().clone()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn names(&self) -> &[String] {
        &self.order
    }

    pub fn active(&self) -> Option<String> {
        self.active.read().clone()
    }

    /// Where `name`'s agent was last found or installed (a Slurm batch script execs it).
    pub fn agent_path(&self, name: &str) -> Option<String> {
        self.slots.get(name)?.agent_path.lock().clone()
    }

    /// `name`'s Slurm defaults when it is a Slurm login node (`scheduler = "slurm"`).
    pub fn slurm(&self, name: &str) -> Option<crate::config::SlurmDefaults> {
        self.sandbox_config(name)?.slurm.clone()
    }

    /// The Landlock ABI `name`'s connected agent serves (no I/O; `None` while it is not
    /// connected, or connecting right now).
    pub fn landlock_abi(&self, name: &str) -> Option<u32> {
        let slot = self.slots.get(name)?;
        let guard = slot.conn.try_lock().ok()?;
        let c = guard.as_ref()?;
        c.client
            .is_alive()
            .then(|| c.client.hello().capabilities.landlock_abi)
    }

    pub fn sandbox_config(&self, name: &str) -> Option<&SandboxConfig> {
        self.slots.get(name).map(|s| &s.cfg)
    }

    /// `""` means the active sandbox; anything else must name a configured sandbox exactly.
    /// Resolve `name` once for a whole call and write the result back, so every later step
    /// (the policy's question, the run, the audit) uses that sandbox even if `select_sandbox`
    /// changes the active one meanwhile. `""` when it does not resolve (`name` is left as
    /// given, for the run to report).
    pub fn pin(&self, name: &mut String) -> String {
        match self.resolve(name) {
            Ok(s) => {
                name.clone_from(&s);
                s
            }
            Err(_) => String::new(),
        }
    }

    pub fn resolve(&self, name: &str) -> Result<String> {
        if name.is_empty() {
            return self.active().ok_or_else(|| {
                RsbError::new(
                    Kind::Config,
                    "no sandbox is configured",
                    "set REMOTE_HOST or REMOTE_SANDBOX_LIST",
                )
            });
        }
        if self.slots.contains_key(name) {
            Ok(name.to_string())
        } else {
            Err(self.unknown(name))
        }
    }

    pub fn unknown(&self, name: &str) -> RsbError {
        RsbError::new(
            Kind::UnknownSandbox,
            format!(
                "unknown sandbox '{name}'; available: {}",
                self.order.join(", ")
            ),
            "use one of the available names (list_sandboxes shows them)",
        )
    }

    pub fn select(&self, name: &str) -> Result<()> {
        if !self.slots.contains_key(name) {
            return Err(self.unknown(name));
        }
        *self.active.write() = Some(name.to_string());
        Ok(())
    }

    /// A live agent client for `name` (`""` = active), connecting or reconnecting as needed.
    pub async fn client(&self, name: &str) -> Result<AgentClient> {
        Ok(self.client_with_generation(name).await?.0)
    }

    /// [`Pool::client`] plus which connection of the slot it is (see [`Pool::store_sample`]).
    pub async fn client_with_generation(&self, name: &str) -> Result<(AgentClient, u64)> {
        let name = self.resolve(name)?;
        let slot = self.slots[&name].clone();
        let mut guard = slot.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            let ssh_ok = c.ssh.as_ref().is_none_or(|s| !s.is_closed());
            if c.client.is_alive() && ssh_ok {
                return Ok((c.client.clone(), slot.generation.load(Ordering::SeqCst)));
            }
            tracing::info!(sandbox = %name, "connection is gone; reconnecting");
            c.client.close("reconnecting");
            *guard = None;
        }
        let known = slot.agent_path.lock().clone();
        let conn = connect::connect(&slot.cfg, known.as_deref()).await?;
        slot.confine(&conn);
        *slot.agent_path.lock() = Some(conn.agent_path.clone());
        let client = conn.client.clone();
        *guard = Some(conn);
        *slot.failure.lock() = None;
        let generation = slot.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let hook = self.first_connect.lock().clone();
        if let Some(hook) = hook
            && slot.cfg.slurm.is_none()
            && !slot.discovered.swap(true, Ordering::SeqCst)
        {
            let (slot, look) = (slot.clone(), hook(client.clone()));
            tokio::spawn(async move {
                if let Some(h) = look.await {
                    *slot.hint.lock() = Some(h);
                }
            });
        }
        Ok((client, generation))
    }

    /// The SSH session of `name`'s live connection, if it has one (a transfer worker's agent
    /// can ride it: [`connect::bridge_agent`]). Never connects.
    pub async fn live_session(&self, name: &str) -> Option<Arc<crate::ssh::SshSession>> {
        let slot = self.slots.get(name)?;
        let guard = slot.conn.lock().await;
        let c = guard.as_ref()?;
        let ssh = c.ssh.clone()?;
        (c.client.is_alive() && !ssh.is_closed()).then_some(ssh)
    }

    /// Use `conn` as `name`'s connection (a worker's bridged agent); when it dies, the next
    /// [`Pool::client`] connects as usual, starting with the agent it names.
    pub async fn adopt(&self, name: &str, conn: Connection) {
        let Some(slot) = self.slots.get(name) else {
            return;
        };
        let mut guard = slot.conn.lock().await;
        slot.confine(&conn);
        *slot.agent_path.lock() = Some(conn.agent_path.clone());
        *guard = Some(conn);
        slot.generation.fetch_add(1, Ordering::SeqCst);
        *slot.failure.lock() = None;
    }

    /// Remember that probing `name` failed, so listings in the next while answer with the
    /// reason at once instead of waiting on the same hung host again.
    pub fn remember_failure(&self, name: &str, why: &str) {
        if let Some(slot) = self.slots.get(name) {
            *slot.failure.lock() = Some((Instant::now(), why.to_string()));
        }
    }

    /// `name`'s last probe failure and its age, when younger than `within`.
    pub fn recent_failure(&self, name: &str, within: Duration) -> Option<(String, Duration)> {
        let slot = self.slots.get(name)?;
        let g = slot.failure.lock();
        let (at, why) = g.as_ref()?;
        (at.elapsed() < within).then(|| (why.clone(), at.elapsed()))
    }

    /// `name`'s last resources sample and its age, when it is younger than `max_age` and the
    /// connection that sent it is still up. No I/O and no waiting: a slot that is connecting
    /// right now has no answer here.
    pub fn fresh_sample(
        &self,
        name: &str,
        max_age: Duration,
    ) -> Option<(rsb_protocol::ResourceSnapshot, Duration)> {
        let slot = self.slots.get(name)?;
        let generation = {
            let guard = slot.conn.try_lock().ok()?;
            let c = guard.as_ref()?;
            let ssh_ok = c.ssh.as_ref().is_none_or(|s| !s.is_closed());
            if !(c.client.is_alive() && ssh_ok) {
                return None;
            }
            slot.generation.load(Ordering::SeqCst)
        };
        let g = slot.sample.lock();
        let s = g.as_ref()?;
        let age = s.at.elapsed();
        (s.generation == generation && age < max_age).then(|| (s.snapshot.clone(), age))
    }

    /// Remember a sample `name`'s agent just sent, for [`Pool::fresh_sample`]. `generation`
    /// is [`Pool::client_with_generation`]'s, so a sample from a connection that has since been
    /// replaced is never stored as the new one's.
    pub fn store_sample(
        &self,
        name: &str,
        generation: u64,
        snapshot: &rsb_protocol::ResourceSnapshot,
    ) {
        if let Some(slot) = self.slots.get(name) {
            *slot.sample.lock() = Some(Sample {
                at: Instant::now(),
                generation,
                snapshot: snapshot.clone(),
            });
        }
    }

    /// Drop `name`'s remembered sample: what it says is no longer so (a job just leased GPUs
    /// there), and the next listing asks the agent.
    pub fn forget_sample(&self, name: &str) {
        if let Some(slot) = self.slots.get(name) {
            *slot.sample.lock() = None;
        }
    }

    /// The pooled SSH session of `name` (`""` = active), connecting or reconnecting exactly as
    /// [`Pool::client`] does, so forwarded channels share the agent's connection and its
    /// ProxyJump chain. `None` for a sandbox without SSH (`local`); nothing is started for it.
    pub async fn ssh_session(&self, name: &str) -> Result<Option<Arc<crate::ssh::SshSession>>> {
        let name = self.resolve(name)?;
        let slot = self.slots[&name].clone();
        if slot.cfg.transport == Transport::Local {
            return Ok(None);
        }
        self.client(&name).await?;
        Ok(slot.conn.lock().await.as_ref().and_then(|c| c.ssh.clone()))
    }

    /// A new SSH connection to `name` of its own, without an agent (`None` for the `local`
    /// sandbox), for a port forward. Not the pooled one: russh acknowledges channel data as it
    /// arrives and its session loop then waits on a channel's full buffer, so a forwarded
    /// client that stops reading would stall every channel of a shared connection, the
    /// agent's included (issue 21 measured `exec_bash` failing at 16 s beside a paused
    /// download). On a connection of its own it stalls only its forward.
    pub async fn dedicated_ssh_session(
        &self,
        name: &str,
    ) -> Result<Option<Arc<crate::ssh::SshSession>>> {
        let name = self.resolve(name)?;
        match &self.slots[&name].cfg.transport {
            Transport::Local => Ok(None),
            Transport::Ssh(t) => Ok(Some(
                crate::ssh::SshSession::connect_for_forward(&name, t).await?,
            )),
        }
    }

    /// The local agent (a child process), for the local end of syncs; restarted if it died.
    pub async fn local_agent(&self) -> Result<AgentClient> {
        let mut guard = self.local.lock().await;
        if let Some(c) = guard.as_ref() {
            if c.client.is_alive() {
                return Ok(c.client.clone());
            }
            c.client.close("restarting");
            *guard = None;
        }
        let conn = connect::start_local("local-sync").await?;
        let client = conn.client.clone();
        *guard = Some(conn);
        Ok(client)
    }

    /// Whether the last connect of `name` uploaded the agent (for tests and diagnostics).
    pub async fn last_connect_deployed(&self, name: &str) -> Option<bool> {
        let slot = self.slots.get(name)?;
        slot.conn.lock().await.as_ref().map(|c| c.deployed)
    }

    /// Connect if needed and do one real round trip to the agent.
    pub async fn health(&self, name: &str) -> Health {
        let r = async {
            let c = self.client(name).await?;
            c.call(rsb_protocol::PingRequest {
                payload: Vec::new(),
            })
            .await?;
            Ok::<_, RsbError>(())
        }
        .await;
        match r {
            Ok(()) => Health {
                alive: true,
                error: None,
            },
            Err(e) => Health {
                alive: false,
                error: Some(e),
            },
        }
    }

    /// Host, port and user for display; never credentials.
    /// Whether `name` is a `local` sandbox (this machine, no SSH).
    pub fn is_local(&self, name: &str) -> bool {
        matches!(
            self.slots.get(name).map(|s| &s.cfg.transport),
            Some(Transport::Local)
        )
    }

    pub fn describe(&self, name: &str) -> (String, u16, String) {
        match self.slots.get(name).map(|s| &s.cfg.transport) {
            Some(Transport::Ssh(t)) => (t.host.clone(), t.port, t.user.clone()),
            _ => (
                "localhost".into(),
                0,
                std::env::var("USER").unwrap_or_default(),
            ),
        }
    }

    /// Test-only fault injection: panics while holding every sync lock of the pool and of
    /// `name`'s slot, as a bug in a tool handler might. The next call must still work.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn panic_while_locked(&self, name: &str) {
        let slot = self.slots.get(name).expect("a configured sandbox");
        let _agent_path = slot.agent_path.lock();
        let _active = self.active.write();
        panic!("injected panic while holding the pool locks of sandbox '{name}'");
    }

    /// Drop every connection (agents see EOF and exit; jobs keep running) and close the store.
    ///
    /// A slot whose lock is held past [`SHUTDOWN_WAIT`] is a connect still in flight (a probe
    /// that gave up waiting leaves its connect running, up to `connect_timeout_s`): there is
    /// nothing to close yet, and waiting would hold the exit of `rsb sandboxes` for the connect
    /// timeout of a hung host. All slots are waited on together, so the bound is one wait.
    pub async fn shutdown(&self) {
        let closes = std::iter::once(&self.local)
            .chain(self.slots.values().map(|s| &s.conn))
            .map(|conn| async move {
                if let Ok(mut conn) = tokio::time::timeout(SHUTDOWN_WAIT, conn.lock()).await
                    && let Some(c) = conn.take()
                {
                    c.client.close("shutdown");
                }
            });
        futures::future::join_all(closes).await;
    }
}
