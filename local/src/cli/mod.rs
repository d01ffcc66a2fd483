//! The human CLI: each `cli/<cap>.rs` renders the typed results of `ops/<cap>.rs` as tables
//! (or `--json`), speaking in commands and flags rather than MCP tool and parameter names.
//! Exit codes come from one table ([`exit`]), shown in `rsb --help` and the README.

pub mod audit;
pub mod config;
pub mod doctor;
pub mod edit;
pub mod exec;
pub mod forward;
pub mod fs;
pub mod jobs;
pub mod meta;
pub mod policy;
pub mod sandboxes;
pub mod search;
mod search_json;
pub mod state;
pub mod sync;
pub mod transfer;
pub mod watchdog;

use std::sync::Arc;

use rsb::term::{shown, shown_lines};

use rsb::{
    app::App,
    config::Config,
    error::{Kind, RsbError},
    pool::Pool,
};

/// The exit codes of every `rsb` command (besides `rsb exec` and `rsb jobs logs -f`, which
/// pass the remote command's own code through).
pub mod exit {
    pub const OK: u8 = 0;
    /// A bad flag, argument or name (unknown sandbox or subcommand).
    pub const USAGE: u8 = 1;
    /// The configuration is missing or invalid.
    pub const CONFIG: u8 = 2;
    /// Cannot connect, authenticate, verify the host key or deploy the agent; or the link
    /// dropped.
    pub const CONNECTION: u8 = 3;
    /// The operation failed on the sandbox (no such file or job, permission denied, …).
    pub const REMOTE: u8 = 4;
    /// A bug in rsb.
    pub const INTERNAL: u8 = 5;
    /// `rsb sync` finished, but files in conflict were kept, not replaced, or a file that kept
    /// changing was left uncommitted: the destination does not match the source (as rsync's
    /// 23 says a transfer was partial). `rsb audit verify`: the log's hash chain breaks.
    pub const CONFLICTS: u8 = 6;
    /// The command policy denied the command, or it needed an approval that was not given
    /// (`[policy]` in the configuration); nothing ran.
    pub const POLICY: u8 = 7;
    /// `rsb exec --timeout` expired; the remote command's session was killed.
    pub const TIMEOUT: u8 = 124;
    /// Interrupted by Ctrl-C.
    pub const INTERRUPTED: u8 = 130;
    /// stdout closed by its reader (`rsb exec yes | head -1`): 128+SIGPIPE, as a shell
    /// reports a writer killed by SIGPIPE.
    pub const PIPE: u8 = 141;

    /// The table, for `--help` and the README.
    pub const TABLE: &str = "\
Exit codes:
  0    success
  N    rsb exec: the remote command's exit code, or 128+SIGNAL if a signal killed it;
       rsb jobs logs -f, rsb wait: the job's exit code, likewise
  1    usage: a bad flag, argument, sandbox or command name
  2    configuration missing or invalid (see `rsb config check`)
  3    connection: cannot connect, authenticate, verify the host key, deploy the agent,
       or the link dropped (see `rsb doctor`); rsb sandboxes: a sandbox is down
  4    the operation failed on the sandbox (no such file or job, permission denied, ...)
  5    internal error (a bug in rsb)
  6    rsb sync: conflicts (files changed on both sides were kept, not replaced;
       --force takes the source's side), or a file that kept changing while it was
       sent was left uncommitted (sync again once it is quiet); rsb audit verify:
       the audit log's hash chain breaks
  7    the command policy denied the command, or it needed an approval that was not
       given (see [policy] in the README); nothing ran
  0/1/2 rsb grep, as rg: a match / no match / an error
  124  rsb exec --timeout expired (the remote command's session was killed)
  130  interrupted (Ctrl-C: SIGINT to the remote command, SIGTERM 5 s later, SIGKILL 3 s after)
  141  stdout closed by its reader (rsb exec: the remote command was sent SIGPIPE and stopped)";
}

/// The exit code for an error of this kind.
pub fn code_of(e: &RsbError) -> u8 {
    match e.kind {
        // A bad argument is a usage error wherever it is found: a job name the agent
        // refuses (`rsb jobs start --name 'a b'`) is the user's argument, not a failure on
        // the sandbox.
        Kind::UnknownSandbox
        | Kind::InvalidArgument
        | Kind::Agent(rsb_protocol::ErrorCode::InvalidArgument) => exit::USAGE,
        Kind::Config => exit::CONFIG,
        Kind::Connect
        | Kind::Auth
        | Kind::HostKey
        | Kind::ConnectionLost
        | Kind::Deploy
        | Kind::Timeout => exit::CONNECTION,
        Kind::Agent(_) => exit::REMOTE,
        Kind::Internal => exit::INTERNAL,
        Kind::Policy => exit::POLICY,
    }
}

/// MCP tool and parameter names in `ops` messages, and what a CLI user types instead.
/// Longest first, so `exec_bash_background` is not read as `exec_bash`.
const CLI_WORDS: &[(&str, &str)] = &[
    (
        "list_sandboxes(check_resources=true)",
        "`rsb sandboxes --resources`",
    ),
    ("exec_bash_background", "`rsb jobs start`"),
    ("check_background_task", "`rsb jobs logs`"),
    ("kill_background_task", "`rsb jobs kill`"),
    ("list_background_tasks", "`rsb jobs list`"),
    ("sync_remote_to_local", "`rsb sync SANDBOX:PATH LOCAL`"),
    ("sync_local_to_remote", "`rsb sync LOCAL SANDBOX:PATH`"),
    ("list_remote_files", "`rsb ls`"),
    ("read_remote_file", "`rsb cat`"),
    ("list_sandboxes", "`rsb sandboxes`"),
    ("select_sandbox", "`-s SANDBOX`"),
    ("exec_bash", "`rsb exec`"),
    ("max_output_chars", "the output cap"),
    ("max_entries", "--max-entries"),
    ("last_n_lines", "--lines"),
    ("session_name", "--name"),
    ("tmux_session", "the job name"),
    ("local_path", "the local path"),
    ("remote_path", "the remote path"),
    ("timeout_s", "--timeout"),
    ("grace_s", "--grace"),
];

pub fn cli_words(s: &str) -> String {
    let mut s = s.to_string();
    for (mcp, cli) in CLI_WORDS {
        if s.contains(mcp) {
            s = s.replace(mcp, cli);
        }
    }
    s
}

/// Print an error (one line plus a hint) in CLI words and return its exit code.
pub fn fail(json: bool, e: &RsbError) -> u8 {
    let (message, hint) = (cli_words(&e.message), cli_words(&e.hint));
    if json {
        println!("{}", serde_json::json!({"error": message, "hint": hint}));
    } else {
        // Errors carry remote text (paths, agent messages): escaped for the terminal.
        let (message, hint) = (shown_lines(&message), shown_lines(&hint));
        eprintln!("rsb: {message}\n  hint: {hint}");
    }
    code_of(e)
}

pub fn warn(msg: &str) {
    eprintln!("rsb: warning: {}", shown_lines(msg));
}

pub fn print_json<T: serde::Serialize>(v: &T) {
    match serde_json::to_string(v) {
        Ok(s) => out_line(&s),
        Err(e) => eprintln!("rsb: cannot encode the reply: {e}"),
    }
}

/// `println!` that never panics: a reader that went away (`| head -c 300`) ends rsb as
/// SIGPIPE would (exit 141), for the commands that keep SIGPIPE ignored (`rsb exec`).
pub fn out_line(s: &str) {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    if writeln!(o, "{s}").and_then(|()| o.flush()).is_err() {
        std::process::exit(i32::from(exit::PIPE));
    }
}

/// Left-aligned columns sized to their widest cell; the last column is not padded.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    // Cells hold remote text (job names, hosts' answers): escaped for the terminal.
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| shown(c).into_owned()).collect())
        .collect();
    let rows = &rows;
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let n = cells.len();
        let mut s = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            if i + 1 == n {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

/// The closest of `names` to `name`, if close enough to be a likely typo.
pub fn did_you_mean<'a>(name: &str, names: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    names
        .into_iter()
        .map(|n| (strsim::jaro_winkler(name, n), n))
        .filter(|(s, _)| *s > 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, n)| n)
}

/// "unknown sandbox `x`" with the nearest name and the list.
pub fn unknown_sandbox(pool: &Pool, name: &str) -> RsbError {
    let names: Vec<&str> = pool.names().iter().map(String::as_str).collect();
    // A `~/.ssh/config` alias is a sandbox by itself only when nothing is configured (then
    // `-s ALIAS` reads it); otherwise the config names it with `ssh_config_host`.
    let ssh_config = rsb::config::ssh_config_file();
    let hint = match did_you_mean(name, names.iter().copied()) {
        Some(n) => format!("did you mean `{n}`? configured: {}", names.join(", ")),
        None if pool.config().source == rsb::config::BUILTIN_LOCAL => format!(
            "nothing is configured and {} has no `Host {name}`; add a Host block there, or a sandbox with ssh_config_host = \"{name}\" to {}",
            ssh_config.display(),
            rsb::config::config_file_path().display()
        ),
        None => format!(
            "configured sandboxes: {} (`rsb sandboxes` lists them); for a Host in {}, add a sandbox with ssh_config_host = \"{name}\"",
            names.join(", "),
            ssh_config.display()
        ),
    };
    RsbError::new(
        Kind::UnknownSandbox,
        format!("unknown sandbox `{name}`"),
        hint,
    )
}

/// `SANDBOX:PATH` when the prefix names a configured sandbox (no `/` in it): the sandbox and
/// the path. Anything else is a path on the `-s`/default sandbox.
pub fn sandbox_path(config: &Config, arg: &str) -> Option<(String, String)> {
    let (name, path) = arg.split_once(':')?;
    (!name.contains('/') && config.sandbox(name).is_some())
        .then(|| (name.to_string(), path.to_string()))
}

/// What every sandbox-using command shares: the pool, `--json`, and the `-s` choice.
pub struct Ctx {
    /// The pool and the store this command works with.
    pub app: Arc<App>,
    pub json: bool,
    /// `-s`/`RSB_SANDBOX`; `""` = the first configured sandbox.
    pub sandbox: String,
}

impl Ctx {
    pub fn new(config: Config, json: bool, sandbox: Option<String>) -> Ctx {
        Ctx {
            app: App::new(Arc::new(config)),
            json,
            sandbox: sandbox.unwrap_or_default(),
        }
    }

    /// The sandbox this command runs on, checked by name (with a suggestion), after
    /// printing the configuration warnings that concern it.
    pub fn resolve(&self) -> Result<String, RsbError> {
        let name = if self.sandbox.is_empty() {
            self.app.pool().resolve("")?
        } else if self.app.pool().names().contains(&self.sandbox) {
            self.sandbox.clone()
        } else {
            return Err(unknown_sandbox(self.app.pool(), &self.sandbox));
        };
        self.warnings_for(&[name.as_str()]);
        Ok(name)
    }

    /// Print the configuration warnings about these sandboxes, and those about no sandbox in
    /// particular, as `rsb: warning: …` lines.
    pub fn warnings_for(&self, used: &[&str]) {
        let config = self.app.pool().config();
        for w in &config.warnings {
            match warning_subject(config, w) {
                Some(n) if !used.contains(&n) => {}
                _ => warn(w),
            }
        }
    }

    pub async fn client(&self) -> Result<rsb::client::AgentClient, RsbError> {
        let name = self.resolve()?;
        self.app.pool().client(&name).await
    }
}

/// The sandbox a configuration warning is about: its label names an entry by position
/// (`REMOTE_SANDBOX_LIST[1]`, `config file …: sandbox[1]`).
pub(crate) fn warning_subject<'a>(config: &'a Config, w: &str) -> Option<&'a str> {
    let (_, rest) = w.split_once('[')?;
    let (idx, _) = rest.split_once(']')?;
    let i: usize = idx.parse().ok()?;
    config.sandboxes.get(i).map(|s| s.name.as_str())
}

/// Without any configuration rsb runs on this machine; say so once, naming where the
/// configuration would go.
pub fn fallback_notice(config: &Config) {
    if config.source == rsb::config::BUILTIN_LOCAL {
        eprintln!(
            "rsb: note: no sandboxes configured ({} not found); using the built-in `local` sandbox (this machine)",
            rsb::config::config_file_path().display()
        );
    }
}

/// One remote command from argv: a single argument is a bash command line as typed
/// (`rsb exec 'make | tee log'`); several are words whose boundaries are kept
/// (`rsb exec -- printf '%s\n' "a b"`), as if typed quoted.
pub fn command_line(argv: &[String]) -> String {
    match argv {
        [one] => one.clone(),
        words => words
            .iter()
            .map(|w| rsb_rules::shell::quote_str(w))
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// Log events in CLI commands read as `rsb: warning: …` lines, like rsb's own messages, not as
/// timestamped log records (those are for `rsb mcp` and the watchdog daemon).
pub struct CliLogFormat;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for CliLogFormat
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = match *event.metadata().level() {
            tracing::Level::ERROR => "error",
            tracing::Level::WARN => "warning",
            tracing::Level::INFO => "info",
            _ => "debug",
        };
        write!(w, "rsb: {level}: ")?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_speak_cli_not_mcp() {
        assert_eq!(
            cli_words("list_background_tasks shows the tasks; use exec_bash_background"),
            "`rsb jobs list` shows the tasks; use `rsb jobs start`"
        );
        assert_eq!(
            cli_words("local_path does not exist"),
            "the local path does not exist"
        );
        assert_eq!(
            cli_words("timeout_s must be between 1 and 5"),
            "--timeout must be between 1 and 5"
        );
    }

    #[test]
    fn typos_get_a_suggestion_and_strangers_do_not() {
        assert_eq!(did_you_mean("gpu2", ["gpu1", "dead"]), Some("gpu1"));
        assert_eq!(did_you_mean("lcoal", ["local"]), Some("local"));
        assert_eq!(did_you_mean("zzz", ["gpu1", "dead"]), None);
    }

    #[test]
    fn argv_words_keep_their_boundaries() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(command_line(&v(&["ls | wc -l"])), "ls | wc -l");
        assert_eq!(
            command_line(&v(&["printf", "%s\\n", "a b"])),
            "'printf' '%s\\n' 'a b'"
        );
        assert_eq!(command_line(&v(&["echo", "it's"])), "'echo' 'it'\\''s'");
    }

    #[test]
    fn every_error_kind_has_its_exit_code() {
        let code = |k| code_of(&RsbError::new(k, "m", "h"));
        assert_eq!(code(Kind::InvalidArgument), exit::USAGE);
        assert_eq!(code(Kind::UnknownSandbox), exit::USAGE);
        assert_eq!(code(Kind::Config), exit::CONFIG);
        assert_eq!(code(Kind::HostKey), exit::CONNECTION);
        assert_eq!(code(Kind::ConnectionLost), exit::CONNECTION);
        assert_eq!(
            code(Kind::Agent(rsb_protocol::ErrorCode::NotFound)),
            exit::REMOTE
        );
        assert_eq!(code(Kind::Internal), exit::INTERNAL);
    }

    #[test]
    fn durations_parse() {
        use std::time::Duration;
        let p = jobs::parse_duration;
        assert_eq!(p("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(p("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(p("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(p("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(p("45"), Ok(Duration::from_secs(45)));
        assert!(p("5x").is_err());
        assert!(p("h").is_err());
    }
}
