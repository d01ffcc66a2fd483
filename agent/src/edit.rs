//! `read_text`, `edit`, `write`: reading by lines and changing text files the way a coding
//! agent does on its own disk (see `rsb_protocol::edit`).
//!
//! A change is made under an exclusive `flock` of the file it replaces: the lock is taken on
//! the open file, then the path is checked to still name that file (a change that won the
//! race before has renamed a new file into place, and the loser retries on it), then the
//! content is read, the precondition checked, the new content staged in the same directory
//! and renamed over the old one. So two changes that expect the same hash cannot both
//! succeed, in one agent or in two. Blocking functions; `serve` runs them on the blocking pool
//! and lets them finish even if the caller cancels (a change is short, and its reply is then
//! the truth about the file).
//!
//! Every step after the path is resolved goes through the file's parent directory, opened once
//! and held ([`at`]): a co-tenant who swaps a directory on the path for a symlink, or plants a
//! link at the file, cannot redirect a change into another directory.

mod at;

use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::{Duration, Instant};

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use rustix::io::Errno;

use rsb_protocol::edit::{MAX_DIFF_LINES, MAX_EDIT_BYTES};
use rsb_protocol::{
    AgentError, Changed, ContentHash, EditOutcome, EditRequest, ErrorCode, LineRange, NearLine,
    ReadTextRequest, ReadTextResult, Refusal, WriteCondition, WriteRequest,
};

use crate::confine::{Writable, own_writes};
use crate::fs::{MAX_READ, open_regular};
use crate::sync::beneath::file_type;
use crate::util::{expand_home, path_string};
use at::{Opts, Target, resolve};

/// The hash every read reply carries and every precondition names.
pub fn content_hash(data: &[u8]) -> ContentHash {
    let h = blake3::hash(data);
    h.as_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// [`resolve`] for a change under `w`'s roots: the path before it is resolved (so no
/// directory is made outside them), then the directory it resolved to, held, is beneath one.
fn resolve_writable(
    w: &Writable,
    path: &std::path::Path,
    opts: Opts,
    what: &str,
) -> Result<Target, AgentError> {
    w.check_path(path, what)?;
    let t = resolve(path, opts, what)?;
    w.check_dir(&t.dir, &t.shown(), what)?;
    Ok(t)
}

fn count_lines(data: &[u8]) -> u64 {
    let nl = data.iter().filter(|&&b| b == b'\n').count() as u64;
    nl + u64::from(data.last().is_some_and(|&b| b != b'\n'))
}

/// Whole lines `range` of `r`, while they fit in `max` bytes (a first line longer than `max`
/// is cut). Returns the bytes, the lines in them, and whether content follows. Reads no
/// further than the range, and holds no more than `max` bytes, however long a line is.
fn take_lines(
    r: &mut impl BufRead,
    range: LineRange,
    max: u64,
) -> std::io::Result<(Vec<u8>, u64, bool)> {
    let mut skip = range.first.saturating_sub(1);
    while skip > 0 {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            return Ok((Vec::new(), 0, false));
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                r.consume(i + 1);
                skip -= 1;
            }
            None => {
                let n = buf.len();
                r.consume(n);
            }
        }
    }
    let max = max as usize;
    let mut data = Vec::new();
    let mut lines = 0u64;
    'lines: while range.count == 0 || lines < range.count {
        let line_start = data.len();
        loop {
            let buf = r.fill_buf()?;
            if buf.is_empty() {
                if data.len() > line_start {
                    lines += 1;
                }
                return Ok((data, lines, false));
            }
            let (seg, ends) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (&buf[..=i], true),
                None => (buf, false),
            };
            let room = max - data.len();
            if seg.len() > room {
                if lines == 0 {
                    // A first line longer than the cap: its head, so the caller sees something.
                    data.extend_from_slice(&seg[..room]);
                } else {
                    data.truncate(line_start);
                }
                return Ok((data, lines, true));
            }
            data.extend_from_slice(seg);
            let n = seg.len();
            r.consume(n);
            if ends {
                lines += 1;
                continue 'lines;
            }
        }
    }
    let more = !r.fill_buf()?.is_empty();
    Ok((data, lines, more))
}

pub fn read_text(req: &ReadTextRequest) -> Result<ReadTextResult, AgentError> {
    let path = expand_home(&req.path);
    crate::confine::own_reads(req.confine.as_ref(), &path, || read_text_in(req))
}

fn read_text_in(req: &ReadTextRequest) -> Result<ReadTextResult, AgentError> {
    let path = expand_home(&req.path);
    let shown = path_string(&path);
    let io_err = |e: std::io::Error| AgentError::from_io(&e, "read_file", &shown);
    let (file, meta) = open_regular(&path).map_err(io_err)?;
    let size = meta.len();
    let max = req.max_bytes.min(MAX_READ);
    let range = req.lines.unwrap_or(LineRange { first: 1, count: 0 });
    if size <= MAX_EDIT_BYTES {
        // Small enough to hash: one read of the whole file, so the hash is of the bytes shown.
        let mut all = Vec::with_capacity(size as usize + 1);
        file.take(MAX_EDIT_BYTES + 1)
            .read_to_end(&mut all)
            .map_err(io_err)?;
        let hash = (all.len() as u64 <= MAX_EDIT_BYTES).then(|| content_hash(&all));
        let total_lines = hash.is_some().then(|| count_lines(&all));
        let (data, lines, truncated) = if req.lines.is_some() {
            take_lines(&mut &all[..], range, max).map_err(io_err)?
        } else {
            let n = all.len().min(max as usize);
            (all[..n].to_vec(), count_lines(&all[..n]), all.len() > n)
        };
        return Ok(ReadTextResult {
            path: shown,
            size: all.len() as u64,
            hash,
            data,
            truncated,
            first_line: if req.lines.is_some() {
                range.first.max(1)
            } else {
                1
            },
            lines,
            total_lines,
        });
    }
    let mut r = BufReader::with_capacity(256 * 1024, file);
    let (data, lines, truncated) = if req.lines.is_some() {
        take_lines(&mut r, range, max).map_err(io_err)?
    } else {
        let mut data = Vec::new();
        (&mut r)
            .take(max + 1)
            .read_to_end(&mut data)
            .map_err(io_err)?;
        let truncated = data.len() as u64 > max;
        data.truncate(max as usize);
        let lines = count_lines(&data);
        (data, lines, truncated)
    };
    Ok(ReadTextResult {
        path: shown,
        size,
        hash: None,
        data,
        truncated,
        first_line: if req.lines.is_some() {
            range.first.max(1)
        } else {
            1
        },
        lines,
        total_lines: None,
    })
}

/// The file a change replaces, locked, and what it held.
struct Locked {
    /// Holds the `flock` until the change is renamed into place (or refused).
    _file: File,
    meta: Metadata,
    data: Vec<u8>,
}

/// How long a change waits for another process's lock on the file.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// A change follows a link at the file (where safe: see [`at`]), so the link stays a link.
const FOLLOW: Opts = Opts {
    follow_last: true,
    make_dirs: false,
};

/// Open, lock and read the file at `target`; `None` when nothing is there. Refuses anything
/// but a regular file, and a file over [`MAX_EDIT_BYTES`].
#[allow(clippy::unnecessary_cast)] // `st_dev` and `st_ino` are narrower on macOS
fn lock_current(
    target: &Target,
    what: &str,
) -> Result<Result<Option<Locked>, Refusal>, AgentError> {
    let shown = target.shown();
    let io_err = |e: std::io::Error| AgentError::from_io(&e, what, &shown);
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        let (file, meta) = match open_regular_at(target) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ok(None)),
            Err(e) => return Err(io_err(e)),
        };
        loop {
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => break,
                Err(rustix::io::Errno::WOULDBLOCK) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(rustix::io::Errno::WOULDBLOCK) => {
                    return Err(AgentError::new(
                        ErrorCode::Io,
                        format!(
                            "{what} {shown}: the file stayed locked by another process for {} s",
                            LOCK_WAIT.as_secs()
                        ),
                    ));
                }
                Err(e) => return Err(io_err(e.into())),
            }
        }
        // A change that held the lock before us has renamed a new file over this one: take
        // the lock on that one instead, and read what it holds.
        match target.lstat() {
            Ok(Some(now)) if now.st_dev as u64 == meta.dev() && now.st_ino as u64 == meta.ino() => {
            }
            Ok(_) | Err(_) if Instant::now() < deadline => continue,
            Ok(_) => {
                return Err(AgentError::new(
                    ErrorCode::Io,
                    format!("{what} {shown}: the file kept being replaced"),
                ));
            }
            Err(e) => return Err(io_err(e)),
        }
        if meta.len() > MAX_EDIT_BYTES {
            return Ok(Err(Refusal::TooLarge { size: meta.len() }));
        }
        if !writable(target) {
            return Err(AgentError::new(
                ErrorCode::PermissionDenied,
                format!(
                    "{what} {shown}: permission denied (the file is not writable by this user)"
                ),
            ));
        }
        let mut data = Vec::with_capacity(meta.len() as usize);
        (&file)
            .take(MAX_EDIT_BYTES + 1)
            .read_to_end(&mut data)
            .map_err(io_err)?;
        if data.len() as u64 > MAX_EDIT_BYTES {
            return Ok(Err(Refusal::TooLarge {
                size: data.len() as u64,
            }));
        }
        return Ok(Ok(Some(Locked {
            _file: file,
            meta,
            data,
        })));
    }
}

fn writable(t: &Target) -> bool {
    rfs::accessat(&t.dir, &*t.name, rfs::Access::WRITE_OK, AtFlags::empty()).is_ok()
}

/// [`open_regular`] of the target's name in its held directory, never through a link: a link
/// there now was put there after the path was resolved.
fn open_regular_at(t: &Target) -> std::io::Result<(File, Metadata)> {
    let fd = rfs::openat(
        &t.dir,
        &*t.name,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::LOOP => std::io::Error::other("a symlink appeared at the file while it was opened"),
        e => e.into(),
    })?;
    let file = File::from(fd);
    let meta = file.metadata()?;
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(std::io::Error::from(std::io::ErrorKind::IsADirectory));
    }
    if !ft.is_file() {
        let kind = format!("{:?}", crate::fs::kind_of(ft)).to_lowercase();
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("not a regular file ({kind}); refusing to replace it"),
        ));
    }
    Ok((file, meta))
}

/// The mode and owner a replaced file keeps.
#[derive(Clone, Copy)]
struct Owner {
    mode: u32,
    uid: u32,
    gid: u32,
}

impl Owner {
    fn of(m: &Metadata) -> Owner {
        Owner {
            mode: m.mode(),
            uid: m.uid(),
            gid: m.gid(),
        }
    }

    #[allow(clippy::unnecessary_cast)]
    fn of_stat(st: &rfs::Stat) -> Owner {
        Owner {
            mode: st.st_mode as u32,
            uid: st.st_uid,
            gid: st.st_gid,
        }
    }
}

/// `data` written to a new file next to `target` in its held directory, with the old file's
/// mode (and owner where this user may keep it); the caller moves it into place ([`place`])
/// or removes it. Returns the staged name.
fn stage(
    target: &Target,
    data: &[u8],
    old: Option<Owner>,
    what: &str,
) -> Result<OsString, AgentError> {
    let shown = target.shown();
    let dir = match target.path.parent() {
        Some(d) if !d.as_os_str().is_empty() => path_string(d),
        _ => ".".to_string(),
    };
    let name = target.name.to_string_lossy().into_owned();
    remove_stale(target);
    // A file that exists is staged owner-only until its bytes are all written and its mode is
    // set: a co-tenant who opens the staged name the moment it appears (inotify) must not keep
    // a descriptor to a private file's new content. A new file gets 0666 less the umask from
    // the start, which is what it ends up with anyway.
    let create_mode = if old.is_some() { 0o600 } else { 0o666 };
    let (tmp, mut file) = stage_file(&target.dir, &name, create_mode).map_err(|e| {
        let mut err = AgentError::from_io(&e, what, &shown);
        if err.code == ErrorCode::PermissionDenied {
            err.message =
                format!("{what} {shown}: permission denied (cannot create a file in {dir})");
        }
        err
    })?;
    let result = (|| -> std::io::Result<()> {
        file.write_all(data)?;
        if let Some(m) = old {
            // Best effort: only root, or a group this user is in, can keep another owner.
            // Owner first: a chown clears the set-id bits, which the mode then restores.
            if m.uid != rustix::process::geteuid().as_raw()
                || m.gid != rustix::process::getegid().as_raw()
            {
                let _ = std::os::unix::fs::fchown(&file, Some(m.uid), Some(m.gid));
            }
            file.set_permissions(std::fs::Permissions::from_mode(m.mode & 0o7777))?;
        }
        // On disk before it is renamed over the old file: a power cut after the rename
        // finds the new content, never an empty file.
        file.sync_all()
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = rfs::unlinkat(&target.dir, &*tmp, AtFlags::empty());
            Err(AgentError::from_io(&e, what, &shown))
        }
    }
}

/// Move a staged file into place: renamed over `target`, or for `create_only` linked (so a
/// file that appeared meanwhile is never replaced). The staged name is gone afterwards.
fn place(
    tmp: &OsStr,
    target: &Target,
    create_only: bool,
    what: &str,
) -> Result<Result<(), Refusal>, AgentError> {
    let d = &target.dir;
    let result = if create_only {
        let r = match rfs::linkat(d, tmp, d, &*target.name, AtFlags::empty()) {
            Ok(()) => Ok(Ok(())),
            Err(Errno::EXIST) => Ok(Err(Refusal::Exists)),
            Err(e) => Err(e),
        };
        let _ = rfs::unlinkat(d, tmp, AtFlags::empty());
        r
    } else {
        let r = rfs::renameat(d, tmp, d, &*target.name).map(Ok);
        if r.is_err() {
            let _ = rfs::unlinkat(d, tmp, AtFlags::empty());
        }
        r
    };
    // The directory's new entry on disk too.
    let _ = rfs::fsync(d);
    result.map_err(|e| AgentError::from_io(&e.into(), what, &target.shown()))
}

/// Staged and kept-aside files of this file's name that a process which is gone left behind
/// (a crash, a kill between staging and renaming): removed, if they are this user's.
fn remove_stale(target: &Target) {
    let short: String = target.name.to_string_lossy().chars().take(40).collect();
    let prefix = format!(".{short}.rsb-");
    // The held descriptor may be O_PATH, which cannot be read: its `.` opened for reading.
    let Ok(fd) = rfs::openat(
        &target.dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    let Ok(dir) = rfs::Dir::read_from(&fd) else {
        return;
    };
    let me = rustix::process::geteuid().as_raw();
    for e in dir.flatten().take(100_000) {
        let n = e.file_name().to_string_lossy();
        let Some(rest) = n.strip_prefix(prefix.as_str()) else {
            continue;
        };
        if !(rest.ends_with(".tmp") || rest.ends_with(".kept")) {
            continue;
        }
        let pid = rest.split('-').next().and_then(|p| p.parse::<i32>().ok());
        let gone = pid
            .and_then(rustix::process::Pid::from_raw)
            .is_some_and(|p| matches!(rustix::process::test_kill_process(p), Err(Errno::SRCH)));
        let mine = rfs::statat(&target.dir, e.file_name(), AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|st| st.st_uid == me && file_type(&st) == rfs::FileType::RegularFile);
        if gone && mine {
            let _ = rfs::unlinkat(&target.dir, e.file_name(), AtFlags::empty());
        }
    }
}

/// Should `cur` be written in place rather than replaced? A rename puts a new file under the
/// name: the old one's other hard links keep the old content, and its extended attributes
/// (ACLs, SELinux labels, user attributes) stay with it. Claude Code's Edit writes in place;
/// so does rsb, for such a file.
fn keeps_identity(cur: &Locked) -> bool {
    let mut names = [0u8; 256];
    cur.meta.nlink() > 1
        || match rfs::flistxattr(&cur._file, &mut names[..]) {
            Ok(n) => n > 0,
            // More names than the buffer holds: there are some.
            Err(Errno::RANGE) => true,
            Err(_) => false,
        }
}

/// Write `data` over the file `target` names, which must still be the file `(dev, ino)`
/// (locked and read): from the start, then cut to length, then flushed to disk. Not atomic:
/// a crash midway leaves a mix of the old and the new content, never an empty file.
fn write_in_place(
    target: &Target,
    dev: u64,
    ino: u64,
    data: &[u8],
    what: &str,
) -> Result<(), AgentError> {
    use std::os::unix::fs::FileExt;
    let shown = target.shown();
    let io = |e: std::io::Error| AgentError::from_io(&e, what, &shown);
    let fd = rfs::openat(
        &target.dir,
        &*target.name,
        OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(e.into()))?;
    let file = File::from(fd);
    let meta = file.metadata().map_err(io)?;
    if meta.dev() != dev || meta.ino() != ino {
        return Err(AgentError::new(
            ErrorCode::Io,
            format!("{what} {shown}: the file was replaced while it was being changed"),
        ));
    }
    file.write_all_at(data, 0).map_err(io)?;
    file.set_len(data.len() as u64).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Replace `target` (locked and read as `cur`) with `data`: in place when its identity must
/// be kept ([`keeps_identity`]) or its directory does not let this user stage a new file
/// beside it (a writable file in a read-only directory), else staged and renamed over it.
/// `Ok(in_place)`.
fn replace(
    target: &Target,
    cur: &Locked,
    data: &[u8],
    what: &str,
) -> Result<Result<bool, Refusal>, AgentError> {
    if keeps_identity(cur) {
        write_in_place(target, cur.meta.dev(), cur.meta.ino(), data, what)?;
        return Ok(Ok(true));
    }
    match commit(target, data, Some(Owner::of(&cur.meta)), false, what) {
        Ok(r) => Ok(r.map(|()| false)),
        Err(e) if e.code == ErrorCode::PermissionDenied => {
            write_in_place(target, cur.meta.dev(), cur.meta.ino(), data, what)?;
            Ok(Ok(true))
        }
        Err(e) => Err(e),
    }
}

fn commit(
    target: &Target,
    data: &[u8],
    old: Option<Owner>,
    create_only: bool,
    what: &str,
) -> Result<Result<(), Refusal>, AgentError> {
    let tmp = stage(target, data, old, what)?;
    place(&tmp, target, create_only, what)
}

/// A new file in `dir` that nobody else can have opened (O_EXCL, O_NOFOLLOW), created with
/// `mode` less the umask.
fn stage_file(
    dir: &std::os::fd::OwnedFd,
    name: &str,
    mode: u32,
) -> std::io::Result<(OsString, File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let short: String = name.chars().take(40).collect();
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = OsString::from(format!(
            ".{short}.rsb-{}-{}-{nanos:x}.tmp",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        match rfs::openat(
            dir,
            &*tmp,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            crate::sync::beneath::mode(mode),
        ) {
            Ok(f) => return Ok((tmp, File::from(f))),
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Line start offsets of `s` (the first is 0); a final line without `\n` counts.
fn line_starts(s: &[u8]) -> Vec<usize> {
    let mut v = vec![0];
    v.extend(
        s.iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
            .map(|(i, _)| i + 1),
    );
    // No line starts at the end (an empty file has no lines).
    if v.last() == Some(&s.len()) {
        v.pop();
    }
    v
}

/// Index of the line holding byte `pos` (`pos` may be the end).
fn line_of(starts: &[usize], pos: usize) -> usize {
    starts.partition_point(|&s| s <= pos).saturating_sub(1)
}

fn line_text(s: &[u8], starts: &[usize], i: usize) -> String {
    let a = starts[i];
    let b = starts.get(i + 1).copied().unwrap_or(s.len());
    let t = &s[a..b];
    let t = t.strip_suffix(b"\n").unwrap_or(t);
    let t = t.strip_suffix(b"\r").unwrap_or(t);
    String::from_utf8_lossy(t).into_owned()
}

/// A changed region in line indexes: old lines `o0..o0+on` became new lines `n0..n0+nn`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Block {
    o0: usize,
    on: usize,
    n0: usize,
    nn: usize,
}

/// The changed line blocks, given the replaced byte spans of `old` (sorted, disjoint) and the
/// text each became: each span widened to whole lines, neighbours merged, and lines equal at
/// both ends of a block trimmed off.
fn blocks(old: &[u8], new: &[u8], spans: &[(usize, usize, usize)]) -> Vec<Block> {
    let os = line_starts(old);
    let ns = line_starts(new);
    // (old byte range widened to lines, new byte range), merged.
    let mut wide: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut delta: isize = 0;
    for &(a, b, new_len) in spans {
        let la = if os.is_empty() {
            0
        } else {
            os[line_of(&os, a)]
        };
        let lb = if b > a && old[b - 1] == b'\n' {
            b
        } else {
            match old[b..].iter().position(|&c| c == b'\n') {
                Some(i) => b + i + 1,
                None => old.len(),
            }
        };
        let shift = new_len as isize - (b - a) as isize;
        let na = (la as isize + delta) as usize;
        let nb = (lb as isize + delta + shift) as usize;
        delta += shift;
        match wide.last_mut() {
            Some(w) if la <= w.1 => {
                w.1 = lb.max(w.1);
                w.3 = nb.max(w.3);
            }
            _ => wide.push((la, lb, na, nb)),
        }
    }
    let count = |starts: &[usize], a: usize, b: usize| -> (usize, usize) {
        if a >= b {
            return (starts.partition_point(|&s| s < a), 0);
        }
        let first = line_of(starts, a);
        let last = line_of(starts, b - 1);
        (first, last + 1 - first)
    };
    wide.into_iter()
        .map(|(oa, ob, na, nb)| {
            let (mut o0, mut on) = count(&os, oa, ob);
            let (mut n0, mut nn) = count(&ns, na, nb);
            while on > 0 && nn > 0 && line_bytes(old, &os, o0) == line_bytes(new, &ns, n0) {
                o0 += 1;
                n0 += 1;
                on -= 1;
                nn -= 1;
            }
            while on > 0
                && nn > 0
                && line_bytes(old, &os, o0 + on - 1) == line_bytes(new, &ns, n0 + nn - 1)
            {
                on -= 1;
                nn -= 1;
            }
            Block { o0, on, n0, nn }
        })
        .filter(|b| b.on > 0 || b.nn > 0)
        .collect()
}

fn line_bytes<'a>(s: &'a [u8], starts: &[usize], i: usize) -> &'a [u8] {
    let a = starts[i];
    let b = starts.get(i + 1).copied().unwrap_or(s.len());
    &s[a..b]
}

const CONTEXT: usize = 3;

/// The `Changed` fields that describe what changed: new line ranges, and a unified diff with
/// ±3 lines of context, cut after [`MAX_DIFF_LINES`] lines.
fn describe(
    old: &[u8],
    new: &[u8],
    spans: &[(usize, usize, usize)],
) -> (Vec<(u64, u64)>, String, bool) {
    let bl = blocks(old, new, spans);
    let os = line_starts(old);
    let ns = line_starts(new);
    let changed = bl
        .iter()
        .filter(|b| b.nn > 0)
        .map(|b| (b.n0 as u64 + 1, (b.n0 + b.nn) as u64))
        .collect();
    let mut out: Vec<String> = Vec::new();
    let mut truncated = false;
    let mut i = 0;
    while i < bl.len() {
        // One hunk: blocks whose contexts touch.
        let mut j = i;
        while j + 1 < bl.len() && bl[j + 1].o0 <= bl[j].o0 + bl[j].on + 2 * CONTEXT {
            j += 1;
        }
        let start = bl[i].o0.saturating_sub(CONTEXT);
        let end = (bl[j].o0 + bl[j].on + CONTEXT).min(os.len());
        let nstart = bl[i].n0 - (bl[i].o0 - start);
        let nend = bl[j].n0 + bl[j].nn + (end - (bl[j].o0 + bl[j].on));
        let mut lines = vec![format!(
            "@@ -{},{} +{},{} @@",
            if end > start { start + 1 } else { start },
            end - start,
            if nend > nstart { nstart + 1 } else { nstart },
            nend - nstart
        )];
        let mut o = start;
        for b in &bl[i..=j] {
            for k in o..b.o0 {
                lines.push(format!(" {}", line_text(old, &os, k)));
            }
            for k in b.o0..b.o0 + b.on {
                lines.push(format!("-{}", line_text(old, &os, k)));
            }
            for k in b.n0..b.n0 + b.nn {
                lines.push(format!("+{}", line_text(new, &ns, k)));
            }
            o = b.o0 + b.on;
        }
        for k in o..end {
            lines.push(format!(" {}", line_text(old, &os, k)));
        }
        for l in lines {
            if out.len() >= MAX_DIFF_LINES {
                truncated = true;
                break;
            }
            let mut l = l;
            if l.len() > 300 {
                let mut cut = 300;
                while !l.is_char_boundary(cut) {
                    cut -= 1;
                }
                l.truncate(cut);
                l.push('…');
            }
            out.push(l);
        }
        if truncated {
            break;
        }
        i = j + 1;
    }
    let mut diff = out.join("\n");
    if !diff.is_empty() {
        diff.push('\n');
    }
    (changed, diff, truncated)
}

/// Lines most like `old` (a near miss in whitespace, indentation or a character or two),
/// for the hint of an edit whose `old` does not occur.
fn near_lines(text: &str, old: &str) -> Vec<NearLine> {
    let norm = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let want: Vec<String> = old
        .lines()
        .map(norm)
        .filter(|l| !l.is_empty())
        .take(20)
        .collect();
    if want.is_empty() {
        return Vec::new();
    }
    let lines: Vec<&str> = text.lines().collect();
    let normed: Vec<String> = lines.iter().map(|l| norm(l)).collect();
    // Score each start line: how many of `old`'s lines match from there, whitespace aside,
    // plus how alike the first one is.
    let mut scored: Vec<(f64, usize)> = Vec::new();
    for i in 0..lines.len() {
        if normed[i].is_empty() {
            continue;
        }
        let first = similarity(&normed[i], &want[0]);
        let mut s = first;
        let mut k = i + 1;
        for w in &want[1..] {
            while k < lines.len() && normed[k].is_empty() {
                k += 1;
            }
            if k < lines.len() && normed[k] == *w {
                s += 1.0;
            }
            k += 1;
        }
        let s = s / want.len() as f64;
        if s >= 0.5 {
            scored.push((s, i));
        }
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    scored
        .into_iter()
        .take(3)
        .map(|(_, i)| {
            let mut t: String = lines[i].chars().take(200).collect();
            if t.len() < lines[i].len() {
                t.push('…');
            }
            NearLine {
                line: i as u64 + 1,
                text: t,
            }
        })
        .collect()
}

/// Dice coefficient of character bigrams: 1 for equal strings, near 0 for unrelated ones.
fn similarity(a: &str, b: &str) -> f64 {
    if a == b {
        return 1.0;
    }
    let bigrams = |s: &str| -> Vec<(char, char)> {
        let c: Vec<char> = s.chars().collect();
        let mut v: Vec<(char, char)> = c.windows(2).map(|w| (w[0], w[1])).collect();
        v.sort_unstable();
        v
    };
    let (x, y) = (bigrams(a), bigrams(b));
    if x.is_empty() || y.is_empty() {
        return 0.0;
    }
    let (mut i, mut j, mut common) = (0, 0, 0);
    while i < x.len() && j < y.len() {
        match x[i].cmp(&y[j]) {
            std::cmp::Ordering::Equal => {
                common += 1;
                i += 1;
                j += 1;
            }
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
        }
    }
    2.0 * common as f64 / (x.len() + y.len()) as f64
}

/// `old` and `new` in the file's line endings: a CRLF file matched by a caller who wrote `\n`.
fn in_line_endings(text: &str, s: &str) -> String {
    let crlf = text
        .find('\n')
        .is_some_and(|i| i > 0 && text.as_bytes()[i - 1] == b'\r');
    if crlf && s.contains('\n') && !s.contains('\r') {
        s.replace('\n', "\r\n")
    } else {
        s.to_string()
    }
}

pub fn edit(req: &EditRequest) -> Result<EditOutcome, AgentError> {
    own_writes(req.confine.as_ref(), |w| edit_in(req, w))
}

fn edit_in(req: &EditRequest, w: &Writable) -> Result<EditOutcome, AgentError> {
    const WHAT: &str = "edit";
    if req.old.is_empty() || req.old == req.new {
        return Ok(EditOutcome::Refused(Refusal::NoChange));
    }
    let path = expand_home(&req.path);
    let target = resolve_writable(w, &path, FOLLOW, WHAT)?;
    let cur = match lock_current(&target, WHAT)? {
        Ok(Some(c)) => c,
        Ok(None) => {
            return Err(AgentError::new(
                ErrorCode::NotFound,
                format!("{WHAT} {}: no such file or directory", target.shown()),
            ));
        }
        Err(r) => return Ok(EditOutcome::Refused(r)),
    };
    let current = content_hash(&cur.data);
    if req.expected_hash.as_ref().is_some_and(|h| *h != current) {
        return Ok(EditOutcome::Refused(Refusal::Changed {
            current: Some(current),
        }));
    }
    let Ok(text) = std::str::from_utf8(&cur.data) else {
        return Ok(EditOutcome::Refused(Refusal::NotText));
    };
    let old = in_line_endings(text, &req.old);
    let new = in_line_endings(text, &req.new);
    let found: Vec<usize> = text.match_indices(old.as_str()).map(|(i, _)| i).collect();
    match found.len() {
        0 => {
            return Ok(EditOutcome::Refused(Refusal::NoMatch {
                near: near_lines(text, &req.old),
            }));
        }
        1 => {}
        n if !req.replace_all => {
            return Ok(EditOutcome::Refused(Refusal::Ambiguous { count: n as u64 }));
        }
        _ => {}
    }
    let mut out = String::with_capacity(text.len() + found.len() * new.len());
    let mut last = 0;
    let mut spans = Vec::with_capacity(found.len());
    for &i in &found {
        out.push_str(&text[last..i]);
        out.push_str(&new);
        spans.push((i, i + old.len(), new.len()));
        last = i + old.len();
    }
    out.push_str(&text[last..]);
    let in_place = match replace(&target, &cur, out.as_bytes(), WHAT)? {
        Ok(p) => p,
        Err(r) => return Ok(EditOutcome::Refused(r)),
    };
    let (changed_lines, diff, diff_truncated) = describe(&cur.data, out.as_bytes(), &spans);
    Ok(EditOutcome::Done(Changed {
        path: target.shown(),
        hash: content_hash(out.as_bytes()),
        created: false,
        replacements: found.len() as u64,
        changed_lines,
        diff,
        diff_truncated,
        in_place,
    }))
}

pub fn write(req: &WriteRequest) -> Result<EditOutcome, AgentError> {
    own_writes(req.confine.as_ref(), |w| write_in(req, w))
}

fn write_in(req: &WriteRequest, w: &Writable) -> Result<EditOutcome, AgentError> {
    const WHAT: &str = "write";
    let path = expand_home(&req.path);
    if req.data.len() as u64 > MAX_EDIT_BYTES {
        return Ok(EditOutcome::Refused(Refusal::TooLarge {
            size: req.data.len() as u64,
        }));
    }
    let target = resolve_writable(
        w,
        &path,
        Opts {
            follow_last: true,
            make_dirs: req.make_dirs,
        },
        WHAT,
    )
    .map_err(|e| {
        if e.code == ErrorCode::NotFound && !req.make_dirs {
            AgentError::new(
                e.code,
                format!(
                    "{}: pass make_dirs=true to create the missing directories",
                    e.message
                ),
            )
        } else {
            e
        }
    })?;
    let tshown = target.shown();
    // FIFOs, devices, sockets and directories are never replaced by a file.
    let now = target
        .lstat()
        .map_err(|e| AgentError::from_io(&e, WHAT, &tshown))?;
    match now.as_ref().map(file_type) {
        Some(rfs::FileType::Directory) => {
            return Err(AgentError::new(
                ErrorCode::IsADirectory,
                format!("{WHAT} {tshown}: is a directory"),
            ));
        }
        Some(rfs::FileType::RegularFile) | None => {}
        Some(t) => {
            let kind = match t {
                rfs::FileType::Symlink => "symlink",
                rfs::FileType::Fifo => "fifo",
                rfs::FileType::Socket => "socket",
                rfs::FileType::BlockDevice => "blockdevice",
                rfs::FileType::CharacterDevice => "chardevice",
                _ => "other",
            };
            return Err(AgentError::new(
                ErrorCode::InvalidArgument,
                format!("{WHAT} {tshown}: not a regular file ({kind}); refusing to replace it"),
            ));
        }
    }
    let create_only = req.condition == WriteCondition::CreateOnly;
    let cur = if create_only {
        if now.is_some() {
            return Ok(EditOutcome::Refused(Refusal::Exists));
        }
        None
    } else {
        match lock_current(&target, WHAT)? {
            Ok(c) => c,
            // Too large to hash: only an unconditional write may replace it.
            Err(Refusal::TooLarge { .. }) if req.condition == WriteCondition::Any => None,
            Err(r) => return Ok(EditOutcome::Refused(r)),
        }
    };
    if let WriteCondition::Hash(want) = &req.condition {
        let current = cur.as_ref().map(|c| content_hash(&c.data));
        if current.as_ref() != Some(want) {
            return Ok(EditOutcome::Refused(Refusal::Changed { current }));
        }
    }
    let old_meta = match &cur {
        Some(c) => Some(Owner::of(&c.meta)),
        None if !create_only => target.lstat().ok().flatten().map(|st| Owner::of_stat(&st)),
        None => None,
    };
    let done = match &cur {
        Some(c) => replace(&target, c, &req.data, WHAT)?,
        None => commit(&target, &req.data, old_meta, create_only, WHAT)?.map(|()| false),
    };
    let in_place = match done {
        Ok(p) => p,
        Err(r) => return Ok(EditOutcome::Refused(r)),
    };
    Ok(EditOutcome::Done(Changed {
        path: tshown,
        hash: content_hash(&req.data),
        created: old_meta.is_none(),
        replacements: 0,
        changed_lines: Vec::new(),
        diff: String::new(),
        diff_truncated: false,
        in_place,
    }))
}

/// A replaced byte range of the old text and the length of what replaced it.
type Span = (usize, usize, usize);

/// Where `pat` occurs in `lines` at or after `start`: exactly, then ignoring trailing
/// whitespace, then ignoring surrounding whitespace, then with typographic punctuation read
/// as ASCII (Codex's own tolerance, in its order); with `eof`, at the end of the file first.
/// A line's `\r` never counts.
fn seek(lines: &[&str], pat: &[String], start: usize, eof: bool) -> Option<usize> {
    if pat.is_empty() {
        return Some(start);
    }
    if pat.len() > lines.len() {
        return None;
    }
    let last = lines.len() - pat.len();
    let strip = |l: &str| l.strip_suffix('\r').unwrap_or(l).to_string();
    type Norm = fn(&str) -> std::borrow::Cow<'_, str>;
    let modes: [Norm; 4] = [
        |l| l.into(),
        |l| l.trim_end().into(),
        |l| l.trim().into(),
        |l| ascii_punctuation(l.trim()),
    ];
    for norm in modes {
        let at = |i: usize| {
            pat.iter()
                .enumerate()
                .all(|(j, p)| norm(&strip(lines[i + j])) == norm(p))
        };
        if eof && last >= start && at(last) {
            return Some(last);
        }
        if let Some(i) = (start..=last).find(|&i| at(i)) {
            return Some(i);
        }
    }
    None
}

/// Dashes, quotes and odd spaces as their ASCII look-alikes, so a patch written in ASCII finds
/// a line holding `—`, `’` or a non-breaking space (and the other way round).
fn ascii_punctuation(s: &str) -> std::borrow::Cow<'_, str> {
    let map = |c: char| match c {
        '\u{2010}'..='\u{2015}' | '\u{2212}' => '-',
        '\u{2018}'..='\u{201B}' => '\'',
        '\u{201C}'..='\u{201F}' => '"',
        '\u{00A0}' | '\u{2002}'..='\u{200A}' | '\u{202F}' | '\u{205F}' | '\u{3000}' => ' ',
        c => c,
    };
    if s.chars().all(|c| map(c) == c) {
        s.into()
    } else {
        s.chars().map(map).collect::<String>().into()
    }
}

/// The file's new text after every chunk, or the chunk that does not apply and why. Line
/// endings follow the file (CRLF stays CRLF), and so does a missing final newline.
fn apply_chunks(
    text: &str,
    chunks: &[rsb_protocol::PatchChunk],
) -> Result<(String, Vec<Span>), (u64, Refusal)> {
    let crlf = text
        .find('\n')
        .is_some_and(|i| i > 0 && text.as_bytes()[i - 1] == b'\r');
    let mut lines: Vec<&str> = text.split('\n').collect();
    let final_newline = text.ends_with('\n');
    if final_newline || text.is_empty() {
        lines.pop();
    }
    let mut repl: Vec<(usize, usize, &[String])> = Vec::new();
    let mut pos = 0;
    for (i, c) in chunks.iter().enumerate() {
        if let Some(ctx) = &c.context {
            match seek(&lines, std::slice::from_ref(ctx), pos, false) {
                Some(k) => pos = k + 1,
                None => {
                    let near = near_lines(text, ctx);
                    return Err((i as u64, Refusal::NoMatch { near }));
                }
            }
        }
        if c.old.is_empty() {
            repl.push((lines.len(), 0, &c.new));
            continue;
        }
        let mut old: &[String] = &c.old;
        let mut new: &[String] = &c.new;
        let mut found = seek(&lines, old, pos, c.end_of_file);
        // A trailing empty line (the final newline, or a blank line before the next hunk) that
        // the file does not have there: without it, as Codex retries.
        if found.is_none() && old.last().is_some_and(String::is_empty) {
            old = &old[..old.len() - 1];
            if new.last().is_some_and(String::is_empty) {
                new = &new[..new.len() - 1];
            }
            found = seek(&lines, old, pos, c.end_of_file);
        }
        match found {
            Some(k) => {
                repl.push((k, old.len(), new));
                pos = k + old.len();
            }
            None => {
                let near = near_lines(text, &c.old.join("\n"));
                return Err((i as u64, Refusal::NoMatch { near }));
            }
        }
    }
    repl.sort_by_key(|r| r.0);
    if repl.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err((0, Refusal::Ambiguous { count: 2 }));
    }
    // Rebuild, and note each replaced span in bytes of the old text for the diff.
    let eol = if crlf { "\r\n" } else { "\n" };
    let mut starts = Vec::with_capacity(lines.len() + 1);
    let mut off = 0;
    for l in &lines {
        starts.push(off);
        off += l.len() + 1;
    }
    starts.push(text.len());
    let mut out = String::with_capacity(text.len() + 64);
    let mut spans = Vec::new();
    let mut next = 0;
    let push_old = |out: &mut String, a: usize, b: usize| {
        for l in &lines[a..b] {
            out.push_str(l);
            out.push('\n');
        }
    };
    for (k, n, new) in repl {
        push_old(&mut out, next, k);
        let from = out.len();
        for l in new {
            out.push_str(l);
            out.push_str(eol);
        }
        let old_a = starts[k].min(text.len());
        let old_b = starts[(k + n).min(lines.len())].min(text.len());
        spans.push((old_a, old_b.max(old_a), out.len() - from));
        next = k + n;
    }
    push_old(&mut out, next, lines.len());
    if !final_newline && out.ends_with('\n') {
        out.pop();
        if crlf && out.ends_with('\r') && !text.ends_with('\r') {
            out.pop();
        }
    }
    Ok((out, spans))
}

/// One file of a patch, checked and ready to be written.
struct Planned {
    target: Target,
    /// The new content; `None` deletes the file (a symlink itself, never what it points to).
    data: Option<Vec<u8>>,
    old: Option<Locked>,
    /// A moved file's old place, removed once the new one is in place.
    remove: Option<Target>,
    replacements: u64,
    spans: Vec<(usize, usize, usize)>,
    /// Written in place ([`keeps_identity`]): not staged, put back by writing the old content.
    in_place: bool,
}

pub fn patch(req: &rsb_protocol::PatchRequest) -> Result<rsb_protocol::PatchOutcome, AgentError> {
    own_writes(req.confine.as_ref(), |w| patch_in(req, w))
}

fn patch_in(
    req: &rsb_protocol::PatchRequest,
    w: &Writable,
) -> Result<rsb_protocol::PatchOutcome, AgentError> {
    use rsb_protocol::{PatchOp, PatchOutcome};
    const WHAT: &str = "apply_patch";
    let refused = |path: &str, hunk: u64, refusal: Refusal| {
        Ok(PatchOutcome::Refused {
            path: path.to_string(),
            hunk,
            refusal,
        })
    };
    // Check every file and hunk, holding each file's lock, before anything is written.
    let mut plan: Vec<Planned> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // Directories made for an Add or a Move to (as Codex makes them): removed again unless
    // the patch goes through.
    let mut made = MadeDirs(Vec::new());
    for f in &req.files {
        let path = expand_home(&f.path);
        // A Delete removes what the path names: a symlink itself, never its target.
        let delete = matches!(f.op, PatchOp::Delete);
        let mut target = resolve_writable(
            w,
            &path,
            Opts {
                follow_last: !delete,
                make_dirs: matches!(f.op, PatchOp::Add { .. }),
            },
            WHAT,
        )?;
        made.0.append(&mut target.made);
        if !seen.insert(target.path.clone()) {
            return Err(AgentError::new(
                ErrorCode::InvalidArgument,
                format!("{WHAT}: {} appears twice in the patch", f.path),
            ));
        }
        let is_link = delete
            && target
                .lstat()
                .map_err(|e| AgentError::from_io(&e, WHAT, &target.shown()))?
                .is_some_and(|st| file_type(&st) == rfs::FileType::Symlink);
        let cur = if is_link {
            None
        } else {
            match lock_current(&target, WHAT)? {
                Ok(c) => c,
                Err(r) => return refused(&f.path, 0, r),
            }
        };
        let tshown = target.shown();
        let missing = || {
            AgentError::new(
                ErrorCode::NotFound,
                format!("{WHAT} {tshown}: no such file or directory"),
            )
        };
        match &f.op {
            PatchOp::Add { text } => plan.push(Planned {
                in_place: cur.as_ref().is_some_and(keeps_identity),
                target,
                data: Some(text.as_bytes().to_vec()),
                old: cur,
                remove: None,
                replacements: 0,
                spans: Vec::new(),
            }),
            PatchOp::Delete => {
                if cur.is_none() && !is_link {
                    return Err(missing());
                }
                plan.push(Planned {
                    target,
                    data: None,
                    old: cur,
                    remove: None,
                    replacements: 0,
                    spans: Vec::new(),
                    in_place: false,
                });
            }
            PatchOp::Update { move_to, chunks } => {
                let Some(cur) = cur else {
                    return Err(missing());
                };
                let Ok(text) = std::str::from_utf8(&cur.data) else {
                    return refused(&f.path, 0, Refusal::NotText);
                };
                let (new, spans) = match apply_chunks(text, chunks) {
                    Ok(r) => r,
                    Err((hunk, r)) => return refused(&f.path, hunk, r),
                };
                let (dest, remove) = match move_to {
                    Some(m) => {
                        let mut dest = resolve_writable(
                            w,
                            &expand_home(m),
                            Opts {
                                follow_last: true,
                                make_dirs: true,
                            },
                            WHAT,
                        )?;
                        made.0.append(&mut dest.made);
                        if !seen.insert(dest.path.clone()) {
                            return Err(AgentError::new(
                                ErrorCode::InvalidArgument,
                                format!("{WHAT}: {m} appears twice in the patch"),
                            ));
                        }
                        (dest, Some(target))
                    }
                    None => (target, None),
                };
                let in_place = remove.is_none() && keeps_identity(&cur);
                plan.push(Planned {
                    target: dest,
                    data: Some(new.into_bytes()),
                    old: Some(cur),
                    remove,
                    replacements: chunks.len() as u64,
                    spans,
                    in_place,
                });
            }
        }
    }
    // Every name that is replaced or removed can be: its directory lets this user unlink it
    // (writable, and a sticky one only for the file's or the directory's owner). Checked
    // before the first write, so a patch that cannot finish does not start.
    for p in &plan {
        if p.old.is_some() || p.data.is_none() {
            may_unlink(&p.target, WHAT)?;
        }
        if let Some(src) = &p.remove {
            may_unlink(src, WHAT)?;
        }
    }
    // Stage every new content, and keep every file that is replaced: a hard link to it (or,
    // where the file system refuses one, a copy of what was read) beside it. A failure
    // removes what was staged and kept, and nothing has changed.
    let mut staged: Vec<Option<OsString>> = Vec::new();
    let mut kept: Vec<Option<OsString>> = Vec::new();
    for p in &plan {
        let Some(data) = p.data.as_ref().filter(|_| !p.in_place) else {
            staged.push(None);
            kept.push(None);
            continue;
        };
        let tmp = match stage(
            &p.target,
            data,
            p.old.as_ref().map(|o| Owner::of(&o.meta)),
            WHAT,
        ) {
            Ok(t) => t,
            Err(e) => return Err(rollback(e, Vec::new(), &plan, &staged, &kept, 0)),
        };
        staged.push(Some(tmp));
        let exists = p.target.lstat().map(|st| st.is_some());
        // A moved file's destination may hold another file: kept too (no copy of it was read).
        let copy = if p.remove.is_none() {
            p.old.as_ref()
        } else {
            None
        };
        let k = match exists {
            Ok(false) => Ok(None),
            Ok(true) => keep(&p.target, copy, WHAT).map(Some),
            Err(e) => Err(AgentError::from_io(&e, WHAT, &p.target.shown())),
        };
        match k {
            Ok(k) => kept.push(k),
            Err(e) => return Err(rollback(e, Vec::new(), &plan, &staged, &kept, 0)),
        }
    }
    // Put each in place; a step that fails undoes the ones before it, newest first.
    let mut undo: Vec<Undo<'_>> = Vec::new();
    for (i, p) in plan.iter().enumerate() {
        if let (true, Some(data), Some(old)) = (p.in_place, &p.data, &p.old) {
            let (dev, ino) = (old.meta.dev(), old.meta.ino());
            if let Err(e) = write_in_place(&p.target, dev, ino, data, WHAT) {
                // Partly written, maybe: put the old content back first.
                let _ = write_in_place(&p.target, dev, ino, &old.data, WHAT);
                return Err(rollback(e, undo, &plan, &staged, &kept, i));
            }
            undo.push(Undo::Rewrite(&p.target, dev, ino, &old.data));
        }
        if let Some(tmp) = &staged[i] {
            if let Err(e) = rfs::renameat(&p.target.dir, &**tmp, &p.target.dir, &*p.target.name) {
                let e = AgentError::from_io(&e.into(), WHAT, &p.target.shown());
                return Err(rollback(e, undo, &plan, &staged, &kept, i));
            }
            undo.push(match &kept[i] {
                Some(k) => Undo::Put(&p.target, k.clone()),
                None => Undo::Remove(&p.target),
            });
        }
        // A delete, or a moved file's old place: renamed aside, removed once all is in place.
        let gone = match (&p.data, &p.remove) {
            (None, _) => Some(&p.target),
            (Some(_), Some(src)) => Some(src),
            _ => None,
        };
        if let Some(t) = gone {
            #[cfg(test)]
            if tests::FAIL_HIDE.with(|f| f.get()) == Some(i) {
                let e = AgentError::new(ErrorCode::Io, format!("{WHAT} {}: injected", t.shown()));
                return Err(rollback(e, undo, &plan, &staged, &kept, i + 1));
            }
            match hide(t) {
                Ok(aside) => undo.push(Undo::Put(t, aside)),
                Err(e) => {
                    let e = AgentError::from_io(&e.into(), WHAT, &t.shown());
                    return Err(rollback(e, undo, &plan, &staged, &kept, i + 1));
                }
            }
        }
    }
    // Done: every changed directory's entries on disk (the new files were flushed when staged),
    // then what was kept aside goes.
    for p in &plan {
        let _ = rfs::fsync(&p.target.dir);
        if let Some(src) = &p.remove {
            let _ = rfs::fsync(&src.dir);
        }
    }
    for u in &undo {
        if let Undo::Put(t, aside) = u {
            let _ = rfs::unlinkat(&t.dir, &**aside, AtFlags::empty());
        }
    }
    made.0.clear();
    let mut changed = Vec::new();
    for p in &plan {
        match &p.data {
            Some(data) => {
                let before = p.old.as_ref().map(|o| &o.data[..]).unwrap_or(b"");
                let (changed_lines, diff, diff_truncated) = if p.spans.is_empty() {
                    (Vec::new(), String::new(), false)
                } else {
                    describe(before, data, &p.spans)
                };
                changed.push(Changed {
                    path: p.target.shown(),
                    hash: content_hash(data),
                    created: p.old.is_none() || p.remove.is_some(),
                    replacements: p.replacements,
                    changed_lines,
                    diff,
                    diff_truncated,
                    in_place: p.in_place,
                });
            }
            None => changed.push(Changed {
                path: p.target.shown(),
                hash: String::new(),
                created: false,
                replacements: 0,
                changed_lines: Vec::new(),
                diff: String::new(),
                diff_truncated: false,
                in_place: false,
            }),
        }
    }
    Ok(PatchOutcome::Done(changed))
}

/// Directories a patch made, removed (if still empty) unless it went through.
struct MadeDirs(Vec<std::path::PathBuf>);

impl Drop for MadeDirs {
    fn drop(&mut self) {
        for d in self.0.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// How to take back one step of a patch: put a kept file back under the target's name, or
/// remove a file the patch created.
enum Undo<'a> {
    Put(&'a Target, OsString),
    Remove(&'a Target),
    /// A file written in place (its device and inode), and its old content.
    Rewrite(&'a Target, u64, u64, &'a [u8]),
}

/// Undo `undo` newest first after `e`; remove what was staged and kept for the steps from
/// `from` on (not yet in `undo`). The error says whether every file is as it was.
fn rollback(
    mut e: AgentError,
    undo: Vec<Undo<'_>>,
    plan: &[Planned],
    staged: &[Option<OsString>],
    kept: &[Option<OsString>],
    from: usize,
) -> AgentError {
    for (i, p) in plan.iter().enumerate().skip(from) {
        for t in [staged.get(i), kept.get(i)].into_iter().flatten().flatten() {
            let _ = rfs::unlinkat(&p.target.dir, &**t, AtFlags::empty());
        }
    }
    let mut stuck = Vec::new();
    for u in undo.into_iter().rev() {
        let ok = match &u {
            Undo::Put(t, aside) => rfs::renameat(&t.dir, &**aside, &t.dir, &*t.name).is_ok(),
            Undo::Remove(t) => rfs::unlinkat(&t.dir, &*t.name, AtFlags::empty()).is_ok(),
            Undo::Rewrite(t, dev, ino, old) => write_in_place(t, *dev, *ino, old, "").is_ok(),
        };
        if !ok {
            stuck.push(match u {
                Undo::Put(t, _) | Undo::Remove(t) | Undo::Rewrite(t, ..) => t.shown(),
            });
        }
    }
    if stuck.is_empty() {
        e.message = format!("{}; no file was changed", e.message);
    } else {
        e.message = format!(
            "{}; and these could not be put back as they were: {}",
            e.message,
            stuck.join(", ")
        );
    }
    e
}

/// May this user unlink (or rename over) `t`'s name? Its directory must be writable and
/// searchable, and in a sticky directory the file or the directory must be the user's.
fn may_unlink(t: &Target, what: &str) -> Result<(), AgentError> {
    let denied = || {
        AgentError::new(
            ErrorCode::PermissionDenied,
            format!(
                "{what} {}: permission denied (its directory does not let this user replace or \
                 remove it); no file was changed",
                t.shown()
            ),
        )
    };
    let euid = rustix::process::geteuid();
    if euid.is_root() {
        return Ok(());
    }
    rfs::accessat(
        &t.dir,
        ".",
        rfs::Access::WRITE_OK | rfs::Access::EXEC_OK,
        AtFlags::EACCESS,
    )
    .map_err(|_| denied())?;
    let dir = rfs::fstat(&t.dir).map_err(|e| AgentError::from_io(&e.into(), what, &t.shown()))?;
    if dir.st_mode & 0o1000 != 0 && dir.st_uid != euid.as_raw() {
        let mine = t
            .lstat()
            .map_err(|e| AgentError::from_io(&e, what, &t.shown()))?
            .is_none_or(|st| st.st_uid == euid.as_raw());
        if !mine {
            return Err(denied());
        }
    }
    Ok(())
}

/// A free name beside `t` for a file kept aside: `.NAME.rsb-PID-N-NANOS.kept`.
fn aside_name(t: &Target, n: u32) -> OsString {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let short: String = t.name.to_string_lossy().chars().take(40).collect();
    OsString::from(format!(
        ".{short}.rsb-{}-{n}-{nanos:x}.kept",
        std::process::id()
    ))
}

/// Keep the file `t` names, to be put back if the patch cannot finish: a hard link (the same
/// file, links and attributes and all), else a copy of `read` (what was read of it).
fn keep(t: &Target, read: Option<&Locked>, what: &str) -> Result<OsString, AgentError> {
    for n in 0..100 {
        let name = aside_name(t, n);
        match rfs::linkat(&t.dir, &*t.name, &t.dir, &*name, AtFlags::empty()) {
            Ok(()) => return Ok(name),
            Err(Errno::EXIST) => continue,
            Err(_) => break,
        }
    }
    match read {
        Some(old) => stage(t, &old.data, Some(Owner::of(&old.meta)), what),
        None => Err(AgentError::new(
            ErrorCode::Io,
            format!(
                "{what} {}: cannot keep the file there aside to put it back if the patch fails \
                 (no hard link here); no file was changed",
                t.shown()
            ),
        )),
    }
}

/// Rename `t` aside (a delete, a moved file's old place) until the patch is through.
fn hide(t: &Target) -> Result<OsString, Errno> {
    for n in 0..100 {
        let name = aside_name(t, n);
        match rfs::statat(&t.dir, &*name, AtFlags::SYMLINK_NOFOLLOW) {
            Err(Errno::NOENT) => {}
            _ => continue,
        }
        return rfs::renameat(&t.dir, &*t.name, &t.dir, &*name).map(|()| name);
    }
    Err(Errno::EXIST)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans_of(old: &str, pat: &str, new: &str) -> (String, Vec<(usize, usize, usize)>) {
        let mut out = String::new();
        let mut last = 0;
        let mut spans = vec![];
        for (i, _) in old.match_indices(pat) {
            out.push_str(&old[last..i]);
            out.push_str(new);
            spans.push((i, i + pat.len(), new.len()));
            last = i + pat.len();
        }
        out.push_str(&old[last..]);
        (out, spans)
    }

    #[test]
    fn diff_names_the_changed_lines_with_context() {
        let old: String = (1..=20).map(|i| format!("line {i}\n")).collect();
        let (new, spans) = spans_of(&old, "line 10\n", "ten\nTEN\n");
        let (changed, diff, cut) = describe(old.as_bytes(), new.as_bytes(), &spans);
        assert_eq!(changed, vec![(10, 11)]);
        assert!(!cut);
        assert_eq!(
            diff,
            "@@ -7,7 +7,8 @@\n line 7\n line 8\n line 9\n-line 10\n+ten\n+TEN\n line 11\n line 12\n line 13\n"
        );
        // A deletion of a whole line, and an edit inside a line.
        let (new, spans) = spans_of(&old, "line 1\n", "");
        let (changed, diff, _) = describe(old.as_bytes(), new.as_bytes(), &spans);
        assert!(changed.is_empty(), "{changed:?}");
        assert!(
            diff.starts_with("@@ -1,4 +1,3 @@\n-line 1\n line 2\n"),
            "{diff}"
        );
        let (new, spans) = spans_of("a b c\n", "b", "B");
        let (changed, diff, _) = describe(b"a b c\n", new.as_bytes(), &spans);
        assert_eq!(changed, vec![(1, 1)]);
        assert_eq!(diff, "@@ -1,1 +1,1 @@\n-a b c\n+a B c\n");
    }

    #[test]
    fn many_replacements_cap_the_diff() {
        let old: String = (0..500).map(|i| format!("x{i}\n\n\n\n\n\n\n\n")).collect();
        let (new, spans) = spans_of(&old, "x", "y");
        let (changed, diff, cut) = describe(old.as_bytes(), new.as_bytes(), &spans);
        assert_eq!(changed.len(), 500);
        assert!(cut);
        assert_eq!(diff.lines().count(), MAX_DIFF_LINES);
    }

    #[test]
    fn take_lines_keeps_whole_lines_within_the_cap() {
        let t = b"a\nbb\nccc\ndddd";
        let r =
            |first, count, max| take_lines(&mut &t[..], LineRange { first, count }, max).unwrap();
        assert_eq!(r(1, 0, 100), (t.to_vec(), 4, false));
        assert_eq!(r(2, 2, 100), (b"bb\nccc\n".to_vec(), 2, true));
        assert_eq!(r(4, 0, 100), (b"dddd".to_vec(), 1, false));
        assert_eq!(r(9, 0, 100), (vec![], 0, false));
        assert_eq!(r(1, 0, 5), (b"a\nbb\n".to_vec(), 2, true));
        assert_eq!(r(3, 1, 2), (b"cc".to_vec(), 0, true));
    }

    fn chunk(ctx: Option<&str>, old: &[&str], new: &[&str]) -> rsb_protocol::PatchChunk {
        rsb_protocol::PatchChunk {
            context: ctx.map(str::to_string),
            old: old.iter().map(|s| s.to_string()).collect(),
            new: new.iter().map(|s| s.to_string()).collect(),
            end_of_file: false,
        }
    }

    #[test]
    fn chunks_apply_in_order_keeping_line_endings() {
        let text = "fn a() {\n    x\n}\nfn b() {\n    x\n}\n";
        let (out, _) =
            apply_chunks(text, &[chunk(Some("fn b() {"), &["    x"], &["    y"])]).unwrap();
        assert_eq!(out, "fn a() {\n    x\n}\nfn b() {\n    y\n}\n");
        let (out, _) = apply_chunks("a\r\nb\r\nc", &[chunk(None, &["b"], &["B", "B2"])]).unwrap();
        assert_eq!(out, "a\r\nB\r\nB2\r\nc");
        // Trailing whitespace is tolerated, as in Codex.
        let (out, _) = apply_chunks("a  \nb\n", &[chunk(None, &["a", "b"], &["c"])]).unwrap();
        assert_eq!(out, "c\n");
        let e = apply_chunks(
            "a\n",
            &[chunk(None, &["a"], &["b"]), chunk(None, &["zz"], &[])],
        );
        assert!(matches!(e, Err((1, Refusal::NoMatch { .. }))), "{e:?}");
        let (out, _) = apply_chunks("a\n", &[chunk(None, &[], &["tail"])]).unwrap();
        assert_eq!(out, "a\ntail\n");
    }

    thread_local! {
        /// The step whose renaming aside fails (a test's injected fault), by plan index.
        pub(super) static FAIL_HIDE: std::cell::Cell<Option<usize>> =
            const { std::cell::Cell::new(None) };
    }

    #[test]
    fn codex_tolerance_unicode_punctuation_and_the_trailing_empty_line() {
        // A patch in ASCII finds a line with typographic dashes, quotes and spaces.
        let text = "let s = \u{201C}hi\u{201D} \u{2014} it\u{2019}s\u{00A0}x;\nz\n";
        let (out, _) = apply_chunks(
            text,
            &[chunk(None, &["let s = \"hi\" - it's x;"], &["let s = 1;"])],
        )
        .unwrap();
        assert_eq!(out, "let s = 1;\nz\n");
        // A hunk ending in an empty line the file does not have there: retried without it.
        let (out, _) = apply_chunks("a\nb\n", &[chunk(None, &["b", ""], &["c", ""])]).unwrap();
        assert_eq!(out, "a\nc\n");
        let mut eof = chunk(None, &["b", ""], &["c"]);
        eof.end_of_file = true;
        let (out, _) = apply_chunks("a\nb", &[eof]).unwrap();
        assert_eq!(out, "a\nc");
    }

    fn files_in(d: &std::path::Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// The last of three operations fails after the first two are in place: both are undone
    /// (the replaced file is the same file again, the added file and its new directory gone,
    /// a moved file back where it was), and nothing is left beside them.
    #[test]
    fn a_patch_that_fails_midway_puts_every_file_back() {
        use rsb_protocol::{PatchFile, PatchOp, PatchOutcome, PatchRequest};
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::write(d.join("a.txt"), "one\ntwo\n").unwrap();
        std::fs::hard_link(d.join("a.txt"), d.join("a-link.txt")).unwrap();
        std::fs::write(d.join("m.txt"), "move me\n").unwrap();
        std::fs::write(d.join("gone.txt"), "stays\n").unwrap();
        let ino = |p: &str| std::fs::metadata(d.join(p)).unwrap().ino();
        let a_ino = ino("a.txt");
        let before = files_in(d);
        let path = |p: &str| d.join(p).display().to_string();
        let req = PatchRequest {
            files: vec![
                PatchFile {
                    path: path("a.txt"),
                    op: PatchOp::Update {
                        move_to: None,
                        chunks: vec![chunk(None, &["two"], &["TWO"])],
                    },
                },
                PatchFile {
                    path: path("new/deeper/b.txt"),
                    op: PatchOp::Add { text: "b\n".into() },
                },
                PatchFile {
                    path: path("m.txt"),
                    op: PatchOp::Update {
                        move_to: Some(path("moved/m.txt")),
                        chunks: vec![chunk(None, &["move me"], &["moved"])],
                    },
                },
                PatchFile {
                    path: path("gone.txt"),
                    op: PatchOp::Delete,
                },
            ],
            confine: None,
        };
        FAIL_HIDE.with(|f| f.set(Some(3)));
        let e = match patch(&req) {
            Err(e) => e,
            Ok(o) => panic!("{o:?}"),
        };
        FAIL_HIDE.with(|f| f.set(None));
        assert!(e.message.ends_with("no file was changed"), "{}", e.message);
        assert_eq!(
            std::fs::read_to_string(d.join("a.txt")).unwrap(),
            "one\ntwo\n"
        );
        assert_eq!(ino("a.txt"), a_ino, "the same file, not a copy");
        assert_eq!(std::fs::metadata(d.join("a.txt")).unwrap().nlink(), 2);
        assert_eq!(
            std::fs::read_to_string(d.join("m.txt")).unwrap(),
            "move me\n"
        );
        assert!(d.join("gone.txt").exists());
        assert_eq!(files_in(d), before, "nothing added, nothing left aside");

        // The same patch goes through when nothing fails: parents made, the link kept.
        let o = patch(&req).unwrap();
        assert!(
            matches!(o, PatchOutcome::Done(ref f) if f.len() == 4),
            "{o:?}"
        );
        assert_eq!(
            std::fs::read_to_string(d.join("a.txt")).unwrap(),
            "one\nTWO\n"
        );
        assert_eq!(
            std::fs::read_to_string(d.join("new/deeper/b.txt")).unwrap(),
            "b\n"
        );
        assert_eq!(
            std::fs::read_to_string(d.join("moved/m.txt")).unwrap(),
            "moved\n"
        );
        assert!(!d.join("m.txt").exists() && !d.join("gone.txt").exists());
        let mut want = vec!["a-link.txt", "a.txt", "moved", "new"];
        want.sort();
        assert_eq!(files_in(d), want, "nothing left aside");
    }

    fn edit_file(path: &std::path::Path, old: &str, new: &str) -> Changed {
        let req = EditRequest {
            path: path.display().to_string(),
            old: old.into(),
            new: new.into(),
            replace_all: false,
            expected_hash: None,
            confine: None,
        };
        match edit(&req).unwrap() {
            EditOutcome::Done(c) => c,
            o => panic!("{o:?}"),
        }
    }

    /// A file with other hard links or extended attributes keeps them: written in place. A
    /// plain file is replaced by a rename, and staged files a killed agent left are removed.
    #[test]
    fn edits_keep_a_files_identity_and_clear_what_a_crash_left() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        // Hard links: both names see the change, the link count stays.
        std::fs::write(d.join("a.txt"), "one\n").unwrap();
        std::fs::hard_link(d.join("a.txt"), d.join("b.txt")).unwrap();
        let ino = std::fs::metadata(d.join("a.txt")).unwrap().ino();
        let c = edit_file(&d.join("a.txt"), "one", "ONE");
        assert!(c.in_place, "{c:?}");
        assert_eq!(std::fs::read_to_string(d.join("b.txt")).unwrap(), "ONE\n");
        let m = std::fs::metadata(d.join("a.txt")).unwrap();
        assert_eq!((m.nlink(), m.ino()), (2, ino));
        // An extended attribute survives (where the file system has them).
        std::fs::write(d.join("x.txt"), "one\n").unwrap();
        let x = d.join("x.txt");
        if rfs::setxattr(&x, "user.rsb", b"kept", rfs::XattrFlags::empty()).is_ok() {
            let c = edit_file(&x, "one", "two");
            assert!(c.in_place, "{c:?}");
            let mut buf = [0u8; 16];
            let n = rfs::getxattr(&x, "user.rsb", &mut buf[..]).unwrap();
            assert_eq!(&buf[..n], b"kept");
            assert_eq!(std::fs::read_to_string(d.join("x.txt")).unwrap(), "two\n");
        }
        // A plain file: replaced; what a killed agent staged beside it (its pid gone) is
        // removed, a live process's is not.
        std::fs::write(d.join("p.txt"), "one\n").unwrap();
        let dead = (400_000..4_000_000)
            .step_by(7919)
            .find(|p| unsafe { libc::kill(*p, 0) } != 0)
            .unwrap();
        let stale = d.join(format!(".p.txt.rsb-{dead}-0-1f.tmp"));
        let live = d.join(format!(".p.txt.rsb-{}-9-1f.kept", std::process::id()));
        std::fs::write(&stale, "a whole staged copy\n").unwrap();
        std::fs::write(&live, "another edit's\n").unwrap();
        let c = edit_file(&d.join("p.txt"), "one", "two");
        assert!(!c.in_place, "{c:?}");
        assert!(!stale.exists(), "a crash's leftover is removed");
        assert!(live.exists(), "a live process's file is not");
        assert_eq!(std::fs::read_to_string(d.join("p.txt")).unwrap(), "two\n");
    }

    #[test]
    fn near_lines_find_an_indentation_slip() {
        let text = "fn main() {\n    let x = 1;\n    println!(\"{x}\");\n}\n";
        let near = near_lines(text, "let  x = 1;\nprintln!(\"{x}\");");
        assert_eq!(near[0].line, 2, "{near:?}");
        assert_eq!(near[0].text, "    let x = 1;");
        assert!(near_lines(text, "zzzz qqqq").is_empty());
    }
}
