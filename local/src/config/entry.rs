//! One sandbox entry, whichever source wrote it: its fields, the types that check each value
//! without ever quoting it (a value may be a secret), and the rules that turn it into a
//! [`SandboxConfig`].

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use rsb_rules::path::expand_tilde;
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeOwned},
};

use super::PolicyRules;
use super::hops::{resolve_hop, unbracket};
use super::secrets::{SecretText, resolve_secret};
use super::slurm::{SlurmDefaults, slurm_defaults};
use super::ssh_config::host_key_settings;
use super::{
    Auth, BuildCtx, ConfigError, HostKeyPolicy, SandboxConfig, SshTarget, SudoPassword, Transport,
};

/// One sandbox entry as written, from `REMOTE_SANDBOX_LIST`, a `[[sandbox]]` table or the legacy
/// variables. serde checks the shape (and, for the TOML file, rejects unknown keys); each field's
/// type checks its own value and says what it must be in words of its own, because serde's
/// default messages quote the value (`invalid type: string "hunter2"`), which may be a secret.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub(super) struct Entry {
    pub(super) name: Text,
    pub(super) host: Text,
    pub(super) port: Port,
    pub(super) user: Text,
    pub(super) password: SecretText,
    pub(super) password_env: Text,
    pub(super) key_file: Text,
    pub(super) key_passphrase: SecretText,
    pub(super) key_passphrase_env: Text,
    pub(super) sudo_password_env: Text,
    pub(super) ssh_config_host: Text,
    pub(super) host_key_policy: Policy,
    pub(super) local: Flag,
    pub(super) connect_timeout_s: Seconds,
    pub(super) scheduler: Text,
    pub(super) slurm: Option<SlurmDefaults>,
    pub(super) policy: Option<PolicyRules>,
    pub(super) confine: Option<super::ConfineRules>,
}

/// What a field's value must be: the whole of a type error's text, so no character of the
/// value can reach a message.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Want {
    Text,
    Port,
    Policy,
    Flag,
    Seconds,
}

impl Want {
    const ALL: [Want; 5] = [
        Want::Text,
        Want::Port,
        Want::Policy,
        Want::Flag,
        Want::Seconds,
    ];

    fn what(self) -> &'static str {
        match self {
            Want::Text => "a string",
            Want::Port => "an integer between 1 and 65535",
            Want::Policy => "one of accept-new, strict, off",
            Want::Flag => "true or false",
            Want::Seconds => "a positive number of seconds",
        }
    }

    pub(super) fn error<E: de::Error>(self) -> E {
        E::custom(self.what())
    }

    /// The `Want` whose [`Want::error`] produced `message`, if any.
    fn of(message: &str) -> Option<Want> {
        Want::ALL.into_iter().find(|w| w.what() == message)
    }
}

/// Any value, reduced to what the field types need, without keeping text for errors.
pub(super) enum Loose {
    Absent,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Other,
}

impl<'de> Deserialize<'de> for Loose {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Loose, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Loose;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Loose, E> {
                Ok(Loose::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Loose, E> {
                Ok(Loose::Int(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Loose, E> {
                Ok(Loose::Int(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Loose, E> {
                Ok(Loose::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Loose, E> {
                Ok(Loose::Str(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Loose, E> {
                Ok(Loose::Str(v))
            }
            fn visit_bytes<E>(self, _: &[u8]) -> Result<Loose, E> {
                Ok(Loose::Other)
            }
            fn visit_none<E>(self) -> Result<Loose, E> {
                Ok(Loose::Absent)
            }
            fn visit_unit<E>(self) -> Result<Loose, E> {
                Ok(Loose::Absent)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Loose, D::Error> {
                Loose::deserialize(d)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                while a.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                while a.next_entry::<de::IgnoredAny, de::IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// A string, trimmed; absent, null and blank are `None`.
#[derive(Default)]
pub(super) struct Text(pub(super) Option<String>);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Text(None)),
            Loose::Str(s) => Ok(Text(Some(s.trim().to_string()).filter(|s| !s.is_empty()))),
            _ => Err(Want::Text.error()),
        }
    }
}

/// A port: an integer, an integral float or a numeric string; blank is `None`.
#[derive(Default)]
pub(super) struct Port(pub(super) Option<u16>);

impl<'de> Deserialize<'de> for Port {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Port, D::Error> {
        let port = match Loose::deserialize(d)? {
            Loose::Absent => return Ok(Port(None)),
            Loose::Str(s) if s.trim().is_empty() => return Ok(Port(None)),
            Loose::Str(s) => parse_port(&s),
            Loose::Int(n) => u16::try_from(n).ok(),
            Loose::Float(f) if f.fract() == 0.0 && (0.0..=65535.0).contains(&f) => Some(f as u16),
            _ => None,
        };
        match port.filter(|p| *p != 0) {
            Some(p) => Ok(Port(Some(p))),
            None => Err(Want::Port.error()),
        }
    }
}

/// `2222`, ` +2222 `; not 0.
pub(super) fn parse_port(s: &str) -> Option<u16> {
    let s = s.trim();
    s.strip_prefix('+')
        .unwrap_or(s)
        .parse()
        .ok()
        .filter(|p| *p != 0)
}

#[derive(Default)]
pub(super) struct Policy(pub(super) Option<HostKeyPolicy>);

impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Policy, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Policy(None)),
            Loose::Str(s) if s.trim().is_empty() => Ok(Policy(None)),
            Loose::Str(s) => HostKeyPolicy::parse(&s)
                .map(|p| Policy(Some(p)))
                .ok_or_else(|| Want::Policy.error()),
            _ => Err(Want::Policy.error()),
        }
    }
}

#[derive(Default)]
pub(super) struct Flag(pub(super) bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Flag, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Flag(false)),
            Loose::Bool(b) => Ok(Flag(b)),
            _ => Err(Want::Flag.error()),
        }
    }
}

/// Seconds, integral or not, in (0, 1 day].
#[derive(Default)]
pub(super) struct Seconds(pub(super) Option<Duration>);

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Seconds, D::Error> {
        let secs = match Loose::deserialize(d)? {
            Loose::Absent => return Ok(Seconds(None)),
            Loose::Int(n) => n as f64,
            Loose::Float(f) => f,
            _ => f64::NAN,
        };
        if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 {
            Ok(Seconds(Some(Duration::from_secs_f64(secs))))
        } else {
            Err(Want::Seconds.error())
        }
    }
}

/// The field names serde derived for `T`, read by asking `T` to deserialize itself from a
/// deserializer that only records them: the struct stays the one list of valid keys.
pub(super) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Names<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("field names recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut fields));
    fields
}

/// Where a deserialization failed (`sandbox[0]` and the field) and why, in words that never
/// include a value: the field's [`Want`], an unknown key (named only when it looks like a
/// name), or only the place. Returns the message and its hint; `keys_hint` lists valid keys.
pub(super) fn describe_de_error(
    path: &serde_path_to_error::Path,
    message: &str,
    keys_hint: &str,
) -> (String, String) {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let (field, parents) = match segments.split_last() {
        Some((Segment::Map { key }, parents)) => (Some(key.as_str()), parents),
        _ => (None, &segments[..]),
    };
    let mut place = String::new();
    for seg in parents {
        match seg {
            Segment::Seq { index } => place.push_str(&format!("[{index}]")),
            Segment::Map { key } => {
                if !place.is_empty() {
                    place.push('.');
                }
                place.push_str(key);
            }
            _ => {}
        }
    }
    let at = |what: String| {
        if place.is_empty() {
            what
        } else {
            format!("{place} {what}")
        }
    };
    let not_shown = "The value is not shown, to keep secrets out of logs.".to_string();
    if let Some(key) = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split('`').next())
    {
        let what = format!("unknown key {}", key_name(key));
        // The path ends at the unknown key itself, or at the table holding it.
        let msg = match field {
            Some(f) if f != key => at(format!("field '{f}' has {what}")),
            _ if place.is_empty() => what,
            _ => format!("{place} has {what}"),
        };
        return (msg, keys_hint.to_string());
    }
    let msg = match (field, Want::of(message)) {
        (Some(f), Some(want)) => at(format!("field '{f}' must be {}", want.what())),
        (Some(f), None) => at(format!("field '{f}' has a value of the wrong type")),
        (None, _) => at("must be a table".to_string()),
    };
    (msg, not_shown)
}

/// Turns a checked entry into a sandbox: `~/.ssh/config` resolution, auth choice, defaults.
pub(super) fn build_sandbox(
    e: Entry,
    label: &str,
    ctx: &mut BuildCtx<'_>,
) -> Result<SandboxConfig, ConfigError> {
    let password = resolve_secret(e.password, e.password_env, "password", label, ctx.env)?;
    let key_passphrase = resolve_secret(
        e.key_passphrase,
        e.key_passphrase_env,
        "key_passphrase",
        label,
        ctx.env,
    )?;
    let sudo_var = e.sudo_password_env.0.clone();
    let sudo = resolve_secret(
        SecretText(None),
        e.sudo_password_env,
        "sudo_password",
        label,
        ctx.env,
    )?
    .zip(sudo_var)
    .map(|(password, var)| SudoPassword { var, password });
    let Entry {
        name: Text(name),
        host: Text(explicit_host),
        port: Port(explicit_port),
        user: Text(explicit_user),
        key_file: Text(key_file),
        ssh_config_host: Text(ssh_config_host),
        host_key_policy: Policy(explicit_policy),
        local: Flag(local),
        connect_timeout_s: Seconds(explicit_timeout),
        scheduler: Text(scheduler),
        slurm,
        policy,
        confine,
        ..
    } = e;
    let policy = policy.unwrap_or_default();
    let confine = confine.or_else(|| ctx.defaults.confine.clone());
    if let Some(c) = &confine {
        c.check(label)?;
    }
    let slurm = slurm_defaults(scheduler.as_deref(), slurm)
        .map_err(|(m, h)| ConfigError::new(format!("{label}: {m}"), h))?;
    if local {
        let remote_fields = [
            ("host", explicit_host.is_some()),
            ("port", explicit_port.is_some()),
            ("user", explicit_user.is_some()),
            ("password", password.is_some()),
            ("key_file", key_file.is_some()),
            ("key_passphrase", key_passphrase.is_some()),
            ("ssh_config_host", ssh_config_host.is_some()),
        ];
        if let Some((field, _)) = remote_fields.iter().find(|(_, set)| *set) {
            return Err(ConfigError::new(
                format!("{label} has local = true and also sets '{field}'"),
                "A local sandbox runs on this machine; drop the SSH fields or set local = false.",
            ));
        }
        return Ok(SandboxConfig {
            name: name.unwrap_or_else(|| "local".to_string()),
            transport: Transport::Local,
            slurm,
            sudo,
            policy,
            confine,
        });
    }

    let params = match &ssh_config_host {
        Some(alias) => Some(ctx.ssh_query(alias, label)?),
        None => None,
    };
    let alias = ssh_config_host.as_deref();

    // host: explicit, else HostName (with %h), else the alias itself (as ssh does).
    let host = explicit_host
        .clone()
        .or_else(|| {
            let hn = params.as_ref()?.host_name.clone()?;
            Some(
                hn.replace("%h", alias.unwrap_or_default())
                    .replace("%%", "%"),
            )
        })
        .or_else(|| alias.map(str::to_string))
        .ok_or_else(|| missing(label, "host"))?;
    let host = unbracket(&host).to_string();
    let user = explicit_user
        .or_else(|| params.as_ref()?.user.clone())
        .ok_or_else(|| missing(label, "user"))?;
    let port = explicit_port
        .or_else(|| params.as_ref()?.port)
        .unwrap_or(22);
    let name = name
        .or_else(|| explicit_host.clone())
        .or_else(|| alias.map(str::to_string))
        .unwrap_or_else(|| host.clone());
    let connect_timeout = explicit_timeout
        .or_else(|| params.as_ref()?.connect_timeout)
        .unwrap_or(ctx.defaults.connect_timeout);

    let auth = if let Some(key) = &key_file {
        let path = expand_tilde(key, ctx.home);
        if !path.exists() {
            ctx.warn(format!(
                "{label}: key_file {} does not exist",
                path.display()
            ));
        }
        Auth::KeyFile {
            path,
            passphrase: key_passphrase.clone(),
        }
    } else if let Some(pw) = &password {
        Auth::Password(pw.clone())
    } else {
        let listed = params
            .as_ref()
            .and_then(|p| p.identity_file.clone())
            .unwrap_or_default();
        let identity_files: Vec<PathBuf> = listed.iter().filter(|p| p.is_file()).cloned().collect();
        if !listed.is_empty() && identity_files.is_empty() {
            ctx.warn(format!(
                "{label}: none of the IdentityFile entries in the ssh config exist"
            ));
        }
        let default_keys = ctx.default_keys();
        let agent = match &params {
            Some(p) => super::ssh_config::identity_agent(p, label, ctx),
            None => super::AgentSocket::Env,
        };
        if identity_files.is_empty() && default_keys.is_empty() && !agent.available(ctx.env) {
            ctx.warn(format!(
                "{label} ('{name}') has no password or key_file, no IdentityFile, no ssh-agent (SSH_AUTH_SOCK unset, or IdentityAgent none) and no ~/.ssh/id_* key; connecting will fail"
            ));
        }
        Auth::Auto {
            identity_files,
            default_keys,
            passphrase: key_passphrase.clone(),
            agent,
        }
    };

    let (block_policy, block_known_hosts) = match &params {
        Some(p) => host_key_settings(p, label, ctx),
        None => (None, None),
    };
    let host_key_policy = explicit_policy
        .or(block_policy)
        .unwrap_or(ctx.defaults.host_key_policy);
    let known_hosts = block_known_hosts.unwrap_or_else(|| ctx.known_hosts());
    let mut target = SshTarget {
        host,
        port,
        user,
        auth,
        proxy_jump: Vec::new(),
        host_key_policy,
        known_hosts,
        connect_timeout,
    };
    let hops = params
        .as_ref()
        .and_then(|p| p.proxy_jump.clone())
        .filter(|hops| !hops.is_empty() && !hops[0].trim().eq_ignore_ascii_case("none"))
        .unwrap_or_default();
    for (i, spec) in hops.iter().enumerate() {
        let hop = resolve_hop(ctx, spec, i, &target, label)?;
        target.proxy_jump.push(hop);
    }
    Ok(SandboxConfig {
        name,
        transport: Transport::Ssh(target),
        slurm,
        sudo,
        policy,
        confine,
    })
}

/// An unknown key, quoted, when it looks like a field name; otherwise not shown (a stray key could
/// be a mangled secret).
pub(super) fn key_name(k: &str) -> String {
    let plain = !k.is_empty()
        && k.len() <= 40
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        format!("'{k}'")
    } else {
        "(name not shown: not a plain identifier)".to_string()
    }
}

fn missing(label: &str, field: &str) -> ConfigError {
    ConfigError::new(
        format!("{label} missing required field: '{field}'"),
        "Each sandbox needs 'host' and 'user', or 'ssh_config_host' naming a Host in ~/.ssh/config that sets them.",
    )
}

pub(super) fn check_names(
    sandboxes: &[SandboxConfig],
    labels: &[String],
) -> Result<(), ConfigError> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, s) in sandboxes.iter().enumerate() {
        if s.name.chars().any(char::is_control) {
            return Err(ConfigError::new(
                format!("{} has a 'name' containing control characters", labels[i]),
                "Use a plain sandbox name such as gpu1.",
            ));
        }
        if let Some(&j) = seen.get(s.name.as_str()) {
            return Err(ConfigError::new(
                format!(
                    "{} duplicate sandbox name '{}' (already used by {})",
                    labels[i], s.name, labels[j]
                ),
                "Give each sandbox a distinct 'name' (it defaults to 'host').",
            ));
        }
        seen.insert(&s.name, i);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::sources::LIST_VAR;

    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn list_bad_types_name_the_field_not_the_value() {
        for (field, value) in [
            ("port", format!(r#""{SECRET}""#)),
            ("port", "70000".into()),
            ("port", "0".into()),
            ("port", "22.5".into()),
            ("port", "true".into()),
            ("password", format!(r#"["{SECRET}"]"#)),
            ("password", "12345".into()),
            ("key_passphrase", format!(r#"{{"v":"{SECRET}"}}"#)),
            ("host", "5".into()),
            ("host_key_policy", format!(r#""{SECRET}""#)),
            ("local", r#""yes""#.into()),
        ] {
            let list = format!(r#"[{{"host":"h","user":"u","{field}":{value}}}]"#);
            let e = err(&[(LIST_VAR, &list)]);
            assert!(
                e.message
                    .starts_with(&format!("REMOTE_SANDBOX_LIST[0] field '{field}' must be ")),
                "{field}={value}: {}",
                e.message
            );
        }
        // null is the same as absent, for every field
        let c = env_only(&[(
            LIST_VAR,
            r#"[{"host":"h","user":"u","port":null,"local":null,"password":null,"host_key_policy":null,"connect_timeout_s":null}]"#,
        )])
        .unwrap();
        assert_eq!((ssh(&c, 0).port, c.sandboxes.len()), (22, 1));
        // numeric strings and integral floats are fine for port
        for port in [r#""2222""#, r#"" 2222 ""#, "2222.0"] {
            let c = env_only(&[(
                LIST_VAR,
                &format!(r#"[{{"host":"h","user":"u","port":{port}}}]"#),
            )])
            .unwrap();
            assert_eq!(ssh(&c, 0).port, 2222);
        }
    }

    #[test]
    fn list_duplicate_names_are_an_error() {
        let list = format!(
            r#"[{{"name":"a","host":"h1","user":"u","password":"{SECRET}"}},{{"host":"a","user":"u","password":"{SECRET}"}}]"#
        );
        let e = err(&[(LIST_VAR, &list)]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[1] duplicate sandbox name 'a' (already used by REMOTE_SANDBOX_LIST[0])"
        );
    }

    #[test]
    fn list_local_entry_and_policy() {
        let list =
            r#"[{"name":"box","local":true},{"host":"h","user":"u","host_key_policy":"Strict"}]"#;
        let c = env_only(&[(LIST_VAR, list), ("RSB_HOST_KEY_POLICY", "off")]).unwrap();
        assert_eq!(
            c.sandboxes[0],
            SandboxConfig {
                name: "box".into(),
                transport: Transport::Local,
                slurm: None,
                sudo: None,
                policy: Default::default(),
                confine: None,
            }
        );
        assert_eq!(ssh(&c, 1).host_key_policy, HostKeyPolicy::Strict);
        let c = env_only(&[
            (LIST_VAR, r#"[{"host":"h","user":"u"}]"#),
            ("RSB_HOST_KEY_POLICY", "off"),
        ])
        .unwrap();
        assert_eq!(ssh(&c, 0).host_key_policy, HostKeyPolicy::Off);
        let e = err(&[(LIST_VAR, r#"[{"local":true,"host":"h"}]"#)]);
        assert!(e.message.contains("local = true and also sets 'host'"));
        let e = err(&[("RSB_HOST_KEY_POLICY", "maybe")]);
        assert!(e.message.starts_with("RSB_HOST_KEY_POLICY must be one of"));
    }
}
