//! A forward request as a user writes it and its start: the `SANDBOX:PORT` /
//! `SANDBOX:HOST:PORT` / `SANDBOX:/path.sock` syntax, the bind address and local port rules,
//! and [`start`], which the MCP server, the CLI and the watchdog daemon (for a detached
//! forward) all call.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use super::{EventSink, Forward, LocalPort, Target};
use crate::{
    error::{Result, RsbError},
    pool::Pool,
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

pub fn exposure_warning(ip: IpAddr) -> Option<String> {
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
    let listener = super::bind(req.bind, req.local_port).await?;
    Forward::start(pool.clone(), sandbox, req.target.clone(), listener, events)
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
