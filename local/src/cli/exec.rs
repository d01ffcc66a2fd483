//! `rsb exec`: a command on a sandbox, like `ssh host cmd`: output streamed as it comes, no
//! timeout unless `--timeout` is given, and the remote exit code (or 128+signal) as rsb's.

use std::io::Write;

use clap::Args;
use rsb::ops::exec;
use rsb_protocol::{Chunk, ExecResult};

use super::{Ctx, exit, fail, print_json};

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Kill the remote process group after SECS seconds (exit 124); 0 or absent = no limit.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Remote working directory (default the remote $HOME; ~ allowed).
    #[arg(long)]
    pub cwd: Option<String>,
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
    let mut req =
        match exec::build_request_ms(&command, a.cwd.as_deref(), timeout_ms, JSON_MAX_OUTPUT) {
            Ok(r) => r,
            Err(e) => return fail(ctx.json, &e),
        };
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return fail(ctx.json, &e),
    };
    if ctx.json {
        return match client.call(req).await {
            Ok(r) => {
                print_json(&exec::reply(&r, a.timeout.unwrap_or(0) as i64));
                exit_code(&r)
            }
            Err(e) => fail(true, &e),
        };
    }
    req.stream = true;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Chunk>(64);
    let printer = tokio::spawn(async move {
        while let Some(c) = rx.recv().await {
            match c {
                Chunk::Stdout(b) => {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&b);
                    let _ = o.flush();
                }
                Chunk::Stderr(b) => {
                    let mut o = std::io::stderr().lock();
                    let _ = o.write_all(&b);
                    let _ = o.flush();
                }
                Chunk::Manifest(_) => {}
            }
        }
    });
    let res = tokio::select! {
        r = client.call_streaming(req, tx) => r,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("\nrsb: interrupted; the remote command was stopped");
            return exit::INTERRUPTED;
        }
    };
    let _ = printer.await;
    match res {
        Ok(r) => {
            if r.timed_out {
                eprintln!(
                    "rsb: timed out after {}s; the remote process group was killed",
                    a.timeout.unwrap_or(0)
                );
            }
            exit_code(&r)
        }
        Err(e) => fail(false, &e),
    }
}
