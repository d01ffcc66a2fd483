//! The sync tools: argument handling with the seed's messages, the inline/background switch,
//! and the glue from a pool to the engine ([`crate::sync`]).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use rsb_rules::path;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use crate::sync::runner::{run, run_with};
use crate::{
    app::App,
    error::{Result, RsbError},
    ops::action::{Act, Caller},
    policy::{self, Action},
    pool::Pool,
    sync::{self, Direction, ProgressFn, RunOptions, SyncRules, SyncSpec},
};

/// The tools' arguments after JSON decoding (`excludes` already a list).
#[derive(Debug, Clone, Default)]
pub struct SyncArgs {
    pub local_path: String,
    pub remote_path: String,
    pub delete_extras: bool,
    pub excludes: Vec<String>,
    pub exclude_file: Option<String>,
    pub sandbox: String,
    /// Plan only: report what would change, change nothing.
    pub dry_run: bool,
    /// Take the source's side of conflicts (MCP `overwrite`, CLI `--force`).
    pub overwrite: bool,
    /// First sync into a non-empty destination: differing files are conflicts (`--safe`).
    pub safe: bool,
    /// Confirms a `delete_extras` into `$HOME`/`/` or of more than half the destination.
    pub confirm_delete: bool,
    /// Also apply the source tree's `.gitignore` files (MCP `gitignore`, CLI `--gitignore`).
    pub gitignore: bool,
}

/// An inline sync still running after this long hands itself to a background worker.
const HANDOFF_AFTER: std::time::Duration = std::time::Duration::from_secs(20);

fn handoff_after() -> std::time::Duration {
    std::env::var("RSB_SYNC_HANDOFF_S")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(std::time::Duration::from_secs_f64)
        .unwrap_or(HANDOFF_AFTER)
}

/// An explicitly empty path is a mistake (an omitted one keeps the default): with
/// `delete_extras` it once meant "the whole home", and as a source "the server's cwd".
fn non_empty<'a>(name: &str, v: &'a str, default: &str) -> Result<&'a str> {
    if v.trim().is_empty() {
        return Err(RsbError::invalid(
            format!("{name} is empty"),
            format!("pass a path, or leave {name} out for the default {default:?}"),
        ));
    }
    Ok(v)
}

/// `excludes` as the seed accepted it: a list of strings, null, or a JSON-encoded list in a
/// string (a plain string that is not JSON is taken as one pattern).
pub fn parse_excludes(v: Option<&Value>) -> Result<Vec<String>> {
    let bad = || {
        RsbError::invalid(
            "excludes must be a list of strings",
            "pass e.g. [\"*.log\", \"build/\"]",
        )
    };
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => {
            let t = s.trim();
            if t.is_empty() {
                return Ok(Vec::new());
            }
            match serde_json::from_str::<Value>(t) {
                Ok(Value::Array(a)) => a,
                Ok(Value::Null) => return Ok(Vec::new()),
                Ok(Value::String(one)) => vec![Value::String(one)],
                Ok(_) => return Err(bad()),
                Err(_) => vec![Value::String(t.to_string())],
            }
        }
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(bad()),
    };
    list.into_iter()
        .map(|x| match x {
            Value::String(s) => Ok(s),
            _ => Err(bad()),
        })
        .collect()
}

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
}

/// A local path as the user meant it: `~`/`~/x` expanded (the seed forgot this for downloads),
/// relative to the server's cwd, `.`/`..` resolved lexically. A trailing `/` is kept.
pub fn expand_local(raw: &str) -> Result<PathBuf> {
    let raw = if raw.trim().is_empty() { "." } else { raw };
    let expanded = if path::starts_with_tilde(raw) {
        let h = home().ok_or_else(|| {
            RsbError::invalid(
                format!("cannot expand {raw}: HOME is not set"),
                "pass an absolute path",
            )
        })?;
        path::expand_tilde(raw, &h)
    } else {
        PathBuf::from(raw)
    };
    let abs = if expanded.is_absolute() {
        expanded
    } else {
        std::env::current_dir()
            .map_err(|e| {
                RsbError::invalid(
                    format!("cannot resolve {raw}: the current directory is unavailable ({e})"),
                    "pass an absolute path",
                )
            })?
            .join(expanded)
    };
    let mut out = path::normalize(&abs);
    if raw.ends_with('/') && out != Path::new("/") {
        let mut s = out.into_os_string();
        s.push("/");
        out = PathBuf::from(s);
    }
    Ok(out)
}

/// Default excludes, then `exclude_file` lines (blank and `#` lines skipped), then `excludes`.
pub fn load_rules(excludes: &[String], exclude_file: Option<&str>) -> Result<SyncRules> {
    let mut lines = Vec::new();
    if let Some(f) = exclude_file.filter(|f| !f.trim().is_empty()) {
        let p = expand_local(f)?;
        let shown = p.display().to_string();
        let meta = std::fs::metadata(&p).map_err(|_| {
            RsbError::invalid(
                format!("exclude_file does not exist: {shown}"),
                "pass an existing file of gitignore-style patterns (relative to the server's cwd)",
            )
        })?;
        if !meta.is_file() {
            return Err(RsbError::invalid(
                format!("exclude_file must be a file: {shown}"),
                "pass a file of gitignore-style patterns",
            ));
        }
        let text = std::fs::read_to_string(&p).map_err(|e| {
            RsbError::invalid(
                format!("cannot read exclude_file {shown}: {e}"),
                "check its permissions and that it is UTF-8 text",
            )
        })?;
        for l in text.lines() {
            let t = trim_line(l);
            if !t.is_empty() && !t.starts_with('#') {
                lines.push(t.to_string());
            }
        }
    }
    for e in excludes {
        let t = trim_line(e);
        if !t.is_empty() {
            lines.push(t.to_string());
        }
    }
    let rules = SyncSpec::rules(lines);
    // Refused here, before anything connects, in the words an agent would use.
    sync::engine::compile_rules(&rules)?;
    Ok(rules)
}

/// Whitespace around a pattern goes, as the seed stripped it, except a trailing space escaped
/// as `\ `: in gitignore syntax that space is part of the name. Backslashes are otherwise kept
/// as they are: they are the engine's escapes (`\#x`, `foo\*bar`), not path separators.
fn trim_line(l: &str) -> &str {
    let start = l.trim_start();
    let t = start.trim_end();
    let escapes = t.bytes().rev().take_while(|&b| b == b'\\').count();
    if escapes % 2 == 1 && start[t.len()..].starts_with(' ') {
        &start[..t.len() + 1]
    } else {
        t
    }
}

/// Validate a local source the way the seed did, with its messages.
fn check_local_source(p: &Path) -> Result<std::fs::Metadata> {
    let shown = p.display().to_string();
    let shown = if shown.len() > 1 {
        shown.trim_end_matches('/').to_string()
    } else {
        shown
    };
    let meta = std::fs::metadata(p).map_err(|_| {
        RsbError::invalid(
            format!("local_path does not exist: {shown}"),
            "relative paths are relative to the MCP server's working directory; ~ is expanded",
        )
    })?;
    if !meta.is_file() && !meta.is_dir() {
        return Err(RsbError::invalid(
            format!("local_path must be a file or directory: {shown}"),
            "sync regular files and directories",
        ));
    }
    Ok(meta)
}

/// How long a sync tool call that went to the background may still hold its reply for the
/// worker to finish (see `Transfers::hold_reply`).
const HOLD_BACKGROUND_REPLY: std::time::Duration = std::time::Duration::from_secs(2);

/// Run a sync for a tool call: inline when the plan is small (what must be sent, not the size
/// of the tree), else as a background task; an inline sync still running after
/// [`HANDOFF_AFTER`] is stopped (whole files already committed stay) and handed to a worker,
/// which skips what is already there.
async fn sync_for_tool(
    app: &Arc<App>,
    sandbox: String,
    spec: SyncSpec,
    args: &SyncArgs,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<Value> {
    let cfg = app.config();
    let (max_files, max_bytes) = (cfg.inline_sync_max_files, cfg.inline_sync_max_bytes);
    let gate: sync::PlanGate = Arc::new(move |p: &sync::PlanSize| {
        // Deleting is cheap per entry compared to sending a file.
        p.files + p.deletions / 10 <= max_files && p.bytes <= max_bytes
    });
    let opts = RunOptions {
        gate: (!spec.dry_run).then_some(gate),
        confirm_delete: args.confirm_delete,
        overwrite: args.overwrite,
        safe: args.safe,
        list_actions: false,
        // The baseline, its sink and the journal are the runner's (`run_with`).
        ..Default::default()
    };
    let exclude_file = args
        .exclude_file
        .as_deref()
        .filter(|f| !f.trim().is_empty())
        .map(|f| expand_local(f).map(|p| p.display().to_string()))
        .transpose()?
        .unwrap_or_default();
    let background = async |reason: String| -> Result<Value> {
        let transfers = app.transfers().await?;
        let mut v = transfers
            .start(
                app.clone(),
                sandbox.clone(),
                spec.clone(),
                &opts,
                &args.excludes,
                &exclude_file,
            )
            .await?;
        v["reason"] = Value::String(reason);
        if let Some(id) = v["task_id"].as_i64()
            && let Some(done) = transfers.hold_reply(id, HOLD_BACKGROUND_REPLY).await
            && let (Value::Object(v), Value::Object(done)) = (&mut v, done)
        {
            // The start's keys (mode, task_id, pid, log_file, reason) and the end's.
            v.extend(done);
        }
        Ok(v)
    };
    // Who this sync waits for while another of the same roots holds them, for the reason a
    // hand-off gives.
    let waiting = Arc::new(parking_lot::Mutex::new(String::new()));
    let progress: Option<ProgressFn> = {
        let waiting = waiting.clone();
        Some(Arc::new(move |p: &sync::Progress| {
            *waiting.lock() = match p.phase {
                sync::Phase::Waiting => p.waiting_for.clone(),
                _ => String::new(),
            };
            if let Some(f) = &progress {
                f(p);
            }
        }))
    };
    let inline_cancel = cancel.child_token();
    let work = run_with(app, &sandbox, &spec, &opts, progress, &inline_cancel);
    tokio::pin!(work);
    let limit = handoff_after();
    let report = tokio::select! {
        r = &mut work => r?,
        _ = tokio::time::sleep(limit), if !spec.dry_run => {
            inline_cancel.cancel();
            let _ = work.await;
            let who = waiting.lock().clone();
            if !who.is_empty() {
                return background(format!(
                    "another sync of the same roots is running ({who}); this one waits for it in the background"
                )).await;
            }
            return background(format!(
                "still running after {}s inline; continued in the background (files already committed are kept)",
                limit.as_secs_f64()
            )).await;
        }
    };
    if report.handed_off {
        return background(format!(
            "the plan sends {} files, {} bytes (inline limits: {max_files} files, {max_bytes} bytes)",
            report.files_transferred, report.bytes_planned
        ))
        .await;
    }
    Ok(report.to_json())
}

/// `sync_local_to_remote`: inline when the plan is small, else a background task.
pub async fn sync_local_to_remote(
    app: &Arc<App>,
    args: SyncArgs,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<Value> {
    let (sandbox, spec) = spec_for(app.pool(), &args, Direction::Upload)?;
    sync_for_tool(app, sandbox, spec, &args, progress, cancel).await
}

/// `sync_remote_to_local`: inline when the plan is small (as the seed, always with progress),
/// else a background task.
pub async fn sync_remote_to_local(
    app: &Arc<App>,
    args: SyncArgs,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<Value> {
    let (sandbox, spec) = spec_for(app.pool(), &args, Direction::Download)?;
    sync_for_tool(app, sandbox, spec, &args, progress, cancel).await
}

/// The sandbox and the engine's spec of a sync tool's call, with the seed's checks and
/// messages.
fn spec_for(pool: &Pool, args: &SyncArgs, direction: Direction) -> Result<(String, SyncSpec)> {
    let default_local = match direction {
        Direction::Upload => ".",
        Direction::Download => "./remote_mirror",
    };
    let local = expand_local(non_empty("local_path", &args.local_path, default_local)?)?;
    let remote_path = non_empty("remote_path", &args.remote_path, ".")?.to_string();
    if direction == Direction::Upload {
        let meta = check_local_source(&local)?;
        if args.delete_extras && !meta.is_dir() {
            return Err(RsbError::invalid(
                "delete_extras is only supported when local_path is a directory",
                "pass delete_extras=false to sync a single file",
            ));
        }
    }
    let mut rules = load_rules(&args.excludes, args.exclude_file.as_deref())?;
    rules.gitignore = args.gitignore;
    let sandbox = pool.resolve(&args.sandbox)?;
    let spec = SyncSpec {
        direction,
        local_path: local,
        remote_path,
        delete_extras: args.delete_extras,
        rules,
        dry_run: args.dry_run,
    };
    Ok((sandbox, spec))
}

/// A sync tool's call as a front end makes it (`sync_local_to_remote`, `sync_remote_to_local`):
/// the sandbox resolved once, its `delete_extras`/`overwrite` through the policy's
/// `ask_actions` ([`approve_spec`]), then the sync between a start and an end audit line
/// ([`described`]).
pub async fn act(
    app: &Arc<App>,
    caller: &Caller,
    tool: &str,
    args: SyncArgs,
    direction: Direction,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<Value> {
    let (sandbox, spec) = spec_for(app.pool(), &args, direction)?;
    let opts = RunOptions {
        overwrite: args.overwrite,
        safe: args.safe,
        confirm_delete: args.confirm_delete,
        ..Default::default()
    };
    approve_spec(app, caller, tool, &sandbox, &spec, &opts, cancel).await?;
    let act = Act {
        sandbox: &sandbox,
        tool,
        command: Some(described(&sandbox, &spec)),
        long: true,
        ..Default::default()
    };
    caller
        .act(app.pool(), act, async |sandbox| {
            sync_for_tool(app, sandbox, spec, &args, progress, cancel).await
        })
        .await
}

/// A sync as its audit line names it, the same from every front end:
/// `/home/me/proj -> gpu:proj (delete extras)`.
pub fn described(sandbox: &str, spec: &SyncSpec) -> String {
    let local = spec.local_path.display();
    let remote = format!("{sandbox}:{}", spec.remote_path);
    let (from, to) = match spec.direction {
        Direction::Upload => (local.to_string(), remote),
        Direction::Download => (remote, local.to_string()),
    };
    format!(
        "{from} -> {to}{}{}",
        if spec.delete_extras {
            " (delete extras)"
        } else {
            ""
        },
        if spec.dry_run { " (dry run)" } else { "" }
    )
}

/// Before a sync that deletes destination entries (`delete_extras`) or replaces edits made
/// on the destination (`overwrite`), where the sandbox's policy asks before that action: a
/// dry run finds what it would destroy, and the user is asked with those paths. Nothing to
/// destroy, nothing asked, so an agent that always passes `delete_extras` is not asked on
/// every sync. `Ok`: run it. What appears between the dry run and the sync itself is
/// handled as the approved option says.
pub async fn approve_spec(
    app: &App,
    caller: &Caller,
    tool: &str,
    sandbox: &str,
    spec: &SyncSpec,
    opts: &RunOptions,
    cancel: &CancellationToken,
) -> Result<()> {
    let cfg = app.config();
    let delete = spec.delete_extras && policy::asks(cfg, sandbox, Action::DeleteExtras);
    let overwrite = opts.overwrite && policy::asks(cfg, sandbox, Action::Overwrite);
    if spec.dry_run || !(delete || overwrite) {
        return Ok(());
    }
    let mut preview = spec.clone();
    preview.dry_run = true;
    // Without overwrite, what an overwrite would replace is what the plan calls conflicts.
    let plan_opts = RunOptions {
        overwrite: false,
        safe: opts.safe,
        confirm_delete: opts.confirm_delete,
        ..Default::default()
    };
    let rep = run_with(app, sandbox, &preview, &plan_opts, None, cancel).await?;
    let (from, to) = match spec.direction {
        Direction::Upload => (
            rep.local_path.clone(),
            format!("{sandbox}:{}", rep.remote_path),
        ),
        Direction::Download => (
            format!("{sandbox}:{}", rep.remote_path),
            rep.local_path.clone(),
        ),
    };
    let deletions: Vec<&str> = rep
        .actions
        .iter()
        .filter_map(|a| a.strip_prefix("delete  "))
        .collect();
    let replaced: Vec<&str> = rep
        .conflicts
        .iter()
        .map(|(rel, _, _)| rel.as_str())
        .collect();
    let checks = [
        (
            delete,
            Action::DeleteExtras,
            &deletions,
            "delete",
            ("entry", "entries"),
            "missing from",
        ),
        (
            overwrite,
            Action::Overwrite,
            &replaced,
            "replace",
            ("file", "files"),
            "changed since the last sync, with the versions of",
        ),
    ];
    for (on, action, paths, verb, (one, many), what) in checks {
        if !on || paths.is_empty() {
            continue;
        }
        let noun = if paths.len() == 1 { one } else { many };
        let what = format!(
            "{from} -> {to} would {verb} {} destination {noun} {what} {from}:\n{}",
            paths.len(),
            listed(paths, 20)
        );
        caller.approve(cfg, sandbox, tool, action, what).await?;
    }
    Ok(())
}

/// Up to `n` paths, a line each, escaped for a terminal or a dialog, then how many more.
fn listed(paths: &[&str], n: usize) -> String {
    let mut lines: Vec<String> = paths
        .iter()
        .take(n)
        .map(|p| format!("  {}", crate::term::shown(p)))
        .collect();
    if paths.len() > n {
        lines.push(format!("  … and {} more", paths.len() - n));
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn excludes_forms() {
        assert_eq!(parse_excludes(None).unwrap(), Vec::<String>::new());
        assert_eq!(
            parse_excludes(Some(&json!(null))).unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(
            parse_excludes(Some(&json!(["a", "b/"]))).unwrap(),
            vec!["a", "b/"]
        );
        assert_eq!(
            parse_excludes(Some(&json!("[\"*.md\"]"))).unwrap(),
            vec!["*.md"]
        );
        assert_eq!(
            parse_excludes(Some(&json!("*.log"))).unwrap(),
            vec!["*.log"]
        );
        assert!(parse_excludes(Some(&json!([1]))).is_err());
        assert!(parse_excludes(Some(&json!(3))).is_err());
    }

    #[test]
    fn exclude_lines_keep_their_escapes() {
        let lines = |ex: &[&str]| {
            let ex: Vec<String> = ex.iter().map(|s| s.to_string()).collect();
            load_rules(&ex, None).map(|r| r.lines)
        };
        assert_eq!(
            lines(&[
                "  \\#notes.txt ",
                "foo\\*bar",
                "a\\ ",
                "b\\\\ ",
                "\tc\t",
                " "
            ])
            .unwrap(),
            vec!["\\#notes.txt", "foo\\*bar", "a\\ ", "b\\\\", "c"]
        );
        let e = lines(&["ok", "[z-a]"]).unwrap_err();
        assert_eq!(
            e.message,
            "invalid exclude pattern \"[z-a]\": invalid range in a character class (end before start)"
        );
        assert!(
            lines(&["x\\"]).is_err(),
            "a dangling backslash is no longer read as x/"
        );
    }

    #[test]
    fn local_paths() {
        let home = home().unwrap();
        assert_eq!(expand_local("~/x/../y").unwrap(), home.join("y"));
        assert_eq!(expand_local("~").unwrap(), home);
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(expand_local("./a/./b").unwrap(), cwd.join("a/b"));
        assert!(
            expand_local("out/")
                .unwrap()
                .to_string_lossy()
                .ends_with("/out/")
        );
        assert_eq!(expand_local("/").unwrap(), PathBuf::from("/"));
    }

    #[test]
    fn rules_and_exclude_file_errors() {
        let e = load_rules(&[], Some("/nonexistent/rsb-ex")).unwrap_err();
        assert_eq!(
            e.message,
            "exclude_file does not exist: /nonexistent/rsb-ex"
        );
        let e = load_rules(&[], Some("/")).unwrap_err();
        assert_eq!(e.message, "exclude_file must be a file: /");
        let dir = std::env::temp_dir().join(format!("rsb-rules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("ex");
        std::fs::write(&f, "# c\n\nbuild/\n!keep.log\n*.log\n").unwrap();
        let r = load_rules(&[" x ".into(), "".into()], Some(f.to_str().unwrap())).unwrap();
        assert!(r.default_excludes);
        assert_eq!(r.lines, vec!["build/", "!keep.log", "*.log", "x"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
