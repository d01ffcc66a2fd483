//! `rsb-agent`: the remote half of rsb. `serve` speaks the framed protocol on stdin/stdout;
//! the other subcommands make the binary useful to a person logged into the host.

use std::process::ExitCode;

use rsb_agent::{hello, jobs, reaper, resources, serve, util};

fn usage() -> &'static str {
    "usage: rsb-agent <command>\n\
     \n\
     commands:\n\
     \x20 serve                 speak the rsb protocol on stdin/stdout (started by rsb)\n\
     \x20 version               print version, protocol and binary hash\n\
     \x20 resources [--json]    print CPU, memory, disk and GPU load of this host\n\
     \x20 jobs [--json]         list background jobs started by rsb on this host\n\
     \x20 hash FILE...          print the blake3 of files\n\
     \x20 job-run ...           (internal) supervise one background job\n\
     \x20 reaper                (internal) stop a dead agent's commands\n"
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().map(String::as_str) else {
        eprint!("{}", usage());
        return ExitCode::from(2);
    };
    let rest = &args[1..];
    let code = match cmd {
        "serve" => serve::main(),
        "version" | "--version" | "-V" => hello::print_version(),
        "resources" => resources::cli_main(rest),
        "jobs" => jobs::cli_main(rest),
        "job-run" => jobs::job_run_main(rest),
        "reaper" => reaper::main(),
        "hash" => util::hash_cli(rest),
        "help" | "--help" | "-h" => match util::write_stdout(usage()) {
            Ok(()) => 0,
            Err(_) => 1,
        },
        other => {
            eprintln!("rsb-agent: unknown command '{other}'\n");
            eprint!("{}", usage());
            2
        }
    };
    ExitCode::from(code.clamp(0, 255) as u8)
}
