//! Which `rsb-agent` fits which remote, where it lives there, and how it gets there intact.
//!
//! The transport is abstracted by [`Remote`] so this crate holds the whole install algorithm
//! (probe → pick → upload to a temp name → verify the blake3 of what landed → chmod 700 →
//! atomic rename) without depending on an SSH library; `rsb` implements [`Remote`] over russh.
//!
//! Install paths are content-addressed (`<version>-<hash12>`), so two processes deploying at
//! once write identical bytes to the same final name and the rename race is harmless.

use std::{borrow::Cow, future::Future, path::PathBuf, sync::Arc};

include!(concat!(env!("OUT_DIR"), "/embedded.rs"));

/// Agent and `rsb` are released together from one workspace.
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

pub const TRIPLE_X86_64: &str = "x86_64-unknown-linux-musl";
pub const TRIPLE_AARCH64: &str = "aarch64-unknown-linux-musl";

#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    #[error(
        "unsupported platform {sys} {machine}: rsb-agent is built for Linux x86_64 and aarch64"
    )]
    UnsupportedPlatform { sys: String, machine: String },
    #[error("no rsb-agent for {triple} in this rsb build; {how}")]
    AgentMissing { triple: String, how: String },
    #[error("could not probe the remote host: {0}")]
    Probe(String),
    #[error("no writable directory that allows executing programs on the remote (tried {tried})")]
    NoExecDir { tried: String },
    #[error("uploaded agent is corrupt at {path}: blake3 {got} != {want}")]
    Verify {
        path: String,
        got: String,
        want: String,
    },
    #[error("agent upload to {path} failed: {reason}")]
    Upload { path: String, reason: String },
}

/// One agent binary ready to upload or run.
#[derive(Clone)]
pub struct AgentBinary {
    pub triple: &'static str,
    pub bytes: Arc<Cow<'static, [u8]>>,
    /// blake3 hex of `bytes`; the agent reports the same value in its Hello.
    pub hash: String,
    /// Where the bytes came from, for messages ("embedded", or a file path).
    pub source: String,
}

impl std::fmt::Debug for AgentBinary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBinary")
            .field("triple", &self.triple)
            .field("len", &self.bytes.len())
            .field("hash", &self.hash)
            .field("source", &self.source)
            .finish()
    }
}

impl AgentBinary {
    fn new(triple: &'static str, bytes: Cow<'static, [u8]>, source: String) -> Self {
        let hash = blake3::hash(&bytes).to_hex().to_string();
        Self {
            triple,
            bytes: Arc::new(bytes),
            hash,
            source,
        }
    }

    /// Directory name under `agent/`: version plus a hash prefix, so versions never collide.
    pub fn dir_name(&self) -> String {
        format!("{AGENT_VERSION}-{}", &self.hash[..12])
    }
}

/// Map `uname -s` / `uname -m` to the agent build that runs there.
pub fn triple_for(sys: &str, machine: &str) -> Result<&'static str, DeployError> {
    let unsupported = || DeployError::UnsupportedPlatform {
        sys: sys.into(),
        machine: machine.into(),
    };
    if !sys.eq_ignore_ascii_case("linux") {
        return Err(unsupported());
    }
    match machine {
        "x86_64" | "amd64" => Ok(TRIPLE_X86_64),
        "aarch64" | "arm64" | "armv8l" => Ok(TRIPLE_AARCH64),
        _ => Err(unsupported()),
    }
}

/// The musl triple matching this machine, when there is one (used by the local sandbox).
pub fn host_triple() -> Option<&'static str> {
    if std::env::consts::OS != "linux" {
        return None;
    }
    triple_for("Linux", std::env::consts::ARCH).ok()
}

/// How to get agents into a build that lacks them; shown verbatim to the user.
pub fn build_instructions(triple: &str) -> String {
    format!(
        "build it with `scripts/build-agents.sh` (needs `rustup target add {triple}`) and rebuild rsb, \
         or point RSB_AGENT_DIR at a directory holding {triple}/rsb-agent"
    )
}

/// Find the agent for `triple`: `$RSB_AGENT_DIR` first (a user's own build wins), then the
/// copy embedded at build time.
pub fn agent_for(triple: &str) -> Result<AgentBinary, DeployError> {
    let static_triple = match triple {
        TRIPLE_X86_64 => TRIPLE_X86_64,
        TRIPLE_AARCH64 => TRIPLE_AARCH64,
        other => {
            return Err(DeployError::AgentMissing {
                triple: other.into(),
                how: "rsb only ships Linux x86_64 and aarch64 agents".into(),
            });
        }
    };
    if let Some(dir) = std::env::var_os("RSB_AGENT_DIR").map(PathBuf::from) {
        for p in [
            dir.join(triple).join("rsb-agent"),
            dir.join(format!("rsb-agent-{triple}")),
        ] {
            if let Ok(bytes) = std::fs::read(&p) {
                return Ok(AgentBinary::new(
                    static_triple,
                    Cow::Owned(bytes),
                    p.display().to_string(),
                ));
            }
        }
    }
    EMBEDDED
        .iter()
        .find(|(t, _)| *t == triple)
        .map(|(_, b)| AgentBinary::new(static_triple, Cow::Borrowed(b), "embedded".into()))
        .ok_or_else(|| DeployError::AgentMissing {
            triple: triple.into(),
            how: build_instructions(triple),
        })
}

/// Which triples this build carries inside the `rsb` binary.
pub fn embedded_triples() -> Vec<&'static str> {
    EMBEDDED.iter().map(|(t, _)| *t).collect()
}

/// Paths handed to the login shell that sshd runs go through the one shell quoter.
pub use rsb_rules::shell::quote_str as shell_quote;

/// Facts about the remote needed to choose and place an agent.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    pub sys: String,
    pub machine: String,
    pub home: String,
    pub uid: String,
    pub xdg_runtime_dir: Option<String>,
}

/// One exec: a marker line guards against login-shell noise before the answers.
pub const PROBE_COMMAND: &str = "printf 'RSB-PROBE\\n%s\\n%s\\n%s\\n%s\\n%s\\n' \"$(uname -s)\" \"$(uname -m)\" \"$HOME\" \"$(id -u)\" \"${XDG_RUNTIME_DIR:-}\"";

pub fn parse_probe(stdout: &str) -> Result<Probe, DeployError> {
    let mut lines = stdout.lines().skip_while(|l| *l != "RSB-PROBE");
    if lines.next().is_none() {
        return Err(DeployError::Probe(format!(
            "unexpected probe output ({} bytes, no marker); is the login shell a POSIX shell?",
            stdout.len()
        )));
    }
    let mut next = || lines.next().unwrap_or("").trim().to_string();
    let (sys, machine, home, uid, xdg) = (next(), next(), next(), next(), next());
    if sys.is_empty() || machine.is_empty() {
        return Err(DeployError::Probe("uname printed nothing".into()));
    }
    if !home.starts_with('/') {
        return Err(DeployError::Probe(format!(
            "remote $HOME is not an absolute path ({home:?})"
        )));
    }
    Ok(Probe {
        sys,
        machine,
        home,
        uid,
        xdg_runtime_dir: (!xdg.is_empty() && xdg.starts_with('/')).then_some(xdg),
    })
}

/// Candidate install directories in order of preference. A `noexec` home falls through to
/// the runtime dir, then to a per-user directory in /tmp.
pub fn install_dirs(probe: &Probe, agent: &AgentBinary) -> Vec<String> {
    let name = agent.dir_name();
    let mut v = vec![format!(
        "{}/.cache/rsb/agent/{name}",
        probe.home.trim_end_matches('/')
    )];
    if let Some(x) = &probe.xdg_runtime_dir {
        v.push(format!("{}/rsb/agent/{name}", x.trim_end_matches('/')));
    }
    if !probe.uid.is_empty() && probe.uid.bytes().all(|b| b.is_ascii_digit()) {
        v.push(format!("/tmp/rsb-{}/agent/{name}", probe.uid));
    }
    v
}

pub fn agent_path(dir: &str) -> String {
    format!("{dir}/rsb-agent")
}

/// The command that turns an exec channel into an agent channel.
pub fn start_command(agent_path: &str) -> String {
    format!("exec {} serve", shell_quote(agent_path))
}

/// Output of one remote command.
#[derive(Debug, Clone, Default)]
pub struct RemoteOutput {
    pub exit_code: Option<u32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl RemoteOutput {
    pub fn ok(&self) -> bool {
        self.exit_code == Some(0)
    }

    pub fn stderr_line(&self) -> String {
        String::from_utf8_lossy(&self.stderr)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    }
}

/// What the install needs from a transport. `sftp_*` may return `Ok(None)` when the SFTP
/// subsystem is unavailable; the installer then falls back to `cat` over exec.
pub trait Remote: Sync {
    fn exec(
        &self,
        command: &str,
        stdin: Option<&[u8]>,
    ) -> impl Future<Output = Result<RemoteOutput, String>> + Send;
    fn sftp_write(
        &self,
        path: &str,
        data: &[u8],
    ) -> impl Future<Output = Result<Option<()>, String>> + Send;
    fn sftp_read(&self, path: &str)
    -> impl Future<Output = Result<Option<Vec<u8>>, String>> + Send;
}

/// Upload `agent` into `dir` and return the installed path. Every step is checked: the bytes
/// that landed are read back and hashed before the file becomes executable and visible under
/// its final name, so a truncated upload can never be started.
pub async fn install<R: Remote>(
    remote: &R,
    agent: &AgentBinary,
    dir: &str,
) -> Result<String, DeployError> {
    let final_path = agent_path(dir);
    let upload_err = |reason: String| DeployError::Upload {
        path: final_path.clone(),
        reason,
    };
    let qdir = shell_quote(dir);
    // Creating the dir and probing that it is writable and executable in one round trip.
    let prep = format!(
        "umask 077 && mkdir -p -- {qdir} && t={qdir}/.exec-check.$$ && printf '#!/bin/sh\\nexit 0\\n' > \"$t\" && chmod 700 \"$t\" && \"$t\"; rc=$?; rm -f \"$t\"; exit $rc"
    );
    let out = remote.exec(&prep, None).await.map_err(upload_err)?;
    if !out.ok() {
        return Err(upload_err(format!(
            "directory not writable or mounted noexec (exit {:?}{})",
            out.exit_code,
            match out.stderr_line() {
                l if l.is_empty() => String::new(),
                l => format!(": {l}"),
            }
        )));
    }
    let nonce = format!("{:x}", std::process::id() as u64 ^ now_nanos());
    let tmp = format!("{dir}/rsb-agent.tmp.{nonce}");
    let bytes: &[u8] = &agent.bytes;
    let landed = match remote.sftp_write(&tmp, bytes).await.map_err(upload_err)? {
        Some(()) => remote.sftp_read(&tmp).await.map_err(upload_err)?,
        None => None,
    };
    let landed = match landed {
        Some(b) => b,
        None => {
            let out = remote
                .exec(
                    &format!("umask 077 && cat > {}", shell_quote(&tmp)),
                    Some(bytes),
                )
                .await
                .map_err(upload_err)?;
            if !out.ok() {
                return Err(upload_err(format!(
                    "cat upload failed: {}",
                    out.stderr_line()
                )));
            }
            let out = remote
                .exec(&format!("cat {}", shell_quote(&tmp)), None)
                .await
                .map_err(upload_err)?;
            out.stdout
        }
    };
    let got = blake3::hash(&landed).to_hex().to_string();
    if got != agent.hash {
        let _ = remote
            .exec(&format!("rm -f -- {}", shell_quote(&tmp)), None)
            .await;
        return Err(DeployError::Verify {
            path: tmp,
            got,
            want: agent.hash.clone(),
        });
    }
    let fin = format!(
        "chmod 700 -- {t} && mv -f -- {t} {f}",
        t = shell_quote(&tmp),
        f = shell_quote(&final_path)
    );
    let out = remote.exec(&fin, None).await.map_err(upload_err)?;
    if !out.ok() {
        let _ = remote
            .exec(&format!("rm -f -- {}", shell_quote(&tmp)), None)
            .await;
        return Err(upload_err(format!("rename failed: {}", out.stderr_line())));
    }
    Ok(final_path)
}

/// Keep the newest three agent versions next to `dir` (best effort; never touches `dir`).
pub fn prune_command(dir: &str) -> String {
    let parent = dir.rsplit_once('/').map(|(p, _)| p).unwrap_or(dir);
    let keep = dir.rsplit_once('/').map(|(_, n)| n).unwrap_or("");
    format!(
        "cd {} 2>/dev/null && ls -1t | grep -v -x -F -e {} | tail -n +3 | while IFS= read -r d; do rm -rf -- \"$d\"; done; true",
        shell_quote(parent),
        shell_quote(keep)
    )
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triples() {
        assert_eq!(triple_for("Linux", "x86_64").unwrap(), TRIPLE_X86_64);
        assert_eq!(triple_for("Linux", "arm64").unwrap(), TRIPLE_AARCH64);
        let e = triple_for("Darwin", "arm64").unwrap_err().to_string();
        assert!(e.contains("unsupported platform Darwin arm64"), "{e}");
        assert!(triple_for("Linux", "riscv64").is_err());
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote("$(x);`y`"), "'$(x);`y`'");
    }

    #[test]
    fn probe_parsing_skips_noise() {
        let p = parse_probe("motd line\nRSB-PROBE\nLinux\nx86_64\n/home/u s\n1000\n\n").unwrap();
        assert_eq!(p.home, "/home/u s");
        assert_eq!(p.xdg_runtime_dir, None);
        assert!(parse_probe("nothing").is_err());
        assert!(parse_probe("RSB-PROBE\nLinux\nx86_64\nrelative\n1\n").is_err());
    }

    #[test]
    fn install_dirs_are_content_addressed() {
        let agent = AgentBinary::new(TRIPLE_X86_64, Cow::Borrowed(b"abc"), "t".into());
        let p = Probe {
            sys: "Linux".into(),
            machine: "x86_64".into(),
            home: "/h/".into(),
            uid: "7".into(),
            xdg_runtime_dir: Some("/run/user/7".into()),
        };
        let d = install_dirs(&p, &agent);
        assert_eq!(d.len(), 3);
        assert!(d[0].starts_with("/h/.cache/rsb/agent/"));
        assert!(d[0].ends_with(&agent.hash[..12]));
        assert!(d[2].starts_with("/tmp/rsb-7/agent/"));
    }

    #[test]
    fn missing_agent_says_how_to_build() {
        let e = agent_for("mips-unknown-linux-musl")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x86_64 and aarch64"), "{e}");
    }
}
