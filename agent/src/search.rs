//! `Search`: ripgrep's semantics over a tree, answered as one sorted, exactly counted page.
//!
//! What is searched is what `rg` searches by default, decided per entry in ripgrep's order:
//! 1. `-g` globs first: a match of a plain glob includes (even a hidden or ignored name), a
//!    `!glob` excludes; with any plain glob, a file that matches none is left out.
//! 2. Ignore files, each kind with its own precedence, the deepest file of a kind first:
//!    `.rgignore` over `.ignore` over `.gitignore` over `.git/info/exclude`. The git ones apply
//!    only inside a git repository (a `.git` in the directory or above it). The root's parents'
//!    ignore files apply too: `.ignore` and `.rgignore` up to `/`, the git ones up to the
//!    repository's top. `no_ignore` turns all off.
//! 3. Hidden names (a leading `.`) are left out unless an ignore file's `!` line re-includes
//!    them.
//!
//! Symlinks are not followed (a root that is one is), binary files (a NUL byte) and files over
//! the size cap are skipped and counted. Patterns match one line at a time (see [`matcher`]).
//!
//! Two passes keep the reply bounded whatever matches: the walk and the match run on several
//! threads and keep only a count per file; then the files are sorted by path and only those
//! holding the requested page are searched again for their lines and context. Not known to
//! ripgrep's walker: git's global excludes file is not read.

mod matcher;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use rsb_protocol::{
    AgentError, ErrorCode, FileKind, SearchEntry, SearchLine, SearchMode, SearchRequest,
    SearchResult,
};
use rsb_rules::{Layer, Rules};
use tokio_util::sync::CancellationToken;

use crate::fs::Meta;
use crate::util::{expand_home, path_string};
use matcher::Matcher;

/// Errors listed in a reply (the rest are counted in the last one).
const MAX_ERRORS: usize = 20;
/// Match ranges kept per line (for colour).
const MAX_RANGES: usize = 32;
/// An ignore file larger than this is reported and not applied.
const MAX_IGNORE_FILE: u64 = 1 << 20;
/// How long past the deadline the files holding the page may still be read.
const PAGE_GRACE: Duration = Duration::from_millis(500);
/// Batches of files queued between the walker and the matchers (each holds its directory's
/// descriptor, see [`Batch`]).
const QUEUE: usize = 64;

/// Search as `req` asks. With [`SearchRequest::stream`] the entries go to `emit` in batches (it
/// returns false once nobody listens, and the search stops); otherwise they are in the reply
/// and `emit` is not called.
pub fn search(
    req: &SearchRequest,
    cancel: &CancellationToken,
    emit: &mut (dyn FnMut(Vec<SearchEntry>) -> bool + Send),
) -> Result<SearchResult, AgentError> {
    let root = crate::util::expand_home(&req.root);
    crate::confine::own_reads(req.confine.as_ref(), &root, || search_in(req, cancel, emit))
}

fn search_in(
    req: &SearchRequest,
    cancel: &CancellationToken,
    emit: &mut dyn FnMut(Vec<SearchEntry>) -> bool,
) -> Result<SearchResult, AgentError> {
    let flags = matcher::Flags {
        literal: req.literal,
        ignore_case: req.ignore_case,
        word: req.word,
        invert: req.invert,
        multiline: req.multiline,
    };
    let matcher = Matcher::new(&req.pattern, flags)
        .map_err(|m| AgentError::new(ErrorCode::InvalidArgument, m))?;
    let rules = |globs: &[String]| {
        Rules::new(globs.iter().map(String::as_str)).map_err(|e| {
            AgentError::new(
                ErrorCode::InvalidArgument,
                format!("glob {:?}: {}", e.line, e.reason),
            )
        })
    };
    let globs = rules(&req.globs)?;
    let types = Types {
        only: (!req.types.is_empty())
            .then(|| rules(&req.types))
            .transpose()?,
        not: (!req.types_not.is_empty())
            .then(|| rules(&req.types_not))
            .transpose()?,
    };
    let root = expand_home(&req.root);
    let meta = std::fs::metadata(&root).map_err(|e| {
        let code = if e.kind() == std::io::ErrorKind::NotFound {
            ErrorCode::NotFound
        } else {
            ErrorCode::Io
        };
        AgentError::new(code, format!("{}: {e}", root.display()))
    })?;
    let deadline = Instant::now() + Duration::from_millis(req.deadline_ms.max(1));
    let mut stop = Stop {
        cancel,
        deadline,
        hit: AtomicBool::new(false),
    };
    let errors = Errors::default();
    let stats = Stats::default();
    let mut found: Vec<Found> = Vec::new();
    if meta.is_dir() {
        let walk = Walker::new(&root, req, (&globs, &types), &errors);
        found = walk.run(req, &matcher, &stop, &errors, &stats)?;
    } else if meta.is_file() {
        // An explicit file is searched whatever the ignore rules say, as rg does; its entries
        // have an empty path (the caller prints the path it gave).
        let mut buf = Vec::new();
        let mut scratch = Vec::new();
        if let Some(f) = search_file(
            open_root(&root),
            Vec::new,
            req,
            &matcher,
            &mut buf,
            &mut scratch,
            (&stop, &errors, &stats),
        ) {
            found.push(f);
        }
    } else {
        return Err(AgentError::new(
            ErrorCode::InvalidArgument,
            format!(
                "{} is neither a directory nor a regular file",
                root.display()
            ),
        ));
    }
    if cancel.is_cancelled() {
        return Err(AgentError::new(ErrorCode::Cancelled, "request cancelled"));
    }
    // By path components, as a sorted walk meets them (`a/b` before `a.txt`, as `rg --sort
    // path`), so pages are stable from one call to the next.
    found.sort_by(|a, b| a.rel.split(|c| *c == b'/').cmp(b.rel.split(|c| *c == b'/')));
    let base = root.clone();
    let mut result = SearchResult {
        root: path_string(&root),
        total: 0,
        total_matches: found.iter().map(|f| f.count).sum(),
        files_matched: found.len() as u64,
        entries: Vec::new(),
        files_searched: stats.searched.load(Ordering::Relaxed),
        skipped_binary: stats.binary.load(Ordering::Relaxed),
        skipped_large: stats.large.load(Ordering::Relaxed),
        skipped_slow_lines: stats.slow.load(Ordering::Relaxed),
        complete: false,
        errors: Vec::new(),
    };
    let mut out = Out::new(req.stream, emit);
    match req.mode {
        SearchMode::Files | SearchMode::Count => {
            result.total = found.len() as u64;
            let page = found
                .iter()
                .skip(req.offset.min(usize::MAX as u64) as usize)
                .take(req.limit.min(usize::MAX as u64) as usize);
            for f in page {
                let entry = SearchEntry {
                    path: String::from_utf8_lossy(&f.rel).into_owned(),
                    exact_path: std::str::from_utf8(&f.rel).is_ok(),
                    line: None,
                    before: Vec::new(),
                    after: Vec::new(),
                    count: f.count,
                    file_bytes: f.bytes,
                };
                if !out.push(entry) {
                    break;
                }
            }
        }
        SearchMode::Content => {
            result.total = result.total_matches;
            // The page's files are read again: a little time past a deadline the walk met; a
            // streamed result, as long again as the walk had.
            stop.deadline = if req.stream {
                Instant::now() + Duration::from_millis(req.deadline_ms.max(1))
            } else {
                deadline + PAGE_GRACE
            };
            page(&base, found, req, &matcher, &stop, &errors, &mut out);
        }
    }
    result.entries = out.finish();
    if cancel.is_cancelled() || out.gone {
        return Err(AgentError::new(ErrorCode::Cancelled, "request cancelled"));
    }
    result.complete = !stop.hit.load(Ordering::Relaxed);
    result.errors = errors.take();
    Ok(result)
}

/// Where the result's entries go: into the reply, or to the caller in batches of about
/// [`BATCH_BYTES`] (a streamed search).
struct Out<'e> {
    emit: Option<&'e mut dyn FnMut(Vec<SearchEntry>) -> bool>,
    entries: Vec<SearchEntry>,
    /// Text bytes in `entries` (a streamed batch is sent once past [`BATCH_BYTES`]).
    bytes: usize,
    /// The caller stopped listening.
    gone: bool,
}

/// A streamed batch is sent once its entries hold this many bytes of text (or
/// [`BATCH_ENTRIES`] entries): large enough that a frame's cost is nothing per line, small
/// enough that the first lines reach a pipe at once.
const BATCH_BYTES: usize = 256 * 1024;
const BATCH_ENTRIES: usize = 4096;

impl<'e> Out<'e> {
    fn new(stream: bool, emit: &'e mut dyn FnMut(Vec<SearchEntry>) -> bool) -> Out<'e> {
        Out {
            emit: stream.then_some(emit),
            entries: Vec::new(),
            bytes: 0,
            gone: false,
        }
    }

    /// Adds an entry; false once the caller has gone (stop producing).
    fn push(&mut self, e: SearchEntry) -> bool {
        let Some(emit) = self.emit.as_mut() else {
            self.entries.push(e);
            return true;
        };
        self.bytes += entry_bytes(&e);
        self.entries.push(e);
        if self.bytes >= BATCH_BYTES || self.entries.len() >= BATCH_ENTRIES {
            self.bytes = 0;
            self.gone = !emit(std::mem::take(&mut self.entries));
        }
        !self.gone
    }

    /// The reply's entries: all of them, or none when they were streamed (the last batch is
    /// sent here).
    fn finish(&mut self) -> Vec<SearchEntry> {
        let entries = std::mem::take(&mut self.entries);
        match self.emit.as_mut() {
            None => entries,
            Some(emit) => {
                if !entries.is_empty() && !self.gone {
                    self.gone = !emit(entries);
                }
                Vec::new()
            }
        }
    }
}

/// A file with matches: its path relative to the root, and how many matching lines.
struct Found {
    rel: Vec<u8>,
    count: u64,
    /// The file's size as searched.
    bytes: u64,
    /// A streamed content search's entries for this file, built by the walk while
    /// [`KEEP_BYTES`] lasts, so that the second pass does not read the file again.
    kept: Option<Vec<SearchEntry>>,
}

/// Bytes of entries a streamed search keeps from its walk (beyond them, files are read again
/// in the second pass, one at a time, as a paged search reads its page's files).
const KEEP_BYTES: u64 = 64 << 20;

struct Stop<'a> {
    cancel: &'a CancellationToken,
    deadline: Instant,
    /// The deadline ended the walk early.
    hit: AtomicBool,
}

impl Stop<'_> {
    fn now(&self) -> bool {
        if self.cancel.is_cancelled() {
            return true;
        }
        if Instant::now() >= self.deadline {
            self.hit.store(true, Ordering::Relaxed);
            return true;
        }
        false
    }
}

#[derive(Default)]
struct Stats {
    searched: AtomicU64,
    binary: AtomicU64,
    large: AtomicU64,
    slow: AtomicU64,
    /// Bytes of entries kept by the walk (see [`KEEP_BYTES`]).
    kept: AtomicU64,
}

#[derive(Default)]
struct Errors {
    list: Mutex<Vec<String>>,
    more: AtomicU64,
}

impl Errors {
    fn push(&self, e: String) {
        let mut l = self.list.lock().unwrap_or_else(|p| p.into_inner());
        if l.len() < MAX_ERRORS {
            l.push(e);
        } else {
            self.more.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn take(&self) -> Vec<String> {
        let mut l = std::mem::take(&mut *self.list.lock().unwrap_or_else(|p| p.into_inner()));
        let more = self.more.load(Ordering::Relaxed);
        if more > 0 {
            l.push(format!("and {more} more errors"));
        }
        l
    }
}

/// The ignore files in effect at one directory of the walk, by kind.
#[derive(Default, Clone)]
struct Layers {
    rgignore: Vec<Layer>,
    ignore: Vec<Layer>,
    gitignore: Vec<Layer>,
    exclude: Vec<Layer>,
}

/// Deepest file of one kind first: its verdict, if any line of it matches.
fn verdict(layers: &[Layer], rel: &str, is_dir: bool) -> Option<bool> {
    layers.iter().rev().find_map(|l| l.decide(rel, is_dir))
}

struct Walker<'a> {
    root: PathBuf,
    /// `root` relative to the top whose ignore files apply (the repository's top, when that
    /// is above the root), with a trailing `/`; empty when the root is the top.
    prefix: String,
    /// A `.git` in or above the root.
    in_git: bool,
    no_ignore: bool,
    /// Hidden names are searched (`rg --hidden`).
    hidden: bool,
    globs: &'a Rules,
    /// Any plain glob: files matching no glob are left out.
    whitelist: bool,
    types: &'a Types,
    top_layers: Layers,
}

/// The file types asked for (`rg -t`) and left out (`rg -T`), as rules of file-name globs.
struct Types {
    only: Option<Rules>,
    not: Option<Rules>,
}

impl<'a> Walker<'a> {
    fn new(
        root: &Path,
        req: &SearchRequest,
        (globs, types): (&'a Rules, &'a Types),
        errors: &Errors,
    ) -> Walker<'a> {
        let mut w = Walker {
            root: root.to_path_buf(),
            prefix: String::new(),
            in_git: false,
            no_ignore: req.no_ignore,
            hidden: req.hidden,
            globs,
            whitelist: globs.has_plain(),
            types,
            top_layers: Layers::default(),
        };
        if req.no_ignore {
            return w;
        }
        // The root's parents, nearest first, up to `/`: their `.ignore` and `.rgignore` apply
        // below them wherever they are (as ripgrep's parent rule), their git ones only from the
        // repository's top down (a `.gitignore` above a repository does not reach into it).
        let canonical = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        let chain: Vec<&Path> = canonical.ancestors().skip(1).collect();
        let repo_top: Option<&Path> = if canonical.join(".git").exists() {
            Some(canonical.as_path())
        } else {
            chain.iter().copied().find(|d| d.join(".git").exists())
        };
        w.in_git = repo_top.is_some();
        let has_own = |d: &Path| d.join(".ignore").exists() || d.join(".rgignore").exists();
        // The top: the highest parent whose ignore files apply (the repository's top, or one
        // holding a `.ignore`/`.rgignore`); the root itself when none does, so the common case
        // matches paths as they are, with no prefix to build per entry.
        let top: &Path = chain
            .iter()
            .rev()
            .copied()
            .find(|d| Some(*d) == repo_top || has_own(d))
            .unwrap_or(canonical.as_path());
        let rel_of = |d: &Path| -> String {
            d.strip_prefix(top)
                .map(|r| r.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        if top != canonical.as_path() {
            w.prefix = format!("{}/", rel_of(&canonical));
        }
        let below_repo_top = |d: &Path| repo_top.is_some_and(|t| d.starts_with(t));
        let mut layers = Layers::default();
        for dir in chain.iter().rev().filter(|d| d.starts_with(top)) {
            let git_files = below_repo_top(dir);
            layers = w.enter_layers(
                &layers,
                dir,
                &rel_of(dir),
                errors,
                git_files,
                Some(*dir) == repo_top,
                exists_in(dir),
            );
        }
        layers = w.enter_layers(
            &layers,
            root,
            w.prefix.trim_end_matches('/'),
            errors,
            w.in_git,
            repo_top == Some(canonical.as_path()),
            exists_in(root),
        );
        w.top_layers = layers;
        w
    }

    /// The layers below `dir` (at `rel` from the top): its own ignore files added, its git
    /// ones only with `git_files` (a parent above the repository's top has none that apply).
    #[allow(clippy::too_many_arguments)]
    fn enter_layers(
        &self,
        above: &Layers,
        dir: &Path,
        rel: &str,
        errors: &Errors,
        git_files: bool,
        repo_top: bool,
        has: impl Fn(&str) -> bool,
    ) -> Layers {
        let mut l = above.clone();
        if self.no_ignore {
            return l;
        }
        // A repository's own git ignore files are the only ones that apply inside it, as with
        // ripgrep: an outer tree's (or outer repository's) `.gitignore` stops at a `.git`.
        if has(".git") {
            l.gitignore.clear();
            l.exclude.clear();
        }
        let add = |into: &mut Vec<Layer>, file: &Path| {
            if let Some(lines) = read_ignore(file, errors) {
                let (layer, bad) = Layer::parse(rel, lines.iter().map(String::as_str));
                for e in bad {
                    errors.push(format!("{}: {e}; line not applied", file.display()));
                }
                into.push(layer);
            }
        };
        if git_files && has(".gitignore") {
            add(&mut l.gitignore, &dir.join(".gitignore"));
        }
        for (into, name) in [(&mut l.ignore, ".ignore"), (&mut l.rgignore, ".rgignore")] {
            if has(name) {
                add(into, &dir.join(name));
            }
        }
        if git_files && (repo_top || (has(".git") && dir.join(".git").is_dir())) {
            add(&mut l.exclude, &dir.join(".git/info/exclude"));
        }
        l
    }

    /// Is the entry at `rel` (from the root) with this `name` left out?
    fn excluded(&self, layers: &Layers, git: bool, rel: &str, name: &[u8], is_dir: bool) -> bool {
        if let Some(plain) = self.globs.decide(rel, is_dir) {
            return !plain;
        }
        if self.whitelist && !is_dir {
            return true;
        }
        let mut whitelisted = false;
        if !self.no_ignore {
            let top_rel;
            let at = if self.prefix.is_empty() {
                rel
            } else {
                top_rel = format!("{}{rel}", self.prefix);
                &top_rel
            };
            let v = verdict(&layers.rgignore, at, is_dir)
                .or_else(|| verdict(&layers.ignore, at, is_dir))
                .or_else(|| {
                    git.then(|| verdict(&layers.gitignore, at, is_dir))
                        .flatten()
                })
                .or_else(|| git.then(|| verdict(&layers.exclude, at, is_dir)).flatten());
            match v {
                Some(true) => return true,
                Some(false) => whitelisted = true,
                None => {}
            }
        }
        // File types, after the ignore files and before the hidden rule, as ripgrep: a file
        // of a type asked for is searched even when hidden.
        if !is_dir {
            let base = String::from_utf8_lossy(name);
            let of = |r: &Option<Rules>| r.as_ref().map(|r| r.decide(&base, false) == Some(true));
            if of(&self.types.not) == Some(true) {
                return true;
            }
            match of(&self.types.only) {
                Some(true) => whitelisted = true,
                Some(false) => return true,
                None => {}
            }
        }
        !whitelisted && !self.hidden && name.first() == Some(&b'.')
    }

    /// Walk on this thread, match on the others; the per-file counts of the files that match.
    fn run(
        &self,
        req: &SearchRequest,
        matcher: &Matcher,
        stop: &Stop,
        errors: &Errors,
        stats: &Stats,
    ) -> Result<Vec<Found>, AgentError> {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 8);
        let (tx, rx) = mpsc::sync_channel::<Batch>(QUEUE);
        let rx = Mutex::new(rx);
        let results = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let mut buf = Vec::new();
                    let mut scratch = Vec::new();
                    let mut mine = Vec::new();
                    loop {
                        let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(batch) = next else { break };
                        for name in &batch.names {
                            if stop.now() {
                                break;
                            }
                            let file = open_in(batch.fd.as_deref(), &batch.dir, name);
                            let rel = || {
                                let mut rel = (*batch.rel).clone();
                                if !rel.is_empty() {
                                    rel.push(b'/');
                                }
                                rel.extend_from_slice(name.as_bytes());
                                rel
                            };
                            if let Some(f) = search_file(
                                file,
                                rel,
                                req,
                                matcher,
                                &mut buf,
                                &mut scratch,
                                (stop, errors, stats),
                            ) {
                                mine.push(f);
                            }
                        }
                    }
                    results
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend(mine);
                });
            }
            self.walk(&tx, stop, errors);
            drop(tx);
        });
        Ok(results.into_inner().unwrap_or_else(|p| p.into_inner()))
    }

    fn walk(&self, tx: &mpsc::SyncSender<Batch>, stop: &Stop, errors: &Errors) {
        let first = match DirList::read(self.root.clone(), Vec::new(), true) {
            Ok(l) => l,
            Err(e) => {
                errors.push(format!("{}: {e}", self.root.display()));
                return;
            }
        };
        // Per level: the directory, its ignore layers, inside git.
        let mut stack: Vec<(DirList, Layers, bool)> =
            vec![(first, self.top_layers.clone(), self.in_git)];
        let mut rel: Vec<u8> = Vec::new();
        loop {
            let depth = stack.len();
            let Some((level, layers, git)) = stack.last_mut() else {
                return;
            };
            let Some((name, kind)) = level.next() else {
                if let Some(b) = level.batch()
                    && tx.send(b).is_err()
                {
                    return;
                }
                stack.pop();
                continue;
            };
            if stop.now() {
                return;
            }
            rel.clear();
            rel.extend_from_slice(&level.rel);
            if !rel.is_empty() {
                rel.push(b'/');
            }
            rel.extend_from_slice(name.as_bytes());
            let rel_str = String::from_utf8_lossy(&rel);
            // The listing's type, when the file system gives one (most do); else an lstat.
            let kind = match kind {
                Some(k) => k,
                None => match level.lstat(&name) {
                    Ok(m) => m.kind(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        errors.push(format!("{rel_str}: {e}"));
                        continue;
                    }
                },
            };
            match kind {
                FileKind::Dir => {
                    if self.excluded(layers, *git, &rel_str, name.as_bytes(), true) {
                        continue;
                    }
                    let path = level.dir.join(&name);
                    let keep_fd = depth < crate::fs::LEVEL_FDS;
                    let sub = match DirList::read(path, rel.clone(), keep_fd) {
                        Ok(l) => l,
                        Err(e) => {
                            errors.push(format!("{rel_str}: {e}"));
                            continue;
                        }
                    };
                    // The new directory's own listing says which ignore files it has: no
                    // stat of a name that is not there.
                    let git_here = *git || (!self.no_ignore && sub.has(".git"));
                    let top_rel = format!("{}{rel_str}", self.prefix);
                    let below =
                        self.enter_layers(layers, &sub.dir, &top_rel, errors, true, false, |n| {
                            sub.has(n)
                        });
                    stack.push((sub, below, git_here));
                }
                FileKind::File => {
                    if self.excluded(layers, *git, &rel_str, name.as_bytes(), false) {
                        continue;
                    }
                    if let Some(b) = level.queue(name)
                        && tx.send(b).is_err()
                    {
                        return;
                    }
                }
                // Symlinks are not followed; special files are never read.
                _ => {}
            }
        }
    }
}

/// Files handed to a matcher at once: one directory's, opened relative to it.
const BATCH: usize = 64;

/// Files of one directory for a matcher thread. A batch holds the directory's descriptor, and
/// at most [`QUEUE`] batches wait, so a walk keeps a bounded number of descriptors open.
struct Batch {
    fd: Option<Arc<OwnedFd>>,
    dir: Arc<PathBuf>,
    /// The directory relative to the root.
    rel: Arc<Vec<u8>>,
    names: Vec<OsString>,
}

/// One directory of the search walk: its names in byte order with the type the listing gives
/// (`None` where the file system does not say), read once, and the regular files seen so far
/// that wait for a [`Batch`]. Unlike [`crate::fs::Level`] an entry is not stat'ed unless its
/// type is unknown, and a file is opened relative to its directory's descriptor.
struct DirList {
    dir: Arc<PathBuf>,
    rel: Arc<Vec<u8>>,
    entries: std::vec::IntoIter<(OsString, Option<FileKind>)>,
    /// Sorted names, to tell which ignore files the directory has without a stat.
    names: Vec<OsString>,
    /// Dropped below [`crate::fs::LEVEL_FDS`] levels (files are then opened by path).
    fd: Option<Arc<OwnedFd>>,
    pending: Vec<OsString>,
}

impl DirList {
    fn read(dir: PathBuf, rel: Vec<u8>, keep_fd: bool) -> std::io::Result<DirList> {
        use rustix::fs::{FileType, Mode, OFlags};
        let fd = rustix::fs::open(
            &dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut entries = Vec::new();
        for e in rustix::fs::Dir::read_from(&fd)? {
            let e = e?;
            let name = e.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let kind = match e.file_type() {
                FileType::RegularFile => Some(FileKind::File),
                FileType::Directory => Some(FileKind::Dir),
                FileType::Symlink => Some(FileKind::Symlink),
                FileType::Fifo => Some(FileKind::Fifo),
                FileType::Socket => Some(FileKind::Socket),
                FileType::CharacterDevice => Some(FileKind::CharDevice),
                FileType::BlockDevice => Some(FileKind::BlockDevice),
                _ => None,
            };
            entries.push((OsString::from_vec(name.to_vec()), kind));
        }
        entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let names = entries.iter().map(|(n, _)| n.clone()).collect();
        Ok(DirList {
            dir: Arc::new(dir),
            rel: Arc::new(rel),
            entries: entries.into_iter(),
            names,
            fd: keep_fd.then(|| Arc::new(fd)),
            pending: Vec::new(),
        })
    }

    fn next(&mut self) -> Option<(OsString, Option<FileKind>)> {
        self.entries.next()
    }

    fn has(&self, name: &str) -> bool {
        self.names
            .binary_search_by(|n| n.as_bytes().cmp(name.as_bytes()))
            .is_ok()
    }

    fn lstat(&self, name: &OsStr) -> std::io::Result<Meta> {
        match &self.fd {
            Some(fd) => {
                let s = rustix::fs::statat(&**fd, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)?;
                Ok(Meta::of_stat(&s))
            }
            None => Ok(Meta::of(&std::fs::symlink_metadata(self.dir.join(name))?)),
        }
    }

    /// Queue a file; a full batch is returned for sending.
    fn queue(&mut self, name: OsString) -> Option<Batch> {
        self.pending.push(name);
        (self.pending.len() >= BATCH)
            .then(|| self.batch())
            .flatten()
    }

    /// The files queued so far, if any.
    fn batch(&mut self) -> Option<Batch> {
        if self.pending.is_empty() {
            return None;
        }
        Some(Batch {
            fd: self.fd.clone(),
            dir: self.dir.clone(),
            rel: self.rel.clone(),
            names: std::mem::take(&mut self.pending),
        })
    }
}

/// Open a regular file for reading, never following a symlink and never blocking on a FIFO
/// swapped in after the walk saw a file: relative to its directory's descriptor when there is
/// one (one path component for the kernel to resolve, not the whole path).
fn open_in(fd: Option<&OwnedFd>, dir: &Path, name: &OsStr) -> std::io::Result<File> {
    match fd {
        Some(fd) => Ok(File::from(rustix::fs::openat(
            fd,
            name,
            OPEN_FLAGS,
            rustix::fs::Mode::empty(),
        )?)),
        None => open_path(&dir.join(name)),
    }
}

/// [`open_in`] by path: the root given as a file, a page's second read, a deep directory.
fn open_path(path: &Path) -> std::io::Result<File> {
    Ok(File::from(rustix::fs::open(
        path,
        OPEN_FLAGS,
        rustix::fs::Mode::empty(),
    )?))
}

/// The root when it is a file: a symlink named as the root is followed, as rg follows a path
/// it is given (links met by the walk are not).
fn open_root(path: &Path) -> std::io::Result<File> {
    Ok(File::from(rustix::fs::open(
        path,
        OPEN_FLAGS.difference(rustix::fs::OFlags::NOFOLLOW),
        rustix::fs::Mode::empty(),
    )?))
}

const OPEN_FLAGS: rustix::fs::OFlags = rustix::fs::OFlags::RDONLY
    .union(rustix::fs::OFlags::NOFOLLOW)
    .union(rustix::fs::OFlags::NONBLOCK)
    .union(rustix::fs::OFlags::CLOEXEC);

/// For the root and its parents, whose listings the walk does not hold: a stat per name.
fn exists_in(dir: &Path) -> impl Fn(&str) -> bool + '_ {
    move |name| dir.join(name).exists()
}

fn read_ignore(file: &Path, errors: &Errors) -> Option<Vec<String>> {
    let meta = std::fs::metadata(file).ok()?;
    if !meta.is_file() {
        return None;
    }
    if meta.len() > MAX_IGNORE_FILE {
        errors.push(format!(
            "{}: larger than 1 MiB; not applied",
            file.display()
        ));
        return None;
    }
    match std::fs::read(file) {
        Ok(b) => Some(
            String::from_utf8_lossy(&b)
                .lines()
                .map(String::from)
                .collect(),
        ),
        Err(e) => {
            errors.push(format!("{}: {e}", file.display()));
            None
        }
    }
}

enum Loaded {
    Text,
    /// Not a regular file any more (swapped since the walk saw it).
    NotFile,
    Large,
}

/// Read a regular file opened by [`open_in`] or [`open_path`] (never a FIFO swapped in after
/// the walk saw a file), unless it is over the cap.
fn load(file: std::io::Result<File>, max: u64, buf: &mut Vec<u8>) -> std::io::Result<Loaded> {
    let mut f = file?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Ok(Loaded::NotFile);
    }
    if m.len() > max {
        return Ok(Loaded::Large);
    }
    buf.clear();
    buf.reserve(m.len() as usize + 1);
    // One byte more than the cap tells a file that grew past it since the stat.
    (&mut f).take(max.saturating_add(1)).read_to_end(buf)?;
    if buf.len() as u64 > max {
        return Ok(Loaded::Large);
    }
    Ok(Loaded::Text)
}

fn search_file(
    file: std::io::Result<File>,
    rel: impl FnOnce() -> Vec<u8>,
    req: &SearchRequest,
    matcher: &Matcher,
    buf: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
    (stop, errors, stats): (&Stop, &Errors, &Stats),
) -> Option<Found> {
    match load(file, req.max_filesize, buf) {
        Ok(Loaded::Text) => {}
        Ok(Loaded::NotFile) => return None,
        Ok(Loaded::Large) => {
            stats.large.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            errors.push(format!("{}: {e}", String::from_utf8_lossy(&rel())));
            return None;
        }
    }
    if memchr::memchr(0, buf).is_some() {
        stats.binary.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    stats.searched.fetch_add(1, Ordering::Relaxed);
    let first_only = req.mode == SearchMode::Files;
    let keep = req.stream
        && req.mode == SearchMode::Content
        && stats.kept.load(Ordering::Relaxed) < KEEP_BYTES;
    let mut count = 0u64;
    let mut hits = Vec::new();
    let scan = matcher.lines(buf, scratch, &|| stop.now(), |s, e| {
        count += 1;
        if keep {
            hits.push((s, e));
        }
        !first_only
    });
    // rg -U -c counts the runs of matches that share lines, not the lines.
    if matcher.multiline() && req.mode == SearchMode::Count {
        count = scan.runs;
    }
    if count == 0 && scan.first_costly.is_none() {
        return None;
    }
    let rel = rel();
    let kept = (keep && count > 0).then(|| {
        let entries: Vec<SearchEntry> = Entries::new(buf, &rel, req, matcher)
            .of(hits.iter().copied())
            .collect();
        let bytes: usize = entries.iter().map(entry_bytes).sum();
        stats.kept.fetch_add(bytes as u64, Ordering::Relaxed);
        entries
    });
    if let (Some((_, est)), true) = (scan.first_costly, matcher.multiline()) {
        stats.slow.fetch_add(scan.costly, Ordering::Relaxed);
        errors.push(format!(
            "{}: not searched with -U: this pattern would take about {:.1} s on its {} bytes; bound its repetitions (`{{1,30}}`, not `*`) or add a literal",
            String::from_utf8_lossy(&rel),
            est.as_secs_f64(),
            buf.len(),
        ));
    } else if let Some((at, est)) = scan.first_costly {
        stats.slow.fetch_add(scan.costly, Ordering::Relaxed);
        let n = memchr::memchr_iter(b'\n', &buf[..at]).count() + 1;
        let len = memchr::memchr(b'\n', &buf[at..]).unwrap_or(buf.len() - at);
        let more = match scan.costly {
            1 => String::new(),
            k => format!(" and {} more long lines", k - 1),
        };
        errors.push(format!(
            "{}: line {n} ({len} bytes){more} not searched: this pattern would take about {:.1} s on it; bound its repetitions (`{{1,30}}`, not `*`) or add a literal",
            String::from_utf8_lossy(&rel),
            est.as_secs_f64(),
        ));
    }
    (count > 0).then_some(Found {
        rel,
        count,
        bytes: buf.len() as u64,
        kept,
    })
}

/// The page of a content search: the matching lines `offset..offset+limit` of the sorted
/// result, each with its context, read again from the few files that hold them (or, streamed,
/// as the walk kept them).
fn page(
    base: &Path,
    found: Vec<Found>,
    req: &SearchRequest,
    matcher: &Matcher,
    stop: &Stop,
    errors: &Errors,
    out: &mut Out,
) {
    let (from, upto) = (req.offset, req.offset.saturating_add(req.limit));
    let mut seen = 0u64;
    let mut buf = Vec::new();
    let mut scratch = Vec::new();
    for f in found {
        let (first, last) = (seen, seen + f.count);
        seen = last;
        if last <= from {
            continue;
        }
        if first >= upto {
            break;
        }
        // The entries numbered `from..upto` of this file's, which start at `first`.
        let wanted = |i: usize| (first + i as u64) >= from;
        let take = (upto - first).min(usize::MAX as u64) as usize;
        if let Some(kept) = f.kept {
            for (_, e) in kept
                .into_iter()
                .enumerate()
                .take(take)
                .filter(|(i, _)| wanted(*i))
            {
                if !out.push(e) {
                    return;
                }
            }
            if stop.now() {
                break;
            }
            continue;
        }
        let file = if f.rel.is_empty() {
            open_root(base)
        } else {
            open_path(&base.join(std::ffi::OsStr::from_bytes(&f.rel)))
        };
        // The walk's size cap still holds: a file that grew past it since is skipped.
        match load(file, req.max_filesize, &mut buf) {
            Ok(Loaded::Text) => {}
            Ok(_) => continue,
            Err(e) => {
                errors.push(format!("{}: {e}", String::from_utf8_lossy(&f.rel)));
                continue;
            }
        }
        // A line judged too costly here may have been judged otherwise in the first pass (a
        // time estimate): the page then shifts by that line, never shows a false match.
        let mut hits = Vec::new();
        let scan = matcher.lines(&buf, &mut scratch, &|| stop.now(), |s, e| {
            hits.push((s, e));
            true
        });
        let hits = hits
            .into_iter()
            .enumerate()
            .take(take)
            .filter(|(i, _)| wanted(*i))
            .map(|(_, h)| h);
        for e in Entries::new(&buf, &f.rel, req, matcher).of(hits) {
            if !out.push(e) {
                return;
            }
        }
        if scan.stopped {
            break;
        }
    }
}

/// The entries of one file's matching lines, each with its context lines.
struct Entries<'a> {
    buf: &'a [u8],
    lines: LineIndex,
    name: String,
    exact: bool,
    req: &'a SearchRequest,
    matcher: &'a Matcher,
    /// With `rg -U`: the lines matches touch, with their ranges ([`Matcher::matched_lines`]).
    multi: Option<BTreeMap<usize, Vec<(usize, usize)>>>,
}

impl<'a> Entries<'a> {
    fn new(buf: &'a [u8], rel: &[u8], req: &'a SearchRequest, matcher: &'a Matcher) -> Entries<'a> {
        Entries {
            buf,
            lines: LineIndex::new(buf),
            name: String::from_utf8_lossy(rel).into_owned(),
            exact: std::str::from_utf8(rel).is_ok(),
            req,
            matcher,
            multi: matcher.multiline().then(|| matcher.matched_lines(buf)),
        }
    }

    /// Line `n` (bounds `a..b`) as sent; `hit`: it is the entry's own line.
    fn line(&self, n: usize, (a, b): (usize, usize), hit: bool) -> SearchLine {
        let Some(multi) = &self.multi else {
            return line_of(
                self.buf,
                (a, b),
                n as u64,
                Some(self.matcher),
                hit,
                self.req,
            );
        };
        let mut line = line_of(self.buf, (a, b), n as u64, None, false, self.req);
        // As without -U: a hit carries its ranges, or the one range (0, 0); a line that is
        // no hit, none.
        let len = line.text.len();
        line.matches = match multi.get(&n) {
            _ if self.matcher.inverted() => Vec::new(),
            None => Vec::new(),
            Some(ranges) if self.req.ranges => ranges
                .iter()
                .map(|&(s, e)| (s.min(len) as u32, e.min(len) as u32))
                .filter(|(s, e)| e > s)
                .take(MAX_RANGES)
                .collect(),
            Some(_) => Vec::new(),
        };
        let is_hit = multi.contains_key(&n) != self.matcher.inverted();
        if is_hit && line.matches.is_empty() {
            line.matches = vec![(0, 0)];
        }
        line
    }

    /// The entry of each match (byte range in the file), in order.
    fn of(
        &'a self,
        hits: impl Iterator<Item = (usize, usize)> + 'a,
    ) -> impl Iterator<Item = SearchEntry> + 'a {
        hits.map(move |(s, e)| self.entry(s, e))
    }

    fn entry(&self, s: usize, e: usize) -> SearchEntry {
        let (buf, req) = (self.buf, self.req);
        let n = self.lines.number_at(s);
        let (before, after) = (req.before as usize, req.after as usize);
        // Context lines that match carry their ranges, so a printer can tell them apart.
        let context = |range: std::ops::Range<usize>| -> Vec<SearchLine> {
            range
                .filter_map(|m| self.lines.line(buf, m).map(|r| (m, r)))
                .map(|(m, r)| self.line(m, r, false))
                .collect()
        };
        SearchEntry {
            path: self.name.clone(),
            exact_path: self.exact,
            line: Some(self.line(n, (s, e), true)),
            file_bytes: buf.len() as u64,
            before: context(n.saturating_sub(before).max(1)..n),
            after: context(n + 1..n + 1 + after),
            count: 1,
        }
    }
}

/// About how many bytes an entry takes (its text; paths and numbers as a small constant).
fn entry_bytes(e: &SearchEntry) -> usize {
    let line = |l: &SearchLine| l.text.len() + l.raw.as_ref().map_or(0, Vec::len) + 16;
    e.path.len()
        + e.line.as_ref().map_or(0, line)
        + e.before.iter().chain(&e.after).map(line).sum::<usize>()
}

/// Line starts of one file, for line numbers and context.
struct LineIndex {
    starts: Vec<usize>,
    len: usize,
}

impl LineIndex {
    fn new(buf: &[u8]) -> LineIndex {
        let mut starts = vec![0];
        starts.extend(
            memchr::memchr_iter(b'\n', buf)
                .map(|i| i + 1)
                .filter(|&i| i < buf.len()),
        );
        LineIndex {
            starts,
            len: buf.len(),
        }
    }

    /// Lines in the file (a final line break starts none).
    fn count(&self) -> usize {
        if self.len == 0 { 0 } else { self.starts.len() }
    }

    /// 1-based number of the line holding byte `at`.
    fn number_at(&self, at: usize) -> usize {
        self.starts.partition_point(|&s| s <= at)
    }

    /// Bounds of line `n` (1-based) without its `\n`.
    fn line(&self, buf: &[u8], n: usize) -> Option<(usize, usize)> {
        let start = *self.starts.get(n.checked_sub(1)?)?;
        let end = self.starts.get(n).map_or(self.len, |&next| next - 1);
        let end = if end > start && buf[end - 1] == b'\n' {
            end - 1
        } else {
            end
        };
        Some((start, end))
    }
}

/// Line `start..end` of the file `buf` as sent: its offset, its text (cut), its own bytes where they differ, and its match ranges
/// (`matched`: the caller knows the line matches).
fn line_of(
    buf: &[u8],
    (start, end): (usize, usize),
    number: u64,
    matcher: Option<&Matcher>,
    matched: bool,
    req: &SearchRequest,
) -> SearchLine {
    let full = &buf[start..end];
    let raw = full.strip_suffix(b"\r").unwrap_or(full);
    let max = req.max_line_bytes as usize;
    let text = String::from_utf8_lossy(raw);
    let (text, cut) = if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        (
            text[..end].to_string(),
            (raw.len() - end.min(raw.len())) as u64,
        )
    } else {
        (text.into_owned(), 0)
    };
    let matches = match matcher {
        None => Vec::new(),
        Some(m) if req.ranges && !m.inverted() => m.ranges(&text, MAX_RANGES),
        Some(m) if matched || m.hit(raw) => vec![(0, 0)],
        Some(_) => Vec::new(),
    };
    // The bytes as the file has them, cut where `text` is.
    let exact = if cut == 0 {
        full
    } else {
        &raw[..raw.len() - cut as usize]
    };
    SearchLine {
        number,
        offset: start as u64,
        raw: (exact != text.as_bytes()).then(|| exact.to_vec()),
        text,
        cut,
        matches,
    }
}
