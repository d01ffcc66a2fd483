//! What rsb takes from OpenSSH's client configuration: `~/.ssh/config` through ssh2-config,
//! the home OpenSSH resolves `~` against, and the known_hosts files and default identities
//! that follow from it, so a sandbox named by its ssh alias connects as `ssh ALIAS` would.

use std::path::{Path, PathBuf};

use rsb_rules::path::expand_tilde;

use super::env::{real_env, real_home};
use super::{BuildCtx, ConfigError, HostKeyPolicy};

/// Default keys for [`Auth::Auto`](super::Auth::Auto) (tried after the agent), in this order.
const DEFAULT_KEY_NAMES: [&str; 3] = ["id_ed25519", "id_ecdsa", "id_rsa"];

/// The home directory OpenSSH uses for `~` in its config, `~/.ssh/known_hosts` and the default
/// identities: the passwd entry's, never `$HOME` (`ssh` ignores it), so a client that starts
/// rsb with another `HOME` (or `sudo -E`, or a `HOME=/tmp` wrapper) still sees the aliases, keys
/// and host keys `ssh` sees. `home` (`$HOME`) only where the passwd database has no entry for
/// this user. rsb's own files (its config, state dir, a config entry's `key_file`) follow
/// `$HOME`, as other XDG tools do.
pub(super) fn ssh_home(home: &Path) -> PathBuf {
    rsb_agent::util::passwd_entry()
        .map(|p| p.home)
        .filter(|h| h.is_absolute())
        .unwrap_or_else(|| home.to_path_buf())
}

/// The OpenSSH client configuration rsb reads: `RSB_SSH_CONFIG` when set (tests, or a user with
/// a second ssh config), else `.ssh/config` under [`ssh_home`], as OpenSSH finds it.
pub(super) fn ssh_config_path(home: &Path) -> PathBuf {
    if let Some(p) = real_env("RSB_SSH_CONFIG").filter(|s| !s.trim().is_empty()) {
        return expand_tilde(p.trim(), home);
    }
    ssh_home(home).join(".ssh").join("config")
}

/// [`ssh_config_path`] for this process: what `rsb doctor` and hints name.
pub fn ssh_config_file() -> PathBuf {
    ssh_config_path(&real_home().unwrap_or_else(|| PathBuf::from(".")))
}

/// The login name of this user, as `ssh` uses it when a Host block sets no `User`.
pub(super) fn local_user() -> Option<String> {
    rsb_agent::util::passwd_entry()
        .map(|p| p.name)
        .filter(|n| !n.is_empty())
        .or_else(|| real_env("USER").filter(|u| !u.is_empty()))
}

impl BuildCtx<'_> {
    pub(super) fn known_hosts(&self) -> Vec<PathBuf> {
        vec![
            self.ssh_home.join(".ssh").join("known_hosts"),
            self.state_dir.join(super::KNOWN_HOSTS),
        ]
    }

    pub(super) fn default_keys(&self) -> Vec<PathBuf> {
        DEFAULT_KEY_NAMES
            .iter()
            .map(|n| self.ssh_home.join(".ssh").join(n))
            .filter(|p| p.is_file())
            .collect()
    }

    pub(super) fn ssh_query(
        &mut self,
        alias: &str,
        label: &str,
    ) -> Result<ssh2_config::HostParams, ConfigError> {
        if self.ssh_config.is_none() {
            let path = self.ssh_config_path.filter(|p| p.is_file()).ok_or_else(|| {
                let shown = self
                    .ssh_config_path
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "~/.ssh/config".to_string());
                ConfigError::new(
                    format!("{label} sets 'ssh_config_host' but {shown} does not exist"),
                    "Create the ssh config with a matching Host block, or give 'host' and 'user' instead.",
                )
            })?;
            let file = std::fs::File::open(path).map_err(|e| {
                ConfigError::new(
                    format!("cannot read {}: {}", path.display(), e.kind()),
                    "Check the file's permissions.",
                )
            })?;
            let mut reader = std::io::BufReader::new(file);
            let rules = ssh2_config::ParseRule::ALLOW_UNKNOWN_FIELDS
                | ssh2_config::ParseRule::ALLOW_UNSUPPORTED_FIELDS;
            let parsed = ssh2_config::SshConfig::default()
                .home_dir(self.ssh_home)
                .parse(&mut reader, rules)
                .map_err(|e| {
                    ConfigError::new(
                        format!("cannot parse ssh config {}: {}", path.display(), e),
                        "Fix the ssh config (check it with `ssh -G <alias>`).",
                    )
                })?;
            self.ssh_config = Some(parsed);
        }
        Ok(self.ssh_config.as_ref().expect("parsed above").query(alias))
    }
}

/// `StrictHostKeyChecking` and `UserKnownHostsFile` of a Host block. `no`/`off` is read as
/// accept-new: only rsb's own `host_key_policy = off` turns checking off, so an old
/// `Host *` line cannot silently disable it. Known-hosts files keep rsb's own file last, where
/// new keys are recorded.
pub(super) fn host_key_settings(
    params: &ssh2_config::HostParams,
    label: &str,
    ctx: &mut BuildCtx<'_>,
) -> (Option<HostKeyPolicy>, Option<Vec<PathBuf>>) {
    let first = |key: &str| {
        params
            .unsupported_fields
            .get(key)
            .and_then(|args| args.first())
            .map(|a| a.trim().to_ascii_lowercase())
    };
    let policy = match first("stricthostkeychecking").as_deref() {
        None => None,
        Some("yes" | "ask") => Some(HostKeyPolicy::Strict),
        Some("accept-new" | "no" | "off") => Some(HostKeyPolicy::AcceptNew),
        Some(_) => {
            ctx.warn(format!(
                "{label}: StrictHostKeyChecking in the ssh config is not yes, ask, accept-new or no; ignored"
            ));
            None
        }
    };
    let files = params
        .unsupported_fields
        .get("userknownhostsfile")
        .map(|args| {
            let mut files: Vec<PathBuf> = args
                .iter()
                .flat_map(|a| a.split_whitespace())
                .filter(|f| !f.eq_ignore_ascii_case("none"))
                .map(|f| expand_tilde(f, ctx.ssh_home))
                .collect();
            files.push(ctx.state_dir.join(super::KNOWN_HOSTS));
            files
        });
    (policy, files)
}

/// `IdentityAgent` of a Host block, as ssh reads it: `none`, `SSH_AUTH_SOCK`, `$VAR` (the
/// variable's value; unset means no agent), or a path with `~` expanded. `%` tokens are not
/// expanded: such a value is reported and the default agent used.
pub(super) fn identity_agent(
    params: &ssh2_config::HostParams,
    label: &str,
    ctx: &mut BuildCtx<'_>,
) -> super::AgentSocket {
    use super::AgentSocket;
    let Some(v) = params
        .unsupported_fields
        .get("identityagent")
        .and_then(|args| args.first())
        .map(|a| a.trim().trim_matches('"').to_string())
        .filter(|a| !a.is_empty())
    else {
        return AgentSocket::Env;
    };
    if v.eq_ignore_ascii_case("none") {
        return AgentSocket::Off;
    }
    if v == "SSH_AUTH_SOCK" {
        return AgentSocket::Env;
    }
    if v.contains('%') {
        ctx.warn(format!(
            "{label}: IdentityAgent {v} in the ssh config uses % tokens, which rsb does not expand; SSH_AUTH_SOCK is used"
        ));
        return AgentSocket::Env;
    }
    if let Some(var) = v.strip_prefix('$') {
        let var = var.trim_start_matches('{').trim_end_matches('}');
        return match (ctx.env)(var).filter(|s| !s.is_empty()) {
            Some(path) => AgentSocket::Path(PathBuf::from(path)),
            None => {
                ctx.warn(format!(
                    "{label}: IdentityAgent ${var} in the ssh config names an unset variable; no agent is asked"
                ));
                AgentSocket::Off
            }
        };
    }
    AgentSocket::Path(expand_tilde(&v, ctx.ssh_home))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use crate::config::sources::LIST_VAR;
    use crate::config::{Auth, Config, Secret};

    use super::*;
    use crate::config::test_support::*;

    /// Issue 44: `IdentityAgent` (1Password, Secretive) was not read, so rsb asked the agent of
    /// `SSH_AUTH_SOCK`, which under launchd is the system's.
    #[test]
    fn identity_agent_is_read_as_ssh_reads_it() {
        use crate::config::AgentSocket;
        let home = TempDir::new();
        let cfg = home.write(
            ".ssh/config",
            "Host op\n  HostName 10.0.0.1\n  User u\n  \
             IdentityAgent \"~/Library/Group Containers/2BUA8C4S2C.com.1password/t/agent.sock\"\n\
             Host off\n  HostName 10.0.0.2\n  User u\n  IdentityAgent none\n\
             Host env\n  HostName 10.0.0.3\n  User u\n  IdentityAgent SSH_AUTH_SOCK\n\
             Host var\n  HostName 10.0.0.4\n  User u\n  IdentityAgent $MY_AGENT\n\
             Host tok\n  HostName 10.0.0.5\n  User u\n  IdentityAgent ~/.ssh/%h.sock\n\
             Host plain\n  HostName 10.0.0.6\n  User u\n",
        );
        let list = r#"[{"ssh_config_host":"op"},{"ssh_config_host":"off"},{"ssh_config_host":"env"},
            {"ssh_config_host":"var"},{"ssh_config_host":"tok"},{"ssh_config_host":"plain"}]"#;
        let c = load_with(
            &home,
            &[(LIST_VAR, list), ("MY_AGENT", "/run/user/1/agent.sock")],
            None,
            Some(&cfg),
        )
        .unwrap();
        let agent = |i| match &ssh(&c, i).auth {
            Auth::Auto { agent, .. } => agent.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            agent(0),
            AgentSocket::Path(
                home.path()
                    .join("Library/Group Containers/2BUA8C4S2C.com.1password/t/agent.sock")
            )
        );
        assert_eq!(agent(1), AgentSocket::Off);
        assert_eq!(agent(2), AgentSocket::Env);
        assert_eq!(agent(3), AgentSocket::Path("/run/user/1/agent.sock".into()));
        assert_eq!(agent(4), AgentSocket::Env, "% tokens are not expanded");
        assert!(
            c.warnings.iter().any(|w| w.contains("% tokens")),
            "{:?}",
            c.warnings
        );
        assert_eq!(agent(5), AgentSocket::Env);
        // The stored definition (what the daemon connects with) keeps it.
        for i in 0..6 {
            let s = &c.sandboxes[i];
            let (p, _) = crate::store::sandboxes::Persisted::from_config(s);
            assert_eq!(&p.to_config(None).unwrap(), s, "sandbox {i}");
        }
    }

    #[test]
    fn ssh_config_alias_resolution() {
        let home = TempDir::new();
        let key = home.write(".ssh/gpu1_key", "x");
        let cfg = home.write(".ssh/config", SSH_CONFIG);
        let list = r#"[{"ssh_config_host":"gpu1"},{"ssh_config_host":"bare"},{"ssh_config_host":"db.internal"}]"#;
        let c = load_with(&home, &[(LIST_VAR, list)], None, Some(&cfg)).unwrap();
        assert_eq!(c.names(), vec!["gpu1", "bare", "db.internal"]);
        let t = ssh(&c, 0);
        assert_eq!(
            (t.host.as_str(), t.port, t.user.as_str()),
            ("10.0.0.5", 2200, "alice")
        );
        // Hops are resolved like ssh does: aliases through their Host block, the user
        // defaulting to the target's.
        assert_eq!(
            hops(t),
            vec!["alice@bastion.example.com:22", "jumper@10.9.9.9:2022"]
        );
        // Neither hop's block names an IdentityFile: they use the target's credentials.
        assert!(t.proxy_jump.iter().all(|h| h.auth == t.auth));
        assert_eq!(t.connect_timeout, Duration::from_secs(7));
        assert_eq!(
            t.auth,
            Auth::Auto {
                identity_files: vec![key],
                default_keys: vec![],
                passphrase: None,
                agent: Default::default(),
            }
        );
        // no HostName: the alias itself is the host, like ssh
        let t = ssh(&c, 1);
        assert_eq!(
            (t.host.as_str(), t.port, t.user.as_str()),
            ("bare", 22, "bob")
        );
        assert_eq!(t.proxy_jump, vec![]);
        assert_eq!(ssh(&c, 2).host, "db.internal.example.org");
    }

    #[test]
    fn ssh_config_explicit_fields_win() {
        let home = TempDir::new();
        home.write(".ssh/gpu1_key", "x");
        let cfg = home.write(".ssh/config", SSH_CONFIG);
        let list = format!(
            r#"[{{"name":"g","ssh_config_host":"gpu1","host":"192.168.1.1","port":22,"user":"root","password":"{SECRET}","host_key_policy":"off"}}]"#
        );
        let c = load_with(&home, &[(LIST_VAR, &list)], None, Some(&cfg)).unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(c.names(), vec!["g"]);
        let t = ssh(&c, 0);
        assert_eq!(
            (t.host.as_str(), t.port, t.user.as_str()),
            ("192.168.1.1", 22, "root")
        );
        assert_eq!(t.auth, Auth::Password(Secret::new(SECRET)));
        assert_eq!(t.host_key_policy, HostKeyPolicy::Off);
        // ProxyJump still carried from the alias
        assert_eq!(
            hops(t),
            vec!["root@bastion.example.com:22", "jumper@10.9.9.9:2022"]
        );
        assert!(
            t.proxy_jump
                .iter()
                .all(|h| h.auth == t.auth && h.host_key_policy == HostKeyPolicy::Off)
        );
    }

    #[test]
    fn ssh_config_missing_file_or_user() {
        let home = TempDir::new();
        let missing = home.path().join(".ssh/config");
        let e = load_with(
            &home,
            &[(LIST_VAR, r#"[{"ssh_config_host":"gpu1"}]"#)],
            None,
            Some(&missing),
        )
        .unwrap_err();
        assert!(
            e.message.contains("sets 'ssh_config_host' but")
                && e.message.contains("does not exist"),
            "{}",
            e.message
        );
        let cfg = home.write(".ssh/config", "Host nouser\n    HostName 1.2.3.4\n");
        let e = load_with(
            &home,
            &[(LIST_VAR, r#"[{"ssh_config_host":"nouser"}]"#)],
            None,
            Some(&cfg),
        )
        .unwrap_err();
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0] missing required field: 'user'"
        );
    }

    /// OpenSSH's files come from the passwd home, rsb's from `$HOME`: with the two apart, `~`
    /// in the ssh config (IdentityFile, UserKnownHostsFile), the default `~/.ssh/known_hosts`
    /// and the default identities are the passwd home's, while `~` in rsb's own `key_file` and
    /// the state dir stay under `$HOME`.
    #[test]
    fn ssh_files_follow_the_passwd_home_and_rsb_files_home() {
        let home = TempDir::new();
        let pw = TempDir::new();
        let cfg = pw.write(
            ".ssh/config",
            "Host box\n    HostName 127.0.0.9\n    User u\n    IdentityFile ~/.ssh/box_key\n\n\
             Host kh\n    HostName 127.0.0.8\n    User u\n    UserKnownHostsFile ~/.ssh/kh\n",
        );
        pw.write(".ssh/box_key", "k");
        pw.write(".ssh/id_ed25519", "k");
        home.write(".ssh/id_rsa", "not the one ssh uses");
        home.write("rsb_key", "k");
        let env: HashMap<String, String> = [
            (
                LIST_VAR.to_string(),
                r#"[{"ssh_config_host":"box"},{"ssh_config_host":"kh"},
                    {"name":"own","host":"127.0.0.7","user":"u","key_file":"~/rsb_key"}]"#
                    .to_string(),
            ),
            ("RSB_STATE_DIR".to_string(), "~/state".to_string()),
        ]
        .into_iter()
        .collect();
        let lookup = move |k: &str| env.get(k).cloned();
        let c = Config::from_sources(&lookup, None, Some(&cfg), home.path(), pw.path()).unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let state = c.state_dir.clone();
        assert_eq!(state, home.path().join("state"));
        let b = ssh(&c, 0);
        assert_eq!(
            b.auth,
            Auth::Auto {
                identity_files: vec![pw.path().join(".ssh/box_key")],
                default_keys: vec![pw.path().join(".ssh/id_ed25519")],
                passphrase: None,
                agent: Default::default(),
            }
        );
        assert_eq!(
            b.known_hosts,
            vec![
                pw.path().join(".ssh/known_hosts"),
                state.join("known_hosts")
            ]
        );
        assert_eq!(
            ssh(&c, 1).known_hosts,
            vec![pw.path().join(".ssh/kh"), state.join("known_hosts")]
        );
        assert_eq!(
            ssh(&c, 2).auth,
            Auth::KeyFile {
                path: home.path().join("rsb_key"),
                passphrase: None
            }
        );
    }
}
