//! The `[policy]` rules as configured: the file's top-level table and each sandbox's
//! `policy`, plus `RSB_POLICY_DENY` / `RSB_POLICY_ASK` for a server whose sandboxes come
//! from the environment. Matching them is `crate::policy`'s; this only reads and checks.

use serde::Deserialize;

use super::ConfigError;

/// `deny`: never run; `ask`: run only once the user approves. Both lists of rules such as
/// `"rm -rf /*"` or `"shutdown*"`; empty (the default) is no policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyRules {
    pub deny: Vec<String>,
    pub ask: Vec<String>,
}

impl PolicyRules {
    pub fn is_empty(&self) -> bool {
        self.deny.is_empty() && self.ask.is_empty()
    }

    /// `self` followed by `more` (rules only ever add up: a sandbox cannot drop a global one).
    pub fn extend(&mut self, more: PolicyRules) {
        self.deny.extend(more.deny);
        self.ask.extend(more.ask);
    }
}

pub const DENY_VAR: &str = "RSB_POLICY_DENY";
pub const ASK_VAR: &str = "RSB_POLICY_ASK";

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
    Ok(PolicyRules {
        deny: list(DENY_VAR)?,
        ask: list(ASK_VAR)?,
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
}
