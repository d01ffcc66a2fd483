//! One sandbox entry, whichever source wrote it: its fields (their types, which check each
//! value without ever quoting it, are in `fields.rs`) and the rules that turn it into a
//! [`SandboxConfig`].

use std::collections::HashMap;
use std::path::PathBuf;

use rsb_rules::path::expand_tilde;
use serde::Deserialize;

use super::PolicyRules;
use super::fields::{Flag, Policy, Port, Seconds, Text};
use super::hops::{resolve_hop, unbracket};
use super::secrets::{SecretText, resolve_secret};
use super::slurm::{SlurmDefaults, slurm_defaults};
use super::ssh_config::host_key_settings;
use super::{Auth, BuildCtx, ConfigError, SandboxConfig, SshTarget, SudoPassword, Transport};

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

/// A password or passphrase written into a file others can read is already exposed: the file
/// is refused until it is private, or the value moves to the environment.
pub(super) fn refuse_plaintext_in_open_file(
    entry: &Entry,
    label: &str,
    shown: &str,
    open_to_others: Option<u32>,
) -> Result<(), ConfigError> {
    let literal = [
        ("password", entry.password.0.is_some()),
        ("key_passphrase", entry.key_passphrase.0.is_some()),
    ]
    .into_iter()
    .find_map(|(field, set)| set.then_some(field));
    if let (Some(field), Some(mode)) = (literal, open_to_others) {
        Err(ConfigError::new(
            format!(
                "{label} has a plaintext '{field}' but {shown} is readable by others (mode {mode:04o})"
            ),
            format!(
                "Run `chmod 600 {shown}`, or use {field}_env = \"VAR\" to read it from the environment."
            ),
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::sources::LIST_VAR;

    use super::*;
    use crate::config::test_support::*;
    use crate::config::{HostKeyPolicy, Secret};

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

    #[cfg(unix)]
    #[test]
    fn toml_plaintext_secret_needs_0600() {
        let home = TempDir::new();
        let body = format!("[[sandbox]]\nhost = \"h\"\nuser = \"u\"\npassword = \"{SECRET}\"\n");
        let file = home.write("c.toml", &body);
        chmod(&file, 0o644);
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message.contains("plaintext 'password'") && e.message.contains("0644"),
            "{}",
            e.message
        );
        assert!(
            e.hint.contains("chmod 600") && e.hint.contains("password_env"),
            "{}",
            e.hint
        );
        chmod(&file, 0o600);
        let c = load_with(&home, &[], Some(&file), None).unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(ssh(&c, 0).auth, Auth::Password(Secret::new(SECRET)));
    }
}
