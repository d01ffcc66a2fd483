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
