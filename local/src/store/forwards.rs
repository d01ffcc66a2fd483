//! The `forwards` table: detached forwards as rows (`starting` → `listening` (or `failed`) →
//! `stopping` → deleted once the port is free). The daemon that serves them is
//! `watchdog::forwards`; this module only reads and writes rows.

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
};

use rusqlite::{Connection, OptionalExtension, Row as SqlRow, params};

use serde::Serialize;

use crate::{
    error::Result,
    store::{db_err, now_s},
};

/// Detached forwards are numbered from here, so an id never names both a detached forward and
/// one of an MCP server's own (those count from 1).
pub const ID_OFFSET: u64 = 1_000_000;

pub const STARTING: &str = "starting";
pub const LISTENING: &str = "listening";
pub const FAILED: &str = "failed";
pub const STOPPING: &str = "stopping";

/// What a forward connects to, as the sandbox host sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Tcp { host: String, port: u16 },
    Unix { path: String },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            Target::Tcp { host, port } => write!(f, "{host}:{port}"),
            Target::Unix { path } => f.write_str(path),
        }
    }
}

/// Which local port to listen on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalPort {
    /// This port or an error.
    Exact(u16),
    /// This port when free, else any (the default: the remote port number, as `ssh -L` users
    /// usually pick, without failing when it is taken).
    Prefer(u16),
    /// Whatever the OS hands out.
    Any,
}

/// A point-in-time copy of a forward's counters (also what the daemon records for a detached
/// forward, so it round-trips through the store).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct StatsSnapshot {
    pub connections_total: u64,
    pub connections_active: u64,
    pub connections_failed: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub reconnects: u64,
    pub last_error: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Row {
    pub id: i64,
    pub sandbox_name: String,
    /// The persisted definition the daemon connects with.
    pub sandbox_fp: String,
    /// [`Target`]'s display form, which `forward::request::parse_target` reads back.
    pub target: String,
    pub bind: String,
    /// [`encode_port`] of the requested [`LocalPort`].
    pub local_port: String,
    pub state: String,
    pub local_address: String,
    pub error: String,
    pub stats: StatsSnapshot,
    pub daemon_pid: i64,
    pub created_ts: i64,
}

impl Row {
    pub fn public_id(&self) -> u64 {
        ID_OFFSET + self.id as u64
    }
}

pub fn encode_port(p: LocalPort) -> String {
    match p {
        LocalPort::Exact(n) => format!("exact:{n}"),
        LocalPort::Prefer(n) => format!("prefer:{n}"),
        LocalPort::Any => "any".into(),
    }
}

pub fn decode_port(s: &str) -> LocalPort {
    let num = |rest: &str| rest.parse::<u16>().ok();
    match s.split_once(':') {
        Some(("exact", n)) => num(n).map_or(LocalPort::Any, LocalPort::Exact),
        Some(("prefer", n)) => num(n).map_or(LocalPort::Any, LocalPort::Prefer),
        _ => LocalPort::Any,
    }
}

const COLUMNS: &str = "id, sandbox_name, target, bind, local_port, state, local_address, error, \
                       stats_json, daemon_pid, created_ts, sandbox_fp";

fn from_sql(r: &SqlRow<'_>) -> rusqlite::Result<Row> {
    let stats: String = r.get(8)?;
    Ok(Row {
        id: r.get(0)?,
        sandbox_name: r.get(1)?,
        target: r.get(2)?,
        bind: r.get(3)?,
        local_port: r.get(4)?,
        state: r.get(5)?,
        local_address: r.get(6)?,
        error: r.get(7)?,
        stats: serde_json::from_str(&stats).unwrap_or_default(),
        daemon_pid: r.get(9)?,
        created_ts: r.get(10)?,
        sandbox_fp: r.get(11)?,
    })
}

pub fn insert(
    conn: &Connection,
    sandbox: &str,
    sandbox_fp: &str,
    target: &Target,
    bind: IpAddr,
    port: LocalPort,
) -> Result<i64> {
    let ts = now_s();
    conn.execute(
        "INSERT INTO forwards (sandbox_name, target, bind, local_port, state, created_ts, updated_ts,
           sandbox_fp)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7)",
        params![
            sandbox,
            target.to_string(),
            bind.to_string(),
            encode_port(port),
            STARTING,
            ts,
            sandbox_fp
        ],
    )
    .map_err(db_err)?;
    Ok(conn.last_insert_rowid())
}

pub fn get(conn: &Connection, id: i64) -> Result<Option<Row>> {
    conn.query_row(
        &format!("SELECT {COLUMNS} FROM forwards WHERE id = ?1"),
        [id],
        from_sql,
    )
    .optional()
    .map_err(db_err)
}

pub fn list(conn: &Connection) -> Result<Vec<Row>> {
    let mut st = conn
        .prepare(&format!("SELECT {COLUMNS} FROM forwards ORDER BY id"))
        .map_err(db_err)?;
    st.query_map([], from_sql)
        .and_then(|rows| rows.collect())
        .map_err(db_err)
}

fn update(conn: &Connection, sql: &str, p: impl rusqlite::Params) -> Result<()> {
    conn.execute(sql, p).map(|_| ()).map_err(db_err)
}

pub fn set_listening(conn: &Connection, id: i64, addr: SocketAddr) -> Result<()> {
    update(
        conn,
        "UPDATE forwards SET state = ?2, local_address = ?3, error = '', daemon_pid = ?4,
         updated_ts = ?5 WHERE id = ?1 AND state IN ('starting', 'listening')",
        params![id, LISTENING, addr.to_string(), std::process::id(), now_s()],
    )
}

/// A `starting` row that cannot start fails; a `listening` one keeps its state and retries.
pub fn set_error(conn: &Connection, id: i64, msg: &str) -> Result<()> {
    update(
        conn,
        "UPDATE forwards SET state = CASE state WHEN 'starting' THEN 'failed' ELSE state END,
         error = ?2, updated_ts = ?3 WHERE id = ?1",
        params![id, msg, now_s()],
    )
}

pub fn set_stats(conn: &Connection, id: i64, s: &StatsSnapshot) -> Result<()> {
    let json = serde_json::to_string(s).unwrap_or_default();
    update(
        conn,
        "UPDATE forwards SET stats_json = ?2 WHERE id = ?1 AND stats_json != ?2",
        params![id, json],
    )
}

/// Ask the daemon to stop a forward. `false` when there is no such row.
pub fn request_stop(conn: &Connection, id: i64) -> Result<bool> {
    let n = conn
        .execute(
            "UPDATE forwards SET state = ?2, updated_ts = ?3 WHERE id = ?1",
            params![id, STOPPING, now_s()],
        )
        .map_err(db_err)?;
    Ok(n > 0)
}

pub fn delete(conn: &Connection, id: i64) -> Result<()> {
    update(conn, "DELETE FROM forwards WHERE id = ?1", [id])
}
