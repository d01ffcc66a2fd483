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

/// `PRAGMA data_version`: unchanged while no other connection committed anything, which is
/// what lets a caller keep a baseline in memory.
pub fn data_version(conn: &Connection) -> Option<i64> {
    conn.query_row("PRAGMA data_version", [], |r| r.get(0)).ok()
}

/// The baseline of `key`; `None` only when no sync of it ever completed.
pub fn load(conn: &Connection, key: &Key) -> Result<Option<Baseline>> {
    let json: Option<String> = conn
        .query_row(
            "SELECT entries_json FROM sync_baselines
             WHERE local_root = ?1 AND sandbox_name = ?2 AND remote_root = ?3",
            params![key.0, key.1, key.2],
            |r| r.get(0),
        )
        .optional()
        .map_err(db_err)?;
    let Some(json) = json else {
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
        .map(Some)
}

/// Write (replace) the baseline of `key`.
pub fn save(conn: &Connection, key: &Key, entries: &Baseline) -> Result<()> {
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
    conn.execute(
        "INSERT INTO sync_baselines (local_root, sandbox_name, remote_root, entries_json,
           updated_ts) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(local_root, sandbox_name, remote_root) DO UPDATE SET
           entries_json = excluded.entries_json, updated_ts = excluded.updated_ts",
        params![key.0, key.1, key.2, json, now_s()],
    )
    .map(|_| ())
    .map_err(db_err)
}

/// Mark `key` as synced now, at most once a day (a no-change resync writes no baseline, and
/// retention drops baselines by this time). An update that matches nothing writes no page, so
/// other connections' `data_version` (and their baseline caches) stay as they are.
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
