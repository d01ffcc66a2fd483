//! The sandbox definitions the daemon connects with, persisted by the server that registers a
//! watch. They hold no secret: addresses, users, ports, key file *paths*, ssh_config-resolved
//! identity files, jump hosts, host-key policy and known_hosts files. The daemon then reaches
//! a host with what needs no stored secret (key files, the ssh-agent).
//!
//! A password (or a key passphrase) is stored only when the user opted in with
//! `RSB_WATCHDOG_STORE_PASSWORDS=1` in the server's environment: then it goes to
//! `<state_dir>/watchdog-secrets.json` (0600, written atomically), never into the database.
//! Without it, a watch on a password-only sandbox says `needs credentials` in one line.
//!
//! A definition is stored under its [`fingerprint`]: a digest of everything it resolves to
//! (transport, address, user, auth kind and key paths, jumps, host-key settings; secrets only
//! by reference). Rows that connect later keep the fingerprint they were registered with, so
//! a second server with another `gpu` adds a second definition instead of re-pointing the
//! first one's watches. Secrets are keyed the same way, and the secrets file is rewritten
//! only under its lock, so concurrent servers never drop each other's entries.
//!
//! [`Persisted`] is rsb's own serialisable form, mapped from [`SandboxConfig`] in exactly one
//! place ([`Persisted::from_config`]) and back in [`Persisted::to_config`].

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::{
    config::ConfineRules,
    config::{AgentSocket, Auth, Hop, HostKeyPolicy, SandboxConfig, Secret, SshTarget, Transport},
    error::Result,
    store::{db_err, now_ms},
};

pub const SECRETS_FILE: &str = "watchdog-secrets.json";
/// The user's opt-in to storing passwords and passphrases in [`SECRETS_FILE`].
pub const STORE_PASSWORDS_VAR: &str = "RSB_WATCHDOG_STORE_PASSWORDS";

/// Whether this process may store secrets (read from its environment each time).
pub fn store_passwords() -> bool {
    crate::config::env_truthy(STORE_PASSWORDS_VAR)
}

/// Held (exclusively) around every read-modify-write of [`SECRETS_FILE`].
pub const SECRETS_LOCK: &str = "watchdog-secrets.lock";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Persisted {
    pub name: String,
    /// `local` or `ssh`.
    pub transport: String,
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub port: u16,
    #[serde(default)]
    pub user: String,
    #[serde(flatten)]
    pub auth: PersistedAuth,
    /// Jump hosts in order, each with its own user, identity and host-key settings.
    #[serde(default)]
    pub proxy_jump: Vec<PersistedHop>,
    #[serde(default)]
    pub host_key_policy: String,
    #[serde(default)]
    pub known_hosts: Vec<PathBuf>,
    #[serde(default)]
    pub connect_timeout_ms: u64,
    /// The sandbox's Landlock confinement, so what the watchdog runs there (a resume) is
    /// confined as the session's commands were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confine: Option<ConfineRules>,
    /// A Slurm login node's defaults, so the watchdog knows it for one and resubmits a job
    /// whose options it has nowhere else with them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm: Option<crate::config::SlurmDefaults>,
}

/// How a target or a hop authenticates, without the secret itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedAuth {
    /// `password`, `key_file`, `agent` or `auto`.
    #[serde(default)]
    pub auth: String,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The key (or the `auto` keys) needs a passphrase the definition does not hold.
    #[serde(default)]
    pub needs_passphrase: bool,
    #[serde(default)]
    pub identity_files: Vec<PathBuf>,
    #[serde(default)]
    pub default_keys: Vec<PathBuf>,
    /// `IdentityAgent` for `auto`: a socket path, or `none`; absent means `SSH_AUTH_SOCK` of
    /// whoever connects (and keeps the fingerprints of definitions stored before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_agent: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedHop {
    pub host: String,
    pub port: u16,
    pub user: String,
    #[serde(flatten)]
    pub auth: PersistedAuth,
    #[serde(default)]
    pub host_key_policy: String,
    #[serde(default)]
    pub known_hosts: Vec<PathBuf>,
}

/// What a definition needs that is not stored (the password, a passphrase).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSecret {
    #[serde(default)]
    pub password: Option<String>,
    #[serde(default)]
    pub key_passphrase: Option<String>,
    /// The jump hosts' own secrets, by hop index.
    #[serde(default)]
    pub hops: Vec<StoredSecret>,
}

impl StoredSecret {
    fn is_empty(&self) -> bool {
        self.password.is_none()
            && self.key_passphrase.is_none()
            && self.hops.iter().all(StoredSecret::is_empty)
    }
}

impl PersistedAuth {
    /// Split an [`Auth`] into what may be stored and the secret it holds.
    fn split(auth: &Auth) -> (PersistedAuth, StoredSecret) {
        let mut p = PersistedAuth::default();
        let mut secret = StoredSecret::default();
        match auth {
            Auth::Password(pw) => {
                p.auth = "password".into();
                secret.password = Some(pw.expose().to_string());
            }
            Auth::KeyFile { path, passphrase } => {
                p.auth = "key_file".into();
                p.key_file = Some(path.clone());
                p.needs_passphrase = passphrase.is_some();
                secret.key_passphrase = passphrase.as_ref().map(|s| s.expose().to_string());
            }
            Auth::Agent => p.auth = "agent".into(),
            Auth::Auto {
                identity_files,
                default_keys,
                passphrase,
                agent,
            } => {
                p.auth = "auto".into();
                p.identity_files = identity_files.clone();
                p.default_keys = default_keys.clone();
                p.identity_agent = match agent {
                    AgentSocket::Env => None,
                    AgentSocket::Off => Some("none".into()),
                    AgentSocket::Path(path) => Some(path.display().to_string()),
                };
                p.needs_passphrase = passphrase.is_some();
                secret.key_passphrase = passphrase.as_ref().map(|s| s.expose().to_string());
            }
        }
        (p, secret)
    }

    /// Back to an [`Auth`], or `Err(what is missing)` ("password", "key passphrase").
    fn join(&self, secret: Option<&StoredSecret>) -> Result<Auth, &'static str> {
        let passphrase = || {
            secret
                .and_then(|s| s.key_passphrase.clone())
                .map(Secret::new)
        };
        Ok(match self.auth.as_str() {
            "password" => match secret.and_then(|s| s.password.clone()) {
                Some(pw) => Auth::Password(Secret::new(pw)),
                None => return Err("password"),
            },
            "key_file" => {
                let pp = passphrase();
                if self.needs_passphrase && pp.is_none() {
                    return Err("key passphrase");
                }
                Auth::KeyFile {
                    path: self.key_file.clone().unwrap_or_default(),
                    passphrase: pp,
                }
            }
            "agent" => Auth::Agent,
            // `auto` without its passphrase still has the agent and unencrypted keys.
            _ => Auth::Auto {
                identity_files: self.identity_files.clone(),
                default_keys: self.default_keys.clone(),
                passphrase: passphrase(),
                agent: match self.identity_agent.as_deref() {
                    None => AgentSocket::Env,
                    Some("none") => AgentSocket::Off,
                    Some(path) => AgentSocket::Path(PathBuf::from(path)),
                },
            },
        })
    }
}

impl Persisted {
    /// The one mapping from a configured sandbox (and the secrets it holds, which are
    /// returned apart so the caller decides whether they may be stored).
    pub fn from_config(s: &SandboxConfig) -> (Persisted, StoredSecret) {
        let mut p = Persisted {
            name: s.name.clone(),
            transport: "local".into(),
            host: String::new(),
            port: 0,
            user: String::new(),
            auth: PersistedAuth::default(),
            proxy_jump: Vec::new(),
            host_key_policy: String::new(),
            known_hosts: Vec::new(),
            connect_timeout_ms: 0,
            confine: s.confine.clone(),
            slurm: s.slurm.clone(),
        };
        let mut secret = StoredSecret::default();
        if let Transport::Ssh(t) = &s.transport {
            p.transport = "ssh".into();
            p.host = t.host.clone();
            p.port = t.port;
            p.user = t.user.clone();
            p.host_key_policy = t.host_key_policy.as_str().into();
            p.known_hosts = t.known_hosts.clone();
            p.connect_timeout_ms = t.connect_timeout.as_millis() as u64;
            (p.auth, secret) = PersistedAuth::split(&t.auth);
            for hop in &t.proxy_jump {
                let (auth, hop_secret) = PersistedAuth::split(&hop.auth);
                p.proxy_jump.push(PersistedHop {
                    host: hop.host.clone(),
                    port: hop.port,
                    user: hop.user.clone(),
                    auth,
                    host_key_policy: hop.host_key_policy.as_str().into(),
                    known_hosts: hop.known_hosts.clone(),
                });
                secret.hops.push(hop_secret);
            }
            if secret.hops.iter().all(StoredSecret::is_empty) {
                secret.hops.clear();
            }
        }
        (p, secret)
    }

    /// Back to a sandbox the pool can connect, or the one-line reason it cannot be.
    pub fn to_config(&self, secret: Option<&StoredSecret>) -> Result<SandboxConfig, String> {
        if self.transport == "local" {
            return Ok(SandboxConfig {
                name: self.name.clone(),
                transport: Transport::Local,
                slurm: self.slurm.clone(),
                sudo: None,
                policy: Default::default(),
                confine: self.confine.clone(),
            });
        }
        let needs = |what: &str, whose: String| {
            format!(
                "needs credentials: {whose} uses a {what}, which rsb does not store unless \
                 the server runs with RSB_WATCHDOG_STORE_PASSWORDS=1 (or use a key without one)"
            )
        };
        let auth = self
            .auth
            .join(secret)
            .map_err(|what| needs(what, format!("sandbox '{}'", self.name)))?;
        let mut proxy_jump = Vec::with_capacity(self.proxy_jump.len());
        for (i, hop) in self.proxy_jump.iter().enumerate() {
            let hop_secret = secret.and_then(|s| s.hops.get(i));
            let auth = hop.auth.join(hop_secret).map_err(|what| {
                needs(
                    what,
                    format!(
                        "jump host {}@{} of sandbox '{}'",
                        hop.user, hop.host, self.name
                    ),
                )
            })?;
            proxy_jump.push(Hop {
                host: hop.host.clone(),
                port: hop.port,
                user: hop.user.clone(),
                auth,
                host_key_policy: HostKeyPolicy::parse(&hop.host_key_policy).unwrap_or_default(),
                known_hosts: hop.known_hosts.clone(),
            });
        }
        Ok(SandboxConfig {
            name: self.name.clone(),
            transport: Transport::Ssh(SshTarget {
                host: self.host.clone(),
                port: self.port,
                user: self.user.clone(),
                auth,
                proxy_jump,
                host_key_policy: HostKeyPolicy::parse(&self.host_key_policy).unwrap_or_default(),
                known_hosts: self.known_hosts.clone(),
                connect_timeout: Duration::from_millis(if self.connect_timeout_ms == 0 {
                    15_000
                } else {
                    self.connect_timeout_ms
                }),
            }),
            slurm: self.slurm.clone(),
            sudo: None,
            policy: Default::default(),
            confine: self.confine.clone(),
        })
    }

    /// Whether the daemon could connect with what is stored (for the registration reply).
    pub fn missing_credentials(&self, secret: Option<&StoredSecret>) -> Option<String> {
        self.to_config(secret).err()
    }
}

impl Persisted {
    /// The key a definition is stored under: blake3 of its canonical JSON (which holds no
    /// secret), shortened to 32 hex digits. Equal definitions from any server share it.
    pub fn fingerprint(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        blake3::hash(&json).to_hex()[..32].to_string()
    }
}

/// The fingerprint a row records for a configured sandbox (see [`Persisted::fingerprint`]).
pub fn fingerprint(s: &SandboxConfig) -> String {
    Persisted::from_config(s).0.fingerprint()
}

/// Which key a row's definition and secret are under: its fingerprint, or its name for a row
/// written before fingerprints.
pub fn key<'a>(fingerprint: &'a str, name: &'a str) -> &'a str {
    if fingerprint.is_empty() {
        name
    } else {
        fingerprint
    }
}

/// Store the definitions of `sandboxes`, each under its fingerprint. Secrets go to the secrets
/// file only when `store_secrets` (the user's opt-in). Without it, this server's own secret
/// (the same value under the same fingerprint) is removed, and no other entry is touched.
pub fn persist(
    conn: &Connection,
    state_dir: &Path,
    sandboxes: &[SandboxConfig],
    store_secrets: bool,
) -> Result<usize> {
    let ts = now_ms() / 1000;
    let mut wanted: Vec<(String, StoredSecret)> = Vec::new();
    for s in sandboxes {
        let (p, secret) = Persisted::from_config(s);
        let fp = p.fingerprint();
        let json = serde_json::to_string(&p).map_err(db_err)?;
        conn.execute(
            "INSERT INTO sandbox_defs (fingerprint, name, def_json, updated_ts)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(fingerprint) DO UPDATE SET updated_ts = excluded.updated_ts",
            params![fp, p.name, json, ts],
        )
        .map_err(db_err)?;
        if !secret.is_empty() {
            wanted.push((fp, secret));
        }
    }
    if !wanted.is_empty() {
        // Without the opt-in, a stored secret of ours is removed (the user turned storing
        // off), but never one that a row still connects with: another server that opted in
        // may have stored it for an active watch, a live detached forward or a transfer.
        let mut in_use = std::collections::BTreeSet::new();
        if !store_secrets {
            for (fp, _) in &wanted {
                if referenced(conn, fp)? {
                    in_use.insert(fp.clone());
                }
            }
        }
        update_secrets(state_dir, |m| {
            for (fp, secret) in wanted {
                if store_secrets {
                    m.insert(fp, secret);
                } else if m.get(&fp) == Some(&secret) && !in_use.contains(&fp) {
                    m.remove(&fp);
                }
            }
        })
        .map_err(db_err)?;
    }
    Ok(sandboxes.len())
}

/// Whether a row that connects later (an active watch, a detached forward starting or
/// listening, a queued or running transfer) names definition `fp`.
fn referenced(conn: &Connection, fp: &str) -> Result<bool> {
    conn.query_row(
        "SELECT EXISTS(SELECT 1 FROM watches WHERE status = 'active' AND sandbox_fp = ?1)
             OR EXISTS(SELECT 1 FROM forwards WHERE state IN ('starting', 'listening')
                       AND sandbox_fp = ?1)
             OR EXISTS(SELECT 1 FROM transfer_tasks WHERE status IN ('queued', 'running')
                       AND sandbox_fp = ?1)",
        params![fp],
        |r| r.get(0),
    )
    .map_err(db_err)
}

/// The definition a row refers to: by fingerprint, or by name in the table of rsb before
/// fingerprints when the row has none.
pub fn load(conn: &Connection, fingerprint: &str, name: &str) -> Result<Option<Persisted>> {
    let json: Option<String> = if fingerprint.is_empty() {
        conn.query_row(
            "SELECT def_json FROM sandboxes WHERE name = ?1",
            params![name],
            |r| r.get(0),
        )
    } else {
        conn.query_row(
            "SELECT def_json FROM sandbox_defs WHERE fingerprint = ?1",
            params![fingerprint],
            |r| r.get(0),
        )
    }
    .optional()
    .map_err(db_err)?;
    Ok(json.and_then(|j| serde_json::from_str(&j).ok()))
}

/// The definition and its stored secret as one config the pool connects with, or the one
/// line saying why not (`Ok(Err)`): not stored, or a secret that is not.
pub fn resolve(
    conn: &Connection,
    state_dir: &Path,
    fingerprint: &str,
    name: &str,
) -> Result<Option<std::result::Result<SandboxConfig, String>>> {
    let Some(def) = load(conn, fingerprint, name)? else {
        return Ok(None);
    };
    let secrets = read_secrets(state_dir);
    Ok(Some(def.to_config(secrets.get(key(fingerprint, name)))))
}

pub fn count(conn: &Connection) -> Result<i64> {
    conn.query_row("SELECT COUNT(*) FROM sandbox_defs", [], |r| r.get(0))
        .map_err(db_err)
}

pub fn read_secrets(state_dir: &Path) -> BTreeMap<String, StoredSecret> {
    std::fs::read(state_dir.join(SECRETS_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Read, change and write the secrets file under [`SECRETS_LOCK`], so two servers updating it
/// at once both keep their entries. The write is atomic (a temporary file renamed over it);
/// an emptied map removes the file.
fn update_secrets(
    state_dir: &Path,
    change: impl FnOnce(&mut BTreeMap<String, StoredSecret>),
) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(state_dir.join(SECRETS_LOCK))?;
    lock.lock()?;
    let mut m = read_secrets(state_dir);
    let before = m.clone();
    change(&mut m);
    if m != before {
        write_secrets(state_dir, &m)?;
    }
    Ok(())
}

fn write_secrets(state_dir: &Path, m: &BTreeMap<String, StoredSecret>) -> std::io::Result<()> {
    let path = state_dir.join(SECRETS_FILE);
    if m.is_empty() {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    }
    let body = serde_json::to_vec_pretty(m).unwrap_or_default();
    crate::store::write_private(&path, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ssh(auth: Auth) -> SandboxConfig {
        SandboxConfig {
            name: "gpu".into(),
            transport: Transport::Ssh(SshTarget {
                host: "10.0.0.5".into(),
                port: 2222,
                user: "me".into(),
                auth,
                proxy_jump: vec![Hop {
                    host: "bastion".into(),
                    port: 22,
                    user: "jump".into(),
                    auth: Auth::KeyFile {
                        path: "/keys/jump".into(),
                        passphrase: None,
                    },
                    host_key_policy: HostKeyPolicy::AcceptNew,
                    known_hosts: vec!["/k2".into()],
                }],
                host_key_policy: HostKeyPolicy::Strict,
                known_hosts: vec!["/k".into()],
                connect_timeout: Duration::from_secs(7),
            }),
            slurm: None,
            sudo: None,
            policy: Default::default(),
            confine: Some(ConfineRules {
                write: vec!["~/work".into()],
                read: Some(vec!["~/data".into()]),
                net: crate::config::Net::Word("none".into()),
                require: true,
            }),
        }
    }

    #[test]
    fn key_sandboxes_round_trip_without_secrets() {
        let c = ssh(Auth::KeyFile {
            path: "/keys/id".into(),
            passphrase: None,
        });
        let (p, s) = Persisted::from_config(&c);
        assert_eq!(s, StoredSecret::default());
        assert_eq!(p.to_config(None).unwrap(), c);
        let local = SandboxConfig {
            name: "local".into(),
            transport: Transport::Local,
            slurm: None,
            sudo: None,
            policy: Default::default(),
            confine: None,
        };
        assert_eq!(
            Persisted::from_config(&local).0.to_config(None).unwrap(),
            local
        );
        // A Slurm login node keeps its defaults (the watchdog resubmits with them), and a
        // sandbox without them keeps the fingerprint it had before they were stored.
        let mut hpc = c.clone();
        hpc.slurm = Some(crate::config::SlurmDefaults {
            partition: Some("gpu".into()),
            gpus: Some(2),
            ..Default::default()
        });
        let (p, _) = Persisted::from_config(&hpc);
        let back: Persisted = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back.to_config(None).unwrap(), hpc);
        assert!(
            !serde_json::to_string(&Persisted::from_config(&c).0)
                .unwrap()
                .contains("slurm")
        );
    }

    #[test]
    fn passwords_are_stored_only_on_opt_in_and_never_in_the_database() {
        let d = tempfile::tempdir().unwrap();
        let conn = crate::store::open(d.path()).unwrap();
        let c = ssh(Auth::Password(Secret::new("S3cr3t-pw!")));
        let fp = fingerprint(&c);
        persist(&conn, d.path(), std::slice::from_ref(&c), false).unwrap();
        let p = load(&conn, &fp, "gpu").unwrap().unwrap();
        let e = p.to_config(read_secrets(d.path()).get(&fp)).unwrap_err();
        assert!(e.starts_with("needs credentials"), "{e}");
        assert!(!d.path().join(SECRETS_FILE).exists());
        persist(&conn, d.path(), std::slice::from_ref(&c), true).unwrap();
        let secrets = read_secrets(d.path());
        assert_eq!(p.to_config(secrets.get(&fp)).unwrap(), c);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.path().join(SECRETS_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        drop(conn);
        let db = std::fs::read(crate::store::db_path(d.path())).unwrap();
        let wal = std::fs::read(format!("{}-wal", crate::store::db_path(d.path()).display()))
            .unwrap_or_default();
        for bytes in [db, wal] {
            assert!(!bytes.windows(10).any(|w| w == b"S3cr3t-pw!"));
        }
        // Opting out again removes the stored secret.
        let conn = crate::store::open(d.path()).unwrap();
        persist(&conn, d.path(), &[c], false).unwrap();
        assert!(!d.path().join(SECRETS_FILE).exists());
    }

    /// Issue 46, item 10: server A (opted in) watches a job on a password sandbox; server B,
    /// same state dir and definition, without the opt-in, persisted its sandboxes and removed
    /// A's secret, so A's watch turned `needs_credentials`. Now a secret an active row names
    /// is kept; once nothing names it, opting out removes it as before.
    #[test]
    fn a_server_without_the_opt_in_keeps_a_secret_an_active_watch_uses() {
        let d = tempfile::tempdir().unwrap();
        let conn = crate::store::open(d.path()).unwrap();
        let c = ssh(Auth::Password(Secret::new("pw-of-a")));
        let fp = fingerprint(&c);
        persist(&conn, d.path(), std::slice::from_ref(&c), true).unwrap();
        conn.execute(
            "INSERT INTO watches (id, sandbox_name, sandbox_fp, tmux_session, log_file,
               created_ts, updated_ts) VALUES (1, 'gpu', ?1, 'train', '/l', 0, 0)",
            [&fp],
        )
        .unwrap();
        let secret_of_a = || read_secrets(d.path()).get(&fp).cloned();
        assert!(secret_of_a().is_some());
        // Server B, no opt-in: A's watch still connects.
        persist(&conn, d.path(), std::slice::from_ref(&c), false).unwrap();
        assert!(secret_of_a().is_some(), "server B removed A's secret");
        let p = load(&conn, &fp, "gpu").unwrap().unwrap();
        assert_eq!(p.to_config(secret_of_a().as_ref()).unwrap(), c);
        // A detached forward or a running transfer holds it the same way.
        conn.execute("UPDATE watches SET status = 'cancelled'", [])
            .unwrap();
        conn.execute(
            "INSERT INTO transfer_tasks (direction, sandbox_name, sandbox_fp, local_path,
               remote_path, status, created_ts, updated_ts)
             VALUES ('upload', 'gpu', ?1, '/a', 'b', 'running', 0, 0)",
            [&fp],
        )
        .unwrap();
        persist(&conn, d.path(), std::slice::from_ref(&c), false).unwrap();
        assert!(secret_of_a().is_some(), "removed under a running transfer");
        // Nothing uses it any more: opting out removes it.
        conn.execute("UPDATE transfer_tasks SET status = 'completed'", [])
            .unwrap();
        persist(&conn, d.path(), std::slice::from_ref(&c), false).unwrap();
        assert!(secret_of_a().is_none());
    }

    fn at(host: &str, pw: &str) -> SandboxConfig {
        let mut c = ssh(Auth::Password(Secret::new(pw)));
        if let Transport::Ssh(t) = &mut c.transport {
            t.host = host.into();
        }
        c
    }

    #[test]
    fn one_name_two_definitions_never_redirect_each_other() {
        let d = tempfile::tempdir().unwrap();
        let conn = crate::store::open(d.path()).unwrap();
        // Server A's `gpu` and server B's `gpu` are different machines with different secrets.
        let a = at("10.0.0.5", "pw-of-a");
        let b = at("10.0.0.9", "pw-of-b");
        let (fa, fb) = (fingerprint(&a), fingerprint(&b));
        assert_ne!(fa, fb);
        assert_eq!(fa, fingerprint(&a.clone()), "a fingerprint is stable");
        persist(&conn, d.path(), std::slice::from_ref(&a), true).unwrap();
        persist(&conn, d.path(), std::slice::from_ref(&b), true).unwrap();
        // The last writer did not win: each row's fingerprint still finds its own host.
        let ra = resolve(&conn, d.path(), &fa, "gpu")
            .unwrap()
            .unwrap()
            .unwrap();
        let rb = resolve(&conn, d.path(), &fb, "gpu")
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(ra, a);
        assert_eq!(rb, b);
        assert_eq!(count(&conn).unwrap(), 2);
        // A server without the opt-in removes only a secret that is its own: B's stays.
        let a_again = at("10.0.0.5", "pw-of-a");
        persist(&conn, d.path(), std::slice::from_ref(&a_again), false).unwrap();
        let secrets = read_secrets(d.path());
        assert!(
            !secrets.contains_key(&fa),
            "A opted out: its secret is gone"
        );
        assert_eq!(
            secrets.get(&fb).and_then(|s| s.password.as_deref()),
            Some("pw-of-b")
        );
        // And a third server with A's target but another password leaves B's and its own alone.
        persist(&conn, d.path(), &[at("10.0.0.9", "other")], false).unwrap();
        assert!(read_secrets(d.path()).contains_key(&fb));
        // A row from before fingerprints is found by name in the old table.
        assert!(load(&conn, "", "gpu").unwrap().is_none());
        conn.execute(
            "INSERT INTO sandboxes (name, def_json, updated_ts) VALUES ('gpu', ?1, 0)",
            [serde_json::to_string(&Persisted::from_config(&a).0).unwrap()],
        )
        .unwrap();
        assert_eq!(load(&conn, "", "gpu").unwrap().unwrap().host, "10.0.0.5");
    }

    #[test]
    fn concurrent_writers_keep_every_secret() {
        let d = tempfile::tempdir().unwrap();
        drop(crate::store::open(d.path()).unwrap());
        let dir = d.path().to_path_buf();
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let dir = dir.clone();
                std::thread::spawn(move || {
                    // Each its own connection, as separate servers have.
                    let conn = crate::store::open(&dir).unwrap();
                    // Every round changes the entry, so every round rewrites the file.
                    for round in 0..5 {
                        let c = at(&format!("10.0.1.{i}"), &format!("pw-{i}-{round}"));
                        persist(&conn, &dir, &[c], true).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let secrets = read_secrets(&dir);
        assert_eq!(
            secrets.len(),
            8,
            "a writer lost another's entry: {:?}",
            secrets.keys()
        );
        for i in 0..8 {
            // The password is not part of the fingerprint.
            let fp = fingerprint(&at(&format!("10.0.1.{i}"), "x"));
            assert_eq!(
                secrets.get(&fp).and_then(|s| s.password.clone()),
                Some(format!("pw-{i}-4"))
            );
        }
    }
}
