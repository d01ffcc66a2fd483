//! `list_remote_files` and `read_remote_file`.

use base64::Engine;
use rsb_protocol::{FileKind, ListDirRequest, ListDirResult, ReadFileRequest, ReadFileResult};
use serde_json::{Map, Value, json};

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

/// Entry paths are the listed directory joined with the relative name: `./x` for `.`,
/// absolute under the remote home for `~`, as the seed did.
pub fn list_reply(remote_path: &str, res: &ListDirResult) -> Value {
    let base = if remote_path == "~" || remote_path.starts_with("~/") {
        res.root.trim_end_matches('/').to_string()
    } else if remote_path == "/" {
        String::new()
    } else {
        remote_path.trim_end_matches('/').to_string()
    };
    let entries: Vec<Value> = res
        .entries
        .iter()
        .map(|e| {
            let mut m = Map::new();
            m.insert("path".into(), json!(format!("{base}/{}", e.rel)));
            m.insert("is_dir".into(), json!(e.kind == FileKind::Dir));
            m.insert("size".into(), json!(e.size));
            m.insert("mtime".into(), json!(e.mtime_ns.div_euclid(1_000_000_000)));
            if !matches!(e.kind, FileKind::File | FileKind::Dir) {
                m.insert("type".into(), json!(kind_name(e.kind)));
            }
            Value::Object(m)
        })
        .collect();
    let mut m = Map::new();
    m.insert("truncated".into(), json!(res.truncated));
    m.insert("entries".into(), Value::Array(entries));
    if !res.errors.is_empty() {
        m.insert("unreadable".into(), json!(res.errors));
    }
    Value::Object(m)
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

/// Text when the bytes are UTF-8 (a multibyte char cut by `max_bytes` is dropped, not
/// mangled); otherwise base64 with `encoding: "base64"`, so binary content is never silently
/// corrupted.
pub fn read_reply(res: &ReadFileResult) -> Value {
    let mut m = Map::new();
    m.insert("size".into(), json!(res.size));
    m.insert("returned_bytes".into(), json!(res.data.len()));
    m.insert("truncated".into(), json!(res.truncated));
    let data = &res.data[..];
    let text = match std::str::from_utf8(data) {
        Ok(s) => Some(s),
        Err(e) if res.truncated && e.error_len().is_none() => {
            std::str::from_utf8(&data[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    };
    match text {
        Some(s) => {
            if s.len() != data.len() {
                m.insert("returned_bytes".into(), json!(s.len()));
            }
            m.insert("content".into(), json!(s));
        }
        None => {
            m.insert("encoding".into(), json!("base64"));
            m.insert(
                "content".into(),
                json!(base64::engine::general_purpose::STANDARD.encode(data)),
            );
        }
    }
    Value::Object(m)
}
