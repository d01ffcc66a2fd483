//! The schema: one ordered list of migrations that only ever grows (`PRAGMA user_version`
//! counts how many have run), so a database written by any older rsb upgrades in place.

/// Schema versions, in order; entry `i` moves `user_version` from `i` to `i + 1`. Never edit or
/// reorder an entry: databases in the field have run it. Add a new entry instead.
pub(crate) const MIGRATIONS: &[&str] = &[
    // 1: background transfers (was transfers.rs's own list; existing databases are at 1).
    "CREATE TABLE IF NOT EXISTS transfer_tasks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        direction TEXT NOT NULL,
        sandbox_name TEXT NOT NULL,
        local_path TEXT NOT NULL,
        remote_path TEXT NOT NULL,
        delete_extras INTEGER NOT NULL DEFAULT 0,
        excludes_json TEXT NOT NULL DEFAULT '[]',
        exclude_file TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'queued',
        pid INTEGER NOT NULL DEFAULT 0,
        owner_start TEXT NOT NULL DEFAULT '',
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        log_file TEXT NOT NULL DEFAULT '',
        started_ts REAL NOT NULL DEFAULT 0,
        finished_ts REAL NOT NULL DEFAULT 0,
        last_error TEXT NOT NULL DEFAULT '',
        result_json TEXT NOT NULL DEFAULT '{}',
        progress_json TEXT NOT NULL DEFAULT '{}',
        created_ts REAL NOT NULL,
        updated_ts REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS idx_transfer_tasks_status ON transfer_tasks(status, id DESC);",
    // 2: the watchdog. The seed's columns keep their names (its replies expose them), plus
    // rsb's: stall detection, millisecond scheduling, a resume-intent marker (so a daemon
    // killed while starting a resume neither loses nor repeats it), `rev` for optimistic
    // updates (a cancel from the server is never overwritten by a daemon's late check), and
    // `delivered` on events (alerts of an event committed just before a crash still go out).
    "CREATE TABLE IF NOT EXISTS watches (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL DEFAULT '',
        name TEXT NOT NULL DEFAULT '',
        sandbox_name TEXT NOT NULL,
        tmux_session TEXT NOT NULL,
        log_file TEXT NOT NULL,
        cwd TEXT NOT NULL DEFAULT '',
        launch_command TEXT NOT NULL DEFAULT '',
        resume_command TEXT NOT NULL DEFAULT '',
        resume_plan_json TEXT NOT NULL DEFAULT '{}',
        checkpoint_path TEXT NOT NULL DEFAULT '',
        checkpoint_format TEXT NOT NULL DEFAULT 'text',
        checkpoint_command TEXT NOT NULL DEFAULT '',
        interval_s INTEGER NOT NULL DEFAULT 300,
        max_log_lines INTEGER NOT NULL DEFAULT 80,
        status TEXT NOT NULL DEFAULT 'active',
        last_state TEXT NOT NULL DEFAULT '',
        last_summary TEXT NOT NULL DEFAULT '',
        last_error TEXT NOT NULL DEFAULT '',
        last_exit_code INTEGER,
        last_signal INTEGER,
        last_log_digest TEXT NOT NULL DEFAULT '',
        last_log_tail TEXT NOT NULL DEFAULT '',
        last_checkpoint_text TEXT NOT NULL DEFAULT '',
        last_checkpoint_digest TEXT NOT NULL DEFAULT '',
        checkpoint_updated_ts INTEGER NOT NULL DEFAULT 0,
        webhook_url TEXT NOT NULL DEFAULT '',
        event_command TEXT NOT NULL DEFAULT '',
        auto_resume INTEGER NOT NULL DEFAULT 0,
        resume_attempts INTEGER NOT NULL DEFAULT 0,
        max_resume_attempts INTEGER NOT NULL DEFAULT 1,
        alert_after_failures INTEGER NOT NULL DEFAULT 2,
        consecutive_ssh_failures INTEGER NOT NULL DEFAULT 0,
        ssh_alert_sent INTEGER NOT NULL DEFAULT 0,
        notify_local INTEGER NOT NULL DEFAULT 1,
        resume_delay_s INTEGER NOT NULL DEFAULT 300,
        interrupted_ts INTEGER NOT NULL DEFAULT 0,
        resume_due_ts INTEGER NOT NULL DEFAULT 0,
        metadata_json TEXT NOT NULL DEFAULT '{}',
        created_ts INTEGER NOT NULL,
        updated_ts INTEGER NOT NULL,
        last_checked_ts INTEGER NOT NULL DEFAULT 0,
        next_check_ts INTEGER NOT NULL DEFAULT 0,
        last_event_ts INTEGER NOT NULL DEFAULT 0,
        stall_after_s INTEGER NOT NULL DEFAULT 0,
        last_log_size INTEGER NOT NULL DEFAULT -1,
        log_changed_ts INTEGER NOT NULL DEFAULT 0,
        stall_alert_sent INTEGER NOT NULL DEFAULT 0,
        last_alert_error TEXT NOT NULL DEFAULT '',
        next_check_ms INTEGER NOT NULL DEFAULT 0,
        resume_intent_ms INTEGER NOT NULL DEFAULT 0,
        rev INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX IF NOT EXISTS idx_watches_due ON watches(status, next_check_ms);
    CREATE TABLE IF NOT EXISTS watch_events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        watch_id INTEGER NOT NULL,
        event_type TEXT NOT NULL,
        summary TEXT NOT NULL,
        payload_json TEXT NOT NULL,
        created_ts INTEGER NOT NULL,
        created_ms INTEGER NOT NULL DEFAULT 0,
        delivered INTEGER NOT NULL DEFAULT 0,
        FOREIGN KEY(watch_id) REFERENCES watches(id)
    );
    CREATE INDEX IF NOT EXISTS idx_watch_events_watch ON watch_events(watch_id, created_ts DESC);
    CREATE INDEX IF NOT EXISTS idx_watch_events_pending ON watch_events(delivered, id);
    CREATE TABLE IF NOT EXISTS daemon_meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL,
        updated_ts INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS sandboxes (
        name TEXT PRIMARY KEY,
        def_json TEXT NOT NULL,
        updated_ts INTEGER NOT NULL
    );",
    // 3: transfers run in a detached worker (`rsb transfer run <id>`), which rebuilds the sync
    // from `spec_json`; `in_process` marks a task kept inside its server (a password sandbox
    // whose secret may not be stored). `sync_baselines` holds the last-synced manifest of each
    // (local root, sandbox, remote root), so a destination file changed since is a conflict.
    "ALTER TABLE transfer_tasks ADD COLUMN spec_json TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE transfer_tasks ADD COLUMN in_process INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE IF NOT EXISTS sync_baselines (
        local_root TEXT NOT NULL,
        sandbox_name TEXT NOT NULL,
        remote_root TEXT NOT NULL,
        entries_json TEXT NOT NULL,
        updated_ts INTEGER NOT NULL,
        PRIMARY KEY (local_root, sandbox_name, remote_root)
    );",
    // 4: forwards served by the watchdog daemon (`forward_port(detach=true)`).
    "CREATE TABLE IF NOT EXISTS forwards (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_name TEXT NOT NULL,
        target TEXT NOT NULL,
        bind TEXT NOT NULL,
        local_port TEXT NOT NULL,
        state TEXT NOT NULL,
        local_address TEXT NOT NULL DEFAULT '',
        error TEXT NOT NULL DEFAULT '',
        stats_json TEXT NOT NULL DEFAULT '',
        daemon_pid INTEGER NOT NULL DEFAULT 0,
        created_ts INTEGER NOT NULL,
        updated_ts INTEGER NOT NULL
    )",
    // 5: a resume records the launch id the agent stores with it and the job name it starts
    // under, so a daemon that stopped mid-start repeats that launch instead of comparing the
    // host's clock with its own.
    "ALTER TABLE watches ADD COLUMN resume_launch_id TEXT NOT NULL DEFAULT '';
    ALTER TABLE watches ADD COLUMN resume_launch_session TEXT NOT NULL DEFAULT '';",
    // 6: persisted sandboxes keyed by the fingerprint of what they resolve to, not by name,
    // and each row that connects later (a watch, a worker's task, a detached forward) names
    // the fingerprint it was registered with: two servers whose configs differ for one name
    // never send each other's daemon or worker to the wrong host. Rows from before keep an
    // empty fingerprint and are found by name in the old table.
    "CREATE TABLE IF NOT EXISTS sandbox_defs (
        fingerprint TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        def_json TEXT NOT NULL,
        updated_ts INTEGER NOT NULL
    );
    ALTER TABLE watches ADD COLUMN sandbox_fp TEXT NOT NULL DEFAULT '';
    ALTER TABLE transfer_tasks ADD COLUMN sandbox_fp TEXT NOT NULL DEFAULT '';
    ALTER TABLE forwards ADD COLUMN sandbox_fp TEXT NOT NULL DEFAULT '';",
    // 7: each baseline row's generation, a random id written with every save, so a server's
    // in-memory copy is checked against its own row rather than against every commit to the
    // file (`PRAGMA data_version`, which a daemon's check or a worker's progress changes).
    // 0 (rows from before) is never taken as current.
    "ALTER TABLE sync_baselines ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;",
    // 8: what a running sync committed, one row per acknowledged batch (`rel` → blake3, as in
    // `sync_baselines`), written as the acknowledgements come. A sync that ends saves its
    // baseline and clears these; one killed outright (SIGKILL, an OOM kill) leaves them, and
    // the next load of the baseline folds them in, so its own commits are not conflicts.
    "CREATE TABLE IF NOT EXISTS sync_journal (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        local_root TEXT NOT NULL,
        sandbox_name TEXT NOT NULL,
        remote_root TEXT NOT NULL,
        entries_json TEXT NOT NULL,
        created_ts INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS idx_sync_journal_key
        ON sync_journal(local_root, sandbox_name, remote_root, id);",
];
