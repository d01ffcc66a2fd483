//! Exact sync between two agents (the local side runs its own agent as a child process, so the
//! same scanning and receiving code serves both directions).
//!
//! A sync is: both sides build a manifest (gitignore rules applied identically on both sides,
//! hashes cached by inode identity), the orchestrator diffs them, reads what differs from the
//! source with `ReadFile` (or only changed blocks, via `BlockHashes`), and streams it to the
//! destination as numbered `Apply` batches inside a staging session, where each file is verified
//! and renamed into place. Nothing partial is ever visible under a final name.

use serde::{Deserialize, Serialize};

use crate::FileKind;

/// Names always excluded by default, at any depth; kept beside the engine that reads them.
pub use rsb_rules::DEFAULT_EXCLUDES;

/// Prefix of the per-session staging directory created inside a destination root; never
/// listed in manifests and never synced.
pub const STAGING_PREFIX: &str = ".rsb-sync-staging-";
/// Where an apply session keeps the staged bytes of large files when it is aborted or its
/// channel ends, so the next sync of the same file resumes instead of starting over. A
/// staging name: manifests skip it and no `rel` may enter it.
pub const PARTIAL_DIR: &str = ".rsb-sync-staging-partial";
/// Staged files at least this large are kept when a sync is interrupted.
pub const PARTIAL_MIN: u64 = 8 * 1024 * 1024;

/// Exclusion rules with gitignore semantics: later lines win, `!` re-includes, a pattern
/// without `/` matches at any depth, a trailing `/` matches directories only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncRules {
    /// Prepend [`DEFAULT_EXCLUDES`].
    pub default_excludes: bool,
    /// `exclude_file` lines, then `excludes`, in order.
    pub lines: Vec<String>,
    /// Also apply the tree's `.gitignore` files at every depth, as git does (a nested one
    /// applies to its directory and below, deeper ones win, `!` re-includes); `lines` still
    /// win over them and they over the defaults.
    #[serde(default)]
    pub gitignore: bool,
    /// With `gitignore`, for the destination's walk: the source's `.gitignore` files
    /// `(dir, lines)` (from its [`ManifestSummary::gitignore_files`]), applied instead of the
    /// destination's own, so both sides leave out exactly the same entries (and an extra the
    /// source ignores is never deleted). `None`: read them from the tree being walked.
    #[serde(default)]
    pub gitignore_files: Option<Vec<(String, Vec<String>)>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestRequest {
    /// `~`/`~/x` expanded by the agent.
    pub root: String,
    pub rules: SyncRules,
    /// Compute blake3 for regular files (served from the hash cache when unchanged).
    pub hash: bool,
    /// Send entries as [`crate::Chunk::ManifestZ`] where that saves a tenth: set for a
    /// remote agent across a slow link (a no-change sync is mostly this reply's bytes).
    pub compress: bool,
    /// The [`crate::codec::ManifestDigest`] of the entries the caller holds from an earlier
    /// scan of this root with these rules. When the walk finds exactly those, none are sent
    /// and the summary says [`ManifestSummary::unchanged`]: a no-change sync then costs the
    /// walk and one small reply, not the whole tree's entries across the link.
    pub expect: Option<[u8; 32]>,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Relative to the root, `/`-separated; `""` when the root itself is a file.
    pub rel: String,
    /// `File`, `Dir` or `Symlink` only; special files are skipped and counted.
    pub kind: FileKind,
    pub size: u64,
    pub mtime_ns: i64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub link_target: Option<String>,
    pub hash: Option<[u8; 32]>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ManifestSummary {
    /// The root after `~` expansion.
    pub root: String,
    /// `None` when the root does not exist.
    pub root_kind: Option<FileKind>,
    pub entries: u64,
    /// FIFOs, sockets and devices (relative paths, at most 100 listed).
    pub skipped_special: Vec<String>,
    pub skipped_special_count: u64,
    /// Bytes hashed afresh (0 when every hash came from the cache).
    pub hashed_bytes: u64,
    /// Unreadable entries, as `rel: reason` (at most 100).
    pub errors: Vec<String>,
    /// With `rules.gitignore` (and no `gitignore_files` given): the `.gitignore` files read,
    /// `(dir, lines)`, dir relative to the root; blank and comment lines left out.
    #[serde(default)]
    pub gitignore_files: Vec<(String, Vec<String>)>,
    /// The request's `expect` matched: no entries were sent, the caller's are current.
    pub unchanged: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockHashesRequest {
    pub path: String,
    pub block_size: u64,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockHashesResult {
    pub size: u64,
    /// blake3 of each `block_size` block (the last may be short).
    pub hashes: Vec<[u8; 32]>,
}

impl BlockHashesResult {
    /// The file's blocks as `(offset, len)`, one per hash; `None` when the count of hashes is
    /// not the count `size` makes (a bug or a lying peer). The list is as long as the hashes
    /// that arrived, so a claimed size cannot make it grow beyond what was received.
    pub fn spans(&self, block_size: u64) -> Option<Vec<(u64, u64)>> {
        let n = u64::try_from(self.hashes.len()).ok()?;
        if block_size == 0 || self.size.div_ceil(block_size) != n {
            return None;
        }
        (0..n)
            .map(|i| {
                let off = i.checked_mul(block_size)?;
                Some((off, block_size.min(self.size.checked_sub(off)?)))
            })
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyOpenRequest {
    pub root: String,
    /// Create the root (and parents) when missing.
    pub create_root: bool,
    /// The destination sandbox's write roots ([`crate::Confine::write`]): the root must be
    /// beneath one (checked on the held directory, before anything is created), else the
    /// session is refused with one line naming them. Every change of the session is made
    /// beneath the root's descriptor, so that check bounds them all.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyOpened {
    pub session: u64,
    /// The root after `~` expansion.
    pub root: String,
    /// Leftover staging directories of killed syncs that were removed.
    pub stale_cleaned: u32,
    /// The session's staging directory: its name inside `root` (for [`StagedWriteRequest`]).
    pub staging: String,
}

/// One change on the destination. `rel` is validated by the agent: no `..`, no absolute paths,
/// no empty components, and no parent that is a symlink (which could escape the root).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ApplyOp {
    Mkdir {
        rel: String,
        mode: u32,
    },
    Symlink {
        rel: String,
        target: String,
    },
    /// Start the staged copy of `rel` from the destination's current file (for block deltas).
    FileBase {
        rel: String,
    },
    /// Write bytes into the staged copy of `rel` (created empty on first use).
    FileData {
        rel: String,
        offset: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Truncate the staged copy to `size`, verify its blake3, set mode and mtime, and rename it
    /// over `rel`.
    FileCommit {
        rel: String,
        size: u64,
        mode: u32,
        mtime_ns: i64,
        hash: [u8; 32],
    },
    /// Set mode and mtime of an existing entry whose content is already right.
    SetAttr {
        rel: String,
        mode: Option<u32>,
        mtime_ns: Option<i64>,
    },
    /// Remove a file, symlink or empty directory.
    Delete {
        rel: String,
    },
    /// Start the staged copy of `rel` from the bytes an interrupted sync of it left behind
    /// (kept in [`PARTIAL_DIR`]), if any. The request's [`ApplyResult::resumed`] holds the
    /// blake3 of each `block_size` block of what was taken (empty when nothing was kept), so the
    /// orchestrator sends only the blocks that differ; the commit still verifies the whole file.
    FileResume {
        rel: String,
        block_size: u64,
    },
    /// The next piece of the session's upload stream ([`crate::compress::StreamEncoder`]),
    /// sent instead of the ops it carries on slow links: one zstd stream runs for the whole
    /// session, so every piece has all earlier ones as context, and a source tree compresses
    /// as a tarball does rather than file by file. The piece inflates to `raw_len` bytes (at
    /// most [`crate::compress::MAX_RAW`]), the [`crate::codec::encode`] of a `Vec<ApplyOp>`
    /// none of which is a `Stream`, and starts at raw position `pos` of the stream. The agent
    /// decodes the pieces in `seq` order and runs the ops in the piece's place, counted one by
    /// one in `applied` and in errors' op numbers. A piece out of position, corrupt, lying
    /// about its length or nesting another `Stream` fails the request before any op runs, and
    /// breaks the stream: the session then accepts no more pieces.
    Stream {
        pos: u64,
        raw_len: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Open `rel`'s staged copy to other channels: created empty when it has none (a
    /// `FileBase` or `FileResume` before it keeps what they staged), its name inside the
    /// staging directory answered in [`ApplyResult::shared`], so that agents on other channels
    /// of the same host write its bytes ([`StagedWriteRequest`]) in parallel, out of `seq`
    /// order. Its commit then hashes the whole staged file again.
    FileShare {
        rel: String,
    },
}

/// One batch of changes. The batches of a session are numbered: the orchestrator pipelines
/// them (many in flight), and the agent runs them strictly in `seq` order, whatever order its
/// request tasks happen to be scheduled in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyRequest {
    pub session: u64,
    /// 0 for the first request after `ApplyOpen`, then one more per `Apply`/`ApplyClose`.
    /// A number already used is refused; a missing one makes its successors wait (briefly)
    /// and then fail, and the session accepts nothing but `ApplyAbort` after that.
    pub seq: u64,
    pub ops: Vec<ApplyOp>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ApplyResult {
    pub applied: u32,
    /// Problems that did not fail the request (from `ApplyClose`: the mtime of a directory
    /// this user does not own, which only its owner may set).
    pub warnings: Vec<String>,
    /// Block hashes of the kept bytes a [`ApplyOp::FileResume`] in this request took over.
    pub resumed: Vec<[u8; 32]>,
    /// The staged names of the files an [`ApplyOp::FileShare`] in this request opened, in op
    /// order.
    pub shared: Vec<String>,
}

/// Write bytes into a staged file that its session opened to other channels
/// ([`ApplyOp::FileShare`]): how a large upload spreads over several SSH channels, each with
/// its own flow-control window, to fill a long fat link. Any agent of the same user on the
/// host may serve it. The staging directory is taken only if it is a directory (not a link)
/// owned by this user with mode 0700, beneath the write roots, and the file only if it is a
/// regular file of this user there: nothing is created, and the session's commit verifies the
/// whole file's hash, so a write that lands wrong is caught there, never committed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagedWriteRequest {
    /// [`ApplyOpened::root`].
    pub root: String,
    /// [`ApplyOpened::staging`].
    pub staging: String,
    /// A name from [`ApplyResult::shared`].
    pub name: String,
    pub offset: u64,
    /// `Some(n)`: `data` is one zstd frame of `n` bytes ([`crate::compress`]).
    pub raw_len: Option<u64>,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// As [`ApplyOpenRequest::confine`].
    pub confine: Option<crate::Confine>,
}

/// `ReadFile` for a sync's source: with `compress`, the agent compresses what it read
/// ([`crate::compress`]) when that saves at least a tenth, else answers raw. At most
/// [`crate::compress::MAX_RAW`] bytes are read, whatever `max_bytes` asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFileZRequest {
    pub path: String,
    pub offset: u64,
    pub max_bytes: u64,
    pub compress: bool,
    /// Read the file from `offset` as one version: the open file's identity (size, mtime,
    /// ctime) the same before and after the read, and unchanged in the clock tick the read
    /// began, else read again (a few times). [`ReadFileZResult::settled`] says whether it got
    /// one. A small file is read in one request, so this is what keeps a file rewritten in
    /// place mid-read from being committed as a mix of versions.
    pub whole: bool,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFileZResult {
    /// Bytes read (`data` decompresses to exactly this many when `compressed`).
    pub raw_len: u64,
    pub compressed: bool,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// True when the file has bytes beyond `offset + raw_len`.
    pub truncated: bool,
    /// With `whole`: the bytes are one version of the file. False when it kept changing
    /// during every try; the bytes are then the last try's, and must not be committed.
    pub settled: bool,
}

/// Finish a session after its last `Apply`: restore directory modes and mtimes, remove the
/// staging directory. Replies with an [`ApplyResult`] whose `warnings` say what could not be
/// restored on directories owned by someone else.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyCloseRequest {
    pub session: u64,
    /// Numbered like [`ApplyRequest::seq`], so the close runs after every batch before it.
    pub seq: u64,
    /// Directory mtimes to restore last (writing into a directory changes its mtime).
    pub dir_mtimes: Vec<(String, i64)>,
}

/// Give up a session at once, outside the `seq` order (a failed or cancelled sync): batches
/// still waiting for their turn fail, the one running finishes, the staging directory goes.
/// Files already committed stay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyAbortRequest {
    pub session: u64,
}

/// A few changes in one round trip, for `rsb sync --watch` bursts whose remote state is known
/// from the last sync: the agent opens a staging session on `root` (which must exist), checks
/// every precondition in `expect` before any op runs, applies `ops` (each file verified and
/// renamed into place, as in a session), restores `dir_mtimes` and closes. Replies like
/// `ApplyClose`. A failed precondition fails the request with
/// [`crate::ErrorCode::AlreadyExists`] and changes nothing; the orchestrator then runs a full
/// sync, which decides (and reports conflicts) as ever.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyOnceRequest {
    pub root: String,
    /// `(rel, blake3)`: the destination file `rel` must have this content now; `None`: nothing
    /// may exist at `rel` (a file, directory or symlink there fails the precondition).
    pub expect: Vec<(String, Option<[u8; 32]>)>,
    pub ops: Vec<ApplyOp>,
    /// As [`ApplyCloseRequest::dir_mtimes`].
    pub dir_mtimes: Vec<(String, i64)>,
    /// As [`ApplyOpenRequest::confine`].
    pub confine: Option<crate::Confine>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_spans_match_the_size_or_are_refused() {
        let r = |size, n| BlockHashesResult {
            size,
            hashes: vec![[0; 32]; n],
        };
        assert_eq!(r(0, 0).spans(4), Some(vec![]));
        assert_eq!(r(4, 1).spans(4), Some(vec![(0, 4)]));
        assert_eq!(r(9, 3).spans(4), Some(vec![(0, 4), (4, 4), (8, 1)]));
        // Too few, too many, a size no count of hashes could match, a zero block size.
        assert_eq!(r(9, 2).spans(4), None);
        assert_eq!(r(9, 4).spans(4), None);
        assert_eq!(r(u64::MAX, 1).spans(4), None);
        assert_eq!(r(4, 1).spans(0), None);
    }
}
