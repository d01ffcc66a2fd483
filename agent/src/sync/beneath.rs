//! The directories under a sync root, reached one component at a time from the root's
//! descriptor with `O_NOFOLLOW` and held open, so that every change of an apply session is an
//! `*at` call relative to a directory it checked.
//!
//! A destination may be shared: another local user who can write it can swap a directory
//! for a symlink between a check by path and the write by path, and redirect writes, chmods
//! and deletes outside the root (issue 21 measured 507–759 of 3,000 files landing in the
//! attacker's directory, and 1,605–1,704 files outside the root deleted). Held descriptors
//! close that window: a component that is a symlink when it is opened is refused, and once
//! open, a directory stays the one that was checked, wherever its name later points.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use rustix::io::Errno;

/// Flags of a held directory. On Linux `O_PATH`: it needs no read permission (a `d-wx`
/// directory of the user's is still usable) and serves every `*at` call.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) const DIR_FLAGS: OFlags = OFlags::PATH
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(crate) const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// Why a directory under the root could not be held.
#[derive(Debug)]
pub enum Refused {
    /// This component (relative to the root) does not exist.
    Missing(String),
    /// This component (relative to the root) is a symlink.
    Link(String),
    /// This component exists and is not a directory.
    NotDir(String),
    /// Any other failure opening this component.
    Io(String, std::io::Error),
}

/// The held directories of one root, by their path relative to it (`""` is the root).
pub struct Beneath {
    held: HashMap<String, Arc<OwnedFd>>,
}

/// `rel`'s parent and last component (`("", rel)` at the top).
pub fn split(rel: &str) -> (&str, &str) {
    rel.rsplit_once('/').unwrap_or(("", rel))
}

impl Beneath {
    pub fn new(root: &OwnedFd) -> std::io::Result<Beneath> {
        let mut held = HashMap::new();
        held.insert(String::new(), Arc::new(root.try_clone()?));
        Ok(Beneath { held })
    }

    /// The held directory `rel`, opened component by component without following a link.
    pub fn dir(&mut self, rel: &str) -> Result<Arc<OwnedFd>, Refused> {
        if let Some(fd) = self.held.get(rel) {
            return Ok(fd.clone());
        }
        let (parent, name) = split(rel);
        let p = self.dir(parent)?;
        match rfs::openat(&*p, name, DIR_FLAGS, Mode::empty()) {
            Ok(fd) => {
                let fd = Arc::new(fd);
                self.held.insert(rel.to_string(), fd.clone());
                Ok(fd)
            }
            Err(Errno::NOENT) => Err(Refused::Missing(rel.to_string())),
            Err(e @ (Errno::LOOP | Errno::NOTDIR | Errno::MLINK)) => {
                match rfs::statat(&*p, name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st)
                        if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Symlink =>
                    {
                        Err(Refused::Link(rel.to_string()))
                    }
                    Ok(st)
                        if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::Directory =>
                    {
                        Err(Refused::NotDir(rel.to_string()))
                    }
                    _ => Err(Refused::Io(rel.to_string(), e.into())),
                }
            }
            Err(e) => Err(Refused::Io(rel.to_string(), e.into())),
        }
    }

    /// The parent directory of `rel`, held, and `rel`'s last component.
    pub fn parent<'r>(&mut self, rel: &'r str) -> Result<(Arc<OwnedFd>, &'r str), Refused> {
        let (parent, name) = split(rel);
        Ok((self.dir(parent)?, name))
    }

    /// Forget `rel` and everything held below it (it was deleted or replaced).
    pub fn forget(&mut self, rel: &str) {
        let below = format!("{rel}/");
        self.held
            .retain(|k, _| k.is_empty() || (k != rel && !k.starts_with(&below)));
    }
}

/// `lstat` of `name` in `dir`; `Ok(None)` when it does not exist.
pub fn lstat_at(dir: &OwnedFd, name: &str) -> std::io::Result<Option<rfs::Stat>> {
    match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// `Mode` of permission bits (`mode_t` is narrower than `u32` on macOS).
#[allow(clippy::unnecessary_cast)]
pub fn mode(bits: u32) -> Mode {
    Mode::from_raw_mode((bits & 0o7777) as rfs::RawMode)
}

/// The permission bits (`st_mode` is narrower than `u32` on some targets).
#[allow(clippy::unnecessary_cast)]
pub fn perm(st: &rfs::Stat) -> u32 {
    st.st_mode as u32 & 0o7777
}

pub fn file_type(st: &rfs::Stat) -> rfs::FileType {
    rfs::FileType::from_raw_mode(st.st_mode)
}

/// `chmod` of the inode `fd` refers to, which may be an `O_PATH` descriptor: those refuse
/// `fchmod`, and go through `/proc/self/fd`, which names that inode and never a path.
pub fn chmod_fd(fd: &OwnedFd, mode: u32) -> std::io::Result<()> {
    let mode = self::mode(mode);
    match rfs::fchmod(fd, mode) {
        Err(Errno::BADF) if cfg!(any(target_os = "linux", target_os = "android")) => {
            rfs::chmod(format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd()), mode)
                .map_err(Into::into)
        }
        r => r.map_err(Into::into),
    }
}

/// `chmod` of `name` in `dir`, never through a symlink: a link put at `name` after it was
/// checked is not followed out of the root.
pub fn chmod_at(dir: &OwnedFd, name: &str, mode: u32) -> std::io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let fd = rfs::openat(
            dir,
            name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        if file_type(&rfs::fstat(&fd)?) == rfs::FileType::Symlink {
            return Err(std::io::Error::other(
                "it became a symlink; its mode was not changed",
            ));
        }
        chmod_fd(&fd, mode)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        rfs::chmodat(dir, name, self::mode(mode), AtFlags::SYMLINK_NOFOLLOW).map_err(Into::into)
    }
}

/// Set the mtime of `name` in `dir` (not of a link's target).
pub fn mtime_at(dir: &OwnedFd, name: &str, mtime_ns: i64) -> std::io::Result<()> {
    rfs::utimensat(dir, name, &times(mtime_ns), AtFlags::SYMLINK_NOFOLLOW).map_err(Into::into)
}

/// Set the mtime of what `fd` is open on (not an `O_PATH` descriptor: a file, the root).
pub fn mtime_fd(fd: impl AsFd, mtime_ns: i64) -> std::io::Result<()> {
    rfs::futimens(fd, &times(mtime_ns)).map_err(Into::into)
}

fn times(mtime_ns: i64) -> rfs::Timestamps {
    rfs::Timestamps {
        last_access: rfs::Timespec {
            tv_sec: 0,
            tv_nsec: rfs::UTIME_OMIT,
        },
        last_modification: rfs::Timespec {
            tv_sec: mtime_ns.div_euclid(1_000_000_000),
            tv_nsec: mtime_ns.rem_euclid(1_000_000_000) as _,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn root(p: &std::path::Path) -> OwnedFd {
        rfs::open(
            p,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    #[test]
    fn a_symlinked_component_is_refused_and_a_held_one_stays_put() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path().join("root");
        let outside = t.path().join("outside");
        std::fs::create_dir_all(r.join("a/b")).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, r.join("link")).unwrap();
        std::fs::write(r.join("file"), "x").unwrap();
        let mut b = Beneath::new(&root(&r)).unwrap();
        assert!(matches!(b.dir("link"), Err(Refused::Link(p)) if p == "link"));
        assert!(matches!(b.dir("link/x"), Err(Refused::Link(p)) if p == "link"));
        assert!(matches!(b.dir("file/x"), Err(Refused::NotDir(p)) if p == "file"));
        assert!(matches!(b.dir("nope/x"), Err(Refused::Missing(p)) if p == "nope"));
        // Held, then swapped for a link: writes still go to the directory that was checked.
        let held = b.dir("a/b").unwrap();
        std::fs::rename(r.join("a"), r.join("a.real")).unwrap();
        std::os::unix::fs::symlink(&outside, r.join("a")).unwrap();
        rfs::mkdirat(&*held, "new", Mode::from_raw_mode(0o755)).unwrap();
        assert!(r.join("a.real/b/new").is_dir());
        assert!(!outside.join("b").exists());
        // Forgotten, it is opened afresh, and refused.
        b.forget("a");
        assert!(matches!(b.dir("a/b"), Err(Refused::Link(p)) if p == "a"));
    }

    #[test]
    fn chmod_and_mtime_never_follow_a_link() {
        let t = tempfile::tempdir().unwrap();
        let target = t.path().join("target");
        std::fs::write(&target, "x").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&target, t.path().join("l")).unwrap();
        std::fs::write(t.path().join("f"), "y").unwrap();
        let d = root(t.path());
        assert!(chmod_at(&d, "l", 0o777).is_err());
        assert_eq!(
            std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            0o600
        );
        chmod_at(&d, "f", 0o640).unwrap();
        assert_eq!(
            std::fs::metadata(t.path().join("f"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o640
        );
        mtime_at(&d, "f", 1_000_000_000_123).unwrap();
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(t.path().join("f")).unwrap();
        assert_eq!((m.mtime(), m.mtime_nsec()), (1000, 123));
        // An O_PATH-held directory can be chmodded (through /proc/self/fd on Linux).
        std::fs::create_dir(t.path().join("dd")).unwrap();
        let mut b = Beneath::new(&d).unwrap();
        let dd = b.dir("dd").unwrap();
        chmod_fd(&dd, 0o711).unwrap();
        assert_eq!(
            std::fs::metadata(t.path().join("dd"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o711
        );
    }
}
