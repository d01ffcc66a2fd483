//! The one error type of the local side. Every failure a user can see carries a one-line
//! message and a hint, so the MCP layer can reply `{"error", "hint"}` without guessing.

use rsb_protocol::{AgentError, ErrorCode};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    UnknownSandbox,
    Config,
    Connect,
    Auth,
    HostKey,
    /// The link died while a request was in flight; the next call reconnects.
    ConnectionLost,
    Deploy,
    /// The agent refused or failed the request.
    Agent(ErrorCode),
    InvalidArgument,
    /// The command policy denied the command, or it needed an approval that was not given.
    Policy,
    Timeout,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RsbError {
    pub kind: Kind,
    pub message: String,
    pub hint: String,
}

pub type Result<T, E = RsbError> = std::result::Result<T, E>;

impl RsbError {
    pub fn new(kind: Kind, message: impl Into<String>, hint: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            hint: hint.into(),
        }
    }

    pub fn invalid(message: impl Into<String>, hint: impl Into<String>) -> Self {
        Self::new(Kind::InvalidArgument, message, hint)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            Kind::Internal,
            message,
            "this is a bug in rsb; please report it with the log",
        )
    }

    pub fn connection_lost(sandbox: &str, detail: &str) -> Self {
        Self::new(
            Kind::ConnectionLost,
            format!("connection lost to sandbox '{sandbox}': {detail}"),
            "the request may or may not have run; the next call reconnects",
        )
    }

    pub fn is_connection_lost(&self) -> bool {
        self.kind == Kind::ConnectionLost
    }

    /// Map an agent error to a user-facing one with a hint per code.
    pub fn from_agent(e: AgentError) -> Self {
        let hint = match e.code {
            // The sandbox's own boundary, not the host's permissions.
            ErrorCode::PermissionDenied if e.message.starts_with("confine: read ") => {
                "read under the sandbox's confine.read or confine.write roots, or change its confine in the config (README: Confinement)"
            }
            ErrorCode::PermissionDenied if e.message.starts_with("confine: ") => {
                "work under the sandbox's confine.write roots, or change its confine in the config (README: Confinement)"
            }
            ErrorCode::NotFound => {
                "check the path (remote paths are relative to the remote $HOME; ~ is expanded)"
            }
            ErrorCode::NotADirectory => "the path names a file, not a directory",
            ErrorCode::IsADirectory => {
                "the path names a directory; use list_remote_files for directories"
            }
            ErrorCode::PermissionDenied => "the remote user lacks permission for this path",
            ErrorCode::AlreadyExists => "choose another name, or stop the existing one first",
            ErrorCode::InvalidArgument => "fix the argument as the message says",
            ErrorCode::NoSpace => "free space on the remote file system, then retry",
            ErrorCode::Unsupported => "this host or agent does not support the operation",
            ErrorCode::Cancelled => "the request was cancelled",
            ErrorCode::Busy => "wait for what holds it to end, or ask another sandbox",
            ErrorCode::Io | ErrorCode::Internal => "retry; if it persists, check the remote host",
        };
        Self::new(Kind::Agent(e.code), e.message, hint)
    }
}

impl std::fmt::Display for RsbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RsbError {}
