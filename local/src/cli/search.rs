//! `rsb grep PATTERN [PATH]`: `search_remote_files` printed as ripgrep prints, with ripgrep's
//! exit codes (0 a match, 1 none, 2 an error), so scripts written for `rg` keep working.

use std::io::{IsTerminal, Write};

use clap::{Args, ValueEnum};
use rsb::error::RsbError;
use rsb::ops::search::{self, Cursor, Printed, Query};
use rsb::term::shown;
use rsb_protocol::{Chunk, SearchEntry, SearchLine, SearchMode};
use serde_json::json;

use super::{Ctx, warn};

/// ripgrep's exit codes.
pub mod exit {
    pub const MATCH: u8 = 0;
    pub const NONE: u8 = 1;
    pub const ERROR: u8 = 2;
}

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
    /// Line numbers: always printed (accepted for rg's habit; rsb grep prints as `rg -n`).
    #[arg(short = 'n', long)]
    pub line_number: bool,
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
        head_limit: 1,
        offset: a.offset,
        no_ignore: a.no_ignore,
    };
    let req = match search::streamed(&q, a.head_limit, colour || ctx.json) {
        Ok(r) => r,
        Err(e) => return error(ctx.json, &e),
    };
    // One walk: the entries arrive in batches as the agent reads them and are printed as they
    // come, a batch per write.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Chunk>(4);
    let call = client.call_streaming(req.clone(), tx);
    tokio::pin!(call);
    let mut out = std::io::BufWriter::with_capacity(256 * 1024, std::io::stdout().lock());
    let mut cursor = Cursor::default();
    let mut shown = 0u64;
    let mut print = |entries: &[SearchEntry], out: &mut dyn Write| {
        shown += entries.len() as u64;
        let lines = search::printed_after(&a.path, req.mode, entries, req.context > 0, &mut cursor);
        // One file searched (its entries have no path of their own): rg prints no path.
        let bare = entries.first().is_some_and(|e| e.path.is_empty());
        let mut buf = Vec::new();
        for p in &lines {
            if ctx.json {
                if let Some(v) = json_line(p) {
                    buf.extend_from_slice(v.to_string().as_bytes());
                    buf.push(b'\n');
                }
            } else {
                human(p, look, bare, &mut buf);
            }
        }
        written(out.write_all(&buf).and_then(|()| out.flush()));
    };
    let result = loop {
        tokio::select! {
            r = &mut call => {
                // Batches sent before the reply are queued already.
                while let Ok(c) = rx.try_recv() {
                    if let Chunk::Search(entries) = c {
                        print(&entries, &mut out);
                    }
                }
                break r;
            }
            Some(c) = rx.recv() => {
                if let Chunk::Search(entries) = c {
                    print(&entries, &mut out);
                }
            }
        }
    };
    let found = match result {
        Ok(r) => r,
        Err(e) => return error(ctx.json, &e),
    };
    for e in &found.errors {
        warn(e);
    }
    let more = found.total.saturating_sub(req.offset).saturating_sub(shown);
    if ctx.json {
        let summary = json!({"type": "summary", "total": found.total, "files_matched": found.files_matched,
            "more": more, "complete": found.complete,
            "skipped_binary": found.skipped_binary, "skipped_large": found.skipped_large,
            "skipped_slow_lines": found.skipped_slow_lines});
        written(writeln!(out, "{summary}").and_then(|()| out.flush()));
    } else {
        if more > 0 {
            warn(&format!(
                "{more} more {}; --offset {} continues",
                if req.mode == SearchMode::Content {
                    "matching lines"
                } else {
                    "files"
                },
                req.offset + shown
            ));
        }
        if !found.complete {
            warn(
                "the search stopped at its 30 s deadline: counts are lower bounds; narrow PATH or -g",
            );
        }
        // rg skips binary files silently; with nothing found, say why a named one was.
        if found.total == 0 && found.skipped_binary > 0 {
            let n = found.skipped_binary;
            warn(&format!(
                "{n} binary file{} (a NUL byte) not searched",
                if n == 1 { "" } else { "s" }
            ));
        }
    }
    if !found.errors.is_empty() {
        exit::ERROR
    } else if found.total > 0 {
        exit::MATCH
    } else {
        exit::NONE
    }
}

/// A failed write to stdout is its reader gone (`rsb grep … | head -1`): exit as a writer
/// killed by SIGPIPE would, as rg does.
fn written(r: std::io::Result<()>) {
    if r.is_err() {
        std::process::exit(i32::from(super::exit::PIPE));
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

/// One printed line, with its newline, appended to `buf`. Piped and uncoloured, a line's own
/// bytes are printed (as rg prints them: a `\r`, bytes that are not UTF-8).
/// `bare`: a line or count is printed without its path (one file searched, as rg does).
fn human(p: &Printed, look: Look, bare: bool, buf: &mut Vec<u8>) {
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
            if !bare {
                buf.extend_from_slice(format!("{}{sep}", paint("35", &shown(path))).as_bytes());
            }
            let number = paint("32", &line.number.to_string());
            buf.extend_from_slice(format!("{number}{sep}").as_bytes());
            match &line.raw {
                Some(raw) if !look.escape && !colour => buf.extend_from_slice(raw),
                _ => buf.extend_from_slice(painted_text(line, look).as_bytes()),
            }
            if line.cut > 0 {
                buf.extend_from_slice(format!(" […{} more bytes]", line.cut).as_bytes());
            }
        }
        Printed::Gap => buf.extend_from_slice(b"--"),
        Printed::Path(path) => buf.extend_from_slice(paint("35", &shown(path)).as_bytes()),
        Printed::Count(_, n) if bare => buf.extend_from_slice(n.to_string().as_bytes()),
        Printed::Count(path, n) => {
            buf.extend_from_slice(format!("{}:{n}", paint("35", &shown(path))).as_bytes());
        }
    }
    buf.push(b'\n');
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
