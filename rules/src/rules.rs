//! Exclusion rules with gitignore semantics: the given lines, plus (when a sync asks for it)
//! the `.gitignore` files of the tree as [`Layer`]s, which the walker reads as it enters each
//! directory (this crate does no I/O).
//!
//! This is git's own algorithm, not a regex translation: each line is parsed as `dir.c` does
//! (comments, trailing spaces, `!`, trailing `/`, anchoring) and matched with a port of git's
//! `wildmatch.c` (`*`, `?`, `[...]` with ranges, `!`/`^` negation and `[:class:]`, `\` escapes,
//! `**` in `**/x`, `x/**` and `x/**/y`). The `ignore` crate does the same through regexes and
//! added ~0.9 MB to the static agent, which must stay under 2 MiB.
//!
//! - The last matching line wins; a `!` line re-includes.
//! - A pattern without a `/` (a trailing one aside) matches the name at any depth; one with a
//!   `/` at the start or in the middle is anchored at the sync root.
//! - A trailing `/` matches directories only.
//! - With `.gitignore` layers ([`Rules::excluded_in`]), a layer's patterns are relative to its
//!   directory and apply to it and below; precedence is git's: the sync's own lines (the
//!   "command line") first, then the deepest `.gitignore`, up to the root's, then the defaults
//!   (like a global excludes file). Within each, the last matching line wins.
//! - Directories are matched as the walk reaches them and an excluded one is never entered,
//!   so (as in git) nothing below an excluded directory can be re-included.
//! - A line git would silently treat as "never matches" (a dangling `\`, an unclosed `[`, an
//!   unknown `[:class:]`, a reversed range) is an error instead, so a typo cannot quietly sync
//!   what the user meant to keep out.

use std::fmt;

/// Names always excluded by default, at any depth, unless a sync turns the defaults off.
pub const DEFAULT_EXCLUDES: &[&str] = &[
    ".git/",
    ".idea/",
    ".vscode/",
    "__pycache__/",
    "*.pyc",
    "node_modules/",
];

#[derive(Debug, Clone)]
struct Pattern {
    glob: Vec<u8>,
    negated: bool,
    dir_only: bool,
    /// No `/`: matched against the last path component only.
    basename: bool,
}

#[derive(Debug)]
pub struct Rules {
    patterns: Vec<Pattern>,
    /// How many of `patterns` (at the front) are [`DEFAULT_EXCLUDES`]: below `.gitignore`
    /// layers in precedence, where the rest are above.
    defaults: usize,
}

/// One `.gitignore` file of the tree: its patterns, relative to `dir`.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Relative to the sync root, `/`-separated; `""` for the root itself.
    dir: String,
    patterns: Vec<Pattern>,
}

impl Layer {
    /// A `.gitignore` in `dir` with these lines. Lines git would silently never match are left
    /// out and returned, so the caller can warn about them: a `.gitignore` in the tree (a
    /// vendored one, say) should not fail a whole sync the way a bad `--exclude` does.
    pub fn parse<'a>(
        dir: &str,
        lines: impl IntoIterator<Item = &'a str>,
    ) -> (Layer, Vec<PatternError>) {
        let mut patterns = Vec::new();
        let mut errors = Vec::new();
        for line in lines {
            match parse(line) {
                Ok(Some(p)) => patterns.push(p),
                Ok(None) => {}
                Err(reason) => errors.push(PatternError {
                    line: line.to_string(),
                    reason,
                }),
            }
        }
        let dir = dir.trim_matches('/').to_string();
        (Layer { dir, patterns }, errors)
    }

    pub fn dir(&self) -> &str {
        &self.dir
    }

    /// This file's verdict on `rel` (relative to the root, like the layer's `dir`):
    /// `Some(true)` excluded, `Some(false)` re-included by a `!` line, `None` when no line of
    /// it matches or the layer is not above `rel`. For walkers that combine several kinds of
    /// ignore file with their own precedence (search: `.rgignore` over `.ignore` over
    /// `.gitignore`, as ripgrep).
    pub fn decide(&self, rel: &str, is_dir: bool) -> Option<bool> {
        decide(&self.patterns, self.sub(rel)?, is_dir)
    }

    /// `rel` relative to this layer's directory, when the layer applies to it.
    fn sub<'r>(&self, rel: &'r str) -> Option<&'r str> {
        if self.dir.is_empty() {
            return Some(rel);
        }
        rel.strip_prefix(self.dir.as_str())?
            .strip_prefix('/')
            .filter(|r| !r.is_empty())
    }
}

/// The last of `patterns` matching `rel`: `Some(excluded)`, or `None` when none does.
fn decide(patterns: &[Pattern], rel: &str, is_dir: bool) -> Option<bool> {
    let path = rel.as_bytes();
    let name = match rel.rfind('/') {
        Some(i) => &path[i + 1..],
        None => path,
    };
    for p in patterns.iter().rev() {
        if p.dir_only && !is_dir {
            continue;
        }
        let hit = if p.basename {
            wildmatch(&p.glob, name, false)
        } else {
            wildmatch(&p.glob, path, true)
        };
        if hit {
            return Some(!p.negated);
        }
    }
    None
}

/// A line the engine refuses, and why. Both ends show it as it is, so a directory sync (decided
/// by an agent) and a single-file sync (decided by `rsb`) fail with the same words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternError {
    pub line: String,
    pub reason: &'static str,
}

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid exclude pattern {:?}: {}",
            self.line, self.reason
        )
    }
}

impl std::error::Error for PatternError {}

impl Rules {
    /// Lines in order (defaults first, then the user's); blank lines and `#` comments are
    /// skipped here, so callers pass lines as the user wrote them.
    pub fn new<'a>(lines: impl IntoIterator<Item = &'a str>) -> Result<Rules, PatternError> {
        let mut patterns = Vec::new();
        for line in lines {
            match parse(line) {
                Ok(Some(p)) => patterns.push(p),
                Ok(None) => {}
                Err(reason) => {
                    return Err(PatternError {
                        line: line.to_string(),
                        reason,
                    });
                }
            }
        }
        Ok(Rules {
            patterns,
            defaults: 0,
        })
    }

    /// A sync's rules: [`DEFAULT_EXCLUDES`] when `default_excludes`, then `lines`.
    pub fn for_sync(default_excludes: bool, lines: &[String]) -> Result<Rules, PatternError> {
        let defaults = if default_excludes {
            DEFAULT_EXCLUDES
        } else {
            &[]
        };
        let mut r = Rules::new(
            defaults
                .iter()
                .copied()
                .chain(lines.iter().map(String::as_str)),
        )?;
        r.defaults = defaults.len();
        Ok(r)
    }

    /// The last of these lines matching `rel`: `Some(true)` excluded, `Some(false)` a `!` line,
    /// `None` when none matches (search's `-g` globs read it the other way round).
    pub fn decide(&self, rel: &str, is_dir: bool) -> Option<bool> {
        decide(&self.patterns, rel, is_dir)
    }

    /// Whether any line is a plain (not `!`) pattern.
    pub fn has_plain(&self) -> bool {
        self.patterns.iter().any(|p| !p.negated)
    }

    /// `rel` is relative to the root, `/`-separated, never empty. Parents are not consulted:
    /// the walk never enters an excluded directory.
    pub fn excluded(&self, rel: &str, is_dir: bool) -> bool {
        decide(&self.patterns, rel, is_dir).unwrap_or(false)
    }

    /// As [`Rules::excluded`], with the tree's `.gitignore` files: `layers` are those of the
    /// directories above `rel` (any order of depth; layers that are not above `rel` are
    /// skipped). Precedence as git: these rules' own lines, then the deepest layer first, then
    /// the defaults.
    pub fn excluded_in(&self, layers: &[Layer], rel: &str, is_dir: bool) -> bool {
        if let Some(x) = decide(&self.patterns[self.defaults..], rel, is_dir) {
            return x;
        }
        let mut applicable: Vec<(&Layer, &str)> = layers
            .iter()
            .filter_map(|l| l.sub(rel).map(|sub| (l, sub)))
            .collect();
        // Deepest first: a nested .gitignore overrides its parents'.
        applicable.sort_by_key(|(l, _)| std::cmp::Reverse(l.dir.len()));
        for (l, sub) in applicable {
            if let Some(x) = decide(&l.patterns, sub, is_dir) {
                return x;
            }
        }
        decide(&self.patterns[..self.defaults], rel, is_dir).unwrap_or(false)
    }

    /// [`Rules::excluded_path`] with `.gitignore` layers: each parent is consulted as the walk
    /// would meet it (with the layers above it), then `rel`.
    pub fn excluded_path_in(&self, layers: &[Layer], rel: &str, is_dir: bool) -> bool {
        let rel = rel.trim_matches('/');
        if rel.is_empty() {
            return false;
        }
        rel.match_indices('/')
            .map(|(i, _)| &rel[..i])
            .any(|parent| self.excluded_in(layers, parent, true))
            || self.excluded_in(layers, rel, is_dir)
    }

    /// Would a walk from the root leave `rel` out? As [`Rules::excluded`], but each parent
    /// directory is consulted first, the way the walk reaches it: for an entry met without a
    /// walk (a single-file sync).
    pub fn excluded_path(&self, rel: &str, is_dir: bool) -> bool {
        let rel = rel.trim_matches('/');
        if rel.is_empty() {
            return false;
        }
        rel.match_indices('/')
            .map(|(i, _)| &rel[..i])
            .any(|parent| self.excluded(parent, true))
            || self.excluded(rel, is_dir)
    }
}

/// One line, as git's `add_pattern` reads it. `None` for blank lines and comments.
fn parse(line: &str) -> Result<Option<Pattern>, &'static str> {
    // Exclude files written on Windows end their lines with CR.
    let line = line.strip_suffix('\r').unwrap_or(line);
    if line.contains('\0') {
        return Err("contains NUL");
    }
    let mut s = trim_trailing_spaces(line.as_bytes());
    if s.is_empty() || s[0] == b'#' {
        return Ok(None);
    }
    let negated = s[0] == b'!';
    if negated {
        s = &s[1..];
    }
    let dir_only = s.last() == Some(&b'/');
    if dir_only {
        s = &s[..s.len() - 1];
    }
    if s.is_empty() {
        return Ok(None);
    }
    let basename = !s.contains(&b'/');
    let glob = s.strip_prefix(b"/").unwrap_or(s);
    validate(glob)?;
    Ok(Some(Pattern {
        glob: glob.to_vec(),
        negated,
        dir_only,
        basename,
    }))
}

/// Trailing spaces are dropped unless escaped with a backslash (git's `trim_trailing_spaces`).
fn trim_trailing_spaces(s: &[u8]) -> &[u8] {
    let mut last_space = None;
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b' ' => {
                if last_space.is_none() {
                    last_space = Some(i);
                }
            }
            b'\\' => {
                i += 1;
                if i >= s.len() {
                    return s;
                }
                last_space = None;
            }
            _ => last_space = None,
        }
        i += 1;
    }
    match last_space {
        Some(i) => &s[..i],
        None => s,
    }
}

const CLASSES: &[&[u8]] = &[
    b"alnum", b"alpha", b"blank", b"cntrl", b"digit", b"graph", b"lower", b"print", b"punct",
    b"space", b"upper", b"xdigit",
];

/// Reject what git would silently treat as "never matches": a dangling `\`, an unclosed
/// `[`, an unknown `[:class:]`.
fn validate(p: &[u8]) -> Result<(), &'static str> {
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            b'\\' => {
                if i + 1 >= p.len() {
                    return Err("dangling backslash at the end");
                }
                i += 2;
                continue;
            }
            b'[' => {
                i += 1;
                if matches!(p.get(i), Some(b'!' | b'^')) {
                    i += 1;
                }
                let mut first = true;
                // The previous single character, which a `-` may start a range from.
                let mut prev: Option<u8> = None;
                loop {
                    let Some(&c) = p.get(i) else {
                        return Err("unclosed character class (missing `]`)");
                    };
                    if c == b']' && !first {
                        break;
                    }
                    first = false;
                    match c {
                        b'\\' => {
                            let Some(&lit) = p.get(i + 1) else {
                                return Err("dangling backslash at the end");
                            };
                            prev = Some(lit);
                            i += 2;
                            continue;
                        }
                        b'-' if prev.is_some() && !matches!(p.get(i + 1), None | Some(b']')) => {
                            let mut j = i + 1;
                            if p[j] == b'\\' {
                                j += 1;
                            }
                            let Some(&hi) = p.get(j) else {
                                return Err("dangling backslash at the end");
                            };
                            if prev.is_some_and(|lo| hi < lo) {
                                return Err(
                                    "invalid range in a character class (end before start)",
                                );
                            }
                            prev = None;
                            i = j + 1;
                            continue;
                        }
                        b'[' if p.get(i + 1) == Some(&b':') => {
                            let s = i + 2;
                            let Some(end) = p[s..].iter().position(|&c| c == b']').map(|e| s + e)
                            else {
                                return Err("unclosed character class (missing `]`)");
                            };
                            if end > s && p[end - 1] == b':' {
                                if !CLASSES.contains(&&p[s..end - 1]) {
                                    return Err("unknown [:class:] in a character class");
                                }
                                prev = None;
                                i = end + 1;
                                continue;
                            }
                            prev = Some(c);
                        }
                        _ => prev = Some(c),
                    }
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wild {
    Match,
    NoMatch,
    AbortAll,
    AbortToStarStar,
}

/// git's `wildmatch(pattern, text, pathname ? WM_PATHNAME : 0) == WM_MATCH`.
fn wildmatch(pattern: &[u8], text: &[u8], pathname: bool) -> bool {
    dowild(pattern, text, pathname) == Wild::Match
}

fn is_glob_special(c: u8) -> bool {
    matches!(c, b'*' | b'?' | b'[' | b'\\')
}

fn in_class(name: &[u8], c: u8) -> Option<bool> {
    Some(match name {
        b"alnum" => c.is_ascii_alphanumeric(),
        b"alpha" => c.is_ascii_alphabetic(),
        b"blank" => c == b' ' || c == b'\t',
        b"cntrl" => c.is_ascii_control(),
        b"digit" => c.is_ascii_digit(),
        b"graph" => c.is_ascii_graphic(),
        b"lower" => c.is_ascii_lowercase(),
        b"print" => c.is_ascii_graphic() || c == b' ',
        b"punct" => c.is_ascii_punctuation(),
        b"space" => c.is_ascii_whitespace(),
        b"upper" => c.is_ascii_uppercase(),
        b"xdigit" => c.is_ascii_hexdigit(),
        _ => return None,
    })
}

/// A line-by-line port of `dowild` from git's `wildmatch.c` (case-sensitive). Bytes past the
/// end read as NUL, as in C; neither patterns nor paths contain NUL.
fn dowild(p: &[u8], text: &[u8], pathname: bool) -> Wild {
    let pc = |i: usize| p.get(i).copied().unwrap_or(0);
    let tc = |i: usize| text.get(i).copied().unwrap_or(0);
    let (mut pi, mut ti) = (0usize, 0usize);
    while pc(pi) != 0 {
        let mut p_ch = pc(pi);
        let mut t_ch = tc(ti);
        if t_ch == 0 && p_ch != b'*' {
            return Wild::AbortAll;
        }
        match p_ch {
            b'\\' => {
                // Literal match with the next character.
                pi += 1;
                p_ch = pc(pi);
                if t_ch != p_ch {
                    return Wild::NoMatch;
                }
            }
            b'?' => {
                if pathname && t_ch == b'/' {
                    return Wild::NoMatch;
                }
            }
            b'*' => {
                let match_slash;
                pi += 1;
                if pc(pi) == b'*' {
                    // `prev` is the character before the first star.
                    let at_start_or_slash = pi < 2 || p[pi - 2] == b'/';
                    pi += 1;
                    while pc(pi) == b'*' {
                        pi += 1;
                    }
                    if at_start_or_slash
                        && (pc(pi) == 0
                            || pc(pi) == b'/'
                            || (pc(pi) == b'\\' && pc(pi + 1) == b'/'))
                    {
                        // `**/` may match nothing: try the rest right here.
                        if pc(pi) == b'/'
                            && dowild(&p[pi + 1..], &text[ti..], pathname) == Wild::Match
                        {
                            return Wild::Match;
                        }
                        match_slash = true;
                    } else {
                        match_slash = !pathname;
                    }
                } else {
                    match_slash = !pathname;
                }
                if pc(pi) == 0 {
                    // A trailing `**` matches everything, a trailing `*` only within one component.
                    if !match_slash && text[ti..].contains(&b'/') {
                        return Wild::NoMatch;
                    }
                    return Wild::Match;
                } else if !match_slash && pc(pi) == b'/' {
                    // One star then a slash matches exactly one component.
                    let Some(off) = text[ti..].iter().position(|&c| c == b'/') else {
                        return Wild::NoMatch;
                    };
                    ti += off + 1;
                    pi += 1;
                    continue;
                }
                loop {
                    if t_ch == 0 {
                        break;
                    }
                    // Skip ahead to the next occurrence of a literal that follows the star.
                    if !is_glob_special(pc(pi)) {
                        let want = pc(pi);
                        loop {
                            t_ch = tc(ti);
                            if t_ch == 0 || (!match_slash && t_ch == b'/') || t_ch == want {
                                break;
                            }
                            ti += 1;
                        }
                        if t_ch != want {
                            return if match_slash {
                                Wild::AbortAll
                            } else {
                                Wild::AbortToStarStar
                            };
                        }
                    }
                    let m = dowild(&p[pi..], &text[ti..], pathname);
                    if m != Wild::NoMatch {
                        if !match_slash || m != Wild::AbortToStarStar {
                            return m;
                        }
                    } else if !match_slash && t_ch == b'/' {
                        return Wild::AbortToStarStar;
                    }
                    ti += 1;
                    t_ch = tc(ti);
                }
                return Wild::AbortAll;
            }
            b'[' => {
                pi += 1;
                p_ch = pc(pi);
                if p_ch == b'^' {
                    p_ch = b'!';
                }
                let negated = p_ch == b'!';
                if negated {
                    pi += 1;
                    p_ch = pc(pi);
                }
                let mut prev_ch = 0u8;
                let mut matched = false;
                loop {
                    if p_ch == 0 {
                        return Wild::AbortAll;
                    }
                    if p_ch == b'\\' {
                        pi += 1;
                        p_ch = pc(pi);
                        if p_ch == 0 {
                            return Wild::AbortAll;
                        }
                        if t_ch == p_ch {
                            matched = true;
                        }
                    } else if p_ch == b'-' && prev_ch != 0 && pc(pi + 1) != 0 && pc(pi + 1) != b']'
                    {
                        pi += 1;
                        p_ch = pc(pi);
                        if p_ch == b'\\' {
                            pi += 1;
                            p_ch = pc(pi);
                            if p_ch == 0 {
                                return Wild::AbortAll;
                            }
                        }
                        if t_ch <= p_ch && t_ch >= prev_ch {
                            matched = true;
                        }
                        p_ch = 0; // so that prev_ch becomes 0
                    } else if p_ch == b'[' && pc(pi + 1) == b':' {
                        let s = pi + 2;
                        pi = s;
                        while pc(pi) != 0 && pc(pi) != b']' {
                            pi += 1;
                        }
                        if pc(pi) == 0 {
                            return Wild::AbortAll;
                        }
                        if pi == s || p[pi - 1] != b':' {
                            // Not `[:name:]` after all: a plain `[` in the set.
                            pi = s - 2;
                            p_ch = b'[';
                            if t_ch == p_ch {
                                matched = true;
                            }
                        } else {
                            match in_class(&p[s..pi - 1], t_ch) {
                                Some(true) => matched = true,
                                Some(false) => {}
                                None => return Wild::AbortAll,
                            }
                            p_ch = 0;
                        }
                    } else if t_ch == p_ch {
                        matched = true;
                    }
                    prev_ch = p_ch;
                    pi += 1;
                    p_ch = pc(pi);
                    if p_ch == b']' {
                        break;
                    }
                }
                if matched == negated || (pathname && t_ch == b'/') {
                    return Wild::NoMatch;
                }
            }
            _ => {
                if t_ch != p_ch {
                    return Wild::NoMatch;
                }
            }
        }
        pi += 1;
        ti += 1;
    }
    if ti < text.len() {
        Wild::NoMatch
    } else {
        Wild::Match
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(default_excludes: bool, lines: &[&str]) -> Rules {
        let lines: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
        Rules::for_sync(default_excludes, &lines).unwrap()
    }

    /// Cases from git's t/t3070-wildmatch.sh: (text, pattern, wildmatch, pathmatch).
    #[test]
    fn wildmatch_agrees_with_git() {
        let cases: &[(&str, &str, bool, bool)] = &[
            ("foo", "foo", true, true),
            ("foo", "bar", false, false),
            ("", "", true, true),
            ("foo", "???", true, true),
            ("foo", "??", false, false),
            ("foo", "*", true, true),
            ("foo", "f*", true, true),
            ("foo", "*f", false, false),
            ("foo", "*foo*", true, true),
            ("foobar", "*ob*a*r*", true, true),
            ("aaaaaaabababab", "*ab", true, true),
            ("foo*", "foo\\*", true, true),
            ("foobar", "foo\\*bar", false, false),
            ("f\\oo", "f\\\\oo", true, true),
            ("ball", "*[al]?", true, true),
            ("ten", "[ten]", false, false),
            ("ten", "**[!te]", true, true),
            ("ten", "**[!ten]", false, false),
            ("ten", "t[a-g]n", true, true),
            ("ten", "t[!a-g]n", false, false),
            ("ton", "t[!a-g]n", true, true),
            ("ton", "t[^a-g]n", true, true),
            ("a]b", "a[]]b", true, true),
            ("a-b", "a[]-]b", true, true),
            ("a]b", "a[]-]b", true, true),
            ("aab", "a[]-]b", false, false),
            ("aab", "a[]a-]b", true, true),
            ("]", "]", true, true),
            ("foo/baz/bar", "foo*bar", true, false),
            ("foo/baz/bar", "foo**bar", true, false),
            ("foobazbar", "foo**bar", true, true),
            ("foo/baz/bar", "foo/**/bar", true, true),
            ("foo/baz/bar", "foo/**/**/bar", true, true),
            ("foo/b/a/z/bar", "foo/**/bar", true, true),
            ("foo/b/a/z/bar", "foo/**/**/bar", true, true),
            ("foo/bar", "foo/**/bar", true, true),
            ("foo/bar", "foo/**/**/bar", true, true),
            ("foo/bar", "foo?bar", true, false),
            ("foo/bar", "foo[/]bar", true, false),
            ("foo/bar", "foo[^a-z]bar", true, false),
            ("foo/bar", "f[^eiu][^eiu][^eiu][^eiu][^eiu]r", true, false),
            ("foo-bar", "f[^eiu][^eiu][^eiu][^eiu][^eiu]r", true, true),
            ("foo", "**/foo", true, true),
            ("XXX/foo", "**/foo", true, true),
            ("bar/baz/foo", "**/foo", true, true),
            ("bar/baz/foo", "*/foo", true, false),
            ("foo/bar/baz", "**/bar*", true, false),
            ("deep/foo/bar/baz", "**/bar/*", true, true),
            ("deep/foo/bar/baz/", "**/bar/*", true, false),
            ("deep/foo/bar/baz/", "**/bar/**", true, true),
            ("deep/foo/bar", "**/bar/*", false, false),
            ("deep/foo/bar/", "**/bar/**", true, true),
            ("foo/bar/baz", "**/bar**", true, false),
            ("foo/bar/baz/x", "*/bar/**", true, true),
            ("deep/foo/bar/baz/x", "*/bar/**", true, false),
            ("deep/foo/bar/baz/x", "**/bar/*/*", true, true),
            ("acrt", "a[c-c]st", false, false),
            ("acrt", "a[c-c]rt", true, true),
            ("]", "[!]-]", false, false),
            ("a", "[!]-]", true, true),
            ("\\", "\\", false, false),
            ("XXX/\\", "*/\\", false, false),
            ("XXX/\\", "*/\\\\", true, true),
            ("foo", "foo", true, true),
            ("@foo", "@foo", true, true),
            ("foo", "@foo", false, false),
            ("[ab]", "\\[ab]", true, true),
            ("[ab]", "[[]ab]", true, true),
            ("[ab]", "[[:]ab]", true, true),
            ("[ab]", "[[::]ab]", false, false),
            ("[ab]", "[[:digit]ab]", true, true),
            ("[ab]", "[\\[:]ab]", true, true),
            ("?a?b", "\\??\\?b", true, true),
            ("abc", "\\a\\b\\c", true, true),
            ("a1B", "[[:alpha:]][[:digit:]][[:upper:]]", true, true),
            ("a", "[[:digit:][:upper:][:space:]]", false, false),
            ("A", "[[:digit:][:upper:][:space:]]", true, true),
            ("1", "[[:digit:][:upper:][:space:]]", true, true),
            (" ", "[[:digit:][:upper:][:space:]]", true, true),
            ("5", "[[:xdigit:]]", true, true),
            ("f", "[[:xdigit:]]", true, true),
            ("D", "[[:xdigit:]]", true, true),
            (
                "_",
                "[[:alnum:][:alpha:][:blank:][:cntrl:][:digit:][:graph:][:lower:][:print:][:punct:][:space:][:upper:][:xdigit:]]",
                true,
                true,
            ),
            ("5", "[a-c[:digit:]x-z]", true, true),
            ("b", "[a-c[:digit:]x-z]", true, true),
            ("y", "[a-c[:digit:]x-z]", true, true),
            ("q", "[a-c[:digit:]x-z]", false, false),
            (
                "-adobe-courier-bold-o-normal--12-120-75-75-m-70-iso8859-1",
                "-*-*-*-*-*-*-12-*-*-*-m-*-*-*",
                true,
                true,
            ),
            (
                "-adobe-courier-bold-o-normal--12-120-75-75-X-70-iso8859-1",
                "-*-*-*-*-*-*-12-*-*-*-m-*-*-*",
                false,
                false,
            ),
            (
                "-adobe-courier-bold-o-normal--12-120-75-75-/-70-iso8859-1",
                "-*-*-*-*-*-*-12-*-*-*-m-*-*-*",
                false,
                false,
            ),
            (
                "XXX/adobe/courier/bold/o/normal//12/120/75/75/m/70/iso8859/1",
                "XXX/*/*/*/*/*/*/12/*/*/*/m/*/*/*",
                true,
                true,
            ),
            (
                "XXX/adobe/courier/bold/o/normal//12/120/75/75/X/70/iso8859/1",
                "XXX/*/*/*/*/*/*/12/*/*/*/m/*/*/*",
                false,
                false,
            ),
            (
                "abcd/abcdefg/abcdefghijk/abcdefghijklmnop.txt",
                "**/*a*b*g*n*t",
                true,
                true,
            ),
            (
                "abcd/abcdefg/abcdefghijk/abcdefghijklmnop.txtz",
                "**/*a*b*g*n*t",
                false,
                false,
            ),
            ("foo", "*/*/*", false, false),
            ("foo/bar", "*/*/*", false, false),
            ("foo/bba/arr", "*/*/*", true, true),
            ("foo/bb/aa/rr", "*/*/*", true, false),
            ("foo/bb/aa/rr", "**/**/**", true, true),
            ("abcXdefXghi", "*X*i", true, true),
            ("ab/cXd/efXg/hi", "*X*i", true, false),
            ("ab/cXd/efXg/hi", "*/*X*/*/*i", true, true),
            ("ab/cXd/efXg/hi", "**/*X*/**/*i", true, true),
            ("foo", "fo", false, false),
            ("foo/bar", "foo/bar", true, true),
            ("foo/bar", "foo/*", true, true),
            ("foo/bba/arr", "foo/*", true, false),
            ("foo/bba/arr", "foo/**", true, true),
            ("foo/bba/arr", "foo*", true, false),
            ("foo/bba/arr", "foo**", true, false),
            ("foo/bba/arr", "foo/*arr", true, false),
            ("foo/bba/arr", "foo/**arr", true, false),
            ("foo/bba/arr", "foo/*z", false, false),
            ("foo/bba/arr", "foo/**z", false, false),
            ("foo\nbar", "foo?bar", true, true),
        ];
        for &(text, pat, wild, path) in cases {
            assert_eq!(
                wildmatch(pat.as_bytes(), text.as_bytes(), false),
                wild,
                "wildmatch {pat:?} {text:?}"
            );
            assert_eq!(
                wildmatch(pat.as_bytes(), text.as_bytes(), true),
                path,
                "pathmatch {pat:?} {text:?}"
            );
        }
    }

    fn layer(dir: &str, lines: &[&str]) -> Layer {
        let (l, errors) = Layer::parse(dir, lines.iter().copied());
        assert!(errors.is_empty(), "{errors:?}");
        l
    }

    #[test]
    fn nested_gitignore_files_apply_below_their_directory() {
        let r = rules(true, &[]);
        let layers = [
            layer("", &["*.log", "/build/", "tmp/"]),
            layer("sub", &["!keep.log", "/local.txt", "data/*.bin"]),
            layer("sub/deep", &["keep.log", "!*.pyc"]),
        ];
        let ex = |rel: &str, dir: bool| r.excluded_in(&layers, rel, dir);
        // The root's patterns apply at every depth (basename) or at the root (anchored).
        assert!(ex("a.log", false));
        assert!(ex("x/y/a.log", false));
        assert!(ex("build", true));
        assert!(!ex("x/build", true), "anchored at the root's .gitignore");
        assert!(ex("x/tmp", true));
        assert!(!ex("x/tmp", false), "dir-only");
        // A nested file re-includes, and anchors at its own directory.
        assert!(!ex("sub/keep.log", false));
        assert!(!ex("sub/x/keep.log", false));
        assert!(ex("sub/other.log", false));
        assert!(ex("sub/local.txt", false));
        assert!(
            !ex("local.txt", false),
            "sub's /local.txt is not the root's"
        );
        assert!(!ex("sub/x/local.txt", false));
        assert!(ex("sub/data/a.bin", false));
        assert!(!ex("data/a.bin", false));
        assert!(!ex("sub/data/x/a.bin", false), "one * is one component");
        // Deeper wins again, and a nested file can re-include over the defaults.
        assert!(ex("sub/deep/keep.log", false));
        assert!(ex("sub/deep/x/keep.log", false));
        assert!(!ex("sub/deep/m.pyc", false));
        assert!(ex("sub/m.pyc", false));
        // A sibling directory whose name starts like a layer's is not below it.
        assert!(ex("subway/keep.log", false));
        // The sync's own lines win over every .gitignore.
        let r = rules(true, &["!a.log", "sub/keep.log"]);
        assert!(!r.excluded_in(&layers, "a.log", false));
        assert!(r.excluded_in(&layers, "sub/keep.log", false));
        // Without layers, the same answers as `excluded`.
        let r = rules(true, &["*.log", "!keep.log"]);
        for (rel, dir) in [
            ("a.log", false),
            ("keep.log", false),
            (".git", true),
            ("s", true),
        ] {
            assert_eq!(r.excluded_in(&[], rel, dir), r.excluded(rel, dir), "{rel}");
        }
    }

    #[test]
    fn nested_gitignore_paths_consult_parents_and_skip_bad_lines() {
        let r = rules(true, &[]);
        let layers = [layer("", &["out/"]), layer("src", &["gen/", "!out/"])];
        // Nothing below an excluded directory comes back, as in git.
        assert!(r.excluded_path_in(&layers, "out/x/keep.txt", false));
        assert!(!r.excluded_path_in(&layers, "src/out/a.rs", false));
        assert!(r.excluded_path_in(&layers, "src/gen/a.rs", false));
        assert!(!r.excluded_path_in(&layers, "src/a.rs", false));
        // A line git would never match is left out and reported, the rest still apply.
        let (l, errors) = Layer::parse("d/", ["*.tmp", "[oops", "# c", ""]);
        assert_eq!(l.dir(), "d");
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].line, "[oops");
        assert!(r.excluded_in(&[l], "d/x.tmp", false));
    }

    #[test]
    fn defaults_apply_at_any_depth() {
        let r = rules(true, &[]);
        for (rel, dir) in [
            (".git", true),
            ("sub/.git", true),
            ("web/node_modules", true),
            ("a/b/node_modules", true),
            ("pkg/__pycache__", true),
            ("x.pyc", false),
            ("a/b/c.pyc", false),
            (".idea", true),
            ("z/.vscode", true),
        ] {
            assert!(r.excluded(rel, dir), "{rel} should be excluded");
        }
        for (rel, dir) in [
            ("src", true),
            ("node_modules", false), // a file: `node_modules/` matches directories only
            ("a.py", false),
            ("git", true),
            (".gitignore", false),
            ("x.pyc.txt", false),
        ] {
            assert!(!r.excluded(rel, dir), "{rel} should be included");
        }
        assert!(!rules(false, &[]).excluded("sub/.git", true));
    }

    #[test]
    fn later_lines_win_and_bang_reincludes() {
        let r = rules(true, &["*.log", "!keep.log", "!important.pyc"]);
        assert!(r.excluded("a.log", false));
        assert!(r.excluded("d/a.log", false));
        assert!(!r.excluded("keep.log", false));
        assert!(!r.excluded("d/keep.log", false));
        assert!(!r.excluded("important.pyc", false));
        assert!(r.excluded("other.pyc", false));
        // Order matters: a later exclude beats an earlier re-include.
        let r = rules(false, &["!keep.log", "*.log"]);
        assert!(r.excluded("keep.log", false));
    }

    #[test]
    fn slashes_anchor_and_comments_and_spaces() {
        let r = rules(
            false,
            &[
                "# a comment",
                "",
                "   ",
                "/top.txt",
                "build/out",
                "data/**/*.bin",
                "trailing   ",
                "escaped\\ ",
                "\\#hash",
                "\\!bang",
                "docs/",
                "*.tmp\r",
                "a/**",
            ],
        );
        assert!(r.excluded("top.txt", false));
        assert!(!r.excluded("d/top.txt", false));
        assert!(r.excluded("build/out", true));
        assert!(!r.excluded("x/build/out", true));
        assert!(r.excluded("data/a/b/c.bin", false));
        assert!(r.excluded("data/c.bin", false));
        assert!(!r.excluded("other/data/c.bin", false));
        assert!(!r.excluded("# a comment", false));
        assert!(r.excluded("trailing", false));
        assert!(r.excluded("escaped ", false));
        assert!(!r.excluded("escaped", false));
        assert!(r.excluded("#hash", false));
        assert!(r.excluded("x/!bang", false));
        assert!(r.excluded("docs", true));
        assert!(r.excluded("deep/docs", true));
        assert!(!r.excluded("docs", false));
        assert!(r.excluded("x.tmp", false));
        assert!(!r.excluded("a", true));
        assert!(r.excluded("a/b", false));
        // `*` does not cross `/` in an anchored pattern; braces are literal, as in git.
        let r = rules(false, &["src/*.rs", "{a,b}"]);
        assert!(r.excluded("src/x.rs", false));
        assert!(!r.excluded("src/m/x.rs", false));
        assert!(r.excluded("{a,b}", false));
        assert!(!r.excluded("a", false));
    }

    #[test]
    fn a_path_met_without_a_walk_consults_its_parents() {
        let r = rules(true, &["build/", "!build/keep.txt", "/top/", "foo\\*bar"]);
        assert!(
            r.excluded_path("build/keep.txt", false),
            "nothing below an excluded dir"
        );
        assert!(r.excluded_path("a/build/x", false));
        assert!(r.excluded_path("sub/.git/HEAD", false));
        assert!(r.excluded_path("top/x", false));
        assert!(!r.excluded_path("a/top/x", false));
        assert!(
            !r.excluded_path("build", false),
            "`build/` is for directories only"
        );
        assert!(r.excluded_path("/build/", true));
        assert!(!r.excluded_path("", false));
        assert!(!r.excluded_path("src/a.rs", false));
        // An escaped `*` is a literal star, at any depth.
        assert!(r.excluded_path("foo*bar", false));
        assert!(r.excluded_path("d/foo*bar", false));
        assert!(!r.excluded_path("fooXbar", false));
        assert!(!r.excluded_path("foo/bar", false));
    }

    #[test]
    fn bad_patterns_are_named() {
        for (bad, why) in [
            ("[a-z", "unclosed"),
            ("[z-a]", "invalid range"),
            ("x[0-9b-a]", "invalid range"),
            ("a[", "unclosed"),
            ("x\\", "dangling backslash"),
            ("[[:nope:]]", "unknown [:class:]"),
            ("a\0b", "NUL"),
        ] {
            let e = Rules::for_sync(true, &["ok".into(), bad.into()])
                .err()
                .unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert_eq!(e.line, bad);
            let message = e.to_string();
            assert!(
                message.starts_with(&format!("invalid exclude pattern {bad:?}: ")),
                "{message}"
            );
            assert!(message.contains(why), "{message}");
        }
        // Odd but valid.
        for ok in [
            "[]]",
            "[!]]",
            "a[]-]b",
            "[[:]ab]",
            "\\[x]",
            "**",
            "!",
            "/",
            "#x",
            "[a-a]",
            "[-z]",
            "[a-]",
            "[[:digit:]-z]",
            "[\\a-\\z]",
        ] {
            assert!(Rules::new([ok]).is_ok(), "{ok:?}");
        }
    }
}
