//! `Manifest`: walk a root with the sync rules and stream its entries.
//!
//! The walk is depth-first in pre-order (a directory before its contents), names sorted by
//! bytes at each level, symlinks never followed, excluded directories never entered. Regular
//! files are hashed (blake3) unless the hash cache knows them; cache misses within a batch are
//! hashed on several threads.
//!
//! With `rules.gitignore`, each directory's `.gitignore` is read as the walk enters it and
//! applies to that directory and below (see [`rsb_rules::Layer`]); the files read are returned
//! in the summary so the orchestrator can hand the source's files to the destination's walk
//! (`rules.gitignore_files`), which then applies those instead of its own.

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::fs::{Level, Meta};
use rsb_protocol::sync::STAGING_PREFIX;
use rsb_protocol::{
    AgentError, Chunk, ErrorCode, FileKind, ManifestEntry, ManifestRequest, ManifestSummary,
};
use rsb_rules::{Layer, Rules};
use tokio_util::sync::CancellationToken;

use super::cache::{HashCache, Key};
use super::hash::hash_files;
use super::{cancelled, kind_of};
use crate::responder::Responder;
use crate::util::{expand_home, path_string};

/// Entries per `Chunk::Manifest`.
pub const BATCH_ENTRIES: usize = 2000;
/// Rough encoded bytes per chunk (paths dominate); a batch closes once past this.
pub const BATCH_BYTES: usize = 256 * 1024;
/// Encoded size of an entry beyond its path and link target (varints, kind, hash).
const ENTRY_OVERHEAD: usize = 64;
/// Listed special files and errors (both are also capped so the summary stays small).
const MAX_LISTED: usize = 100;
/// A `.gitignore` larger than this is reported and not applied (git has a similar cap).
const MAX_GITIGNORE: u64 = 1 << 20;
/// Entries held back while a walk may still match the caller's `expect`; a larger tree is
/// streamed as it is walked (the caller keeps no copy of one this large anyway).
const HOLD_MAX_ENTRIES: usize = 200_000;

/// Where a walk's `.gitignore` layers come from.
enum Gitignore {
    Off,
    /// Read each directory's `.gitignore` from the tree.
    Read,
    /// The source's files by directory (the destination's walk).
    Given(std::collections::HashMap<String, Vec<String>>),
}

/// Stream the manifest of `req.root` as `Chunk::Manifest` batches; return the summary.
pub async fn manifest(
    req: ManifestRequest,
    cancel: &CancellationToken,
    out: &mut Responder,
) -> Result<ManifestSummary, AgentError> {
    let compress = req.compress;
    let token = cancel.clone();
    out.stream_blocking(
        cancel,
        move |emit| scan(&req, &token, emit),
        move |batch| {
            if compress {
                compress_batch(batch)
            } else {
                Chunk::Manifest(batch)
            }
        },
    )
    .await
}

/// A batch as [`Chunk::ManifestZ`] when that saves a tenth (paths and times shrink, the
/// hashes do not), else as it is. A batch is at most about [`BATCH_BYTES`]: a millisecond or
/// two of deflate, inline.
fn compress_batch(batch: Vec<ManifestEntry>) -> Chunk {
    let Ok(raw) = rsb_protocol::codec::encode(&batch) else {
        return Chunk::Manifest(batch);
    };
    match rsb_protocol::compress::compress(&raw) {
        Some(data) => Chunk::ManifestZ {
            raw_len: raw.len() as u64,
            data,
        },
        None => Chunk::Manifest(batch),
    }
}

/// The blocking scan; `emit` returns false when nobody listens any more.
pub fn scan(
    req: &ManifestRequest,
    cancel: &CancellationToken,
    emit: &mut (dyn FnMut(Vec<ManifestEntry>) -> bool + Send),
) -> Result<ManifestSummary, AgentError> {
    let root = expand_home(&req.root);
    crate::confine::own_reads(req.confine.as_ref(), &root, || scan_in(req, cancel, emit))
}

fn scan_in(
    req: &ManifestRequest,
    cancel: &CancellationToken,
    emit: &mut dyn FnMut(Vec<ManifestEntry>) -> bool,
) -> Result<ManifestSummary, AgentError> {
    if req.root.is_empty() {
        return Err(AgentError::new(
            ErrorCode::InvalidArgument,
            "manifest: empty root path",
        ));
    }
    let root = expand_home(&req.root);
    let shown = path_string(&root);
    // Rules first: a bad pattern is an error even when the root does not exist.
    let rules = Rules::for_sync(req.rules.default_excludes, &req.rules.lines)
        .map_err(|e| AgentError::new(ErrorCode::InvalidArgument, e.to_string()))?;
    let summary = ManifestSummary {
        root: shown.clone(),
        ..Default::default()
    };
    let io_err = |e: &std::io::Error| AgentError::from_io(e, "manifest", &shown);
    // The root itself is followed when it is a symlink (like `ls dir/`); nothing below is.
    let meta = match fs::metadata(&root) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match fs::symlink_metadata(&root) {
            Ok(l) if l.file_type().is_symlink() => {
                // A dangling symlink as the root: describe the link.
                let mut scan = Scanner::new(rules, false, HashCache::disabled(), cancel, emit);
                scan.expect(req.expect);
                scan.summary = summary;
                scan.summary.root_kind = Some(FileKind::Symlink);
                scan.push_symlink(&root, String::new(), &Meta::of(&l))?;
                return scan.finish();
            }
            _ => {
                let none = rsb_protocol::codec::ManifestDigest::default().finish();
                return Ok(ManifestSummary {
                    unchanged: req.expect == Some(none),
                    ..summary
                });
            }
        },
        Err(e) => return Err(io_err(&e)),
    };
    let cache = if req.hash {
        HashCache::load(&root)
    } else {
        HashCache::disabled()
    };
    let mut scan = Scanner::new(rules, req.hash, cache, cancel, emit);
    scan.expect(req.expect);
    scan.summary = summary;
    scan.gitignore = match (&req.rules.gitignore, &req.rules.gitignore_files) {
        (false, _) => Gitignore::Off,
        (true, None) => Gitignore::Read,
        (true, Some(files)) => Gitignore::Given(files.iter().cloned().collect()),
    };
    let kind = kind_of(meta.file_type());
    scan.summary.root_kind = Some(kind);
    match kind {
        FileKind::Dir => {
            // Every sync scans its destination, so staging left by a killed sync is removed at
            // the next sync even when that sync has nothing to apply (live sessions hold a lock).
            super::apply::clean_stale(&root);
            let first = Level::read(root.clone(), String::new()).map_err(|e| io_err(&e))?;
            scan.walk(first)?;
        }
        // Hashing opens with O_NOFOLLOW, so a root that is a symlink is resolved first.
        FileKind::File => {
            let real = fs::canonicalize(&root).unwrap_or_else(|_| root.clone());
            scan.push_file(real, String::new(), &Meta::of(&meta))?
        }
        _ => scan.special(""),
    }
    scan.finish()
}

struct Pending {
    idx: usize,
    path: PathBuf,
    key: Key,
}

struct Scanner<'a> {
    rules: Rules,
    hash: bool,
    cache: HashCache,
    cancel: &'a CancellationToken,
    emit: &'a mut dyn FnMut(Vec<ManifestEntry>) -> bool,
    summary: ManifestSummary,
    /// The hash cache directory, never listed (it changes whenever a scan writes to it).
    skip_dir: Option<(u64, u64)>,
    entries: Vec<ManifestEntry>,
    pending: Vec<Pending>,
    bytes: usize,
    gitignore: Gitignore,
    /// The `.gitignore` layers of the directories on the walk's stack, with the stack depth
    /// each belongs to (popped with its directory).
    layers: Vec<Layer>,
    layer_depths: Vec<usize>,
    /// Over every entry, sent or held.
    digest: rsb_protocol::codec::ManifestDigest,
    /// The caller's digest; while `Some`, finished batches are held in `held`, not sent.
    expect: Option<[u8; 32]>,
    held: Vec<Vec<ManifestEntry>>,
    held_entries: usize,
}

impl<'a> Scanner<'a> {
    fn new(
        rules: Rules,
        hash: bool,
        cache: HashCache,
        cancel: &'a CancellationToken,
        emit: &'a mut dyn FnMut(Vec<ManifestEntry>) -> bool,
    ) -> Self {
        let skip_dir = crate::util::hash_cache_dir()
            .and_then(|d| fs::metadata(d).ok())
            .map(|m| (m.dev(), m.ino()));
        Scanner {
            rules,
            hash,
            cache,
            cancel,
            emit,
            summary: ManifestSummary::default(),
            skip_dir,
            entries: Vec::new(),
            pending: Vec::new(),
            bytes: 0,
            gitignore: Gitignore::Off,
            layers: Vec::new(),
            layer_depths: Vec::new(),
            digest: Default::default(),
            expect: None,
            held: Vec::new(),
            held_entries: 0,
        }
    }

    fn expect(&mut self, digest: Option<[u8; 32]>) {
        self.expect = digest;
    }

    /// Send a finished batch, or hold it while the walk may still match `expect`.
    fn send(&mut self, entries: Vec<ManifestEntry>) -> Result<(), AgentError> {
        if self.expect.is_some() {
            self.held_entries += entries.len();
            self.held.push(entries);
            if self.held_entries <= HOLD_MAX_ENTRIES {
                return Ok(());
            }
            // Too many to hold: stream from here on.
            self.expect = None;
            return self.release();
        }
        if (self.emit)(entries) {
            Ok(())
        } else {
            Err(cancelled())
        }
    }

    /// Send what was held back.
    fn release(&mut self) -> Result<(), AgentError> {
        for batch in std::mem::take(&mut self.held) {
            if !(self.emit)(batch) {
                return Err(cancelled());
            }
        }
        Ok(())
    }

    fn excluded(&self, rel: &str, is_dir: bool) -> bool {
        if self.layers.is_empty() {
            self.rules.excluded(rel, is_dir)
        } else {
            self.rules.excluded_in(&self.layers, rel, is_dir)
        }
    }

    /// The walk entered `dir` (at stack `depth`): push its `.gitignore` layer, if any.
    fn enter(&mut self, dir: &Path, rel: &str, depth: usize) {
        let lines = match &self.gitignore {
            Gitignore::Off => return,
            Gitignore::Given(files) => match files.get(rel) {
                Some(lines) => lines.clone(),
                None => return,
            },
            Gitignore::Read => match read_gitignore(dir) {
                Ok(Some(lines)) => {
                    self.summary
                        .gitignore_files
                        .push((rel.to_string(), lines.clone()));
                    lines
                }
                Ok(None) => return,
                Err(e) => {
                    self.error(format!("{}: {e}", join(rel, ".gitignore")));
                    return;
                }
            },
        };
        let (layer, errors) = Layer::parse(rel, lines.iter().map(String::as_str));
        if matches!(self.gitignore, Gitignore::Read) {
            for e in errors {
                self.error(format!(
                    "{}: {e}; line not applied",
                    join(rel, ".gitignore")
                ));
            }
        }
        self.layers.push(layer);
        self.layer_depths.push(depth);
    }

    /// The walk left every directory deeper than `depth`.
    fn leave(&mut self, depth: usize) {
        while self.layer_depths.last().is_some_and(|d| *d > depth) {
            self.layer_depths.pop();
            self.layers.pop();
        }
    }

    fn error(&mut self, msg: String) {
        if self.summary.errors.len() < MAX_LISTED {
            self.summary.errors.push(msg);
        }
    }

    fn special(&mut self, rel: &str) {
        self.summary.skipped_special_count += 1;
        if self.summary.skipped_special.len() < MAX_LISTED {
            self.summary.skipped_special.push(rel.to_string());
        }
    }

    fn walk(&mut self, first: Level) -> Result<(), AgentError> {
        self.enter(&first.dir, &first.rel, 1);
        let mut stack = vec![first];
        while let Some(level) = stack.last_mut() {
            let Some(name) = level.next_name() else {
                stack.pop();
                self.leave(stack.len());
                continue;
            };
            if self.cancel.is_cancelled() {
                return Err(cancelled());
            }
            if name.as_bytes().starts_with(STAGING_PREFIX.as_bytes()) {
                continue;
            }
            let path = level.dir.join(&name);
            let lstat = level.lstat(&name);
            let Some(name) = name.to_str() else {
                let rel = join(&level.rel, &name.to_string_lossy());
                self.error(format!("{rel}: name is not valid UTF-8; skipped"));
                continue;
            };
            let rel = join(&level.rel, name);
            let meta = match lstat {
                Ok(m) => m,
                // Removed since the directory was read: it simply is not there any more.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    self.error(format!("{rel}: {e}"));
                    continue;
                }
            };
            match meta.kind() {
                FileKind::Dir => {
                    if self.excluded(&rel, true) || self.skip_dir == Some((meta.dev, meta.ino)) {
                        continue;
                    }
                    self.push(dir_entry(rel.clone(), &meta), None)?;
                    match Level::read(path, rel.clone()) {
                        Ok(mut l) => {
                            if stack.len() >= crate::fs::LEVEL_FDS {
                                l.close();
                            }
                            self.enter(&l.dir, &l.rel, stack.len() + 1);
                            stack.push(l);
                        }
                        Err(e) => self.error(format!("{rel}: {e}")),
                    }
                }
                FileKind::File => {
                    if !self.excluded(&rel, false) {
                        self.push_file(path, rel, &meta)?;
                    }
                }
                FileKind::Symlink => {
                    if !self.excluded(&rel, false) {
                        self.push_symlink(&path, rel, &meta)?;
                    }
                }
                _ => {
                    if !self.excluded(&rel, false) {
                        self.special(&rel);
                    }
                }
            }
        }
        Ok(())
    }

    fn push_file(&mut self, path: PathBuf, rel: String, meta: &Meta) -> Result<(), AgentError> {
        let entry = ManifestEntry {
            rel,
            kind: FileKind::File,
            size: meta.size,
            mtime_ns: meta.mtime_ns,
            mode: meta.mode(),
            link_target: None,
            hash: None,
        };
        let pending = self.hash.then(|| (path, Key::of_meta(meta)));
        self.push(entry, pending)
    }

    fn push_symlink(&mut self, path: &Path, rel: String, meta: &Meta) -> Result<(), AgentError> {
        let target = match fs::read_link(path) {
            Ok(t) => t,
            Err(e) => {
                self.error(format!("{rel}: {e}"));
                return Ok(());
            }
        };
        let Some(target) = target.to_str() else {
            self.error(format!("{rel}: symlink target is not valid UTF-8; skipped"));
            return Ok(());
        };
        let entry = ManifestEntry {
            rel,
            kind: FileKind::Symlink,
            size: meta.size,
            mtime_ns: meta.mtime_ns,
            mode: meta.mode(),
            link_target: Some(target.to_string()),
            hash: None,
        };
        self.push(entry, None)
    }

    fn push(
        &mut self,
        entry: ManifestEntry,
        hash: Option<(PathBuf, Key)>,
    ) -> Result<(), AgentError> {
        if self.entries.len() >= BATCH_ENTRIES || self.bytes >= BATCH_BYTES {
            self.flush()?;
        }
        self.bytes +=
            entry.rel.len() + entry.link_target.as_ref().map_or(0, String::len) + ENTRY_OVERHEAD;
        if let Some((path, key)) = hash {
            self.pending.push(Pending {
                idx: self.entries.len(),
                path,
                key,
            });
        }
        self.entries.push(entry);
        Ok(())
    }

    /// Fill in the batch's hashes (cache, then hashing the misses) and send it.
    fn flush(&mut self) -> Result<(), AgentError> {
        if self.entries.is_empty() {
            return Ok(());
        }
        let mut entries = std::mem::take(&mut self.entries);
        self.bytes = 0;
        let mut misses = Vec::new();
        for p in std::mem::take(&mut self.pending) {
            match self.cache.get(&p.key) {
                Some(h) => entries[p.idx].hash = Some(h),
                None => misses.push(p),
            }
        }
        let paths: Vec<&Path> = misses.iter().map(|p| p.path.as_path()).collect();
        let results = hash_files(&paths, self.cancel);
        if self.cancel.is_cancelled() {
            return Err(cancelled());
        }
        let mut vanished = Vec::new();
        for (p, r) in misses.iter().zip(results) {
            let e = &mut entries[p.idx];
            match r {
                Ok(h) => {
                    e.hash = Some(h.hash);
                    // What was hashed is described by the open file, not the earlier lstat.
                    e.size = h.key.size;
                    e.mtime_ns = h.key.mtime_ns;
                    e.mode = h.mode;
                    self.summary.hashed_bytes += h.key.size;
                    if h.settled {
                        self.cache.insert(h.key, h.hash);
                    }
                }
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => vanished.push(p.idx),
                Err(err) => {
                    let msg = format!("{}: {err}", e.rel);
                    self.error(msg);
                }
            }
        }
        if !vanished.is_empty() {
            let mut i = 0;
            entries.retain(|_| {
                i += 1;
                !vanished.contains(&(i - 1))
            });
        }
        self.summary.entries += entries.len() as u64;
        if entries.is_empty() {
            return Ok(());
        }
        // Only a caller that named a digest needs one (and only while batches are held).
        if self.expect.is_some() {
            entries.iter().for_each(|e| self.digest.add(e));
        }
        self.send(entries)
    }

    fn finish(mut self) -> Result<ManifestSummary, AgentError> {
        self.flush()?;
        if self.expect.is_some() && self.expect == Some(self.digest.finish()) {
            self.summary.unchanged = true;
        } else {
            self.release()?;
        }
        self.cache.save();
        Ok(self.summary)
    }
}

/// The lines of `dir/.gitignore` that say something (blank and `#` lines left out), `None`
/// when there is none. A symlinked `.gitignore` is not followed, as git does not.
fn read_gitignore(dir: &Path) -> std::io::Result<Option<Vec<String>>> {
    let path = dir.join(".gitignore");
    let meta = match fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !meta.is_file() {
        return Ok(None);
    }
    if meta.len() > MAX_GITIGNORE {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_GITIGNORE} bytes; not applied"
        )));
    }
    let bytes = fs::read(&path)?;
    let text = String::from_utf8_lossy(&bytes);
    Ok(Some(
        text.lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .map(str::to_string)
            .collect(),
    ))
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}/{name}")
    }
}

fn dir_entry(rel: String, meta: &Meta) -> ManifestEntry {
    ManifestEntry {
        rel,
        kind: FileKind::Dir,
        size: 0,
        mtime_ns: meta.mtime_ns,
        mode: meta.mode(),
        link_target: None,
        hash: None,
    }
}
