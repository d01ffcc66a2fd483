//! What a state dir holds, named once. The store owns the database and the rows' files;
//! the other entries are written by the layer whose content they are, and live beside the
//! database rather than in it for a reason each entry states. `rsb state` lists every entry
//! ([`super::retention::usage`]); a name used anywhere else comes from here (or, for
//! `known_hosts`, from `config`, which sits below the store).

/// The database ([`super::DB_FILE`]) and its WAL and shared-memory files are the store's;
/// these are the other entries, with what `rsb state` calls them.
///
/// The daemon's lock: a file lock, not a row, because the kernel releases it when the daemon
/// dies however it dies (`watchdog/lock.rs`); it also holds the daemon's pid and start time.
pub const DAEMON_LOCK: &str = "watchdog.lock";
/// The daemon's log, and `.1` its previous one: written by `tracing` through a file (a log
/// must be readable when the database is not); rotated by retention.
pub const DAEMON_LOG: &str = "watchdog.log";
/// The environment `rsb mcp` last started with, names and paths only (`server_env.rs`): read
/// by `rsb doctor`, which must work when the store cannot be opened.
pub const MCP_ENV: &str = "mcp-env.json";
/// Background transfers' logs (`transfer-<id>.log`): appended by the worker line by line and read by
/// `check_file_transfer_task` from an offset, as the seed's were; rows name them.
pub const TRANSFER_LOGS: &str = "transfers";
/// The audit log, a file a month (`audit.rs`): append-only JSON lines with a hash chain, kept
/// out of the database so a store that is damaged or pruned cannot take the record with it.
pub const AUDIT: &str = "audit";

/// Every entry besides the database's own files: (name, is a directory, what it is).
pub const ENTRIES: &[(&str, bool, &str)] = &[
    (DAEMON_LOCK, false, "the watchdog daemon's lock (its pid)"),
    (DAEMON_LOG, false, "the daemon's log"),
    ("watchdog.log.1", false, "the daemon's previous log"),
    (
        super::sandboxes::SECRETS_FILE,
        false,
        "opted-in secrets (RSB_WATCHDOG_STORE_PASSWORDS)",
    ),
    (
        super::sandboxes::SECRETS_LOCK,
        false,
        "the lock of the secrets file",
    ),
    (crate::config::KNOWN_HOSTS, false, "host keys rsb learned"),
    (MCP_ENV, false, "the environment rsb mcp last started with"),
    (super::events::DIR, true, "watch event files"),
    (TRANSFER_LOGS, true, "transfer logs"),
    (AUDIT, true, "the audit log, a file a month (12 kept)"),
    (super::roots_lock::DIR, true, "locks of synced roots"),
];
