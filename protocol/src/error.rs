//! Errors the agent reports as data. The code lets the local side map them to a precise
//! user-facing message and hint without parsing strings.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    NotFound,
    NotADirectory,
    IsADirectory,
    PermissionDenied,
    AlreadyExists,
    InvalidArgument,
    NoSpace,
    Unsupported,
    Cancelled,
    /// What was asked for is held by someone else now (GPUs leased or in use): try later or
    /// elsewhere.
    Busy,
    Io,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentError {
    pub code: ErrorCode,
    pub message: String,
}

impl AgentError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// Map an OS error on `path` to a code plus a message that names the path.
    pub fn from_io(err: &std::io::Error, what: &str, path: &str) -> Self {
        use std::io::ErrorKind as K;
        let code = match err.kind() {
            K::NotFound => ErrorCode::NotFound,
            K::PermissionDenied => ErrorCode::PermissionDenied,
            K::AlreadyExists => ErrorCode::AlreadyExists,
            K::NotADirectory => ErrorCode::NotADirectory,
            K::IsADirectory => ErrorCode::IsADirectory,
            K::StorageFull | K::QuotaExceeded => ErrorCode::NoSpace,
            K::InvalidInput => ErrorCode::InvalidArgument,
            _ => ErrorCode::Io,
        };
        let reason = match code {
            ErrorCode::NotFound => "no such file or directory".to_string(),
            ErrorCode::PermissionDenied => "permission denied".to_string(),
            ErrorCode::NotADirectory => "not a directory".to_string(),
            ErrorCode::IsADirectory => "is a directory".to_string(),
            ErrorCode::NoSpace => "no space left on device".to_string(),
            _ => err.to_string(),
        };
        Self::new(code, format!("{what} {path}: {reason}"))
    }
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for AgentError {}
