//! `rsb audit`: the audit log's lines, filtered (see `rsb::audit`).

use rsb::{error::RsbError, term::shown};

use super::{Ctx, fail, print_json};

pub fn run(ctx: &Ctx, since: Option<&str>, grep: Option<&str>) -> u8 {
    let since = match since {
        None => None,
        Some(s) => match rsb::audit::parse_since(s) {
            Some(secs) => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                Some(rsb::store::transfers::utc_stamp(
                    now.saturating_sub(secs) as f64
                ))
            }
            None => {
                return fail(
                    ctx.json,
                    &RsbError::invalid(
                        format!("--since '{s}' is not a duration"),
                        "use a number and s, m, h or d: --since 2h",
                    ),
                );
            }
        },
    };
    let sandbox = (!ctx.sandbox.is_empty()).then_some(ctx.sandbox.as_str());
    let lines = match rsb::audit::read(&ctx.app.config().state_dir, sandbox, since.as_deref(), grep)
    {
        Ok(l) => l,
        Err(e) => {
            return fail(
                ctx.json,
                &RsbError::internal(format!("cannot read the audit log: {e}")),
            );
        }
    };
    for v in &lines {
        if ctx.json {
            print_json(v);
        } else {
            // Every field may hold the model's or a host's text (a path with a newline, an
            // error quoting remote output): escaped, so no line can forge another row or
            // reach the terminal as an escape sequence.
            let s = |k: &str| shown(v[k].as_str().unwrap_or_default()).into_owned();
            let code = match (v["exit_code"].as_i64(), v["detail"]["policy"].as_str()) {
                (Some(c), _) => format!("exit {c}"),
                (None, Some(p)) => format!("policy {p}"),
                (None, None) if v["event"] == "start" => "started".to_string(),
                (None, None) => s("error"),
            };
            super::out_line(&format!(
                "{}  {}  {}  {}  {}  {}",
                s("time"),
                s("sandbox"),
                s("origin"),
                s("tool"),
                code,
                s("command").escape_default()
            ));
        }
    }
    0
}

/// `rsb audit verify`: where the hash chain breaks, if it does.
pub fn verify(ctx: &Ctx) -> u8 {
    let v = match rsb::audit::verify(&ctx.app.config().state_dir) {
        Ok(v) => v,
        Err(e) => {
            return fail(
                ctx.json,
                &RsbError::internal(format!("cannot read the audit log: {e}")),
            );
        }
    };
    if ctx.json {
        print_json(&serde_json::json!({
            "ok": v.broken.is_none(),
            "files": v.files,
            "lines": v.lines,
            "unchained": v.unchained,
            "broken": v.broken.as_ref().map(|b| serde_json::json!({
                "file": b.file.display().to_string(),
                "line": b.line,
                "why": b.why,
            })),
        }));
    } else {
        match &v.broken {
            None => super::out_line(&format!(
                "audit log intact: {} lines in {} files{}",
                v.lines,
                v.files,
                if v.unchained > 0 {
                    format!(" ({} written before the chain, not checked)", v.unchained)
                } else {
                    String::new()
                }
            )),
            Some(b) => eprintln!(
                "rsb: the audit log's chain breaks at {} line {}: {}",
                shown(&b.file.display().to_string()),
                b.line,
                b.why
            ),
        }
    }
    if v.broken.is_some() {
        super::exit::CONFLICTS
    } else {
        super::exit::OK
    }
}
