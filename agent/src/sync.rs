//! Sync, agent side: manifests, block hashes and apply sessions.
//!
//! The same code serves both directions: rsb runs its own agent locally, so a sync is an
//! orchestrator diffing two manifests and moving bytes from one agent to the other.
//!
//! - [`manifest`] walks a root with gitignore rules, streams the entries in batches and hashes
//!   regular files with blake3, served from a per-root hash cache when the file is unchanged.
//! - [`block_hashes`] hashes a file block by block, for block deltas of large files.
//! - [`apply_open`] / [`apply`] / [`apply_close`] receive changes into a staging directory
//!   inside the destination root; a file only appears under its final name after its size and
//!   blake3 were verified, by an atomic rename. Sessions belong to one channel ([`Sessions`]);
//!   their requests run in the order of their `seq`, and [`apply_abort`] gives one up.

mod apply;
pub(crate) mod beneath;
mod blocks;
mod cache;
mod hash;
mod manifest;
mod read;

use std::path::{Path, PathBuf};

use rsb_protocol::{AgentError, ErrorCode};
use tokio_util::sync::CancellationToken;

pub use apply::{
    GAP_WAIT, Sessions, apply, apply_abort, apply_close, apply_once, apply_open, staged_write,
};
pub use blocks::block_hashes;
pub use manifest::manifest;
pub use read::{OneVersion, read_file_z, read_one_version};

fn cancelled() -> AgentError {
    AgentError::new(ErrorCode::Cancelled, "request cancelled")
}

fn internal(e: impl std::fmt::Display) -> AgentError {
    AgentError::new(ErrorCode::Internal, format!("worker failed: {e}"))
}

/// Run blocking work on the blocking pool and answer a cancel at once; the work sees the same
/// token and stops at its next check.
async fn blocking<T, F>(cancel: &CancellationToken, f: F) -> Result<T, AgentError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, AgentError> + Send + 'static,
{
    let task = tokio::task::spawn_blocking(f);
    tokio::select! {
        r = task => r.unwrap_or_else(|e| Err(internal(e))),
        _ = cancel.cancelled() => Err(cancelled()),
    }
}

pub(crate) use crate::fs::{kind_of, mode_of, mtime_ns};

/// The wall clock that file timestamps are taken from. On Linux that is the coarse clock (one
/// tick, a few ms); a timestamp strictly below it was assigned before this call, so any later
/// change gets a different one. That is what makes a cached hash trustworthy (see `cache`).
fn fs_clock_ns() -> i64 {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let clock = libc::CLOCK_REALTIME_COARSE;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let clock = libc::CLOCK_REALTIME;
    // SAFETY: an all-zero timespec is valid; clock_gettime writes into it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `ts` is a valid, writable timespec.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as i64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as i64)
}

/// The path made absolute (against the current directory) without resolving symlinks.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}
