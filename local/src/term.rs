//! Text that came from a remote machine, made safe to print on the user's terminal.
//!
//! A file name, an error or a job name on the remote side is the remote's to choose: one
//! holding an escape sequence (OSC 52 writes the user's clipboard in many terminals; others
//! retitle the window, move the cursor or rewrite what was printed) would act on the local
//! terminal if printed byte for byte. The CLI passes every such text through [`shown`] for
//! its human output; `--json` keeps the exact bytes (JSON escapes control characters itself).

use std::borrow::Cow;

/// `s` with every control character (C0 including tab and newline, DEL, C1) written as a
/// visible `\u{..}` escape and every backslash doubled, so no name can pass for another
/// one's escape. Text with neither is returned as it is (nearly every name).
pub fn shown(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| c.is_control() || c == '\\') {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// [`shown`] for a message of several lines that the CLI prints as they are: each line's
/// text is escaped, the line breaks kept.
pub fn shown_lines(s: &str) -> Cow<'_, str> {
    if !s
        .chars()
        .any(|c| (c.is_control() && c != '\n') || c == '\\')
    {
        return Cow::Borrowed(s);
    }
    Cow::Owned(s.split('\n').map(shown).collect::<Vec<_>>().join("\n"))
}

/// Byte counts as people read them (binary units, one decimal), for CLI tables and summaries.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_reach_the_terminal_as_text() {
        assert!(matches!(shown("src/main.rs"), Cow::Borrowed(_)));
        let osc52 = "a\u{1b}]52;c;aGk=\u{7}b";
        assert_eq!(shown(osc52), "a\\u{1b}]52;c;aGk=\\u{7}b");
        // C1 (a one-character CSI), DEL, a newline that would forge a second line.
        assert_eq!(shown("x\u{9b}2Jy\u{7f}\nz"), "x\\u{9b}2Jy\\u{7f}\\u{a}z");
        // A backslash is doubled: no name can pass for an escaped one.
        assert_eq!(shown("a\\u{1b}"), "a\\\\u{1b}");
        assert_ne!(shown("a\\u{1b}"), shown("a\u{1b}"));
        assert_eq!(shown_lines("one\u{1b}[2J\ntwo"), "one\\u{1b}[2J\ntwo");
        for s in [osc52, "\u{9b}", "\u{1b}[31m"] {
            assert!(!shown(s).chars().any(char::is_control), "{s:?}");
        }
    }
}
