//! The manifests this process last received, so that the next scan of the same root can name
//! them ([`ManifestRequest::expect`](rsb_protocol::ManifestRequest)) and an agent whose walk
//! finds exactly those sends none: a no-change resync then moves one small reply per side
//! instead of every entry of the tree (about 180 KB for 2,000 files), which is most of its
//! cost on a slow link and a good part of it on loopback.
//!
//! Safe by construction: the digest is computed here over the entries held, and the agent
//! computes it over the entries it would send, so an `unchanged` answer means byte-equal
//! entries; a stale or evicted copy only costs a full manifest.

use std::{collections::VecDeque, sync::Arc};

use bytes::Bytes;
use parking_lot::Mutex;
use rsb_protocol::{ManifestEntry, codec::ManifestDigest};

/// Manifests larger than this are not kept (the walk's own cost dominates them anyway).
const MAX_ENTRIES: usize = 100_000;
/// All manifests kept, together; the least recently used go first.
const TOTAL_ENTRIES: usize = 250_000;

/// Which agent, which root (as requested) and which rules (encoded).
pub type Key = (String, String, Bytes);

struct Held {
    key: Key,
    digest: [u8; 32],
    entries: Arc<Vec<ManifestEntry>>,
}

static HELD: std::sync::LazyLock<Mutex<VecDeque<Held>>> =
    std::sync::LazyLock::new(Default::default);

/// The digest and entries held for `key`, now the most recently used.
pub fn get(key: &Key) -> Option<([u8; 32], Arc<Vec<ManifestEntry>>)> {
    let mut all = HELD.lock();
    let i = all.iter().position(|h| h.key == *key)?;
    let h = all.remove(i)?;
    let found = (h.digest, h.entries.clone());
    all.push_back(h);
    Some(found)
}

/// Keep `entries` as `key`'s manifest (replacing what was held for it).
pub fn put(key: Key, entries: Vec<ManifestEntry>) {
    let mut all = HELD.lock();
    all.retain(|h| h.key != key);
    if entries.len() > MAX_ENTRIES {
        return;
    }
    let digest = ManifestDigest::of(&entries);
    all.push_back(Held {
        key,
        digest,
        entries: Arc::new(entries),
    });
    let mut total: usize = all.iter().map(|h| h.entries.len()).sum();
    while total > TOTAL_ENTRIES
        && let Some(old) = all.pop_front()
    {
        total -= old.entries.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rsb_protocol::FileKind;

    fn entry(rel: &str) -> ManifestEntry {
        ManifestEntry {
            rel: rel.into(),
            kind: FileKind::File,
            size: 1,
            mtime_ns: 2,
            mode: 0o644,
            hash: Some([1; 32]),
            link_target: None,
        }
    }

    #[test]
    fn held_manifests_are_found_by_key_and_evicted_oldest_first() {
        let key = |root: &str| ("held-test".to_string(), root.to_string(), Bytes::new());
        put(key("a"), vec![entry("x")]);
        let (d, e) = get(&key("a")).unwrap();
        assert_eq!(d, ManifestDigest::of(&[entry("x")]));
        assert_eq!(e.len(), 1);
        // A different root (or rules, or agent) is another manifest.
        assert!(get(&key("b")).is_none());
        // Too large to keep: the old copy goes too, so no stale digest is offered.
        put(key("a"), vec![entry("y"); MAX_ENTRIES + 1]);
        assert!(get(&key("a")).is_none());
    }
}
