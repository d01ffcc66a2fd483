//! `list_remote_files` and `read_remote_file`.

use base64::Engine;
use rsb_protocol::{FileKind, ListDirRequest, ListDirResult, ReadFileRequest, ReadFileResult};
use serde::Serialize;

use crate::error::{Result, RsbError};

pub const DEFAULT_MAX_ENTRIES: i64 = 200;
/// Keeps one listing inside a frame.
pub const MAX_ENTRIES: i64 = 50_000;
pub const DEFAULT_MAX_BYTES: i64 = 200_000;
pub const MAX_READ_BYTES: i64 = 8 * 1024 * 1024;

fn check_path(p: &str, what: &str) -> Result<()> {
    if p.trim().is_empty() {
        return Err(RsbError::invalid(
            format!("{what} cannot be empty"),
            "pass a remote path; ~ means the remote home",
        ));
    }
    if p.contains('\0') {
        return Err(RsbError::invalid(
            format!("{what} contains a NUL byte"),
            "pass a plain path",
        ));
    }
    Ok(())
}

pub fn list_request(
    remote_path: &str,
    recursive: bool,
    max_entries: i64,
) -> Result<ListDirRequest> {
    check_path(remote_path, "remote_path")?;
    if max_entries <= 0 || max_entries > MAX_ENTRIES {
        return Err(RsbError::invalid(
            format!("max_entries must be between 1 and {MAX_ENTRIES} (got {max_entries})"),
            "list a narrower directory for more entries",
        ));
    }
    Ok(ListDirRequest {
        path: remote_path.to_string(),
        recursive,
        max_entries: max_entries as u64,
    })
}

/// One entry of a listing. `type` appears only for what is neither a file nor a directory.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub path: String,
    pub is_dir: bool,
    pub size: u64,
    /// Seconds since the epoch.
    pub mtime: i64,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Listing {
    pub truncated: bool,
    pub entries: Vec<Entry>,
    /// Paths the walk could not read (with why).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<String>,
}

/// Entry paths are the listed directory joined with the relative name: `./x` for `.`,
/// absolute under the remote home for `~`, as the seed did.
pub fn list_reply(remote_path: &str, res: &ListDirResult) -> Listing {
    let base = if remote_path == "~" || remote_path.starts_with("~/") {
        res.root.trim_end_matches('/').to_string()
    } else if remote_path == "/" {
        String::new()
    } else {
        remote_path.trim_end_matches('/').to_string()
    };
    let entries = res
        .entries
        .iter()
        .map(|e| Entry {
            path: format!("{base}/{}", e.rel),
            is_dir: e.kind == FileKind::Dir,
            size: e.size,
            mtime: e.mtime_ns.div_euclid(1_000_000_000),
            kind: (!matches!(e.kind, FileKind::File | FileKind::Dir)).then(|| kind_name(e.kind)),
        })
        .collect();
    Listing {
        truncated: res.truncated,
        entries,
        unreadable: res.errors.clone(),
    }
}

pub fn kind_name(k: FileKind) -> &'static str {
    match k {
        FileKind::File => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "symlink",
        FileKind::Fifo => "fifo",
        FileKind::Socket => "socket",
        FileKind::BlockDevice => "block_device",
        FileKind::CharDevice => "char_device",
        FileKind::Other => "other",
    }
}

pub fn read_request(remote_path: &str, max_bytes: i64) -> Result<ReadFileRequest> {
    check_path(remote_path, "remote_path")?;
    if max_bytes <= 0 || max_bytes > MAX_READ_BYTES {
        return Err(RsbError::invalid(
            format!("max_bytes must be between 1 and {MAX_READ_BYTES} (got {max_bytes})"),
            "read large files in pieces, or sync them with sync_remote_to_local",
        ));
    }
    Ok(ReadFileRequest {
        path: remote_path.to_string(),
        offset: 0,
        max_bytes: max_bytes as u64,
    })
}

/// `read_remote_file`'s reply. `content` is text, or base64 when `encoding` says so.
#[derive(Debug, Clone, Serialize)]
pub struct FileContent {
    /// The file's size on the host.
    pub size: u64,
    pub returned_bytes: usize,
    pub truncated: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoding: Option<&'static str>,
    pub content: String,
}

/// Text when the bytes are UTF-8 without NUL bytes (a multibyte char cut by `max_bytes` is
/// dropped, not mangled); otherwise base64 with `encoding: "base64"`, so binary content is
/// never silently corrupted, and a model is never handed NULs as text.
pub fn read_reply(res: &ReadFileResult) -> FileContent {
    let data = &res.data[..];
    let text = match std::str::from_utf8(data) {
        Ok(s) => Some(s),
        Err(e) if res.truncated && e.error_len().is_none() => {
            std::str::from_utf8(&data[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    }
    .filter(|s| !s.contains('\0'));
    match text {
        Some(s) => FileContent {
            size: res.size,
            returned_bytes: s.len(),
            truncated: res.truncated,
            encoding: None,
            content: s.to_string(),
        },
        None => FileContent {
            size: res.size,
            returned_bytes: data.len(),
            truncated: res.truncated,
            encoding: Some("base64"),
            content: base64::engine::general_purpose::STANDARD.encode(data),
        },
    }
}
