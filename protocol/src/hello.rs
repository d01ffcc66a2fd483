//! The handshake: the agent's first frame. It tells the local side whether this is the agent
//! it deployed (version + hash of the running binary) and what the host can do.

use serde::{Deserialize, Serialize};

/// Guards against a login shell that prints a banner onto the channel before the agent starts:
/// such bytes would otherwise be misread as a frame length.
pub const MAGIC: [u8; 4] = *b"RSB\x01";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub magic: [u8; 4],
    pub protocol_version: u32,
    /// [`crate::PROTOCOL_FINGERPRINT`] of the agent's build.
    pub protocol_fingerprint: String,
    pub agent_version: String,
    /// blake3 (hex) of the agent's own executable, read from `/proc/self/exe`.
    pub agent_hash: String,
    pub os: String,
    pub arch: String,
    pub kernel: String,
    pub hostname: String,
    pub user: String,
    pub uid: u32,
    pub home: String,
    pub pid: u32,
    pub capabilities: Capabilities,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    pub bash: bool,
    pub tmux: bool,
    pub nvidia_smi: bool,
    pub nvml: bool,
    /// The Landlock ABI the host's kernel serves (0: none): what `confine` can enforce
    /// (1: files, 2: renames across directories, 3: truncation, 4: TCP ports, 6: scoping).
    pub landlock_abi: u32,
}
