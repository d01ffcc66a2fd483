//! The process's own environment and places, read once here: its variables, the user's home
//! and rsb's platform directories. Everything else takes them as arguments (a `BuildCtx`, an
//! `env` function), so tests can give their own.

use std::path::PathBuf;

pub(super) fn project_dirs() -> Option<directories::ProjectDirs> {
    directories::ProjectDirs::from("", "", "rsb")
}

pub(super) fn real_home() -> Option<PathBuf> {
    directories::BaseDirs::new()
        .map(|b| b.home_dir().to_path_buf())
        .or_else(|| std::env::var_os("HOME").map(PathBuf::from))
}

pub(super) fn real_env(key: &str) -> Option<String> {
    std::env::var(key).ok()
}
