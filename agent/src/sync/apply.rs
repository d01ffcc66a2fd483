//! Apply sessions: receive changes into `<root>/<STAGING_PREFIX><session>` and move each one
//! into place atomically.
//!
//! - A session holds an exclusive `flock` on `<staging>/lock` for its whole life, so a staging
//!   directory whose lock anyone can take belongs to a dead sync and is removed by the next
//!   `ApplyOpen` on that root.
//! - `Apply` runs its ops in order and stops at the first failure; every op is atomic on its
//!   own, so the ops before the failing one stay applied and nothing of the failing one is
//!   visible.
//! - Sessions belong to one channel ([`Sessions`] lives in the channel's shared state): another
//!   channel, even in the same process, cannot see them, and they end with their channel.
//! - Requests on one session run strictly in `seq` order, so the orchestrator may pipeline
//!   `Apply` requests without waiting for each reply. A request waits for its predecessors:
//!   without limit for one that has arrived (it runs, or waits in turn), at most [`GAP_WAIT`]
//!   for one that has not. A number already used is refused; a gap that does not fill in time
//!   ends the session, which then accepts only `ApplyAbort`. A request cancelled while it waits
//!   gives up its turn, so its successors are not held up.
//! - Verified files wait in a small queue: their fsyncs run in parallel and their renames follow
//!   in op order, before any op that could observe them and before the reply. Observably this
//!   is the same as committing each file on its own, but it costs one fsync round per batch
//!   instead of one per file.
//!
//! Here: the requests and their checks. [`order`]: the `seq` order of a session's requests.
//! [`session`]: the session itself (staging, held directories, staged files, commits).
//! [`staging`]: stale staging dirs and the kept bytes of interrupted large files.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions, Permissions};
use std::os::fd::OwnedFd;

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use rsb_protocol::sync::{PARTIAL_DIR, PARTIAL_MIN, STAGING_PREFIX};
use rsb_protocol::{
    AgentError, ApplyAbortRequest, ApplyCloseRequest, ApplyOnceRequest, ApplyOp, ApplyOpenRequest,
    ApplyOpened, ApplyRequest, ApplyResult, ErrorCode,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::beneath::{
    Beneath, Refused, chmod_at, chmod_fd, file_type, lstat_at, mtime_at, mtime_fd, perm,
};
use super::blocks::{MAX_BLOCK, MAX_BLOCKS, MIN_BLOCK, hash_blocks};
use super::cache::{self, Key};
use super::hash::hash_threads;
use super::{blocking, cancelled, fs_clock_ns, mtime_ns};
use crate::confine::Writable;
use crate::util::{expand_home, path_string};

mod order;
mod session;
mod shared;
mod staging;

pub use order::Sessions;
use order::*;
use session::*;
pub use shared::staged_write;
pub(crate) use staging::clean_stale;
use staging::*;

/// Name of the lock file inside a staging directory.
const LOCK_NAME: &str = "lock";
/// A staging directory without a lock file is only taken for stale after this long (its
/// creator may be between `mkdir` and creating the lock).
const UNLOCKED_GRACE: Duration = Duration::from_secs(60);
/// Staged files kept open between ops; beyond this they are closed and reopened on use.
const MAX_OPEN: usize = 64;
/// Verified files waiting for their fsync and rename.
const MAX_PENDING: usize = 256;
/// Read size when verifying a staged file.
const VERIFY_BUF: usize = 1024 * 1024;
/// How long a request waits for a predecessor that has not arrived. Requests are read in the
/// order they were sent and first run in that order, so a missing one is normally never coming
/// (the orchestrator gave up on it); this only absorbs scheduling jitter.
pub const GAP_WAIT: Duration = Duration::from_secs(2);
/// How far ahead of the next expected number a request may be; the orchestrator keeps a few
/// dozen in flight.
const MAX_AHEAD: u64 = 4096;
/// Kept bytes of interrupted files older than this are removed, not resumed.
const PARTIAL_MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// At most this many kept files, and this many bytes, per root; the oldest go first.
const PARTIAL_FILES: usize = 8;
const PARTIAL_CAP: u64 = 32 * 1024 * 1024 * 1024;
/// How long closing a channel waits for a session's running batch before removing its staging.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);

fn err(code: ErrorCode, msg: impl Into<String>) -> AgentError {
    AgentError::new(code, msg)
}

fn io(e: &std::io::Error, what: &str, rel: &str) -> AgentError {
    AgentError::from_io(e, what, rel)
}

/// Tell the orchestrator which op failed; the ones before it were applied.
fn at_op(mut e: AgentError, i: usize, n: usize) -> AgentError {
    e.message = format!("{} (op {} of {n})", e.message, i + 1);
    e
}

// ---------------------------------------------------------------------------------------------
// Requests

pub async fn apply_open(
    sessions: &Sessions,
    req: ApplyOpenRequest,
    cancel: &CancellationToken,
) -> Result<ApplyOpened, AgentError> {
    let session = blocking(cancel, move || open(&req)).await?;
    let opened = ApplyOpened {
        session: session.id,
        root: path_string(&session.root),
        stale_cleaned: session.stale_cleaned,
        staging: session.staging_name.clone(),
    };
    let (order, _) = watch::channel(Order::default());
    let entry = Entry {
        id: session.id,
        order,
        state: Arc::new(tokio::sync::Mutex::new(session)),
    };
    sessions.map().insert(opened.session, Arc::new(entry));
    Ok(opened)
}

/// Write `data` at `offset`, leaving holes for the all-zero 4 KiB blocks that lie past the
/// staged file's end, so a sparse source stays sparse (the commit's `set_len` extends the file
/// over a trailing hole; every hole reads as the zeros the source holds). Below the end (a
/// copied base, kept bytes) everything is written: a skipped block would keep old bytes.
fn write_sparse(file: &File, data: &[u8], offset: u64) -> std::io::Result<()> {
    const BLOCK: usize = 4096;
    if data.len() < BLOCK || offset < file.metadata()?.len() {
        return file.write_all_at(data, offset);
    }
    let mut run: Option<usize> = None;
    let mut i = 0;
    while i < data.len() {
        let end = (i + BLOCK).min(data.len());
        let zero = data[i..end].iter().all(|&b| b == 0);
        match (zero, run) {
            (false, None) => run = Some(i),
            (true, Some(s)) => {
                file.write_all_at(&data[s..i], offset + s as u64)?;
                run = None;
            }
            _ => {}
        }
        i = end;
    }
    if let Some(s) = run {
        file.write_all_at(&data[s..], offset + s as u64)?;
    }
    Ok(())
}

/// `ops` with each [`ApplyOp::Stream`] piece replaced by the ops it carries, decoded by the
/// session's stream decoder (made on the first piece), so the runner, the `applied` count and
/// the op numbers in errors see the ops one by one. A piece that is out of position, does not
/// inflate to its stated length, does not decode, or nests another `Stream` fails the request
/// before any op runs, and breaks the stream for the rest of the session.
fn unstream(
    dec: &mut Option<rsb_protocol::compress::StreamDecoder>,
    ops: Vec<ApplyOp>,
) -> Result<Vec<ApplyOp>, AgentError> {
    if !ops.iter().any(|o| matches!(o, ApplyOp::Stream { .. })) {
        return Ok(ops);
    }
    let bad = |m: String| err(ErrorCode::InvalidArgument, format!("upload stream: {m}"));
    let mut out = Vec::with_capacity(ops.len());
    for op in ops {
        let ApplyOp::Stream { pos, raw_len, data } = op else {
            out.push(op);
            continue;
        };
        if dec.is_none() {
            *dec = Some(rsb_protocol::compress::StreamDecoder::new().map_err(bad)?);
        }
        let d = dec.as_mut().expect("made above");
        let raw = d.piece(pos, &data, raw_len).map_err(bad)?;
        let inner: Vec<ApplyOp> = match rsb_protocol::codec::decode(&raw) {
            Ok(v) => v,
            Err(e) => {
                d.poison(format!("a piece did not decode: {e}"));
                return Err(bad(format!("a piece does not decode: {e}")));
            }
        };
        if inner.iter().any(|o| matches!(o, ApplyOp::Stream { .. })) {
            d.poison("a piece held another piece".into());
            return Err(bad("a piece holds another stream piece".into()));
        }
        out.extend(inner);
    }
    Ok(out)
}

pub async fn apply(
    sessions: &Sessions,
    req: ApplyRequest,
    cancel: &CancellationToken,
) -> Result<ApplyResult, AgentError> {
    let entry = sessions.lookup(req.session)?;
    let _turn = entry.turn(req.seq, cancel).await?;
    // Only the request whose turn it is takes the lock (or an abort, which waits for it).
    let guard = tokio::select! {
        biased;
        g = entry.state.clone().lock_owned() => g,
        _ = cancel.cancelled() => return Err(cancelled()),
    };
    let token = cancel.clone();
    blocking(cancel, move || {
        let mut s = guard;
        s.run(req.ops, &token)
    })
    .await
}

pub async fn apply_close(
    sessions: &Sessions,
    req: ApplyCloseRequest,
    cancel: &CancellationToken,
) -> Result<ApplyResult, AgentError> {
    let entry = sessions.lookup(req.session)?;
    let turn = entry.turn(req.seq, cancel).await?;
    let guard = tokio::select! {
        biased;
        g = entry.state.clone().lock_owned() => g,
        _ = cancel.cancelled() => return Err(cancelled()),
    };
    // Requests numbered after the close can never run.
    entry.end("closed");
    drop(turn);
    sessions.map().remove(&entry.id);
    blocking(cancel, move || {
        let mut s = guard;
        s.close(&req.dir_mtimes)
    })
    .await
}

/// Out of order: refuse what waits, let the running batch finish, drop the staging.
pub async fn apply_abort(
    sessions: &Sessions,
    req: ApplyAbortRequest,
    cancel: &CancellationToken,
) -> Result<(), AgentError> {
    let entry = sessions.lookup(req.session)?;
    entry.end("aborted");
    let guard = tokio::select! {
        biased;
        g = entry.state.clone().lock_owned() => g,
        // Still in the map: the channel's end removes its staging.
        _ = cancel.cancelled() => return Err(cancelled()),
    };
    sessions.map().remove(&entry.id);
    blocking(cancel, move || {
        let mut s = guard;
        s.abort();
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Opening

fn open(req: &ApplyOpenRequest) -> Result<Session, AgentError> {
    if req.root.is_empty() {
        return Err(err(
            ErrorCode::InvalidArgument,
            "apply_open: empty root path",
        ));
    }
    let (root, shown, writable) = writable_root(&req.root, req.confine.as_ref())?;
    match fs::metadata(&root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(err(
                ErrorCode::NotADirectory,
                format!("apply root {shown} exists and is not a directory"),
            ));
        }
        Err(e) if e.kind() == ErrorKind::NotFound && req.create_root => {
            fs::create_dir_all(&root).map_err(|e| io(&e, "create root", &shown))?;
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(err(
                ErrorCode::NotFound,
                format!("apply root {shown} does not exist"),
            ));
        }
        Err(e) => return Err(io(&e, "apply root", &shown)),
    }
    // From here on the root is used only through this descriptor, checked to be beneath the
    // write roots: every change of the session is made beneath it.
    let root_fd = rfs::open(
        &root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(&e.into(), "open", &shown))?;
    writable.check_dir(&root_fd, &shown, "sync into")?;
    let stale_cleaned = clean_stale(&root);
    for _ in 0..16 {
        let id = new_id();
        let staging_name = format!("{STAGING_PREFIX}{id}");
        let staging = root.join(&staging_name);
        match rfs::mkdirat(&root_fd, staging_name.as_str(), Mode::from_raw_mode(0o700)) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(io(&e.into(), "create staging in", &shown)),
        }
        // The staging directory too is used only through its descriptor (and the root's): a
        // directory swapped in at its name by someone else is never written to.
        let staging_fd = rfs::openat(
            &root_fd,
            staging_name.as_str(),
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io(&e.into(), "open staging in", &shown))?;
        let st = rfs::fstat(&staging_fd).map_err(|e| io(&e.into(), "stat staging in", &shown))?;
        let lock = rfs::openat(
            &staging_fd,
            LOCK_NAME,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map(File::from)
        .map_err(|e| io(&e.into(), "create staging lock in", &shown))?;
        // A concurrent `ApplyOpen` may have taken this brand-new directory for stale (it can
        // lock the file before we do) and removed it: then start over under a new name.
        if !try_lock(&lock) || lock.metadata().map(|m| m.nlink()).unwrap_or(0) == 0 {
            continue;
        }
        let beneath = Beneath::new(&root_fd).map_err(|e| io(&e, "open", &shown))?;
        return Ok(Session {
            id,
            stale_cleaned,
            beneath,
            root: root.clone(),
            staging_name,
            staging,
            staging_fd,
            root_fd,
            staging_id: (st.st_dev as u64, st.st_ino as u64),
            lock: Some(lock),
            closed: false,
            next_name: 0,
            staged: HashMap::new(),
            open_files: 0,
            pending: Vec::new(),
            deferred_modes: HashMap::new(),
            committed: Vec::new(),
            resumed: Vec::new(),
            stream: None,
            shared: Vec::new(),
        });
    }
    Err(err(
        ErrorCode::Internal,
        format!("cannot create a staging directory in {shown}"),
    ))
}

/// A session's root (`~` expanded), as shown in messages, and the write roots it must be
/// beneath (checked on its path here; on its held descriptor once opened).
fn writable_root(
    root: &str,
    confine: Option<&rsb_protocol::Confine>,
) -> Result<(PathBuf, String, Writable), AgentError> {
    let root = expand_home(root);
    let shown = path_string(&root);
    let writable = match confine {
        Some(c) => Writable::open(c)?,
        None => Writable::any(),
    };
    writable.check_path(&root, "sync into")?;
    Ok((root, shown, writable))
}

fn new_id() -> u64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    h.update(&nanos.to_le_bytes());
    h.update(&SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let bytes: [u8; 8] = h.finalize().as_bytes()[..8].try_into().unwrap_or([1; 8]);
    // 53 bits: exact in any JSON number, should an id ever be shown there.
    u64::from_le_bytes(bytes) >> 11
}

// ---------------------------------------------------------------------------------------------
// The session

// ---------------------------------------------------------------------------------------------
// One round trip (watch bursts)

/// A whole session in one request: open, check the preconditions, apply, close. Used by
/// `rsb sync --watch` for small bursts; the staging, verification and atomic renames are the
/// session's own. A failed precondition or op aborts the session (files committed before a
/// failed op stay, as in any session).
pub async fn apply_once(
    req: ApplyOnceRequest,
    cancel: &CancellationToken,
) -> Result<ApplyResult, AgentError> {
    let token = cancel.clone();
    blocking(cancel, move || {
        let mut s = open(&ApplyOpenRequest {
            root: req.root,
            create_root: false,
            confine: req.confine,
        })?;
        let done = s
            .expect_all(&req.expect)
            .and_then(|()| s.run(req.ops, &token));
        match done {
            Ok(r) => {
                let closed = s.close(&req.dir_mtimes)?;
                Ok(ApplyResult {
                    applied: r.applied,
                    warnings: closed.warnings,
                    ..ApplyResult::default()
                })
            }
            Err(e) => {
                s.abort();
                Err(e)
            }
        }
    })
    .await
}

/// The rules every `rel` obeys: relative, no `.`/`..`/empty components, no NUL, and not inside
/// a staging directory.
fn check_syntax(rel: &str, allow_root: bool) -> Result<(), AgentError> {
    let refuse = |why: &str| {
        Err(err(
            ErrorCode::InvalidArgument,
            format!("refusing {rel:?}: {why}"),
        ))
    };
    if rel.is_empty() {
        return if allow_root {
            Ok(())
        } else {
            refuse("empty path")
        };
    }
    if rel.starts_with('/') {
        return refuse("absolute path");
    }
    if rel.contains('\0') {
        return refuse("contains NUL");
    }
    for c in rel.split('/') {
        match c {
            "" => return refuse("empty path component"),
            "." | ".." => return refuse(&format!("`{c}` component")),
            _ if c.starts_with(STAGING_PREFIX) => {
                return refuse(&format!("{STAGING_PREFIX}* names are reserved for staging"));
            }
            _ => {}
        }
    }
    Ok(())
}

fn hash_staged(file: &File, size: u64) -> std::io::Result<blake3::Hash> {
    let mut buf = vec![0u8; VERIFY_BUF.min(size.max(1) as usize)];
    let mut hasher = blake3::Hasher::new();
    let mut off = 0u64;
    while off < size {
        let want = ((size - off) as usize).min(buf.len());
        file.read_exact_at(&mut buf[..want], off)?;
        hasher.update(&buf[..want]);
        off += want as u64;
    }
    Ok(hasher.finalize())
}

/// Whether received files are fsynced before they are renamed into place. Off by default, like
/// rsync without `--fsync`: a killed sync or a cut link still never exposes a partial file (the
/// rename after the blake3 check is what makes a file visible); only a power loss right after a
/// sync can leave a just-received file empty, which the next sync sees by its hash.
/// `RSB_SYNC_FSYNC=1` in the agent's environment buys that durability. Measured on a VM's ext4:
/// 2,000 small files apply in ~0.16 s without fsync and ~1.1-1.5 s with it, and the 2,000-file
/// first upload goes from 1.7x to 0.95x the time of `rsync -a`.
fn fsync_enabled() -> bool {
    static ON: LazyLock<bool> =
        LazyLock::new(|| std::env::var_os("RSB_SYNC_FSYNC").is_some_and(|v| v == "1"));
    *ON
}

fn sync_all(pending: &[Commit]) -> Vec<std::io::Result<()>> {
    if !fsync_enabled() {
        return pending.iter().map(|_| Ok(())).collect();
    }
    let workers = hash_threads().min(pending.len());
    if workers <= 1 {
        return pending.iter().map(|c| c.file.sync_all()).collect();
    }
    let per = pending.len().div_ceil(workers);
    std::thread::scope(|s| {
        let handles: Vec<_> = pending
            .chunks(per)
            .map(|part| s.spawn(move || part.iter().map(|c| c.file.sync_all()).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .zip(pending.chunks(per))
            .flat_map(|(h, part)| {
                h.join().unwrap_or_else(|_| {
                    part.iter()
                        .map(|_| Err(std::io::Error::other("fsync worker panicked")))
                        .collect()
                })
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_syntax() {
        for ok in ["a", "a/b", "a b/ü.txt", "..a", "a..", ".hidden/x"] {
            assert!(check_syntax(ok, false).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a/./b",
            ".",
            "a//b",
            "a/",
            "a\0b",
            ".rsb-sync-staging-1/f1",
            "x/.rsb-sync-staging-2",
        ] {
            let e = check_syntax(bad, false)
                .err()
                .unwrap_or_else(|| panic!("{bad:?}"));
            assert_eq!(e.code, ErrorCode::InvalidArgument, "{bad:?}");
        }
        assert!(check_syntax("", true).is_ok());
    }
}
