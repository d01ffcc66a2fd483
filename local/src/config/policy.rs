//! The `[policy]` rules as configured: the file's top-level table and each sandbox's
//! `policy`, plus `RSB_POLICY_DENY` / `RSB_POLICY_ASK` for a server whose sandboxes come
//! from the environment. Matching them is `crate::policy`'s; this only reads and checks.

use serde::Deserialize;

use super::ConfigError;

/// `deny`: never run; `ask`: run only once the user approves. Both lists of rules such as
/// `"rm -rf /*"` or `"shutdown*"`; `ask_actions`: rsb's own destructive operations that also
/// need the user's approval. All empty (the default) is no policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyRules {
    pub deny: Vec<String>,
    pub ask: Vec<String>,
    pub ask_actions: Vec<Action>,
}

/// A destructive operation of rsb itself (not a command the agent wrote) that a policy can
/// put behind an approval. A name that is not one of these is a configuration error, so a
/// misspelt guard never silently guards nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A sync with `delete_extras` (CLI `--delete`) that would delete destination entries.
    DeleteExtras,
    /// `kill_background_task` / `rsb jobs kill` (a Slurm job's `scancel` too).
    Kill,
    /// A sync with `overwrite` (CLI `--force`) that would replace conflicting files, edits
    /// made on the destination since the last sync.
    Overwrite,
}

impl Action {
    /// As written in the configuration, and in audit lines.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::DeleteExtras => "delete_extras",
            Action::Kill => "kill",
            Action::Overwrite => "overwrite",
        }
    }
}

impl PolicyRules {
    pub fn is_empty(&self) -> bool {
        self.deny.is_empty() && self.ask.is_empty() && self.ask_actions.is_empty()
    }

    /// `self` followed by `more` (rules only ever add up: a sandbox cannot drop a global one).
    pub fn extend(&mut self, more: PolicyRules) {
        self.deny.extend(more.deny);
        self.ask.extend(more.ask);
        self.ask_actions.extend(more.ask_actions);
    }
}

pub const DENY_VAR: &str = "RSB_POLICY_DENY";
pub const ASK_VAR: &str = "RSB_POLICY_ASK";
pub const ASK_ACTIONS_VAR: &str = "RSB_POLICY_ASK_ACTIONS";

/// The global rules the environment adds: each variable a JSON array of strings. A value
/// that does not parse is an error, not a warning: a guard that silently vanished would be
/// worse than a server that says why it cannot start.
pub(super) fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<PolicyRules, ConfigError> {
    let list = |var: &str| -> Result<Vec<String>, ConfigError> {
        match env(var).filter(|v| !v.trim().is_empty()) {
            None => Ok(Vec::new()),
            Some(v) => serde_json::from_str::<Vec<String>>(&v).map_err(|_| {
                ConfigError::new(
                    format!("{var} must be a JSON array of strings"),
                    format!(r#"For example {var}='["rm -rf /*", "shutdown*"]'."#),
                )
            }),
        }
    };
    let ask_actions = match env(ASK_ACTIONS_VAR).filter(|v| !v.trim().is_empty()) {
        None => Vec::new(),
        Some(v) => serde_json::from_str::<Vec<Action>>(&v).map_err(|_| {
            ConfigError::new(
                format!("{ASK_ACTIONS_VAR} must be a JSON array of delete_extras, kill, overwrite"),
                format!(r#"For example {ASK_ACTIONS_VAR}='["delete_extras", "kill"]'."#),
            )
        })?,
    };
    Ok(PolicyRules {
        deny: list(DENY_VAR)?,
        ask: list(ASK_VAR)?,
        ask_actions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_lists_are_json_arrays() {
        let env = |k: &str| match k {
            DENY_VAR => Some(r#"["rm -rf /*", "mkfs*"]"#.to_string()),
            ASK_VAR => Some("  ".to_string()),
            _ => None,
        };
        let r = from_env(&env).unwrap();
        assert_eq!(r.deny, ["rm -rf /*", "mkfs*"]);
        assert!(r.ask.is_empty());
        let bad = |k: &str| (k == ASK_VAR).then(|| "rm".to_string());
        let e = from_env(&bad).unwrap_err();
        assert!(e.message.contains(ASK_VAR), "{}", e.message);
    }

    #[test]
    fn ask_actions_are_known_names_only() {
        let env = |k: &str| (k == ASK_ACTIONS_VAR).then(|| r#"["kill","overwrite"]"#.to_string());
        let r = from_env(&env).unwrap();
        assert_eq!(r.ask_actions, [Action::Kill, Action::Overwrite]);
        assert!(!r.is_empty(), "actions alone are a policy");
        let typo = |k: &str| (k == ASK_ACTIONS_VAR).then(|| r#"["delete"]"#.to_string());
        let e = from_env(&typo).unwrap_err();
        assert!(
            e.message.contains("delete_extras, kill, overwrite"),
            "{}",
            e.message
        );
        let toml: PolicyRules = toml::from_str(r#"ask_actions = ["delete_extras"]"#).unwrap();
        assert_eq!(toml.ask_actions, [Action::DeleteExtras]);
        let e = toml::from_str::<PolicyRules>(r#"ask_actions = ["kil"]"#).unwrap_err();
        assert!(e.to_string().contains("kill"), "{e}");
    }
}
