//! Reading by lines and editing text files in place: what a coding agent does on its own disk
//! (`read_remote_file` with line ranges, `edit_remote_file`, `write_remote_file`), done by the
//! agent in one round trip.
//!
//! Every read reply carries the file's content hash ([`ContentHash`]) and every change can be
//! made conditional on it, so a caller can tell whether a file changed since it last read it.
//! A change is staged in the file's own directory and renamed over it under an exclusive
//! `flock` of the file (re-checked after the lock is held), so two changes that expect the
//! same hash cannot both succeed. A condition that stops a change is a [`Refusal`] (data the
//! local side turns into a message and a hint), not an [`crate::AgentError`].

use serde::{Deserialize, Serialize};

/// The first 16 bytes of the blake3 of the whole file, as 32 lowercase hex digits: a
/// precondition token (files only their owner can change), not a signature.
pub type ContentHash = String;

/// Files larger than this are neither hashed nor edited: an edit holds the file in memory.
pub const MAX_EDIT_BYTES: u64 = 32 * 1024 * 1024;

/// A read of a regular file, by bytes (`lines: None`) or by lines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadTextRequest {
    pub path: String,
    pub lines: Option<LineRange>,
    /// Cap on `data`. By lines, whole lines are returned while they fit (a first line longer
    /// than the cap is cut).
    pub max_bytes: u64,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineRange {
    /// 1-based number of the first line returned.
    pub first: u64,
    /// Lines at most; 0 means to the end (within `max_bytes`).
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadTextResult {
    /// After `~` expansion.
    pub path: String,
    /// Size of the whole file.
    pub size: u64,
    /// `None` only for a file over [`MAX_EDIT_BYTES`].
    pub hash: Option<ContentHash>,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// True when the file has content after `data` (beyond the cap or the line count).
    pub truncated: bool,
    /// 1-based number of the first line in `data` (1 for a byte read).
    pub first_line: u64,
    /// Lines in `data` (a last line without a newline counts).
    pub lines: u64,
    /// Lines in the whole file, when the read saw all of it (always, under [`MAX_EDIT_BYTES`]).
    pub total_lines: Option<u64>,
}

/// Replace `old` by `new` in a UTF-8 file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EditRequest {
    pub path: String,
    pub old: String,
    pub new: String,
    /// Replace every occurrence; otherwise `old` must occur exactly once.
    pub replace_all: bool,
    pub expected_hash: Option<ContentHash>,
    /// The sandbox's write roots ([`crate::Confine::write`]): the change is refused, with one
    /// line naming them, unless the file's directory is beneath one, and the agent makes it in
    /// a thread the kernel confines to them where Landlock is available.
    pub confine: Option<crate::Confine>,
}

/// A file an edit, write or patch changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Changed {
    /// The file written: a symlink's target, not the link.
    pub path: String,
    pub hash: ContentHash,
    /// The file did not exist before.
    pub created: bool,
    /// Occurrences replaced (edit), hunks applied (patch), 0 for a write.
    pub replacements: u64,
    /// 1-based, inclusive line ranges of the new file that differ from the old one.
    pub changed_lines: Vec<(u64, u64)>,
    /// Unified diff, ±3 lines of context, capped ([`MAX_DIFF_LINES`]).
    pub diff: String,
    pub diff_truncated: bool,
    /// Written in place rather than replaced by a new file: it has other hard links or
    /// extended attributes (ACLs, SELinux labels), which a rename would lose, or its directory
    /// does not let this user create the new file beside it.
    pub in_place: bool,
}

/// Lines of diff a reply carries at most.
pub const MAX_DIFF_LINES: usize = 60;

/// A line close to a missing `old` string, for the caller to correct it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NearLine {
    /// 1-based.
    pub line: u64,
    pub text: String,
}

/// Why a change was not made (nothing was written).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Refusal {
    /// `old` does not occur; the closest lines of the file.
    NoMatch {
        near: Vec<NearLine>,
    },
    /// `old` occurs this many times and `replace_all` is off.
    Ambiguous {
        count: u64,
    },
    /// The file's hash is not the expected one (`None`: the file does not exist).
    Changed {
        current: Option<ContentHash>,
    },
    /// `create_only`, and the path exists.
    Exists,
    /// The file is not UTF-8 text.
    NotText,
    TooLarge {
        size: u64,
    },
    /// `old` equals `new`, or `old` is empty.
    NoChange,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EditOutcome {
    Done(Changed),
    Refused(Refusal),
}

/// What must hold for a write to go ahead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteCondition {
    Any,
    /// The file exists with this hash.
    Hash(ContentHash),
    /// Nothing exists at the path (checked atomically: the file is linked into place).
    CreateOnly,
}

/// Replace a file's whole content (or create it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteRequest {
    pub path: String,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub condition: WriteCondition,
    /// Create missing parent directories (with the umask).
    pub make_dirs: bool,
    /// As [`EditRequest::confine`].
    pub confine: Option<crate::Confine>,
}

/// Codex's `apply_patch`, parsed by the local side: every hunk of every file is checked against
/// the file under its lock before any file is written; then each file is replaced atomically.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatchRequest {
    pub files: Vec<PatchFile>,
    /// As [`EditRequest::confine`], for every file (and `Move to`) of the patch.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatchFile {
    pub path: String,
    pub op: PatchOp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PatchOp {
    /// Create (or replace) the file with this text.
    Add {
        text: String,
    },
    Delete,
    Update {
        move_to: Option<String>,
        chunks: Vec<PatchChunk>,
    },
}

/// One `@@` hunk: `old` (context and removed lines, in order) becomes `new`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatchChunk {
    /// The text after `@@ `: a line to find first (a function's header, say).
    pub context: Option<String>,
    pub old: Vec<String>,
    pub new: Vec<String>,
    /// `*** End of File`: `old` ends the file.
    pub end_of_file: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PatchOutcome {
    Done(Vec<Changed>),
    /// Nothing was written: `hunk` (0-based; 0 for a whole-file condition) of `path` failed.
    Refused {
        path: String,
        hunk: u64,
        refusal: Refusal,
    },
}
