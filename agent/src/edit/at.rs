//! Where a code tool's change lands: the file's parent directory, reached one component at a
//! time and held open, and the file's name in it. Every later step (open, lock, stage, link,
//! rename, unlink) is an `*at` call relative to that descriptor, as sync's apply sessions are
//! ([`crate::sync::beneath`]).
//!
//! Hosts are shared. A co-tenant who can write a directory on the path can swap a component
//! for a symlink between a check by path and a write by path: issue 50 measured an edit of a
//! shared `sub/notes.txt` replacing the user's private `notes.txt` elsewhere on the first try,
//! and a planted `/tmp/notes.txt -> ~/.ssh/authorized_keys` being written through. So:
//! - once a directory is open, a swap of its name changes nothing: the change goes where the
//!   file was read;
//! - a symlink on the way (or at the end, where it is followed) is followed only where the
//!   kernel's `fs.protected_symlinks` would let the user follow it, extended to every
//!   directory others can write: in a sticky or world-writable directory, only a link owned by
//!   the user or by the directory's owner. Anything else is refused in one line naming the
//!   link and its owner.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rsb_protocol::{AgentError, ErrorCode};
use rustix::fs::{self as rfs, AtFlags, Mode};
use rustix::io::Errno;

use crate::sync::beneath::{DIR_FLAGS, file_type};
use crate::util::path_string;

/// Links followed in one resolution before it is called a loop (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// A file's place: its parent directory, held, and its name there.
pub struct Target {
    pub dir: OwnedFd,
    /// One component, never `.` or `..`.
    pub name: OsString,
    /// The path as resolved (links followed), for replies and errors.
    pub path: PathBuf,
    /// Directories [`resolve`] created on the way (`make_dirs`), outermost first: what a
    /// change that does not go ahead removes again.
    pub made: Vec<PathBuf>,
}

impl Target {
    pub fn shown(&self) -> String {
        path_string(&self.path)
    }

    /// `lstat` of the name; `None` when nothing is there.
    pub fn lstat(&self) -> std::io::Result<Option<rfs::Stat>> {
        match rfs::statat(&self.dir, &*self.name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// How [`resolve`] treats the last component and missing directories.
#[derive(Clone, Copy)]
pub struct Opts {
    /// Follow a symlink at the last component (where safe); else the link itself is the
    /// target (a delete removes the link, never what it points to).
    pub follow_last: bool,
    /// Create missing directories on the way (mode 0777 less the umask).
    pub make_dirs: bool,
}

fn err(code: ErrorCode, msg: String) -> AgentError {
    AgentError::new(code, msg)
}

/// The components of `p` still to walk, `.` dropped.
fn parts(p: &Path) -> VecDeque<OsString> {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            _ => None,
        })
        .collect()
}

fn open_dir(at: &OwnedFd, name: &OsStr) -> rustix::io::Result<OwnedFd> {
    rfs::openat(at, name, DIR_FLAGS, Mode::empty())
}

fn start(p: &Path) -> rustix::io::Result<(OwnedFd, PathBuf)> {
    if p.is_absolute() {
        Ok((
            rfs::open("/", DIR_FLAGS, Mode::empty())?,
            PathBuf::from("/"),
        ))
    } else {
        Ok((rfs::open(".", DIR_FLAGS, Mode::empty())?, PathBuf::new()))
    }
}

/// May the user follow the link `name` (stat `link`) in `dir`? Not when the directory is
/// sticky or world-writable and the link is owned by neither the user nor the directory's
/// owner: such a link is someone else's, planted where they may write.
fn check_link(
    dir: &OwnedFd,
    link: &rfs::Stat,
    at: &Path,
    what: &str,
    shown: &str,
) -> Result<(), AgentError> {
    let d =
        rfs::fstat(dir).map_err(|e| AgentError::from_io(&std::io::Error::from(e), what, shown))?;
    #[allow(clippy::unnecessary_cast)]
    let m = d.st_mode as u32;
    let open_to_others = m & 0o002 != 0 || m & 0o1000 != 0;
    let me = rustix::process::geteuid().as_raw();
    if !open_to_others || link.st_uid == me || link.st_uid == d.st_uid {
        return Ok(());
    }
    Err(err(
        ErrorCode::PermissionDenied,
        format!(
            "{what} {shown}: refusing to follow the symlink {} (owned by uid {}, in a directory \
             others can write): name the file it points to instead",
            path_string(at),
            link.st_uid
        ),
    ))
}

/// Read the link `name` in `dir` whose `lstat` was `st`, checking that it is still that link
/// afterwards (a co-tenant swapping it between the check and the read is refused).
fn read_link(
    dir: &OwnedFd,
    name: &OsStr,
    st: &rfs::Stat,
    what: &str,
    shown: &str,
) -> Result<PathBuf, AgentError> {
    let io = |e: Errno| AgentError::from_io(&std::io::Error::from(e), what, shown);
    let t = rfs::readlinkat(dir, name, Vec::new()).map_err(io)?;
    let again = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(io)?;
    if (again.st_dev, again.st_ino, again.st_uid) != (st.st_dev, st.st_ino, st.st_uid) {
        return Err(err(
            ErrorCode::Io,
            format!("{what} {shown}: a symlink on the path changed while it was read"),
        ));
    }
    Ok(PathBuf::from(OsStr::from_bytes(t.as_bytes())))
}

/// `path`'s parent directory, held, and its last name. See the module's rules.
pub fn resolve(path: &Path, opts: Opts, what: &str) -> Result<Target, AgentError> {
    let shown = path_string(path);
    // Errors name the path as given, as every code tool's do.
    let io = |e: std::io::Error, _at: &Path| AgentError::from_io(&e, what, &shown);
    let (mut dir, mut at) = start(path).map_err(|e| io(e.into(), path))?;
    let mut todo = parts(path);
    let mut links = 0usize;
    let mut made = Vec::new();
    loop {
        let Some(c) = todo.pop_front() else {
            return Err(err(
                ErrorCode::IsADirectory,
                format!("{what} {shown}: is a directory"),
            ));
        };
        let last = todo.is_empty();
        if c == ".." {
            dir = open_dir(&dir, OsStr::new("..")).map_err(|e| io(e.into(), &at))?;
            if at.as_os_str().is_empty() || at.ends_with("..") {
                at.push("..");
            } else if at != Path::new("/") {
                at.pop();
            }
            continue;
        }
        let here = at.join(&c);
        let mut follow = |st: &rfs::Stat,
                          dir: &mut OwnedFd,
                          at: &mut PathBuf,
                          todo: &mut VecDeque<OsString>|
         -> Result<(), AgentError> {
            check_link(dir, st, &here, what, &shown)?;
            links += 1;
            if links > MAX_LINKS {
                return Err(err(
                    ErrorCode::InvalidArgument,
                    format!("{what} {shown}: too many levels of symbolic links"),
                ));
            }
            let t = read_link(dir, &c, st, what, &shown)?;
            for p in parts(&t).into_iter().rev() {
                todo.push_front(p);
            }
            if t.is_absolute() {
                let (d, a) = start(&t).map_err(|e| io(e.into(), &t))?;
                *dir = d;
                *at = a;
            }
            Ok(())
        };
        if last {
            let st = match rfs::statat(&dir, &*c, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => Some(st),
                Err(Errno::NOENT) => None,
                Err(e) => return Err(io(e.into(), &here)),
            };
            match st {
                Some(st) if opts.follow_last && file_type(&st) == rfs::FileType::Symlink => {
                    follow(&st, &mut dir, &mut at, &mut todo)?;
                    continue;
                }
                _ => {
                    return Ok(Target {
                        dir,
                        name: c,
                        path: here,
                        made,
                    });
                }
            }
        }
        match open_dir(&dir, &c) {
            Ok(fd) => {
                dir = fd;
                at = here;
            }
            Err(Errno::NOENT) if opts.make_dirs => {
                match rfs::mkdirat(&dir, &*c, Mode::from_raw_mode(0o777)) {
                    Ok(()) => made.push(here.clone()),
                    Err(Errno::EXIST) => {}
                    Err(e) => return Err(io(e.into(), &here)),
                }
                // Opened, not assumed: whatever is there now is checked as any component.
                todo.push_front(c);
            }
            Err(e @ (Errno::LOOP | Errno::NOTDIR | Errno::MLINK)) => {
                let st = rfs::statat(&dir, &*c, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|e| io(e.into(), &here))?;
                if file_type(&st) != rfs::FileType::Symlink {
                    return Err(io(e.into(), &here));
                }
                follow(&st, &mut dir, &mut at, &mut todo)?;
            }
            Err(e) => return Err(io(e.into(), &here)),
        }
    }
}
