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
pub mod compress;
pub mod edit;
pub mod error;
pub mod exec;
pub mod fs;
pub mod hello;
pub mod jobs;
pub mod resources;
pub mod search;
pub mod sync;

use serde::{Deserialize, Serialize};

pub use codec::{CodecError, MAX_CHUNK, MAX_FRAME, decode, encode, frame_codec};
pub use edit::{
    Changed, ContentHash, EditOutcome, EditRequest, LineRange, NearLine, PatchChunk, PatchFile,
    PatchOp, PatchOutcome, PatchRequest, ReadTextRequest, ReadTextResult, Refusal, WriteCondition,
    WriteRequest,
};
pub use error::{AgentError, ErrorCode};
pub use exec::{
    Captured, Confine, ExecInput, ExecRequest, ExecResult, INPUT_WINDOW, SYSTEM_READABLE, TtySize,
};
pub use fs::{
    DirEntry, FileKind, FileStat, ListDirRequest, ListDirResult, ReadFileRequest, ReadFileResult,
    StatRequest,
};
pub use hello::{Capabilities, Hello, MAGIC};
pub use jobs::{
    CONFINED_LOG, GPU_LEASE_DIR, GpuAsk, JOB_EVENTS_RESCAN_MS, JOBS_ROOT, JobEvent, JobEventKind,
    JobEventsRequest, JobInfo, JobKillRequest, JobListRequest, JobStartRequest, JobState,
    JobStatusRequest, JobStatusResult, LOG_EXIT_CODE, LOG_HEADER, OomKill, job_output,
};
pub use resources::{
    CpuInfo, DiskInfo, GpuHolder, GpuInfo, GpuProcess, GpuReport, GpuSource, MemoryInfo,
    ResourceSnapshot, ResourcesRequest,
};
pub use search::{SearchEntry, SearchLine, SearchMode, SearchRequest, SearchResult};
pub use sync::{
    ApplyAbortRequest, ApplyCloseRequest, ApplyOnceRequest, ApplyOp, ApplyOpenRequest, ApplyOpened,
    ApplyRequest, ApplyResult, BlockHashesRequest, BlockHashesResult, ManifestEntry,
    ManifestRequest, ManifestSummary, ReadFileZRequest, ReadFileZResult, StagedWriteRequest,
    SyncRules,
};

/// Bumped whenever a message changes shape; both ends refuse a peer with another value.
/// 7: ReadText/Edit/Write (code tools). 8: zstd frames replace raw deflate in every compressed
/// payload, and `ApplyOp::Packed` (gone in 13) carried a batch of small files as one frame. 9: Search.
/// 10: `ToAgent::Credit`, the per-request window of streamed chunks. 11: launch ids.
/// 12: `ReadFileZRequest::{compress, whole}` and `ReadFileZResult::settled`. 13: one zstd
/// stream per apply session (`ApplyOp::Stream`) replaces `Packed` and `FileDataZ`.
/// 17: `SearchRequest::{stream, ranges}`, `SearchLine::raw`, [`Chunk::Search`]; `JobEvents` and
/// [`Chunk::JobEvent`]. 18: `JobEventsRequest::output_after`, `JobEventKind::Output`.
/// 19: `SearchRequest::{before, after}` replace `context`; `word`, `invert`, `hidden`, `types`,
/// `types_not` (rg's -A/-B, -w, -v, --hidden, -t/-T). 20: `ExecRequest::confine` (Landlock),
/// `ExecResult::unconfined`, `JobStartRequest::confine`, `JobInfo::unconfined`. 21: `Confine::net`.
/// 22: `Capabilities::landlock_abi`. 23: `confine` on `Edit`, `Write`, `Patch`, `ApplyOpen`
/// and `ApplyOnce` (rsb's own writes keep to the write roots). 24: `Confine::read`. 25:
/// `confine` on `Stat`, `ListDir`, `ReadFile`, `ReadFileZ`, `BlockHashes`, `Manifest`,
/// `ReadText` and `Search` (rsb's own reads keep to the read roots). 26:
/// `SearchRequest::multiline` (rg's -U). 27: `SearchLine::offset`, `SearchEntry::file_bytes`
/// (rg's JSON lines). 28: `ApplyOp::FileShare`, `ApplyResult::shared`, `ApplyOpened::staging`
/// and `StagedWrite` (a large upload over several channels).
pub const PROTOCOL_VERSION: u32 = 30;

/// Most bytes of chunk frames one request may have sent and not yet had credited back by
/// [`ToAgent::Credit`]. Each streaming request has its own window, so a caller that stops
/// reading one request's output (`rsb exec … | (sleep 20; cat)`) stops only that request at
/// the agent (its command then blocks on its pipe, as under ssh), while the channel and every
/// other request go on. 4 MiB keeps 200 MB/s flowing at 20 ms RTT.
pub const OUTPUT_WINDOW: u64 = 4 << 20;

/// Hash of this crate's sources at build time: catches an agent and an `rsb` built from
/// different protocol sources even when nobody bumped [`PROTOCOL_VERSION`].
pub const PROTOCOL_FINGERPRINT: &str = env!("RSB_PROTOCOL_FINGERPRINT");

/// Request identifier chosen by the local side; every reply and chunk names it so that
/// many requests can be in flight on one channel and answered out of order.
pub type RequestId = u64;

/// Frames sent by the local side to the agent.
// A frame lives only between its decode and its dispatch, one at a time, so the size of its
// largest variant (a request) costs nothing worth a box on every send.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToAgent {
    /// Start a request. The agent answers with zero or more [`FromAgent::Chunk`] frames and
    /// exactly one [`FromAgent::Reply`].
    Request { id: RequestId, body: Request },
    /// Stop the request with this id as soon as possible. The agent still sends its final
    /// reply (for exec: with `cancelled: true`) so the caller is never left waiting.
    Cancel { id: RequestId },
    /// Input for a running exec that asked for it ([`ExecRequest::stdin`] or a tty); input for
    /// an id that is not (or no longer) running is dropped.
    Input { id: RequestId, input: ExecInput },
    /// The caller's consumer took `bytes` (encoded frame lengths) of this request's chunks:
    /// the agent may send that much more ([`OUTPUT_WINDOW`]). Unknown ids are ignored.
    Credit { id: RequestId, bytes: u64 },
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

/// A request type and the answer it gets, so that neither end matches replies by hand: the
/// local side calls `client.call(req)` and gets `C::Reply`, the agent answers with
/// [`Call::into_reply`], and a reply of another variant is refused in one place.
///
/// The enums [`Request`] and [`Reply`] stay the wire format; this trait only ties their
/// variants together (in the spirit of lsp-types' `Request { Params; Result; METHOD }`).
pub trait Call: Into<Request> + Send + 'static {
    /// What a successful answer carries.
    type Reply: Send + 'static;
    /// Short name for logs and error messages (equal to [`Request::kind`]).
    const NAME: &'static str;
    /// The wire form of a successful answer (agent side).
    fn into_reply(reply: Self::Reply) -> Reply;
    /// The answer, or the reply itself when it is another variant (local side).
    fn from_reply(reply: Reply) -> Result<Self::Reply, Box<Reply>>;
}

/// Ties a request struct to its [`Request`] variant and its [`Reply`] variant.
macro_rules! call {
    ($req:ty, $variant:ident, $name:literal => $reply:ident($out:ty)) => {
        impl From<$req> for Request {
            fn from(r: $req) -> Request {
                Request::$variant(r)
            }
        }
        impl Call for $req {
            type Reply = $out;
            const NAME: &'static str = $name;
            fn into_reply(reply: $out) -> Reply {
                Reply::$reply(reply)
            }
            fn from_reply(reply: Reply) -> Result<$out, Box<Reply>> {
                match reply {
                    Reply::$reply(r) => Ok(r),
                    other => Err(Box::new(other)),
                }
            }
        }
    };
    ($req:ty, $variant:ident, $name:literal => $reply:ident) => {
        impl From<$req> for Request {
            fn from(r: $req) -> Request {
                Request::$variant(r)
            }
        }
        impl Call for $req {
            type Reply = ();
            const NAME: &'static str = $name;
            fn into_reply((): ()) -> Reply {
                Reply::$reply
            }
            fn from_reply(reply: Reply) -> Result<(), Box<Reply>> {
                match reply {
                    Reply::$reply => Ok(()),
                    other => Err(Box::new(other)),
                }
            }
        }
    };
}

call!(PingRequest, Ping, "ping" => Pong(Vec<u8>));
call!(ExecRequest, Exec, "exec" => Exec(ExecResult));
call!(StatRequest, Stat, "stat" => Stat(FileStat));
call!(ListDirRequest, ListDir, "list_dir" => ListDir(ListDirResult));
call!(ReadFileRequest, ReadFile, "read_file" => ReadFile(ReadFileResult));
call!(ResourcesRequest, Resources, "resources" => Resources(ResourceSnapshot));
call!(JobStartRequest, JobStart, "job_start" => Job(JobInfo));
call!(JobStatusRequest, JobStatus, "job_status" => JobStatus(JobStatusResult));
call!(JobKillRequest, JobKill, "job_kill" => Job(JobInfo));
call!(JobListRequest, JobList, "job_list" => JobList(Vec<JobInfo>));
call!(ManifestRequest, Manifest, "manifest" => Manifest(ManifestSummary));
call!(BlockHashesRequest, BlockHashes, "block_hashes" => BlockHashes(BlockHashesResult));
call!(ApplyOpenRequest, ApplyOpen, "apply_open" => ApplyOpened(ApplyOpened));
call!(ApplyRequest, Apply, "apply" => Applied(ApplyResult));
call!(ApplyCloseRequest, ApplyClose, "apply_close" => Applied(ApplyResult));
call!(ApplyAbortRequest, ApplyAbort, "apply_abort" => Done);
call!(ApplyOnceRequest, ApplyOnce, "apply_once" => Applied(ApplyResult));
call!(ReadFileZRequest, ReadFileZ, "read_file_z" => ReadFileZ(ReadFileZResult));
call!(ReadTextRequest, ReadText, "read_text" => ReadText(ReadTextResult));
call!(EditRequest, Edit, "edit" => Edited(EditOutcome));
call!(WriteRequest, Write, "write" => Edited(EditOutcome));
call!(PatchRequest, Patch, "patch" => Patched(PatchOutcome));
call!(SearchRequest, Search, "search" => Searched(SearchResult));
call!(JobEventsRequest, JobEvents, "job_events" => JobList(Vec<JobInfo>));
call!(StagedWriteRequest, StagedWrite, "staged_write" => Done);

/// Echoed back unchanged: a round trip through the agent's loop (liveness, latency).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PingRequest {
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
}

/// Every variant holds a struct implementing [`Call`]; [`Request::kind`] is its `NAME`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    Ping(PingRequest),
    Exec(ExecRequest),
    Stat(StatRequest),
    ListDir(ListDirRequest),
    ReadFile(ReadFileRequest),
    Resources(ResourcesRequest),
    JobStart(JobStartRequest),
    JobStatus(JobStatusRequest),
    JobKill(JobKillRequest),
    JobList(JobListRequest),
    Manifest(ManifestRequest),
    BlockHashes(BlockHashesRequest),
    ApplyOpen(ApplyOpenRequest),
    Apply(ApplyRequest),
    ApplyClose(ApplyCloseRequest),
    ApplyAbort(ApplyAbortRequest),
    ApplyOnce(ApplyOnceRequest),
    ReadFileZ(ReadFileZRequest),
    ReadText(ReadTextRequest),
    Edit(EditRequest),
    Write(WriteRequest),
    Patch(PatchRequest),
    Search(SearchRequest),
    JobEvents(JobEventsRequest),
    StagedWrite(StagedWriteRequest),
}

impl Request {
    /// The `confine` of a request that is one of rsb's own reads (a file, a listing, a sync's
    /// walk or hashes, a search), which keeps to a sandbox's read roots; `None` for others.
    pub fn read_confine(&mut self) -> Option<&mut Option<Confine>> {
        match self {
            Request::Stat(r) => Some(&mut r.confine),
            Request::ListDir(r) => Some(&mut r.confine),
            Request::ReadFile(r) => Some(&mut r.confine),
            Request::Manifest(r) => Some(&mut r.confine),
            Request::BlockHashes(r) => Some(&mut r.confine),
            Request::ReadFileZ(r) => Some(&mut r.confine),
            Request::ReadText(r) => Some(&mut r.confine),
            Request::Search(r) => Some(&mut r.confine),
            _ => None,
        }
    }

    /// Every request name, in wire order (for tests that must cover each kind).
    pub const KINDS: &[&str] = &[
        PingRequest::NAME,
        ExecRequest::NAME,
        StatRequest::NAME,
        ListDirRequest::NAME,
        ReadFileRequest::NAME,
        ResourcesRequest::NAME,
        JobStartRequest::NAME,
        JobStatusRequest::NAME,
        JobKillRequest::NAME,
        JobListRequest::NAME,
        ManifestRequest::NAME,
        BlockHashesRequest::NAME,
        ApplyOpenRequest::NAME,
        ApplyRequest::NAME,
        ApplyCloseRequest::NAME,
        ApplyAbortRequest::NAME,
        ApplyOnceRequest::NAME,
        ReadFileZRequest::NAME,
        ReadTextRequest::NAME,
        EditRequest::NAME,
        WriteRequest::NAME,
        PatchRequest::NAME,
        SearchRequest::NAME,
        JobEventsRequest::NAME,
        StagedWriteRequest::NAME,
    ];

    /// Short name for logs and error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Ping(_) => PingRequest::NAME,
            Request::Exec(_) => ExecRequest::NAME,
            Request::Stat(_) => StatRequest::NAME,
            Request::ListDir(_) => ListDirRequest::NAME,
            Request::ReadFile(_) => ReadFileRequest::NAME,
            Request::Resources(_) => ResourcesRequest::NAME,
            Request::JobStart(_) => JobStartRequest::NAME,
            Request::JobStatus(_) => JobStatusRequest::NAME,
            Request::JobKill(_) => JobKillRequest::NAME,
            Request::JobList(_) => JobListRequest::NAME,
            Request::Manifest(_) => ManifestRequest::NAME,
            Request::BlockHashes(_) => BlockHashesRequest::NAME,
            Request::ApplyOpen(_) => ApplyOpenRequest::NAME,
            Request::Apply(_) => ApplyRequest::NAME,
            Request::ApplyClose(_) => ApplyCloseRequest::NAME,
            Request::ApplyAbort(_) => ApplyAbortRequest::NAME,
            Request::ApplyOnce(_) => ApplyOnceRequest::NAME,
            Request::ReadFileZ(_) => ReadFileZRequest::NAME,
            Request::ReadText(_) => ReadTextRequest::NAME,
            Request::Edit(_) => EditRequest::NAME,
            Request::Write(_) => WriteRequest::NAME,
            Request::Patch(_) => PatchRequest::NAME,
            Request::Search(_) => SearchRequest::NAME,
            Request::JobEvents(_) => JobEventsRequest::NAME,
            Request::StagedWrite(_) => StagedWriteRequest::NAME,
        }
    }
}

/// The final answer to a request; which variant answers which request is fixed by [`Call`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Pong(#[serde(with = "serde_bytes")] Vec<u8>),
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
    /// Any request can fail with this instead of its own reply.
    Error(AgentError),
    ReadFileZ(ReadFileZResult),
    ReadText(ReadTextResult),
    /// Answers both `Edit` and `Write`.
    Edited(EditOutcome),
    Patched(PatchOutcome),
    Searched(SearchResult),
}

impl Reply {
    /// Short name for error messages (a reply's contents can be large; its name is enough).
    pub fn kind(&self) -> &'static str {
        match self {
            Reply::Pong(_) => "pong",
            Reply::Exec(_) => "exec",
            Reply::Stat(_) => "stat",
            Reply::ListDir(_) => "list_dir",
            Reply::ReadFile(_) => "read_file",
            Reply::Resources(_) => "resources",
            Reply::Job(_) => "job",
            Reply::JobStatus(_) => "job_status",
            Reply::JobList(_) => "job_list",
            Reply::Manifest(_) => "manifest",
            Reply::BlockHashes(_) => "block_hashes",
            Reply::ApplyOpened(_) => "apply_opened",
            Reply::Applied(_) => "applied",
            Reply::Done => "done",
            Reply::Error(_) => "error",
            Reply::ReadFileZ(_) => "read_file_z",
            Reply::ReadText(_) => "read_text",
            Reply::Edited(_) => "edited",
            Reply::Patched(_) => "patched",
            Reply::Searched(_) => "searched",
        }
    }
}

/// Streamed output of a running request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Chunk {
    Stdout(#[serde(with = "serde_bytes")] Vec<u8>),
    Stderr(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A batch of manifest entries (a manifest can exceed one frame).
    Manifest(Vec<ManifestEntry>),
    /// This many more bytes of [`ExecInput::Data`] were written to the command (or discarded
    /// because it closed its stdin): the sender's window reopens by as much.
    InputConsumed(u64),
    /// [`Chunk::Manifest`] compressed ([`compress`]): `data` decompresses to `raw_len` bytes, the
    /// [`codec::encode`] of the batch's `Vec<ManifestEntry>`. Sent instead of it when the
    /// request asked ([`ManifestRequest::compress`]) and the batch shrinks by a tenth.
    ManifestZ {
        raw_len: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// A batch of a streamed search's entries ([`SearchRequest::stream`]), in result order.
    Search(Vec<SearchEntry>),
    /// A job started, ended or was lost ([`JobEventsRequest`]).
    JobEvent(Box<JobEvent>),
}
