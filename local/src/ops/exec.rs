//! `exec_bash`: validation, the request sent to the agent, and the seed-compatible reply.

use rsb_protocol::{Chunk, ExecInput, ExecRequest, ExecResult};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::{
    client::AgentClient,
    config::SandboxConfig,
    error::{Kind, Result, RsbError},
    ops::{action::Caller, output::render},
    pool::Pool,
};

pub const DEFAULT_TIMEOUT_S: i64 = 120;
pub const DEFAULT_MAX_OUTPUT_CHARS: i64 = 20_000;
/// Keeps one reply inside a frame and inside what a model can use.
pub const MAX_OUTPUT_CHARS: i64 = 4 * 1024 * 1024;
/// One day; longer work belongs in a background job.
pub const MAX_TIMEOUT_S: i64 = 86_400;
/// After the timeout the process group gets SIGTERM, then SIGKILL after this grace.
pub const KILL_GRACE_MS: u64 = 2_000;

/// What every exec entry (MCP tool, CLI) refuses before anything is sent.
fn check_command(command: &str) -> Result<()> {
    if command.trim().is_empty() {
        return Err(RsbError::invalid(
            "command cannot be empty",
            "pass the bash command to run",
        ));
    }
    if command.contains('\0') {
        return Err(RsbError::invalid(
            "command contains a NUL byte",
            "remove the NUL byte",
        ));
    }
    Ok(())
}

pub fn build_request(
    command: &str,
    cwd: Option<&str>,
    timeout_s: i64,
    max_output_chars: i64,
) -> Result<ExecRequest> {
    check_command(command)?;
    if timeout_s <= 0 || timeout_s > MAX_TIMEOUT_S {
        return Err(RsbError::invalid(
            format!("timeout_s must be between 1 and {MAX_TIMEOUT_S} (got {timeout_s})"),
            "use exec_bash_background for longer work",
        ));
    }
    build_request_ms(command, cwd, timeout_s as u64 * 1000, max_output_chars)
}

/// Like [`build_request`] with the timeout in ms, where 0 means none (the CLI's default, as
/// with `ssh host cmd`); the MCP tool always has one.
pub fn build_request_ms(
    command: &str,
    cwd: Option<&str>,
    timeout_ms: u64,
    max_output_chars: i64,
) -> Result<ExecRequest> {
    check_command(command)?;
    if max_output_chars <= 0 || max_output_chars > MAX_OUTPUT_CHARS {
        return Err(RsbError::invalid(
            format!(
                "max_output_chars must be between 1 and {MAX_OUTPUT_CHARS} (got {max_output_chars})"
            ),
            "ask for less output, or redirect it to a file and read it with read_remote_file",
        ));
    }
    let cwd = match cwd {
        None => None,
        Some(c) if c.trim().is_empty() => None,
        Some(c) if c.contains('\0') || c.contains('\n') => {
            return Err(RsbError::invalid(
                "cwd contains a NUL byte or newline",
                "pass a plain directory path",
            ));
        }
        Some(c) => Some(c.to_string()),
    };
    let mut req = ExecRequest::new(command);
    req.cwd = cwd;
    req.timeout_ms = timeout_ms;
    req.kill_grace_ms = KILL_GRACE_MS;
    // Caps are in bytes; a char is at least one byte, so this never returns more chars than asked.
    req.max_stdout = max_output_chars as u64;
    req.max_stderr = max_output_chars as u64;
    Ok(req)
}

/// The lines a reply adds about confinement: that it was not applied (and why), or, when a
/// confined command failed, which roots it may write, so a "Permission denied" reads as the
/// boundary rather than something to retry.
pub fn confinement_note(req: Option<&rsb_protocol::Confine>, res: &ExecResult) -> Option<String> {
    let c = req?;
    if let Some(why) = &res.unconfined {
        return Some(unconfined_note(why, "the command ran"));
    }
    let failed = res.exit_code != Some(0) && !res.timed_out && !res.cancelled;
    failed.then(|| {
        let roots = if c.write.is_empty() {
            "none".to_string()
        } else {
            c.write.join(", ")
        };
        let reads = crate::config::reads_words(c.read.as_deref());
        format!(
            "confined: the command may change files only under {roots}{reads} (Landlock); a write{} elsewhere fails with Permission denied by design",
            if reads.is_empty() { "" } else { " or read" }
        )
    })
}

/// [`reply`] for a request sent with `confine`: with its [`confinement_note`].
pub fn confined_reply(
    res: &ExecResult,
    timeout_s: i64,
    confine: Option<&rsb_protocol::Confine>,
) -> ExecReply {
    let mut out = reply(res, timeout_s);
    out.confinement = confinement_note(confine, res);
    out
}

/// The line a reply carries when what `confine` asks was not (all) applied: why, and that
/// `require = false` allowed it. `ran`: "the command ran", "the job runs".
pub fn unconfined_note(why: &str, ran: &str) -> String {
    format!("unconfined: {why}; {ran} without that confinement (confine.require = false)")
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The seed's reply keys (`exit_code`, `stdout`, `stderr`, `timed_out`), empty ones omitted,
/// plus what the seed could not say: signal, truncation, invalid UTF-8, duration.
#[derive(Debug, Clone, Serialize)]
pub struct ExecReply {
    /// The command's code, 128+signal, or 124 after a timeout (like GNU timeout).
    pub exit_code: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    #[serde(skip_serializing_if = "is_false")]
    pub timed_out: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub cancelled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    #[serde(skip_serializing_if = "is_false")]
    pub stdout_truncated: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub stderr_truncated: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub invalid_utf8: bool,
    pub duration_s: f64,
    /// Set by the caller from [`confinement_note`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confinement: Option<String>,
    /// Pids of the command's session that outlived the timeout's or cancel's SIGKILL.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub survivors: Vec<u32>,
}

/// The exit status a caller of `exec` sees: the command's code, else 128+signal, else -1.
pub fn exit_status(res: &ExecResult) -> i32 {
    match (res.exit_code, res.signal) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => -1,
    }
}

pub fn reply(res: &ExecResult, timeout_s: i64) -> ExecReply {
    // A timeout reads as 124 like GNU timeout, but only `timed_out` says it was one.
    let exit_code = if res.timed_out { 124 } else { exit_status(res) };
    let out = render(&res.stdout);
    let mut err = render(&res.stderr);
    if res.timed_out {
        if !err.text.is_empty() && !err.text.ends_with('\n') {
            err.text.push('\n');
        }
        err.text.push_str(&format!(
            "[TIMEOUT] Remote process group killed by timeout after {timeout_s}s"
        ));
    }
    if !res.survivors.is_empty() {
        if !err.text.is_empty() && !err.text.ends_with('\n') {
            err.text.push('\n');
        }
        err.text.push_str(&format!(
            "[SURVIVORS] still running after SIGKILL: pids {}",
            res.survivors
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    ExecReply {
        exit_code,
        invalid_utf8: out.lossy || err.lossy,
        stdout_truncated: out.truncated,
        stderr_truncated: err.truncated,
        stdout: (!out.text.is_empty()).then_some(out.text),
        stderr: (!err.text.is_empty()).then_some(err.text),
        timed_out: res.timed_out,
        cancelled: res.cancelled,
        signal: res.signal,
        duration_s: (res.duration_ms as f64 / 1000.0 * 1000.0).round() / 1000.0,
        survivors: res.survivors.clone(),
        confinement: None,
    }
}

/// What a sudo exec runs: rsb's own constant text, never the command. sudo reads the password
/// from stdin (`-S`, an empty prompt); once it lets the command in, one marker byte on stderr
/// says so, and the command runs with stdin from /dev/null, so a password sudo did not read
/// (a NOPASSWD rule) can never reach it. The command is data: `$RSB_SUDO_COMMAND`, expanded
/// into one argument of sudo.
pub const SUDO_SCRIPT: &str = r#"exec sudo -S -p '' -- bash -c 'printf "\036" >&2; exec bash -c "$1" </dev/null' rsb-sudo "$RSB_SUDO_COMMAND""#;
const SUDO_COMMAND_VAR: &str = "RSB_SUDO_COMMAND";
const SUDO_MARK: u8 = 0x1e;

/// [`run_sudo`] on `client`'s sandbox as `pool` has it configured (`exec_bash(sudo)`,
/// `rsb exec --sudo`).
pub async fn sudo(pool: &Pool, client: &AgentClient, req: ExecRequest) -> Result<ExecResult> {
    let sandbox = pool
        .sandbox_config(client.sandbox())
        .ok_or_else(|| RsbError::internal("the sandbox has no config"))?;
    run_sudo(client, sandbox, req).await
}

/// Run `req` through sudo on `sandbox`, its password fed to sudo through the agent's stdin
/// channel: it is in no argv, environment or file, on either machine.
pub async fn run_sudo(
    client: &AgentClient,
    sandbox: &SandboxConfig,
    mut req: ExecRequest,
) -> Result<ExecResult> {
    if sandbox.confine.is_some() {
        return Err(RsbError::invalid(
            format!(
                "sandbox '{}' confines its commands, and sudo cannot gain root under Landlock's no_new_privs",
                sandbox.name
            ),
            "run the command without sudo, or remove confine from this sandbox's configuration",
        ));
    }
    let sudo = sandbox.sudo.as_ref().ok_or_else(|| {
        RsbError::invalid(
            format!("sandbox '{}' has no sudo password configured", sandbox.name),
            "set sudo_password_env = \"VAR\" on the sandbox and export VAR (the password sudo \
             asks for) in the environment rsb starts with",
        )
    })?;
    let command = std::mem::replace(&mut req.command, SUDO_SCRIPT.to_string());
    req.env.push((SUDO_COMMAND_VAR.into(), command));
    req.stdin = true;
    let (input, input_rx) = mpsc::channel(1);
    let mut line = sudo.password.expose().as_bytes().to_vec();
    line.push(b'\n');
    // Room for one message: the sender is dropped after it, which closes stdin (EOF).
    let _ = input.try_send(ExecInput::Data(line));
    drop(input);
    // stdin implies streamed chunks; the reply carries the capped output again.
    let (out_tx, mut out_rx) = mpsc::channel::<Chunk>(64);
    let drain = tokio::spawn(async move { while out_rx.recv().await.is_some() {} });
    let r = client.exec_with_input(req, out_tx, input_rx).await;
    let _ = drain.await;
    let mut r = r?;
    settle_sudo(&sandbox.name, &sudo.var, &mut r)?;
    Ok(r)
}

/// Takes what sudo wrote before the command (its lecture, the marker) out of stderr, or, when
/// the marker never came, turns sudo's refusal into one error that names the variable.
fn settle_sudo(sandbox: &str, var: &str, r: &mut ExecResult) -> Result<()> {
    if let Some(i) = r.stderr.head.iter().position(|&b| b == SUDO_MARK) {
        r.stderr.head.drain(..=i);
        r.stderr.total = r.stderr.total.saturating_sub(i as u64 + 1);
        return Ok(());
    }
    if r.timed_out || r.cancelled {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&r.stderr.head);
    let said = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("no message");
    if r.exit_code == Some(127) && text.contains("sudo") {
        return Err(RsbError::new(
            Kind::Config,
            format!("sudo is not installed on '{sandbox}' ({said})"),
            "install sudo there, or run the command without sudo",
        ));
    }
    Err(RsbError::new(
        Kind::Auth,
        format!("sudo on '{sandbox}' did not run the command: {said}"),
        format!(
            "check the password in {var} (the sandbox's sudo_password_env) and that the login \
             user may use sudo there"
        ),
    ))
}

#[cfg(test)]
mod sudo_tests {
    use super::*;
    use rsb_protocol::Captured;

    fn result(code: i32, stderr: &[u8]) -> ExecResult {
        ExecResult {
            exit_code: Some(code),
            signal: None,
            timed_out: false,
            cancelled: false,
            duration_ms: 1,
            stdout: Captured {
                head: b"0\n".to_vec(),
                tail: vec![],
                total: 2,
            },
            stderr: Captured {
                head: stderr.to_vec(),
                tail: vec![],
                total: stderr.len() as u64,
            },
            survivors: vec![],
            unconfined: None,
        }
    }

    #[test]
    fn what_sudo_said_before_the_marker_is_not_the_commands() {
        let mut r = result(
            0,
            b"\nWe trust you have received the usual lecture\n\x1ewarn\n",
        );
        settle_sudo("s", "PW", &mut r).unwrap();
        assert_eq!(r.stderr.head, b"warn\n");
        assert_eq!(r.stderr.total, 5);
        // A command that fails after sudo let it in is its own failure, not sudo's.
        let mut r = result(3, b"\x1e");
        settle_sudo("s", "PW", &mut r).unwrap();
        assert_eq!((r.exit_code, r.stderr.total), (Some(3), 0));
    }

    #[test]
    fn a_refused_password_is_one_error_naming_the_variable() {
        let mut r = result(
            1,
            b"Sorry, try again.\nsudo: 1 incorrect password attempt\n",
        );
        let e = settle_sudo("gpu", "GPU_SUDO_PW", &mut r).unwrap_err();
        assert_eq!(e.kind, Kind::Auth);
        assert_eq!(
            e.message,
            "sudo on 'gpu' did not run the command: sudo: 1 incorrect password attempt"
        );
        assert!(e.hint.contains("GPU_SUDO_PW"), "{}", e.hint);
        let mut r = result(127, b"bash: line 1: sudo: command not found\n");
        let e = settle_sudo("gpu", "V", &mut r).unwrap_err();
        assert!(
            e.message.starts_with("sudo is not installed on 'gpu'"),
            "{}",
            e.message
        );
    }

    #[test]
    fn the_command_is_data_and_never_in_the_script() {
        assert!(SUDO_SCRIPT.contains("\"$RSB_SUDO_COMMAND\""));
        assert!(SUDO_SCRIPT.starts_with("exec sudo -S -p '' -- "));
        assert!(SUDO_SCRIPT.contains("</dev/null"));
    }
}

/// A command on a sandbox as a front end asks for it (`exec_bash`, `rsb exec`, `rsb shell`).
pub struct Command<'a> {
    /// The sandbox as named (`""`: the active one); resolved once, so the sandbox the policy
    /// asks about is the one that runs it, whatever `select_sandbox` does meanwhile.
    pub sandbox: &'a str,
    /// The tool or command, as the policy's questions and the audit name it.
    pub tool: &'a str,
    /// What runs, as the audit records it.
    pub command: String,
    /// What the policy checks, each with the parameter it came in; `None`: nothing to check
    /// (a person typing at a terminal: audited, not gated).
    pub checked: Option<Vec<(&'static str, String)>>,
    pub cwd: Option<&'a str>,
    /// The caller's stdin reaches the command (see [`crate::policy::Request`]).
    pub stdin_forwarded: bool,
}

/// How a run ended, for its audit line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ran {
    pub exit_code: Option<i64>,
    pub bytes: Option<u64>,
    /// rsb's confinement line (a confined command that failed, or one run unconfined).
    pub detail: Option<serde_json::Value>,
}

impl Ran {
    /// A finished command: its exit status (124 for a timeout, as the reply says), the bytes
    /// it wrote, and the confinement line its reply carries.
    pub fn of(r: &ExecResult, confine: Option<&rsb_protocol::Confine>) -> Ran {
        Ran {
            exit_code: Some(if r.timed_out { 124 } else { exit_status(r) }.into()),
            bytes: Some(r.stdout.total + r.stderr.total),
            detail: confinement_note(confine, r).map(|c| serde_json::json!({ "confinement": c })),
        }
    }
}

/// The one path of a command on a sandbox, for every front end: the sandbox resolved once,
/// the policy's gate (its decision an audit line), the connection, the request confined as
/// the sandbox says, the start line, `run` (which the front end shapes: captured, streamed to
/// a terminal, through sudo), and the end line with how it ran or why it failed.
pub async fn run_command<T>(
    pool: &Pool,
    caller: &Caller,
    cmd: Command<'_>,
    mut req: ExecRequest,
    run: impl AsyncFnOnce(AgentClient, ExecRequest) -> Result<(T, Ran)>,
) -> Result<T> {
    let sandbox = pool.resolve(cmd.sandbox)?;
    let config = pool.config();
    if let Some(checked) = &cmd.checked {
        caller
            .gate(
                config,
                &sandbox,
                cmd.tool,
                checked,
                cmd.cwd,
                cmd.stdin_forwarded,
            )
            .await?;
    }
    let client = pool.client(&sandbox).await?;
    req.confine = client.confine().cloned();
    let started = caller.start(
        config,
        &sandbox,
        cmd.tool,
        Some(cmd.command),
        cmd.cwd.map(str::to_string),
    );
    let r = run(client, req).await;
    started.end(|a| match &r {
        Ok((_, ran)) => {
            a.exit_code = ran.exit_code;
            a.bytes = ran.bytes;
            a.detail = ran.detail.clone();
        }
        Err(e) => a.error = Some(e.message.clone()),
    });
    r.map(|(t, _)| t)
}
