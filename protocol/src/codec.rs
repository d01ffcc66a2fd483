//! Frame codec: a 4-byte big-endian length, then one bincode-encoded message.
//!
//! This is the only module that knows the encoding. The same limit applies to encode and decode
//! on both sides, so an oversized message fails at the sender with a clear error rather than
//! killing the channel at the receiver.

use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};
use tokio_util::codec::LengthDelimitedCodec;

/// Largest frame either side accepts.
pub const MAX_FRAME: usize = 16 * 1024 * 1024;
/// Bulk data (file bytes, command output) moves in pieces no larger than this, so one big
/// transfer cannot monopolise the channel and stall a concurrent small request.
pub const MAX_CHUNK: usize = 256 * 1024;

type Config = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_FRAME>,
>;
const CFG: Config = bincode::config::standard().with_limit::<MAX_FRAME>();

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("cannot encode frame: {0}")]
    Encode(String),
    #[error("malformed frame: {0}")]
    Decode(String),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
}

/// The length-delimited framing used on the agent channel.
pub fn frame_codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_type::<u32>()
        .max_frame_length(MAX_FRAME)
        .new_codec()
}

/// Encode one message body (without the length prefix; the framing adds it).
pub fn encode<T: Serialize>(msg: &T) -> Result<Bytes, CodecError> {
    let v =
        bincode::serde::encode_to_vec(msg, CFG).map_err(|e| CodecError::Encode(e.to_string()))?;
    if v.len() > MAX_FRAME {
        return Err(CodecError::TooLarge(v.len()));
    }
    Ok(Bytes::from(v))
}

/// A running blake3 over manifest entries in walk order, each as its bincode encoding: what a
/// [`crate::ManifestRequest::expect`] names. The caller computes it over the entries it holds,
/// the agent over those it would send, so equal digests mean equal entries whoever sent them.
#[derive(Default, Clone)]
pub struct ManifestDigest {
    hasher: blake3::Hasher,
    /// Encoded entries not yet hashed: blake3 is several times faster over a few KB at once
    /// than over each entry's dozen small writes.
    buf: Vec<u8>,
}

impl ManifestDigest {
    pub fn add(&mut self, entry: &crate::ManifestEntry) {
        // Writing into a Vec cannot fail, and an entry is far below the frame limit.
        let _ = bincode::serde::encode_into_std_write(entry, &mut self.buf, CFG);
        if self.buf.len() >= 16 * 1024 {
            self.hasher.update(&self.buf);
            self.buf.clear();
        }
    }

    pub fn finish(&self) -> [u8; 32] {
        let mut h = self.hasher.clone();
        h.update(&self.buf);
        *h.finalize().as_bytes()
    }

    /// The digest of `entries`, in order.
    pub fn of(entries: &[crate::ManifestEntry]) -> [u8; 32] {
        let mut d = ManifestDigest::default();
        entries.iter().for_each(|e| d.add(e));
        d.finish()
    }
}

/// Decode one message body. Trailing bytes are an error: they mean the peers disagree on shape.
pub fn decode<T: DeserializeOwned>(buf: &[u8]) -> Result<T, CodecError> {
    let (v, used) = bincode::serde::decode_from_slice(buf, CFG)
        .map_err(|e| CodecError::Decode(e.to_string()))?;
    if used != buf.len() {
        return Err(CodecError::Decode(format!(
            "{} trailing bytes after a {used}-byte message",
            buf.len() - used
        )));
    }
    Ok(v)
}
