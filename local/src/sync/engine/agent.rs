//! The engine's calls to one agent: manifests, stats, pings and reads of source bytes
//! (plain or through the source's compression). Each returns plain data, so the transfer
//! code above it never touches a request type.

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use rsb_protocol::{
    ApplyOp, BlockHashesRequest, Chunk, ErrorCode, ManifestEntry, ManifestRequest, ManifestSummary,
    PingRequest, ReadFileRequest, ReadFileZRequest, StatRequest, SyncRules, compress::MAX_RAW,
};
use tokio::sync::mpsc;

use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
    sync::{
        compress::Compress,
        plan::{BLOCK_SIZE, FileXfer},
    },
};

/// A directory or file manifest: the summary plus every entry (streamed as chunks).
/// `compress`: ask for [`Chunk::ManifestZ`] (a remote agent across a slow link).
pub(super) async fn manifest(
    c: &AgentClient,
    root: &str,
    rules: &SyncRules,
    compress: bool,
) -> Result<(ManifestSummary, Vec<ManifestEntry>)> {
    let (tx, mut rx) = mpsc::channel::<Chunk>(64);
    let key = rsb_protocol::encode(rules)
        .ok()
        .map(|r| (c.sandbox().to_string(), root.to_string(), r));
    let held = key.as_ref().and_then(crate::sync::held::get);
    let call = c.call_streaming(
        ManifestRequest {
            root: root.to_string(),
            rules: rules.clone(),
            hash: true,
            compress,
            expect: held.as_ref().map(|h| h.0),
            confine: None,
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
        crate::sync::held::put(key, entries.clone());
    }
    Ok((r, entries))
}

/// `stat` that maps "not found" to `None`.
pub(super) async fn stat_opt(
    c: &AgentClient,
    path: &str,
) -> Result<Option<rsb_protocol::FileStat>> {
    let req = StatRequest {
        path: path.into(),
        follow: true,
        confine: None,
    };
    match c.call(req).await {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind == Kind::Agent(ErrorCode::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

/// One round trip to `c`; a failed ping reads as a slow link (the transfer that follows then
/// reports the broken link itself).
pub(super) async fn ping(c: &AgentClient) -> Duration {
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

/// A small file as read, ready for its batch.
pub(super) struct SmallFile {
    pub(super) f: FileXfer,
    pub(super) data: Vec<u8>,
    /// blake3 of `data`, when taken off the runtime (compression on: the runtime then has the
    /// batches to compress).
    pub(super) hash: Option<[u8; 32]>,
    /// The bytes are one version of the file (see [`ReadFileZRequest::whole`]); a file that
    /// kept changing during every try is not committed.
    pub(super) settled: bool,
}

/// Read a whole small file (owned arguments: the future is `'static`) as one version, in
/// one request; with compression on, hash it on a blocking thread, so files hash in parallel
/// with each other and with the reads. Small files are compressed by batch, as pieces of
/// the session's upload stream (`Session::send`), not one by one.
pub(super) async fn read_small(
    src: AgentClient,
    path: String,
    f: FileXfer,
    comp: Arc<Compress>,
) -> Result<SmallFile> {
    let want = f.size.max(64 * 1024).min(MAX_RAW as u64);
    let comp_at_source = comp.at_source().then_some((&*comp, None));
    let (data, truncated, settled) = read_z(&src, &path, 0, want, true, comp_at_source).await?;
    // Grown past one request since the scan: it is changing, and is not committed.
    let settled = settled && !truncated;
    if !comp.here() {
        return Ok(SmallFile {
            f,
            data,
            hash: None,
            settled,
        });
    }
    let work = move || {
        let hash = *blake3::hash(&data).as_bytes();
        SmallFile {
            f,
            data,
            hash: Some(hash),
            settled,
        }
    };
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| RsbError::internal(format!("hashing a file: {e}")))
}

/// One block of a large file: `(offset, bytes)`.
pub(super) type Block = (u64, Vec<u8>);

/// Read one block of a large file, compressed by the source agent when that is where the
/// link is (a download).
pub(super) async fn read_block(
    src: AgentClient,
    path: String,
    off: u64,
    len: u64,
    comp: Arc<Compress>,
    skip: Arc<std::sync::atomic::AtomicBool>,
) -> Result<Block> {
    let z = (!skip.load(Ordering::Relaxed)).then_some((&*comp, Some(&*skip)));
    Ok((off, read_range(&src, &path, off, len, z).await?))
}

/// The op that writes `data` at `offset`.
pub(super) fn data_op(rel: &str, offset: u64, data: Vec<u8>) -> ApplyOp {
    ApplyOp::FileData {
        rel: rel.to_string(),
        offset,
        data,
    }
}

pub(super) async fn block_hashes(c: &AgentClient, path: &str) -> Result<Vec<[u8; 32]>> {
    let req = BlockHashesRequest {
        path: path.to_string(),
        block_size: BLOCK_SIZE,
        confine: None,
    };
    Ok(c.call(req).await?.hashes)
}

/// `ReadFileZ`, compressed at the source when `comp` is given: `(data, truncated,
/// settled)`. A block that did not shrink sets `skip`, so the rest of its file is read plain.
async fn read_z(
    src: &AgentClient,
    path: &str,
    offset: u64,
    max_bytes: u64,
    whole: bool,
    comp: Option<(&Compress, Option<&std::sync::atomic::AtomicBool>)>,
) -> Result<(Vec<u8>, bool, bool)> {
    let r = src
        .call(ReadFileZRequest {
            path: path.to_string(),
            offset,
            max_bytes,
            compress: comp.is_some(),
            whole,
            confine: None,
        })
        .await?;
    if r.raw_len > max_bytes {
        return Err(RsbError::internal(format!(
            "read of {path}: {} bytes answered for {max_bytes} asked",
            r.raw_len
        )));
    }
    let Some((comp, skip)) = comp else {
        return Ok((r.data, r.truncated, r.settled));
    };
    if !r.compressed {
        if let Some(s) = skip.filter(|_| r.raw_len > 0) {
            s.store(true, Ordering::Relaxed);
        }
        return Ok((r.data, r.truncated, r.settled));
    }
    let raw = rsb_protocol::compress::decompress(&r.data, r.raw_len)
        .map_err(|m| RsbError::internal(format!("read of {path}: {m}")))?;
    comp.record(r.raw_len, r.data.len() as u64);
    Ok((raw, r.truncated, r.settled))
}

/// Read `[offset, offset + len)` of a large file, with `comp` compressing at the source
/// through [`read_z`].
async fn read_range(
    src: &AgentClient,
    path: &str,
    offset: u64,
    len: u64,
    comp: Option<(&Compress, Option<&std::sync::atomic::AtomicBool>)>,
) -> Result<Vec<u8>> {
    let comp = comp.filter(|c| c.0.at_source());
    let mut data = Vec::new();
    let mut off = offset;
    loop {
        let want = len - data.len() as u64;
        let chunk = match comp {
            Some(c) => {
                read_z(src, path, off, want.min(MAX_RAW as u64), false, Some(c))
                    .await?
                    .0
            }
            None => {
                src.call(ReadFileRequest {
                    path: path.to_string(),
                    offset: off,
                    max_bytes: want,
                    confine: None,
                })
                .await?
                .data
            }
        };
        let n = chunk.len() as u64;
        if data.is_empty() {
            data = chunk;
        } else {
            data.extend_from_slice(&chunk);
        }
        off += n;
        if data.len() as u64 >= len || n == 0 {
            return Ok(data);
        }
    }
}
