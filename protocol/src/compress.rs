//! Per-payload compression of file bytes on slow links: zstd frames at a fast level, via the
//! `zstd` crate (libzstd, compiled for each musl target by the cc crate; about 250 KiB in the
//! agent with the decoder and the fast levels).
//!
//! Each payload is compressed on its own rather than the SSH connection as a whole (russh's
//! zlib): the sender keeps bytes that do not shrink raw, control frames (exec, pings) never
//! wait behind a compressor, and a fast link simply sends nothing compressed. A payload is a
//! whole batch of small files ([`crate::ApplyOp::Packed`]), a large file's chunk, a download's
//! read or a manifest, so the context a frame sees is up to a few MiB of neighbouring files.

use std::cell::RefCell;

/// zstd level, chosen by measurement on the benchmark's source-text tree (1 MiB batches,
/// one core of the benchmark host): level 1 gives a ratio of 0.31 at 230 MB/s, level 3 0.29
/// at 175 MB/s, level 6 0.27 at 60 MB/s, level 9 0.27 at 26 MB/s. Level 3 keeps a
/// 50 Mbit/s link the bottleneck with a quarter of a core; the higher levels buy 2–3 % of
/// the bytes for three to seven times the CPU, which the destination's agent and sshd share.
pub const LEVEL: i32 = 3;

/// The most bytes one compressed payload may inflate to (a batch of small files, at most
/// 1 MiB of file bytes plus their ops, is the largest payload; a large file travels in
/// 256 KiB chunks). A claimed `raw_len` above this is refused before anything is allocated.
pub const MAX_RAW: usize = 4 * 1024 * 1024;

/// A payload worth sending compressed saves at least this share of its bytes (1/`SAVE_DIV`);
/// below that, the receiver's work buys too little.
pub const SAVE_DIV: usize = 10;

thread_local! {
    /// One compression context per thread, reused: a fresh one costs an allocation of a few
    /// hundred KiB per payload. Long-distance matching stays off (its window is larger than
    /// any payload; it would only cost memory).
    static CCTX: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
}

/// Compress `data`; `None` when it does not shrink by at least 1/[`SAVE_DIV`] (send it raw),
/// or when libzstd fails (the payload then travels raw as well).
pub fn compress(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < 64 {
        return None;
    }
    let z = CCTX.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            let mut z = zstd::bulk::Compressor::new(LEVEL).ok()?;
            z.set_parameter(zstd::zstd_safe::CParameter::EnableLongDistanceMatching(
                false,
            ))
            .ok()?;
            *c = Some(z);
        }
        c.as_mut()?.compress(data).ok()
    })?;
    (z.len() <= data.len() - data.len() / SAVE_DIV).then_some(z)
}

/// Decompress `data`, which must yield exactly `raw_len` bytes. Output is bounded by
/// `raw_len` (itself at most [`MAX_RAW`]): a lying length or a zstd bomb is an error, never
/// an unbounded allocation.
pub fn decompress(data: &[u8], raw_len: u64) -> Result<Vec<u8>, String> {
    if raw_len > MAX_RAW as u64 {
        return Err(format!(
            "compressed payload claims {raw_len} bytes, more than the {MAX_RAW}-byte limit"
        ));
    }
    let raw_len = raw_len as usize;
    let out = zstd::bulk::decompress(data, raw_len)
        .map_err(|e| format!("corrupt compressed payload (or larger than {raw_len} bytes): {e}"))?;
    if out.len() != raw_len {
        return Err(format!(
            "compressed payload decompresses to {} bytes, not the {raw_len} claimed",
            out.len()
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_incompressible() {
        let text: Vec<u8> = (0..20_000u32)
            .flat_map(|i| format!("line {i} value {}\n", i * 7 % 113).into_bytes())
            .collect();
        let z = compress(&text).expect("text compresses");
        assert!(z.len() < text.len() / 3);
        assert_eq!(decompress(&z, text.len() as u64).unwrap(), text);
        // Pseudo-random bytes do not shrink: sent raw.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let rnd: Vec<u8> = (0..100_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(compress(&rnd).is_none());
    }

    #[test]
    fn bomb_and_lying_length_are_errors() {
        // 4 MiB of zeros compresses to some KiB; claiming less must fail, not allocate more.
        let zeros = vec![0u8; MAX_RAW];
        let z = compress(&zeros).unwrap();
        assert!(z.len() < 64 * 1024);
        assert!(decompress(&z, 1024).is_err());
        assert!(decompress(&z, MAX_RAW as u64 - 1).is_err());
        assert_eq!(decompress(&z, MAX_RAW as u64).unwrap().len(), MAX_RAW);
        // Claiming more than it holds is an error too, as is more than the limit.
        assert!(decompress(&z, MAX_RAW as u64 + 1).is_err());
        assert!(decompress(&compress(&[7u8; 1000]).unwrap(), 2000).is_err());
        assert!(decompress(b"not zstd at all, not at all", 100).is_err());
        assert!(decompress(&z, u64::MAX).is_err());
    }
}
