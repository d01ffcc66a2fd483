//! `rsb sync SRC DST`: one exact sync (or `--watch`), with rsync's habits: its trailing-slash
//! rule, `-n`, `--delete`, `--exclude`, `-v` (a line per file sent, deleted or in conflict),
//! `-a` accepted.

use clap::Args;
use rsb::{
    app::App,
    error::RsbError,
    ops::action::{Act, Caller},
    pool::Pool,
    sync::{Direction, SyncSpec},
};

use super::{Ctx, exit, fail};
use rsb::term::shown;

#[derive(Args)]
pub struct SyncArgs {
    /// LOCAL or SANDBOX:PATH. As rsync: a directory named without a trailing slash is copied
    /// as a directory of that name inside DST (`proj` makes DST/proj); with one (`proj/`), or
    /// `.`, its contents are copied into DST.
    src: String,
    /// SANDBOX:PATH or LOCAL; `SANDBOX:` alone is the remote home (contents written straight
    /// into a non-empty home are asked first).
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
    /// Also apply the source tree's .gitignore files at every depth, as git does (nested
    /// ones apply below their directory; --exclude still wins).
    #[arg(long)]
    gitignore: bool,
    /// List what would change, one line per action; change nothing.
    #[arg(long, short = 'n')]
    dry_run: bool,
    /// A line per file sent, symlink made, entry deleted (and each conflict), as rsync -v.
    #[arg(long, short = 'v')]
    verbose: bool,
    /// Keep syncing: upload every burst of local changes until Ctrl-C (a line per burst).
    #[arg(long, short = 'w')]
    watch: bool,
    /// With --watch: poll the tree instead of using OS file events.
    #[arg(long, requires = "watch")]
    poll: bool,
    /// With --watch: a burst is sent once the tree was quiet this long (ms; a small burst whose
    /// written files are all closed again waits 20 ms at most).
    #[arg(long, requires = "watch", value_name = "MS", default_value_t = 50,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    debounce: u64,
    #[command(flatten)]
    safety: rsb::sync::cli::SafetyArgs,
    /// Approve a --delete or --force the policy's ask_actions hold for approval, without the
    /// question.
    #[arg(long, short = 'y')]
    yes: bool,
    /// Accepted for rsync habits and ignored: rsb always keeps modes, mtimes and symlinks.
    #[arg(short = 'a', long = "archive")]
    archive: bool,
    /// Compress file bytes on the wire, as rsync -z. Without it rsb compresses when the link is
    /// slow (a round trip of 5 ms or more; RSB_SYNC_COMPRESS=on|off|auto).
    #[arg(short = 'z', long = "compress")]
    compress: bool,
}

impl SyncArgs {
    /// `-z` as the engine's compression mode.
    fn compress_mode(&self) -> Option<rsb::sync::compress::Mode> {
        self.compress.then_some(rsb::sync::compress::Mode::On)
    }
}

impl SyncArgs {
    /// The two paths as given, for finding a `~/.ssh/config` alias among their prefixes.
    pub fn paths(&self) -> [&str; 2] {
        [&self.src, &self.dst]
    }
}

/// `SANDBOX:PATH` (or `:PATH` for the `-s`/active sandbox) when the prefix names a sandbox.
pub(super) fn split_remote<'a>(pool: &Pool, arg: &'a str) -> Option<(&'a str, &'a str)> {
    let (name, path) = arg.split_once(':')?;
    if name.contains('/') {
        return None;
    }
    (name.is_empty() || pool.names().iter().any(|n| n == name)).then_some((name, path))
}

/// `uxl:foo` where `uxl` names no sandbox (and no local `uxl:foo` exists): the user meant a
/// sandbox, so say which name is unknown rather than that no side is remote.
fn unknown_prefix(pool: &Pool, args: [&str; 2]) -> Option<RsbError> {
    args.into_iter().find_map(|a| {
        let (name, _) = a.split_once(':')?;
        let plausible = !name.is_empty()
            && !name.contains('/')
            && !pool.names().iter().any(|n| n == name)
            && !std::path::Path::new(a).exists();
        plausible.then(|| super::unknown_sandbox(pool, name))
    })
}

pub async fn run(ctx: &Ctx, a: SyncArgs) -> u8 {
    if a.archive {
        eprintln!("rsb: note: -a is implied: rsb always keeps modes, mtimes and symlinks");
    }
    let used: Vec<&str> = [&a.src, &a.dst]
        .iter()
        .filter_map(|x| x.split_once(':').map(|(n, _)| n))
        .collect();
    ctx.warnings_for(&used);
    let pool = ctx.app.pool();
    let json = ctx.json;
    let (direction, sandbox, remote, local) = match (
        split_remote(pool, &a.src),
        split_remote(pool, &a.dst),
    ) {
        (None, Some((s, r))) => (Direction::Upload, s, r, a.src.as_str()),
        (Some((s, r)), None) => (Direction::Download, s, r, a.dst.as_str()),
        _ => {
            let e = unknown_prefix(pool, [&a.src, &a.dst]).unwrap_or_else(|| {
                    RsbError::invalid(
                        "exactly one side must be SANDBOX:PATH",
                        format!(
                            "rsb sync LOCAL SANDBOX:REMOTE uploads, rsb sync SANDBOX:REMOTE LOCAL downloads; sandboxes: {}",
                            pool.names().join(", ")
                        ),
                    )
                });
            return fail(json, &e);
        }
    };
    // `:PATH` means the sandbox chosen with -s/RSB_SANDBOX (else the active one).
    let sandbox = if sandbox.is_empty() {
        ctx.sandbox.as_str()
    } else {
        sandbox
    };
    let prep = (|| {
        let sandbox = if pool.names().iter().any(|n| n == sandbox) || sandbox.is_empty() {
            pool.resolve(sandbox)?
        } else {
            return Err(super::unknown_sandbox(pool, sandbox));
        };
        let local_path = rsb::ops::sync::expand_local(local)?;
        if direction == Direction::Upload && !local_path.exists() {
            return Err(RsbError::invalid(
                format!("no such local file or directory: {}", local_path.display()),
                "check the LOCAL argument (relative paths start from the current directory)",
            ));
        }
        let mut rules = rsb::ops::sync::load_rules(&a.exclude, a.exclude_file.as_deref())?;
        rules.gitignore = a.gitignore;
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
                delete_extras: a.delete,
                rules,
                dry_run: a.dry_run,
            },
        ))
    })();
    let (sandbox, mut spec) = match prep {
        Ok(x) => x,
        Err(e) => return fail(json, &e),
    };
    if let Err(e) = as_rsync(ctx, &sandbox, &mut spec, &a).await {
        return fail(json, &e);
    }
    let caller = super::policy::caller(a.yes);
    if let Err(e) = approve(ctx, &caller, &sandbox, &spec, &a).await {
        return fail(json, &e);
    }
    let act = Act {
        sandbox: &sandbox,
        tool: "rsb sync",
        command: Some(rsb::ops::sync::described(&sandbox, &spec)),
        long: true,
        ..Default::default()
    };
    if a.watch {
        let opts = rsb::sync::watch::WatchOptions {
            poll: a.poll.then_some(std::time::Duration::from_millis(500)),
            debounce: std::time::Duration::from_millis(a.debounce),
            // A writer that never pauses still gets synced; 1 s at the default debounce.
            max_burst: std::time::Duration::from_millis(a.debounce.saturating_mul(20).max(1000)),
            confirm_delete: a.safety.confirm_delete,
            compress: a.compress_mode(),
            ..Default::default()
        };
        let r = caller
            .act(pool, act, async |sandbox| {
                rsb::sync::watch::run_cli(&ctx.app, &sandbox, &spec, json, opts).await
            })
            .await;
        return match r {
            Ok(()) => exit::OK,
            Err(e) => fail(json, &e),
        };
    }
    once(&ctx.app, &caller, act, json, &spec, &a).await
}

/// A source named as a directory's contents: a trailing slash, `.`/`..`, or a home (`box:`,
/// `box:~`), as rsync reads it.
fn names_contents(src: &str) -> bool {
    let s = src.trim();
    s.is_empty() || s.ends_with('/') || matches!(s.rsplit('/').next(), Some("." | ".." | "~"))
}

/// `dst` with rsync's rule applied for a directory source `src`: named without a trailing slash
/// it is copied as a directory of its own name inside `dst`; named as its contents
/// ([`names_contents`]) it is copied into `dst` itself.
fn rsync_dst(src: &str, dst: &str) -> String {
    if names_contents(src) {
        return dst.to_string();
    }
    let name = src
        .trim()
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    match dst.trim() {
        "" => name.to_string(),
        d if d.ends_with('/') => format!("{d}{name}"),
        d => format!("{d}/{name}"),
    }
}

/// The destination is a home: the sandbox's (`box:`, `box:~`, `box:.`) or, downloading, the
/// user's own.
fn is_home(spec: &SyncSpec) -> bool {
    match spec.direction {
        Direction::Upload => {
            rsb_rules::path::anchor_home(&spec.remote_path).trim_end_matches('/') == "~"
        }
        Direction::Download => {
            let canon = |p: &std::path::Path| std::fs::canonicalize(p).ok();
            let home = std::env::var_os("HOME").and_then(|h| canon(std::path::Path::new(&h)));
            home.is_some_and(|h| Some(h) == canon(&spec.local_path))
        }
    }
}

/// rsync's trailing-slash rule, which the MCP tools (the seed's semantics) do not follow:
/// `rsb sync proj box:` makes `~/proj`, and `rsb sync proj/ box:` copies proj's contents into
/// the home; so does a download. Writing a directory's contents straight into a non-empty home
/// is asked first (`-y` approves it; a dry run changes nothing and is not asked).
async fn as_rsync(
    ctx: &Ctx,
    sandbox: &str,
    spec: &mut SyncSpec,
    a: &SyncArgs,
) -> Result<(), RsbError> {
    let src_is_dir = match spec.direction {
        Direction::Upload => spec.local_path.is_dir(),
        Direction::Download => {
            let client = ctx.app.pool().client(sandbox).await?;
            let req = rsb_protocol::StatRequest {
                path: rsb_rules::path::anchor_home(&spec.remote_path),
                follow: true,
                confine: None,
            };
            match client.call(req).await {
                Ok(st) => st.kind == rsb_protocol::FileKind::Dir,
                // A missing source is the sync's own error to report.
                Err(_) => false,
            }
        }
    };
    if !src_is_dir {
        return Ok(());
    }
    // The source as typed (a remote one without its `SANDBOX:`).
    let src = match spec.direction {
        Direction::Upload => a.src.clone(),
        Direction::Download => spec.remote_path.clone(),
    };
    match spec.direction {
        Direction::Upload => spec.remote_path = rsync_dst(&src, &spec.remote_path),
        Direction::Download => {
            let given = a.dst.clone();
            spec.local_path = rsb::ops::sync::expand_local(&rsync_dst(&src, &given))?;
        }
    }
    if !names_contents(&src) || spec.dry_run || !is_home(spec) {
        return Ok(());
    }
    let empty = match spec.direction {
        Direction::Upload => {
            let client = ctx.app.pool().client(sandbox).await?;
            let req = rsb_protocol::ListDirRequest {
                path: "~".into(),
                recursive: false,
                max_entries: 1,
                confine: None,
            };
            client.call(req).await.is_ok_and(|l| l.entries.is_empty())
        }
        Direction::Download => std::fs::read_dir(&spec.local_path)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false),
    };
    if empty {
        return Ok(());
    }
    let whose = match spec.direction {
        Direction::Upload => format!("{sandbox}'s home"),
        Direction::Download => "your home".to_string(),
    };
    let question = format!(
        "rsb sync {} -> {} writes the contents of {} straight into {whose}, which is not empty (rsync's trailing-slash rule; without the slash it makes a directory of that name)",
        shown(&a.src),
        shown(&a.dst),
        shown(a.src.trim_end_matches('/')),
    );
    let why = match super::policy::terminal(question, a.yes).await {
        rsb::policy::Answer::Approved => return Ok(()),
        rsb::policy::Answer::Declined => "declined".to_string(),
        rsb::policy::Answer::Cancelled => "cancelled".to_string(),
        rsb::policy::Answer::CannotAsk(why) => why,
    };
    // Refused as an unapproved action is (exit 7).
    Err(RsbError::new(
        rsb::error::Kind::Policy,
        format!(
            "not syncing the contents of {} into {whose}: {why}",
            shown(&a.src),
        ),
        "drop the trailing slash to make a directory of that name, name one (box:proj), or pass -y",
    ))
}

/// The policy's `ask_actions` for `--delete` and `--force`: asked with what the first sync
/// would destroy; with `--watch`, a `--delete` is asked about up front, since every later
/// burst deletes what goes from the local tree.
async fn approve(
    ctx: &Ctx,
    caller: &Caller,
    sandbox: &str,
    spec: &SyncSpec,
    a: &SyncArgs,
) -> Result<(), RsbError> {
    let cfg = ctx.app.config();
    if a.watch
        && spec.delete_extras
        && rsb::policy::asks(cfg, sandbox, rsb::policy::Action::DeleteExtras)
    {
        let what = format!(
            "rsb sync --watch --delete {} -> {} deletes destination entries as they go from the \
             local tree, for as long as it runs",
            shown(&a.src),
            shown(&a.dst)
        );
        return caller
            .approve(
                cfg,
                sandbox,
                "rsb sync",
                rsb::policy::Action::DeleteExtras,
                what,
            )
            .await;
    }
    let cancel = rsb::sync::CancellationToken::new();
    rsb::ops::sync::approve_spec(
        &ctx.app,
        caller,
        "rsb sync",
        sandbox,
        spec,
        &a.safety.options(),
        &cancel,
    )
    .await
}

/// A sync that kept conflicting files, or left a file that kept changing uncommitted, did not
/// make the destination match: a script's `rsb sync . gpu:proj && rsb exec 'python
/// train.py'` must not go on with the stale file.
fn conflict_code(rep: &rsb::sync::SyncReport) -> u8 {
    if rep.conflicts.is_empty() && rep.unsettled == 0 {
        exit::OK
    } else {
        exit::CONFLICTS
    }
}

/// One sync (`act`, its audit lines around it), rendered: the actions with `-n`/`-v`, the
/// conflicts, the summary line.
async fn once(
    app: &App,
    caller: &Caller,
    act: Act<'_>,
    json: bool,
    spec: &SyncSpec,
    a: &SyncArgs,
) -> u8 {
    use std::io::IsTerminal;
    let (bar, progress) = if !json && !a.dry_run && std::io::stderr().is_terminal() {
        let (b, f) = rsb::sync::cli::progress_bar();
        (Some(b), Some(f))
    } else {
        (None, None)
    };
    let cancel = rsb::sync::CancellationToken::new();
    let c2 = cancel.clone();
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            c2.cancel();
        }
    });
    let mut opts = a.safety.options();
    opts.list_actions = a.verbose && !json;
    opts.compress = a.compress_mode();
    let r = caller
        .act(app.pool(), act, async |sandbox| {
            rsb::ops::sync::run_with(app, &sandbox, spec, &opts, progress, &cancel).await
        })
        .await;
    ctrl_c.abort();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    match r {
        Ok(rep) if json => {
            println!("{}", rep.to_json());
            conflict_code(&rep)
        }
        Ok(rep) => {
            // Quiet by default (the summary line); -n and -v list the actions.
            // Names and errors are the remote's text: escaped for the terminal.
            for line in &rep.actions {
                println!("{}", shown(line));
            }
            if a.verbose {
                for (rel, _, _) in &rep.conflicts {
                    println!("conflict {} (kept)", shown(rel));
                }
            }
            for e in &rep.errors {
                eprintln!("rsb: warning: {}", shown(e));
            }
            rsb::sync::cli::print_conflicts(&rep);
            println!(
                "{}",
                rsb::sync::cli::summary(&rep, spec.direction == Direction::Upload)
            );
            conflict_code(&rep)
        }
        Err(e) if cancel.is_cancelled() => {
            fail(json, &e);
            exit::INTERRUPTED
        }
        Err(e) => fail(json, &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rsync_trailing_slash_rule() {
        let cases = [
            ("proj", "", "proj"),
            ("proj", ".", "./proj"),
            ("proj", "work", "work/proj"),
            ("proj", "work/", "work/proj"),
            ("/abs/path/proj", "~", "~/proj"),
            ("proj/", "work", "work"),
            ("proj//", "", ""),
            (".", "work", "work"),
            ("../..", "work", "work"),
            ("a/.", "work", "work"),
            ("~", "bak", "bak"),
            ("", "bak", "bak"),
            ("~/data", "/scratch/", "/scratch/data"),
        ];
        for (src, dst, want) in cases {
            assert_eq!(rsync_dst(src, dst), want, "{src} -> {dst}");
        }
    }
}
