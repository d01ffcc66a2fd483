//! Every simple command a bash script can run, as words, from brush-parser's syntax tree.
//!
//! A rule is only as good as the commands it is matched against, and the blocklists the
//! issue cites fall to `;`, `$(…)` and quoting. So the walk visits every place bash runs a
//! command (lists, pipelines, compound commands, function bodies, `$(…)`, backticks, process
//! substitution, substitutions inside words, assignments and redirections), removes quotes
//! and escapes the way bash does, re-parses the strings other programs run as shell code
//! (`bash -c`, `eval`, `trap`, here-strings fed to a shell, aliases) and looks through
//! wrappers (`wrappers.rs`). What it cannot know before bash runs (a word that comes from a
//! variable or a substitution, a script it cannot parse) becomes [`Arg::Unknown`], which the
//! rules treat as matching anything: the policy fails closed.

use std::collections::HashMap;

use brush_parser::{
    ParserOptions, ast,
    word::{self, WordPiece, WordPieceWithSource},
};

use super::wrappers::{self, Inner};

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
    pub opaque: Option<&'static str>,
}

impl Simple {
    /// The command for a message: unknown words as `…`.
    pub fn display(&self) -> String {
        if let Some(why) = self.opaque {
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
}

impl WordVal {
    pub fn unknown(many: bool) -> WordVal {
        WordVal {
            arg: Arg::Unknown { many },
            raw: String::new(),
            glob: false,
        }
    }
    pub fn lit(&self) -> Option<&str> {
        self.arg.lit()
    }
}

/// What a command's standard input is, for a shell that reads its script from it.
#[derive(Clone, Debug)]
enum Stdin {
    /// Inherited (closed under exec_bash): nothing to read a script from.
    Inherited,
    /// A here-string or a here-document with no expansion: the text is known.
    Known(String),
    /// A pipe, a file or an expanded here-document.
    Unknown,
}

/// How deep `bash -c`, `eval`, substitutions and aliases may nest before the rest counts as
/// unknown; deeper nesting than this is not something an agent writes by accident.
const MAX_DEPTH: usize = 12;
/// The most simple commands collected; a script past it counts as unknown (and stays cheap).
const MAX_COMMANDS: usize = 10_000;

/// Every simple command of `script`, in source order, wrappers looked through (the wrapper
/// and the command it runs are both listed).
pub fn commands(script: &str) -> Vec<Simple> {
    let mut w = Walker {
        opts: ParserOptions::default(),
        out: Vec::new(),
        aliases: HashMap::new(),
        depth: 0,
    };
    w.script(script);
    w.out
}

struct Walker {
    opts: ParserOptions,
    out: Vec<Simple>,
    /// `alias name=value` seen so far (bash -c does not expand aliases unless told to; the
    /// guard assumes it was told).
    aliases: HashMap<String, String>,
    depth: usize,
}

impl Walker {
    fn opaque(&mut self, why: &'static str) {
        self.out.push(Simple {
            words: vec![Arg::Unknown { many: true }],
            opaque: Some(why),
        });
    }

    fn script(&mut self, src: &str) {
        if self.depth > MAX_DEPTH {
            return self.opaque("nested too deeply to check");
        }
        if self.out.len() > MAX_COMMANDS {
            return self.opaque("too many commands to check");
        }
        let mut parser = brush_parser::Parser::new(src.as_bytes(), &self.opts);
        match parser.parse_program() {
            Ok(prog) => {
                for cc in &prog.complete_commands {
                    self.list(cc);
                }
            }
            Err(_) => self.opaque("a script that does not parse"),
        }
    }

    fn nested(&mut self, src: &str) {
        self.depth += 1;
        self.script(src);
        self.depth -= 1;
    }

    fn list(&mut self, l: &ast::CompoundList) {
        for item in &l.0 {
            self.and_or(&item.0);
        }
    }

    fn and_or(&mut self, l: &ast::AndOrList) {
        self.pipeline(&l.first);
        for next in &l.additional {
            match next {
                ast::AndOr::And(p) | ast::AndOr::Or(p) => self.pipeline(p),
            }
        }
    }

    fn pipeline(&mut self, p: &ast::Pipeline) {
        for (i, c) in p.seq.iter().enumerate() {
            self.command(c, i > 0);
        }
    }

    fn command(&mut self, c: &ast::Command, piped: bool) {
        match c {
            ast::Command::Simple(sc) => self.simple(sc, piped),
            ast::Command::Compound(cc, redirs) => {
                self.compound(cc);
                self.redirects(redirs.as_ref());
            }
            ast::Command::Function(f) => {
                self.compound(&f.body.0);
                self.redirects(f.body.1.as_ref());
            }
            ast::Command::ExtendedTest(t, redirs) => {
                self.test(&t.expr);
                self.redirects(redirs.as_ref());
            }
        }
    }

    fn redirects(&mut self, r: Option<&ast::RedirectList>) {
        let mut stdin = Stdin::Inherited;
        for r in r.iter().flat_map(|r| r.0.iter()) {
            self.redirect(r, &mut stdin);
        }
    }

    fn compound(&mut self, c: &ast::CompoundCommand) {
        use ast::CompoundCommand as C;
        match c {
            C::Arithmetic(a) => self.arith(&a.expr.value),
            C::ArithmeticForClause(f) => {
                for e in [&f.initializer, &f.condition, &f.updater]
                    .into_iter()
                    .flatten()
                {
                    self.arith(&e.value);
                }
                self.list(&f.body.list);
            }
            C::BraceGroup(b) => self.list(&b.list),
            C::Subshell(s) => self.list(&s.list),
            C::ForClause(f) => {
                for w in f.values.iter().flatten() {
                    self.word(&w.value);
                }
                self.list(&f.body.list);
            }
            C::CaseClause(c) => {
                self.word(&c.value.value);
                for item in &c.cases {
                    for p in &item.patterns {
                        self.word(&p.value);
                    }
                    if let Some(cmd) = &item.cmd {
                        self.list(cmd);
                    }
                }
            }
            C::IfClause(i) => {
                self.list(&i.condition);
                self.list(&i.then);
                for e in i.elses.iter().flatten() {
                    if let Some(c) = &e.condition {
                        self.list(c);
                    }
                    self.list(&e.body);
                }
            }
            C::WhileClause(w) | C::UntilClause(w) => {
                self.list(&w.0);
                self.list(&w.1.list);
            }
            C::Coprocess(c) => self.command(&c.body, false),
        }
    }

    fn test(&mut self, e: &ast::ExtendedTestExpr) {
        use ast::ExtendedTestExpr as E;
        match e {
            E::And(a, b) | E::Or(a, b) => {
                self.test(a);
                self.test(b);
            }
            E::Not(a) | E::Parenthesized(a) => self.test(a),
            E::UnaryTest(_, w) => {
                self.word(&w.value);
            }
            E::BinaryTest(_, a, b) => {
                self.word(&a.value);
                self.word(&b.value);
            }
        }
    }

    /// An arithmetic expression runs the substitutions it holds.
    fn arith(&mut self, text: &str) {
        if text.contains("$(") || text.contains('`') {
            self.word(text);
        }
    }

    fn simple(&mut self, sc: &ast::SimpleCommand, piped: bool) {
        use ast::CommandPrefixOrSuffixItem as I;
        let mut words: Vec<WordVal> = Vec::new();
        let mut stdin = if piped {
            Stdin::Unknown
        } else {
            Stdin::Inherited
        };
        let prefix = sc.prefix.iter().flat_map(|p| p.0.iter());
        let suffix = sc.suffix.iter().flat_map(|s| s.0.iter());
        for item in prefix {
            match item {
                I::IoRedirect(r) => self.redirect(r, &mut stdin),
                I::AssignmentWord(a, _) => self.assignment(a),
                I::ProcessSubstitution(_, s) => self.list(&s.list),
                I::Word(w) => words.push(self.word(&w.value)),
            }
        }
        if let Some(w) = &sc.word_or_name {
            words.push(self.word(&w.value));
        }
        for item in suffix {
            match item {
                I::IoRedirect(r) => self.redirect(r, &mut stdin),
                I::Word(w) => words.push(self.word(&w.value)),
                // `export X=$(…)`, `declare -a a=(…)`: an argument, whose value runs too.
                I::AssignmentWord(_, w) => words.push(self.word(&w.value)),
                I::ProcessSubstitution(_, s) => {
                    self.list(&s.list);
                    words.push(WordVal::unknown(false));
                }
            }
        }
        self.resolve(words, &stdin);
    }

    fn assignment(&mut self, a: &ast::Assignment) {
        match &a.value {
            ast::AssignmentValue::Scalar(w) => {
                self.word(&w.value);
            }
            ast::AssignmentValue::Array(items) => {
                for (k, v) in items {
                    if let Some(k) = k {
                        self.word(&k.value);
                    }
                    self.word(&v.value);
                }
            }
        }
        if let ast::AssignmentName::ArrayElementName(_, index) = &a.name {
            self.arith(index);
        }
    }

    fn redirect(&mut self, r: &ast::IoRedirect, stdin: &mut Stdin) {
        use ast::{IoFileRedirectKind as K, IoFileRedirectTarget as T, IoRedirect as R};
        match r {
            R::File(fd, kind, target) => {
                let reads_stdin =
                    matches!(kind, K::Read | K::ReadAndWrite) && fd.is_none_or(|fd| fd == 0);
                match target {
                    T::Filename(w) | T::Duplicate(w) => {
                        self.word(&w.value);
                    }
                    T::Fd(_) => {}
                    T::ProcessSubstitution(_, s) => self.list(&s.list),
                }
                if reads_stdin {
                    *stdin = Stdin::Unknown;
                }
            }
            R::HereDocument(fd, h) => {
                let known = if h.requires_expansion {
                    match word::parse_heredoc(&h.doc.value, &self.opts) {
                        Ok(pieces) => {
                            let mut v = Value::default();
                            self.pieces(&h.doc.value, &pieces, true, &mut v);
                            (!v.unknown).then_some(v.text)
                        }
                        Err(_) => {
                            self.opaque("a here-document that does not parse");
                            None
                        }
                    }
                } else {
                    Some(h.doc.value.clone())
                };
                if fd.is_none_or(|fd| fd == 0) {
                    *stdin = known.map(Stdin::Known).unwrap_or(Stdin::Unknown);
                }
            }
            R::HereString(fd, w) => {
                let v = self.word(&w.value);
                if fd.is_none_or(|fd| fd == 0) {
                    *stdin = match v.arg {
                        Arg::Lit(s) => Stdin::Known(s),
                        Arg::Unknown { .. } => Stdin::Unknown,
                    };
                }
            }
            R::OutputAndError(w, _) => {
                self.word(&w.value);
            }
        }
    }

    /// A word's value after quote removal; the substitutions it holds are walked as scripts.
    fn word(&mut self, text: &str) -> WordVal {
        let pieces = match word::parse(text, &self.opts) {
            Ok(p) => p,
            Err(_) => {
                self.opaque("a word that does not parse");
                return WordVal {
                    arg: Arg::Unknown { many: true },
                    raw: text.to_string(),
                    glob: false,
                };
            }
        };
        let mut v = Value::default();
        self.pieces(text, &pieces, false, &mut v);
        let brace = has_brace_expansion(&v.unquoted);
        let arg = if v.unknown || brace {
            Arg::Unknown {
                many: v.many || brace,
            }
        } else {
            Arg::Lit(v.text)
        };
        WordVal {
            arg,
            raw: text.to_string(),
            glob: super::glob::has_glob(&v.unquoted),
        }
    }

    fn pieces(&mut self, src: &str, pieces: &[WordPieceWithSource], quoted: bool, v: &mut Value) {
        for p in pieces {
            match &p.piece {
                WordPiece::Text(t) => {
                    v.text.push_str(t);
                    if !quoted {
                        v.unquoted.push_str(t);
                    }
                }
                WordPiece::SingleQuotedText(t) => v.text.push_str(t),
                WordPiece::AnsiCQuotedText(t) => v.text.push_str(&ansi_c(t)),
                WordPiece::DoubleQuotedSequence(inner)
                | WordPiece::GettextDoubleQuotedSequence(inner) => self.pieces(src, inner, true, v),
                WordPiece::TildeExpansion(_) => v.unknown = true,
                WordPiece::ParameterExpansion(_) => {
                    v.unknown = true;
                    v.many |= !quoted;
                    // `${x:-$(cmd)}` runs cmd; its text is not split out by the parser.
                    let s = src.get(p.start_index..p.end_index).unwrap_or(src);
                    if s.contains("$(") || s.contains('`') || s.contains("<(") {
                        self.opaque("a substitution inside ${…}");
                    }
                }
                WordPiece::CommandSubstitution(inner) => {
                    self.nested(inner);
                    v.unknown = true;
                    v.many |= !quoted;
                }
                WordPiece::BackquotedCommandSubstitution(inner) => {
                    self.nested(&unbackquote(inner));
                    v.unknown = true;
                    v.many |= !quoted;
                }
                WordPiece::EscapeSequence(e) => {
                    let c = e.strip_prefix('\\').unwrap_or(e);
                    if c != "\n" {
                        v.text.push_str(c);
                    }
                }
                WordPiece::ArithmeticExpression(e) => {
                    self.arith(&e.value);
                    v.unknown = true;
                }
            }
        }
    }

    /// The command itself, then what it runs: an alias's value, a wrapper's command, a
    /// shell's script.
    fn resolve(&mut self, words: Vec<WordVal>, stdin: &Stdin) {
        let Some(first) = words.first() else {
            return;
        };
        if self.depth > MAX_DEPTH {
            return self.opaque("nested too deeply to check");
        }
        let mut args: Vec<Arg> = words.iter().map(|w| w.arg.clone()).collect();
        if first.glob {
            args[0] = Arg::Unknown { many: true };
        }
        self.out.push(Simple {
            words: args,
            opaque: None,
        });
        let Some(name) = first.lit().filter(|_| !first.glob) else {
            return;
        };
        let base = name.rsplit('/').next().unwrap_or(name).to_string();
        if let Some(value) = self.aliases.get(&base).cloned() {
            let mut text = value;
            for w in &words[1..] {
                text.push(' ');
                text.push_str(&w.raw);
            }
            return self.nested(&text);
        }
        if base == "alias" {
            for w in &words[1..] {
                if let Some((k, v)) = w.lit().and_then(|s| s.split_once('=')) {
                    self.aliases.insert(k.to_string(), v.to_string());
                    // Checked where it is defined too, whether or not it is used.
                    self.nested(v);
                } else if w.lit().is_none() {
                    self.opaque("an alias whose value is not known");
                }
            }
            return;
        }
        for inner in wrappers::inner(&base, &words[1..]) {
            self.depth += 1;
            match inner {
                Inner::Command(ws) => self.resolve(ws, &Stdin::Inherited),
                Inner::Script(s) => self.script(&s),
                Inner::Stdin => match stdin {
                    Stdin::Inherited => {}
                    Stdin::Known(s) => self.script(&s.clone()),
                    Stdin::Unknown => self.opaque("a shell that reads its script from stdin"),
                },
                Inner::Unknown(why) => self.opaque(why),
            }
            self.depth -= 1;
        }
    }
}

#[derive(Default)]
struct Value {
    text: String,
    /// The unquoted text alone, where globs and braces expand.
    unquoted: String,
    unknown: bool,
    many: bool,
}

/// `{a,b}` or `{1..3}` in unquoted text: bash turns the word into several.
fn has_brace_expansion(s: &str) -> bool {
    let Some(open) = s.find('{') else {
        return false;
    };
    let Some(close) = s[open..].find('}') else {
        return false;
    };
    let inner = &s[open + 1..open + close];
    inner.contains(',') || inner.contains("..")
}

/// The script inside backquotes: `\\`, `` \` `` and `\$` lose their backslash.
fn unbackquote(s: &str) -> String {
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
fn ansi_c(s: &str) -> String {
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

    fn lit(ws: &[&str]) -> Simple {
        Simple {
            words: ws.iter().map(|w| Arg::Lit(w.to_string())).collect(),
            opaque: None,
        }
    }

    fn shown(script: &str) -> Vec<String> {
        commands(script).iter().map(Simple::display).collect()
    }

    #[test]
    fn quotes_and_escapes_are_removed() {
        assert_eq!(commands("r''m -rf /"), vec![lit(&["rm", "-rf", "/"])]);
        assert_eq!(commands("\"rm\" -rf /"), vec![lit(&["rm", "-rf", "/"])]);
        assert_eq!(commands("\\rm -rf /"), vec![lit(&["rm", "-rf", "/"])]);
        assert_eq!(commands("$'\\x72m' -rf /"), vec![lit(&["rm", "-rf", "/"])]);
        assert_eq!(commands("$'\\162m' x"), vec![lit(&["rm", "x"])]);
        assert_eq!(commands("r\"m\" 'a b'"), vec![lit(&["rm", "a b"])]);
    }

    #[test]
    fn every_simple_command_of_lists_pipelines_and_compounds() {
        assert_eq!(
            shown("ls; rm a && rm b || rm c | tee x\nrm d & (rm e); { rm f; }"),
            [
                "ls", "rm a", "rm b", "rm c", "tee x", "rm d", "rm e", "rm f"
            ]
        );
        assert_eq!(
            shown("if rm a; then rm b; elif rm c; then :; else rm d; fi"),
            ["rm a", "rm b", "rm c", ":", "rm d"]
        );
        assert_eq!(
            shown("for x in a; do rm $x; done; while rm w; do :; done"),
            ["rm …", "rm w", ":"]
        );
        assert_eq!(
            shown("case $x in a) rm a;; esac; f() { rm g; }; f"),
            ["rm a", "rm g", "f"]
        );
    }

    #[test]
    fn substitutions_run_and_their_values_are_unknown() {
        assert_eq!(
            shown("echo $(rm a) `rm b` <(rm c) \"$(rm d)\""),
            ["rm a", "rm b", "rm c", "rm d", "echo … … … …"]
        );
        let c = commands("$(echo rm) -rf /");
        assert_eq!(c[0], lit(&["echo", "rm"]));
        assert_eq!(c[1].words[0], Arg::Unknown { many: true });
        let c = commands("\"$X\" -rf /");
        assert_eq!(c[0].words[0], Arg::Unknown { many: false });
        assert_eq!(shown("X=$(rm a) ls"), ["rm a", "ls"]);
        assert_eq!(shown("echo > $(rm a)"), ["rm a", "echo"]);
        assert_eq!(shown("echo $(( $(rm a) + 1 ))"), ["rm a", "echo …"]);
        assert_eq!(
            shown("echo ${x:-$(rm a)}")[0],
            "(a substitution inside ${…})"
        );
        assert_eq!(
            shown("echo `echo \\`rm a\\``"),
            ["rm a", "echo …", "echo …"]
        );
    }

    #[test]
    fn shells_eval_and_aliases_are_parsed_again() {
        assert_eq!(
            shown("bash -c 'rm -rf /'"),
            ["bash -c rm -rf /", "rm -rf /"]
        );
        assert_eq!(
            shown("sh -c \"bash -c 'rm -rf /'\""),
            ["sh -c bash -c 'rm -rf /'", "bash -c rm -rf /", "rm -rf /"]
        );
        assert_eq!(shown("eval 'rm' -rf /"), ["eval rm -rf /", "rm -rf /"]);
        assert_eq!(shown("bash <<< 'rm -rf /'"), ["bash", "rm -rf /"]);
        assert_eq!(shown("bash <<EOF\nrm -rf /\nEOF\n"), ["bash", "rm -rf /"]);
        assert_eq!(
            shown("echo rm | bash")[2],
            "(a shell that reads its script from stdin)"
        );
        assert_eq!(shown("bash train.sh"), ["bash train.sh"]);
        assert_eq!(
            shown("alias x='rm -rf'; x /"),
            ["alias x=rm -rf", "rm -rf", "x /", "rm -rf /"]
        );
        assert_eq!(
            shown("eval \"$X\"")[1],
            "(eval of a string not known before it runs)"
        );
    }

    #[test]
    fn unparsable_and_deep_scripts_are_unknown() {
        assert_eq!(shown("rm a; ((("), ["(a script that does not parse)"]);
        let s = format!("{}rm a", "eval ".repeat(20));
        assert!(
            shown(&s)
                .iter()
                .any(|c| c == "(nested too deeply to check)")
        );
    }

    #[test]
    fn globs_and_braces_in_the_command_name_are_unknown() {
        assert_eq!(
            commands("/bin/r? -rf /")[0].words[0],
            Arg::Unknown { many: true }
        );
        assert_eq!(
            commands("{rm,-rf,/}")[0].words[0],
            Arg::Unknown { many: true }
        );
        assert_eq!(commands("ls *.py")[0], lit(&["ls", "*.py"]));
    }

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
