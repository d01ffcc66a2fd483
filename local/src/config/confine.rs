//! `confine`: the kernel as the boundary. The file's top-level `[confine]` table applies to
//! every sandbox; a sandbox's own `confine = { ... }` replaces it whole. Applying it is the
//! agent's (Landlock, in the command's process before exec); this only reads and checks.

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// What a confined command may change. `write`: the only trees (or files) it may create,
/// change, rename or delete in (`~` is the remote home; absolute otherwise); everything else
/// stays readable and executable. `require` (default true): a host that cannot confine
/// refuses to run the command; false runs it unconfined and each reply says so.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfineRules {
    pub write: Vec<String>,
    #[serde(default = "required")]
    pub require: bool,
}

fn required() -> bool {
    true
}

impl ConfineRules {
    /// Every root is a usable path: `~`, `~/…` or absolute, with no NUL or newline.
    pub(super) fn check(&self, label: &str) -> Result<(), ConfigError> {
        for w in &self.write {
            let ok = (w == "~" || w.starts_with("~/") || w.starts_with('/'))
                && !w.contains(['\0', '\n']);
            if !ok {
                return Err(ConfigError::new(
                    format!("{label}: confine.write entry {w:?} is not an absolute or ~ path"),
                    "Write each root as \"~/work\" or \"/scratch/me\"; a relative path has no fixed meaning on the host.",
                ));
            }
        }
        Ok(())
    }

    /// As the agent takes it.
    pub fn request(&self) -> rsb_protocol::Confine {
        rsb_protocol::Confine {
            write: self.write.clone(),
            require: self.require,
        }
    }
}
