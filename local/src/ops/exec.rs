//! `exec_bash`: validation, the request sent to the agent, and the seed-compatible reply.

use rsb_protocol::{ExecRequest, ExecResult};
use serde::Serialize;

use crate::{
    error::{Result, RsbError},
    ops::output::render,
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
    }
}
