//! `rsb exec`: a command on a sandbox, like `ssh host cmd`: stdin forwarded, output streamed as
//! it comes (on a pty with `-t`), no timeout unless `--timeout` is given, and the remote exit
//! code (or 128+signal) as rsb's. `rsb shell`: the login shell on a pty.

use clap::Args;
use rsb::ops::exec;
use rsb_protocol::{ExecRequest, ExecResult};

use super::{Ctx, exit, fail, print_json};

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Kill the remote process group after SECS seconds (exit 124); 0 or absent = no limit.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Remote working directory (default the remote $HOME; ~ allowed).
    #[arg(long)]
    pub cwd: Option<String>,
    /// Run on a pseudo-terminal (like `ssh -t`), sized like the local window.
    #[arg(long, short = 't')]
    pub tty: bool,
    /// Run as root through sudo, with the password from the sandbox's `sudo_password_env`
    /// (fed to sudo through the agent, never in argv, env or a file). stdin is not forwarded.
    #[arg(long, conflicts_with = "tty")]
    pub sudo: bool,
    /// Approve a command the policy's `ask` rules hold for approval, without the question.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One argument is a bash command line (`'make | tee log'`); several are words whose
    /// boundaries are kept (`-- printf '%s\n' "a b"`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// The `--json` reply keeps at most this much of each stream (head and tail).
const JSON_MAX_OUTPUT: i64 = 1 << 20;

/// What rsb exits with after the remote command ended this way.
pub fn exit_code(r: &ExecResult) -> u8 {
    if r.timed_out {
        return exit::TIMEOUT;
    }
    match exec::exit_status(r) {
        c @ 0..=255 => c as u8,
        _ => exit::REMOTE,
    }
}

pub async fn run(ctx: &Ctx, a: ExecArgs) -> u8 {
    let timeout_ms = a.timeout.unwrap_or(0).saturating_mul(1000);
    let command = super::command_line(&a.command);
    let req = match exec::build_request_ms(&command, a.cwd.as_deref(), timeout_ms, JSON_MAX_OUTPUT)
    {
        Ok(r) => r,
        Err(e) => return fail(ctx.json, &e),
    };
    let sandbox = match ctx.resolve() {
        Ok(s) => s,
        Err(e) => return fail(ctx.json, &e),
    };
    let checked = if a.sudo {
        rsb::policy::as_sudo(&command)
    } else {
        command.clone()
    };
    let cmd = exec::Command {
        sandbox: &sandbox,
        tool: if a.sudo {
            "rsb exec --sudo"
        } else {
            "rsb exec"
        },
        command,
        checked: Some(vec![("command", checked)]),
        cwd: a.cwd.as_deref(),
        // Piped stdin is forwarded (not under --sudo): a shell reading it runs what the
        // policy never saw (`echo 'rm -rf /' | rsb exec sb bash`). A terminal is a person
        // typing.
        stdin_forwarded: !a.sudo && !std::io::IsTerminal::is_terminal(&std::io::stdin()),
    };
    let caller = super::policy::caller(a.yes);
    let r = exec::run_command(ctx.app.pool(), &caller, cmd, req, async |client, req| {
        run_on(ctx, &client, req, &a).await
    })
    .await;
    r.unwrap_or_else(|e| fail(ctx.json, &e))
}

/// Run and render `req`: through sudo, collected for `--json`, or streamed to the terminal;
/// rsb's exit code and how the command ended.
async fn run_on(
    ctx: &Ctx,
    client: &rsb::client::AgentClient,
    req: ExecRequest,
    a: &ExecArgs,
) -> Result<(u8, exec::Ran), rsb::error::RsbError> {
    let confine = req.confine.clone();
    let timeout_s = a.timeout.unwrap_or(0) as i64;
    if a.sudo {
        let r = exec::sudo(ctx.app.pool(), client, req).await?;
        if ctx.json {
            print_json(&exec::reply(&r, timeout_s));
        } else {
            use std::io::Write;
            let _ = std::io::stdout().write_all(&rsb::ops::output::raw(&r.stdout));
            let _ = std::io::stderr().write_all(&rsb::ops::output::raw(&r.stderr));
        }
        return Ok((exit_code(&r), exec::Ran::of(&r, confine.as_ref())));
    }
    if ctx.json {
        // stdin is forwarded here too: `… | rsb --json exec -- wc -l` counts the input.
        return match rsb::exec_stream::run_collected(client, req).await {
            Ok(r) => {
                let r = r?;
                print_json(&exec::confined_reply(&r, timeout_s, confine.as_ref()));
                Ok((exit_code(&r), exec::Ran::of(&r, confine.as_ref())))
            }
            Err(rsb::exec_stream::Interrupted::Signal(sig)) => Ok(interrupted(sig, false)),
        };
    }
    stream(client, req, a.tty, a.timeout.unwrap_or(0)).await
}

/// `rsb shell [SANDBOX]`: the remote login shell, like `ssh HOST`: on a pty when stdin is a
/// terminal.
pub async fn shell(ctx: &Ctx, sandbox: Option<String>, cwd: Option<String>) -> u8 {
    // rsb's own string: the remote login shell, as a login shell (argv0 `-bash`).
    let req = match exec::build_request_ms(
        "exec -l \"${SHELL:-bash}\"",
        cwd.as_deref(),
        0,
        JSON_MAX_OUTPUT,
    ) {
        Ok(r) => r,
        Err(e) => return fail(false, &e),
    };
    let sandbox = match sandbox {
        Some(name) if !ctx.app.pool().names().contains(&name) => {
            return fail(false, &super::unknown_sandbox(ctx.app.pool(), &name));
        }
        Some(name) => {
            ctx.warnings_for(&[name.as_str()]);
            name
        }
        None => match ctx.resolve() {
            Ok(s) => s,
            Err(e) => return fail(false, &e),
        },
    };
    // As `ssh HOST`: a pty only when stdin is a terminal; otherwise the login shell reads its
    // commands from stdin (`rsb shell gpu1 <<< 'nvidia-smi'`), prints, and exits with its status
    // at EOF, instead of waiting on a pty for input that never comes.
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdin());
    let cmd = exec::Command {
        sandbox: &sandbox,
        tool: "rsb shell",
        command: if tty {
            "(interactive login shell)".into()
        } else {
            "(login shell reading stdin)".into()
        },
        // A person at a terminal types what they like (audited, not checked: the policy
        // guards an agent's commands). Piped, the shell runs a script nobody saw: under a
        // policy that counts as matching every rule, like `… | rsb exec sb bash`.
        checked: (!tty).then(|| vec![("rsb shell", "bash -l".to_string())]),
        cwd: cwd.as_deref(),
        stdin_forwarded: true,
    };
    let caller = super::policy::caller(false);
    let r = exec::run_command(ctx.app.pool(), &caller, cmd, req, async |client, req| {
        stream(&client, req, tty, 0).await
    })
    .await;
    r.unwrap_or_else(|e| fail(false, &e))
}

/// rsb's exit code after the local side stopped the command on signal `sig` (its audit
/// line's code too).
fn interrupted(sig: i32, say: bool) -> (u8, exec::Ran) {
    if say && sig != libc::SIGPIPE {
        eprintln!("\r\nrsb: interrupted; the remote command was stopped");
    }
    // SIGINT (^C) is the table's 130; others are 128+N, as a shell reports them.
    let code = match sig {
        2 => exit::INTERRUPTED,
        s => (128 + s).clamp(0, 255) as u8,
    };
    let ran = exec::Ran {
        exit_code: Some(code.into()),
        ..Default::default()
    };
    (code, ran)
}

/// Local stdin forwarded, output written live (on a pty with `tty`), the remote code returned.
async fn stream(
    client: &rsb::client::AgentClient,
    req: ExecRequest,
    tty: bool,
    timeout_s: u64,
) -> Result<(u8, exec::Ran), rsb::error::RsbError> {
    let confine = req.confine.clone();
    match rsb::exec_stream::run(client, req, tty).await {
        Ok(Ok(r)) => {
            if let Some(note) = exec::confinement_note(confine.as_ref(), &r) {
                eprintln!("rsb: {note}");
            }
            if r.timed_out {
                eprintln!(
                    "rsb: timed out after {timeout_s}s; the remote command's session was killed"
                );
            }
            if !r.survivors.is_empty() {
                eprintln!(
                    "rsb: warning: still running on the sandbox after SIGKILL: pids {}",
                    r.survivors
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            Ok((exit_code(&r), exec::Ran::of(&r, confine.as_ref())))
        }
        Ok(Err(e)) => Err(e),
        Err(rsb::exec_stream::Interrupted::Signal(sig)) => Ok(interrupted(sig, true)),
    }
}
