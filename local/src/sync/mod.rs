//! Exact, incremental, two-way sync between two agents.
//!
//! The local side runs its own `rsb-agent` as a child process ([`crate::pool::Pool::local_agent`]),
//! so an upload and a download are the same thing with the roles swapped: the *source* agent
//! scans and serves bytes (`Manifest`, `ReadFile`, `BlockHashes`), the *destination* agent scans
//! and receives (`Manifest`, `ApplyOpen`/`Apply`/`ApplyClose`). This module only orchestrates:
//! [`plan`] diffs two manifests into a [`plan::Plan`] (pure, unit-tested), [`engine`] runs it.
//!
//! Guarantees (with the agent's staging): the destination never holds a partial file (each file
//! is written into a staging dir inside the destination root, verified by blake3 and renamed
//! into place); type conflicts are reported before anything changes; `delete_extras` never
//! touches excluded paths and refuses to delete every file of a non-empty destination; a
//! cancelled or cut sync leaves only whole files (old or new).
//!
//! Counting (differs from the seed, which counted every directory as "uploaded" on every run
//! and skipped files by size+mtime): `uploaded_dirs`/`created_dirs` are directories created,
//! `uploaded_files`/`downloaded_files` are files and symlinks written, `skipped_files` are files
//! and symlinks whose content was already identical (by blake3), `attrs_updated` are entries
//! whose mode or mtime alone was fixed.

pub mod cli;
pub mod compress;
pub mod engine;
mod held;
pub mod plan;
pub mod runner;
pub mod transfers;
pub mod watch;

use std::{path::PathBuf, sync::Arc};

use serde::Serialize;
use serde_json::{Value, json};

pub use engine::{PlanGate, PlanSize, RunOptions, run, run_with};
pub use rsb_protocol::SyncRules;
pub use tokio_util::sync::CancellationToken;

/// Which way the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Direction {
    /// Local → sandbox.
    Upload,
    /// Sandbox → local.
    Download,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Upload => "local_to_remote",
            Direction::Download => "remote_to_local",
        }
    }
}

/// One sync, fully resolved except for the remote `~` (the agent expands it).
#[derive(Debug, Clone)]
pub struct SyncSpec {
    pub direction: Direction,
    /// Absolute, `~` already expanded. A trailing `/` is kept: for a single-file download it
    /// means "into this directory".
    pub local_path: PathBuf,
    /// As given; `~` and relative paths are resolved by the remote agent (relative to $HOME).
    pub remote_path: String,
    /// Delete destination entries that the source lacks (directories only; never excluded ones).
    pub delete_extras: bool,
    pub rules: SyncRules,
    /// Plan only: report what would change, change nothing.
    pub dry_run: bool,
}

/// rsb's own files on a sandbox, which an upload never deletes or overwrites, whatever the
/// rules: the default job logs (`<cwd>/.codex_logs/NAME.log`), which a running job appends
/// to. An upload with `delete_extras` into a job's working directory deleted its log.
pub const UPLOAD_PROTECTED: &[&str] = &[".codex_logs/"];

impl SyncSpec {
    /// The default excludes plus `lines` (exclude_file lines, then excludes).
    pub fn rules(lines: Vec<String>) -> SyncRules {
        SyncRules {
            default_excludes: true,
            lines,
            ..Default::default()
        }
    }

    /// The rules a sync runs with: for an upload, [`UPLOAD_PROTECTED`] after every other line,
    /// so no `!` re-includes them and both sides leave them out (neither sent nor deleted).
    /// A download brings them home like any file. Idempotent.
    pub fn effective_rules(&self) -> SyncRules {
        let mut rules = self.rules.clone();
        let done = rules.lines.len() >= UPLOAD_PROTECTED.len()
            && rules.lines[rules.lines.len() - UPLOAD_PROTECTED.len()..]
                .iter()
                .zip(UPLOAD_PROTECTED)
                .all(|(a, b)| a == b);
        if self.direction == Direction::Upload && !done {
            rules
                .lines
                .extend(UPLOAD_PROTECTED.iter().map(|l| l.to_string()));
        }
        rules
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Another sync of the same roots holds them ([`crate::store::roots_lock`]).
    Waiting,
    #[default]
    Scanning,
    Planning,
    Transferring,
    Deleting,
    Complete,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Waiting => "waiting",
            Phase::Scanning => "scanning",
            Phase::Planning => "planning",
            Phase::Transferring => "transferring",
            Phase::Deleting => "deleting",
            Phase::Complete => "complete",
        }
    }
}

/// A snapshot of a running sync, for progress bars, MCP progress and transfer records.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Progress {
    pub phase: Phase,
    /// Files (and symlinks) written so far, of those the plan transfers.
    pub files_done: u64,
    pub files_total: u64,
    /// Directories created so far (all of the plan's, once its files start).
    pub dirs_done: u64,
    /// Files the plan found already up to date (set when the transfer starts).
    pub files_unchanged: u64,
    /// File bytes sent so far, of those the plan sends (changed blocks only for deltas).
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// The file being sent (the latest one acknowledged).
    pub current_path: String,
    /// Bytes per second since the transfer phase began.
    pub rate_bps: f64,
    pub elapsed_s: f64,
    /// While [`Phase::Waiting`]: the sync it waits for ("pid 123, rsb mcp").
    #[serde(skip_serializing_if = "String::is_empty")]
    pub waiting_for: String,
}

pub type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// What a sync did (or, for a dry run, would do).
#[derive(Debug, Clone, Default)]
pub struct SyncReport {
    pub direction: Option<Direction>,
    pub local_path: String,
    pub remote_path: String,
    /// `"file"` or `"directory"`.
    pub synced_type: &'static str,
    pub dirs_created: u64,
    /// Files and symlinks written.
    pub files_transferred: u64,
    /// Files and symlinks already identical (or an excluded single file).
    pub skipped_files: u64,
    pub deleted_dirs: u64,
    pub deleted_files: u64,
    pub attrs_updated: u64,
    pub delete_extras: bool,
    /// File content bytes sent to the destination (changed blocks only for block deltas).
    pub bytes_sent: u64,
    /// FIFOs, sockets and devices in the source, skipped.
    pub skipped_special: u64,
    /// Files sent as block deltas.
    pub delta_files: u64,
    /// Size of the files the plan sends (whole files; deltas send less).
    pub bytes_planned: u64,
    pub duration_s: f64,
    pub dry_run: bool,
    /// For a dry run: one line per action (`mkdir a/`, `send a/b (12 B)`, …).
    pub actions: Vec<String>,
    /// Entries that could not be read on either side (`side rel: reason`).
    pub errors: Vec<String>,
    /// Destination files changed since the last sync, left as they are:
    /// `(rel, source blake3, destination blake3)`.
    pub conflicts: Vec<(String, [u8; 32], [u8; 32])>,
    /// The plan was handed off by [`engine::RunOptions::gate`]; nothing changed.
    pub handed_off: bool,
    /// (source, destination): the agent found the tree as this process last saw it and sent
    /// no entries (see `held`). For tests and timing; not in the reply.
    pub manifests_unchanged: (bool, bool),
    /// What both sides agree on after this sync (`rel` → blake3), to store as the baseline.
    /// `None` for a dry run, a handed-off plan, or where the sync did not finish.
    pub baseline_out: Option<std::collections::HashMap<String, [u8; 32]>>,
    /// Non-fatal problems after commit (e.g. the root's mtime on a directory not owned).
    pub warnings: Vec<String>,
    /// Files not committed because they kept changing while they were sent (each also a line
    /// in `errors`): the destination does not match for them.
    pub unsettled: u64,
    /// With compression on for this transfer ([`compress`]): the file bytes that crossed the
    /// link, compressed or not (`bytes_sent` counts them raw). `None`: compression was off.
    pub bytes_wire: Option<u64>,
}

/// A report serializes as its reply ([`SyncReport::to_json`]), so an audit line takes its
/// numbers as from the tool's reply.
impl serde::Serialize for SyncReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl SyncReport {
    /// The seed's reply keys for this direction, plus rsb's extras.
    pub fn to_json(&self) -> Value {
        let mut v = match self.direction {
            Some(Direction::Download) => json!({
                "remote_path": self.remote_path,
                "local_path": self.local_path,
                "synced_type": self.synced_type,
                "created_dirs": self.dirs_created,
                "downloaded_files": self.files_transferred,
                "skipped_files": self.skipped_files,
                "duration_s": round3(self.duration_s),
            }),
            _ => json!({
                "mode": "inline",
                "local_path": self.local_path,
                "remote_path": self.remote_path,
                "synced_type": self.synced_type,
                "uploaded_dirs": self.dirs_created,
                "uploaded_files": self.files_transferred,
                "skipped_files": self.skipped_files,
                "deleted_dirs": self.deleted_dirs,
                "deleted_files": self.deleted_files,
                "delete_extras": self.delete_extras,
                "duration_s": round3(self.duration_s),
            }),
        };
        v["bytes_sent"] = json!(self.bytes_sent);
        v["attrs_updated"] = json!(self.attrs_updated);
        if let Some(w) = self.bytes_wire {
            v["bytes_wire"] = json!(w);
        }
        if self.delta_files > 0 {
            v["delta_files"] = json!(self.delta_files);
        }
        if self.skipped_special > 0 {
            v["skipped_special"] = json!(self.skipped_special);
        }
        if self.direction == Some(Direction::Download) && self.deleted_files + self.deleted_dirs > 0
        {
            v["deleted_files"] = json!(self.deleted_files);
            v["deleted_dirs"] = json!(self.deleted_dirs);
        }
        if self.dry_run {
            v["dry_run"] = json!(true);
            v["bytes_planned"] = json!(self.bytes_planned);
            v["actions"] = json!(self.actions);
        }
        if !self.errors.is_empty() {
            v["errors"] = json!(self.errors);
        }
        if !self.conflicts.is_empty() {
            v["conflicts"] = json!(
                self.conflicts
                    .iter()
                    .take(100)
                    .map(|(rel, s, d)| json!({
                        "path": rel,
                        "source_blake3": hex(s),
                        "destination_blake3": hex(d),
                    }))
                    .collect::<Vec<_>>()
            );
            v["conflict_count"] = json!(self.conflicts.len());
            v["conflict_hint"] = json!(
                "these destination files changed since the last sync and were left as they are; pass overwrite: true (CLI --force) to take the source's side"
            );
        }
        if !self.warnings.is_empty() {
            v["warnings"] = json!(self.warnings);
        }
        v
    }
}

fn hex(h: &[u8; 32]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Join an agent-side root and a relative path (`""` = the root itself).
pub(crate) fn join_rel(root: &str, rel: &str) -> String {
    if rel.is_empty() {
        root.to_string()
    } else if root.is_empty() {
        rel.to_string()
    } else if root.ends_with('/') {
        format!("{root}{rel}")
    } else {
        format!("{root}/{rel}")
    }
}
