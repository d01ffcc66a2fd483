//! ProxyJump hops: parsing a hop as `ssh -J` writes it, and resolving each through its own
//! Host block, so a jump host keeps its own user, identity and host-key settings.

use std::path::PathBuf;

use super::ssh_config::host_key_settings;
use super::{Auth, BuildCtx, ConfigError, HostKeyPolicy, SshTarget};

/// One SSH server on the way to a sandbox: a ProxyJump hop, or the target itself
/// ([`SshTarget::as_hop`]). Each hop authenticates and checks host keys on its own terms,
/// as `ssh -J` does through each jump host's Host block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hop {
    /// An IPv6 literal without brackets.
    pub host: String,
    pub port: u16,
    pub user: String,
    pub auth: Auth,
    pub host_key_policy: HostKeyPolicy,
    /// Read all; new keys are written to the last one.
    pub known_hosts: Vec<PathBuf>,
}

impl Hop {
    /// `user@host:port` (`user@[::1]:22` for IPv6), for messages.
    pub fn address(&self) -> String {
        format!("{}@{}", self.user, host_port(&self.host, self.port))
    }
}

/// `host:port`, with an IPv6 literal in brackets so the port cannot be mistaken for part of it.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `[::1]` → `::1`; anything else unchanged. Users write IPv6 literals either way, while
/// sockets and known_hosts lookups need them bare.
pub(super) fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .filter(|h| h.contains(':'))
        .unwrap_or(host)
}

/// A ProxyJump hop as written: `[user@]host[:port]`, where `host` may be a bracketed IPv6
/// literal (`[::1]:2222`) or a bare one without a port (`::1`), optionally as
/// `ssh://[user@]host[:port]` (both forms `ssh -J` accepts).
#[derive(Debug, PartialEq, Eq)]
struct HopSpec {
    user: Option<String>,
    host: String,
    port: Option<u16>,
}

fn parse_hop_spec(spec: &str) -> Result<HopSpec, &'static str> {
    let spec = spec.trim();
    let spec = spec.strip_prefix("ssh://").unwrap_or(spec);
    let (user, rest) = match spec.rsplit_once('@') {
        Some(("", _)) => return Err("has an empty user name"),
        Some((u, r)) => (Some(u.to_string()), r),
        None => (None, spec),
    };
    let port_of = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or("has a port that is not an integer between 1 and 65535")
    };
    let (host, port) = if let Some(inner) = rest.strip_prefix('[') {
        let (host, after) = inner
            .split_once(']')
            .ok_or("has a '[' without its closing ']'")?;
        let port = match after {
            "" => None,
            _ => Some(port_of(
                after
                    .strip_prefix(':')
                    .ok_or("has text after ']' that is not :port")?,
            )?),
        };
        (host, port)
    } else if rest.matches(':').count() > 1 {
        // A bare IPv6 literal: its colons are not a port separator.
        (rest, None)
    } else {
        match rest.split_once(':') {
            Some((h, p)) => (h, Some(port_of(p)?)),
            None => (rest, None),
        }
    };
    if host.is_empty() {
        return Err("has an empty host");
    }
    if host.contains(['/', ' ', '\t']) {
        return Err("has a host that is not a name or address");
    }
    Ok(HopSpec {
        user,
        host: host.to_string(),
        port,
    })
}

/// One ProxyJump hop, looked up as an ssh_config alias the way `ssh` does: HostName, Port and
/// User, and the hop's own IdentityFile, StrictHostKeyChecking and UserKnownHostsFile. What
/// the hop's block does not say comes from the target (its user, credentials and host-key
/// settings), as before hops were typed.
pub(super) fn resolve_hop(
    ctx: &mut BuildCtx<'_>,
    raw: &str,
    index: usize,
    target: &SshTarget,
    label: &str,
) -> Result<Hop, ConfigError> {
    let spec = parse_hop_spec(raw).map_err(|why| {
        ConfigError::new(
            format!("{label}: ProxyJump hop {} ('{}') {why}", index + 1, raw.trim()),
            "Write hops as [user@]host[:port] separated by commas, IPv6 literals in brackets: admin@[::1]:2222.",
        )
    })?;
    let params = ctx.ssh_query(&spec.host, label)?;
    let host = params
        .host_name
        .as_deref()
        .map(|hn| hn.replace("%h", &spec.host).replace("%%", "%"))
        .unwrap_or_else(|| spec.host.clone());
    let host = unbracket(&host).to_string();
    let port = spec.port.or(params.port).unwrap_or(22);
    let user = spec
        .user
        .or_else(|| params.user.clone())
        .unwrap_or_else(|| target.user.clone());
    let identity_files: Vec<PathBuf> = params
        .identity_file
        .iter()
        .flatten()
        .filter(|p| p.is_file())
        .cloned()
        .collect();
    let auth = if identity_files.is_empty() {
        target.auth.clone()
    } else {
        Auth::Auto {
            identity_files,
            default_keys: ctx.default_keys(),
            passphrase: None,
            agent: super::ssh_config::identity_agent(&params, label, ctx),
        }
    };
    let hop_label = format!("{label} ProxyJump hop {}", index + 1);
    let (policy, known_hosts) = host_key_settings(&params, &hop_label, ctx);
    Ok(Hop {
        host,
        port,
        user,
        auth,
        host_key_policy: policy.unwrap_or(target.host_key_policy),
        known_hosts: known_hosts.unwrap_or_else(|| target.known_hosts.clone()),
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::sources::LIST_VAR;

    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn hop_specs_parse_like_ssh_j() {
        let spec = |user: Option<&str>, host: &str, port: Option<u16>| HopSpec {
            user: user.map(str::to_string),
            host: host.to_string(),
            port,
        };
        for (raw, want) in [
            ("jump", spec(None, "jump", None)),
            (" me@jump:2222 ", spec(Some("me"), "jump", Some(2222))),
            ("[::1]:2222", spec(None, "::1", Some(2222))),
            ("me@[::1]", spec(Some("me"), "::1", None)),
            ("::1", spec(None, "::1", None)),
            ("fe80::1:22", spec(None, "fe80::1:22", None)),
            ("ssh://a@b:7", spec(Some("a"), "b", Some(7))),
            ("a@b@host", spec(Some("a@b"), "host", None)),
        ] {
            assert_eq!(parse_hop_spec(raw), Ok(want), "{raw:?}");
        }
        for bad in [
            "", "@h", "h:", "h:0", "h:x", "[::1", "[::1]x", "[::1]:", "[]:22", "a b",
        ] {
            assert!(parse_hop_spec(bad).is_err(), "{bad:?}");
        }
        assert_eq!(host_port("::1", 22), "[::1]:22");
        assert_eq!(host_port("h", 22), "h:22");
        assert_eq!(unbracket("[::1]"), "::1");
        assert_eq!(unbracket("[x]"), "[x]");
    }

    #[test]
    fn hops_keep_their_own_user_identity_and_host_keys() {
        let home = TempDir::new();
        let k1 = home.write(".ssh/k1", "x");
        let k2 = home.write(".ssh/k2", "x");
        let kt = home.write(".ssh/kt", "x");
        let cfg = home.write(
            ".ssh/config",
            &format!(
                "\
Host target
    HostName ::1
    User t
    IdentityFile {kt}
    ProxyJump j1,u2@[::1]:2200,j3

Host j1
    HostName [fd00::5]
    Port 2201
    User one
    IdentityFile {k1}
    StrictHostKeyChecking yes
    UserKnownHostsFile ~/.ssh/kh1 ~/.ssh/kh1b

Host ::1
    IdentityFile {k2}
    StrictHostKeyChecking no

Host j3
    HostName 127.0.0.3
",
                kt = kt.display(),
                k1 = k1.display(),
                k2 = k2.display()
            ),
        );
        let c = load_with(
            &home,
            &[(
                LIST_VAR,
                r#"[{"ssh_config_host":"target","host_key_policy":"off"},{"ssh_config_host":"j1"}]"#,
            )],
            None,
            Some(&cfg),
        )
        .unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let t = ssh(&c, 0);
        assert_eq!(t.address(), "t@[::1]:22");
        assert_eq!(
            hops(t),
            vec!["one@[fd00::5]:2201", "u2@[::1]:2200", "t@127.0.0.3:22"]
        );
        let auto = |k: &Path| Auth::Auto {
            identity_files: vec![k.to_path_buf()],
            default_keys: vec![],
            passphrase: None,
            agent: Default::default(),
        };
        let [h1, h2, h3] = &t.proxy_jump[..] else {
            panic!("three hops: {:?}", t.proxy_jump)
        };
        assert_eq!(t.auth, auto(&kt));
        assert_eq!(h1.auth, auto(&k1));
        assert_eq!(h2.auth, auto(&k2));
        assert_eq!(h3.auth, t.auth, "no IdentityFile: the target's credentials");
        assert_eq!(h1.host_key_policy, HostKeyPolicy::Strict);
        assert_eq!(
            h2.host_key_policy,
            HostKeyPolicy::AcceptNew,
            "ssh_config's `no` never turns checking off"
        );
        assert_eq!(h3.host_key_policy, HostKeyPolicy::Off, "the sandbox's own");
        assert_eq!(
            h1.known_hosts,
            vec![
                home.path().join(".ssh/kh1"),
                home.path().join(".ssh/kh1b"),
                home.path().join("state/known_hosts")
            ]
        );
        assert_eq!(h2.known_hosts, t.known_hosts);
        // The same Host block read for a target (no host_key_policy of its own) says the same.
        let j1 = ssh(&c, 1);
        assert_eq!(j1.host_key_policy, HostKeyPolicy::Strict);
        assert_eq!(j1.known_hosts, h1.known_hosts);
        // A hop that cannot be parsed names the hop, and the fix.
        let cfg = home.write(
            ".ssh/config",
            "Host t\n    User u\n    ProxyJump ok,[::1:22\n",
        );
        let e = load_with(
            &home,
            &[(LIST_VAR, r#"[{"ssh_config_host":"t"}]"#)],
            None,
            Some(&cfg),
        )
        .unwrap_err();
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0]: ProxyJump hop 2 ('[::1:22') has a '[' without its closing ']'"
        );
        // IPv6 literals in the list's host field work bracketed or bare.
        let c = load_with(
            &home,
            &[(
                LIST_VAR,
                r#"[{"host":"[::1]","user":"u","port":2222},{"name":"b","host":"::1","user":"u"}]"#,
            )],
            None,
            None,
        )
        .unwrap();
        assert_eq!(ssh(&c, 0).address(), "u@[::1]:2222");
        assert_eq!(ssh(&c, 1).host, "::1");
    }
}
