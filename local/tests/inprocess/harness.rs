//! In-process agents, a frame-recording tap, and bounded waiting.

use std::{
    path::Path,
    sync::Arc,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;
use rsb::client::AgentClient;
use rsb_protocol::{FromAgent, ToAgent, decode, frame_codec};
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream};
use tokio_util::codec::{FramedRead, FramedWrite};

const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// In-memory pipe capacity per direction; frames larger than this just take several writes.
const PIPE: usize = 256 * 1024;

/// One agent channel served on a thread of its own. Its exit status is the thread's result.
pub struct Agent {
    pub client: AgentClient,
    pub tap: Option<Tap>,
    thread: Option<JoinHandle<i32>>,
}

impl Agent {
    /// An agent connected directly to its client.
    pub async fn start(name: &str) -> Agent {
        let (ours, theirs) = tokio::io::duplex(PIPE);
        let thread = serve(theirs);
        let (r, w) = tokio::io::split(ours);
        Agent {
            client: client(name, r, w).await,
            tap: None,
            thread: Some(thread),
        }
    }

    /// An agent whose frames pass through a [`Tap`].
    pub async fn tapped(name: &str) -> Agent {
        let (client_end, tap_client) = tokio::io::duplex(PIPE);
        let (tap_agent, agent_end) = tokio::io::duplex(PIPE);
        let thread = serve(agent_end);
        let tap = Tap::new(tap_client, tap_agent);
        let (r, w) = tokio::io::split(client_end);
        Agent {
            client: client(name, r, w).await,
            tap: Some(tap),
            thread: Some(thread),
        }
    }

    pub fn tap(&self) -> &Tap {
        self.tap.as_ref().expect("a tapped agent")
    }

    /// The agent's exit status once its channel has ended, waiting at most `limit`.
    pub async fn exit_status(&mut self, limit: Duration) -> i32 {
        let thread = self.thread.take().expect("waited for once");
        eventually("the agent to stop serving", limit, || {
            thread.is_finished().then_some(())
        })
        .await;
        thread.join().expect("the agent thread panicked")
    }
}

fn serve(io: DuplexStream) -> JoinHandle<i32> {
    std::thread::Builder::new()
        .name("rsb-agent".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("agent runtime");
            let local = tokio::task::LocalSet::new();
            let (r, w) = tokio::io::split(io);
            let hello = rsb_agent::hello::hello();
            let code = local.block_on(&rt, rsb_agent::serve::run(r, w, hello));
            rt.shutdown_timeout(Duration::from_millis(500));
            code
        })
        .expect("spawn the agent thread")
}

async fn client<R, W>(name: &str, r: R, w: W) -> AgentClient
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    AgentClient::start(name, r, w, Box::new(()), HELLO_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("handshake with the in-process agent: {e}"))
}

/// Relays frames both ways, keeping a decoded copy of each, until cut.
pub struct Tap {
    to_agent: Arc<Mutex<Vec<ToAgent>>>,
    from_agent: Arc<Mutex<Vec<FromAgent>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Tap {
    fn new(client_side: DuplexStream, agent_side: DuplexStream) -> Tap {
        let to_agent = Arc::default();
        let from_agent = Arc::default();
        let (cr, cw) = tokio::io::split(client_side);
        let (ar, aw) = tokio::io::split(agent_side);
        let tasks = vec![
            tokio::spawn(pump(cr, aw, Arc::clone(&to_agent))),
            tokio::spawn(pump(ar, cw, Arc::clone(&from_agent))),
        ];
        Tap {
            to_agent,
            from_agent,
            tasks,
        }
    }

    pub fn sent(&self) -> Vec<ToAgent> {
        self.to_agent.lock().clone()
    }

    pub fn received(&self) -> Vec<FromAgent> {
        self.from_agent.lock().clone()
    }

    /// Cut the link: both ends' streams close, as when an SSH connection dies.
    pub fn cut(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn pump<R, W, T>(r: R, w: W, log: Arc<Mutex<Vec<T>>>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    T: DeserializeOwned,
{
    let mut frames = FramedRead::new(r, frame_codec());
    let mut sink = FramedWrite::new(w, frame_codec());
    while let Some(Ok(buf)) = frames.next().await {
        let msg = decode::<T>(&buf).expect("the tap saw an undecodable frame");
        log.lock().push(msg);
        if sink.send(buf.freeze()).await.is_err() {
            break;
        }
    }
    // Pass the end of the stream on.
    let _ = SinkExt::<bytes::Bytes>::close(&mut sink).await;
}

/// Poll `f` every 10 ms until it returns `Some`, failing the test after `limit`.
pub async fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Live (non-zombie) processes in process group `pgid`, from `/proc`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut live = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp …`; comm may contain spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 2 && f[0] != "Z" && f[2].parse() == Ok(pgid) {
            live.push(pid);
        }
    }
    live
}

/// The pid a command wrote into `file` (`echo $$ > "$PIDFILE"`), once it is there.
pub fn read_pid(file: &Path) -> Option<i32> {
    let s = std::fs::read_to_string(file).ok()?;
    if !s.ends_with('\n') {
        return None;
    }
    s.trim().parse().ok()
}
