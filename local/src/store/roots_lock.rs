//! One sync at a time per pair of roots, across every process on the state dir (the MCP
//! server, a background transfer worker, `rsb sync`, `--watch`).
//!
//! Each sync loads the pair's baseline when it starts and saves it when it ends. Two syncs
//! that overlap would each save their own view, and the last to finish wins even when it is
//! the older: a file the other one committed is then recorded at its old hash, and the next
//! edit of it reads as a conflict. Holding this lock from the baseline's load to its save
//! makes the saves follow the commits.
//!
//! The lock is an advisory file lock (`File::try_lock`, flock on Unix) on
//! `sync-locks/<hash of the key>.lock`: the kernel drops it however its holder dies, so a
//! crashed worker never leaves the roots locked. The file holds the holder's pid and role for
//! the message a waiting sync shows. Pruning removes a file only while holding its lock, and
//! a taker checks that the file it locked is still the one at the path, so a lock taken on a
//! just-pruned file is never held beside one taken on its replacement.

use std::{
    fs::{File, TryLockError},
    io::{Read, Seek, Write},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use crate::{
    error::{Kind, Result, RsbError},
    store::{baselines::Key, ensure_private_dir},
};

pub const DIR: &str = "sync-locks";

/// The held lock; released when dropped (or when the process dies).
#[derive(Debug)]
pub struct RootsLock {
    _file: File,
}

/// What an attempt found.
#[derive(Debug)]
pub enum Attempt {
    Held(RootsLock),
    /// Another sync holds it: who, as its lock file says ("pid 123, rsb mcp").
    Busy(String),
}

fn lock_err(path: &Path, e: std::io::Error) -> RsbError {
    RsbError::new(
        Kind::Config,
        format!(
            "cannot lock the sync of these roots ({}): {e}",
            path.display()
        ),
        "check free space and permissions of the rsb state dir (RSB_STATE_DIR)",
    )
}

fn lock_path(state_dir: &Path, key: &Key) -> PathBuf {
    let mut h = blake3::Hasher::new();
    for part in [&key.0, &key.1, &key.2] {
        h.update(part.as_bytes());
        h.update(&[0]);
    }
    let hex = h.finalize().to_hex();
    state_dir.join(DIR).join(format!("{}.lock", &hex[..32]))
}

/// A lock file of the state dir: created 0600, never truncated on open (its holder's text
/// stays readable), and never through a symlink (the state dir's files are ours).
pub fn open_lock_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// The same inode as the path names now (not one that pruning unlinked after we opened it).
fn still_at(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Who this process is, for a waiting sync's message: its pid and the words after the
/// binary's name that say its role (`mcp`, `sync`, `transfer run`).
fn holder_text() -> String {
    let role: Vec<String> = std::env::args().skip(1).take(2).collect();
    let role = role
        .iter()
        .take_while(|a| !a.starts_with('-') && a.len() <= 16)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(" ");
    if role.is_empty() {
        format!("pid {}", std::process::id())
    } else {
        format!("pid {}, rsb {role}", std::process::id())
    }
}

fn read_holder(f: &mut File) -> String {
    let mut buf = Vec::new();
    let _ = f.rewind();
    let _ = Read::by_ref(f).take(128).read_to_end(&mut buf);
    let s: String = String::from_utf8_lossy(&buf)
        .chars()
        .filter(|c| !c.is_control())
        .collect();
    if s.trim().is_empty() {
        "another process".into()
    } else {
        s.trim().to_string()
    }
}

/// Take the lock of `key`'s roots if it is free; never waits.
pub fn try_lock(state_dir: &Path, key: &Key) -> Result<Attempt> {
    let path = lock_path(state_dir, key);
    let err = |e| lock_err(&path, e);
    ensure_private_dir(path.parent().expect("a lock path has a parent")).map_err(err)?;
    // A file pruned between our open and our lock is retried on the new one; pruning is
    // rare (once an hour, on files idle for months), so a few tries always settle.
    for _ in 0..8 {
        let mut f = open_lock_file(&path).map_err(err)?;
        match f.try_lock() {
            Ok(()) => {
                if !still_at(&f, &path) {
                    continue;
                }
                f.set_len(0).map_err(err)?;
                f.rewind().map_err(err)?;
                f.write_all(holder_text().as_bytes()).map_err(err)?;
                return Ok(Attempt::Held(RootsLock { _file: f }));
            }
            Err(TryLockError::WouldBlock) => return Ok(Attempt::Busy(read_holder(&mut f))),
            Err(TryLockError::Error(e)) => return Err(err(e)),
        }
    }
    Ok(Attempt::Busy("a process pruning the state dir".into()))
}

/// Remove lock files not used for `days` before `now` (Unix seconds), each only while holding
/// its lock; how many.
pub fn prune(state_dir: &Path, days: i64, now: i64) -> u64 {
    let Ok(rd) = std::fs::read_dir(state_dir.join(DIR)) else {
        return 0;
    };
    let cut = now - days.max(0) * 86_400;
    let mut n = 0;
    for e in rd.flatten() {
        let path = e.path();
        let idle = e
            .metadata()
            .is_ok_and(|m| m.is_file() && super::clock::modified_before(&m, cut));
        if !idle || path.extension().is_none_or(|x| x != "lock") {
            continue;
        }
        let Ok(f) = open_lock_file(&path) else {
            continue;
        };
        if f.try_lock().is_ok() && still_at(&f, &path) && std::fs::remove_file(&path).is_ok() {
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> Key {
        (format!("/src/{n}"), "gpu".into(), "~/dst".into())
    }

    #[test]
    fn a_pair_of_roots_is_held_once_and_freed_with_its_holder() {
        let d = tempfile::tempdir().unwrap();
        let Attempt::Held(held) = try_lock(d.path(), &key("a")).unwrap() else {
            panic!("a free lock is taken");
        };
        match try_lock(d.path(), &key("a")).unwrap() {
            Attempt::Busy(who) => assert!(
                who.starts_with(&format!("pid {}", std::process::id())),
                "{who}"
            ),
            Attempt::Held(_) => panic!("a held lock was taken twice"),
        }
        // Another pair is independent.
        assert!(matches!(
            try_lock(d.path(), &key("b")).unwrap(),
            Attempt::Held(_)
        ));
        drop(held);
        assert!(matches!(
            try_lock(d.path(), &key("a")).unwrap(),
            Attempt::Held(_)
        ));
    }

    #[test]
    fn pruning_never_removes_a_held_lock_and_a_pruned_file_is_not_held_twice() {
        let d = tempfile::tempdir().unwrap();
        let Attempt::Held(held) = try_lock(d.path(), &key("a")).unwrap() else {
            panic!()
        };
        // Idle for "0 days" (a second on) is everything; a held lock still stays.
        let later = crate::store::now_s() + 1;
        assert_eq!(prune(d.path(), 0, later), 0);
        drop(held);
        assert_eq!(prune(d.path(), 0, later), 1);
        assert_eq!(
            std::fs::read_dir(d.path().join(DIR)).unwrap().count(),
            0,
            "the idle lock file is gone"
        );
        // A file unlinked under an open descriptor: a lock taken on it is not the lock.
        let path = lock_path(d.path(), &key("c"));
        let stale = open_lock_file(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        stale.try_lock().unwrap();
        assert!(!still_at(&stale, &path));
        let Attempt::Held(_fresh) = try_lock(d.path(), &key("c")).unwrap() else {
            panic!("the path's new file is free")
        };
    }

    #[test]
    fn a_lock_file_replaced_by_a_symlink_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let path = lock_path(d.path(), &key("a"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &path).unwrap();
        assert!(try_lock(d.path(), &key("a")).is_err());
        assert!(!d.path().join("elsewhere").exists());
    }
}
