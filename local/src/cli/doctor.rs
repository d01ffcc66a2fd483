//! `rsb doctor`: one verdict per line for the configuration and each sandbox (reachable, host
//! key, authentication, agent, tmux, clock skew). Sandboxes are checked in parallel, each within
//! its own deadline, so a dead host costs its deadline, not the sum.

use futures::future::join_all;
use rsb::{
    config::{Auth, Transport},
    error::Kind,
    ops::{exec, sandboxes},
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
    let config = ctx.pool.config();
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
    let ssh = match ctx.pool.sandbox_config(name).map(|c| &c.transport) {
        Some(Transport::Ssh(t)) => Some(t.clone()),
        _ => None,
    };
    if let Some(t) = &ssh {
        out.push(keys(name, &t.auth));
    }
    let deadline = sandboxes::probe_deadline(&ctx.pool, name);
    // The stages of a connection, in order: a failure names its stage, the ones before passed.
    const STAGES: [&str; 4] = ["reachable", "host key", "auth", "agent"];
    let client = match tokio::time::timeout(deadline, ctx.pool.client(name)).await {
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
            out.push(line(
                name,
                STAGES[failed],
                "FAIL",
                format!("{} ({})", e.message, e.hint),
            ));
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
    out.push(clock(name, &client).await);
    out
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
            ..
        } => {
            let agent = std::env::var_os("SSH_AUTH_SOCK").is_some();
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
    let config = ctx.pool.config();
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
    let names: Vec<String> = if ctx.sandbox.is_empty() {
        ctx.pool.names().to_vec()
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
            let who = if c.sandbox.is_empty() {
                String::new()
            } else {
                format!("{}: ", c.sandbox)
            };
            println!("{:<5} {who}{}: {}", c.verdict, c.check, c.detail);
        }
    }
    if failed { exit::CONNECTION } else { exit::OK }
}
