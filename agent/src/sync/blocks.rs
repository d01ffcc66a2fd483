//! `BlockHashes`: blake3 of each fixed-size block of a file, for block deltas.

use crate::confine::own_reads;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};

use rsb_protocol::{AgentError, BlockHashesRequest, BlockHashesResult, ErrorCode, MAX_FRAME};
use tokio_util::sync::CancellationToken;

use super::cancelled;
use super::hash::hash_threads;
use crate::util::{expand_home, path_string};

pub const MIN_BLOCK: u64 = 4 * 1024;
pub const MAX_BLOCK: u64 = 64 * 1024 * 1024;
/// Hashes that fit one reply frame with room to spare (32 bytes each).
pub const MAX_BLOCKS: u64 = (MAX_FRAME as u64 - 64 * 1024) / 32;
/// Read size within a block.
const READ: usize = 1024 * 1024;

pub fn block_hashes(
    req: &BlockHashesRequest,
    cancel: &CancellationToken,
) -> Result<BlockHashesResult, AgentError> {
    let path = expand_home(&req.path);
    own_reads(req.confine.as_ref(), &path, || block_hashes_in(req, cancel))
}

fn block_hashes_in(
    req: &BlockHashesRequest,
    cancel: &CancellationToken,
) -> Result<BlockHashesResult, AgentError> {
    let bs = req.block_size;
    if !(MIN_BLOCK..=MAX_BLOCK).contains(&bs) {
        return Err(AgentError::new(
            ErrorCode::InvalidArgument,
            format!("block_size {bs} is out of range ({MIN_BLOCK} to {MAX_BLOCK} bytes)"),
        ));
    }
    let path = expand_home(&req.path);
    let shown = path_string(&path);
    let io_err = |e: std::io::Error| AgentError::from_io(&e, "block_hashes", &shown);
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&path)
        .map_err(io_err)?;
    let meta = file.metadata().map_err(io_err)?;
    if !meta.is_file() {
        return Err(AgentError::new(
            ErrorCode::InvalidArgument,
            format!("block_hashes {shown}: not a regular file"),
        ));
    }
    let size = meta.len();
    let blocks = size.div_ceil(bs);
    if blocks > MAX_BLOCKS {
        return Err(AgentError::new(
            ErrorCode::InvalidArgument,
            format!(
                "block_hashes {shown}: {blocks} blocks of {bs} bytes exceed the {MAX_BLOCKS}-block \
                 limit; use a larger block_size"
            ),
        ));
    }
    let blocks = blocks as usize;
    let mut hashes = vec![[0u8; 32]; blocks];
    let result = hash_blocks(&file, bs, size, &mut hashes, cancel);
    if cancel.is_cancelled() {
        return Err(cancelled());
    }
    let changed = || {
        AgentError::new(
            ErrorCode::Io,
            format!("block_hashes {shown}: the file changed while it was being hashed; re-run"),
        )
    };
    result.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            changed()
        } else {
            io_err(e)
        }
    })?;
    let after = file.metadata().map_err(io_err)?;
    if after.len() != size || after.modified().ok() != meta.modified().ok() {
        return Err(changed());
    }
    Ok(BlockHashesResult { size, hashes })
}

/// Hash the `out.len()` blocks of `bs` bytes from the start of `file` (the last one may end
/// at `size`), in parallel.
pub fn hash_blocks(
    file: &File,
    bs: u64,
    size: u64,
    out: &mut [[u8; 32]],
    cancel: &CancellationToken,
) -> std::io::Result<()> {
    let blocks = out.len();
    if blocks == 0 {
        return Ok(());
    }
    let workers = hash_threads().min(blocks).max(1);
    // Contiguous ranges per thread keep each thread's reads sequential (read-ahead).
    let per = blocks.div_ceil(workers).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = out
            .chunks_mut(per)
            .enumerate()
            .map(|(t, out)| {
                s.spawn(move || hash_range(file, (t * per) as u64, bs, size, out, cancel))
            })
            .collect();
        // The scope joins whatever is left after an early error.
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("worker panicked")))
        })
    })
}

fn hash_range(
    file: &File,
    first: u64,
    bs: u64,
    size: u64,
    out: &mut [[u8; 32]],
    cancel: &CancellationToken,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; READ.min(bs as usize)];
    for (i, slot) in out.iter_mut().enumerate() {
        if cancel.is_cancelled() {
            return Ok(());
        }
        let start = (first + i as u64) * bs;
        let end = (start + bs).min(size);
        let mut hasher = blake3::Hasher::new();
        let mut off = start;
        while off < end {
            let want = ((end - off) as usize).min(buf.len());
            file.read_exact_at(&mut buf[..want], off)?;
            hasher.update(&buf[..want]);
            off += want as u64;
        }
        *slot = *hasher.finalize().as_bytes();
    }
    Ok(())
}
