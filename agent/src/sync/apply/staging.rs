//! Staging housekeeping: stale staging dirs of dead syncs, and the kept bytes of interrupted
//! large files (`PARTIAL_DIR`) that a later sync resumes from.

use super::*;

pub(super) fn try_lock(f: &File) -> bool {
    // SAFETY: the fd is open for the duration of the call.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Remove the staging directories of dead syncs: those whose lock file nobody holds.
pub(crate) fn clean_stale(root: &Path) -> u32 {
    let Ok(dir) = fs::read_dir(root) else {
        return 0;
    };
    let mut cleaned = 0;
    for entry in dir.flatten() {
        if !entry
            .file_name()
            .as_bytes()
            .starts_with(STAGING_PREFIX.as_bytes())
        {
            continue;
        }
        let path = entry.path();
        if entry.file_name().as_bytes() == PARTIAL_DIR.as_bytes() {
            // Not a session's staging: kept bytes of interrupted files, pruned by age and size.
            if let Ok(root_fd) = rfs::open(
                root,
                OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
            ) && let Some(dir) = partial_dir(&root_fd, false)
            {
                prune_partial(&root_fd, &dir);
            }
            continue;
        }
        let Ok(meta) = fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        let stale = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path.join(LOCK_NAME))
        {
            // Locked by us while it is removed, so no one else takes it meanwhile.
            Ok(lock) => {
                try_lock(&lock) && {
                    salvage(root, &path);
                    fs::remove_dir_all(&path).is_ok()
                }
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let old = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > UNLOCKED_GRACE);
                old && fs::remove_dir_all(&path).is_ok()
            }
            Err(_) => false,
        };
        if stale {
            cleaned += 1;
        }
    }
    cleaned
}

/// Keep the received bytes of large files from the staging directory of a sync that died
/// without cleaning up (a killed agent, a cut link that outlived the shutdown wait), as an
/// aborted session would have. Only a staging directory that is ours and closed to others, and
/// only files that are ours with a single link.
#[allow(clippy::unnecessary_cast)]
pub(super) fn salvage(root: &Path, staging: &Path) {
    let me = rustix::process::geteuid().as_raw();
    let Ok(sfd) = rfs::open(
        staging,
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    match rfs::fstat(&sfd) {
        Ok(st) if st.st_uid == me && st.st_mode & 0o077 == 0 => {}
        _ => return,
    }
    let Ok(root_fd) = rfs::open(
        root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    let Ok(list) = rfs::Dir::read_from(&sfd) else {
        return;
    };
    let mut dir = None;
    for e in list.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(hash) = name
            .strip_prefix('f')
            .and_then(|r| r.split_once('-'))
            .map(|(_, h)| h.to_string())
            .filter(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        else {
            continue;
        };
        let keep = rfs::statat(&sfd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW).is_ok_and(|st| {
            rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile
                && st.st_uid == me
                && st.st_nlink == 1
                && st.st_size as u64 >= PARTIAL_MIN
        });
        if !keep {
            continue;
        }
        if dir.is_none() {
            dir = partial_dir(&root_fd, true);
        }
        let Some(d) = &dir else { return };
        let _ = rfs::renameat(&sfd, name.as_str(), d, hash.as_str());
    }
    if let Some(d) = &dir {
        prune_partial(&root_fd, d);
    }
}

/// The kept bytes of `rel`, by a name that no path can collide with or escape through.
pub(super) fn partial_name(rel: &str) -> String {
    let h = blake3::hash(rel.as_bytes());
    h.to_hex()[..32].to_string()
}

pub(super) fn partial_age(st: &rfs::Stat) -> Option<Duration> {
    let mtime = SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(st.st_mtime).ok()?);
    Some(mtime.elapsed().unwrap_or(Duration::ZERO))
}

/// [`PARTIAL_DIR`] of the root, (created and) opened without following links, and used only
/// when it is ours and closed to everyone else.
pub(super) fn partial_dir(root_fd: &OwnedFd, create: bool) -> Option<OwnedFd> {
    if create {
        let _ = rfs::mkdirat(root_fd, PARTIAL_DIR, Mode::from_raw_mode(0o700));
    }
    let fd = rfs::openat(
        root_fd,
        PARTIAL_DIR,
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let st = rfs::fstat(&fd).ok()?;
    (st.st_uid == rustix::process::geteuid().as_raw() && st.st_mode & 0o077 == 0).then_some(fd)
}

/// Remove kept files past their age, then the oldest beyond the count and size caps; the
/// directory itself goes when nothing is left in it.
pub(super) fn prune_partial(root_fd: &OwnedFd, dir: &OwnedFd) {
    let Ok(list) = rfs::Dir::read_from(dir) else {
        return;
    };
    let mut kept = Vec::new();
    for e in list.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "." || name == ".." {
            continue;
        }
        let Ok(st) = rfs::statat(dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) else {
            continue;
        };
        match partial_age(&st) {
            Some(age) if age <= PARTIAL_MAX_AGE => kept.push((age, st.st_size as u64, name)),
            _ => {
                let _ = rfs::unlinkat(dir, name.as_str(), AtFlags::empty());
            }
        }
    }
    kept.sort();
    let mut total = 0u64;
    let mut left = 0usize;
    for (i, (_, size, name)) in kept.iter().enumerate() {
        total += size;
        if i >= PARTIAL_FILES || total > PARTIAL_CAP {
            let _ = rfs::unlinkat(dir, name.as_str(), AtFlags::empty());
        } else {
            left += 1;
        }
    }
    if left == 0 {
        let _ = rfs::unlinkat(root_fd, PARTIAL_DIR, AtFlags::REMOVEDIR);
    }
}
