//! SSH transport (russh): connect, verify the host key, authenticate, run one-shot commands
//! for the deploy step, and turn an exec channel into an agent channel.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use parking_lot::Mutex;
use rsb_deploy::RemoteOutput;
use russh::{
    ChannelMsg, client,
    keys::{self, PrivateKeyWithHashAlg, PublicKeyOrCertificate, known_hosts},
};
use tokio::io::AsyncWriteExt;

use crate::{
    client::{AgentClient, StartError},
    config::{AgentSocket, Auth, Hop, HostKeyPolicy, SshTarget},
    error::{Kind, Result, RsbError},
};

/// How often an idle connection is probed, and how many unanswered probes mean "dead".
/// Together they bound how long a black-holed link goes unnoticed (about 9–12 s).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
/// What the server may send on a channel before this side says it took it. russh's default
/// (2 MiB, OpenSSH's too) caps a download at 2 MiB per round trip: 20 MB/s at 100 ms.
const CHANNEL_WINDOW: u32 = 8 << 20;
const KEEPALIVE_MAX: usize = 3;
/// The session dies after this long without any packet moving either way. russh awaits the
/// socket flush under this timer only, so without it a black-holed link with a full send
/// buffer (a rate-limited upload) froze every call for as long as the fault lasted.
pub const LIVENESS_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
enum HandlerError {
    #[error(transparent)]
    Ssh(#[from] russh::Error),
    #[error("{0}")]
    HostKey(String),
}

struct Checker {
    host: String,
    port: u16,
    policy: HostKeyPolicy,
    files: Vec<PathBuf>,
    /// Set when the key was rejected, so the connect error can say exactly why.
    verdict: Arc<Mutex<Option<String>>>,
    /// Why the session ended, in words, once it has: the agent channel's error quotes it.
    ended: Arc<Mutex<Option<String>>>,
}

impl client::Handler for Checker {
    type Error = HandlerError;

    async fn disconnected(
        &mut self,
        reason: client::DisconnectReason<Self::Error>,
    ) -> Result<(), Self::Error> {
        let (why, res) =
            match reason {
                client::DisconnectReason::ReceivedDisconnect(info) => (
                    format!(
                        "the server closed the connection ({})",
                        one_line(&info.message)
                    ),
                    Ok(()),
                ),
                client::DisconnectReason::Error(e) => {
                    let why = match &e {
                    HandlerError::Ssh(russh::Error::InactivityTimeout) => format!(
                        "nothing moved on the link for {}s (the link is dead or black-holed)",
                        LIVENESS_TIMEOUT.as_secs()
                    ),
                    HandlerError::Ssh(russh::Error::KeepaliveTimeout) => {
                        "the server stopped answering keepalives (the link is dead or black-holed)"
                            .to_string()
                    }
                    other => format!("the SSH connection ended ({})", one_line(&other.to_string())),
                };
                    (why, Err(e))
                }
            };
        *self.ended.lock() = Some(why);
        res
    }

    async fn check_server_key(&mut self, k: &PublicKeyOrCertificate) -> Result<bool, Self::Error> {
        let key = match k {
            PublicKeyOrCertificate::PublicKey { key, .. } => key,
            _ => {
                let msg = format!(
                    "host [{}]:{} presented a certificate; rsb verifies plain host keys only",
                    self.host, self.port
                );
                *self.verdict.lock() = Some(msg.clone());
                return Err(HandlerError::HostKey(msg));
            }
        };
        if self.policy == HostKeyPolicy::Off {
            return Ok(true);
        }
        for f in &self.files {
            match known_hosts::check_known_hosts_path(&self.host, self.port, key, f) {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(keys::Error::KeyChanged { line }) => {
                    let msg = format!(
                        "host key for [{}]:{} has CHANGED: it does not match {} line {line} ({} {})",
                        self.host,
                        self.port,
                        f.display(),
                        key.algorithm(),
                        key.fingerprint(Default::default())
                    );
                    *self.verdict.lock() = Some(msg.clone());
                    return Err(HandlerError::HostKey(msg));
                }
                // An unreadable or malformed file must not silently turn into "unknown".
                Err(e) if f.exists() => {
                    let msg = format!("cannot read known_hosts file {}: {e}", f.display());
                    *self.verdict.lock() = Some(msg.clone());
                    return Err(HandlerError::HostKey(msg));
                }
                Err(_) => {}
            }
        }
        let fp = key.fingerprint(Default::default());
        match self.policy {
            HostKeyPolicy::Strict => {
                let msg = format!(
                    "host key for [{}]:{} is unknown ({} {fp}) and host_key_policy is strict",
                    self.host,
                    self.port,
                    key.algorithm()
                );
                *self.verdict.lock() = Some(msg.clone());
                Err(HandlerError::HostKey(msg))
            }
            _ => {
                let own =
                    self.files.last().cloned().unwrap_or_else(|| {
                        crate::config::state_dir().join(crate::config::KNOWN_HOSTS)
                    });
                private_file(&own);
                if let Err(e) =
                    known_hosts::learn_known_hosts_path(&self.host, self.port, key, &own)
                {
                    tracing::warn!("could not record host key in {}: {e}", own.display());
                } else {
                    tracing::info!(host = %self.host, port = self.port, %fp, file = %own.display(), "recorded new host key");
                }
                Ok(true)
            }
        }
    }
}

/// Create `path` 0600 before russh appends to it (russh creates it with the umask, 0644
/// commonly): which hosts a user reaches is theirs, and every file rsb keeps is 0600. A file
/// that exists keeps its mode (it may be the user's own `UserKnownHostsFile`), except rsb's
/// own in the state dir, which an older rsb created 0644.
fn private_file(path: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path);
        if path.parent() == Some(crate::config::state_dir().as_path()) {
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// AES-GCM is hardware-accelerated on current x86_64 and aarch64 CPUs and moved bulk sync data
/// 25–30 % faster than russh's default ChaCha20 in our measurements; without AES instructions
/// ChaCha20 stays first.
fn preferred_algorithms() -> russh::Preferred {
    use russh::cipher;
    const AES_FIRST: &[cipher::Name] = &[
        cipher::AES_256_GCM,
        cipher::CHACHA20_POLY1305,
        cipher::AES_256_CTR,
        cipher::AES_192_CTR,
        cipher::AES_128_CTR,
    ];
    #[cfg(target_arch = "x86_64")]
    let aes = std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("pclmulqdq");
    #[cfg(target_arch = "aarch64")]
    let aes = std::arch::is_aarch64_feature_detected!("aes");
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let aes = false;
    let mut p = russh::Preferred::default();
    if aes {
        p.cipher = std::borrow::Cow::Borrowed(AES_FIRST);
    }
    p
}

/// Why a forwarding channel did not open. The two cases call for different reactions: a
/// refusal comes from a live server (nothing listens there, or forwarding is disabled), so
/// retrying on a new connection would not help; anything else means the link is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelOpenError {
    Refused(String),
    Link(String),
}

impl From<russh::Error> for ChannelOpenError {
    fn from(e: russh::Error) -> Self {
        use russh::ChannelOpenFailure as F;
        match e {
            russh::Error::ChannelOpenFailure(f) => ChannelOpenError::Refused(match f {
                F::ConnectFailed => "the sandbox could not connect to it (is anything listening?)".into(),
                F::AdministrativelyProhibited => {
                    "the SSH server does not allow forwarding (AllowTcpForwarding / AllowStreamLocalForwarding)".into()
                }
                F::UnknownChannelType => "the SSH server does not support this kind of forwarding".into(),
                F::ResourceShortage => "the SSH server is out of resources".into(),
                F::Other { code, reason } => format!("refused by the SSH server ({code}): {}", one_line(&reason)),
            }),
            other => ChannelOpenError::Link(one_line(&other.to_string())),
        }
    }
}

/// One authenticated SSH connection.
pub struct SshSession {
    handle: client::Handle<Checker>,
    /// Session channels open on this connection (agents, workers' bridges, deploy steps):
    /// sshd refuses more than its `MaxSessions`, so they are counted here, never found out.
    channels: Arc<tokio::sync::Semaphore>,
    /// Why the session ended (see [`Checker::ended`]).
    ended: Arc<Mutex<Option<String>>>,
    /// Sessions to the ProxyJump hops, innermost last; they carry `handle`'s transport.
    _jumps: Vec<client::Handle<Checker>>,
    pub target_desc: String,
}

/// Session channels one connection may hold: OpenSSH's default `MaxSessions`, which servers
/// rarely raise and a client cannot ask for.
pub const SESSION_CHANNELS: usize = 10;

/// How long a short step (deploy, sftp) or an agent waits for a channel of a busy connection.
const CHANNEL_WAIT: Duration = Duration::from_secs(10);

/// How long a worker's bridge waits for a channel. The worker waits 3 s for its agent's Hello
/// before connecting by itself; a bridge refused sooner lets it do so at once.
const BRIDGE_WAIT: Duration = Duration::from_secs(2);

/// What a worker's bridge holds of the agent's output while the worker is slow to read it. The
/// channel is read at once whatever the worker does, so a worker that stops reading never stalls
/// the connection its server shares with it; past this much the bridge is closed.
const BRIDGE_BUFFER: usize = 32 << 20;

/// A worker that has not taken anything from its bridge for this long (stopped, frozen) is cut
/// off: its agent's channel closes and the worker, seeing its connection end, goes on over a
/// connection of its own.
const BRIDGE_STALL: Duration = Duration::from_secs(10);

/// One session channel of a connection, held for as long as the channel is open.
pub type ChannelSlot = tokio::sync::OwnedSemaphorePermit;

impl SshSession {
    /// Connect to `t`, through its ProxyJump hops when it has any: each hop is an SSH session
    /// whose `direct-tcpip` channel carries the next one. Every hop authenticates with its own
    /// user and credentials and checks its host key under its own policy and known_hosts.
    pub async fn connect(sandbox: &str, t: &SshTarget) -> Result<Arc<SshSession>> {
        Self::connect_with(sandbox, t, Some(LIVENESS_TIMEOUT)).await
    }

    /// [`connect`](Self::connect) for a port forward's own connection. russh waits on a
    /// channel's full buffer inside its session loop, so a forwarded client that pauses
    /// reading holds that loop, and its inactivity timer, which can then fire the moment the
    /// client reads again, would end a healthy link. Without it, keepalives (9–12 s) and the
    /// socket's own deadline ([`DeadLink`]) still notice a dead one.
    pub async fn connect_for_forward(sandbox: &str, t: &SshTarget) -> Result<Arc<SshSession>> {
        Self::connect_with(sandbox, t, None).await
    }

    async fn connect_with(
        sandbox: &str,
        t: &SshTarget,
        inactivity: Option<Duration>,
    ) -> Result<Arc<SshSession>> {
        let mut jumps: Vec<client::Handle<Checker>> = Vec::new();
        for hop in &t.proxy_jump {
            let h = open_session(
                sandbox,
                hop,
                t.connect_timeout,
                jumps.last(),
                "jump host ",
                Arc::default(),
                inactivity,
            )
            .await?;
            jumps.push(h);
        }
        let ended = Arc::new(Mutex::new(None));
        let handle = open_session(
            sandbox,
            &t.as_hop(),
            t.connect_timeout,
            jumps.last(),
            "",
            ended.clone(),
            inactivity,
        )
        .await?;
        Ok(Arc::new(SshSession {
            handle,
            channels: Arc::new(tokio::sync::Semaphore::new(SESSION_CHANNELS)),
            ended,
            _jumps: jumps,
            target_desc: t.address(),
        }))
    }

    pub fn is_closed(&self) -> bool {
        self.handle.is_closed()
    }

    /// A channel to `host:port` as the sandbox host sees it (what `ssh -L` opens). It rides
    /// this session, so it goes through the ProxyJump chain the session was built on.
    pub async fn open_direct_tcpip(
        &self,
        host: &str,
        port: u16,
        originator: std::net::SocketAddr,
    ) -> std::result::Result<russh::Channel<client::Msg>, ChannelOpenError> {
        self.handle
            .channel_open_direct_tcpip(
                host,
                u32::from(port),
                originator.ip().to_string(),
                u32::from(originator.port()),
            )
            .await
            .map_err(ChannelOpenError::from)
    }

    /// A channel to a Unix socket on the sandbox host (`direct-streamlocal@openssh.com`).
    pub async fn open_direct_streamlocal(
        &self,
        path: &str,
    ) -> std::result::Result<russh::Channel<client::Msg>, ChannelOpenError> {
        self.handle
            .channel_open_direct_streamlocal(path)
            .await
            .map_err(ChannelOpenError::from)
    }

    /// Session channels this connection has free.
    pub fn free_channels(&self) -> usize {
        self.channels.available_permits()
    }

    /// A slot for one more session channel, waiting up to `wait` for one, with `spare` more left
    /// free for others (a bridge leaves one for a deploy or a reconnecting agent).
    async fn channel_slot(
        &self,
        wait: Duration,
        spare: u32,
    ) -> std::result::Result<ChannelSlot, String> {
        let all = self.channels.clone();
        match tokio::time::timeout(wait, all.acquire_many_owned(1 + spare)).await {
            Ok(Ok(mut slot)) => {
                drop(slot.split(spare as usize));
                Ok(slot)
            }
            _ => Err(format!(
                "all {SESSION_CHANNELS} session channels of the server's connection are in use \
                 (sshd's MaxSessions) after waiting {}s",
                wait.as_secs()
            )),
        }
    }

    /// A fresh channel running `command`, split into its halves, with its slot.
    async fn exec_channel(
        &self,
        command: &str,
        slot: ChannelSlot,
    ) -> std::result::Result<
        (
            russh::ChannelReadHalf,
            russh::ChannelWriteHalf<client::Msg>,
            ChannelSlot,
        ),
        String,
    > {
        let ch = self
            .handle
            .channel_open_session()
            .await
            .map_err(|e| format!("cannot open channel: {e}"))?;
        ch.exec(true, command)
            .await
            .map_err(|e| format!("exec failed: {e}"))?;
        let (rd, wr) = ch.split();
        Ok((rd, wr, slot))
    }

    /// Run one command to completion, optionally feeding `stdin`. Used by deploy only.
    pub async fn exec_collect(
        &self,
        command: &str,
        stdin: Option<&[u8]>,
    ) -> std::result::Result<RemoteOutput, String> {
        let slot = self.channel_slot(CHANNEL_WAIT, 0).await?;
        let (mut rd, wr, _slot) = self.exec_channel(command, slot).await?;
        let feeder = stdin.map(|data| {
            let data = data.to_vec();
            let mut w = wr.make_writer();
            async move {
                let r = w.write_all(&data).await;
                let _ = w.shutdown().await;
                r
            }
        });
        let writer = async {
            if let Some(f) = feeder {
                f.await.map_err(|e| format!("stdin write failed: {e}"))?;
            }
            wr.eof().await.map_err(|e| format!("eof failed: {e}"))
        };
        let reader = async {
            let mut out = RemoteOutput::default();
            while let Some(msg) = rd.wait().await {
                match msg {
                    ChannelMsg::Data { data } => out.stdout.extend_from_slice(&data),
                    ChannelMsg::ExtendedData { data, .. } => out.stderr.extend_from_slice(&data),
                    ChannelMsg::ExitStatus { exit_status } => out.exit_code = Some(exit_status),
                    _ => {}
                }
            }
            out
        };
        let (w, out) = tokio::join!(writer, reader);
        if let Err(e) = w
            && out.exit_code.is_none()
        {
            return Err(e);
        }
        Ok(out)
    }

    /// Open an SFTP session (with its channel's slot), or `None` when the server has no sftp
    /// subsystem.
    async fn sftp(
        &self,
    ) -> std::result::Result<Option<(russh_sftp::client::SftpSession, ChannelSlot)>, String> {
        let slot = self.channel_slot(CHANNEL_WAIT, 0).await?;
        let ch = self
            .handle
            .channel_open_session()
            .await
            .map_err(|e| format!("cannot open channel: {e}"))?;
        if ch.request_subsystem(true, "sftp").await.is_err() {
            return Ok(None);
        }
        match tokio::time::timeout(
            Duration::from_secs(10),
            russh_sftp::client::SftpSession::new(ch.into_stream()),
        )
        .await
        {
            Ok(Ok(s)) => Ok(Some((s, slot))),
            // A refused subsystem shows up as a failed init on some servers.
            Ok(Err(_)) | Err(_) => Ok(None),
        }
    }

    /// Start `agent_path serve` on a fresh exec channel and complete the handshake.
    pub async fn start_agent(
        self: &Arc<Self>,
        sandbox: &str,
        agent_path: &str,
    ) -> std::result::Result<AgentClient, StartError> {
        self.start_agent_with(sandbox, rsb_deploy::start_command(agent_path))
            .await
    }

    /// [`SshSession::start_agent`] with the start command given (one of `rsb_deploy`'s).
    pub async fn start_agent_with(
        self: &Arc<Self>,
        sandbox: &str,
        command: String,
    ) -> std::result::Result<AgentClient, StartError> {
        let slot = self
            .channel_slot(CHANNEL_WAIT, 0)
            .await
            .map_err(StartError::NoHello)?;
        self.start_agent_on(sandbox, command, slot).await
    }

    /// Starts more agents like the one `command` started, each on a channel of its own, for
    /// [`AgentClient::sibling`]: never waiting for a channel, and leaving one free for whoever
    /// needs it next (an exec, a deploy).
    pub(crate) fn siblings(
        self: &Arc<Self>,
        sandbox: &str,
        command: String,
    ) -> crate::client::Siblings {
        let (session, sandbox) = (Arc::downgrade(self), sandbox.to_string());
        Arc::new(move || {
            let (session, sandbox, command) = (session.clone(), sandbox.clone(), command.clone());
            Box::pin(async move {
                let s = session.upgrade()?;
                let slot = s.channel_slot(Duration::ZERO, 1).await.ok()?;
                Some(
                    s.start_agent_on(&sandbox, command, slot)
                        .await
                        .map_err(|e| e.to_string()),
                )
            })
        })
    }

    /// [`SshSession::start_agent_with`] on the channel `slot` holds.
    async fn start_agent_on(
        self: &Arc<Self>,
        sandbox: &str,
        command: String,
        slot: ChannelSlot,
    ) -> std::result::Result<AgentClient, StartError> {
        let ch = self
            .handle
            .channel_open_session()
            .await
            .map_err(|e| StartError::NoHello(format!("cannot open channel: {e}")))?;
        ch.exec(true, command.clone())
            .await
            .map_err(|e| StartError::NoHello(format!("exec failed: {e}")))?;
        let (mut rd, wr) = ch.split();
        let (mut pipe_in, pipe_out) = tokio::io::duplex(1 << 20);
        let stderr_tail = Arc::new(Mutex::new(Vec::<u8>::new()));
        let tail = stderr_tail.clone();
        let name = sandbox.to_string();
        let heard = crate::client::Heard::default();
        let touch = heard.clone();
        let session = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(msg) = rd.wait().await {
                // Window updates count: during an upload they are all that comes back.
                touch.touch();
                match msg {
                    ChannelMsg::Data { data } if pipe_in.write_all(&data).await.is_err() => break,
                    ChannelMsg::Data { .. } => {}
                    ChannelMsg::ExtendedData { data, .. } => {
                        let text = String::from_utf8_lossy(&data);
                        for line in text.lines().filter(|l| !l.trim().is_empty()) {
                            tracing::info!(sandbox = %name, "agent: {line}");
                        }
                        let mut t = tail.lock();
                        t.extend_from_slice(&data);
                        let excess = t.len().saturating_sub(2048);
                        t.drain(..excess);
                    }
                    ChannelMsg::ExitStatus { exit_status } => {
                        tracing::debug!(sandbox = %name, exit_status, "agent process exited");
                    }
                    _ => {}
                }
            }
            // The whole session went down: say why in the channel's error (the handler records
            // it as the session task ends, at about the same time as the channel).
            if let Some(s) = session.upgrade() {
                for _ in 0..20 {
                    if let Some(why) = s.ended.lock().clone() {
                        touch.set_reason(why);
                        break;
                    }
                    if !s.is_closed() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            drop(pipe_in);
        });
        let writer = wr.make_writer();
        let keep: Box<dyn std::any::Any + Send> = Box::new((self.clone(), wr, slot));
        match AgentClient::start_watched(
            sandbox,
            pipe_out,
            writer,
            keep,
            Duration::from_secs(20),
            heard,
        )
        .await
        {
            Ok(c) => {
                c.allow_siblings(self.siblings(sandbox, command));
                Ok(c)
            }
            Err(StartError::NoHello(m)) => {
                // Give the stderr pump a moment to capture why (e.g. "No such file").
                tokio::time::sleep(Duration::from_millis(50)).await;
                let err = String::from_utf8_lossy(&stderr_tail.lock())
                    .trim()
                    .to_string();
                Err(StartError::NoHello(if err.is_empty() {
                    m
                } else {
                    format!("{m}: {}", one_line(&err))
                }))
            }
            Err(e) => Err(e),
        }
    }
}

impl SshSession {
    /// Start an agent with `command` on a fresh channel of this session and pump its stdio to
    /// `stream` and back until either end closes: how a transfer worker rides the server's
    /// warm connection (no handshake, no probe) while the server lives. Returns once the
    /// channel runs the command; the worker reads the agent's Hello through `stream`.
    pub async fn bridge_agent(
        self: &Arc<Self>,
        sandbox: &str,
        command: String,
        stream: tokio::net::UnixStream,
    ) -> std::result::Result<(), String> {
        use tokio::io::AsyncReadExt;
        let slot = self.channel_slot(BRIDGE_WAIT, 1).await?;
        let (mut rd, wr, slot) = self.exec_channel(&command, slot).await?;
        let (mut from_worker, mut to_worker) = stream.into_split();
        let name = sandbox.to_string();
        let session = self.clone();
        let cut = tokio_util::sync::CancellationToken::new();
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        // The channel's reader never waits for the worker: what it reads is queued (up to
        // BRIDGE_BUFFER) for the task below, so the connection's other channels keep flowing.
        {
            let (cut, queued, name) = (cut.clone(), queued.clone(), name.clone());
            tokio::spawn(async move {
                let _held = (session, slot);
                let mut tx = Some(tx);
                while let Some(msg) = rd.wait().await {
                    match msg {
                        ChannelMsg::Data { data } => {
                            let Some(q) = &tx else { continue };
                            let total = queued
                                .fetch_add(data.len(), std::sync::atomic::Ordering::SeqCst)
                                + data.len();
                            if total > BRIDGE_BUFFER || q.send(data.to_vec()).is_err() {
                                if total > BRIDGE_BUFFER {
                                    tracing::warn!(sandbox = %name, "a transfer worker fell {total} bytes behind its agent; closing its bridge");
                                }
                                // Whatever comes until the channel closes is read and dropped.
                                tx = None;
                                cut.cancel();
                            }
                        }
                        ChannelMsg::ExtendedData { data, .. } => {
                            let text = String::from_utf8_lossy(&data);
                            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                                tracing::info!(sandbox = %name, "worker's agent: {line}");
                            }
                        }
                        _ => {}
                    }
                }
            });
        }
        {
            let (cut, name) = (cut.clone(), name.clone());
            tokio::spawn(async move {
                while let Some(data) = tokio::select! {
                    d = rx.recv() => d,
                    () = cut.cancelled() => None,
                } {
                    match tokio::time::timeout(BRIDGE_STALL, to_worker.write_all(&data)).await {
                        Ok(Ok(())) => {
                            queued.fetch_sub(data.len(), std::sync::atomic::Ordering::SeqCst);
                        }
                        Ok(Err(_)) => break,
                        Err(_) => {
                            tracing::warn!(sandbox = %name, "a transfer worker took nothing from its bridge for {} s; closing it", BRIDGE_STALL.as_secs());
                            break;
                        }
                    }
                }
                // The worker reads the end of its connection (and goes on by itself, or is gone).
                cut.cancel();
                drop(to_worker);
            });
        }
        tokio::spawn(async move {
            let mut w = wr.make_writer();
            let mut buf = vec![0u8; 256 << 10];
            loop {
                let n = tokio::select! {
                    r = from_worker.read(&mut buf) => match r {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    },
                    () = cut.cancelled() => break,
                };
                if w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            // The worker is gone (done, cancelled, killed) or cut off: the agent reads end of
            // input and exits.
            cut.cancel();
            let _ = w.shutdown().await;
            let _ = wr.eof().await;
            let _ = wr.close().await;
        });
        Ok(())
    }
}

impl rsb_deploy::Remote for SshSession {
    async fn exec(
        &self,
        command: &str,
        stdin: Option<&[u8]>,
    ) -> std::result::Result<RemoteOutput, String> {
        self.exec_collect(command, stdin).await
    }

    async fn sftp_write(&self, path: &str, data: &[u8]) -> std::result::Result<Option<()>, String> {
        let Some((sftp, _slot)) = self.sftp().await? else {
            return Ok(None);
        };
        let mut f = sftp
            .create(path)
            .await
            .map_err(|e| format!("sftp create {path}: {e}"))?;
        f.write_all(data)
            .await
            .map_err(|e| format!("sftp write {path}: {e}"))?;
        f.shutdown()
            .await
            .map_err(|e| format!("sftp close {path}: {e}"))?;
        let _ = sftp.close().await;
        Ok(Some(()))
    }

    async fn sftp_read(&self, path: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        let Some((sftp, _slot)) = self.sftp().await? else {
            return Ok(None);
        };
        let data = sftp
            .read(path)
            .await
            .map_err(|e| format!("sftp read {path}: {e}"))?;
        let _ = sftp.close().await;
        Ok(Some(data))
    }
}

/// TCP (or a `direct-tcpip` channel through `via`), key exchange with host-key check, and
/// authentication, each bounded by the target's connect timeout.
async fn open_session(
    sandbox: &str,
    hop: &Hop,
    timeout: Duration,
    via: Option<&client::Handle<Checker>>,
    what: &str,
    ended: Arc<Mutex<Option<String>>>,
    inactivity: Option<Duration>,
) -> Result<client::Handle<Checker>> {
    let desc = format!("{what}{}", hop.address());
    let (host, port) = (hop.host.as_str(), hop.port);
    let cfg = Arc::new(client::Config {
        nodelay: true,
        preferred: preferred_algorithms(),
        keepalive_interval: Some(KEEPALIVE_INTERVAL),
        keepalive_max: KEEPALIVE_MAX,
        inactivity_timeout: inactivity,
        window_size: CHANNEL_WINDOW,
        ..Default::default()
    });
    let verdict = Arc::new(Mutex::new(None));
    let checker = Checker {
        host: host.to_string(),
        port,
        policy: hop.host_key_policy,
        files: hop.known_hosts.clone(),
        verdict: verdict.clone(),
        ended,
    };
    let connect = async {
        match via {
            None => {
                let tcp = tcp_connect(host, port).await?;
                client::connect_stream(cfg, tcp, checker).await
            }
            Some(j) => {
                let ch = j
                    .channel_open_direct_tcpip(host, port as u32, "127.0.0.1", 0)
                    .await
                    .map_err(HandlerError::Ssh)?;
                client::connect_stream(cfg, ch.into_stream(), checker).await
            }
        }
    };
    let mut handle = match tokio::time::timeout(timeout, connect).await {
        Err(_) => {
            return Err(RsbError::new(
                Kind::Connect,
                format!(
                    "SSH connect to sandbox '{sandbox}' ({desc}) timed out after {}s (connect_timeout_s)",
                    timeout.as_secs()
                ),
                "check that the host is up and reachable, and that sshd listens on that port (a port that accepts TCP but never speaks SSH looks like this); a slow host needs a larger connect_timeout_s in its sandbox entry",
            ));
        }
        Ok(Err(e)) => {
            if let Some(v) = verdict.lock().take() {
                return Err(RsbError::new(
                    Kind::HostKey,
                    format!("refusing sandbox '{sandbox}': {v}"),
                    "if the host was legitimately reinstalled, delete that known_hosts line and retry; otherwise the connection may be intercepted",
                ));
            }
            return Err(RsbError::new(
                Kind::Connect,
                format!(
                    "SSH connect to sandbox '{sandbox}' ({desc}) failed: {}",
                    one_line(&e.to_string())
                ),
                "check the host and port, and that sshd runs there",
            ));
        }
        Ok(Ok(h)) => h,
    };
    match tokio::time::timeout(timeout, authenticate(&mut handle, &hop.user, &hop.auth)).await {
        Err(_) => Err(RsbError::new(
            Kind::Auth,
            format!("SSH authentication for sandbox '{sandbox}' ({desc}) timed out"),
            "check the credentials and the server's auth settings",
        )),
        Ok(Err(e)) => Err(e.with_context(sandbox, &desc)),
        Ok(Ok(())) => Ok(handle),
    }
}

/// How the kernel itself gives up on a dead or black-holed link, chosen per OS. The protocol
/// heartbeat (russh keepalives every [`KEEPALIVE_INTERVAL`], [`LIVENESS_TIMEOUT`] without
/// traffic) is the other half on every OS; the socket options make the socket fail too, so a
/// write stuck in the kernel returns instead of waiting for TCP's own ~15 min retransmit limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeadLink {
    /// Linux `TCP_USER_TIMEOUT`: sent data unacknowledged this long fails the socket.
    pub user_timeout: Option<Duration>,
    /// macOS `TCP_RXT_CONNDROPTIME`: retransmitting this long drops the connection (Darwin's
    /// counterpart of `TCP_USER_TIMEOUT`, which it lacks).
    pub rxt_conndrop: Option<Duration>,
    /// `SO_KEEPALIVE` with the idle time (`TCP_KEEPIDLE`, macOS `TCP_KEEPALIVE`),
    /// `TCP_KEEPINTVL` and `TCP_KEEPCNT`: probes while nothing is in flight.
    pub keepalive: Option<Keepalive>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Keepalive {
    pub idle: Duration,
    pub interval: Duration,
    pub count: u32,
}

/// The settings for `os` (`std::env::consts::OS`); a function of the name, so every OS's
/// choice is tested on any OS.
pub(crate) fn dead_link_for(os: &str) -> DeadLink {
    // Idle probes finish within LIVENESS_TIMEOUT: 3 + 3 * 4 = 15 s.
    let keepalive = Keepalive {
        idle: Duration::from_secs(3),
        interval: Duration::from_secs(3),
        count: 4,
    };
    match os {
        // TCP_USER_TIMEOUT also bounds keepalive probes on Linux, and russh's own keepalives
        // keep the link from idling, so no TCP keepalive is needed there.
        "linux" | "android" => DeadLink {
            user_timeout: Some(LIVENESS_TIMEOUT),
            rxt_conndrop: None,
            keepalive: None,
        },
        "macos" | "ios" => DeadLink {
            user_timeout: None,
            rxt_conndrop: Some(LIVENESS_TIMEOUT),
            keepalive: Some(keepalive),
        },
        _ => DeadLink {
            user_timeout: None,
            rxt_conndrop: None,
            keepalive: Some(keepalive),
        },
    }
}

/// Apply `d` to `tcp`; an option the OS refuses is logged, never fatal (the protocol
/// heartbeat still bounds the session).
fn apply_dead_link(tcp: &tokio::net::TcpStream, d: DeadLink) {
    let sock = socket2::SockRef::from(tcp);
    // Each OS reads the fields it has options for; the others are None there.
    let DeadLink {
        user_timeout,
        rxt_conndrop,
        keepalive,
    } = d;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = user_timeout;
    #[cfg(not(target_vendor = "apple"))]
    let _ = rxt_conndrop;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Some(t) = user_timeout
        && let Err(e) = sock.set_tcp_user_timeout(Some(t))
    {
        tracing::debug!("cannot set TCP_USER_TIMEOUT: {e}");
    }
    #[cfg(target_vendor = "apple")]
    if let Some(t) = rxt_conndrop {
        use std::os::fd::AsRawFd;
        /// `<netinet/tcp.h>`; the libc crate does not define it.
        const TCP_RXT_CONNDROPTIME: libc::c_int = 0x80;
        let secs = libc::c_int::try_from(t.as_secs()).unwrap_or(libc::c_int::MAX);
        // SAFETY: the descriptor is open (borrowed from `tcp`), and the option value is a
        // c_int of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                tcp.as_raw_fd(),
                libc::IPPROTO_TCP,
                TCP_RXT_CONNDROPTIME,
                (&secs as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(
                "cannot set TCP_RXT_CONNDROPTIME: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    if let Some(k) = keepalive {
        let ka = socket2::TcpKeepalive::new()
            .with_time(k.idle)
            .with_interval(k.interval)
            .with_retries(k.count);
        if let Err(e) = sock.set_tcp_keepalive(&ka) {
            tracing::debug!("cannot set TCP keepalive: {e}");
        }
    }
}

/// A TCP connection that the kernel fails after about [`LIVENESS_TIMEOUT`] on a black-holed
/// peer (see [`dead_link_for`]).
async fn tcp_connect(
    host: &str,
    port: u16,
) -> std::result::Result<tokio::net::TcpStream, HandlerError> {
    let tcp = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| HandlerError::Ssh(russh::Error::IO(e)))?;
    let _ = tcp.set_nodelay(true);
    apply_dead_link(&tcp, dead_link_for(std::env::consts::OS));
    Ok(tcp)
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

struct AuthError {
    method: String,
    detail: String,
    kind: Kind,
    hint: String,
}

impl AuthError {
    fn with_context(self, sandbox: &str, desc: &str) -> RsbError {
        RsbError::new(
            self.kind,
            format!(
                "SSH authentication failed for sandbox '{sandbox}' ({desc}) using {}: {}",
                self.method, self.detail
            ),
            self.hint,
        )
    }
}

fn load_key(
    path: &Path,
    passphrase: Option<&str>,
) -> std::result::Result<keys::PrivateKey, AuthError> {
    let shown = path.display().to_string();
    keys::load_secret_key(path, passphrase).map_err(|e| {
        let (detail, hint) = match e {
            keys::Error::KeyIsEncrypted => (
                format!("key file {shown} is encrypted and no passphrase was given"),
                "set key_passphrase (REMOTE_KEY_PASSPHRASE) or load the key into ssh-agent",
            ),
            keys::Error::IO(ref io) if io.kind() == std::io::ErrorKind::NotFound => (
                format!("key file {shown} does not exist"),
                "check key_file (REMOTE_KEY_FILE)",
            ),
            _ if passphrase.is_some() => (
                format!("cannot decrypt key file {shown} (wrong passphrase?)"),
                "check key_passphrase (REMOTE_KEY_PASSPHRASE)",
            ),
            other => (
                format!(
                    "cannot load key file {shown}: {}",
                    one_line(&other.to_string())
                ),
                "check key_file",
            ),
        };
        AuthError {
            method: format!("key {shown}"),
            detail,
            kind: Kind::Auth,
            hint: hint.into(),
        }
    })
}

async fn auth_with_key(
    h: &mut client::Handle<Checker>,
    user: &str,
    key: keys::PrivateKey,
) -> std::result::Result<bool, String> {
    let hash = h
        .best_supported_rsa_hash()
        .await
        .map_err(|e| e.to_string())?
        .flatten();
    let r = h
        .authenticate_publickey(user, PrivateKeyWithHashAlg::new(Arc::new(key), hash))
        .await
        .map_err(|e| e.to_string())?;
    Ok(r.success())
}

/// Sign in with the keys of the ssh-agent at `socket` (`SSH_AUTH_SOCK` for [`AgentSocket::Env`];
/// the caller skips [`AgentSocket::Off`]).
async fn auth_with_agent(
    h: &mut client::Handle<Checker>,
    user: &str,
    socket: &AgentSocket,
) -> std::result::Result<bool, String> {
    let mut agent = match socket {
        AgentSocket::Path(p) => keys::agent::client::AgentClient::connect_uds(p)
            .await
            .map_err(|e| {
                format!(
                    "cannot reach the ssh-agent at {} (IdentityAgent): {e}",
                    p.display()
                )
            })?,
        _ => keys::agent::client::AgentClient::connect_env()
            .await
            .map_err(|e| format!("cannot reach ssh-agent (SSH_AUTH_SOCK): {e}"))?,
    };
    let ids = agent
        .request_identities()
        .await
        .map_err(|e| format!("ssh-agent: {e}"))?;
    if ids.is_empty() {
        return Err("ssh-agent holds no keys".into());
    }
    for id in ids {
        let hash = h
            .best_supported_rsa_hash()
            .await
            .map_err(|e| e.to_string())?
            .flatten();
        let r = h
            .authenticate_publickey_with(user, id.public_key().into_owned(), hash, &mut agent)
            .await
            .map_err(|e| format!("ssh-agent signing failed: {e}"))?;
        if r.success() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Try each key in turn; what was rejected goes into `tried` for the final error.
async fn try_keys(
    h: &mut client::Handle<Checker>,
    user: &str,
    keys_to_try: &[PathBuf],
    passphrase: Option<&str>,
    tried: &mut Vec<String>,
) -> bool {
    for p in keys_to_try {
        match keys::load_secret_key(p, passphrase) {
            Ok(k) => match auth_with_key(h, user, k).await {
                Ok(true) => return true,
                _ => tried.push(p.display().to_string()),
            },
            Err(_) => tried.push(format!("{} (encrypted or unreadable)", p.display())),
        }
    }
    false
}

async fn authenticate(
    h: &mut client::Handle<Checker>,
    user: &str,
    auth: &Auth,
) -> std::result::Result<(), AuthError> {
    let fail = |method: &str, detail: String, hint: &str| AuthError {
        method: method.into(),
        detail,
        kind: Kind::Auth,
        hint: hint.into(),
    };
    match auth {
        Auth::Password(pw) => {
            let r = h
                .authenticate_password(user, pw.expose())
                .await
                .map_err(|e| fail("password", one_line(&e.to_string()), "check the server"))?;
            if r.success() {
                Ok(())
            } else {
                Err(fail(
                    "password",
                    "the server rejected the password".into(),
                    "check password (REMOTE_PASSWORD) and the user name",
                ))
            }
        }
        Auth::KeyFile { path, passphrase } => {
            let key = load_key(path, passphrase.as_ref().map(|p| p.expose()))?;
            let method = format!("key {}", path.display());
            match auth_with_key(h, user, key).await {
                Ok(true) => Ok(()),
                Ok(false) => Err(fail(
                    &method,
                    "the server did not accept this key".into(),
                    "add the public key to the remote ~/.ssh/authorized_keys, or check the user name",
                )),
                Err(e) => Err(fail(&method, e, "check the server")),
            }
        }
        Auth::Agent => match auth_with_agent(h, user, &AgentSocket::Env).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(fail(
                "ssh-agent",
                "the server accepted none of the agent's keys".into(),
                "add one of `ssh-add -L` to the remote authorized_keys",
            )),
            Err(e) => Err(fail(
                "ssh-agent",
                e,
                "start ssh-agent and `ssh-add` your key, or configure key_file",
            )),
        },
        Auth::Auto {
            identity_files,
            default_keys,
            passphrase,
            agent,
        } => {
            let mut tried = Vec::new();
            let pass = passphrase.as_ref().map(|p| p.expose());
            if try_keys(h, user, identity_files, pass, &mut tried).await {
                return Ok(());
            }
            let env = |k: &str| std::env::var(k).ok();
            if agent.available(&env) {
                match auth_with_agent(h, user, agent).await {
                    Ok(true) => return Ok(()),
                    Ok(false) => tried.push("ssh-agent".to_string()),
                    Err(e) => tried.push(format!("ssh-agent ({e})")),
                }
            }
            if try_keys(h, user, default_keys, pass, &mut tried).await {
                return Ok(());
            }
            Err(fail(
                "default credentials",
                if tried.is_empty() {
                    "no password, key_file, ssh-agent or ~/.ssh/id_* key available".into()
                } else {
                    format!("rejected: {}", tried.join(", "))
                },
                "configure password or key_file for this sandbox",
            ))
        }
    }
}

#[cfg(test)]
mod dead_link_tests {
    use super::*;

    #[test]
    fn linux_uses_tcp_user_timeout_alone() {
        let d = dead_link_for("linux");
        assert_eq!(d.user_timeout, Some(LIVENESS_TIMEOUT));
        assert_eq!(d.rxt_conndrop, None);
        assert_eq!(d.keepalive, None);
    }

    #[test]
    fn macos_uses_rxt_conndroptime_and_keepalive_within_the_liveness_timeout() {
        let d = dead_link_for("macos");
        assert_eq!(d.user_timeout, None, "Darwin has no TCP_USER_TIMEOUT");
        assert_eq!(d.rxt_conndrop, Some(LIVENESS_TIMEOUT));
        let k = d.keepalive.expect("macOS probes idle links");
        assert!(k.count >= 1 && !k.interval.is_zero() && !k.idle.is_zero());
        // The longest an idle dead link goes unnoticed by the kernel.
        assert!(k.idle + k.interval * k.count <= LIVENESS_TIMEOUT, "{k:?}");
    }

    #[test]
    fn other_systems_fall_back_to_keepalive() {
        let d = dead_link_for("freebsd");
        assert_eq!((d.user_timeout, d.rxt_conndrop), (None, None));
        assert!(d.keepalive.is_some());
    }

    #[test]
    fn this_build_applies_its_own_os_settings_to_a_real_socket() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = l.local_addr().unwrap().port();
            let tcp = tcp_connect("127.0.0.1", port).await.unwrap();
            let sock = socket2::SockRef::from(&tcp);
            let d = dead_link_for(std::env::consts::OS);
            #[cfg(any(target_os = "linux", target_os = "android"))]
            assert_eq!(sock.tcp_user_timeout().unwrap(), d.user_timeout);
            assert_eq!(sock.keepalive().unwrap(), d.keepalive.is_some());
        });
    }
}
