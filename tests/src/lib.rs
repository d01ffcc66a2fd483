//! Test bed for rsb's integration tests.
//!
//! rsb talks to real OpenSSH servers in production, so its tests talk to a
//! real, private `sshd` too ([`Sshd`]) instead of a mock: protocol quirks,
//! PAM, host-key handling and environment propagation only show up against
//! the real thing. [`ChaosProxy`] sits between a client and that sshd to
//! inject the network faults (latency, silence, resets) that the reconnect
//! logic must survive, and [`SshAgentProc`] provides an isolated agent so
//! agent-based auth never touches the developer's own agent.

pub mod agent;
pub mod chaos;
pub mod gpu;
pub mod slurm;
pub mod sshd;

use std::path::PathBuf;

pub use agent::SshAgentProc;
pub use chaos::ChaosProxy;
pub use sshd::{LocalUser, Sshd, SshdOptions, other_local_user};

/// Root of the rsb workspace, so tests can locate sibling crates' artefacts
/// (built agents, scripts) regardless of the directory cargo runs them from.
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// Runs `cmd` to completion but never longer than `timeout`, so a wedged
/// ssh (blackholed proxy, stuck auth prompt) fails the test instead of
/// hanging the whole suite. The child is killed on timeout; stdin is closed
/// so nothing can block on a prompt.
pub fn output_with_timeout(
    cmd: &mut std::process::Command,
    timeout: std::time::Duration,
) -> anyhow::Result<std::process::Output> {
    use anyhow::Context as _;
    use std::io::Read;
    use std::process::Stdio;
    use std::sync::mpsc;
    use std::time::Instant;

    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {:?}", cmd.get_program()))?;

    // Pipes are drained on threads so a chatty child cannot fill a pipe
    // buffer and deadlock against our wait.
    let (tx, rx) = mpsc::channel::<(bool, Vec<u8>)>();
    for (is_out, pipe) in [
        (
            true,
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ),
        (
            false,
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            let _ = tx.send((is_out, buf));
        });
    }
    drop(tx);

    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("{:?} did not finish within {timeout:?}", cmd.get_program());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };

    // A grandchild that inherited the pipes could keep them open forever;
    // give the readers a bounded grace period and return what we have.
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let grace = Instant::now() + std::time::Duration::from_secs(2);
    for _ in 0..2 {
        let left = grace.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((true, b)) => stdout = b,
            Ok((false, b)) => stderr = b,
            Err(_) => break,
        }
    }
    Ok(std::process::Output {
        status,
        stdout,
        stderr,
    })
}
