//! `rsb sandboxes [--resources]`: exits 3 (connection) when any sandbox is down, as a health
//! check would, after the listing.

use rsb::ops::sandboxes::{self, ResourcesOrError};

use super::{Ctx, exit, print_json, print_table};

pub async fn run(ctx: &Ctx, resources: bool) -> u8 {
    let names: Vec<&str> = ctx.app.pool().names().iter().map(String::as_str).collect();
    ctx.warnings_for(&names);
    // A CLI process has no pool history to report: it always probes.
    let depth = if resources {
        sandboxes::Listing::Resources
    } else {
        sandboxes::Listing::Probe
    };
    let list = sandboxes::list(ctx.app.pool(), depth).await;
    let down: Vec<&str> = list
        .sandboxes
        .iter()
        .filter(|s| !s.connection_alive)
        .map(|s| s.name.as_str())
        .collect();
    let code = if down.is_empty() {
        exit::OK
    } else {
        exit::CONNECTION
    };
    if ctx.json {
        print_json(&list);
        return code;
    }
    let mut header = vec!["", "NAME", "ADDRESS", "ALIVE"];
    if resources {
        header.extend(["CPU%", "MEM%", "GPUS", "IDLE"]);
    }
    header.push("NOTE");
    let rows: Vec<Vec<String>> = list
        .sandboxes
        .iter()
        .map(|s| {
            let mut row = vec![
                if s.is_active { "*" } else { "" }.to_string(),
                s.name.clone(),
                if s.port == 0 {
                    "this machine".to_string()
                } else {
                    format!("{}@{}:{}", s.user, s.host, s.port)
                },
                if s.connection_alive { "yes" } else { "no" }.to_string(),
            ];
            let mut note = s.connection_error.clone().unwrap_or_default();
            if resources {
                match &s.resources {
                    Some(ResourcesOrError::Ok(r)) => row.extend([
                        format!("{:.0}", r.cpu.usage_pct),
                        format!("{:.0}", r.memory.used_pct),
                        r.gpu.len().to_string(),
                        format!("{:.3}", r.idle_score),
                    ]),
                    Some(ResourcesOrError::Err(e)) => {
                        row.extend(["-", "-", "-", "-"].map(String::from));
                        if note.is_empty() {
                            note = e.error.clone();
                        }
                    }
                    None => row.extend(["-", "-", "-", "-"].map(String::from)),
                }
            }
            row.push(super::cli_words(&note));
            row
        })
        .collect();
    print_table(&header, &rows);
    if !down.is_empty() {
        eprintln!(
            "rsb: {} of {} sandboxes down: {} (rsb doctor says why)",
            down.len(),
            list.sandboxes.len(),
            down.iter()
                .map(|n| rsb::term::shown(n))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    code
}
