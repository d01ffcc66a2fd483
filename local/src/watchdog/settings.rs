//! What the user allows, as opposed to what a model asks for.
//!
//! `event_command` and `codex_command` run on the user's own machine, and `webhook_url` sends
//! log tails and checkpoints wherever it points: from a tool call they are local code execution
//! and data exfiltration. A tool call may set them only when the server was started with
//! `RSB_ALLOW_WATCH_HOOKS=1`. The user's own config file may always set them, in its
//! `[watchdog]` table; those apply to every watch:
//!
//! ```toml
//! [watchdog]
//! webhook_url = "https://hooks.slack.com/services/…"   # every event
//! webhook_format = "slack"                     # json (default), slack, discord or ntfy
//! event_command = "notify-me \"$RSMCP_EVENT_TYPE\""
//! hook_timeout_s = 30                          # webhook and event_command deadline
//! notify_local = true                          # desktop notifications (default on)
//! ```

use std::time::Duration;

use serde::Deserialize;

pub const ALLOW_HOOKS_VAR: &str = "RSB_ALLOW_WATCH_HOOKS";
pub const DEFAULT_HOOK_TIMEOUT: Duration = Duration::from_secs(30);

pub use crate::config::env_truthy;
/// The secrets opt-in belongs to the store that keeps them; named here for the watchdog's
/// callers.
pub use crate::store::sandboxes::{STORE_PASSWORDS_VAR, store_passwords};

pub fn hooks_allowed() -> bool {
    env_truthy(ALLOW_HOOKS_VAR)
}

/// What a webhook's body is: rsb's event as JSON, a chat message (Slack's `{"text"}`, which
/// Mattermost and Rocket.Chat take too; Discord's `{"content"}`), or an ntfy notification
/// (plain text, with a `Title` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    Json,
    Slack,
    Discord,
    Ntfy,
}

impl WebhookFormat {
    /// The format a URL's well-known host speaks; rsb's JSON for any other.
    pub fn for_url(url: &str) -> WebhookFormat {
        let rest = url
            .trim()
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        let host = rest
            .split(['/', '?', ':'])
            .next()
            .unwrap_or("")
            .to_ascii_lowercase();
        match host.as_str() {
            "hooks.slack.com" => WebhookFormat::Slack,
            "discord.com" | "discordapp.com" | "ptb.discord.com" | "canary.discord.com"
                if rest.contains("/api/webhooks/") =>
            {
                WebhookFormat::Discord
            }
            "ntfy.sh" => WebhookFormat::Ntfy,
            _ => WebhookFormat::Json,
        }
    }
}

/// The `[watchdog]` table of the user's config file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSettings {
    #[serde(default)]
    pub webhook_url: String,
    #[serde(default)]
    pub event_command: String,
    /// The body `webhook_url` gets; unset: guessed from the URL's host (Slack, Discord, ntfy.sh),
    /// else rsb's JSON event.
    #[serde(default)]
    pub webhook_format: Option<WebhookFormat>,
    #[serde(default)]
    pub hook_timeout_s: Option<u64>,
    #[serde(default)]
    pub notify_local: Option<bool>,
}

#[derive(Deserialize)]
struct Top {
    #[serde(default)]
    watchdog: Option<FileSettings>,
}

impl FileSettings {
    /// The table from `crate::config::config_file_path()`; absent file or table = defaults.
    /// Errors name the file and line, never the text (it may hold secrets).
    pub fn load() -> Result<FileSettings, String> {
        Self::load_from(&crate::config::config_file_path())
    }

    pub fn load_from(path: &std::path::Path) -> Result<FileSettings, String> {
        let src = match std::fs::read_to_string(path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(format!("cannot read {}: {}", path.display(), e.kind())),
        };
        match toml::from_str::<Top>(&src) {
            Ok(t) => Ok(t.watchdog.unwrap_or_default()),
            Err(e) => {
                let line = e
                    .span()
                    .map(|s| {
                        src.as_bytes()[..s.start.min(src.len())]
                            .iter()
                            .filter(|b| **b == b'\n')
                            .count()
                            + 1
                    })
                    .unwrap_or(0);
                Err(format!(
                    "config file {}: the [watchdog] table is invalid (line {line}); its keys are \
                     webhook_url, webhook_format (json, slack, discord, ntfy), event_command, \
                     hook_timeout_s, notify_local",
                    path.display()
                ))
            }
        }
    }

    pub fn hook_timeout(&self) -> Option<Duration> {
        self.hook_timeout_s
            .filter(|s| *s > 0)
            .map(|s| Duration::from_secs(s.min(3600)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_table_is_read_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("config.toml");
        assert_eq!(
            FileSettings::load_from(&p).unwrap(),
            FileSettings::default()
        );
        std::fs::write(
            &p,
            "host_key_policy = \"strict\"\n[watchdog]\nwebhook_url = \"http://127.0.0.1:1/x\"\nhook_timeout_s = 2\n",
        )
        .unwrap();
        let s = FileSettings::load_from(&p).unwrap();
        assert_eq!(s.webhook_url, "http://127.0.0.1:1/x");
        assert_eq!(s.hook_timeout(), Some(Duration::from_secs(2)));
        std::fs::write(&p, "[watchdog]\npassword = \"S3cr3t\"\n").unwrap();
        let e = FileSettings::load_from(&p).unwrap_err();
        assert!(e.contains("(line ") && !e.contains("S3cr3t"), "{e}");
        std::fs::write(&p, "[watchdog]\nwebhook_format = \"ntfy\"\n").unwrap();
        let s = FileSettings::load_from(&p).unwrap();
        assert_eq!(s.webhook_format, Some(WebhookFormat::Ntfy));
        std::fs::write(&p, "[watchdog]\nwebhook_format = \"teams\"\n").unwrap();
        let e = FileSettings::load_from(&p).unwrap_err();
        assert!(e.contains("json, slack, discord, ntfy"), "{e}");
    }
}
