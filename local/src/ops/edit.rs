//! `edit_remote_file` and `write_remote_file` (and `rsb edit`): validation, and the agent's
//! typed outcome as a reply or as one error line with a hint. The change itself (lock, check,
//! stage, rename) happens on the agent (`agent/src/edit.rs`).

use base64::Engine;
use rsb_protocol::{
    Changed, ContentHash, EditOutcome, EditRequest, ErrorCode, Refusal, WriteCondition,
    WriteRequest,
};
use serde::Serialize;

use crate::error::{Kind, Result, RsbError};

fn check_path(p: &str) -> Result<()> {
    if p.trim().is_empty() || p.contains('\0') {
        return Err(RsbError::invalid(
            "remote_path must be a non-empty path without NUL bytes",
            "pass a file path; ~ means the remote home",
        ));
    }
    Ok(())
}

/// `""` is no precondition; otherwise the 32 hex digits a read reply's `hash` holds.
pub fn parse_hash(h: &str) -> Result<Option<ContentHash>> {
    let h = h.trim().to_ascii_lowercase();
    if h.is_empty() {
        return Ok(None);
    }
    if h.len() != 32 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(RsbError::invalid(
            format!(
                "expected_hash must be 32 hex digits (got {} characters)",
                h.len()
            ),
            "pass the `hash` of a read_remote_file or edit reply, or leave it empty",
        ));
    }
    Ok(Some(h))
}

pub fn edit_request(
    remote_path: &str,
    old_string: &str,
    new_string: &str,
    replace_all: bool,
    expected_hash: &str,
) -> Result<EditRequest> {
    check_path(remote_path)?;
    if old_string.is_empty() {
        return Err(RsbError::invalid(
            "old_string cannot be empty",
            "pass the exact text to replace; use write_remote_file to create or overwrite a file",
        ));
    }
    if old_string == new_string {
        return Err(RsbError::invalid(
            "new_string equals old_string",
            "nothing would change; pass the replacement text",
        ));
    }
    Ok(EditRequest {
        path: remote_path.to_string(),
        old: old_string.to_string(),
        new: new_string.to_string(),
        replace_all,
        expected_hash: parse_hash(expected_hash)?,
    })
}

pub fn write_request(
    remote_path: &str,
    content: Option<&str>,
    content_base64: Option<&str>,
    expected_hash: &str,
    create_only: bool,
    make_dirs: bool,
) -> Result<WriteRequest> {
    check_path(remote_path)?;
    let data = match (content, content_base64) {
        (Some(c), None) => c.as_bytes().to_vec(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b.trim())
            .map_err(|e| {
                RsbError::invalid(
                    format!("content_base64 is not valid base64: {e}"),
                    "pass standard base64 (with padding), or the text as content",
                )
            })?,
        _ => {
            return Err(RsbError::invalid(
                "pass exactly one of content and content_base64",
                "content for text, content_base64 for bytes",
            ));
        }
    };
    let condition = match (parse_hash(expected_hash)?, create_only) {
        (Some(_), true) => {
            return Err(RsbError::invalid(
                "expected_hash and create_only exclude each other",
                "create_only: the file must not exist; expected_hash: it must hold that content",
            ));
        }
        (Some(h), false) => WriteCondition::Hash(h),
        (None, true) => WriteCondition::CreateOnly,
        (None, false) => WriteCondition::Any,
    };
    Ok(WriteRequest {
        path: remote_path.to_string(),
        data,
        condition,
        make_dirs,
    })
}

/// What a successful edit or write replies.
#[derive(Debug, Clone, Serialize)]
pub struct EditReply {
    /// The file written (a symlink's target).
    pub path: String,
    /// The new content's hash: the next change's `expected_hash`.
    pub hash: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub created: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replacements: Option<u64>,
    /// Lines of the new file that changed, as `"7"` or `"7-9"`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changed_lines: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub diff: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub diff_truncated: bool,
}

/// The agent's outcome as the reply, or a refusal as an error naming `path`.
pub fn outcome(path: &str, expected: Option<&str>, o: EditOutcome) -> Result<EditReply> {
    match o {
        EditOutcome::Done(c) => Ok(reply_of(c)),
        EditOutcome::Refused(r) => Err(refusal(path, expected, r)),
    }
}

fn reply_of(c: Changed) -> EditReply {
    EditReply {
        path: c.path,
        hash: c.hash,
        created: c.created,
        replacements: (c.replacements > 0).then_some(c.replacements),
        changed_lines: c
            .changed_lines
            .iter()
            .map(|&(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect(),
        diff: c.diff,
        diff_truncated: c.diff_truncated,
    }
}

/// One line saying why nothing was written, and what to do instead.
pub fn refusal(path: &str, expected: Option<&str>, r: Refusal) -> RsbError {
    let bad = |m: String, h: String| RsbError::new(Kind::InvalidArgument, m, h);
    match r {
        Refusal::NoMatch { near } => {
            let hint = if near.is_empty() {
                "read the file again (read_remote_file) and copy old_string exactly".to_string()
            } else {
                let lines: Vec<String> = near
                    .iter()
                    .map(|n| format!("line {}: {:?}", n.line, n.text))
                    .collect();
                format!(
                    "closest: {}; old_string must match exactly, whitespace and indentation included",
                    lines.join("; ")
                )
            };
            bad(format!("old_string not found in {path}"), hint)
        }
        Refusal::Ambiguous { count } => bad(
            format!("old_string occurs {count} times in {path}"),
            "include more surrounding lines to make it unique, or pass replace_all=true".into(),
        ),
        Refusal::Changed { current } => {
            let was = expected.unwrap_or("?");
            let m = match current {
                Some(h) => format!(
                    "{path} changed since it was read: its hash is {h}, not {was}; nothing was written"
                ),
                None => format!("{path} does not exist (expected hash {was}); nothing was written"),
            };
            RsbError::new(
                Kind::Agent(ErrorCode::AlreadyExists),
                m,
                "read it again (read_remote_file) and redo the change on what it holds now",
            )
        }
        Refusal::Exists => RsbError::new(
            Kind::Agent(ErrorCode::AlreadyExists),
            format!("{path} already exists; nothing was written (create_only)"),
            "drop create_only to replace it, or pass its hash as expected_hash",
        ),
        Refusal::NotText => bad(
            format!("{path} is not UTF-8 text; edit_remote_file edits text only"),
            "replace its bytes with write_remote_file(content_base64=...)".into(),
        ),
        Refusal::TooLarge { size } => bad(
            format!(
                "{path} is {size} bytes, over the {} MiB limit of edits and writes",
                rsb_protocol::edit::MAX_EDIT_BYTES >> 20
            ),
            "change a file that large with exec_bash, or sync it".into(),
        ),
        Refusal::NoChange => bad(
            "old_string is empty or equals new_string".into(),
            "pass the exact text to replace and its replacement".into(),
        ),
    }
}
