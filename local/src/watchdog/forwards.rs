//! Detached forwards: `forward_port(detach=true)` and `rsb forward --detach` record a forward
//! here, and the watchdog daemon serves it. The daemon already keeps one pooled connection per
//! sandbox and outlives MCP servers and terminals, so a forward to a notebook keeps working
//! after the agent's session ends. The daemon writes back the bound address, errors and
//! counters; a row's life is `starting` → `listening` (or `failed`) → `stopping` → deleted once
//! the port is free. A daemon restarted by its service picks `listening` rows up again on the
//! same local port.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use parking_lot::Mutex;

use crate::{
    error::{Result, RsbError},
    forward::{
        Forward,
        request::{self as fwd_ops, ForwardRequest},
    },
    pool::Pool,
    store,
};

pub use crate::store::forwards::*;

/// How long the daemon waits before trying again to serve a `listening` row it could not
/// restart (the host is down, the port is taken); a `starting` row fails at once instead, so
/// the caller waiting for it hears why.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// Connect + bind, the same bound as a watch's connect.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// The request a row stands for. A forward that was listening is restarted on the same port,
/// so a URL handed out before a daemon restart keeps working.
fn request_of(row: &Row) -> Result<ForwardRequest> {
    let target = fwd_ops::parse_target(&row.target)?;
    let bind = fwd_ops::parse_bind(&row.bind)?;
    let local_port = match row.local_address.parse::<SocketAddr>() {
        Ok(a) if row.state == LISTENING => LocalPort::Exact(a.port()),
        _ => decode_port(&row.local_port),
    };
    Ok(ForwardRequest {
        sandbox: row.sandbox_name.clone(),
        target,
        bind,
        local_port,
    })
}

/// How the daemon finds the pool of a persisted sandbox (fingerprint, name) for a forward.
pub type PoolFor = Arc<
    dyn Fn(
            String,
            String,
        ) -> futures::future::BoxFuture<'static, std::result::Result<Arc<Pool>, String>>
        + Send
        + Sync,
>;

/// The daemon's side: the forwards it serves, reconciled with the store every tick.
pub struct Served {
    store: store::Store,
    running: Mutex<HashMap<i64, Arc<Forward>>>,
    /// Rows with a start or stop in flight.
    busy: Mutex<HashSet<i64>>,
    retry_at: Mutex<HashMap<i64, Instant>>,
}

impl Served {
    pub fn new(store: store::Store) -> Served {
        Served {
            store,
            running: Mutex::new(HashMap::new()),
            busy: Mutex::new(HashSet::new()),
            retry_at: Mutex::new(HashMap::new()),
        }
    }

    /// One reconcile pass. `pool_for(fingerprint, sandbox)` resolves a sandbox the way watches
    /// do (the persisted definition and any opted-in secret). Returns how many forwards the
    /// store wants served, which keeps a detached daemon from exiting idle.
    pub async fn tick(self: &Arc<Self>, pool_for: &PoolFor) -> usize {
        let rows = match self.store.call(|c| list(c)).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("[watchdog] cannot read forwards: {}", e.message);
                return self.running.lock().len();
            }
        };
        let mut wanted = 0;
        let ids: HashSet<i64> = rows.iter().map(|r| r.id).collect();
        let mut stats = Vec::new();
        for row in rows {
            match row.state.as_str() {
                STOPPING => self.stop(row.id),
                STARTING | LISTENING => {
                    wanted += 1;
                    let running = self.running.lock().get(&row.id).cloned();
                    if let Some(f) = running {
                        stats.push((row.id, f.stats()));
                    } else {
                        self.start(row, pool_for).await;
                    }
                }
                _ => {}
            }
        }
        if !stats.is_empty() {
            // One call for every served forward's counters.
            let _ = self
                .store
                .call(move |c| {
                    for (id, s) in &stats {
                        let _ = set_stats(c, *id, s);
                    }
                    Ok(())
                })
                .await;
        }
        // A row deleted by hand (or by `stop` without a daemon) stops its forward too.
        let orphans: Vec<i64> = self
            .running
            .lock()
            .keys()
            .filter(|id| !ids.contains(id))
            .copied()
            .collect();
        for id in orphans {
            self.stop(id);
        }
        wanted
    }

    async fn start(self: &Arc<Self>, row: Row, pool_for: &PoolFor) {
        if let Some(at) = self.retry_at.lock().get(&row.id)
            && Instant::now() < *at
        {
            return;
        }
        if !self.busy.lock().insert(row.id) {
            return;
        }
        let prepared = match request_of(&row) {
            Ok(req) => pool_for(row.sandbox_fp.clone(), row.sandbox_name.clone())
                .await
                .map(|p| (req, p)),
            Err(e) => Err(e.message),
        };
        let (req, pool) = match prepared {
            Ok(x) => x,
            Err(msg) => {
                self.failed(&row, &msg).await;
                self.busy.lock().remove(&row.id);
                return;
            }
        };
        let me = self.clone();
        tokio::spawn(async move {
            let r = match tokio::time::timeout(START_DEADLINE, fwd_ops::start(&pool, &req, None))
                .await
            {
                Ok(r) => r.map_err(|e| format!("{} ({})", e.message, e.hint)),
                Err(_) => Err(format!(
                    "no connection to sandbox '{}' within {}s",
                    row.sandbox_name,
                    START_DEADLINE.as_secs()
                )),
            };
            match r {
                Ok(f) => {
                    let (id, addr) = (row.id, f.local_addr);
                    match me.store.call(move |c| set_listening(c, id, addr)).await {
                        Ok(()) => {
                            tracing::info!(
                                "[watchdog] forward {} listening on {} -> {}:{}",
                                row.public_id(),
                                f.local_addr,
                                row.sandbox_name,
                                row.target
                            );
                            me.retry_at.lock().remove(&row.id);
                            me.running.lock().insert(row.id, f);
                        }
                        Err(e) => {
                            // Not on record: not served (the next tick tries again).
                            tracing::warn!(
                                "[watchdog] cannot record forward {}: {}",
                                row.id,
                                e.message
                            );
                            f.stop().await;
                        }
                    }
                }
                Err(msg) => me.failed(&row, &msg).await,
            }
            me.busy.lock().remove(&row.id);
        });
    }

    async fn failed(&self, row: &Row, msg: &str) {
        tracing::warn!("[watchdog] forward {}: {msg}", row.public_id());
        let (id, m) = (row.id, msg.to_string());
        let _ = self.store.call(move |c| set_error(c, id, &m)).await;
        self.retry_at
            .lock()
            .insert(row.id, Instant::now() + RETRY_AFTER);
    }

    /// Stop (if served here) and delete the row once the port is free.
    fn stop(self: &Arc<Self>, id: i64) {
        if !self.busy.lock().insert(id) {
            return;
        }
        let f = self.running.lock().remove(&id);
        let me = self.clone();
        tokio::spawn(async move {
            if let Some(f) = f {
                f.stop().await;
                tracing::info!("[watchdog] forward {} stopped", ID_OFFSET + id as u64);
            }
            if let Err(e) = me.store.call(move |c| delete(c, id)).await {
                tracing::warn!("[watchdog] forward {id}: {}", e.message);
            }
            me.retry_at.lock().remove(&id);
            me.busy.lock().remove(&id);
        });
    }

    pub async fn stop_all(&self) {
        let all: Vec<Arc<Forward>> = std::mem::take(&mut *self.running.lock())
            .into_values()
            .collect();
        for f in all {
            f.stop().await;
        }
    }
}

/// Turn an id a user passed into a row id, when it names a detached forward.
pub fn row_id(public: u64) -> Option<i64> {
    public
        .checked_sub(ID_OFFSET)
        .filter(|n| *n > 0)
        .and_then(|n| i64::try_from(n).ok())
}

/// The error for a detached forward that did not start, as the daemon recorded it.
pub fn start_error(row: &Row) -> RsbError {
    RsbError::invalid(
        format!(
            "the watchdog could not start forward {} to {}:{}: {}",
            row.public_id(),
            row.sandbox_name,
            row.target,
            row.error
        ),
        "fix what the message says and ask again; `rsb watchdog status` shows the daemon",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::Target;

    #[test]
    fn ports_round_trip() {
        for p in [
            LocalPort::Exact(8080),
            LocalPort::Prefer(6006),
            LocalPort::Any,
        ] {
            assert_eq!(decode_port(&encode_port(p)), p);
        }
        assert_eq!(decode_port("exact:99999"), LocalPort::Any);
        assert_eq!(decode_port(""), LocalPort::Any);
    }

    #[test]
    fn ids_never_collide_with_a_servers_own() {
        assert_eq!(row_id(ID_OFFSET + 7), Some(7));
        assert_eq!(row_id(7), None);
        assert_eq!(row_id(ID_OFFSET), None);
    }

    #[test]
    fn rows_live_in_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let c = store::open(dir.path()).unwrap();
        let t = Target::Tcp {
            host: "localhost".into(),
            port: 8888,
        };
        let id = insert(
            &c,
            "gpu",
            "fp1",
            &t,
            "127.0.0.1".parse().unwrap(),
            LocalPort::Prefer(8888),
        )
        .unwrap();
        let r = get(&c, id).unwrap().unwrap();
        assert_eq!(
            (r.state.as_str(), r.target.as_str()),
            (STARTING, "localhost:8888")
        );
        assert_eq!(r.sandbox_fp, "fp1");
        set_error(&c, id, "boom").unwrap();
        assert_eq!(get(&c, id).unwrap().unwrap().state, FAILED);
        let id2 = insert(
            &c,
            "gpu",
            "",
            &t,
            "127.0.0.1".parse().unwrap(),
            LocalPort::Any,
        )
        .unwrap();
        set_listening(&c, id2, "127.0.0.1:4000".parse().unwrap()).unwrap();
        let r2 = get(&c, id2).unwrap().unwrap();
        assert_eq!(r2.state, LISTENING);
        // A listening row restarts on the port it had.
        assert_eq!(request_of(&r2).unwrap().local_port, LocalPort::Exact(4000));
        // A listening row that cannot restart keeps its state (it is retried).
        set_error(&c, id2, "host down").unwrap();
        assert_eq!(get(&c, id2).unwrap().unwrap().state, LISTENING);
        assert!(request_stop(&c, id2).unwrap());
        delete(&c, id2).unwrap();
        assert!(!request_stop(&c, id2).unwrap());
        assert_eq!(list(&c).unwrap().len(), 1);
    }
}
