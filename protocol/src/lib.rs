//! The one vocabulary that `rsb` (local) and `rsb-agent` (remote) share.
//!
//! Both ends are built from this workspace, so the wire format only has to agree with itself;
//! a version bump in [`PROTOCOL_VERSION`] plus the agent's binary hash in [`Hello`] make a
//! mismatched pair visible at the handshake instead of as garbled frames later.
//!
//! Framing and encoding live in [`codec`] alone, so swapping bincode for postcard is one file.
//! bincode is not self-describing: no untagged enums, no `skip_serializing_if`, no
//! `serde_json::Value` anywhere in these types (JSON travels as `String`).

pub mod codec;
pub mod error;
pub mod exec;
pub mod fs;
pub mod hello;
pub mod jobs;
pub mod resources;
pub mod sync;

use serde::{Deserialize, Serialize};

pub use codec::{CodecError, MAX_CHUNK, MAX_FRAME, decode, encode, frame_codec};
pub use error::{AgentError, ErrorCode};
pub use exec::{Captured, ExecRequest, ExecResult};
pub use fs::{
    DirEntry, FileKind, FileStat, ListDirRequest, ListDirResult, ReadFileRequest, ReadFileResult,
    StatRequest,
};
pub use hello::{Capabilities, Hello, MAGIC};
pub use jobs::{
    JobInfo, JobKillRequest, JobStartRequest, JobState, JobStatusRequest, JobStatusResult,
};
pub use resources::{
    CpuInfo, DiskInfo, GpuInfo, GpuProcess, GpuReport, GpuSource, MemoryInfo, ResourceSnapshot,
    ResourcesRequest,
};
pub use sync::{
    ApplyCloseRequest, ApplyOp, ApplyOpenRequest, ApplyOpened, ApplyRequest, ApplyResult,
    BlockHashesRequest, BlockHashesResult, ManifestEntry, ManifestRequest, ManifestSummary,
    SyncRules,
};

/// Bumped whenever a message changes shape; both ends refuse a peer with another value.
pub const PROTOCOL_VERSION: u32 = 1;

/// Hash of this crate's sources at build time: catches an agent and an `rsb` built from
/// different protocol sources even when nobody bumped [`PROTOCOL_VERSION`].
pub const PROTOCOL_FINGERPRINT: &str = env!("RSB_PROTOCOL_FINGERPRINT");

/// Request identifier chosen by the local side; every reply and chunk names it so that
/// many requests can be in flight on one channel and answered out of order.
pub type RequestId = u64;

/// Frames sent by the local side to the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToAgent {
    /// Start a request. The agent answers with zero or more [`FromAgent::Chunk`] frames and
    /// exactly one [`FromAgent::Reply`].
    Request { id: RequestId, body: Request },
    /// Stop the request with this id as soon as possible. The agent still sends its final
    /// reply (for exec: with `cancelled: true`) so the caller is never left waiting.
    Cancel { id: RequestId },
}

/// Frames sent by the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FromAgent {
    /// The first frame on every channel, before any request is read.
    Hello(Hello),
    /// The final answer to a request.
    Reply { id: RequestId, body: Reply },
    /// Streamed data belonging to an unfinished request.
    Chunk { id: RequestId, chunk: Chunk },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    Ping {
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    Exec(ExecRequest),
    Stat(StatRequest),
    ListDir(ListDirRequest),
    ReadFile(ReadFileRequest),
    Resources(ResourcesRequest),
    JobStart(JobStartRequest),
    JobStatus(JobStatusRequest),
    JobKill(JobKillRequest),
    JobList,
    Manifest(ManifestRequest),
    BlockHashes(BlockHashesRequest),
    ApplyOpen(ApplyOpenRequest),
    Apply(ApplyRequest),
    ApplyClose(ApplyCloseRequest),
}

impl Request {
    /// Short name for logs and error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Ping { .. } => "ping",
            Request::Exec(_) => "exec",
            Request::Stat(_) => "stat",
            Request::ListDir(_) => "list_dir",
            Request::ReadFile(_) => "read_file",
            Request::Resources(_) => "resources",
            Request::JobStart(_) => "job_start",
            Request::JobStatus(_) => "job_status",
            Request::JobKill(_) => "job_kill",
            Request::JobList => "job_list",
            Request::Manifest(_) => "manifest",
            Request::BlockHashes(_) => "block_hashes",
            Request::ApplyOpen(_) => "apply_open",
            Request::Apply(_) => "apply",
            Request::ApplyClose(_) => "apply_close",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Pong {
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    Exec(ExecResult),
    Stat(FileStat),
    ListDir(ListDirResult),
    ReadFile(ReadFileResult),
    Resources(ResourceSnapshot),
    Job(JobInfo),
    JobStatus(JobStatusResult),
    JobList(Vec<JobInfo>),
    /// Final reply to `Manifest`; the entries arrive before it as [`Chunk::Manifest`].
    Manifest(ManifestSummary),
    BlockHashes(BlockHashesResult),
    ApplyOpened(ApplyOpened),
    Applied(ApplyResult),
    Done,
    Error(AgentError),
}

/// Streamed output of a running request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Chunk {
    Stdout(#[serde(with = "serde_bytes")] Vec<u8>),
    Stderr(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A batch of manifest entries (a manifest can exceed one frame).
    Manifest(Vec<ManifestEntry>),
}
