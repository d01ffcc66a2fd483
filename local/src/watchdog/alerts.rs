//! Alerts for one event: a desktop notification, a webhook and an `event_command`. Each runs
//! off the daemon's loop with its own deadline, so a slow hook delays nothing else (the seed
//! blocked its whole loop for up to 300 s on one `event_command`, and died on a bad URL).
//!
//! The webhook is a POST through `ureq` (rustls), `http://` or `https://`: nearly every real
//! endpoint (Slack, Discord, ntfy, a team's own) is https. Certificates are checked against
//! Mozilla's roots, or against `SSL_CERT_FILE`'s when it is set (a company CA, as curl and
//! OpenSSL take it). A refused connection, a timeout, 429 or 5xx is retried with backoff
//! inside the hook's deadline; then one failure is recorded.

use std::{path::Path, process::Stdio, time::Duration};

use serde_json::json;

use super::settings::{FileSettings, WebhookFormat};
use crate::store::{
    events::{self, WatchEvent},
    watch_model::{Watch, one_line},
};

const NOTIFY_TIMEOUT: Duration = Duration::from_secs(10);

/// The hooks one event goes to: the watch's own, then the config file's.
pub struct Targets {
    pub webhooks: Vec<(String, WebhookFormat)>,
    pub commands: Vec<String>,
    pub notify: bool,
    pub timeout: Duration,
}

impl Targets {
    pub fn for_watch(w: &Watch, file: &FileSettings, timeout: Duration) -> Targets {
        let mut webhooks: Vec<(String, WebhookFormat)> = Vec::new();
        let mut commands = Vec::new();
        let own = (&w.webhook_url, WebhookFormat::for_url(&w.webhook_url));
        let global = (
            &file.webhook_url,
            file.webhook_format
                .unwrap_or_else(|| WebhookFormat::for_url(&file.webhook_url)),
        );
        for (url, format) in [own, global] {
            if !url.trim().is_empty() && !webhooks.iter().any(|(u, _)| u == url) {
                webhooks.push((url.clone(), format));
            }
        }
        for s in [&w.event_command, &file.event_command] {
            if !s.trim().is_empty() && !commands.contains(s) {
                commands.push(s.clone());
            }
        }
        Targets {
            webhooks,
            commands,
            notify: w.notify_local && file.notify_local != Some(false),
            timeout: file.hook_timeout().unwrap_or(timeout),
        }
    }
}

/// Send one event everywhere it should go; returns the failures, one line each.
pub async fn dispatch(t: &Targets, e: &WatchEvent, event_file: &Path) -> Vec<String> {
    let body = serde_json::to_string(&json!(e)).unwrap_or_default();
    let mut jobs: Vec<futures::future::BoxFuture<'_, Option<String>>> = Vec::new();
    for (url, format) in &t.webhooks {
        let body = webhook_body(*format, e, &body);
        jobs.push(Box::pin(async move {
            post(url, body, t.timeout)
                .await
                .err()
                .map(|err| format!("webhook failed: {err}"))
        }));
    }
    let brief = hook_event_json(e, event_file);
    for cmd in &t.commands {
        let brief = brief.clone();
        jobs.push(Box::pin(async move {
            run_event_command(cmd, e, &brief, event_file, t.timeout)
                .await
                .err()
                .map(|err| format!("event_command failed: {err}"))
        }));
    }
    if t.notify && notify_worthy(&e.event_type) {
        jobs.push(Box::pin(async move {
            if let Err(err) = notify(e).await {
                // Not a watch error: a headless box without a notification daemon is normal.
                tracing::info!(event = e.id, "desktop notification not shown: {err}");
            }
            None
        }));
    }
    futures::future::join_all(jobs)
        .await
        .into_iter()
        .flatten()
        .collect()
}

fn notify_worthy(t: &str) -> bool {
    !matches!(t, events::RUNNING_RESTORED | events::RESUME_STARTED)
}

// ---------------------------------------------------------------------------------------------
// Webhook

#[derive(Debug)]
struct Url {
    host: String,
    port: u16,
}

fn parse_http_url(url: &str) -> Result<Url, String> {
    let url = url.trim();
    let (rest, default_port) = if let Some(r) = url.strip_prefix("http://") {
        (r, 80)
    } else if let Some(r) = url.strip_prefix("https://") {
        (r, 443)
    } else {
        return Err("invalid webhook_url: it must start with http:// or https://".into());
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let path = if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_string()
    };
    if authority.contains('@') {
        return Err("invalid webhook_url: credentials in the URL are not supported".into());
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or("invalid webhook_url: unclosed [ in the host")?;
        (h.to_string(), after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        }
    };
    let port = match port {
        None | Some("") => default_port,
        Some(p) => p
            .parse::<u16>()
            .map_err(|_| "invalid webhook_url: bad port".to_string())?,
    };
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
    if !host_ok || path.chars().any(|c| c.is_control() || c == ' ') {
        return Err("invalid webhook_url: bad host or path".into());
    }
    Ok(Url { host, port })
}

/// Checks a webhook URL the way the daemon will use it (for registration errors up front).
pub fn check_webhook_url(url: &str) -> Result<(), String> {
    parse_http_url(url).map(|_| ())
}

/// Pauses before the second and third tries of a webhook.
const WEBHOOK_BACKOFF: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(3)];

/// What one try came to: sent (the 2xx status), worth trying again, or final.
enum Try {
    Sent(u16),
    Again(String),
    Final(String),
}

/// A webhook request's body, its content type and its extra headers.
#[derive(Debug, Clone)]
pub struct Body {
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub text: String,
}

/// One line a person reads in a chat or a notification: what happened, where.
fn event_line(e: &WatchEvent) -> String {
    let w = &e.payload["watch"];
    let field = |k: &str| w[k].as_str().unwrap_or("").to_string();
    let job = [field("name"), field("run_id"), field("tmux_session")]
        .into_iter()
        .find(|s| !s.is_empty())
        .unwrap_or_default();
    let sandbox = field("sandbox_name");
    let line = format!(
        "rsb {}: {} (job {job} on {sandbox}, watch {})",
        e.event_type, e.summary, e.watch_id
    );
    // Remote text (the summary) stays on one line, and a chat message stays short.
    line.replace(['\r', '\n'], " ").chars().take(1500).collect()
}

/// The body `format` calls for; `json` is the event as the event file holds it.
pub fn webhook_body(format: WebhookFormat, e: &WatchEvent, json_event: &str) -> Body {
    let chat = |key: &str| Body {
        content_type: "application/json",
        headers: Vec::new(),
        text: json!({ key: event_line(e) }).to_string(),
    };
    match format {
        WebhookFormat::Json => Body {
            content_type: "application/json",
            headers: Vec::new(),
            text: json_event.to_string(),
        },
        WebhookFormat::Slack => chat("text"),
        WebhookFormat::Discord => chat("content"),
        WebhookFormat::Ntfy => Body {
            content_type: "text/plain; charset=utf-8",
            headers: vec![("Title", format!("rsb: {}", e.event_type))],
            text: event_line(e),
        },
    }
}

/// POST `body` as JSON; `Ok(status)` for a 2xx answer (see [`post`]).
pub async fn post_json(url: &str, body: &str, timeout: Duration) -> Result<u16, String> {
    let body = Body {
        content_type: "application/json",
        headers: Vec::new(),
        text: body.to_string(),
    };
    post(url, body, timeout).await
}

/// POST `body`; `Ok(status)` for a 2xx answer. Tries up to three times while the failure may
/// pass (no connection, no answer, 429, 5xx), all within `timeout`.
pub async fn post(url: &str, body: Body, timeout: Duration) -> Result<u16, String> {
    let u = parse_http_url(url)?;
    let at = if u.host.contains(':') {
        format!("[{}]:{}", u.host, u.port)
    } else {
        format!("{}:{}", u.host, u.port)
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last = String::new();
    for pause in std::iter::once(Duration::ZERO).chain(WEBHOOK_BACKOFF) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if pause >= left {
            break;
        }
        tokio::time::sleep(pause).await;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let (u, b, at) = (url.to_string(), body.clone(), at.clone());
        let one = tokio::task::spawn_blocking(move || post_once(&u, &at, &b, left));
        match one.await {
            Ok(Try::Sent(code)) => return Ok(code),
            Ok(Try::Final(e)) => return Err(e),
            Ok(Try::Again(e)) => last = e,
            Err(e) => return Err(format!("the webhook task failed: {e}")),
        }
    }
    if last.is_empty() {
        last = format!("no answer within {}s", timeout.as_secs());
    }
    Err(last)
}

/// The roots a webhook's certificate is checked against: `SSL_CERT_FILE`'s certificates when
/// it is set (replacing the defaults, as for OpenSSL and curl), else Mozilla's.
fn webhook_roots() -> Result<ureq::tls::RootCerts, String> {
    let Some(path) = std::env::var_os("SSL_CERT_FILE").filter(|p| !p.is_empty()) else {
        return Ok(ureq::tls::RootCerts::WebPki);
    };
    let shown = std::path::PathBuf::from(&path).display().to_string();
    let pem = std::fs::read(&path).map_err(|e| format!("SSL_CERT_FILE {shown}: {e}"))?;
    let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        return Err(format!("SSL_CERT_FILE {shown} holds no PEM certificate"));
    }
    Ok(ureq::tls::RootCerts::new_with_certs(&certs))
}

/// One POST; `at` (host:port) names the server in errors, never the URL, whose path or query
/// may hold a token (Slack's and Discord's do).
fn post_once(url: &str, at: &str, body: &Body, timeout: Duration) -> Try {
    let roots = match webhook_roots() {
        Ok(r) => r,
        Err(e) => return Try::Final(e),
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout.max(Duration::from_millis(100))))
        .http_status_as_error(false)
        // A POST is not replayed at another address the server names.
        .max_redirects(0)
        .user_agent(format!("rsb-watchdog/{}", env!("CARGO_PKG_VERSION")))
        .tls_config(ureq::tls::TlsConfig::builder().root_certs(roots).build())
        .build()
        .into();
    let mut req = agent.post(url).header("Content-Type", body.content_type);
    for (k, v) in &body.headers {
        req = req.header(*k, v.as_str());
    }
    match req.send(body.text.as_str()) {
        Ok(r) => {
            let code = r.status().as_u16();
            match code {
                200..=299 => Try::Sent(code),
                429 | 500..=599 => Try::Again(format!("the server answered HTTP {code}")),
                _ => Try::Final(format!("the server answered HTTP {code}")),
            }
        }
        Err(ureq::Error::Timeout(_)) => {
            Try::Again(format!("no answer within {}s", timeout.as_secs()))
        }
        Err(
            e @ (ureq::Error::Io(_) | ureq::Error::HostNotFound | ureq::Error::ConnectionFailed),
        ) => Try::Again(format!("cannot reach {at}: {e}")),
        Err(e) => Try::Final(e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// event_command

/// The most bytes one `RSMCP_*` value carries. Linux refuses an exec whose single argv or
/// environment string passes MAX_ARG_STRLEN (128 KiB) with E2BIG; the seed put the log tail
/// in two variables, JSON-escaped (a control byte is six), so its hooks failed on exactly the
/// noisy failures they were for. The whole event is always in the file `RSMCP_EVENT_FILE`.
pub const HOOK_VALUE_MAX: usize = 16 * 1024;

/// `RSMCP_EVENT_JSON`: the event as it is when it fits [`HOOK_VALUE_MAX`]; otherwise with its
/// remote texts cut to their tails until it does, marked `"truncated": true` with the
/// `event_file` that holds all of it.
pub fn hook_event_json(e: &WatchEvent, event_file: &Path) -> String {
    let full = serde_json::to_string(&json!(e)).unwrap_or_default();
    if full.len() <= HOOK_VALUE_MAX {
        return full;
    }
    let mut keep = 4000usize;
    loop {
        let mut v = json!(e);
        if let Some(p) = v["payload"].as_object_mut() {
            for k in ["log_tail", "checkpoint_text", "suggested_codex_prompt"] {
                if let Some(t) = p.get(k).and_then(|t| t.as_str()) {
                    let cut = super::clip_tail(t, keep);
                    p.insert(k.into(), json!(cut));
                }
            }
            p.insert("truncated".into(), json!(true));
            p.insert("event_file".into(), json!(event_file));
        }
        let s = serde_json::to_string(&v).unwrap_or_default();
        if s.len() <= HOOK_VALUE_MAX {
            return s;
        }
        if keep == 0 {
            // Other keys are too big on their own: identity, type and where the rest is.
            return json!({
                "id": e.id, "watch_id": e.watch_id, "event_type": e.event_type,
                "summary": super::clip_tail(&e.summary, 1000), "created_ts": e.created_ts,
                "truncated": true, "event_file": event_file,
            })
            .to_string();
        }
        keep /= 4;
    }
}

/// A text for one `RSMCP_*` variable: without NUL (no environment string can hold one, and
/// one NUL in a log used to stop every hook from starting) and at most [`HOOK_VALUE_MAX`]
/// bytes, its head and tail kept around a note that says where the whole text is.
pub fn hook_env_text(s: &str) -> String {
    let s = s.replace('\0', "");
    if s.len() <= HOOK_VALUE_MAX {
        return s;
    }
    let note = format!(
        "\n[… {} bytes cut here; the whole event is in $RSMCP_EVENT_FILE …]\n",
        s.len()
    );
    let half = (HOOK_VALUE_MAX - note.len()) / 2;
    let mut head = half;
    while !s.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = s.len() - half;
    while !s.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}{note}{}", &s[..head], &s[tail..])
}

/// `sh -c CMD` with the seed's `RSMCP_*` variables, in its own process group, killed (the whole
/// group) at the deadline. Every value is bounded and free of NUL ([`hook_env_text`]).
pub async fn run_event_command(
    cmd: &str,
    e: &WatchEvent,
    event_json: &str,
    event_file: &Path,
    timeout: Duration,
) -> Result<(), String> {
    let w = &e.payload["watch"];
    let s = |k: &str| hook_env_text(w[k].as_str().unwrap_or_default());
    let mut c = tokio::process::Command::new("/bin/sh");
    // The same environment every local child of rsb gets: the user's own variables (a hook
    // may need its Slack token), never rsb's configuration or secrets.
    c.arg("-c")
        .arg(cmd)
        .env_clear()
        .envs(crate::connect::child_env());
    c.env("RSMCP_EVENT_FILE", event_file)
        .env("RSMCP_EVENT_JSON", hook_env_text(event_json))
        .env("RSMCP_EVENT_TYPE", hook_env_text(&e.event_type))
        .env("RSMCP_WATCH_ID", e.watch_id.to_string())
        .env("RSMCP_SANDBOX_NAME", s("sandbox_name"))
        .env("RSMCP_TMUX_SESSION", s("tmux_session"))
        .env("RSMCP_LOG_FILE", s("log_file"))
        .env(
            "RSMCP_SUGGESTED_PROMPT",
            hook_env_text(
                e.payload["suggested_codex_prompt"]
                    .as_str()
                    .unwrap_or_default(),
            ),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = c
        .spawn()
        .map_err(|err| format!("cannot start /bin/sh: {err}"))?;
    let pid = child.id();
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(out)) if out.status.success() => Ok(()),
        Ok(Ok(out)) => {
            let text = String::from_utf8_lossy(if out.stderr.is_empty() {
                &out.stdout
            } else {
                &out.stderr
            })
            .into_owned();
            Err(format!(
                "exit {}: {}",
                out.status
                    .code()
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "by signal".into()),
                one_line(&super::clip_tail(&text, 300))
            ))
        }
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => {
            if let Some(pid) = pid {
                // SAFETY: plain syscall on the group we created; ESRCH is fine.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            }
            Err(format!(
                "did not finish within {}s; its process group was killed",
                timeout.as_secs()
            ))
        }
    }
}

/// The seed's codex wake-up hook as an `event_command`.
pub fn codex_event_command(codex_command: &str) -> String {
    let bin = if codex_command.trim().is_empty() {
        "codex"
    } else {
        codex_command.trim()
    };
    format!(
        "case \"$RSMCP_EVENT_TYPE\" in ssh_unreachable|interrupted|resume_failed|completed|config_missing) {} exec \"$RSMCP_SUGGESTED_PROMPT\" ;; esac",
        rsb_deploy::shell_quote(bin)
    )
}

// ---------------------------------------------------------------------------------------------
// Desktop notification

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(d.join(bin))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// The AppleScript of a macOS notification, one `-e` line each. It is constant: the text
/// reaches it only as `argv` of its run handler, so no job name or log line is ever parsed as
/// AppleScript (quotes, backslashes, `" & (do shell script …) & "` are just characters).
const NOTIFY_SCRIPT: [&str; 3] = [
    "on run argv",
    "display notification (item 1 of argv) with title (item 2 of argv) subtitle (item 3 of argv)",
    "end run",
];

/// `osascript`'s arguments for a notification: the script, `--` (so a text starting with `-`
/// is never read as another `-e` option), then message, title and subtitle as data. NULs,
/// which no argv can carry, are dropped.
pub(crate) fn osascript_args(title: &str, subtitle: &str, msg: &str) -> Vec<String> {
    let mut args: Vec<String> = NOTIFY_SCRIPT
        .iter()
        .flat_map(|line| ["-e".to_string(), line.to_string()])
        .collect();
    args.push("--".into());
    args.extend([msg, title, subtitle].map(|s| s.replace('\0', "")));
    args
}

async fn notify(e: &WatchEvent) -> Result<(), String> {
    let title = "rsb watchdog";
    let w = &e.payload["watch"];
    let label = [&w["name"], &w["run_id"], &w["tmux_session"]]
        .into_iter()
        .filter_map(|v| v.as_str())
        .find(|s| !s.is_empty())
        .unwrap_or("");
    let subtitle: String = format!("watch {} · {label}", e.watch_id)
        .chars()
        .take(120)
        .collect();
    let msg: String = one_line(&format!("{}: {}", e.event_type, e.summary))
        .chars()
        .take(240)
        .collect();
    let mut c = if cfg!(target_os = "macos") {
        let mut c = tokio::process::Command::new("/usr/bin/osascript");
        c.args(osascript_args(title, &subtitle, &msg));
        c
    } else if on_path("notify-send") {
        let mut c = tokio::process::Command::new("notify-send");
        c.arg("--app-name=rsb")
            .arg(format!("{title}: {subtitle}"))
            .arg(&msg);
        c
    } else {
        return Err("no notify-send on PATH".into());
    };
    c.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = c.spawn().map_err(|e| e.to_string())?;
    match tokio::time::timeout(NOTIFY_TIMEOUT, child.wait_with_output()).await {
        Ok(Ok(o)) if o.status.success() => Ok(()),
        Ok(Ok(o)) => Err(one_line(&String::from_utf8_lossy(&o.stderr))),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21 defect 6: 80 log lines of 249 control bytes made a 237 KB payload, and the hook
    /// failed with "Argument list too long"; one NUL in the log stopped every hook from starting.
    #[tokio::test]
    async fn a_noisy_log_with_a_nul_still_runs_the_hook_with_bounded_values() {
        let line: String = (0..249u32)
            .map(|i| char::from_u32(1 + i % 31).unwrap())
            .collect();
        let mut tail = vec![line; 80].join("\n");
        tail.push_str("\nlast words\0 after a NUL");
        let prompt = format!("Inspect the task.\nLatest log tail:\n{tail}");
        let e = WatchEvent {
            id: 3,
            watch_id: 9,
            event_type: "failed".into(),
            summary: "exit 1".into(),
            created_ts: 1,
            payload: json!({"watch": {"sandbox_name": "s", "tmux_session": "t\0x",
                                      "log_file": "/h/l.log"},
                            "log_tail": tail, "checkpoint_text": "",
                            "suggested_codex_prompt": prompt}),
        };
        assert!(serde_json::to_string(&json!(e)).unwrap().len() > 200_000);
        let dir = tempfile::tempdir().unwrap();
        let event_file = dir.path().join("event-3.json");
        let out = dir.path().join("out");
        let cmd = format!(
            "printf %s \"$RSMCP_EVENT_JSON\" > {0}.json; printf %s \"$RSMCP_SUGGESTED_PROMPT\" > {0}.prompt",
            out.display()
        );
        let brief = hook_event_json(&e, &event_file);
        run_event_command(&cmd, &e, &brief, &event_file, Duration::from_secs(10))
            .await
            .unwrap();
        let json_text = std::fs::read_to_string(out.with_extension("json")).unwrap();
        assert!(json_text.len() <= HOOK_VALUE_MAX, "{}", json_text.len());
        let v: serde_json::Value = serde_json::from_str(&json_text).unwrap();
        assert_eq!(v["payload"]["truncated"], true, "{v}");
        assert_eq!(v["payload"]["event_file"], event_file.display().to_string());
        assert_eq!(v["watch_id"], 9);
        // The tail is what is kept: the job's last words are there.
        assert!(
            v["payload"]["log_tail"]
                .as_str()
                .unwrap()
                .ends_with("last words\0 after a NUL")
        );
        let p = std::fs::read(out.with_extension("prompt")).unwrap();
        assert!(p.len() <= HOOK_VALUE_MAX && !p.contains(&0), "{}", p.len());
        let p = String::from_utf8(p).unwrap();
        assert!(p.starts_with("Inspect the task.") && p.ends_with("last words after a NUL"));
        assert!(
            p.contains("$RSMCP_EVENT_FILE"),
            "the cut says where the rest is"
        );

        // A small event passes whole, as the seed's did.
        let small = WatchEvent {
            payload: json!({"log_tail": "ok\n"}),
            ..e.clone()
        };
        assert_eq!(
            hook_event_json(&small, &event_file),
            serde_json::to_string(&json!(small)).unwrap()
        );
    }

    #[test]
    fn osascript_gets_hostile_text_as_data_never_as_script() {
        let hostile = [
            "say \"hi\" & (do shell script \"touch /tmp/pwned\") & \"",
            "back\\slash \\\" end run",
            "line one\nend run\non run argv\ndo shell script \"id\"",
            "-e do shell script \"id\"",
            "tell application \"Finder\" to delete every item",
            "nul\0byte",
        ];
        for t in hostile {
            let args = osascript_args(t, t, t);
            // The script is the constant one, whatever the text.
            let n = 2 * NOTIFY_SCRIPT.len();
            assert_eq!(
                &args[..n],
                osascript_args("", "", "")[..n].to_vec(),
                "{t:?}"
            );
            for (i, line) in NOTIFY_SCRIPT.iter().enumerate() {
                assert_eq!(args[2 * i], "-e");
                assert_eq!(args[2 * i + 1], *line);
            }
            // Then the end of options, then exactly three data arguments, verbatim (less NUL).
            assert_eq!(args[n], "--");
            let data = t.replace('\0', "");
            assert_eq!(&args[n + 1..], [data.as_str(); 3], "{t:?}");
        }
        let args = osascript_args("rsb watchdog", "watch 7 · train", "exited: code 1");
        assert_eq!(
            args[7..],
            ["exited: code 1", "rsb watchdog", "watch 7 · train"]
        );
        assert!(NOTIFY_SCRIPT[1].starts_with("display notification (item 1 of argv)"));
    }

    #[test]
    fn webhook_bodies_follow_their_format() {
        let e = WatchEvent {
            id: 7,
            watch_id: 3,
            event_type: "completed".into(),
            summary: "Background task completed with exit code 0\nsecond line".into(),
            created_ts: 1,
            payload: json!({"watch": {"name": "", "run_id": "", "tmux_session": "train",
                                      "sandbox_name": "gpu1"}}),
        };
        let line = "rsb completed: Background task completed with exit code 0 second line \
                    (job train on gpu1, watch 3)";
        let slack = webhook_body(WebhookFormat::Slack, &e, "{}");
        assert_eq!(slack.text, json!({"text": line}).to_string());
        let discord = webhook_body(WebhookFormat::Discord, &e, "{}");
        assert_eq!(discord.text, json!({"content": line}).to_string());
        let ntfy = webhook_body(WebhookFormat::Ntfy, &e, "{}");
        assert_eq!(
            (ntfy.text.as_str(), ntfy.content_type),
            (line, "text/plain; charset=utf-8")
        );
        assert_eq!(ntfy.headers, [("Title", "rsb: completed".to_string())]);
        let raw = webhook_body(WebhookFormat::Json, &e, "{\"id\":7}");
        assert_eq!(raw.text, "{\"id\":7}");
        for (url, f) in [
            (
                "https://hooks.slack.com/services/T0/B0/x",
                WebhookFormat::Slack,
            ),
            (
                "https://discord.com/api/webhooks/1/abc",
                WebhookFormat::Discord,
            ),
            ("https://discord.com/other", WebhookFormat::Json),
            ("https://ntfy.sh/my-topic", WebhookFormat::Ntfy),
            ("http://127.0.0.1:8080/rsb", WebhookFormat::Json),
        ] {
            assert_eq!(WebhookFormat::for_url(url), f, "{url}");
        }
    }

    #[test]
    fn urls_are_parsed_http_and_https() {
        let u = parse_http_url("http://127.0.0.1:8080/hook?x=1").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("127.0.0.1", 8080));
        let u = parse_http_url("http://[::1]/").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 80));
        let u = parse_http_url("https://hooks.example.org/services/T0/B0/x").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("hooks.example.org", 443));
        assert!(parse_http_url("http://example.org").is_ok());
        assert!(
            parse_http_url("notaurl")
                .unwrap_err()
                .contains("must start with http:// or https://")
        );
        assert!(parse_http_url("http://u:p@h/").is_err());
        assert!(parse_http_url("http://h:99999/").is_err());
        assert!(parse_http_url("http://h/a b").is_err());
    }

    #[test]
    fn codex_command_is_quoted() {
        let c = codex_event_command("/opt/my codex");
        assert!(c.contains("'/opt/my codex' exec"), "{c}");
        assert!(codex_event_command("").contains("'codex' exec"));
    }

    #[tokio::test]
    async fn a_hanging_command_is_killed_at_its_deadline() {
        let e = WatchEvent {
            id: 1,
            watch_id: 2,
            event_type: "completed".into(),
            summary: "s".into(),
            created_ts: 0,
            payload: json!({"watch": {"sandbox_name": "s"}}),
        };
        let t0 = std::time::Instant::now();
        let r = run_event_command(
            "sleep 30",
            &e,
            "{}",
            Path::new("/x"),
            Duration::from_millis(300),
        )
        .await;
        assert!(r.unwrap_err().contains("did not finish"), "");
        assert!(t0.elapsed() < Duration::from_secs(5));
        let r = run_event_command(
            "echo nope >&2; exit 3",
            &e,
            "{}",
            Path::new("/x"),
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(r.unwrap_err(), "exit 3: nope");
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("env");
        let cmd = format!("env | grep ^RSMCP_ | sort > {}", out.display());
        run_event_command(
            &cmd,
            &e,
            "{\"a\":1}",
            Path::new("/x/event-1.json"),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let env = std::fs::read_to_string(out).unwrap();
        assert_eq!(env.lines().count(), 8, "{env}");
        assert!(
            env.contains("RSMCP_WATCH_ID=2\n") && env.contains("RSMCP_EVENT_FILE=/x/event-1.json")
        );
    }
}
