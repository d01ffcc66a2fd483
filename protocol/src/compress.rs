//! Compression of file bytes on slow links: zstd at a fast level, via the `zstd` crate
//! (libzstd, compiled for each musl target by the cc crate; about 250 KiB in the agent with
//! the decoder and the fast levels).
//!
//! What is compressed is chosen per payload rather than the SSH connection as a whole
//! (russh's zlib): control frames (exec, pings) never wait behind a compressor, and a fast
//! link simply sends nothing compressed. An upload is one stream per apply session
//! ([`StreamEncoder`], [`crate::ApplyOp::Stream`]): every batch of small files and every
//! large file's chunk has all that went before as context. A download's read and a manifest
//! are single frames ([`compress`]).

use std::cell::RefCell;

/// zstd level of single frames (a download's read, a manifest), chosen by measurement on the
/// benchmark's source-text tree (1 MiB batches,
/// one core of the benchmark host): level 1 gives a ratio of 0.31 at 230 MB/s, level 3 0.29
/// at 175 MB/s, level 6 0.27 at 60 MB/s, level 9 0.27 at 26 MB/s. Level 3 keeps a
/// 50 Mbit/s link the bottleneck with a quarter of a core; the higher levels buy 2–3 % of
/// the bytes for three to seven times the CPU, which the destination's agent and sshd share.
pub const LEVEL: i32 = 3;

/// The most bytes one compressed payload or stream piece may inflate to (a batch of small
/// files, at most 2 MiB of file bytes plus their ops, is the largest piece; a download reads
/// at most this much per request). A claimed `raw_len` above this is refused before anything is allocated.
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

/// The zstd level of an upload's stream ([`StreamEncoder`]), chosen by measurement on the
/// benchmark's 42.7 MB source-text tree as one stream (one core of the benchmark host):
/// level 1 gives 8.83 MB at 420 MB/s, level 3 8.00 MB at 300 MB/s, level 6 7.50 MB at
/// 100 MB/s, level 9 6.58 MB at 65 MB/s. With [`STREAM_WINDOW_LOG`] level 3 gives 7.16 MB at
/// the same 300 MB/s: past a few MiB the window, not the search effort, is what finds the
/// repeats between files. Level 3 keeps even a gigabit link the bottleneck.
pub const STREAM_LEVEL: i32 = 3;

/// log2 of the upload stream's window: 8 MiB (level 3 defaults to 2 MiB). The decoder holds
/// this much per session and refuses a stream that asks for more.
pub const STREAM_WINDOW_LOG: u32 = 23;

fn zstd_error(code: usize) -> String {
    zstd::zstd_safe::get_error_name(code).to_string()
}

/// The sending end of one apply session's upload stream: a single zstd frame that runs for
/// the whole session, flushed at the end of every piece so that the receiver can decode each
/// piece as it arrives. Every piece has all earlier ones as context (the small files of one
/// batch and of every batch before it), which is what makes a source tree compress as a
/// tarball does rather than file by file. Pieces must reach the receiver in the order they
/// were made.
pub struct StreamEncoder {
    cctx: zstd::zstd_safe::CCtx<'static>,
    /// Raw bytes fed so far: the position of the next piece.
    pos: u64,
}

impl StreamEncoder {
    pub fn new() -> Result<StreamEncoder, String> {
        use zstd::zstd_safe::CParameter;
        let mut cctx = zstd::zstd_safe::CCtx::try_create()
            .ok_or_else(|| "zstd could not allocate a compression context".to_string())?;
        for p in [
            CParameter::CompressionLevel(STREAM_LEVEL),
            CParameter::WindowLog(STREAM_WINDOW_LOG),
            CParameter::EnableLongDistanceMatching(false),
            CParameter::ChecksumFlag(false),
        ] {
            cctx.set_parameter(p).map_err(zstd_error)?;
        }
        Ok(StreamEncoder { cctx, pos: 0 })
    }

    /// Compress `raw` (at most [`MAX_RAW`] bytes) as the stream's next piece: `(pos, bytes)`,
    /// where `pos` is the stream position the piece starts at (what the receiver checks).
    /// After an error the stream is unusable: the session must end.
    pub fn piece(&mut self, raw: &[u8]) -> Result<(u64, Vec<u8>), String> {
        use zstd::zstd_safe::{InBuffer, OutBuffer, zstd_sys::ZSTD_EndDirective};
        if raw.len() > MAX_RAW {
            return Err(format!(
                "a stream piece of {} bytes is over the {MAX_RAW}-byte limit",
                raw.len()
            ));
        }
        let mut out: Vec<u8> = Vec::with_capacity(zstd::zstd_safe::compress_bound(raw.len()) + 64);
        let mut input = InBuffer::around(raw);
        // Bounded: the output has room for the whole piece, so one call normally finishes
        // it; each further round gets more room.
        for _ in 0..64 {
            if out.capacity() - out.len() < 1024 {
                out.reserve(64 * 1024);
            }
            let len = out.len();
            let mut output = OutBuffer::around_pos(&mut out, len);
            let left = self
                .cctx
                .compress_stream2(&mut output, &mut input, ZSTD_EndDirective::ZSTD_e_flush)
                .map_err(zstd_error)?;
            if left == 0 && input.pos() == raw.len() {
                let pos = self.pos;
                self.pos += raw.len() as u64;
                return Ok((pos, out));
            }
        }
        Err("zstd did not finish a stream piece".into())
    }
}

/// The receiving end of an upload stream ([`StreamEncoder`]). Output is bounded by each
/// piece's claimed length (itself at most [`MAX_RAW`]) and the window by
/// [`STREAM_WINDOW_LOG`], so a lying length or a bomb is an error, never an unbounded
/// allocation. After any error the decoder refuses every later piece: the stream's state is
/// lost with the piece.
pub struct StreamDecoder {
    dctx: zstd::zstd_safe::DCtx<'static>,
    pos: u64,
    broken: Option<String>,
}

impl StreamDecoder {
    pub fn new() -> Result<StreamDecoder, String> {
        let mut dctx = zstd::zstd_safe::DCtx::try_create()
            .ok_or_else(|| "zstd could not allocate a decompression context".to_string())?;
        dctx.set_parameter(zstd::zstd_safe::DParameter::WindowLogMax(STREAM_WINDOW_LOG))
            .map_err(zstd_error)?;
        Ok(StreamDecoder {
            dctx,
            pos: 0,
            broken: None,
        })
    }

    /// Decode the piece made at stream position `pos`, which must inflate to exactly
    /// `raw_len` bytes.
    pub fn piece(&mut self, pos: u64, data: &[u8], raw_len: u64) -> Result<Vec<u8>, String> {
        if let Some(b) = &self.broken {
            return Err(format!("the stream broke earlier ({b})"));
        }
        let r = self.decode(pos, data, raw_len);
        if let Err(e) = &r {
            self.broken = Some(e.clone());
        }
        r
    }

    /// Mark the stream broken for a reason found in what a piece decoded to.
    pub fn poison(&mut self, why: String) {
        self.broken.get_or_insert(why);
    }

    fn decode(&mut self, pos: u64, data: &[u8], raw_len: u64) -> Result<Vec<u8>, String> {
        use zstd::zstd_safe::{InBuffer, OutBuffer};
        if pos != self.pos {
            return Err(format!(
                "a piece for stream position {pos} arrived at position {} (out of order)",
                self.pos
            ));
        }
        if raw_len > MAX_RAW as u64 {
            return Err(format!(
                "a stream piece claims {raw_len} bytes, more than the {MAX_RAW}-byte limit"
            ));
        }
        let want = raw_len as usize;
        // One byte of room past the claim: a piece that fills it inflates to more than it said.
        let mut out: Vec<u8> = Vec::with_capacity(want + 1);
        let mut input = InBuffer::around(data);
        loop {
            let before = (input.pos(), out.len());
            let len = out.len();
            let mut output = OutBuffer::around_pos(&mut out, len);
            self.dctx
                .decompress_stream(&mut output, &mut input)
                .map_err(|c| format!("corrupt stream piece: {}", zstd_error(c)))?;
            if out.len() > want {
                return Err(format!(
                    "a stream piece inflates to more than the {want} bytes claimed"
                ));
            }
            if (input.pos(), out.len()) == before {
                break;
            }
        }
        if input.pos() != data.len() || out.len() != want {
            return Err(format!(
                "a stream piece inflates to {} bytes, not the {want} claimed",
                out.len()
            ));
        }
        self.pos += raw_len;
        Ok(out)
    }
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

    fn text(seed: u32, n: u32) -> Vec<u8> {
        (0..n)
            .flat_map(|i| format!("fn f{seed}_{i}() {{ return {}; }}\n", i % 13).into_bytes())
            .collect()
    }

    #[test]
    fn stream_pieces_roundtrip_with_earlier_pieces_as_context() {
        let mut enc = StreamEncoder::new().unwrap();
        let mut dec = StreamDecoder::new().unwrap();
        let a = text(1, 5_000);
        let (pos, za) = enc.piece(&a).unwrap();
        assert_eq!(pos, 0);
        assert_eq!(dec.piece(0, &za, a.len() as u64).unwrap(), a);
        // The same bytes again cost almost nothing: the stream remembers them.
        let (pos, zb) = enc.piece(&a).unwrap();
        assert_eq!(pos, a.len() as u64);
        assert!(zb.len() < 200, "{} bytes for a repeat", zb.len());
        assert_eq!(dec.piece(pos, &zb, a.len() as u64).unwrap(), a);
        // Empty and incompressible pieces pass too.
        let (pos, ze) = enc.piece(&[]).unwrap();
        assert_eq!(dec.piece(pos, &ze, 0).unwrap(), Vec::<u8>::new());
        let mut x = 0x9e37_79b9u32;
        let rnd: Vec<u8> = (0..300_000)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect();
        let (pos, zr) = enc.piece(&rnd).unwrap();
        assert!(zr.len() < rnd.len() + 1024);
        assert_eq!(dec.piece(pos, &zr, rnd.len() as u64).unwrap(), rnd);
        assert!(enc.piece(&vec![0u8; MAX_RAW + 1]).is_err());
    }

    #[test]
    fn a_stream_piece_out_of_order_lying_or_corrupt_breaks_the_stream() {
        let a = text(2, 4_000);
        let b = text(3, 4_000);
        let mut enc = StreamEncoder::new().unwrap();
        let (_, za) = enc.piece(&a).unwrap();
        let (pb, zb) = enc.piece(&b).unwrap();
        // The second piece first: refused by position, and the stream stays broken.
        let mut dec = StreamDecoder::new().unwrap();
        let e = dec.piece(pb, &zb, b.len() as u64).unwrap_err();
        assert!(e.contains("out of order"), "{e}");
        let e = dec.piece(0, &za, a.len() as u64).unwrap_err();
        assert!(e.contains("broke earlier"), "{e}");
        // A length one short, one long, over the limit, and bytes that are not zstd.
        for (data, len, needle) in [
            (&za, a.len() as u64 - 1, "more than"),
            (&za, a.len() as u64 + 1, "not the"),
            (&za, MAX_RAW as u64 + 1, "limit"),
        ] {
            let mut dec = StreamDecoder::new().unwrap();
            let e = dec.piece(0, data, len).unwrap_err();
            assert!(e.contains(needle), "{needle}: {e}");
        }
        let mut dec = StreamDecoder::new().unwrap();
        assert!(dec.piece(0, b"not zstd at all, at all", 10).is_err());
        // A bomb: 4 MiB of zeros claimed as 64 KiB.
        let mut enc = StreamEncoder::new().unwrap();
        let (_, zz) = enc.piece(&vec![0u8; MAX_RAW]).unwrap();
        let mut dec = StreamDecoder::new().unwrap();
        assert!(dec.piece(0, &zz, 64 * 1024).is_err());
    }

    #[test]
    fn a_stream_whose_window_is_larger_than_allowed_is_refused() {
        use zstd::zstd_safe::CParameter;
        // A stream (no size known up front) that declares a 32 MiB window: the decoder must
        // refuse it rather than allocate the window.
        let big = text(4, 400_000);
        let mut dec = StreamDecoder::new().unwrap();
        let mut cctx = zstd::zstd_safe::CCtx::create();
        cctx.set_parameter(CParameter::WindowLog(25)).unwrap();
        let mut out = Vec::with_capacity(MAX_RAW);
        let mut input = zstd::zstd_safe::InBuffer::around(&big[..MAX_RAW]);
        let mut output = zstd::zstd_safe::OutBuffer::around(&mut out);
        cctx.compress_stream2(
            &mut output,
            &mut input,
            zstd::zstd_safe::zstd_sys::ZSTD_EndDirective::ZSTD_e_flush,
        )
        .unwrap();
        let e = dec.piece(0, &out, MAX_RAW as u64).unwrap_err();
        assert!(e.contains("corrupt"), "{e}");
    }
}
