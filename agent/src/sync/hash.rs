//! Hashing the files of a scan: blake3 over each file on a scoped pool of threads, the file's
//! identity taken before and after so a file changed while read is hashed again, never
//! returned torn.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_util::sync::CancellationToken;

use super::cache::Key;
use super::{fs_clock_ns, mode_of};

/// Read buffer per hashing thread; large enough for blake3's widest SIMD.
const HASH_BUF: usize = 512 * 1024;
/// Attempts at hashing a file that keeps changing under the reader.
const HASH_ATTEMPTS: usize = 3;

/// Threads for hashing: the CPUs, at most 8 (past that the disk is the limit). Shared by the
/// scan, block hashes and the apply side's verification.
pub(crate) fn hash_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 8)
    })
}

pub(super) struct Hashed {
    pub hash: [u8; 32],
    /// The open file's identity before it was read (equal to the one after).
    pub key: Key,
    pub mode: u32,
    /// Safe to cache (see [`Key::settled`]).
    pub settled: bool,
}

/// Hash files on up to [`hash_threads`] threads; results in input order.
pub(super) fn hash_files(
    paths: &[&Path],
    cancel: &CancellationToken,
) -> Vec<std::io::Result<Hashed>> {
    let workers = hash_threads().min(paths.len());
    if workers <= 1 {
        let mut buf = vec![0u8; HASH_BUF];
        return paths
            .iter()
            .map(|p| hash_one(p, cancel, &mut buf))
            .collect();
    }
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<std::io::Result<Hashed>>> = Vec::new();
    results.resize_with(paths.len(), || None);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut buf = vec![0u8; HASH_BUF];
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= paths.len() || cancel.is_cancelled() {
                            break;
                        }
                        done.push((i, hash_one(paths[i], cancel, &mut buf)));
                    }
                    done
                })
            })
            .collect();
        for h in handles {
            // A panicking worker aborts the process (panic=abort) in the release build.
            for (i, r) in h.join().unwrap_or_default() {
                results[i] = Some(r);
            }
        }
    });
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(std::io::Error::other("not hashed (cancelled)"))))
        .collect()
}

fn hash_one(path: &Path, cancel: &CancellationToken, buf: &mut [u8]) -> std::io::Result<Hashed> {
    for _ in 0..HASH_ATTEMPTS {
        // Read before the content is: see `Key::settled`.
        let clock = fs_clock_ns();
        // O_NONBLOCK: a file swapped for a FIFO since the lstat must not hang the scan.
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
            .open(path)?;
        let before = file.metadata()?;
        if !before.is_file() {
            return Err(std::io::Error::other("no longer a regular file"));
        }
        let mut hasher = blake3::Hasher::new();
        let mut total = 0u64;
        loop {
            let n = match file.read(buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            hasher.update(&buf[..n]);
            total += n as u64;
            if cancel.is_cancelled() {
                return Err(std::io::Error::other("cancelled"));
            }
        }
        let after = file.metadata()?;
        let key = Key::of(&before);
        if key == Key::of(&after) && total == key.size {
            return Ok(Hashed {
                hash: *hasher.finalize().as_bytes(),
                key,
                mode: mode_of(&before),
                settled: key.settled(clock),
            });
        }
    }
    Err(std::io::Error::other(format!(
        "changed while being hashed ({HASH_ATTEMPTS} attempts); not hashed"
    )))
}
