//! Port forwarding: a local TCP listener whose every connection becomes a channel on the
//! sandbox's pooled SSH connection — `direct-tcpip` to a host and port, or
//! `direct-streamlocal@openssh.com` to a Unix socket — as `ssh -L` does. The pooled session is
//! already chained through any ProxyJump hops, so forwarding goes through them too. The `local`
//! sandbox has no SSH: its connections are relayed to the target directly.
//!
//! A forward outlives its link. A connection in flight when the link drops is reset (so a
//! client never mistakes a cut response for a whole one); the next connection asks the pool
//! for a session, which reconnects, and repeated failures back off so a dead host is not
//! hammered.

pub mod request;

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use parking_lot::Mutex;
use russh::ChannelMsg;
use serde::Serialize;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Semaphore,
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

use crate::{
    error::{Result, RsbError},
    pool::Pool,
    ssh::{ChannelOpenError, SshSession},
};

/// Connections served at once per forward; further ones wait in the listen backlog, so a
/// flood cannot exhaust file descriptors.
const MAX_CONNECTIONS: usize = 512;
/// How long one new connection may wait for the sandbox to become reachable again.
const OPEN_DEADLINE: Duration = Duration::from_secs(30);
/// A channel open that gets no answer (a silent link not yet declared dead by keepalive).
const CHANNEL_OPEN_TIMEOUT: Duration = Duration::from_secs(15);
const BACKOFF_FIRST: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const COPY_BUF: usize = 64 * 1024;
const STOPPED: &str = "the forward was stopped";

/// The forward vocabulary is the store's too (a detached forward is a row); it is named here.
pub use crate::store::forwards::{LocalPort, StatsSnapshot, Target};

/// Bind the listener, with errors that say which port and what to do.
pub async fn bind(ip: IpAddr, port: LocalPort) -> Result<TcpListener> {
    let try_bind = |p: u16| TcpListener::bind(SocketAddr::new(ip, p));
    let (first, fallback) = match port {
        LocalPort::Exact(p) => (p, false),
        LocalPort::Prefer(p) => (p, true),
        LocalPort::Any => (0, false),
    };
    match try_bind(first).await {
        Ok(l) => Ok(l),
        Err(e) if fallback && e.kind() == std::io::ErrorKind::AddrInUse => {
            try_bind(0).await.map_err(|e| bind_error(ip, 0, &e))
        }
        Err(e) if fallback && e.kind() == std::io::ErrorKind::PermissionDenied => {
            try_bind(0).await.map_err(|e| bind_error(ip, 0, &e))
        }
        Err(e) => Err(bind_error(ip, first, &e)),
    }
}

fn bind_error(ip: IpAddr, port: u16, e: &std::io::Error) -> RsbError {
    let addr = SocketAddr::new(ip, port);
    let hint = match e.kind() {
        std::io::ErrorKind::AddrInUse => "choose another local port, or 0 for any free port",
        std::io::ErrorKind::PermissionDenied => {
            "ports below 1024 need privileges; choose a port of 1024 or more"
        }
        std::io::ErrorKind::AddrNotAvailable => {
            "the bind address is not one of this machine's; use 127.0.0.1 or a local interface's address"
        }
        _ => "check the bind address and port",
    };
    RsbError::invalid(format!("cannot listen on {addr}: {e}"), hint)
}

/// The address to show in a URL: an unspecified bind (0.0.0.0, ::) is reached via loopback.
pub fn url_for(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/", SocketAddr::new(ip, addr.port()))
}

/// One line of a forward's life, for the CLI (and logs).
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Open {
        conn: u64,
        peer: String,
    },
    Close {
        conn: u64,
        peer: String,
        /// Bytes from the local client to the sandbox service, and back.
        bytes_sent: u64,
        bytes_received: u64,
        duration_s: f64,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// The sandbox could not be reached; the next attempt waits `retry_in_s`.
    LinkDown {
        error: String,
        retry_in_s: f64,
    },
    /// A new SSH connection replaced the one that was lost.
    Reconnected {
        sandbox: String,
    },
}

pub type EventSink = Arc<dyn Fn(&Event) + Send + Sync>;

/// Counters of one forward, readable while it runs.
#[derive(Debug, Default)]
struct Stats {
    connections_total: AtomicU64,
    connections_active: AtomicU64,
    connections_failed: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    reconnects: AtomicU64,
    last_error: Mutex<Option<String>>,
}

/// A running forward. [`Forward::stop`] returns once the port is free; dropping it stops it
/// too, without waiting.
pub struct Forward {
    pub sandbox: String,
    pub target: Target,
    pub local_addr: SocketAddr,
    pub started: SystemTime,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Forward {
    /// Serve `listener` until stopped. `sandbox` must be a resolved name.
    pub fn start(
        pool: Arc<Pool>,
        sandbox: String,
        target: Target,
        listener: TcpListener,
        events: Option<EventSink>,
    ) -> Result<Arc<Forward>> {
        let local_addr = listener
            .local_addr()
            .map_err(|e| RsbError::internal(format!("listener has no address: {e}")))?;
        let direct = pool
            .sandbox_config(&sandbox)
            .ok_or_else(|| pool.unknown(&sandbox))?
            .transport
            == crate::config::Transport::Local;
        let shared = Arc::new(Shared {
            pool,
            sandbox: sandbox.clone(),
            target: target.clone(),
            direct,
            stats: Stats::default(),
            events,
            link: Mutex::new(LinkState::default()),
            connecting: tokio::sync::Mutex::new(()),
            own: Mutex::new(None),
        });
        let cancel = CancellationToken::new();
        let task = tokio::spawn(accept_loop(listener, shared.clone(), cancel.clone()));
        Ok(Arc::new(Forward {
            sandbox,
            target,
            local_addr,
            started: SystemTime::now(),
            shared,
            cancel,
            task: tokio::sync::Mutex::new(Some(task)),
        }))
    }

    pub fn url(&self) -> String {
        url_for(self.local_addr)
    }

    pub fn is_running(&self) -> bool {
        !self.cancel.is_cancelled()
    }

    pub fn stats(&self) -> StatsSnapshot {
        let s = &self.shared.stats;
        StatsSnapshot {
            connections_total: s.connections_total.load(Ordering::Relaxed),
            connections_active: s.connections_active.load(Ordering::Relaxed),
            connections_failed: s.connections_failed.load(Ordering::Relaxed),
            bytes_sent: s.bytes_sent.load(Ordering::Relaxed),
            bytes_received: s.bytes_received.load(Ordering::Relaxed),
            reconnects: s.reconnects.load(Ordering::Relaxed),
            last_error: s.last_error.lock().clone(),
        }
    }

    /// Stop accepting, close every connection, and return once the port is free again.
    pub async fn stop(&self) {
        self.cancel.cancel();
        if let Some(t) = self.task.lock().await.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[derive(Default)]
struct LinkState {
    /// Consecutive failures, for the backoff.
    failures: u32,
    /// Every failure ever, so a waiter can tell that an attempt failed while it waited.
    attempts_failed: u64,
    /// No reconnect attempt before this instant.
    not_before: Option<Instant>,
    /// The session used last, to notice (and report) that the pool replaced it.
    last: Option<Weak<SshSession>>,
}

struct Shared {
    pool: Arc<Pool>,
    sandbox: String,
    target: Target,
    /// No SSH (the `local` sandbox): relay straight to the target.
    direct: bool,
    stats: Stats,
    events: Option<EventSink>,
    link: Mutex<LinkState>,
    /// Held while asking the pool for a session (see [`Shared::open`]).
    connecting: tokio::sync::Mutex<()>,
    /// This forward's own SSH connection ([`Pool::dedicated_ssh_session`]), replaced once it
    /// dies: a client of this forward that stops reading stalls this connection only.
    own: Mutex<Option<Arc<SshSession>>>,
}

impl Shared {
    fn emit(&self, e: Event) {
        if let Some(sink) = &self.events {
            sink(&e);
        }
    }

    fn link_failed(&self, error: &str) {
        let retry_in = {
            let mut l = self.link.lock();
            l.failures = l.failures.saturating_add(1);
            l.attempts_failed += 1;
            let wait = BACKOFF_FIRST
                .saturating_mul(1u32 << (l.failures - 1).min(8))
                .min(BACKOFF_MAX);
            l.not_before = Some(Instant::now() + wait);
            wait
        };
        *self.stats.last_error.lock() = Some(error.to_string());
        // A foreground forward prints this as an event line already; say it once.
        if self.events.is_none() {
            tracing::warn!(sandbox = %self.sandbox, "forward: sandbox unreachable: {error}");
        }
        self.emit(Event::LinkDown {
            error: error.to_string(),
            retry_in_s: retry_in.as_secs_f64(),
        });
    }

    fn link_ok(&self, ssh: &Arc<SshSession>) {
        let replaced = {
            let mut l = self.link.lock();
            l.failures = 0;
            l.not_before = None;
            let same = l
                .last
                .as_ref()
                .and_then(Weak::upgrade)
                .is_some_and(|prev| Arc::ptr_eq(&prev, ssh));
            let had_one = l.last.is_some();
            l.last = Some(Arc::downgrade(ssh));
            had_one && !same
        };
        if replaced {
            self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
            tracing::info!(sandbox = %self.sandbox, "forward: reconnected");
            self.emit(Event::Reconnected {
                sandbox: self.sandbox.clone(),
            });
        }
    }

    /// The forward's own connection, opened anew when there is none or it died. Called with
    /// `connecting` held, so one attempt runs at a time.
    async fn session(&self) -> crate::error::Result<Option<Arc<SshSession>>> {
        if let Some(s) = self.own.lock().as_ref().filter(|s| !s.is_closed()) {
            return Ok(Some(s.clone()));
        }
        let s = self.pool.dedicated_ssh_session(&self.sandbox).await?;
        *self.own.lock() = s.clone();
        Ok(s)
    }

    /// A stream to the target: a channel on the forward's own session (reconnecting as needed, within
    /// [`OPEN_DEADLINE`]), or a direct socket for the `local` sandbox.
    async fn open(&self, peer: SocketAddr) -> std::result::Result<Remote, String> {
        if self.direct {
            return open_direct(&self.target).await.map(Remote::Direct);
        }
        let deadline = tokio::time::Instant::now() + OPEN_DEADLINE;
        let mut last = String::from("no attempt finished in time");
        // Bounded in count as well as time: a failed attempt backs off at least 200 ms, and a
        // stale session is replaced by the pool on the next turn.
        for _ in 0..32 {
            let wait = self.link.lock().not_before;
            if let Some(t) = wait {
                if tokio::time::Instant::from_std(t) >= deadline {
                    break;
                }
                tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await;
            }
            let ssh = {
                // One reconnect attempt at a time: connections that waited behind a failed
                // attempt share its outcome and go back to the backoff instead of each
                // paying a connect timeout of their own.
                let seen = self.link.lock().attempts_failed;
                let Ok(_one) = tokio::time::timeout_at(deadline, self.connecting.lock()).await
                else {
                    break;
                };
                if self.link.lock().attempts_failed != seen {
                    continue;
                }
                match tokio::time::timeout_at(deadline, self.session()).await {
                    Err(_) => break,
                    Ok(Ok(Some(s))) => s,
                    Ok(Ok(None)) => return Err("the sandbox has no SSH connection".into()),
                    Ok(Err(e)) => {
                        last = e.message;
                        self.link_failed(&last);
                        continue;
                    }
                }
            };
            let open = async {
                match &self.target {
                    Target::Tcp { host, port } => ssh.open_direct_tcpip(host, *port, peer).await,
                    Target::Unix { path } => ssh.open_direct_streamlocal(path).await,
                }
            };
            match tokio::time::timeout(CHANNEL_OPEN_TIMEOUT, open).await {
                Ok(Ok(ch)) => {
                    self.link_ok(&ssh);
                    return Ok(Remote::Channel(ch, ssh));
                }
                Ok(Err(ChannelOpenError::Refused(why))) => {
                    self.link_ok(&ssh);
                    return Err(format!("{}: {why}", self.target));
                }
                // The session died under us; the pool notices and reconnects on the next turn.
                Ok(Err(ChannelOpenError::Link(why))) if ssh.is_closed() => {
                    last = format!("connection lost: {why}");
                }
                Ok(Err(ChannelOpenError::Link(why))) => {
                    last = format!("connection lost: {why}");
                    self.link_failed(&last);
                }
                Err(_) => {
                    last = format!(
                        "no answer to the channel open within {}s",
                        CHANNEL_OPEN_TIMEOUT.as_secs()
                    );
                    self.link_failed(&last);
                }
            }
        }
        Err(format!("cannot reach sandbox '{}': {last}", self.sandbox))
    }
}

/// A socket of any kind the `local` sandbox can relay to.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

enum Remote {
    /// Keeps its session alive while the connection lasts, and tells a lost link from a
    /// normal end of stream.
    Channel(russh::Channel<russh::client::Msg>, Arc<SshSession>),
    Direct(Box<dyn Io>),
}

async fn open_direct(target: &Target) -> std::result::Result<Box<dyn Io>, String> {
    match target {
        Target::Tcp { host, port } => TcpStream::connect((host.as_str(), *port))
            .await
            .map(|s| {
                let _ = s.set_nodelay(true);
                Box::new(s) as Box<dyn Io>
            })
            .map_err(|e| format!("{target}: {e}")),
        Target::Unix { path } => tokio::net::UnixStream::connect(path)
            .await
            .map(|s| Box::new(s) as Box<dyn Io>)
            .map_err(|e| format!("{target}: {e}")),
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, cancel: CancellationToken) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut conns = JoinSet::new();
    let mut next_id = 0u64;
    loop {
        let permit = tokio::select! {
            _ = cancel.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("forward: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        next_id += 1;
        let (shared, id, cancel) = (shared.clone(), next_id, cancel.clone());
        conns.spawn(async move {
            serve(&shared, stream, peer, id, &cancel).await;
            drop(permit);
        });
        // Reap finished connections so the set stays as small as the live ones.
        while conns.try_join_next().is_some() {}
    }
    // The port is free once the listener is gone. Live connections saw the same token and
    // close their channels; any that cannot within a moment are aborted.
    drop(listener);
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(2), drain)
        .await
        .is_err()
    {
        conns.shutdown().await;
    }
}

async fn serve(
    shared: &Shared,
    mut client: TcpStream,
    peer: SocketAddr,
    conn: u64,
    cancel: &CancellationToken,
) {
    let stats = &shared.stats;
    stats.connections_total.fetch_add(1, Ordering::Relaxed);
    stats.connections_active.fetch_add(1, Ordering::Relaxed);
    let _ = client.set_nodelay(true);
    let t0 = Instant::now();
    let peer_s = peer.to_string();
    shared.emit(Event::Open {
        conn,
        peer: peer_s.clone(),
    });
    let (sent, received) = (AtomicU64::new(0), AtomicU64::new(0));
    let opened = tokio::select! {
        r = shared.open(peer) => r,
        _ = cancel.cancelled() => Err(STOPPED.to_string()),
    };
    let result = match opened {
        Err(e) => Err(e),
        Ok(remote) => relay(&mut client, remote, shared, &sent, &received, cancel)
            .await
            .map_err(|e| e.to_string()),
    };
    if let Err(e) = &result {
        stats.connections_failed.fetch_add(1, Ordering::Relaxed);
        *stats.last_error.lock() = Some(e.clone());
        // A reset, not a FIN: a client reading to end of stream must not take a cut
        // response for a whole one.
        let _ = client.set_zero_linger();
    }
    drop(client);
    stats.connections_active.fetch_sub(1, Ordering::Relaxed);
    shared.emit(Event::Close {
        conn,
        peer: peer_s,
        bytes_sent: sent.load(Ordering::Relaxed),
        bytes_received: received.load(Ordering::Relaxed),
        duration_s: t0.elapsed().as_secs_f64(),
        error: result.err(),
    });
}

/// Copy both ways until both sides have ended. An end of stream in one direction is passed on
/// as a half-close and the other direction goes on; an error, or the link dying, ends both.
async fn relay(
    client: &mut TcpStream,
    remote: Remote,
    shared: &Shared,
    sent: &AtomicU64,
    received: &AtomicU64,
    cancel: &CancellationToken,
) -> std::io::Result<()> {
    let stopped = || std::io::Error::other(STOPPED);
    let (mut cr, mut cw) = client.split();
    let to_remote_total = &shared.stats.bytes_sent;
    let from_remote_total = &shared.stats.bytes_received;
    match remote {
        Remote::Direct(s) => {
            let (mut rr, mut rw) = tokio::io::split(s);
            let up = async {
                copy(&mut cr, &mut rw, sent, to_remote_total).await?;
                let _ = rw.shutdown().await;
                Ok::<_, std::io::Error>(())
            };
            let down = async {
                copy(&mut rr, &mut cw, received, from_remote_total).await?;
                cw.shutdown().await
            };
            tokio::select! {
                r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
                _ = cancel.cancelled() => Err(stopped()),
            }
        }
        Remote::Channel(ch, _session) => {
            let (mut rd, wr) = ch.split();
            let mut rw = wr.make_writer();
            let up = async {
                copy(&mut cr, &mut rw, sent, to_remote_total).await?;
                // EOF to the service; it may still answer.
                let _ = rw.shutdown().await;
                Ok::<_, std::io::Error>(())
            };
            let down = async {
                loop {
                    match rd.wait().await {
                        Some(ChannelMsg::Data { data }) => {
                            cw.write_all(&data).await?;
                            received.fetch_add(data.len() as u64, Ordering::Relaxed);
                            from_remote_total.fetch_add(data.len() as u64, Ordering::Relaxed);
                        }
                        Some(ChannelMsg::Eof | ChannelMsg::Close) => break,
                        Some(_) => {}
                        // The session is gone: whatever was in flight may be incomplete.
                        None => {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::ConnectionAborted,
                                "the link to the sandbox was lost",
                            ));
                        }
                    }
                }
                cw.shutdown().await
            };
            let r = tokio::select! {
                r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
                _ = cancel.cancelled() => Err(stopped()),
            };
            // A split channel is not closed on drop; a no-op when the server closed it first.
            let _ = tokio::time::timeout(Duration::from_secs(1), wr.close()).await;
            r
        }
    }
}

async fn copy<R, W>(
    r: &mut R,
    w: &mut W,
    count: &AtomicU64,
    total: &AtomicU64,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin + ?Sized,
    W: AsyncWrite + Unpin + ?Sized,
{
    let mut buf = vec![0u8; COPY_BUF];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        w.write_all(&buf[..n]).await?;
        count.fetch_add(n as u64, Ordering::Relaxed);
        total.fetch_add(n as u64, Ordering::Relaxed);
    }
}
