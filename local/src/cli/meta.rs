//! `rsb version`, `rsb completions SHELL`, `rsb man`: about rsb itself.

use clap_complete::Shell;

use super::{exit, print_json};

pub fn version(json: bool) -> u8 {
    let agents: Vec<(String, String)> = rsb_deploy::embedded_triples()
        .into_iter()
        .filter_map(|t| {
            rsb_deploy::agent_for(t)
                .ok()
                .map(|a| (t.to_string(), a.hash))
        })
        .collect();
    if json {
        let list: Vec<_> = agents
            .iter()
            .map(|(t, h)| serde_json::json!({"triple": t, "blake3": h}))
            .collect();
        print_json(&serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "protocol": rsb_protocol::PROTOCOL_VERSION,
            "agents": list,
        }));
        return exit::OK;
    }
    println!("rsb {}", env!("CARGO_PKG_VERSION"));
    if agents.is_empty() {
        println!("agents: none embedded (scripts/build-agents.sh, then rebuild rsb)");
    }
    for (t, h) in &agents {
        println!("agent {t} blake3:{}", &h[..16.min(h.len())]);
    }
    exit::OK
}

pub fn completions(cmd: &mut clap::Command, shell: Shell) -> u8 {
    clap_complete::generate(shell, cmd, "rsb", &mut std::io::stdout());
    exit::OK
}

pub fn man(cmd: clap::Command) -> u8 {
    let mut out = std::io::stdout().lock();
    match clap_mangen::Man::new(cmd).render(&mut out) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("rsb: cannot write the man page: {e}");
            exit::INTERNAL
        }
    }
}
