//! Passwords and passphrases: a type that never prints them, the two ways an entry may give
//! one (literally, or by naming an environment variable), and the refusal of a literal one in
//! a file others can read.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Deserializer};

use super::ConfigError;
use super::fields::{Loose, Text, Want};

/// A credential. Never printed (Debug/Display show `***`), never serialized.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub(super) String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// A secret given literally: kept exactly (not trimmed); empty is `None`.
#[derive(Default)]
pub(super) struct SecretText(pub(super) Option<Secret>);

impl<'de> Deserialize<'de> for SecretText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SecretText, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(SecretText(None)),
            Loose::Str(s) if s.is_empty() => Ok(SecretText(None)),
            Loose::Str(s) => Ok(SecretText(Some(Secret(s)))),
            _ => Err(Want::Text.error()),
        }
    }
}

/// A secret given literally (`direct`) or by naming an environment variable (`by_env`).
pub(super) fn resolve_secret(
    direct: SecretText,
    by_env: Text,
    field: &str,
    label: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Secret>, ConfigError> {
    let env_field = format!("{field}_env");
    match (direct.0, by_env.0) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            format!("{label} sets both '{field}' and '{env_field}'"),
            format!("Keep one: '{env_field}' names an environment variable holding the value."),
        )),
        (Some(v), None) => Ok(Some(v)),
        (None, Some(var)) => match env(&var).filter(|v| !v.is_empty()) {
            Some(v) => Ok(Some(Secret(v))),
            None => Err(ConfigError::new(
                format!(
                    "{label} field '{env_field}' names the environment variable {var}, which is not set"
                ),
                format!(
                    "Export {var} in the environment rsb starts with, or remove '{env_field}'."
                ),
            )),
        },
        (None, None) => Ok(None),
    }
}

/// True when group/other have any permission bit on the file.
#[cfg(unix)]
pub(super) fn readable_by_others(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then_some(mode)
}

#[cfg(not(unix))]
pub(super) fn readable_by_others(_path: &Path) -> Option<u32> {
    None
}

#[cfg(test)]
mod tests {
    use crate::config::Auth;

    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn secret_never_prints() {
        let s = Secret::new(SECRET);
        assert_eq!(format!("{s}"), "***");
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(s.expose(), SECRET);
        let a = Auth::KeyFile {
            path: "/k".into(),
            passphrase: Some(s),
        };
        assert!(!format!("{a:?}").contains(SECRET));
    }

    #[test]
    fn toml_env_reference_unset() {
        let home = TempDir::new();
        let file = home.write(
            "c.toml",
            "[[sandbox]]\nhost = \"h\"\nuser = \"u\"\npassword_env = \"NOPE_VAR\"\n",
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message.contains("NOPE_VAR") && e.message.contains("not set"),
            "{}",
            e.message
        );
    }
}
