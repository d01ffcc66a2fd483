//! The `sync_baselines` table: per (local root, sandbox, remote root), the content both sides
//! agreed on at the last sync (relative path → blake3), which is what tells an edit on one side
//! from a conflict. A row that cannot be read is an error, never "no baseline": a missing
//! baseline makes the next sync a first sync, which would overwrite a remote edit without a
//! conflict.
//!
//! The `sync_journal` table holds what a running sync committed, batch by batch, as the
//! acknowledgements come ([`journal`]). A sync that ends (completed, failed or cancelled)
//! replaces the baseline and clears its journal in one transaction ([`save`]); one killed
//! outright leaves the journal, and [`fold`], run by the next load, lays it over the baseline.
//! A killed sync's own commits are then edits both sides agree on, not conflicts.

use std::collections::HashMap;

use rusqlite::{Connection, OptionalExtension, params};

use crate::{
    error::{Kind, Result, RsbError},
    store::{db_err, now_s},
};

/// Relative path → blake3 of the content both sides agreed on at the last sync.
pub type Baseline = HashMap<String, [u8; 32]>;

/// (local root, sandbox, remote root), the row's key.
pub type Key = (String, String, String);

/// The generation of `key`'s row (see [`save`]): a read of one small column, which is how a
/// copy in memory is checked. `None` when there is no row.
pub fn generation(conn: &Connection, key: &Key) -> Result<Option<i64>> {
    conn.query_row(
        "SELECT generation FROM sync_baselines
         WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3",
        params![key.0, key.1, key.2],
        |r| r.get(0),
    )
    .optional()
    .map_err(db_err)
}

/// The baseline of `key`; `None` only when no sync of it ever completed.
pub fn load(conn: &Connection, key: &Key) -> Result<Option<Baseline>> {
    Ok(load_with_generation(conn, key)?.map(|(_, b)| b))
}

/// [`load`] with the row's generation, read in the same statement.
pub fn load_with_generation(conn: &Connection, key: &Key) -> Result<Option<(i64, Baseline)>> {
    let row: Option<(i64, String)> = conn
        .query_row(
            "SELECT generation, entries_json FROM sync_baselines
             WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3",
            params![key.0, key.1, key.2],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()
        .map_err(db_err)?;
    let Some((generation, json)) = row else {
        return Ok(None);
    };
    decode(key, &json).map(|b| Some((generation, b)))
}

/// `entries_json` of a baseline or journal row: `rel` → blake3 in hex.
fn decode(key: &Key, json: &str) -> Result<Baseline> {
    let damaged = || {
        RsbError::new(
            Kind::Config,
            format!(
                "the sync baseline of {} → {}:{} in the state database is damaged",
                key.0, key.1, key.2
            ),
            crate::store::UNUSABLE_HINT,
        )
    };
    let hexes: HashMap<String, String> = serde_json::from_str(json).map_err(|_| damaged())?;
    hexes
        .into_iter()
        .map(|(k, v)| {
            let h = blake3::Hash::from_hex(&v).map_err(|_| damaged())?;
            Ok((k, *h.as_bytes()))
        })
        .collect()
}

fn encode<'a>(entries: impl IntoIterator<Item = (&'a String, &'a [u8; 32])>) -> Result<String> {
    let hexes: HashMap<&str, String> = entries
        .into_iter()
        .map(|(k, h)| {
            (
                k.as_str(),
                blake3::Hash::from_bytes(*h).to_hex().to_string(),
            )
        })
        .collect();
    serde_json::to_string(&hexes).map_err(db_err)
}

/// A fresh generation: random, positive and never 0, so a row deleted (by retention) and
/// written again never repeats the generation a server cached for the old one.
fn new_generation() -> i64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    ((h.finish() >> 1) as i64).max(1)
}

/// Write (replace) the baseline of `key` and clear its journal, in one transaction (the
/// baseline a run saves already holds what it journaled); returns the row's new generation.
pub fn save(conn: &Connection, key: &Key, entries: &Baseline) -> Result<i64> {
    let json = encode(entries)?;
    in_transaction(conn, || {
        let generation = write(conn, key, &json)?;
        clear_journal(conn, key)?;
        Ok(generation)
    })
}

fn write(conn: &Connection, key: &Key, json: &str) -> Result<i64> {
    let generation = new_generation();
    conn.execute(
        "INSERT INTO sync_baselines (local_root, sandbox_name, remote_root, entries_json,
           updated_ts, generation) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT(local_root, sandbox_name, remote_root) DO UPDATE SET
           entries_json = excluded.entries_json, updated_ts = excluded.updated_ts,
           generation = excluded.generation",
        params![key.0, key.1, key.2, json, now_s(), generation],
    )
    .map(|_| generation)
    .map_err(db_err)
}

fn clear_journal(conn: &Connection, key: &Key) -> Result<()> {
    conn.execute(
        "DELETE FROM sync_journal WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3",
        params![key.0, key.1, key.2],
    )
    .map(|_| ())
    .map_err(db_err)
}

/// `f` inside `BEGIN IMMEDIATE` … `COMMIT` (rolled back on an error): the write lock is taken
/// up front, so a second writer waits on the busy timeout instead of failing mid-way.
fn in_transaction<T>(conn: &Connection, f: impl FnOnce() -> Result<T>) -> Result<T> {
    conn.execute_batch("BEGIN IMMEDIATE").map_err(db_err)?;
    match f() {
        Ok(v) => {
            if let Err(e) = conn.execute_batch("COMMIT") {
                let _ = conn.execute_batch("ROLLBACK");
                return Err(db_err(e));
            }
            Ok(v)
        }
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

/// Mark `key` as synced now, at most once a day (a no-change resync writes no baseline, and
/// retention drops baselines by this time). The content is the same, so the generation stays;
/// what the run journaled (commits of the content the baseline holds) goes.
pub fn touch(conn: &Connection, key: &Key, now: i64) -> Result<()> {
    conn.execute(
        "UPDATE sync_baselines SET updated_ts = ?4
         WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3 AND updated_ts < ?4 - 86400",
        params![key.0, key.1, key.2, now],
    )
    .map_err(db_err)?;
    clear_journal(conn, key)
}

/// Record that a running sync of `key` committed `commits` (`rel` → the hash each commit
/// carried). One row per acknowledged batch; [`fold`] reads them in order.
pub fn journal(conn: &Connection, key: &Key, commits: &[(String, [u8; 32])]) -> Result<()> {
    if commits.is_empty() {
        return Ok(());
    }
    let json = encode(commits.iter().map(|(k, h)| (k, h)))?;
    conn.execute(
        "INSERT INTO sync_journal (local_root, sandbox_name, remote_root, entries_json, created_ts)
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![key.0, key.1, key.2, json, now_s()],
    )
    .map(|_| ())
    .map_err(db_err)
}

/// Lay the journal of a sync of `key` that never ended over its baseline, in the order the
/// batches were acknowledged, and clear it; `true` when there was one. Without a baseline the
/// journal is dropped: a first sync journals nothing, and a baseline that retention removed
/// makes the next sync a first sync either way. A damaged row is an error and changes nothing.
pub fn fold(conn: &Connection, key: &Key) -> Result<bool> {
    let pending: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM sync_journal
               WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3)",
            params![key.0, key.1, key.2],
            |r| r.get(0),
        )
        .map_err(db_err)?;
    if !pending {
        return Ok(false);
    }
    in_transaction(conn, || {
        let rows: Vec<String> = conn
            .prepare(
                "SELECT entries_json FROM sync_journal
                 WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3 ORDER BY id",
            )
            .and_then(|mut st| {
                st.query_map(params![key.0, key.1, key.2], |r| r.get(0))?
                    .collect()
            })
            .map_err(db_err)?;
        if let Some(mut base) = load(conn, key)? {
            for json in &rows {
                base.extend(decode(key, json)?);
            }
            write(conn, key, &encode(&base)?)?;
        }
        clear_journal(conn, key)?;
        Ok(true)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        ("l".into(), "s".into(), "r".into())
    }

    #[test]
    fn a_baseline_round_trips_and_a_missing_one_is_none() {
        let d = tempfile::tempdir().unwrap();
        let c = crate::store::open(d.path()).unwrap();
        assert_eq!(load(&c, &key()).unwrap(), None);
        let b: Baseline = [("a/b".to_string(), [7; 32])].into();
        save(&c, &key(), &b).unwrap();
        assert_eq!(load(&c, &key()).unwrap(), Some(b));
    }

    fn journal_rows(c: &Connection) -> i64 {
        c.query_row("SELECT count(*) FROM sync_journal", [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn a_journal_is_folded_over_the_baseline_in_order_and_cleared() {
        let d = tempfile::tempdir().unwrap();
        let c = crate::store::open(d.path()).unwrap();
        let b: Baseline = [("a".to_string(), [1; 32]), ("b".to_string(), [2; 32])].into();
        let g0 = save(&c, &key(), &b).unwrap();
        assert!(!fold(&c, &key()).unwrap(), "nothing journaled");
        journal(&c, &key(), &[("a".into(), [3; 32]), ("c".into(), [4; 32])]).unwrap();
        journal(&c, &key(), &[("a".into(), [5; 32])]).unwrap();
        journal(&c, &key(), &[]).unwrap();
        // Another pair of roots keeps its own journal.
        let other: Key = ("l".into(), "s".into(), "r2".into());
        journal(&c, &other, &[("z".into(), [9; 32])]).unwrap();
        assert_eq!(journal_rows(&c), 3, "an empty batch writes no row");
        assert!(fold(&c, &key()).unwrap());
        let (g1, folded) = load_with_generation(&c, &key()).unwrap().unwrap();
        assert_ne!(g1, g0, "a fold is a new generation: caches reload it");
        let want: Baseline = [
            ("a".to_string(), [5; 32]),
            ("b".to_string(), [2; 32]),
            ("c".to_string(), [4; 32]),
        ]
        .into();
        assert_eq!(folded, want, "the later batch wins");
        assert_eq!(journal_rows(&c), 1, "only the other pair's row is left");
        assert!(!fold(&c, &key()).unwrap(), "a fold happens once");
        // A save ends the run: its journal goes with it.
        journal(&c, &key(), &[("d".into(), [6; 32])]).unwrap();
        save(&c, &key(), &want).unwrap();
        assert!(!fold(&c, &key()).unwrap());
        assert_eq!(load(&c, &key()).unwrap(), Some(want));
        // Without a baseline the journal is dropped, and none is made up.
        assert!(fold(&c, &other).unwrap());
        assert_eq!((load(&c, &other).unwrap(), journal_rows(&c)), (None, 0));
    }

    #[test]
    fn a_damaged_journal_row_is_an_error_and_changes_nothing() {
        let d = tempfile::tempdir().unwrap();
        let c = crate::store::open(d.path()).unwrap();
        let b: Baseline = [("a".to_string(), [1; 32])].into();
        save(&c, &key(), &b).unwrap();
        journal(&c, &key(), &[("a".into(), [3; 32])]).unwrap();
        c.execute(
            "INSERT INTO sync_journal (local_root, sandbox_name, remote_root, entries_json,
               created_ts) VALUES ('l', 's', 'r', '{not json', 0)",
            [],
        )
        .unwrap();
        let e = fold(&c, &key()).unwrap_err();
        assert!(e.message.contains("damaged"), "{}", e.message);
        assert_eq!(load(&c, &key()).unwrap(), Some(b));
        assert_eq!(journal_rows(&c), 2);
    }

    #[test]
    fn a_damaged_row_is_an_error_not_a_first_sync() {
        let d = tempfile::tempdir().unwrap();
        let c = crate::store::open(d.path()).unwrap();
        for bad in ["{not json", r#"{"a":"zz"}"#] {
            c.execute(
                "INSERT OR REPLACE INTO sync_baselines (local_root, sandbox_name, remote_root,
                   entries_json, updated_ts) VALUES ('l', 's', 'r', ?1, 0)",
                [bad],
            )
            .unwrap();
            let e = load(&c, &key()).unwrap_err();
            assert!(e.message.contains("damaged"), "{}", e.message);
            assert!(e.hint.contains("rsb state check"), "{}", e.hint);
        }
    }
}
