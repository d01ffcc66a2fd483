//! The handshake frame and `rsb-agent version`.

use std::sync::OnceLock;

use rsb_protocol::{Capabilities, Hello, MAGIC, PROTOCOL_VERSION};

use crate::{proc, util};

/// blake3 of the running executable, computed once: the local side compares it with the bytes it
/// deployed to decide whether this agent is the one it expects. An empty string (unreadable
/// executable) never matches, which makes the local side redeploy rather than trust it.
pub fn agent_hash() -> &'static str {
    static HASH: OnceLock<String> = OnceLock::new();
    HASH.get_or_init(|| {
        let exe = own_executable();
        util::hash_file(&exe).unwrap_or_else(|e| {
            eprintln!("rsb-agent: cannot hash {}: {e}", exe.display());
            String::new()
        })
    })
}

/// The running executable: `/proc/self/exe` on Linux (still the bytes that run even after the
/// file was replaced), the path the kernel exec'd on macOS (`_NSGetExecutablePath`, no /proc).
fn own_executable() -> std::path::PathBuf {
    if cfg!(any(target_os = "linux", target_os = "android")) {
        "/proc/self/exe".into()
    } else {
        std::env::current_exe().unwrap_or_default()
    }
}

/// Kernel release and hostname from one `uname` call.
fn uname() -> (String, String) {
    let u = rustix::system::uname();
    let text = |f: &std::ffi::CStr| f.to_string_lossy().into_owned();
    (text(u.release()), text(u.nodename()))
}

fn nvml_available() -> bool {
    #[cfg(all(feature = "nvml", not(target_env = "musl")))]
    {
        nvml_wrapper::Nvml::init().is_ok()
    }
    #[cfg(not(all(feature = "nvml", not(target_env = "musl"))))]
    {
        false
    }
}

/// What the host offers, probed once per agent start (PATH lookups only, no subprocesses).
pub fn capabilities() -> Capabilities {
    Capabilities {
        // One PATH policy (proc.rs) for all three: the job runner and the GPU sampler look
        // programs up the same way, so what the Hello promises is what they find.
        bash: proc::find_on_path("bash").is_some(),
        tmux: proc::find_on_path("tmux").is_some(),
        nvidia_smi: proc::find_on_path("nvidia-smi").is_some(),
        nvml: nvml_available(),
        landlock_abi: crate::confine::abi(),
    }
}

pub fn hello() -> Hello {
    let (kernel, hostname) = uname();
    let pw = util::passwd_entry();
    let user = match &pw {
        Some(p) if !p.name.is_empty() => p.name.clone(),
        _ => std::env::var("USER").unwrap_or_default(),
    };
    let home = match std::env::var_os("HOME") {
        Some(h) if !h.is_empty() => h.to_string_lossy().into_owned(),
        _ => pw.map(|p| util::path_string(&p.home)).unwrap_or_default(),
    };
    Hello {
        magic: MAGIC,
        protocol_version: PROTOCOL_VERSION,
        protocol_fingerprint: rsb_protocol::PROTOCOL_FINGERPRINT.into(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        agent_hash: agent_hash().to_string(),
        os: std::env::consts::OS.to_string(),
        arch: std::env::consts::ARCH.to_string(),
        kernel,
        hostname,
        user,
        uid: rustix::process::getuid().as_raw(),
        home,
        pid: std::process::id(),
        capabilities: capabilities(),
    }
}

/// `rsb-agent version`: what a person on the host needs to match a binary with a deploy.
pub fn print_version() -> i32 {
    let line = format!(
        "rsb-agent {} (protocol {}, blake3 {}, {})\n",
        env!("CARGO_PKG_VERSION"),
        PROTOCOL_VERSION,
        agent_hash(),
        std::env::consts::ARCH,
    );
    match util::write_stdout(&line) {
        Ok(()) => 0,
        Err(_) => 1,
    }
}
