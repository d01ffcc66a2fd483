//! [`Store`]: this process's one connection to the state dir's database, owned by one thread.
//!
//! A query can wait up to the busy timeout (5 s) while another process holds the database's
//! write lock. Run on a runtime thread, that wait stalls every task queued there: an
//! `exec_bash` on an unrelated sandbox, a timer, a heartbeat. So no runtime thread touches
//! SQLite: every store call is a closure sent through a bounded queue to the store's thread,
//! and the caller awaits the answer. Calls run one at a time, in the order they were sent (a
//! write sent before another is committed before it), on one connection, whose prepared
//! statements stay cached between calls.
//!
//! The connection is opened (created 0600, migrated, checked: [`super::open`]) on the thread by
//! the first call, so a handle costs nothing until it is used. A store that cannot be opened
//! answers each call with that error and is tried again by the next call, as a fresh
//! [`super::open`] would be. [`Store::close`] closes the connection (SQLite then folds its
//! write-ahead log into the database and removes it); a later call opens it again. The thread
//! ends when the last handle is dropped.

use std::{
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
    sync::Arc,
};

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use crate::error::{Kind, RsbError};

/// Calls waiting for the store's thread at most. A caller beyond them waits for room, without
/// holding a thread: a stalled store slows its callers, never the runtime.
const QUEUE: usize = 64;

type Job = Box<dyn FnOnce(Result<&mut Connection, RsbError>) + Send>;

enum Msg {
    Call(Job),
    Close(oneshot::Sender<()>),
}

/// A handle to the store's thread; clones share it. See the module's documentation.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    tx: mpsc::Sender<Msg>,
    state_dir: PathBuf,
    /// Why the thread could not be started (then every call says so).
    not_started: Option<String>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("state_dir", &self.inner.state_dir)
            .finish()
    }
}

impl Store {
    /// The store of `state_dir`, opened by its first call. A thread that cannot be started
    /// (the process is out of threads) is each call's error, as an unusable store is.
    pub fn new(state_dir: &Path) -> Store {
        let (tx, rx) = mpsc::channel(QUEUE);
        let dir = state_dir.to_path_buf();
        let not_started = std::thread::Builder::new()
            .name("rsb-store".into())
            .spawn(move || serve(&dir, rx))
            .err()
            .map(|e| e.to_string());
        Store {
            inner: Arc::new(Inner {
                tx,
                state_dir: state_dir.to_path_buf(),
                not_started,
            }),
        }
    }

    /// [`Store::new`], then opened: an error here is the store's (damaged, newer, unwritable).
    pub async fn open(state_dir: &Path) -> Result<Store, RsbError> {
        let s = Store::new(state_dir);
        s.call(|_| Ok(())).await?;
        Ok(s)
    }

    pub fn state_dir(&self) -> &Path {
        &self.inner.state_dir
    }

    /// Runs `f` on the store's connection and returns what it returned. The caller waits
    /// without holding a thread. Once sent, `f` runs even if the caller stops waiting (a write
    /// is never half-sent).
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, RsbError> + Send + 'static,
    ) -> Result<T, RsbError> {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |c| {
            let _ = tx.send(c.and_then(f));
        });
        self.inner
            .tx
            .send(Msg::Call(job))
            .await
            .map_err(|_| self.gone())?;
        rx.await.map_err(|_| self.gone())?
    }

    /// Why a call got no answer: the thread never started, or the call panicked on it.
    fn gone(&self) -> RsbError {
        match &self.inner.not_started {
            Some(why) => RsbError::new(
                Kind::Internal,
                format!("the state database's thread cannot be started: {why}"),
                "the process is out of threads or memory; retry",
            ),
            None => RsbError::new(
                Kind::Internal,
                "the state database's thread stopped (a store call panicked)",
                "retry; if it persists, report this as an rsb bug",
            ),
        }
    }

    /// Closes the connection once the calls sent before have run, and returns when it is
    /// closed: what a process does before it exits, so the database is left whole, with no
    /// write-ahead log beside it. A call after this opens it again.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.inner.tx.send(Msg::Close(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// The store's thread: the connection, opened on first use, and each call in turn.
fn serve(state_dir: &Path, mut rx: mpsc::Receiver<Msg>) {
    let mut conn: Option<Connection> = None;
    while let Some(msg) = rx.blocking_recv() {
        let job = match msg {
            Msg::Call(job) => job,
            Msg::Close(done) => {
                drop(conn.take());
                let _ = done.send(());
                continue;
            }
        };
        if conn.is_none() {
            match super::open(state_dir) {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    job(Err(e));
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        // A call that panics loses its answer (its caller gets an error), not the thread; the
        // connection is reopened in case the panic left a transaction open.
        if std::panic::catch_unwind(AssertUnwindSafe(|| job(Ok(c)))).is_err() {
            conn = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    async fn meta_rows(s: &Store) -> i64 {
        s.call(|c| {
            c.query_row("SELECT COUNT(*) FROM daemon_meta", [], |r| r.get(0))
                .map_err(super::super::db_err)
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn calls_run_in_order_on_one_connection() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).await.unwrap();
        let mut sent = Vec::new();
        for i in 0..100 {
            let s = s.clone();
            sent.push(tokio::spawn(async move {
                s.call(move |c| {
                    c.execute(
                        "INSERT INTO daemon_meta (key, value, updated_ts) VALUES (?1, '', ?2)",
                        rusqlite::params![format!("k{i}"), i],
                    )
                    .map_err(super::super::db_err)?;
                    Ok(c.last_insert_rowid())
                })
                .await
            }));
        }
        for h in sent {
            h.await.unwrap().unwrap();
        }
        let n = meta_rows(&s).await;
        assert_eq!(n, 100);
    }

    #[tokio::test]
    async fn close_leaves_the_database_whole_and_a_later_call_reopens_it() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).await.unwrap();
        s.call(|c| {
            c.execute(
                "INSERT INTO daemon_meta (key, value, updated_ts) VALUES ('k', 'v', 1)",
                [],
            )
            .map_err(super::super::db_err)
        })
        .await
        .unwrap();
        let wal = d.path().join(format!("{}-wal", super::super::DB_FILE));
        assert!(wal.exists(), "WAL mode keeps a log while open");
        s.close().await;
        assert!(!wal.exists(), "the log is folded in and removed on close");
        let n = meta_rows(&s).await;
        assert_eq!(n, 1);
    }

    #[tokio::test]
    async fn a_panicking_call_is_an_error_and_the_store_goes_on() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).await.unwrap();
        let e = s
            .call(|_| -> Result<(), RsbError> { panic!("planted") })
            .await
            .unwrap_err();
        assert!(e.message.contains("stopped"), "{}", e.message);
        assert_eq!(s.call(|_| Ok(7)).await.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_store_that_cannot_open_says_why_on_each_call() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(super::super::DB_FILE), vec![7u8; 4096]).unwrap();
        let s = Store::new(d.path());
        for _ in 0..2 {
            let e = s.call(|_| Ok(())).await.unwrap_err();
            assert!(e.message.contains("unusable"), "{}", e.message);
        }
        // Moved aside, the next call opens a fresh one.
        std::fs::remove_file(d.path().join(super::super::DB_FILE)).unwrap();
        s.call(|_| Ok(())).await.unwrap();
    }

    /// Issue 45, step 2: on a current-thread runtime (one thread for every task) a timer still
    /// fires on time while a store call waits a second for another process's write lock.
    #[test]
    fn a_timer_fires_on_time_while_a_store_call_waits_on_a_lock() {
        let d = tempfile::tempdir().unwrap();
        drop(super::super::open(d.path()).unwrap());
        let holder = Connection::open(super::super::db_path(d.path())).unwrap();
        holder.execute_batch("BEGIN EXCLUSIVE;").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = d.path().to_path_buf();
        let (late, waited) = rt.block_on(async move {
            let s = Store::new(&dir);
            let t0 = Instant::now();
            let call = tokio::spawn(async move {
                s.call(|c| {
                    c.execute("DELETE FROM daemon_meta", [])
                        .map_err(super::super::db_err)
                })
                .await
            });
            // The lock goes after 1 s, from a plain thread.
            let release = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(1));
                holder.execute_batch("COMMIT;").unwrap();
            });
            let mut late = Duration::ZERO;
            for i in 1..=8u32 {
                tokio::time::sleep_until((t0 + Duration::from_millis(100) * i).into()).await;
                late = late.max(t0.elapsed().saturating_sub(Duration::from_millis(100) * i));
            }
            call.await.unwrap().unwrap();
            release.join().unwrap();
            (late, t0.elapsed())
        });
        assert!(
            waited >= Duration::from_millis(950),
            "the call did not wait: {waited:?}"
        );
        // A timer on a stalled thread would be ~1 s late; 2 cores under a test run: 50 ms.
        assert!(
            late < Duration::from_millis(50),
            "a timer fired {late:?} late"
        );
    }
}
