//! `rsb grep PATTERN [PATH]`: `search_remote_files` printed as ripgrep prints, with ripgrep's
//! exit codes (0 a match, 1 none, 2 an error), so scripts written for `rg` keep working.

use std::io::{IsTerminal, Write};

use super::search_json::Json;
use super::{Ctx, warn};
use clap::{Args, ValueEnum};
use rsb::error::RsbError;
use rsb::ops::search::{self, Cursor, Printed, Query};
use rsb::term::shown;
use rsb_protocol::{Chunk, SearchEntry, SearchLine, SearchMode};

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

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Sort {
    /// By path (what rsb grep always does; accepted for scripts written for rg).
    Path,
}

#[derive(Debug, Args)]
#[command(
    after_help = "As rg: the first word is the PATTERN and the rest are PATHs (with -e, every \
    word is a PATH); piped, lines print as `path:text` (line numbers with -n), on a terminal \
    grouped under each path with line numbers. Results are always sorted by path. Exit 0: a \
    match; 1: none; 2: an error (a bad flag too)."
)]
pub struct GrepArgs {
    /// PATTERN, then the PATHs searched (relative to the remote home; SANDBOX:PATH picks the
    /// sandbox; none: the home).
    #[arg(value_name = "PATTERN | PATH", allow_hyphen_values = false)]
    pub words: Vec<String>,
    /// A pattern to search for; repeatable: a line matching any matches. Every positional
    /// word is then a PATH.
    #[arg(
        short = 'e',
        long = "regexp",
        value_name = "PATTERN",
        allow_hyphen_values = true
    )]
    pub regexps: Vec<String>,
    /// Match case-insensitively.
    #[arg(short = 'i', long, overrides_with_all = ["case_sensitive", "smart_case"])]
    pub ignore_case: bool,
    /// Case-insensitive when the pattern has no upper-case letter.
    #[arg(short = 'S', long, overrides_with_all = ["case_sensitive", "ignore_case"])]
    pub smart_case: bool,
    /// Match case-sensitively (the default; overrides -i and -S). rg's `-s` is rsb's
    /// `--sandbox`, so only the long form.
    #[arg(long, overrides_with_all = ["ignore_case", "smart_case"])]
    pub case_sensitive: bool,
    /// The patterns are literal strings.
    #[arg(short = 'F', long)]
    pub fixed_strings: bool,
    /// A match must stand as a word (bounded by non-word characters or the line's edges).
    #[arg(short = 'w', long)]
    pub word_regexp: bool,
    /// Select the lines that do not match.
    #[arg(short = 'v', long)]
    pub invert_match: bool,
    /// A match may span lines (`\n` in the pattern matches a line break; `.` still does
    /// not): every line a match touches prints as a match, and -c counts matches.
    #[arg(short = 'U', long)]
    pub multiline: bool,
    /// Include (GLOB) or exclude (!GLOB) files, gitignore syntax with {a,b}; repeatable.
    #[arg(
        short = 'g',
        long = "glob",
        value_name = "GLOB",
        allow_hyphen_values = true
    )]
    pub globs: Vec<String>,
    /// Search only files of this type (rg's names: rust, py, js, ts, go, c, cpp, md, ...; see
    /// --type-list); repeatable.
    #[arg(short = 't', long = "type", value_name = "TYPE")]
    pub types: Vec<String>,
    /// Do not search files of this type; repeatable.
    #[arg(short = 'T', long = "type-not", value_name = "TYPE")]
    pub types_not: Vec<String>,
    /// Print the file types -t knows, with their globs.
    #[arg(long)]
    pub type_list: bool,
    /// Lines of context after each match.
    #[arg(short = 'A', long, value_name = "NUM")]
    pub after_context: Option<i64>,
    /// Lines of context before each match.
    #[arg(short = 'B', long, value_name = "NUM")]
    pub before_context: Option<i64>,
    /// Lines of context before and after each match.
    #[arg(short = 'C', long, value_name = "NUM")]
    pub context: Option<i64>,
    /// Print only the paths of files with matches.
    #[arg(short = 'l', long, conflicts_with = "count")]
    pub files_with_matches: bool,
    /// Print each file's count of matching lines.
    #[arg(short = 'c', long)]
    pub count: bool,
    /// Print nothing; the exit code says whether anything matched.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// Print line numbers (the default on a terminal).
    #[arg(short = 'n', long, overrides_with = "no_line_number")]
    pub line_number: bool,
    /// Print no line numbers.
    #[arg(short = 'N', long, overrides_with = "line_number")]
    pub no_line_number: bool,
    /// Print the path with each line, even when one file is searched.
    #[arg(short = 'H', long, overrides_with = "no_filename")]
    pub with_filename: bool,
    /// Never print the path with a line or count.
    #[arg(short = 'I', long, overrides_with = "with_filename")]
    pub no_filename: bool,
    /// Print each file's path once, above its lines (the default on a terminal).
    #[arg(long, overrides_with = "no_heading")]
    pub heading: bool,
    /// Print the path on every line.
    #[arg(long, overrides_with = "heading")]
    pub no_heading: bool,
    /// Search hidden files and directories (a leading `.`); ignore files still apply.
    #[arg(long)]
    pub hidden: bool,
    /// Search files that .gitignore, .ignore and .rgignore leave out.
    #[arg(long)]
    pub no_ignore: bool,
    /// -u: --no-ignore; -uu: and --hidden (binary files stay skipped).
    #[arg(short = 'u', long = "unrestricted", action = clap::ArgAction::Count)]
    pub unrestricted: u8,
    /// Results are always sorted by path; `--sort path` is accepted.
    #[arg(long, value_enum, value_name = "SORTBY")]
    pub sort: Option<Sort>,
    /// Print at most N entries (matching lines, or files with -l/-c).
    #[arg(long, value_name = "N")]
    pub head_limit: Option<u64>,
    /// Skip the first N entries.
    #[arg(long, default_value_t = 0)]
    pub offset: i64,
    #[arg(long, value_enum, default_value_t = Color::Auto)]
    pub color: Color,
}

impl GrepArgs {
    /// Where the PATH words start: after the pattern, or at the first word with -e.
    fn first_path(&self) -> usize {
        usize::from(self.regexps.is_empty()).min(self.words.len())
    }

    pub fn paths_mut(&mut self) -> &mut [String] {
        let skip = self.first_path();
        &mut self.words[skip..]
    }

    pub fn paths(&self) -> &[String] {
        &self.words[self.first_path()..]
    }
}

/// What the flags ask, checked: the query (without its path) and how lines are printed.
struct Plan {
    query: Query,
    paths: Vec<String>,
    /// Print line numbers; each file's path above its lines; the path with each line.
    numbers: bool,
    heading: bool,
    with_filename: Option<bool>,
    /// Print nothing; stop at the first match.
    quiet: bool,
}

fn plan(a: &GrepArgs, terminal: bool, json: bool) -> Result<Plan, RsbError> {
    if json && (a.files_with_matches || a.count) {
        let flag = if a.count { "-c" } else { "-l" };
        return Err(RsbError::invalid(
            format!("--json cannot be used with {flag}: rg's JSON lines are lines"),
            "drop --json (or -l/-c), as with rg",
        ));
    }
    let patterns: Vec<String> = if a.regexps.is_empty() {
        match a.words.first() {
            Some(p) => vec![p.clone()],
            None => {
                return Err(RsbError::invalid(
                    "no pattern given",
                    "rsb grep PATTERN [PATH ...], or -e PATTERN (repeatable)",
                ));
            }
        }
    } else {
        a.regexps.clone()
    };
    let (pattern, literal) = search::one_pattern(&patterns, a.fixed_strings);
    let ignore_case = a.ignore_case
        || (a.smart_case && !patterns.iter().any(|p| p.chars().any(char::is_uppercase)));
    let mut paths = a.paths().to_vec();
    if paths.is_empty() {
        paths.push(String::new());
    }
    let mode = if a.files_with_matches || a.quiet {
        "files_with_matches"
    } else if a.count {
        "count"
    } else {
        "content"
    };
    let query = Query {
        pattern,
        remote_path: String::new(),
        literal,
        ignore_case,
        globs: a
            .globs
            .iter()
            .flat_map(|g| search::split_globs(g))
            .collect(),
        context: a.context.unwrap_or(0),
        before: a.before_context,
        after: a.after_context,
        output_mode: mode.into(),
        head_limit: 1,
        offset: a.offset,
        no_ignore: a.no_ignore || a.unrestricted >= 1,
        word: a.word_regexp,
        invert: a.invert_match,
        multiline: a.multiline,
        hidden: a.hidden || a.unrestricted >= 2,
        types: search::type_globs(&a.types)?,
        types_not: search::type_globs(&a.types_not)?,
    };
    Ok(Plan {
        query,
        paths,
        // Each pair overrides the other, so at most one is set; neither: a terminal's default.
        numbers: !a.no_line_number && (a.line_number || terminal),
        heading: !a.no_heading && (a.heading || terminal),
        quiet: a.quiet,
        with_filename: (a.with_filename || a.no_filename).then_some(a.with_filename),
    })
}

pub async fn run(ctx: &Ctx, a: GrepArgs) -> u8 {
    if a.type_list {
        let mut out = String::new();
        for (name, globs) in search::TYPES {
            out.push_str(&format!("{name}: {}\n", globs.join(", ")));
        }
        written(std::io::stdout().lock().write_all(out.as_bytes()));
        return exit::MATCH;
    }
    let terminal = std::io::stdout().is_terminal();
    let plan = match plan(&a, terminal, ctx.json) {
        Ok(p) => p,
        Err(e) => return error(&e),
    };
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
        numbers: plan.numbers,
    };
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return error(&e),
    };
    let mut out = std::io::BufWriter::with_capacity(256 * 1024, std::io::stdout().lock());
    let mut printer = Printer {
        look,
        heading: plan.heading && plan.query.output_mode == "content" && !ctx.json,
        last_path: None,
        shown: 0,
        gap: false,
        json: (ctx.json && !plan.quiet).then(Json::new),
    };
    let (mut matched, mut failed) = (false, false);
    let mut left = if plan.quiet { Some(1) } else { a.head_limit };
    for path in &plan.paths {
        let q = Query {
            remote_path: path.clone(),
            ..plan.query.clone()
        };
        let several = plan.paths.len() > 1;
        match one_path(
            ctx,
            &client,
            &q,
            left,
            several,
            &plan,
            &mut printer,
            &mut out,
        )
        .await
        {
            Ok(found) => {
                matched |= found.total > 0;
                failed |= !found.errors.is_empty();
                if let Some(l) = &mut left {
                    *l = l.saturating_sub(found.shown);
                }
            }
            Err(mut e) => {
                if e.message.contains("can match a line break") {
                    e.hint = "-U (--multiline) lets a match span lines, as rg's".into();
                }
                super::fail(false, &e);
                failed = true;
            }
        }
        if left == Some(0) || (plan.quiet && matched) {
            break;
        }
    }
    if let Some(json) = &mut printer.json {
        let mut buf = Vec::new();
        json.finish(&mut buf);
        written(out.write_all(&buf).and_then(|()| out.flush()));
    }
    if failed {
        exit::ERROR
    } else if matched {
        exit::MATCH
    } else {
        exit::NONE
    }
}

/// What one PATH's search found.
struct OnePath {
    total: u64,
    shown: u64,
    errors: Vec<String>,
}

/// Search one PATH and print its result as it streams in.
#[allow(clippy::too_many_arguments)]
async fn one_path(
    ctx: &Ctx,
    client: &rsb::client::AgentClient,
    q: &Query,
    limit: Option<u64>,
    several: bool,
    plan: &Plan,
    printer: &mut Printer,
    out: &mut dyn Write,
) -> Result<OnePath, RsbError> {
    let req = search::streamed(q, limit, printer.look.colour || ctx.json)?;
    // One walk: the entries arrive in batches as the agent reads them and are printed as they
    // come, a batch per write.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Chunk>(4);
    let call = client.call_streaming(req.clone(), tx);
    tokio::pin!(call);
    let mut cursor = Cursor::default();
    let context = req.before > 0 || req.after > 0;
    let start = printer.shown;
    let mut print = |entries: &[SearchEntry], out: &mut dyn Write| {
        printer.shown += entries.len() as u64;
        if plan.quiet {
            return;
        }
        let lines = search::printed_after(&q.remote_path, req.mode, entries, context, &mut cursor);
        // One file searched (its entries have no path of their own): rg prints no path.
        let one_file = !several && entries.first().is_some_and(|e| e.path.is_empty());
        let bare = !plan.with_filename.unwrap_or(!one_file);
        let mut buf = Vec::new();
        for p in &lines {
            match &mut printer.json {
                Some(json) => json.line(p, &mut buf),
                None => printer.human(p, bare, &mut buf),
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
                        print(&entries, out);
                    }
                }
                break r;
            }
            Some(c) = rx.recv() => {
                if let Chunk::Search(entries) = c {
                    print(&entries, out);
                }
            }
        }
    };
    let found = result?;
    let shown = printer.shown - start;
    for e in &found.errors {
        warn(e);
    }
    let more = found.total.saturating_sub(req.offset).saturating_sub(shown);
    if plan.quiet {
        // -q: the exit code is the whole answer.
    } else {
        let of = if several {
            format!(" in {}", shown_or_home(&q.remote_path))
        } else {
            String::new()
        };
        if more > 0 {
            warn(&format!(
                "{more} more {}{of}; --offset {} continues",
                if req.mode == SearchMode::Content {
                    "matching lines"
                } else {
                    "files"
                },
                req.offset + shown
            ));
        }
        if !found.complete {
            warn(&format!(
                "the search{of} stopped at its 30 s deadline: counts are lower bounds; narrow PATH or -g"
            ));
        }
        // rg skips binary files silently; with nothing found, say why a named one was.
        if found.total == 0 && found.skipped_binary > 0 {
            let n = found.skipped_binary;
            warn(&format!(
                "{n} binary file{} (a NUL byte) not searched{of}",
                if n == 1 { "" } else { "s" }
            ));
        }
    }
    Ok(OnePath {
        total: found.total,
        shown,
        errors: found.errors,
    })
}

fn shown_or_home(path: &str) -> &str {
    if path.is_empty() { "~" } else { path }
}

/// A failed write to stdout is its reader gone (`rsb grep … | head -1`): exit as a writer
/// killed by SIGPIPE would, as rg does.
fn written(r: std::io::Result<()>) {
    if r.is_err() {
        std::process::exit(i32::from(super::exit::PIPE));
    }
}

/// An error, on stderr as rg prints it (with --json too: stdout holds rg's messages only).
fn error(e: &RsbError) -> u8 {
    super::fail(false, e);
    exit::ERROR
}

/// How a line is printed: coloured, escaped for a terminal, with its line number.
#[derive(Clone, Copy)]
struct Look {
    colour: bool,
    escape: bool,
    numbers: bool,
}

/// Prints the result of every PATH: with a heading, a file's path once above its lines and a
/// blank line between files, as rg on a terminal.
struct Printer {
    look: Look,
    heading: bool,
    /// The path whose heading was printed last.
    last_path: Option<String>,
    /// Entries printed so far.
    shown: u64,
    /// A `--` waits for the line after it.
    gap: bool,
    /// `--json`: rg's JSON lines instead.
    json: Option<Json>,
}

impl Printer {
    fn human(&mut self, p: &Printed, bare: bool, buf: &mut Vec<u8>) {
        if !self.heading {
            return human(p, self.look, bare, buf);
        }
        match p {
            // Held until the next line: between files the heading separates, not `--`.
            Printed::Gap => self.gap = true,
            Printed::Line { path, .. } => {
                let gap = std::mem::take(&mut self.gap);
                if self.last_path.as_deref() != Some(path.as_str()) {
                    if self.last_path.is_some() {
                        buf.push(b'\n');
                    }
                    if !bare {
                        human(&Printed::Path(path.clone()), self.look, false, buf);
                    }
                    self.last_path = Some(path.clone());
                } else if gap {
                    human(&Printed::Gap, self.look, true, buf);
                }
                human(p, self.look, true, buf);
            }
            _ => human(p, self.look, bare, buf),
        }
    }
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
            ..
        } => {
            let sep = if *is_match { ':' } else { '-' };
            if !bare {
                buf.extend_from_slice(format!("{}{sep}", paint("35", &shown(path))).as_bytes());
            }
            if look.numbers {
                let number = paint("32", &line.number.to_string());
                buf.extend_from_slice(format!("{number}{sep}").as_bytes());
            }
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
