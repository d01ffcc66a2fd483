//! `edit_remote_file` and `write_remote_file` (and `rsb edit`): validation, and the agent's
//! typed outcome as a reply or as one error line with a hint. The change itself (lock, check,
//! stage, rename) happens on the agent (`agent/src/edit.rs`).

use base64::Engine;
use rsb_protocol::{
    Changed, ContentHash, EditOutcome, EditRequest, ErrorCode, Refusal, WriteCondition,
    WriteRequest,
};
use serde::Serialize;

use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
};

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
        path: home_relative(remote_path),
        old: old_string.to_string(),
        new: new_string.to_string(),
        replace_all,
        expected_hash: parse_hash(expected_hash)?,
        confine: None,
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
        path: home_relative(remote_path),
        data,
        condition,
        make_dirs,
        confine: None,
    })
}

/// A write's error with the hint that fixes it: a missing directory is created by `make_dirs`
/// (the generic "check the path" would send a model looking for a typo).
pub fn write_failed(e: RsbError, make_dirs: bool) -> RsbError {
    if e.kind == Kind::Agent(rsb_protocol::ErrorCode::NotFound) && !make_dirs {
        return RsbError {
            hint: "pass make_dirs: true to create the missing directories".to_string(),
            ..e
        };
    }
    e
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
    /// Written in place, so the file keeps its identity (other hard links, ACLs, SELinux
    /// labels, extended attributes), or because its directory is not writable; otherwise the
    /// new content replaced it by an atomic rename.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub in_place: bool,
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
        in_place: c.in_place,
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

/// Codex's patch format (`*** Begin Patch` … `*** End Patch`: Add / Delete / Update File,
/// `*** Move to:`, `@@` hunks of ` `/`-`/`+` lines, `*** End of File`), parsed into what the
/// agent checks and applies. As lenient as Codex's own parser (openai/codex,
/// `codex-rs/apply-patch`), where models rely on it: markers and hunk headers with whitespace
/// around them, a patch wrapped in a `<<'EOF'` … `EOF` here-document, blank lines between
/// hunks. A malformed patch is refused here, naming its line.
pub fn parse_patch(patch: &str) -> Result<rsb_protocol::PatchRequest> {
    use rsb_protocol::{PatchChunk, PatchFile, PatchOp};
    let bad = |n: usize, what: &str| {
        RsbError::invalid(
            format!("patch line {n}: {what}"),
            "use Codex's format: *** Begin Patch, *** Add/Update/Delete File: PATH, @@ hunks of ' ', '-', '+' lines, *** End Patch",
        )
    };
    let mut lines: Vec<&str> = patch
        .lines()
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .collect();
    // `<<'EOF'` … `EOF` around the patch (a here-document passed as the argument).
    let first = lines.iter().position(|l| !l.trim().is_empty());
    let last = lines.iter().rposition(|l| !l.trim().is_empty());
    if let (Some(a), Some(b)) = (first, last)
        && b > a
        && matches!(lines[a].trim(), "<<EOF" | "<<'EOF'" | "<<\"EOF\"")
        && lines[b].trim() == "EOF"
    {
        lines[a] = "";
        lines[b] = "";
    }
    let marker = |l: &str| l.trim().to_string();
    let mut it = lines
        .iter()
        .enumerate()
        .map(|(i, l)| (i + 1, *l))
        .peekable();
    while it.peek().is_some_and(|(_, l)| l.trim().is_empty()) {
        it.next();
    }
    match it.next() {
        Some((_, l)) if l.trim() == "*** Begin Patch" => {}
        Some((n, _)) => return Err(bad(n, "expected *** Begin Patch")),
        None => return Err(bad(0, "the patch is empty")),
    }
    let mut files = Vec::new();
    let mut ended = false;
    while let Some((n, l)) = it.next() {
        let m = marker(l);
        if m == "*** End Patch" {
            ended = true;
            break;
        }
        let path_of = |rest: &str| -> Result<String> {
            let p = rest.trim();
            if p.is_empty() || p.contains('\0') {
                return Err(bad(n, "a file header needs a path"));
            }
            Ok(home_relative(p))
        };
        if let Some(rest) = m.strip_prefix("*** Add File:") {
            let path = path_of(rest)?;
            let mut text = String::new();
            while let Some((_, l)) = it.peek() {
                let Some(body) = l.strip_prefix('+') else {
                    break;
                };
                text.push_str(body);
                text.push('\n');
                it.next();
            }
            files.push(PatchFile {
                path,
                op: PatchOp::Add { text },
            });
        } else if let Some(rest) = m.strip_prefix("*** Delete File:") {
            files.push(PatchFile {
                path: path_of(rest)?,
                op: PatchOp::Delete,
            });
        } else if let Some(rest) = m.strip_prefix("*** Update File:") {
            let path = path_of(rest)?;
            let mut move_to = None;
            if let Some((k, l)) = it.peek().copied()
                && let Some(rest) = marker(l).strip_prefix("*** Move to:")
            {
                let to = rest.trim();
                if to.is_empty() {
                    return Err(bad(k, "*** Move to: needs a path"));
                }
                move_to = Some(home_relative(to));
                it.next();
            }
            let mut chunks: Vec<PatchChunk> = Vec::new();
            while let Some((k, l)) = it.peek().copied() {
                let m = marker(l);
                if m == "*** End of File" {
                    match chunks.last_mut() {
                        Some(c) => c.end_of_file = true,
                        None => return Err(bad(k, "*** End of File before any hunk")),
                    }
                    it.next();
                    continue;
                }
                if is_header(&m) {
                    break;
                }
                it.next();
                if let Some(ctx) = hunk_header(l) {
                    chunks.push(PatchChunk {
                        context: (!ctx.is_empty()).then(|| ctx.to_string()),
                        old: Vec::new(),
                        new: Vec::new(),
                        end_of_file: false,
                    });
                    continue;
                }
                if chunks.is_empty() {
                    chunks.push(PatchChunk {
                        context: None,
                        old: Vec::new(),
                        new: Vec::new(),
                        end_of_file: false,
                    });
                }
                let c = chunks.last_mut().expect("a chunk was pushed");
                match l.chars().next() {
                    Some(' ') | None => {
                        let t = l.get(1..).unwrap_or("").to_string();
                        c.old.push(t.clone());
                        c.new.push(t);
                    }
                    Some('-') => c.old.push(l[1..].to_string()),
                    Some('+') => c.new.push(l[1..].to_string()),
                    // Whitespace that is not a context line's leading space: skipped, as Codex
                    // skips blank lines between hunks.
                    _ if l.trim().is_empty() => {}
                    _ => return Err(bad(k, "a hunk line must start with ' ', '-' or '+'")),
                }
            }
            if chunks.iter().all(|c| c.old == c.new) && move_to.is_none() {
                return Err(bad(n, "an Update File section changes nothing"));
            }
            files.push(PatchFile {
                path,
                op: PatchOp::Update { move_to, chunks },
            });
        } else if l.trim().is_empty() {
            continue;
        } else {
            return Err(bad(
                n,
                "expected *** Add File:, *** Update File:, *** Delete File: or *** End Patch",
            ));
        }
    }
    if !ended {
        return Err(bad(lines.len(), "missing *** End Patch"));
    }
    if files.is_empty() {
        return Err(bad(1, "the patch names no file"));
    }
    Ok(rsb_protocol::PatchRequest {
        files,
        confine: None,
    })
}

/// A file header or the end of the patch (whitespace around it allowed).
fn is_header(m: &str) -> bool {
    m == "*** End Patch"
        || [
            "*** Add File:",
            "*** Delete File:",
            "*** Update File:",
            "*** Move to:",
        ]
        .iter()
        .any(|h| m.starts_with(h))
}

/// `@@` or `@@ CONTEXT` (whitespace around it allowed): the context, possibly empty. A line
/// of one space and `@@…` is a context line holding `@@…`, as Codex reads it.
fn hunk_header(l: &str) -> Option<&str> {
    let padded = l.starts_with("  ") || l.starts_with('\t');
    if !(l.starts_with("@@") || padded) {
        return None;
    }
    let t = l.trim();
    let rest = t.strip_prefix("@@")?;
    if !(rest.is_empty() || rest.starts_with(char::is_whitespace)) {
        return None;
    }
    // `@@ fn main() @@` (git's form) carries its context between the markers.
    let rest = rest.trim();
    Some(rest.strip_suffix("@@").map(str::trim_end).unwrap_or(rest))
}

/// `edit_remote_file`: `req` ([`edit_request`]) on `client`, confined as its sandbox is;
/// `shown` is the path as the caller named it, for the refusal's words.
pub async fn edit(client: &AgentClient, req: EditRequest, shown: &str) -> Result<EditReply> {
    let req = EditRequest {
        confine: client.confine().cloned(),
        ..req
    };
    let expected = req.expected_hash.clone();
    client
        .call(req)
        .await
        .and_then(|o| outcome(shown, expected.as_deref(), o))
}

/// `write_remote_file`: `req` ([`write_request`]) on `client`, confined as its sandbox is.
pub async fn write(client: &AgentClient, req: WriteRequest, shown: &str) -> Result<EditReply> {
    let make_dirs = req.make_dirs;
    let req = WriteRequest {
        confine: client.confine().cloned(),
        ..req
    };
    let expected = match &req.condition {
        WriteCondition::Hash(h) => Some(h.clone()),
        _ => None,
    };
    client
        .call(req)
        .await
        .map_err(|e| write_failed(e, make_dirs))
        .and_then(|o| outcome(shown, expected.as_deref(), o))
}

/// `apply_patch`: `req` ([`parse_patch`]) on `client`, confined as its sandbox is.
pub async fn patch(client: &AgentClient, req: rsb_protocol::PatchRequest) -> Result<PatchReply> {
    let req = rsb_protocol::PatchRequest {
        confine: client.confine().cloned(),
        ..req
    };
    client
        .call(req)
        .await
        .map_err(patch_error)
        .and_then(patch_outcome)
}

/// The files a patch names, for its audit line (never its text, which is file content).
pub fn patch_paths(req: &rsb_protocol::PatchRequest) -> String {
    let paths: Vec<&str> = req.files.iter().map(|f| f.path.as_str()).collect();
    paths.join(", ")
}

/// A relative path is relative to `$HOME`, as every remote path of rsb's tools (the agent's
/// working directory need not be `$HOME`).
pub fn home_relative(p: &str) -> String {
    if p.starts_with('/') || p == "~" || p.starts_with("~/") {
        p.to_string()
    } else {
        format!("~/{p}")
    }
}

/// What `apply_patch` replies: each file it wrote or deleted.
#[derive(Debug, Clone, Serialize)]
pub struct PatchReply {
    pub files: Vec<PatchedFile>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PatchedFile {
    #[serde(flatten)]
    pub change: EditReply,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub deleted: bool,
}

/// An error the agent gave for a patch: it checks everything and keeps what it replaces
/// before the first write, and puts it back if a later step fails, so unless it says some
/// file could not be put back, no file was changed (a link lost mid-patch is not the agent's
/// answer, and says nothing of the sort).
pub fn patch_error(mut e: RsbError) -> RsbError {
    if matches!(e.kind, Kind::Agent(_))
        && !e.message.contains("no file was changed")
        && !e.message.contains("could not be put back")
    {
        e.message = format!("{}; no file was changed", e.message);
    }
    e
}

pub fn patch_outcome(o: rsb_protocol::PatchOutcome) -> Result<PatchReply> {
    match o {
        rsb_protocol::PatchOutcome::Done(files) => Ok(PatchReply {
            files: files
                .into_iter()
                .map(|c| PatchedFile {
                    deleted: c.hash.is_empty(),
                    change: reply_of(c),
                })
                .collect(),
        }),
        rsb_protocol::PatchOutcome::Refused {
            path,
            hunk,
            refusal: why,
        } => {
            let mut e = refusal(&path, None, why);
            e.message = format!(
                "hunk {} of {path}: {}; no file was changed",
                hunk + 1,
                e.message
            );
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rsb_protocol::PatchOp;

    #[test]
    fn codex_patches_parse() {
        let p = parse_patch(
            "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** Update File: b.rs\n*** Move to: c.rs\n@@ fn main() {\n-    old\n+    new\n     keep\n*** End of File\n*** Delete File: d\n*** End Patch\n",
        )
        .unwrap();
        assert_eq!(p.files.len(), 3);
        assert_eq!(
            p.files[0].op,
            PatchOp::Add {
                text: "hi\n".into()
            }
        );
        let PatchOp::Update { move_to, chunks } = &p.files[1].op else {
            panic!("{:?}", p.files[1])
        };
        assert_eq!(move_to.as_deref(), Some("~/c.rs"));
        assert_eq!(p.files[0].path, "~/a.txt");
        assert_eq!(chunks[0].context.as_deref(), Some("fn main() {"));
        assert_eq!(chunks[0].old, ["    old", "    keep"]);
        assert_eq!(chunks[0].new, ["    new", "    keep"]);
        assert!(chunks[0].end_of_file);
        assert_eq!(p.files[2].op, PatchOp::Delete);
        // As lenient as Codex: padded markers and hunk headers, a here-document around it,
        // blank lines between hunks, whitespace-only lines.
        let p = parse_patch(
            "<<'EOF'\n *** Begin Patch \n  *** Update File: x.py  \n  @@  def f():  \n-    a\n+    b\n\t\n@@ class C: @@\n     keep\n-    c\n+    d\n *** End Patch \nEOF\n",
        )
        .unwrap();
        let PatchOp::Update { chunks, .. } = &p.files[0].op else {
            panic!("{:?}", p.files[0])
        };
        assert_eq!(p.files[0].path, "~/x.py");
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        assert_eq!(chunks[0].context.as_deref(), Some("def f():"));
        assert_eq!(chunks[0].old, ["    a"]);
        assert_eq!(chunks[1].context.as_deref(), Some("class C:"));
        assert_eq!(chunks[1].old, ["    keep", "    c"]);
        // One space then `@@`: a context line holding `@@`, as Codex reads it.
        let p = parse_patch("*** Begin Patch\n*** Update File: y\n @@ x\n-a\n+b\n*** End Patch")
            .unwrap();
        let PatchOp::Update { chunks, .. } = &p.files[0].op else {
            panic!()
        };
        assert_eq!(chunks[0].old, ["@@ x", "a"]);
        for (bad, want) in [
            ("", "empty"),
            ("*** Update File: x\n", "Begin Patch"),
            ("*** Begin Patch\n*** Delete File: x\n", "End Patch"),
            (
                "*** Begin Patch\n*** Update File: x\n@@\n?x\n*** End Patch",
                "line 4",
            ),
            ("*** Begin Patch\n*** End Patch", "no file"),
        ] {
            let e = parse_patch(bad).unwrap_err();
            assert!(e.message.contains(want), "{bad:?}: {}", e.message);
        }
    }
}
