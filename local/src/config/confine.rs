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
    /// `"any"` (the default), `"none"`, or the TCP ports a command may connect to and bind
    /// (`["443", "22"]`, numbers or strings).
    #[serde(default, skip_serializing_if = "Net::is_any")]
    pub net: Net,
    #[serde(default = "required")]
    pub require: bool,
}

/// What network a confined command may use.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Net {
    /// `"any"` or `"none"`.
    #[default]
    #[serde(skip)]
    Any,
    Word(String),
    Ports(Vec<Port>),
}

/// A port, written as a number or a string.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Port {
    Number(u64),
    Text(String),
}

impl Net {
    fn is_any(&self) -> bool {
        matches!(self, Net::Any) || matches!(self, Net::Word(w) if w == "any")
    }

    /// As the agent takes it: `None` any, `Some([])` none, else the ports.
    fn ports(&self, label: &str) -> Result<Option<Vec<u16>>, ConfigError> {
        let bad = |what: String| {
            ConfigError::new(
                format!("{label}: confine.net {what}"),
                "Write net = \"any\", \"none\", or a list of TCP ports such as [\"443\", \"22\"].",
            )
        };
        match self {
            Net::Any => Ok(None),
            Net::Word(w) if w == "any" => Ok(None),
            Net::Word(w) if w == "none" => Ok(Some(Vec::new())),
            Net::Word(w) => Err(bad(format!("is {w:?}, not \"any\" or \"none\""))),
            Net::Ports(ports) => ports
                .iter()
                .map(|p| {
                    let n = match p {
                        Port::Number(n) => Some(*n),
                        Port::Text(t) => t.trim().parse().ok(),
                    };
                    n.filter(|n| (1..=65535).contains(n))
                        .map(|n| n as u16)
                        .ok_or_else(|| bad(format!("has {p:?}, not a port between 1 and 65535")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
        }
    }
}

fn required() -> bool {
    true
}

impl ConfineRules {
    /// Every root is a usable path: `~`, `~/…` or absolute, with no NUL or newline.
    pub(super) fn check(&self, label: &str) -> Result<(), ConfigError> {
        self.net.ports(label)?;
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
            // Checked when the configuration loaded.
            net: self.net.ports("").unwrap_or(Some(Vec::new())),
            require: self.require,
        }
    }
}
