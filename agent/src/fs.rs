//! Read-only file system queries: `stat`, `list_dir`, `read_file`.
//!
//! These are blocking functions; `serve` runs them on tokio's blocking pool. Paths are data:
//! only a leading `~` is expanded, nothing is handed to a shell.

use crate::confine::own_reads;
use std::fs::{File, Metadata};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rsb_protocol::{
    AgentError, DirEntry, ErrorCode, FileKind, FileStat, ListDirRequest, ListDirResult, MAX_FRAME,
    ReadFileRequest, ReadFileResult, StatRequest,
};
use tokio_util::sync::CancellationToken;

use crate::util::{expand_home, path_string};

/// Room left in a frame for everything that is not file data (envelope, path, lengths), so a
/// maximal `read_file` reply still encodes within [`MAX_FRAME`].
const FRAME_HEADROOM: u64 = 64 * 1024;
/// Largest `read_file` payload; larger requests are clamped and come back `truncated`.
pub const MAX_READ: u64 = MAX_FRAME as u64 - FRAME_HEADROOM;
/// Rough encoded size of one [`DirEntry`] beyond its name (varints, kind, times).
const ENTRY_OVERHEAD: usize = 40;

pub(crate) fn kind_of(ft: std::fs::FileType) -> FileKind {
    if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else if ft.is_fifo() {
        FileKind::Fifo
    } else if ft.is_socket() {
        FileKind::Socket
    } else if ft.is_block_device() {
        FileKind::BlockDevice
    } else if ft.is_char_device() {
        FileKind::CharDevice
    } else {
        FileKind::Other
    }
}

/// Permission bits only (including setuid/setgid/sticky): the file type travels as `kind`.
pub(crate) fn mode_of(m: &Metadata) -> u32 {
    m.mode() & 0o7777
}

pub(crate) fn mtime_ns(m: &Metadata) -> i64 {
    ns(m.mtime(), m.mtime_nsec())
}

fn cancelled() -> AgentError {
    AgentError::new(ErrorCode::Cancelled, "request cancelled")
}

pub fn stat(req: &StatRequest) -> Result<FileStat, AgentError> {
    own_reads(req.confine.as_ref(), &expand_home(&req.path), || {
        stat_in(req)
    })
}

fn stat_in(req: &StatRequest) -> Result<FileStat, AgentError> {
    let path = expand_home(&req.path);
    let shown = path_string(&path);
    let lmeta =
        std::fs::symlink_metadata(&path).map_err(|e| AgentError::from_io(&e, "stat", &shown))?;
    // The link target is reported even when following, so a caller sees both facts at once.
    let symlink_target = if lmeta.file_type().is_symlink() {
        std::fs::read_link(&path).ok().map(|t| path_string(&t))
    } else {
        None
    };
    let meta = if req.follow && lmeta.file_type().is_symlink() {
        std::fs::metadata(&path).map_err(|e| AgentError::from_io(&e, "stat", &shown))?
    } else {
        lmeta
    };
    Ok(FileStat {
        path: shown,
        kind: kind_of(meta.file_type()),
        size: meta.len(),
        mode: mode_of(&meta),
        mtime_ns: mtime_ns(&meta),
        symlink_target,
    })
}

/// One directory of a depth-first walk: its names in byte order (not locale order, so every
/// host walks alike) and how far the walk has got. A walk reads each directory only when it
/// reaches it, so one stopped after N entries costs about N lstat calls however large the tree.
/// Listings here and sync manifests walk with it.
pub(crate) struct Level {
    pub dir: PathBuf,
    /// The directory relative to the walk's root (`""` for the root itself).
    pub rel: String,
    names: Vec<std::ffi::OsString>,
    next: usize,
    /// The directory, open: its entries are stat'ed relative to it ([`Level::lstat`]), one
    /// path component each instead of the whole path every time. Dropped below
    /// [`LEVEL_FDS`] levels, so that a very deep tree cannot exhaust the descriptors.
    fd: Option<std::os::fd::OwnedFd>,
}

/// Directories of one walk held open at most (see [`Level::fd`]).
pub(crate) const LEVEL_FDS: usize = 64;

/// What a walk needs of an lstat, from `statat` (the walk) or `std` (roots).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    /// The whole `st_mode`: type and permission bits.
    pub st_mode: u32,
}

fn ns(s: i64, nsec: i64) -> i64 {
    s.saturating_mul(1_000_000_000).saturating_add(nsec)
}

impl Meta {
    pub fn of(m: &Metadata) -> Meta {
        Meta {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
            st_mode: m.mode(),
        }
    }

    // The field types differ between targets (x86_64 and aarch64, libc and linux_raw).
    #[allow(clippy::unnecessary_cast)]
    pub(crate) fn of_stat(s: &rustix::fs::Stat) -> Meta {
        Meta {
            dev: s.st_dev as u64,
            ino: s.st_ino as u64,
            size: s.st_size as u64,
            mtime_ns: ns(s.st_mtime as i64, s.st_mtime_nsec as i64),
            ctime_ns: ns(s.st_ctime as i64, s.st_ctime_nsec as i64),
            st_mode: s.st_mode as u32,
        }
    }

    pub fn kind(&self) -> FileKind {
        // `mode_t` is u32 on Linux and u16 on macOS; compare in the u32 `st_mode` keeps.
        #[allow(clippy::unnecessary_cast)]
        const fn bits(m: libc::mode_t) -> u32 {
            m as u32
        }
        const IFMT: u32 = bits(libc::S_IFMT);
        const LNK: u32 = bits(libc::S_IFLNK);
        const DIR: u32 = bits(libc::S_IFDIR);
        const REG: u32 = bits(libc::S_IFREG);
        const FIFO: u32 = bits(libc::S_IFIFO);
        const SOCK: u32 = bits(libc::S_IFSOCK);
        const BLK: u32 = bits(libc::S_IFBLK);
        const CHR: u32 = bits(libc::S_IFCHR);
        match self.st_mode & IFMT {
            LNK => FileKind::Symlink,
            DIR => FileKind::Dir,
            REG => FileKind::File,
            FIFO => FileKind::Fifo,
            SOCK => FileKind::Socket,
            BLK => FileKind::BlockDevice,
            CHR => FileKind::CharDevice,
            _ => FileKind::Other,
        }
    }

    /// Permission bits only, as [`mode_of`].
    pub fn mode(&self) -> u32 {
        self.st_mode & 0o7777
    }
}

impl Level {
    pub fn read(dir: PathBuf, rel: String) -> std::io::Result<Level> {
        use rustix::fs::{Mode, OFlags};
        use std::os::unix::ffi::OsStringExt;
        // Followed as `read_dir` does: a root given as a symlink to a directory is walked.
        let fd = rustix::fs::open(
            &dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut names = Vec::new();
        for e in rustix::fs::Dir::read_from(&fd)? {
            let name = e?.file_name().to_bytes().to_vec();
            if name != b"." && name != b".." {
                names.push(std::ffi::OsString::from_vec(name));
            }
        }
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        Ok(Level {
            dir,
            rel,
            names,
            next: 0,
            fd: Some(fd),
        })
    }

    /// Close the directory (its names are read); [`Level::lstat`] then goes by path.
    pub fn close(&mut self) {
        self.fd = None;
    }

    /// lstat of `name` in this directory.
    pub fn lstat(&self, name: &std::ffi::OsStr) -> std::io::Result<Meta> {
        match &self.fd {
            Some(fd) => {
                let s = rustix::fs::statat(fd, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)?;
                Ok(Meta::of_stat(&s))
            }
            None => Ok(Meta::of(&std::fs::symlink_metadata(self.dir.join(name))?)),
        }
    }

    /// The next name in order; `None` once this directory is done.
    pub fn next_name(&mut self) -> Option<std::ffi::OsString> {
        let name = self.names.get_mut(self.next).map(std::mem::take)?;
        self.next += 1;
        Some(name)
    }
}

/// Depth-first, name-sorted listing (see [`Level`]).
struct Walk<'a> {
    stack: Vec<Level>,
    recursive: bool,
    errors: &'a mut Vec<String>,
}

impl Walk<'_> {
    fn next_entry(&mut self) -> Option<DirEntry> {
        loop {
            let level = self.stack.last_mut()?;
            let Some(name) = level.next_name() else {
                self.stack.pop();
                continue;
            };
            let path = level.dir.join(&name);
            let name = name.to_string_lossy();
            let rel = if level.rel.is_empty() {
                name.into_owned()
            } else {
                format!("{}/{}", level.rel, name)
            };
            let meta = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) => {
                    // Vanished between readdir and lstat (or unreadable): report, keep going.
                    self.errors.push(format!("{rel}: {e}"));
                    continue;
                }
            };
            let kind = kind_of(meta.file_type());
            // lstat never reports a symlink as a dir, so symlinked dirs are not descended.
            if self.recursive && kind == FileKind::Dir {
                match Level::read(path, rel.clone()) {
                    // Listings go by path: no descriptor held per level.
                    Ok(mut l) => {
                        l.close();
                        self.stack.push(l)
                    }
                    Err(e) => self.errors.push(format!("{rel}: {e}")),
                }
            }
            return Some(DirEntry {
                rel,
                kind,
                size: meta.len(),
                mode: mode_of(&meta),
                mtime_ns: mtime_ns(&meta),
            });
        }
    }
}

pub fn list_dir(
    req: &ListDirRequest,
    cancel: &CancellationToken,
) -> Result<ListDirResult, AgentError> {
    own_reads(req.confine.as_ref(), &expand_home(&req.path), || {
        list_dir_in(req, cancel)
    })
}

fn list_dir_in(
    req: &ListDirRequest,
    cancel: &CancellationToken,
) -> Result<ListDirResult, AgentError> {
    let root = expand_home(&req.path);
    let shown = path_string(&root);
    // The root itself may be a symlink to a directory (like `ls dir/`); entries below are not followed.
    let meta = std::fs::metadata(&root).map_err(|e| AgentError::from_io(&e, "list_dir", &shown))?;
    if !meta.is_dir() {
        return Err(AgentError::new(
            ErrorCode::NotADirectory,
            format!("list_dir {shown}: not a directory"),
        ));
    }
    let first = Level::read(root, String::new())
        .map_err(|e| AgentError::from_io(&e, "list_dir", &shown))?;
    let mut errors = Vec::new();
    let mut walk = Walk {
        stack: vec![first],
        recursive: req.recursive,
        errors: &mut errors,
    };
    let mut entries = Vec::new();
    let mut budget = MAX_FRAME - FRAME_HEADROOM as usize;
    let mut truncated = false;
    loop {
        if cancel.is_cancelled() {
            return Err(cancelled());
        }
        let Some(entry) = walk.next_entry() else {
            break;
        };
        let cost = entry.rel.len() + ENTRY_OVERHEAD;
        // Past `max_entries`, or past what one frame can carry: this entry proves there is more.
        if entries.len() as u64 >= req.max_entries || cost > budget {
            truncated = true;
            break;
        }
        budget -= cost;
        entries.push(entry);
    }
    // Errors are bounded too: a tree of unreadable dirs must not overflow the frame.
    errors.truncate(1000);
    Ok(ListDirResult {
        root: shown,
        entries,
        truncated,
        errors,
    })
}

/// Open a file for reading only if it is a regular file: the one way the agent opens a file a
/// caller named (`read_file`, a job's `log_file`).
///
/// O_NONBLOCK makes opening a FIFO with no writer return at once instead of pinning a thread
/// until someone writes; the fstat on the opened descriptor (not a second lookup of the path)
/// then refuses FIFOs, devices (`/dev/zero` would read forever or as empty) and sockets. The
/// flag has no effect on reads of a regular file. Errors are `IsADirectory` or `InvalidInput`
/// with a message that names the kind, so `AgentError::from_io` yields one clear line.
pub fn open_regular(path: &Path) -> std::io::Result<(File, Metadata)> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(std::io::Error::from(std::io::ErrorKind::IsADirectory));
    }
    if !ft.is_file() {
        let kind = format!("{:?}", kind_of(ft)).to_lowercase();
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("not a regular file ({kind}); refusing to read it"),
        ));
    }
    Ok((file, meta))
}

pub fn read_file(req: &ReadFileRequest) -> Result<ReadFileResult, AgentError> {
    own_reads(req.confine.as_ref(), &expand_home(&req.path), || {
        read_file_in(req)
    })
}

fn read_file_in(req: &ReadFileRequest) -> Result<ReadFileResult, AgentError> {
    let path = expand_home(&req.path);
    let shown = path_string(&path);
    let io_err = |e: std::io::Error| AgentError::from_io(&e, "read_file", &shown);
    let (mut file, meta) = open_regular(&path).map_err(io_err)?;
    let size = meta.len();
    let max = req.max_bytes.min(MAX_READ);
    file.seek(SeekFrom::Start(req.offset)).map_err(io_err)?;
    // One byte beyond `max` tells whether more follows, which `size` cannot for files such as
    // /proc entries that report size 0 but have content.
    let expected = size.saturating_sub(req.offset).min(max) + 1;
    let mut data = Vec::with_capacity(expected as usize);
    (&mut file)
        .take(max + 1)
        .read_to_end(&mut data)
        .map_err(io_err)?;
    let truncated = data.len() as u64 > max;
    data.truncate(max as usize);
    Ok(ReadFileResult {
        path: shown,
        size,
        offset: req.offset,
        data,
        truncated,
    })
}

/// The reason a path could not be used as a directory, for callers outside this module (exec's cwd).
pub fn require_dir(path: &Path, what: &str) -> Result<(), AgentError> {
    let shown = path_string(path);
    let meta = std::fs::metadata(path).map_err(|e| AgentError::from_io(&e, what, &shown))?;
    if meta.is_dir() {
        Ok(())
    } else {
        Err(AgentError::new(
            ErrorCode::NotADirectory,
            format!("{what} {shown}: not a directory"),
        ))
    }
}
