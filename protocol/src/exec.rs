//! Running one command to completion with a timeout the agent enforces itself.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Passed to `bash -c` as one argument, never spliced into another shell string.
    pub command: String,
    /// Working directory, taken as a path (a leading `~` or `~/` means the agent's `$HOME`).
    pub cwd: Option<String>,
    /// Extra environment, passed as data.
    pub env: Vec<(String, String)>,
    /// 0 means no timeout.
    pub timeout_ms: u64,
    /// After the timeout (or a cancel) the group gets SIGTERM, then SIGKILL after this grace.
    pub kill_grace_ms: u64,
    /// Caps on what the reply carries; output beyond them is counted, not kept.
    pub max_stdout: u64,
    pub max_stderr: u64,
    /// Also send output as [`crate::Chunk`]s while the command runs (for live CLI output).
    pub stream: bool,
    /// The command's stdin is a pipe fed by [`crate::ToAgent::Input`] frames (like `ssh host
    /// cmd`); otherwise it is /dev/null, so a command that reads input ends at once (the MCP
    /// tool). Implies streaming: the agent acknowledges written input with
    /// [`crate::Chunk::InputConsumed`].
    pub stdin: bool,
    /// Run on a pseudo-terminal of this size (`rsb exec -t`, `rsb shell`): stdin, stdout and
    /// stderr are the terminal, output arrives as stdout chunks, and input frames feed it
    /// whether or not `stdin` is set.
    pub tty: Option<TtySize>,
    /// Confine the command (and all it starts) with Landlock before it runs; see [`Confine`].
    pub confine: Option<Confine>,
}

/// The kernel as the boundary: what a confined command may change. Applied by the agent in the
/// child between fork and exec (`no_new_privs`, then `landlock_restrict_self`), so the command
/// and everything it starts inherit it, whatever they are written in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confine {
    /// The only trees (or files) in which a command may create, change, rename or delete; a
    /// leading `~` is the agent's `$HOME`. Each must exist.
    pub write: Vec<String>,
    /// `None`: everything stays readable and executable. `Some(roots)`: a command may read and
    /// execute only beneath these, the write roots and the system's own trees
    /// ([`SYSTEM_READABLE`]), so `~/.ssh` or another project stays out of its reach. Each must
    /// exist.
    pub read: Option<Vec<String>>,
    /// TCP the command may use: `None` any; `Some([])` none; else connect and bind only on
    /// these ports (Landlock ABI 4, Linux 6.7). UDP and other protocols are not covered.
    pub net: Option<Vec<u16>>,
    /// When the host cannot enforce this (no Landlock, or an older ABI than needed), refuse to
    /// run; false: run with what the host can enforce and say what is not in
    /// [`ExecResult::unconfined`].
    pub require: bool,
}

/// The trees a command whose reads are confined ([`Confine::read`]) may still read and execute:
/// the system's programs, libraries and settings, and the kernel's views. Those missing on a
/// host are skipped.
pub const SYSTEM_READABLE: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/nix",
    "/proc", "/sys", "/dev", "/run",
];

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtySize {
    pub rows: u16,
    pub cols: u16,
}

/// What the caller feeds a running exec that asked for `stdin` or a `tty`.
///
/// Flow control: the caller keeps at most [`INPUT_WINDOW`] bytes sent but not yet acknowledged
/// by [`crate::Chunk::InputConsumed`], so a command that does not read its input stops the
/// sender instead of growing the agent's memory, and the channel stays free for other requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ExecInput {
    /// Bytes for the command's stdin (or the terminal), at most [`crate::MAX_CHUNK`].
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    /// End of input: the command's stdin is closed (on a terminal: the EOF character is sent).
    Eof,
    /// The caller's terminal changed size (a terminal only; ignored otherwise).
    Resize(TtySize),
    /// Send this signal (a raw number: INT for ^C, PIPE when the caller's output closed, TERM)
    /// to the command's whole session, as a terminal or a closing pipe would.
    Signal(i32),
}

/// Most input bytes in flight (sent, not yet acknowledged) per exec.
pub const INPUT_WINDOW: u64 = 1 << 20;

impl ExecRequest {
    pub fn new(command: impl Into<String>) -> Self {
        Self {
            command: command.into(),
            cwd: None,
            env: Vec::new(),
            timeout_ms: 120_000,
            kill_grace_ms: 2_000,
            max_stdout: 1 << 20,
            max_stderr: 1 << 20,
            stream: false,
            stdin: false,
            tty: None,
            confine: None,
        }
    }
}

/// Output kept within a cap: the first half and the last half of the cap, so both the start
/// of a log and the error at its end survive truncation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Captured {
    #[serde(with = "serde_bytes")]
    pub head: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub tail: Vec<u8>,
    /// Bytes the command wrote in all; `total > head.len() + tail.len()` means truncated.
    pub total: u64,
}

impl Captured {
    pub fn truncated(&self) -> bool {
        self.total > (self.head.len() + self.tail.len()) as u64
    }

    /// Bytes dropped between head and tail.
    pub fn omitted(&self) -> u64 {
        self.total
            .saturating_sub((self.head.len() + self.tail.len()) as u64)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    /// `None` when the process was ended by a signal.
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// True only when the agent's own timer fired; a command exiting 124 is not a timeout.
    pub timed_out: bool,
    pub cancelled: bool,
    pub duration_ms: u64,
    pub stdout: Captured,
    pub stderr: Captured,
    /// Pids of the command's session still alive after the timeout's or cancel's SIGKILL and
    /// its verification wait (empty when everything is gone, as it should be).
    pub survivors: Vec<u32>,
    /// The request asked for confinement with `require: false` and the host could not give
    /// it: why (the command ran unconfined).
    pub unconfined: Option<String>,
}
