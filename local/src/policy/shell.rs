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

use std::collections::{HashMap, HashSet};

use brush_parser::{
    ParserOptions, ast,
    word::{self, ParameterExpr, ParameterTransformOp, WordPiece, WordPieceWithSource},
};

use super::evaluated::{self, POSITIONAL, Val, Vars};
use super::words::{Arg, Simple, WordVal, ansi_c, unbackquote};
use super::wrappers::{self, Inner};

/// What a command's standard input is, for a shell that reads its script from it.
#[derive(Clone, Debug)]
enum Stdin {
    /// Inherited (closed under exec_bash): nothing to read a script from.
    Inherited,
    /// A here-string or a here-document with no expansion: the text is known.
    Known(String),
    /// A pipe, a file or an expanded here-document.
    Unknown,
    /// In a function's body: whatever each call gives it.
    Caller,
}

/// How deep `bash -c`, `eval`, substitutions and aliases may nest before the rest counts as
/// unknown; deeper nesting than this is not something an agent writes by accident.
const MAX_DEPTH: usize = 12;
/// The most simple commands collected; a script past it counts as unknown (and stays cheap).
const MAX_COMMANDS: usize = 10_000;

/// Every simple command of `script`, in source order, wrappers looked through (the wrapper
/// and the command it runs are both listed).
pub fn commands(script: &str) -> Vec<Simple> {
    commands_for(script, &[], false)
}

/// [`commands`], with the policy's rule names (`programs`: an unknown launcher's argument
/// naming one is a command too) and whether the script's stdin is data from the caller
/// (`… | rsb exec sb bash`), which a shell would read as its script.
pub fn commands_for(script: &str, programs: &[String], stdin_forwarded: bool) -> Vec<Simple> {
    let mut w = Walker {
        opts: ParserOptions::default(),
        out: Vec::new(),
        aliases: HashMap::new(),
        depth: 0,
        vars: Vars::default(),
        functions: HashSet::new(),
        in_function: None,
        runs_args: HashSet::new(),
        reads_stdin: HashSet::new(),
        stdin: if stdin_forwarded {
            Stdin::Unknown
        } else {
            Stdin::Inherited
        },
        programs: programs.to_vec(),
    };
    w.script(script);
    if let Some(name) = w.vars.tainted_read() {
        let why = if name == POSITIONAL {
            "the positional parameters are read as arithmetic or as a name, and may hold a \
             subscript that runs code"
                .to_string()
        } else {
            format!(
                "${name} is read as arithmetic or as a name, and its value may hold a subscript \
                 that runs code"
            )
        };
        w.opaque(why);
    }
    w.out
}

struct Walker {
    opts: ParserOptions,
    out: Vec<Simple>,
    /// `alias name=value` seen so far (bash -c does not expand aliases unless told to; the
    /// guard assumes it was told).
    aliases: HashMap<String, String>,
    depth: usize,
    /// What bash may evaluate from a variable's value ([`evaluated`]).
    vars: Vars,
    /// Functions defined so far: a call assigns the positional parameters.
    functions: HashSet<String>,
    /// The function whose body is being walked.
    in_function: Option<String>,
    /// Functions that run their arguments as a command (`retry() { "$@"; }`): a call runs
    /// its arguments.
    runs_args: HashSet<String>,
    /// Functions whose body runs a shell on the function's stdin.
    reads_stdin: HashSet<String>,
    /// The stdin commands inherit here: the script's, a group's redirection, `exec 0<…`.
    stdin: Stdin,
    /// The command names of the policy's rules (globs): an unknown program's argument that
    /// names one is checked as a command ([`Walker::launched`]).
    programs: Vec<String>,
}

/// Programs that never run their arguments as a command: their arguments are not looked at
/// as one (`echo rm -rf /`, `grep -r sudo .`, `man bash`).
const NOT_LAUNCHERS: &[&str] = &[
    "echo",
    "printf",
    "cat",
    "ls",
    "grep",
    "egrep",
    "fgrep",
    "rg",
    "ag",
    "head",
    "tail",
    "less",
    "more",
    "wc",
    "sort",
    "uniq",
    "cut",
    "tr",
    "man",
    "info",
    "help",
    "which",
    "whereis",
    "whatis",
    "apropos",
    "type",
    "test",
    "[",
    "true",
    "false",
    ":",
    "cd",
    "pwd",
    "mkdir",
    "touch",
    "basename",
    "dirname",
    "realpath",
    "readlink",
    "stat",
    "file",
    "diff",
    "cmp",
    "tee",
    "seq",
    "sleep",
    "kill",
    "pkill",
    "pgrep",
    "killall",
    "jq",
    "yq",
    "export",
    "declare",
    "typeset",
    "local",
    "readonly",
    "unset",
    "read",
    "set",
    "shift",
    "return",
    "exit",
    "wait",
    "history",
    "alias",
    "unalias",
    "let",
    "hash",
    "enable",
    "pip",
    "pip3",
    "apt",
    "apt-get",
    "dnf",
    "yum",
    "brew",
    "conda-env",
    "mv",
    "cp",
    "ln",
    "chmod",
    "chown",
];

impl Walker {
    fn opaque(&mut self, why: impl Into<String>) {
        self.out.push(Simple {
            words: vec![Arg::Unknown { many: true }],
            opaque: Some(why.into()),
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
                // `{ bash; } <<< '…'`, `echo … | ( sh )`: the body reads what the group does.
                let start = if piped {
                    Stdin::Unknown
                } else {
                    self.stdin.clone()
                };
                let stdin = self.redirects(redirs.as_ref(), start);
                let outer = std::mem::replace(&mut self.stdin, stdin);
                self.compound(cc);
                self.stdin = outer;
            }
            ast::Command::Function(f) => {
                self.functions.insert(f.fname.value.clone());
                let outer = self.in_function.replace(f.fname.value.clone());
                let stdin = self.redirects(f.body.1.as_ref(), Stdin::Caller);
                let outer_stdin = std::mem::replace(&mut self.stdin, stdin);
                self.compound(&f.body.0);
                self.stdin = outer_stdin;
                self.in_function = outer;
            }
            ast::Command::ExtendedTest(t, redirs) => {
                self.test(&t.expr);
                self.redirects(redirs.as_ref(), Stdin::Inherited);
            }
        }
    }

    /// Walk redirections; what stdin becomes, from `start`.
    fn redirects(&mut self, r: Option<&ast::RedirectList>, start: Stdin) -> Stdin {
        let mut stdin = start;
        for r in r.iter().flat_map(|r| r.0.iter()) {
            self.redirect(r, &mut stdin);
        }
        stdin
    }

    /// A shell (or a function holding one) reads its script from `stdin`.
    fn feed(&mut self, stdin: &Stdin) {
        match stdin {
            Stdin::Inherited => {}
            Stdin::Known(s) => self.script(&s.clone()),
            Stdin::Unknown => self.opaque("a shell that reads its script from stdin"),
            Stdin::Caller => {
                if let Some(f) = self.in_function.clone() {
                    self.reads_stdin.insert(f);
                }
            }
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
                let mut v = Val::default();
                match &f.values {
                    Some(values) => {
                        for w in values {
                            self.word(&w.value);
                            v.add(evaluated::classify(
                                &w.value,
                                &self.opts,
                                true,
                                &self.vars.assoc,
                            ));
                        }
                    }
                    None => v.deps.push(POSITIONAL.to_string()),
                }
                self.vars.assign(&f.variable_name, v);
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
            // Its stdin is a pipe from the shell.
            C::Coprocess(c) => self.command(&c.body, true),
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
            E::UnaryTest(op, w) => {
                let v = self.word(&w.value);
                if matches!(
                    op,
                    ast::UnaryPredicate::ShellVariableIsSetAndAssigned
                        | ast::UnaryPredicate::ShellVariableIsSetAndNameRef
                ) {
                    self.name_operand(&v);
                }
            }
            E::BinaryTest(op, a, b) => {
                use ast::BinaryPredicate as B;
                self.word(&a.value);
                self.word(&b.value);
                // `[[ $x -eq 0 ]]` evaluates both sides as arithmetic.
                if matches!(
                    op,
                    B::ArithmeticEqualTo
                        | B::ArithmeticNotEqualTo
                        | B::ArithmeticLessThan
                        | B::ArithmeticLessThanOrEqualTo
                        | B::ArithmeticGreaterThan
                        | B::ArithmeticGreaterThanOrEqualTo
                ) {
                    self.arith_of(&a.value);
                    self.arith_of(&b.value);
                }
            }
        }
    }

    /// An arithmetic expression: the substitutions in it run, and bash evaluates the value
    /// of every name it reads in turn ([`evaluated`]).
    fn arith(&mut self, text: &str) {
        self.arith_in(text, true);
    }

    /// A word, walked already, whose value bash evaluates as arithmetic (`[[ $x -eq 0 ]]`,
    /// `let`, `declare -i`).
    fn arith_of(&mut self, text: &str) {
        self.arith_in(text, false);
    }

    fn arith_in(&mut self, text: &str, walk: bool) {
        match word::parse(text, &self.opts) {
            Ok(pieces) => self.arith_pieces(text, &pieces, walk),
            Err(_) => self.opaque("arithmetic that does not parse"),
        }
    }

    fn arith_pieces(&mut self, src: &str, pieces: &[WordPieceWithSource], walk: bool) {
        for p in pieces {
            match &p.piece {
                WordPiece::Text(t) | WordPiece::SingleQuotedText(t) => self.arith_names(t),
                WordPiece::AnsiCQuotedText(t) => self.arith_names(&ansi_c(t)),
                WordPiece::EscapeSequence(_) | WordPiece::TildeExpansion(_) => {}
                WordPiece::DoubleQuotedSequence(inner)
                | WordPiece::GettextDoubleQuotedSequence(inner) => {
                    self.arith_pieces(src, inner, walk)
                }
                WordPiece::ParameterExpansion(e) => {
                    if walk {
                        self.param(src.get(p.start_index..p.end_index).unwrap_or(src), e);
                    }
                    // Its value is pasted into the expression.
                    let v = evaluated::param_val(e);
                    if v.unsafe_ {
                        self.opaque("arithmetic over a value only known when it runs");
                    }
                    for d in &v.deps {
                        self.vars.read(d);
                    }
                }
                WordPiece::CommandSubstitution(inner) => {
                    if walk {
                        self.nested(inner);
                    }
                    if !evaluated::numeric_output(inner, &self.opts) {
                        self.opaque("arithmetic over a command's output, which may hold code");
                    }
                }
                WordPiece::BackquotedCommandSubstitution(inner) => {
                    let inner = unbackquote(inner);
                    if walk {
                        self.nested(&inner);
                    }
                    if !evaluated::numeric_output(&inner, &self.opts) {
                        self.opaque("arithmetic over a command's output, which may hold code");
                    }
                }
                WordPiece::ArithmeticExpression(e) => {
                    if walk {
                        self.arith(&e.value);
                    }
                }
            }
        }
    }

    /// The names an expression's text reads, and their subscripts.
    fn arith_names(&mut self, text: &str) {
        if text.contains("$[") {
            // `$[…]`, bash's old arithmetic expansion, which the parser reads as text.
            self.opaque("a $[…] arithmetic expansion");
        }
        for (name, sub) in evaluated::names(text) {
            self.vars.read(&name);
            if let Some(sub) = sub {
                self.subscript(&name, &sub);
            }
        }
    }

    /// `name[sub]`: an expression for an indexed array, a string for an associative one.
    fn subscript(&mut self, name: &str, sub: &str) {
        if self.vars.assoc.contains(name) {
            self.word(sub);
        } else {
            self.arith(sub);
        }
    }

    /// A `${…}` expansion: what in it bash evaluates.
    fn param(&mut self, src: &str, e: &ParameterExpr) {
        // `${x:-$(cmd)}` runs cmd; its text is not split out by the parser.
        if src.contains("$(") || src.contains('`') || src.contains("<(") {
            self.opaque("a substitution inside ${…}");
        }
        if let Some((p, indirect)) = evaluated::parts(e) {
            if indirect && let Some(n) = evaluated::param_name(p) {
                // `${!x}`: x's value is used as a name, subscript and all.
                self.vars.read(n);
            }
            if let word::Parameter::NamedWithIndex { name, index } = p {
                self.subscript(name, index);
            }
        }
        match e {
            ParameterExpr::Substring { offset, length, .. } => {
                self.arith(&offset.value);
                if let Some(l) = length {
                    self.arith(&l.value);
                }
            }
            ParameterExpr::Transform {
                op: ParameterTransformOp::PromptExpand,
                ..
            } => self.opaque("${x@P}, which runs the substitutions in its value"),
            _ => {}
        }
    }

    /// A word that names a variable (`printf -v`, `read`, `unset`, `test -v`): a subscript in
    /// it is evaluated.
    fn name_operand(&mut self, w: &WordVal) {
        match w.lit() {
            Some(l) => {
                if let Some((n, Some(sub))) = evaluated::reference(l) {
                    self.subscript(n, sub);
                }
            }
            None => self.opaque("a variable name only known when it runs"),
        }
    }

    /// Assigning `value` (as written) to `name`: names bash runs code from, `declare -i`
    /// names, and what the name may hold from now on.
    fn assigned(&mut self, name: &str, value: &str) {
        match name {
            "PS1" | "PS2" | "PS3" | "PS4" if value.contains(['$', '`']) => {
                self.opaque("a prompt (PS4 under set -x) runs the substitutions in its value")
            }
            "PROMPT_COMMAND" => self.opaque("PROMPT_COMMAND runs its value as code"),
            "BASH_ENV" | "ENV" if !value.is_empty() => {
                self.opaque("BASH_ENV names a script every new bash runs")
            }
            "BASH_CMDS" | "BASH_ALIASES" => {
                self.opaque("BASH_CMDS and BASH_ALIASES change what a command name runs")
            }
            n if n.starts_with("BASH_FUNC_") => {
                self.opaque("an exported function runs its value as code")
            }
            _ => {}
        }
        if self.vars.integer.contains(name) {
            self.arith_of(value);
        }
        let v = evaluated::classify(value, &self.opts, false, &self.vars.assoc);
        self.vars.assign(name, v);
    }

    fn simple(&mut self, sc: &ast::SimpleCommand, piped: bool) {
        use ast::CommandPrefixOrSuffixItem as I;
        let mut words: Vec<WordVal> = Vec::new();
        let mut stdin = if piped {
            Stdin::Unknown
        } else {
            self.stdin.clone()
        };
        let mut assigns: Vec<&ast::Assignment> = Vec::new();
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
                I::AssignmentWord(a, w) => {
                    let mut v = self.word(&w.value);
                    v.assignment = true;
                    words.push(v);
                    assigns.push(a);
                }
                I::ProcessSubstitution(_, s) => {
                    self.list(&s.list);
                    words.push(WordVal::unknown(false));
                }
            }
        }
        self.declared(&words, &assigns);
        if words.len() == 1 && words[0].lit() == Some("exec") {
            // `exec 0<<<'…'`: the rest of the script reads that.
            self.stdin = stdin.clone();
        }
        self.resolve(words, &stdin);
    }

    /// `export`/`declare`/`local`/`readonly`/`typeset` arguments: what they assign and
    /// declare. Another command's `NAME=value` arguments are only words.
    fn declared(&mut self, words: &[WordVal], assigns: &[&ast::Assignment]) {
        let base = words
            .first()
            .and_then(WordVal::lit)
            .map(|n| n.rsplit('/').next().unwrap_or(n));
        if !matches!(
            base,
            Some("export" | "declare" | "typeset" | "local" | "readonly")
        ) {
            return;
        }
        let mut flags = String::new();
        for w in &words[1..] {
            if let Some(l) = w.lit().filter(|l| l.len() > 1 && l.starts_with('-')) {
                flags.push_str(&l[1..]);
            }
        }
        let mut names: Vec<(String, Option<String>)> = Vec::new();
        for a in assigns {
            if let ast::AssignmentName::ArrayElementName(n, index) = &a.name {
                self.subscript(n, index);
            }
            let value = match &a.value {
                ast::AssignmentValue::Scalar(w) => w.value.clone(),
                ast::AssignmentValue::Array(_) => String::new(),
            };
            names.push((assignment_name(a).to_string(), Some(value)));
        }
        for w in words[1..].iter().filter(|w| !w.assignment) {
            match w.lit() {
                Some(l) if l.starts_with(['-', '+']) => {}
                Some(l) => {
                    let (n, v) = match l.split_once('=') {
                        Some((n, v)) => (n, Some(v)),
                        None => (l, None),
                    };
                    if let Some((name, sub)) = evaluated::reference(n) {
                        if let Some(sub) = sub {
                            self.subscript(name, sub);
                        }
                        // The value is text here: quote it again for what follows.
                        let quoted = v.map(|v| format!("'{}'", v.replace('\'', r"'\''")));
                        names.push((name.to_string(), quoted));
                    }
                }
                None => self.opaque("a variable name only known when it runs"),
            }
        }
        for (name, value) in names {
            if flags.contains('A') {
                self.vars.assoc.insert(name.clone());
            }
            if flags.contains('i') {
                self.vars.integer.insert(name.clone());
            }
            if flags.contains('n') {
                // A nameref: every use of `name` reads the named variable, subscript and all.
                match value
                    .as_deref()
                    .map(|v| evaluated::classify(v, &self.opts, false, &self.vars.assoc))
                {
                    Some(v) if !v.unsafe_ => {
                        let target = value
                            .as_deref()
                            .unwrap_or_default()
                            .trim_matches(['\'', '"']);
                        if let Some((_, Some(sub))) = evaluated::reference(target) {
                            self.arith(sub);
                        }
                        self.vars.assign(&name, v);
                    }
                    Some(_) => self.opaque("a nameref to a name only known when it runs"),
                    None => {}
                }
                continue;
            }
            if let Some(v) = value {
                self.assigned(&name, &v);
            }
        }
        for a in assigns {
            if let ast::AssignmentValue::Array(items) = &a.value {
                self.array_items(assignment_name(a), items);
            }
        }
    }

    fn assignment(&mut self, a: &ast::Assignment) {
        let name = assignment_name(a);
        if let ast::AssignmentName::ArrayElementName(_, index) = &a.name {
            self.subscript(name, index);
        }
        match &a.value {
            ast::AssignmentValue::Scalar(w) => {
                self.word(&w.value);
                self.assigned(name, &w.value);
            }
            ast::AssignmentValue::Array(items) => {
                for (_, v) in items {
                    self.word(&v.value);
                }
                self.array_items(name, items);
            }
        }
    }

    /// `a=([k]=v …)`: keys are subscripts, values may be globbed.
    fn array_items(&mut self, name: &str, items: &[(Option<ast::Word>, ast::Word)]) {
        if name.starts_with("BASH_CMDS") || name.starts_with("BASH_ALIASES") {
            self.assigned(name, "");
        }
        for (k, v) in items {
            if let Some(k) = k {
                self.subscript(name, &k.value);
            }
            let c = evaluated::classify(&v.value, &self.opts, true, &self.vars.assoc);
            self.vars.assign(name, c);
        }
    }

    fn redirect(&mut self, r: &ast::IoRedirect, stdin: &mut Stdin) {
        use ast::{IoFileRedirectKind as K, IoFileRedirectTarget as T, IoRedirect as R};
        match r {
            R::File(fd, kind, target) => {
                // `< file`, `<> file`, `0<&3`: stdin from a file or another descriptor.
                let reads_stdin = matches!(kind, K::Read | K::ReadAndWrite | K::DuplicateInput)
                    && fd.is_none_or(|fd| fd == 0);
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
                    assignment: false,
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
            assignment: false,
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
                WordPiece::ParameterExpansion(e) => {
                    v.unknown = true;
                    v.many |= !quoted;
                    self.param(src.get(p.start_index..p.end_index).unwrap_or(src), e);
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
        if let Some(f) = &self.in_function
            && words.len() == 1
            && matches!(first.raw.as_str(), "\"$@\"" | "$@" | "\"${@}\"" | "${@}")
        {
            // Runs the function's arguments: checked at each call instead.
            self.runs_args.insert(f.clone());
            return;
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
        self.builtin(&base, &words);
        if self.reads_stdin.contains(&base) {
            self.feed(stdin);
        }
        let Some(inners) = wrappers::inner(&base, &words[1..]) else {
            return self.launched(&base, &words);
        };
        // What a wrapper runs reads the wrapper's stdin; xargs and parallel read it themselves.
        let inner_stdin = if matches!(base.as_str(), "xargs" | "parallel") {
            Stdin::Inherited
        } else {
            stdin.clone()
        };
        for inner in inners {
            self.depth += 1;
            match inner {
                Inner::Command(ws) => self.resolve(ws, &inner_stdin),
                Inner::Script(s) => {
                    let outer = std::mem::replace(&mut self.stdin, inner_stdin.clone());
                    self.script(&s);
                    self.stdin = outer;
                }
                Inner::Stdin => self.feed(stdin),
                Inner::Unknown(why) => self.opaque(why),
            }
            self.depth -= 1;
        }
    }

    /// A program rsb does not know that may run its arguments (`srun`, `mpirun`, `numactl`,
    /// `ld.so`, `systemd-run`, `tmux new`, `apptainer exec`, `conda run`, `valgrind`, …):
    /// an argument that names a rule's program, a shell or a wrapper is checked as the command
    /// it starts, and one that is shell code starting so (`tmux new 'rm -rf /'`,
    /// `sbatch --wrap='…'`) as a script.
    fn launched(&mut self, base: &str, words: &[WordVal]) {
        if NOT_LAUNCHERS.contains(&base) || self.depth > MAX_DEPTH {
            return;
        }
        for i in 1..words.len() {
            let Some(arg) = words[i].lit() else { continue };
            if self.starts_command(arg) {
                self.depth += 1;
                self.resolve(words[i..].to_vec(), &Stdin::Inherited);
                self.depth -= 1;
                return;
            }
            let code = match arg.split_once('=') {
                Some((opt, v)) if opt.starts_with('-') => v,
                _ => arg,
            };
            if code.contains(char::is_whitespace)
                && code
                    .split_whitespace()
                    .next()
                    .is_some_and(|w| self.starts_command(w))
            {
                self.depth += 1;
                let mut parser = brush_parser::Parser::new(code.as_bytes(), &self.opts);
                if parser.parse_program().is_ok() {
                    self.script(code);
                } else {
                    let ws = code
                        .split_whitespace()
                        .map(|w| WordVal {
                            arg: Arg::Lit(w.to_string()),
                            raw: w.to_string(),
                            ..WordVal::unknown(false)
                        })
                        .collect();
                    self.resolve(ws, &Stdin::Inherited);
                }
                self.depth -= 1;
            }
        }
    }

    /// Does a word name a program some rule names, a shell or a wrapper?
    fn starts_command(&self, word: &str) -> bool {
        let base = word.rsplit('/').next().unwrap_or(word);
        if base.is_empty() || word.starts_with('-') {
            return false;
        }
        wrappers::inner(base, &[]).is_some()
            || self.programs.iter().any(|p| {
                super::glob::matches(p, word) || (!p.contains('/') && super::glob::matches(p, base))
            })
    }
}

impl Walker {
    /// What bash evaluates in the arguments of its builtins and functions, and what they
    /// assign ([`evaluated`]).
    fn builtin(&mut self, base: &str, words: &[WordVal]) {
        let args = &words[1..];
        let lits = || args.iter().filter_map(WordVal::lit);
        if self.functions.contains(base)
            || wrappers::is_shell(base)
            || (base == "set"
                && lits()
                    .next()
                    .is_some_and(|a| a == "--" || !a.starts_with(['-', '+'])))
        {
            for w in args {
                let v = evaluated::classify(&w.raw, &self.opts, true, &self.vars.assoc);
                self.vars.assign(POSITIONAL, v);
            }
        }
        if self.runs_args.contains(base) && !args.is_empty() {
            self.depth += 1;
            self.resolve(args.to_vec(), &Stdin::Inherited);
            self.depth -= 1;
        }
        match base {
            "let" => {
                for w in args {
                    self.arith_of(&w.raw);
                }
            }
            "printf" => {
                let mut it = args.iter();
                while let Some(w) = it.next() {
                    match w.lit() {
                        Some("-v") => {
                            if let Some(n) = it.next() {
                                self.name_operand(n);
                                if let Some((n, _)) = n.lit().and_then(evaluated::reference) {
                                    self.vars.assign(n, Val::unknown());
                                }
                            }
                        }
                        Some(l) if l.starts_with("-v") => {
                            let n = WordVal {
                                arg: Arg::Lit(l[2..].to_string()),
                                ..WordVal::unknown(false)
                            };
                            self.name_operand(&n);
                            if let Some((n, _)) = evaluated::reference(&l[2..]) {
                                self.vars.assign(n, Val::unknown());
                            }
                        }
                        Some("--") => break,
                        Some(l) if l.starts_with('-') => {}
                        _ => break,
                    }
                }
            }
            "read" | "mapfile" | "readarray" => {
                let takes = if base == "read" {
                    "adinNptu"
                } else {
                    "dnOsuCc"
                };
                let mut i = 0;
                let mut names = Vec::new();
                while i < args.len() {
                    match args[i].lit() {
                        Some(l) if l.len() > 1 && l.starts_with('-') && l != "--" => {
                            for (j, c) in l[1..].char_indices() {
                                if takes.contains(c) {
                                    let attached = &l[1 + j + c.len_utf8()..];
                                    let value = if attached.is_empty() {
                                        i += 1;
                                        args.get(i).map(|w| w.arg.clone())
                                    } else {
                                        Some(Arg::Lit(attached.to_string()))
                                    };
                                    match (c, value) {
                                        ('a', Some(v)) if base == "read" => names.push(v),
                                        ('C', Some(Arg::Lit(cb))) => self.nested(&cb),
                                        ('C', _) => self
                                            .opaque("a mapfile callback only known when it runs"),
                                        _ => {}
                                    }
                                    break;
                                }
                            }
                        }
                        Some("--") => {}
                        _ => names.push(args[i].arg.clone()),
                    }
                    i += 1;
                }
                for n in names {
                    let w = WordVal {
                        arg: n,
                        ..WordVal::unknown(false)
                    };
                    self.name_operand(&w);
                    if let Some((n, _)) = w.lit().and_then(evaluated::reference) {
                        self.vars.assign(n, Val::unknown());
                    }
                }
            }
            "unset" if !lits().any(|a| a.starts_with('-') && a.contains('f')) => {
                for w in args
                    .iter()
                    .filter(|w| !w.lit().is_some_and(|l| l.starts_with('-')))
                {
                    self.name_operand(w);
                }
            }
            "test" | "[" => {
                for (i, w) in args.iter().enumerate() {
                    if matches!(w.lit(), Some("-v" | "-R"))
                        && let Some(n) = args.get(i + 1)
                    {
                        self.name_operand(n);
                    }
                }
            }
            "hash" if lits().any(|a| a.starts_with('-') && a.contains('p')) => {
                self.opaque("hash -p makes a command name run another program")
            }
            "enable" if lits().any(|a| a.starts_with('-') && a.contains('f')) => {
                self.opaque("enable -f loads a builtin from a shared library")
            }
            "env" | "sudo" | "doas" => {
                for l in lits() {
                    if let Some((n, v)) = l.split_once('=')
                        && evaluated::reference(n).is_some()
                    {
                        let quoted = format!("'{}'", v.replace('\'', r"'\''"));
                        self.assigned(n, &quoted);
                    }
                }
            }
            _ => {}
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

fn assignment_name(a: &ast::Assignment) -> &str {
    match &a.name {
        ast::AssignmentName::VariableName(n) | ast::AssignmentName::ArrayElementName(n, _) => n,
    }
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
        // rm's output is evaluated as an expression too: it could hold code.
        assert_eq!(
            shown("echo $(( $(rm a) + 1 ))"),
            [
                "rm a",
                "(arithmetic over a command's output, which may hold code)",
                "echo …"
            ]
        );
        assert_eq!(shown("echo $(( $(nproc) / 2 ))"), ["nproc", "echo …"]);
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
}
