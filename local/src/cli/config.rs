//! `rsb config path|check`.

use clap::Subcommand;
use rsb::config::{Config, config_file_path};

use super::{exit, print_json};

#[derive(Debug, Subcommand)]
pub enum ConfigCmd {
    /// Print where rsb reads its configuration file (RSB_CONFIG overrides).
    Path,
    /// Load the configuration as every command does and report what it defines.
    Check,
}

pub fn run(cmd: ConfigCmd, json: bool) -> u8 {
    let path = config_file_path();
    match cmd {
        ConfigCmd::Path => {
            if json {
                print_json(&serde_json::json!({"path": path, "exists": path.is_file()}));
            } else {
                println!("{}", path.display());
            }
            exit::OK
        }
        ConfigCmd::Check => match Config::load() {
            Ok(c) => {
                if json {
                    print_json(&serde_json::json!({
                        "ok": true,
                        "source": c.source,
                        "sandboxes": c.names(),
                        "warnings": c.warnings,
                        "path": path,
                    }));
                } else {
                    for w in &c.warnings {
                        super::warn(w);
                    }
                    println!(
                        "ok: {} sandbox(es) from {}: {}",
                        c.sandboxes.len(),
                        c.source,
                        c.names().join(", ")
                    );
                    if c.source == rsb::config::BUILTIN_LOCAL {
                        println!("note: {} does not exist", path.display());
                    }
                }
                exit::OK
            }
            Err(e) => {
                if json {
                    print_json(
                        &serde_json::json!({"ok": false, "error": e.message, "hint": e.hint, "path": path}),
                    );
                } else {
                    eprintln!("rsb: {}\n  hint: {}", e.message, e.hint);
                }
                exit::CONFIG
            }
        },
    }
}
