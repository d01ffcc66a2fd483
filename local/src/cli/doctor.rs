//! `rsb doctor`: one verdict per line for the configuration, the watchdog daemon and the
//! detached forwards it serves, and each sandbox (reachable, host key, authentication, agent,
//! tmux, clock skew). Sandboxes are checked in parallel, each within its own deadline, so a
//! dead host costs its deadline, not the sum.

use futures::future::join_all;
use rsb::{
    config::{Auth, Transport},
    error::Kind,
    ops::{exec, sandboxes},
    slurm::discover::{probe, undeclared_login_node},
};
use serde::Serialize;

use super::{Ctx, exit, print_json};

#[derive(Debug, Serialize)]
struct Check {
    sandbox: String,
    check: &'static str,
    verdict: &'static str,
    detail: String,
}

impl Check {
    /// The line a terminal gets. A detail quotes the host (an error, a path, a version) and
    /// a sandbox name may come from an ssh_config alias: escaped (`term::shown`), so a host
    /// cannot act on the user's terminal; `--json` keeps the bytes.
    fn human(&self) -> String {
        let who = if self.sandbox.is_empty() {
            String::new()
        } else {
            format!("{}: ", rsb::term::shown(&self.sandbox))
        };
        format!(
            "{:<5} {who}{}: {}",
            self.verdict,
            self.check,
            rsb::term::shown(&self.detail)
        )
    }
}

fn line(sandbox: &str, check: &'static str, verdict: &'static str, detail: String) -> Check {
    Check {
        sandbox: sandbox.into(),
        check,
        verdict,
        detail: super::cli_words(&detail),
    }
}

/// Clock difference above which `doctor` warns: file mtimes and job durations get odd.
const MAX_SKEW_S: f64 = 2.0;

async fn check_sandbox(ctx: &Ctx, name: &str) -> Vec<Check> {
    let mut out = Vec::new();
    let config = ctx.app.config();
    let own: Vec<&String> = config
        .warnings
        .iter()
        .filter(|w| super::warning_subject(config, w) == Some(name))
        .collect();
    if own.is_empty() {
        out.push(line(name, "config", "ok", "no warnings".into()));
    }
    for w in own {
        out.push(line(name, "config", "warn", w.clone()));
    }
    let ssh = match ctx.app.pool().sandbox_config(name).map(|c| &c.transport) {
        Some(Transport::Ssh(t)) => Some(t.clone()),
        _ => None,
    };
    if let Some(t) = &ssh {
        out.push(keys(name, &t.auth));
    }
    let deadline =
        sandboxes::connect_deadline(ctx.app.pool(), name) + sandboxes::ROUND_TRIP_DEADLINE;
    // The stages of a connection, in order: a failure names its stage, the ones before passed.
    const STAGES: [&str; 4] = ["reachable", "host key", "auth", "agent"];
    let client = match tokio::time::timeout(deadline, ctx.app.pool().client(name)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            let failed = match e.kind {
                Kind::HostKey => 1,
                Kind::Auth => 2,
                Kind::Deploy => 3,
                _ => 0,
            };
            for stage in &STAGES[..failed] {
                out.push(line(name, stage, "ok", "passed".into()));
            }
            let detail = host_key_changed(&e.message)
                .unwrap_or_else(|| format!("{} ({})", e.message, e.hint));
            out.push(line(name, STAGES[failed], "FAIL", detail));
            return out;
        }
        Err(_) => {
            out.push(line(
                name,
                "reachable",
                "FAIL",
                format!("no connection within {}s", deadline.as_secs()),
            ));
            return out;
        }
    };
    match &ssh {
        Some(t) => {
            out.push(line(name, "reachable", "ok", t.address()));
            out.push(line(
                name,
                "host key",
                "ok",
                format!("verified (policy {})", t.host_key_policy.as_str()),
            ));
            out.push(line(name, "auth", "ok", format!("logged in as {}", t.user)));
        }
        None => out.push(line(
            name,
            "reachable",
            "ok",
            "this machine (local sandbox)".into(),
        )),
    }
    let h = client.hello();
    let embedded = rsb_deploy::triple_for(&h.os, &h.arch)
        .ok()
        .and_then(|t| rsb_deploy::agent_for(t).ok());
    let (verdict, note) = match embedded {
        Some(a) if a.hash == h.agent_hash => ("ok", "the one this rsb ships"),
        Some(_) => (
            "warn",
            "differs from the one this rsb ships (RSB_AGENT_DIR?)",
        ),
        None => ("warn", "this rsb embeds no agent for it"),
    };
    out.push(line(
        name,
        "agent",
        verdict,
        format!(
            "rsb-agent {} blake3:{} on {} {}; {note}",
            h.agent_version,
            &h.agent_hash[..12.min(h.agent_hash.len())],
            h.os,
            h.arch
        ),
    ));
    out.push(if h.capabilities.tmux {
        line(name, "tmux", "ok", "present (jobs run in tmux)".into())
    } else {
        line(
            name,
            "tmux",
            "warn",
            "absent; jobs run under setsid (still supervised)".into(),
        )
    });
    out.push(confine_check(
        name,
        h.capabilities.landlock_abi,
        ctx.app
            .pool()
            .sandbox_config(name)
            .and_then(|c| c.confine.as_ref()),
    ));
    out.push(clock(name, &client).await);
    let slurm = ctx
        .app
        .pool()
        .sandbox_config(name)
        .is_some_and(|c| c.slurm.is_some());
    out.extend(host_tools(name, &client, slurm).await);
    out
}

/// What the host's Landlock can enforce, and whether the sandbox's `confine` asks for more: a
/// confined sandbox on a host that cannot confine it fails (its commands are refused), or
/// warns when `require = false` lets them run unconfined.
fn confine_check(name: &str, abi: u32, rules: Option<&rsb::config::ConfineRules>) -> Check {
    let can = rsb::config::landlock_can(abi);
    let Some(rules) = rules else {
        return line(name, "confine", "ok", format!("{can}; not configured"));
    };
    let missing = rules.missing_on(abi);
    let roots = rules.write.join(", ");
    match missing {
        None => line(
            name,
            "confine",
            "ok",
            format!(
                "{can}; writes only under {roots}{}",
                rsb::config::reads_words(rules.read.as_deref())
            ),
        ),
        Some(m) if rules.require => line(
            name,
            "confine",
            "FAIL",
            format!(
                "{can}: cannot enforce {m}, so its commands are refused; set confine.require = false to run them unconfined, or use a newer kernel"
            ),
        ),
        Some(m) => line(
            name,
            "confine",
            "warn",
            format!("{can}: cannot enforce {m}; commands run without it (confine.require = false)"),
        ),
    }
}

/// The `slurm` and `host` verdicts from a probe's values. A host where sbatch and sinfo
/// answer is a cluster's login node: background jobs there belong to the scheduler, so a
/// sandbox not declared `scheduler = "slurm"` is told how to declare it.
fn host_checks(
    name: &str,
    declared_slurm: bool,
    v: &std::collections::BTreeMap<String, String>,
) -> Vec<Check> {
    let get = |k: &str| v.get(k).map(String::as_str).filter(|s| !s.is_empty());
    let mut out = Vec::new();
    match (get("sbatch"), get("sinfo"), declared_slurm) {
        (Some(_), Some(_), false) => {
            if let Some(hint) = undeclared_login_node(v) {
                out.push(line(name, "slurm", "warn", hint));
            }
        }
        (Some(_), Some(parts), true) => {
            out.push(line(name, "slurm", "ok", format!("partitions: {parts}")))
        }
        (_, _, true) => out.push(line(
            name,
            "slurm",
            "FAIL",
            "declared scheduler = \"slurm\", but sbatch or sinfo does not answer here".into(),
        )),
        _ => {}
    }
    let mut have = Vec::new();
    match (get("driver"), get("cuda")) {
        (Some(d), Some(c)) => have.push(format!("NVIDIA driver {d} (CUDA {c})")),
        (Some(d), None) => have.push(format!("NVIDIA driver {d}")),
        _ => have.push("no NVIDIA driver".into()),
    }
    have.push(get("python").unwrap_or("no python3").to_string());
    if let Some(c) = get("conda") {
        have.push(c.to_string());
    }
    if get("modules").is_some() {
        have.push("environment modules".into());
    }
    let scratch: Vec<&str> = [get("scratch"), get("scratch_dir")]
        .into_iter()
        .flatten()
        .collect();
    if !scratch.is_empty() {
        have.push(format!("scratch {}", scratch.join(", ")));
    }
    out.push(line(name, "host", "ok", have.join("; ")));
    out
}

async fn host_tools(
    name: &str,
    client: &rsb::client::AgentClient,
    declared_slurm: bool,
) -> Vec<Check> {
    match probe(client).await {
        Ok(v) => host_checks(name, declared_slurm, &v),
        Err(e) => vec![line(
            name,
            "host",
            "warn",
            format!("cannot probe the host: {}", e.message),
        )],
    }
}

/// A changed host key, said as what changed, where the old key is, and the command that
/// forgets it (`ssh-keygen -R`, which also handles hashed entries). `None` for other errors.
fn host_key_changed(message: &str) -> Option<String> {
    // "… host key for [HOST]:PORT has CHANGED: it does not match FILE line N (ALG FP)"
    let (_, rest) = message.split_once("host key for [")?;
    let (host, rest) = rest.split_once("]:")?;
    let (port, rest) = rest.split_once(" has CHANGED: it does not match ")?;
    let (file, rest) = rest.rsplit_once(" line ")?;
    let (line_no, presented) = rest.split_once(' ')?;
    let presented = presented.trim_start_matches('(').trim_end_matches(')');
    let name = if port == "22" {
        host.to_string()
    } else {
        format!("[{host}]:{port}")
    };
    Some(format!(
        "CHANGED: {name} now presents {presented}, not the key in {file} line {line_no}; if the host \
         was reinstalled, run `ssh-keygen -R '{name}' -f {file}` and retry, otherwise the \
         connection may be intercepted"
    ))
}

/// The watchdog daemon (which serves detached forwards and watches long jobs) and the detached
/// forwards: one line each. Read-only; a state directory that was never used is not created.
async fn local_services(ctx: &Ctx) -> Vec<Check> {
    let state_dir = &ctx.app.config().state_dir;
    let mut out = Vec::new();
    let forwards = rsb::ops::forward::Forwards::default()
        .list(&ctx.app.store())
        .await
        .map(|l| l.forwards);
    let forwards = match forwards {
        Ok(f) => f,
        Err(e) => {
            out.push(line("", "forwards", "warn", e.message));
            Vec::new()
        }
    };
    let status = if rsb::store::db_path(state_dir).exists() {
        rsb::ops::watchdog::status(&ctx.app.store()).await.map(Some)
    } else {
        Ok(None)
    };
    let (running, active_watches) = match status {
        Ok(Some(s)) => {
            let d = &s.daemon;
            let active = s.watch_counts.get("active").copied().unwrap_or(0);
            if d.running {
                out.push(line(
                    "",
                    "watchdog",
                    "ok",
                    format!(
                        "running (pid {}, {}); {active} active watch(es)",
                        d.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
                        d.mode.as_deref().unwrap_or("?"),
                    ),
                ));
            }
            (d.running, active)
        }
        Ok(None) => (false, 0),
        Err(e) => {
            out.push(line("", "watchdog", "warn", e.message));
            return out;
        }
    };
    if !running {
        let needed = active_watches > 0 || !forwards.is_empty();
        out.push(line(
            "",
            "watchdog",
            if needed { "warn" } else { "ok" },
            if needed {
                format!(
                    "not running, but {active_watches} active watch(es) and {} detached forward(s) need it; start it with `rsb watchdog run` or `rsb watchdog install`",
                    forwards.len()
                )
            } else {
                "not running (nothing needs it: no active watches or detached forwards)".into()
            },
        ));
    }
    let service = rsb::ops::watchdog::service(state_dir);
    out.extend(service_check(&service));
    let config = ctx.app.config();
    let agent_users: Vec<&str> = config
        .sandboxes
        .iter()
        .filter(|c| match &c.transport {
            Transport::Ssh(t) => matches!(
                &t.auth,
                Auth::Agent
                    | Auth::Auto {
                        agent: rsb::config::AgentSocket::Env,
                        ..
                    }
            ),
            _ => false,
        })
        .map(|c| c.name.as_str())
        .collect();
    let tmpdir = std::env::var_os("TMPDIR").map(std::path::PathBuf::from);
    out.extend(agent_check(
        &service,
        rsb::watchdog::service::shell_agent_socket().as_deref(),
        &agent_users,
        tmpdir.as_deref(),
    ));
    if forwards.is_empty() {
        out.push(line("", "forwards", "ok", "no detached forwards".into()));
    }
    for f in &forwards {
        let recorded =
            f.state
                .as_deref()
                .unwrap_or(if f.running { "listening" } else { "stopped" });
        // The row is what the daemon last wrote; whether the port answers is checked here, so
        // a forward whose daemon died is never called listening.
        let state = if recorded != "listening" {
            recorded.to_string()
        } else if !running {
            "not served: the watchdog daemon is not running".to_string()
        } else if !accepts(&f.local_address) {
            "recorded as listening, but the port refuses connections".to_string()
        } else {
            "listening".to_string()
        };
        let verdict = if state == "listening" { "ok" } else { "warn" };
        let mut detail = format!(
            "{} {} -> {}:{} ({state}, {} connection(s))",
            f.forward_id, f.local_address, f.sandbox, f.target, f.stats.connections_total
        );
        if let Some(e) = &f.stats.last_error {
            detail.push_str(&format!("; last error: {e}"));
        }
        out.push(line("", "forward", verdict, detail));
    }
    out
}

/// The installed watchdog service, when there is one: a unit or plist whose binary is gone
/// (a Homebrew or nix upgrade removed the versioned path it named) never starts the daemon.
fn service_check(s: &rsb::watchdog::service::ServiceStatus) -> Option<Check> {
    if !s.installed {
        return None;
    }
    let bin = s.binary.as_deref().unwrap_or("?");
    Some(if s.binary_missing {
        line(
            "",
            "service",
            "warn",
            format!(
                "the {} service {} runs {bin}, which no longer exists or is not executable, so it \
                 cannot start the daemon; run `rsb watchdog install` again with the rsb you use now",
                s.kind, s.path
            ),
        )
    } else if !s.for_this_state_dir {
        line(
            "",
            "service",
            "warn",
            format!(
                "the {} service {} watches another state dir than this one; run `rsb watchdog \
                 install` with this RSB_STATE_DIR to serve it",
                s.kind, s.path
            ),
        )
    } else {
        line(
            "",
            "service",
            "ok",
            format!("{} service {} runs {bin}", s.kind, s.path),
        )
    })
}

/// Whether the installed daemon can ask the SSH agent this shell (and an MCP server started
/// from it) asks at `shell_sock`, for the sandboxes (`users`) that log in through
/// `SSH_AUTH_SOCK`. A service manager gives the daemon its own environment (launchd: a socket
/// of its own, not 1Password's or Secretive's), so only the socket written into the service
/// counts. Nothing is said without an installed service, an agent here, or a sandbox that
/// needs one.
fn agent_check(
    s: &rsb::watchdog::service::ServiceStatus,
    shell_sock: Option<&std::path::Path>,
    users: &[&str],
    tmpdir: Option<&std::path::Path>,
) -> Option<Check> {
    use rsb::watchdog::service::{stable_agent_socket, unstable_agent_note};
    let shell = shell_sock?;
    if !s.installed || users.is_empty() {
        return None;
    }
    let who = users.join(", ");
    let here = shell.display();
    let (verdict, detail) = match s.ssh_auth_sock.as_deref() {
        Some(d) if std::path::Path::new(d) == shell => {
            ("ok", format!("the daemon asks your SSH agent at {here}"))
        }
        Some(d) => (
            "warn",
            format!(
                "the daemon asks the SSH agent at {d}, not this shell's ({here}), for {who}; run \
                 `rsb watchdog install` again from this shell to give it yours"
            ),
        ),
        None if stable_agent_socket(shell, tmpdir) => (
            "warn",
            format!(
                "the {} service names no SSH_AUTH_SOCK, so the daemon asks whatever agent its \
                 service manager gives it (under launchd none of yours), not yours at {here}, for \
                 {who}; run `rsb watchdog install` again to write it into the service",
                s.kind
            ),
        ),
        None => (
            "warn",
            format!(
                "the daemon cannot ask your SSH agent for {who}: {}",
                unstable_agent_note(shell)
            ),
        ),
    };
    Some(line("", "service", verdict, detail))
}

/// The MCP servers' recorded environments ([`rsb::server_env`]) against this shell's: an MCP
/// client may start `rsb mcp` without `SSH_AUTH_SOCK` or `RSB_STATE_DIR`, so what works here
/// fails (or lands in another store) there. Names and paths only; one line per environment.
fn server_environments(ctx: &Ctx) -> Vec<Check> {
    use rsb::server_env;
    let config = ctx.app.config();
    let me = server_env::current(server_env::env_pairs(), &config.state_dir, &config.source);
    let recorded = server_env::read_all(&config.state_dir);
    if recorded.is_empty() {
        return vec![line(
            "",
            "mcp env",
            "ok",
            "no `rsb mcp` has started with this HOME and state dir yet (nothing to compare)".into(),
        )];
    }
    let now = me.started_at;
    server_env::differences(&me, &recorded)
        .into_iter()
        .map(|(r, diffs)| {
            let who = format!(
                "the MCP server started {}{}",
                ago(now.saturating_sub(r.started_at)),
                r.client
                    .as_deref()
                    .map(|c| format!(" by {c}"))
                    .unwrap_or_default()
            );
            if diffs.is_empty() {
                line("", "mcp env", "ok", format!("{who} has this environment"))
            } else {
                line(
                    "",
                    "mcp env",
                    "warn",
                    format!(
                        "{who} ran {}; set the same in the client's server entry (README: MCP clients)",
                        diffs.join("; ")
                    ),
                )
            }
        })
        .collect()
}

fn ago(secs: u64) -> String {
    match secs {
        0..=119 => format!("{secs}s ago"),
        120..=7199 => format!("{}m ago", secs / 60),
        7200..=172_799 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86_400),
    }
}

/// Whether a TCP connection to `addr` (`host:port`) is accepted within 300 ms. A reset after
/// the handshake counts as accepted: a forward whose remote target refuses accepts the local
/// connection and then resets it, and when that reset arrives before the connect's own check
/// it reads as ECONNRESET (`cli_table`'s forward to `gpu1:9` failed that way under load). Only
/// a refused handshake (ECONNREFUSED) or silence means nothing listens.
fn accepts(addr: &str) -> bool {
    use std::{io::ErrorKind, net::ToSocketAddrs};
    let Ok(mut addrs) = addr.to_socket_addrs() else {
        return false;
    };
    addrs.any(|a| {
        match std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_millis(300)) {
            Ok(_) => true,
            Err(e) => matches!(
                e.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
            ),
        }
    })
}

/// Which credential will be tried; a key file that is missing is a failure before connecting.
fn keys(name: &str, auth: &Auth) -> Check {
    match auth {
        Auth::Password(_) => line(
            name,
            "keys",
            "ok",
            "password (from the configuration)".into(),
        ),
        Auth::KeyFile { path, .. } if path.is_file() => {
            line(name, "keys", "ok", format!("key file {}", path.display()))
        }
        Auth::KeyFile { path, .. } => line(
            name,
            "keys",
            "FAIL",
            format!("key file {} does not exist", path.display()),
        ),
        Auth::Agent => line(name, "keys", "ok", "ssh-agent".into()),
        Auth::Auto {
            identity_files,
            default_keys,
            agent,
            ..
        } => {
            let agent = agent.available(&|k| std::env::var(k).ok());
            let n = identity_files.len() + default_keys.len();
            if n == 0 && !agent {
                line(
                    name,
                    "keys",
                    "FAIL",
                    "no key_file, IdentityFile, ~/.ssh/id_* key or ssh-agent".into(),
                )
            } else {
                line(
                    name,
                    "keys",
                    "ok",
                    format!(
                        "{n} key file(s){}",
                        if agent { " and ssh-agent" } else { "" }
                    ),
                )
            }
        }
    }
}

/// Remote clock minus the local one at the midpoint of the round trip.
async fn clock(name: &str, client: &rsb::client::AgentClient) -> Check {
    let req = match exec::build_request_ms("date +%s.%N", None, 10_000, 256) {
        Ok(r) => r,
        Err(e) => return line(name, "clock", "warn", e.message),
    };
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    };
    let t0 = now();
    let r = client.call(req).await;
    let t1 = now();
    let remote = r.ok().and_then(|r| {
        String::from_utf8_lossy(&r.stdout.head)
            .trim()
            .parse::<f64>()
            .ok()
    });
    match remote {
        Some(t) => {
            let skew = t - (t0 + t1) / 2.0;
            let v = if skew.abs() > MAX_SKEW_S {
                "warn"
            } else {
                "ok"
            };
            line(name, "clock", v, format!("skew {skew:+.2}s"))
        }
        None => line(name, "clock", "warn", "cannot read the remote clock".into()),
    }
}

pub async fn run(ctx: &Ctx) -> u8 {
    let mut checks = Vec::new();
    let config = ctx.app.config();
    checks.push(line(
        "",
        "config",
        "ok",
        format!(
            "{} sandbox(es) from {}",
            config.sandboxes.len(),
            config.source
        ),
    ));
    for w in &config.warnings {
        if super::warning_subject(config, w).is_none() {
            checks.push(line("", "config", "warn", w.clone()));
        }
    }
    checks.extend(local_services(ctx).await);
    checks.extend(server_environments(ctx));
    let names: Vec<String> = if ctx.sandbox.is_empty() {
        ctx.app.pool().names().to_vec()
    } else {
        match ctx.resolve() {
            Ok(n) => vec![n],
            Err(e) => return super::fail(ctx.json, &e),
        }
    };
    for c in join_all(names.iter().map(|n| check_sandbox(ctx, n))).await {
        checks.extend(c);
    }
    let failed = checks.iter().any(|c| c.verdict == "FAIL");
    if ctx.json {
        print_json(&serde_json::json!({"ok": !failed, "checks": checks}));
    } else {
        for c in &checks {
            println!("{}", c.human());
        }
    }
    if failed { exit::CONNECTION } else { exit::OK }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confine_says_what_the_host_enforces_and_fails_what_it_cannot() {
        use rsb::config::{ConfineRules, Net};
        let rules = |net: Net, require: bool| ConfineRules {
            write: vec!["~/work".into()],
            read: None,
            net,
            require,
        };
        let cases = [
            (0, None, "ok", "no Landlock; not configured"),
            (7, None, "ok", "scoping; not configured"),
            (
                7,
                Some(rules(Net::Word("none".into()), true)),
                "ok",
                "writes only under ~/work",
            ),
            (0, Some(rules(Net::Any, true)), "FAIL", "are refused"),
            (0, Some(rules(Net::Any, false)), "warn", "run without it"),
            (
                3,
                Some(rules(Net::Word("none".into()), true)),
                "FAIL",
                "TCP rules need ABI 4",
            ),
            (3, Some(rules(Net::Any, true)), "ok", "ABI 3: files"),
        ];
        for (abi, r, verdict, needle) in cases {
            let c = confine_check("box", abi, r.as_ref());
            assert_eq!(c.verdict, verdict, "ABI {abi}: {}", c.detail);
            assert!(c.detail.contains(needle), "ABI {abi}: {}", c.detail);
        }
    }

    /// Issue 44: doctor says when the daemon cannot ask the agent this shell asks.
    #[test]
    fn the_daemon_s_ssh_agent_against_this_shell_s() {
        use rsb::watchdog::service::ServiceStatus;
        use std::path::Path;
        let status = |installed: bool, sock: Option<&str>| ServiceStatus {
            kind: "launchd",
            installed,
            path: "/Users/a/Library/LaunchAgents/com.rsb.watchdog.plist".into(),
            for_this_state_dir: true,
            binary: Some("/opt/homebrew/bin/rsb".into()),
            binary_missing: false,
            ssh_auth_sock: sock.map(String::from),
        };
        let op = "/Users/a/Library/Group Containers/2BUA8C4S2C.com.1password/t/agent.sock";
        let launchd = "/private/tmp/com.apple.launchd.x/Listeners";
        let users = ["gpu1", "gpu2"];
        let check = |s: &ServiceStatus, shell: Option<&str>, users: &[&str]| {
            agent_check(s, shell.map(Path::new), users, None).map(|c| (c.verdict, c.detail))
        };
        // Nothing to say: no service, no agent here, no sandbox that needs one.
        assert_eq!(check(&status(false, None), Some(op), &users), None);
        assert_eq!(check(&status(true, None), None, &users), None);
        assert_eq!(check(&status(true, None), Some(op), &[]), None);
        let (v, d) = check(&status(true, Some(op)), Some(op), &users).unwrap();
        assert_eq!(
            (v, d.as_str()),
            ("ok", &*format!("the daemon asks your SSH agent at {op}"))
        );
        let (v, d) = check(&status(true, Some("/Users/a/old.sock")), Some(op), &users).unwrap();
        assert_eq!(v, "warn");
        assert!(
            d.contains("asks the SSH agent at /Users/a/old.sock, not this shell's"),
            "{d}"
        );
        assert!(d.contains("for gpu1, gpu2; run `rsb watchdog install` again from this shell"));
        let (v, d) = check(&status(true, None), Some(op), &users).unwrap();
        assert_eq!(v, "warn");
        assert!(
            d.contains("names no SSH_AUTH_SOCK") && d.contains("write it into"),
            "{d}"
        );
        let (v, d) = check(&status(true, None), Some(launchd), &users).unwrap();
        assert_eq!(v, "warn");
        assert!(
            d.contains("made anew at each login") && d.contains("IdentityAgent"),
            "{d}"
        );
    }

    #[test]
    fn a_host_s_text_is_escaped_on_the_terminal() {
        // OSC 52 would write the user's clipboard; a newline would forge a second check line.
        let c = line(
            "gpu1",
            "agent",
            "FAIL",
            "cannot start: \u{1b}]52;c;cm0gLXJmIH4=\u{7}\nok    gpu1: agent: fine".into(),
        );
        let shown = c.human();
        assert!(!shown.chars().any(|ch| ch.is_control()), "{shown:?}");
        assert!(
            shown.starts_with("FAIL  gpu1: agent: cannot start: \\u{1b}]52"),
            "{shown}"
        );
        // --json keeps the exact text.
        let v = serde_json::to_value(&c).unwrap();
        assert!(v["detail"].as_str().unwrap().contains('\u{1b}'));
    }
    use rsb::slurm::discover::probe_values;

    fn verdicts(declared: bool, out: &str) -> Vec<(String, String, String)> {
        host_checks("s", declared, &probe_values(out))
            .into_iter()
            .map(|c| (c.check.to_string(), c.verdict.to_string(), c.detail))
            .collect()
    }

    #[test]
    fn a_login_node_not_declared_slurm_is_told_how_to_declare_it() {
        let out = "sbatch=/usr/bin/sbatch\nsinfo=debug* gpu \ndriver=550.54.15\ncuda=12.4\n\
                   python=Python 3.11.2\nmodules=yes\nscratch=/scratch/me\nscratch_dir=/scratch\n";
        let v = verdicts(false, out);
        assert_eq!(v[0].0, "slurm");
        assert_eq!(v[0].1, "warn");
        assert!(v[0].2.contains("scheduler = \"slurm\""), "{}", v[0].2);
        assert!(v[0].2.contains("debug* gpu"), "{}", v[0].2);
        assert_eq!(
            v[1],
            (
                "host".into(),
                "ok".into(),
                "NVIDIA driver 550.54.15 (CUDA 12.4); Python 3.11.2; environment modules; \
                 scratch /scratch/me, /scratch"
                    .into()
            )
        );
        let v = verdicts(true, out);
        assert_eq!(
            (v[0].1.as_str(), v[0].2.as_str()),
            ("ok", "partitions: debug* gpu")
        );
    }

    #[test]
    fn a_plain_host_has_no_slurm_line_and_a_declared_one_without_sbatch_fails() {
        let v = verdicts(false, "sbatch=\nscratch=\n");
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].2, "no NVIDIA driver; no python3");
        // sbatch without a controller that answers is not a login node yet.
        let v = verdicts(false, "sbatch=/usr/bin/sbatch\nsinfo=\n");
        assert_eq!(v[0].0, "host");
        let v = verdicts(true, "sbatch=\n");
        assert_eq!((v[0].0.as_str(), v[0].1.as_str()), ("slurm", "FAIL"));
    }
}
