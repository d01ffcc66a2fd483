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
    &["gpus"],
    &["exec_stream"],
    &["ssh"],
    &["connect"],
    &["store"],
    &["server_env"],
    &["pool"],
    &["app"],
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

/// The edges out of one file, whose module path under `src/` is `module`
/// (for `sync/engine/window.rs`, `["sync", "engine", "window"]`): to each other top-level
/// module a `crate::` path (or a `super::` path climbing to the root) names.
pub fn edges_of(module: &[String], file: &str, src: &str) -> Vec<Edge> {
    let from = &module[0];
    let mut seen = BTreeSet::new();
    let mut edges = Vec::new();
    for (target, line) in paths_named(module, None, src) {
        match target.first() {
            Some(to) if to != from && seen.insert((to.clone(), line)) => edges.push(Edge {
                from: from.clone(),
                to: to.clone(),
                file: file.to_string(),
                line,
            }),
            _ => {}
        }
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
    let library = CrateFiles::scan(src, "lib.rs", None, &["cli"]);
    let mut edges = Vec::new();
    for (f, module) in library.files.iter().filter(|(_, m)| !m.is_empty()) {
        let rel = f.strip_prefix(src).unwrap_or(f).to_string_lossy();
        let text = std::fs::read_to_string(f).unwrap_or_default();
        edges.extend(edges_of(module, &rel, &text));
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

/// One crate's files for the file-level graph, each with its module path (the root file,
/// `lib.rs` or `main.rs`, is the empty path).
pub struct CrateFiles {
    pub files: Vec<(PathBuf, Vec<String>)>,
}

impl CrateFiles {
    /// The crate whose root file is `src/<root>`, with the `.rs` files under `src` of the
    /// top-level modules in `only` (all when `None`), less those in `skip` and the other root
    /// file: the library and the binary share `local/src`.
    pub fn scan(src: &Path, root: &str, only: Option<&[&str]>, skip: &[&str]) -> CrateFiles {
        let mut paths = Vec::new();
        rust_files(src, &mut paths);
        paths.sort();
        let mut files = Vec::new();
        for f in paths {
            let rel = f.strip_prefix(src).unwrap_or(&f).to_path_buf();
            let mut module = module_path(&rel);
            match module.first().map(String::as_str) {
                Some(r) if module.len() == 1 && r == root.trim_end_matches(".rs") => module.clear(),
                Some("lib" | "main") if module.len() == 1 => continue,
                Some(top) if skip.contains(&top) => continue,
                Some(top) if only.is_some_and(|o| !o.contains(&top)) => continue,
                _ => {}
            }
            files.push((f, module));
        }
        CrateFiles { files }
    }

    /// Every file-level edge of the crate: from a file's module to the module a path names
    /// (the longest prefix of the path that is a module of the crate), whether the path
    /// climbs with `crate::`/`super::`, stays with `self::`, or starts at a child module,
    /// drawn between the two siblings under their deepest common ancestor (`sync::engine::
    /// window` using `sync::plan` is `sync::engine -> sync::plan`). So a circle is one among
    /// the children of one module; a module and its own submodules never are one. A path
    /// through a sibling's re-export is an edge to that sibling.
    pub fn edges(&self) -> Vec<Edge> {
        let known: BTreeSet<Vec<String>> = self.files.iter().map(|(_, m)| m.clone()).collect();
        let mut edges = Vec::new();
        for (f, module) in &self.files {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            let shown = f.display().to_string();
            edges.extend(file_edges_of(module, &known, &shown, &text));
        }
        edges
    }
}

/// The name of a module path in the file-level graph (`crate` for the root).
fn module_name(m: &[String]) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

/// The paths a `use` tree or path expression at `i` names, each as its segments with where
/// its last segment starts: `a::b`, `a::{b, c::d}`, `a::{self, b::*}`. Stops at the first
/// segment that is not an identifier (a turbofish, a `*`, a call).
fn path_tree(
    b: &[char],
    i: usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, usize)>,
) -> usize {
    let mut path = prefix.to_vec();
    let mut k = i;
    loop {
        while k < b.len() && b[k].is_whitespace() {
            k += 1;
        }
        if b.get(k) == Some(&'{') {
            k += 1;
            loop {
                while k < b.len() && (b[k].is_whitespace() || b[k] == ',') {
                    k += 1;
                }
                match b.get(k) {
                    None => return k,
                    Some('}') => return k + 1,
                    _ => {}
                }
                let before = k;
                k = path_tree(b, k, &path, out);
                if k == before {
                    k += 1;
                }
            }
        }
        let (id, end) = ident_at(b, k);
        if id.is_empty() {
            out.push((path, k));
            return k;
        }
        let at = end - id.chars().count();
        k = end;
        if id != "self" {
            path.push(id);
        }
        let mut j = k;
        while j < b.len() && b[j].is_whitespace() {
            j += 1;
        }
        if b[j..].starts_with(&[':', ':']) {
            k = j + 2;
        } else {
            out.push((path, at));
            // `x as y`: the new name is not a path.
            let (word, after) = ident_at(b, k);
            if word == "as" {
                k = ident_at(b, after).1;
            }
            return k;
        }
    }
}

/// Whether the code before `i` ends in `::` (so the identifier at `i` is not a path's start).
fn after_colons(b: &[char], i: usize) -> bool {
    let mut j = i;
    while j > 0 && b[j - 1].is_whitespace() {
        j -= 1;
    }
    j >= 2 && b[j - 1] == ':' && b[j - 2] == ':'
}

/// The file-level edges out of one file of a crate whose modules are `known`.
pub fn file_edges_of(
    module: &[String],
    known: &BTreeSet<Vec<String>>,
    file: &str,
    src: &str,
) -> Vec<Edge> {
    let mut edges = BTreeSet::new();
    for (target, line) in paths_named(module, Some(known), src) {
        // Project onto the two children of the deepest common ancestor: a module and its
        // own submodules (a facade and what it contains) are not a circle, siblings are.
        let common = module
            .iter()
            .zip(&target)
            .take_while(|(a, b)| a == b)
            .count();
        if common < module.len() && common < target.len() {
            edges.insert(Edge {
                from: module_name(&module[..=common]),
                to: module_name(&target[..=common]),
                file: file.to_string(),
                line,
            });
        }
    }
    edges.into_iter().collect()
}

/// Every module path one file of module `module` names outside comments, strings and test
/// items, with its line: `crate::` and `super::` paths, `self::` paths and, when the crate's
/// modules are `known`, paths that start at a child module; each resolved to the longest of
/// its prefixes that is a known module (to the whole path without `known`).
fn paths_named(
    module: &[String],
    known: Option<&BTreeSet<Vec<String>>>,
    src: &str,
) -> Vec<(Vec<String>, usize)> {
    let code = strip_test_items(&strip_comments_and_strings(src));
    let b: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < b.len() {
        if b[i] == '\n' {
            line += 1;
            i += 1;
            continue;
        }
        if ident_char_before(&b, i) || !(b[i].is_alphabetic() || b[i] == '_') || after_colons(&b, i)
        {
            i += 1;
            continue;
        }
        let (id, end) = ident_at(&b, i);
        let mut j = end;
        while j < b.len() && b[j].is_whitespace() {
            j += 1;
        }
        let mut at = j + 2;
        let base = match id.as_str() {
            _ if !b[j..].starts_with(&[':', ':']) => None,
            "crate" => Some(Vec::new()),
            "self" => Some(module.to_vec()),
            "super" => {
                let mut up = module.to_vec();
                at = i;
                while b[at..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
                    up.pop();
                    at += 7;
                }
                Some(up)
            }
            _ => {
                let mut child = module.to_vec();
                child.push(id.clone());
                at = i;
                known
                    .is_some_and(|k| k.contains(&child))
                    .then(|| module.to_vec())
            }
        };
        let Some(base) = base else {
            i = end;
            continue;
        };
        let mut paths = Vec::new();
        let stop = path_tree(&b, at, &base, &mut paths);
        for (p, at) in paths {
            let line = line + b[i..at.max(i)].iter().filter(|&&c| c == '\n').count();
            let target = match known {
                Some(k) => (0..=p.len())
                    .rev()
                    .map(|n| p[..n].to_vec())
                    .find(|m| k.contains(m) || m.is_empty())
                    .unwrap_or_default(),
                None => p,
            };
            out.push((target, line));
        }
        // Newlines inside a `use` tree still count.
        line += b[i..stop.max(i)].iter().filter(|&&c| c == '\n').count();
        i = stop.max(end);
    }
    out
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
    fn no_file_imports_a_module_that_imports_it_back() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        // (crate, src, root file, only these top-level modules, skip these, fewest edges the
        // scan must see: a scan that finds nothing proves nothing). The protocol's files only
        // use the crate root's vocabulary today.
        let crates = [
            ("local (library)", "src", "lib.rs", None, &["cli"][..], 50),
            (
                "local (binary)",
                "src",
                "main.rs",
                Some(&["cli"][..]),
                &[][..],
                5,
            ),
            (
                "agent (library)",
                "../agent/src",
                "lib.rs",
                None,
                &[][..],
                20,
            ),
            ("protocol", "../protocol/src", "lib.rs", None, &[][..], 0),
        ];
        let mut found = Vec::new();
        for (name, src, root, only, skip, fewest) in crates {
            let c = CrateFiles::scan(&dir.join(src), root, only, skip);
            let edges = c.edges();
            assert!(edges.len() >= fewest, "{name}: only {} edges", edges.len());
            for circle in circles(&edges) {
                let lines: Vec<String> = edges
                    .iter()
                    .filter(|e| circle.contains(&e.from) && circle.contains(&e.to))
                    .map(|e| format!("  {}:{}: {} -> {}", e.file, e.line, e.from, e.to))
                    .collect();
                found.push(format!("{name}: {circle:?}\n{}", lines.join("\n")));
            }
        }
        assert!(
            found.is_empty(),
            "file-level import circles:\n{}",
            found.join("\n")
        );
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
    fn a_planted_file_level_circle_is_found_and_a_facade_is_not_one() {
        let known: BTreeSet<Vec<String>> = [
            "",
            "config",
            "config::entry",
            "config::secrets",
            "config::fields",
            "serve",
            "exec",
            "responder",
        ]
        .iter()
        .map(|m| {
            m.split("::")
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        })
        .collect();
        let files = [
            // Siblings through `super::` and through `crate::`: a circle.
            (
                "config/secrets.rs",
                "use super::entry::Entry;\nuse super::fields::Text;\n",
            ),
            (
                "config/entry.rs",
                "fn f() { crate::config::secrets::check(); }\nuse super::Thing;\n",
            ),
            // A facade re-exporting its children, which use its items: not a circle.
            (
                "config/mod.rs",
                "mod entry;\npub use entry::Entry;\npub use fields::Text;\n",
            ),
            // A path through a sibling's re-export is an edge to that sibling.
            (
                "exec.rs",
                "use crate::{\n    responder::Ok as Fine,\n    serve::Responder,\n};\n",
            ),
            (
                "serve.rs",
                "use crate::exec;\nuse crate::responder::Responder;\n",
            ),
        ];
        let mut edges = Vec::new();
        for (file, text) in files {
            edges.extend(file_edges_of(&m(file), &known, file, text));
        }
        let shown: Vec<String> = edges
            .iter()
            .map(|e| format!("{}:{} {} -> {}", e.file, e.line, e.from, e.to))
            .collect();
        assert_eq!(
            shown,
            [
                "config/secrets.rs:1 config::secrets -> config::entry",
                "config/secrets.rs:2 config::secrets -> config::fields",
                "config/entry.rs:1 config::entry -> config::secrets",
                "exec.rs:2 exec -> responder",
                "exec.rs:3 exec -> serve",
                "serve.rs:1 serve -> exec",
                "serve.rs:2 serve -> responder",
            ]
        );
        let c = circles(&edges);
        let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(
            c,
            vec![
                set(&["config::entry", "config::secrets"]),
                set(&["exec", "serve"])
            ]
        );
        // Moved to its own file and named there, the circle is gone.
        let fixed = file_edges_of(
            &m("exec.rs"),
            &known,
            "exec.rs",
            "use crate::responder::Responder;",
        );
        edges.retain(|e| e.file != "exec.rs" && e.file != "config/entry.rs");
        edges.extend(fixed);
        assert!(circles(&edges).is_empty(), "{edges:?}");
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
use crate::{error::Error as E, term::{human, Style}};
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
