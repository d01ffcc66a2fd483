//! The transfer itself: directories, then small files in pipelined batches beside large
//! files one at a time under their byte window, then attributes and deletes. Everything here
//! runs inside one apply session, and every commit it sends carries the hash of the bytes
//! it read, which is what the run's baseline records.

use std::sync::Arc;

use futures::{StreamExt, stream::FuturesUnordered};
use parking_lot::Mutex;
use rsb_protocol::{ApplyOp, BlockHashesRequest, ErrorCode, sync::PARTIAL_MIN};
use tokio::sync::mpsc;

use super::{
    BATCH_BYTES, BATCH_OPS, LARGE_READS, LARGE_WINDOW, META_OPS, SMALL_MAX, SMALL_READS,
    SMALL_WINDOW,
    agent::{SmallFile, block_hashes, data_op, read_block, read_small},
    lanes::{LANE_BYTES, LANES_MIN_BYTES, Lanes, Shared},
    paths::Roots,
    progress::{BatchInfo, Tracker, tmark},
    session::{AbortOnDrop, Session},
    window::Window,
};
use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
    sync::{
        Phase, SyncReport,
        compress::Compress,
        plan::{BLOCK_SIZE, FileXfer, Plan},
    },
};

/// How often a large file that changed since its scan is sent again before it is reported
/// as changing and left uncommitted.
pub(super) const RESEND_TRIES: usize = 3;

/// One pass over a large file's blocks.
struct Pass {
    /// `(size, blake3)` of the bytes read, when the pass read the whole file in order.
    whole: Option<(u64, [u8; 32])>,
    /// Every block hashed as the pass was told to expect (true when nothing was expected).
    matched: bool,
}

pub(super) struct Ctx<'a> {
    pub(super) src: &'a AgentClient,
    pub(super) session: &'a Session,
    pub(super) roots: &'a Roots,
    pub(super) tracker: Arc<Tracker>,
    pub(super) bytes_sent: Mutex<u64>,
    /// Compression of the file bytes this transfer sends.
    pub(super) comp: Arc<Compress>,
    /// Files that kept changing while they were sent, not committed (one line each).
    pub(super) changed: Mutex<Vec<String>>,
    /// Extra channels for large files on a long link.
    pub(super) lanes: Lanes,
}

impl Ctx<'_> {
    fn sent(&self, n: u64) {
        *self.bytes_sent.lock() += n;
    }

    pub(super) async fn transfer(&self, plan: &Plan, report: &mut SyncReport) -> Result<()> {
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
                    inflight.push(self.session.apply_batch(batch, bi));
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
            let SmallFile {
                f,
                data,
                hash,
                settled,
            } = r?;
            if !settled {
                self.changed.lock().push(format!(
                    "source {}: changed while it was being read (every try); not committed, \
                     the destination keeps what it had; sync again once it is quiet",
                    f.rel
                ));
                continue;
            }
            // What is committed is exactly what was read: a file changed since the scan is
            // sent as read (its hash taken here), never torn.
            let hash = hash.unwrap_or_else(|| *blake3::hash(&data).as_bytes());
            let size = data.len() as u64;
            data_bytes += data.len();
            info.files += 1;
            info.bytes += size;
            info.last = Some(f.rel.clone());
            info.commits.push((f.rel.clone(), hash));
            ops.push(data_op(&f.rel, 0, data));
            ops.push(ApplyOp::FileCommit {
                rel: f.rel.clone(),
                size,
                mode: f.mode,
                mtime_ns: f.mtime_ns,
                hash,
            });
            if data_bytes >= BATCH_BYTES || ops.len() >= BATCH_OPS {
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
        // A file large enough on a long link goes over the lanes (its staged copy opened to
        // them first).
        let to_send: u64 = blocks.iter().map(|b| b.1).sum();
        let lanes = if to_send >= LANES_MIN_BYTES {
            self.lanes.get(&self.session.dst).await
        } else {
            &[]
        };
        let shared = if lanes.is_empty() {
            None
        } else {
            let name = self.session.share(&f.rel).await?;
            first_awaited = true;
            Some(Shared {
                root: &self.session.root,
                staging: &self.session.staging,
                name,
                lanes,
            })
        };
        let pass = self
            .send_blocks(
                f,
                &src_path,
                f.size,
                blocks,
                whole,
                first_awaited,
                None,
                shared.as_ref(),
            )
            .await?;
        let (size, hash) = match pass.whole {
            // The bytes sent are the version the scan hashed (in one pass, its identity
            // unchanged from the first byte to the last): one version, commit it.
            Some(got) if got == (f.size, f.hash) => got,
            // The source changed between its scan and this read, maybe in the middle of it:
            // what is staged may be a mix of versions. Send it again against a fresh hash.
            Some(_) => match self.resend_settled(f, &src_path, shared.as_ref()).await? {
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
        self.tracker.file_committed(&f.rel, hash);
        self.tracker.acked(1, 0, Some(&f.rel));
        Ok(())
    }

    /// Read `blocks` of the source and stream them into the staged copy, under the byte
    /// window. `whole`: the blocks are the whole file (of `size` bytes) in order, hashed as
    /// read (the file may shrink under the read: it stops there). `expect`: the source's block
    /// hashes this pass must reproduce. `shared`: the blocks go over its lanes, the window
    /// widened for them.
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
        shared: Option<&Shared<'_>>,
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
        let lanes = shared.map_or(1, |s| s.lanes.len());
        let mut window = Window::new(lanes);
        // Wire bytes in flight on each lane: a request goes to the least loaded one, and waits
        // while even that one holds a full SSH window.
        let mut load = vec![0u64; lanes];
        loop {
            let next = if eof { None } else { reads.next().await };
            let last = next.is_none();
            if let Some(r) = next {
                let (off, data) = r?;
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
                pending_wire += if skip.load(std::sync::atomic::Ordering::Relaxed) {
                    n
                } else {
                    self.comp.estimate(n)
                };
                if n > 0 {
                    pending.push(data_op(&f.rel, off, data));
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
                    self.session
                        .apply_timed(ops, (bytes, wire), skip.clone())
                        .await?;
                    self.tracker.acked(0, bytes, Some(&f.rel));
                    held(bytes);
                    first_awaited = true;
                } else {
                    // The window counts bytes on the wire: it bounds the link's queue.
                    let lane_full = |load: &[u64]| {
                        shared.is_some() && load.iter().min().is_some_and(|l| l + wire > LANE_BYTES)
                    };
                    while inflight.len() >= LARGE_WINDOW * lanes
                        || (!inflight.is_empty() && (window.full(wire) || lane_full(&load)))
                    {
                        let ((b, w), at, k) = inflight.next().await.expect("non-empty")?;
                        window.acked(w, at);
                        load[k] -= w;
                        self.tracker.acked(0, b, Some(&f.rel));
                        held(b);
                    }
                    window.sent(wire);
                    let k = (0..lanes).min_by_key(|k| load[*k]).unwrap_or(0);
                    load[k] += wire;
                    let lane = shared.map(|s| (s, k));
                    inflight.push(self.put(lane, ops, (bytes, wire), skip.clone()));
                    // Poll now: the new request takes its place in the channel at once (its
                    // send time is its first poll), and acknowledgements that came are counted.
                    while let Some(Some(r)) = futures::FutureExt::now_or_never(inflight.next()) {
                        let ((b, w), at, k) = r?;
                        window.acked(w, at);
                        load[k] -= w;
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
            let ((b, _), _, _) = r?;
            self.tracker.acked(0, b, Some(&f.rel));
            held(b);
        }
        Ok(Pass {
            whole: hasher.map(|h| (total, *h.finalize().as_bytes())),
            matched,
        })
    }

    /// Send one request of a large file's data: through the session, or through lane `k` of
    /// `lane` into the shared staged copy. Answers as [`Session::apply_timed`], plus the lane
    /// (0 without lanes).
    async fn put(
        &self,
        lane: Option<(&Shared<'_>, usize)>,
        ops: Vec<ApplyOp>,
        bytes: (u64, u64),
        skip: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<((u64, u64), std::time::Instant, usize)> {
        let Some((shared, k)) = lane else {
            let (b, at) = self.session.apply_timed(ops, bytes, skip).await?;
            return Ok((b, at, 0));
        };
        let at = std::time::Instant::now();
        shared.write(k, ops, &self.comp, &skip).await?;
        Ok((bytes, at, k))
    }

    /// A large file that changed since its scan, sent again until what is staged is one
    /// version: the source's block hashes are taken in one pass (the agent refuses a file
    /// that changes while it hashes), then every block is read and sent again and must hash
    /// as that pass said, the size too. `None`: it kept changing for [`RESEND_TRIES`] tries.
    async fn resend_settled(
        &self,
        f: &FileXfer,
        src_path: &str,
        shared: Option<&Shared<'_>>,
    ) -> Result<Option<(u64, [u8; 32])>> {
        for _ in 0..RESEND_TRIES {
            let fresh = match self
                .src
                .call(BlockHashesRequest {
                    path: src_path.to_string(),
                    block_size: BLOCK_SIZE,
                    confine: None,
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
            // The size and the count of hashes come from the source's agent: they must
            // agree, or the list of blocks would be as long as a claimed size makes it.
            let Some(blocks) = fresh.spans(BLOCK_SIZE) else {
                return Err(RsbError::internal(format!(
                    "block hashes of {src_path}: {} hashes for {size} bytes",
                    fresh.hashes.len()
                )));
            };
            self.tracker.update(false, |p| p.bytes_total += size);
            let pass = self
                .send_blocks(
                    f,
                    src_path,
                    size,
                    blocks,
                    true,
                    true,
                    Some(&fresh.hashes),
                    shared,
                )
                .await?;
            match pass.whole {
                Some((got, hash)) if pass.matched && got == size => return Ok(Some((got, hash))),
                _ => continue,
            }
        }
        Ok(None)
    }
}
