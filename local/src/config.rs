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
//!   `key_passphrase_env` per sandbox; unknown fields in `REMOTE_SANDBOX_LIST` are ignored with a
//!   warning (the seed ignored them silently); unknown keys in the TOML file are errors.
//! - Host keys are checked (accept-new by default) against `~/.ssh/known_hosts` and rsb's own
//!   `<state_dir>/known_hosts`; the seed accepted any key.
//! - `ssh_config_host` also brings ProxyJump: each hop ([`Hop`]) is resolved through its own Host
//!   block (User, Port, IdentityFile, StrictHostKeyChecking, UserKnownHostsFile); `host` and hops
//!   accept IPv6 literals (`[::1]`, `admin@[::1]:2222`).

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rsb_rules::path::expand_tilde;
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeOwned},
};
use serde_json::Value;

/// Inline sync limits the seed's README documents.
pub const DEFAULT_INLINE_SYNC_MAX_FILES: u64 = 200;
pub const DEFAULT_INLINE_SYNC_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// The seed's paramiko connect/auth/banner timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

const LIST_VAR: &str = "REMOTE_SANDBOX_LIST";
const TRUTHY: [&str; 4] = ["1", "true", "yes", "on"];
const FALSY: [&str; 4] = ["0", "false", "no", "off"];
/// Default keys for [`Auth::Auto`] (tried after the agent), in this order.
const DEFAULT_KEY_NAMES: [&str; 3] = ["id_ed25519", "id_ecdsa", "id_rsa"];

// ---------------------------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------------------------

/// A credential. Never printed (Debug/Display show `***`), never serialized.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

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
    },
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
fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .filter(|h| h.contains(':'))
        .unwrap_or(host)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxConfig {
    pub name: String,
    pub transport: Transport,
    /// `scheduler = "slurm"`: a login node whose background jobs go through Slurm, with the
    /// sandbox's `slurm = { ... }` defaults (see `crate::slurm`).
    pub slurm: Option<crate::slurm::SlurmDefaults>,
}

#[derive(Clone, Debug)]
pub struct Config {
    /// In configuration order; the first is the initially active sandbox. Never empty.
    pub sandboxes: Vec<SandboxConfig>,
    pub expose_advanced_tools: bool,
    pub inline_sync_max_files: u64,
    pub inline_sync_max_bytes: u64,
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

// ---------------------------------------------------------------------------------------------
// Paths
// ---------------------------------------------------------------------------------------------

fn project_dirs() -> Option<directories::ProjectDirs> {
    directories::ProjectDirs::from("", "", "rsb")
}

fn real_home() -> Option<PathBuf> {
    directories::BaseDirs::new()
        .map(|b| b.home_dir().to_path_buf())
        .or_else(|| std::env::var_os("HOME").map(PathBuf::from))
}

fn real_env(key: &str) -> Option<String> {
    std::env::var(key).ok()
}

/// `RSB_STATE_DIR`, else the seed's `REMOTE_SANDBOX_MCP_HOME` (so a user moving from the Python
/// server keeps one place for state; rsb's files there do not collide with the seed's), else the
/// platform data dir for "rsb", else `~/.local/share/rsb`. Pure.
fn resolve_state_dir(env: &dyn Fn(&str) -> Option<String>, home: &Path) -> PathBuf {
    for var in ["RSB_STATE_DIR", "REMOTE_SANDBOX_MCP_HOME"] {
        if let Some(dir) = env(var).filter(|s| !s.trim().is_empty()) {
            return expand_tilde(dir.trim(), home);
        }
    }
    project_dirs()
        .map(|p| p.data_dir().to_path_buf())
        .unwrap_or_else(|| home.join(".local").join("share").join("rsb"))
}

/// The state dir with no `RSB_STATE_DIR` / `REMOTE_SANDBOX_MCP_HOME`: what a process whose
/// environment lost those variables uses (an MCP client that passes only `HOME`, say).
pub fn default_state_dir() -> PathBuf {
    let home = real_home().unwrap_or_else(|| PathBuf::from("."));
    resolve_state_dir(&|_| None, &home)
}

/// The platform data dir for rsb (`RSB_STATE_DIR` overrides), created with mode 0700.
/// Creation errors are ignored here; [`Config::load`] reports them.
pub fn state_dir() -> PathBuf {
    let home = real_home().unwrap_or_else(|| PathBuf::from("."));
    let dir = resolve_state_dir(&real_env, &home);
    let _ = crate::store::ensure_private_dir(&dir);
    dir
}

/// `RSB_CONFIG`, else `<platform config dir>/rsb/config.toml`.
pub fn config_file_path() -> PathBuf {
    let home = real_home().unwrap_or_else(|| PathBuf::from("."));
    if let Some(p) = real_env("RSB_CONFIG").filter(|s| !s.trim().is_empty()) {
        return expand_tilde(p.trim(), &home);
    }
    project_dirs()
        .map(|p| p.config_dir().to_path_buf())
        .unwrap_or_else(|| home.join(".config").join("rsb"))
        .join("config.toml")
}

/// The home directory OpenSSH uses for `~` in its config, `~/.ssh/known_hosts` and the default
/// identities: the passwd entry's, never `$HOME` (`ssh` ignores it), so a client that starts
/// rsb with another `HOME` (or `sudo -E`, or a `HOME=/tmp` wrapper) still sees the aliases, keys
/// and host keys `ssh` sees. `home` (`$HOME`) only where the passwd database has no entry for
/// this user. rsb's own files (its config, state dir, a config entry's `key_file`) follow
/// `$HOME`, as other XDG tools do.
fn ssh_home(home: &Path) -> PathBuf {
    rsb_agent::util::passwd_entry()
        .map(|p| p.home)
        .filter(|h| h.is_absolute())
        .unwrap_or_else(|| home.to_path_buf())
}

/// The OpenSSH client configuration rsb reads: `RSB_SSH_CONFIG` when set (tests, or a user with
/// a second ssh config), else `.ssh/config` under [`ssh_home`], as OpenSSH finds it.
fn ssh_config_path(home: &Path) -> PathBuf {
    if let Some(p) = real_env("RSB_SSH_CONFIG").filter(|s| !s.trim().is_empty()) {
        return expand_tilde(p.trim(), home);
    }
    ssh_home(home).join(".ssh").join("config")
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

/// [`ssh_config_path`] for this process: what `rsb doctor` and hints name.
pub fn ssh_config_file() -> PathBuf {
    ssh_config_path(&real_home().unwrap_or_else(|| PathBuf::from(".")))
}

/// The login name of this user, as `ssh` uses it when a Host block sets no `User`.
fn local_user() -> Option<String> {
    rsb_agent::util::passwd_entry()
        .map(|p| p.name)
        .filter(|n| !n.is_empty())
        .or_else(|| real_env("USER").filter(|u| !u.is_empty()))
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
        if cfg.source == BUILTIN_LOCAL {
            let vars: Vec<(String, String)> = std::env::vars_os()
                .filter_map(|(k, v)| {
                    Some((k.into_string().ok()?, v.to_string_lossy().into_owned()))
                })
                .collect();
            check_unconfigured_env(&vars)?;
        }
        crate::store::ensure_private_dir(&cfg.state_dir).map_err(|e| {
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
            },
            warnings: &mut warnings,
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
            },
            warnings: &mut warnings,
        };

        let list = env(LIST_VAR).filter(|s| !s.trim().is_empty());
        let legacy_host = env("REMOTE_HOST").filter(|s| !s.trim().is_empty());
        let file = config_file.filter(|p| p.is_file());

        let (sandboxes, source) = if let Some(list) = list {
            if legacy_host.is_some() {
                ctx.warn("REMOTE_HOST is ignored because REMOTE_SANDBOX_LIST is set".into());
            }
            if let Some(f) = file {
                ctx.warn(format!(
                    "config file {} is ignored because REMOTE_SANDBOX_LIST is set",
                    f.display()
                ));
            }
            (parse_list(&list, &mut ctx)?, LIST_VAR.to_string())
        } else if let Some(host) = legacy_host {
            if let Some(f) = file {
                ctx.warn(format!(
                    "config file {} is ignored because REMOTE_HOST is set",
                    f.display()
                ));
            }
            (
                vec![parse_legacy(&host, &mut ctx)?],
                "REMOTE_HOST".to_string(),
            )
        } else if let Some(f) = file {
            let sandboxes = parse_toml_file(f, env_policy, &mut ctx)?;
            if sandboxes.is_empty() {
                ctx.warn(format!(
                    "config file {} defines no [[sandbox]]; serving the built-in local sandbox",
                    f.display()
                ));
                (vec![builtin_local()], BUILTIN_LOCAL.to_string())
            } else {
                (sandboxes, format!("config file {}", f.display()))
            }
        } else {
            (vec![builtin_local()], BUILTIN_LOCAL.to_string())
        };

        Ok(Config {
            sandboxes,
            expose_advanced_tools,
            inline_sync_max_files,
            inline_sync_max_bytes,
            state_dir,
            source,
            warnings,
        })
    }
}

/// [`Config::source`] when nothing configures a sandbox.
pub const BUILTIN_LOCAL: &str = "built-in local";

/// Every `REMOTE_*` / `RSB_*` variable rsb (or its test and bench harness) reads, and the
/// `RSB_*` names rsb itself sets for a resumed job. Anything else with those prefixes is a
/// name rsb does not know.
const KNOWN_VARS: &[&str] = &[
    LIST_VAR,
    "REMOTE_HOST",
    "REMOTE_PORT",
    "REMOTE_USER",
    "REMOTE_PASSWORD",
    "REMOTE_KEY_FILE",
    "REMOTE_KEY_PASSPHRASE",
    "REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS",
    "REMOTE_SANDBOX_MCP_HOME",
    "REMOTE_SANDBOX_INLINE_SYNC_MAX_FILES",
    "REMOTE_SANDBOX_INLINE_SYNC_MAX_BYTES",
    "RSB_CONFIG",
    "RSB_SSH_CONFIG",
    "RSB_STATE_DIR",
    "RSB_SANDBOX",
    "RSB_LOG",
    "RSB_HOST_KEY_POLICY",
    "RSB_ALLOW_WATCH_HOOKS",
    "RSB_WATCHDOG_STORE_PASSWORDS",
    "RSB_AGENT_DIR",
    "RSB_LOCAL_AGENT",
    "RSB_CACHE_DIR",
    "RSB_NVIDIA_SMI_TIMEOUT_MS",
    "RSB_SYNC_FSYNC",
    "RSB_SYNC_TIMING",
    "RSB_SYNC_COMPRESS",
    "RSB_SYNC_HANDOFF_S",
    "RSB_EMBED_AGENTS_DIR",
    "RSB_BUILD_AGENTS",
    "RSB_REQUIRE_AARCH64",
    "RSB_PROTOCOL_FINGERPRINT",
    "RSB_CHECKPOINT",
    "RSB_RESUME_ATTEMPT",
    "RSB_WATCH_ID",
    "RSB_JOB_NAME",
];
/// Prefixes of the harness's own variables (tests, benches, the job wrapper's children).
const KNOWN_VAR_PREFIXES: &[&str] = &[
    "RSB_TEST",
    "RSB_BENCH_",
    "RSB_SOAK_",
    "RSB_SWEEP_",
    "RSB_WATCH_BENCH_",
    "RSB_JOBS_CHILD_",
];
/// The variables that name where sandboxes come from: one of them set but empty, or a
/// connection variable without `REMOTE_HOST`, means the user meant a remote sandbox.
const SANDBOX_VARS: &[&str] = &[LIST_VAR, "REMOTE_HOST", "RSB_CONFIG"];
const LEGACY_PART_VARS: &[&str] = &[
    "REMOTE_PORT",
    "REMOTE_USER",
    "REMOTE_PASSWORD",
    "REMOTE_KEY_FILE",
    "REMOTE_KEY_PASSPHRASE",
];

/// With nothing configured rsb serves the built-in `local` sandbox: this machine. An
/// environment that *tried* to configure a sandbox and failed (a misspelt `REMOTE_HOSTNAME`, an
/// empty `REMOTE_HOST`, a `REMOTE_USER` without a host) must not silently become "run the
/// model's commands here": it is a configuration error, which every MCP tool call then reports.
/// `vars` is the whole environment; values are only tested for blankness, never quoted.
pub fn check_unconfigured_env(vars: &[(String, String)]) -> Result<(), ConfigError> {
    let hint_tail = "with nothing configured at all rsb serves the built-in `local` sandbox (this machine); `rsb config check` shows the result";
    for (k, v) in vars {
        if SANDBOX_VARS.contains(&k.as_str()) && v.trim().is_empty() {
            return Err(ConfigError::new(
                format!("{k} is set but empty, so no sandbox is configured"),
                format!("give {k} a value or unset it; {hint_tail}"),
            ));
        }
    }
    if let Some((k, _)) = vars
        .iter()
        .find(|(k, v)| LEGACY_PART_VARS.contains(&k.as_str()) && !v.trim().is_empty())
    {
        return Err(ConfigError::new(
            format!("{k} is set but REMOTE_HOST is not, so no sandbox is configured"),
            format!("set REMOTE_HOST (or REMOTE_SANDBOX_LIST) too, or unset {k}; {hint_tail}"),
        ));
    }
    let mut unknown: Vec<&str> = vars
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| {
            (k.starts_with("REMOTE_") || k.starts_with("RSB_"))
                && !KNOWN_VARS.contains(k)
                && !KNOWN_VAR_PREFIXES.iter().any(|p| k.starts_with(p))
        })
        .filter(|k| {
            // `RSB_*` is rsb's own prefix; other programs use `REMOTE_*` too (VS Code's
            // `REMOTE_CONTAINERS`), so those count only when they look like one of ours.
            k.starts_with("RSB_") || k.starts_with("REMOTE_SANDBOX_") || nearest_var(k).is_some()
        })
        .collect();
    unknown.sort_unstable();
    if let Some(k) = unknown.first() {
        let dym = match nearest_var(k) {
            Some(n) => format!("did you mean {n}? "),
            None => String::new(),
        };
        return Err(ConfigError::new(
            format!("{k} is not a variable rsb reads, and nothing else configures a sandbox"),
            format!("{dym}see the README's Configuration table for the names; {hint_tail}"),
        ));
    }
    Ok(())
}

/// The known variable `name` is most likely a typo of.
fn nearest_var(name: &str) -> Option<&'static str> {
    KNOWN_VARS
        .iter()
        .map(|k| (strsim::normalized_damerau_levenshtein(name, k), *k))
        .filter(|(s, _)| *s >= 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

fn builtin_local() -> SandboxConfig {
    SandboxConfig {
        name: "local".to_string(),
        transport: Transport::Local,
        slurm: None,
    }
}

fn parse_truthy(env: &dyn Fn(&str) -> Option<String>, warnings: &mut Vec<String>) -> bool {
    let key = "REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS";
    let Some(raw) = env(key) else { return false };
    let v = raw.trim().to_ascii_lowercase();
    if TRUTHY.contains(&v.as_str()) {
        return true;
    }
    if !v.is_empty() && !FALSY.contains(&v.as_str()) {
        warnings.push(format!(
            "{key} is not one of 1/true/yes/on or 0/false/no/off; advanced tools stay hidden"
        ));
    }
    false
}

fn parse_limit(
    env: &dyn Fn(&str) -> Option<String>,
    key: &str,
    default: u64,
    warnings: &mut Vec<String>,
) -> u64 {
    let Some(raw) = env(key) else { return default };
    let v = raw.trim();
    if v.is_empty() {
        return default;
    }
    match v.strip_prefix('+').unwrap_or(v).parse::<u64>() {
        Ok(n) => n,
        Err(_) => {
            warnings.push(format!(
                "{key} is not a non-negative integer; using the default {default}"
            ));
            default
        }
    }
}

struct Defaults {
    host_key_policy: HostKeyPolicy,
    connect_timeout: Duration,
}

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
}

impl BuildCtx<'_> {
    fn warn(&mut self, w: String) {
        self.warnings.push(w);
    }

    fn known_hosts(&self) -> Vec<PathBuf> {
        vec![
            self.ssh_home.join(".ssh").join("known_hosts"),
            self.state_dir.join("known_hosts"),
        ]
    }

    fn default_keys(&self) -> Vec<PathBuf> {
        DEFAULT_KEY_NAMES
            .iter()
            .map(|n| self.ssh_home.join(".ssh").join(n))
            .filter(|p| p.is_file())
            .collect()
    }

    fn ssh_query(
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

// ---------------------------------------------------------------------------------------------
// One sandbox entry, from any source
// ---------------------------------------------------------------------------------------------

/// One sandbox entry as written, from `REMOTE_SANDBOX_LIST`, a `[[sandbox]]` table or the legacy
/// variables. serde checks the shape (and, for the TOML file, rejects unknown keys); each field's
/// type checks its own value and says what it must be in words of its own, because serde's
/// default messages quote the value (`invalid type: string "hunter2"`), which may be a secret.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct Entry {
    name: Text,
    host: Text,
    port: Port,
    user: Text,
    password: SecretText,
    password_env: Text,
    key_file: Text,
    key_passphrase: SecretText,
    key_passphrase_env: Text,
    ssh_config_host: Text,
    host_key_policy: Policy,
    local: Flag,
    connect_timeout_s: Seconds,
    scheduler: Text,
    slurm: Option<crate::slurm::SlurmDefaults>,
}

/// The TOML file's top level.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct FileConfig {
    host_key_policy: Policy,
    connect_timeout_s: Seconds,
    sandbox: Vec<Entry>,
    /// Read and checked by `crate::watchdog::settings` (alert hooks the user allows in their
    /// own file); accepted here so the rest of the file parses.
    #[allow(dead_code)]
    watchdog: Option<toml::Value>,
}

/// What a field's value must be: the whole of a type error's text, so no character of the
/// value can reach a message.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    Text,
    Port,
    Policy,
    Flag,
    Seconds,
}

impl Want {
    const ALL: [Want; 5] = [
        Want::Text,
        Want::Port,
        Want::Policy,
        Want::Flag,
        Want::Seconds,
    ];

    fn what(self) -> &'static str {
        match self {
            Want::Text => "a string",
            Want::Port => "an integer between 1 and 65535",
            Want::Policy => "one of accept-new, strict, off",
            Want::Flag => "true or false",
            Want::Seconds => "a positive number of seconds",
        }
    }

    fn error<E: de::Error>(self) -> E {
        E::custom(self.what())
    }

    /// The `Want` whose [`Want::error`] produced `message`, if any.
    fn of(message: &str) -> Option<Want> {
        Want::ALL.into_iter().find(|w| w.what() == message)
    }
}

/// Any value, reduced to what the field types need, without keeping text for errors.
enum Loose {
    Absent,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Other,
}

impl<'de> Deserialize<'de> for Loose {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Loose, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Loose;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Loose, E> {
                Ok(Loose::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Loose, E> {
                Ok(Loose::Int(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Loose, E> {
                Ok(Loose::Int(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Loose, E> {
                Ok(Loose::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Loose, E> {
                Ok(Loose::Str(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Loose, E> {
                Ok(Loose::Str(v))
            }
            fn visit_bytes<E>(self, _: &[u8]) -> Result<Loose, E> {
                Ok(Loose::Other)
            }
            fn visit_none<E>(self) -> Result<Loose, E> {
                Ok(Loose::Absent)
            }
            fn visit_unit<E>(self) -> Result<Loose, E> {
                Ok(Loose::Absent)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Loose, D::Error> {
                Loose::deserialize(d)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                while a.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                while a.next_entry::<de::IgnoredAny, de::IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// A string, trimmed; absent, null and blank are `None`.
#[derive(Default)]
struct Text(Option<String>);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Text(None)),
            Loose::Str(s) => Ok(Text(Some(s.trim().to_string()).filter(|s| !s.is_empty()))),
            _ => Err(Want::Text.error()),
        }
    }
}

/// A secret given literally: kept exactly (not trimmed); empty is `None`.
#[derive(Default)]
struct SecretText(Option<Secret>);

impl<'de> Deserialize<'de> for SecretText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SecretText, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(SecretText(None)),
            Loose::Str(s) if s.is_empty() => Ok(SecretText(None)),
            Loose::Str(s) => Ok(SecretText(Some(Secret(s)))),
            _ => Err(Want::Text.error()),
        }
    }
}

/// A port: an integer, an integral float or a numeric string; blank is `None`.
#[derive(Default)]
struct Port(Option<u16>);

impl<'de> Deserialize<'de> for Port {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Port, D::Error> {
        let port = match Loose::deserialize(d)? {
            Loose::Absent => return Ok(Port(None)),
            Loose::Str(s) if s.trim().is_empty() => return Ok(Port(None)),
            Loose::Str(s) => parse_port(&s),
            Loose::Int(n) => u16::try_from(n).ok(),
            Loose::Float(f) if f.fract() == 0.0 && (0.0..=65535.0).contains(&f) => Some(f as u16),
            _ => None,
        };
        match port.filter(|p| *p != 0) {
            Some(p) => Ok(Port(Some(p))),
            None => Err(Want::Port.error()),
        }
    }
}

/// `2222`, ` +2222 `; not 0.
fn parse_port(s: &str) -> Option<u16> {
    let s = s.trim();
    s.strip_prefix('+')
        .unwrap_or(s)
        .parse()
        .ok()
        .filter(|p| *p != 0)
}

#[derive(Default)]
struct Policy(Option<HostKeyPolicy>);

impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Policy, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Policy(None)),
            Loose::Str(s) if s.trim().is_empty() => Ok(Policy(None)),
            Loose::Str(s) => HostKeyPolicy::parse(&s)
                .map(|p| Policy(Some(p)))
                .ok_or_else(|| Want::Policy.error()),
            _ => Err(Want::Policy.error()),
        }
    }
}

#[derive(Default)]
struct Flag(bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Flag, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Flag(false)),
            Loose::Bool(b) => Ok(Flag(b)),
            _ => Err(Want::Flag.error()),
        }
    }
}

/// Seconds, integral or not, in (0, 1 day].
#[derive(Default)]
struct Seconds(Option<Duration>);

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Seconds, D::Error> {
        let secs = match Loose::deserialize(d)? {
            Loose::Absent => return Ok(Seconds(None)),
            Loose::Int(n) => n as f64,
            Loose::Float(f) => f,
            _ => f64::NAN,
        };
        if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 {
            Ok(Seconds(Some(Duration::from_secs_f64(secs))))
        } else {
            Err(Want::Seconds.error())
        }
    }
}

/// The field names serde derived for `T`, read by asking `T` to deserialize itself from a
/// deserializer that only records them: the struct stays the one list of valid keys.
fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Names<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("field names recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut fields));
    fields
}

/// Where a deserialization failed (`sandbox[0]` and the field) and why, in words that never
/// include a value: the field's [`Want`], an unknown key (named only when it looks like a
/// name), or only the place. Returns the message and its hint; `keys_hint` lists valid keys.
fn describe_de_error(
    path: &serde_path_to_error::Path,
    message: &str,
    keys_hint: &str,
) -> (String, String) {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let (field, parents) = match segments.split_last() {
        Some((Segment::Map { key }, parents)) => (Some(key.as_str()), parents),
        _ => (None, &segments[..]),
    };
    let mut place = String::new();
    for seg in parents {
        match seg {
            Segment::Seq { index } => place.push_str(&format!("[{index}]")),
            Segment::Map { key } => {
                if !place.is_empty() {
                    place.push('.');
                }
                place.push_str(key);
            }
            _ => {}
        }
    }
    let at = |what: String| {
        if place.is_empty() {
            what
        } else {
            format!("{place} {what}")
        }
    };
    let not_shown = "The value is not shown, to keep secrets out of logs.".to_string();
    if let Some(key) = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split('`').next())
    {
        let what = format!("unknown key {}", key_name(key));
        // The path ends at the unknown key itself, or at the table holding it.
        let msg = match field {
            Some(f) if f != key => at(format!("field '{f}' has {what}")),
            _ if place.is_empty() => what,
            _ => format!("{place} has {what}"),
        };
        return (msg, keys_hint.to_string());
    }
    let msg = match (field, Want::of(message)) {
        (Some(f), Some(want)) => at(format!("field '{f}' must be {}", want.what())),
        (Some(f), None) => at(format!("field '{f}' has a value of the wrong type")),
        (None, _) => at("must be a table".to_string()),
    };
    (msg, not_shown)
}

/// A secret given literally (`direct`) or by naming an environment variable (`by_env`).
fn resolve_secret(
    direct: SecretText,
    by_env: Text,
    field: &str,
    label: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Secret>, ConfigError> {
    let env_field = format!("{field}_env");
    match (direct.0, by_env.0) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            format!("{label} sets both '{field}' and '{env_field}'"),
            format!("Keep one: '{env_field}' names an environment variable holding the value."),
        )),
        (Some(v), None) => Ok(Some(v)),
        (None, Some(var)) => match env(&var).filter(|v| !v.is_empty()) {
            Some(v) => Ok(Some(Secret(v))),
            None => Err(ConfigError::new(
                format!(
                    "{label} field '{env_field}' names the environment variable {var}, which is not set"
                ),
                format!(
                    "Export {var} in the environment rsb starts with, or remove '{env_field}'."
                ),
            )),
        },
        (None, None) => Ok(None),
    }
}

/// Turns a checked entry into a sandbox: `~/.ssh/config` resolution, auth choice, defaults.
fn build_sandbox(
    e: Entry,
    label: &str,
    ctx: &mut BuildCtx<'_>,
) -> Result<SandboxConfig, ConfigError> {
    let password = resolve_secret(e.password, e.password_env, "password", label, ctx.env)?;
    let key_passphrase = resolve_secret(
        e.key_passphrase,
        e.key_passphrase_env,
        "key_passphrase",
        label,
        ctx.env,
    )?;
    let Entry {
        name: Text(name),
        host: Text(explicit_host),
        port: Port(explicit_port),
        user: Text(explicit_user),
        key_file: Text(key_file),
        ssh_config_host: Text(ssh_config_host),
        host_key_policy: Policy(explicit_policy),
        local: Flag(local),
        connect_timeout_s: Seconds(explicit_timeout),
        scheduler: Text(scheduler),
        slurm,
        ..
    } = e;
    let slurm = crate::slurm::from_config(scheduler.as_deref(), slurm)
        .map_err(|(m, h)| ConfigError::new(format!("{label}: {m}"), h))?;
    if local {
        let remote_fields = [
            ("host", explicit_host.is_some()),
            ("port", explicit_port.is_some()),
            ("user", explicit_user.is_some()),
            ("password", password.is_some()),
            ("key_file", key_file.is_some()),
            ("key_passphrase", key_passphrase.is_some()),
            ("ssh_config_host", ssh_config_host.is_some()),
        ];
        if let Some((field, _)) = remote_fields.iter().find(|(_, set)| *set) {
            return Err(ConfigError::new(
                format!("{label} has local = true and also sets '{field}'"),
                "A local sandbox runs on this machine; drop the SSH fields or set local = false.",
            ));
        }
        return Ok(SandboxConfig {
            name: name.unwrap_or_else(|| "local".to_string()),
            transport: Transport::Local,
            slurm,
        });
    }

    let params = match &ssh_config_host {
        Some(alias) => Some(ctx.ssh_query(alias, label)?),
        None => None,
    };
    let alias = ssh_config_host.as_deref();

    // host: explicit, else HostName (with %h), else the alias itself (as ssh does).
    let host = explicit_host
        .clone()
        .or_else(|| {
            let hn = params.as_ref()?.host_name.clone()?;
            Some(
                hn.replace("%h", alias.unwrap_or_default())
                    .replace("%%", "%"),
            )
        })
        .or_else(|| alias.map(str::to_string))
        .ok_or_else(|| missing(label, "host"))?;
    let host = unbracket(&host).to_string();
    let user = explicit_user
        .or_else(|| params.as_ref()?.user.clone())
        .ok_or_else(|| missing(label, "user"))?;
    let port = explicit_port
        .or_else(|| params.as_ref()?.port)
        .unwrap_or(22);
    let name = name
        .or_else(|| explicit_host.clone())
        .or_else(|| alias.map(str::to_string))
        .unwrap_or_else(|| host.clone());
    let connect_timeout = explicit_timeout
        .or_else(|| params.as_ref()?.connect_timeout)
        .unwrap_or(ctx.defaults.connect_timeout);

    let auth = if let Some(key) = &key_file {
        let path = expand_tilde(key, ctx.home);
        if !path.exists() {
            ctx.warn(format!(
                "{label}: key_file {} does not exist",
                path.display()
            ));
        }
        Auth::KeyFile {
            path,
            passphrase: key_passphrase.clone(),
        }
    } else if let Some(pw) = &password {
        Auth::Password(pw.clone())
    } else {
        let listed = params
            .as_ref()
            .and_then(|p| p.identity_file.clone())
            .unwrap_or_default();
        let identity_files: Vec<PathBuf> = listed.iter().filter(|p| p.is_file()).cloned().collect();
        if !listed.is_empty() && identity_files.is_empty() {
            ctx.warn(format!(
                "{label}: none of the IdentityFile entries in the ssh config exist"
            ));
        }
        let default_keys = ctx.default_keys();
        let agent = (ctx.env)("SSH_AUTH_SOCK").is_some_and(|s| !s.is_empty());
        if identity_files.is_empty() && default_keys.is_empty() && !agent {
            ctx.warn(format!(
                "{label} ('{name}') has no password or key_file, no IdentityFile, no ssh-agent (SSH_AUTH_SOCK unset) and no ~/.ssh/id_* key; connecting will fail"
            ));
        }
        Auth::Auto {
            identity_files,
            default_keys,
            passphrase: key_passphrase.clone(),
        }
    };

    let (block_policy, block_known_hosts) = match &params {
        Some(p) => host_key_settings(p, label, ctx),
        None => (None, None),
    };
    let host_key_policy = explicit_policy
        .or(block_policy)
        .unwrap_or(ctx.defaults.host_key_policy);
    let known_hosts = block_known_hosts.unwrap_or_else(|| ctx.known_hosts());
    let mut target = SshTarget {
        host,
        port,
        user,
        auth,
        proxy_jump: Vec::new(),
        host_key_policy,
        known_hosts,
        connect_timeout,
    };
    let hops = params
        .as_ref()
        .and_then(|p| p.proxy_jump.clone())
        .filter(|hops| !hops.is_empty() && !hops[0].trim().eq_ignore_ascii_case("none"))
        .unwrap_or_default();
    for (i, spec) in hops.iter().enumerate() {
        let hop = resolve_hop(ctx, spec, i, &target, label)?;
        target.proxy_jump.push(hop);
    }
    Ok(SandboxConfig {
        name,
        transport: Transport::Ssh(target),
        slurm,
    })
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

/// `StrictHostKeyChecking` and `UserKnownHostsFile` of a Host block. `no`/`off` is read as
/// accept-new: only rsb's own `host_key_policy = off` turns checking off, so an old
/// `Host *` line cannot silently disable it. Known-hosts files keep rsb's own file last, where
/// new keys are recorded.
fn host_key_settings(
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
            files.push(ctx.state_dir.join("known_hosts"));
            files
        });
    (policy, files)
}

/// One ProxyJump hop, looked up as an ssh_config alias the way `ssh` does: HostName, Port and
/// User, and the hop's own IdentityFile, StrictHostKeyChecking and UserKnownHostsFile. What
/// the hop's block does not say comes from the target (its user, credentials and host-key
/// settings), as before hops were typed.
fn resolve_hop(
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

/// An unknown key, quoted, when it looks like a field name; otherwise not shown (a stray key could
/// be a mangled secret).
fn key_name(k: &str) -> String {
    let plain = !k.is_empty()
        && k.len() <= 40
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        format!("'{k}'")
    } else {
        "(name not shown: not a plain identifier)".to_string()
    }
}

fn missing(label: &str, field: &str) -> ConfigError {
    ConfigError::new(
        format!("{label} missing required field: '{field}'"),
        "Each sandbox needs 'host' and 'user', or 'ssh_config_host' naming a Host in ~/.ssh/config that sets them.",
    )
}

fn check_names(sandboxes: &[SandboxConfig], labels: &[String]) -> Result<(), ConfigError> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, s) in sandboxes.iter().enumerate() {
        if s.name.chars().any(char::is_control) {
            return Err(ConfigError::new(
                format!("{} has a 'name' containing control characters", labels[i]),
                "Use a plain sandbox name such as gpu1.",
            ));
        }
        if let Some(&j) = seen.get(s.name.as_str()) {
            return Err(ConfigError::new(
                format!(
                    "{} duplicate sandbox name '{}' (already used by {})",
                    labels[i], s.name, labels[j]
                ),
                "Give each sandbox a distinct 'name' (it defaults to 'host').",
            ));
        }
        seen.insert(&s.name, i);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// REMOTE_SANDBOX_LIST
// ---------------------------------------------------------------------------------------------

/// serde_json's fixed syntax-error descriptions; anything else is reported as "syntax error".
const JSON_REASONS: [&str; 25] = [
    "EOF while parsing a list",
    "EOF while parsing an object",
    "EOF while parsing a string",
    "EOF while parsing a value",
    "expected `:`",
    "expected `,` or `]`",
    "expected `,` or `}`",
    "expected ident",
    "expected value",
    "expected `\"`",
    "invalid escape",
    "invalid number",
    "number out of range",
    "invalid unicode code point",
    "control character (\\u0000-\\u001F) found while parsing a string",
    "key must be a string",
    "invalid value: expected key to be a number in quotes",
    "float key must be finite (got NaN or +/-inf)",
    "lone leading surrogate in hex escape",
    "trailing comma",
    "trailing characters",
    "unexpected end of hex escape",
    "recursion limit exceeded",
    "syntax error",
    "unexpected end of input",
];

/// `<reason> at line L column C`, with the reason taken only from serde_json's fixed list, so
/// no character of the input can appear.
fn json_error_text(err: &serde_json::Error) -> String {
    let full = err.to_string();
    let reason = full
        .rsplit_once(" at line ")
        .map(|(r, _)| r)
        .unwrap_or(&full);
    let reason = if JSON_REASONS.contains(&reason) {
        reason
    } else if err.is_eof() {
        "unexpected end of input"
    } else {
        "syntax error"
    };
    format!("{reason} at line {} column {}", err.line(), err.column())
}

fn parse_list(raw: &str, ctx: &mut BuildCtx<'_>) -> Result<Vec<SandboxConfig>, ConfigError> {
    let value: Value = serde_json::from_str(raw.trim()).map_err(|e| {
        ConfigError::new(
            format!("{LIST_VAR} is not valid JSON: {}", json_error_text(&e)),
            "Check REMOTE_SANDBOX_LIST is valid JSON: [{\"name\": \"gpu1\", \"host\": \"10.0.0.5\", \"user\": \"me\", \"key_file\": \"~/.ssh/id_ed25519\"}] (the value is not shown, to keep secrets out of logs).",
        )
    })?;
    let Value::Array(items) = value else {
        return Err(ConfigError::new(
            format!("{LIST_VAR} must be a JSON array"),
            "Wrap the sandboxes in [ ... ], one JSON object per sandbox.",
        ));
    };
    if items.is_empty() {
        return Err(ConfigError::new(
            format!("{LIST_VAR} must contain at least one sandbox"),
            "Add a sandbox object, or unset REMOTE_SANDBOX_LIST to use REMOTE_HOST, the config file or the built-in local sandbox.",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    let mut labels = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let label = format!("{LIST_VAR}[{i}]");
        let Value::Object(mut map) = item else {
            return Err(ConfigError::new(
                format!("{label} must be a JSON object"),
                "Each element is an object such as {\"host\": \"10.0.0.5\", \"user\": \"me\", \"key_file\": \"~/.ssh/id_ed25519\"}.",
            ));
        };
        // Unknown fields are ignored with a warning here (the seed ignored them silently), so
        // a list written for the seed keeps working; the TOML file, rsb's own, rejects them.
        let known = field_names::<Entry>();
        let mut unknown: Vec<String> = map
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .cloned()
            .collect();
        unknown.sort_unstable();
        for k in unknown {
            ctx.warn(format!("{label}: unknown field {} ignored", key_name(&k)));
            map.remove(&k);
        }
        let entry: Entry = serde_path_to_error::deserialize(Value::Object(map)).map_err(|e| {
            let (what, hint) = describe_de_error(e.path(), &e.inner().to_string(), "");
            ConfigError::new(format!("{label} {what}"), hint)
        })?;
        out.push(build_sandbox(entry, &label, ctx)?);
        labels.push(label);
    }
    check_names(&out, &labels)?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Legacy single sandbox
// ---------------------------------------------------------------------------------------------

fn parse_legacy(host: &str, ctx: &mut BuildCtx<'_>) -> Result<SandboxConfig, ConfigError> {
    let get = |k: &str| {
        (ctx.env)(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let user = get("REMOTE_USER").ok_or_else(|| {
        ConfigError::new(
            "REMOTE_USER is required when REMOTE_HOST is set",
            "Set REMOTE_USER to the SSH login name.",
        )
    })?;
    let port = match get("REMOTE_PORT") {
        None => None,
        Some(p) => Some(parse_port(&p).ok_or_else(|| {
            ConfigError::new(
                "REMOTE_PORT must be an integer between 1 and 65535",
                "Set REMOTE_PORT to the SSH port (default 22).",
            )
        })?),
    };
    let entry = Entry {
        host: Text(Some(host.trim().to_string())),
        port: Port(port),
        user: Text(Some(user)),
        // Stripped, like the seed (including the password).
        password: SecretText(get("REMOTE_PASSWORD").map(Secret)),
        key_file: Text(get("REMOTE_KEY_FILE")),
        key_passphrase: SecretText(get("REMOTE_KEY_PASSPHRASE").map(Secret)),
        ..Entry::default()
    };
    build_sandbox(entry, "REMOTE_HOST", ctx)
}

// ---------------------------------------------------------------------------------------------
// TOML file
// ---------------------------------------------------------------------------------------------

fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(src.len());
    let before = src.get(..offset).unwrap_or(src);
    let line = before.matches('\n').count() + 1;
    let col = before
        .rsplit('\n')
        .next()
        .map(|l| l.chars().count())
        .unwrap_or(0)
        + 1;
    (line, col)
}

/// True when group/other have any permission bit on the file.
#[cfg(unix)]
fn readable_by_others(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then_some(mode)
}

#[cfg(not(unix))]
fn readable_by_others(_path: &Path) -> Option<u32> {
    None
}

fn parse_toml_file(
    path: &Path,
    env_policy: Option<HostKeyPolicy>,
    ctx: &mut BuildCtx<'_>,
) -> Result<Vec<SandboxConfig>, ConfigError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| {
        ConfigError::new(
            format!("cannot read config file {shown}: {}", e.kind()),
            "Check the file's permissions, or set RSB_CONFIG to another file.",
        )
    })?;
    let src = String::from_utf8(bytes).map_err(|e| {
        let (line, col) = line_col(
            &String::from_utf8_lossy(e.as_bytes()),
            e.utf8_error().valid_up_to(),
        );
        ConfigError::new(
            format!("config file {shown} is not valid UTF-8 (line {line}, column {col})"),
            "Save the file as UTF-8.",
        )
    })?;
    let position = |e: &toml::de::Error| match e.span() {
        Some(span) => {
            let (line, col) = line_col(&src, span.start);
            format!(" (line {line}, column {col})")
        }
        None => String::new(),
    };
    let doc = toml::Deserializer::parse(&src).map_err(|e| {
        ConfigError::new(
            format!("config file {shown} is not valid TOML{}", position(&e)),
            "Fix the TOML syntax at that position (the text is not shown, to keep secrets out of logs).",
        )
    })?;
    let file: FileConfig = serde_path_to_error::deserialize(doc).map_err(|e| {
        let in_sandbox = matches!(
            e.path().iter().collect::<Vec<_>>()[..],
            [
                serde_path_to_error::Segment::Map { .. },
                serde_path_to_error::Segment::Seq { .. },
                ..
            ]
        );
        let keys = if in_sandbox {
            format!("Sandbox keys are: {}.", field_names::<Entry>().join(", "))
        } else {
            format!(
                "Top-level keys are: {}; per sandbox: [[sandbox]] tables.",
                field_names::<FileConfig>().join(", ")
            )
        };
        let (what, hint) = if e.path().to_string() == "sandbox" {
            (
                "'sandbox' must be an array of tables".to_string(),
                "Write each sandbox as a [[sandbox]] table.".to_string(),
            )
        } else {
            describe_de_error(e.path(), e.inner().message(), &keys)
        };
        ConfigError::new(
            format!("config file {shown}{}: {what}", position(e.inner())),
            hint,
        )
    })?;
    // RSB_HOST_KEY_POLICY (env) beats the file's default; a per-sandbox value beats both.
    if let (Some(p), None) = (file.host_key_policy.0, env_policy) {
        ctx.defaults.host_key_policy = p;
    }
    if let Some(t) = file.connect_timeout_s.0 {
        ctx.defaults.connect_timeout = t;
    }
    let open_to_others = readable_by_others(path);
    let mut out = Vec::with_capacity(file.sandbox.len());
    let mut labels = Vec::with_capacity(file.sandbox.len());
    for (i, entry) in file.sandbox.into_iter().enumerate() {
        let label = format!("config file {shown}: sandbox[{i}]");
        let literal = [
            ("password", entry.password.0.is_some()),
            ("key_passphrase", entry.key_passphrase.0.is_some()),
        ]
        .into_iter()
        .find_map(|(field, set)| set.then_some(field));
        if let (Some(field), Some(mode)) = (literal, open_to_others) {
            return Err(ConfigError::new(
                format!(
                    "{label} has a plaintext '{field}' but {shown} is readable by others (mode {mode:04o})"
                ),
                format!(
                    "Run `chmod 600 {shown}`, or use {field}_env = \"VAR\" to read it from the environment."
                ),
            ));
        }
        out.push(build_sandbox(entry, &label, ctx)?);
        labels.push(label);
    }
    check_names(&out, &labels)?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const SECRET: &str = "S3cr3t-pw!";

    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let dir = std::env::temp_dir().join(format!(
                "rsb-config-test-{}-{}-{nanos}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(dir.join(".ssh")).unwrap();
            TempDir(dir)
        }
        fn path(&self) -> &Path {
            &self.0
        }
        fn write(&self, rel: &str, content: &str) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, content).unwrap();
            p
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[cfg(unix)]
    fn chmod(p: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// Runs `from_sources` with the given env pairs; RSB_STATE_DIR points into the temp home.
    fn load_with(
        home: &TempDir,
        vars: &[(&str, &str)],
        config_file: Option<&Path>,
        ssh_config: Option<&Path>,
    ) -> Result<Config, ConfigError> {
        let mut map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        map.entry("RSB_STATE_DIR".into())
            .or_insert_with(|| home.path().join("state").display().to_string());
        let env = move |k: &str| map.get(k).cloned();
        Config::from_sources(&env, config_file, ssh_config, home.path(), home.path())
    }

    fn env_only(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let home = TempDir::new();
        load_with(&home, vars, None, None)
    }

    fn err(vars: &[(&str, &str)]) -> ConfigError {
        let e = env_only(vars).expect_err("expected a config error");
        assert_no_secret_err(&e);
        e
    }

    fn assert_no_secret_err(e: &ConfigError) {
        for text in [&e.message, &e.hint, &format!("{e:?}"), &e.to_string()] {
            assert!(!text.contains(SECRET), "secret leaked: {text}");
            assert!(!text.contains("S3cr3t"), "partial secret leaked: {text}");
            assert!(!text.contains('\n'), "multi-line: {text}");
        }
        assert!(!e.hint.is_empty());
    }

    fn assert_no_secret_cfg(c: &Config) {
        let dbg = format!("{c:?}");
        assert!(!dbg.contains(SECRET), "secret in Debug: {dbg}");
        assert!(!dbg.contains("S3cr3t"), "partial secret in Debug: {dbg}");
        for w in &c.warnings {
            assert!(!w.contains("S3cr3t"), "secret in warning: {w}");
        }
    }

    fn ssh(c: &Config, i: usize) -> &SshTarget {
        match &c.sandboxes[i].transport {
            Transport::Ssh(t) => t,
            Transport::Local => panic!("sandbox {i} is local"),
        }
    }

    #[test]
    fn secret_never_prints() {
        let s = Secret::new(SECRET);
        assert_eq!(format!("{s}"), "***");
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(s.expose(), SECRET);
        let a = Auth::KeyFile {
            path: "/k".into(),
            passphrase: Some(s),
        };
        assert!(!format!("{a:?}").contains(SECRET));
    }

    #[test]
    fn nothing_configured_gives_local() {
        let c = env_only(&[]).unwrap();
        assert_eq!(c.sandboxes, vec![builtin_local()]);
        assert_eq!(c.source, "built-in local");
        assert!(!c.expose_advanced_tools);
        assert_eq!(c.inline_sync_max_files, 200);
        assert_eq!(c.inline_sync_max_bytes, 67_108_864);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        // blank values count as unset, like the seed
        let c = env_only(&[(LIST_VAR, "  "), ("REMOTE_HOST", " ")]).unwrap();
        assert_eq!(c.source, "built-in local");
        // a missing config file is just absent
        let home = TempDir::new();
        let c = load_with(&home, &[], Some(&home.path().join("nope.toml")), None).unwrap();
        assert_eq!(c.source, "built-in local");
    }

    #[test]
    fn an_environment_that_configures_no_sandbox_is_an_error() {
        let check = |vars: &[(&str, &str)]| {
            let v: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            check_unconfigured_env(&v)
        };
        // nothing, or only settings that configure no sandbox: the built-in local is fine
        assert!(check(&[]).is_ok());
        assert!(
            check(&[
                ("RSB_STATE_DIR", "/x"),
                ("RSB_LOG", "debug"),
                ("HOME", "/h")
            ])
            .is_ok()
        );
        assert!(check(&[("REMOTE_CONTAINERS", "true"), ("RSB_TESTBED_FIXTURE", "1")]).is_ok());
        // a typo'd name, with a did-you-mean; the value is never quoted
        let e = check(&[("REMOTE_HOSTNAME", "S3cr3t.example")]).unwrap_err();
        assert!(e.message.contains("REMOTE_HOSTNAME"), "{e:?}");
        assert!(e.hint.contains("did you mean REMOTE_HOST?"), "{e:?}");
        assert!(!format!("{e:?}").contains("S3cr3t"));
        let e = check(&[("RSB_SANDBOX_LIST", "[]")]).unwrap_err();
        assert!(
            e.hint.contains("did you mean REMOTE_SANDBOX_LIST?"),
            "{e:?}"
        );
        // empty values of the variables that name a source
        for k in [LIST_VAR, "REMOTE_HOST", "RSB_CONFIG"] {
            let e = check(&[(k, " ")]).unwrap_err();
            assert!(
                e.message.contains(&format!("{k} is set but empty")),
                "{e:?}"
            );
        }
        // a connection variable without a host
        let e = check(&[("REMOTE_USER", "me")]).unwrap_err();
        assert!(
            e.message
                .contains("REMOTE_USER is set but REMOTE_HOST is not"),
            "{e:?}"
        );
    }

    #[test]
    fn list_happy_path_with_defaults_order_and_auth() {
        let home = TempDir::new();
        let key = home.write("keys/k1", "x");
        let list = format!(
            r#"[{{"name":"a","host":"h1","port":2222,"user":"u1","password":"{SECRET}"}},
                {{"host":"h2","user":"u2","key_file":"~/keys/k1","key_passphrase":"{SECRET}"}},
                {{"name":"c","host":"h3","port":"2200","user":"u3","password":"pw","key_file":"/abs/key"}}]"#
        );
        let c = load_with(&home, &[(LIST_VAR, &list)], None, None).unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(c.source, "REMOTE_SANDBOX_LIST");
        assert_eq!(c.names(), vec!["a", "h2", "c"]);
        let a = ssh(&c, 0);
        assert_eq!(
            (a.host.as_str(), a.port, a.user.as_str()),
            ("h1", 2222, "u1")
        );
        assert_eq!(a.auth, Auth::Password(Secret::new(SECRET)));
        assert_eq!(a.host_key_policy, HostKeyPolicy::AcceptNew);
        assert_eq!(a.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(
            a.known_hosts,
            vec![
                home.path().join(".ssh/known_hosts"),
                home.path().join("state/known_hosts")
            ]
        );
        let b = ssh(&c, 1);
        assert_eq!(b.port, 22);
        assert_eq!(
            b.auth,
            Auth::KeyFile {
                path: key,
                passphrase: Some(Secret::new(SECRET))
            }
        );
        // both given: key wins, like the seed
        assert!(
            matches!(&ssh(&c, 2).auth, Auth::KeyFile { path, passphrase: None } if path == Path::new("/abs/key"))
        );
        assert_eq!(ssh(&c, 2).port, 2200);
        // missing key file is a warning naming the path, not an error
        assert!(
            c.warnings.iter().any(|w| w.contains("/abs/key")),
            "{:?}",
            c.warnings
        );
    }

    #[test]
    fn list_wins_over_legacy_with_warning() {
        let list = r#"[{"host":"h1","user":"u","password":"p"}]"#;
        let c = env_only(&[
            (LIST_VAR, list),
            ("REMOTE_HOST", "legacy"),
            ("REMOTE_USER", "u"),
        ])
        .unwrap();
        assert_eq!(c.names(), vec!["h1"]);
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("REMOTE_HOST is ignored"))
        );
    }

    #[test]
    fn list_not_json_never_echoes() {
        // the seed leaked '123" "port":22}' from exactly this kind of input
        let bad = format!(r#"[{{"host":"h","user":"u","password":"{SECRET}" "port":22}}]"#);
        let e = err(&[(LIST_VAR, &bad)]);
        assert!(
            e.message.starts_with(
                "REMOTE_SANDBOX_LIST is not valid JSON: expected `,` or `}` at line 1 column"
            ),
            "{}",
            e.message
        );
        for bad in [
            format!(r#"[{{"password":"{SECRET}"#),
            format!(r#"[{{"password":"{SECRET}\q"}}]"#),
            format!(r#"[{{"password":{SECRET}}}]"#),
            format!("[{{\"password\":\"{SECRET}\u{1}\"}}]"),
            format!(r#"[{{"host":"h"}}] {SECRET}"#),
        ] {
            let e = err(&[(LIST_VAR, &bad)]);
            assert!(
                e.message
                    .starts_with("REMOTE_SANDBOX_LIST is not valid JSON: "),
                "{}",
                e.message
            );
            assert!(e.message.contains(" at line 1 column "), "{}", e.message);
        }
    }

    #[test]
    fn list_structure_errors_match_seed_wording() {
        let e = err(&[(
            LIST_VAR,
            &format!(r#"{{"host":"h","password":"{SECRET}"}}"#),
        )]);
        assert_eq!(e.message, "REMOTE_SANDBOX_LIST must be a JSON array");
        let e = err(&[(
            LIST_VAR,
            &format!(r#"[{{"host":"h","user":"u"}}, "{SECRET}"]"#),
        )]);
        assert_eq!(e.message, "REMOTE_SANDBOX_LIST[1] must be a JSON object");
        let e = err(&[(
            LIST_VAR,
            &format!(r#"[{{"user":"u","password":"{SECRET}"}}]"#),
        )]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0] missing required field: 'host'"
        );
        let e = err(&[(
            LIST_VAR,
            &format!(r#"[{{"host":"h","password":"{SECRET}"}}]"#),
        )]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0] missing required field: 'user'"
        );
        let e = err(&[(LIST_VAR, r#"[{"host":"","user":"u"}]"#)]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0] missing required field: 'host'"
        );
        let e = err(&[(LIST_VAR, "[]")]);
        assert!(e.message.contains("at least one sandbox"));
    }

    #[test]
    fn list_bad_types_name_the_field_not_the_value() {
        for (field, value) in [
            ("port", format!(r#""{SECRET}""#)),
            ("port", "70000".into()),
            ("port", "0".into()),
            ("port", "22.5".into()),
            ("port", "true".into()),
            ("password", format!(r#"["{SECRET}"]"#)),
            ("password", "12345".into()),
            ("key_passphrase", format!(r#"{{"v":"{SECRET}"}}"#)),
            ("host", "5".into()),
            ("host_key_policy", format!(r#""{SECRET}""#)),
            ("local", r#""yes""#.into()),
        ] {
            let list = format!(r#"[{{"host":"h","user":"u","{field}":{value}}}]"#);
            let e = err(&[(LIST_VAR, &list)]);
            assert!(
                e.message
                    .starts_with(&format!("REMOTE_SANDBOX_LIST[0] field '{field}' must be ")),
                "{field}={value}: {}",
                e.message
            );
        }
        // null is the same as absent, for every field
        let c = env_only(&[(
            LIST_VAR,
            r#"[{"host":"h","user":"u","port":null,"local":null,"password":null,"host_key_policy":null,"connect_timeout_s":null}]"#,
        )])
        .unwrap();
        assert_eq!((ssh(&c, 0).port, c.sandboxes.len()), (22, 1));
        // numeric strings and integral floats are fine for port
        for port in [r#""2222""#, r#"" 2222 ""#, "2222.0"] {
            let c = env_only(&[(
                LIST_VAR,
                &format!(r#"[{{"host":"h","user":"u","port":{port}}}]"#),
            )])
            .unwrap();
            assert_eq!(ssh(&c, 0).port, 2222);
        }
    }

    #[test]
    fn list_duplicate_names_are_an_error() {
        let list = format!(
            r#"[{{"name":"a","host":"h1","user":"u","password":"{SECRET}"}},{{"host":"a","user":"u","password":"{SECRET}"}}]"#
        );
        let e = err(&[(LIST_VAR, &list)]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[1] duplicate sandbox name 'a' (already used by REMOTE_SANDBOX_LIST[0])"
        );
    }

    #[test]
    fn list_unknown_fields_warn_and_no_credentials_is_auto() {
        let home = TempDir::new();
        let k = home.write(".ssh/id_rsa", "x");
        let list = r#"[{"host":"h","user":"u","colour":"red","key_passphrase":"kp"}]"#;
        let c = load_with(&home, &[(LIST_VAR, list)], None, None).unwrap();
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("unknown field 'colour'"))
        );
        assert_eq!(
            ssh(&c, 0).auth,
            Auth::Auto {
                identity_files: vec![],
                default_keys: vec![k],
                passphrase: Some(Secret::new("kp"))
            }
        );
        // a default key exists, so no "connecting will fail" warning
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        // a stray key that is not a plain identifier is not echoed
        let list = format!(r#"[{{"host":"h","user":"u","pw={SECRET}":1}}]"#);
        let c = load_with(&home, &[(LIST_VAR, &list)], None, None).unwrap();
        assert_no_secret_cfg(&c);
        assert!(
            c.warnings.iter().any(|w| w.contains("name not shown")),
            "{:?}",
            c.warnings
        );
        // nothing at all to authenticate with: still loads, with a warning
        let c = env_only(&[(LIST_VAR, r#"[{"host":"h","user":"u"}]"#)]).unwrap();
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("connecting will fail")),
            "{:?}",
            c.warnings
        );
        let c = env_only(&[
            (LIST_VAR, r#"[{"host":"h","user":"u"}]"#),
            ("SSH_AUTH_SOCK", "/tmp/agent"),
        ])
        .unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn list_local_entry_and_policy() {
        let list =
            r#"[{"name":"box","local":true},{"host":"h","user":"u","host_key_policy":"Strict"}]"#;
        let c = env_only(&[(LIST_VAR, list), ("RSB_HOST_KEY_POLICY", "off")]).unwrap();
        assert_eq!(
            c.sandboxes[0],
            SandboxConfig {
                name: "box".into(),
                transport: Transport::Local,
                slurm: None,
            }
        );
        assert_eq!(ssh(&c, 1).host_key_policy, HostKeyPolicy::Strict);
        let c = env_only(&[
            (LIST_VAR, r#"[{"host":"h","user":"u"}]"#),
            ("RSB_HOST_KEY_POLICY", "off"),
        ])
        .unwrap();
        assert_eq!(ssh(&c, 0).host_key_policy, HostKeyPolicy::Off);
        let e = err(&[(LIST_VAR, r#"[{"local":true,"host":"h"}]"#)]);
        assert!(e.message.contains("local = true and also sets 'host'"));
        let e = err(&[("RSB_HOST_KEY_POLICY", "maybe")]);
        assert!(e.message.starts_with("RSB_HOST_KEY_POLICY must be one of"));
    }

    #[test]
    fn legacy_env_password() {
        let pw = format!("  {SECRET}  ");
        let c = env_only(&[
            ("REMOTE_HOST", " 10.0.0.5 "),
            ("REMOTE_PORT", " 2022 "),
            ("REMOTE_USER", " me "),
            ("REMOTE_PASSWORD", &pw),
        ])
        .unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(c.source, "REMOTE_HOST");
        assert_eq!(c.names(), vec!["10.0.0.5"]);
        let t = ssh(&c, 0);
        assert_eq!(
            (t.host.as_str(), t.port, t.user.as_str()),
            ("10.0.0.5", 2022, "me")
        );
        // stripped, like the seed
        assert_eq!(t.auth, Auth::Password(Secret::new(SECRET)));
    }

    #[test]
    fn legacy_env_key_and_errors() {
        let home = TempDir::new();
        let key = home.write(".ssh/work", "x");
        let c = load_with(
            &home,
            &[
                ("REMOTE_HOST", "h"),
                ("REMOTE_USER", "me"),
                ("REMOTE_KEY_FILE", "~/.ssh/work"),
                ("REMOTE_KEY_PASSPHRASE", SECRET),
                ("REMOTE_PASSWORD", SECRET),
            ],
            None,
            None,
        )
        .unwrap();
        assert_no_secret_cfg(&c);
        let t = ssh(&c, 0);
        assert_eq!(t.port, 22);
        assert_eq!(
            t.auth,
            Auth::KeyFile {
                path: key,
                passphrase: Some(Secret::new(SECRET))
            }
        );
        // empty passphrase means "no passphrase" (seed README: leave blank)
        let c = env_only(&[
            ("REMOTE_HOST", "h"),
            ("REMOTE_USER", "me"),
            ("REMOTE_KEY_FILE", "/k"),
            ("REMOTE_KEY_PASSPHRASE", ""),
        ])
        .unwrap();
        assert!(matches!(
            &ssh(&c, 0).auth,
            Auth::KeyFile {
                passphrase: None,
                ..
            }
        ));
        let e = err(&[("REMOTE_HOST", "h"), ("REMOTE_PASSWORD", SECRET)]);
        assert_eq!(e.message, "REMOTE_USER is required when REMOTE_HOST is set");
        let e = err(&[
            ("REMOTE_HOST", "h"),
            ("REMOTE_USER", "u"),
            ("REMOTE_PORT", SECRET),
        ]);
        assert_eq!(
            e.message,
            "REMOTE_PORT must be an integer between 1 and 65535"
        );
        // no password and no key: Auto (the seed refused)
        let c = env_only(&[("REMOTE_HOST", "h"), ("REMOTE_USER", "u")]).unwrap();
        assert!(matches!(ssh(&c, 0).auth, Auth::Auto { .. }));
    }

    #[test]
    fn advanced_tools_truthiness() {
        for (v, want) in [
            ("1", true),
            ("true", true),
            ("TRUE", true),
            (" yes ", true),
            ("On", true),
            ("0", false),
            ("false", false),
            ("no", false),
            ("off", false),
            ("", false),
            ("2", false),
            ("enable", false),
        ] {
            let c = env_only(&[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", v)]).unwrap();
            assert_eq!(c.expose_advanced_tools, want, "{v:?}");
            let warned = !c.warnings.is_empty();
            assert_eq!(warned, v == "2" || v == "enable", "{v:?}: {:?}", c.warnings);
        }
    }

    #[test]
    fn inline_sync_limits() {
        let f = "REMOTE_SANDBOX_INLINE_SYNC_MAX_FILES";
        let b = "REMOTE_SANDBOX_INLINE_SYNC_MAX_BYTES";
        let c = env_only(&[(f, "5000"), (b, " 1048576 ")]).unwrap();
        assert_eq!(
            (c.inline_sync_max_files, c.inline_sync_max_bytes),
            (5000, 1_048_576)
        );
        let c = env_only(&[(f, "0"), (b, "+10")]).unwrap();
        assert_eq!((c.inline_sync_max_files, c.inline_sync_max_bytes), (0, 10));
        assert!(c.warnings.is_empty());
        let c = env_only(&[(f, "lots"), (b, "-5")]).unwrap();
        assert_eq!(
            (c.inline_sync_max_files, c.inline_sync_max_bytes),
            (200, 67_108_864)
        );
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c.warnings[0].contains(f) && c.warnings[1].contains(b));
        let c = env_only(&[(f, ""), (b, "  ")]).unwrap();
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn state_dir_override() {
        let home = TempDir::new();
        let c = load_with(&home, &[("RSB_STATE_DIR", "~/st")], None, None).unwrap();
        assert_eq!(c.state_dir, home.path().join("st"));
        assert!(
            !c.state_dir.exists(),
            "from_sources must not create anything"
        );
        let c = load_with(&home, &[("RSB_STATE_DIR", "")], None, None).unwrap();
        assert!(c.state_dir.ends_with("rsb"), "{}", c.state_dir.display());
        // The seed's variable is honoured; RSB_STATE_DIR still wins.
        let c = load_with(
            &home,
            &[("REMOTE_SANDBOX_MCP_HOME", "~/seed"), ("RSB_STATE_DIR", "")],
            None,
            None,
        )
        .unwrap();
        assert_eq!(c.state_dir, home.path().join("seed"));
        let c = load_with(
            &home,
            &[
                ("REMOTE_SANDBOX_MCP_HOME", "~/seed"),
                ("RSB_STATE_DIR", "/x"),
            ],
            None,
            None,
        )
        .unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/x"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let d = home.path().join("a/b");
            crate::store::ensure_private_dir(&d).unwrap();
            assert_eq!(
                std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
                0o700
            );
        }
    }

    const SSH_CONFIG: &str = "\
Host gpu1
    HostName 10.0.0.5
    Port 2200
    User alice
    IdentityFile ~/.ssh/missing_key
    IdentityFile ~/.ssh/gpu1_key
    ProxyJump bastion.example.com,jump2
    ConnectTimeout 7

Host bare
    User bob

Host jump2
    HostName 10.9.9.9
    Port 2022
    User jumper

Host *.internal
    HostName %h.example.org
    User carol
";

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
                passphrase: None
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

    fn hops(t: &SshTarget) -> Vec<String> {
        t.proxy_jump.iter().map(Hop::address).collect()
    }

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

    const TOML_OK: &str = r#"
host_key_policy = "strict"
connect_timeout_s = 5

[[sandbox]]
name = "gpu1"
host = "10.0.0.5"
port = 2222
user = "me"
key_file = "~/.ssh/id_ed25519"
key_passphrase_env = "GPU1_PASSPHRASE"
host_key_policy = "accept-new"

[[sandbox]]
name = "alias"
ssh_config_host = "gpu1"

[[sandbox]]
name = "pw"
host = "h"
user = "u"
password_env = "PW_VAR"

[[sandbox]]
name = "local"
local = true
"#;

    #[test]
    fn toml_happy_path() {
        let home = TempDir::new();
        let key = home.write(".ssh/id_ed25519", "x");
        let cfg = home.write(".ssh/config", SSH_CONFIG);
        let file = home.write("rsb/config.toml", TOML_OK);
        #[cfg(unix)]
        chmod(&file, 0o644); // no literal secrets, so any mode is fine
        let c = load_with(
            &home,
            &[("GPU1_PASSPHRASE", SECRET), ("PW_VAR", SECRET)],
            Some(&file),
            Some(&cfg),
        )
        .unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(c.source, format!("config file {}", file.display()));
        assert_eq!(c.names(), vec!["gpu1", "alias", "pw", "local"]);
        let t = ssh(&c, 0);
        assert_eq!((t.host.as_str(), t.port), ("10.0.0.5", 2222));
        assert_eq!(t.host_key_policy, HostKeyPolicy::AcceptNew);
        assert_eq!(t.connect_timeout, Duration::from_secs(5));
        assert_eq!(
            t.auth,
            Auth::KeyFile {
                path: key.clone(),
                passphrase: Some(Secret::new(SECRET))
            }
        );
        let t = ssh(&c, 1);
        assert_eq!((t.host.as_str(), t.user.as_str()), ("10.0.0.5", "alice"));
        assert_eq!(t.host_key_policy, HostKeyPolicy::Strict);
        assert_eq!(
            t.connect_timeout,
            Duration::from_secs(7),
            "ssh_config ConnectTimeout beats the file default"
        );
        assert_eq!(
            t.auth,
            Auth::Auto {
                identity_files: vec![],
                default_keys: vec![key.clone()],
                passphrase: None
            },
            "gpu1_key does not exist in this home; id_ed25519 does"
        );
        assert_eq!(ssh(&c, 2).auth, Auth::Password(Secret::new(SECRET)));
        assert_eq!(c.sandboxes[3].transport, Transport::Local);
        // env vars win over the file
        let c = load_with(
            &home,
            &[("REMOTE_HOST", "h"), ("REMOTE_USER", "u")],
            Some(&file),
            Some(&cfg),
        )
        .unwrap();
        assert_eq!(c.source, "REMOTE_HOST");
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("is ignored because REMOTE_HOST is set"))
        );
        // RSB_HOST_KEY_POLICY beats the file's default, not a sandbox's own
        let c = load_with(
            &home,
            &[
                ("GPU1_PASSPHRASE", "p"),
                ("PW_VAR", "p"),
                ("RSB_HOST_KEY_POLICY", "off"),
            ],
            Some(&file),
            Some(&cfg),
        )
        .unwrap();
        assert_eq!(ssh(&c, 0).host_key_policy, HostKeyPolicy::AcceptNew);
        assert_eq!(ssh(&c, 1).host_key_policy, HostKeyPolicy::Off);
    }

    #[test]
    fn toml_env_reference_unset() {
        let home = TempDir::new();
        let file = home.write(
            "c.toml",
            "[[sandbox]]\nhost = \"h\"\nuser = \"u\"\npassword_env = \"NOPE_VAR\"\n",
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message.contains("NOPE_VAR") && e.message.contains("not set"),
            "{}",
            e.message
        );
    }

    #[test]
    fn toml_unknown_keys_are_errors() {
        let home = TempDir::new();
        let file = home.write(
            "c.toml",
            "[[sandbox]]\nhost = \"h\"\nuser = \"u\"\nhostname = \"x\"\n",
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert!(
            e.message.ends_with("sandbox[0] has unknown key 'hostname'"),
            "{}",
            e.message
        );
        assert!(e.hint.contains("ssh_config_host"));
        assert!(
            e.message.contains("(line 4, column 1): sandbox[0]"),
            "{}",
            e.message
        );
        let file = home.write("d.toml", "colour = 1\n");
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert!(e.message.ends_with("unknown key 'colour'"), "{}", e.message);
        assert!(e.hint.starts_with("Top-level keys are: host_key_policy"));
        // A key that is not a plain name may be a mangled secret: not shown.
        let file = home.write(
            "e.toml",
            &format!("[[sandbox]]\nhost = \"h\"\n\"pw={SECRET}\" = 1\n"),
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message
                .ends_with("(name not shown: not a plain identifier)")
        );
    }

    #[test]
    fn toml_malformed_gives_position_not_text() {
        let home = TempDir::new();
        let file = home.write(
            "c.toml",
            &format!("[[sandbox]]\nhost = \"h\"\npassword = \"{SECRET}\n"),
        );
        #[cfg(unix)]
        chmod(&file, 0o600);
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message.contains("is not valid TOML (line 3, column"),
            "{}",
            e.message
        );
        let file = home.write(
            "d.toml",
            &format!("[[sandbox]]\nport = \"{SECRET}\"\nhost=\"h\"\nuser=\"u\"\n"),
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message
                .ends_with("field 'port' must be an integer between 1 and 65535"),
            "{}",
            e.message
        );
        assert!(
            e.message
                .contains("(line 2, column 8): sandbox[0] field 'port'"),
            "{}",
            e.message
        );
        // Wrong shapes anywhere, with a secret as the value: the place and line, never the value.
        for (body, want) in [
            (
                format!("[[sandbox]]\nhost='h'\n[[sandbox]]\npassword = [\"{SECRET}\"]\n"),
                "(line 4, column 12): sandbox[1] field 'password' must be a string",
            ),
            (
                format!("sandbox = \"{SECRET}\"\n"),
                "(line 1, column 11): 'sandbox' must be an array of tables",
            ),
            (
                format!("sandbox = [\"{SECRET}\"]\n"),
                "(line 1, column 12): sandbox[0] must be a table",
            ),
            (
                format!("host_key_policy = \"{SECRET}\"\n"),
                "(line 1, column 19): field 'host_key_policy' must be one of accept-new, strict, off",
            ),
            (
                format!("[[sandbox]]\nlocal = \"{SECRET}\"\n"),
                "(line 2, column 9): sandbox[0] field 'local' must be true or false",
            ),
            (
                "connect_timeout_s = 1979-05-27T07:32:00Z\n".to_string(),
                "(line 1, column 21): field 'connect_timeout_s' must be a positive number of seconds",
            ),
        ] {
            let file = home.write("w.toml", &body);
            #[cfg(unix)]
            chmod(&file, 0o600);
            let e = load_with(&home, &[], Some(&file), None).unwrap_err();
            assert_no_secret_err(&e);
            assert!(e.message.ends_with(want), "{body:?}: {}", e.message);
        }
        let file = home.write("e.toml", "[[sandbox]]\nname=\"a\"\nhost=\"h\"\nuser=\"u\"\n[[sandbox]]\nname=\"a\"\nlocal=true\n");
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert!(
            e.message.contains("duplicate sandbox name 'a'"),
            "{}",
            e.message
        );
    }

    #[cfg(unix)]
    #[test]
    fn toml_plaintext_secret_needs_0600() {
        let home = TempDir::new();
        let body = format!("[[sandbox]]\nhost = \"h\"\nuser = \"u\"\npassword = \"{SECRET}\"\n");
        let file = home.write("c.toml", &body);
        chmod(&file, 0o644);
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message.contains("plaintext 'password'") && e.message.contains("0644"),
            "{}",
            e.message
        );
        assert!(
            e.hint.contains("chmod 600") && e.hint.contains("password_env"),
            "{}",
            e.hint
        );
        chmod(&file, 0o600);
        let c = load_with(&home, &[], Some(&file), None).unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(ssh(&c, 0).auth, Auth::Password(Secret::new(SECRET)));
    }

    #[test]
    fn toml_without_sandboxes_falls_back_to_local() {
        let home = TempDir::new();
        let file = home.write("c.toml", "host_key_policy = \"off\"\n");
        let c = load_with(&home, &[], Some(&file), None).unwrap();
        assert_eq!(c.sandboxes, vec![builtin_local()]);
        assert_eq!(c.warnings.len(), 1);
    }

    #[test]
    fn json_reason_whitelist_covers_serde_messages() {
        for bad in [
            "[",
            "[1,",
            "{\"a\" 1}",
            "[1 2]",
            "\"\\q\"",
            "tru",
            "[1] x",
            "[1,]",
            "{1:2}",
        ] {
            let e = serde_json::from_str::<Value>(bad).unwrap_err();
            let text = json_error_text(&e);
            assert!(
                !text.starts_with("syntax error"),
                "{bad:?} -> {e} -> {text}"
            );
        }
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
