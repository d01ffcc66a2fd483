//! `rsb`: the MCP server (`rsb mcp`) and a human CLI over the same operations.

use std::{io::Write, process::ExitCode, sync::Arc, time::Duration};

use clap::{Parser, Subcommand};
use rsb::{
    config::Config,
    error::RsbError,
    ops::{exec, fs, jobs, sandboxes},
    pool::Pool,
};
use rsb_protocol::Chunk;
use serde_json::Value;

#[derive(Parser)]
#[command(
    name = "rsb",
    version,
    about = "Remote machines over SSH as sandboxes for AI agents"
)]
struct Cli {
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
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
    /// Run a command on a sandbox, streaming its output; exits with its exit code.
    Exec {
        #[arg(long, short)]
        sandbox: Option<String>,
        /// Seconds before the command's process group is killed.
        #[arg(long, short, default_value_t = 120)]
        timeout: i64,
        #[arg(long)]
        cwd: Option<String>,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// List a remote directory.
    Ls {
        #[arg(default_value = ".")]
        path: String,
        #[arg(long, short)]
        recursive: bool,
        #[arg(long, default_value_t = 200)]
        max_entries: i64,
        #[arg(long, short)]
        sandbox: Option<String>,
    },
    /// Print a remote file.
    Cat {
        path: String,
        #[arg(long, default_value_t = 8 * 1024 * 1024)]
        max_bytes: i64,
        #[arg(long, short)]
        sandbox: Option<String>,
    },
    /// Sync files exactly: `rsb sync LOCAL SANDBOX:REMOTE` uploads, `rsb sync SANDBOX:REMOTE LOCAL`
    /// downloads (`:REMOTE` = the active sandbox). Remote paths are relative to the remote $HOME.
    Sync {
        src: String,
        dst: String,
        /// Delete destination entries missing from the source (never excluded ones).
        #[arg(long)]
        delete: bool,
        /// gitignore-style pattern to exclude (repeatable); .git, node_modules, … are excluded
        /// by default.
        #[arg(long = "exclude", value_name = "PAT")]
        exclude: Vec<String>,
        /// File of exclude patterns.
        #[arg(long)]
        exclude_file: Option<String>,
        /// List what would change, one line per action; change nothing.
        #[arg(long, short = 'n')]
        dry_run: bool,
        #[command(flatten)]
        safety: rsb::sync::cli::SafetyArgs,
    },
    /// Forward a local port to a service on a sandbox over its SSH connection, as `ssh -L`
    /// does: SANDBOX:PORT, SANDBOX:HOST:PORT or SANDBOX:/path/to.sock (`:PORT` = the active
    /// sandbox). Runs until Ctrl-C, printing a line per connection; survives reconnects.
    Forward {
        /// SANDBOX:PORT, SANDBOX:HOST:PORT or SANDBOX:/path/to.sock, as the sandbox sees it.
        target: String,
        /// Local port: default the remote port when free (else any), 0 = any free port.
        local_port: Option<i64>,
        /// Local address to listen on; anything but loopback lets other machines in.
        #[arg(long, default_value = "127.0.0.1")]
        bind: String,
    },
    /// Background jobs supervised by the agent.
    Jobs {
        #[command(subcommand)]
        cmd: JobsCmd,
    },
    /// The local daemon that watches long jobs: run, install, uninstall, status.
    Watchdog {
        #[command(subcommand)]
        cmd: rsb::watchdog::cli::WatchdogCmd,
    },
    /// Watches of long jobs: list, show, events, cancel.
    Watch {
        #[command(subcommand)]
        cmd: rsb::watchdog::cli::WatchCmd,
    },
    /// Background transfer worker (started by the server).
    #[command(hide = true)]
    Transfer {
        #[command(subcommand)]
        cmd: rsb::sync::cli::TransferCmd,
    },
}

#[derive(Subcommand)]
enum JobsCmd {
    /// Start a detached job.
    Start {
        #[arg(long, short)]
        name: Option<String>,
        #[arg(long)]
        cwd: Option<String>,
        #[arg(long)]
        log: Option<String>,
        #[arg(long, short)]
        sandbox: Option<String>,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// List jobs.
    List {
        #[arg(long, short)]
        sandbox: Option<String>,
    },
    /// Show a job's log (follow with -f until it ends).
    Logs {
        name: String,
        #[arg(long, short)]
        follow: bool,
        #[arg(long, short = 'n', default_value_t = 50)]
        lines: i64,
        #[arg(long, short)]
        sandbox: Option<String>,
    },
    /// Stop a job: SIGTERM, then SIGKILL after the grace.
    Kill {
        name: String,
        #[arg(long, default_value_t = 5.0)]
        grace: f64,
        #[arg(long, short)]
        sandbox: Option<String>,
    },
}

fn init_tracing(default: &str) {
    // stdout is the MCP channel: logs go to stderr only.
    let filter = tracing_subscriber::EnvFilter::try_from_env("RSB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(filter)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The watchdog's log (a file or the journal) should say when it started and why it stopped.
    let daemon = matches!(
        cli.cmd,
        Cmd::Watchdog {
            cmd: rsb::watchdog::cli::WatchdogCmd::Run { .. }
        }
    );
    init_tracing(if daemon { "info" } else { "warn" });
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rsb: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = rt.block_on(run(cli));
    // Do not wait for lingering tasks (idle SSH connections) on exit.
    rt.shutdown_timeout(Duration::from_millis(200));
    ExitCode::from(code)
}

fn print_error(json: bool, e: &RsbError) {
    if json {
        println!(
            "{}",
            serde_json::json!({"error": e.message, "hint": e.hint})
        );
    } else {
        eprintln!("rsb: {}\n  hint: {}", e.message, e.hint);
    }
}

fn print_value(json: bool, v: &Value) {
    if json {
        println!("{v}");
    } else {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    }
}

async fn run(cli: Cli) -> u8 {
    rsb::transfers::enable_workers();
    // The watchdog needs only the state dir (it reads persisted, secret-free sandboxes).
    match cli.cmd {
        Cmd::Watchdog { cmd } => {
            return rsb::watchdog::cli::watchdog(cmd, cli.json, &rsb::config::state_dir()).await;
        }
        Cmd::Watch { cmd } => {
            return rsb::watchdog::cli::watch(cmd, cli.json, &rsb::config::state_dir()).await;
        }
        Cmd::Transfer { cmd } => {
            return rsb::sync::cli::transfer(cmd, &rsb::config::state_dir()).await;
        }
        _ => {}
    }
    let config = match Config::load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rsb: {e}\n  hint: {}", e.hint);
            // An MCP client shows a server that exits at start as a bare failure; serve the
            // tools instead and reply to each call with the config error (as the seed did).
            if let Cmd::Mcp = cli.cmd {
                return match rsb::mcp::serve_config_error(e).await {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("rsb mcp: {e}");
                        1
                    }
                };
            }
            return 2;
        }
    };
    for w in &config.warnings {
        tracing::warn!("{w}");
    }
    if let Cmd::Mcp = cli.cmd {
        return match rsb::mcp::serve(config).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rsb mcp: {e}");
                1
            }
        };
    }
    let pool = Arc::new(Pool::new(Arc::new(config)));
    let json = cli.json;
    let code = match cli.cmd {
        Cmd::Mcp | Cmd::Watchdog { .. } | Cmd::Watch { .. } | Cmd::Transfer { .. } => {
            unreachable!()
        }
        Cmd::Sandboxes { resources } => {
            let v = sandboxes::list(&pool, resources).await;
            if json {
                print_value(true, &v)
            } else {
                print_sandboxes(&v, resources)
            }
            0
        }
        Cmd::Exec {
            sandbox,
            timeout,
            cwd,
            command,
        } => {
            run_exec(
                &pool,
                json,
                sandbox.as_deref().unwrap_or(""),
                timeout,
                cwd.as_deref(),
                &command.join(" "),
            )
            .await
        }
        Cmd::Ls {
            path,
            recursive,
            max_entries,
            sandbox,
        } => {
            let r = async {
                let req = fs::list_request(&path, recursive, max_entries)?;
                let c = pool.client(sandbox.as_deref().unwrap_or("")).await?;
                Ok::<_, RsbError>(fs::list_reply(&path, &c.call(req).await?))
            }
            .await;
            match r {
                Ok(v) if json => {
                    print_value(true, &v);
                    0
                }
                Ok(v) => {
                    for e in v["entries"].as_array().into_iter().flatten() {
                        let d = if e["is_dir"].as_bool() == Some(true) {
                            "/"
                        } else {
                            ""
                        };
                        println!("{:>12}  {}{d}", e["size"], e["path"].as_str().unwrap_or(""));
                    }
                    if v["truncated"].as_bool() == Some(true) {
                        eprintln!("(truncated at {max_entries} entries)");
                    }
                    0
                }
                Err(e) => {
                    print_error(json, &e);
                    1
                }
            }
        }
        Cmd::Cat {
            path,
            max_bytes,
            sandbox,
        } => {
            let r = async {
                let req = fs::read_request(&path, max_bytes)?;
                let c = pool.client(sandbox.as_deref().unwrap_or("")).await?;
                c.call(req).await
            }
            .await;
            match r {
                Ok(f) if json => {
                    print_value(true, &fs::read_reply(&f));
                    0
                }
                Ok(f) => {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(&f.data);
                    let _ = out.flush();
                    if f.truncated {
                        eprintln!(
                            "rsb: output truncated at {} of {} bytes",
                            f.data.len(),
                            f.size
                        );
                    }
                    0
                }
                Err(e) => {
                    print_error(json, &e);
                    1
                }
            }
        }
        Cmd::Jobs { cmd } => run_jobs(&pool, json, cmd).await,
        Cmd::Forward {
            target,
            local_port,
            bind,
        } => rsb::forward::cli::run(pool.clone(), &target, local_port, &bind, json).await,
        Cmd::Sync {
            src,
            dst,
            delete,
            exclude,
            exclude_file,
            dry_run,
            safety,
        } => {
            let opts = SyncOpts {
                delete,
                exclude,
                exclude_file,
                dry_run,
                safety,
            };
            run_sync(&pool, json, &src, &dst, opts).await
        }
    };
    pool.shutdown().await;
    code
}

async fn run_exec(
    pool: &Pool,
    json: bool,
    sandbox: &str,
    timeout: i64,
    cwd: Option<&str>,
    command: &str,
) -> u8 {
    let mut req = match exec::build_request(command, cwd, timeout, 1 << 20) {
        Ok(r) => r,
        Err(e) => {
            print_error(json, &e);
            return 2;
        }
    };
    let client = match pool.client(sandbox).await {
        Ok(c) => c,
        Err(e) => {
            print_error(json, &e);
            return 255;
        }
    };
    if json {
        return match client.call(req).await {
            Ok(r) => {
                print_value(true, &exec::reply(&r, timeout));
                r.exit_code
                    .unwrap_or(if r.timed_out {
                        124
                    } else {
                        128 + r.signal.unwrap_or(0)
                    })
                    .clamp(0, 255) as u8
            }
            Err(e) => {
                print_error(true, &e);
                255
            }
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
            return 130;
        }
    };
    let _ = printer.await;
    match res {
        Ok(r) => {
            if r.timed_out {
                eprintln!("rsb: timed out after {timeout}s; the remote process group was killed");
                return 124;
            }
            match (r.exit_code, r.signal) {
                (Some(c), _) => c.clamp(0, 255) as u8,
                (None, Some(s)) => (128 + s).clamp(0, 255) as u8,
                _ => 255,
            }
        }
        Err(e) => {
            print_error(false, &e);
            255
        }
    }
}

async fn run_jobs(pool: &Pool, json: bool, cmd: JobsCmd) -> u8 {
    let sandbox = match &cmd {
        JobsCmd::Start { sandbox, .. }
        | JobsCmd::List { sandbox }
        | JobsCmd::Logs { sandbox, .. }
        | JobsCmd::Kill { sandbox, .. } => sandbox.clone().unwrap_or_default(),
    };
    let client = match pool.client(&sandbox).await {
        Ok(c) => c,
        Err(e) => {
            print_error(json, &e);
            return 1;
        }
    };
    let r: Result<Value, RsbError> = match cmd {
        JobsCmd::Start {
            name,
            cwd,
            log,
            command,
            ..
        } => {
            jobs::start(
                &client,
                &command.join(" "),
                name.as_deref().unwrap_or(""),
                log.as_deref().unwrap_or(""),
                cwd.as_deref().unwrap_or(""),
            )
            .await
        }
        JobsCmd::List { .. } => jobs::list(&client).await,
        JobsCmd::Kill { name, grace, .. } => jobs::kill(&client, &name, grace).await,
        JobsCmd::Logs {
            name,
            follow,
            lines,
            ..
        } => {
            if !follow {
                match jobs::status_request(&name, "", lines, None, 1) {
                    Ok(req) => client
                        .call(req)
                        .await
                        .and_then(|r| jobs::status_reply(&name, false, &r)),
                    Err(e) => Err(e),
                }
            } else {
                return follow_logs(&client, &name).await;
            }
        }
    };
    match r {
        Ok(v) => {
            if !json && let Some(t) = v.get("log_tail").and_then(Value::as_str) {
                print!("{t}");
            } else {
                print_value(json, &v);
            }
            0
        }
        Err(e) => {
            print_error(json, &e);
            1
        }
    }
}

/// Print the log from the start, then every new byte, until the job ends (bounded polling).
async fn follow_logs(client: &rsb::client::AgentClient, name: &str) -> u8 {
    let mut offset = 0i64;
    loop {
        let req = match jobs::status_request(name, "", 1, Some(offset), jobs::MAX_CURSOR_BYTES) {
            Ok(r) => r,
            Err(e) => {
                print_error(false, &e);
                return 1;
            }
        };
        let r = match client.call(req).await {
            Ok(r) => r,
            Err(e) => {
                print_error(false, &e);
                return 1;
            }
        };
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(&r.log);
        let _ = o.flush();
        drop(o);
        offset = r.next_offset as i64;
        let running = r
            .info
            .as_ref()
            .is_some_and(|i| i.state == rsb_protocol::JobState::Running);
        if !running && !r.log_truncated {
            return 0;
        }
        if !r.log_truncated {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

struct SyncOpts {
    delete: bool,
    exclude: Vec<String>,
    exclude_file: Option<String>,
    dry_run: bool,
    safety: rsb::sync::cli::SafetyArgs,
}

/// `SANDBOX:PATH` (or `:PATH` for the active sandbox) when the prefix names a sandbox.
fn split_remote<'a>(pool: &Pool, arg: &'a str) -> Option<(&'a str, &'a str)> {
    let (name, path) = arg.split_once(':')?;
    if name.contains('/') {
        return None;
    }
    (name.is_empty() || pool.names().iter().any(|n| n == name)).then_some((name, path))
}

async fn run_sync(pool: &Pool, json: bool, src: &str, dst: &str, o: SyncOpts) -> u8 {
    use rsb::sync::{Direction, Phase, Progress, SyncSpec};
    use std::io::IsTerminal;
    let (direction, sandbox, remote, local) = match (
        split_remote(pool, src),
        split_remote(pool, dst),
    ) {
        (None, Some((s, r))) => (Direction::Upload, s, r, src),
        (Some((s, r)), None) => (Direction::Download, s, r, dst),
        _ => {
            print_error(
                json,
                &RsbError::invalid(
                    "exactly one side must be SANDBOX:PATH",
                    format!(
                        "rsb sync LOCAL SANDBOX:REMOTE uploads, rsb sync SANDBOX:REMOTE LOCAL downloads; sandboxes: {}",
                        pool.names().join(", ")
                    ),
                ),
            );
            return 2;
        }
    };
    let prep = (|| {
        let sandbox = pool.resolve(sandbox)?;
        let local_path = rsb::ops::sync::expand_local(local)?;
        if direction == Direction::Upload && !local_path.exists() {
            return Err(RsbError::invalid(
                format!("local_path does not exist: {}", local_path.display()),
                "check the path",
            ));
        }
        let rules = rsb::ops::sync::load_rules(&o.exclude, o.exclude_file.as_deref())?;
        Ok::<_, RsbError>((
            sandbox,
            SyncSpec {
                direction,
                local_path,
                remote_path: if remote.is_empty() {
                    ".".into()
                } else {
                    remote.into()
                },
                delete_extras: o.delete,
                rules,
                dry_run: o.dry_run,
            },
        ))
    })();
    let (sandbox, spec) = match prep {
        Ok(x) => x,
        Err(e) => {
            print_error(json, &e);
            return 2;
        }
    };
    let bar = (!json && !o.dry_run && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {msg:32} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.enable_steady_tick(Duration::from_millis(120));
        b
    });
    let progress: Option<rsb::sync::ProgressFn> = bar.clone().map(|b| {
        Arc::new(move |p: &Progress| {
            b.set_length(p.bytes_total);
            b.set_position(p.bytes_done);
            let msg = match p.phase {
                Phase::Transferring | Phase::Deleting => {
                    format!(
                        "{} {}/{} files",
                        p.phase.as_str(),
                        p.files_done,
                        p.files_total
                    )
                }
                ph => ph.as_str().to_string(),
            };
            b.set_message(msg);
        }) as rsb::sync::ProgressFn
    });
    let cancel = rsb::sync::CancellationToken::new();
    let c2 = cancel.clone();
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            c2.cancel();
        }
    });
    let r = rsb::ops::sync::run_with(
        pool,
        &sandbox,
        &spec,
        &o.safety.options(),
        progress,
        &cancel,
    )
    .await;
    ctrl_c.abort();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    match r {
        Ok(rep) if json => {
            print_value(true, &rep.to_json());
            0
        }
        Ok(rep) => {
            for a in &rep.actions {
                println!("{a}");
            }
            for e in &rep.errors {
                eprintln!("rsb: warning: {e}");
            }
            rsb::sync::cli::print_conflicts(&rep);
            let verb = if rep.dry_run { "would send" } else { "sent" };
            println!(
                "{} {} -> {}: {verb} {} files ({} bytes), {} dirs created, {} unchanged, {} attrs, {} deleted, {} special skipped, {:.2}s",
                rep.synced_type,
                if direction == Direction::Upload {
                    &rep.local_path
                } else {
                    &rep.remote_path
                },
                if direction == Direction::Upload {
                    &rep.remote_path
                } else {
                    &rep.local_path
                },
                rep.files_transferred,
                if rep.dry_run {
                    rep.bytes_planned
                } else {
                    rep.bytes_sent
                },
                rep.dirs_created,
                rep.skipped_files,
                rep.attrs_updated,
                rep.deleted_files + rep.deleted_dirs,
                rep.skipped_special,
                rep.duration_s
            );
            0
        }
        Err(e) if cancel.is_cancelled() => {
            print_error(json, &e);
            130
        }
        Err(e) => {
            print_error(json, &e);
            1
        }
    }
}

fn print_sandboxes(v: &Value, resources: bool) {
    let active = v["active_sandbox"].as_str().unwrap_or("");
    println!(
        "{:<2}{:<16} {:<28} {:<6} {}",
        "",
        "NAME",
        "ADDRESS",
        "ALIVE",
        if resources {
            "CPU%  MEM%  GPU  IDLE"
        } else {
            ""
        }
    );
    for s in v["sandboxes"].as_array().into_iter().flatten() {
        let name = s["name"].as_str().unwrap_or("");
        let mark = if name == active { "*" } else { "" };
        let addr = format!(
            "{}@{}:{}",
            s["user"].as_str().unwrap_or(""),
            s["host"].as_str().unwrap_or(""),
            s["port"]
        );
        let alive = if s["connection_alive"].as_bool() == Some(true) {
            "yes"
        } else {
            "no"
        };
        let mut extra = String::new();
        if resources {
            let r = &s["resources"];
            if let Some(e) = r.get("error").and_then(Value::as_str) {
                extra = format!("error: {e}");
            } else {
                let gpus = r["gpu"].as_array().map(|g| g.len()).unwrap_or(0);
                extra = format!(
                    "{:>4.0}  {:>4.0}  {:>3}  {:.3}",
                    r["cpu"]["usage_pct"].as_f64().unwrap_or(0.0),
                    r["memory"]["used_pct"].as_f64().unwrap_or(0.0),
                    gpus,
                    r["idle_score"].as_f64().unwrap_or(0.0)
                );
            }
        } else if let Some(e) = s.get("connection_error").and_then(Value::as_str) {
            extra = e.to_string();
        }
        println!("{mark:<2}{name:<16} {addr:<28} {alive:<6} {extra}");
    }
}
