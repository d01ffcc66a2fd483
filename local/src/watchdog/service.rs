//! Keeping a daemon alive: the platform service (a systemd --user unit on Linux, a launchd
//! LaunchAgent on macOS), `ensure_watchdog` (start the service, else a detached `rsb watchdog
//! run`), and whether a daemon is alive at all (its lock is held by a live `rsb watchdog run`; a
//! heartbeat row alone never counts), and `rsb watchdog restart`.
//!
//! Both service managers go through one structure, [`Manager`]: the file it reads, the argv of
//! every command install/uninstall/start/status run, are pure functions of their inputs, so the
//! launchd path is tested on Linux as closely as the systemd one. Under either manager the
//! daemon runs in the foreground (`watchdog run --mode service`): it never forks or detaches
//! itself, so the manager sees its real exit status and restarts it only after a failure.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde::Serialize;
use serde_json::Value;

use super::daemon;
use crate::error::{Kind, Result, RsbError};
use crate::store::layout::DAEMON_LOG;

pub const UNIT_NAME: &str = "rsb-watchdog.service";
pub const LAUNCHD_LABEL: &str = "com.rsb.watchdog";
/// The PATH a service gets when the installing shell has none (the seed's launchd default).
const DEFAULT_PATH: &str = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin";
/// A failed daemon is restarted after this long (systemd `RestartSec`, launchd
/// `ThrottleInterval`), so one that keeps failing (an unreadable state dir) does not spin.
pub const RESTART_AFTER_S: u64 = 10;
/// The argv after the binary, under either manager.
const RUN_ARGS: [&str; 4] = ["watchdog", "run", "--mode", "service"];

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"))
}

pub fn unit_path() -> PathBuf {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .unwrap_or_else(|| home().join(".config"));
    base.join("systemd").join("user").join(UNIT_NAME)
}

pub fn plist_path() -> PathBuf {
    home()
        .join("Library")
        .join("LaunchAgents")
        .join(format!("{LAUNCHD_LABEL}.plist"))
}

/// The user service manager of this OS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Manager {
    /// `systemctl --user` (Linux).
    Systemd,
    /// `launchctl` in the user's `gui/<uid>` domain (macOS).
    Launchd,
}

/// One command a service operation runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub argv: Vec<String>,
    /// A failure aborts the operation (else it is ignored: e.g. stopping what is not loaded).
    pub required: bool,
    /// Tries before a failure counts: launchd may still be tearing down the instance a
    /// `bootout` just stopped when `bootstrap` comes, and answers "Input/output error" then.
    pub attempts: u32,
}

fn step(argv: &[&str], required: bool) -> Step {
    Step {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        required,
        attempts: 1,
    }
}

impl Manager {
    pub fn here() -> Option<Manager> {
        if cfg!(target_os = "macos") {
            Some(Manager::Launchd)
        } else if cfg!(target_os = "linux") {
            Some(Manager::Systemd)
        } else {
            None
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Manager::Systemd => "systemd",
            Manager::Launchd => "launchd",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Manager::Systemd => UNIT_NAME,
            Manager::Launchd => LAUNCHD_LABEL,
        }
    }

    /// The unit or plist file.
    pub fn path(self) -> PathBuf {
        match self {
            Manager::Systemd => unit_path(),
            Manager::Launchd => plist_path(),
        }
    }

    /// The file's content for a daemon of `bin` (absolute) serving `state_dir`, asking the SSH
    /// agent at `auth_sock` (see [`stable_agent_socket`]).
    pub fn text(
        self,
        bin: &Path,
        state_dir: &Path,
        path_env: &str,
        auth_sock: Option<&Path>,
    ) -> Result<String> {
        match self {
            Manager::Systemd => Ok(unit_text(bin, state_dir, path_env, auth_sock)),
            Manager::Launchd => plist_text(bin, state_dir, path_env, auth_sock).map_err(|e| {
                RsbError::new(
                    Kind::Config,
                    format!("cannot write the launchd plist: {e}"),
                    "install rsb under a path that is valid UTF-8 and run it by its absolute path",
                )
            }),
        }
    }

    /// The launchd service target, `gui/<uid>/<label>`.
    fn target(uid: u32) -> String {
        format!("gui/{uid}/{LAUNCHD_LABEL}")
    }

    /// Run after the file is written. launchd loads a LaunchAgent at every login by itself;
    /// `bootstrap` loads it now (RunAtLoad starts it), after a `bootout` of the instance an
    /// earlier install may have loaded.
    pub fn install_steps(self, file: &Path, uid: u32, start: bool) -> Vec<Step> {
        let file = file.display().to_string();
        match self {
            Manager::Systemd => vec![
                step(&["systemctl", "--user", "daemon-reload"], true),
                if start {
                    step(&["systemctl", "--user", "enable", "--now", UNIT_NAME], true)
                } else {
                    step(&["systemctl", "--user", "enable", UNIT_NAME], true)
                },
            ],
            Manager::Launchd if start => vec![
                step(&["launchctl", "bootout", &Self::target(uid)], false),
                Step {
                    attempts: 5,
                    ..step(
                        &["launchctl", "bootstrap", &format!("gui/{uid}"), &file],
                        true,
                    )
                },
            ],
            Manager::Launchd => Vec::new(),
        }
    }

    /// Run before the file is removed.
    pub fn stop_steps(self, uid: u32) -> Vec<Step> {
        match self {
            Manager::Systemd => vec![step(
                &["systemctl", "--user", "disable", "--now", UNIT_NAME],
                false,
            )],
            Manager::Launchd => vec![step(&["launchctl", "bootout", &Self::target(uid)], false)],
        }
    }

    /// Run after the file is removed.
    pub fn forget_steps(self) -> Vec<Step> {
        match self {
            Manager::Systemd => vec![step(&["systemctl", "--user", "daemon-reload"], false)],
            Manager::Launchd => Vec::new(),
        }
    }

    /// Start the installed service now.
    pub fn start_argv(self, uid: u32) -> Vec<String> {
        match self {
            Manager::Systemd => step(&["systemctl", "--user", "start", UNIT_NAME], true).argv,
            Manager::Launchd => step(&["launchctl", "kickstart", &Self::target(uid)], true).argv,
        }
    }

    /// Succeeds while the service is loaded.
    pub fn status_argv(self, uid: u32) -> Vec<String> {
        match self {
            Manager::Systemd => step(&["systemctl", "--user", "is-enabled", UNIT_NAME], true).argv,
            Manager::Launchd => step(&["launchctl", "print", &Self::target(uid)], true).argv,
        }
    }
}

/// systemd's quoting for one word of `ExecStart=` / `Environment=` (`%` is a specifier).
fn systemd_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '%' => out.push_str("%%"),
            '$' => out.push_str("$$"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The systemd --user unit. `Restart=on-failure` brings a crashed daemon back; a clean exit
/// (another daemon already holds the lock) stays down.
pub fn unit_text(bin: &Path, state_dir: &Path, path_env: &str, auth_sock: Option<&Path>) -> String {
    let auth = auth_sock.map_or_else(String::new, |p| {
        format!(
            "Environment={}\n",
            systemd_quote(&format!("SSH_AUTH_SOCK={}", p.display()))
        )
    });
    format!(
        "# Generated by `rsb watchdog install`. Remove with `rsb watchdog uninstall`.\n\
         # To keep it running after you log out: loginctl enable-linger $USER\n\
         [Unit]\n\
         Description=rsb watchdog: watches long jobs on remote sandboxes\n\
         \n\
         [Service]\n\
         Type=simple\n\
         ExecStart={} {}\n\
         Environment={}\n\
         Environment={}\n\
         {auth}\
         Restart=on-failure\n\
         RestartSec={RESTART_AFTER_S}\n\
         \n\
         [Install]\n\
         WantedBy=default.target\n",
        systemd_quote(&bin.display().to_string()),
        RUN_ARGS.join(" "),
        systemd_quote(&format!("RSB_STATE_DIR={}", state_dir.display())),
        systemd_quote(&format!("PATH={path_env}")),
    )
}

/// The launchd LaunchAgent, written by the `plist` crate (so every string is escaped as a
/// property list needs): the absolute binary, `KeepAlive` only after a failure (a clean exit,
/// another daemon holding the lock, stays down, as systemd's `Restart=on-failure`), an
/// explicit PATH (launchd gives agents almost none), stdout and stderr in the state dir. Err
/// for a relative binary or a path that is not UTF-8 (a plist holds Unicode strings only).
pub fn plist_text(
    bin: &Path,
    state_dir: &Path,
    path_env: &str,
    auth_sock: Option<&Path>,
) -> std::result::Result<String, String> {
    use plist::{Dictionary, Value};
    if !bin.is_absolute() {
        return Err(format!("the binary path {} is not absolute", bin.display()));
    }
    let s = |p: &Path| -> std::result::Result<Value, String> {
        p.to_str()
            .map(|s| Value::String(s.into()))
            .ok_or_else(|| format!("{} is not valid UTF-8", p.display()))
    };
    let log = state_dir.join(DAEMON_LOG);
    let mut env = Dictionary::new();
    env.insert("PATH".into(), Value::String(path_env.into()));
    env.insert("RSB_STATE_DIR".into(), s(state_dir)?);
    if let Some(sock) = auth_sock {
        env.insert("SSH_AUTH_SOCK".into(), s(sock)?);
    }
    let mut keep_alive = Dictionary::new();
    keep_alive.insert("SuccessfulExit".into(), Value::Boolean(false));
    let mut args = vec![s(bin)?];
    args.extend(RUN_ARGS.iter().map(|a| Value::String((*a).into())));
    let mut d = Dictionary::new();
    d.insert("Label".into(), Value::String(LAUNCHD_LABEL.into()));
    d.insert("ProgramArguments".into(), Value::Array(args));
    d.insert("RunAtLoad".into(), Value::Boolean(true));
    d.insert("KeepAlive".into(), Value::Dictionary(keep_alive));
    d.insert(
        "ThrottleInterval".into(),
        Value::Integer(RESTART_AFTER_S.into()),
    );
    d.insert("StandardOutPath".into(), s(&log)?);
    d.insert("StandardErrorPath".into(), s(&log)?);
    d.insert("EnvironmentVariables".into(), Value::Dictionary(env));
    let mut out = Vec::new();
    Value::Dictionary(d)
        .to_writer_xml(&mut out)
        .map_err(|e| e.to_string())?;
    out.push(b'\n');
    String::from_utf8(out).map_err(|e| e.to_string())
}

fn path_env() -> String {
    std::env::var("PATH")
        .ok()
        .filter(|p| !p.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_PATH.into())
}

/// The path the service (and a detached daemon) runs rsb by: the one the user ran it by when
/// that is the same file (`/opt/homebrew/bin/rsb`, `~/.nix-profile/bin/rsb`, a symlink that
/// an upgrade re-points), else the binary itself. The resolved path
/// (`…/Cellar/rsb/1.2/bin/rsb`, `/nix/store/…-rsb-1.2/bin/rsb`) disappears with the next
/// upgrade, and the service would fail to start from then on.
fn rsb_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .map_err(|e| {
            RsbError::new(
                Kind::Internal,
                format!("cannot find rsb's own binary: {e}"),
                "run rsb from its installed path",
            )
        })?;
    let argv0 = std::env::args_os().next().map(PathBuf::from);
    let cwd = std::env::current_dir().ok();
    Ok(stable_binary(
        &exe,
        argv0.as_deref(),
        std::env::var_os("PATH").as_deref(),
        cwd.as_deref(),
    ))
}

/// See [`rsb_binary`]: `argv0` (made absolute against `cwd`, or looked up on `path_var` when
/// it is a bare name) if it resolves to `exe`, else `exe`.
fn stable_binary(
    exe: &Path,
    argv0: Option<&Path>,
    path_var: Option<&std::ffi::OsStr>,
    cwd: Option<&Path>,
) -> PathBuf {
    let same = |p: &Path| p.canonicalize().is_ok_and(|c| c == exe);
    let candidate = argv0.and_then(|a| {
        if a.components().count() > 1 {
            let abs = if a.is_absolute() {
                a.to_path_buf()
            } else {
                cwd?.join(a)
            };
            Some(abs)
        } else {
            let name = a.to_str()?;
            rsb_agent::proc::find_executable(name, path_var)
        }
    });
    match candidate {
        // Without `.` or `..` parts, which would tie the path to directories of the moment.
        Some(c) if same(&c) => c
            .components()
            .filter(|c| !matches!(c, std::path::Component::CurDir))
            .collect::<PathBuf>(),
        _ => exe.to_path_buf(),
    }
}

/// Run a service manager command with a deadline; Ok(stdout) or Err(one line).
fn run(cmd: &mut Command, timeout: Duration) -> std::result::Result<String, String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{:?} did not finish in time", cmd.get_program()));
            }
        }
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let text = |b: &[u8]| crate::store::watch_model::one_line(&String::from_utf8_lossy(b));
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        let err = text(&out.stderr);
        Err(if err.is_empty() {
            text(&out.stdout)
        } else {
            err
        })
    }
}

/// Run one argv (`argv[0]` is the program) with the service-manager deadline.
fn run_argv(argv: &[String]) -> std::result::Result<String, String> {
    let (prog, args) = argv.split_first().ok_or("empty command")?;
    run(Command::new(prog).args(args), Duration::from_secs(15))
}

/// Run `steps` in order; the first required one that still fails after its attempts is Err.
fn run_steps(steps: &[Step]) -> std::result::Result<(), String> {
    for s in steps {
        let mut result = run_argv(&s.argv);
        for _ in 1..s.attempts {
            if result.is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
            result = run_argv(&s.argv);
        }
        match result {
            Err(e) if s.required => return Err(format!("`{}` failed: {e}", s.argv.join(" "))),
            _ => {}
        }
    }
    Ok(())
}

fn systemctl(args: &[&str]) -> std::result::Result<String, String> {
    run(
        Command::new("systemctl").arg("--user").args(args),
        Duration::from_secs(15),
    )
}

/// Whether this user has a systemd user manager to talk to.
fn user_systemd() -> std::result::Result<(), String> {
    systemctl(&["show-environment"]).map(|_| ())
}

fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

fn linger_note() -> Option<String> {
    let user = std::env::var("USER").unwrap_or_else(|_| uid().to_string());
    let out = run(
        Command::new("loginctl").args(["show-user", &user, "--property=Linger"]),
        Duration::from_secs(5),
    )
    .ok()?;
    (out.trim() != "Linger=yes").then(|| {
        format!(
            "the watchdog stops when you log out; run `loginctl enable-linger {user}` to keep it running"
        )
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct InstallInfo {
    pub kind: &'static str,
    pub label: String,
    /// The unit or plist written (`plist_path` is the seed's key).
    pub plist_path: String,
    pub stdout_path: String,
    pub stderr_path: String,
    pub config_path: String,
    pub db_path: String,
    pub started: bool,
    /// The SSH agent socket written into the service (see [`stable_agent_socket`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssh_auth_sock: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

fn no_service(detail: &str) -> RsbError {
    RsbError::new(
        Kind::Config,
        format!("no user service manager here ({detail})"),
        "run `rsb watchdog run` yourself (in tmux, or from your own init system) instead",
    )
}

/// Write and (with `start`) start the platform service for `state_dir`.
pub fn install(state_dir: &Path, start: bool) -> Result<InstallInfo> {
    let Some(m) = Manager::here() else {
        return Err(no_service(
            "only systemd (Linux) and launchd (macOS) are supported",
        ));
    };
    let bin = rsb_binary()?;
    let db_path = crate::store::db_path(state_dir).display().to_string();
    let config_path = crate::config::config_file_path().display().to_string();
    if m == Manager::Systemd {
        user_systemd().map_err(|e| no_service(&format!("systemctl --user: {e}")))?;
    }
    // The user's SSH agent, for sandboxes that log in through it: the daemon a service manager
    // starts has only the manager's environment (launchd's own per-boot socket, not 1Password's
    // or Secretive's), so a socket that lasts is written into the service.
    let shell_sock = shell_agent_socket();
    let tmpdir = std::env::var_os("TMPDIR").map(PathBuf::from);
    let auth_sock = shell_sock
        .as_deref()
        .filter(|s| stable_agent_socket(s, tmpdir.as_deref()));
    let text = m.text(&bin, state_dir, &path_env(), auth_sock)?;
    let path = m.path();
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| io_err(d, e))?;
    }
    crate::store::write_private(&path, text.as_bytes()).map_err(|e| io_err(&path, e))?;
    run_steps(&m.install_steps(&path, uid(), start)).map_err(|e| no_service(&e))?;
    let (log, mut note) = match m {
        Manager::Launchd => (state_dir.join(DAEMON_LOG).display().to_string(), None),
        Manager::Systemd => ("journalctl --user -u rsb-watchdog".into(), linger_note()),
    };
    if let Some(sock) = shell_sock.as_deref().filter(|_| auth_sock.is_none()) {
        let n = unstable_agent_note(sock);
        note = Some(note.map_or(n.clone(), |a| format!("{a}; {n}")));
    }
    Ok(InstallInfo {
        kind: m.kind(),
        label: m.label().into(),
        plist_path: path.display().to_string(),
        stdout_path: log.clone(),
        stderr_path: log,
        config_path,
        db_path,
        started: start,
        ssh_auth_sock: auth_sock.map(|p| p.display().to_string()),
        note,
    })
}

/// Why the shell's agent socket is not written into the service, and what to do instead.
pub fn unstable_agent_note(sock: &Path) -> String {
    format!(
        "your SSH_AUTH_SOCK ({}) is made anew at each login, so the service does not get it: \
         for sandboxes that log in through an agent, set IdentityAgent in ~/.ssh/config to a \
         lasting socket (1Password, Secretive, gpg-agent) or give them a key file",
        sock.display()
    )
}

fn io_err(p: &Path, e: std::io::Error) -> RsbError {
    RsbError::new(
        Kind::Internal,
        format!("cannot write {}: {}", p.display(), e.kind()),
        "check the permissions of that directory",
    )
}

#[derive(Debug, Clone, Serialize)]
pub struct Removal {
    pub label: String,
    pub plist_path: String,
    pub removed: bool,
}

/// Stop and remove the service (the store, events and watches stay).
pub fn uninstall() -> Result<Removal> {
    let Some(m) = Manager::here() else {
        return Err(no_service(
            "only systemd (Linux) and launchd (macOS) are supported",
        ));
    };
    let path = m.path();
    if path.exists() {
        let _ = run_steps(&m.stop_steps(uid()));
    }
    let removed = std::fs::remove_file(&path).is_ok();
    if removed {
        let _ = run_steps(&m.forget_steps());
    }
    Ok(Removal {
        label: m.label().into(),
        plist_path: path.display().to_string(),
        removed,
    })
}

/// The `RSB_STATE_DIR` a unit or plist (its bytes) gives the daemon.
fn state_dir_in(m: Manager, file: &[u8]) -> Option<PathBuf> {
    env_in(m, file, "RSB_STATE_DIR").map(PathBuf::from)
}

/// The value of the variable `key` a unit or plist (its bytes) gives the daemon.
fn env_in(m: Manager, file: &[u8], key: &str) -> Option<String> {
    match m {
        Manager::Launchd => {
            let v = plist::Value::from_reader(std::io::Cursor::new(file)).ok()?;
            let value = v
                .as_dictionary()?
                .get("EnvironmentVariables")?
                .as_dictionary()?
                .get(key)?
                .as_string()?;
            Some(value.to_string())
        }
        Manager::Systemd => {
            let text = std::str::from_utf8(file).ok()?;
            let needle = format!("\"{key}=");
            let i = text.find(&needle)?;
            systemd_unquote(&text[i + needle.len()..], true)
        }
    }
}

/// Whether the service can keep asking the SSH agent at `sock`: an absolute path that outlives
/// this login (1Password's and Secretive's under `~/Library`, gpg-agent's and gnome-keyring's
/// under `/run/user/UID`). A socket under a temporary directory (ssh-agent's
/// `/tmp/ssh-XXXX/agent.N`, launchd's `/private/tmp/com.apple.launchd.*/Listeners`, anything
/// under `$TMPDIR` or macOS's `/var/folders`) is made anew at each login or boot: written
/// into the service it would leave the daemon a dead path.
pub fn stable_agent_socket(sock: &Path, tmpdir: Option<&Path>) -> bool {
    const TEMPORARY: [&str; 7] = [
        "/tmp",
        "/private/tmp",
        "/var/tmp",
        "/private/var/tmp",
        "/var/folders",
        "/private/var/folders",
        "/dev/shm",
    ];
    sock.is_absolute()
        && !sock
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        && !TEMPORARY.iter().any(|t| sock.starts_with(t))
        && !tmpdir.is_some_and(|t| t.is_absolute() && t != Path::new("/") && sock.starts_with(t))
}

/// This shell's `SSH_AUTH_SOCK`, when it names a socket.
pub fn shell_agent_socket() -> Option<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let sock = PathBuf::from(std::env::var_os("SSH_AUTH_SOCK").filter(|s| !s.is_empty())?);
    std::fs::metadata(&sock)
        .is_ok_and(|m| m.file_type().is_socket())
        .then_some(sock)
}

/// The binary an installed unit or plist (its bytes) runs: `ExecStart=`'s first word, or
/// `ProgramArguments`' first string.
fn binary_in(m: Manager, file: &[u8]) -> Option<PathBuf> {
    match m {
        Manager::Launchd => {
            let v = plist::Value::from_reader(std::io::Cursor::new(file)).ok()?;
            let bin = v
                .as_dictionary()?
                .get("ProgramArguments")?
                .as_array()?
                .first()?
                .as_string()?;
            Some(PathBuf::from(bin))
        }
        Manager::Systemd => {
            let text = std::str::from_utf8(file).ok()?;
            let line = text
                .lines()
                .find_map(|l| l.trim_start().strip_prefix("ExecStart="))?;
            // A hand-edited unit may not quote the path, or prefix it with systemd's `-`/`@`/...
            let line = line.trim_start_matches(['-', '@', ':', '+', '!']);
            match line.strip_prefix('"') {
                Some(quoted) => systemd_unquote(quoted, true),
                None => systemd_unquote(line.split_ascii_whitespace().next()?, false),
            }
            .map(PathBuf::from)
        }
    }
}

/// A regular file (through symlinks) that someone may execute.
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Undoes [`systemd_quote`]: the text up to the closing quote (when `quoted`), else all of it.
fn systemd_unquote(s: &str, quoted: bool) -> Option<String> {
    let mut chars = s.chars();
    let mut out = String::new();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted => return Some(out),
            '\n' => break,
            '\\' => out.push(chars.next()?),
            '%' | '$' => {
                chars.next()?;
                out.push(c);
            }
            c => out.push(c),
        }
    }
    Some(out)
}

#[derive(Debug, Clone, Serialize)]
pub struct ServiceStatus {
    /// `systemd`, `launchd` or `none`.
    pub kind: &'static str,
    pub installed: bool,
    pub path: String,
    /// The installed service watches this state dir (not another one).
    pub for_this_state_dir: bool,
    /// The rsb binary the installed service runs.
    pub binary: Option<String>,
    /// That binary is no longer there (an upgrade removed a versioned path): the service
    /// manager fails to start the daemon until `rsb watchdog install` is run again.
    pub binary_missing: bool,
    /// The SSH agent socket the service gives the daemon (`SSH_AUTH_SOCK` in its file).
    pub ssh_auth_sock: Option<String>,
}

pub fn service_status(state_dir: &Path) -> ServiceStatus {
    let m = Manager::here();
    let path = m.map(Manager::path).unwrap_or_default();
    // The unit or plist, read once for all it says.
    let file = m.and_then(|m| Some((m, std::fs::read(m.path()).ok()?)));
    let for_dir = file.as_ref().and_then(|(m, f)| state_dir_in(*m, f));
    let binary = file
        .as_ref()
        .and_then(|(m, f)| binary_in(*m, f))
        .filter(|b| b.is_absolute());
    ServiceStatus {
        kind: m.map_or("none", Manager::kind),
        installed: path.exists(),
        path: path.display().to_string(),
        for_this_state_dir: for_dir.as_deref() == Some(state_dir),
        binary_missing: binary.as_deref().is_some_and(|b| !is_executable(b)),
        binary: binary.map(|b| b.display().to_string()),
        ssh_auth_sock: file
            .as_ref()
            .and_then(|(m, f)| env_in(*m, f, "SSH_AUTH_SOCK")),
    }
}

/// The seed's `launchd` block of the status payload.
pub fn launchd_status() -> Value {
    if Manager::here() != Some(Manager::Launchd) {
        return serde_json::json!({
            "platform": std::env::consts::OS,
            "label": LAUNCHD_LABEL,
            "loaded": false,
            "detail": "launchd status is only available on macOS",
        });
    }
    let r = run_argv(&Manager::Launchd.status_argv(uid()));
    serde_json::json!({
        "platform": "darwin",
        "label": LAUNCHD_LABEL,
        "loaded": r.is_ok(),
        "plist_path": plist_path().display().to_string(),
        "detail": match &r { Ok(_) => String::new(), Err(e) => e.clone() },
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct DaemonInfo {
    pub running: bool,
    pub pid: Option<i64>,
    /// `service`, `detached` or `foreground`, as the daemon recorded it.
    pub mode: Option<String>,
    pub heartbeat_age_s: Option<i64>,
    pub lock_held: bool,
}

/// The daemon of `state_dir`, from its lock and `heartbeat` (the store's `heartbeat` row, read
/// by the caller: [`crate::store::watches::meta_get`]).
pub fn daemon_info(heartbeat: Option<(Value, i64)>, state_dir: &Path) -> DaemonInfo {
    // Running means: something holds the daemon's flock (released by the kernel however the
    // process died) and the pid it wrote is a live `rsb watchdog run`. A heartbeat row alone
    // proves nothing: a daemon SIGKILLed, SIGTERMed or idle-exited a moment ago left a fresh
    // one, and a watch registered then would never be checked.
    let holder = daemon::running_daemon(state_dir).map(|h| h.pid);
    let hb = heartbeat;
    let now = crate::store::now_s();
    let age = hb
        .as_ref()
        .and_then(|(v, _)| v["ts"].as_i64())
        .map(|ts| (now - ts).max(0));
    let meta = hb.map(|(v, _)| v).unwrap_or(Value::Null);
    DaemonInfo {
        running: holder.is_some(),
        pid: holder,
        mode: meta["mode"].as_str().map(str::to_string),
        heartbeat_age_s: age,
        lock_held: holder.is_some(),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct EnsureReport {
    /// `already_running`, `service_started` or `spawned_detached`.
    pub action: &'static str,
    pub pid: Option<i64>,
    pub mode: Option<String>,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub install_hint: Option<String>,
}

fn wait_for_lock(state_dir: &Path, within: Duration) -> Option<i64> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(pid) = daemon::lock_holder(state_dir) {
            return Some(pid);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

const INSTALL_HINT: &str = "run `rsb watchdog install` to keep the watchdog running across reboots (systemd --user / launchd)";

/// Make sure a daemon serves `state_dir`: nothing if one is alive (`info`, as
/// [`daemon_info`] read it); else start the installed service (if it serves this state dir);
/// else spawn a detached `rsb watchdog run`. Blocking: it runs the service manager and waits
/// for the daemon's lock.
pub fn ensure(info: DaemonInfo, state_dir: &Path) -> Result<EnsureReport> {
    if info.running {
        return Ok(EnsureReport {
            action: "already_running",
            pid: info.pid,
            mode: info.mode,
            detail: "a watchdog is already running for this state dir".into(),
            install_hint: None,
        });
    }
    let svc = service_status(state_dir);
    if let Some(m) = Manager::here()
        && svc.installed
        && svc.for_this_state_dir
    {
        match run_argv(&m.start_argv(uid())) {
            Ok(_) => {
                let pid = wait_for_lock(state_dir, Duration::from_secs(5));
                return Ok(EnsureReport {
                    action: "service_started",
                    pid,
                    mode: Some("service".into()),
                    detail: format!("started the installed {} service", svc.kind),
                    install_hint: None,
                });
            }
            Err(e) => {
                tracing::warn!("the installed watchdog service did not start ({e}); spawning one")
            }
        }
    }
    let pid = spawn_detached(state_dir)?;
    let pid = wait_for_lock(state_dir, Duration::from_secs(5)).or(Some(pid as i64));
    Ok(EnsureReport {
        action: "spawned_detached",
        pid,
        mode: Some("detached".into()),
        detail: format!(
            "started a detached `rsb watchdog run` (logs: {}); it stops after 10 minutes without active watches",
            state_dir.join(DAEMON_LOG).display()
        ),
        install_hint: Some(INSTALL_HINT.into()),
    })
}

/// `rsb watchdog restart`: stop the running daemon (SIGTERM; SIGKILL if it still holds the
/// lock 10 s later) and start one as [`ensure`] does (the installed service, else detached),
/// so it runs the current binary with the current config.
pub fn restart(state_dir: &Path) -> Result<EnsureReport> {
    if let Some(daemon) = daemon::running_daemon(state_dir) {
        let pid = daemon.pid;
        let stopped = |within: Duration| {
            let deadline = Instant::now() + within;
            loop {
                if daemon::lock_holder(state_dir).is_none() {
                    return true;
                }
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        // Only to the process that wrote the lock (pid and start time), checked to be a
        // watchdog: never to one that took its pid since.
        daemon.signal(rsb_agent::proc::Signal::TERM);
        if !stopped(Duration::from_secs(10)) {
            daemon.signal(rsb_agent::proc::Signal::KILL);
            if !stopped(Duration::from_secs(3)) {
                return Err(RsbError::internal(format!(
                    "the watchdog (pid {pid}) still holds its lock after SIGKILL"
                )));
            }
        }
    }
    // Stopped: the lock decides (a heartbeat says nothing of a daemon that is gone).
    ensure(daemon_info(None, state_dir), state_dir)
}

/// Spawn `rsb watchdog run --mode detached` in its own session, logging to the state dir, with
/// an environment stripped of rsb's sandbox configuration (the daemon reads the persisted,
/// secret-free definitions; it must not inherit passwords).
pub fn spawn_detached(state_dir: &Path) -> Result<u32> {
    use std::os::unix::{fs::OpenOptionsExt, process::CommandExt};
    let bin = rsb_binary()?;
    let log = state_dir.join(DAEMON_LOG);
    let open_log = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log)
    };
    let (out, err) = match (open_log(), open_log()) {
        (Ok(a), Ok(b)) => (Stdio::from(a), Stdio::from(b)),
        _ => (Stdio::null(), Stdio::null()),
    };
    let mut cmd = Command::new(bin);
    cmd.args(["watchdog", "run", "--mode", "detached"])
        .current_dir(state_dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // Without the configuration's secrets and the variables naming them (sudo_password_env's
    // too), and without any variable holding a secret's value: a daemon outlives the session.
    cmd.env_clear().envs(crate::connect::rsb_child_env());
    for (k, _) in std::env::vars_os() {
        let up = k.to_string_lossy().to_ascii_uppercase();
        if up.starts_with("REMOTE_") || up.contains("PASSWORD") || up.contains("PASSPHRASE") {
            cmd.env_remove(&k);
        }
    }
    cmd.env("RSB_STATE_DIR", state_dir);
    // SAFETY: setsid is async-signal-safe; it detaches the daemon from the server's session
    // so the client killing the server's process group does not kill the watchdog.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| {
        RsbError::new(
            Kind::Internal,
            format!("cannot start the watchdog: {e}"),
            "run `rsb watchdog run` yourself",
        )
    })?;
    let pid = child.id();
    // Reap it when it exits, so it never lingers as a zombie of this server.
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 44: the plist named the canonical binary (Homebrew's versioned Cellar path), which
    /// an upgrade removes. The path the user ran rsb by is kept when it is the same file.
    #[test]
    fn the_service_runs_rsb_by_the_path_that_survives_an_upgrade() {
        use std::os::unix::fs::{PermissionsExt, symlink};
        let d = tempfile::tempdir().unwrap();
        let d = d.path().canonicalize().unwrap();
        let cellar = d.join("Cellar/rsb/1.2/bin");
        let bin = d.join("bin");
        std::fs::create_dir_all(&cellar).unwrap();
        std::fs::create_dir_all(&bin).unwrap();
        let exe = cellar.join("rsb");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        symlink("../Cellar/rsb/1.2/bin/rsb", bin.join("rsb")).unwrap();
        let path = std::ffi::OsString::from(format!("/nonexistent:{}", bin.display()));
        // Run as `rsb` from PATH, as `/…/bin/rsb`, or as `./bin/rsb` from its parent.
        for (argv0, cwd) in [
            (Path::new("rsb"), None),
            (&*bin.join("rsb"), None),
            (Path::new("./bin/rsb"), Some(&*d)),
        ] {
            assert_eq!(
                stable_binary(&exe, Some(argv0), Some(&path), cwd),
                bin.join("rsb"),
                "{argv0:?}"
            );
        }
        // A name on PATH that is another program, or no argv0: the binary itself.
        let other = d.join("other");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("rsb"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(other.join("rsb"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let elsewhere = std::ffi::OsString::from(other.display().to_string());
        assert_eq!(
            stable_binary(&exe, Some(Path::new("rsb")), Some(&elsewhere), None),
            exe
        );
        assert_eq!(stable_binary(&exe, None, Some(&path), None), exe);
    }

    #[test]
    fn unit_quotes_paths_and_names_the_state_dir() {
        let t = unit_text(
            Path::new("/opt/my rsb/rsb"),
            Path::new("/home/u/st 100%"),
            "/usr/bin:/bin",
            None,
        );
        assert!(
            t.contains("ExecStart=\"/opt/my rsb/rsb\" watchdog run --mode service"),
            "{t}"
        );
        assert!(
            t.contains("Environment=\"RSB_STATE_DIR=/home/u/st 100%%\""),
            "{t}"
        );
        assert!(t.contains("Restart=on-failure"));
        assert!(t.contains("enable-linger"));
    }

    const HOSTILE_BIN: &str = "/Applications/My \"rsb\" & <co> 'x'/rsb";
    const HOSTILE_STATE: &str = "/Users/a b/Library/Application Support/rsb \"q\" $HOME %h \\";

    #[test]
    fn plist_parses_back_with_exactly_the_launchd_keys_and_paths_intact() {
        let t = plist_text(
            Path::new(HOSTILE_BIN),
            Path::new(HOSTILE_STATE),
            "/opt/homebrew/bin:/usr/bin:/bin",
            None,
        )
        .unwrap();
        let v = plist::Value::from_reader(std::io::Cursor::new(t.as_bytes())).unwrap();
        let d = v.as_dictionary().unwrap();
        let mut keys: Vec<&str> = d.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "EnvironmentVariables",
                "KeepAlive",
                "Label",
                "ProgramArguments",
                "RunAtLoad",
                "StandardErrorPath",
                "StandardOutPath",
                "ThrottleInterval",
            ]
        );
        let str_of = |k: &str| d.get(k).and_then(plist::Value::as_string).unwrap();
        assert_eq!(str_of("Label"), LAUNCHD_LABEL);
        let args: Vec<&str> = d["ProgramArguments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_string().unwrap())
            .collect();
        assert_eq!(args, [HOSTILE_BIN, "watchdog", "run", "--mode", "service"]);
        assert_eq!(d["RunAtLoad"].as_boolean(), Some(true));
        // Restarted after a failure only: a clean exit (the lock is taken) stays down.
        let keep = d["KeepAlive"].as_dictionary().unwrap();
        assert_eq!(keep.len(), 1);
        assert_eq!(keep["SuccessfulExit"].as_boolean(), Some(false));
        assert_eq!(
            d["ThrottleInterval"].as_unsigned_integer(),
            Some(RESTART_AFTER_S)
        );
        let log = format!("{HOSTILE_STATE}/{DAEMON_LOG}");
        assert_eq!(str_of("StandardOutPath"), log);
        assert_eq!(str_of("StandardErrorPath"), log);
        let env = d["EnvironmentVariables"].as_dictionary().unwrap();
        assert_eq!(env.len(), 2);
        assert_eq!(
            env["PATH"].as_string(),
            Some("/opt/homebrew/bin:/usr/bin:/bin")
        );
        assert_eq!(env["RSB_STATE_DIR"].as_string(), Some(HOSTILE_STATE));
        assert_eq!(
            state_dir_in(Manager::Launchd, t.as_bytes()).as_deref(),
            Some(Path::new(HOSTILE_STATE))
        );
    }

    #[test]
    fn plist_refuses_a_relative_binary() {
        let e = plist_text(Path::new("target/rsb"), Path::new("/s"), "/bin", None).unwrap_err();
        assert!(e.contains("not absolute"), "{e}");
        let e = Manager::Launchd
            .text(Path::new("rsb"), Path::new("/s"), "/bin", None)
            .unwrap_err();
        assert!(!e.message.contains('\n'), "one line: {}", e.message);
    }

    #[test]
    fn unit_state_dir_reads_back_through_the_quoting() {
        let t = unit_text(
            Path::new(HOSTILE_BIN),
            Path::new(HOSTILE_STATE),
            "/bin",
            None,
        );
        assert_eq!(
            state_dir_in(Manager::Systemd, t.as_bytes()).as_deref(),
            Some(Path::new(HOSTILE_STATE))
        );
    }

    /// Issue 44: under launchd the daemon got the system's SSH_AUTH_SOCK, not the user's agent.
    /// A lasting socket is written into the service and reads back through both formats; one
    /// made anew at each login is not.
    #[test]
    fn a_lasting_agent_socket_is_written_into_the_service() {
        let tmp = Some(Path::new("/var/folders/xy/T"));
        for lasting in [
            "/Users/a b/Library/Group Containers/2BUA8C4S2C.com.1password/t/agent.sock",
            "/Users/a/Library/Containers/com.maxgoedjen.Secretive.SecretAgent/Data/socket.ssh",
            "/run/user/1000/gnupg/S.gpg-agent.ssh",
            "/home/u/.ssh/agent %h $X \"q\".sock",
        ] {
            assert!(stable_agent_socket(Path::new(lasting), tmp), "{lasting}");
        }
        for passing in [
            "/tmp/ssh-XXXXabc/agent.1234",
            "/private/tmp/com.apple.launchd.AbC/Listeners",
            "/var/folders/xy/T/ssh-1/agent.2",
            "/private/var/folders/xy/T/agent",
            "relative/agent.sock",
            "/home/u/../../tmp/ssh-1/agent",
        ] {
            assert!(!stable_agent_socket(Path::new(passing), tmp), "{passing}");
        }
        assert!(!stable_agent_socket(
            Path::new("/scratch/me/tmp/a.sock"),
            Some(Path::new("/scratch/me/tmp"))
        ));
        let sock = Path::new("/home/u/.ssh/agent %h $X \"q\".sock");
        for m in [Manager::Systemd, Manager::Launchd] {
            let t = m
                .text(
                    Path::new(HOSTILE_BIN),
                    Path::new(HOSTILE_STATE),
                    "/bin",
                    Some(sock),
                )
                .unwrap();
            assert_eq!(
                env_in(m, t.as_bytes(), "SSH_AUTH_SOCK").as_deref(),
                sock.to_str(),
                "{m:?}"
            );
            assert_eq!(
                state_dir_in(m, t.as_bytes()).as_deref(),
                Some(Path::new(HOSTILE_STATE))
            );
            let without = m
                .text(
                    Path::new(HOSTILE_BIN),
                    Path::new(HOSTILE_STATE),
                    "/bin",
                    None,
                )
                .unwrap();
            assert_eq!(env_in(m, without.as_bytes(), "SSH_AUTH_SOCK"), None);
        }
    }

    /// `rsb doctor` names the binary an installed service runs, and warns when it is gone.
    #[test]
    fn the_binary_reads_back_from_the_unit_and_the_plist() {
        let bin = Path::new("/opt/my %i $x \\ \"rsb\"/bin/rsb");
        for m in [Manager::Systemd, Manager::Launchd] {
            for b in [Path::new(HOSTILE_BIN), bin] {
                let t = m.text(b, Path::new(HOSTILE_STATE), "/bin", None).unwrap();
                assert_eq!(binary_in(m, t.as_bytes()).as_deref(), Some(b), "{m:?}");
            }
        }
        // Hand-written units: unquoted, with systemd's prefixes.
        for line in [
            "ExecStart=/usr/bin/rsb watchdog run",
            "ExecStart=-/usr/bin/rsb",
        ] {
            let t = format!("[Service]\n{line}\n");
            assert_eq!(
                binary_in(Manager::Systemd, t.as_bytes()).as_deref(),
                Some(Path::new("/usr/bin/rsb"))
            );
        }
        assert_eq!(binary_in(Manager::Systemd, b"[Service]\n"), None);
        assert_eq!(binary_in(Manager::Launchd, b"not a plist"), None);
    }

    fn argvs(steps: &[Step]) -> Vec<(Vec<&str>, bool, u32)> {
        steps
            .iter()
            .map(|s| {
                (
                    s.argv.iter().map(String::as_str).collect(),
                    s.required,
                    s.attempts,
                )
            })
            .collect()
    }

    #[test]
    fn launchctl_gets_exactly_these_argv() {
        let plist = Path::new("/Users/a b/Library/LaunchAgents/com.rsb.watchdog.plist");
        let m = Manager::Launchd;
        assert_eq!(
            argvs(&m.install_steps(plist, 501, true)),
            [
                (
                    vec!["launchctl", "bootout", "gui/501/com.rsb.watchdog"],
                    false,
                    1
                ),
                (
                    vec![
                        "launchctl",
                        "bootstrap",
                        "gui/501",
                        "/Users/a b/Library/LaunchAgents/com.rsb.watchdog.plist",
                    ],
                    true,
                    5
                ),
            ]
        );
        // Not started now: launchd loads ~/Library/LaunchAgents at the next login by itself.
        assert!(m.install_steps(plist, 501, false).is_empty());
        assert_eq!(
            argvs(&m.stop_steps(501)),
            [(
                vec!["launchctl", "bootout", "gui/501/com.rsb.watchdog"],
                false,
                1
            )]
        );
        assert!(m.forget_steps().is_empty());
        assert_eq!(
            m.start_argv(501),
            ["launchctl", "kickstart", "gui/501/com.rsb.watchdog"]
        );
        assert_eq!(
            m.status_argv(501),
            ["launchctl", "print", "gui/501/com.rsb.watchdog"]
        );
    }

    #[test]
    fn systemctl_gets_exactly_these_argv() {
        let m = Manager::Systemd;
        let unit = Path::new("/home/u/.config/systemd/user/rsb-watchdog.service");
        assert_eq!(
            argvs(&m.install_steps(unit, 1000, true)),
            [
                (vec!["systemctl", "--user", "daemon-reload"], true, 1),
                (
                    vec!["systemctl", "--user", "enable", "--now", UNIT_NAME],
                    true,
                    1
                ),
            ]
        );
        assert_eq!(
            argvs(&m.install_steps(unit, 1000, false))[1].0,
            ["systemctl", "--user", "enable", UNIT_NAME]
        );
        assert_eq!(
            argvs(&m.stop_steps(1000)),
            [(
                vec!["systemctl", "--user", "disable", "--now", UNIT_NAME],
                false,
                1
            )]
        );
        assert_eq!(
            m.start_argv(1000),
            ["systemctl", "--user", "start", UNIT_NAME]
        );
    }
}
