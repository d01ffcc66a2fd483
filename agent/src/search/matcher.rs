//! Which lines match: regex-lite for the semantics, memchr's `memmem` to find candidate lines.
//!
//! The full `regex` crate (its literal optimisations and lazy DFA) would cost the static agent
//! 0.7–1.2 MB of its 2 MiB budget; regex-lite costs ~65 KB but scans slowly. So a literal that
//! every match must contain is found with SIMD `memmem` over the whole file, and only the
//! lines holding it are given to the regex (a literal pattern needs no regex at all). Measured
//! figures are in the README's search section.
//!
//! regex-lite's matcher cannot be interrupted, and its time grows with the pattern's size
//! times the line's length (`(?:[a-z]{1,30}){1,30}[0-9]` takes ~45 s on a 2 MiB line). So a
//! line over [`LONG`] bytes is matched in pieces that each take a bounded time, with the stop
//! asked between them: in overlapping windows when every match spans a bounded number of
//! characters (exact, see [`span`]), else whole only if a timed probe says that is quick;
//! a line that would take longer is not matched and is reported ([`Scan::costly`]).

use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use memchr::memmem;
use regex_lite::{Regex, RegexBuilder};

use super::LineIndex;

/// Lines longer than this are matched in bounded pieces.
const LONG: usize = 8 << 10;
/// Bytes matched between two questions to `stop`, and the first window or probe.
const CHECK: usize = 2 << 10;
/// The longest one uninterruptible match call should take.
const SLICE: Duration = Duration::from_millis(300);
/// The longest a whole file's match may take with `rg -U` (it cannot be interrupted).
const WHOLE: Duration = Duration::from_secs(2);
/// Spans wider than this are not windowed (each window would be as costly as the line).
const MAX_SPAN: usize = 16 << 10;

/// What a scan of one file met besides its matches.
#[derive(Default)]
pub struct Scan {
    /// `stop` ended the scan early.
    pub stopped: bool,
    /// Lines not matched because the match would take too long; the first one's start and
    /// its estimated time.
    pub costly: u64,
    pub first_costly: Option<(usize, Duration)>,
    /// With `rg -U`: the runs of matches that share lines (inverted: the lines hit), what
    /// rg counts.
    pub runs: u64,
}

/// How a line is tested.
pub struct Matcher {
    re: Regex,
    /// A byte string every matching line contains (lowercased ASCII when `fold`).
    prefilter: Option<memmem::Finder<'static>>,
    /// The prefilter's hit is the match (a case-sensitive literal): no regex needed.
    exact: bool,
    /// Case-insensitive prefilter: the haystack is ASCII-lowercased before `memmem`.
    fold: bool,
    /// The most characters a match spans, for a windowed match of long lines ([`span`]).
    span: Option<usize>,
    /// `rg -w`: `re` is the pattern between word boundaries, its group 1 the match.
    word: bool,
    /// `rg -v`: a line is a hit when the pattern does not match it.
    invert: bool,
    /// `rg -U`: the pattern runs over the whole file ([`Matcher::lines_multi`]).
    multiline: bool,
}

/// How a pattern is matched, beyond its text.
#[derive(Clone, Copy, Default)]
pub struct Flags {
    pub literal: bool,
    pub ignore_case: bool,
    /// A match must stand as a word (`rg -w`).
    pub word: bool,
    /// Lines that do not match are the hits (`rg -v`).
    pub invert: bool,
    /// A match may span lines (`rg -U`).
    pub multiline: bool,
}

impl Matcher {
    pub fn new(pattern: &str, flags: Flags) -> Result<Matcher, String> {
        let Flags {
            literal,
            ignore_case,
            word,
            invert,
            multiline,
        } = flags;
        if pattern.is_empty() {
            return Err("the pattern is empty".into());
        }
        if !multiline && (pattern.contains('\n') || (!literal && has_newline_escape(pattern))) {
            return Err(
                "the pattern can match a line break; search matches one line at a time".into(),
            );
        }
        let source = if literal {
            regex_lite::escape(pattern)
        } else {
            pattern.to_string()
        };
        // As rg 13 spells `-w`: a non-word character or the line's edge on each side, so a
        // pattern that starts or ends with punctuation still matches as a word (`\b` would
        // not). The group is the match, for its ranges.
        let source = if word {
            format!(r"(?:^|\W)({source})(?:$|\W)")
        } else {
            source
        };
        // Over a whole file, `^` and `$` mark each line's edges, as over one line.
        let re = RegexBuilder::new(&source)
            .case_insensitive(ignore_case)
            .multi_line(multiline)
            .build()
            .map_err(|e| format!("invalid regex: {}", one_line(&e.to_string())))?;
        let needle = if literal {
            Some(pattern.as_bytes().to_vec())
        } else {
            required_literal(pattern)
        };
        // Folding a non-ASCII needle would need Unicode case rules, which regex-lite does not
        // apply either; such a search runs the regex on every line.
        let needle = needle.filter(|n| !n.is_empty() && (!ignore_case || n.is_ascii()));
        let fold = ignore_case && needle.is_some();
        let exact = literal && !ignore_case && !word;
        let prefilter = needle.map(|n| {
            let n = if fold { n.to_ascii_lowercase() } else { n };
            memmem::Finder::new(&n).into_owned()
        });
        Ok(Matcher {
            re,
            prefilter,
            exact,
            fold,
            span: span(&source).filter(|&n| n <= MAX_SPAN),
            word,
            invert,
            multiline,
        })
    }

    /// Call `hit(start, end)` for each matching line of `hay` (bounds without the `\n`), in
    /// order; stop when it returns false, or when `stop()` says so (asked every [`CHECK`]
    /// bytes matched). `scratch` holds the folded copy of `hay`.
    pub fn lines(
        &self,
        hay: &[u8],
        scratch: &mut Vec<u8>,
        stop: &dyn Fn() -> bool,
        mut hit: impl FnMut(usize, usize) -> bool,
    ) -> Scan {
        if self.multiline {
            return self.lines_multi(hay, scratch, stop, hit);
        }
        let mut scan = Scan::default();
        let mut pace = 0usize;
        let prefilter = self.prefilter.as_ref().filter(|_| !self.invert);
        let Some(finder) = prefilter else {
            let mut start = 0;
            while start < hay.len() {
                let end = memchr::memchr(b'\n', &hay[start..]).map_or(hay.len(), |i| start + i);
                let costly = scan.costly;
                // Inverted, a line too costly to match is neither a hit nor not: it is
                // counted in `scan` and left out.
                match self.test(hay, start, end, stop, &mut pace, &mut scan) {
                    None => return scan,
                    Some(m) if m != self.invert && scan.costly == costly && !hit(start, end) => {
                        return scan;
                    }
                    _ => {}
                }
                start = end + 1;
            }
            return scan;
        };
        let searched = self.folded(hay, scratch);
        let mut from = 0;
        while from < hay.len() {
            let Some(at) = finder.find(&searched[from..]) else {
                return scan;
            };
            let at = from + at;
            let start = memchr::memrchr(b'\n', &hay[..at]).map_or(0, |i| i + 1);
            let end = memchr::memchr(b'\n', &hay[at..]).map_or(hay.len(), |i| at + i);
            let matched = if self.exact {
                Some(true)
            } else {
                self.test(hay, start, end, stop, &mut pace, &mut scan)
            };
            match matched {
                None => return scan,
                Some(true) if !hit(start, end) => return scan,
                _ => {}
            }
            from = end + 1;
        }
        scan
    }

    /// What the prefilter searches: `hay`, or its ASCII-lowercased copy in `scratch` when
    /// the search folds case.
    fn folded<'h>(&self, hay: &'h [u8], scratch: &'h mut Vec<u8>) -> &'h [u8] {
        if !self.fold {
            return hay;
        }
        scratch.clear();
        scratch.extend(hay.iter().map(u8::to_ascii_lowercase));
        scratch
    }

    /// [`Matcher::lines`] with `rg -U`: the pattern runs over the whole file, and every line
    /// a match touches is a hit (inverted: every line none touches). [`Scan::runs`] counts the
    /// runs of matches that share lines, which rg counts as one each. A file whose match would
    /// take longer than [`WHOLE`] (a probe on its start says) is not matched and is reported.
    fn lines_multi(
        &self,
        hay: &[u8],
        scratch: &mut Vec<u8>,
        stop: &dyn Fn() -> bool,
        mut hit: impl FnMut(usize, usize) -> bool,
    ) -> Scan {
        let mut scan = Scan::default();
        if let Some(finder) = self.prefilter.as_ref().filter(|_| !self.invert)
            && finder.find(self.folded(hay, scratch)).is_none()
        {
            return scan;
        }
        if stop() {
            scan.stopped = true;
            return scan;
        }
        let text = String::from_utf8_lossy(hay);
        if let Some(est) = self.too_slow(&text) {
            scan.costly = 1;
            scan.first_costly = Some((0, est));
            return scan;
        }
        // Lines are numbered alike in the text and the bytes: a `\n` ends an invalid sequence.
        let runs = self.runs(&text);
        let lines = LineIndex::new(hay);
        let bounds = |n: usize| lines.line(hay, n).unwrap_or((hay.len(), hay.len()));
        if self.invert {
            let mut runs = runs.iter().peekable();
            for n in 1..=lines.count() {
                while runs.next_if(|&&(_, last)| last < n).is_some() {}
                if runs.peek().is_some_and(|&&(first, _)| first <= n) {
                    continue;
                }
                scan.runs += 1;
                let (s, e) = bounds(n);
                if !hit(s, e) {
                    return scan;
                }
            }
            return scan;
        }
        scan.runs = runs.len() as u64;
        for (first, last) in runs {
            for n in first..=last {
                let (s, e) = bounds(n);
                if !hit(s, e) {
                    return scan;
                }
            }
        }
        scan
    }

    /// The estimated time of matching all of `text` when that is over [`WHOLE`].
    fn too_slow(&self, text: &str) -> Option<Duration> {
        if text.len() <= LONG {
            return None;
        }
        let mut cut = CHECK;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let t = Instant::now();
        let _ = self.spans(&text[..cut], usize::MAX, true).len();
        let est = t.elapsed().mul_f64(text.len() as f64 / cut.max(1) as f64);
        (est > WHOLE).then_some(est)
    }

    /// The lines (1-based, first and last) each run of matches in `text` touches, where a
    /// run is matches that share a line; an empty match touches the line it stands on.
    fn runs(&self, text: &str) -> Vec<(usize, usize)> {
        let lines = LineIndex::new(text.as_bytes());
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (_, (s, e)) in self.touched(text, &lines) {
            match runs.last_mut() {
                Some(r) if s <= r.1 => r.1 = r.1.max(e),
                _ => runs.push((s, e)),
            }
        }
        runs
    }

    /// Each match in `text`, in order, with the first and last line (1-based) it touches.
    /// An empty match after the final line break stands on no line.
    fn touched(&self, text: &str, lines: &LineIndex) -> Vec<((usize, usize), (usize, usize))> {
        self.spans(text, usize::MAX, true)
            .into_iter()
            .filter(|&(s, _)| s < text.len() || (s > 0 && !text.ends_with('\n')))
            .map(|(s, e)| {
                let first = lines.number_at(s);
                let last = if e > s { lines.number_at(e - 1) } else { first };
                ((s, e), (first, last))
            })
            .collect()
    }

    /// With `rg -U`: each line (1-based) of `hay` a match touches, with the byte ranges of
    /// the matches within the line's text (lossily UTF-8, without its `\n`). An inverted
    /// search's hits are the lines not in it.
    pub fn matched_lines(&self, hay: &[u8]) -> BTreeMap<usize, Vec<(usize, usize)>> {
        let text = String::from_utf8_lossy(hay);
        let lines = LineIndex::new(text.as_bytes());
        let mut out = BTreeMap::<usize, Vec<(usize, usize)>>::new();
        for ((s, e), (first, last)) in self.touched(&text, &lines) {
            for n in first..=last {
                let Some((a, b)) = lines.line(text.as_bytes(), n) else {
                    continue;
                };
                let ranges = out.entry(n).or_default();
                let (x, y) = (s.max(a), e.min(b));
                if y > x {
                    ranges.push((x - a, y - a));
                }
            }
        }
        out
    }

    /// Whether the pattern may span lines (`rg -U`).
    pub fn multiline(&self) -> bool {
        self.multiline
    }

    /// Whether line `hay[start..end]` matches; `None` when `stop` ended it. A line too costly
    /// to match is counted in `scan` and taken as no match.
    fn test(
        &self,
        hay: &[u8],
        start: usize,
        end: usize,
        stop: &dyn Fn() -> bool,
        pace: &mut usize,
        scan: &mut Scan,
    ) -> Option<bool> {
        let line = &hay[start..end];
        *pace += line.len();
        if *pace >= CHECK {
            *pace = 0;
            if stop() {
                scan.stopped = true;
                return None;
            }
        }
        if line.len() <= LONG {
            return Some(self.is_match(line));
        }
        let text = String::from_utf8_lossy(line);
        let long = match self.span {
            Some(span) => self.windowed(&text, span, (CHECK, 1 << 20), stop),
            None => self.probed(&text, stop),
        };
        match long {
            Long::Decided(m) => Some(m),
            Long::Stopped => {
                scan.stopped = true;
                None
            }
            Long::Costly(est) => {
                scan.costly += 1;
                scan.first_costly.get_or_insert((start, est));
                Some(false)
            }
        }
    }

    /// Match a long line in windows of `sizes.0` to `sizes.1` bytes (adapted so each takes a
    /// fraction of [`SLICE`]), each extended by `span` characters: every match of at most
    /// `span` characters lies wholly in one window, and an assertion-free pattern matches a
    /// window exactly when it matches that text in the line.
    fn windowed(
        &self,
        text: &str,
        span: usize,
        sizes: (usize, usize),
        stop: &dyn Fn() -> bool,
    ) -> Long {
        let mut size = sizes.0;
        let mut start = 0;
        loop {
            // The next window starts at least one character further.
            let mut next = (start + size).min(text.len());
            while !text.is_char_boundary(next) {
                next += 1;
            }
            let end = text[next..]
                .char_indices()
                .nth(span)
                .map_or(text.len(), |(k, _)| next + k);
            let t = Instant::now();
            if self.re.is_match(&text[start..end]) {
                return Long::Decided(true);
            }
            if end == text.len() {
                return Long::Decided(false);
            }
            let took = t.elapsed();
            if took < SLICE / 16 {
                size = (size * 2).min(sizes.1);
            } else if took > SLICE / 4 {
                size = (size / 2).max(sizes.0.min(256));
            }
            start = next;
            if stop() {
                return Long::Stopped;
            }
        }
    }

    /// Match a long line whole if matching its first [`CHECK`] bytes says that takes at
    /// most [`SLICE`].
    fn probed(&self, text: &str, stop: &dyn Fn() -> bool) -> Long {
        let mut cut = CHECK;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let t = Instant::now();
        let _ = self.re.is_match(&text[..cut]);
        let est = t.elapsed().mul_f64(text.len() as f64 / cut.max(1) as f64);
        if est > SLICE {
            return Long::Costly(est);
        }
        if stop() {
            return Long::Stopped;
        }
        Long::Decided(self.re.is_match(text))
    }

    fn is_match(&self, line: &[u8]) -> bool {
        match std::str::from_utf8(line) {
            Ok(s) => self.re.is_match(s),
            Err(_) => self.re.is_match(&String::from_utf8_lossy(line)),
        }
    }

    /// Whether `line` is a hit: it matches, or (inverted) it does not.
    pub fn hit(&self, line: &[u8]) -> bool {
        self.is_match(line) != self.invert
    }

    /// Whether hits are lines that do not match (which have no match ranges).
    pub fn inverted(&self) -> bool {
        self.invert
    }

    /// Byte ranges of the matches in `text` (at most `max`).
    pub fn ranges(&self, text: &str, max: usize) -> Vec<(u32, u32)> {
        self.spans(text, max, false)
            .into_iter()
            .map(|(s, e)| (s as u32, e as u32))
            .collect()
    }

    /// Byte ranges of the matches in `text` (at most `max`), empty ones too when `empty`.
    fn spans(&self, text: &str, max: usize, empty: bool) -> Vec<(usize, usize)> {
        if !self.word {
            return self
                .re
                .find_iter(text)
                .filter(|m| empty || m.end() > m.start())
                .take(max)
                .map(|m| (m.start(), m.end()))
                .collect();
        }
        // Each next search starts where the last word ended, so the character after it can
        // be the boundary before the next (`foo foo`: both).
        let mut out = Vec::new();
        let mut at = 0;
        while out.len() < max && at <= text.len() {
            let Some(m) = self.re.captures_at(text, at).and_then(|c| c.get(1)) else {
                break;
            };
            if empty || m.end() > m.start() {
                out.push((m.start(), m.end()));
            }
            at = if m.end() > at {
                m.end()
            } else {
                at + text[at..].chars().next().map_or(1, char::len_utf8)
            };
        }
        out
    }
}

enum Long {
    Decided(bool),
    Stopped,
    Costly(Duration),
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `\n` outside a character class is the only escape that spells a line break (`\x0A` and
/// `\u{A}` too, rarely; they are caught by regex-lite matching nothing across lines anyway).
fn has_newline_escape(p: &str) -> bool {
    let b = p.as_bytes();
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\\' {
            if b[i + 1] == b'n' {
                return true;
            }
            i += 2;
        } else {
            i += 1;
        }
    }
    false
}

/// The longest run of literal text at the top level of `pattern` that every match contains,
/// or `None` when that cannot be told cheaply (an alternation at the top, inline flags). Only
/// ever an under-approximation: it may miss a literal, never invent one.
pub fn required_literal(pattern: &str) -> Option<Vec<u8>> {
    let b = pattern.as_bytes();
    if pattern.contains("(?") {
        return None;
    }
    let mut best: Vec<u8> = Vec::new();
    let mut run: Vec<u8> = Vec::new();
    // Byte length of the last literal character in `run` (a quantifier after it makes it
    // optional or repeated).
    let mut last_len = 0usize;
    let mut depth = 0usize;
    let mut i = 0;
    let flush = |run: &mut Vec<u8>, best: &mut Vec<u8>| {
        if run.len() > best.len() {
            *best = run.clone();
        }
        run.clear();
    };
    while i < b.len() {
        let c = b[i];
        if depth > 0 {
            match c {
                b'\\' => i += 2,
                b'[' => i = skip_class(b, i)?,
                b'(' => {
                    depth += 1;
                    i += 1;
                }
                b')' => {
                    depth -= 1;
                    i += 1;
                }
                _ => i += 1,
            }
            continue;
        }
        match c {
            b'|' => return None,
            b'\\' => {
                let e = *b.get(i + 1)?;
                if e.is_ascii_punctuation() {
                    run.push(e);
                    last_len = 1;
                    i += 2;
                } else {
                    flush(&mut run, &mut best);
                    last_len = 0;
                    i = skip_escape(b, i)?;
                }
            }
            b'[' => {
                flush(&mut run, &mut best);
                last_len = 0;
                i = skip_class(b, i)?;
            }
            b'(' => {
                flush(&mut run, &mut best);
                last_len = 0;
                depth = 1;
                i += 1;
            }
            b')' => return None,
            b'.' | b'^' | b'$' => {
                flush(&mut run, &mut best);
                last_len = 0;
                i += 1;
            }
            b'?' | b'*' | b'{' => {
                // The character before is optional (or its count unknown): drop it.
                let keep = run.len().saturating_sub(last_len);
                run.truncate(keep);
                flush(&mut run, &mut best);
                last_len = 0;
                i += 1;
                if c == b'{' {
                    while i < b.len() && b[i] != b'}' {
                        i += 1;
                    }
                    i += 1;
                }
                // A lazy or possessive marker after the quantifier.
                if matches!(b.get(i), Some(b'?' | b'+')) {
                    i += 1;
                }
            }
            b'+' => {
                // Required at least once: the run up to here holds, but not beyond.
                flush(&mut run, &mut best);
                last_len = 0;
                i += 1;
                if matches!(b.get(i), Some(b'?')) {
                    i += 1;
                }
            }
            _ => {
                let len = utf8_len(c);
                run.extend_from_slice(b.get(i..i + len)?);
                last_len = len;
                i += len;
            }
        }
    }
    if depth != 0 {
        return None;
    }
    flush(&mut run, &mut best);
    (!best.is_empty()).then_some(best)
}

/// Index just past the escape that starts at `b[i] == b'\\'` and is not escaped punctuation,
/// with its argument: `\x41`, `\x{41}`, `\u0041`, `\U00000041`, `\pL`, `\p{Greek}`. The
/// argument's characters are not literal text (`\x41BC` must not require `41BC`). Only hex
/// digits are skipped after `\x`, `\u`, `\U`, so a `|`, `(` or `[` after a short one is
/// still seen; `None` for a brace that never closes (the regex then reports the error).
fn skip_escape(b: &[u8], i: usize) -> Option<usize> {
    let e = *b.get(i + 1)?;
    let mut j = i + 2;
    let digits = match e {
        b'x' => 2,
        b'u' => 4,
        b'U' => 8,
        b'p' | b'P' => {
            return match b.get(j) {
                Some(b'{') => b[j..].iter().position(|&c| c == b'}').map(|k| j + k + 1),
                Some(&c) => Some(j + utf8_len(c)),
                None => Some(j),
            };
        }
        _ => return Some(j),
    };
    if b.get(j) == Some(&b'{') {
        return b[j..].iter().position(|&c| c == b'}').map(|k| j + k + 1);
    }
    let end = (j + digits).min(b.len());
    while j < end && b[j].is_ascii_hexdigit() {
        j += 1;
    }
    Some(j)
}

/// The most characters a match of `pattern` can span, when that is bounded and the pattern
/// has no assertion (`^`, `$`, `\b`, `\B`, `\A`, `\z`, `\<`, `\>`) and no inline flags:
/// whether such a pattern matches depends only on the matched text, so a line matches
/// exactly when one of its windows overlapping by the span does. `None` when unbounded
/// (`*`, `+`, `{n,}`) or unsure: an over-estimate only costs time, an under-estimate would
/// miss matches.
fn span(pattern: &str) -> Option<usize> {
    let b = pattern.as_bytes();
    let mut i = 0;
    let n = span_alt(b, &mut i)?;
    (i == b.len()).then_some(n)
}

fn span_alt(b: &[u8], i: &mut usize) -> Option<usize> {
    let mut most = span_seq(b, i)?;
    while b.get(*i) == Some(&b'|') {
        *i += 1;
        most = most.max(span_seq(b, i)?);
    }
    Some(most)
}

fn span_seq(b: &[u8], i: &mut usize) -> Option<usize> {
    let mut sum = 0usize;
    while let Some(&c) = b.get(*i) {
        let atom = match c {
            b'|' | b')' => break,
            b'(' => {
                *i += match b.get(*i + 1..*i + 3) {
                    Some(b"?:") => 3,
                    _ if b.get(*i + 1) == Some(&b'?') => return None,
                    _ => 1,
                };
                let n = span_alt(b, i)?;
                if b.get(*i) != Some(&b')') {
                    return None;
                }
                *i += 1;
                n
            }
            b'[' => {
                *i = skip_class(b, *i)?;
                1
            }
            b'\\' => {
                let e = *b.get(*i + 1)?;
                if matches!(e, b'b' | b'B' | b'A' | b'z' | b'<' | b'>') {
                    return None;
                }
                *i = if e.is_ascii_punctuation() {
                    *i + 2
                } else {
                    skip_escape(b, *i)?
                };
                1
            }
            b'^' | b'$' | b'*' | b'+' | b'?' | b'{' => return None,
            _ => {
                *i += utf8_len(c);
                1
            }
        };
        let times = match b.get(*i) {
            Some(b'*' | b'+') => return None,
            Some(b'?') => Some(1),
            Some(b'{') => {
                let close = *i + b[*i..].iter().position(|&c| c == b'}')?;
                let inner = std::str::from_utf8(&b[*i + 1..close]).ok()?;
                *i = close;
                Some(inner.rsplit(',').next()?.parse::<usize>().ok()?)
            }
            _ => None,
        };
        // After a quantifier, a lazy marker; any other repetition is left to `None` above.
        if times.is_some() {
            *i += 1;
            if b.get(*i) == Some(&b'?') {
                *i += 1;
            }
        }
        sum = sum.saturating_add(atom.saturating_mul(times.unwrap_or(1)));
        if sum > MAX_SPAN {
            return None;
        }
    }
    Some(sum)
}

fn utf8_len(first: u8) -> usize {
    match first {
        0xF0..=0xFF => 4,
        0xE0..=0xEF => 3,
        0xC0..=0xDF => 2,
        _ => 1,
    }
}

/// Index just past the class that starts at `b[i] == b'['` (nested `[...]` and escapes
/// included), or `None` if it never closes (regex-lite then reports the error).
fn skip_class(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    if b.get(i) == Some(&b'^') {
        i += 1;
    }
    if b.get(i) == Some(&b']') {
        i += 1;
    }
    let mut depth = 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'[' => {
                depth += 1;
                i += 1;
            }
            b']' => {
                depth -= 1;
                i += 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(literal: bool, ignore_case: bool) -> Flags {
        Flags {
            literal,
            ignore_case,
            ..Flags::default()
        }
    }

    fn lit(p: &str) -> Option<String> {
        required_literal(p).map(|v| String::from_utf8(v).unwrap())
    }

    #[test]
    fn required_literals_never_invent_text() {
        assert_eq!(lit("hello"), Some("hello".into()));
        assert_eq!(lit("fn \\w+\\(foo"), Some("(foo".into()));
        assert_eq!(lit("colou?r"), Some("colo".into()));
        assert_eq!(lit("ab*c"), Some("a".into()));
        assert_eq!(lit("x+yz"), Some("yz".into()));
        assert_eq!(lit("a|b"), None);
        assert_eq!(lit("(?i)abc"), None);
        assert_eq!(lit("(ab|cd)efg"), Some("efg".into()));
        assert_eq!(lit("[a-z]+_test"), Some("_test".into()));
        assert_eq!(lit("a{2,3}bcd"), Some("bcd".into()));
        assert_eq!(lit("\\d\\d"), None);
        assert_eq!(lit("déjà vu"), Some("déjà vu".into()));
        assert_eq!(lit("[]x]abc"), Some("abc".into()));
        // An escape's argument is not literal text (issue 50: `\x41BC` required "41BC").
        assert_eq!(lit("\\x41BC"), Some("BC".into()));
        assert_eq!(lit("\\u0041BC"), Some("BC".into()));
        assert_eq!(lit("\\U00000041BC"), Some("BC".into()));
        assert_eq!(lit("\\x{41}BC"), Some("BC".into()));
        assert_eq!(lit("\\x{41BC"), None);
        assert_eq!(lit("xy\\pLz"), Some("xy".into()));
        assert_eq!(lit("xy\\p{Greek}zz"), Some("xy".into()));
        assert_eq!(lit("\\x4|abc"), None);
    }

    /// A tiny deterministic generator (xorshift), so the property test needs no crate and
    /// fails the same way every run.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }

        fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
            xs[self.below(xs.len())]
        }
    }

    /// A random pattern from a grammar of literals, escapes (with and without arguments),
    /// classes, groups, alternations and quantifiers.
    fn pattern(r: &mut Rng, depth: usize) -> String {
        const ATOMS: &[&str] = &[
            "a",
            "b",
            "c",
            "A",
            "B",
            "1",
            " ",
            "\\.",
            "\\x41",
            "\\x{62}",
            "\\x6",
            "\\u0061",
            "\\u{43}",
            "\\U00000042",
            "\\d",
            "\\w",
            "\\s",
            "\\b",
            "\\B",
            "\\t",
            "[a-c]",
            "[^b]",
            "[\\x41-\\x43]",
            "[]a]",
            ".",
            "^",
            "$",
            "\\x2E",
            "\\(",
            "\\|",
        ];
        const QUANT: &[&str] = &[
            "", "", "", "", "?", "*", "+", "{0,2}", "{1}", "{2,}", "??", "*?", "+?",
        ];
        let mut p = String::new();
        for _ in 0..1 + r.below(5) {
            match r.below(10) {
                0 if depth < 2 => {
                    p.push('(');
                    p.push_str(&pattern(r, depth + 1));
                    if r.below(2) == 0 {
                        p.push('|');
                        p.push_str(&pattern(r, depth + 1));
                    }
                    p.push(')');
                }
                1 if depth == 0 && !p.is_empty() => p.push('|'),
                _ => p.push_str(r.pick(ATOMS)),
            }
            p.push_str(r.pick(QUANT));
        }
        p
    }

    /// Issue 50: for 10,000 random patterns (either case mode) and a haystack of random lines,
    /// the prefiltered search returns exactly the lines a plain regex scan does.
    #[test]
    fn the_prefiltered_search_equals_a_plain_scan_for_random_patterns() {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        const CH: &[&str] = &["a", "b", "c", "A", "B", "C", "1", ".", " ", "(", "|", "\t"];
        let hay: String = (0..200)
            .map(|_| (0..r.below(9)).map(|_| r.pick(CH)).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n");
        let (mut tried, mut filtered) = (0, 0);
        for _ in 0..10_000 {
            let p = pattern(&mut r, 0);
            let ic = r.below(3) == 0;
            let Ok(m) = Matcher::new(&p, flags(false, ic)) else {
                continue;
            };
            tried += 1;
            filtered += usize::from(m.prefilter.is_some());
            let expect: Vec<String> = hay
                .split('\n')
                .filter(|l| m.re.is_match(l))
                .map(String::from)
                .collect();
            assert_eq!(
                matching(&m, &hay),
                expect,
                "pattern {p:?}, ignore_case {ic}"
            );
        }
        // The generator makes mostly valid patterns, and many of them get a prefilter.
        assert!(tried > 6_000, "{tried} valid patterns");
        assert!(filtered > 2_000, "{filtered} prefiltered");
    }

    fn matching(m: &Matcher, hay: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut scratch = Vec::new();
        m.lines(hay.as_bytes(), &mut scratch, &|| false, |s, e| {
            out.push(hay[s..e].to_string());
            true
        });
        out
    }

    #[test]
    fn spans_are_bounded_only_when_sure() {
        let cases: &[(&str, Option<usize>)] = &[
            ("(?:[a-z]{1,30}){1,30}[0-9]", Some(901)),
            ("abc", Some(3)),
            ("a|bcd|ef", Some(3)),
            ("(ab|c)d?", Some(3)),
            ("a??b{0}c{2}?", Some(3)),
            ("\\x{41}\\pL\\p{Greek}\\.[]a]é", Some(6)),
            ("a{2,}", None),
            ("a*b", None),
            ("(a+)", None),
            ("^a", None),
            ("a$", None),
            ("\\bword", None),
            ("x\\B", None),
            ("(?i)a", None),
            ("(?i:a)", None),
            ("a{1,}", None),
            ("a{1,100000}", None),
        ];
        for (p, want) in cases {
            assert_eq!(span(p), *want, "{p:?}");
        }
    }

    /// For random bounded, assertion-free patterns, matching a long line in windows (from
    /// several first window sizes, over multibyte text) agrees with one whole-line match.
    #[test]
    fn windowed_matches_equal_whole_line_matches() {
        let mut r = Rng(0x2545_f491_4f6c_dd1d);
        const CH: &[&str] = &["a", "b", "c", "A", "B", "1", ".", " ", "é", "日", "\t"];
        let lines: Vec<String> = (0..8)
            .map(|_| (0..40 + r.below(200)).map(|_| r.pick(CH)).collect())
            .collect();
        let (mut tried, mut matched) = (0, 0);
        for _ in 0..10_000 {
            let p = pattern(&mut r, 0);
            let Ok(m) = Matcher::new(&p, flags(false, r.below(3) == 0)) else {
                continue;
            };
            let Some(span) = m.span else { continue };
            tried += 1;
            let line = &lines[r.below(lines.len())];
            let whole = m.re.is_match(line);
            matched += usize::from(whole);
            let size = 1 + r.below(8);
            assert!(
                matches!(m.windowed(line, span, (size, size), &|| false), Long::Decided(w) if w == whole),
                "pattern {p:?}, window {size}, line {line:?}"
            );
        }
        assert!(tried > 1_200, "{tried} windowed patterns");
        assert!(
            matched > 200 && matched < tried - 200,
            "{matched} of {tried} matched"
        );
    }

    /// Issue 50: the pattern that has no literal and took ~45 s on a 2 MiB line stops within
    /// a slice of being asked to, and an unbounded one is refused after a short probe.
    #[test]
    fn long_lines_stop_when_asked_and_costly_ones_are_skipped() {
        let letters: String = (0..2 << 20)
            .map(|i| (b'a' + (i % 26) as u8) as char)
            .collect();
        let m = Matcher::new("(?:[a-z]{1,30}){1,30}[0-9]", flags(false, false)).unwrap();
        assert_eq!(m.span, Some(901));
        let t = Instant::now();
        let stop = || t.elapsed() > Duration::from_millis(200);
        let scan = m.lines(letters.as_bytes(), &mut Vec::new(), &stop, |_, _| true);
        assert!(scan.stopped);
        assert!(
            t.elapsed() < Duration::from_millis(200) + SLICE * 2,
            "{:?}",
            t.elapsed()
        );
        // A match near the end of a long line is found by the windows.
        let near = format!("{}7", &letters[..40_000]);
        let mut hits = 0;
        let scan = m.lines(near.as_bytes(), &mut Vec::new(), &|| false, |_, _| {
            hits += 1;
            true
        });
        assert!(!scan.stopped && scan.costly == 0 && hits == 1);
        // Unbounded (`+`): not windowed; the probe says the line would take too long.
        let m = Matcher::new("(?:[a-z]{1,30}){1,30}[0-9]+", flags(false, false)).unwrap();
        assert_eq!(m.span, None);
        let hay = format!("short1\n{letters}\nlast2");
        let t = Instant::now();
        let mut hits = Vec::new();
        let scan = m.lines(hay.as_bytes(), &mut Vec::new(), &|| false, |s, e| {
            hits.push(hay[s..e].to_string());
            true
        });
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert_eq!(hits, ["short1", "last2"]);
        assert_eq!(scan.costly, 1);
        assert!(matches!(scan.first_costly, Some((7, est)) if est > SLICE));
    }

    #[test]
    fn the_prefilter_agrees_with_the_regex_on_every_line() {
        let hay = "alpha beta\nGamma delta\nbeta\n\nfn foo(x)\nfnfoo\nlast beta";
        for (p, lit, ic) in [
            ("beta", false, false),
            ("BETA", false, true),
            ("fn \\w+\\(", false, false),
            ("^beta$", false, false),
            ("(x)", true, false),
            ("gamma", true, true),
            ("a|f", false, false),
        ] {
            let m = Matcher::new(p, flags(lit, ic)).unwrap();
            let expect: Vec<String> = hay
                .split('\n')
                .filter(|l| m.re.is_match(l))
                .map(String::from)
                .collect();
            assert_eq!(matching(&m, hay), expect, "pattern {p:?}");
        }
    }

    #[test]
    fn patterns_that_span_lines_are_refused() {
        assert!(Matcher::new("a\\nb", flags(false, false)).is_err());
        assert!(Matcher::new("a\nb", flags(true, false)).is_err());
        assert!(Matcher::new("(unclosed", flags(false, false)).is_err());
        assert!(Matcher::new("", flags(false, false)).is_err());
        // A literal `\n` (two characters) is fine when the pattern is literal.
        assert!(Matcher::new("a\\nb", flags(true, false)).is_ok());
    }

    #[test]
    fn words_match_as_rg_spells_them() {
        let hay = "foo\nfoobar\nbar foo baz\nx-foo-y\n_foo\n-x here\nfoo foo\n";
        let word = |_: &str, literal: bool| Flags {
            literal,
            word: true,
            ..Flags::default()
        };
        let m = Matcher::new("foo", word("foo", true)).unwrap();
        assert_eq!(
            matching(&m, hay),
            ["foo", "bar foo baz", "x-foo-y", "foo foo"]
        );
        // Both words of `foo foo`, and only the word, as ranges.
        assert_eq!(m.ranges("foo foo", 8), [(0, 3), (4, 7)]);
        assert_eq!(m.ranges("x-foo-y", 8), [(2, 5)]);
        // A pattern that starts with punctuation still matches as a word (`\b-x` would not).
        let m = Matcher::new("-x", word("-x", true)).unwrap();
        assert_eq!(matching(&m, hay), ["-x here"]);
        let m = Matcher::new("fo+", word("fo+", false)).unwrap();
        assert_eq!(
            matching(&m, hay),
            ["foo", "bar foo baz", "x-foo-y", "foo foo"]
        );
    }

    #[test]
    fn inverted_hits_are_the_lines_that_do_not_match() {
        let hay = "alpha\nbeta\n\ngamma beta\nlast";
        for literal in [false, true] {
            let m = Matcher::new(
                "beta",
                Flags {
                    literal,
                    invert: true,
                    ..Flags::default()
                },
            )
            .unwrap();
            assert_eq!(
                matching(&m, hay),
                ["alpha", "", "last"],
                "literal {literal}"
            );
            assert!(m.hit(b"alpha") && !m.hit(b"a beta"));
        }
    }

    /// With -U, the lines and counts rg 13 prints (`rg -U PATTERN`, `rg -U -c PATTERN`),
    /// checked by hand against it on this text.
    #[test]
    fn multiline_matches_span_lines_as_rg_does() {
        let hay = "a\nfoo\nbar\nbaz\nfoo\nbar\nx\ny\nfoo bar\n";
        let multi = |pattern: &str, f: Flags| {
            let m = Matcher::new(
                pattern,
                Flags {
                    multiline: true,
                    ..f
                },
            )
            .unwrap();
            let (mut lines, mut scratch) = (Vec::new(), Vec::new());
            let scan = m.lines(hay.as_bytes(), &mut scratch, &|| false, |s, e| {
                lines.push(hay[s..e].to_string());
                true
            });
            (lines, scan.runs)
        };
        let plain = Flags::default();
        let (lines, runs) = multi("foo\\nbar", plain);
        assert_eq!(
            (lines, runs),
            (
                vec!["foo", "bar", "foo", "bar"]
                    .into_iter()
                    .map(String::from)
                    .collect::<Vec<_>>(),
                2
            )
        );
        // Matches on one line are one run; on lines that only touch, separate ones.
        assert_eq!(multi("o", plain).1, 3);
        assert_eq!(multi("ba.", plain).1, 4);
        assert_eq!(multi("r\\nb", plain), (vec!["bar".into(), "baz".into()], 1));
        let (lines, runs) = multi("(?s)a.*x", plain);
        assert_eq!((lines.len(), lines[6].as_str(), runs), (7, "x", 1));
        // `^` marks each line's start (none after the final line break); a match that ends
        // with the line break stays on its line.
        assert_eq!(multi("^", plain).0.len(), 9);
        assert_eq!(multi("a\\n", plain).0, ["a"]);
        // -v: the lines no match touches; -w and -i as without -U.
        let inverted = Flags {
            invert: true,
            ..plain
        };
        assert_eq!(
            multi("foo\\nbar", inverted).0,
            ["a", "baz", "x", "y", "foo bar"]
        );
        let word = Flags {
            word: true,
            ..plain
        };
        assert_eq!(multi("foo\\nbar", word).1, 2);
        assert_eq!(multi("oo\\nbar", word).1, 0);
        let fold = Flags {
            ignore_case: true,
            ..plain
        };
        assert_eq!(multi("FOO\\nBAR", fold).1, 2);
        assert_eq!(multi("nothing\\nhere", fold), (vec![], 0));
        // Ranges within each line's text.
        let m = Matcher::new(
            "o\\nb",
            Flags {
                multiline: true,
                ..plain
            },
        )
        .unwrap();
        let lines = m.matched_lines(hay.as_bytes());
        assert_eq!(lines.get(&2), Some(&vec![(2, 3)]));
        assert_eq!(lines.get(&3), Some(&vec![(0, 1)]));
        assert_eq!(lines.len(), 4);
        // Bytes that are not UTF-8: lines keep their bounds in the file.
        let bytes = b"\xff\xfe\nfoo\nbar\n";
        let m = Matcher::new(
            "foo\\nbar",
            Flags {
                multiline: true,
                ..plain
            },
        )
        .unwrap();
        let mut hits = Vec::new();
        m.lines(bytes, &mut Vec::new(), &|| false, |s, e| {
            hits.push((s, e));
            true
        });
        assert_eq!(hits, [(3, 6), (7, 10)]);
    }

    /// With -U the whole file is one uninterruptible match: a pattern that would take too
    /// long on it is not run, and the file is reported rather than the search hanging.
    #[test]
    fn a_multiline_match_too_slow_for_the_file_is_skipped() {
        let hay = "a".repeat(1 << 20);
        let m = Matcher::new(
            "(?:[a-z]{1,30}){1,30}[0-9]",
            Flags {
                multiline: true,
                ..Flags::default()
            },
        )
        .unwrap();
        let t = Instant::now();
        let scan = m.lines(hay.as_bytes(), &mut Vec::new(), &|| false, |_, _| true);
        assert_eq!(scan.costly, 1);
        assert!(scan.first_costly.is_some_and(|(_, est)| est > WHOLE));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
}
