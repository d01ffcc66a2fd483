//! `rsb forward SANDBOX:TARGET [LOCAL_PORT]`: forward in the foreground until Ctrl-C, one line
//! per connection (JSON lines with `--json`); `--detach` hands it to the watchdog daemon instead,
//! `--list` and `--stop ID` manage those.

use std::{io::Write, sync::Arc};

use rsb::{
    app::App,
    error::RsbError,
    forward::{Event, EventSink},
    ops::forward::{self, ForwardInfo},
    ops::output::human_bytes,
};

/// `rsb forward`'s arguments (kept here so the command's whole surface lives in one file).
#[derive(Debug, clap::Args)]
pub struct ForwardArgs {
    /// SANDBOX:PORT, SANDBOX:HOST:PORT or SANDBOX:/path/to.sock, as the sandbox sees it.
    #[arg(required_unless_present_any = ["list", "stop"])]
    pub target: Option<String>,
    /// Local port: default the remote port when free (else any), 0 = any free port.
    pub local_port: Option<i64>,
    /// Local address to listen on; anything but loopback lets other machines in.
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: String,
    /// Allow a --bind address that other machines can reach (0.0.0.0, ::, a LAN address).
    #[arg(long)]
    pub allow_external: bool,
    /// Let the watchdog daemon serve the forward (it outlives this command); prints its URL.
    #[arg(long, conflicts_with_all = ["list", "stop"])]
    pub detach: bool,
    /// List the detached forwards.
    #[arg(long, conflicts_with = "stop")]
    pub list: bool,
    /// Stop the detached forward with this id.
    #[arg(long, value_name = "ID")]
    pub stop: Option<u64>,
}

/// Exit code: 0 on success (or after Ctrl-C), 2 for bad arguments, 1 when the forward cannot
/// start or stop.
pub async fn main(app: Arc<App>, a: ForwardArgs, json: bool) -> u8 {
    let store = app.store();
    if a.list {
        let reg = forward::Forwards::default();
        return match reg.list(&store).await {
            Ok(l) if json => {
                println!("{}", serde_json::to_string(&l).unwrap_or_default());
                0
            }
            Ok(l) => {
                print_table(&l.forwards);
                0
            }
            Err(e) => {
                print_error(json, &e);
                failure_code(&e)
            }
        };
    }
    if let Some(id) = a.stop {
        let reg = forward::Forwards::default();
        let stopped = super::policy::caller(false)
            .act_on(
                app.config(),
                "rsb forward --stop",
                format!("forward {id}"),
                async || reg.stop(&store, id).await,
                |info| info.sandbox.clone(),
            )
            .await;
        return match stopped {
            Ok(info) => {
                if json {
                    println!("{}", serde_json::to_string(&info).unwrap_or_default());
                } else {
                    println!(
                        "stopped forward {id} ({} -> {}:{})",
                        info.local_address, info.sandbox, info.target
                    );
                }
                0
            }
            Err(e) => {
                print_error(json, &e);
                failure_code(&e)
            }
        };
    }
    let spec = a.target.unwrap_or_default();
    let req = match forward::cli_request(
        app.pool().names(),
        &spec,
        a.local_port,
        &a.bind,
        a.allow_external,
    ) {
        Ok(r) => r,
        Err(e) => {
            print_error(json, &e);
            return 2;
        }
    };
    if a.detach {
        return detach(&app, &req, json).await;
    }
    run(&app, &req, json).await
}

/// `--detach`: the watchdog daemon serves the forward; audited as its start
/// ([`forward::act`]), as `forward_port` is.
async fn detach(app: &App, req: &forward::ForwardRequest, json: bool) -> u8 {
    let r = super::policy::caller(false)
        .act(
            app.pool(),
            forward::act("rsb forward", req),
            async |sandbox| forward::detach(app, &req.on(sandbox)).await,
        )
        .await;
    match r {
        Ok(info) if json => {
            println!("{}", serde_json::to_string(&info).unwrap_or_default());
            0
        }
        Ok(info) => {
            if info.running {
                println!(
                    "forwarding {} -> {}:{} (detached, id {}; `rsb forward --stop {}` stops it)",
                    info.local_url, info.sandbox, info.target, info.forward_id, info.forward_id
                );
            } else {
                println!(
                    "forward {} to {}:{} is still starting; `rsb forward --list` shows it",
                    info.forward_id, info.sandbox, info.target
                );
            }
            if let Some(w) = &info.watchdog {
                eprintln!("rsb: {w}");
            }
            if let Some(w) = &info.warning {
                eprintln!("rsb: warning: {w}");
            }
            0
        }
        Err(e) => {
            print_error(json, &e);
            failure_code(&e)
        }
    }
}

/// 2 for what the user asked wrong (a taken port, an unknown id), 1 for what failed on the way.
fn failure_code(e: &RsbError) -> u8 {
    if e.kind == rsb::error::Kind::InvalidArgument {
        2
    } else {
        1
    }
}

fn print_table(list: &[ForwardInfo]) {
    if list.is_empty() {
        println!("no detached forwards (`rsb forward --detach SANDBOX:PORT` starts one)");
        return;
    }
    println!(
        "{:<9} {:<10} {:<22} {:<24} {:>6} {:>10} {:>10}",
        "ID", "STATE", "LOCAL", "TARGET", "CONNS", "SENT", "RECEIVED"
    );
    for f in list {
        println!(
            "{:<9} {:<10} {:<22} {:<24} {:>6} {:>10} {:>10}",
            f.forward_id,
            f.state
                .as_deref()
                .unwrap_or(if f.running { "listening" } else { "stopped" }),
            f.local_address,
            format!("{}:{}", f.sandbox, f.target),
            f.stats.connections_total,
            human_bytes(f.stats.bytes_sent),
            human_bytes(f.stats.bytes_received)
        );
        if let Some(e) = &f.stats.last_error {
            println!("          last error: {e}");
        }
    }
}

/// Exit code: 0 after Ctrl-C, 2 for bad arguments (a taken port too), 1 when the forward cannot
/// start.
async fn run(app: &App, req: &forward::ForwardRequest, json: bool) -> u8 {
    /// A started forward: its line's numbers are its reply's, as `forward_port`'s.
    #[derive(serde::Serialize)]
    struct Listening {
        #[serde(flatten)]
        info: ForwardInfo,
        #[serde(skip)]
        fwd: Arc<rsb::forward::Forward>,
    }
    let sink: EventSink = Arc::new(move |e: &Event| print_event(json, e));
    let pool = app.pool();
    let started = super::policy::caller(false)
        .act(pool, forward::act("rsb forward", req), async |sandbox| {
            let fwd = forward::start(pool, &req.on(sandbox), Some(sink)).await?;
            let info = ForwardInfo::of(1, &fwd);
            Ok(Listening { info, fwd })
        })
        .await;
    let Listening { info, fwd } = match started {
        Ok(l) => l,
        Err(e) => {
            print_error(json, &e);
            return failure_code(&e);
        }
    };
    if json {
        let mut v = serde_json::to_value(&info).unwrap_or_default();
        v["event"] = "listening".into();
        println!("{v}");
    } else {
        println!(
            "forwarding {} -> {}:{} (Ctrl-C stops)",
            info.local_url, info.sandbox, info.target
        );
        if let Some(w) = &info.warning {
            eprintln!("rsb: warning: {w}");
        }
    }
    let _ = std::io::stdout().flush();
    let _ = tokio::signal::ctrl_c().await;
    fwd.stop().await;
    let s = fwd.stats();
    if json {
        let mut v = serde_json::to_value(ForwardInfo::of(1, &fwd)).unwrap_or_default();
        v["event"] = "stopped".into();
        println!("{v}");
    } else {
        println!(
            "stopped: {} connections ({} failed), sent {}, received {}",
            s.connections_total,
            s.connections_failed,
            human_bytes(s.bytes_sent),
            human_bytes(s.bytes_received)
        );
    }
    0
}

fn print_error(json: bool, e: &RsbError) {
    if json {
        println!(
            "{}",
            serde_json::json!({"event": "error", "error": e.message, "hint": e.hint})
        );
    } else {
        eprintln!("rsb: {}\n  hint: {}", e.message, e.hint);
    }
}

fn print_event(json: bool, e: &Event) {
    let line = if json {
        serde_json::to_string(e).unwrap_or_default()
    } else {
        match e {
            Event::Open { conn, peer } => format!("#{conn} open  {peer}"),
            Event::Close {
                conn,
                peer,
                bytes_sent,
                bytes_received,
                duration_s,
                error,
            } => {
                let what = if error.is_some() { "error" } else { "close" };
                let mut l = format!(
                    "#{conn} {what} {peer}  sent {}, received {}, {duration_s:.2}s",
                    human_bytes(*bytes_sent),
                    human_bytes(*bytes_received)
                );
                if let Some(err) = error {
                    l.push_str(": ");
                    l.push_str(err);
                }
                l
            }
            Event::LinkDown { error, retry_in_s } => {
                format!("link down: {error}; retrying in {retry_in_s:.1}s")
            }
            Event::Reconnected { sandbox } => format!("reconnected to sandbox '{sandbox}'"),
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
