//! The audit log: one JSON line per action rsb takes on a sandbox (from MCP or the CLI), in
//! `<state dir>/audit/YYYY-MM.jsonl`.
//!
//! Each line is written by one `write(2)` on a file opened `O_APPEND` (0600), so concurrent
//! writers (many `rsb` processes) never interleave within a line; JSON encoding escapes every
//! newline and quote in a command, so a command cannot forge a line. Configured passwords and
//! passphrases, and token-looking words (`ghp_…`, `sk-…`, `Bearer …`, `KEY=value` for secret-ish
//! names), are replaced by `***` before anything is written. Files older than
//! [`RETENTION_MONTHS`] are removed when a new month's file is created.
//!
//! Lines are hash-chained: each holds `prev`, the blake3 of the line before it (the last line
//! of the previous month's file for a month's first), written under an exclusive lock on the
//! file so concurrent writers chain in order. [`verify`] finds where a chain breaks: a line
//! edited, inserted or removed anywhere but at the end. A user with a shell can still rewrite
//! a whole file consistently, or cut its tail; the chain makes tampering evident, not
//! impossible.

use std::{
    io::Write,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use serde::Serialize;
use serde_json::Value;

use crate::config::{Config, Transport};

/// Months of audit files kept.
pub const RETENTION_MONTHS: u32 = 12;

/// Which MCP call an action belongs to, so a line can be tied to the transcript: the
/// server's session, the JSON-RPC request id, and the client's tool-use id when its `_meta`
/// carries one.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CallIds {
    pub session: String,
    pub request: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_use: Option<String>,
}

tokio::task_local! {
    /// Set by the MCP server around each tool call: every line recorded inside carries it.
    pub static CALL: CallIds;
}

/// A fresh random-enough id (16 hex): this process, the time, a counter, hashed.
pub fn fresh_id() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let seed = format!("{} {now} {n}", std::process::id());
    blake3::hash(seed.as_bytes()).to_hex()[..16].to_string()
}

/// An action that runs a while: its `start` line is on the record before it runs, so a
/// cancelled call or a killed rsb still leaves it; [`Started::end`] writes the `end` line
/// (the result, the duration). Dropped unfinished (an MCP call cancelled), it writes an
/// `end` line saying so.
pub struct Started<'a> {
    config: &'a Config,
    sandbox: String,
    action: Action,
    t0: std::time::Instant,
    call: Option<CallIds>,
    done: bool,
}

/// Write `action`'s start line on `sandbox`.
pub fn start<'a>(config: &'a Config, sandbox: &str, mut action: Action) -> Started<'a> {
    action.event = Some("start");
    action.action_id = Some(fresh_id());
    record(config, sandbox, &action);
    Started {
        config,
        sandbox: sandbox.to_string(),
        action,
        t0: std::time::Instant::now(),
        call: CALL.try_with(CallIds::clone).ok(),
        done: false,
    }
}

impl Started<'_> {
    /// The end line: the start's fields, the duration, and what `result` sets (exit code,
    /// bytes, error, detail).
    pub fn end(mut self, result: impl FnOnce(&mut Action)) {
        self.finish(result);
    }

    fn finish(&mut self, result: impl FnOnce(&mut Action)) {
        self.done = true;
        let mut a = std::mem::take(&mut self.action);
        a.event = Some("end");
        a.duration_ms = Some(self.t0.elapsed().as_millis() as u64);
        result(&mut a);
        match self.call.clone() {
            // Dropped outside the call's scope: keep its ids.
            Some(c) if CALL.try_with(|_| ()).is_err() => {
                CALL.sync_scope(c, || record(self.config, &self.sandbox, &a))
            }
            _ => record(self.config, &self.sandbox, &a),
        }
    }
}

impl Drop for Started<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.finish(|a| {
                a.error = Some("did not finish: the call was cancelled or rsb stopped".into())
            });
        }
    }
}

/// The client's id for this tool use from a request's `_meta` (Claude Code's
/// `claudecode/toolUseId`, or any key naming a tool-use or tool-call id).
pub fn tool_use_id(meta: &serde_json::Map<String, Value>) -> Option<String> {
    meta.iter().find_map(|(k, v)| {
        let k: String = k
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect::<String>()
            .to_ascii_lowercase();
        let named = k.ends_with("tooluseid") || k.ends_with("toolcallid") || k.ends_with("callid");
        named.then(|| v.as_str().map(|s| s.chars().take(200).collect()))?
    })
}

/// One action, as the caller knows it; [`record`] adds time, sandbox, host and user.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Action {
    /// `start` or `end` for an action that runs a while ([`start`]); absent for a one-line
    /// action.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event: Option<&'static str>,
    /// Ties an `end` line to its `start`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action_id: Option<String>,
    /// `mcp:<client name>` or `cli`.
    pub origin: String,
    /// The tool or command (`exec_bash`, `rsb exec`, ...).
    pub tool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Set when the action failed before a result (the error line).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The numbers of the reply (files, bytes, deletions, ids, mode): see [`reply_summary`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<Value>,
}

/// A reply's numbers, flags, its `mode`/`status`/`direction` words and rsb's `confinement`
/// line (a confined command that failed, or one run unconfined), for an audit line:
/// what a sync moved or deleted, which id a forward or watch got. Never its texts, which can
/// hold file content or remote output.
pub fn reply_summary(v: &Value) -> Option<Value> {
    let obj = v.as_object()?;
    let keep: serde_json::Map<String, Value> = obj
        .iter()
        .filter(|(k, v)| {
            v.is_number()
                || v.is_boolean()
                || (v.is_string()
                    && matches!(
                        k.as_str(),
                        "mode" | "status" | "direction" | "local_url" | "confinement"
                    ))
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    (!keep.is_empty()).then_some(Value::Object(keep))
}

#[derive(Serialize)]
struct Line<'a> {
    time: String,
    sandbox: &'a str,
    host: String,
    user: String,
    #[serde(flatten)]
    action: &'a Action,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    call: Option<CallIds>,
}

pub fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join(crate::store::layout::AUDIT)
}

/// Append `action` on `sandbox` to this month's file. Never fails the caller: a log that cannot
/// be written is a warning on stderr.
pub fn record(config: &Config, sandbox: &str, action: &Action) {
    if config.state_dir.as_os_str().is_empty() {
        return;
    }
    let (host, user) = target(config, sandbox);
    write(
        &config.state_dir,
        sandbox,
        host,
        user,
        &secrets(config),
        action,
    );
}

/// [`record`] where no configuration is loaded (`rsb watch cancel` reads only the state
/// dir): no host or user, and only the token forms are redacted.
pub fn record_in(state_dir: &Path, sandbox: &str, action: &Action) {
    write(
        state_dir,
        sandbox,
        String::new(),
        String::new(),
        &[],
        action,
    );
}

/// Where an action's line goes: a loaded configuration's log (its hosts, users and secrets), or
/// a bare state dir's ([`record_in`]).
#[derive(Clone, Copy)]
pub enum Log<'a> {
    Configured(&'a Config),
    Bare(&'a Path),
}

impl<'a> From<&'a Config> for Log<'a> {
    fn from(c: &'a Config) -> Log<'a> {
        Log::Configured(c)
    }
}

impl<'a> From<&'a Path> for Log<'a> {
    fn from(dir: &'a Path) -> Log<'a> {
        Log::Bare(dir)
    }
}

impl Log<'_> {
    pub fn record(self, sandbox: &str, action: &Action) {
        match self {
            Log::Configured(c) => record(c, sandbox, action),
            Log::Bare(dir) => record_in(dir, sandbox, action),
        }
    }
}

fn write(
    state_dir: &Path,
    sandbox: &str,
    host: String,
    user: String,
    secrets: &[String],
    action: &Action,
) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut v = match serde_json::to_value(Line {
        time: crate::store::transfers::utc_stamp(now),
        sandbox,
        host,
        user,
        action,
        call: CALL.try_with(CallIds::clone).ok(),
    }) {
        Ok(v) => v,
        Err(_) => return,
    };
    redact_value(&mut v, secrets);
    let dir = dir(state_dir);
    let file = dir.join(format!(
        "{}.jsonl",
        &crate::store::transfers::utc_stamp(now)[..7]
    ));
    if let Err(e) = append(&dir, &file, v) {
        tracing::warn!("cannot write the audit log {}: {e}", file.display());
    }
}

/// The chain's link to `line` (without its newline).
fn link(line: &[u8]) -> String {
    blake3::hash(line).to_hex()[..32].to_string()
}

fn append(dir: &Path, file: &Path, mut v: Value) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o600)
        .open(file)?;
    // Writers chain in turn: the previous line is read and this one written under the lock.
    f.lock()?;
    let fresh = f.metadata()?.len() == 0;
    let prev = match last_line(&f)? {
        Some(l) => Some(l),
        None => match previous_file(dir, file) {
            Some(p) => std::fs::File::open(p).and_then(|p| last_line(&p))?,
            None => None,
        },
    };
    if let (Some(p), Some(obj)) = (prev, v.as_object_mut()) {
        obj.insert("prev".into(), Value::String(link(&p)));
    }
    let mut line = v.to_string();
    line.push('\n');
    // One write: O_APPEND makes it atomic against other appenders on a local file system.
    f.write_all(line.as_bytes())?;
    if fresh {
        prune(dir, file);
    }
    Ok(())
}

/// The last line of `f` (without its newline), read from the end; `None` when empty.
fn last_line(f: &std::fs::File) -> std::io::Result<Option<Vec<u8>>> {
    use std::os::unix::fs::FileExt;
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(None);
    }
    // A line ends with the file's last newline (a torn last line, without one, is a line).
    let mut end = len;
    let mut last = [0u8; 1];
    f.read_exact_at(&mut last, len - 1)?;
    if last[0] == b'\n' {
        end -= 1;
    }
    let mut start = end;
    let mut buf = vec![0u8; 8192];
    'back: while start > 0 {
        let n = (start.min(buf.len() as u64)) as usize;
        f.read_exact_at(&mut buf[..n], start - n as u64)?;
        for i in (0..n).rev() {
            if buf[i] == b'\n' {
                start = start - n as u64 + i as u64 + 1;
                break 'back;
            }
        }
        start -= n as u64;
    }
    let mut line = vec![0u8; (end - start) as usize];
    f.read_exact_at(&mut line, start)?;
    Ok(Some(line))
}

/// The newest month file before `file`, if any.
fn previous_file(dir: &Path, file: &Path) -> Option<PathBuf> {
    let name = file.file_name()?.to_str()?.to_string();
    month_files(dir).ok()?.into_iter().rfind(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| *n < *name)
    })
}

fn month_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    files.sort();
    Ok(files)
}

/// How far the log's hash chain holds ([`verify`]).
#[derive(Debug, Default)]
pub struct Verified {
    pub files: usize,
    pub lines: usize,
    /// Lines written before the chain existed (no `prev`), not checked.
    pub unchained: usize,
    /// The first line whose `prev` is not the hash of the line before it.
    pub broken: Option<Break>,
}

#[derive(Debug)]
pub struct Break {
    pub file: PathBuf,
    /// 1-based.
    pub line: usize,
    pub why: String,
}

/// Check every line's `prev` against the line before it, across the month files in order.
/// The oldest file's first line is the anchor (what it chained to may have been pruned).
pub fn verify(state_dir: &Path) -> std::io::Result<Verified> {
    let mut out = Verified::default();
    let mut before: Option<Vec<u8>> = None;
    let mut first = true;
    for f in month_files(&dir(state_dir))? {
        out.files += 1;
        let bytes = std::fs::read(&f)?;
        let mut lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
        if lines.last().is_some_and(|l| l.is_empty()) {
            lines.pop();
        }
        for (i, l) in lines.iter().enumerate() {
            out.lines += 1;
            let prev = serde_json::from_slice::<Value>(l)
                .ok()
                .and_then(|v| v.get("prev").and_then(Value::as_str).map(str::to_string));
            match (&prev, &before) {
                (None, _) => out.unchained += 1,
                (Some(_), None) if first => {}
                (Some(p), Some(b)) if *p == link(b) => {}
                (Some(_), _) if out.broken.is_none() => {
                    out.broken = Some(Break {
                        file: f.clone(),
                        line: i + 1,
                        why: if i == 0 {
                            "it does not follow the previous month's last line (that file was \
                             changed or removed)"
                                .into()
                        } else {
                            format!(
                                "line {} before it was changed, or a line was inserted or removed \
                                 there",
                                i
                            )
                        },
                    });
                }
                _ => {}
            }
            first = false;
            before = Some(l.to_vec());
        }
    }
    Ok(out)
}

/// Remove month files older than the retention (names sort by month).
fn prune(dir: &Path, current: &Path) {
    let Some(cur) = current.file_stem().and_then(|s| s.to_str()) else {
        return;
    };
    let (Ok(y), Ok(m)) = (cur[..4].parse::<u32>(), cur[5..7].parse::<u32>()) else {
        return;
    };
    let months = y * 12 + (m - 1);
    let oldest = months.saturating_sub(RETENTION_MONTHS - 1);
    let keep_from = format!("{:04}-{:02}", oldest / 12, oldest % 12 + 1);
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.ends_with(".jsonl") && n.len() == 13 && n[..7] < *keep_from {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

fn target(config: &Config, sandbox: &str) -> (String, String) {
    match config.sandboxes.iter().find(|s| s.name == sandbox) {
        Some(s) => match &s.transport {
            Transport::Ssh(t) => (crate::config::host_port(&t.host, t.port), t.user.clone()),
            Transport::Local => (
                "localhost".into(),
                std::env::var("USER").unwrap_or_default(),
            ),
        },
        None => (String::new(), String::new()),
    }
}

/// Every password and passphrase in the configuration (sandboxes and their jump hosts).
fn secrets(config: &Config) -> Vec<String> {
    let mut out: Vec<String> = config
        .sandboxes
        .iter()
        .flat_map(|sb| sb.secrets())
        .map(|s| s.expose().to_string())
        .collect();
    out.retain(|s| !s.is_empty());
    // Longest first, so a secret containing another is replaced whole.
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out
}

fn redact_value(v: &mut Value, secrets: &[String]) {
    match v {
        Value::String(s) => *s = redact(s, secrets),
        Value::Object(m) => m.values_mut().for_each(|v| redact_value(v, secrets)),
        Value::Array(a) => a.iter_mut().for_each(|v| redact_value(v, secrets)),
        _ => {}
    }
}

/// `s` with configured secrets and token-looking words replaced by `***`: secret-named
/// assignments and options (`API_KEY=x`, `--password x`, `--token=x`), bearer tokens, known
/// token formats, a URL's password (`https://user:***@host`), `curl -u user:***` and mysql's
/// `-p***`. A best effort over text: a secret spelled otherwise stays.
pub fn redact(s: &str, secrets: &[String]) -> String {
    let mut s = s.to_string();
    for secret in secrets {
        if s.contains(secret.as_str()) {
            s = s.replace(secret.as_str(), "***");
        }
    }
    // mysql's `-pSECRET` only where a mysql client is named (`-p` means other things elsewhere).
    let mysql = s.split_whitespace().any(|w| {
        let prog = w.rsplit('/').next().unwrap_or(w);
        prog.starts_with("mysql") || prog.starts_with("mariadb")
    });
    let mut out = String::with_capacity(s.len());
    let mut next = Next::Keep;
    for (i, word) in s.split_inclusive(char::is_whitespace).enumerate() {
        let w = word.trim_end();
        let tail = &word[w.len()..];
        if i > 0 && next != Next::Keep && !w.is_empty() {
            match next {
                Next::Whole => out.push_str("***"),
                _ => out.push_str(&after_colon(w)),
            }
            out.push_str(tail);
            next = Next::Keep;
            continue;
        }
        next = next_is_secret(w);
        if mysql && let Some(pw) = w.strip_prefix("-p").filter(|p| !p.is_empty()) {
            out.push_str(if pw.starts_with('-') { w } else { "-p***" });
        } else {
            out.push_str(&redact_word(w));
        }
        out.push_str(tail);
    }
    out
}

#[derive(Clone, Copy, PartialEq)]
enum Next {
    Keep,
    /// The next word is a secret (`--password X`, `Bearer X`).
    Whole,
    /// The next word is `user:secret` (`curl -u user:pass`).
    AfterColon,
}

fn next_is_secret(w: &str) -> Next {
    let bare = w.trim_start_matches(['\'', '"']);
    if bare.eq_ignore_ascii_case("bearer") || bare.eq_ignore_ascii_case("token") {
        return Next::Whole;
    }
    if matches!(w, "-u" | "--user" | "--proxy-user") {
        return Next::AfterColon;
    }
    match w.strip_prefix("--") {
        Some(name) if !name.contains('=') && secret_name(name) => Next::Whole,
        _ => Next::Keep,
    }
}

/// A name that holds a secret: `*PASSWORD*`, `*PASSWD*`, `*PASSPHRASE*`, `*SECRET*`,
/// `*TOKEN*`, `*_KEY`, `*API_KEY`, `*APIKEY`, in any case, `-` read as `_`.
fn secret_name(name: &str) -> bool {
    let n = name
        .trim_start_matches('-')
        .to_ascii_uppercase()
        .replace('-', "_");
    ["PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "TOKEN"]
        .iter()
        .any(|k| n.contains(k))
        || n.ends_with("_KEY")
        || n.ends_with("APIKEY")
        || n == "KEY"
}

/// `user:secret` → `user:***` (a word with no colon is kept).
fn after_colon(w: &str) -> String {
    match w.split_once(':') {
        Some((user, pw)) if !pw.is_empty() => format!("{user}:***"),
        _ => w.to_string(),
    }
}

/// A URL's password: `scheme://user:secret@host` → `scheme://user:***@host`.
fn redact_url_password(w: &str) -> String {
    let Some(at) = w.find("://") else {
        return w.to_string();
    };
    let start = at + 3;
    let rest = &w[start..];
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let auth = &rest[..auth_end];
    match auth.rfind('@') {
        Some(k) if auth[..k].contains(':') => {
            let user = &auth[..auth[..k].find(':').unwrap_or(k)];
            format!("{}{user}:***{}", &w[..start], &w[start + k..])
        }
        _ => w.to_string(),
    }
}

fn redact_word(w: &str) -> String {
    // NAME=value with a secret-ish NAME (`--password=x`, `API_KEY=x`, `AWS_SECRET_X=x`), and
    // `--user=name:secret`.
    if let Some((k, val)) = w.split_once('=')
        && !val.is_empty()
        && !k.contains("://")
    {
        if secret_name(k.trim_start_matches(['\'', '"'])) {
            return format!("{k}=***");
        }
        if k == "--user" || k == "--proxy-user" {
            return format!("{k}={}", after_colon(val));
        }
    }
    redact_tokens(&redact_url_password(w))
}

const TOKEN_PREFIXES: [&str; 8] = [
    "ghp_",
    "gho_",
    "ghs_",
    "github_pat_",
    "sk-",
    "xoxb-",
    "xoxp-",
    "hf_",
];

/// Runs that start with a known token prefix (at a word boundary) and go on for at least 16
/// token characters, and AWS access key ids, become `***` wherever they sit in the word (a
/// URL's user part, say).
fn redact_tokens(w: &str) -> String {
    let is_tok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    let mut out = String::with_capacity(w.len());
    let mut i = 0;
    while i < w.len() {
        let boundary = i == 0 || !is_tok(w[..i].chars().next_back().unwrap_or(' '));
        if boundary && w.is_char_boundary(i) {
            let rest = &w[i..];
            let run = rest.find(|c: char| !is_tok(c)).unwrap_or(rest.len());
            let hit = TOKEN_PREFIXES
                .iter()
                .any(|p| rest.starts_with(p) && run >= p.len() + 16)
                || (rest.starts_with("AKIA") && run == 20);
            if hit {
                out.push_str("***");
                i += run;
                continue;
            }
        }
        let c = w[i..].chars().next().unwrap_or(' ');
        out.push(c);
        i += c.len_utf8();
    }
    out
}

/// A `--since` value: `90s`, `30m`, `2h`, `7d` → seconds.
pub fn parse_since(s: &str) -> Option<u64> {
    let s = s.trim();
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = n.parse().ok()?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    Some(n * mult)
}

/// The lines of the audit files, oldest first, that pass the filters (`since`: an RFC 3339
/// UTC stamp the line's time must not precede).
pub fn read(
    state_dir: &Path,
    sandbox: Option<&str>,
    since: Option<&str>,
    grep: Option<&str>,
) -> std::io::Result<Vec<Value>> {
    let files = month_files(&dir(state_dir))?;
    let mut out = Vec::new();
    for f in files {
        if let Some(since) = since
            && let Some(stem) = f.file_stem().and_then(|s| s.to_str())
            && stem < &since[..7.min(since.len())]
        {
            continue;
        }
        let text = std::fs::read_to_string(&f)?;
        for line in text.lines() {
            if let Some(g) = grep
                && !line.contains(g)
            {
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            if sandbox.is_some_and(|s| v["sandbox"] != s) {
                continue;
            }
            if since.is_some_and(|s| v["time"].as_str().unwrap_or_default() < s) {
                continue;
            }
            out.push(v);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_and_tokens_are_redacted() {
        let secrets = vec!["hunter2!".to_string()];
        assert_eq!(
            redact("echo hunter2! | sudo -S id", &secrets),
            "echo *** | sudo -S id"
        );
        assert_eq!(
            redact(
                "curl -H 'Authorization: Bearer abc.def' x API_KEY=zzz ls",
                &[]
            ),
            "curl -H 'Authorization: Bearer *** x API_KEY=*** ls"
        );
        assert_eq!(
            redact(
                "git clone https://ghp_0123456789abcdefghij@github.com/x",
                &[]
            ),
            "git clone https://***@github.com/x"
        );
        assert_eq!(
            redact("export T=ghp_0123456789abcdefghij", &[]),
            "export T=***"
        );
        assert_eq!(redact("echo 'sk-0123456789abcdefghij'", &[]), "echo '***'");
        assert_eq!(
            redact("task-0123456789abcdefghijk", &[]),
            "task-0123456789abcdefghijk"
        );
        assert_eq!(redact("ls -la", &[]), "ls -la");
    }

    /// Issue 39: what the audit log used to keep in plain text.
    #[test]
    fn secret_spellings_are_redacted() {
        let cases = [
            (
                "export AWS_SECRET_ACCESS_KEY=abc123",
                "export AWS_SECRET_ACCESS_KEY=***",
            ),
            ("MY_SECRET_THING=x ./run", "MY_SECRET_THING=*** ./run"),
            ("HF_TOKEN_RW=x python t.py", "HF_TOKEN_RW=*** python t.py"),
            ("OPENAI_KEY=x make", "OPENAI_KEY=*** make"),
            ("deploy --password hunter2 --x", "deploy --password *** --x"),
            ("deploy --password=hunter2", "deploy --password=***"),
            (
                "tool --api-key abc --db-password=p",
                "tool --api-key *** --db-password=***",
            ),
            ("mysql -u root -pS3cret db", "mysql -u root -p*** db"),
            (
                "/usr/bin/mysqldump -psecret x",
                "/usr/bin/mysqldump -p*** x",
            ),
            (
                "git clone https://alice:pa55@example.com/r.git",
                "git clone https://alice:***@example.com/r.git",
            ),
            (
                "pip install --index-url https://u:p%40ss@pypi.example/simple x",
                "pip install --index-url https://u:***@pypi.example/simple x",
            ),
            ("curl -u bob:s3cr3t https://x", "curl -u bob:*** https://x"),
            (
                "curl --user=bob:s3cr3t https://x",
                "curl --user=bob:*** https://x",
            ),
        ];
        for (raw, want) in cases {
            assert_eq!(redact(raw, &[]), want, "{raw}");
        }
        // Ordinary commands keep their words.
        for keep in [
            "sort -u names.txt",
            "git add -u",
            "ps -u root",
            "ssh -p 2222 host",
            "tar -cpf a.tar dir",
            "python -m pytest -k key_test",
            "grep -r KEYBOARD src",
            "git clone https://example.com/r.git",
            "cp a b -p",
        ] {
            assert_eq!(redact(keep, &[]), keep);
        }
    }

    #[test]
    fn since_values() {
        assert_eq!(parse_since("2h"), Some(7200));
        assert_eq!(parse_since("90s"), Some(90));
        assert_eq!(parse_since("7d"), Some(604_800));
        assert_eq!(parse_since("2x"), None);
        assert_eq!(parse_since("h"), None);
    }

    #[test]
    fn old_months_are_pruned() {
        let d = tempfile::tempdir().unwrap();
        for m in ["2025-11", "2025-12", "2026-01", "2026-11"] {
            std::fs::write(d.path().join(format!("{m}.jsonl")), "").unwrap();
        }
        let cur = d.path().join("2026-12.jsonl");
        std::fs::write(&cur, "").unwrap();
        prune(d.path(), &cur);
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["2026-01.jsonl", "2026-11.jsonl", "2026-12.jsonl"]);
    }
}
