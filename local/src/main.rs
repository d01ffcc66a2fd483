//! `rsb`: the MCP server (`rsb mcp`) and a human CLI over the same operations. This file is
//! the clap entry and the dispatch; each command lives in `cli/<capability>.rs`.

mod cli;

use std::{process::ExitCode, time::Duration};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use cli::{Ctx, exit};
use rsb::config::Config;

#[derive(Parser)]
#[command(
    name = "rsb",
    version,
    about = "Remote machines over SSH as sandboxes for AI agents"
)]
struct Cli {
    /// Print machine-readable JSON instead of tables and text.
    #[arg(long, global = true)]
    json: bool,
    /// The sandbox to use (default: the first configured one).
    #[arg(
        long,
        short,
        global = true,
        env = "RSB_SANDBOX",
        value_name = "SANDBOX"
    )]
    sandbox: Option<String>,
    /// `-s` was on the command line (not only `RSB_SANDBOX`).
    #[arg(skip)]
    sandbox_flag: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum AuditCmd {
    /// Check the log's hash chain: exit 0 when every line follows the one before it, 6 with
    /// the first line that does not (one before it edited, inserted or removed).
    Verify,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve MCP on stdin/stdout (what MCP clients run).
    Mcp,
    /// List sandboxes and their health.
    Sandboxes {
        /// Also show CPU, memory and GPU load side by side.
        #[arg(long)]
        resources: bool,
    },
    /// Run a command on a sandbox, like `ssh host cmd`; exits with its exit code.
    Exec(cli::exec::ExecArgs),
    /// The audit log: what rsb ran, from MCP and the CLI (`-s` filters by sandbox).
    Audit {
        #[command(subcommand)]
        verify: Option<AuditCmd>,
        /// Only lines this recent: 90s, 30m, 2h, 7d.
        #[arg(long)]
        since: Option<String>,
        /// Only lines containing this text.
        #[arg(long)]
        grep: Option<String>,
    },
    /// Wait for a job to end: prints its last lines and exits with its exit code (128+signal;
    /// 4 when lost; 124 after --timeout). The end arrives the moment the job's supervisor
    /// records it, so a client without notifications can run this in the background.
    Wait {
        /// `SANDBOX JOB`, or `JOB` on the -s (or first) sandbox.
        first: String,
        job: Option<String>,
        /// Give up after this long (30s, 10m, 2h); the job keeps running.
        #[arg(long, value_name = "DUR", value_parser = cli::jobs::parse_duration)]
        timeout: Option<std::time::Duration>,
        /// Lines of the run's log printed once it ended (0: none).
        #[arg(long, short = 'n', default_value_t = 10)]
        lines: i64,
    },
    /// An interactive login shell on a sandbox (like `ssh HOST`); exits with the shell's code.
    Shell {
        /// The sandbox (default: -s, RSB_SANDBOX, or the first configured one).
        sandbox: Option<String>,
        /// Remote working directory (default the remote $HOME).
        #[arg(long)]
        cwd: Option<String>,
    },
    /// List a remote directory.
    Ls {
        /// Remote path, relative to the remote $HOME (~ allowed).
        #[arg(default_value = ".")]
        path: String,
        #[arg(long, short)]
        recursive: bool,
        #[arg(long, default_value_t = 200)]
        max_entries: i64,
    },
    /// Print a remote file (the whole file, streamed).
    Cat {
        /// Remote path, relative to the remote $HOME (~ allowed).
        path: String,
        /// With --json: bytes to return (the reply of the read_remote_file tool).
        #[arg(long, default_value_t = rsb::ops::fs::DEFAULT_MAX_BYTES)]
        max_bytes: i64,
        /// First line to print, 1-based (read_remote_file's `offset`).
        #[arg(long, default_value_t = 0)]
        offset: i64,
        /// Lines to print at most (read_remote_file's `limit`; 0 = to the end).
        #[arg(long, default_value_t = 0)]
        limit: i64,
        /// Number the lines, as `cat -n`.
        #[arg(long, short = 'n')]
        numbered: bool,
    },
    /// Edit a remote file with $VISUAL/$EDITOR on a local copy: written back only if the
    /// remote file is unchanged since it was fetched (otherwise the copy is kept).
    Edit {
        /// SANDBOX:PATH (`:PATH` = the -s or active sandbox), relative to the remote $HOME.
        target: String,
    },
    /// Search file contents on the sandbox, as ripgrep (exit 0 a match, 1 none, 2 an error).
    Grep(cli::search::GrepArgs),
    /// Sync files exactly: `rsb sync LOCAL SANDBOX:REMOTE` uploads, `rsb sync SANDBOX:REMOTE LOCAL`
    /// downloads (`:REMOTE` = the -s or active sandbox). Remote paths are relative to the
    /// remote $HOME.
    Sync(cli::sync::SyncArgs),
    /// Forward a local port to a service on a sandbox over its SSH connection, as `ssh -L`
    /// does: SANDBOX:PORT, SANDBOX:HOST:PORT or SANDBOX:/path/to.sock (`:PORT` = the active
    /// sandbox). Runs until Ctrl-C, printing a line per connection; survives reconnects.
    /// `--detach` lets the watchdog daemon serve it instead.
    Forward(cli::forward::ForwardArgs),
    /// Background jobs supervised by the agent.
    Jobs {
        #[command(subcommand)]
        cmd: cli::jobs::JobsCmd,
    },
    /// The local daemon that watches long jobs: run, install, uninstall, status.
    Watchdog {
        #[command(subcommand)]
        cmd: cli::watchdog::WatchdogCmd,
    },
    /// Watches of long jobs: list, show, events, cancel.
    Watch {
        #[command(subcommand)]
        cmd: cli::watchdog::WatchCmd,
    },
    /// The state dir: what it holds and its size, `check` (is the store usable), `prune`
    /// (apply the retention policy now).
    State {
        #[command(subcommand)]
        cmd: Option<cli::state::StateCmd>,
    },
    /// Where the configuration file is, and whether it loads.
    Config {
        #[command(subcommand)]
        cmd: cli::config::ConfigCmd,
    },
    /// Check the configuration, the watchdog daemon and its detached forwards, and every
    /// sandbox (keys, host key, agent, tmux, clock), one verdict per line.
    Doctor,
    /// Print a shell completion script: `source <(rsb completions bash)`.
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff): `rsb man | man -l -`.
    Man,
    /// Print rsb's version and the agents embedded in it.
    Version,
    /// Background transfer worker (started by the server).
    #[command(hide = true)]
    Transfer {
        #[command(subcommand)]
        cmd: cli::transfer::TransferCmd,
    },
}

/// `log_records`: timestamped records (for `rsb mcp` and the watchdog daemon); else CLI lines.
fn init_tracing(default: &str, log_records: bool) {
    // stdout is the MCP channel: logs go to stderr only.
    let filter = tracing_subscriber::EnvFilter::try_from_env("RSB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let fmt = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(filter);
    if log_records {
        fmt.init();
    } else {
        fmt.event_format(cli::CliLogFormat).init();
    }
}

/// The clap command with the exit-code table and the config path in `--help`.
fn command() -> clap::Command {
    Cli::command().after_help(format!(
        "Configuration: {} (RSB_CONFIG overrides; REMOTE_SANDBOX_LIST and REMOTE_HOST take \
         precedence). Without any, rsb uses the built-in `local` sandbox (this machine).\n\n{}",
        rsb::config::config_file_path().display(),
        exit::TABLE
    ))
}

fn parse() -> Result<Cli, u8> {
    let parsed = command().try_get_matches().and_then(|m| {
        let mut cli = Cli::from_arg_matches(&m)?;
        cli.sandbox_flag =
            m.value_source("sandbox") == Some(clap::parser::ValueSource::CommandLine);
        Ok(cli)
    });
    parsed.map_err(|e| {
        let _ = e.print();
        match e.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                exit::OK
            }
            // `rsb grep` keeps rg's codes: 1 means "no match", a bad flag is 2.
            _ if subcommand_named() == Some("grep".into()) => cli::search::exit::ERROR,
            _ => exit::USAGE,
        }
    })
}

/// The subcommand of a command line that did not parse, as far as clap got.
fn subcommand_named() -> Option<String> {
    command()
        .ignore_errors(true)
        .try_get_matches()
        .ok()?
        .subcommand_name()
        .map(String::from)
}

fn main() -> ExitCode {
    let cli = match parse() {
        Ok(c) => c,
        Err(code) => return ExitCode::from(code),
    };
    // A command whose reader went away (`rsb completions bash | head -1`, `rsb jobs list | head`)
    // ends quietly by SIGPIPE, as coreutils do, instead of panicking in `println!`. The MCP
    // server, the transfer worker and `rsb exec`/`rsb shell` keep it ignored: they see EPIPE
    // as an error and handle it (exec stops the remote command first, as ssh does).
    if !matches!(
        cli.cmd,
        Cmd::Mcp | Cmd::Exec(_) | Cmd::Shell { .. } | Cmd::Transfer { .. }
    ) {
        // SAFETY: called before any other thread exists; only resets one signal disposition.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // The watchdog's log (a file or the journal) should say when it started and why it stopped.
    let daemon = matches!(
        cli.cmd,
        Cmd::Watchdog {
            cmd: cli::watchdog::WatchdogCmd::Run { .. }
        }
    );
    let records = daemon || matches!(cli.cmd, Cmd::Mcp | Cmd::Watchdog { .. });
    init_tracing(if daemon { "info" } else { "warn" }, records);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rsb: cannot start the runtime: {e}");
            return ExitCode::from(exit::INTERNAL);
        }
    };
    let code = rt.block_on(run(cli));
    // Do not wait for lingering tasks (idle SSH connections) on exit.
    rt.shutdown_timeout(Duration::from_millis(200));
    ExitCode::from(code)
}

async fn run(cli: Cli) -> u8 {
    rsb::sync::transfers::enable_workers();
    let json = cli.json;
    // Commands that need no sandbox configuration.
    match cli.cmd {
        Cmd::Watchdog { cmd } => {
            return cli::watchdog::watchdog(cmd, json, &rsb::config::state_dir()).await;
        }
        Cmd::Watch { cmd } => {
            return cli::watchdog::watch(cmd, json, &rsb::config::state_dir()).await;
        }
        Cmd::Config { cmd } => return cli::config::run(cmd, json),
        Cmd::State { cmd } => {
            // The store's checks and pruning wait on its lock: on the blocking pool.
            let dir = rsb::config::state_dir();
            return tokio::task::spawn_blocking(move || cli::state::run(cmd, json, &dir))
                .await
                .unwrap_or(1);
        }
        Cmd::Completions { shell } => return cli::meta::completions(&mut command(), shell),
        Cmd::Man => return cli::meta::man(command()),
        Cmd::Version => return cli::meta::version(json),
        Cmd::Transfer { cmd } => {
            return cli::transfer::transfer(cmd, &rsb::config::state_dir()).await;
        }
        _ => {}
    }
    let config = match Config::load() {
        Ok(c) => c,
        Err(e) => {
            // An MCP client shows a server that exits at start as a bare failure; serve the
            // tools instead and reply to each call with the config error (as the seed did).
            if let Cmd::Mcp = cli.cmd {
                eprintln!("rsb: {e}\n  hint: {}", e.hint);
                rsb::server_env::record(None, Some(&e.message));
                return match rsb::mcp::serve_config_error(e).await {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("rsb mcp: {e}");
                        1
                    }
                };
            }
            if json {
                println!(
                    "{}",
                    serde_json::json!({"error": e.message, "hint": e.hint})
                );
            } else {
                eprintln!("rsb: {e}\n  hint: {}", e.hint);
            }
            return exit::CONFIG;
        }
    };
    if let Cmd::Mcp = cli.cmd {
        for w in &config.warnings {
            tracing::warn!("{w}");
        }
        // For `rsb doctor` in a shell: which variables (names only) and paths this server has.
        rsb::server_env::record(Some(&config), None);
        return match rsb::mcp::serve(config).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rsb mcp: {e}");
                1
            }
        };
    }
    // `rsb -s ALIAS`, `rsb shell ALIAS` or `rsb ls ALIAS:PATH` (cat, grep, edit, sync alike)
    // with nothing configured: a `~/.ssh/config` Host, as `ssh ALIAS` would take it.
    let mut config = config;
    let prefix = |arg: &str| -> Option<String> {
        let (name, _) = arg.split_once(':')?;
        (!name.is_empty() && !name.contains('/')).then(|| name.to_string())
    };
    let wanted: Option<String> = match &cli.cmd {
        Cmd::Shell {
            sandbox: Some(s), ..
        } => Some(s.clone()),
        Cmd::Wait {
            first,
            job: Some(_),
            ..
        } => Some(first.clone()),
        _ if cli.sandbox.is_some() => cli.sandbox.clone(),
        // `rsb exec ALIAS cmd`, as `ssh ALIAS cmd`.
        Cmd::Exec(a) if a.command.len() >= 2 => Some(a.command[0].clone()),
        Cmd::Ls { path, .. } | Cmd::Cat { path, .. } | Cmd::Edit { target: path } => prefix(path),
        Cmd::Grep(a) => a.paths().iter().find_map(|p| prefix(p)),
        Cmd::Sync(a) => a.paths().into_iter().find_map(prefix),
        _ => None,
    };
    if config.source == rsb::config::BUILTIN_LOCAL
        && let Some(alias) = wanted.as_deref()
        && config.sandbox(alias).is_none()
    {
        match Config::from_ssh_alias(&config, alias) {
            Ok(Some(c)) => config = c,
            Ok(None) => {}
            Err(e) => {
                eprintln!("rsb: {e}\n  hint: {}", e.hint);
                return exit::CONFIG;
            }
        }
    }
    cli::fallback_notice(&config);
    // `rsb ls gpu1:data` / `rsb cat gpu1:log.txt`, as `rsb sync` takes them: a prefix that
    // names a configured sandbox picks it (over `-s`).
    let mut sandbox = cli.sandbox;
    let mut cmd = cli.cmd;
    if let Cmd::Ls { path, .. } | Cmd::Cat { path, .. } = &mut cmd
        && let Some((name, rest)) = cli::sandbox_path(&config, path)
    {
        sandbox = Some(name);
        *path = rest;
    }
    // `rsb grep PAT gpu1:src gpu1:tests`: every PATH on one sandbox.
    if let Cmd::Grep(a) = &mut cmd {
        let mut named: Option<String> = None;
        for path in a.paths_mut() {
            let Some((name, rest)) = cli::sandbox_path(&config, path) else {
                continue;
            };
            if named.as_ref().is_some_and(|n| *n != name) {
                eprintln!(
                    "rsb: the PATHs name two sandboxes ({} and {name})\n  hint: search one sandbox per rsb grep",
                    named.unwrap_or_default()
                );
                return cli::search::exit::ERROR;
            }
            named = Some(name);
            *path = rest;
        }
        if let Some(name) = named {
            sandbox = Some(name);
        }
    }
    // `rsb wait gpu1 train`: the first of two words is the sandbox.
    if let Cmd::Wait {
        first,
        job: Some(_),
        ..
    } = &cmd
    {
        sandbox = Some(first.clone());
    }
    // `rsb exec gpu1 hostname`, as `ssh gpu1 hostname`: a first word that names a configured
    // sandbox picks it unless `-s` was given (RSB_SANDBOX is a default, not a choice here).
    if let Cmd::Exec(a) = &mut cmd
        && !cli.sandbox_flag
        && let Some(first) = a.command.first()
        && config.sandbox(first).is_some()
    {
        if a.command.len() == 1 || (a.command.len() == 2 && a.command[1] == "--") {
            let name = rsb::term::shown(first);
            eprintln!(
                "rsb: `{name}` names a sandbox, not a command\n  hint: `rsb exec {name} -- CMD` runs CMD there (`rsb shell {name}` for a shell; `rsb exec -s SANDBOX -- {name}` runs a command of that name)"
            );
            return exit::USAGE;
        }
        sandbox = Some(a.command.remove(0));
        if a.command.first().is_some_and(|w| w == "--") {
            a.command.remove(0);
        }
    }
    let ctx = Ctx::new(config, json, sandbox);
    let code = match cmd {
        Cmd::Mcp
        | Cmd::Watchdog { .. }
        | Cmd::Watch { .. }
        | Cmd::Config { .. }
        | Cmd::State { .. }
        | Cmd::Completions { .. }
        | Cmd::Man
        | Cmd::Version
        | Cmd::Transfer { .. } => unreachable!(),
        Cmd::Sandboxes { resources } => cli::sandboxes::run(&ctx, resources).await,
        Cmd::Exec(a) => cli::exec::run(&ctx, a).await,
        Cmd::Audit {
            verify: Some(AuditCmd::Verify),
            ..
        } => cli::audit::verify(&ctx),
        Cmd::Audit { since, grep, .. } => cli::audit::run(&ctx, since.as_deref(), grep.as_deref()),
        Cmd::Shell { sandbox, cwd } => cli::exec::shell(&ctx, sandbox, cwd).await,
        Cmd::Ls {
            path,
            recursive,
            max_entries,
        } => cli::fs::ls(&ctx, &path, recursive, max_entries).await,
        Cmd::Cat {
            path,
            max_bytes,
            offset,
            limit,
            numbered,
        } => {
            let lines = cli::fs::Lines {
                offset,
                limit,
                numbered,
            };
            cli::fs::cat(&ctx, &path, max_bytes, lines).await
        }
        Cmd::Edit { target } => cli::edit::run(&ctx, &target).await,
        Cmd::Grep(a) => cli::search::run(&ctx, a).await,
        Cmd::Jobs { cmd } => cli::jobs::run(&ctx, cmd).await,
        Cmd::Wait {
            first,
            job,
            timeout,
            lines,
        } => cli::jobs::wait(&ctx, job.as_deref().unwrap_or(&first), timeout, lines).await,
        Cmd::Doctor => cli::doctor::run(&ctx).await,
        Cmd::Forward(a) => {
            ctx.warnings_for(&[]);
            // forward/cli.rs says 2 for a bad argument and 1 when it cannot start.
            match cli::forward::main(ctx.app.clone(), a, json).await {
                2 => exit::USAGE,
                1 => exit::CONNECTION,
                c => c,
            }
        }
        Cmd::Sync(a) => cli::sync::run(&ctx, a).await,
    };
    ctx.app.shutdown().await;
    code
}
