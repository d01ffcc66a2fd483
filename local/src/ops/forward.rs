//! Forwarding as a user asks for it: the `SANDBOX:PORT` / `SANDBOX:HOST:PORT` /
//! `SANDBOX:/path.sock` syntax, the bind address and local port rules, the typed replies the
//! CLI and the MCP tools both print, and the registry of forwards an MCP server keeps.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use parking_lot::Mutex;
use serde::Serialize;

use crate::{
    error::{Result, RsbError},
    forward::{EventSink, Forward, LocalPort, StatsSnapshot, Target},
    pool::Pool,
    watchdog::{daemon, forwards, sandboxes, service, settings},
};

/// The host a bare port means, as in `ssh -L 8888:localhost:8888`; the SSH server tries each
/// address it resolves to, so a service bound to 127.0.0.1 or ::1 is found either way.
pub const DEFAULT_REMOTE_HOST: &str = "localhost";

/// A validated forward request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardRequest {
    /// `""` = the active sandbox.
    pub sandbox: String,
    pub target: Target,
    pub bind: IpAddr,
    pub local_port: LocalPort,
}

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

/// A forward on an address other machines can reach serves them too, through the user's SSH
/// login: like OpenSSH's `GatewayPorts`, that takes an explicit yes, never only a warning.
pub fn check_exposure(ip: IpAddr, allow_external: bool) -> Result<()> {
    if ip.is_loopback() || allow_external {
        return Ok(());
    }
    Err(RsbError::invalid(
        format!("bind address {ip} would let other machines use the forward"),
        "bind 127.0.0.1 (the default), or pass --allow-external (allow_external=true) if other \
         machines should reach it",
    ))
}

fn exposure_warning(ip: IpAddr) -> Option<String> {
    (!ip.is_loopback()).then(|| {
        format!("listening on {ip}: other machines that can reach this address can use the forward")
    })
}

/// Split `SANDBOX:REST`. Sandbox names may themselves contain `:` (a name defaults to its
/// host, which can be an IPv6 literal), so the longest configured name followed by `:` wins;
/// otherwise a leading `:` means the active sandbox.
pub fn split_sandbox<'a>(names: &[String], spec: &'a str) -> Result<(&'a str, &'a str)> {
    let best = names
        .iter()
        .filter(|n| {
            spec.len() > n.len() && spec.starts_with(n.as_str()) && spec[n.len()..].starts_with(':')
        })
        .max_by_key(|n| n.len());
    if let Some(n) = best {
        return Ok((&spec[..n.len()], &spec[n.len() + 1..]));
    }
    if let Some(rest) = spec.strip_prefix(':') {
        return Ok(("", rest));
    }
    let hint = format!(
        "write SANDBOX:PORT, SANDBOX:HOST:PORT or SANDBOX:/path/to.sock (:PORT = the active sandbox); sandboxes: {}",
        names.join(", ")
    );
    match spec.split_once(':') {
        Some((name, _)) => Err(RsbError::invalid(
            format!("unknown sandbox '{name}' in '{spec}'"),
            hint,
        )),
        None => Err(RsbError::invalid(
            format!("'{spec}' names no sandbox"),
            hint,
        )),
    }
}

/// `PORT`, `HOST:PORT`, `[V6]:PORT` or an absolute Unix socket path, as the sandbox sees it.
pub fn parse_target(s: &str) -> Result<Target> {
    let hint = "write PORT, HOST:PORT, [IPv6]:PORT or /absolute/path/to.sock";
    if s.starts_with('/') {
        return unix_target(s);
    }
    if s.starts_with('~') || s.contains('/') {
        return Err(RsbError::invalid(
            format!("Unix socket path '{s}' is not absolute"),
            "give the full path; the SSH server does not expand ~ or relative paths",
        ));
    }
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest
            .split_once("]:")
            .ok_or_else(|| RsbError::invalid(format!("cannot read target '{s}'"), hint))?;
        (h, p)
    } else {
        match s.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => {
                return Err(RsbError::invalid(
                    format!("cannot read target '{s}'"),
                    "put an IPv6 address in brackets: [::1]:8888",
                ));
            }
            Some((h, p)) => (h, p),
            None => (DEFAULT_REMOTE_HOST, s),
        }
    };
    tcp_target(host, port_number(port, "remote port")?)
}

/// A TCP target from separate host and port (the MCP tool's parameters).
pub fn tcp_target(host: &str, port: u16) -> Result<Target> {
    let host = host.trim();
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(RsbError::invalid(
            "the remote host is empty or contains spaces or control characters",
            "give a host name or address as the sandbox sees it, e.g. localhost",
        ));
    }
    if port == 0 {
        return Err(RsbError::invalid(
            "remote port 0 is not a port",
            "give the port the service listens on (1-65535)",
        ));
    }
    Ok(Target::Tcp {
        host: host.to_string(),
        port,
    })
}

pub fn unix_target(path: &str) -> Result<Target> {
    if !path.starts_with('/') {
        return Err(RsbError::invalid(
            format!("Unix socket path '{path}' is not absolute"),
            "give the full path; the SSH server does not expand ~ or relative paths",
        ));
    }
    if path.chars().any(char::is_control) {
        return Err(RsbError::invalid(
            "the Unix socket path contains control characters",
            "give the socket's path as a plain string",
        ));
    }
    Ok(Target::Unix {
        path: path.to_string(),
    })
}

fn port_number(s: &str, what: &str) -> Result<u16> {
    match s.parse::<u32>() {
        Ok(p) if (1..=65535).contains(&p) => Ok(p as u16),
        _ => Err(RsbError::invalid(
            format!("{what} '{s}' is not a port number"),
            "ports are 1-65535",
        )),
    }
}

/// `""` is loopback; `localhost` is accepted as 127.0.0.1 (resolving names would make the
/// listening address depend on /etc/hosts).
pub fn parse_bind(s: &str) -> Result<IpAddr> {
    match s.trim() {
        "" | "localhost" => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        "*" => Ok(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        t => t
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| {
                RsbError::invalid(
                    format!("bind address '{t}' is not an IP address"),
                    "use 127.0.0.1 (the default), ::1, 0.0.0.0 or one of this machine's addresses",
                )
            }),
    }
}

/// The local port rule: `None` = the remote port number when free (any port for a socket),
/// `0` = any, otherwise exactly that port.
pub fn local_port(requested: Option<i64>, target: &Target) -> Result<LocalPort> {
    match requested {
        None => Ok(match target {
            Target::Tcp { port, .. } => LocalPort::Prefer(*port),
            Target::Unix { .. } => LocalPort::Any,
        }),
        Some(0) => Ok(LocalPort::Any),
        Some(p) if (1..=65535).contains(&p) => Ok(LocalPort::Exact(p as u16)),
        Some(p) => Err(RsbError::invalid(
            format!("local port {p} is not a port number"),
            "ports are 1-65535; 0 picks any free port",
        )),
    }
}

/// Parse the CLI's `SANDBOX:TARGET [LOCAL_PORT] [--bind ADDR]`.
pub fn cli_request(
    names: &[String],
    spec: &str,
    local: Option<i64>,
    bind: &str,
    allow_external: bool,
) -> Result<ForwardRequest> {
    let (sandbox, rest) = split_sandbox(names, spec)?;
    let target = parse_target(rest)?;
    let bind = parse_bind(bind)?;
    check_exposure(bind, allow_external)?;
    Ok(ForwardRequest {
        sandbox: sandbox.to_string(),
        local_port: local_port(local, &target)?,
        bind,
        target,
    })
}

/// Resolve the sandbox, connect it now (so a bad host or key fails here, not on the first
/// browser request), bind, and start serving.
pub async fn start(
    pool: &Arc<Pool>,
    req: &ForwardRequest,
    events: Option<EventSink>,
) -> Result<Arc<Forward>> {
    let sandbox = pool.resolve(&req.sandbox)?;
    pool.ssh_session(&sandbox).await?;
    let listener = crate::forward::bind(req.bind, req.local_port).await?;
    Forward::start(pool.clone(), sandbox, req.target.clone(), listener, events)
}

/// How long `detach` waits for the daemon to connect and bind before answering.
const DETACH_WAIT: Duration = Duration::from_secs(45);
/// How long `stop` waits for the daemon to free a detached forward's port.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// Hand a forward to the watchdog daemon (starting one if none runs) and wait until it listens
/// or says why it cannot. The sandbox definitions are persisted as for a watch: without secrets
/// unless the user opted in, so a password-only sandbox is refused here with the opt-in named.
pub async fn detach(pool: &Arc<Pool>, req: &ForwardRequest) -> Result<ForwardInfo> {
    let sandbox = pool.resolve(&req.sandbox)?;
    let cfg = pool.config();
    let state_dir = crate::ops::watchdog::state_dir_of(cfg);
    let configured = cfg.sandboxes.clone();
    let req = req.clone();
    let dir = state_dir.clone();
    let name = sandbox.clone();
    let (id, report) = blocking(move || {
        let conn = crate::ops::watchdog::open(&dir)?;
        sandboxes::persist(&conn, &dir, &configured, settings::store_passwords())?;
        let secrets = sandboxes::read_secrets(&dir);
        if let Some(msg) =
            sandboxes::load(&conn, &name)?.and_then(|p| p.missing_credentials(secrets.get(&name)))
        {
            return Err(RsbError::invalid(
                format!("cannot detach a forward to '{name}': {msg}"),
                "use a key or ssh-agent for this sandbox, or set RSB_WATCHDOG_STORE_PASSWORDS=1 \
                 to let the watchdog store its password (0600); or forward without detach",
            ));
        }
        let id = forwards::insert(&conn, &name, &req.target, req.bind, req.local_port)?;
        match service::ensure(&conn, &dir) {
            Ok(r) => Ok((id, r)),
            Err(e) => {
                let _ = forwards::delete(&conn, id);
                Err(e)
            }
        }
    })
    .await?;
    let note = match &report.install_hint {
        Some(h) => format!("{} ({h})", report.detail),
        None => report.detail.clone(),
    };
    let deadline = Instant::now() + DETACH_WAIT;
    loop {
        let dir = state_dir.clone();
        let row = blocking(move || forwards::get(&crate::ops::watchdog::open(&dir)?, id)).await?;
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
                let dir = state_dir.clone();
                let _ = blocking(move || forwards::delete(&crate::ops::watchdog::open(&dir)?, id))
                    .await;
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

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RsbError::internal(format!("state store task failed: {e}")))?
}

/// The detached forwards in the store (none when there is no store yet: listing never creates
/// one).
fn detached_list(state_dir: &std::path::Path) -> Result<Vec<ForwardInfo>> {
    if !crate::store::db_path(state_dir).exists() {
        return Ok(Vec::new());
    }
    let conn = crate::ops::watchdog::open(state_dir)?;
    Ok(forwards::list(&conn)?
        .iter()
        .filter(|r| r.state != forwards::STOPPING)
        .map(ForwardInfo::of_row)
        .collect())
}

/// Stop a detached forward: the daemon frees the port and deletes the row; without a daemon
/// nothing listens, so the row goes at once.
async fn stop_detached(
    state_dir: &std::path::Path,
    public: u64,
    row_id: i64,
) -> Result<ForwardInfo> {
    let dir = state_dir.to_path_buf();
    let row = blocking(move || {
        let conn = crate::ops::watchdog::open(&dir)?;
        let row = forwards::get(&conn, row_id)?;
        if row.is_some() {
            if daemon::lock_holder(&dir).is_some() {
                forwards::request_stop(&conn, row_id)?;
            } else {
                forwards::delete(&conn, row_id)?;
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
        let dir = state_dir.to_path_buf();
        let gone = blocking(move || {
            Ok(forwards::get(&crate::ops::watchdog::open(&dir)?, row_id)?.is_none())
        })
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
    pub fn list(&self, state_dir: &std::path::Path) -> Result<ForwardList> {
        let mut forwards: Vec<ForwardInfo> = self
            .map
            .lock()
            .iter()
            .map(|(id, f)| ForwardInfo::of(*id, f))
            .collect();
        forwards.extend(detached_list(state_dir)?);
        Ok(ForwardList { forwards })
    }

    /// Stop one forward; its port is free when this returns.
    pub async fn stop(&self, state_dir: &std::path::Path, id: u64) -> Result<ForwardInfo> {
        if let Some(row_id) = forwards::row_id(id) {
            return stop_detached(state_dir, id, row_id).await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    fn names() -> Vec<String> {
        vec!["gpu".into(), "::1".into(), "gpu:2".into()]
    }

    fn tcp(h: &str, p: u16) -> Target {
        Target::Tcp {
            host: h.into(),
            port: p,
        }
    }

    #[test]
    fn specs_name_a_sandbox_and_a_target() {
        let r = cli_request(&names(), "gpu:8888", None, "", false).unwrap();
        assert_eq!(r.sandbox, "gpu");
        assert_eq!(r.target, tcp("localhost", 8888));
        assert_eq!(r.local_port, LocalPort::Prefer(8888));
        assert_eq!(r.bind, IpAddr::V4(Ipv4Addr::LOCALHOST));

        let r = cli_request(&names(), "gpu:10.0.0.2:80", Some(9000), "0.0.0.0", true).unwrap();
        assert_eq!(r.target, tcp("10.0.0.2", 80));
        assert_eq!(r.local_port, LocalPort::Exact(9000));
        assert_eq!(r.bind, IpAddr::V4(Ipv4Addr::UNSPECIFIED));

        let r = cli_request(&names(), "gpu:[::1]:80", Some(0), "::1", false).unwrap();
        assert_eq!(r.target, tcp("::1", 80));
        assert_eq!(r.target.to_string(), "[::1]:80");
        assert_eq!(r.local_port, LocalPort::Any);
        assert_eq!(r.bind, IpAddr::V6(Ipv6Addr::LOCALHOST));

        let r = cli_request(&names(), "gpu:/run/app.sock", None, "", false).unwrap();
        assert_eq!(
            r.target,
            Target::Unix {
                path: "/run/app.sock".into()
            }
        );
        assert_eq!(r.local_port, LocalPort::Any);

        // The active sandbox, and names that contain ':' themselves.
        assert_eq!(
            cli_request(&names(), ":22", None, "", false)
                .unwrap()
                .sandbox,
            ""
        );
        assert_eq!(
            cli_request(&names(), "::1:22", None, "", false)
                .unwrap()
                .sandbox,
            "::1"
        );
        let r = cli_request(&names(), "gpu:2:22", None, "", false).unwrap();
        assert_eq!(
            (r.sandbox.as_str(), r.target),
            ("gpu:2", tcp("localhost", 22))
        );
    }

    #[test]
    fn bad_specs_get_one_line_errors_with_hints() {
        let e = |spec: &str, local: Option<i64>, bind: &str| {
            cli_request(&names(), spec, local, bind, false).unwrap_err()
        };
        assert!(
            e("nope:80", None, "")
                .message
                .contains("unknown sandbox 'nope'")
        );
        assert!(e("nope:80", None, "").hint.contains("gpu"));
        assert!(e("8888", None, "").message.contains("names no sandbox"));
        assert!(e("gpu:0", None, "").message.contains("not a port"));
        assert!(e("gpu:70000", None, "").message.contains("not a port"));
        assert!(e("gpu:http", None, "").message.contains("not a port"));
        assert!(e("gpu:host:", None, "").message.contains("not a port"));
        assert!(e("gpu::1:80", None, "").hint.contains("brackets"));
        assert!(e("gpu:~/x.sock", None, "").message.contains("not absolute"));
        assert!(
            e("gpu:run/x.sock", None, "")
                .message
                .contains("not absolute")
        );
        assert!(e("gpu: :80", None, "").message.contains("remote host"));
        assert!(e("gpu:80", Some(70000), "").message.contains("local port"));
        assert!(e("gpu:80", Some(-1), "").message.contains("local port"));
        assert!(
            e("gpu:80", None, "example.org")
                .message
                .contains("bind address")
        );
        for err in [e("gpu:x\ny:80", None, ""), e("gpu:/a\nb", None, "")] {
            assert!(!err.message.contains('\n'), "{}", err.message);
        }
    }

    /// Issue 21: a forward bound to 0.0.0.0 or :: was accepted with only a warning.
    #[test]
    fn a_bind_other_machines_reach_needs_allow_external() {
        for bind in ["0.0.0.0", "*", "::", "[::]", "192.168.1.5"] {
            let e = cli_request(&names(), "gpu:8888", None, bind, false).unwrap_err();
            assert!(
                e.to_string()
                    .contains("would let other machines use the forward"),
                "{bind}: {e}"
            );
            assert!(e.hint.contains("--allow-external"), "{bind}");
            assert!(
                cli_request(&names(), "gpu:8888", None, bind, true).is_ok(),
                "{bind}"
            );
        }
        for bind in ["", "localhost", "127.0.0.1", "127.3.4.5", "::1"] {
            assert!(
                cli_request(&names(), "gpu:8888", None, bind, false).is_ok(),
                "{bind}"
            );
        }
    }

    #[test]
    fn only_non_loopback_binds_warn() {
        assert!(exposure_warning(IpAddr::V4(Ipv4Addr::LOCALHOST)).is_none());
        assert!(exposure_warning(IpAddr::V6(Ipv6Addr::LOCALHOST)).is_none());
        assert!(exposure_warning(IpAddr::V4(Ipv4Addr::UNSPECIFIED)).is_some());
    }
}
