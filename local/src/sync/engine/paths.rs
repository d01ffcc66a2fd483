//! Where a sync reads and writes, and which single files its rules leave out. Pure
//! string work (plus one read of a `.gitignore`), shared by the directory and the file case.

use rsb_protocol::{ReadFileRequest, SyncRules};

use crate::{
    client::AgentClient,
    error::{Result, RsbError},
    sync::join_rel,
};

/// Where things are on each side once resolved.
pub(super) struct Roots {
    /// Source root (a directory), or the source file itself.
    pub(super) src: String,
    /// The destination root the staging session opens (for a single file: its parent dir).
    pub(super) dst: String,
    /// Single-file mode: every read goes to `src` itself.
    pub(super) single: bool,
}

impl Roots {
    pub(super) fn src_path(&self, rel: &str) -> String {
        if self.single {
            self.src.clone()
        } else {
            join_rel(&self.src, rel)
        }
    }
    pub(super) fn dst_path(&self, rel: &str) -> String {
        join_rel(&self.dst, rel)
    }
}

pub(super) fn basename(p: &str) -> &str {
    let t = p.trim_end_matches('/');
    t.rsplit_once('/').map(|(_, b)| b).unwrap_or(t)
}

/// Parent directory and name of a file path (`x` → `.`, `/x` → `/`).
pub(super) fn split_parent(p: &str) -> (String, String) {
    match p.rsplit_once('/') {
        Some(("", name)) => ("/".into(), name.into()),
        Some((dir, name)) => (dir.into(), name.into()),
        None => (".".into(), p.into()),
    }
}

/// `rules` in the engine the agents use for directories. A line it refuses is the same one-line
/// error here as from an agent.
pub fn compile_rules(rules: &SyncRules) -> Result<rsb_rules::Rules> {
    rsb_rules::Rules::for_sync(rules.default_excludes, &rules.lines).map_err(|e| {
        RsbError::invalid(
            e.to_string(),
            "patterns use gitignore syntax; write \\[ for a literal [ and \\\\ for a literal \\",
        )
    })
}

/// Is a single file excluded by `rules`? Candidates as in the seed: the path as given (when
/// relative, each parent as the directory walk would meet it), and its basename.
pub fn single_file_excluded(rules: &SyncRules, given: &str) -> Result<bool> {
    let rules = compile_rules(rules)?;
    let mut rel = given.trim();
    while let Some(r) = rel.strip_prefix("./") {
        rel = r;
    }
    let name = basename(rel);
    if !name.is_empty() && rules.excluded(name, false) {
        return Ok(true);
    }
    let relative =
        !rel.starts_with('/') && !rel.starts_with('~') && !rel.split('/').any(|c| c == "..");
    Ok(relative && rules.excluded_path(rel, false))
}

/// With `rules.gitignore`: is a single file left out by the `.gitignore` beside it (read
/// through the source's agent), as the directory walk would decide for it?
pub(super) async fn single_file_gitignored(
    src: &AgentClient,
    rules: &SyncRules,
    given: &str,
) -> Result<bool> {
    if !rules.gitignore {
        return Ok(false);
    }
    let (dir, name) = split_parent(given.trim_end_matches('/'));
    let req = ReadFileRequest {
        path: join_rel(&dir, ".gitignore"),
        offset: 0,
        max_bytes: 1 << 20,
        confine: None,
    };
    let text = match src.call(req).await {
        Ok(r) => String::from_utf8_lossy(&r.data).into_owned(),
        // None there (or unreadable): nothing to apply.
        Err(_) => return Ok(false),
    };
    let (layer, _) = rsb_rules::Layer::parse("", text.lines());
    Ok(compile_rules(rules)?.excluded_in(&[layer], &name, false))
}
