//! `rsb state [show|check|prune]`: what the state dir holds, whether its store is usable, and
//! retention applied now (see `rsb::store::retention`).

use std::path::Path;

use clap::Subcommand;
use rsb::{ops::output::human_bytes, store};

use super::{code_of, exit, print_json};

#[derive(Debug, Subcommand)]
pub enum StateCmd {
    /// What the state dir holds: each file and table with its size (the default).
    Show,
    /// Whether the store opens, is at a schema this rsb knows, and every page reads.
    Check,
    /// Apply the retention policy now: events and logs older than 30 days (or over 16 MiB),
    /// finished transfers older than 7 days, baselines of roots not synced for 90 days; the
    /// daemon log rotated above 4 MiB.
    Prune,
}

fn fail(e: &rsb::error::RsbError, json: bool) -> u8 {
    if json {
        print_json(&serde_json::json!({"ok": false, "error": e.message, "hint": e.hint}));
    } else {
        eprintln!("rsb: {}\n  hint: {}", e.message, e.hint);
    }
    code_of(e)
}

pub fn run(cmd: Option<StateCmd>, json: bool, state_dir: &Path) -> u8 {
    // Opening checks the pages (`store::open`).
    let opened = store::open(state_dir);
    match cmd.unwrap_or(StateCmd::Show) {
        StateCmd::Show => {
            let u = match store::retention::usage(state_dir, opened.as_ref().ok()) {
                Ok(u) => u,
                Err(e) => return fail(&e, json),
            };
            if json {
                print_json(&serde_json::json!({
                    "usage": u,
                    "store_error": opened.as_ref().err().map(|e| &e.message),
                }));
                return exit::OK;
            }
            println!("{}: {}", u.state_dir, human_bytes(u.total_bytes));
            for e in &u.files {
                println!("  {:<24} {:>10}  {}", e.path, human_bytes(e.bytes), e.what);
            }
            for e in &u.tables {
                println!(
                    "  {:<24} {:>10}  {} rows of {}",
                    e.path,
                    human_bytes(e.bytes),
                    e.count,
                    e.what
                );
            }
            if let Err(e) = &opened {
                super::warn(&format!("{} ({})", e.message, e.hint));
            }
            exit::OK
        }
        StateCmd::Check => match opened {
            Ok(_) => {
                if json {
                    print_json(&serde_json::json!({"ok": true, "schema": store::SCHEMA_VERSION}));
                } else {
                    println!(
                        "ok: {} (schema {}, every page reads)",
                        store::db_path(state_dir).display(),
                        store::SCHEMA_VERSION
                    );
                }
                exit::OK
            }
            Err(e) => fail(&e, json),
        },
        StateCmd::Prune => {
            let c = match opened {
                Ok(c) => c,
                Err(e) => return fail(&e, json),
            };
            match store::retention::prune_now(state_dir, &c, &Default::default()) {
                Ok(p) if json => {
                    print_json(&p);
                    exit::OK
                }
                Ok(p) => {
                    println!(
                        "pruned: {} events ({} files), {} watches, {} transfers ({} logs), {} \
                         baselines ({} sync locks, {} journal rows), {} sandbox definitions{}; {} freed",
                        p.events,
                        p.event_files,
                        p.watches,
                        p.transfers,
                        p.transfer_logs,
                        p.baselines,
                        p.sync_locks,
                        p.journal,
                        p.sandboxes,
                        if p.daemon_log_rotated {
                            ", daemon log rotated"
                        } else {
                            ""
                        },
                        human_bytes(p.bytes_freed)
                    );
                    exit::OK
                }
                Err(e) => fail(&e, json),
            }
        }
    }
}
