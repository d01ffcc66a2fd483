//! `search_remote_files` and `rsb grep`: ripgrep's contract (what is searched, how a result
//! reads), one page at a time with an exact count of what is left (the MCP tool), or the
//! whole result from one walk, streamed in batches as the agent reads it (`rsb grep`).
//!
//! Paths are printed as `rg PATTERN DIR` prints them: joined to the `remote_path` the caller
//! gave, so every path in a reply can be passed to `read_remote_file` as it is.

use rsb_protocol::{SearchEntry, SearchLine, SearchMode, SearchRequest, SearchResult};
use serde::Serialize;

use crate::error::{Result, RsbError};

pub const DEFAULT_HEAD_LIMIT: i64 = 100;
/// One page stays well inside a frame and a model's context.
pub const MAX_HEAD_LIMIT: i64 = 5_000;
pub const MAX_CONTEXT: i64 = 20;
/// Files larger than this are skipped (ripgrep has no default cap; minified bundles and data
/// dumps are what it would spend its time on).
pub const MAX_FILESIZE: u64 = 16 * 1024 * 1024;
/// Text kept of one line.
pub const MAX_LINE_BYTES: u32 = 500;
/// The printed page is cut at an entry boundary past this (the "N more" marker stays exact).
pub const MAX_OUTPUT_BYTES: usize = 64 * 1024;
/// The walk answers with what it has after this long.
pub const DEADLINE_MS: u64 = 30_000;

/// What a caller asks, in the tool's words.
#[derive(Debug, Clone, Default)]
pub struct Query {
    pub pattern: String,
    pub remote_path: String,
    pub literal: bool,
    pub ignore_case: bool,
    pub globs: Vec<String>,
    pub context: i64,
    /// Lines before and after each match, where they differ from `context` (`rg -B`, `-A`).
    pub before: Option<i64>,
    pub after: Option<i64>,
    /// `content`, `files_with_matches` or `count`.
    pub output_mode: String,
    pub head_limit: i64,
    pub offset: i64,
    pub no_ignore: bool,
    /// `rg -w`, `-v`, `--hidden`, `-U`.
    pub word: bool,
    pub invert: bool,
    pub hidden: bool,
    pub multiline: bool,
    /// File-name globs of the file types searched (`rg -t`) and left out (`rg -T`).
    pub types: Vec<String>,
    pub types_not: Vec<String>,
}

/// The `glob` parameter as ripgrep `-g` globs: separated by whitespace, with `{a,b}`
/// alternatives expanded (the agent's gitignore engine has no braces; ripgrep's globs do).
pub fn split_globs(s: &str) -> Vec<String> {
    s.split_whitespace().flat_map(expand_braces).collect()
}

/// `*.{ts,tsx}` → `*.ts`, `*.tsx`; nested and repeated groups too; an unclosed `{` or an
/// escaped one stays literal. Bounded: a glob that would expand past 256 forms is kept as is.
fn expand_braces(glob: &str) -> Vec<String> {
    let b = glob.as_bytes();
    let mut open = None;
    let mut depth = 0;
    let mut commas = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 1,
            b'{' => {
                if depth == 0 {
                    open = Some(i);
                    commas.clear();
                }
                depth += 1;
            }
            b',' if depth == 1 => commas.push(i),
            b'}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    let start = open.unwrap_or(0);
                    let (head, tail) = (&glob[..start], &glob[i + 1..]);
                    let mut bounds = vec![start];
                    bounds.extend(&commas);
                    bounds.push(i);
                    let mut out = Vec::new();
                    for w in bounds.windows(2) {
                        let alt = &glob[w[0] + 1..w[1]];
                        for rest in expand_braces(&format!("{alt}{tail}")) {
                            out.push(format!("{head}{rest}"));
                            if out.len() > 256 {
                                return vec![glob.to_string()];
                            }
                        }
                    }
                    return out;
                }
            }
            _ => {}
        }
        i += 1;
    }
    vec![glob.to_string()]
}

/// The globs of types rg knows by two names.
const MARKDOWN: &[&str] = &[
    "*.markdown",
    "*.md",
    "*.mdown",
    "*.mdwn",
    "*.mkd",
    "*.mkdn",
    "*.mdx",
];
const PYTHON: &[&str] = &["*.py", "*.pyi"];
const TYPESCRIPT: &[&str] = &["*.cts", "*.mts", "*.ts", "*.tsx"];

/// ripgrep's file types (`rg -t NAME`) that code and data trees hold, with rg 14's globs.
pub const TYPES: &[(&str, &[&str])] = &[
    ("asm", &["*.S", "*.asm", "*.s"]),
    ("c", &["*.[chH]", "*.[chH].in", "*.cats"]),
    ("cmake", &["*.cmake", "CMakeLists.txt"]),
    ("config", &["*.cfg", "*.conf", "*.config", "*.ini"]),
    (
        "cpp",
        &[
            "*.[ChH]",
            "*.[ChH].in",
            "*.[ch]pp",
            "*.[ch]pp.in",
            "*.[ch]xx",
            "*.[ch]xx.in",
            "*.cc",
            "*.cc.in",
            "*.hh",
            "*.hh.in",
            "*.inl",
        ],
    ),
    ("cs", &["*.cs"]),
    ("css", &["*.css", "*.scss"]),
    ("csv", &["*.csv"]),
    ("cuda", &["*.cu", "*.cuh"]),
    ("docker", &["*Dockerfile*"]),
    ("go", &["*.go"]),
    ("h", &["*.h", "*.hh", "*.hpp"]),
    ("html", &["*.ejs", "*.htm", "*.html"]),
    ("java", &["*.java", "*.jsp", "*.jspx", "*.properties"]),
    ("js", &["*.cjs", "*.js", "*.jsx", "*.mjs", "*.vue"]),
    ("json", &["*.json", "composer.lock", "*.sarif"]),
    ("jsonl", &["*.jsonl"]),
    ("julia", &["*.jl"]),
    ("jupyter", &["*.ipynb", "*.jpynb"]),
    ("kotlin", &["*.kt", "*.kts"]),
    ("lock", &["*.lock", "package-lock.json"]),
    ("lua", &["*.lua"]),
    (
        "make",
        &[
            "*.mak",
            "*.mk",
            "[Gg][Nn][Uu]makefile",
            "[Gg][Nn][Uu]makefile.am",
            "[Gg][Nn][Uu]makefile.in",
            "[Mm]akefile",
            "[Mm]akefile.am",
            "[Mm]akefile.in",
        ],
    ),
    ("markdown", MARKDOWN),
    ("md", MARKDOWN),
    ("nix", &["*.nix"]),
    ("php", &["*.php", "*.php3", "*.php4", "*.php5", "*.phtml"]),
    ("protobuf", &["*.proto"]),
    ("py", PYTHON),
    ("python", PYTHON),
    ("r", &["*.R", "*.Rmd", "*.Rnw", "*.r"]),
    (
        "ruby",
        &[
            "*.gemspec",
            "*.rb",
            "*.rbw",
            ".irbrc",
            "Gemfile",
            "Rakefile",
            "config.ru",
        ],
    ),
    ("rust", &["*.rs"]),
    ("scala", &["*.sbt", "*.scala"]),
    (
        "sh",
        &[
            "*.bash", "*.bashrc", "*.csh", "*.ksh", "*.sh", "*.tcsh", "*.zsh", ".bashrc",
            ".profile", ".zshrc",
        ],
    ),
    ("sql", &["*.psql", "*.sql"]),
    ("swift", &["*.swift"]),
    (
        "tex",
        &[
            "*.bib", "*.cls", "*.dtx", "*.ins", "*.ltx", "*.sty", "*.tex",
        ],
    ),
    ("toml", &["*.toml", "Cargo.lock"]),
    ("ts", TYPESCRIPT),
    ("typescript", TYPESCRIPT),
    ("txt", &["*.txt"]),
    ("vim", &["*.vim", ".vimrc", "vimrc"]),
    (
        "xml",
        &[
            "*.dtd",
            "*.rng",
            "*.sch",
            "*.xhtml",
            "*.xjb",
            "*.xml",
            "*.xml.dist",
            "*.xsd",
            "*.xsl",
            "*.xslt",
        ],
    ),
    ("yaml", &["*.yaml", "*.yml"]),
    ("zig", &["*.zig"]),
];

/// The globs of the file types named (`rg -t rust -t py`); an unknown name is an error that
/// lists the known ones.
pub fn type_globs(names: &[String]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for n in names {
        let Some((_, globs)) = TYPES.iter().find(|(t, _)| t == n) else {
            let known: Vec<&str> = TYPES.iter().map(|(t, _)| *t).collect();
            return Err(RsbError::invalid(
                format!("unrecognized file type: {n}"),
                format!(
                    "known types: {}; or select files with -g GLOB",
                    known.join(", ")
                ),
            ));
        };
        out.extend(globs.iter().map(|g| g.to_string()));
    }
    Ok(out)
}

/// Several patterns (`rg -e A -e B`) as one: a line matching any matches. Literal patterns
/// are escaped; one pattern is passed as it is (a literal keeps its fast path).
/// Returns the pattern and whether it is literal.
pub fn one_pattern(patterns: &[String], literal: bool) -> (String, bool) {
    if let [one] = patterns {
        return (one.clone(), literal);
    }
    let alts: Vec<String> = patterns
        .iter()
        .map(|p| {
            if literal {
                regex_escape(p)
            } else {
                format!("(?:{p})")
            }
        })
        .collect();
    (alts.join("|"), false)
}

/// `text` as a regex that matches it literally.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

pub fn mode_of(name: &str) -> Result<SearchMode> {
    match name {
        "" | "content" => Ok(SearchMode::Content),
        "files_with_matches" | "files" => Ok(SearchMode::Files),
        "count" => Ok(SearchMode::Count),
        other => Err(RsbError::invalid(
            format!("unknown output_mode {other:?}"),
            "use content, files_with_matches or count",
        )),
    }
}

pub fn request(q: &Query) -> Result<SearchRequest> {
    if q.pattern.is_empty() {
        return Err(RsbError::invalid(
            "pattern cannot be empty",
            "pass a regex (Rust syntax), or literal=true for plain text",
        ));
    }
    if q.remote_path.contains('\0') || q.pattern.contains('\0') {
        return Err(RsbError::invalid(
            "pattern or remote_path contains a NUL byte",
            "binary files are skipped; search text",
        ));
    }
    if !(1..=MAX_HEAD_LIMIT).contains(&q.head_limit) {
        return Err(RsbError::invalid(
            format!(
                "head_limit must be between 1 and {MAX_HEAD_LIMIT} (got {})",
                q.head_limit
            ),
            "page through a large result with offset",
        ));
    }
    if q.offset < 0 {
        return Err(RsbError::invalid(
            format!("offset must be 0 or more (got {})", q.offset),
            "offset is the number of entries to skip",
        ));
    }
    for (name, n) in [
        ("context", Some(q.context)),
        ("before", q.before),
        ("after", q.after),
    ] {
        let Some(n) = n else { continue };
        if !(0..=MAX_CONTEXT).contains(&n) {
            return Err(RsbError::invalid(
                format!("{name} must be between 0 and {MAX_CONTEXT} lines (got {n})"),
                "read more around a match with read_remote_file(offset, limit)",
            ));
        }
    }
    Ok(SearchRequest {
        root: rsb_rules::path::anchor_home(&q.remote_path),
        pattern: q.pattern.clone(),
        literal: q.literal,
        ignore_case: q.ignore_case,
        globs: q.globs.clone(),
        before: q.before.unwrap_or(q.context) as u32,
        after: q.after.unwrap_or(q.context) as u32,
        word: q.word,
        invert: q.invert,
        multiline: q.multiline,
        hidden: q.hidden,
        types: q.types.clone(),
        types_not: q.types_not.clone(),
        mode: mode_of(&q.output_mode)?,
        offset: q.offset as u64,
        limit: q.head_limit as u64,
        no_ignore: q.no_ignore,
        max_filesize: MAX_FILESIZE,
        max_line_bytes: MAX_LINE_BYTES,
        deadline_ms: DEADLINE_MS,
        stream: false,
        // The tool's text tells a match from context by its separator only.
        ranges: false,
        confine: None,
    })
}

/// Longest text kept of one line in a streamed result: rg prints whole lines, and a line this
/// long (a minified bundle's) is printed cut with its count of bytes left out. 41 such lines
/// (a match and 20 of context each side) still fit one frame.
pub const STREAM_LINE_BYTES: u32 = 256 * 1024;

/// `rsb grep`'s request: the whole result from `q.offset` (at most `limit` entries, all when
/// `None`), streamed from one walk. `q.head_limit` is not used.
/// `ranges`: the printer colours matches or prints them as JSON.
pub fn streamed(q: &Query, limit: Option<u64>, ranges: bool) -> Result<SearchRequest> {
    let mut req = request(&Query {
        head_limit: 1,
        ..q.clone()
    })?;
    req.limit = limit.unwrap_or(u64::MAX);
    req.stream = true;
    req.ranges = ranges;
    req.max_line_bytes = STREAM_LINE_BYTES;
    Ok(req)
}

/// The reply: the page as ripgrep would print it, and the counts a caller pages by.
#[derive(Debug, Clone, Serialize)]
pub struct Found {
    /// `path:line:text` (content; context lines `path-line-text`, `--` between groups),
    /// `path` (files_with_matches) or `path:count` (count), one per line; then, when entries
    /// remain, a last line `[N more …; offset=K]`.
    pub output: String,
    /// Entries in the whole result (matching lines, or files).
    pub total: u64,
    /// Entries in `output`.
    pub shown: u64,
    /// Entries after this page; `offset + shown` continues.
    pub more: u64,
    pub files_matched: u64,
    /// False when the walk hit its deadline: counts are then lower bounds.
    pub complete: bool,
    #[serde(skip_serializing_if = "is_zero")]
    pub skipped_binary: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub skipped_large: u64,
    /// Long lines the pattern was too costly to match on (`errors` names them).
    #[serde(skip_serializing_if = "is_zero")]
    pub skipped_slow_lines: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `remote_path` as a prefix of printed paths (`rg pat dir` prints `dir/x`).
fn prefix_of(remote_path: &str) -> String {
    let t = remote_path.trim();
    if t.is_empty() {
        return String::new();
    }
    if t == "." || t == "./" {
        return "./".into();
    }
    format!("{}/", t.trim_end_matches('/'))
}

/// The printed path of an entry; a root that is a file prints as given.
pub fn shown_path(remote_path: &str, e: &SearchEntry) -> String {
    if e.path.is_empty() {
        return remote_path.trim().to_string();
    }
    format!("{}{}", prefix_of(remote_path), e.path)
}

/// One printed line of the page, before colour: for the CLI to colour, and for `output`.
#[derive(Debug, Clone, PartialEq)]
pub enum Printed<'a> {
    Line {
        path: String,
        line: &'a SearchLine,
        is_match: bool,
        /// The file's size as searched ([`SearchEntry::file_bytes`]).
        file_bytes: u64,
    },
    /// `--`: a gap between context groups.
    Gap,
    Path(String),
    Count(String, u64),
}

/// Where printed output stands: the file and line printed last. A streamed result arrives in
/// batches, and a file's lines may span two: with the cursor they print as one (no line
/// twice, `--` only between groups that do not touch).
#[derive(Debug, Default)]
pub struct Cursor {
    last: Option<(String, u64)>,
}

/// The page as ripgrep prints it: in content mode each file's lines in order, a line shown
/// once even when it is context of two matches, `--` between groups that do not touch.
pub fn printed<'a>(
    remote_path: &str,
    mode: SearchMode,
    entries: &'a [SearchEntry],
    context: bool,
) -> Vec<Printed<'a>> {
    printed_after(remote_path, mode, entries, context, &mut Cursor::default())
}

/// [`printed`] for the next batch of a result, after what `cursor` says was printed.
pub fn printed_after<'a>(
    remote_path: &str,
    mode: SearchMode,
    entries: &'a [SearchEntry],
    context: bool,
    cursor: &mut Cursor,
) -> Vec<Printed<'a>> {
    let mut out = Vec::new();
    match mode {
        SearchMode::Files => {
            out.extend(
                entries
                    .iter()
                    .map(|e| Printed::Path(shown_path(remote_path, e))),
            );
        }
        SearchMode::Count => {
            out.extend(
                entries
                    .iter()
                    .map(|e| Printed::Count(shown_path(remote_path, e), e.count)),
            );
        }
        SearchMode::Content => {
            let mut i = 0;
            while i < entries.len() {
                let path = &entries[i].path;
                let mut j = i;
                while j < entries.len() && &entries[j].path == path {
                    j += 1;
                }
                // This file's lines in the batch, by number; a match wins over context.
                let mut lines: std::collections::BTreeMap<u64, (&SearchLine, bool)> =
                    std::collections::BTreeMap::new();
                for e in &entries[i..j] {
                    for l in e.before.iter().chain(&e.after) {
                        let is_match = !l.matches.is_empty();
                        lines.entry(l.number).or_insert((l, is_match));
                    }
                    if let Some(l) = &e.line {
                        lines.insert(l.number, (l, true));
                    }
                }
                // Lines the last batch printed of this file are not printed again.
                let printed_to = match &cursor.last {
                    Some((p, n)) if p == path => *n,
                    _ => 0,
                };
                let shown = shown_path(remote_path, &entries[i]);
                for (n, (l, is_match)) in lines.range(printed_to + 1..) {
                    if context {
                        let touches =
                            matches!(&cursor.last, Some((p, last)) if p == path && *n == last + 1);
                        if cursor.last.is_some() && !touches {
                            out.push(Printed::Gap);
                        }
                    }
                    cursor.last = Some((path.clone(), *n));
                    out.push(Printed::Line {
                        path: shown.clone(),
                        line: l,
                        is_match: *is_match,
                        file_bytes: entries[i].file_bytes,
                    });
                }
                i = j;
            }
        }
    }
    out
}

fn plain(p: &Printed) -> String {
    match p {
        Printed::Line {
            path,
            line,
            is_match,
            ..
        } => {
            let sep = if *is_match { ':' } else { '-' };
            let cut = if line.cut > 0 {
                format!(" […{} more bytes]", line.cut)
            } else {
                String::new()
            };
            format!("{path}{sep}{}{sep}{}{cut}", line.number, line.text)
        }
        Printed::Gap => "--".into(),
        Printed::Path(p) => p.clone(),
        Printed::Count(p, n) => format!("{p}:{n}"),
    }
}

pub fn reply(q: &Query, req: &SearchRequest, r: SearchResult) -> Found {
    let context = req.before > 0 || req.after > 0;
    // Cut the page at an entry boundary once its text passes the cap (each entry measured
    // alone: merged context only makes the printed page shorter).
    let mut entries = r.entries;
    let mut size = 0usize;
    let mut kept = entries.len();
    for k in 0..entries.len() {
        size += printed(&q.remote_path, req.mode, &entries[k..k + 1], context)
            .iter()
            .map(|p| plain(p).len() + 1)
            .sum::<usize>();
        if size > MAX_OUTPUT_BYTES && k > 0 {
            kept = k;
            break;
        }
    }
    entries.truncate(kept);
    let mut output = String::new();
    for p in printed(&q.remote_path, req.mode, &entries, context) {
        output.push_str(&plain(&p));
        output.push('\n');
    }
    let shown = entries.len() as u64;
    let more = r.total.saturating_sub(req.offset).saturating_sub(shown);
    let unit = match req.mode {
        SearchMode::Content => "matching lines",
        SearchMode::Files | SearchMode::Count => "files",
    };
    if more > 0 {
        let bound = if r.complete { "" } else { "at least " };
        output.push_str(&format!(
            "[{bound}{more} more {unit}; offset={} continues]\n",
            req.offset + shown
        ));
    } else if !r.complete {
        output.push_str("[search stopped at its deadline; narrow remote_path or glob]\n");
    }
    if r.skipped_slow_lines > 0 {
        let n = r.skipped_slow_lines;
        let (s, them) = if n == 1 { ("", "it") } else { ("s", "them") };
        output.push_str(&format!(
            "[{n} long line{s} not searched: the pattern is too costly on {them} (see errors)]\n"
        ));
    }
    Found {
        output,
        total: r.total,
        shown,
        more,
        files_matched: r.files_matched,
        complete: r.complete,
        skipped_binary: r.skipped_binary,
        skipped_large: r.skipped_large,
        skipped_slow_lines: r.skipped_slow_lines,
        errors: r.errors,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(n: u64, text: &str, m: bool) -> SearchLine {
        SearchLine {
            number: n,
            offset: 0,
            text: text.into(),
            cut: 0,
            matches: if m { vec![(0, 1)] } else { vec![] },
            raw: None,
        }
    }

    fn entry(path: &str, n: u64, before: Vec<SearchLine>, after: Vec<SearchLine>) -> SearchEntry {
        SearchEntry {
            path: path.into(),
            exact_path: true,
            line: Some(line(n, "m", true)),
            before,
            after,
            count: 1,
            file_bytes: 0,
        }
    }

    fn text(remote: &str, entries: &[SearchEntry], context: bool) -> Vec<String> {
        printed(remote, SearchMode::Content, entries, context)
            .iter()
            .map(plain)
            .collect()
    }

    #[test]
    fn overlapping_context_is_printed_once_and_groups_are_separated() {
        let e = vec![
            entry(
                "a.rs",
                2,
                vec![line(1, "x", false)],
                vec![line(3, "m", true)],
            ),
            entry(
                "a.rs",
                3,
                vec![line(2, "m", true)],
                vec![line(4, "y", false)],
            ),
            entry("a.rs", 9, vec![line(8, "z", false)], vec![]),
            entry("b.rs", 1, vec![], vec![line(2, "w", false)]),
        ];
        assert_eq!(
            text("src", &e, true),
            [
                "src/a.rs-1-x",
                "src/a.rs:2:m",
                "src/a.rs:3:m",
                "src/a.rs-4-y",
                "--",
                "src/a.rs-8-z",
                "src/a.rs:9:m",
                "--",
                "src/b.rs:1:m",
                "src/b.rs-2-w",
            ]
        );
        let bare = vec![entry("a", 1, vec![], vec![]), entry("a", 5, vec![], vec![])];
        assert_eq!(text("", &bare, false), ["a:1:m", "a:5:m"]);
    }

    /// A streamed result cuts a file's lines between batches anywhere: printed batch by batch
    /// with one cursor, it reads as the whole printed at once.
    #[test]
    fn batches_print_as_the_whole_result() {
        let e = vec![
            entry(
                "a.rs",
                2,
                vec![line(1, "x", false)],
                vec![line(3, "m", true)],
            ),
            entry(
                "a.rs",
                3,
                vec![line(2, "m", true)],
                vec![line(4, "y", false)],
            ),
            entry(
                "a.rs",
                5,
                vec![line(4, "y", false)],
                vec![line(6, "z", false)],
            ),
            entry("a.rs", 9, vec![line(8, "z", false)], vec![]),
            entry("b.rs", 1, vec![], vec![line(2, "w", false)]),
            entry("b.rs", 3, vec![line(2, "w", false)], vec![]),
        ];
        for context in [false, true] {
            let whole = text("src", &e, context);
            for cut in 1..e.len() {
                let mut cursor = Cursor::default();
                let mut got: Vec<String> = Vec::new();
                for part in [&e[..cut], &e[cut..]] {
                    let p = printed_after("src", SearchMode::Content, part, context, &mut cursor);
                    got.extend(p.iter().map(plain));
                }
                assert_eq!(got, whole, "cut after {cut}, context {context}");
            }
        }
    }

    #[test]
    fn paths_join_the_given_remote_path_as_rg_prints_them() {
        let e = entry("x/y.py", 1, vec![], vec![]);
        assert_eq!(shown_path("", &e), "x/y.py");
        assert_eq!(shown_path(".", &e), "./x/y.py");
        assert_eq!(shown_path("./", &e), "./x/y.py");
        assert_eq!(shown_path("proj/", &e), "proj/x/y.py");
        assert_eq!(shown_path("~/proj", &e), "~/proj/x/y.py");
        let file = SearchEntry {
            path: String::new(),
            ..e
        };
        assert_eq!(shown_path("proj/a.py", &file), "proj/a.py");
    }

    #[test]
    fn the_more_marker_is_exact_and_the_page_is_bounded() {
        let q = Query {
            pattern: "m".into(),
            head_limit: 5000,
            ..Default::default()
        };
        let req = request(&q).unwrap();
        let long = "m".repeat(400);
        let entries: Vec<SearchEntry> = (1..=1000)
            .map(|n| SearchEntry {
                line: Some(line(n, &long, true)),
                ..entry("f", n, vec![], vec![])
            })
            .collect();
        let r = SearchResult {
            root: "/h".into(),
            total: 3000,
            total_matches: 3000,
            files_matched: 1,
            entries,
            files_searched: 1,
            skipped_binary: 0,
            skipped_large: 0,
            skipped_slow_lines: 0,
            complete: true,
            errors: vec![],
        };
        let f = reply(&q, &req, r);
        assert!(
            f.output.len() <= MAX_OUTPUT_BYTES + 100,
            "{}",
            f.output.len()
        );
        assert!(f.shown > 100 && f.shown < 1000, "{}", f.shown);
        assert_eq!(f.more, 3000 - f.shown);
        assert!(f.output.ends_with(&format!(
            "[{} more matching lines; offset={} continues]\n",
            3000 - f.shown,
            f.shown
        )));
    }

    #[test]
    fn braces_expand_as_ripgrep_globs_do() {
        assert_eq!(
            split_globs("*.{ts,tsx} !*.min.js"),
            ["*.ts", "*.tsx", "!*.min.js"]
        );
        assert_eq!(
            split_globs("{a,b}/{c,d}.py"),
            ["a/c.py", "a/d.py", "b/c.py", "b/d.py"]
        );
        assert_eq!(split_globs("x.{a,{b,c}}"), ["x.a", "x.b", "x.c"]);
        assert_eq!(split_globs("odd{.rs"), ["odd{.rs"]);
        assert_eq!(split_globs(r"lit\{a,b}"), [r"lit\{a,b}"]);
        assert!(split_globs("").is_empty());
    }

    #[test]
    fn bad_queries_are_refused_with_a_hint() {
        let ok = Query {
            pattern: "x".into(),
            head_limit: 10,
            ..Default::default()
        };
        assert!(request(&ok).is_ok());
        for bad in [
            Query {
                pattern: String::new(),
                ..ok.clone()
            },
            Query {
                head_limit: 0,
                ..ok.clone()
            },
            Query {
                offset: -1,
                ..ok.clone()
            },
            Query {
                context: 21,
                ..ok.clone()
            },
            Query {
                output_mode: "lines".into(),
                ..ok.clone()
            },
        ] {
            assert!(request(&bad).is_err(), "{bad:?}");
        }
    }
}
