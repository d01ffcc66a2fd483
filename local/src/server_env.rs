//! What environment the MCP server started with, so `rsb doctor` (run from a shell) can say
//! where it differs: MCP clients start servers with an environment of their own (Codex passes
//! only `HOME, PATH, SHELL, LANG, TERM` and its configured `env_vars`), so a server may lack
//! `SSH_AUTH_SOCK` (ssh-agent logins fail) or `RSB_STATE_DIR` (its watches land in another
//! store than the CLI's) while the same commands work from the user's shell.
//!
//! `rsb mcp` writes a summary at start: the *names* of the variables that steer rsb
//! (`RSB_*`, `REMOTE_*`, `SSH_AUTH_SOCK`), never a value (a `REMOTE_PASSWORD` or a sandbox
//! list may hold secrets, and even a socket path says more than needed), plus its state
//! directory, config file path and configuration source: paths, no credentials. It goes to the
//! server's state dir and to the default one (the platform data dir under `HOME`), since a
//! server without `RSB_STATE_DIR` and a shell with it (or the reverse) share only the latter.
//! The last [`KEEP`] distinct environments are kept, newest first.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::config::Config;

/// Distinct server environments remembered (Claude Code's and Codex's servers, say).
pub const KEEP: usize = 8;

/// One server start, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerEnv {
    /// Unix seconds.
    pub started_at: u64,
    pub pid: u32,
    /// The parent process's name (the MCP client: `codex`, `claude`, `node`), where known.
    #[serde(default)]
    pub client: Option<String>,
    /// Names of the variables that steer rsb which were set (non-empty), sorted.
    pub vars: Vec<String>,
    pub state_dir: PathBuf,
    pub config_file: PathBuf,
    /// `Config::source`, or the configuration error's first words.
    pub config_source: String,
}

impl ServerEnv {
    /// Everything but when and who: two starts with the same of this are one environment.
    fn key(&self) -> (&[String], &Path, &Path, &str) {
        (
            &self.vars,
            &self.state_dir,
            &self.config_file,
            &self.config_source,
        )
    }
}

/// Whether a variable's *presence* matters to rsb (its value is never recorded). `RSB_LOG`
/// only changes logging, and the test/bench harness's own variables are not the user's.
fn steers_rsb(name: &str) -> bool {
    (name.starts_with("RSB_") || name.starts_with("REMOTE_") || name == "SSH_AUTH_SOCK")
        && name != "RSB_LOG"
        && !name.starts_with("RSB_TEST")
}

/// This process's summary: the variable names from `vars` (pairs from the environment).
pub fn current(
    vars: impl IntoIterator<Item = (String, String)>,
    state_dir: &Path,
    config_source: &str,
) -> ServerEnv {
    let names: BTreeSet<String> = vars
        .into_iter()
        .filter(|(k, v)| steers_rsb(k) && !v.is_empty())
        .map(|(k, _)| k)
        .collect();
    ServerEnv {
        started_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        pid: std::process::id(),
        client: parent_name(),
        vars: names.into_iter().collect(),
        state_dir: state_dir.to_path_buf(),
        config_file: crate::config::config_file_path(),
        config_source: config_source.to_string(),
    }
}

/// This process's real environment, as [`current`] takes it.
pub fn env_pairs() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .collect()
}

#[cfg(target_os = "linux")]
fn parent_name() -> Option<String> {
    let ppid = std::os::unix::process::parent_id();
    let comm = std::fs::read_to_string(format!("/proc/{ppid}/comm")).ok()?;
    let comm = comm.trim();
    (!comm.is_empty()).then(|| comm.to_string())
}

/// No `/proc` on macOS; the client stays unnamed (the rest of the summary is the same).
#[cfg(not(target_os = "linux"))]
fn parent_name() -> Option<String> {
    None
}

/// The records in `dir`, newest first; an absent or unreadable file is none.
pub fn read(dir: &Path) -> Vec<ServerEnv> {
    std::fs::read(dir.join(crate::store::layout::MCP_ENV))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Adds `me` to the records in `dir` (replacing an earlier start with the same environment),
/// keeping the newest [`KEEP`]. Atomic and 0600 ([`crate::store::write_private`]).
pub fn record_in(dir: &Path, me: &ServerEnv) -> std::io::Result<()> {
    crate::store::ensure_private_dir(dir)?;
    let mut all = read(dir);
    all.retain(|r| r.key() != me.key());
    all.insert(0, me.clone());
    all.truncate(KEEP);
    let bytes = serde_json::to_vec_pretty(&all).map_err(std::io::Error::other)?;
    crate::store::write_private(&dir.join(crate::store::layout::MCP_ENV), &bytes)
}

/// Where `rsb mcp` records and `rsb doctor` looks: the state dir, and the default one.
pub fn dirs(state_dir: &Path) -> Vec<PathBuf> {
    let mut d = vec![state_dir.to_path_buf()];
    let default = crate::config::default_state_dir();
    if default != state_dir {
        d.push(default);
    }
    d
}

/// `rsb mcp` at start: record this server's environment. Failures are logged, never fatal:
/// the server works without the record.
pub fn record(config: Option<&Config>, config_error: Option<&str>) {
    let state_dir = config
        .map(|c| c.state_dir.clone())
        .unwrap_or_else(crate::config::state_dir);
    let source = match (config, config_error) {
        (Some(c), _) => c.source.clone(),
        (None, Some(e)) => format!("configuration error: {e}"),
        (None, None) => String::new(),
    };
    let me = current(env_pairs(), &state_dir, &source);
    for dir in dirs(&state_dir) {
        if let Err(e) = record_in(&dir, &me) {
            tracing::debug!(
                "cannot record the server environment in {}: {e}",
                dir.display()
            );
        }
    }
}

/// How the recorded server environments differ from `me` (this shell's), newest first: one
/// line per server environment that differs. Only what was recorded is compared: names and
/// paths.
pub fn differences(me: &ServerEnv, recorded: &[ServerEnv]) -> Vec<(ServerEnv, Vec<String>)> {
    recorded
        .iter()
        .map(|r| {
            let mut d = Vec::new();
            let missing: Vec<&str> = me
                .vars
                .iter()
                .filter(|v| !r.vars.contains(v))
                .map(String::as_str)
                .collect();
            if !missing.is_empty() {
                d.push(format!("without {}", missing.join(", ")));
            }
            let extra: Vec<&str> = r
                .vars
                .iter()
                .filter(|v| !me.vars.contains(v))
                .map(String::as_str)
                .collect();
            if !extra.is_empty() {
                d.push(format!("with {} (unset here)", extra.join(", ")));
            }
            if r.state_dir != me.state_dir {
                d.push(format!(
                    "with another state dir, {} (here: {}): its watches and transfers are not the ones this shell sees",
                    r.state_dir.display(),
                    me.state_dir.display()
                ));
            }
            if r.config_file != me.config_file {
                d.push(format!(
                    "with another config file, {} (here: {})",
                    r.config_file.display(),
                    me.config_file.display()
                ));
            }
            if r.config_source != me.config_source {
                d.push(format!(
                    "with its sandboxes from {} (here: {})",
                    r.config_source, me.config_source
                ));
            }
            (r.clone(), d)
        })
        .collect()
}

/// Every record from [`dirs`], newest first, one per environment.
pub fn read_all(state_dir: &Path) -> Vec<ServerEnv> {
    let mut all: Vec<ServerEnv> = dirs(state_dir).iter().flat_map(|d| read(d)).collect();
    all.sort_by_key(|r| std::cmp::Reverse(r.started_at));
    let mut seen = Vec::new();
    all.retain(|r| {
        let k = (
            r.vars.clone(),
            r.state_dir.clone(),
            r.config_file.clone(),
            r.config_source.clone(),
        );
        if seen.contains(&k) {
            false
        } else {
            seen.push(k);
            true
        }
    });
    all.truncate(KEEP);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn names_only_and_only_those_that_steer_rsb() {
        let me = current(
            pairs(&[
                ("REMOTE_PASSWORD", "hunter2"),
                ("SSH_AUTH_SOCK", "/tmp/ssh-x/agent.1"),
                ("RSB_LOG", "debug"),
                ("RSB_STATE_DIR", ""),
                ("AWS_SECRET_ACCESS_KEY", "k"),
            ]),
            Path::new("/s"),
            "REMOTE_HOST",
        );
        assert_eq!(me.vars, vec!["REMOTE_PASSWORD", "SSH_AUTH_SOCK"]);
        let json = serde_json::to_string(&me).unwrap();
        assert!(
            !json.contains("hunter2") && !json.contains("/tmp/ssh-x"),
            "{json}"
        );
    }

    #[test]
    fn records_are_kept_newest_first_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..(KEEP + 3) {
            let mut me = current(Vec::new(), Path::new("/s"), &format!("src{i}"));
            me.started_at = i as u64;
            record_in(dir.path(), &me).unwrap();
        }
        // The same environment again replaces its earlier record.
        let mut again = current(Vec::new(), Path::new("/s"), &format!("src{}", KEEP + 2));
        again.started_at = 100;
        record_in(dir.path(), &again).unwrap();
        let all = read(dir.path());
        assert_eq!(all.len(), KEEP);
        assert_eq!(all[0].started_at, 100);
        assert_eq!(all[1].config_source, format!("src{}", KEEP + 1));
    }

    #[test]
    fn differences_name_what_differs() {
        let me = current(
            pairs(&[("SSH_AUTH_SOCK", "/a"), ("RSB_STATE_DIR", "/x")]),
            Path::new("/x"),
            "REMOTE_SANDBOX_LIST",
        );
        let mut server = me.clone();
        server.vars = vec![];
        server.state_dir = PathBuf::from("/default");
        let d = differences(&me, &[server, me.clone()]);
        assert_eq!(d.len(), 2);
        let text = d[0].1.join("; ");
        assert!(
            text.contains("without RSB_STATE_DIR, SSH_AUTH_SOCK"),
            "{text}"
        );
        assert!(text.contains("another state dir, /default"), "{text}");
        assert!(d[1].1.is_empty());
    }
}
