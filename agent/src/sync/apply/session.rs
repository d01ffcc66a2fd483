//! One apply session: its staging directory, held descriptors, staged files and the commits
//! waiting for their fsync and rename.

use super::*;

pub(super) struct Staged {
    /// Name inside the staging directory (always reached through its descriptor).
    pub(super) name: String,
    pub(super) file: Option<File>,
    /// Hash of the bytes written so far, while every write has continued the previous one
    /// from offset 0 (the common case: no re-read is needed to verify).
    pub(super) seq: Option<blake3::Hasher>,
    pub(super) seq_len: u64,
    /// Received from the source (not a copy of the destination's old version): worth keeping
    /// when the sync is interrupted.
    pub(super) resumable: bool,
}

impl Staged {
    /// A staged file whose bytes are all written already (a copied base, kept bytes taken over):
    /// later writes must re-read it to verify.
    pub(super) fn written(name: String, resumable: bool) -> Self {
        Staged {
            name,
            file: None,
            seq: None,
            seq_len: 0,
            resumable,
        }
    }
}

/// A verified staged file waiting for its fsync and rename.
pub(super) struct Commit {
    pub(super) op: usize,
    pub(super) rel: String,
    /// Name inside the staging directory.
    pub(super) staged: String,
    pub(super) file: File,
    /// The held directory it goes into, and its name there.
    pub(super) parent: Arc<OwnedFd>,
    pub(super) name: String,
    pub(super) hash: [u8; 32],
    pub(super) size: u64,
    pub(super) mtime_ns: i64,
}

pub(super) struct Session {
    pub(super) id: u64,
    /// Leftover staging directories removed when this session opened.
    pub(super) stale_cleaned: u32,
    pub(super) root: PathBuf,
    pub(super) staging: PathBuf,
    pub(super) staging_name: String,
    /// The staging directory and the root, opened once: staged files are created, renamed
    /// and removed relative to these, never by path.
    pub(super) staging_fd: OwnedFd,
    pub(super) root_fd: OwnedFd,
    /// `(dev, inode)` of the staging directory, checked before every commit.
    pub(super) staging_id: (u64, u64),
    /// Every directory under the root that an op changes something in, held: nothing is
    /// changed by path (see [`Beneath`]).
    pub(super) beneath: Beneath,
    pub(super) lock: Option<File>,
    pub(super) closed: bool,
    pub(super) next_name: u64,
    pub(super) staged: HashMap<String, Staged>,
    pub(super) open_files: usize,
    pub(super) pending: Vec<Commit>,
    /// Directories whose mode lacks `u+rwx`: created with it, given their exact mode at close.
    pub(super) deferred_modes: HashMap<String, u32>,
    /// Hashes of received files, for the root's hash cache.
    pub(super) committed: Vec<(Key, [u8; 32])>,
    /// Block hashes taken over by a `FileResume` of the running request, for its reply.
    pub(super) resumed: Vec<[u8; 32]>,
    /// The decoder of the session's upload stream, from its first [`ApplyOp::Stream`] piece.
    pub(super) stream: Option<rsb_protocol::compress::StreamDecoder>,
    /// Staged names opened to other channels by the running request, for its reply.
    pub(super) shared: Vec<String>,
}

impl Session {
    pub(super) fn staged_name(&mut self, prefix: char) -> String {
        self.next_name += 1;
        format!("{prefix}{}", self.next_name)
    }

    /// The staged name of received bytes of `rel`: `f<n>-<partial name>`, so that the staging
    /// of a sync that died without cleaning up can still be kept for resuming (see
    /// [`salvage`]).
    pub(super) fn data_name(&mut self, rel: &str) -> String {
        format!("{}-{}", self.staged_name('f'), partial_name(rel))
    }

    pub(super) fn unlink_staged(&self, name: &str) {
        let _ = rfs::unlinkat(&self.staging_fd, name, AtFlags::empty());
    }

    /// The staging directory is still ours and still the one at its path: owned by us, mode
    /// 0700, same device and inode. Anything else means someone swapped it; the sync stops.
    // `st_dev`/`st_ino` are not u64 on every target.
    #[allow(clippy::unnecessary_cast)]
    pub(super) fn staging_ok(&self) -> Result<(), AgentError> {
        let swapped = |why: String| {
            err(
                ErrorCode::PermissionDenied,
                format!(
                    "the staging directory {} in {} was tampered with ({why}); sync aborted, nothing more was committed. Another user can write this directory: sync into one only you can write",
                    self.staging_name,
                    path_string(&self.root)
                ),
            )
        };
        let held = rfs::fstat(&self.staging_fd).map_err(|e| swapped(format!("stat: {e}")))?;
        if held.st_uid != rustix::process::geteuid().as_raw() || held.st_mode & 0o077 != 0 {
            return Err(swapped("owner or mode changed".into()));
        }
        match rfs::statat(
            &self.root_fd,
            self.staging_name.as_str(),
            AtFlags::SYMLINK_NOFOLLOW,
        ) {
            Ok(at) if (at.st_dev as u64, at.st_ino as u64) == self.staging_id => Ok(()),
            Ok(_) => Err(swapped("another directory or a link is at its path".into())),
            Err(e) => Err(swapped(format!("{e} at its path"))),
        }
    }

    pub(super) fn run(
        &mut self,
        ops: Vec<ApplyOp>,
        cancel: &CancellationToken,
    ) -> Result<ApplyResult, AgentError> {
        if self.closed {
            return Err(err(ErrorCode::NotFound, "the sync session is closed"));
        }
        let ops = unstream(&mut self.stream, ops)?;
        let n = ops.len();
        for (i, op) in ops.into_iter().enumerate() {
            if cancel.is_cancelled() {
                self.flush(n)?;
                return Err(cancelled());
            }
            let flush_first = match &op {
                ApplyOp::FileData { .. } => false,
                ApplyOp::FileCommit { rel, .. }
                | ApplyOp::FileResume { rel, .. }
                | ApplyOp::FileShare { rel }
                | ApplyOp::Mkdir { rel, .. }
                | ApplyOp::Symlink { rel, .. } => self.pending.iter().any(|c| &c.rel == rel),
                ApplyOp::FileBase { .. } | ApplyOp::SetAttr { .. } | ApplyOp::Delete { .. } => {
                    !self.pending.is_empty()
                }
                ApplyOp::Stream { .. } => unreachable!("unstream expanded every piece"),
            };
            if flush_first {
                self.flush(n)?;
            }
            if let Err(e) = self.op(i, op) {
                // The ops before this one count as applied: finish their commits first (an
                // error there is the earlier failure, so it wins).
                self.flush(n)?;
                return Err(at_op(e, i, n));
            }
            if self.pending.len() >= MAX_PENDING {
                self.flush(n)?;
            }
        }
        self.flush(n)?;
        Ok(ApplyResult {
            applied: n as u32,
            warnings: Vec::new(),
            resumed: std::mem::take(&mut self.resumed),
            shared: std::mem::take(&mut self.shared),
        })
    }

    pub(super) fn op(&mut self, i: usize, op: ApplyOp) -> Result<(), AgentError> {
        match op {
            ApplyOp::Mkdir { rel, mode } => self.mkdir(&rel, mode),
            ApplyOp::Symlink { rel, target } => self.symlink(&rel, &target),
            ApplyOp::FileBase { rel } => self.file_base(&rel),
            ApplyOp::FileData { rel, offset, data } => self.file_data(&rel, offset, &data),
            ApplyOp::FileCommit {
                rel,
                size,
                mode,
                mtime_ns,
                hash,
            } => self.file_commit(i, rel, size, mode, mtime_ns, hash),
            ApplyOp::SetAttr {
                rel,
                mode,
                mtime_ns,
            } => self.set_attr(&rel, mode, mtime_ns),
            ApplyOp::Delete { rel } => self.delete(&rel),
            ApplyOp::FileResume { rel, block_size } => self.file_resume(&rel, block_size),
            ApplyOp::FileShare { rel } => self.file_share(&rel),
            ApplyOp::Stream { .. } => Err(err(
                ErrorCode::Internal,
                "a stream piece reached the op runner undecoded",
            )),
        }
    }

    /// The refusal of `rel` when a directory above it is not one a sync may write into.
    pub(super) fn refused(&self, rel: &str, r: Refused) -> AgentError {
        match r {
            Refused::Missing(p) => err(
                ErrorCode::NotFound,
                format!("{rel}: parent {p} does not exist"),
            ),
            // The plan was made from a scan that saw directories here: a link now means the
            // destination changed under the sync, maybe by someone redirecting its writes.
            Refused::Link(p) => err(
                ErrorCode::PermissionDenied,
                format!(
                    "refusing {rel}: {} a symlink, so the destination {} was changed under the sync (tampered with?); nothing was written through it. If another user can write there, sync into a directory only you can write",
                    if p == rel {
                        "it is now".to_string()
                    } else {
                        format!("parent {p} is")
                    },
                    path_string(&self.root)
                ),
            ),
            Refused::NotDir(p) => err(
                ErrorCode::NotADirectory,
                format!("refusing {rel}: parent {p} is not a directory"),
            ),
            Refused::Io(p, e) => io(&e, "open", &p),
        }
    }

    /// Validate `rel` and hold its parent directory; `Err(missing)` names the first
    /// directory above it that does not exist.
    #[allow(clippy::type_complexity)]
    pub(super) fn parent_of<'r>(
        &mut self,
        rel: &'r str,
    ) -> Result<Result<(Arc<OwnedFd>, &'r str), String>, AgentError> {
        check_syntax(rel, false)?;
        match self.beneath.parent(rel) {
            Ok(v) => Ok(Ok(v)),
            Err(Refused::Missing(p)) => Ok(Err(p)),
            Err(r) => Err(self.refused(rel, r)),
        }
    }

    /// The held directory `rel` itself (the root for `""`).
    pub(super) fn dir_fd(&mut self, rel: &str) -> Result<Arc<OwnedFd>, AgentError> {
        self.beneath.dir(rel).map_err(|r| self.refused(rel, r))
    }

    pub(super) fn parent_exists<'r>(
        &mut self,
        what: &str,
        rel: &'r str,
    ) -> Result<(Arc<OwnedFd>, &'r str), AgentError> {
        match self.parent_of(rel)? {
            Ok(v) => Ok(v),
            Err(p) => Err(err(
                ErrorCode::NotFound,
                format!(
                    "{what} {rel}: parent {p} does not exist (removed or moved since the sync looked?)"
                ),
            )),
        }
    }

    /// The mode to give a directory now; modes that would lock us out are completed at close.
    pub(super) fn dir_mode_now(&mut self, rel: &str, mode: u32) -> u32 {
        let mode = mode & 0o7777;
        if mode & 0o700 == 0o700 {
            self.deferred_modes.remove(rel);
            mode
        } else {
            self.deferred_modes.insert(rel.to_string(), mode);
            mode | 0o700
        }
    }

    pub(super) fn mkdir(&mut self, rel: &str, mode: u32) -> Result<(), AgentError> {
        let (p, name) = self.parent_exists("mkdir", rel)?;
        let now = self.dir_mode_now(rel, mode);
        match lstat_at(&p, name).map_err(|e| io(&e, "mkdir", rel))? {
            Some(st) if file_type(&st) == rfs::FileType::Directory => {
                if perm(&st) != now {
                    let fd = self.dir_fd(rel)?;
                    chmod_fd(&fd, now).map_err(|e| io(&e, "chmod", rel))?;
                }
            }
            // The plan makes or keeps a directory here only where its scan saw one or
            // nothing (a file in the way is the plan's refusal), so anything else came since.
            Some(_) => {
                return Err(err(
                    ErrorCode::NotADirectory,
                    format!(
                        "{rel} exists and is not a directory: the destination changed since the sync looked (tampered with?); nothing was written through it"
                    ),
                ));
            }
            None => {
                rfs::mkdirat(&*p, name, super::super::beneath::mode(now))
                    .map_err(|e| io(&e.into(), "mkdir", rel))?;
                // The umask may have removed bits.
                let fd = self.dir_fd(rel)?;
                chmod_fd(&fd, now).map_err(|e| io(&e, "chmod", rel))?;
            }
        }
        Ok(())
    }

    pub(super) fn symlink(&mut self, rel: &str, target: &str) -> Result<(), AgentError> {
        let (p, name) = self.parent_exists("symlink", rel)?;
        if target.is_empty() || target.contains('\0') {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!("symlink {rel}: invalid target {target:?}"),
            ));
        }
        if lstat_at(&p, name)
            .is_ok_and(|st| st.is_some_and(|st| file_type(&st) == rfs::FileType::Directory))
        {
            return Err(err(
                ErrorCode::IsADirectory,
                format!("{rel} exists and is a directory; refusing to replace it with a symlink"),
            ));
        }
        let tmp = self.staged_name('l');
        rfs::symlinkat(target, &self.staging_fd, tmp.as_str())
            .map_err(|e| io(&e.into(), "symlink", rel))?;
        let moved = self.staging_ok().and_then(|()| {
            rfs::renameat(&self.staging_fd, tmp.as_str(), &*p, name)
                .map_err(|e| io(&e.into(), "symlink", rel))
        });
        if moved.is_err() {
            self.unlink_staged(&tmp);
        }
        moved
    }

    pub(super) fn file_base(&mut self, rel: &str) -> Result<(), AgentError> {
        let (p, name) = self.parent_exists("delta base", rel)?;
        let not_regular = || {
            err(
                ErrorCode::InvalidArgument,
                format!("delta base {rel}: not a regular file"),
            )
        };
        // Opened without following a link, then checked: what is copied is the file that was
        // checked.
        let from = match rfs::openat(
            &*p,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => File::from(fd),
            Err(rustix::io::Errno::LOOP) => return Err(not_regular()),
            Err(e) => return Err(io(&e.into(), "delta base", rel)),
        };
        if !from.metadata().is_ok_and(|m| m.is_file()) {
            return Err(not_regular());
        }
        self.drop_staged(rel);
        let staged = self.staged_name('b');
        let copied = Ok(from).and_then(|mut from: File| {
            let mut to = File::from(rfs::openat(
                &self.staging_fd,
                staged.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )?);
            std::io::copy(&mut from, &mut to)
        });
        if let Err(e) = copied {
            self.unlink_staged(&staged);
            return Err(io(&e, "copy", rel));
        }
        self.staged
            .insert(rel.to_string(), Staged::written(staged, false));
        Ok(())
    }

    /// Take over the bytes an interrupted sync of `rel` kept, as its staged copy, and note the
    /// hashes of their whole blocks for the reply. Nothing kept (or too old): nothing happens.
    pub(super) fn file_resume(&mut self, rel: &str, bs: u64) -> Result<(), AgentError> {
        check_syntax(rel, false)?;
        if !(MIN_BLOCK..=MAX_BLOCK).contains(&bs) {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!(
                    "resume {rel}: block_size {bs} is out of range ({MIN_BLOCK} to {MAX_BLOCK} bytes)"
                ),
            ));
        }
        self.drop_staged(rel);
        let Some(dir) = partial_dir(&self.root_fd, false) else {
            return Ok(());
        };
        let name = partial_name(rel);
        let Ok(st) = rfs::statat(&dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) else {
            return Ok(());
        };
        let me = rustix::process::geteuid().as_raw();
        let fresh = partial_age(&st).is_some_and(|a| a <= PARTIAL_MAX_AGE);
        if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::RegularFile
            || st.st_uid != me
            || st.st_nlink != 1
            || !fresh
        {
            let _ = rfs::unlinkat(&dir, name.as_str(), AtFlags::empty());
            return Ok(());
        }
        let staged = self.data_name(rel);
        if rfs::renameat(&dir, name.as_str(), &self.staging_fd, staged.as_str()).is_err() {
            return Ok(());
        }
        // Gone with its last kept file (fails harmlessly while others remain).
        let _ = rfs::unlinkat(&self.root_fd, PARTIAL_DIR, AtFlags::REMOVEDIR);
        let file = match rfs::openat(
            &self.staging_fd,
            staged.as_str(),
            OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => File::from(fd),
            Err(_) => {
                self.unlink_staged(&staged);
                return Ok(());
            }
        };
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let whole = (size / bs).min(MAX_BLOCKS) as usize;
        let mut hashes = vec![[0u8; 32]; whole];
        if hash_blocks(&file, bs, size, &mut hashes, &CancellationToken::new()).is_err() {
            self.unlink_staged(&staged);
            return Ok(());
        }
        self.resumed = hashes;
        self.staged
            .insert(rel.to_string(), Staged::written(staged, true));
        Ok(())
    }

    /// Move the staged bytes of large received files into [`PARTIAL_DIR`], for the next sync.
    pub(super) fn keep_partials(&mut self) {
        let me = rustix::process::geteuid().as_raw();
        let mut dir = None;
        for (rel, s) in &self.staged {
            if !s.resumable {
                continue;
            }
            let big = rfs::statat(&self.staging_fd, s.name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| st.st_size as u64 >= PARTIAL_MIN && st.st_uid == me);
            if !big {
                continue;
            }
            if dir.is_none() {
                dir = partial_dir(&self.root_fd, true);
            }
            let Some(d) = &dir else { return };
            let _ = rfs::renameat(
                &self.staging_fd,
                s.name.as_str(),
                d,
                partial_name(rel).as_str(),
            );
        }
        if let Some(d) = &dir {
            prune_partial(&self.root_fd, d);
        }
    }

    /// The staged file of `rel`, opened (created empty on first use).
    pub(super) fn staged_file(&mut self, rel: &str) -> std::io::Result<&mut Staged> {
        let needs_open = self.staged.get(rel).is_none_or(|s| s.file.is_none());
        if needs_open && self.open_files >= MAX_OPEN {
            for s in self.staged.values_mut() {
                s.file = None;
            }
            self.open_files = 0;
        }
        if !self.staged.contains_key(rel) {
            let name = self.data_name(rel);
            let file = File::from(rfs::openat(
                &self.staging_fd,
                name.as_str(),
                OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )?);
            self.open_files += 1;
            self.staged.insert(
                rel.to_string(),
                Staged {
                    name,
                    file: Some(file),
                    seq: Some(blake3::Hasher::new()),
                    seq_len: 0,
                    resumable: true,
                },
            );
        } else if needs_open {
            let fd = &self.staging_fd;
            let s = self.staged.get_mut(rel).expect("checked above");
            s.file = Some(File::from(rfs::openat(
                fd,
                s.name.as_str(),
                OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?));
            self.open_files += 1;
        }
        Ok(self.staged.get_mut(rel).expect("inserted above"))
    }

    /// Open `rel`'s staged copy to other channels ([`ApplyOp::FileShare`]): their writes come
    /// in any order, so the commit hashes the file again.
    pub(super) fn file_share(&mut self, rel: &str) -> Result<(), AgentError> {
        check_syntax(rel, false)?;
        let s = self.staged_file(rel).map_err(|e| io(&e, "stage", rel))?;
        s.seq = None;
        let name = s.name.clone();
        self.shared.push(name);
        Ok(())
    }

    pub(super) fn drop_staged(&mut self, rel: &str) {
        if let Some(s) = self.staged.remove(rel) {
            if s.file.is_some() {
                self.open_files -= 1;
            }
            self.unlink_staged(&s.name);
        }
    }

    pub(super) fn file_data(
        &mut self,
        rel: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<(), AgentError> {
        // Only the staging area is written: the parents are checked at commit.
        check_syntax(rel, false)?;
        if offset.checked_add(data.len() as u64).is_none() {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!("write {rel}: offset {offset} is out of range"),
            ));
        }
        let written = self.staged_file(rel).and_then(|s| {
            let file = s.file.as_ref().expect("opened by staged_file");
            write_sparse(file, data, offset)?;
            if let Some(h) = &mut s.seq {
                if offset == s.seq_len {
                    h.update(data);
                    s.seq_len += data.len() as u64;
                } else {
                    s.seq = None;
                }
            }
            Ok(())
        });
        written.map_err(|e| {
            // A half-written staged file is useless; on a full disk it also holds the space.
            self.drop_staged(rel);
            io(&e, "write", rel)
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn file_commit(
        &mut self,
        op: usize,
        rel: String,
        size: u64,
        mode: u32,
        mtime_ns: i64,
        hash: [u8; 32],
    ) -> Result<(), AgentError> {
        let r = self.verify(op, &rel, size, mode, mtime_ns, hash);
        if r.is_err() {
            self.drop_staged(&rel);
        }
        let commit = r?;
        self.pending.push(commit);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn verify(
        &mut self,
        op: usize,
        rel: &str,
        size: u64,
        mode: u32,
        mtime_ns: i64,
        hash: [u8; 32],
    ) -> Result<Commit, AgentError> {
        let (parent, name) = self.parent_exists("commit", rel)?;
        if lstat_at(&parent, name)
            .is_ok_and(|st| st.is_some_and(|st| file_type(&st) == rfs::FileType::Directory))
        {
            return Err(err(
                ErrorCode::IsADirectory,
                format!("{rel} exists and is a directory; refusing to replace it with a file"),
            ));
        }
        let s = self.staged_file(rel).map_err(|e| io(&e, "write", rel))?;
        let file = s.file.take().expect("opened by staged_file");
        let seq = s.seq.take().filter(|_| s.seq_len == size);
        let staged = s.name.clone();
        self.staged.remove(rel);
        self.open_files -= 1;
        let cleanup = |e: AgentError| {
            self.unlink_staged(&staged);
            e
        };
        file.set_len(size)
            .map_err(|e| cleanup(io(&e, "write", rel)))?;
        let got = match seq {
            Some(h) => h.finalize(),
            None => hash_staged(&file, size).map_err(|e| cleanup(io(&e, "verify", rel)))?,
        };
        if got.as_bytes() != &hash {
            return Err(cleanup(err(
                ErrorCode::InvalidArgument,
                format!("{rel}: content changed during sync (hash mismatch); re-run"),
            )));
        }
        file.set_permissions(Permissions::from_mode(mode & 0o7777))
            .map_err(|e| cleanup(io(&e, "chmod", rel)))?;
        mtime_fd(&file, mtime_ns).map_err(|e| cleanup(io(&e, "set mtime of", rel)))?;
        Ok(Commit {
            op,
            rel: rel.to_string(),
            staged,
            file,
            name: name.to_string(),
            parent,
            hash,
            size,
            mtime_ns,
        })
    }

    /// fsync the verified files (in parallel) and rename them into place, in op order. On a
    /// failure the files before it are in place and the rest are discarded.
    pub(super) fn flush(&mut self, n: usize) -> Result<(), AgentError> {
        let pending = std::mem::take(&mut self.pending);
        if pending.is_empty() {
            return Ok(());
        }
        let synced = sync_all(&pending);
        let mut failure = None;
        for (c, synced) in pending.into_iter().zip(synced) {
            if failure.is_some() {
                self.unlink_staged(&c.staged);
                continue;
            }
            let done = synced
                .map_err(|e| io(&e, "write", &c.rel))
                .and_then(|()| self.staging_ok())
                .and_then(|()| {
                    rfs::renameat(
                        &self.staging_fd,
                        c.staged.as_str(),
                        &*c.parent,
                        c.name.as_str(),
                    )
                    .map_err(|e| io(&e.into(), "commit", &c.rel))
                });
            match done {
                Ok(()) => self.remember(&c),
                Err(e) => {
                    self.unlink_staged(&c.staged);
                    failure = Some(at_op(e, c.op, n));
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Record a received file's hash for the root's cache, when its identity proves that the
    /// content is still exactly what was verified: our inode, our size, and the mtime we set
    /// (any later write moves the mtime to "now", which is past the clock read here).
    #[allow(clippy::unnecessary_cast)]
    pub(super) fn remember(&mut self, c: &Commit) {
        let (Ok(ours), Ok(Some(now))) = (c.file.metadata(), lstat_at(&c.parent, &c.name)) else {
            return;
        };
        if ours.ino() == now.st_ino as u64
            && ours.dev() == now.st_dev as u64
            && ours.len() == c.size
            && mtime_ns(&ours) == c.mtime_ns
            && c.mtime_ns < fs_clock_ns()
        {
            self.committed.push((Key::of(&ours), c.hash));
        }
    }

    pub(super) fn set_attr(
        &mut self,
        rel: &str,
        mode: Option<u32>,
        mtime: Option<i64>,
    ) -> Result<(), AgentError> {
        if rel.is_empty() {
            return self.set_root_attr(mode, mtime);
        }
        let (p, name) = match self.parent_of(rel)? {
            Ok(v) => v,
            Err(p) => {
                return Err(err(
                    ErrorCode::NotFound,
                    format!("set attributes of {rel}: parent {p} does not exist"),
                ));
            }
        };
        let st = lstat_at(&p, name)
            .and_then(|st| st.ok_or_else(|| ErrorKind::NotFound.into()))
            .map_err(|e| io(&e, "set attributes of", rel))?;
        let ty = file_type(&st);
        if let Some(mode) = mode
            && ty != rfs::FileType::Symlink
        {
            let dir = ty == rfs::FileType::Directory;
            let now = if dir {
                self.dir_mode_now(rel, mode)
            } else {
                mode & 0o7777
            };
            if perm(&st) != now {
                let r = if dir {
                    chmod_fd(&*self.dir_fd(rel)?, now)
                } else {
                    chmod_at(&p, name, now)
                };
                r.map_err(|e| io(&e, "chmod", rel))?;
            }
        }
        if let Some(mtime) = mtime {
            mtime_at(&p, name, mtime).map_err(|e| io(&e, "set mtime of", rel))?;
        }
        Ok(())
    }

    /// The root's own mode and mtime, through its descriptor.
    pub(super) fn set_root_attr(
        &mut self,
        mode: Option<u32>,
        mtime: Option<i64>,
    ) -> Result<(), AgentError> {
        let st = rfs::fstat(&self.root_fd).map_err(|e| io(&e.into(), "set attributes of", "."))?;
        if let Some(mode) = mode {
            let now = self.dir_mode_now("", mode);
            if perm(&st) != now {
                chmod_fd(&self.root_fd, now).map_err(|e| io(&e, "chmod", "."))?;
            }
        }
        if let Some(mtime) = mtime {
            mtime_fd(&self.root_fd, mtime).map_err(|e| io(&e, "set mtime of", "."))?;
        }
        Ok(())
    }

    pub(super) fn delete(&mut self, rel: &str) -> Result<(), AgentError> {
        let (p, name) = match self.parent_of(rel)? {
            Ok(v) => v,
            Err(_) => return Ok(()), // a parent is missing, so rel is too
        };
        let Some(st) = lstat_at(&p, name).map_err(|e| io(&e, "delete", rel))? else {
            return Ok(());
        };
        if file_type(&st) == rfs::FileType::Directory {
            rfs::unlinkat(&*p, name, AtFlags::REMOVEDIR)
                .map_err(|e| io(&e.into(), "delete", rel))?;
            self.deferred_modes.remove(rel);
            self.beneath.forget(rel);
        } else {
            rfs::unlinkat(&*p, name, AtFlags::empty()).map_err(|e| io(&e.into(), "delete", rel))?;
        }
        Ok(())
    }

    pub(super) fn close(
        &mut self,
        dir_mtimes: &[(String, i64)],
    ) -> Result<ApplyResult, AgentError> {
        if self.closed {
            return Err(err(ErrorCode::NotFound, "the sync session is closed"));
        }
        let mut errors = Vec::new();
        let mut warnings = Vec::new();
        let me = rustix::process::geteuid().as_raw();
        if let Err(e) = self.flush(0) {
            errors.push(e.message);
        }
        self.abandon(false);
        // Exact modes of directories that were kept writable, deepest first.
        let mut modes: Vec<(String, u32)> = self.deferred_modes.drain().collect();
        modes.sort_by_key(|(rel, _)| std::cmp::Reverse(rel.matches('/').count()));
        for (rel, mode) in modes {
            match self.beneath.dir(&rel) {
                Ok(fd) => {
                    if let Err(e) = chmod_fd(&fd, mode) {
                        errors.push(io(&e, "chmod", &rel).message);
                    }
                }
                Err(Refused::Missing(_)) => {}
                Err(r) => errors.push(self.refused(&rel, r).message),
            }
        }
        // Last: removing the staging directory and writing files changed these mtimes.
        for (rel, mtime) in dir_mtimes {
            let shown = if rel.is_empty() { "." } else { rel.as_str() };
            let found = if rel.is_empty() {
                rfs::fstat(&self.root_fd)
                    .map(|st| Some((None, st)))
                    .map_err(std::io::Error::from)
            } else {
                match check_syntax(rel, false).map(|()| self.beneath.parent(rel)) {
                    Err(e) => {
                        errors.push(e.message);
                        continue;
                    }
                    Ok(Err(Refused::Missing(_))) => continue,
                    Ok(Err(r)) => {
                        errors.push(self.refused(rel, r).message);
                        continue;
                    }
                    Ok(Ok((p, name))) => {
                        lstat_at(&p, name).map(|st| st.map(|st| (Some((p, name)), st)))
                    }
                }
            };
            match found {
                Ok(Some((at, st))) if file_type(&st) == rfs::FileType::Directory => {
                    let set = match &at {
                        Some((p, name)) => mtime_at(p, name, *mtime),
                        None => mtime_fd(&self.root_fd, *mtime),
                    };
                    if let Err(e) = set {
                        // Only a directory's owner may set its times: on one that is not ours
                        // (a shared directory we may write) the files are in, so say so and
                        // go on.
                        if e.kind() == ErrorKind::PermissionDenied && st.st_uid != me {
                            warnings.push(format!(
                                "could not set the mtime of {shown}: it belongs to uid {}, not to this user (the files were committed)",
                                st.st_uid
                            ));
                        } else {
                            errors.push(io(&e, "set mtime of", shown).message);
                        }
                    }
                }
                Ok(Some((_, st))) if file_type(&st) == rfs::FileType::Symlink => {
                    errors.push(self.refused(rel, Refused::Link(rel.clone())).message);
                }
                Ok(Some(_)) => errors.push(format!("set mtime of {shown}: not a directory")),
                Ok(None) => {}
                Err(e) => errors.push(io(&e, "set mtime of", shown).message),
            }
        }
        cache::record(&self.root, &std::mem::take(&mut self.committed));
        match errors.len() {
            0 => Ok(ApplyResult {
                warnings,
                ..ApplyResult::default()
            }),
            1 => Err(err(ErrorCode::Io, errors.remove(0))),
            k => Err(err(
                ErrorCode::Io,
                format!("{} (and {} more errors)", errors[0], k - 1),
            )),
        }
    }

    /// Give up: what was committed stays (and its hashes are cached), the staging goes, except
    /// the bytes of large files, kept for the next sync to resume.
    pub(super) fn abort(&mut self) {
        if self.closed {
            return;
        }
        self.abandon(true);
        cache::record(&self.root, &std::mem::take(&mut self.committed));
    }

    /// Drop everything staged (keeping large received files when `keep`) and remove the
    /// staging directory (its lock goes last).
    pub(super) fn abandon(&mut self, keep: bool) {
        if keep && !self.closed && self.staging_ok().is_ok() {
            self.keep_partials();
        }
        self.closed = true;
        self.staged.clear();
        self.pending.clear();
        self.open_files = 0;
        if self.staging_ok().is_ok() {
            let _ = fs::remove_dir_all(&self.staging);
        } else {
            // Not ours at that path any more: empty our own directory through its descriptor
            // and leave the path alone.
            if let Ok(dir) = rfs::Dir::read_from(&self.staging_fd) {
                for e in dir.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if name != "." && name != ".." {
                        self.unlink_staged(&name);
                    }
                }
            }
        }
        self.lock = None;
    }
}

impl Session {
    /// Each destination entry is what the orchestrator last saw there: a file with this
    /// blake3, or nothing (`None`).
    pub(super) fn expect_all(
        &mut self,
        expect: &[(String, Option<[u8; 32]>)],
    ) -> Result<(), AgentError> {
        for (rel, want) in expect {
            let changed = || {
                err(
                    ErrorCode::AlreadyExists,
                    format!("{rel} changed on the destination since the last sync"),
                )
            };
            let (p, name) = match self.parent_of(rel)? {
                Ok(v) => v,
                // A parent is missing, so nothing is at `rel`.
                Err(_) if want.is_some() => return Err(changed()),
                Err(_) => continue,
            };
            let now = match lstat_at(&p, name).map_err(|e| io(&e, "stat", rel))? {
                Some(st) if file_type(&st) == rfs::FileType::RegularFile => {
                    let f = rfs::openat(
                        &*p,
                        name,
                        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                        Mode::empty(),
                    )
                    .map(File::from)
                    .map_err(|e| io(&e.into(), "read", rel))?;
                    let len = f.metadata().map_err(|e| io(&e, "read", rel))?.len();
                    Some(
                        *hash_staged(&f, len)
                            .map_err(|e| io(&e, "read", rel))?
                            .as_bytes(),
                    )
                }
                Some(_) => return Err(changed()),
                None => None,
            };
            if now != *want {
                return Err(changed());
            }
        }
        Ok(())
    }
}
