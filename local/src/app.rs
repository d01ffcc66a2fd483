//! The state one process works with: the connection [`Pool`] and the state dir's [`Store`]
//! (with the background transfer registry on it). Each front end builds one `App` (the MCP
//! server, a CLI command, a transfer worker) and passes it down; the watchdog daemon keeps its
//! own store and a pool per configuration instead, because it reloads the configuration while
//! it runs.
//!
//! The pool knows sandboxes and connections and nothing of the store; the store knows rows and
//! nothing of connections. What needs both (a sync with its baseline, a background transfer, a
//! detached forward) takes the `App`.

use std::sync::{Arc, OnceLock};

use crate::{
    config::Config,
    error::Result,
    pool::Pool,
    store::{Store, transfers::Transfers},
};

pub struct App {
    pool: Arc<Pool>,
    /// Started on first use: a command that never touches the state dir starts no thread.
    store: OnceLock<Store>,
    /// Background transfer tasks, on `store` (opened by the first ask that succeeds).
    transfers: tokio::sync::OnceCell<Arc<Transfers>>,
}

impl App {
    pub fn new(config: Arc<Config>) -> Arc<App> {
        App::on(Arc::new(Pool::new(config)))
    }

    /// An `App` around a pool built by the caller (one with a first-connect hook, say).
    pub fn on(pool: Arc<Pool>) -> Arc<App> {
        Arc::new(App {
            pool,
            store: OnceLock::new(),
            transfers: tokio::sync::OnceCell::new(),
        })
    }

    /// An `App` whose store is the one `transfers` runs on (a transfer worker, which claimed
    /// its task before it knew the sandbox to build a pool for).
    pub fn with_transfers(pool: Arc<Pool>, transfers: Arc<Transfers>) -> Arc<App> {
        let app = App::on(pool);
        let _ = app.store.set(transfers.store().clone());
        let _ = app.transfers.set(transfers);
        app
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn config(&self) -> &Config {
        self.pool.config()
    }

    /// The state dir's database: every store call of this process goes through it (its thread
    /// opens the database on the first call; see [`Store`]).
    pub fn store(&self) -> Store {
        self.store
            .get_or_init(|| Store::new(&self.pool.config().state_dir))
            .clone()
    }

    /// The background transfer registry, on [`App::store`]. A store that cannot be opened is
    /// an error each time it is asked for, and opened by the first ask that succeeds.
    pub async fn transfers(&self) -> Result<Arc<Transfers>> {
        self.transfers
            .get_or_try_init(|| async {
                let store = self.store();
                store.call(|_| Ok(())).await?;
                Ok(Arc::new(Transfers::on(store)))
            })
            .await
            .cloned()
    }

    /// Close every connection, then the store once what was sent to it ran: the database is
    /// left whole, without its write-ahead log (a held lock bounds this wait like a hung
    /// connect).
    pub async fn shutdown(&self) {
        self.pool.shutdown().await;
        if let Some(s) = self.store.get() {
            let _ = tokio::time::timeout(crate::pool::SHUTDOWN_WAIT, s.close()).await;
        }
    }
}
