//! The diff: two manifests in, the list of destination changes out. Pure, so every rule
//! (conflicts, deletes, the mass-delete guard, dir mtimes) is unit-tested without agents.

use std::collections::{BTreeMap, BTreeSet};

use rsb_protocol::{FileKind, ManifestEntry};

use crate::error::{Result, RsbError};

/// Files at least this large that already exist on the destination go as block deltas.
pub const DELTA_MIN_SIZE: u64 = 8 * 1024 * 1024;
/// Block size for deltas (and the `FileData` chunk size of large files).
pub const BLOCK_SIZE: u64 = 256 * 1024;

#[derive(Debug, Clone, PartialEq)]
pub struct FileXfer {
    pub rel: String,
    pub size: u64,
    pub mode: u32,
    pub mtime_ns: i64,
    pub hash: [u8; 32],
    /// The destination has an older version worth diffing against (block delta).
    pub delta: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Parents first. Modes always include `u+rwx` so the sync can write inside; the real
    /// mode of such a directory is restored by a `SetAttr` in `final_attrs`.
    pub mkdirs: Vec<(String, u32)>,
    pub symlinks: Vec<(String, String)>,
    pub files: Vec<FileXfer>,
    /// Mode/mtime fixes of entries whose content is already right.
    pub attrs: Vec<(String, Option<u32>, Option<i64>)>,
    /// Modes of new directories that lack `u+rwx`, applied after everything else.
    pub final_attrs: Vec<(String, Option<u32>, Option<i64>)>,
    /// Files and symlinks to delete.
    pub delete_files: Vec<String>,
    /// Directories to delete, deepest first.
    pub delete_dirs: Vec<String>,
    /// Directory mtimes to restore at the end (changed directories and those whose mtime
    /// differs).
    pub dir_mtimes: Vec<(String, i64)>,
    /// Files and symlinks already identical.
    pub unchanged: u64,
    /// Source entries that could not be used (no hash), as `rel: reason`.
    pub errors: Vec<String>,
    /// Destination files changed since the last sync (or, with `safe`, differing on a first
    /// sync): left as they are.
    pub conflicts: Vec<Conflict>,
}

/// A destination file that someone else changed: the sync leaves it and reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Conflict {
    pub rel: String,
    pub source_hash: [u8; 32],
    pub dest_hash: [u8; 32],
}

impl Plan {
    /// Nothing to do at all (no staging session needed).
    pub fn is_empty(&self) -> bool {
        self.mkdirs.is_empty()
            && self.symlinks.is_empty()
            && self.files.is_empty()
            && self.attrs.is_empty()
            && self.final_attrs.is_empty()
            && self.delete_files.is_empty()
            && self.delete_dirs.is_empty()
            && self.dir_mtimes.is_empty()
    }

    /// The bytes of the files to send. [`plan`] checked that this sum fits (the sizes come
    /// from the other side's manifest), so it never wraps.
    pub fn bytes_total(&self) -> u64 {
        self.files
            .iter()
            .try_fold(0u64, |t, f| t.checked_add(f.size))
            .unwrap_or(u64::MAX)
    }

    /// One human line per action, for `--dry-run`.
    pub fn actions(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (rel, _) in &self.mkdirs {
            v.push(format!("mkdir   {rel}/"));
        }
        for f in &self.files {
            let how = if f.delta { "delta" } else { "send " };
            v.push(format!("{how}   {} ({} B)", f.rel, f.size));
        }
        for (rel, t) in &self.symlinks {
            v.push(format!("symlink {rel} -> {t}"));
        }
        for (rel, mode, mtime) in &self.attrs {
            let mut what = Vec::new();
            if let Some(m) = mode {
                what.push(format!("mode {m:o}"));
            }
            if mtime.is_some() {
                what.push("mtime".to_string());
            }
            v.push(format!("attrs   {rel} ({})", what.join(", ")));
        }
        for rel in &self.delete_files {
            v.push(format!("delete  {rel}"));
        }
        for rel in &self.delete_dirs {
            v.push(format!("delete  {rel}/"));
        }
        v
    }
}

#[derive(Debug, Clone, Default)]
pub struct PlanOptions {
    pub delete_extras: bool,
    /// Source paths that could not be read (from the manifest's errors): nothing at or under
    /// them is deleted on the destination.
    pub unreadable: Vec<String>,
    /// Shown in errors for the destination root.
    pub dest_name: String,
    /// The user confirmed a delete the guard would refuse (more than half the destination).
    pub confirm_delete: bool,
    /// The last-synced content (`rel` → blake3) of this pair of roots, when there is one.
    pub baseline: Option<std::sync::Arc<std::collections::HashMap<String, [u8; 32]>>>,
    /// Take the source's side of every conflict.
    pub overwrite: bool,
    /// Without a baseline, treat every differing destination file as a conflict.
    pub safe: bool,
}

/// The mass-delete guard refuses deleting more than this share of the destination's files…
pub const MASS_DELETE_SHARE: f64 = 0.5;
/// …when that is more than this many files (smaller trees are judged only by "every file").
pub const MASS_DELETE_MIN_FILES: usize = 20;

fn kind_word(k: FileKind) -> &'static str {
    match k {
        FileKind::File => "a file",
        FileKind::Dir => "a directory",
        FileKind::Symlink => "a symlink",
        _ => "a special file",
    }
}

fn parent(rel: &str) -> &str {
    rel.rsplit_once('/').map(|(p, _)| p).unwrap_or("")
}

fn touch(rel: &str, t: &mut BTreeSet<String>) {
    t.insert(parent(rel).to_string());
}

fn is_under(rel: &str, dir: &str) -> bool {
    dir.is_empty()
        || rel == dir
        || (rel.starts_with(dir) && rel.as_bytes().get(dir.len()) == Some(&b'/'))
}

/// Diff `src` against `dst` (both directory manifests, entries relative to their roots).
pub fn plan(src: &[ManifestEntry], dst: &[ManifestEntry], opts: &PlanOptions) -> Result<Plan> {
    let s: BTreeMap<&str, &ManifestEntry> = src
        .iter()
        .filter(|e| !e.rel.is_empty())
        .map(|e| (e.rel.as_str(), e))
        .collect();
    let d: BTreeMap<&str, &ManifestEntry> = dst
        .iter()
        .filter(|e| !e.rel.is_empty())
        .map(|e| (e.rel.as_str(), e))
        .collect();

    // Type conflicts first: nothing changes when any exists.
    let mut conflicts = Vec::new();
    for (rel, se) in &s {
        if let Some(de) = d.get(rel) {
            let clash = match (se.kind, de.kind) {
                (FileKind::Dir, FileKind::Dir) => false,
                (FileKind::Dir, _) | (_, FileKind::Dir) => true,
                _ => false,
            };
            if clash {
                conflicts.push(format!(
                    "{rel} is {} on the destination but {} on the source",
                    kind_word(de.kind),
                    kind_word(se.kind)
                ));
            }
        }
    }
    if !conflicts.is_empty() {
        let n = conflicts.len();
        let mut msg = conflicts.into_iter().take(5).collect::<Vec<_>>().join("; ");
        if n > 5 {
            msg.push_str(&format!("; and {} more", n - 5));
        }
        return Err(RsbError::invalid(
            format!("{msg}; nothing was changed"),
            "remove or rename the conflicting destination entries, then sync again",
        ));
    }

    let mut p = Plan::default();
    // Directories whose contents change (their mtime must be restored afterwards).
    let mut touched: BTreeSet<String> = BTreeSet::new();

    for (rel, se) in &s {
        let de = d.get(rel).copied();
        match se.kind {
            FileKind::Dir => match de {
                None => {
                    let mode = se.mode & 0o7777;
                    p.mkdirs.push((rel.to_string(), mode | 0o700));
                    if mode & 0o700 != 0o700 {
                        p.final_attrs.push((rel.to_string(), Some(mode), None));
                    }
                    touch(rel, &mut touched);
                    touched.insert(rel.to_string());
                }
                Some(de) => {
                    if de.mode & 0o7777 != se.mode & 0o7777 {
                        p.attrs
                            .push((rel.to_string(), Some(se.mode & 0o7777), None));
                    }
                }
            },
            FileKind::File => {
                let Some(hash) = se.hash else {
                    p.errors
                        .push(format!("{rel}: not hashed (unreadable?); skipped"));
                    continue;
                };
                match de {
                    Some(de) if de.kind == FileKind::File && de.hash == Some(hash) => {
                        let mode =
                            (de.mode & 0o7777 != se.mode & 0o7777).then_some(se.mode & 0o7777);
                        let mtime = (de.mtime_ns != se.mtime_ns).then_some(se.mtime_ns);
                        if mode.is_some() || mtime.is_some() {
                            p.attrs.push((rel.to_string(), mode, mtime));
                        }
                        p.unchanged += 1;
                    }
                    Some(de)
                        if de.kind == FileKind::File
                            && !opts.overwrite
                            && de.hash.is_some_and(|dh| match &opts.baseline {
                                Some(b) => b.get(*rel) != Some(&dh),
                                None => opts.safe,
                            }) =>
                    {
                        p.conflicts.push(Conflict {
                            rel: rel.to_string(),
                            source_hash: hash,
                            dest_hash: de.hash.unwrap_or_default(),
                        });
                    }
                    _ => {
                        let delta = matches!(de, Some(de) if de.kind == FileKind::File && de.size > 0)
                            && se.size >= DELTA_MIN_SIZE;
                        p.files.push(FileXfer {
                            rel: rel.to_string(),
                            size: se.size,
                            mode: se.mode & 0o7777,
                            mtime_ns: se.mtime_ns,
                            hash,
                            delta,
                        });
                        touch(rel, &mut touched);
                    }
                }
            }
            FileKind::Symlink => {
                let target = se.link_target.clone().unwrap_or_default();
                match de {
                    Some(de)
                        if de.kind == FileKind::Symlink
                            && de.link_target.as_deref() == Some(&target) =>
                    {
                        p.unchanged += 1;
                    }
                    _ => {
                        p.symlinks.push((rel.to_string(), target));
                        touch(rel, &mut touched);
                    }
                }
            }
            _ => {}
        }
    }

    if opts.delete_extras {
        let protected = |rel: &str| opts.unreadable.iter().any(|u| is_under(rel, u));
        let mut files = Vec::new();
        let mut dirs = Vec::new();
        for (rel, de) in d.iter().rev() {
            if s.contains_key(rel) || protected(rel) {
                continue;
            }
            touch(rel, &mut touched);
            if de.kind == FileKind::Dir {
                dirs.push(rel.to_string());
            } else {
                files.push(rel.to_string());
            }
        }
        let dest_files = d.values().filter(|e| e.kind != FileKind::Dir).count();
        let share = files.len() as f64 / dest_files.max(1) as f64;
        if !opts.confirm_delete
            && files.len() > MASS_DELETE_MIN_FILES
            && share > MASS_DELETE_SHARE
            && files.len() < dest_files
        {
            return Err(RsbError::invalid(
                format!(
                    "delete_extras would delete {} of the {dest_files} files of {} ({:.0} %); refusing, nothing was changed",
                    files.len(),
                    if opts.dest_name.is_empty() {
                        "the destination"
                    } else {
                        &opts.dest_name
                    },
                    share * 100.0
                ),
                "check local_path and remote_path (dry_run: true lists the deletes); pass confirm_delete: true (CLI --confirm-delete) if that is intended",
            ));
        }
        if dest_files > 0 && files.len() == dest_files {
            return Err(RsbError::invalid(
                format!(
                    "delete_extras would delete every file of {} ({dest_files} files); refusing, nothing was changed",
                    if opts.dest_name.is_empty() {
                        "the destination"
                    } else {
                        &opts.dest_name
                    }
                ),
                "check local_path and remote_path; if emptying the destination is intended, delete its files first (exec_bash), then sync",
            ));
        }
        // Reverse order puts every child before its parent.
        p.delete_files = files;
        p.delete_dirs = dirs;
    }

    // Restore the mtime of every source directory that changed or whose mtime differs.
    for (rel, se) in &s {
        if se.kind != FileKind::Dir {
            continue;
        }
        let differs = d.get(rel).is_none_or(|de| de.mtime_ns != se.mtime_ns);
        if differs || touched.contains(*rel) {
            p.dir_mtimes.push((rel.to_string(), se.mtime_ns));
        }
    }
    check_sizes(&p)?;
    Ok(p)
}

/// Sizes come from the other side's manifest: a file larger than any file system allows
/// (`off_t` is signed), or sizes whose sum does not fit, mean an agent that is broken or
/// hostile, and the sync stops before any arithmetic on them can wrap.
fn check_sizes(p: &Plan) -> Result<()> {
    let mut total = 0u64;
    for f in &p.files {
        let fits = i64::try_from(f.size).is_ok();
        match total.checked_add(f.size).filter(|_| fits) {
            Some(t) => total = t,
            None => {
                return Err(RsbError::invalid(
                    format!(
                        "the source's manifest claims {} is {} bytes, which no file system holds (or a total past 2^64 bytes); nothing was changed",
                        f.rel, f.size
                    ),
                    "the agent on that side is broken or tampered with: check that machine, then sync again",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(rel: &str, content: &str) -> ManifestEntry {
        ManifestEntry {
            rel: rel.into(),
            kind: FileKind::File,
            size: content.len() as u64,
            mtime_ns: 1_000,
            mode: 0o644,
            link_target: None,
            hash: Some(*blake3::hash(content.as_bytes()).as_bytes()),
        }
    }
    fn dir(rel: &str) -> ManifestEntry {
        ManifestEntry {
            rel: rel.into(),
            kind: FileKind::Dir,
            size: 0,
            mtime_ns: 5_000,
            mode: 0o755,
            link_target: None,
            hash: None,
        }
    }
    fn link(rel: &str, t: &str) -> ManifestEntry {
        ManifestEntry {
            rel: rel.into(),
            kind: FileKind::Symlink,
            size: t.len() as u64,
            mtime_ns: 1_000,
            mode: 0o777,
            link_target: Some(t.into()),
            hash: None,
        }
    }
    #[test]
    fn mass_delete_is_judged_by_share() {
        let src = vec![f("keep", "k")];
        let mut dst = vec![f("keep", "k")];
        for i in 0..30 {
            dst.push(f(&format!("x{i}"), "x"));
        }
        let e = plan(&src, &dst, &opts(true)).unwrap_err();
        assert!(
            e.message.contains("would delete 30 of the 31 files"),
            "{}",
            e.message
        );
        let ok = PlanOptions {
            delete_extras: true,
            confirm_delete: true,
            ..Default::default()
        };
        assert_eq!(plan(&src, &dst, &ok).unwrap().delete_files.len(), 30);
    }

    #[test]
    fn sizes_that_overflow_are_refused_not_summed() {
        let mut a = f("a", "x");
        let mut b = f("b", "y");
        a.size = u64::MAX / 2 + 1;
        b.size = u64::MAX / 2 + 1;
        let e = plan(&[a.clone(), b], &[], &PlanOptions::default()).unwrap_err();
        assert!(e.message.contains("no file system holds"), "{}", e.message);
        a.size = i64::MAX as u64;
        let p = plan(&[a.clone()], &[], &PlanOptions::default()).unwrap();
        assert_eq!(p.bytes_total(), i64::MAX as u64);
        // Each size possible, their sum not.
        let (mut c, mut d) = (f("c", "z"), f("d", "w"));
        c.size = i64::MAX as u64;
        d.size = i64::MAX as u64;
        let e = plan(&[a, c, d], &[], &PlanOptions::default()).unwrap_err();
        assert!(e.message.contains("past 2^64"), "{}", e.message);
    }

    #[test]
    fn changed_destination_files_are_conflicts() {
        let src = vec![f("a", "new"), f("b", "new")];
        let dst = vec![f("a", "theirs"), f("b", "old")];
        let base: std::collections::HashMap<String, [u8; 32]> = [
            ("a".to_string(), *blake3::hash(b"old").as_bytes()),
            ("b".to_string(), *blake3::hash(b"old").as_bytes()),
        ]
        .into();
        let o = PlanOptions {
            baseline: Some(std::sync::Arc::new(base)),
            ..Default::default()
        };
        let p = plan(&src, &dst, &o).unwrap();
        assert_eq!(p.conflicts.len(), 1);
        assert_eq!(p.conflicts[0].rel, "a");
        assert_eq!(p.files.len(), 1);
        assert_eq!(p.files[0].rel, "b");
        let p = plan(
            &src,
            &dst,
            &PlanOptions {
                overwrite: true,
                ..o
            },
        )
        .unwrap();
        assert!(p.conflicts.is_empty() && p.files.len() == 2);
        // First sync: conflicts only with `safe`.
        assert_eq!(
            plan(&src, &dst, &PlanOptions::default())
                .unwrap()
                .files
                .len(),
            2
        );
        let safe = PlanOptions {
            safe: true,
            ..Default::default()
        };
        assert_eq!(plan(&src, &dst, &safe).unwrap().conflicts.len(), 2);
    }

    fn opts(delete: bool) -> PlanOptions {
        PlanOptions {
            delete_extras: delete,
            ..Default::default()
        }
    }

    #[test]
    fn identical_trees_plan_nothing() {
        let t = vec![dir("a"), f("a/x", "1"), link("l", "a/x"), f("y", "2")];
        let p = plan(&t, &t, &opts(true)).unwrap();
        assert!(p.is_empty(), "{p:?}");
        assert_eq!(p.unchanged, 3);
    }

    #[test]
    fn new_changed_attrs_and_links() {
        let src = vec![
            dir("a"),
            dir("a/b"),
            f("a/b/x", "new"),
            f("y", "same"),
            link("l", "y"),
        ];
        let mut y = f("y", "same");
        y.mode = 0o755;
        y.mtime_ns = 9;
        let dst = vec![dir("a"), y, link("l", "elsewhere")];
        let p = plan(&src, &dst, &opts(false)).unwrap();
        assert_eq!(p.mkdirs, vec![("a/b".to_string(), 0o755)]);
        assert_eq!(p.files.len(), 1);
        assert_eq!(p.files[0].rel, "a/b/x");
        assert!(!p.files[0].delta);
        assert_eq!(p.attrs, vec![("y".to_string(), Some(0o644), Some(1_000))]);
        assert_eq!(p.symlinks, vec![("l".to_string(), "y".to_string())]);
        // a is touched (a/b created inside it), a/b is new.
        let dm: Vec<&str> = p.dir_mtimes.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(dm, vec!["a", "a/b"]);
    }

    #[test]
    fn conflicts_fail_before_anything() {
        let src = vec![dir("x"), f("y", "1")];
        let dst = vec![f("x", "1"), dir("y")];
        let e = plan(&src, &dst, &opts(false)).unwrap_err();
        assert!(
            e.message
                .contains("x is a file on the destination but a directory on the source"),
            "{}",
            e.message
        );
        assert!(
            e.message
                .contains("y is a directory on the destination but a file on the source"),
            "{}",
            e.message
        );
    }

    #[test]
    fn deletes_deepest_first_and_guard() {
        let src = vec![f("keep", "k")];
        let dst = vec![
            f("keep", "k"),
            dir("old"),
            dir("old/deep"),
            f("old/deep/z", "z"),
            f("old/a", "a"),
        ];
        let p = plan(&src, &dst, &opts(true)).unwrap();
        assert_eq!(p.delete_files, vec!["old/deep/z", "old/a"]);
        assert_eq!(p.delete_dirs, vec!["old/deep", "old"]);
        // Without delete_extras nothing is deleted.
        let p = plan(&src, &dst, &opts(false)).unwrap();
        assert!(p.delete_files.is_empty() && p.delete_dirs.is_empty());
        // Deleting every destination file is refused.
        let src = vec![f("new", "n")];
        let e = plan(&src, &dst, &opts(true)).unwrap_err();
        assert!(
            e.message.contains("would delete every file"),
            "{}",
            e.message
        );
        // An empty destination is not "every file".
        assert!(plan(&src, &[dir("d")], &opts(true)).is_ok());
    }

    #[test]
    fn unreadable_source_dirs_protect_their_destination() {
        let src = vec![f("k", "k"), dir("locked")];
        let dst = vec![
            f("k", "k"),
            dir("locked"),
            f("locked/a", "a"),
            f("gone", "g"),
        ];
        let mut o = opts(true);
        o.unreadable = vec!["locked".into()];
        let p = plan(&src, &dst, &o).unwrap();
        assert_eq!(p.delete_files, vec!["gone"]);
    }

    #[test]
    fn big_changed_files_are_deltas_and_readonly_dirs_stay_writable() {
        let mut big = f("big", "x");
        big.size = DELTA_MIN_SIZE;
        let mut old = f("big", "y");
        old.size = DELTA_MIN_SIZE;
        let mut ro = dir("ro");
        ro.mode = 0o555;
        let p = plan(&[big, ro], &[old], &opts(false)).unwrap();
        assert!(p.files[0].delta);
        assert_eq!(p.mkdirs, vec![("ro".to_string(), 0o755)]);
        assert_eq!(p.final_attrs, vec![("ro".to_string(), Some(0o555), None)]);
    }

    #[test]
    fn a_symlink_replaces_a_file_and_back() {
        let p = plan(
            &[link("a", "t"), f("b", "1")],
            &[f("a", "1"), link("b", "t")],
            &opts(false),
        )
        .unwrap();
        assert_eq!(p.symlinks.len(), 1);
        assert_eq!(p.files.len(), 1);
    }
}
