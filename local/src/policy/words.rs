//! The words the policy reads a script as: a simple command's words after quote removal
//! ([`Arg`], unknown where only bash can know them), with what resolving wrappers and aliases
//! needs ([`WordVal`]), and bash's own unquoting of backquotes and `$'…'`. The walk
//! (`shell.rs`), the wrappers (`wrappers.rs`) and the value tracking (`evaluated.rs`) share
//! them.

/// One word of a simple command, after quote removal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arg {
    Lit(String),
    /// Known only when bash runs: `$X`, `$(…)`, `~`, a brace or glob in the command name.
    /// `many`: unquoted, so it may split into any number of words.
    Unknown {
        many: bool,
    },
}

impl Arg {
    pub fn lit(&self) -> Option<&str> {
        match self {
            Arg::Lit(s) => Some(s),
            Arg::Unknown { .. } => None,
        }
    }
}

/// A simple command as bash would run it; `words[0]` is the command name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Simple {
    pub words: Vec<Arg>,
    /// Why the whole command is unknown (a script that does not parse, say), for messages.
    pub opaque: Option<String>,
}

impl Simple {
    /// The command for a message: unknown words as `…`.
    pub fn display(&self) -> String {
        if let Some(why) = &self.opaque {
            return format!("({why})");
        }
        self.words
            .iter()
            .map(|w| w.lit().unwrap_or("…"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// A word with what resolving wrappers and aliases needs besides its value.
#[derive(Clone, Debug)]
pub struct WordVal {
    pub arg: Arg,
    /// The source text, for re-parsing (an alias's arguments).
    pub raw: String,
    /// Unquoted glob characters: as a command name, the shell may expand it to anything.
    pub glob: bool,
    /// A `NAME=value` argument the parser recognised (`export X=1`).
    pub assignment: bool,
}

impl WordVal {
    pub fn unknown(many: bool) -> WordVal {
        WordVal {
            arg: Arg::Unknown { many },
            raw: String::new(),
            glob: false,
            assignment: false,
        }
    }
    pub fn lit(&self) -> Option<&str> {
        self.arg.lit()
    }
}

/// The script inside backquotes: `\\`, `` \` `` and `\$` lose their backslash.
pub(super) fn unbackquote(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\\'
            && let Some(&n) = it.peek()
            && matches!(n, '\\' | '`' | '$')
        {
            out.push(n);
            it.next();
            continue;
        }
        out.push(c);
    }
    out
}

/// The value of `$'…'`: bash's escapes (`\n`, `\x72`, `\162`, `\u0072`, `\cX`, ...).
pub(super) fn ansi_c(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let b: Vec<char> = s.chars().collect();
    let mut i = 0;
    let num = |from: usize, max: usize, radix: u32| -> (u32, usize) {
        let mut v = 0u32;
        let mut n = 0;
        while n < max
            && let Some(d) = b.get(from + n).and_then(|c| c.to_digit(radix))
        {
            v = v * radix + d;
            n += 1;
        }
        (v, n)
    };
    while i < b.len() {
        if b[i] != '\\' || i + 1 >= b.len() {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let e = b[i + 1];
        i += 2;
        let simple = match e {
            'a' => Some('\x07'),
            'b' => Some('\x08'),
            'e' | 'E' => Some('\x1b'),
            'f' => Some('\x0c'),
            'n' => Some('\n'),
            'r' => Some('\r'),
            't' => Some('\t'),
            'v' => Some('\x0b'),
            '\\' | '\'' | '"' | '?' => Some(e),
            _ => None,
        };
        if let Some(c) = simple {
            out.push(c);
            continue;
        }
        let (v, n) = match e {
            '0'..='7' => {
                let (v, n) = num(i - 1, 3, 8);
                (v, n - 1)
            }
            'x' => num(i, 2, 16),
            'u' => num(i, 4, 16),
            'U' => num(i, 8, 16),
            'c' if i < b.len() => {
                i += 1;
                out.push(char::from_u32(b[i - 1] as u32 & 0x1f).unwrap_or('?'));
                continue;
            }
            _ => {
                out.push('\\');
                out.push(e);
                continue;
            }
        };
        if n == 0 && e != '0' && !e.is_ascii_digit() {
            out.push('\\');
            out.push(e);
            continue;
        }
        i += n;
        out.push(char::from_u32(v).unwrap_or('\u{fffd}'));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ansi_c_escapes() {
        assert_eq!(ansi_c("a\\nb"), "a\nb");
        assert_eq!(ansi_c("\\x72\\x6d"), "rm");
        assert_eq!(ansi_c("\\162\\155"), "rm");
        assert_eq!(ansi_c("\\u0072m"), "rm");
        assert_eq!(ansi_c("\\'"), "'");
        assert_eq!(ansi_c("\\q"), "\\q");
    }
}
