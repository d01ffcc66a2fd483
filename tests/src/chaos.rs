//! A loopback TCP relay that injects network faults between an SSH client
//! and the fixture sshd.
//!
//! rsb's reconnect and keep-alive logic has to cope with links that are
//! slow, that go silent without closing (NAT timeouts, suspended laptops),
//! and that are reset mid-transfer. Real sshd behind a controllable relay
//! reproduces those deterministically without root-only tools like `tc`.
//!
//! The relay runs on its own thread with its own single-threaded tokio
//! runtime, so it works the same from sync tests and from async tests
//! (whose runtime may be single-threaded and blocked by the test itself).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

/// Enough for any pooled client under test; beyond it new connections are
/// dropped so a runaway reconnect loop cannot exhaust file descriptors.
const MAX_CONNECTIONS: usize = 256;
const CHUNK: usize = 16 * 1024;
/// Chunks a [`ChaosProxy::set_latency`] link holds in flight per direction (8 MiB: far above
/// the bandwidth-delay product of any link a test models).
const LATENCY_QUEUE: usize = 512;
/// Sending time a [`ChaosProxy::set_latency`] link may catch up on after a late timer.
const LATENCY_BURST: Duration = Duration::from_millis(5);
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `cut()` waits for the cut connections to be fully closed, so a
/// test can assert on `connections()` right after it.
const CUT_SETTLE_TIMEOUT: Duration = Duration::from_secs(2);

pub struct ChaosProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    upstream: SocketAddr,
    delay_ns: AtomicU64,
    /// One-way propagation delay of connections opened from now on (pipelined: no cap on
    /// throughput); 0 is none.
    latency_ns: AtomicU64,
    /// Bytes per second per connection and direction; 0 is unlimited.
    rate: AtomicU64,
    refuse: AtomicBool,
    /// `true` while blackholed; pumps wait on it instead of polling.
    blackhole: watch::Sender<bool>,
    /// Bumped by every `cut()`; connections alive at that moment see the
    /// change and close.
    cut_gen: watch::Sender<u64>,
    live: Mutex<BTreeSet<u64>>,
    next_id: AtomicU64,
    up: AtomicU64,
    down: AtomicU64,
}

impl Shared {
    fn live(&self) -> MutexGuard<'_, BTreeSet<u64>> {
        // A panicking task must not turn every later control call into a
        // panic too; the set stays consistent regardless.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_ns.load(Ordering::Relaxed))
    }
}

impl ChaosProxy {
    pub fn start(upstream: SocketAddr) -> Result<ChaosProxy> {
        let std_listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .context("binding chaos proxy listener")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("building chaos proxy runtime")?;
        let shared = Arc::new(Shared {
            upstream,
            delay_ns: AtomicU64::new(0),
            latency_ns: AtomicU64::new(0),
            rate: AtomicU64::new(0),
            refuse: AtomicBool::new(false),
            blackhole: watch::Sender::new(false),
            cut_gen: watch::Sender::new(0),
            live: Mutex::new(BTreeSet::new()),
            next_id: AtomicU64::new(0),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
        });
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("chaos-proxy-{}", addr.port()))
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match TcpListener::from_std(std_listener) {
                        Ok(l) => {
                            let _ = ready_tx.send(Ok(()));
                            l
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.into()));
                            return;
                        }
                    };
                    accept_loop(listener, sh, shutdown_rx).await;
                });
                // Drops every connection task, closing their sockets.
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .context("spawning chaos proxy thread")?;
        match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.context("registering chaos proxy listener")),
            Err(_) => anyhow::bail!("chaos proxy thread did not start"),
        }
        Ok(ChaosProxy {
            addr,
            shared,
            shutdown: Some(shutdown_tx),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Latency added to every chunk in each direction. Chunks are delayed
    /// one after another, so this also caps throughput, like a long thin
    /// pipe.
    pub fn set_delay(&self, delay: Duration) {
        let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.shared.delay_ns.store(ns, Ordering::Relaxed);
    }

    /// One-way latency of a long fat pipe: every byte arrives `one_way` after it was sent, with
    /// many chunks in flight at once, so unlike [`set_delay`](Self::set_delay) this does not
    /// cap throughput (a 20 ms round trip is `set_latency(10 ms)`). Combine with
    /// [`set_rate_mbit`](Self::set_rate_mbit) for a wide-area link. Applies to connections
    /// opened after the call.
    pub fn set_latency(&self, one_way: Duration) {
        let ns = u64::try_from(one_way.as_nanos()).unwrap_or(u64::MAX);
        self.shared.latency_ns.store(ns, Ordering::Relaxed);
    }

    /// Caps each direction of each connection at `bytes_per_sec` (`None`: unlimited), as a
    /// thin link would. The kernel buffers in front of the proxy fill up, so a fast sender sees
    /// the same full send buffer it would on a real slow link.
    pub fn set_rate(&self, bytes_per_sec: Option<u64>) {
        self.shared
            .rate
            .store(bytes_per_sec.unwrap_or(0), Ordering::Relaxed);
    }

    /// [`set_rate`](Self::set_rate) in megabits per second.
    pub fn set_rate_mbit(&self, mbit: u64) {
        self.set_rate(Some(mbit * 1_000_000 / 8));
    }

    /// Closes every current connection on both sides (FIN; RST if the
    /// kernel still holds unread data). New connections are unaffected.
    /// Returns once the cut connections are gone (bounded wait).
    pub fn cut(&self) {
        let hi = self.shared.next_id.load(Ordering::SeqCst);
        self.shared.cut_gen.send_modify(|g| *g += 1);
        let deadline = Instant::now() + CUT_SETTLE_TIMEOUT;
        while Instant::now() < deadline {
            if self.shared.live().range(..hi).next().is_none() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Silence without closing: bytes stop flowing both ways on existing
    /// and new connections, nobody sees a FIN. Data is held back, not
    /// dropped, so turning it off again behaves like a healed partition
    /// (TCP would retransmit) rather than corrupting the SSH stream.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.send_replace(on);
    }

    /// While on, new connections are accepted and closed at once, as when
    /// the server host is up but sshd is not answering.
    pub fn refuse(&self, on: bool) {
        self.shared.refuse.store(on, Ordering::SeqCst);
    }

    /// Connections currently open through the proxy.
    pub fn connections(&self) -> usize {
        self.shared.live().len()
    }

    /// Bytes relayed so far: (client → upstream, upstream → client).
    pub fn bytes_forwarded(&self) -> (u64, u64) {
        (
            self.shared.up.load(Ordering::Relaxed),
            self.shared.down.load(Ordering::Relaxed),
        )
    }

    /// Turns every fault off (does not reopen cut connections).
    pub fn reset(&self) {
        self.set_delay(Duration::ZERO);
        self.set_rate(None);
        self.refuse(false);
        self.blackhole(false);
    }
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // Release held data so no task is parked forever; the runtime
        // shutdown below drops them anyway.
        self.shared.blackhole.send_replace(false);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for ChaosProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChaosProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("connections", &self.connections())
            .finish_non_exhaustive()
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: oneshot::Receiver<()>,
) {
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return,
            r = listener.accept() => r,
        };
        let client = match accepted {
            Ok((s, _)) => s,
            Err(_) => {
                // EMFILE and friends: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if shared.refuse.load(Ordering::SeqCst) || shared.live().len() >= MAX_CONNECTIONS {
            drop(client);
            continue;
        }
        // Subscribe before taking an id: `cut()` reads the id counter before
        // bumping the generation, so every id it waits for is guaranteed to
        // observe that bump.
        let cut_rx = shared.cut_gen.subscribe();
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        shared.live().insert(id);
        let guard = Arc::new(ConnGuard {
            shared: shared.clone(),
            id,
        });
        tokio::spawn(relay(client, guard, cut_rx));
    }
}

/// Removes the connection from the live set once both directions are done.
struct ConnGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.live().remove(&self.id);
    }
}

async fn relay(client: TcpStream, guard: Arc<ConnGuard>, mut cut_rx: watch::Receiver<u64>) {
    let shared = guard.shared.clone();
    let upstream = tokio::select! {
        _ = cut_rx.changed() => return,
        r = tokio::time::timeout(UPSTREAM_CONNECT_TIMEOUT, TcpStream::connect(shared.upstream)) => r,
    };
    let Ok(Ok(upstream)) = upstream else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_rd, client_wr) = client.into_split();
    let (up_rd, up_wr) = upstream.into_split();

    let down_guard = guard.clone();
    let down_cut = cut_rx.clone();
    let down_bh = shared.blackhole.subscribe();
    let latency = Duration::from_nanos(shared.latency_ns.load(Ordering::Relaxed));
    tokio::spawn(async move {
        let shared = down_guard.shared.clone();
        if latency.is_zero() {
            pump(up_rd, client_wr, down_cut, down_bh, &shared, &shared.down).await;
        } else {
            let p = (up_rd, client_wr, down_cut, down_bh);
            pump_latency(p, &shared, &shared.down, latency).await;
        }
        drop(down_guard);
    });
    let up_bh = shared.blackhole.subscribe();
    if latency.is_zero() {
        pump(client_rd, up_wr, cut_rx, up_bh, &shared, &shared.up).await;
    } else {
        let p = (client_rd, up_wr, cut_rx, up_bh);
        pump_latency(p, &shared, &shared.up, latency).await;
    }
    drop(guard);
}

/// Copies one direction until EOF, error or cut. Returning drops the write
/// half, which sends FIN; when both pumps of a connection have returned the
/// sockets are closed.
async fn pump(
    mut rd: OwnedReadHalf,
    mut wr: OwnedWriteHalf,
    mut cut: watch::Receiver<u64>,
    mut blackhole: watch::Receiver<bool>,
    shared: &Shared,
    counter: &AtomicU64,
) {
    let mut buf = vec![0u8; CHUNK];
    // When the rate-limited pipe is next free: a token bucket without burst.
    let mut next_free = tokio::time::Instant::now();
    loop {
        // While blackholed, do not even read: the bytes stay in the kernel
        // buffers and the sender eventually sees a zero window, as on a
        // dead link.
        if !wait_open(&mut blackhole, &mut cut).await {
            return;
        }
        let n = tokio::select! {
            _ = cut.changed() => return,
            r = rd.read(&mut buf) => match r {
                Ok(n) => n,
                Err(_) => return,
            },
        };
        if n == 0 {
            let _ = wr.shutdown().await;
            return;
        }
        let delay = shared.delay();
        if !delay.is_zero() {
            tokio::select! {
                _ = cut.changed() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
        // A chunk read just before the blackhole went up is held, not sent.
        if !wait_open(&mut blackhole, &mut cut).await {
            return;
        }
        tokio::select! {
            _ = cut.changed() => return,
            r = wr.write_all(&buf[..n]) => if r.is_err() { return },
        }
        counter.fetch_add(n as u64, Ordering::Relaxed);
        let rate = shared.rate.load(Ordering::Relaxed);
        if let Some(ns) = (n as u64 * 1_000_000_000).checked_div(rate) {
            let now = tokio::time::Instant::now();
            next_free = next_free.max(now) + Duration::from_nanos(ns);
            tokio::select! {
                _ = cut.changed() => return,
                _ = tokio::time::sleep_until(next_free) => {}
            }
        } else {
            next_free = tokio::time::Instant::now();
        }
    }
}

/// [`pump`] for a link with propagation delay: a reader paces chunks at the rate cap and queues
/// each with the time it is due, a writer sends it then, so up to [`LATENCY_QUEUE`] chunks are
/// in flight at once (a real link's bandwidth-delay product), not one per delay.
async fn pump_latency(
    (mut rd, mut wr, cut, blackhole): (
        OwnedReadHalf,
        OwnedWriteHalf,
        watch::Receiver<u64>,
        watch::Receiver<bool>,
    ),
    shared: &Shared,
    counter: &AtomicU64,
    latency: Duration,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(Vec<u8>, tokio::time::Instant)>(LATENCY_QUEUE);
    let (mut cut_r, mut cut_w) = (cut.clone(), cut);
    let (mut bh_r, mut bh_w) = (blackhole.clone(), blackhole);
    let reader = async move {
        let mut next_free = tokio::time::Instant::now();
        loop {
            if !wait_open(&mut bh_r, &mut cut_r).await {
                return;
            }
            let mut buf = vec![0u8; CHUNK];
            let n = tokio::select! {
                _ = cut_r.changed() => return,
                r = rd.read(&mut buf) => match r {
                    Ok(n) => n,
                    Err(_) => return,
                },
            };
            if n == 0 {
                // Dropping `tx` lets the writer drain the queue and send FIN.
                return;
            }
            buf.truncate(n);
            let rate = shared.rate.load(Ordering::Relaxed);
            if let Some(ns) = (n as u64 * 1_000_000_000).checked_div(rate) {
                // Timers fire up to a millisecond late: the pipe keeps that much credit (a
                // burst of at most LATENCY_BURST), or the cap would read far below its rate.
                let now = tokio::time::Instant::now();
                let floor = now.checked_sub(LATENCY_BURST).unwrap_or(now);
                next_free = next_free.max(floor) + Duration::from_nanos(ns);
                tokio::select! {
                    _ = cut_r.changed() => return,
                    _ = tokio::time::sleep_until(next_free) => {}
                }
            }
            let due = tokio::time::Instant::now() + latency;
            if tx.send((buf, due)).await.is_err() {
                return;
            }
        }
    };
    let writer = async move {
        while let Some((buf, due)) = rx.recv().await {
            tokio::select! {
                _ = cut_w.changed() => return,
                _ = tokio::time::sleep_until(due) => {}
            }
            if !wait_open(&mut bh_w, &mut cut_w).await {
                return;
            }
            tokio::select! {
                _ = cut_w.changed() => return,
                r = wr.write_all(&buf) => if r.is_err() { return },
            }
            counter.fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
        let _ = wr.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// Waits until the blackhole is off; `false` means the connection was cut
/// (or the proxy is going away) meanwhile.
async fn wait_open(blackhole: &mut watch::Receiver<bool>, cut: &mut watch::Receiver<u64>) -> bool {
    if !*blackhole.borrow_and_update() {
        return true;
    }
    tokio::select! {
        _ = cut.changed() => false,
        r = blackhole.wait_for(|on| !*on) => r.is_ok(),
    }
}
