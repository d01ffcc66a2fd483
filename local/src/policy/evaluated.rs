//! Values bash evaluates as code (issue 39). Arithmetic (`(( x ))`, `$((x))`, `let`,
//! `[[ x -eq 0 ]]`, an indexed array's subscript, `declare -i`), indirection (`${!x}`) and
//! namerefs read a variable's value as an expression, and a `[…]` in that value runs the
//! substitutions inside it: `x='a[$(rm -rf ~)]'; (( x ))` runs `rm`. The walker records every
//! name such a place reads and what each assignment may put in the name; a read of a name
//! that may hold a subscript counts as unknown code.
//!
//! Flow-insensitive on purpose: an assignment anywhere in the script (a loop body after the
//! read, a function, a `bash -c` inside) counts for every read. A name the script never
//! assigns comes from the environment rsb gives the command, which no earlier command can
//! change, and is trusted.

use std::collections::{HashMap, HashSet};

use brush_parser::{
    ParserOptions, ast,
    word::{self, Parameter, ParameterExpr, WordPiece, WordPieceWithSource},
};

/// What an assignment may put in a name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Val {
    /// May hold a `[` (or anything at all: a command's output, a file name, input).
    pub unsafe_: bool,
    /// Names whose values it copies (`y=$x`, `y=x`: evaluating `y` evaluates `x`).
    pub deps: Vec<String>,
}

impl Val {
    pub fn unknown() -> Val {
        Val {
            unsafe_: true,
            deps: Vec::new(),
        }
    }

    pub fn add(&mut self, o: Val) {
        self.unsafe_ |= o.unsafe_;
        self.deps.extend(o.deps);
    }
}

/// The positional parameters (`$1`, `$@`), as one pseudo-name.
pub const POSITIONAL: &str = "@";

/// Names and what they may hold, across the whole walk.
#[derive(Default)]
pub struct Vars {
    assigned: HashMap<String, Val>,
    reads: Vec<String>,
    /// Declared `-A`: a subscript is a string, not an expression.
    pub assoc: HashSet<String>,
    /// Declared `-i`: every assignment is evaluated as arithmetic.
    pub integer: HashSet<String>,
}

impl Vars {
    pub fn assign(&mut self, name: &str, v: Val) {
        self.assigned.entry(name.to_string()).or_default().add(v);
    }

    /// `name`'s value is read as an expression (or as a name).
    pub fn read(&mut self, name: &str) {
        if self.reads.len() < 10_000 {
            self.reads.push(name.to_string());
        }
    }

    /// The first name read as an expression whose value may hold a subscript, directly or
    /// through the names it copies.
    pub fn tainted_read(&self) -> Option<&str> {
        let mut seen = HashSet::new();
        self.reads
            .iter()
            .find(|n| self.tainted(n, &mut seen))
            .map(String::as_str)
    }

    fn tainted<'a>(&'a self, name: &'a str, seen: &mut HashSet<&'a str>) -> bool {
        if !seen.insert(name) {
            return false;
        }
        match self.assigned.get(name) {
            None => false,
            Some(v) => v.unsafe_ || v.deps.iter().any(|d| self.tainted(d, seen)),
        }
    }
}

/// The names an arithmetic text reads, each with the subscript that follows it:
/// `a[i+1] + x` → `[("a", Some("i+1")), ("x", None)]`. Numbers (`0x1f`, `16#ff`) are not
/// names.
pub fn names(text: &str) -> Vec<(String, Option<String>)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_digit() {
            while i < b.len() && (word(b[i]) || b[i] == b'#' || b[i] == b'@') {
                i += 1;
            }
            continue;
        }
        if !(c.is_ascii_alphabetic() || c == b'_') {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && word(b[i]) {
            i += 1;
        }
        let name = text[start..i].to_string();
        let mut sub = None;
        if b.get(i) == Some(&b'[') {
            let mut depth = 0;
            let open = i;
            while i < b.len() {
                match b[i] {
                    b'[' => depth += 1,
                    b']' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            // Unbalanced: the rest is the subscript, as bash would try it.
            sub = Some(text[open + 1..i.min(b.len())].to_string());
            i += 1;
        }
        out.push((name, sub));
    }
    out
}

/// `name` or `name[sub]` as a variable reference: the name and its subscript; `None` when
/// it is not one (bash refuses those).
pub fn reference(s: &str) -> Option<(&str, Option<&str>)> {
    let (name, sub) = match s.find('[') {
        Some(i) if s.ends_with(']') => (&s[..i], Some(&s[i + 1..s.len() - 1])),
        Some(_) => return None,
        None => (s, None),
    };
    let ok = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    ok.then_some((name, sub))
}

/// What assigning the word `text` may put in a variable. `globbed`: the word is expanded as
/// a command's argument or a `for` list, so an unquoted `*` may become any file name.
/// `assoc`: the associative arrays, whose keys (`${!m[@]}`) are any text; an indexed
/// array's are numbers.
pub fn classify(text: &str, opts: &ParserOptions, globbed: bool, assoc: &HashSet<String>) -> Val {
    match word::parse(text, opts) {
        Ok(pieces) => {
            let mut v = Val::default();
            let mut lit = String::new();
            let c = Ctx {
                opts,
                globbed,
                assoc,
            };
            pieces_val(&c, &pieces, false, &mut lit, &mut v);
            v.add(literal(&lit));
            v
        }
        Err(_) => Val::unknown(),
    }
}

/// A value known as text.
pub fn literal(s: &str) -> Val {
    if s.contains('[') {
        Val::unknown()
    } else {
        Val {
            unsafe_: false,
            deps: names(s).into_iter().map(|(n, _)| n).collect(),
        }
    }
}

struct Ctx<'a> {
    opts: &'a ParserOptions,
    globbed: bool,
    assoc: &'a HashSet<String>,
}

fn pieces_val(
    c: &Ctx<'_>,
    pieces: &[WordPieceWithSource],
    quoted: bool,
    lit: &mut String,
    v: &mut Val,
) {
    let opts = c.opts;
    for p in pieces {
        match &p.piece {
            WordPiece::Text(t) => {
                if c.globbed && !quoted && super::glob::has_glob(t) {
                    v.unsafe_ = true;
                }
                lit.push_str(t);
            }
            WordPiece::SingleQuotedText(t) | WordPiece::EscapeSequence(t) => lit.push_str(t),
            WordPiece::AnsiCQuotedText(t) => lit.push_str(&super::words::ansi_c(t)),
            WordPiece::DoubleQuotedSequence(inner)
            | WordPiece::GettextDoubleQuotedSequence(inner) => pieces_val(c, inner, true, lit, v),
            WordPiece::TildeExpansion(_) | WordPiece::ArithmeticExpression(_) => {}
            WordPiece::ParameterExpansion(ParameterExpr::MemberKeys { variable_name, .. })
                if !c.assoc.contains(variable_name) => {}
            WordPiece::ParameterExpansion(e) => v.add(param_val(e)),
            WordPiece::CommandSubstitution(s) => {
                if !numeric_output(s, opts) {
                    v.unsafe_ = true;
                }
            }
            WordPiece::BackquotedCommandSubstitution(s) => {
                if !numeric_output(&super::words::unbackquote(s), opts) {
                    v.unsafe_ = true;
                }
            }
        }
    }
}

/// The name a parameter stands for, as [`Vars`] records it; `None` for `$?`, `$$`, ….
pub fn param_name(p: &Parameter) -> Option<&str> {
    match p {
        Parameter::Positional(0) | Parameter::Special(_) => None,
        Parameter::Positional(_) => Some(POSITIONAL),
        Parameter::Named(n) => Some(n),
        Parameter::NamedWithIndex { name, .. } | Parameter::NamedWithAllIndices { name, .. } => {
            Some(name)
        }
    }
}

/// The parameter of an expansion and whether it is indirect (`${!x}`); `None` for
/// `${!prefix*}` and `${!a[@]}`.
pub fn parts(e: &ParameterExpr) -> Option<(&Parameter, bool)> {
    use ParameterExpr as P;
    match e {
        P::Parameter {
            parameter,
            indirect,
        }
        | P::UseDefaultValues {
            parameter,
            indirect,
            ..
        }
        | P::AssignDefaultValues {
            parameter,
            indirect,
            ..
        }
        | P::IndicateErrorIfNullOrUnset {
            parameter,
            indirect,
            ..
        }
        | P::UseAlternativeValue {
            parameter,
            indirect,
            ..
        }
        | P::ParameterLength {
            parameter,
            indirect,
        }
        | P::RemoveSmallestSuffixPattern {
            parameter,
            indirect,
            ..
        }
        | P::RemoveLargestSuffixPattern {
            parameter,
            indirect,
            ..
        }
        | P::RemoveSmallestPrefixPattern {
            parameter,
            indirect,
            ..
        }
        | P::RemoveLargestPrefixPattern {
            parameter,
            indirect,
            ..
        }
        | P::Substring {
            parameter,
            indirect,
            ..
        }
        | P::Transform {
            parameter,
            indirect,
            ..
        }
        | P::UppercaseFirstChar {
            parameter,
            indirect,
            ..
        }
        | P::UppercasePattern {
            parameter,
            indirect,
            ..
        }
        | P::LowercaseFirstChar {
            parameter,
            indirect,
            ..
        }
        | P::LowercasePattern {
            parameter,
            indirect,
            ..
        }
        | P::ReplaceSubstring {
            parameter,
            indirect,
            ..
        } => Some((parameter, *indirect)),
        P::VariableNames { .. } | P::MemberKeys { .. } => None,
    }
}

/// What an expansion pastes: a copy of its parameter's value, cut or cased (`${x%.txt}`,
/// `${x^^}`), its length (a number), or text of its own (`${x:-0}`).
pub fn param_val(e: &ParameterExpr) -> Val {
    use ParameterExpr as P;
    let extra = match e {
        P::ParameterLength { .. } | P::VariableNames { .. } => return Val::default(),
        P::Transform { .. } | P::MemberKeys { .. } => return Val::unknown(),
        P::UseDefaultValues {
            default_value: t, ..
        }
        | P::AssignDefaultValues {
            default_value: t, ..
        }
        | P::UseAlternativeValue {
            alternative_value: t,
            ..
        }
        | P::ReplaceSubstring { replacement: t, .. } => t.as_deref(),
        _ => None,
    };
    let Some((p, indirect)) = parts(e) else {
        return Val::unknown();
    };
    if indirect {
        return Val::unknown();
    }
    let mut v = Val {
        unsafe_: false,
        deps: param_name(p).map(str::to_string).into_iter().collect(),
    };
    if let Some(t) = extra {
        v.add(literal(t));
        if t.contains(['$', '`']) {
            v.unsafe_ = true;
        }
    }
    v
}

/// Programs whose output is a number (or text without a `[`) whatever their input, given
/// literal arguments without one: a substitution of theirs is safe in arithmetic
/// (`make -j$(( $(nproc) / 2 ))`, `$(( $(date +%s) - start ))`, `[[ $(wc -l < f) -gt 9 ]]`).
/// `grep -c` too.
const NUMERIC: &[&str] = &["nproc", "wc", "getconf", "id", "date", "stat", "seq"];

/// Does the script `src` print only what [`NUMERIC`] programs print? Its last command
/// decides (`ls | wc -l`).
pub fn numeric_output(src: &str, opts: &ParserOptions) -> bool {
    let mut parser = brush_parser::Parser::new(src.as_bytes(), opts);
    let Ok(prog) = parser.parse_program() else {
        return false;
    };
    let last = prog
        .complete_commands
        .last()
        .and_then(|cc| cc.0.last())
        .map(|item| {
            item.0
                .additional
                .last()
                .map(|a| match a {
                    ast::AndOr::And(p) | ast::AndOr::Or(p) => p,
                })
                .unwrap_or(&item.0.first)
        })
        .and_then(|p| p.seq.last());
    let Some(ast::Command::Simple(sc)) = last else {
        return false;
    };
    let Some(name) = &sc.word_or_name else {
        return false;
    };
    let base = name.value.rsplit('/').next().unwrap_or(&name.value);
    let words = || {
        sc.suffix
            .iter()
            .flat_map(|s| s.0.iter())
            .filter_map(|i| match i {
                ast::CommandPrefixOrSuffixItem::Word(w) => Some(w.value.as_str()),
                _ => None,
            })
    };
    let count = matches!(base, "grep" | "egrep" | "fgrep" | "rg")
        && words().any(|w| {
            w == "--count" || (w.starts_with('-') && !w.starts_with("--") && w.contains('c'))
        });
    (NUMERIC.contains(&base) || count)
        && sc.suffix.iter().flat_map(|s| s.0.iter()).all(|i| match i {
            ast::CommandPrefixOrSuffixItem::Word(w) => !w.value.contains(['[', '$', '`', '*', '?']),
            ast::CommandPrefixOrSuffixItem::IoRedirect(_) => true,
            _ => false,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_subscripts_of_an_expression() {
        assert_eq!(
            names("a[i+1] + x*0x1f - 16#ff"),
            vec![
                ("a".to_string(), Some("i+1".to_string())),
                ("x".to_string(), None)
            ]
        );
        assert_eq!(
            names("m[a[j]]"),
            vec![("m".to_string(), Some("a[j]".to_string()))]
        );
        assert_eq!(reference("a[$i]"), Some(("a", Some("$i"))));
        assert_eq!(reference("x"), Some(("x", None)));
        assert_eq!(reference("1x"), None);
    }

    #[test]
    fn values_that_may_hold_a_subscript() {
        let o = ParserOptions::default();
        let none = HashSet::new();
        let classify = |t: &str, o: &ParserOptions, g: bool| super::classify(t, o, g, &none);
        assert!(classify("'a[$(rm x)]'", &o, false).unsafe_);
        assert!(classify("$(cat f)", &o, false).unsafe_);
        assert!(classify("*.txt", &o, true).unsafe_);
        assert!(!classify("*.txt", &o, false).unsafe_);
        assert!(!classify("$(nproc)", &o, false).unsafe_);
        assert!(!classify("$(ls | wc -l)", &o, false).unsafe_);
        assert!(classify("$(date +'a[$x]')", &o, false).unsafe_);
        assert!(!classify("$((n+1))", &o, false).unsafe_);
        assert_eq!(classify("${y:-0}", &o, false).deps, ["y"]);
        assert_eq!(classify("$1", &o, false).deps, [POSITIONAL]);
        assert!(classify("${!y}", &o, false).unsafe_);

        let mut v = Vars::default();
        v.assign("x", classify("'a[$(rm)]'", &o, false));
        v.assign("y", classify("x", &o, false));
        v.assign("z", classify("5", &o, false));
        v.read("z");
        assert_eq!(v.tainted_read(), None);
        v.read("y");
        assert_eq!(v.tainted_read(), Some("y"));
    }
}
