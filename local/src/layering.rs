//! The layering rule, checked: every top-level module of the library may use
//! only the modules below it in [`LAYERS`], so no two modules import each
//! other, directly or through a third.
//!
//! Why a test and not a convention: the import circles this replaced (the
//! daemon calling up into `ops`, the transfer runner calling back into
//! `ops::sync`, `config` reaching into `store`) each came in one reasonable
//! line at a time. A reader who knows a capability's name finds its state one
//! layer down, and this keeps it so.
//!
//! The scan is textual, which is enough for this crate's style: paths are
//! written `crate::module::…` or `super::…`; comments, string literals and
//! `#[cfg(test)]` items are removed first, because tests may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bottom to top. A module may use those before it, never one after it.
/// Modules on one line (a slice) are one layer and must not use each other.
pub const LAYERS: &[&[&str]] = &[
    &["error"],
    &["term"],
    &["config"],
    &["client"],
    &["exec_stream"],
    &["ssh"],
    &["connect"],
    &["store"],
    &["server_env"],
    &["pool"],
    &["audit"],
    &["policy"],
    &["sync"],
    &["forward"],
    &["slurm"],
    &["watchdog"],
    &["ops"],
    &["mcp"],
];

/// One `crate::` (or `super::` that climbs to the crate root) reference from
/// one top-level module to another.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub file: String,
    pub line: usize,
}

/// Blanks comments and the contents of string and char literals, keeping
/// newlines so line numbers still match the file.
fn strip_comments_and_strings(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |c: char, out: &mut String| out.push(if c == '\n' { '\n' } else { ' ' });
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(b[i], &mut out);
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_char_before(&b, i)
        {
            // Raw string: r"…" or r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            for _ in i..=j {
                out.push(' ');
            }
            i = j + 1;
            while i < b.len() {
                if b[i] == '"' && (0..hashes).all(|k| b.get(i + 1 + k) == Some(&'#')) {
                    for _ in 0..=hashes {
                        out.push(' ');
                    }
                    i += 1 + hashes;
                    break;
                }
                blank(b[i], &mut out);
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    blank(b[i], &mut out);
                    i += 1;
                }
                if i < b.len() {
                    blank(b[i], &mut out);
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && is_char_literal(&b, i) {
            let end = char_literal_end(&b, i);
            for _ in i..end {
                out.push(' ');
            }
            i = end;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident_char_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// Tells `'a'` and `'\n'` from a lifetime such as `'a`.
fn is_char_literal(b: &[char], i: usize) -> bool {
    matches!(
        (b.get(i + 1), b.get(i + 2)),
        (Some('\\'), _) | (Some(_), Some('\''))
    )
}

fn char_literal_end(b: &[char], i: usize) -> usize {
    let mut j = i + 1;
    if b.get(j) == Some(&'\\') {
        j += 2;
    } else {
        j += 1;
    }
    while j < b.len() && b[j] != '\'' {
        j += 1;
    }
    (j + 1).min(b.len())
}

/// Removes every item that `#[cfg(test)]` guards: the next item up to its
/// matching `}` or its `;`. Tests may use any layer; the rule is about the
/// code that ships.
fn strip_test_items(code: &str) -> String {
    let b: Vec<char> = code.chars().collect();
    let pat: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut out = String::with_capacity(code.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(&pat) {
            // Blank through the end of the guarded item.
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                let c = b[j];
                if c == '{' {
                    depth += 1;
                } else if c == '}' {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        j += 1;
                        break;
                    }
                } else if c == ';' && depth == 0 {
                    j += 1;
                    break;
                }
                j += 1;
            }
            for &c in &b[i..j] {
                out.push(if c == '\n' { '\n' } else { ' ' });
            }
            i = j;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn ident_at(b: &[char], mut i: usize) -> (String, usize) {
    while i < b.len() && b[i].is_whitespace() {
        i += 1;
    }
    let start = i;
    while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
        i += 1;
    }
    (b[start..i].iter().collect(), i)
}

/// The top-level modules named right after a crate-root path at `i`: one
/// for `crate::x`, each of them for `crate::{x, y::z}`.
fn heads_at(b: &[char], i: usize) -> Vec<String> {
    let mut j = i;
    while j < b.len() && b[j].is_whitespace() {
        j += 1;
    }
    if b.get(j) != Some(&'{') {
        let (id, _) = ident_at(b, j);
        return if id.is_empty() { vec![] } else { vec![id] };
    }
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect = true;
    let mut k = j;
    while k < b.len() {
        match b[k] {
            '{' => {
                depth += 1;
                expect = depth == 1;
                k += 1;
            }
            '}' => {
                depth -= 1;
                k += 1;
                if depth == 0 {
                    break;
                }
            }
            ',' => {
                expect = depth == 1;
                k += 1;
            }
            c if expect && (c.is_alphanumeric() || c == '_') => {
                let (id, end) = ident_at(b, k);
                heads.push(id);
                expect = false;
                k = end;
            }
            _ => k += 1,
        }
    }
    heads
}

/// The edges out of one file, whose module path under `src/` is `module`
/// (for `sync/engine/window.rs`, `["sync", "engine", "window"]`).
pub fn edges_of(module: &[String], file: &str, src: &str) -> Vec<Edge> {
    let code = strip_test_items(&strip_comments_and_strings(src));
    let b: Vec<char> = code.chars().collect();
    let from = module[0].clone();
    let mut edges = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < b.len() {
        if b[i] == '\n' {
            line += 1;
            i += 1;
            continue;
        }
        if ident_char_before(&b, i) {
            i += 1;
            continue;
        }
        let mut targets = Vec::new();
        let mut end = i + 1;
        if b[i..].starts_with(&['c', 'r', 'a', 't', 'e', ':', ':']) {
            targets = heads_at(&b, i + 7);
            end = i + 7;
        } else if b[i..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
            let mut j = i;
            let mut ups = 0;
            while b[j..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
                ups += 1;
                j += 7;
            }
            end = j;
            // Only a climb back to the crate root names another top-level module.
            if ups >= module.len() {
                targets = heads_at(&b, j);
            }
        }
        for to in targets {
            if to != from && to != "self" && to != "super" {
                edges.push(Edge {
                    from: from.clone(),
                    to,
                    file: file.to_string(),
                    line,
                });
            }
        }
        i = end;
    }
    edges
}

/// The module path of a file under `src/`: `a/b/mod.rs` and `a/b.rs` are
/// both `["a", "b"]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every edge of the library under `src`. The binary's own modules (`main.rs`
/// and `cli/`) sit above the library and are left out.
pub fn crate_edges(src: &Path) -> Vec<Edge> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut edges = Vec::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap_or(&f).to_path_buf();
        let module = module_path(&rel);
        if module.is_empty() || matches!(module[0].as_str(), "main" | "lib" | "cli") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        edges.extend(edges_of(&module, &rel.to_string_lossy(), &text));
    }
    edges
}

/// The strongly connected components with more than one module: each is an
/// import circle.
pub fn circles(edges: &[Edge]) -> Vec<BTreeSet<String>> {
    let mut graph: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for e in edges {
        graph.entry(&e.from).or_default().insert(&e.to);
        graph.entry(&e.to).or_default();
    }
    let reach = |start: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![start];
        while let Some(n) = stack.pop() {
            for &m in graph.get(n).into_iter().flatten() {
                if seen.insert(m.to_string()) {
                    stack.push(m);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&str, BTreeSet<String>> = graph.keys().map(|&n| (n, reach(n))).collect();
    let mut out: Vec<BTreeSet<String>> = Vec::new();
    for (&n, r) in &reaches {
        let comp: BTreeSet<String> = r
            .iter()
            .filter(|m| reaches[m.as_str()].contains(n))
            .cloned()
            .collect();
        if comp.len() > 1 && !out.contains(&comp) {
            out.push(comp);
        }
    }
    out
}

/// The edges that go up or sideways in [`LAYERS`], and the edges to or from
/// a module that is not listed there (a new module must take its place).
pub fn violations(edges: &[Edge]) -> Vec<String> {
    let rank = |m: &str| LAYERS.iter().position(|l| l.contains(&m));
    let mut out = BTreeSet::new();
    for e in edges {
        match (rank(&e.from), rank(&e.to)) {
            (Some(f), Some(t)) if t < f => {}
            (Some(_), Some(_)) => {
                out.insert(format!(
                    "{}:{}: {} uses {}, which is not below it",
                    e.file, e.line, e.from, e.to
                ));
            }
            _ => {
                out.insert(format!(
                    "{}:{}: {} uses {}; give each module its place in layering::LAYERS",
                    e.file, e.line, e.from, e.to
                ));
            }
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(path: &str) -> Vec<String> {
        module_path(Path::new(path))
    }

    #[test]
    fn no_top_level_module_imports_one_above_it() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let edges = crate_edges(&src);
        assert!(
            edges.len() > 50,
            "the scan found only {} edges",
            edges.len()
        );
        let bad = violations(&edges);
        assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
        let circles = circles(&edges);
        assert!(circles.is_empty(), "import circles: {circles:?}");
        // Every top-level module has a place, so a new one cannot slip in
        // unranked.
        let listed: BTreeSet<&str> = LAYERS.iter().flat_map(|l| l.iter().copied()).collect();
        for e in &edges {
            assert!(
                listed.contains(e.from.as_str()),
                "{} is not in LAYERS",
                e.from
            );
        }
    }

    #[test]
    fn a_planted_circle_is_found() {
        let mut edges = edges_of(&m("pool.rs"), "pool.rs", "use crate::ops::exec;\n");
        edges.extend(edges_of(
            &m("ops/exec.rs"),
            "ops/exec.rs",
            "fn f() { crate::sync::run(); }\n",
        ));
        edges.extend(edges_of(
            &m("sync/engine/window.rs"),
            "sync/engine/window.rs",
            "use super::super::super::pool::Pool;\n",
        ));
        let c = circles(&edges);
        assert_eq!(c.len(), 1, "{edges:?}");
        assert_eq!(
            c[0],
            ["ops", "pool", "sync"]
                .iter()
                .map(|s| s.to_string())
                .collect()
        );
        let bad = violations(&edges);
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert!(bad[0].starts_with("pool.rs:1: pool uses ops"), "{bad:?}");
    }

    #[test]
    fn comments_strings_and_tests_are_not_imports() {
        let src = r##"
//! See crate::ops for the tool layer.
/* crate::mcp /* nested crate::cli */ still a comment crate::ops */
const HINT: &str = "run crate::ops::x";
const RAW: &str = r#"crate::mcp "quoted" "#;
const C: char = '"';
fn f<'a>(x: &'a str) -> &'a str { x }
use crate::{error::Error, term::{human, Style}};
#[cfg(test)]
mod tests {
    use crate::ops::exec;
    fn g() { crate::mcp::serve(); }
}
#[cfg(test)]
use crate::watchdog::Thing;
fn h() { crate::store::open(); }
"##;
        let edges = edges_of(&m("sync/mod.rs"), "sync/mod.rs", src);
        let to: Vec<(&str, usize)> = edges.iter().map(|e| (e.to.as_str(), e.line)).collect();
        assert_eq!(to, vec![("error", 8), ("term", 8), ("store", 16)]);
    }

    #[test]
    fn super_counts_only_when_it_climbs_to_the_root() {
        // From sync/engine/window.rs, `super::` is sync::engine and
        // `super::super::` is sync: both inside sync.
        let one = edges_of(
            &m("sync/engine/window.rs"),
            "w",
            "use super::super::plan; use super::batch;",
        );
        assert!(one.is_empty(), "{one:?}");
        let up = edges_of(&m("sync/plan.rs"), "p", "use super::super::store::X;");
        assert_eq!(up.len(), 1);
        assert_eq!(up[0].to, "store");
        assert_eq!(m("sync/engine/mod.rs"), vec!["sync", "engine"]);
    }
}
