//! The glob of a rule word: `*` (any run, `/` and spaces included), `?` (one character),
//! `[...]` (a class, `!`/`^` negated, ranges) and `\` (the next character literally).
//!
//! Not `rsb-rules`' wildmatch: that crate is compiled into the static agent, and a rule word
//! is not a path (`/*` must match `/home/x` too), so the few lines here keep the agent as it is.

/// Does `pat` match the whole of `text`?
pub fn matches(pat: &str, text: &str) -> bool {
    let p: Vec<char> = pat.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matcher with one backtrack point for the last `*`: linear in practice and
    // never exponential, whatever the pattern.
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() {
            match p[pi] {
                '*' => {
                    star = Some((pi, ti));
                    pi += 1;
                    continue;
                }
                '?' => {
                    pi += 1;
                    ti += 1;
                    continue;
                }
                '[' => match class(&p, pi, t[ti]) {
                    Some((true, next)) => {
                        pi = next;
                        ti += 1;
                        continue;
                    }
                    Some((false, _)) => {}
                    // An unclosed `[` is a literal.
                    None if t[ti] == '[' => {
                        pi += 1;
                        ti += 1;
                        continue;
                    }
                    None => {}
                },
                '\\' if pi + 1 < p.len() => {
                    if p[pi + 1] == t[ti] {
                        pi += 2;
                        ti += 1;
                        continue;
                    }
                }
                c => {
                    if c == t[ti] {
                        pi += 1;
                        ti += 1;
                        continue;
                    }
                }
            }
        }
        match star {
            Some((sp, st)) => {
                pi = sp + 1;
                ti = st + 1;
                star = Some((sp, st + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// `[...]` at `p[at]` against `c`: `Some((matched, index after the class))`, `None` when the
/// class is not closed.
fn class(p: &[char], at: usize, c: char) -> Option<(bool, usize)> {
    let mut i = at + 1;
    let negated = matches!(p.get(i), Some('!' | '^'));
    if negated {
        i += 1;
    }
    let mut hit = false;
    let mut first = true;
    while i < p.len() {
        if p[i] == ']' && !first {
            return Some((hit != negated, i + 1));
        }
        first = false;
        let lo = p[i];
        if i + 2 < p.len() && p[i + 1] == '-' && p[i + 2] != ']' {
            if lo <= c && c <= p[i + 2] {
                hit = true;
            }
            i += 3;
        } else {
            if lo == c {
                hit = true;
            }
            i += 1;
        }
    }
    None
}

/// Does `s` hold an unescaped glob character (for a word the shell would expand)?
/// A `[` only opens a bracket expression when a `]` follows (`[` alone is `test`).
pub fn has_glob(s: &str) -> bool {
    s.contains(['*', '?']) || s.find('[').is_some_and(|i| s[i + 1..].contains(']'))
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn globs() {
        assert!(matches("rm", "rm"));
        assert!(!matches("rm", "rmdir"));
        assert!(matches("shutdown*", "shutdown"));
        assert!(matches("shutdown*", "shutdown.sh"));
        assert!(matches("mkfs*", "mkfs.ext4"));
        assert!(matches("/*", "/"));
        assert!(matches("/*", "/home/me"));
        assert!(!matches("/*", "./x"));
        assert!(matches("of=/dev/*", "of=/dev/sda"));
        assert!(!matches("of=/dev/*", "if=/dev/zero"));
        assert!(matches("a?c", "abc"));
        assert!(!matches("a?c", "ac"));
        assert!(matches("[a-c]x", "bx"));
        assert!(!matches("[!a-c]x", "bx"));
        assert!(matches("*.py", "train.py"));
        assert!(matches("a*b*c", "aXXbYYc"));
        assert!(!matches("a*b*c", "aXXbYY"));
        assert!(matches("\\*", "*"));
        assert!(!matches("\\*", "x"));
        assert!(matches("[x", "[x"));
        assert!(matches("", ""));
        assert!(!matches("", "x"));
    }
}
