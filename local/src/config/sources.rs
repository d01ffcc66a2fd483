//! Where sandboxes come from and which source wins: `REMOTE_SANDBOX_LIST`, the legacy
//! `REMOTE_HOST` variables, the TOML file, else the built-in `local` sandbox (the order the
//! module documentation of [`crate::config`] gives), plus the server-wide variables. Every
//! source is turned into the same [`Entry`], so the rules for a sandbox are written once.

use std::path::{Path, PathBuf};

use rsb_rules::path::expand_tilde;
use serde::Deserialize;
use serde_json::Value;

use super::entry::{Entry, build_sandbox, check_names, refuse_plaintext_in_open_file};
use super::env::{project_dirs, real_env, real_home};
use super::fields::{
    Policy, Port, Seconds, Text, describe_de_error, field_names, key_name, parse_port,
};
use super::secrets::{Secret, SecretText, readable_by_others};
use super::{BuildCtx, ConfigError, HostKeyPolicy, SandboxConfig, Transport};

pub(super) const LIST_VAR: &str = "REMOTE_SANDBOX_LIST";
const TRUTHY: [&str; 4] = ["1", "true", "yes", "on"];
const FALSY: [&str; 4] = ["0", "false", "no", "off"];

/// `RSB_CONFIG`, else `<platform config dir>/rsb/config.toml`.
pub fn config_file_path() -> PathBuf {
    let home = real_home().unwrap_or_else(|| PathBuf::from("."));
    if let Some(p) = real_env("RSB_CONFIG").filter(|s| !s.trim().is_empty()) {
        return expand_tilde(p.trim(), &home);
    }
    project_dirs()
        .map(|p| p.config_dir().to_path_buf())
        .unwrap_or_else(|| home.join(".config").join("rsb"))
        .join("config.toml")
}

/// The sandboxes and the [`Config::source`](super::Config::source) that names where they came from. The first source
/// that is set wins; each one it shadows gets a warning, so a user who set two learns which
/// one rsb took.
pub(super) fn sandboxes(
    env: &dyn Fn(&str) -> Option<String>,
    config_file: Option<&Path>,
    env_policy: Option<HostKeyPolicy>,
    ctx: &mut BuildCtx<'_>,
) -> Result<(Vec<SandboxConfig>, String), ConfigError> {
    let list = env(LIST_VAR).filter(|s| !s.trim().is_empty());
    let legacy_host = env("REMOTE_HOST").filter(|s| !s.trim().is_empty());
    let file = config_file.filter(|p| p.is_file());
    // REMOTE_USER & co. only complete REMOTE_HOST: beside another source they do nothing.
    let other = match (&list, file) {
        (Some(_), _) => Some(LIST_VAR.to_string()),
        (None, Some(f)) => Some(format!("config file {}", f.display())),
        (None, None) => None,
    };
    if legacy_host.is_none()
        && let Some(source) = other
    {
        for k in LEGACY_PART_VARS {
            if env(k).is_some_and(|v| !v.trim().is_empty()) {
                ctx.warn(format!(
                    "{k} is ignored: it only completes REMOTE_HOST, and the sandboxes come from {source}"
                ));
            }
        }
    }

    let chosen = if let Some(list) = list {
        if legacy_host.is_some() {
            ctx.warn("REMOTE_HOST is ignored because REMOTE_SANDBOX_LIST is set".into());
        }
        if let Some(f) = file {
            ctx.warn(format!(
                "config file {} is ignored because REMOTE_SANDBOX_LIST is set",
                f.display()
            ));
        }
        (parse_list(&list, ctx)?, LIST_VAR.to_string())
    } else if let Some(host) = legacy_host {
        if let Some(f) = file {
            ctx.warn(format!(
                "config file {} is ignored because REMOTE_HOST is set",
                f.display()
            ));
        }
        (vec![parse_legacy(&host, ctx)?], "REMOTE_HOST".to_string())
    } else if let Some(f) = file {
        let sandboxes = parse_toml_file(f, env_policy, ctx)?;
        if sandboxes.is_empty() {
            ctx.warn(format!(
                "config file {} defines no [[sandbox]]; serving the built-in local sandbox",
                f.display()
            ));
            (vec![builtin_local()], BUILTIN_LOCAL.to_string())
        } else {
            (sandboxes, format!("config file {}", f.display()))
        }
    } else {
        (vec![builtin_local()], BUILTIN_LOCAL.to_string())
    };
    Ok(chosen)
}

/// [`Config::source`](super::Config::source) when nothing configures a sandbox.
pub const BUILTIN_LOCAL: &str = "built-in local";

/// Every `REMOTE_*` / `RSB_*` variable rsb (or its test and bench harness) reads, and the
/// `RSB_*` names rsb itself sets for a resumed job. Anything else with those prefixes is a
/// name rsb does not know.
const KNOWN_VARS: &[&str] = &[
    LIST_VAR,
    "REMOTE_HOST",
    "REMOTE_PORT",
    "REMOTE_USER",
    "REMOTE_PASSWORD",
    "REMOTE_KEY_FILE",
    "REMOTE_KEY_PASSPHRASE",
    "REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS",
    "REMOTE_SANDBOX_MCP_HOME",
    "REMOTE_SANDBOX_INLINE_SYNC_MAX_FILES",
    "REMOTE_SANDBOX_INLINE_SYNC_MAX_BYTES",
    "RSB_CONFIG",
    "RSB_SSH_CONFIG",
    "RSB_STATE_DIR",
    "RSB_SANDBOX",
    "RSB_LOG",
    "RSB_HOST_KEY_POLICY",
    "RSB_POLICY_DENY",
    "RSB_POLICY_ASK",
    "RSB_POLICY_ASK_ACTIONS",
    "RSB_ALLOW_WATCH_HOOKS",
    "RSB_WATCHDOG_STORE_PASSWORDS",
    "RSB_AGENT_DIR",
    "RSB_LOCAL_AGENT",
    "RSB_CACHE_DIR",
    "RSB_NVIDIA_SMI_TIMEOUT_MS",
    "RSB_SYNC_FSYNC",
    "RSB_SYNC_TIMING",
    "RSB_SYNC_COMPRESS",
    "RSB_SYNC_LANES",
    "RSB_SYNC_HANDOFF_S",
    "RSB_EMBED_AGENTS_DIR",
    "RSB_BUILD_AGENTS",
    "RSB_REQUIRE_AARCH64",
    "RSB_PROTOCOL_FINGERPRINT",
    "RSB_CHECKPOINT",
    "RSB_RESUME_ATTEMPT",
    "RSB_WATCH_ID",
    "RSB_JOB_NAME",
    "RSB_REQUIRE_SLURM",
    "RSB_AGENTS_WITH_ZIG",
    // Set by rsb for the commands it runs (Slurm submission, sudo), so an rsb run from one of
    // them sees them.
    "RSB_LAUNCH_ID",
    "RSB_JOBNAME",
    "RSB_CWD",
    "RSB_SPEC",
    "RSB_SCRIPT",
    "RSB_ROOT",
    "RSB_ID",
    "RSB_D",
    "RSB_AGENT",
    "RSB_SUDO_COMMAND",
];
/// Prefixes of the harness's own variables (tests, benches, the job wrapper's children).
const KNOWN_VAR_PREFIXES: &[&str] = &[
    "RSB_TEST",
    "RSB_BENCH_",
    "RSB_SOAK_",
    "RSB_SWEEP_",
    "RSB_WATCH_BENCH_",
    "RSB_JOBS_CHILD_",
    "RSB_SLURM_",
];
/// The variables that name where sandboxes come from: one of them set but empty, or a
/// connection variable without `REMOTE_HOST`, means the user meant a remote sandbox.
const SANDBOX_VARS: &[&str] = &[LIST_VAR, "REMOTE_HOST", "RSB_CONFIG"];
const LEGACY_PART_VARS: &[&str] = &[
    "REMOTE_PORT",
    "REMOTE_USER",
    "REMOTE_PASSWORD",
    "REMOTE_KEY_FILE",
    "REMOTE_KEY_PASSPHRASE",
];

/// With nothing configured rsb serves the built-in `local` sandbox: this machine. An
/// environment that *tried* to configure a sandbox and failed (a misspelt `REMOTE_HOSTNAME`, an
/// empty `REMOTE_HOST`, a `REMOTE_USER` without a host) must not silently become "run the
/// model's commands here": it is a configuration error, which every MCP tool call then reports.
/// `vars` is the whole environment; values are only tested for blankness, never quoted.
pub fn check_unconfigured_env(vars: &[(String, String)]) -> Result<(), ConfigError> {
    let hint_tail = "with nothing configured at all rsb serves the built-in `local` sandbox (this machine); `rsb config check` shows the result";
    for (k, v) in vars {
        if SANDBOX_VARS.contains(&k.as_str()) && v.trim().is_empty() {
            return Err(ConfigError::new(
                format!("{k} is set but empty, so no sandbox is configured"),
                format!("give {k} a value or unset it; {hint_tail}"),
            ));
        }
    }
    if let Some((k, _)) = vars
        .iter()
        .find(|(k, v)| LEGACY_PART_VARS.contains(&k.as_str()) && !v.trim().is_empty())
    {
        return Err(ConfigError::new(
            format!("{k} is set but REMOTE_HOST is not, so no sandbox is configured"),
            format!("set REMOTE_HOST (or REMOTE_SANDBOX_LIST) too, or unset {k}; {hint_tail}"),
        ));
    }
    match unknown_var(vars) {
        Some((k, dym)) => Err(ConfigError::new(
            format!("{k} is not a variable rsb reads, and nothing else configures a sandbox"),
            format!("{dym}see the README's Configuration table for the names; {hint_tail}"),
        )),
        None => Ok(()),
    }
}

/// A `REMOTE_*` / `RSB_*` name rsb does not read, with the one it most likely misspells: a
/// configured rsb would otherwise ignore `REMOTE_PORTT=2231` and dial port 22.
pub fn check_unknown_vars(vars: &[(String, String)]) -> Result<(), ConfigError> {
    match unknown_var(vars) {
        Some((k, dym)) => Err(ConfigError::new(
            format!("{k} is not a variable rsb reads"),
            format!("{dym}see the README's Configuration table for the names, or unset {k}"),
        )),
        None => Ok(()),
    }
}

/// The first unknown rsb-like variable and a "did you mean" for it.
fn unknown_var(vars: &[(String, String)]) -> Option<(&str, String)> {
    let mut unknown: Vec<&str> = vars
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| {
            (k.starts_with("REMOTE_") || k.starts_with("RSB_"))
                && !KNOWN_VARS.contains(k)
                && !KNOWN_VAR_PREFIXES.iter().any(|p| k.starts_with(p))
        })
        .filter(|k| {
            // `RSB_*` is rsb's own prefix; other programs use `REMOTE_*` too (VS Code's
            // `REMOTE_CONTAINERS`), so those count only when they look like one of ours.
            k.starts_with("RSB_") || k.starts_with("REMOTE_SANDBOX_") || nearest_var(k).is_some()
        })
        .collect();
    unknown.sort_unstable();
    let k = unknown.first()?;
    let dym = match nearest_var(k) {
        Some(n) => format!("did you mean {n}? "),
        None => String::new(),
    };
    Some((k, dym))
}

/// The known variable `name` is most likely a typo of.
fn nearest_var(name: &str) -> Option<&'static str> {
    KNOWN_VARS
        .iter()
        .map(|k| (strsim::normalized_damerau_levenshtein(name, k), *k))
        .filter(|(s, _)| *s >= 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

fn builtin_local() -> SandboxConfig {
    SandboxConfig {
        name: "local".to_string(),
        transport: Transport::Local,
        slurm: None,
        sudo: None,
        policy: Default::default(),
        confine: None,
    }
}

/// Whether the environment variable `var` is one of 1/true/yes/on, any case (the seed's
/// truthiness): the one reading of every boolean opt-in rsb takes from the environment.
pub fn env_truthy(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| TRUTHY.contains(&v.trim().to_ascii_lowercase().as_str()))
}

pub(super) fn parse_truthy(
    env: &dyn Fn(&str) -> Option<String>,
    warnings: &mut Vec<String>,
) -> bool {
    let key = "REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS";
    let Some(raw) = env(key) else { return false };
    let v = raw.trim().to_ascii_lowercase();
    if TRUTHY.contains(&v.as_str()) {
        return true;
    }
    if !v.is_empty() && !FALSY.contains(&v.as_str()) {
        warnings.push(format!(
            "{key} is not one of 1/true/yes/on or 0/false/no/off; advanced tools stay hidden"
        ));
    }
    false
}

pub(super) fn parse_limit(
    env: &dyn Fn(&str) -> Option<String>,
    key: &str,
    default: u64,
    warnings: &mut Vec<String>,
) -> u64 {
    let Some(raw) = env(key) else { return default };
    let v = raw.trim();
    if v.is_empty() {
        return default;
    }
    match v.strip_prefix('+').unwrap_or(v).parse::<u64>() {
        Ok(n) => n,
        Err(_) => {
            warnings.push(format!(
                "{key} is not a non-negative integer; using the default {default}"
            ));
            default
        }
    }
}

/// The TOML file's top level.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct FileConfig {
    host_key_policy: Policy,
    connect_timeout_s: Seconds,
    sandbox: Vec<Entry>,
    /// The global command rules (`[policy]`), under each sandbox's own.
    policy: Option<super::PolicyRules>,
    /// Every sandbox's confinement (`[confine]`), unless it sets its own.
    confine: Option<super::ConfineRules>,
    /// Read and checked by the watchdog's own settings (alert hooks the user allows in their
    /// own file); accepted here so the rest of the file parses.
    #[allow(dead_code)]
    watchdog: Option<toml::Value>,
}

// ---------------------------------------------------------------------------------------------
// REMOTE_SANDBOX_LIST
// ---------------------------------------------------------------------------------------------

/// `<reason> at line L column C`. serde_json classifies its errors: a syntax or end-of-input
/// error's text is one of its fixed descriptions and holds no character of the input, so it is
/// kept; a data error (a type mismatch) may quote the input, so only its class is named.
fn json_error_text(err: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let full;
    let reason = match err.classify() {
        Category::Syntax | Category::Eof => {
            full = err.to_string();
            full.rsplit_once(" at line ")
                .map(|(r, _)| r)
                .unwrap_or(&full)
        }
        Category::Data => "a value of the wrong type",
        Category::Io => "a read error",
    };
    format!("{reason} at line {} column {}", err.line(), err.column())
}

fn parse_list(raw: &str, ctx: &mut BuildCtx<'_>) -> Result<Vec<SandboxConfig>, ConfigError> {
    let value: Value = serde_json::from_str(raw.trim()).map_err(|e| {
        ConfigError::new(
            format!("{LIST_VAR} is not valid JSON: {}", json_error_text(&e)),
            "Check REMOTE_SANDBOX_LIST is valid JSON: [{\"name\": \"gpu1\", \"host\": \"10.0.0.5\", \"user\": \"me\", \"key_file\": \"~/.ssh/id_ed25519\"}] (the value is not shown, to keep secrets out of logs).",
        )
    })?;
    let Value::Array(items) = value else {
        return Err(ConfigError::new(
            format!("{LIST_VAR} must be a JSON array"),
            "Wrap the sandboxes in [ ... ], one JSON object per sandbox.",
        ));
    };
    if items.is_empty() {
        return Err(ConfigError::new(
            format!("{LIST_VAR} must contain at least one sandbox"),
            "Add a sandbox object, or unset REMOTE_SANDBOX_LIST to use REMOTE_HOST, the config file or the built-in local sandbox.",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    let mut labels = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let label = format!("{LIST_VAR}[{i}]");
        let Value::Object(mut map) = item else {
            return Err(ConfigError::new(
                format!("{label} must be a JSON object"),
                "Each element is an object such as {\"host\": \"10.0.0.5\", \"user\": \"me\", \"key_file\": \"~/.ssh/id_ed25519\"}.",
            ));
        };
        // Unknown fields are ignored with a warning here (the seed ignored them silently), so
        // a list written for the seed keeps working; the TOML file, rsb's own, rejects them.
        let known = field_names::<Entry>();
        let mut unknown: Vec<String> = map
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .cloned()
            .collect();
        unknown.sort_unstable();
        for k in unknown {
            ctx.warn(format!("{label}: unknown field {} ignored", key_name(&k)));
            map.remove(&k);
        }
        let entry: Entry = serde_path_to_error::deserialize(Value::Object(map)).map_err(|e| {
            let (what, hint) = describe_de_error(e.path(), &e.inner().to_string(), "");
            ConfigError::new(format!("{label} {what}"), hint)
        })?;
        out.push(build_sandbox(entry, &label, ctx)?);
        labels.push(label);
    }
    check_names(&out, &labels)?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Legacy single sandbox
// ---------------------------------------------------------------------------------------------

fn parse_legacy(host: &str, ctx: &mut BuildCtx<'_>) -> Result<SandboxConfig, ConfigError> {
    let get = |k: &str| {
        (ctx.env)(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let user = get("REMOTE_USER").ok_or_else(|| {
        ConfigError::new(
            "REMOTE_USER is required when REMOTE_HOST is set",
            "Set REMOTE_USER to the SSH login name.",
        )
    })?;
    let port = match get("REMOTE_PORT") {
        None => None,
        Some(p) => Some(parse_port(&p).ok_or_else(|| {
            ConfigError::new(
                "REMOTE_PORT must be an integer between 1 and 65535",
                "Set REMOTE_PORT to the SSH port (default 22).",
            )
        })?),
    };
    let entry = Entry {
        host: Text(Some(host.trim().to_string())),
        port: Port(port),
        user: Text(Some(user)),
        // Stripped, like the seed (including the password).
        password: SecretText(get("REMOTE_PASSWORD").map(Secret)),
        key_file: Text(get("REMOTE_KEY_FILE")),
        key_passphrase: SecretText(get("REMOTE_KEY_PASSPHRASE").map(Secret)),
        ..Entry::default()
    };
    build_sandbox(entry, "REMOTE_HOST", ctx)
}

// ---------------------------------------------------------------------------------------------
// TOML file
// ---------------------------------------------------------------------------------------------

fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(src.len());
    let before = src.get(..offset).unwrap_or(src);
    let line = before.matches('\n').count() + 1;
    let col = before
        .rsplit('\n')
        .next()
        .map(|l| l.chars().count())
        .unwrap_or(0)
        + 1;
    (line, col)
}

fn parse_toml_file(
    path: &Path,
    env_policy: Option<HostKeyPolicy>,
    ctx: &mut BuildCtx<'_>,
) -> Result<Vec<SandboxConfig>, ConfigError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| {
        ConfigError::new(
            format!("cannot read config file {shown}: {}", e.kind()),
            "Check the file's permissions, or set RSB_CONFIG to another file.",
        )
    })?;
    let src = String::from_utf8(bytes).map_err(|e| {
        let (line, col) = line_col(
            &String::from_utf8_lossy(e.as_bytes()),
            e.utf8_error().valid_up_to(),
        );
        ConfigError::new(
            format!("config file {shown} is not valid UTF-8 (line {line}, column {col})"),
            "Save the file as UTF-8.",
        )
    })?;
    let position = |e: &toml::de::Error| match e.span() {
        Some(span) => {
            let (line, col) = line_col(&src, span.start);
            format!(" (line {line}, column {col})")
        }
        None => String::new(),
    };
    let doc = toml::Deserializer::parse(&src).map_err(|e| {
        ConfigError::new(
            format!("config file {shown} is not valid TOML{}", position(&e)),
            "Fix the TOML syntax at that position (the text is not shown, to keep secrets out of logs).",
        )
    })?;
    let file: FileConfig = serde_path_to_error::deserialize(doc).map_err(|e| {
        let in_sandbox = matches!(
            e.path().iter().collect::<Vec<_>>()[..],
            [
                serde_path_to_error::Segment::Map { .. },
                serde_path_to_error::Segment::Seq { .. },
                ..
            ]
        );
        let keys = if in_sandbox {
            format!("Sandbox keys are: {}.", field_names::<Entry>().join(", "))
        } else {
            format!(
                "Top-level keys are: {}; per sandbox: [[sandbox]] tables.",
                field_names::<FileConfig>().join(", ")
            )
        };
        let (what, hint) = if e.path().to_string() == "sandbox" {
            (
                "'sandbox' must be an array of tables".to_string(),
                "Write each sandbox as a [[sandbox]] table.".to_string(),
            )
        } else {
            describe_de_error(e.path(), e.inner().message(), &keys)
        };
        ConfigError::new(
            format!("config file {shown}{}: {what}", position(e.inner())),
            hint,
        )
    })?;
    // RSB_HOST_KEY_POLICY (env) beats the file's default; a per-sandbox value beats both.
    if let (Some(p), None) = (file.host_key_policy.0, env_policy) {
        ctx.defaults.host_key_policy = p;
    }
    if let Some(t) = file.connect_timeout_s.0 {
        ctx.defaults.connect_timeout = t;
    }
    if let Some(p) = file.policy {
        ctx.policy.extend(p);
    }
    if let Some(c) = file.confine {
        c.check(&format!("config file {shown}: [confine]"))?;
        ctx.defaults.confine = Some(c);
    }
    let open_to_others = readable_by_others(path);
    let mut out = Vec::with_capacity(file.sandbox.len());
    let mut labels = Vec::with_capacity(file.sandbox.len());
    for (i, entry) in file.sandbox.into_iter().enumerate() {
        let label = format!("config file {shown}: sandbox[{i}]");
        refuse_plaintext_in_open_file(&entry, &label, &shown, open_to_others)?;
        out.push(build_sandbox(entry, &label, ctx)?);
        labels.push(label);
    }
    check_names(&out, &labels)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::{Auth, DEFAULT_CONNECT_TIMEOUT};

    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn nothing_configured_gives_local() {
        let c = env_only(&[]).unwrap();
        assert_eq!(c.sandboxes, vec![builtin_local()]);
        assert_eq!(c.source, "built-in local");
        assert!(!c.expose_advanced_tools);
        assert_eq!(c.inline_sync_max_files, 200);
        assert_eq!(c.inline_sync_max_bytes, 67_108_864);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        // blank values count as unset, like the seed
        let c = env_only(&[(LIST_VAR, "  "), ("REMOTE_HOST", " ")]).unwrap();
        assert_eq!(c.source, "built-in local");
        // a missing config file is just absent
        let home = TempDir::new();
        let c = load_with(&home, &[], Some(&home.path().join("nope.toml")), None).unwrap();
        assert_eq!(c.source, "built-in local");
    }

    #[test]
    fn an_environment_that_configures_no_sandbox_is_an_error() {
        let check = |vars: &[(&str, &str)]| {
            let v: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            check_unconfigured_env(&v)
        };
        // nothing, or only settings that configure no sandbox: the built-in local is fine
        assert!(check(&[]).is_ok());
        assert!(
            check(&[
                ("RSB_STATE_DIR", "/x"),
                ("RSB_LOG", "debug"),
                ("HOME", "/h")
            ])
            .is_ok()
        );
        assert!(check(&[("REMOTE_CONTAINERS", "true"), ("RSB_TESTBED_FIXTURE", "1")]).is_ok());
        // a typo'd name, with a did-you-mean; the value is never quoted
        let e = check(&[("REMOTE_HOSTNAME", "S3cr3t.example")]).unwrap_err();
        assert!(e.message.contains("REMOTE_HOSTNAME"), "{e:?}");
        assert!(e.hint.contains("did you mean REMOTE_HOST?"), "{e:?}");
        assert!(!format!("{e:?}").contains("S3cr3t"));
        let e = check(&[("RSB_SANDBOX_LIST", "[]")]).unwrap_err();
        assert!(
            e.hint.contains("did you mean REMOTE_SANDBOX_LIST?"),
            "{e:?}"
        );
        // empty values of the variables that name a source
        for k in [LIST_VAR, "REMOTE_HOST", "RSB_CONFIG"] {
            let e = check(&[(k, " ")]).unwrap_err();
            assert!(
                e.message.contains(&format!("{k} is set but empty")),
                "{e:?}"
            );
        }
        // a connection variable without a host
        let e = check(&[("REMOTE_USER", "me")]).unwrap_err();
        assert!(
            e.message
                .contains("REMOTE_USER is set but REMOTE_HOST is not"),
            "{e:?}"
        );
    }

    #[test]
    fn list_happy_path_with_defaults_order_and_auth() {
        let home = TempDir::new();
        let key = home.write("keys/k1", "x");
        let list = format!(
            r#"[{{"name":"a","host":"h1","port":2222,"user":"u1","password":"{SECRET}"}},
                {{"host":"h2","user":"u2","key_file":"~/keys/k1","key_passphrase":"{SECRET}"}},
                {{"name":"c","host":"h3","port":"2200","user":"u3","password":"pw","key_file":"/abs/key"}}]"#
        );
        let c = load_with(&home, &[(LIST_VAR, &list)], None, None).unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(c.source, "REMOTE_SANDBOX_LIST");
        assert_eq!(c.names(), vec!["a", "h2", "c"]);
        let a = ssh(&c, 0);
        assert_eq!(
            (a.host.as_str(), a.port, a.user.as_str()),
            ("h1", 2222, "u1")
        );
        assert_eq!(a.auth, Auth::Password(Secret::new(SECRET)));
        assert_eq!(a.host_key_policy, HostKeyPolicy::AcceptNew);
        assert_eq!(a.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(
            a.known_hosts,
            vec![
                home.path().join(".ssh/known_hosts"),
                home.path().join("state/known_hosts")
            ]
        );
        let b = ssh(&c, 1);
        assert_eq!(b.port, 22);
        assert_eq!(
            b.auth,
            Auth::KeyFile {
                path: key,
                passphrase: Some(Secret::new(SECRET))
            }
        );
        // both given: key wins, like the seed
        assert!(
            matches!(&ssh(&c, 2).auth, Auth::KeyFile { path, passphrase: None } if path == Path::new("/abs/key"))
        );
        assert_eq!(ssh(&c, 2).port, 2200);
        // missing key file is a warning naming the path, not an error
        assert!(
            c.warnings.iter().any(|w| w.contains("/abs/key")),
            "{:?}",
            c.warnings
        );
    }

    #[test]
    fn list_wins_over_legacy_with_warning() {
        let list = r#"[{"host":"h1","user":"u","password":"p"}]"#;
        let c = env_only(&[
            (LIST_VAR, list),
            ("REMOTE_HOST", "legacy"),
            ("REMOTE_USER", "u"),
        ])
        .unwrap();
        assert_eq!(c.names(), vec!["h1"]);
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("REMOTE_HOST is ignored"))
        );
    }

    #[test]
    fn list_not_json_never_echoes() {
        // the seed leaked '123" "port":22}' from exactly this kind of input
        let bad = format!(r#"[{{"host":"h","user":"u","password":"{SECRET}" "port":22}}]"#);
        let e = err(&[(LIST_VAR, &bad)]);
        assert!(
            e.message.starts_with(
                "REMOTE_SANDBOX_LIST is not valid JSON: expected `,` or `}` at line 1 column"
            ),
            "{}",
            e.message
        );
        for bad in [
            format!(r#"[{{"password":"{SECRET}"#),
            format!(r#"[{{"password":"{SECRET}\q"}}]"#),
            format!(r#"[{{"password":{SECRET}}}]"#),
            format!("[{{\"password\":\"{SECRET}\u{1}\"}}]"),
            format!(r#"[{{"host":"h"}}] {SECRET}"#),
        ] {
            let e = err(&[(LIST_VAR, &bad)]);
            assert!(
                e.message
                    .starts_with("REMOTE_SANDBOX_LIST is not valid JSON: "),
                "{}",
                e.message
            );
            assert!(e.message.contains(" at line 1 column "), "{}", e.message);
        }
    }

    #[test]
    fn list_structure_errors_match_seed_wording() {
        let e = err(&[(
            LIST_VAR,
            &format!(r#"{{"host":"h","password":"{SECRET}"}}"#),
        )]);
        assert_eq!(e.message, "REMOTE_SANDBOX_LIST must be a JSON array");
        let e = err(&[(
            LIST_VAR,
            &format!(r#"[{{"host":"h","user":"u"}}, "{SECRET}"]"#),
        )]);
        assert_eq!(e.message, "REMOTE_SANDBOX_LIST[1] must be a JSON object");
        let e = err(&[(
            LIST_VAR,
            &format!(r#"[{{"user":"u","password":"{SECRET}"}}]"#),
        )]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0] missing required field: 'host'"
        );
        let e = err(&[(
            LIST_VAR,
            &format!(r#"[{{"host":"h","password":"{SECRET}"}}]"#),
        )]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0] missing required field: 'user'"
        );
        let e = err(&[(LIST_VAR, r#"[{"host":"","user":"u"}]"#)]);
        assert_eq!(
            e.message,
            "REMOTE_SANDBOX_LIST[0] missing required field: 'host'"
        );
        let e = err(&[(LIST_VAR, "[]")]);
        assert!(e.message.contains("at least one sandbox"));
    }

    #[test]
    fn list_unknown_fields_warn_and_no_credentials_is_auto() {
        let home = TempDir::new();
        let k = home.write(".ssh/id_rsa", "x");
        let list = r#"[{"host":"h","user":"u","colour":"red","key_passphrase":"kp"}]"#;
        let c = load_with(&home, &[(LIST_VAR, list)], None, None).unwrap();
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("unknown field 'colour'"))
        );
        assert_eq!(
            ssh(&c, 0).auth,
            Auth::Auto {
                identity_files: vec![],
                default_keys: vec![k],
                passphrase: Some(Secret::new("kp")),
                agent: Default::default(),
            }
        );
        // a default key exists, so no "connecting will fail" warning
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        // a stray key that is not a plain identifier is not echoed
        let list = format!(r#"[{{"host":"h","user":"u","pw={SECRET}":1}}]"#);
        let c = load_with(&home, &[(LIST_VAR, &list)], None, None).unwrap();
        assert_no_secret_cfg(&c);
        assert!(
            c.warnings.iter().any(|w| w.contains("name not shown")),
            "{:?}",
            c.warnings
        );
        // nothing at all to authenticate with: still loads, with a warning
        let c = env_only(&[(LIST_VAR, r#"[{"host":"h","user":"u"}]"#)]).unwrap();
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("connecting will fail")),
            "{:?}",
            c.warnings
        );
        let c = env_only(&[
            (LIST_VAR, r#"[{"host":"h","user":"u"}]"#),
            ("SSH_AUTH_SOCK", "/tmp/agent"),
        ])
        .unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn legacy_env_password() {
        let pw = format!("  {SECRET}  ");
        let c = env_only(&[
            ("REMOTE_HOST", " 10.0.0.5 "),
            ("REMOTE_PORT", " 2022 "),
            ("REMOTE_USER", " me "),
            ("REMOTE_PASSWORD", &pw),
        ])
        .unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(c.source, "REMOTE_HOST");
        assert_eq!(c.names(), vec!["10.0.0.5"]);
        let t = ssh(&c, 0);
        assert_eq!(
            (t.host.as_str(), t.port, t.user.as_str()),
            ("10.0.0.5", 2022, "me")
        );
        // stripped, like the seed
        assert_eq!(t.auth, Auth::Password(Secret::new(SECRET)));
    }

    #[test]
    fn legacy_env_key_and_errors() {
        let home = TempDir::new();
        let key = home.write(".ssh/work", "x");
        let c = load_with(
            &home,
            &[
                ("REMOTE_HOST", "h"),
                ("REMOTE_USER", "me"),
                ("REMOTE_KEY_FILE", "~/.ssh/work"),
                ("REMOTE_KEY_PASSPHRASE", SECRET),
                ("REMOTE_PASSWORD", SECRET),
            ],
            None,
            None,
        )
        .unwrap();
        assert_no_secret_cfg(&c);
        let t = ssh(&c, 0);
        assert_eq!(t.port, 22);
        assert_eq!(
            t.auth,
            Auth::KeyFile {
                path: key,
                passphrase: Some(Secret::new(SECRET))
            }
        );
        // empty passphrase means "no passphrase" (seed README: leave blank)
        let c = env_only(&[
            ("REMOTE_HOST", "h"),
            ("REMOTE_USER", "me"),
            ("REMOTE_KEY_FILE", "/k"),
            ("REMOTE_KEY_PASSPHRASE", ""),
        ])
        .unwrap();
        assert!(matches!(
            &ssh(&c, 0).auth,
            Auth::KeyFile {
                passphrase: None,
                ..
            }
        ));
        let e = err(&[("REMOTE_HOST", "h"), ("REMOTE_PASSWORD", SECRET)]);
        assert_eq!(e.message, "REMOTE_USER is required when REMOTE_HOST is set");
        let e = err(&[
            ("REMOTE_HOST", "h"),
            ("REMOTE_USER", "u"),
            ("REMOTE_PORT", SECRET),
        ]);
        assert_eq!(
            e.message,
            "REMOTE_PORT must be an integer between 1 and 65535"
        );
        // no password and no key: Auto (the seed refused)
        let c = env_only(&[("REMOTE_HOST", "h"), ("REMOTE_USER", "u")]).unwrap();
        assert!(matches!(ssh(&c, 0).auth, Auth::Auto { .. }));
    }

    #[test]
    fn advanced_tools_truthiness() {
        for (v, want) in [
            ("1", true),
            ("true", true),
            ("TRUE", true),
            (" yes ", true),
            ("On", true),
            ("0", false),
            ("false", false),
            ("no", false),
            ("off", false),
            ("", false),
            ("2", false),
            ("enable", false),
        ] {
            let c = env_only(&[("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", v)]).unwrap();
            assert_eq!(c.expose_advanced_tools, want, "{v:?}");
            let warned = !c.warnings.is_empty();
            assert_eq!(warned, v == "2" || v == "enable", "{v:?}: {:?}", c.warnings);
        }
    }

    #[test]
    fn inline_sync_limits() {
        let f = "REMOTE_SANDBOX_INLINE_SYNC_MAX_FILES";
        let b = "REMOTE_SANDBOX_INLINE_SYNC_MAX_BYTES";
        let c = env_only(&[(f, "5000"), (b, " 1048576 ")]).unwrap();
        assert_eq!(
            (c.inline_sync_max_files, c.inline_sync_max_bytes),
            (5000, 1_048_576)
        );
        let c = env_only(&[(f, "0"), (b, "+10")]).unwrap();
        assert_eq!((c.inline_sync_max_files, c.inline_sync_max_bytes), (0, 10));
        assert!(c.warnings.is_empty());
        let c = env_only(&[(f, "lots"), (b, "-5")]).unwrap();
        assert_eq!(
            (c.inline_sync_max_files, c.inline_sync_max_bytes),
            (200, 67_108_864)
        );
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c.warnings[0].contains(f) && c.warnings[1].contains(b));
        let c = env_only(&[(f, ""), (b, "  ")]).unwrap();
        assert!(c.warnings.is_empty());
    }

    const TOML_OK: &str = r#"
host_key_policy = "strict"
connect_timeout_s = 5

[[sandbox]]
name = "gpu1"
host = "10.0.0.5"
port = 2222
user = "me"
key_file = "~/.ssh/id_ed25519"
key_passphrase_env = "GPU1_PASSPHRASE"
host_key_policy = "accept-new"

[[sandbox]]
name = "alias"
ssh_config_host = "gpu1"

[[sandbox]]
name = "pw"
host = "h"
user = "u"
password_env = "PW_VAR"

[[sandbox]]
name = "local"
local = true
"#;

    #[test]
    fn policy_rules_come_from_the_file_the_list_and_the_environment() {
        let home = TempDir::new();
        let file = home.write(
            "rsb/config.toml",
            r#"
[policy]
deny = ["shutdown*"]

[[sandbox]]
name = "a"
local = true
policy = { ask = ["git push*"] }

[[sandbox]]
name = "b"
local = true
"#,
        );
        let c = load_with(
            &home,
            &[("RSB_POLICY_DENY", r#"["mkfs*"]"#)],
            Some(&file),
            None,
        )
        .unwrap();
        assert_eq!(c.policy.deny, ["mkfs*", "shutdown*"]);
        assert_eq!(c.sandbox("a").unwrap().policy.ask, ["git push*"]);
        assert!(c.sandbox("b").unwrap().policy.is_empty());
        let bad = home.write(
            "rsb/bad.toml",
            "[policy]
den = [\"x\"]\n",
        );
        let e = load_with(&home, &[], Some(&bad), None).unwrap_err();
        assert!(e.message.contains("den"), "{}", e.message);
        let c = env_only(&[(
            LIST_VAR,
            r#"[{"name": "s", "local": true, "policy": {"deny": ["rm -rf /*"]}}]"#,
        )])
        .unwrap();
        assert_eq!(c.sandboxes[0].policy.deny, ["rm -rf /*"]);
        let e = err(&[(LIST_VAR, r#"[{"local": true, "policy": {"deny": "rm"}}]"#)]);
        assert!(e.message.contains("policy"), "{}", e.message);
    }

    #[test]
    fn confine_comes_from_the_file_and_a_sandbox_replaces_it_whole() {
        let home = TempDir::new();
        let file = home.write(
            "rsb/config.toml",
            r#"
[confine]
write = ["~/work", "/tmp"]

[[sandbox]]
name = "a"
local = true
confine = { write = ["/scratch"], require = false }

[[sandbox]]
name = "b"
local = true
"#,
        );
        let c = load_with(&home, &[], Some(&file), None).unwrap();
        let a = c.sandbox("a").unwrap().confine.clone().unwrap();
        assert_eq!(a.request().net, None);
        assert_eq!((a.write, a.require), (vec!["/scratch".to_string()], false));
        let b = c.sandbox("b").unwrap().confine.clone().unwrap();
        assert_eq!(
            (b.write, b.require),
            (vec!["~/work".into(), "/tmp".into()], true)
        );
        // A relative root has no fixed meaning on the host; an unknown key is a typo.
        for (text, needle) in [
            (
                "[confine]\nwrite = []\nnet = \"nonе\"\n",
                "not \"any\" or \"none\"",
            ),
            ("[confine]\nwrite = []\nnet = [\"http\"]\n", "not a port"),
            ("[confine]\nwrite = []\nnet = [0]\n", "not a port"),
            (
                "[confine]\nwrite = [\"work\"]\n",
                "not an absolute or ~ path",
            ),
            (
                "[confine]\nwrite = []\nread = [\"/data\", \"data\"]\n",
                "confine.read entry \"data\" is not an absolute or ~ path",
            ),
            ("[confine]\nwrite = []\nread = \"/data\"\n", "read"),
            ("[confine]\nwrite = []\nrequire = 1\n", "require"),
            ("[confine]\nwrites = [\"/x\"]\n", "writes"),
        ] {
            let bad = home.write("rsb/bad.toml", text);
            let e = load_with(&home, &[], Some(&bad), None).unwrap_err();
            assert!(e.message.contains(needle), "{text}: {}", e.message);
        }
        let c = env_only(&[(
            LIST_VAR,
            r#"[{"name": "s", "local": true, "confine": {"write": ["~"]}}]"#,
        )])
        .unwrap();
        assert_eq!(c.sandboxes[0].confine.as_ref().unwrap().write, ["~"]);
        assert!(c.sandboxes[0].confine.as_ref().unwrap().require);
        assert_eq!(
            c.sandboxes[0].confine.as_ref().unwrap().request().read,
            None
        );
        let c = env_only(&[(
            LIST_VAR,
            r#"[{"name": "s", "local": true, "confine": {"write": [], "read": ["~/data"]}}]"#,
        )])
        .unwrap();
        let rules = c.sandboxes[0].confine.clone().unwrap();
        assert_eq!(rules.request().read, Some(vec!["~/data".to_string()]));
        for (net, want) in [
            (r#""none""#, Some(vec![])),
            (r#""any""#, None),
            (r#"["443", 22]"#, Some(vec![443, 22])),
        ] {
            let list = format!(
                r#"[{{"name": "s", "local": true, "confine": {{"write": [], "net": {net}}}}}]"#
            );
            let c = env_only(&[(LIST_VAR, list.as_str())]).unwrap();
            let rules = c.sandboxes[0].confine.clone().unwrap();
            assert_eq!(rules.request().net, want, "{net}");
        }
    }

    #[test]
    fn toml_happy_path() {
        let home = TempDir::new();
        let key = home.write(".ssh/id_ed25519", "x");
        let cfg = home.write(".ssh/config", SSH_CONFIG);
        let file = home.write("rsb/config.toml", TOML_OK);
        #[cfg(unix)]
        chmod(&file, 0o644); // no literal secrets, so any mode is fine
        let c = load_with(
            &home,
            &[("GPU1_PASSPHRASE", SECRET), ("PW_VAR", SECRET)],
            Some(&file),
            Some(&cfg),
        )
        .unwrap();
        assert_no_secret_cfg(&c);
        assert_eq!(c.source, format!("config file {}", file.display()));
        assert_eq!(c.names(), vec!["gpu1", "alias", "pw", "local"]);
        let t = ssh(&c, 0);
        assert_eq!((t.host.as_str(), t.port), ("10.0.0.5", 2222));
        assert_eq!(t.host_key_policy, HostKeyPolicy::AcceptNew);
        assert_eq!(t.connect_timeout, Duration::from_secs(5));
        assert_eq!(
            t.auth,
            Auth::KeyFile {
                path: key.clone(),
                passphrase: Some(Secret::new(SECRET))
            }
        );
        let t = ssh(&c, 1);
        assert_eq!((t.host.as_str(), t.user.as_str()), ("10.0.0.5", "alice"));
        assert_eq!(t.host_key_policy, HostKeyPolicy::Strict);
        assert_eq!(
            t.connect_timeout,
            Duration::from_secs(7),
            "ssh_config ConnectTimeout beats the file default"
        );
        assert_eq!(
            t.auth,
            Auth::Auto {
                identity_files: vec![],
                default_keys: vec![key.clone()],
                passphrase: None,
                agent: Default::default(),
            },
            "gpu1_key does not exist in this home; id_ed25519 does"
        );
        assert_eq!(ssh(&c, 2).auth, Auth::Password(Secret::new(SECRET)));
        assert_eq!(c.sandboxes[3].transport, Transport::Local);
        // env vars win over the file
        let c = load_with(
            &home,
            &[("REMOTE_HOST", "h"), ("REMOTE_USER", "u")],
            Some(&file),
            Some(&cfg),
        )
        .unwrap();
        assert_eq!(c.source, "REMOTE_HOST");
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("is ignored because REMOTE_HOST is set"))
        );
        // RSB_HOST_KEY_POLICY beats the file's default, not a sandbox's own
        let c = load_with(
            &home,
            &[
                ("GPU1_PASSPHRASE", "p"),
                ("PW_VAR", "p"),
                ("RSB_HOST_KEY_POLICY", "off"),
            ],
            Some(&file),
            Some(&cfg),
        )
        .unwrap();
        assert_eq!(ssh(&c, 0).host_key_policy, HostKeyPolicy::AcceptNew);
        assert_eq!(ssh(&c, 1).host_key_policy, HostKeyPolicy::Off);
    }

    #[test]
    fn toml_unknown_keys_are_errors() {
        let home = TempDir::new();
        let file = home.write(
            "c.toml",
            "[[sandbox]]\nhost = \"h\"\nuser = \"u\"\nhostname = \"x\"\n",
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert!(
            e.message.ends_with("sandbox[0] has unknown key 'hostname'"),
            "{}",
            e.message
        );
        assert!(e.hint.contains("ssh_config_host"));
        assert!(
            e.message.contains("(line 4, column 1): sandbox[0]"),
            "{}",
            e.message
        );
        let file = home.write("d.toml", "colour = 1\n");
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert!(e.message.ends_with("unknown key 'colour'"), "{}", e.message);
        assert!(e.hint.starts_with("Top-level keys are: host_key_policy"));
        // A key that is not a plain name may be a mangled secret: not shown.
        let file = home.write(
            "e.toml",
            &format!("[[sandbox]]\nhost = \"h\"\n\"pw={SECRET}\" = 1\n"),
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message
                .ends_with("(name not shown: not a plain identifier)")
        );
    }

    #[test]
    fn toml_malformed_gives_position_not_text() {
        let home = TempDir::new();
        let file = home.write(
            "c.toml",
            &format!("[[sandbox]]\nhost = \"h\"\npassword = \"{SECRET}\n"),
        );
        #[cfg(unix)]
        chmod(&file, 0o600);
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message.contains("is not valid TOML (line 3, column"),
            "{}",
            e.message
        );
        let file = home.write(
            "d.toml",
            &format!("[[sandbox]]\nport = \"{SECRET}\"\nhost=\"h\"\nuser=\"u\"\n"),
        );
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert_no_secret_err(&e);
        assert!(
            e.message
                .ends_with("field 'port' must be an integer between 1 and 65535"),
            "{}",
            e.message
        );
        assert!(
            e.message
                .contains("(line 2, column 8): sandbox[0] field 'port'"),
            "{}",
            e.message
        );
        // Wrong shapes anywhere, with a secret as the value: the place and line, never the value.
        for (body, want) in [
            (
                format!("[[sandbox]]\nhost='h'\n[[sandbox]]\npassword = [\"{SECRET}\"]\n"),
                "(line 4, column 12): sandbox[1] field 'password' must be a string",
            ),
            (
                format!("sandbox = \"{SECRET}\"\n"),
                "(line 1, column 11): 'sandbox' must be an array of tables",
            ),
            (
                format!("sandbox = [\"{SECRET}\"]\n"),
                "(line 1, column 12): sandbox[0] must be a table",
            ),
            (
                format!("host_key_policy = \"{SECRET}\"\n"),
                "(line 1, column 19): field 'host_key_policy' must be one of accept-new, strict, off",
            ),
            (
                format!("[[sandbox]]\nlocal = \"{SECRET}\"\n"),
                "(line 2, column 9): sandbox[0] field 'local' must be true or false",
            ),
            (
                "connect_timeout_s = 1979-05-27T07:32:00Z\n".to_string(),
                "(line 1, column 21): field 'connect_timeout_s' must be a positive number of seconds",
            ),
        ] {
            let file = home.write("w.toml", &body);
            #[cfg(unix)]
            chmod(&file, 0o600);
            let e = load_with(&home, &[], Some(&file), None).unwrap_err();
            assert_no_secret_err(&e);
            assert!(e.message.ends_with(want), "{body:?}: {}", e.message);
        }
        let file = home.write("e.toml", "[[sandbox]]\nname=\"a\"\nhost=\"h\"\nuser=\"u\"\n[[sandbox]]\nname=\"a\"\nlocal=true\n");
        let e = load_with(&home, &[], Some(&file), None).unwrap_err();
        assert!(
            e.message.contains("duplicate sandbox name 'a'"),
            "{}",
            e.message
        );
    }

    #[test]
    fn toml_without_sandboxes_falls_back_to_local() {
        let home = TempDir::new();
        let file = home.write("c.toml", "host_key_policy = \"off\"\n");
        let c = load_with(&home, &[], Some(&file), None).unwrap();
        assert_eq!(c.sandboxes, vec![builtin_local()]);
        assert_eq!(c.warnings.len(), 1);
    }

    #[test]
    fn json_errors_keep_serde_reasons_and_never_the_input() {
        for bad in [
            "[",
            "[1,",
            "{\"a\" 1}",
            "[1 2]",
            "\"\\q\"",
            "tru",
            "[1] x",
            "[1,]",
            "{1:2}",
        ] {
            let e = serde_json::from_str::<Value>(bad).unwrap_err();
            let text = json_error_text(&e);
            assert_eq!(
                text,
                e.to_string(),
                "a syntax reason is kept as serde_json wrote it"
            );
        }
        let e = serde_json::from_str::<Value>("[1,").unwrap_err();
        assert_eq!(
            json_error_text(&e),
            "EOF while parsing a value at line 1 column 3"
        );
        // A data error quotes what it read: only its class is named.
        let e = serde_json::from_str::<Vec<u8>>("[\"S3cr3t\"]").unwrap_err();
        assert!(e.to_string().contains("S3cr3t"), "{e}");
        let text = json_error_text(&e);
        assert_eq!(text, "a value of the wrong type at line 1 column 9");
    }
}
