//! `list_remote_files` and `read_remote_file`.

use base64::Engine;
use rsb_protocol::{
    FileKind, LineRange, ListDirRequest, ListDirResult, ReadTextRequest, ReadTextResult,
};
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
        confine: None,
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

/// A read by bytes (the seed's `max_bytes` from the start), or by lines when `offset` or
/// `limit` is set: `offset` is the 1-based first line (0 or 1: the first), `limit` the lines
/// wanted (0: to the end); `max_bytes` still caps the reply, cutting at a line boundary.
pub fn read_request(
    remote_path: &str,
    max_bytes: i64,
    offset: i64,
    limit: i64,
) -> Result<ReadTextRequest> {
    check_path(remote_path, "remote_path")?;
    if max_bytes <= 0 || max_bytes > MAX_READ_BYTES {
        return Err(RsbError::invalid(
            format!("max_bytes must be between 1 and {MAX_READ_BYTES} (got {max_bytes})"),
            "read large files in pieces, or sync them with sync_remote_to_local",
        ));
    }
    if offset < 0 || limit < 0 {
        return Err(RsbError::invalid(
            format!("offset and limit must be 0 or more (got offset {offset}, limit {limit})"),
            "offset is the first line to read (1-based), limit the number of lines",
        ));
    }
    Ok(ReadTextRequest {
        path: remote_path.to_string(),
        lines: (offset > 0 || limit > 0).then(|| LineRange {
            first: offset.max(1) as u64,
            count: limit as u64,
        }),
        max_bytes: max_bytes as u64,
        confine: None,
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
    /// The whole file's content hash, the `expected_hash` of edit_remote_file and
    /// write_remote_file (absent only for a file over 32 MiB).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// By lines: the first line returned (1-based), how many, and how many the file has.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_line: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lines: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_lines: Option<u64>,
    /// When `truncated`: how to read on (the `offset` that continues).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// Text when the bytes are UTF-8 without NUL bytes (a multibyte char cut by `max_bytes` is
/// dropped, not mangled); otherwise base64 with `encoding: "base64"`, so binary content is
/// never silently corrupted, and a model is never handed NULs as text. `numbered` prefixes
/// each text line with its number, as `cat -n` does (the agents' own Read form).
pub fn read_reply(res: &ReadTextResult, by_lines: bool, numbered: bool) -> FileContent {
    let data = &res.data[..];
    let text = match std::str::from_utf8(data) {
        Ok(s) => Some(s),
        Err(e) if res.truncated && e.error_len().is_none() => {
            std::str::from_utf8(&data[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    }
    .filter(|s| !s.contains('\0'));
    let lines_meta = by_lines || numbered;
    let (returned_bytes, encoding, content) = match text {
        Some(s) if numbered => (s.len(), None, number_lines(s, res.first_line)),
        Some(s) => (s.len(), None, s.to_string()),
        None => (
            data.len(),
            Some("base64"),
            base64::engine::general_purpose::STANDARD.encode(data),
        ),
    };
    let next = res.truncated.then(|| match text {
        Some(s) => {
            // By lines, whole lines came back; by bytes, the last line may be cut: it is read
            // again whole.
            let from = if by_lines {
                res.first_line + res.lines
            } else {
                s.matches('\n').count() as u64 + 1
            };
            format!(
                "truncated at {returned_bytes} of {} bytes: offset={from} continues (1-based line; limit sets how many lines, max_bytes how many bytes)",
                res.size
            )
        }
        None => format!(
            "truncated at {returned_bytes} of {} bytes of binary content: a larger max_bytes reads more",
            res.size
        ),
    });
    FileContent {
        size: res.size,
        returned_bytes,
        truncated: res.truncated,
        encoding,
        content,
        next,
        hash: res.hash.clone(),
        first_line: lines_meta.then_some(res.first_line),
        lines: lines_meta.then_some(res.lines),
        total_lines: if lines_meta { res.total_lines } else { None },
    }
}

/// `     7\tline` per line, numbers from `first`.
fn number_lines(s: &str, first: u64) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for (i, line) in s.split_inclusive('\n').enumerate() {
        out.push_str(&format!("{:>6}\t{line}", first + i as u64));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_lines_count_from_the_first_line() {
        assert_eq!(number_lines("a\nb", 9), "     9\ta\n    10\tb");
        assert_eq!(number_lines("", 1), "");
    }
}
