//! Which `rsb-agent` fits which remote, where it lives there, and how it gets there intact.
//!
//! The transport is abstracted by [`Remote`] so this crate holds the whole install algorithm
//! (probe → pick → upload to a temp name → verify the blake3 of what landed → chmod 700 →
//! atomic rename) without depending on an SSH library; `rsb` implements [`Remote`] over russh.
//!
//! Install paths are content-addressed (`<version>-<hash12>`), so two processes deploying at
//! once write identical bytes to the same final name and the rename race is harmless.
//!
//! Another local user must never be able to choose what runs as you. Every shell snippet that
//! places, verifies or starts the agent first checks the directory chain it works in (see
//! [`CHECKS`]): the agent's directory and the two above it (`<root>/agent/<name>`) are owned by
//! the login user and not writable by group or others, and every directory above those is owned
//! by that user or root and not writable by others unless sticky (like `/tmp`). Nobody else can
//! then replace anything between the check and the `exec` that follows in the same snippet.
//! A root that fails the check is skipped with the reason; if none passes, a fresh private
//! `mktemp -d` directory in /tmp is used (and found again by later connects).

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
    #[error(
        "no directory on the remote is private to the login user, writable and allows executing programs (tried {tried})"
    )]
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
        "install the target (`rustup target add {triple}`) and rebuild rsb (`cargo build` builds the agents; \
         `scripts/build-agents.sh` says what else is missing), \
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

/// One agent carried inside this `rsb` binary, for `rsb version` and `rsb doctor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddedAgent {
    pub triple: &'static str,
    pub bytes: usize,
    /// blake3 of the binary, hex; the same hash deploy verifies on the remote.
    pub blake3: String,
}

/// The agents this build embeds (built by `deploy/build.rs`), in triple order.
pub fn embedded_agents() -> Vec<EmbeddedAgent> {
    EMBEDDED
        .iter()
        .map(|(t, b)| EmbeddedAgent {
            triple: t,
            bytes: b.len(),
            blake3: blake3::hash(b).to_hex().to_string(),
        })
        .collect()
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

/// A directory rsb may own on the remote: `<parent>/<name>`, with the agent installed at
/// `<parent>/<name>/agent/<version>-<hash12>/rsb-agent`.
#[derive(Debug, Clone, PartialEq)]
pub struct InstallRoot {
    pub parent: String,
    pub name: String,
}

impl InstallRoot {
    pub fn path(&self) -> String {
        format!("{}/{}", self.parent.trim_end_matches('/'), self.name)
    }
}

/// Install roots in order of preference: `~/.cache/rsb`, then `$XDG_RUNTIME_DIR/rsb` (a
/// `noexec` home falls through to it), then `/tmp/rsb-<uid>`. [`locate_command`] adds a private
/// `mktemp -d` root when none of these is usable.
pub fn install_roots(probe: &Probe) -> Vec<InstallRoot> {
    let mut v = vec![InstallRoot {
        parent: format!("{}/.cache", probe.home.trim_end_matches('/')),
        name: "rsb".into(),
    }];
    if let Some(x) = &probe.xdg_runtime_dir {
        v.push(InstallRoot {
            parent: x.trim_end_matches('/').to_string(),
            name: "rsb".into(),
        });
    }
    if !probe.uid.is_empty() && probe.uid.bytes().all(|b| b.is_ascii_digit()) {
        v.push(InstallRoot {
            parent: "/tmp".into(),
            name: format!("rsb-{}", probe.uid),
        });
    }
    v
}

/// The agent's directory below an install root.
pub fn agent_subdir(agent: &AgentBinary) -> String {
    format!("agent/{}", agent.dir_name())
}

pub fn agent_path(dir: &str) -> String {
    format!("{dir}/rsb-agent")
}

/// Shell functions every snippet below starts with (POSIX sh; needs `stat -c`, which GNU
/// coreutils and BusyBox both have). `u` is the login user's uid; a failed check leaves the
/// reason in `rsb_why`. One `stat` call covers a whole chain, so a check costs two forks.
/// Their variables start with `rsb_k` so they never clobber a caller's.
///
/// - `rsb_check P N`: P is a physical path; its N lowest components (P itself first) must be
///   owned by `u` and not group/world-writable; every component above them must be owned by
///   `u` or root and not group/world-writable unless sticky. Sets `rsb_id` to P's identity
///   (device, inode, size, mtime, ctime): any replacement or write changes it, so a verified
///   identity stands for verified content.
/// - `rsb_file F N`: F is a regular file (not a symlink), checked with its N - 1 lowest
///   directories as by `rsb_check F N`.
pub const CHECKS: &str = r#"u=$(id -u) || exit 1
rsb_check() {
  rsb_kc=$1; rsb_kn=$2; set --
  while :; do
    set -- "$@" "$rsb_kc"
    [ "$rsb_kc" = / ] && break
    rsb_kc=${rsb_kc%/*}; [ -n "$rsb_kc" ] || rsb_kc=/
  done
  rsb_ks=$(stat -c '%u %a %d:%i:%s:%Y:%Z %n' -- "$@" 2>/dev/null) || { rsb_why="cannot stat $1 or a directory above it (is stat installed?)"; return 1; }
  rsb_id=
  while read -r rsb_ko rsb_km rsb_ki rsb_kp; do
    [ -n "$rsb_id" ] || rsb_id=$rsb_ki
    rsb_kb=$((0$rsb_km))
    if [ "$rsb_kn" -gt 0 ]; then
      [ "$rsb_ko" = "$u" ] || { rsb_why="$rsb_kp is owned by uid $rsb_ko, not by $u"; return 1; }
      [ $((rsb_kb & 18)) -eq 0 ] || { rsb_why="$rsb_kp is writable by group or others (mode $rsb_km)"; return 1; }
      rsb_kn=$((rsb_kn - 1))
    else
      [ "$rsb_ko" = "$u" ] || [ "$rsb_ko" = 0 ] || { rsb_why="$rsb_kp is owned by uid $rsb_ko, neither $u nor root"; return 1; }
      [ $((rsb_kb & 18)) -eq 0 ] || [ $((rsb_kb & 512)) -ne 0 ] || { rsb_why="$rsb_kp is writable by group or others (mode $rsb_km)"; return 1; }
    fi
  done <<RSB_EOF
$rsb_ks
RSB_EOF
  [ -n "$rsb_id" ] || { rsb_why="cannot stat $1"; return 1; }
}
rsb_file() {
  if [ -L "$1" ] || [ ! -f "$1" ]; then rsb_why="$1 is not a regular file"; return 1; fi
  rsb_check "$1" "$2"
}
"#;

/// How many components of an agent directory (`<root>/agent/<name>`) must belong to the user.
const OWNED_DEPTH: u32 = 3;

/// Candidate handling for [`locate_command`]: create what is missing (umask 077) without ever
/// creating anything inside a directory another user owns, check the chain, check that
/// programs may run there, and report the agent file if one is present.
const LOCATE_FNS: &str = r#"umask 077
rsb_try() {
  mkdir -p -- "$2" 2>/dev/null
  rsb_p=$(cd -P -- "$2" 2>/dev/null && pwd -P) || { echo "RSB-SKIP $1 cannot enter $2"; return 1; }
  rsb_check "$rsb_p" 0 || { echo "RSB-SKIP $1 $rsb_why"; return 1; }
  [ "$rsb_p" = / ] && rsb_p=
  rsb_r=$rsb_p/$3
  mkdir -- "$rsb_r" 2>/dev/null
  rsb_s=$(stat -c %u -- "$rsb_r" 2>/dev/null) || { echo "RSB-SKIP $1 cannot create $rsb_r"; return 1; }
  [ "$rsb_s" = "$u" ] || { echo "RSB-SKIP $1 $rsb_r is owned by uid $rsb_s, not by $u"; return 1; }
  rsb_in "$1" "$rsb_r" "$4"
}
rsb_in() {
  mkdir -p -- "$2/$3" 2>/dev/null
  rsb_d=$(cd -P -- "$2/$3" 2>/dev/null && pwd -P) || { echo "RSB-SKIP $1 cannot create $2/$3"; return 1; }
  rsb_check "$rsb_d" OWNED_DEPTH || { echo "RSB-SKIP $1 $rsb_why"; return 1; }
  rsb_t=$rsb_d/.exec-check.$$
  if ! { printf '#!/bin/sh\nexit 0\n' > "$rsb_t" && chmod 700 -- "$rsb_t" && "$rsb_t"; }; then
    rm -f -- "$rsb_t"; echo "RSB-SKIP $1 $rsb_d does not allow executing programs (mounted noexec?)"; return 1
  fi
  rm -f -- "$rsb_t"
  echo "RSB-DIR $1 $rsb_d"
  rsb_f=$rsb_d/rsb-agent
  if [ -e "$rsb_f" ] || [ -L "$rsb_f" ]; then
    if rsb_file "$rsb_f" FILE_DEPTH; then echo "RSB-FILE $1 $rsb_id"; else echo "RSB-BADFILE $1 $rsb_why"; fi
  fi
  return 0
}
rsb_private() {
  for rsb_q in /tmp/rsb-"$u".*; do
    [ -d "$rsb_q" ] && [ ! -L "$rsb_q" ] || continue
    [ "$(stat -c %u -- "$rsb_q" 2>/dev/null)" = "$u" ] || continue
    rsb_in "$1" "$rsb_q" "$2" && return 0
  done
  rsb_q=$(mktemp -d "/tmp/rsb-$u.XXXXXXXX") || { echo "RSB-SKIP $1 mktemp -d in /tmp failed"; return 1; }
  rsb_in "$1" "$rsb_q" "$2"
}
"#;

/// The label [`parse_locate`] reports for the private fallback root.
pub const PRIVATE_LABEL: &str = "private";

/// One exec that picks the first usable install directory among `roots[from..]`, falling back
/// to a private `/tmp/rsb-<uid>.XXXXXXXX`. Every path is passed single-quoted; the output is
/// read by [`parse_locate`].
pub fn locate_command(roots: &[InstallRoot], from: usize, agent: &AgentBinary) -> String {
    let sub = shell_quote(&agent_subdir(agent));
    let mut tries: Vec<String> = roots
        .iter()
        .enumerate()
        .skip(from)
        .map(|(i, r)| {
            format!(
                "rsb_try {i} {} {} {sub}",
                shell_quote(&r.parent),
                shell_quote(&r.name)
            )
        })
        .collect();
    tries.push(format!("rsb_private {PRIVATE_LABEL} {sub}"));
    format!(
        "{CHECKS}{}{}\n",
        LOCATE_FNS
            .replace("OWNED_DEPTH", &OWNED_DEPTH.to_string())
            .replace("FILE_DEPTH", &(OWNED_DEPTH + 1).to_string()),
        tries.join(" || ")
    )
}

/// What is in a usable agent directory.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentFile {
    Absent,
    /// Present and safe by owner and mode; the identity from `rsb_id`.
    Present(String),
    /// Present but not safe to run (a symlink, another owner, writable by others): replace it.
    Unsafe(String),
}

/// The outcome of [`locate_command`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Located {
    /// `(label, reason)` for each root that was refused: a root index or [`PRIVATE_LABEL`].
    pub skipped: Vec<(String, String)>,
    /// The chosen directory (physical path) with its label, and what it holds.
    pub dir: Option<(String, String, AgentFile)>,
}

pub fn parse_locate(stdout: &str) -> Located {
    let mut loc = Located::default();
    for line in stdout.lines() {
        let Some((tag, rest)) = line.split_once(' ') else {
            continue;
        };
        let (label, value) = rest.split_once(' ').unwrap_or((rest, ""));
        let (label, value) = (label.to_string(), value.to_string());
        match tag {
            "RSB-SKIP" => loc.skipped.push((label, value)),
            "RSB-DIR" => loc.dir = Some((label, value, AgentFile::Absent)),
            "RSB-FILE" | "RSB-BADFILE" => {
                if let Some((l, _, f)) = &mut loc.dir
                    && *l == label
                {
                    *f = if tag == "RSB-FILE" {
                        AgentFile::Present(value)
                    } else {
                        AgentFile::Unsafe(value)
                    };
                }
            }
            _ => {}
        }
    }
    loc
}

/// Check the agent at `path` (its directory chain, owner and mode) and print its identity, then,
/// with `content`, the file itself, so the caller can hash exactly what will run.
pub fn verify_command(path: &str, content: bool) -> String {
    format!(
        "{CHECKS}f={}\nif rsb_file \"$f\" {}; then echo \"RSB-FILE $rsb_id\"{}; else echo \"RSB-BAD $rsb_why\"; fi\n",
        shell_quote(path),
        OWNED_DEPTH + 1,
        if content { " && cat -- \"$f\"" } else { "" }
    )
}

/// The output of [`verify_command`]: the identity and, when asked for, the file's bytes.
pub fn parse_verify(stdout: &[u8]) -> Result<(String, Vec<u8>), String> {
    let mut at = 0;
    while at < stdout.len() {
        let end = stdout[at..]
            .iter()
            .position(|b| *b == b'\n')
            .map_or(stdout.len(), |i| at + i);
        let line = String::from_utf8_lossy(&stdout[at..end]);
        if let Some(id) = line.strip_prefix("RSB-FILE ") {
            let rest = &stdout[(end + 1).min(stdout.len())..];
            let size: usize = id
                .split(':')
                .nth(2)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("unreadable file identity {id:?}"))?;
            let body = rest.get(..size).unwrap_or(rest).to_vec();
            return Ok((id.to_string(), body));
        }
        if let Some(why) = line.strip_prefix("RSB-BAD ") {
            return Err(why.to_string());
        }
        at = end + 1;
    }
    Err("no answer from the verification (is the login shell a POSIX shell?)".into())
}

/// The command that turns an exec channel into an agent channel: the same checks as
/// [`verify_command`], then `exec` in the same shell, so nothing can change in between. (No
/// umask here: the agent's commands keep the login shell's.)
pub fn start_command(agent_path: &str) -> String {
    format!(
        "{CHECKS}f={}\nif rsb_file \"$f\" {}; then exec \"$f\" serve; fi\necho \"rsb: refusing to start $f: $rsb_why\" >&2\nexit 126\n",
        shell_quote(agent_path),
        OWNED_DEPTH + 1
    )
}

/// [`start_command`] that also insists the file is still the one whose identity (from
/// [`verify_command`]) was verified: a reconnect checks and starts in one exec, and nothing can
/// change between the check and the `exec`.
pub fn start_command_expecting(agent_path: &str, id: &str) -> String {
    format!(
        "{CHECKS}f={}\nif rsb_file \"$f\" {}; then if [ \"$rsb_id\" = {} ]; then exec \"$f\" serve; fi; rsb_why=\"it changed since it was verified\"; fi\necho \"rsb: refusing to start $f: $rsb_why\" >&2\nexit 126\n",
        shell_quote(agent_path),
        OWNED_DEPTH + 1,
        shell_quote(id)
    )
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

/// An agent that landed: where, and (when the rename provably moved our own upload) the
/// identity of the file under its final name, which stands for the verified content.
#[derive(Debug, Clone, PartialEq)]
pub struct Installed {
    pub path: String,
    pub id: Option<String>,
}

/// Upload `agent` into `dir` (a directory [`locate_command`] chose and checked) and return the
/// installed path. Every step is checked: the bytes that landed are read back and hashed
/// before the file becomes executable and visible under its final name, so a truncated upload
/// can never be started.
pub async fn install<R: Remote>(
    remote: &R,
    agent: &AgentBinary,
    dir: &str,
) -> Result<Installed, DeployError> {
    let final_path = agent_path(dir);
    let upload_err = |reason: String| DeployError::Upload {
        path: final_path.clone(),
        reason,
    };
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
    // The identity before and after the rename: the same inode means the final name holds
    // our verified upload, not a concurrent deploy's (identical bytes, but not ones we read).
    let fin = format!(
        "t={t}; f={f}; i='%d:%i:%s:%Y:%Z'\nchmod 700 -- \"$t\" && a=$(stat -c \"$i\" -- \"$t\") && mv -f -- \"$t\" \"$f\" && echo \"RSB-MOVED $a $(stat -c \"$i\" -- \"$f\")\"\n",
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
    let id = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("RSB-MOVED ").map(str::to_string))
        .and_then(|ids| {
            let (before, after) = ids.split_once(' ')?;
            let same_inode = before.split(':').take(2).eq(after.split(':').take(2));
            same_inode.then(|| after.to_string())
        });
    Ok(Installed {
        path: final_path,
        id,
    })
}

/// Keep the newest three agent versions next to `dir` (best effort; never touches `dir`),
/// and every version a Slurm job that has not ended will still exec: its batch script under
/// `$HOME/<jobs_root>/<name>/batch.sh` names the agent's path, and a job pending in the queue
/// across three upgrades would otherwise start on a deleted agent. A job has ended when its
/// record's `state` holds `ended_ms=`.
pub fn prune_command(dir: &str, jobs_root: &str) -> String {
    let parent = dir.rsplit_once('/').map(|(p, _)| p).unwrap_or(dir);
    let keep = dir.rsplit_once('/').map(|(_, n)| n).unwrap_or("");
    format!(
        "cd {parent} 2>/dev/null || exit 0\n\
         held=$(for b in \"$HOME\"/{jobs}/*/batch.sh; do [ -f \"$b\" ] || continue; \
         j=${{b%/batch.sh}}; grep -q '^ended_ms=' \"$j/state\" 2>/dev/null && continue; \
         cat \"$b\"; done 2>/dev/null)\n\
         ls -1t | grep -v -x -F -e {keep} | tail -n +3 | while IFS= read -r d; do \
         case \"$held\" in *\"/$d/\"*) continue;; esac; rm -rf -- \"$d\"; done; true\n",
        parent = shell_quote(parent),
        keep = shell_quote(keep),
        jobs = shell_quote(jobs_root.trim_matches('/')),
    )
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// build.rs's choice of agent builder, compiled here only to be tested.
#[cfg(test)]
#[path = "../agent_builder.rs"]
mod agent_builder;

#[cfg(test)]
mod agent_builder_tests {
    use super::agent_builder::{AgentBuilder, choose};

    fn has(progs: &'static [&'static str]) -> impl Fn(&str) -> bool {
        move |p| progs.contains(&p)
    }

    const LINUX: &str = "x86_64-unknown-linux-gnu";
    const MAC: &str = "aarch64-apple-darwin";
    const X86: &str = "x86_64-unknown-linux-musl";
    const ARM: &str = "aarch64-unknown-linux-musl";

    #[test]
    fn linux_with_musl_gcc_keeps_the_gcc_build() {
        let all = has(&["gcc", "aarch64-linux-gnu-gcc", "cargo-zigbuild", "zig"]);
        assert_eq!(choose(LINUX, X86, false, &all), Ok(AgentBuilder::MuslGcc));
        assert_eq!(choose(LINUX, ARM, false, &all), Ok(AgentBuilder::MuslGcc));
        assert_eq!(choose(LINUX, ARM, true, &all), Ok(AgentBuilder::Zig));
    }

    #[test]
    fn a_mac_builds_both_agents_with_zig_even_with_a_gcc_on_path() {
        // Apple's `gcc` is clang without a musl sysroot.
        let mac = has(&["gcc", "cargo-zigbuild", "zig"]);
        assert_eq!(choose(MAC, X86, false, &mac), Ok(AgentBuilder::Zig));
        assert_eq!(choose(MAC, ARM, false, &mac), Ok(AgentBuilder::Zig));
        let linux_no_cross = has(&["gcc", "cargo-zigbuild", "zig"]);
        assert_eq!(
            choose(LINUX, ARM, false, &linux_no_cross),
            Ok(AgentBuilder::Zig)
        );
    }

    #[test]
    fn nothing_to_build_with_names_what_to_install() {
        let e = choose(MAC, X86, false, &has(&["gcc", "zig"])).unwrap_err();
        assert!(e.contains("pip install ziglang cargo-zigbuild"), "{e}");
        assert!(!e.contains('\n'));
        let e = choose(LINUX, ARM, false, &has(&["gcc"])).unwrap_err();
        assert!(
            e.contains("gcc-aarch64-linux-gnu") && e.contains("ziglang"),
            "{e}"
        );
        let e = choose(LINUX, X86, true, &has(&["gcc", "cargo-zigbuild"])).unwrap_err();
        assert!(e.contains("RSB_AGENTS_WITH_ZIG=1"), "{e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 43: the prune kept three versions, so a Slurm job pending across upgrades
    /// exec'd a deleted agent. Versions named by an unended job's batch script are kept.
    #[test]
    fn prune_keeps_three_versions_and_those_unended_slurm_jobs_will_exec() {
        let home =
            std::env::temp_dir().join(format!("rsb-prune-{}-{}", std::process::id(), now_nanos()));
        let agents = home.join(".cache/rsb/agent");
        let jobs = home.join(".cache/rsb/jobs");
        let versions = ["v1", "v2", "v3", "v4", "v5", "v6"];
        for (i, v) in versions.iter().enumerate() {
            let d = agents.join(v);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("rsb-agent"), "x").unwrap();
            // Oldest first: v1 ten minutes ago, v6 now.
            let t = std::process::Command::new("touch")
                .arg("-d")
                .arg(format!("-{} minutes", 10 - i))
                .arg(&d)
                .status()
                .unwrap();
            assert!(t.success());
        }
        let job = |name: &str, v: &str, ended: bool| {
            let j = jobs.join(name);
            std::fs::create_dir_all(&j).unwrap();
            std::fs::write(
                j.join("batch.sh"),
                format!(
                    "#!/bin/sh\nexec '{}' job-run --root x --name {name}\n",
                    agents.join(v).join("rsb-agent").display()
                ),
            )
            .unwrap();
            if ended {
                std::fs::write(j.join("state"), "name=x\nended_ms=5\n").unwrap();
            } else {
                std::fs::write(j.join("state"), "name=x\n").unwrap();
            }
        };
        job("pending", "v1", false);
        job("done", "v2", true);
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(prune_command(
                &agents.join("v6").display().to_string(),
                ".cache/rsb/jobs",
            ))
            .env("HOME", &home)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let mut left: Vec<String> = std::fs::read_dir(&agents)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        // v6 (in use), the two newest others, and v1 that the pending job will exec.
        assert_eq!(left, ["v1", "v4", "v5", "v6"]);
        let _ = std::fs::remove_dir_all(&home);
    }

    #[test]
    fn embedded_agents_are_named_with_their_hash() {
        let agents = embedded_agents();
        assert_eq!(
            agents.iter().map(|a| a.triple).collect::<Vec<_>>(),
            embedded_triples()
        );
        for a in agents {
            let bin = agent_for(a.triple).unwrap();
            assert_eq!(a.bytes, bin.bytes.len());
            assert_eq!(a.blake3, blake3::hash(&bin.bytes).to_hex().to_string());
        }
    }

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
    fn install_roots_in_order() {
        let p = Probe {
            sys: "Linux".into(),
            machine: "x86_64".into(),
            home: "/h/".into(),
            uid: "7".into(),
            xdg_runtime_dir: Some("/run/user/7".into()),
        };
        let d = install_roots(&p);
        assert_eq!(
            d.iter().map(InstallRoot::path).collect::<Vec<_>>(),
            ["/h/.cache/rsb", "/run/user/7/rsb", "/tmp/rsb-7"]
        );
        let agent = AgentBinary::new(TRIPLE_X86_64, Cow::Borrowed(b"abc"), "t".into());
        assert!(agent_subdir(&agent).ends_with(&agent.hash[..12]));
    }

    #[test]
    fn locate_output_is_parsed() {
        let out = "noise\nRSB-SKIP 0 /h/.cache is owned by uid 5, neither 7 nor root\n\
                   RSB-DIR 2 /tmp/rsb-7/agent/v-x y\nRSB-FILE 2 1:2:3:4:5\n";
        let l = parse_locate(out);
        assert_eq!(l.skipped.len(), 1);
        assert_eq!(
            l.dir,
            Some((
                "2".into(),
                "/tmp/rsb-7/agent/v-x y".into(),
                AgentFile::Present("1:2:3:4:5".into())
            ))
        );
    }

    #[test]
    fn verify_output_is_parsed() {
        let (id, body) = parse_verify(b"motd\nRSB-FILE 1:2:3:4:5\nabc").unwrap();
        assert_eq!((id.as_str(), body.as_slice()), ("1:2:3:4:5", &b"abc"[..]));
        let e = parse_verify(b"RSB-BAD /x is owned by uid 9, not by 7\n").unwrap_err();
        assert!(e.contains("owned by uid 9"), "{e}");
        assert!(parse_verify(b"").is_err());
    }

    /// The snippets run under the shells a remote login may have, and refuse what they must.
    #[test]
    fn snippets_check_the_chain_in_real_shells() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = std::env::temp_dir().join(format!("rsb-deploy-test-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700)).unwrap();
        struct Remove(std::path::PathBuf);
        impl Drop for Remove {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let _remove = Remove(tmp.clone());
        let tmp = tmp.canonicalize().unwrap();
        let root = tmp.join("root");
        let agent = AgentBinary::new(
            TRIPLE_X86_64,
            Cow::Borrowed(b"#!/bin/sh\necho hi\n"),
            "t".into(),
        );
        let roots = [InstallRoot {
            parent: tmp.display().to_string(),
            name: "root".into(),
        }];
        for shell in ["sh", "bash", "dash", "busybox"] {
            let mut cmd = std::process::Command::new(shell);
            if shell == "busybox" {
                cmd.arg("sh");
            }
            if cmd.arg("-c").arg("true").output().is_err() {
                eprintln!("note: {shell} is not installed; not testing the snippets under it");
                continue;
            }
            let run = |script: &str| {
                let mut cmd = std::process::Command::new(shell);
                if shell == "busybox" {
                    cmd.arg("sh");
                }
                let out = cmd.arg("-c").arg(script).output().unwrap();
                String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr)
            };
            let _ = std::fs::remove_dir_all(&root);
            let l = parse_locate(&run(&locate_command(&roots, 0, &agent)));
            let (label, dir, file) = l.dir.clone().unwrap_or_else(|| panic!("{shell}: {l:?}"));
            assert_eq!(
                (label.as_str(), &file),
                ("0", &AgentFile::Absent),
                "{shell}"
            );
            assert!(dir.ends_with(&agent_subdir(&agent)), "{shell}: {dir}");
            let mode = std::fs::metadata(&root).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{shell}");
            let path = agent_path(&dir);
            std::fs::write(&path, &**agent.bytes).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
            let (_, body) = parse_verify(run(&verify_command(&path, true)).as_bytes()).unwrap();
            assert_eq!(body, &**agent.bytes, "{shell}");
            assert!(run(&start_command(&path)).contains("hi"), "{shell}");
            // Started by identity: the verified file runs; a rewritten one (same bytes, new
            // identity) does not.
            let (id, _) = parse_verify(run(&verify_command(&path, false)).as_bytes()).unwrap();
            assert!(
                run(&start_command_expecting(&path, &id)).contains("hi"),
                "{shell}"
            );
            let out = run(&start_command_expecting(&path, "1:2:3:4:5"));
            assert!(
                out.contains("changed since it was verified") && !out.contains("hi"),
                "{shell}: {out}"
            );

            // Group-writable: refused by verify and start, skipped by locate.
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
            let e = parse_verify(run(&verify_command(&path, false)).as_bytes()).unwrap_err();
            assert!(
                e.contains("writable by group or others (mode 770)"),
                "{shell}: {e}"
            );
            let out = run(&start_command(&path));
            assert!(
                out.contains("refusing to start") && !out.contains("hi"),
                "{shell}: {out}"
            );
            let l = parse_locate(&run(&locate_command(&roots, 0, &agent)));
            assert!(
                l.skipped[0].1.contains("writable by group"),
                "{shell}: {l:?}"
            );
            assert_eq!(l.dir.as_ref().unwrap().0, PRIVATE_LABEL, "{shell}: {l:?}");
            let private = l.dir.unwrap().1;
            assert!(private.starts_with("/tmp/rsb-"), "{shell}: {private}");
            // A later locate finds the same private directory again.
            let again = parse_locate(&run(&locate_command(&roots, 0, &agent)));
            assert_eq!(again.dir.unwrap().1, private, "{shell}");
            let _ = std::fs::remove_dir_all(
                private.trim_end_matches(&format!("/{}", agent_subdir(&agent))),
            );
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();

            // A symlink in place of the agent is reported, not followed.
            std::fs::remove_file(&path).unwrap();
            std::os::unix::fs::symlink("/bin/true", &path).unwrap();
            let l = parse_locate(&run(&locate_command(&roots, 0, &agent)));
            assert!(matches!(l.dir.unwrap().2, AgentFile::Unsafe(_)), "{shell}");

            // An ancestor others may write to (not sticky) makes the whole root unusable.
            std::fs::remove_file(&path).unwrap();
            std::fs::write(&path, &**agent.bytes).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
            assert!(run(&start_command(&path)).contains("hi"), "{shell}");
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o777)).unwrap();
            let out = run(&start_command(&path));
            assert!(out.contains("(mode 777)"), "{shell}: {out}");
            let l = parse_locate(&run(&locate_command(&roots, 0, &agent)));
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700)).unwrap();
            assert!(l.skipped[0].1.contains("(mode 777)"), "{shell}: {l:?}");
            let private = l.dir.unwrap().1;
            let _ = std::fs::remove_dir_all(
                private.trim_end_matches(&format!("/{}", agent_subdir(&agent))),
            );
        }
    }

    #[test]
    fn missing_agent_says_how_to_build() {
        let e = agent_for("mips-unknown-linux-musl")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x86_64 and aarch64"), "{e}");
    }
}
