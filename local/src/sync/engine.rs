//! Runs a sync between a source and a destination agent: scan both concurrently, plan, then
//! stream the changes into a staging session on the destination.
//!
//! Ordering: every request of an apply session carries a sequence number, taken when the request
//! is sent, and the agent runs them in that order; still, this engine does not lean on that more
//! than it must. Directories are created first (awaited), then small
//! files (whole, data and commit in one request, many files per request), symlinks and
//! attribute fixes stream through a window of requests while large files go one at a time,
//! each with its own window of `FileData` requests; a large file's first request is awaited
//! before the rest (it creates the staged file) and its `FileCommit` is sent only once every
//! data request has been acknowledged. Deletes come last, deepest first, then `ApplyClose`
//! restores directory mtimes. Source bytes are read with pipelined `ReadFile` requests (small
//! files by a reader task that starts before the directories are created).
//!
//! A sync that fails, is cancelled or is dropped aborts its session (the staging dir goes);
//! files already committed stay, and nothing partial is ever visible. The destination keeps the
//! staged bytes of a large file it was receiving; the next sync of that file resumes from them.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{StreamExt, stream::FuturesUnordered};
use parking_lot::Mutex;
use rsb_protocol::{
    ApplyAbortRequest, ApplyCloseRequest, ApplyOp, ApplyOpenRequest, ApplyRequest,
    BlockHashesRequest, Chunk, ErrorCode, FileKind, ManifestEntry, ManifestRequest,
    ManifestSummary, PingRequest, ReadFileRequest, ReadFileZRequest, StatRequest, SyncRules,
    compress::MAX_RAW, sync::PARTIAL_MIN,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    Direction, Phase, Progress, ProgressFn, SyncReport, SyncSpec,
    compress::{Compress, Mode},
    join_rel,
    plan::{self, BLOCK_SIZE, FileXfer, Plan, PlanOptions},
};
use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
};

/// Files up to this size travel whole inside a batch (data and commit in one request).
const SMALL_MAX: u64 = 1024 * 1024;
/// A batch is sent once it holds this much file data…
const BATCH_BYTES: usize = 1024 * 1024;
/// …or this much when it travels packed ([`Compress::pack`]): a larger frame gives each file
/// more neighbours as context (source text: 9.3 MB on the wire per 42.7 MB in 1 MiB batches,
/// 8.9 MB in 2 MiB ones, at zstd level 3), and the batch plus one more small file stays within
/// [`MAX_RAW`].
const BATCH_BYTES_PACKED: usize = MAX_RAW / 2;
/// …or this many ops.
const BATCH_OPS: usize = 512;
/// Apply requests in flight for small batches, and for one large file.
const SMALL_WINDOW: usize = 8;
const LARGE_WINDOW: usize = 8;
/// Concurrent `ReadFile` requests for small files.
const SMALL_READS: usize = 32;
/// Concurrent `ReadFile` requests for one large file.
const LARGE_READS: usize = 8;
/// `FileData` chunks per request for large files (4 × 256 KiB = 1 MiB), at most.
const CHUNKS_PER_REQUEST: usize = 4;
/// Unacknowledged bytes of one large file are kept to about this much sending time at the
/// rate acknowledgements arrive, so an exec or a ping queued behind them (in the SSH window and
/// the socket buffers, where the control lane cannot reorder) waits about this long, not
/// seconds on a slow link. Bounded below by [`LARGE_MIN_BYTES`] and above by
/// [`LARGE_WINDOW`] requests.
const LARGE_QUEUE_TIME: Duration = Duration::from_millis(10);
const LARGE_MIN_BYTES: u64 = 512 * 1024;
/// The window before a rate is known. Each large file starts with this much sent at once, so
/// it is what an exec meets in the link at a file's start: traced, the slowest exec round trips
/// during an upload were those that met this first burst (2 MiB ahead, 80–120 ms on a busy
/// loopback).
const LARGE_START_BYTES: u64 = 1024 * 1024;
/// Ops per request for metadata-only batches (mkdir, delete).
const META_OPS: usize = 2000;
/// More ping pairs (sequential) before a slow-looking round trip turns compression on: the
/// link's delay is a floor that every sample shows, a loaded host's stall is not. Each costs a
/// round trip of a far link before its transfer starts, so one, and none when the sandbox's
/// last transfer already found the link far.
const RTT_CONFIRM: usize = 1;
/// How long a failed or cancelled sync waits for `ApplyAbort` (removes its staging dir).
const CLEANUP_TIMEOUT: Duration = Duration::from_millis(500);
/// Progress callbacks at most this often (plus every phase change and the end).
const PROGRESS_EVERY: Duration = Duration::from_millis(50);

pub fn cancelled_error() -> RsbError {
    RsbError::new(
        Kind::Agent(ErrorCode::Cancelled),
        "sync cancelled",
        "files already committed stay; nothing partial was left; run the sync again to finish",
    )
}

/// The cancel error, saying what of an interrupted large file the destination kept.
fn cancelled_keeping(kept: Option<(String, u64)>) -> RsbError {
    let mut e = cancelled_error();
    if let Some((rel, bytes)) = kept.filter(|k| k.1 >= PARTIAL_MIN) {
        e.message = format!(
            "sync cancelled; kept {} MiB of {} staged; the next sync resumes it",
            bytes / (1024 * 1024),
            basename(&rel)
        );
    }
    e
}

// ---------------------------------------------------------------------------------------------
// Progress
// ---------------------------------------------------------------------------------------------

fn tmark(t: &Tracker, what: &str) {
    if std::env::var_os("RSB_SYNC_TIMING").is_some() {
        eprintln!(
            "[sync timing] {what}: {:.1} ms",
            t.start.elapsed().as_secs_f64() * 1000.0
        );
    }
}

struct Tracker {
    cb: Option<ProgressFn>,
    start: Instant,
    /// The large file being sent and how many of its bytes the destination holds staged
    /// (acknowledged, or kept from an interrupted sync), for the cancel message.
    large: Mutex<Option<(String, u64)>>,
    state: Mutex<TrackState>,
    /// The baseline this run leaves before any commit: what both sides held when it planned
    /// (unchanged files, conflicts' old entries, the old entries of files about to be sent).
    /// Set once the plan is made.
    base: Mutex<Option<std::collections::HashMap<String, [u8; 32]>>>,
    /// `rel` → the hash each acknowledged `FileCommit` carried: exactly what the destination
    /// now holds, whatever the manifest said when the run scanned.
    committed: Mutex<std::collections::HashMap<String, [u8; 32]>>,
}

struct TrackState {
    p: Progress,
    last_emit: Option<Instant>,
    xfer_start: Option<Instant>,
}

impl Tracker {
    fn new(cb: Option<ProgressFn>) -> Tracker {
        Tracker {
            cb,
            start: Instant::now(),
            large: Mutex::new(None),
            base: Mutex::new(None),
            committed: Mutex::new(Default::default()),
            state: Mutex::new(TrackState {
                p: Progress::default(),
                last_emit: None,
                xfer_start: None,
            }),
        }
    }

    fn update(&self, force: bool, f: impl FnOnce(&mut Progress)) {
        let snapshot = {
            let mut st = self.state.lock();
            let before = st.p.phase;
            f(&mut st.p);
            let now = Instant::now();
            if st.p.phase == Phase::Transferring && st.xfer_start.is_none() {
                st.xfer_start = Some(now);
            }
            st.p.elapsed_s = self.start.elapsed().as_secs_f64();
            if let Some(t) = st.xfer_start {
                let secs = now.duration_since(t).as_secs_f64();
                if secs > 0.0 {
                    st.p.rate_bps = st.p.bytes_done as f64 / secs;
                }
            }
            let due = force
                || before != st.p.phase
                || st
                    .last_emit
                    .is_none_or(|t| now.duration_since(t) >= PROGRESS_EVERY);
            if !due || self.cb.is_none() {
                return;
            }
            st.last_emit = Some(now);
            st.p.clone()
        };
        if let Some(cb) = &self.cb {
            cb(&snapshot);
        }
    }

    fn phase(&self, ph: Phase) {
        self.update(true, |p| p.phase = ph);
    }

    /// A batch acknowledged: its progress, and the hashes its commits carried.
    fn batch_acked(&self, b: BatchInfo) {
        self.acked(b.files, b.bytes, b.last.as_deref());
        self.committed.lock().extend(b.commits);
    }

    /// The baseline after what this run did so far: the planned one with every acknowledged
    /// commit's hash over it. `None` before a plan was made (nothing to save).
    fn baseline(&self) -> Option<std::collections::HashMap<String, [u8; 32]>> {
        let mut b = self.base.lock().clone()?;
        b.extend(self.committed.lock().iter().map(|(k, v)| (k.clone(), *v)));
        Some(b)
    }

    fn acked(&self, files: u64, bytes: u64, path: Option<&str>) {
        self.update(false, |p| {
            p.files_done += files;
            p.bytes_done += bytes;
            if let Some(path) = path {
                p.current_path = path.to_string();
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Agent calls
// ---------------------------------------------------------------------------------------------

/// A directory or file manifest: the summary plus every entry (streamed as chunks).
/// `compress`: ask for [`Chunk::ManifestZ`] (a remote agent across a slow link).
async fn manifest(
    c: &AgentClient,
    root: &str,
    rules: &SyncRules,
    compress: bool,
) -> Result<(ManifestSummary, Vec<ManifestEntry>)> {
    let (tx, mut rx) = mpsc::channel::<Chunk>(64);
    let key = rsb_protocol::encode(rules)
        .ok()
        .map(|r| (c.sandbox().to_string(), root.to_string(), r));
    let held = key.as_ref().and_then(super::held::get);
    let call = c.call_streaming(
        ManifestRequest {
            root: root.to_string(),
            rules: rules.clone(),
            hash: true,
            compress,
            expect: held.as_ref().map(|h| h.0),
        },
        tx,
    );
    let collect = async {
        let mut v = Vec::new();
        let mut bad = None;
        while let Some(ch) = rx.recv().await {
            match ch {
                Chunk::Manifest(es) => v.extend(es),
                Chunk::ManifestZ { raw_len, data } => {
                    let es = rsb_protocol::compress::decompress(&data, raw_len).and_then(|raw| {
                        rsb_protocol::decode::<Vec<ManifestEntry>>(&raw).map_err(|e| e.to_string())
                    });
                    match es {
                        Ok(es) => v.extend(es),
                        Err(e) => bad = bad.or(Some(e)),
                    }
                }
                _ => {}
            }
        }
        (v, bad)
    };
    let (r, (entries, bad)) = tokio::join!(call, collect);
    let r = r?;
    if let Some(e) = bad {
        return Err(RsbError::new(
            Kind::Internal,
            format!("the agent sent a manifest batch that does not decode: {e}"),
            "this is a bug in rsb; retry with RSB_SYNC_COMPRESS=off and report it",
        ));
    }
    if r.unchanged {
        return match held {
            Some((_, e)) if entries.is_empty() => Ok((r, e.as_ref().clone())),
            _ => Err(RsbError::internal(
                "the agent answered a manifest request with `unchanged` that had nothing to match",
            )),
        };
    }
    if let Some(key) = key {
        super::held::put(key, entries.clone());
    }
    Ok((r, entries))
}

/// `stat` that maps "not found" to `None`.
async fn stat_opt(c: &AgentClient, path: &str) -> Result<Option<rsb_protocol::FileStat>> {
    let req = StatRequest {
        path: path.into(),
        follow: true,
    };
    match c.call(req).await {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind == Kind::Agent(ErrorCode::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

/// One round trip to `c`; a failed ping reads as a slow link (the transfer that follows then
/// reports the broken link itself).
async fn ping(c: &AgentClient) -> Duration {
    let t = Instant::now();
    match c
        .call(PingRequest {
            payload: Vec::new(),
        })
        .await
    {
        Ok(_) => t.elapsed(),
        Err(_) => Duration::MAX,
    }
}

/// An open apply session on the destination.
///
/// Its requests are numbered at the moment the client queues their frames, so they reach the
/// agent in number order, and the agent runs them in that order: pipelined batches cannot
/// overtake each other, however their futures or the agent's tasks are scheduled.
struct Session {
    dst: AgentClient,
    id: u64,
    next_seq: AtomicU64,
}

impl Session {
    fn new(dst: &AgentClient, id: u64) -> Session {
        Session {
            dst: dst.clone(),
            id,
            next_seq: AtomicU64::new(0),
        }
    }

    fn seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    async fn apply(&self, ops: Vec<ApplyOp>) -> Result<u32> {
        let req = || ApplyRequest {
            session: self.id,
            seq: self.seq(),
            ops,
        };
        Ok(self.dst.call_with(req).await?.applied)
    }

    /// Take over what an interrupted sync of `rel` left staged: the hashes of its blocks.
    async fn resume(&self, rel: &str) -> Result<Vec<[u8; 32]>> {
        let req = || ApplyRequest {
            session: self.id,
            seq: self.seq(),
            ops: vec![ApplyOp::FileResume {
                rel: rel.to_string(),
                block_size: BLOCK_SIZE,
            }],
        };
        Ok(self.dst.call_with(req).await?.resumed)
    }

    /// Apply one batch of small files, packed into one compressed op when `comp` compresses
    /// here (on a blocking thread, so batches compress in parallel). Batches of small files
    /// are independent of each other, so the order they reach the agent in, which packing
    /// may change, does not matter.
    async fn apply_batch(
        &self,
        ops: Vec<ApplyOp>,
        info: BatchInfo,
        comp: Arc<Compress>,
    ) -> Result<BatchInfo> {
        let ops = if comp.here() {
            tokio::task::spawn_blocking(move || comp.pack(ops))
                .await
                .map_err(|e| RsbError::internal(format!("compressing a batch: {e}")))?
        } else {
            ops
        };
        self.apply(ops).await?;
        Ok(info)
    }

    /// Apply, answering with `(raw, wire)` bytes and when the request was handed to the
    /// channel.
    async fn apply_timed(
        &self,
        ops: Vec<ApplyOp>,
        bytes: (u64, u64),
    ) -> Result<((u64, u64), Instant)> {
        let at = Instant::now();
        self.apply(ops).await?;
        Ok((bytes, at))
    }

    /// Finish the session after every batch (directory mtimes last).
    async fn close(&self, dir_mtimes: Vec<(String, i64)>) -> Result<rsb_protocol::ApplyResult> {
        let req = || ApplyCloseRequest {
            session: self.id,
            seq: self.seq(),
            dir_mtimes,
        };
        self.dst.call_with(req).await
    }
}

/// Give up a session out of order: batches not yet run fail, the staging dir goes.
async fn abort(dst: AgentClient, session: u64) -> Result<()> {
    dst.call(ApplyAbortRequest { session }).await
}

/// How often a large file that changed since its scan is sent again before it is reported
/// as changing and left uncommitted.
const RESEND_TRIES: usize = 3;

/// One pass over a large file's blocks.
struct Pass {
    /// `(size, blake3)` of the bytes read, when the pass read the whole file in order.
    whole: Option<(u64, [u8; 32])>,
    /// Every block hashed as the pass was told to expect (true when nothing was expected).
    matched: bool,
}

/// A small file as read, ready for its batch.
struct SmallFile {
    f: FileXfer,
    data: Vec<u8>,
    /// blake3 of `data`, when taken off the runtime (compression on: the runtime then has the
    /// batches to compress).
    hash: Option<[u8; 32]>,
}

/// Read a whole small file (owned arguments: the future is `'static`); with compression on,
/// hash it on a blocking thread, so files hash in parallel with each other and with the
/// reads. Small files compress by batch ([`Compress::pack`]), not one by one.
async fn read_small(
    src: AgentClient,
    path: String,
    f: FileXfer,
    comp: Arc<Compress>,
) -> Result<SmallFile> {
    let data = read_range(&src, &path, 0, f.size, true, Some((&comp, None))).await?;
    if !comp.here() {
        return Ok(SmallFile {
            f,
            data,
            hash: None,
        });
    }
    let work = move || {
        let hash = *blake3::hash(&data).as_bytes();
        SmallFile {
            f,
            data,
            hash: Some(hash),
        }
    };
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| RsbError::internal(format!("hashing a file: {e}")))
}

/// One block of a large file: `(offset, raw bytes, deflated bytes when on and they shrank)`.
type Block = (u64, Vec<u8>, Option<Vec<u8>>);

async fn read_block(
    src: AgentClient,
    path: String,
    off: u64,
    len: u64,
    comp: Arc<Compress>,
    skip: Arc<std::sync::atomic::AtomicBool>,
) -> Result<Block> {
    let z = (!skip.load(Ordering::Relaxed)).then_some((&*comp, Some(&*skip)));
    let d = read_range(&src, &path, off, len, false, z).await?;
    if !comp.here() || skip.load(Ordering::Relaxed) {
        return Ok((off, d, None));
    }
    tokio::task::spawn_blocking(move || {
        let z = comp.compress(&d, Some(&skip));
        (off, d, z)
    })
    .await
    .map_err(|e| RsbError::internal(format!("compressing a block: {e}")))
}

/// The op that writes `data` at `offset`: deflated when `z` holds it.
fn data_op(rel: &str, offset: u64, data: Vec<u8>, z: Option<Vec<u8>>) -> ApplyOp {
    match z {
        Some(z) => ApplyOp::FileDataZ {
            rel: rel.to_string(),
            offset,
            raw_len: data.len() as u64,
            data: z,
        },
        None => ApplyOp::FileData {
            rel: rel.to_string(),
            offset,
            data,
        },
    }
}

async fn block_hashes(c: &AgentClient, path: &str) -> Result<Vec<[u8; 32]>> {
    let req = BlockHashesRequest {
        path: path.to_string(),
        block_size: BLOCK_SIZE,
    };
    Ok(c.call(req).await?.hashes)
}

/// `ReadFile` through the source agent's compression: `(data, truncated)`. A block that
/// did not shrink sets `skip`, so the rest of its file is read plain.
async fn read_z(
    src: &AgentClient,
    path: &str,
    offset: u64,
    max_bytes: u64,
    (comp, skip): (&Compress, Option<&std::sync::atomic::AtomicBool>),
) -> Result<(Vec<u8>, bool)> {
    let r = src
        .call(ReadFileZRequest {
            path: path.to_string(),
            offset,
            max_bytes,
        })
        .await?;
    if r.raw_len > max_bytes {
        return Err(RsbError::internal(format!(
            "read of {path}: {} bytes answered for {max_bytes} asked",
            r.raw_len
        )));
    }
    if !r.compressed {
        if let Some(s) = skip.filter(|_| r.raw_len > 0) {
            s.store(true, Ordering::Relaxed);
        }
        return Ok((r.data, r.truncated));
    }
    let raw = rsb_protocol::compress::decompress(&r.data, r.raw_len)
        .map_err(|m| RsbError::internal(format!("read of {path}: {m}")))?;
    comp.record(r.raw_len, r.data.len() as u64);
    Ok((raw, r.truncated))
}

/// Read `[offset, offset + len)`; with `to_eof`, keep reading while the file has more. With
/// `comp` compressing at the source, through [`read_z`].
async fn read_range(
    src: &AgentClient,
    path: &str,
    offset: u64,
    len: u64,
    to_eof: bool,
    comp: Option<(&Compress, Option<&std::sync::atomic::AtomicBool>)>,
) -> Result<Vec<u8>> {
    let comp = comp.filter(|c| c.0.at_source());
    let mut data = Vec::new();
    let mut off = offset;
    loop {
        let want = if to_eof {
            (len.saturating_sub(data.len() as u64)).max(64 * 1024)
        } else {
            len - data.len() as u64
        };
        let (chunk, truncated) = match comp {
            Some(c) => read_z(src, path, off, want.min(MAX_RAW as u64), c).await?,
            None => {
                let r = src
                    .call(ReadFileRequest {
                        path: path.to_string(),
                        offset: off,
                        max_bytes: want,
                    })
                    .await?;
                (r.data, r.truncated)
            }
        };
        let n = chunk.len() as u64;
        if data.is_empty() {
            data = chunk;
        } else {
            data.extend_from_slice(&chunk);
        }
        off += n;
        let done = if to_eof {
            !truncated || n == 0
        } else {
            data.len() as u64 >= len || n == 0
        };
        if done {
            return Ok(data);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry point
// ---------------------------------------------------------------------------------------------

/// Where things are on each side once resolved.
struct Roots {
    /// Source root (a directory), or the source file itself.
    src: String,
    /// The destination root the staging session opens (for a single file: its parent dir).
    dst: String,
    /// Single-file mode: every read goes to `src` itself.
    single: bool,
}

impl Roots {
    fn src_path(&self, rel: &str) -> String {
        if self.single {
            self.src.clone()
        } else {
            join_rel(&self.src, rel)
        }
    }
    fn dst_path(&self, rel: &str) -> String {
        join_rel(&self.dst, rel)
    }
}

fn basename(p: &str) -> &str {
    let t = p.trim_end_matches('/');
    t.rsplit_once('/').map(|(_, b)| b).unwrap_or(t)
}

/// Parent directory and name of a file path (`x` → `.`, `/x` → `/`).
fn split_parent(p: &str) -> (String, String) {
    match p.rsplit_once('/') {
        Some(("", name)) => ("/".into(), name.into()),
        Some((dir, name)) => (dir.into(), name.into()),
        None => (".".into(), p.into()),
    }
}

/// `rules` in the engine the agents use for directories. A line it refuses is the same one-line
/// error here as from an agent.
pub fn compile_rules(rules: &SyncRules) -> Result<rsb_rules::Rules> {
    rsb_rules::Rules::for_sync(rules.default_excludes, &rules.lines).map_err(|e| {
        RsbError::invalid(
            e.to_string(),
            "patterns use gitignore syntax; write \\[ for a literal [ and \\\\ for a literal \\",
        )
    })
}

/// Is a single file excluded by `rules`? Candidates as in the seed: the path as given (when
/// relative, each parent as the directory walk would meet it), and its basename.
pub fn single_file_excluded(rules: &SyncRules, given: &str) -> Result<bool> {
    let rules = compile_rules(rules)?;
    let mut rel = given.trim();
    while let Some(r) = rel.strip_prefix("./") {
        rel = r;
    }
    let name = basename(rel);
    if !name.is_empty() && rules.excluded(name, false) {
        return Ok(true);
    }
    let relative =
        !rel.starts_with('/') && !rel.starts_with('~') && !rel.split('/').any(|c| c == "..");
    Ok(relative && rules.excluded_path(rel, false))
}

/// With `rules.gitignore`: is a single file left out by the `.gitignore` beside it (read
/// through the source's agent), as the directory walk would decide for it?
async fn single_file_gitignored(src: &AgentClient, rules: &SyncRules, given: &str) -> Result<bool> {
    if !rules.gitignore {
        return Ok(false);
    }
    let (dir, name) = split_parent(given.trim_end_matches('/'));
    let req = ReadFileRequest {
        path: join_rel(&dir, ".gitignore"),
        offset: 0,
        max_bytes: 1 << 20,
    };
    let text = match src.call(req).await {
        Ok(r) => String::from_utf8_lossy(&r.data).into_owned(),
        // None there (or unreadable): nothing to apply.
        Err(_) => return Ok(false),
    };
    let (layer, _) = rsb_rules::Layer::parse("", text.lines());
    Ok(compile_rules(rules)?.excluded_in(&[layer], &name, false))
}

/// Remote paths are relative to the remote `$HOME` (as the seed resolved them), not to
/// wherever the agent process happens to run.
pub use rsb_rules::path::anchor_home;

/// What a planned sync would send, for [`RunOptions::gate`].
#[derive(Debug, Clone, Copy, Default)]
pub struct PlanSize {
    /// Files and symlinks to write.
    pub files: u64,
    /// Bytes of the files to write (whole files; deltas send less).
    pub bytes: u64,
    /// Files and directories to delete.
    pub deletions: u64,
}

/// Decides after the plan whether this call runs it (`true`) or hands it off (`false`: the
/// report comes back with `handed_off` and nothing changed).
pub type PlanGate = Arc<dyn Fn(&PlanSize) -> bool + Send + Sync>;

/// Options beyond the [`SyncSpec`] (all off by default).
#[derive(Clone, Default)]
pub struct RunOptions {
    pub gate: Option<PlanGate>,
    /// Confirms a `delete_extras` the guards refuse: into `$HOME` or `/`, or deleting more
    /// than half of the destination's files.
    pub confirm_delete: bool,
    /// The last-synced content of this pair of roots (`rel` → blake3), for conflicts.
    pub baseline: Option<Arc<std::collections::HashMap<String, [u8; 32]>>>,
    /// Take the source's side of conflicts.
    pub overwrite: bool,
    /// Without a baseline, treat differing destination files as conflicts.
    pub safe: bool,
    /// Fill [`SyncReport::actions`] for a real run too (`rsb sync -v`), not only a dry run.
    pub list_actions: bool,
    /// Where a run that fails or is cancelled after planning leaves its baseline (what it
    /// did commit), for the caller to store as a completed run's
    /// [`SyncReport::baseline_out`] is.
    pub baseline_sink: Option<BaselineSink>,
}

/// Where a failed run leaves the baseline of what it committed ([`RunOptions::baseline_sink`]).
pub type BaselineSink = Arc<Mutex<Option<std::collections::HashMap<String, [u8; 32]>>>>;

/// Run one sync. `local` is the local agent, `remote` the sandbox's; `spec.direction` decides
/// which is the source.
pub async fn run(
    local: &AgentClient,
    remote: &AgentClient,
    spec: &SyncSpec,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
) -> Result<SyncReport> {
    run_with(
        local,
        remote,
        spec,
        progress,
        cancel,
        &RunOptions::default(),
    )
    .await
}

/// [`run`] with [`RunOptions`].
pub async fn run_with(
    local: &AgentClient,
    remote: &AgentClient,
    spec: &SyncSpec,
    progress: Option<ProgressFn>,
    cancel: &CancellationToken,
    opts: &RunOptions,
) -> Result<SyncReport> {
    let compress_mode = Mode::from_env()?;
    let tracker = Arc::new(Tracker::new(progress));
    let local_str = spec.local_path.to_string_lossy().into_owned();
    let remote_str = anchor_home(&spec.remote_path);
    let (src, dst, src_given, dst_given) = match spec.direction {
        Direction::Upload => (local, remote, local_str.clone(), remote_str),
        Direction::Download => (remote, local, remote_str, local_str.clone()),
    };
    // As the user wrote them, for messages.
    let (src_shown, dst_shown) = match spec.direction {
        Direction::Upload => (local_str.clone(), spec.remote_path.clone()),
        Direction::Download => (spec.remote_path.clone(), local_str.clone()),
    };
    let mut report = SyncReport {
        direction: Some(spec.direction),
        local_path: local_str.clone(),
        remote_path: spec.remote_path.clone(),
        delete_extras: spec.delete_extras,
        dry_run: spec.dry_run,
        ..Default::default()
    };
    tracker.phase(Phase::Scanning);

    let work = async {
        let src_root_given = if src_given.len() > 1 {
            src_given.trim_end_matches('/').to_string()
        } else {
            src_given.clone()
        };
        // Round trips are the cost of a sync that finds nothing to change on a far link, so
        // the source's manifest is asked for beside its stat (a directory and a file are
        // scanned by the same request), and a directory's destination is not stat'ed: its
        // manifest says what the root is. Not with gitignore, whose single-file check comes
        // first, nor for a file the rules exclude (it would be hashed for nothing).
        let mz = compress_mode.manifest(remote.sandbox());
        let (zsrc, zdst) = match spec.direction {
            Direction::Upload => (false, mz),
            Direction::Download => (mz, false),
        };
        let speculate =
            !spec.rules.gitignore && !single_file_excluded(&spec.rules, &src_shown).unwrap_or(true);
        let src_scan = async {
            if speculate {
                Some(manifest(src, &src_root_given, &spec.rules, zsrc).await)
            } else {
                None
            }
        };
        let (src_stat, src_scan) = tokio::join!(stat_opt(src, &src_root_given), src_scan);
        let src_stat = src_stat?;
        let mut src_scan = src_scan;
        let mut src_manifest = async || match src_scan.take() {
            Some(r) => r,
            None => manifest(src, &src_root_given, &spec.rules, zsrc).await,
        };
        let (what_src, what_dst) = match spec.direction {
            Direction::Upload => ("local_path", "remote_path"),
            Direction::Download => ("remote_path", "local_path"),
        };
        let src_stat = src_stat.ok_or_else(|| {
            RsbError::new(
                Kind::Agent(ErrorCode::NotFound),
                format!("{what_src} does not exist: {src_shown}"),
                "check the path (remote paths are relative to the remote $HOME; ~ is expanded)",
            )
        })?;
        match src_stat.kind {
            FileKind::Dir => {
                report.synced_type = "directory";
                if spec.delete_extras && !opts.confirm_delete {
                    refuse_home_delete(dst, &dst_given, &dst_shown, what_dst).await?;
                }
                let dst_ref = &dst_given;
                let dst_fut =
                    |rules: SyncRules| async move { manifest(dst, dst_ref, &rules, zdst).await };
                let ((ssum, sents), (dsum, dents)) = if spec.rules.gitignore {
                    // The destination's walk applies the source's .gitignore files, so the
                    // source is scanned first.
                    let s = src_manifest().await?;
                    let rules = SyncRules {
                        gitignore_files: Some(s.0.gitignore_files.clone()),
                        ..spec.rules.clone()
                    };
                    (s, dst_fut(rules).await?)
                } else {
                    tokio::try_join!(src_manifest(), dst_fut(spec.rules.clone()))?
                };
                // A missing root (or a dangling symlink, which stat reads as missing) is
                // created by the apply session, as before.
                let (dsum, dents) = match dsum.root_kind {
                    Some(FileKind::Dir) => (dsum, dents),
                    None | Some(FileKind::Symlink) => Default::default(),
                    Some(_) => {
                        return Err(RsbError::invalid(
                            format!(
                                "{what_dst} {dst_shown} is a file on the destination but a directory on the source; nothing was changed"
                            ),
                            "remove it or rename it, or choose another destination",
                        ));
                    }
                };
                tracker.phase(Phase::Planning);
                tmark(
                    &tracker,
                    &format!(
                        "scanned (unchanged manifests: source {}, destination {})",
                        ssum.unchanged, dsum.unchanged
                    ),
                );
                let roots = Roots {
                    src: ssum.root.clone(),
                    dst: if dsum.root.is_empty() {
                        dst_given.clone()
                    } else {
                        dsum.root.clone()
                    },
                    single: false,
                };
                set_paths(&mut report, spec.direction, &roots.src, &roots.dst);
                report.manifests_unchanged = (ssum.unchanged, dsum.unchanged);
                report.skipped_special = ssum.skipped_special_count;
                report
                    .errors
                    .extend(ssum.errors.iter().map(|e| format!("source {e}")));
                report
                    .errors
                    .extend(dsum.errors.iter().map(|e| format!("destination {e}")));
                let unreadable = ssum
                    .errors
                    .iter()
                    .map(|e| e.split_once(": ").map(|(r, _)| r).unwrap_or(e).to_string())
                    .collect();
                let mut plan = plan::plan(
                    &sents,
                    &dents,
                    &PlanOptions {
                        delete_extras: spec.delete_extras,
                        unreadable,
                        dest_name: roots.dst.clone(),
                        confirm_delete: opts.confirm_delete,
                        baseline: opts.baseline.clone(),
                        overwrite: opts.overwrite,
                        safe: opts.safe,
                    },
                )?;
                // The root's own mtime, when anything inside it changes (as rsync -a does).
                if !plan.is_empty() {
                    plan.dir_mtimes.push((String::new(), src_stat.mtime_ns));
                }
                *tracker.base.lock() = Some(baseline_planned(&sents, &plan, opts));
                execute(
                    src,
                    dst,
                    spec,
                    &roots,
                    plan,
                    &tracker,
                    &mut report,
                    cancel,
                    opts,
                    compress_mode,
                )
                .await
            }
            FileKind::File | FileKind::Symlink => {
                report.synced_type = "file";
                if spec.delete_extras {
                    return Err(RsbError::invalid(
                        "delete_extras is only supported when local_path is a directory",
                        "pass delete_extras=false to sync a single file",
                    ));
                }
                if single_file_excluded(&spec.rules, &src_shown)?
                    || single_file_gitignored(src, &spec.rules, &src_root_given).await?
                {
                    report.skipped_files = 1;
                    return Ok(());
                }
                let dst_kind = stat_opt(dst, &dst_given).await?.map(|s| s.kind);
                let name = basename(&src_root_given).to_string();
                let into_dir = dst_kind == Some(FileKind::Dir)
                    || dst_given.ends_with('/')
                    || matches!(dst_given.as_str(), "." | "/" | "~" | "");
                let base = dst_given.trim_end_matches('/');
                let target = if !into_dir {
                    dst_given.clone()
                } else if base.is_empty() {
                    format!("/{name}")
                } else {
                    join_rel(base, &name)
                };
                let ((ssum, sents), (dsum, dents)) =
                    tokio::try_join!(src_manifest(), manifest(dst, &target, &spec.rules, zdst))?;
                tracker.phase(Phase::Planning);
                tmark(&tracker, "scanned");
                if dsum.root_kind == Some(FileKind::Dir) {
                    return Err(RsbError::invalid(
                        format!(
                            "{what_dst} points to a directory, expected a file target: {target}"
                        ),
                        "pass the directory itself (or a path ending in /) to sync the file into it",
                    ));
                }
                let (parent, fname) = split_parent(if dsum.root.is_empty() {
                    &target
                } else {
                    &dsum.root
                });
                let roots = Roots {
                    src: if ssum.root.is_empty() {
                        src_root_given.clone()
                    } else {
                        ssum.root.clone()
                    },
                    dst: parent,
                    single: true,
                };
                set_paths(
                    &mut report,
                    spec.direction,
                    &roots.src,
                    &roots.dst_path(&fname),
                );
                let rename = |v: Vec<ManifestEntry>| -> Vec<ManifestEntry> {
                    v.into_iter()
                        .filter(|e| e.rel.is_empty())
                        .map(|mut e| {
                            e.rel = fname.clone();
                            e
                        })
                        .collect()
                };
                let sents = rename(sents);
                if sents.is_empty() {
                    // The agent excluded or skipped the root (a FIFO, say).
                    report.skipped_files = 1;
                    report.skipped_special = ssum.skipped_special_count;
                    return Ok(());
                }
                let plan = plan::plan(
                    &sents,
                    &rename(dents),
                    &PlanOptions {
                        baseline: opts.baseline.clone(),
                        overwrite: opts.overwrite,
                        safe: opts.safe,
                        ..PlanOptions::default()
                    },
                )?;
                *tracker.base.lock() = Some(baseline_planned(&sents, &plan, opts));
                execute(
                    src,
                    dst,
                    spec,
                    &roots,
                    plan,
                    &tracker,
                    &mut report,
                    cancel,
                    opts,
                    compress_mode,
                )
                .await
            }
            other => Err(RsbError::invalid(
                format!("{what_src} must be a file or directory: {src_shown} ({other:?})"),
                "sync regular files, directories and symlinks only",
            )),
        }
    };
    let res = tokio::select! {
        r = work => r,
        _ = cancel.cancelled() => Err(cancelled_keeping(tracker.large.lock().clone())),
    };
    if let Err(e) = res {
        // What this run did before it failed, exactly: a worker that runs the sync again
        // adds it to the rerun's report.
        tracker.update(true, |_| {});
        // And the baseline of what did commit: an edit made after this cut is then an edit,
        // not a conflict. A first sync (no baseline) leaves none: its next run is a first sync
        // again, which detects no conflicts, rather than one whose empty baseline makes every
        // destination file it did not reach a conflict.
        if let Some(sink) = opts
            .baseline_sink
            .as_ref()
            .filter(|_| opts.baseline.is_some())
        {
            *sink.lock() = tracker.baseline();
        }
        return Err(e);
    }
    report.baseline_out = tracker.baseline();
    report.duration_s = tracker.start.elapsed().as_secs_f64();
    tmark(&tracker, "closed");
    tracker.phase(Phase::Complete);
    Ok(report)
}

/// The content both sides agree on before this plan commits anything: the source's files
/// that need no transfer (the destination holds the same bytes); conflicts and the files
/// about to be sent keep their old baseline (conflicts stay conflicts until resolved; a file
/// sent gets the hash its commit carries once acknowledged, [`Tracker::baseline`]).
fn baseline_planned(
    sents: &[ManifestEntry],
    plan: &Plan,
    opts: &RunOptions,
) -> std::collections::HashMap<String, [u8; 32]> {
    let kept: std::collections::HashSet<&str> = plan
        .conflicts
        .iter()
        .map(|c| c.rel.as_str())
        .chain(plan.files.iter().map(|f| f.rel.as_str()))
        .collect();
    let mut out = std::collections::HashMap::new();
    for e in sents {
        let Some(h) = e.hash.filter(|_| e.kind == FileKind::File) else {
            continue;
        };
        if kept.contains(e.rel.as_str()) {
            if let Some(old) = opts.baseline.as_ref().and_then(|b| b.get(&e.rel)) {
                out.insert(e.rel.clone(), *old);
            }
        } else {
            out.insert(e.rel.clone(), h);
        }
    }
    out
}

/// `delete_extras` into the destination's `$HOME` or `/` needs `confirm_delete`: one
/// mistyped path there would delete everything the source lacks.
async fn refuse_home_delete(
    dst: &AgentClient,
    dst_given: &str,
    dst_shown: &str,
    what_dst: &str,
) -> Result<()> {
    let home = stat_opt(dst, "~").await?.map(|s| s.path);
    let resolved = match dst_given {
        "~" => home.clone().unwrap_or_default(),
        g if g.starts_with("~/") => match &home {
            Some(h) => format!("{}/{}", h.trim_end_matches('/'), &g[2..]),
            None => g.to_string(),
        },
        g => g.to_string(),
    };
    let norm = rsb_rules::path::normalize(std::path::Path::new(&resolved));
    let is_home = home
        .as_deref()
        .is_some_and(|h| rsb_rules::path::normalize(std::path::Path::new(h)) == norm);
    if is_home || norm == std::path::Path::new("/") {
        let which = if is_home { "the home directory" } else { "/" };
        return Err(RsbError::invalid(
            format!(
                "delete_extras into {which} ({what_dst} {dst_shown:?} resolves to {}) is refused: it would delete everything there that the source lacks",
                norm.display()
            ),
            "pass a subdirectory as the destination, or confirm_delete: true (CLI --confirm-delete) if you mean it",
        ));
    }
    Ok(())
}

fn set_paths(report: &mut SyncReport, dir: Direction, src: &str, dst: &str) {
    match dir {
        Direction::Upload => {
            report.local_path = src.to_string();
            report.remote_path = dst.to_string();
        }
        Direction::Download => {
            report.remote_path = src.to_string();
            report.local_path = dst.to_string();
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn execute(
    src: &AgentClient,
    dst: &AgentClient,
    spec: &SyncSpec,
    roots: &Roots,
    plan: Plan,
    tracker: &Arc<Tracker>,
    report: &mut SyncReport,
    cancel: &CancellationToken,
    opts: &RunOptions,
    compress_mode: Mode,
) -> Result<()> {
    report.skipped_files += plan.unchanged;
    report.conflicts = plan
        .conflicts
        .iter()
        .map(|c| (c.rel.clone(), c.source_hash, c.dest_hash))
        .collect();
    report
        .errors
        .extend(plan.errors.iter().map(|e| format!("source {e}")));
    report.dirs_created = plan.mkdirs.len() as u64;
    report.files_transferred = (plan.files.len() + plan.symlinks.len()) as u64;
    report.attrs_updated = plan.attrs.len() as u64;
    report.deleted_files = plan.delete_files.len() as u64;
    report.deleted_dirs = plan.delete_dirs.len() as u64;
    report.delta_files = plan.files.iter().filter(|f| f.delta).count() as u64;
    report.bytes_planned = plan.bytes_total();
    if let Some(gate) = &opts.gate {
        let size = PlanSize {
            files: report.files_transferred,
            bytes: report.bytes_planned,
            deletions: report.deleted_files + report.deleted_dirs,
        };
        if !spec.dry_run && !gate(&size) {
            report.handed_off = true;
            *tracker.base.lock() = None;
            return Ok(());
        }
    }
    if spec.dry_run || opts.list_actions {
        report.actions = plan.actions();
    }
    if spec.dry_run {
        return Ok(());
    }
    if plan.is_empty() {
        return Ok(());
    }
    tracker.update(true, |p| {
        p.phase = Phase::Transferring;
        p.files_total = (plan.files.len() + plan.symlinks.len()) as u64;
        p.files_unchanged = plan.unchanged;
        p.bytes_total = plan.bytes_total();
    });
    let (remote, local) = match spec.direction {
        Direction::Upload => (dst, src),
        Direction::Download => (src, dst),
    };
    let open = dst.call(ApplyOpenRequest {
        root: roots.dst.clone(),
        create_root: true,
    });
    // The link's own delay, for the compression decision, measured beside the open (which
    // costs a round trip anyway): the remote agent's round trip less the local agent's, taken
    // at the same moment (the same client and agent code, no link), so that a loaded host or
    // a debug build, slow on both, does not read as a far link. A slow-looking link is
    // measured again: its delay is a floor every sample shows, a stall of the host is not.
    let (opened, r0, l0) = tokio::join!(open, ping(remote), ping(local));
    let opened = opened?;
    let (mut r_min, mut l_min) = (r0, l0);
    let link = |r: Duration, l: Duration| r.saturating_sub(l);
    // A far sample needs no second one when this sandbox's last transfer found the link far
    // too (that decision was confirmed): a round trip less per transfer on a far link.
    let known_far = compress_mode.manifest(remote.sandbox());
    for _ in 0..RTT_CONFIRM {
        if compress_mode != Mode::Auto || !compress_mode.decide(link(r_min, l_min)) || known_far {
            break;
        }
        let (r, l) = tokio::join!(ping(remote), ping(local));
        (r_min, l_min) = (r_min.min(r), l_min.min(l));
    }
    let rtt = link(r_min, l_min);
    let compress_on = compress_mode.decide(rtt);
    if compress_mode == Mode::Auto {
        super::compress::remember(remote.sandbox(), compress_on);
    }
    tracing::debug!(?r_min, ?l_min, compress_on, "link measured");
    if std::env::var_os("RSB_SYNC_TIMING").is_some() {
        eprintln!(
            "[sync timing] round trip remote {r_min:?}, local {l_min:?}: compression {compress_on}"
        );
    }
    let comp = Arc::new(Compress::new(
        compress_on,
        spec.direction == Direction::Download,
    ));
    let session = Session::new(dst, opened.session);
    // Whatever happens from here (error, cancel, this future dropped), the session is aborted
    // so its staging dir goes; a session left open would keep its staging until the
    // connection ends.
    let mut guard = SessionGuard {
        dst: dst.clone(),
        session: opened.session,
        armed: true,
    };
    tmark(tracker, "opened");
    // A destination root that did not exist was only known as given (`~/x`): show it expanded.
    if !roots.single {
        let shown = match spec.direction {
            Direction::Upload => &mut report.remote_path,
            Direction::Download => &mut report.local_path,
        };
        if *shown == roots.dst {
            *shown = opened.root.clone();
        }
    }
    let ctx = Ctx {
        src,
        session: &session,
        roots,
        tracker: tracker.clone(),
        bytes_sent: Mutex::new(0),
        comp: comp.clone(),
        changed: Mutex::new(Vec::new()),
    };
    let res = tokio::select! {
        r = ctx.transfer(&plan, report) => r,
        _ = cancel.cancelled() => Err(cancelled_keeping(tracker.large.lock().clone())),
    };
    report.bytes_sent = *ctx.bytes_sent.lock();
    let changed = std::mem::take(&mut *ctx.changed.lock());
    report.files_transferred = report
        .files_transferred
        .saturating_sub(changed.len() as u64);
    report.unsettled += changed.len() as u64;
    report.errors.extend(changed);
    if comp.on() {
        let (raw, wire) = comp.saved();
        report.bytes_wire = Some(report.bytes_sent.saturating_sub(raw) + wire);
    }
    match res {
        Ok(()) => {
            tmark(tracker, "transferred");
            guard.armed = false;
            let closed = session.close(plan.dir_mtimes.clone()).await?;
            report.warnings.extend(closed.warnings);
            Ok(())
        }
        Err(e) => {
            // Abort now, waiting a little (the agent lets the running batch finish); if that
            // takes longer, the abort finishes in the background.
            guard.armed = false;
            if dst.is_alive() {
                let h = tokio::spawn(abort(dst.clone(), session.id));
                let _ = tokio::time::timeout(CLEANUP_TIMEOUT, h).await;
            }
            Err(e)
        }
    }
}

/// The byte window of one large file's requests: the rate acknowledgements arrive at (over the
/// last few), times the quickest acknowledgement seen (the link's and the agent's own delay)
/// plus [`LARGE_QUEUE_TIME`]. When data queues, acknowledgements slow, the window shrinks and
/// the queue drains to about [`LARGE_QUEUE_TIME`] (a delay-based controller, as TCP Vegas).
struct Window {
    in_flight: u64,
    acked: u64,
    /// (when, bytes acknowledged by then), the last few acknowledgements.
    recent: std::collections::VecDeque<(Instant, u64)>,
    min_delay: Option<Duration>,
    limit: u64,
}

impl Window {
    fn new() -> Window {
        Window {
            in_flight: 0,
            acked: 0,
            recent: std::collections::VecDeque::new(),
            min_delay: None,
            limit: LARGE_START_BYTES,
        }
    }

    fn full(&self, next: u64) -> bool {
        self.in_flight + next > self.limit
    }

    fn sent(&mut self, n: u64) {
        self.in_flight += n;
    }

    fn acked(&mut self, n: u64, sent_at: Instant) {
        self.in_flight = self.in_flight.saturating_sub(n);
        let now = Instant::now();
        let delay = now.duration_since(sent_at);
        self.min_delay = Some(self.min_delay.map_or(delay, |d| d.min(delay)));
        self.acked += n;
        self.recent.push_back((now, self.acked));
        if self.recent.len() > 8 {
            self.recent.pop_front();
        }
        let (t0, b0) = self.recent[0];
        let secs = now.duration_since(t0).as_secs_f64();
        if self.recent.len() >= 4 && secs >= 0.005 {
            let rate = (self.acked - b0) as f64 / secs;
            let span = self.min_delay.unwrap_or_default() + LARGE_QUEUE_TIME;
            let want = (rate * span.as_secs_f64()) as u64;
            self.limit = want.clamp(
                LARGE_MIN_BYTES,
                LARGE_WINDOW as u64 * CHUNKS_PER_REQUEST as u64 * BLOCK_SIZE,
            );
        }
    }

    /// Chunks per request: two requests fit the window, so one is written while the other is
    /// applied; 1 to [`CHUNKS_PER_REQUEST`].
    fn chunks(&self) -> usize {
        ((self.limit / 2 / BLOCK_SIZE) as usize).clamp(1, CHUNKS_PER_REQUEST)
    }
}

/// Aborts a helper task when the sync stops (or is dropped) before it finishes.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Aborts an apply session (dropping what was staged) when the sync stops early.
struct SessionGuard {
    dst: AgentClient,
    session: u64,
    armed: bool,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if !self.armed || !self.dst.is_alive() {
            return;
        }
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(abort(self.dst.clone(), self.session));
        }
    }
}

struct Ctx<'a> {
    src: &'a AgentClient,
    session: &'a Session,
    roots: &'a Roots,
    tracker: Arc<Tracker>,
    bytes_sent: Mutex<u64>,
    /// Compression of the file bytes this transfer sends.
    comp: Arc<Compress>,
    /// Files that kept changing while they were sent, not committed (one line each).
    changed: Mutex<Vec<String>>,
}

/// What one small batch carries, for progress once it is acknowledged.
struct BatchInfo {
    files: u64,
    bytes: u64,
    last: Option<String>,
    /// `(rel, hash)` of the batch's `FileCommit`s.
    commits: Vec<(String, [u8; 32])>,
}

impl Ctx<'_> {
    fn sent(&self, n: u64) {
        *self.bytes_sent.lock() += n;
    }

    async fn transfer(&self, plan: &Plan, report: &mut SyncReport) -> Result<()> {
        let (small, large): (Vec<&FileXfer>, Vec<&FileXfer>) =
            plan.files.iter().partition(|f| f.size <= SMALL_MAX);
        // Small files are read by a task of their own from the start, so reading overlaps with
        // creating directories and with waiting for acknowledgements.
        let (tx, rx) = mpsc::channel(SMALL_READS);
        let jobs: Vec<(AgentClient, String, FileXfer)> = small
            .into_iter()
            .map(|f| (self.src.clone(), self.roots.src_path(&f.rel), f.clone()))
            .collect();
        let comp = self.comp.clone();
        let reader = AbortOnDrop(tokio::spawn(async move {
            let mut reads = futures::stream::iter(jobs)
                .map(|(c, p, f)| read_small(c, p, f, comp.clone()))
                .buffered(SMALL_READS);
            while let Some(r) = reads.next().await {
                let stop = r.is_err();
                if tx.send(r).await.is_err() || stop {
                    break;
                }
            }
        }));
        // 1. Directories, parents first, awaited.
        for chunk in plan.mkdirs.chunks(META_OPS) {
            let ops = chunk
                .iter()
                .map(|(rel, mode)| ApplyOp::Mkdir {
                    rel: rel.clone(),
                    mode: *mode,
                })
                .collect();
            self.session.apply(ops).await?;
        }
        let dirs = plan.mkdirs.len() as u64;
        self.tracker.update(false, |p| p.dirs_done = dirs);
        tmark(&self.tracker, "mkdirs");
        // 2. Small items stream alongside large files (one at a time).
        let small_fut = self.send_small(plan, rx);
        let large_fut = async {
            for f in large {
                self.send_large(f).await?;
            }
            Ok::<_, RsbError>(())
        };
        tokio::try_join!(small_fut, large_fut)?;
        drop(reader);
        // 3. Modes of new read-only directories, now that nothing more is written inside.
        if !plan.final_attrs.is_empty() {
            let ops = plan
                .final_attrs
                .iter()
                .map(|(rel, mode, mtime)| ApplyOp::SetAttr {
                    rel: rel.clone(),
                    mode: *mode,
                    mtime_ns: *mtime,
                })
                .collect();
            self.session.apply(ops).await?;
        }
        // 4. Deletes: files, then directories deepest first.
        if !plan.delete_files.is_empty() || !plan.delete_dirs.is_empty() {
            self.tracker.phase(Phase::Deleting);
        }
        for chunk in plan.delete_files.chunks(META_OPS) {
            let ops = chunk
                .iter()
                .map(|rel| ApplyOp::Delete { rel: rel.clone() })
                .collect();
            self.session.apply(ops).await?;
        }
        if !plan.delete_dirs.is_empty() {
            let ops: Vec<ApplyOp> = plan
                .delete_dirs
                .iter()
                .map(|rel| ApplyOp::Delete { rel: rel.clone() })
                .collect();
            if self.session.apply(ops).await.is_err() {
                // A directory that still holds excluded entries cannot be removed (and must
                // not be): delete one by one and keep those.
                let mut deleted = 0;
                for rel in &plan.delete_dirs {
                    match self
                        .session
                        .apply(vec![ApplyOp::Delete { rel: rel.clone() }])
                        .await
                    {
                        Ok(_) => deleted += 1,
                        Err(e) if e.kind == Kind::Agent(ErrorCode::NotFound) => deleted += 1,
                        Err(e) if e.is_connection_lost() => return Err(e),
                        Err(e) => tracing::debug!(%rel, "directory kept: {e}"),
                    }
                }
                report.deleted_dirs = deleted;
            }
        }
        Ok(())
    }

    /// Small files (whole), symlinks and attribute fixes, batched and pipelined.
    async fn send_small(
        &self,
        plan: &Plan,
        mut reads: mpsc::Receiver<Result<SmallFile>>,
    ) -> Result<()> {
        let mut inflight = FuturesUnordered::new();
        let mut ops: Vec<ApplyOp> = Vec::new();
        let mut info = BatchInfo {
            files: 0,
            bytes: 0,
            last: None,
            commits: Vec::new(),
        };
        let mut data_bytes = 0usize;
        let batch_bytes = if self.comp.here() {
            BATCH_BYTES_PACKED
        } else {
            BATCH_BYTES
        };

        macro_rules! flush {
            () => {
                if !ops.is_empty() {
                    while inflight.len() >= SMALL_WINDOW {
                        let r: Result<BatchInfo> = inflight.next().await.expect("non-empty");
                        self.tracker.batch_acked(r?);
                    }
                    let batch = std::mem::take(&mut ops);
                    let bi = std::mem::replace(
                        &mut info,
                        BatchInfo {
                            files: 0,
                            bytes: 0,
                            last: None,
                            commits: Vec::new(),
                        },
                    );
                    self.sent(bi.bytes);
                    #[allow(unused_assignments)]
                    {
                        data_bytes = 0;
                    }
                    inflight.push(self.session.apply_batch(batch, bi, self.comp.clone()));
                }
            };
        }

        for (rel, target) in &plan.symlinks {
            ops.push(ApplyOp::Symlink {
                rel: rel.clone(),
                target: target.clone(),
            });
            info.files += 1;
            info.last = Some(rel.clone());
            if ops.len() >= BATCH_OPS {
                flush!();
            }
        }
        for (rel, mode, mtime) in &plan.attrs {
            ops.push(ApplyOp::SetAttr {
                rel: rel.clone(),
                mode: *mode,
                mtime_ns: *mtime,
            });
            if ops.len() >= BATCH_OPS {
                flush!();
            }
        }
        loop {
            // Reap acknowledgements as they come, so progress moves while reads continue.
            while let Some(Some(r)) = futures::FutureExt::now_or_never(inflight.next()) {
                self.tracker.batch_acked(r?);
            }
            let Some(r) = reads.recv().await else { break };
            let SmallFile { f, data, hash } = r?;
            // What is committed is exactly what was read: a file changed since the scan is
            // sent as read (its hash taken here), never torn.
            let hash = hash.unwrap_or_else(|| *blake3::hash(&data).as_bytes());
            let size = data.len() as u64;
            data_bytes += data.len();
            info.files += 1;
            info.bytes += size;
            info.last = Some(f.rel.clone());
            info.commits.push((f.rel.clone(), hash));
            ops.push(data_op(&f.rel, 0, data, None));
            ops.push(ApplyOp::FileCommit {
                rel: f.rel.clone(),
                size,
                mode: f.mode,
                mtime_ns: f.mtime_ns,
                hash,
            });
            if data_bytes >= batch_bytes || ops.len() >= BATCH_OPS {
                flush!();
            }
        }
        flush!();
        while let Some(r) = inflight.next().await {
            self.tracker.batch_acked(r?);
        }
        Ok(())
    }

    /// One large file: whole, or only its changed blocks when the destination has a version.
    async fn send_large(&self, f: &FileXfer) -> Result<()> {
        let src_path = self.roots.src_path(&f.rel);
        let nblocks = f.size.div_ceil(BLOCK_SIZE);
        // Blocks to send, as (offset, len).
        let mut blocks: Vec<(u64, u64)> = (0..nblocks)
            .map(|i| (i * BLOCK_SIZE, BLOCK_SIZE.min(f.size - i * BLOCK_SIZE)))
            .collect();
        let mut first_awaited = false;
        // Bytes an interrupted sync of this file kept on the destination: blocks whose hash
        // matches the source's are not sent again (the commit verifies the whole file).
        let mut resumed = false;
        if !f.delta && f.size >= PARTIAL_MIN {
            let kept = self.session.resume(&f.rel).await?;
            first_awaited = true;
            if !kept.is_empty() {
                let s = block_hashes(self.src, &src_path).await?;
                blocks.retain(|(off, _)| {
                    let i = (off / BLOCK_SIZE) as usize;
                    kept.get(i).is_none() || s.get(i) != kept.get(i)
                });
                let send: u64 = blocks.iter().map(|b| b.1).sum();
                self.tracker.update(false, |p| {
                    p.bytes_total = p.bytes_total.saturating_sub(f.size - send);
                    p.current_path = f.rel.clone();
                });
                resumed = true;
            }
        }
        let whole = !f.delta && !resumed;
        let kept_before = if resumed {
            f.size - blocks.iter().map(|b| b.1).sum::<u64>()
        } else {
            0
        };
        *self.tracker.large.lock() = (!f.delta).then(|| (f.rel.clone(), kept_before));
        if f.delta {
            let dst_path = self.roots.dst_path(&f.rel);
            let (s, d) = tokio::try_join!(
                block_hashes(self.src, &src_path),
                block_hashes(&self.session.dst, &dst_path)
            )?;
            blocks = blocks
                .into_iter()
                .enumerate()
                .filter(|(i, _)| s.get(*i).is_none() || s.get(*i) != d.get(*i))
                .map(|(_, b)| b)
                .collect();
            let send: u64 = blocks.iter().map(|b| b.1).sum();
            self.tracker.update(false, |p| {
                p.bytes_total = p.bytes_total.saturating_sub(f.size - send);
                p.current_path = f.rel.clone();
            });
            self.session
                .apply(vec![ApplyOp::FileBase { rel: f.rel.clone() }])
                .await?;
            first_awaited = true;
        }
        let pass = self
            .send_blocks(f, &src_path, f.size, blocks, whole, first_awaited, None)
            .await?;
        let (size, hash) = match pass.whole {
            // The bytes sent are the version the scan hashed (in one pass, its identity
            // unchanged from the first byte to the last): one version, commit it.
            Some(got) if got == (f.size, f.hash) => got,
            // The source changed between its scan and this read, maybe in the middle of it:
            // what is staged may be a mix of versions. Send it again against a fresh hash.
            Some(_) => match self.resend_settled(f, &src_path).await? {
                Some(v) => v,
                None => {
                    *self.tracker.large.lock() = None;
                    self.changed.lock().push(format!(
                        "source {}: changed while it was being sent ({RESEND_TRIES} tries); not \
                         committed, the destination keeps what it had; sync again once it is \
                         quiet",
                        f.rel
                    ));
                    return Ok(());
                }
            },
            None => (f.size, f.hash),
        };
        self.session
            .apply(vec![ApplyOp::FileCommit {
                rel: f.rel.clone(),
                size,
                mode: f.mode,
                mtime_ns: f.mtime_ns,
                hash,
            }])
            .await?;
        *self.tracker.large.lock() = None;
        self.tracker.committed.lock().insert(f.rel.clone(), hash);
        self.tracker.acked(1, 0, Some(&f.rel));
        Ok(())
    }

    /// Read `blocks` of the source and stream them into the staged copy, under the byte
    /// window. `whole`: the blocks are the whole file (of `size` bytes) in order, hashed as
    /// read (the file may shrink under the read: it stops there). `expect`: the source's block
    /// hashes this pass must reproduce.
    #[allow(clippy::too_many_arguments)]
    async fn send_blocks(
        &self,
        f: &FileXfer,
        src_path: &str,
        size: u64,
        blocks: Vec<(u64, u64)>,
        whole: bool,
        mut first_awaited: bool,
        expect: Option<&[[u8; 32]]>,
    ) -> Result<Pass> {
        let held = |b: u64| {
            if let Some(l) = self.tracker.large.lock().as_mut() {
                l.1 += b;
            }
        };
        let jobs: Vec<(AgentClient, String, u64, u64)> = blocks
            .into_iter()
            .map(|(off, len)| (self.src.clone(), src_path.to_string(), off, len))
            .collect();
        // Set when a block of this file did not shrink: the rest travels raw untried.
        let skip = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut reads = futures::stream::iter(jobs)
            .map(|(c, p, off, len)| read_block(c, p, off, len, self.comp.clone(), skip.clone()))
            .buffered(LARGE_READS);
        let mut hasher = whole.then(blake3::Hasher::new);
        let mut total: u64 = 0;
        let mut matched = true;
        let mut inflight = FuturesUnordered::new();
        let mut pending: Vec<ApplyOp> = Vec::new();
        // Raw bytes (progress) and bytes on the wire (the window) of `pending`.
        let mut pending_bytes = 0u64;
        let mut pending_wire = 0u64;
        let mut eof = false;
        let mut window = Window::new();
        loop {
            let next = if eof { None } else { reads.next().await };
            let last = next.is_none();
            if let Some(r) = next {
                let (off, data, z) = r?;
                if let Some(want) = expect {
                    let i = (off / BLOCK_SIZE) as usize;
                    if want.get(i) != Some(blake3::hash(&data).as_bytes()) {
                        matched = false;
                    }
                }
                if let Some(h) = hasher.as_mut() {
                    if off != total {
                        // The file shrank under us: stop at what was read.
                        eof = true;
                        continue;
                    }
                    h.update(&data);
                }
                let n = data.len() as u64;
                total = off + n;
                if whole && n < BLOCK_SIZE.min(size - off.min(size)) {
                    eof = true;
                }
                pending_bytes += n;
                pending_wire += z.as_ref().map_or(n, |z| z.len() as u64);
                if n > 0 {
                    pending.push(data_op(&f.rel, off, data, z));
                }
            }
            let full = pending.len() >= window.chunks();
            if (full || last || !first_awaited) && (!pending.is_empty() || !first_awaited) {
                let ops = if pending.is_empty() {
                    // An empty first request still creates the staged file.
                    vec![ApplyOp::FileData {
                        rel: f.rel.clone(),
                        offset: 0,
                        data: Vec::new(),
                    }]
                } else {
                    std::mem::take(&mut pending)
                };
                let bytes = std::mem::take(&mut pending_bytes);
                let wire = std::mem::take(&mut pending_wire);
                self.sent(bytes);
                if !first_awaited {
                    self.session.apply(ops).await?;
                    self.tracker.acked(0, bytes, Some(&f.rel));
                    held(bytes);
                    first_awaited = true;
                } else {
                    // The window counts bytes on the wire: it bounds the link's queue.
                    while inflight.len() >= LARGE_WINDOW
                        || (!inflight.is_empty() && window.full(wire))
                    {
                        let ((b, w), at) = inflight.next().await.expect("non-empty")?;
                        window.acked(w, at);
                        self.tracker.acked(0, b, Some(&f.rel));
                        held(b);
                    }
                    window.sent(wire);
                    inflight.push(self.session.apply_timed(ops, (bytes, wire)));
                    // Poll now: the new request takes its place in the channel at once (its
                    // send time is its first poll), and acknowledgements that came are counted.
                    while let Some(Some(r)) = futures::FutureExt::now_or_never(inflight.next()) {
                        let ((b, w), at) = r?;
                        window.acked(w, at);
                        self.tracker.acked(0, b, Some(&f.rel));
                        held(b);
                    }
                }
            }
            if last {
                break;
            }
        }
        while let Some(r) = inflight.next().await {
            let ((b, _), _) = r?;
            self.tracker.acked(0, b, Some(&f.rel));
            held(b);
        }
        Ok(Pass {
            whole: hasher.map(|h| (total, *h.finalize().as_bytes())),
            matched,
        })
    }

    /// A large file that changed since its scan, sent again until what is staged is one
    /// version: the source's block hashes are taken in one pass (the agent refuses a file
    /// that changes while it hashes), then every block is read and sent again and must hash
    /// as that pass said, the size too. `None`: it kept changing for [`RESEND_TRIES`] tries.
    async fn resend_settled(
        &self,
        f: &FileXfer,
        src_path: &str,
    ) -> Result<Option<(u64, [u8; 32])>> {
        for _ in 0..RESEND_TRIES {
            let fresh = match self
                .src
                .call(BlockHashesRequest {
                    path: src_path.to_string(),
                    block_size: BLOCK_SIZE,
                })
                .await
            {
                Ok(r) => r,
                // Changing while it was hashed: another try.
                Err(e)
                    if e.kind == Kind::Agent(ErrorCode::Io)
                        && e.message.contains("changed while") =>
                {
                    continue;
                }
                Err(e) => return Err(e),
            };
            let size = fresh.size;
            let blocks: Vec<(u64, u64)> = (0..size.div_ceil(BLOCK_SIZE))
                .map(|i| (i * BLOCK_SIZE, BLOCK_SIZE.min(size - i * BLOCK_SIZE)))
                .collect();
            self.tracker.update(false, |p| p.bytes_total += size);
            let pass = self
                .send_blocks(f, src_path, size, blocks, true, true, Some(&fresh.hashes))
                .await?;
            match pass.whole {
                Some((got, hash)) if pass.matched && got == size => return Ok(Some((got, hash))),
                _ => continue,
            }
        }
        Ok(None)
    }
}
