//! Which lines match: regex-lite for the semantics, memchr's `memmem` to find candidate lines.
//!
//! The full `regex` crate (its literal optimisations and lazy DFA) would cost the static agent
//! 0.7–1.2 MB of its 2 MiB budget; regex-lite costs ~65 KB but scans slowly. So a literal that
//! every match must contain is found with SIMD `memmem` over the whole file, and only the
//! lines holding it are given to the regex (a literal pattern needs no regex at all). Measured
//! figures are in the README's search section.

use memchr::memmem;
use regex_lite::{Regex, RegexBuilder};

/// How a line is tested.
pub struct Matcher {
    re: Regex,
    /// A byte string every matching line contains (lowercased ASCII when `fold`).
    prefilter: Option<memmem::Finder<'static>>,
    /// The prefilter's hit is the match (a case-sensitive literal): no regex needed.
    exact: bool,
    /// Case-insensitive prefilter: the haystack is ASCII-lowercased before `memmem`.
    fold: bool,
}

impl Matcher {
    pub fn new(pattern: &str, literal: bool, ignore_case: bool) -> Result<Matcher, String> {
        if pattern.is_empty() {
            return Err("the pattern is empty".into());
        }
        if pattern.contains('\n') || (!literal && has_newline_escape(pattern)) {
            return Err(
                "the pattern can match a line break; search matches one line at a time".into(),
            );
        }
        let source = if literal {
            regex_lite::escape(pattern)
        } else {
            pattern.to_string()
        };
        let re = RegexBuilder::new(&source)
            .case_insensitive(ignore_case)
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
        let exact = literal && !ignore_case;
        let prefilter = needle.map(|n| {
            let n = if fold { n.to_ascii_lowercase() } else { n };
            memmem::Finder::new(&n).into_owned()
        });
        Ok(Matcher {
            re,
            prefilter,
            exact,
            fold,
        })
    }

    /// Call `hit(start, end)` for each matching line of `hay` (bounds without the `\n`), in
    /// order; stop when it returns false. `scratch` holds the folded copy of `hay`.
    pub fn lines(
        &self,
        hay: &[u8],
        scratch: &mut Vec<u8>,
        mut hit: impl FnMut(usize, usize) -> bool,
    ) {
        let Some(finder) = &self.prefilter else {
            let mut start = 0;
            while start < hay.len() {
                let end = memchr::memchr(b'\n', &hay[start..]).map_or(hay.len(), |i| start + i);
                if self.is_match(&hay[start..end]) && !hit(start, end) {
                    return;
                }
                start = end + 1;
            }
            return;
        };
        let searched: &[u8] = if self.fold {
            scratch.clear();
            scratch.extend(hay.iter().map(u8::to_ascii_lowercase));
            scratch
        } else {
            hay
        };
        let mut from = 0;
        while from < hay.len() {
            let Some(at) = finder.find(&searched[from..]) else {
                return;
            };
            let at = from + at;
            let start = memchr::memrchr(b'\n', &hay[..at]).map_or(0, |i| i + 1);
            let end = memchr::memchr(b'\n', &hay[at..]).map_or(hay.len(), |i| at + i);
            if (self.exact || self.is_match(&hay[start..end])) && !hit(start, end) {
                return;
            }
            from = end + 1;
        }
    }

    pub fn is_match(&self, line: &[u8]) -> bool {
        match std::str::from_utf8(line) {
            Ok(s) => self.re.is_match(s),
            Err(_) => self.re.is_match(&String::from_utf8_lossy(line)),
        }
    }

    /// Byte ranges of the matches in `text` (at most `max`).
    pub fn ranges(&self, text: &str, max: usize) -> Vec<(u32, u32)> {
        self.re
            .find_iter(text)
            .filter(|m| m.end() > m.start())
            .take(max)
            .map(|m| (m.start() as u32, m.end() as u32))
            .collect()
    }
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
                } else {
                    flush(&mut run, &mut best);
                    last_len = 0;
                }
                i += 2;
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
    }

    fn matching(m: &Matcher, hay: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut scratch = Vec::new();
        m.lines(hay.as_bytes(), &mut scratch, |s, e| {
            out.push(hay[s..e].to_string());
            true
        });
        out
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
            let m = Matcher::new(p, lit, ic).unwrap();
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
        assert!(Matcher::new("a\\nb", false, false).is_err());
        assert!(Matcher::new("a\nb", true, false).is_err());
        assert!(Matcher::new("(unclosed", false, false).is_err());
        assert!(Matcher::new("", false, false).is_err());
        // A literal `\n` (two characters) is fine when the pattern is literal.
        assert!(Matcher::new("a\\nb", true, false).is_ok());
    }
}
