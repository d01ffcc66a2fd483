//! The `sync_baselines` table: per (local root, sandbox, remote root), the content both sides
//! agreed on at the last sync (relative path → blake3), which is what tells an edit on one side
//! from a conflict. A row that cannot be read is an error, never "no baseline": a missing
//! baseline makes the next sync a first sync, which would overwrite a remote edit without a
//! conflict.

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
    let hexes: HashMap<String, String> = serde_json::from_str(&json).map_err(|_| damaged())?;
    hexes
        .into_iter()
        .map(|(k, v)| {
            let h = blake3::Hash::from_hex(&v).map_err(|_| damaged())?;
            Ok((k, *h.as_bytes()))
        })
        .collect::<Result<Baseline>>()
        .map(|b| Some((generation, b)))
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

/// Write (replace) the baseline of `key`; returns the row's new generation.
pub fn save(conn: &Connection, key: &Key, entries: &Baseline) -> Result<i64> {
    let hexes: HashMap<&str, String> = entries
        .iter()
        .map(|(k, h)| {
            (
                k.as_str(),
                blake3::Hash::from_bytes(*h).to_hex().to_string(),
            )
        })
        .collect();
    let json = serde_json::to_string(&hexes).map_err(db_err)?;
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

/// Mark `key` as synced now, at most once a day (a no-change resync writes no baseline, and
/// retention drops baselines by this time). The content is the same, so the generation stays.
pub fn touch(conn: &Connection, key: &Key, now: i64) -> Result<()> {
    conn.execute(
        "UPDATE sync_baselines SET updated_ts = ?4
         WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3 AND updated_ts < ?4 - 86400",
        params![key.0, key.1, key.2, now],
    )
    .map(|_| ())
    .map_err(db_err)
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
