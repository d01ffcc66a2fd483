//! Configuration: which sandboxes exist, how to reach them, and the server-wide knobs.
//!
//! rsb reads the Python `remote-sandbox-mcp` environment variables unchanged, so a user switches
//! by changing only the command line. On top of them it reads an optional TOML file and resolves
//! `~/.ssh/config` aliases.
//!
//! # Where the sandbox list comes from (first match wins, the rest is ignored with a warning)
//! 1. `REMOTE_SANDBOX_LIST` (JSON array), when set and not blank.
//! 2. `REMOTE_HOST` (+ `REMOTE_PORT`, `REMOTE_USER`, `REMOTE_PASSWORD`, `REMOTE_KEY_FILE`,
//!    `REMOTE_KEY_PASSPHRASE`), when set and not blank.
//! 3. The TOML file at [`config_file_path`] (`RSB_CONFIG` overrides), when it exists and has at
//!    least one `[[sandbox]]`.
//! 4. One built-in sandbox named `local` ([`Transport::Local`]).
//!
//! Server-wide settings (`REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS`, `REMOTE_SANDBOX_INLINE_SYNC_*`,
//! `RSB_HOST_KEY_POLICY`, `RSB_STATE_DIR`) are read from the environment whatever the source.
//!
//! # Differences from the Python server (for the README)
//! - A malformed `REMOTE_SANDBOX_LIST` never echoes characters of the value (the seed quoted 15
//!   raw characters around the error, leaking passwords): errors give the JSON error kind plus
//!   line/column, field names and indexes only.
//! - A duplicate sandbox `name` is an error (the seed silently overwrote the first).
//! - A sandbox with neither `password` nor `key_file` is not an error: it gets [`Auth::Auto`]
//!   (`~/.ssh/config` IdentityFile(s), then ssh-agent, then `~/.ssh/id_ed25519|id_ecdsa|id_rsa`).
//!   Same for the legacy variables (the seed required `REMOTE_PASSWORD` or `REMOTE_KEY_FILE`).
//! - `port` may be a JSON number or a numeric string; anything else is an error naming the field.
//! - `name`, `host`, `user` and `key_file` in `REMOTE_SANDBOX_LIST` are trimmed (the seed kept
//!   whitespace, which made such names unselectable); `password`/`key_passphrase` are not.
//!   The legacy variables are all trimmed, **including `REMOTE_PASSWORD`**, exactly as the seed.
//! - Both `password` and `key_file`: the key is used, as in the seed; the password is ignored.
//! - Inline sync limits default to 200 files / 64 MiB as the seed's README promises (its code
//!   capped them at 10 / 1 MiB), and the variables can raise them as well as lower them. `0`
//!   means "always background". A value that is not a non-negative integer falls back to the
//!   default with a warning.
//! - Extras: `ssh_config_host`, `host_key_policy`, `local`, `connect_timeout_s`, `password_env`,
//!   `key_passphrase_env`, `sudo_password_env` per sandbox; unknown fields in `REMOTE_SANDBOX_LIST` are ignored with a
//!   warning (the seed ignored them silently); unknown keys in the TOML file are errors.
//! - Host keys are checked (accept-new by default) against `~/.ssh/known_hosts` and rsb's own
//!   `<state_dir>/known_hosts`; the seed accepted any key.
//! - `ssh_config_host` also brings ProxyJump: each hop ([`Hop`]) is resolved through its own Host
//!   block (User, Port, IdentityFile, StrictHostKeyChecking, UserKnownHostsFile); `host` and hops
//!   accept IPv6 literals (`[::1]`, `admin@[::1]:2222`).

mod confine;
mod entry;
mod env;
mod fields;
mod hops;
mod policy;
mod secrets;
mod slurm;
mod sources;
mod ssh_config;
mod state_dir;
#[cfg(test)]
mod test_support;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use confine::{ConfineRules, Net, landlock_can, reads_words};
pub use hops::{Hop, host_port};
pub use policy::{
    ASK_ACTIONS_VAR as POLICY_ASK_ACTIONS_VAR, ASK_VAR as POLICY_ASK_VAR, Action as PolicyAction,
    DENY_VAR as POLICY_DENY_VAR, PolicyRules,
};
pub use secrets::Secret;
pub use slurm::{SlurmDefaults, SlurmOptions};
pub use sources::{
    BUILTIN_LOCAL, check_unconfigured_env, check_unknown_vars, config_file_path, env_truthy,
};
pub use ssh_config::ssh_config_file;
pub use state_dir::{KNOWN_HOSTS, default_state_dir, ensure_private_dir, state_dir};

use entry::{Entry, build_sandbox};
use env::{real_env, real_home};
use fields::Text;
use sources::{parse_limit, parse_truthy};
use ssh_config::{local_user, ssh_config_path, ssh_home};
use state_dir::resolve_state_dir;

/// Inline sync limits the seed's README documents.
pub const DEFAULT_INLINE_SYNC_MAX_FILES: u64 = 200;
pub const DEFAULT_INLINE_SYNC_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// The seed's paramiko connect/auth/banner timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------------------------

/// How to authenticate to an SSH sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Auth {
    Password(Secret),
    KeyFile {
        path: PathBuf,
        passphrase: Option<Secret>,
    },
    /// ssh-agent only (`SSH_AUTH_SOCK`). Not produced by the config loader; for callers.
    Agent,
    /// No explicit credential. Try, in order: `identity_files` (from `~/.ssh/config`), the
    /// ssh-agent (`SSH_AUTH_SOCK`), then `default_keys`. Keys that need a passphrase use
    /// `passphrase` when given, and are skipped otherwise.
    Auto {
        /// IdentityFile entries of the `ssh_config_host` alias that exist, in file order.
        identity_files: Vec<PathBuf>,
        /// `~/.ssh/id_ed25519`, `id_ecdsa`, `id_rsa`: those that existed at load time.
        default_keys: Vec<PathBuf>,
        /// `key_passphrase` given without `key_file`.
        passphrase: Option<Secret>,
        /// Which ssh-agent to ask (`IdentityAgent` of the alias).
        agent: AgentSocket,
    },
}

/// Which ssh-agent [`Auth::Auto`] asks: `IdentityAgent` of the ssh config, as ssh reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AgentSocket {
    /// `SSH_AUTH_SOCK` of the process that connects (the default, and `IdentityAgent
    /// SSH_AUTH_SOCK`).
    #[default]
    Env,
    /// `IdentityAgent none`: no agent is asked.
    Off,
    /// A socket path, with `~` and `$VAR` expanded when the config is read (1Password,
    /// Secretive, a forwarded agent). It travels with the sandbox's stored definition, so the
    /// watchdog daemon, which launchd starts with the system's `SSH_AUTH_SOCK`, still asks
    /// the user's agent.
    Path(PathBuf),
}

impl AgentSocket {
    /// Whether there is an agent to ask: a path, or `SSH_AUTH_SOCK` set (in `env`).
    pub fn available(&self, env: &dyn Fn(&str) -> Option<String>) -> bool {
        match self {
            AgentSocket::Env => env("SSH_AUTH_SOCK").is_some_and(|s| !s.is_empty()),
            AgentSocket::Off => false,
            AgentSocket::Path(_) => true,
        }
    }
}

/// What to do with a server host key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostKeyPolicy {
    /// Record unknown keys in rsb's own known_hosts; refuse a changed key.
    #[default]
    AcceptNew,
    /// Only keys already in a known_hosts file.
    Strict,
    /// No checking at all (the seed's behaviour).
    Off,
}

impl HostKeyPolicy {
    /// Accepts `accept-new` (`accept_new`), `strict` (`yes`), `off` (`no`), any case.
    pub fn parse(s: &str) -> Option<HostKeyPolicy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "accept-new" | "accept_new" | "acceptnew" => Some(HostKeyPolicy::AcceptNew),
            "strict" | "yes" => Some(HostKeyPolicy::Strict),
            "off" | "no" | "none" => Some(HostKeyPolicy::Off),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            HostKeyPolicy::AcceptNew => "accept-new",
            HostKeyPolicy::Strict => "strict",
            HostKeyPolicy::Off => "off",
        }
    }
}

// One per sandbox, built once and read in place: boxing the SSH target would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// The agent runs as a local subprocess, no SSH.
    Local,
    Ssh(SshTarget),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshTarget {
    /// Address to connect to (after `~/.ssh/config` HostName resolution); an IPv6 literal is
    /// kept without brackets, as sockets and known_hosts lookups want it.
    pub host: String,
    pub port: u16,
    pub user: String,
    pub auth: Auth,
    /// `ProxyJump` from `~/.ssh/config`, outermost first. Typed rather than a `user@host:port`
    /// string so that each hop keeps what its own Host block says (identity, host keys) and an
    /// IPv6 literal never has to survive a second parse.
    pub proxy_jump: Vec<Hop>,
    pub host_key_policy: HostKeyPolicy,
    /// Read all; new keys are written to the last one (rsb's own, in the state dir).
    pub known_hosts: Vec<PathBuf>,
    pub connect_timeout: Duration,
}

impl SshTarget {
    /// `user@host:port` (`user@[::1]:22` for IPv6), for messages.
    pub fn address(&self) -> String {
        format!("{}@{}", self.user, host_port(&self.host, self.port))
    }

    /// The target itself as the last hop of its chain.
    pub fn as_hop(&self) -> Hop {
        Hop {
            host: self.host.clone(),
            port: self.port,
            user: self.user.clone(),
            auth: self.auth.clone(),
            host_key_policy: self.host_key_policy,
            known_hosts: self.known_hosts.clone(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxConfig {
    pub name: String,
    pub transport: Transport,
    /// `scheduler = "slurm"`: a login node whose background jobs go through Slurm, with the
    /// sandbox's `slurm = { ... }` defaults, under each job's own options.
    pub slurm: Option<SlurmDefaults>,
    /// `sudo_password_env`: the password `exec_bash(sudo=true)` gives sudo, read from that
    /// variable when the configuration loads; kept in memory only, never stored or passed on.
    pub sudo: Option<SudoPassword>,
    /// The sandbox's own `policy` rules, on top of the global ones ([`Config::policy`]).
    pub policy: PolicyRules,
    /// Landlock confinement of its commands: its own `confine`, else the file's `[confine]`.
    pub confine: Option<ConfineRules>,
}

impl SandboxConfig {
    /// Every secret this sandbox holds: its login password or key passphrase, its jump hosts'
    /// and its sudo password. What the audit log redacts and local children never see.
    pub fn secrets(&self) -> Vec<&Secret> {
        let mut out = Vec::new();
        if let Transport::Ssh(t) = &self.transport {
            for auth in std::iter::once(&t.auth).chain(t.proxy_jump.iter().map(|h| &h.auth)) {
                match auth {
                    Auth::Password(s) => out.push(s),
                    Auth::KeyFile { passphrase, .. } | Auth::Auto { passphrase, .. } => {
                        out.extend(passphrase.as_ref())
                    }
                    Auth::Agent => {}
                }
            }
        }
        out.extend(self.sudo.as_ref().map(|s| &s.password));
        out
    }
}

/// The sudo password of a sandbox and the variable it came from (for messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SudoPassword {
    pub var: String,
    pub password: Secret,
}

#[derive(Clone, Debug)]
pub struct Config {
    /// In configuration order; the first is the initially active sandbox. Never empty.
    pub sandboxes: Vec<SandboxConfig>,
    pub expose_advanced_tools: bool,
    pub inline_sync_max_files: u64,
    pub inline_sync_max_bytes: u64,
    /// The global `[policy]` rules (the file's table and `RSB_POLICY_DENY`/`RSB_POLICY_ASK`);
    /// each sandbox adds its own.
    pub policy: PolicyRules,
    pub state_dir: PathBuf,
    /// `REMOTE_SANDBOX_LIST` | `REMOTE_HOST` | `config file <path>` | `built-in local`.
    pub source: String,
    /// Non-fatal problems for the server to log (never contain secrets).
    pub warnings: Vec<String>,
}

impl Config {
    pub fn sandbox(&self, name: &str) -> Option<&SandboxConfig> {
        self.sandboxes.iter().find(|s| s.name == name)
    }
    pub fn names(&self) -> Vec<&str> {
        self.sandboxes.iter().map(|s| s.name.as_str()).collect()
    }
}

/// A configuration error: one line of message plus a hint. Never contains a secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub message: String,
    pub hint: String,
}

impl ConfigError {
    fn new(message: impl Into<String>, hint: impl Into<String>) -> Self {
        ConfigError {
            message: one_line(message.into()),
            hint: one_line(hint.into()),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

fn one_line(s: String) -> String {
    if s.contains(['\n', '\r']) {
        s.replace(['\n', '\r'], " ")
    } else {
        s
    }
}

/// [`Config::from_sources`] with this process's files and homes, and the given environment:
/// for a caller that needs to see which variables the loader reads.
pub fn load_with_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let home = real_home().unwrap_or_else(|| PathBuf::from("."));
    Config::from_sources(
        env,
        Some(&config_file_path()),
        Some(&ssh_config_path(&home)),
        &home,
        &ssh_home(&home),
    )
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

impl Config {
    /// Real environment, `config_file_path()`, `~/.ssh/config`; creates the state dir.
    pub fn load() -> Result<Config, ConfigError> {
        let home = real_home().ok_or_else(|| {
            ConfigError::new(
                "cannot determine the home directory",
                "Set HOME to your home directory.",
            )
        })?;
        let config_file = config_file_path();
        if real_env("RSB_CONFIG").is_some_and(|s| !s.trim().is_empty()) && !config_file.exists() {
            return Err(ConfigError::new(
                format!(
                    "RSB_CONFIG points to {}, which does not exist",
                    config_file.display()
                ),
                "Create that file, or unset RSB_CONFIG to use the default location.",
            ));
        }
        let ssh_config = ssh_config_path(&home);
        let cfg = Config::from_sources(
            &real_env,
            Some(&config_file),
            Some(&ssh_config),
            &home,
            &ssh_home(&home),
        )?;
        let vars: Vec<(String, String)> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
            .collect();
        if cfg.source == BUILTIN_LOCAL {
            check_unconfigured_env(&vars)?;
        } else {
            check_unknown_vars(&vars)?;
        }
        ensure_private_dir(&cfg.state_dir).map_err(|e| {
            ConfigError::new(
                format!(
                    "cannot create the state directory {}: {}",
                    cfg.state_dir.display(),
                    e.kind()
                ),
                "Set RSB_STATE_DIR to a writable directory.",
            )
        })?;
        Ok(cfg)
    }

    /// `rsb -s ALIAS` (or `rsb shell ALIAS`) with no rsb configuration at all: ALIAS as
    /// `ssh ALIAS` takes it, when the ssh config ([`ssh_config_path`]) has a `Host` line naming
    /// it literally (a wildcard pattern is not an alias). The one sandbox, named ALIAS, is
    /// `ssh_config_host = ALIAS`; a block without `User` means the local login name, as for
    /// `ssh`. `Ok(None)`: no such Host (the caller reports the unknown sandbox).
    pub fn from_ssh_alias(builtin: &Config, alias: &str) -> Result<Option<Config>, ConfigError> {
        let Some(home) = real_home() else {
            return Ok(None);
        };
        let path = ssh_config_path(&home);
        if alias.trim().is_empty() || !path.is_file() {
            return Ok(None);
        }
        let policy = real_env("RSB_HOST_KEY_POLICY")
            .and_then(|v| HostKeyPolicy::parse(&v))
            .unwrap_or_default();
        let mut warnings = Vec::new();
        let ssh_home = ssh_home(&home);
        let mut ctx = BuildCtx {
            env: &real_env,
            home: &home,
            ssh_home: &ssh_home,
            ssh_config_path: Some(&path),
            ssh_config: None,
            state_dir: &builtin.state_dir,
            defaults: Defaults {
                host_key_policy: policy,
                connect_timeout: DEFAULT_CONNECT_TIMEOUT,
                confine: None,
            },
            warnings: &mut warnings,
            policy: PolicyRules::default(),
        };
        let label = format!("-s {alias}");
        let params = ctx.ssh_query(alias, &label)?;
        let literal = ctx.ssh_config.as_ref().is_some_and(|c| {
            c.get_hosts()
                .iter()
                .flat_map(|h| &h.pattern)
                .any(|p| !p.negated && p.pattern == alias)
        });
        if !literal {
            return Ok(None);
        }
        let entry = Entry {
            name: Text(Some(alias.to_string())),
            ssh_config_host: Text(Some(alias.to_string())),
            user: Text(params.user.is_none().then(local_user).flatten()),
            ..Entry::default()
        };
        let sandbox = build_sandbox(entry, &label, &mut ctx)?;
        let mut cfg = builtin.clone();
        cfg.sandboxes = vec![sandbox];
        cfg.source = format!("Host {alias} in {}", path.display());
        cfg.warnings = warnings;
        Ok(Some(cfg))
    }

    /// Builds the configuration from injected sources; reads files but changes nothing.
    /// `config_file`/`ssh_config` that do not exist are treated as absent (an `ssh_config_host`
    /// then fails with a clear error).
    pub fn from_sources(
        env: &dyn Fn(&str) -> Option<String>,
        config_file: Option<&Path>,
        ssh_config: Option<&Path>,
        home: &Path,
        ssh_home: &Path,
    ) -> Result<Config, ConfigError> {
        let mut warnings = Vec::new();
        let state_dir = resolve_state_dir(env, home);

        let expose_advanced_tools = parse_truthy(env, &mut warnings);
        let inline_sync_max_files = parse_limit(
            env,
            "REMOTE_SANDBOX_INLINE_SYNC_MAX_FILES",
            DEFAULT_INLINE_SYNC_MAX_FILES,
            &mut warnings,
        );
        let inline_sync_max_bytes = parse_limit(
            env,
            "REMOTE_SANDBOX_INLINE_SYNC_MAX_BYTES",
            DEFAULT_INLINE_SYNC_MAX_BYTES,
            &mut warnings,
        );

        let env_policy = match env("RSB_HOST_KEY_POLICY").filter(|s| !s.trim().is_empty()) {
            None => None,
            Some(v) => Some(HostKeyPolicy::parse(&v).ok_or_else(|| {
                ConfigError::new(
                    "RSB_HOST_KEY_POLICY must be one of accept-new, strict, off",
                    "accept-new records unknown host keys and refuses changed ones (default).",
                )
            })?),
        };

        let mut ctx = BuildCtx {
            env,
            home,
            ssh_home,
            ssh_config_path: ssh_config,
            ssh_config: None,
            state_dir: &state_dir,
            defaults: Defaults {
                host_key_policy: env_policy.unwrap_or_default(),
                connect_timeout: DEFAULT_CONNECT_TIMEOUT,
                confine: None,
            },
            warnings: &mut warnings,
            policy: policy::from_env(env)?,
        };

        let (sandboxes, source) = sources::sandboxes(env, config_file, env_policy, &mut ctx)?;
        let policy = std::mem::take(&mut ctx.policy);

        Ok(Config {
            sandboxes,
            expose_advanced_tools,
            inline_sync_max_files,
            inline_sync_max_bytes,
            policy,
            state_dir,
            source,
            warnings,
        })
    }
}

/// What the file and the environment set for every sandbox, before an entry's own keys.
struct Defaults {
    host_key_policy: HostKeyPolicy,
    connect_timeout: Duration,
    /// The file's `[confine]`.
    confine: Option<ConfineRules>,
}

/// Everything building a sandbox needs besides its entry, shared by all the sources so that
/// one ssh config is parsed once and every warning lands in one list.
struct BuildCtx<'a> {
    env: &'a dyn Fn(&str) -> Option<String>,
    /// `$HOME`: `~` in rsb's own config.
    home: &'a Path,
    /// [`ssh_home`]: `~` in the ssh config, and the default known_hosts and identities.
    ssh_home: &'a Path,
    ssh_config_path: Option<&'a Path>,
    /// Parsed lazily, once.
    ssh_config: Option<ssh2_config::SshConfig>,
    state_dir: &'a Path,
    defaults: Defaults,
    warnings: &'a mut Vec<String>,
    /// The global policy rules read so far (the environment's, then the file's table).
    policy: PolicyRules,
}

impl BuildCtx<'_> {
    fn warn(&mut self, w: String) {
        self.warnings.push(w);
    }
}
