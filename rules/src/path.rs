//! Reading paths as the user meant them, without a shell: only a leading `~` or `~/` means the
//! home directory (never `~user`, never `$VAR`), because paths arrive as data and must never be
//! re-parsed by a shell on either side.

use std::path::{Component, Path, PathBuf};

/// Does `p` start with the home directory (`~` alone or `~/…`)? Lets a caller look the home
/// directory up, or report that it is unknown, only when it is needed.
pub fn starts_with_tilde(p: &str) -> bool {
    p == "~" || p.starts_with("~/")
}

/// A leading `~` or `~/` replaced by `home`; anything else is returned as given. Slashes after
/// `~/` are dropped so that `~//etc` stays under `home` instead of joining as `/etc`.
pub fn expand_tilde(p: &str, home: &Path) -> PathBuf {
    if !starts_with_tilde(p) {
        return PathBuf::from(p);
    }
    let rest = p[1..].trim_start_matches('/');
    if rest.is_empty() {
        home.to_path_buf()
    } else {
        home.join(rest)
    }
}

/// Lexical normalisation: `.` dropped, `..` pops the previous component. Nothing touches the
/// file system: the path may not exist yet, and resolving symlinks would report a different
/// path than the one asked for. `..` never climbs above `/`; a relative path keeps the `..`
/// components it cannot pop (`../a/../..` is `../..`). `.` alone normalises to an empty path.
pub fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    // Named components in `out` that a `..` may pop (not the root, not a kept `..`).
    let mut depth = 0usize;
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if depth > 0 {
                    out.pop();
                    depth -= 1;
                } else if !out.has_root() {
                    out.push("..");
                }
            }
            Component::RootDir | Component::Prefix(_) => out.push(c.as_os_str()),
            Component::Normal(n) => {
                out.push(n);
                depth += 1;
            }
        }
    }
    out
}

/// A remote path anchored where the seed resolved it: at the remote `$HOME`, not wherever the
/// agent process happens to run. `x` and `./x` become `~/x`; empty and `.` become `~`; absolute
/// and `~` paths are kept.
pub fn anchor_home(p: &str) -> String {
    let t = p.trim();
    if t.is_empty() || t == "." || t == "./" {
        return "~".into();
    }
    if t.starts_with('/') || starts_with_tilde(t) {
        return t.to_string();
    }
    let mut rel = t;
    while let Some(r) = rel.strip_prefix("./") {
        rel = r;
    }
    format!("~/{rel}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_leading_tilde_is_the_home() {
        let home = Path::new("/home/u");
        assert_eq!(expand_tilde("~", home), home);
        assert_eq!(expand_tilde("~/", home), home);
        assert_eq!(expand_tilde("~/a/b", home), home.join("a/b"));
        assert_eq!(expand_tilde("~//etc", home), home.join("etc"));
        for kept in ["~user/x", "~user", "/x/~/y", "$HOME/x", "rel", "", "a~"] {
            assert_eq!(expand_tilde(kept, home), PathBuf::from(kept), "{kept:?}");
            assert!(!starts_with_tilde(kept), "{kept:?}");
        }
        assert!(starts_with_tilde("~") && starts_with_tilde("~/x"));
    }

    #[test]
    fn normalize_is_lexical() {
        for (given, want) in [
            ("/a/./b/../c", "/a/c"),
            ("/..", "/"),
            ("/../../x", "/x"),
            ("a/./b", "a/b"),
            ("a/..", ""),
            (".", ""),
            ("..", ".."),
            ("../a/../..", "../.."),
            ("a/../../b", "../b"),
            ("a/b/../../..", ".."),
            ("/home/u/proj/../logs/x.log", "/home/u/logs/x.log"),
            ("a//b/", "a/b"),
        ] {
            assert_eq!(
                normalize(Path::new(given)),
                PathBuf::from(want),
                "{given:?}"
            );
        }
    }

    #[test]
    fn remote_paths_anchor_at_home() {
        for (given, want) in [
            ("", "~"),
            (" . ", "~"),
            ("./", "~"),
            ("x", "~/x"),
            ("./././x/y", "~/x/y"),
            ("/abs", "/abs"),
            ("~", "~"),
            ("~/x", "~/x"),
            // Not the home directory: a relative name that happens to start with `~`.
            ("~user", "~/~user"),
        ] {
            assert_eq!(anchor_home(given), want, "{given:?}");
        }
    }
}
