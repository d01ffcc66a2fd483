//! A private `ssh-agent` per test.
//!
//! Agent-based auth must be tested without the developer's own agent
//! (whose keys would make tests pass or fail by accident), so each test
//! gets a fresh agent on a socket inside its own temp dir.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

use crate::output_with_timeout;

const STARTUP_TIMEOUT: Duration = Duration::from_secs(5);
const SSH_ADD_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `ssh-agent -D`; killed on drop.
pub struct SshAgentProc {
    child: Option<Child>,
    sock: PathBuf,
    // Last, so the socket dir outlives the agent process.
    dir: TempDir,
}

impl SshAgentProc {
    pub fn start() -> Result<SshAgentProc> {
        let dir = tempfile::Builder::new()
            .prefix("rsb-agent-")
            .tempdir()
            .context("creating agent dir")?;
        let sock = dir.path().join("agent.sock");
        let log = fs::File::create(dir.path().join("agent.log"))?;
        let child = Command::new("ssh-agent")
            .arg("-D")
            .arg("-a")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning ssh-agent")?;
        let mut agent = SshAgentProc {
            child: Some(child),
            sock,
            dir,
        };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = agent
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let log =
                    fs::read_to_string(agent.dir.path().join("agent.log")).unwrap_or_default();
                bail!("ssh-agent exited during startup ({status}): {log}");
            }
            if UnixStream::connect(&agent.sock).is_ok() {
                return Ok(agent);
            }
            if Instant::now() >= deadline {
                bail!(
                    "ssh-agent socket {} not ready after {STARTUP_TIMEOUT:?}",
                    agent.sock.display()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Value for `SSH_AUTH_SOCK`.
    pub fn sock(&self) -> &Path {
        &self.sock
    }

    /// Loads a private key into the agent. Encrypted keys get their
    /// passphrase through `SSH_ASKPASS`, since ssh-add only prompts on a tty.
    pub fn add_key(&self, key: &Path, passphrase: Option<&str>) -> Result<()> {
        let askpass = self.dir.path().join("askpass.sh");
        let secret = self.dir.path().join("askpass.secret");
        match passphrase {
            Some(p) => {
                fs::write(&secret, p)?;
                fs::set_permissions(&secret, fs::Permissions::from_mode(0o600))?;
                let _ = fs::remove_file(crate::sshd::path_with_suffix(&secret, ".used"));
                fs::write(&askpass, crate::sshd::askpass_script(&secret))?;
            }
            // Fail fast instead of prompting if the key turns out encrypted.
            None => fs::write(&askpass, "#!/bin/sh\nexit 1\n")?,
        }
        fs::set_permissions(&askpass, fs::Permissions::from_mode(0o700))?;
        let mut cmd = self.command("ssh-add");
        cmd.env("SSH_ASKPASS", &askpass)
            .env("SSH_ASKPASS_REQUIRE", "force")
            .arg(key);
        let out = output_with_timeout(&mut cmd, SSH_ADD_TIMEOUT);
        let _ = fs::remove_file(&secret);
        let out = out?;
        if !out.status.success() {
            bail!(
                "ssh-add {} failed ({}): {}",
                key.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// `ssh-add -l` output: one line per loaded key, empty when none.
    pub fn list_keys(&self) -> Result<String> {
        let out = output_with_timeout(self.command("ssh-add").arg("-l"), SSH_ADD_TIMEOUT)?;
        // Exit 1 means "no identities" (with a human message on stdout),
        // a valid answer here.
        if out.status.code() == Some(1) {
            return Ok(String::new());
        }
        if !out.status.success() {
            bail!(
                "ssh-add -l failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A command wired to this agent (and only this agent).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SSH_AUTH_SOCK", &self.sock);
        c
    }
}

impl Drop for SshAgentProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl std::fmt::Debug for SshAgentProc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshAgentProc")
            .field("sock", &self.sock)
            .finish_non_exhaustive()
    }
}
