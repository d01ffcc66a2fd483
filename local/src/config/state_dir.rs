//! Where rsb keeps its state (the store, its own known_hosts, logs), and how that directory is
//! made private.

use std::path::{Path, PathBuf};

use rsb_rules::path::expand_tilde;

use super::env::{project_dirs, real_env, real_home};

/// rsb's own known_hosts in the state dir (after `~/.ssh/known_hosts`): the host keys it
/// learned under `accept-new`. Named here, below the store, because the SSH side reads it.
pub const KNOWN_HOSTS: &str = "known_hosts";

/// `RSB_STATE_DIR`, else the seed's `REMOTE_SANDBOX_MCP_HOME` (so a user moving from the Python
/// server keeps one place for state; rsb's files there do not collide with the seed's), else the
/// platform data dir for "rsb", else `~/.local/share/rsb`. Pure.
pub(super) fn resolve_state_dir(env: &dyn Fn(&str) -> Option<String>, home: &Path) -> PathBuf {
    for var in ["RSB_STATE_DIR", "REMOTE_SANDBOX_MCP_HOME"] {
        if let Some(dir) = env(var).filter(|s| !s.trim().is_empty()) {
            return expand_tilde(dir.trim(), home);
        }
    }
    project_dirs()
        .map(|p| p.data_dir().to_path_buf())
        .unwrap_or_else(|| home.join(".local").join("share").join("rsb"))
}

/// The state dir with no `RSB_STATE_DIR` / `REMOTE_SANDBOX_MCP_HOME`: what a process whose
/// environment lost those variables uses (an MCP client that passes only `HOME`, say).
pub fn default_state_dir() -> PathBuf {
    let home = real_home().unwrap_or_else(|| PathBuf::from("."));
    resolve_state_dir(&|_| None, &home)
}

/// The platform data dir for rsb (`RSB_STATE_DIR` overrides), created with mode 0700.
/// Creation errors are ignored here; [`Config::load`](super::Config::load) reports them.
pub fn state_dir() -> PathBuf {
    let home = real_home().unwrap_or_else(|| PathBuf::from("."));
    let dir = resolve_state_dir(&real_env, &home);
    let _ = ensure_private_dir(&dir);
    dir
}

/// Creates `dir` (and parents) 0700, tightening an existing one that others can read.
pub fn ensure_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mode = std::fs::metadata(dir)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn state_dir_override() {
        let home = TempDir::new();
        let c = load_with(&home, &[("RSB_STATE_DIR", "~/st")], None, None).unwrap();
        assert_eq!(c.state_dir, home.path().join("st"));
        assert!(
            !c.state_dir.exists(),
            "from_sources must not create anything"
        );
        let c = load_with(&home, &[("RSB_STATE_DIR", "")], None, None).unwrap();
        assert!(c.state_dir.ends_with("rsb"), "{}", c.state_dir.display());
        // The seed's variable is honoured; RSB_STATE_DIR still wins.
        let c = load_with(
            &home,
            &[("REMOTE_SANDBOX_MCP_HOME", "~/seed"), ("RSB_STATE_DIR", "")],
            None,
            None,
        )
        .unwrap();
        assert_eq!(c.state_dir, home.path().join("seed"));
        let c = load_with(
            &home,
            &[
                ("REMOTE_SANDBOX_MCP_HOME", "~/seed"),
                ("RSB_STATE_DIR", "/x"),
            ],
            None,
            None,
        )
        .unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/x"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let d = home.path().join("a/b");
            ensure_private_dir(&d).unwrap();
            assert_eq!(
                std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
                0o700
            );
        }
    }
}
