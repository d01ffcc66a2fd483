//! `rsb grep PATTERN [PATH]`: `search_remote_files` printed as ripgrep prints, with ripgrep's
//! exit codes (0 a match, 1 none, 2 an error), so scripts written for `rg` keep working.

use std::io::IsTerminal;

use clap::{Args, ValueEnum};
use rsb::error::RsbError;
use rsb::ops::search::{self, Printed, Query};
use rsb::term::shown;
use rsb_protocol::{SearchLine, SearchMode};
use serde_json::json;

use super::{Ctx, out_line, warn};

/// ripgrep's exit codes.
pub mod exit {
    pub const MATCH: u8 = 0;
    pub const NONE: u8 = 1;
    pub const ERROR: u8 = 2;
}

/// Entries asked per round trip; a larger result takes one walk per page.
const PAGE: i64 = search::MAX_HEAD_LIMIT;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Color {
    Auto,
    Always,
    Never,
}

#[derive(Debug, Args)]
pub struct GrepArgs {
    /// A regex (Rust syntax; \w, \d and case folding are ASCII), matched per line.
    pub pattern: String,
    /// A directory or file, relative to the remote home (SANDBOX:PATH picks the sandbox).
    #[arg(default_value = "")]
    pub path: String,
    /// Match case-insensitively.
    #[arg(short = 'i', long)]
    pub ignore_case: bool,
    /// The pattern is a literal string.
    #[arg(short = 'F', long)]
    pub fixed_strings: bool,
    /// Include (GLOB) or exclude (!GLOB) files, gitignore syntax with {a,b}; repeatable.
    #[arg(short = 'g', long = "glob", value_name = "GLOB")]
    pub globs: Vec<String>,
    /// Lines of context around each match.
    #[arg(short = 'C', long, default_value_t = 0)]
    pub context: i64,
    /// Print only the paths of files with matches.
    #[arg(short = 'l', long, conflicts_with = "count")]
    pub files_with_matches: bool,
    /// Print each file's count of matching lines.
    #[arg(short = 'c', long)]
    pub count: bool,
    /// Search files that .gitignore, .ignore and .rgignore leave out.
    #[arg(long)]
    pub no_ignore: bool,
    /// Print at most N entries (matching lines, or files with -l/-c).
    #[arg(long, value_name = "N")]
    pub head_limit: Option<u64>,
    /// Skip the first N entries.
    #[arg(long, default_value_t = 0)]
    pub offset: i64,
    #[arg(long, value_enum, default_value_t = Color::Auto)]
    pub color: Color,
}

pub async fn run(ctx: &Ctx, a: GrepArgs) -> u8 {
    let mode = if a.files_with_matches {
        "files_with_matches"
    } else if a.count {
        "count"
    } else {
        "content"
    };
    let terminal = std::io::stdout().is_terminal();
    let colour = match a.color {
        Color::Always => true,
        Color::Never => false,
        Color::Auto => terminal && std::env::var_os("NO_COLOR").is_none(),
    };
    // On a terminal, remote text is escaped (a name or line holding an escape sequence must
    // not act on it); piped, the bytes are printed as they are, as rg prints them.
    let look = Look {
        colour,
        escape: terminal,
    };
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return error(ctx.json, &e),
    };
    let mut offset = a.offset;
    let mut left = a.head_limit.unwrap_or(u64::MAX);
    let mut matched = false;
    let mut errors = false;
    loop {
        let q = Query {
            pattern: a.pattern.clone(),
            remote_path: a.path.clone(),
            literal: a.fixed_strings,
            ignore_case: a.ignore_case,
            globs: a
                .globs
                .iter()
                .flat_map(|g| search::split_globs(g))
                .collect(),
            context: a.context,
            output_mode: mode.into(),
            head_limit: left.min(PAGE as u64) as i64,
            offset,
            no_ignore: a.no_ignore,
        };
        let req = match search::request(&q) {
            Ok(r) => r,
            Err(e) => return error(ctx.json, &e),
        };
        let found = match client.call(req.clone()).await {
            Ok(r) => search::reply(&q, &req, r),
            Err(e) => return error(ctx.json, &e),
        };
        matched |= found.total > 0;
        for e in &found.errors {
            errors = true;
            warn(e);
        }
        let context = req.context > 0;
        let lines = search::printed(&a.path, req.mode, &found.entries, context);
        if ctx.json {
            for p in &lines {
                if let Some(v) = json_line(p) {
                    out_line(&v.to_string());
                }
            }
        } else {
            if context && offset > a.offset && !lines.is_empty() {
                out_line("--");
            }
            for p in &lines {
                out_line(&human(p, look));
            }
        }
        left = left.saturating_sub(found.shown);
        offset += found.shown as i64;
        let done = found.more == 0 || left == 0 || found.shown == 0;
        if done {
            if ctx.json {
                out_line(
                    &json!({"type": "summary", "total": found.total, "files_matched": found.files_matched,
                        "more": found.more, "complete": found.complete,
                        "skipped_binary": found.skipped_binary, "skipped_large": found.skipped_large,
                        "skipped_slow_lines": found.skipped_slow_lines})
                    .to_string(),
                );
            } else {
                if found.more > 0 {
                    warn(&format!(
                        "{} more {}; --offset {offset} continues",
                        found.more,
                        if req.mode == SearchMode::Content {
                            "matching lines"
                        } else {
                            "files"
                        }
                    ));
                }
                if !found.complete {
                    warn(
                        "the search stopped at its 30 s deadline: counts are lower bounds; narrow PATH or -g",
                    );
                }
            }
            break;
        }
    }
    if errors {
        exit::ERROR
    } else if matched {
        exit::MATCH
    } else {
        exit::NONE
    }
}

fn error(json: bool, e: &RsbError) -> u8 {
    super::fail(json, e);
    exit::ERROR
}

/// How a line is printed: coloured, and escaped for a terminal.
#[derive(Clone, Copy)]
struct Look {
    colour: bool,
    escape: bool,
}

/// ripgrep's colours: path magenta, line number green, match bold red.
/// Remote text as `look` prints it: escaped for a terminal, else its bytes.
fn text(s: &str, look: Look) -> std::borrow::Cow<'_, str> {
    if look.escape { shown(s) } else { s.into() }
}

fn human(p: &Printed, look: Look) -> String {
    let colour = look.colour;
    let shown = |s: &str| text(s, look).into_owned();
    let paint = |code: &str, s: &str| {
        if colour {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    };
    match p {
        Printed::Line {
            path,
            line,
            is_match,
        } => {
            let sep = if *is_match { ':' } else { '-' };
            let cut = if line.cut > 0 {
                format!(" […{} more bytes]", line.cut)
            } else {
                String::new()
            };
            format!(
                "{}{sep}{}{sep}{}{cut}",
                paint("35", &shown(path)),
                paint("32", &line.number.to_string()),
                painted_text(line, look)
            )
        }
        Printed::Gap => "--".into(),
        Printed::Path(path) => paint("35", &shown(path)),
        Printed::Count(path, n) => format!("{}:{n}", paint("35", &shown(path))),
    }
}

/// The line's text, escaped for the terminal segment by segment so the match ranges (byte
/// offsets in the raw text) still fall where they belong.
fn painted_text(line: &SearchLine, look: Look) -> String {
    let shown = |s: &str| text(s, look).into_owned();
    if !look.colour || line.matches.is_empty() {
        return shown(&line.text);
    }
    let t = &line.text;
    let mut out = String::new();
    let mut at = 0usize;
    for &(s, e) in &line.matches {
        let (s, e) = (s as usize, e as usize);
        if s < at || e > t.len() || !t.is_char_boundary(s) || !t.is_char_boundary(e) {
            continue;
        }
        out.push_str(&shown(&t[at..s]));
        out.push_str(&format!("\x1b[1;31m{}\x1b[0m", shown(&t[s..e])));
        at = e;
    }
    out.push_str(&shown(&t[at..]));
    out
}

/// ripgrep-like JSON lines: the exact text (JSON escapes what a terminal would act on).
fn json_line(p: &Printed) -> Option<serde_json::Value> {
    Some(match p {
        Printed::Line {
            path,
            line,
            is_match,
        } => json!({
            "type": if *is_match { "match" } else { "context" },
            "path": path, "line": line.number, "text": line.text,
            "cut_bytes": line.cut, "matches": line.matches,
        }),
        Printed::Gap => return None,
        Printed::Path(path) => json!({"type": "file", "path": path}),
        Printed::Count(path, n) => json!({"type": "count", "path": path, "count": n}),
    })
}
