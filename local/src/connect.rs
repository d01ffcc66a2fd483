//! From a sandbox's config to a live agent channel: SSH connect, probe, reuse or deploy the
//! agent, handshake. Also the local transport (agent as a child process, no SSH).

use std::{collections::HashMap, path::PathBuf, process::Stdio, sync::Arc, time::Duration};

use rsb_deploy::{AgentBinary, DeployError};
use tokio::{io::AsyncBufReadExt, process::Command};

use crate::{
    client::{AgentClient, StartError},
    config::{SandboxConfig, SshTarget, Transport},
    error::{Kind, Result, RsbError},
    ssh::SshSession,
};

/// A live agent channel plus how it came to be (tests and `rsb sandboxes` report it).
pub struct Connection {
    pub client: AgentClient,
    pub ssh: Option<Arc<SshSession>>,
    /// The agent binary was uploaded during this connect.
    pub deployed: bool,
    /// Where the agent runs on the host.
    pub agent_path: String,
    /// Install directories refused on the way (another owner, writable by others, noexec),
    /// each with its reason; also logged as warnings.
    pub notices: Vec<String>,
}

pub async fn connect(sandbox: &SandboxConfig, known_path: Option<&str>) -> Result<Connection> {
    match &sandbox.transport {
        Transport::Local => start_local_sandbox(&sandbox.name).await,
        Transport::Ssh(t) => connect_ssh(&sandbox.name, t, known_path).await,
    }
}

fn deploy_err(sandbox: &str, e: DeployError) -> RsbError {
    let hint = match &e {
        DeployError::AgentMissing { .. } => {
            "rebuild rsb with agents embedded, or set RSB_AGENT_DIR"
        }
        DeployError::UnsupportedPlatform { .. } => {
            "rsb sandboxes must be Linux x86_64 or aarch64 hosts"
        }
        DeployError::NoExecDir { .. } => {
            "make ~/.cache yours alone (chmod go-w), writable and executable, or free /tmp for this user"
        }
        DeployError::Verify { .. } | DeployError::Upload { .. } => {
            "retry; check free disk space on the remote"
        }
        DeployError::Probe(_) => {
            "make sure the remote login shell is a POSIX shell that runs commands"
        }
    };
    RsbError::new(
        Kind::Deploy,
        format!("cannot start rsb-agent on sandbox '{sandbox}': {e}"),
        hint,
    )
}

/// Agents this process has hashed, by [`verified_key`]: the file identity (device, inode, size,
/// times) that was verified and the blake3 it had. A start whose identity still matches needs no
/// second read-back; any replacement or write changes the identity.
static VERIFIED: std::sync::LazyLock<parking_lot::Mutex<HashMap<String, (String, String)>>> =
    std::sync::LazyLock::new(Default::default);

/// The host as reached (jump hosts included, since one `user@host:port` may name different
/// machines behind different bastions) plus the agent path.
fn verified_key(t: &SshTarget, path: &str) -> String {
    let mut key: String = t.proxy_jump.iter().map(|h| h.address() + " -> ").collect();
    key.push_str(&t.address());
    key.push('\0');
    key.push_str(path);
    key
}

/// The host as reached, without the agent path: sandboxes that share it share one agent install.
fn host_key(t: &SshTarget) -> String {
    verified_key(t, "")
}

/// Per host (see [`host_key`]): where an agent was last verified and started, so that a first
/// connect of another sandbox on the same host skips the probe and the locate step.
static AGENT_AT: std::sync::LazyLock<parking_lot::Mutex<HashMap<String, String>>> =
    std::sync::LazyLock::new(Default::default);

/// Per host: held while probing, locating, verifying or installing, so that many sandboxes on
/// one host connecting at once (a `list_sandboxes` over all of them) do that work once, and the
/// others start the agent it found.
static DEPLOYING: std::sync::LazyLock<
    parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
> = std::sync::LazyLock::new(Default::default);

/// SSH handshakes in flight to one address. OpenSSH drops unauthenticated connections at
/// random beyond `MaxStartups` (10 by default), so a fan-out over many sandboxes on one host
/// queues here instead of failing a third of them.
const HANDSHAKES_PER_ADDRESS: usize = 8;

static HANDSHAKES: std::sync::LazyLock<
    parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
> = std::sync::LazyLock::new(Default::default);

fn handshake_slots(t: &SshTarget) -> Arc<tokio::sync::Semaphore> {
    // The first hop is the server that counts the unauthenticated connections.
    let first = t
        .proxy_jump
        .first()
        .map_or_else(|| t.address(), |h| h.address());
    HANDSHAKES
        .lock()
        .entry(first)
        .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(HANDSHAKES_PER_ADDRESS)))
        .clone()
}

/// Start the agent at `path` if this process verified that very file before: the identity
/// check and the start are one exec. `None` when there is nothing cached for it or it fails
/// (the caller then takes the full path, which finds out why).
async fn start_known(
    ssh: &Arc<SshSession>,
    t: &SshTarget,
    sandbox: &str,
    path: &str,
) -> Option<Connection> {
    let (id, hash) = VERIFIED.lock().get(&verified_key(t, path)).cloned()?;
    let client = ssh
        .start_agent_with(sandbox, rsb_deploy::start_command_expecting(path, &id))
        .await
        .ok()?;
    if client.hello().agent_hash != hash {
        client.close("agent hash mismatch");
        return None;
    }
    AGENT_AT.lock().insert(host_key(t), path.to_string());
    Some(Connection {
        client,
        ssh: Some(ssh.clone()),
        deployed: false,
        agent_path: path.to_string(),
        notices: Vec::new(),
    })
}

/// The agent this process verified and started on a host: where it is, the file identity that
/// was hashed, and the hash. A transfer worker is handed the server's, so that its connect is
/// one exec (identity check plus start, as a reconnect here is) instead of probe, locate,
/// read-back and start: about 150 ms off every background sync on loopback.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VerifiedAgent {
    pub path: String,
    pub id: String,
    pub hash: String,
}

/// What this process last verified and started on `t`'s host, if anything.
pub fn verified_agent(t: &SshTarget) -> Option<VerifiedAgent> {
    let path = AGENT_AT.lock().get(&host_key(t)).cloned()?;
    let (id, hash) = VERIFIED.lock().get(&verified_key(t, &path)).cloned()?;
    Some(VerifiedAgent { path, id, hash })
}

/// Take `a` (from the process that verified it, through the private state dir) as verified
/// here. Only an agent this binary carries is taken: a worker of a newer `rsb` than the server
/// that recorded the task verifies, and if need be installs, its own.
pub fn trust_verified_agent(t: &SshTarget, a: &VerifiedAgent) {
    let ours = [rsb_deploy::TRIPLE_X86_64, rsb_deploy::TRIPLE_AARCH64]
        .iter()
        .any(|triple| rsb_deploy::agent_for(triple).is_ok_and(|b| b.hash == a.hash));
    if !ours || a.id.is_empty() {
        return;
    }
    VERIFIED
        .lock()
        .insert(verified_key(t, &a.path), (a.id.clone(), a.hash.clone()));
    AGENT_AT.lock().insert(host_key(t), a.path.clone());
}

/// Start the verified agent `a` on `ssh` for a transfer worker, its stdio pumped to `stream`
/// (see [`SshSession::bridge_agent`]); the identity check runs in the same exec, as in
/// [`start_known`].
pub async fn bridge_agent(
    ssh: &Arc<SshSession>,
    sandbox: &str,
    a: &VerifiedAgent,
    stream: tokio::net::UnixStream,
) -> std::result::Result<(), String> {
    ssh.bridge_agent(
        sandbox,
        rsb_deploy::start_command_expecting(&a.path, &a.id),
        stream,
    )
    .await
}

/// How long a worker waits for the Hello of the agent its server starts for it before it
/// connects by itself.
const BRIDGE_HELLO_TIMEOUT: Duration = Duration::from_secs(3);

/// The worker's end of [`bridge_agent`]: the agent's Hello read through `stream`, checked to
/// be the verified agent `a` on `t`'s host. `None` (the worker then connects by itself) when
/// the server did not start one or it is not `a`. Its siblings (a large upload's lanes on a
/// long link) run on an SSH connection of the worker's own, opened at the first one: the
/// server's connection carries one channel per worker.
pub async fn adopt_bridged(
    sandbox: &str,
    t: &SshTarget,
    stream: tokio::net::UnixStream,
    a: &VerifiedAgent,
) -> Option<Connection> {
    let (r, w) = stream.into_split();
    let client = AgentClient::start(sandbox, r, w, Box::new(()), BRIDGE_HELLO_TIMEOUT)
        .await
        .ok()?;
    if client.hello().agent_hash != a.hash {
        client.close("agent hash mismatch");
        return None;
    }
    let own = Arc::new(tokio::sync::OnceCell::<Option<Arc<SshSession>>>::new());
    let (name, target) = (sandbox.to_string(), t.clone());
    let command = rsb_deploy::start_command_expecting(&a.path, &a.id);
    client.allow_siblings(Arc::new(move || {
        let (own, name, target, command) =
            (own.clone(), name.clone(), target.clone(), command.clone());
        Box::pin(async move {
            let ssh = own
                .get_or_init(|| async {
                    SshSession::connect_for_forward(&name, &target)
                        .await
                        .map_err(|e| tracing::info!(sandbox = %name, "lanes: {}", e.message))
                        .ok()
                })
                .await
                .clone()?;
            (ssh.siblings(&name, command))().await
        })
    }));
    Some(Connection {
        client,
        ssh: None,
        deployed: false,
        agent_path: a.path.clone(),
        notices: Vec::new(),
    })
}

/// Agent channels one shared SSH connection carries at most: OpenSSH's `MaxSessions` is 10 by
/// default, and a deploy needs a channel of its own next to them.
const AGENTS_PER_SESSION: usize = 8;

/// A shared session is offered to new agents only while it is part of a burst of connects (an
/// agent started on it this recently). A reconnect long after, typically after a failure, gets
/// a fresh connection, as it always did, rather than a session that may sit on a dead link.
const SHARE_WINDOW: Duration = Duration::from_secs(10);

/// Open SSH connections that sandboxes with the very same target (address, user, credentials,
/// host-key policy, jump hosts) may share: each sandbox still runs its own agent, on its own
/// channel, but a `list_sandboxes` over 100 names for one host makes about 100/8 handshakes,
/// not 100. Weak: a connection lives as long as the agents (and forwards) using it.
struct SharedSession {
    target: SshTarget,
    session: std::sync::Weak<SshSession>,
    agents: usize,
    last_start: std::time::Instant,
}

static SHARED: std::sync::LazyLock<parking_lot::Mutex<Vec<SharedSession>>> =
    std::sync::LazyLock::new(Default::default);

/// A live shared session to `t` with room for one more agent (counted as taken).
fn take_shared(t: &SshTarget) -> Option<Arc<SshSession>> {
    let mut all = SHARED.lock();
    all.retain(|s| s.session.strong_count() > 0);
    all.iter_mut().find_map(|s| {
        if s.agents >= AGENTS_PER_SESSION || s.last_start.elapsed() > SHARE_WINDOW || s.target != *t
        {
            return None;
        }
        // Workers' bridges hold channels too: the agent needs one, and a deploy another.
        let session = s
            .session
            .upgrade()
            .filter(|x| !x.is_closed() && x.free_channels() >= 2)?;
        s.agents += 1;
        Some(session)
    })
}

fn shared_entry(session: &Arc<SshSession>, f: impl FnOnce(&mut SharedSession)) {
    if let Some(s) = SHARED
        .lock()
        .iter_mut()
        .find(|s| std::ptr::eq(s.session.as_ptr(), Arc::as_ptr(session)))
    {
        f(s);
    }
}

/// A session for one more agent on `t`: a shared one when there is room, else a new one (at
/// most [`HANDSHAKES_PER_ADDRESS`] handshakes at a time), offered to the next sandboxes.
async fn session_for(sandbox: &str, t: &SshTarget) -> Result<(Arc<SshSession>, bool)> {
    if let Some(s) = take_shared(t) {
        return Ok((s, true));
    }
    let slots = handshake_slots(t);
    let _slot = slots.acquire().await;
    // While this one waited, another may have opened a session with room.
    if let Some(s) = take_shared(t) {
        return Ok((s, true));
    }
    let session = SshSession::connect(sandbox, t).await?;
    SHARED.lock().push(SharedSession {
        target: t.clone(),
        session: Arc::downgrade(&session),
        agents: 1,
        last_start: std::time::Instant::now(),
    });
    Ok((session, false))
}

async fn connect_ssh(sandbox: &str, t: &SshTarget, known_path: Option<&str>) -> Result<Connection> {
    let host = host_key(t);
    // Fast path for a reconnect, or a first connect on a host another sandbox already uses:
    // the agent verified and started last time is most likely still there, unchanged.
    let shared = || AGENT_AT.lock().get(&host).cloned();
    let first_guess = known_path.map(str::to_string).or_else(shared);
    let (mut ssh, borrowed) = session_for(sandbox, t).await?;
    if borrowed {
        // A borrowed session must prove itself quickly; if it cannot, this sandbox gets a
        // connection of its own and nobody is offered that session again.
        let quick = t.connect_timeout.min(Duration::from_secs(5));
        let started = match &first_guess {
            Some(p) => tokio::time::timeout(quick, start_known(&ssh, t, sandbox, p))
                .await
                .ok()
                .flatten(),
            None => None,
        };
        if let Some(c) = started {
            shared_entry(&ssh, |s| s.last_start = std::time::Instant::now());
            return Ok(c);
        }
        if first_guess.is_some() {
            shared_entry(&ssh, |s| s.agents = usize::MAX);
            ssh = {
                let slots = handshake_slots(t);
                let _slot = slots.acquire().await;
                SshSession::connect(sandbox, t).await?
            };
        }
    } else if let Some(p) = &first_guess
        && let Some(c) = start_known(&ssh, t, sandbox, p).await
    {
        return Ok(c);
    }
    let lock = DEPLOYING.lock().entry(host.clone()).or_default().clone();
    let mut one_at_a_time = lock.lock().await;
    // Whoever held the lock may just have verified (or installed) the agent this host runs:
    // start it without holding the lock, so the sandboxes queued here start side by side.
    if let Some(p) = shared()
        && first_guess.as_deref() != Some(p.as_str())
    {
        drop(one_at_a_time);
        if let Some(c) = start_known(&ssh, t, sandbox, &p).await {
            return Ok(c);
        }
        one_at_a_time = lock.lock().await;
    }
    let connection = deploy_and_start(&ssh, sandbox, t).await?;
    drop(one_at_a_time);
    AGENT_AT.lock().insert(host, connection.agent_path.clone());
    Ok(connection)
}

/// Probe the host, find (or make) a safe install directory, reuse a verified agent there or
/// upload ours, and start it.
async fn deploy_and_start(
    ssh: &Arc<SshSession>,
    sandbox: &str,
    t: &SshTarget,
) -> Result<Connection> {
    let ssh = ssh.clone();
    let out = ssh
        .exec_collect(rsb_deploy::PROBE_COMMAND, None)
        .await
        .map_err(|e| {
            RsbError::new(
                Kind::Connect,
                format!("cannot probe sandbox '{sandbox}': {e}"),
                "check the remote host",
            )
        })?;
    let probe = rsb_deploy::parse_probe(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| deploy_err(sandbox, e))?;
    let triple =
        rsb_deploy::triple_for(&probe.sys, &probe.machine).map_err(|e| deploy_err(sandbox, e))?;
    let agent = rsb_deploy::agent_for(triple).map_err(|e| deploy_err(sandbox, e))?;
    let roots = rsb_deploy::install_roots(&probe);
    let mut notices = Vec::new();
    let mut tried = Vec::new();
    let mut from = 0;
    // Each round locates the first usable directory from `from` on; a failed upload there moves
    // on to the next root (the private fallback is always last).
    while from <= roots.len() {
        let out = ssh
            .exec_collect(&rsb_deploy::locate_command(&roots, from, &agent), None)
            .await
            .map_err(|e| {
                RsbError::new(
                    Kind::Connect,
                    format!("cannot prepare the agent directory on sandbox '{sandbox}': {e}"),
                    "check the remote host",
                )
            })?;
        let located = rsb_deploy::parse_locate(&String::from_utf8_lossy(&out.stdout));
        for (label, reason) in &located.skipped {
            let root = root_name(&roots, label, &probe);
            let notice = format!("not using {root} for rsb-agent: {reason}");
            tracing::warn!(sandbox, "{notice}");
            tried.push(format!("{root} ({reason})"));
            notices.push(notice);
        }
        let Some((label, dir, file)) = located.dir else {
            break;
        };
        let path = rsb_deploy::agent_path(&dir);
        match file {
            rsb_deploy::AgentFile::Present(id) => {
                match verify_and_start(&ssh, t, sandbox, &path, &id, &agent).await {
                    Ok(client) => {
                        return Ok(Connection {
                            client,
                            ssh: Some(ssh),
                            deployed: false,
                            agent_path: path,
                            notices,
                        });
                    }
                    Err(e) => {
                        tracing::info!(sandbox, %path, "installed agent not usable, replacing it: {e}")
                    }
                }
            }
            rsb_deploy::AgentFile::Unsafe(why) => {
                let notice = format!("replacing {path}: {why}");
                tracing::warn!(sandbox, "{notice}");
                notices.push(notice);
            }
            rsb_deploy::AgentFile::Absent => {}
        }
        match rsb_deploy::install(ssh.as_ref(), &agent, &dir).await {
            Ok(installed) => {
                tracing::info!(sandbox, path = %installed.path, bytes = agent.bytes.len(), "deployed rsb-agent");
                if let Some(id) = &installed.id {
                    VERIFIED.lock().insert(
                        verified_key(t, &installed.path),
                        (id.clone(), agent.hash.clone()),
                    );
                }
                let client = match &installed.id {
                    Some(_) => start_verified(&ssh, sandbox, &installed.path, &agent).await,
                    // A concurrent deploy renamed its copy over ours: hash what is there.
                    None => {
                        verify_and_start(&ssh, t, sandbox, &installed.path, "", &agent).await
                    }
                }
                .map_err(|e| {
                    RsbError::new(
                        Kind::Deploy,
                        format!("rsb-agent was installed at {} on sandbox '{sandbox}' but does not start: {e}", installed.path),
                        "the directory may be mounted noexec, or the host may lack a compatible kernel",
                    )
                })?;
                let _ = ssh
                    .exec_collect(
                        &rsb_deploy::prune_command(&dir, rsb_protocol::JOBS_ROOT),
                        None,
                    )
                    .await;
                return Ok(Connection {
                    client,
                    ssh: Some(ssh),
                    deployed: true,
                    agent_path: installed.path,
                    notices,
                });
            }
            Err(e @ DeployError::Upload { .. }) => {
                tried.push(format!("{dir} ({e})"));
                from = match label.parse::<usize>() {
                    Ok(i) => i + 1,
                    Err(_) => break,
                };
            }
            Err(e) => return Err(deploy_err(sandbox, e)),
        }
    }
    Err(deploy_err(
        sandbox,
        DeployError::NoExecDir {
            tried: tried.join("; "),
        },
    ))
}

/// The install root a locate label stands for, for messages.
fn root_name(roots: &[rsb_deploy::InstallRoot], label: &str, probe: &rsb_deploy::Probe) -> String {
    match label.parse::<usize>().ok().and_then(|i| roots.get(i)) {
        Some(r) => r.path(),
        None => format!("a private /tmp/rsb-{}.* directory", probe.uid),
    }
}

/// Hash the agent at `path` unless this process already verified that very file (`id`), then
/// start it: the read-back and the start both check the directory chain, which only the login
/// user can change, so what was hashed is what runs.
async fn verify_and_start(
    ssh: &Arc<SshSession>,
    t: &SshTarget,
    sandbox: &str,
    path: &str,
    id: &str,
    agent: &AgentBinary,
) -> std::result::Result<AgentClient, String> {
    let key = verified_key(t, path);
    let known = VERIFIED.lock().get(&key).cloned();
    if known != Some((id.to_string(), agent.hash.clone())) {
        let out = ssh
            .exec_collect(&rsb_deploy::verify_command(path, true), None)
            .await?;
        let (id, body) = rsb_deploy::parse_verify(&out.stdout)?;
        let got = blake3::hash(&body).to_hex().to_string();
        if got != agent.hash {
            return Err(format!(
                "{path} has blake3 {got}, expected {} (not started)",
                agent.hash
            ));
        }
        VERIFIED.lock().insert(key, (id, agent.hash.clone()));
    }
    start_verified(ssh, sandbox, path, agent).await
}

/// Start the agent at `path` and insist that it is exactly the binary we ship.
async fn start_verified(
    ssh: &Arc<SshSession>,
    sandbox: &str,
    path: &str,
    agent: &AgentBinary,
) -> std::result::Result<AgentClient, String> {
    let client = ssh
        .start_agent(sandbox, path)
        .await
        .map_err(|e: StartError| e.to_string())?;
    if client.hello().agent_hash != agent.hash {
        let got = client.hello().agent_hash.clone();
        client.close("agent hash mismatch");
        return Err(format!(
            "agent at {path} reports blake3 {got}, expected {}",
            agent.hash
        ));
    }
    Ok(client)
}

/// The agent binary for the built-in `local` sandbox: an explicit `RSB_LOCAL_AGENT`, else the
/// `rsb-agent` built next to `rsb`, else the embedded static agent for this machine written
/// (verified) into the state dir.
pub fn local_agent_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("RSB_LOCAL_AGENT").map(PathBuf::from) {
        return Ok(p);
    }
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        for cand in [dir.join("rsb-agent"), dir.join("../rsb-agent")] {
            if cand.is_file() {
                return Ok(cand);
            }
        }
    }
    let triple = rsb_deploy::host_triple().ok_or_else(|| {
        RsbError::new(
            Kind::Deploy,
            "no rsb-agent for the local sandbox on this platform",
            "build it with `cargo build -p rsb-agent` and set RSB_LOCAL_AGENT to its path",
        )
    })?;
    let agent = rsb_deploy::agent_for(triple).map_err(|e| deploy_err("local", e))?;
    let dir = crate::config::state_dir()
        .join("agent")
        .join(agent.dir_name());
    let path = dir.join("rsb-agent");
    if let Ok(bytes) = std::fs::read(&path)
        && blake3::hash(&bytes).to_hex().as_str() == agent.hash
    {
        return Ok(path);
    }
    materialize(&dir, &path, &agent).map_err(|e| {
        RsbError::new(
            Kind::Deploy,
            format!("cannot write the local agent to {}: {e}", path.display()),
            "check free space and permissions of the state dir",
        )
    })?;
    Ok(path)
}

fn materialize(
    dir: &std::path::Path,
    path: &std::path::Path,
    agent: &AgentBinary,
) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("rsb-agent.tmp.{}", std::process::id()));
    std::fs::write(&tmp, &**agent.bytes)?;
    if blake3::hash(&std::fs::read(&tmp)?).to_hex().as_str() != agent.hash {
        let _ = std::fs::remove_file(&tmp);
        return Err(std::io::Error::other(
            "written agent does not match its hash",
        ));
    }
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700))?;
    std::fs::rename(&tmp, path)
}

pub async fn start_local(sandbox: &str) -> Result<Connection> {
    start_local_in(sandbox, None).await
}

/// The agent of a `local` sandbox: it runs in `$HOME`, so relative paths (`exec_bash` without
/// `cwd`, `read_remote_file("notes.txt")`) mean what they mean on a remote sandbox, the home
/// directory, not whatever directory the MCP server happened to be started in.
async fn start_local_sandbox(sandbox: &str) -> Result<Connection> {
    let home = directories::BaseDirs::new().map(|b| b.home_dir().to_path_buf());
    start_local_in(sandbox, home.as_deref()).await
}

async fn start_local_in(sandbox: &str, cwd: Option<&std::path::Path>) -> Result<Connection> {
    let path = local_agent_path()?;
    let client = start_local_with_cwd(sandbox, &path.to_string_lossy(), &[], cwd).await?;
    Ok(Connection {
        client,
        ssh: None,
        deployed: false,
        agent_path: path.display().to_string(),
        notices: Vec::new(),
    })
}

/// Run `program [prefix_args…] serve` as a child and handshake with it. `prefix_args` lets a
/// wrapper run the agent (`qemu-aarch64-static /path/rsb-agent`).
pub async fn start_local_with(
    sandbox: &str,
    program: &str,
    prefix_args: &[&str],
) -> Result<AgentClient> {
    start_local_with_cwd(sandbox, program, prefix_args, None).await
}

async fn start_local_with_cwd(
    sandbox: &str,
    program: &str,
    prefix_args: &[&str],
    cwd: Option<&std::path::Path>,
) -> Result<AgentClient> {
    let mut cmd = Command::new(program);
    if let Some(dir) = cwd.filter(|d| d.is_dir()) {
        cmd.current_dir(dir);
    }
    cmd.env_clear()
        .envs(child_env())
        .args(prefix_args)
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| {
        RsbError::new(
            Kind::Deploy,
            format!("cannot start local agent {program}: {e}"),
            "set RSB_LOCAL_AGENT to a built rsb-agent",
        )
    })?;
    let stdin = child.stdin.take().expect("piped");
    let stdout = child.stdout.take().expect("piped");
    if let Some(err) = child.stderr.take() {
        let name = sandbox.to_string();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(err).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                tracing::warn!(sandbox = %name, "agent: {l}");
            }
        });
    }
    AgentClient::start(
        sandbox,
        stdout,
        stdin,
        Box::new(child),
        Duration::from_secs(20),
    )
    .await
    .map_err(|e| {
        RsbError::new(
            Kind::Deploy,
            format!("local agent {program} did not start: {e}"),
            "rebuild rsb-agent",
        )
    })
}

/// Variables the agent itself reads; a user who sets them for rsb means them for the agent.
const AGENT_VARS: [&str; 3] = [
    "RSB_CACHE_DIR",
    "RSB_NVIDIA_SMI_TIMEOUT_MS",
    "RSB_SYNC_FSYNC",
];

/// rsb's configuration variables (the seed's names) and the askpass hooks that would hand a
/// child a way to ask for credentials.
const WITHHELD_VARS: [&str; 8] = [
    "REMOTE_HOST",
    "REMOTE_PORT",
    "REMOTE_USER",
    "REMOTE_PASSWORD",
    "REMOTE_KEY_FILE",
    "REMOTE_KEY_PASSPHRASE",
    "SSH_ASKPASS",
    "SSH_ASKPASS_REQUIRE",
];

/// The environment of every child rsb starts on this machine (the `local` sandbox's agent, the
/// local sync agent, and through them every command and job): rsb's own environment without
/// its secrets and configuration, so `exec_bash("env")` on the local sandbox cannot print a
/// password into a transcript.
///
/// Withheld: `REMOTE_SANDBOX_*`, `RSB_*` (except the agent's own [`AGENT_VARS`]), the legacy
/// `REMOTE_*` variables and `SSH_ASKPASS*`; every variable the configuration loader reads
/// (which covers the names given in `password_env` / `key_passphrase_env`); and any variable
/// whose value is one of the configured secrets, however it got there.
pub fn child_env() -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    filtered_env(|name| name.starts_with("RSB_") && !AGENT_VARS.contains(&name))
}

/// The environment of rsb's own detached processes (the watchdog daemon): [`child_env`]'s
/// rule, except that rsb's settings (`RSB_*`, such as `RSB_ALLOW_WATCH_HOOKS`) are its own to
/// read. The configuration's secrets and the variables that name them (`password_env`,
/// `key_passphrase_env`, `sudo_password_env`) are withheld all the same.
pub fn rsb_child_env() -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    filtered_env(|_| false)
}

fn filtered_env(
    withheld_rsb: impl Fn(&str) -> bool,
) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    let (read_by_config, secrets) = config_vars_and_secrets();
    std::env::vars_os()
        .filter(|(k, v)| {
            let name = k.to_string_lossy();
            let value = v.to_string_lossy();
            let rsb_own = name.starts_with("RSB_") && !withheld_rsb(&name);
            let withheld = withheld_rsb(&name)
                || name.starts_with("REMOTE_SANDBOX_")
                || WITHHELD_VARS.contains(&name.as_ref())
                || (read_by_config.iter().any(|r| *r == name) && !rsb_own)
                || secrets.iter().any(|s| s.as_str() == value.trim());
            // A child without PATH or HOME could not run anything; no config names them.
            !withheld || name == "PATH" || name == "HOME"
        })
        .collect()
}

/// Which variables loading the configuration reads, and the secrets it yields. The loader is
/// run (reading files only) with an environment that records each lookup, so the rule cannot
/// drift from what the loader actually consults.
fn config_vars_and_secrets() -> (Vec<String>, Vec<String>) {
    let read = parking_lot::Mutex::new(Vec::<String>::new());
    let env = |key: &str| {
        read.lock().push(key.to_string());
        std::env::var(key).ok()
    };
    let loaded = crate::config::load_with_env(&env);
    let mut secrets = Vec::new();
    if let Ok(cfg) = &loaded {
        for sb in &cfg.sandboxes {
            secrets.extend(sb.secrets().iter().map(|s| s.expose().trim().to_string()));
        }
    }
    secrets.retain(|s| !s.is_empty());
    (read.into_inner(), secrets)
}
