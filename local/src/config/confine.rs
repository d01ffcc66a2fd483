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
    /// When given, what a confined command may read and execute besides the write roots and
    /// the system's own trees (`/usr`, `/etc`, …): the rest of the host, `~/.ssh` included, is
    /// out of its reach.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read: Option<Vec<String>>,
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

/// What confined reads reach, for a line that has said where writes go: empty when reads are
/// not confined.
pub fn reads_words(read: Option<&[String]>) -> String {
    match read {
        None => String::new(),
        Some(r) => {
            let mut all: Vec<&str> = r.iter().map(String::as_str).collect();
            all.extend(["the write roots", "the system's directories"]);
            format!("; commands and rsb read only under {}", all.join(", "))
        }
    }
}

fn required() -> bool {
    true
}

/// What a host serving Landlock `abi` enforces, in words (`rsb doctor`, `list_sandboxes`).
pub fn landlock_can(abi: u32) -> String {
    match abi {
        0 => "no Landlock".to_string(),
        1 => "Landlock ABI 1: files; no renames across directories".to_string(),
        2 | 3 => format!("Landlock ABI {abi}: files"),
        4 | 5 => format!("Landlock ABI {abi}: files, TCP ports"),
        _ => format!("Landlock ABI {abi}: files, TCP ports, scoping"),
    }
}

impl ConfineRules {
    /// Every root is a usable path: `~`, `~/…` or absolute, with no NUL or newline.
    pub(super) fn check(&self, label: &str) -> Result<(), ConfigError> {
        self.net.ports(label)?;
        let write = self.write.iter().map(|w| ("write", w));
        for (key, w) in write.chain(self.read.iter().flatten().map(|r| ("read", r))) {
            let ok = (w == "~" || w.starts_with("~/") || w.starts_with('/'))
                && !w.contains(['\0', '\n']);
            if !ok {
                return Err(ConfigError::new(
                    format!("{label}: confine.{key} entry {w:?} is not an absolute or ~ path"),
                    "Write each root as \"~/work\" or \"/scratch/me\"; a relative path has no fixed meaning on the host.",
                ));
            }
        }
        Ok(())
    }

    /// What of these rules a host serving Landlock `abi` cannot enforce (`None`: all of it).
    pub fn missing_on(&self, abi: u32) -> Option<&'static str> {
        if abi == 0 {
            Some("any confinement")
        } else if self.request().net.is_some() && abi < 4 {
            Some("confine.net (TCP rules need ABI 4, Linux 6.7)")
        } else {
            None
        }
    }

    /// One line for a listing: what is confined, and whether a host serving Landlock `abi`
    /// (`None`: not reached) enforces it.
    pub fn status_on(&self, abi: Option<u32>) -> String {
        let roots = if self.write.is_empty() {
            "nowhere".to_string()
        } else {
            format!("only under {}", self.write.join(", "))
        };
        let net = match self.request().net {
            None => String::new(),
            Some(p) if p.is_empty() => "; no TCP".to_string(),
            Some(p) => {
                let p: Vec<String> = p.iter().map(u16::to_string).collect();
                format!("; TCP ports {}", p.join(", "))
            }
        };
        let reads = reads_words(self.read.as_deref());
        let asked = format!("commands and rsb's writes change files {roots}{reads}{net}");
        let Some(abi) = abi else {
            return asked;
        };
        let can = landlock_can(abi);
        match self.missing_on(abi) {
            None => format!("{asked} ({can})"),
            Some(m) if self.require => {
                format!(
                    "{asked}; this host ({can}) cannot enforce {m}, so its commands are refused"
                )
            }
            Some(m) => format!(
                "{asked}; this host ({can}) cannot enforce {m}: commands run without it (require = false)"
            ),
        }
    }

    /// As the agent takes it.
    pub fn request(&self) -> rsb_protocol::Confine {
        rsb_protocol::Confine {
            write: self.write.clone(),
            read: self.read.clone(),
            // Checked when the configuration loaded.
            net: self.net.ports("").unwrap_or(Some(Vec::new())),
            require: self.require,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listing's line: the roots and ports, and what a host of each ABI does with them.
    #[test]
    fn status_says_what_is_confined_and_whether_the_host_enforces_it() {
        let rules = |net: Net, require: bool| ConfineRules {
            write: vec!["~/work".into(), "/tmp".into()],
            read: None,
            net,
            require,
        };
        let ports = Net::Ports(vec![Port::Text("443".into()), Port::Number(22)]);
        let cases = [
            (rules(Net::Any, true), None, "only under ~/work, /tmp", true),
            (
                rules(Net::Any, true),
                Some(7),
                "only under ~/work, /tmp (Landlock ABI 7: files, TCP ports, scoping)",
                true,
            ),
            (
                rules(ports.clone(), true),
                Some(4),
                "; TCP ports 443, 22 (Landlock ABI 4: files, TCP ports)",
                true,
            ),
            (
                rules(ports, true),
                Some(3),
                "cannot enforce confine.net (TCP rules need ABI 4, Linux 6.7), so its commands are refused",
                true,
            ),
            (
                rules(Net::Word("none".into()), false),
                Some(0),
                "; no TCP; this host (no Landlock) cannot enforce any confinement: commands run without it (require = false)",
                true,
            ),
            (rules(Net::Any, false), Some(2), "refused", false),
        ];
        for (r, abi, needle, present) in cases {
            let line = r.status_on(abi);
            assert_eq!(line.contains(needle), present, "{abi:?}: {line}");
            assert!(
                line.starts_with("commands and rsb's writes change files"),
                "{line}"
            );
        }
        let mut reads = rules(Net::Any, true);
        reads.read = Some(vec!["~/data".into()]);
        assert_eq!(
            reads.status_on(Some(6)),
            "commands and rsb's writes change files only under ~/work, /tmp; commands and rsb read only \
             under ~/data, the write roots, the system's directories (Landlock ABI 6: files, TCP \
             ports, scoping)"
        );
    }
}
