//! Search a remote tree with ripgrep's semantics, in one round trip: the agent walks with the
//! same rules engine as sync (plus `.ignore`/`.rgignore` and the hidden-file rule), matches on
//! several threads, and answers with one page of the sorted result and the exact totals, so a
//! caller can page through a large result without the agent holding it between calls.

use serde::{Deserialize, Serialize};

/// What one result entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SearchMode {
    /// One entry per matching line, with its context lines.
    Content,
    /// One entry per file with at least one match (`rg -l`).
    Files,
    /// One entry per file with at least one match, with its count of matching lines (`rg -c`).
    Count,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchRequest {
    /// The directory (or file) searched; a leading `~` is the agent's `$HOME`.
    pub root: String,
    pub pattern: String,
    /// `pattern` is a literal string, not a regex.
    pub literal: bool,
    pub ignore_case: bool,
    /// ripgrep `-g` globs, gitignore syntax: `*.rs` includes only what matches (files),
    /// `!*.min.js` excludes. They take precedence over ignore files and hidden names.
    pub globs: Vec<String>,
    /// Lines of context before each matching line (content mode; `rg -B`).
    pub before: u32,
    /// Lines of context after each matching line (content mode; `rg -A`).
    pub after: u32,
    /// A match must stand as a word: preceded by the line's start or a non-word character,
    /// followed by its end or one (`rg -w`; word characters are ASCII `[0-9A-Za-z_]`).
    pub word: bool,
    /// The lines that do not match are the result (`rg -v`); their context lines are those
    /// that do. No match ranges are sent for either.
    pub invert: bool,
    /// A match may span lines (`rg -U`): the pattern runs over the whole file, `^`/`$` match
    /// at each line's edges, and every line a match touches is a matching line. A run of
    /// matches sharing lines is one in count mode, as rg counts. Without it, a pattern that
    /// can match a line break is refused.
    pub multiline: bool,
    /// Hidden names (a leading `.`) are searched too (`rg --hidden`); ignore files still apply.
    pub hidden: bool,
    /// File-name globs of the selected file types (`rg -t`): a file that passed the ignore
    /// rules is searched only when its name matches one, and then even when hidden. Empty:
    /// every type.
    pub types: Vec<String>,
    /// File-name globs of the excluded file types (`rg -T`).
    pub types_not: Vec<String>,
    pub mode: SearchMode,
    /// Entries of the sorted result to skip, then at most `limit` returned.
    pub offset: u64,
    pub limit: u64,
    /// Do not read `.gitignore`, `.ignore`, `.rgignore` or `.git/info/exclude` (ripgrep
    /// `--no-ignore`); hidden names stay skipped.
    pub no_ignore: bool,
    /// Files larger than this are skipped, and counted.
    pub max_filesize: u64,
    /// Longest text kept of one line; the rest is cut and counted in [`SearchLine::cut`].
    pub max_line_bytes: u32,
    /// The walk stops after this long and answers with what it found ([`SearchResult::complete`]
    /// false).
    pub deadline_ms: u64,
    /// Send the entries as [`Chunk::Search`](crate::Chunk::Search) batches, in order, as the
    /// second pass reads them, instead of in the reply (whose `entries` is then empty): a
    /// result of any size from one walk, held by neither end (`rsb grep`). The second pass then
    /// has a deadline of its own, as long as the walk's.
    pub stream: bool,
    /// Find each line's match ranges ([`SearchLine::matches`]) for colour or JSON. Without, a
    /// line that matches has the one range `(0, 0)`, which tells it from a context line: the
    /// pattern is not run again on a matching line, and once on a context line.
    pub ranges: bool,
    /// rsb's own read keeps to the sandbox's [`crate::Confine::read`] roots (with its write
    /// roots and the system's directories); `None`, or a `Confine` without `read`: anywhere.
    pub confine: Option<crate::Confine>,
}

/// One line of a file: a match or a context line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchLine {
    /// 1-based.
    pub number: u64,
    /// Where the line starts in the file, in bytes (rg's `absolute_offset`).
    pub offset: u64,
    /// The line without its `\n` (and without a `\r` before it), lossily UTF-8, cut at
    /// [`SearchRequest::max_line_bytes`].
    pub text: String,
    /// Bytes of the line left out of `text`.
    pub cut: u64,
    /// Byte ranges of the matches within `text` (empty for a context line; `(0, 0)` when the
    /// request asked for no [`SearchRequest::ranges`]).
    pub matches: Vec<(u32, u32)>,
    /// The line's own bytes (its `\r` included, cut as `text` is) when they differ from
    /// `text`: not UTF-8, or a `\r` before the `\n`. What `rsb grep` prints into a pipe, as rg
    /// prints the bytes.
    #[serde(with = "serde_bytes")]
    pub raw: Option<Vec<u8>>,
}

/// One entry of the page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchEntry {
    /// Relative to the root, `/`-separated; lossily UTF-8 for a name that is not (and then
    /// `exact_path` is false). Empty when the root is a file.
    pub path: String,
    pub exact_path: bool,
    /// The matching line (content mode).
    pub line: Option<SearchLine>,
    /// Context lines before and after it, in order (content mode).
    pub before: Vec<SearchLine>,
    pub after: Vec<SearchLine>,
    /// Matching lines in the file (count mode; 1 or more in files mode: at least one).
    pub count: u64,
    /// The file's size as searched: whether a line ends with a line break (it does when it
    /// ends before this), rg's `bytes_searched`.
    pub file_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// The root after `~` expansion.
    pub root: String,
    /// Entries in the whole sorted result (matching lines, or matching files), of which this
    /// page holds `entries`, starting at the request's offset.
    pub total: u64,
    /// Matching lines in all files (content and count mode; files with matches in files mode).
    pub total_matches: u64,
    /// Files with at least one match.
    pub files_matched: u64,
    pub entries: Vec<SearchEntry>,
    /// Files read and matched.
    pub files_searched: u64,
    /// Files skipped as binary (a NUL byte) or as larger than the cap.
    pub skipped_binary: u64,
    pub skipped_large: u64,
    /// Lines over 8 KiB not matched because the pattern would take too long on them (it
    /// cannot be interrupted inside a line); `errors` names the first of each file.
    pub skipped_slow_lines: u64,
    /// False when the deadline stopped the walk: the totals are then lower bounds.
    pub complete: bool,
    /// Unreadable entries, ignore files with lines not applied, as `path: reason` (capped).
    pub errors: Vec<String>,
}
