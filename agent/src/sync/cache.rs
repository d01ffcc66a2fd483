//! Per-root blake3 cache, keyed by inode identity: (dev, inode, size, mtime_ns, ctime_ns).
//!
//! A write to a file changes its ctime (which no one can set), so an unchanged key means
//! unchanged content, with one hole: two changes within one timestamp tick share a ctime. An
//! entry is therefore only stored when the file's ctime is strictly older than the clock read
//! *before* its content was read ([`Key::settled`]): any later change then carries a later
//! ctime. A file changed moments before the scan is hashed again next time, which is cheap.
//!
//! File: `$RSB_CACHE_DIR/hashcache/<16 hex of blake3(root)>`, else
//! `$HOME/.cache/rsb/hashcache/…`. Format: magic, count, fixed 72-byte records, blake3 of all
//! that. Written to a temporary name and renamed; anything unreadable is ignored and rebuilt.

use std::collections::HashMap;
use std::fs::{self, Metadata};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::util::hash_cache_dir;

const MAGIC: &[u8; 8] = b"RSBHC\x01\0\0";
const RECORD: usize = 8 * 5 + 32;
const HEADER: usize = 16;
const TRAILER: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl Key {
    pub fn of_meta(m: &crate::fs::Meta) -> Key {
        Key {
            dev: m.dev,
            ino: m.ino,
            size: m.size,
            mtime_ns: m.mtime_ns,
            ctime_ns: m.ctime_ns,
        }
    }

    pub fn of(m: &Metadata) -> Key {
        Key::of_meta(&crate::fs::Meta::of(m))
    }

    /// Whether a hash read after `clock_ns` (see [`super::fs_clock_ns`]) can be cached under
    /// this key. File systems with whole-second timestamps (no nanoseconds at all) get a
    /// two-second margin.
    pub fn settled(&self, clock_ns: i64) -> bool {
        self.settles_at() < clock_ns
    }

    /// The clock reading past which [`Key::settled`] holds.
    pub fn settles_at(&self) -> i64 {
        let coarse = self.ctime_ns % 1_000_000_000 == 0 && self.mtime_ns % 1_000_000_000 == 0;
        let margin = if coarse { 2_000_000_000 } else { 0 };
        self.ctime_ns.saturating_add(margin)
    }
}

/// The cache file of one root: the root made absolute and, when it exists, canonical, so that
/// `~/p`, `/home/u/p` and a path through a symlink share one cache.
pub fn cache_file(root: &Path) -> Option<PathBuf> {
    let canonical = fs::canonicalize(root).unwrap_or_else(|_| super::absolute(root));
    let digest = blake3::hash(canonical.as_os_str().as_bytes());
    Some(hash_cache_dir()?.join(&digest.to_hex()[..16]))
}

/// Keys are inode numbers, sizes and times: a multiply-rotate hash is plenty and several
/// times cheaper than SipHash over 2,000 lookups a scan. Seeded per process, so that a tree
/// crafted to collide on one host does not collide on another.
#[derive(Clone, Copy)]
pub struct KeyHasher(u64);

impl Default for KeyHasher {
    fn default() -> Self {
        static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        KeyHasher(*SEED.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(0x5eed);
            h.finish() | 1
        }))
    }
}

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(23) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_i64(&mut self, n: i64) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        // Mix the high bits down: hashbrown takes its bucket from the low bits.
        self.0 ^ (self.0 >> 29)
    }
}

impl std::hash::BuildHasher for KeyHasher {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        *self
    }
}

type Map<V> = HashMap<Key, V, KeyHasher>;

pub struct HashCache {
    file: Option<PathBuf>,
    /// What the file held, each with whether this scan saw it.
    old: Map<([u8; 32], bool)>,
    seen: usize,
    /// Hashes computed in this scan.
    new: Map<[u8; 32]>,
}

impl HashCache {
    pub fn disabled() -> HashCache {
        HashCache {
            file: None,
            old: Map::default(),
            seen: 0,
            new: Map::default(),
        }
    }

    pub fn load(root: &Path) -> HashCache {
        let file = cache_file(root);
        let old = file
            .as_deref()
            .map(read_file)
            .unwrap_or_default()
            .into_iter()
            .map(|(k, h)| (k, (h, false)))
            .collect();
        HashCache {
            file,
            old,
            seen: 0,
            new: Map::default(),
        }
    }

    pub fn get(&mut self, key: &Key) -> Option<[u8; 32]> {
        if let Some(h) = self.new.get(key) {
            return Some(*h);
        }
        let (hash, seen) = self.old.get_mut(key)?;
        if !*seen {
            *seen = true;
            self.seen += 1;
        }
        Some(*hash)
    }

    pub fn insert(&mut self, key: Key, hash: [u8; 32]) {
        self.new.insert(key, hash);
    }

    /// Write back the entries seen in this scan (entries of files that are gone, or excluded
    /// this time, drop out). Nothing is written when nothing changed.
    pub fn save(self) {
        let Some(file) = self.file else { return };
        if self.new.is_empty() && self.seen == self.old.len() {
            return;
        }
        let mut map = self.new;
        map.extend(
            self.old
                .into_iter()
                .filter(|(_, (_, seen))| *seen)
                .map(|(k, (h, _))| (k, h)),
        );
        write_file(&file, &map);
    }
}

/// Add entries to a root's cache, keeping what it holds (used after files were received).
pub fn record(root: &Path, entries: &[(Key, [u8; 32])]) {
    if entries.is_empty() {
        return;
    }
    let Some(file) = cache_file(root) else { return };
    let mut map = read_file(&file);
    map.extend(entries.iter().copied());
    write_file(&file, &map);
}

fn read_file(path: &Path) -> Map<[u8; 32]> {
    let Ok(buf) = fs::read(path) else {
        return Map::default();
    };
    parse(&buf).unwrap_or_default()
}

fn parse(buf: &[u8]) -> Option<Map<[u8; 32]>> {
    if buf.len() < HEADER + TRAILER || &buf[..8] != MAGIC {
        return None;
    }
    let count = u64::from_le_bytes(buf[8..16].try_into().ok()?) as usize;
    let body_end = HEADER.checked_add(count.checked_mul(RECORD)?)?;
    if buf.len() != body_end.checked_add(TRAILER)? {
        return None;
    }
    if blake3::hash(&buf[..body_end]).as_bytes() != &buf[body_end..] {
        return None;
    }
    let u = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap());
    let mut map = Map::with_capacity_and_hasher(count, KeyHasher::default());
    for rec in buf[HEADER..body_end].chunks_exact(RECORD) {
        let key = Key {
            dev: u(&rec[0..8]),
            ino: u(&rec[8..16]),
            size: u(&rec[16..24]),
            mtime_ns: u(&rec[24..32]) as i64,
            ctime_ns: u(&rec[32..40]) as i64,
        };
        map.insert(key, rec[40..72].try_into().unwrap());
    }
    Some(map)
}

fn serialize(map: &Map<[u8; 32]>) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER + map.len() * RECORD + TRAILER);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&(map.len() as u64).to_le_bytes());
    for (k, h) in map {
        buf.extend_from_slice(&k.dev.to_le_bytes());
        buf.extend_from_slice(&k.ino.to_le_bytes());
        buf.extend_from_slice(&k.size.to_le_bytes());
        buf.extend_from_slice(&k.mtime_ns.to_le_bytes());
        buf.extend_from_slice(&k.ctime_ns.to_le_bytes());
        buf.extend_from_slice(h);
    }
    let sum = blake3::hash(&buf);
    buf.extend_from_slice(sum.as_bytes());
    buf
}

/// Best effort: a cache that cannot be written only costs hashing next time.
fn write_file(path: &Path, map: &Map<[u8; 32]>) {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let Some(dir) = path.parent() else { return };
    if fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .is_err()
    {
        return;
    }
    let tmp = dir.join(format!(
        ".tmp-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let ok = fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(&serialize(map)))
        .and_then(|()| fs::rename(&tmp, path));
    if ok.is_err() {
        let _ = fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> Key {
        Key {
            dev: 1,
            ino: i,
            size: i * 10,
            mtime_ns: -5,
            ctime_ns: 1_700_000_000_123_456_789,
        }
    }

    #[test]
    fn roundtrip_and_corruption() {
        let mut map = Map::default();
        for i in 0..100 {
            map.insert(key(i), [i as u8; 32]);
        }
        let buf = serialize(&map);
        assert_eq!(parse(&buf).unwrap(), map);
        let mut bad = buf.clone();
        bad[HEADER + 5] ^= 1;
        assert!(parse(&bad).is_none());
        assert!(parse(&buf[..buf.len() - 1]).is_none());
        assert!(parse(b"garbage").is_none());
        let mut huge = buf.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse(&huge).is_none());
    }

    #[test]
    fn settled_needs_a_ctime_before_the_clock() {
        let k = key(1);
        assert!(k.settled(k.ctime_ns + 1));
        assert!(!k.settled(k.ctime_ns));
        let whole = Key {
            ctime_ns: 1_700_000_000_000_000_000,
            mtime_ns: 1_700_000_000_000_000_000,
            ..k
        };
        assert!(!whole.settled(whole.ctime_ns + 1_000_000_000));
        assert!(whole.settled(whole.ctime_ns + 3_000_000_000));
    }
}
