//! Read-only file system queries. Paths are data: a leading `~` or `~/` is the agent's `$HOME`,
//! nothing else is interpreted.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    BlockDevice,
    CharDevice,
    Other,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatRequest {
    pub path: String,
    /// Follow a final symlink (stat) instead of describing the link itself (lstat).
    pub follow: bool,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileStat {
    /// The path after `~` expansion (not canonicalised).
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub mtime_ns: i64,
    pub symlink_target: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListDirRequest {
    pub path: String,
    pub recursive: bool,
    /// Exact cap on returned entries; the agent stops walking once it is reached.
    pub max_entries: u64,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DirEntry {
    /// Relative to the listed directory, `/`-separated.
    pub rel: String,
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub mtime_ns: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListDirResult {
    /// The listed directory after `~` expansion.
    pub root: String,
    pub entries: Vec<DirEntry>,
    /// True only when at least one more entry existed beyond `max_entries`.
    pub truncated: bool,
    /// Subdirectories that could not be read (permission denied, vanished), as `rel: reason`.
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFileRequest {
    pub path: String,
    pub offset: u64,
    pub max_bytes: u64,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFileResult {
    pub path: String,
    /// Size of the whole file, not of `data`.
    pub size: u64,
    pub offset: u64,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// True when the file has bytes beyond `offset + data.len()`.
    pub truncated: bool,
}
