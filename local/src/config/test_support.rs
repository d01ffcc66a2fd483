//! Fixtures for the config submodules' tests: a throwaway home, loading from injected sources,
//! and the checks that no secret reaches an error or a `Debug`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Config, ConfigError, Hop, SshTarget, Transport};

pub(super) const SECRET: &str = "S3cr3t-pw!";

pub(super) struct TempDir(PathBuf);

impl TempDir {
    pub(super) fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "rsb-config-test-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(dir.join(".ssh")).unwrap();
        TempDir(dir)
    }
    pub(super) fn path(&self) -> &Path {
        &self.0
    }
    pub(super) fn write(&self, rel: &str, content: &str) -> PathBuf {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, content).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(unix)]
pub(super) fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Runs `from_sources` with the given env pairs; RSB_STATE_DIR points into the temp home.
pub(super) fn load_with(
    home: &TempDir,
    vars: &[(&str, &str)],
    config_file: Option<&Path>,
    ssh_config: Option<&Path>,
) -> Result<Config, ConfigError> {
    let mut map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    map.entry("RSB_STATE_DIR".into())
        .or_insert_with(|| home.path().join("state").display().to_string());
    let env = move |k: &str| map.get(k).cloned();
    Config::from_sources(&env, config_file, ssh_config, home.path(), home.path())
}

pub(super) fn env_only(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let home = TempDir::new();
    load_with(&home, vars, None, None)
}

pub(super) fn err(vars: &[(&str, &str)]) -> ConfigError {
    let e = env_only(vars).expect_err("expected a config error");
    assert_no_secret_err(&e);
    e
}

pub(super) fn assert_no_secret_err(e: &ConfigError) {
    for text in [&e.message, &e.hint, &format!("{e:?}"), &e.to_string()] {
        assert!(!text.contains(SECRET), "secret leaked: {text}");
        assert!(!text.contains("S3cr3t"), "partial secret leaked: {text}");
        assert!(!text.contains('\n'), "multi-line: {text}");
    }
    assert!(!e.hint.is_empty());
}

pub(super) fn assert_no_secret_cfg(c: &Config) {
    let dbg = format!("{c:?}");
    assert!(!dbg.contains(SECRET), "secret in Debug: {dbg}");
    assert!(!dbg.contains("S3cr3t"), "partial secret in Debug: {dbg}");
    for w in &c.warnings {
        assert!(!w.contains("S3cr3t"), "secret in warning: {w}");
    }
}

pub(super) fn ssh(c: &Config, i: usize) -> &SshTarget {
    match &c.sandboxes[i].transport {
        Transport::Ssh(t) => t,
        Transport::Local => panic!("sandbox {i} is local"),
    }
}

pub(super) const SSH_CONFIG: &str = "\
Host gpu1
    HostName 10.0.0.5
    Port 2200
    User alice
    IdentityFile ~/.ssh/missing_key
    IdentityFile ~/.ssh/gpu1_key
    ProxyJump bastion.example.com,jump2
    ConnectTimeout 7

Host bare
    User bob

Host jump2
    HostName 10.9.9.9
    Port 2022
    User jumper

Host *.internal
    HostName %h.example.org
    User carol
";

pub(super) fn hops(t: &SshTarget) -> Vec<String> {
    t.proxy_jump.iter().map(Hop::address).collect()
}
