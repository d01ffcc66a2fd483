//! A sync's source reads on a slow link: `ReadFile`, deflated when that pays.

use rsb_protocol::{
    AgentError, ReadFileRequest, ReadFileZRequest, ReadFileZResult,
    compress::{MAX_RAW, compress},
};

/// Read as `ReadFile` does (at most [`MAX_RAW`] bytes) and deflate the bytes when they shrink
/// by a tenth; the local side inflates them, bounded by `raw_len`.
pub fn read_file_z(req: &ReadFileZRequest) -> Result<ReadFileZResult, AgentError> {
    let r = crate::fs::read_file(&ReadFileRequest {
        path: req.path.clone(),
        offset: req.offset,
        max_bytes: req.max_bytes.min(MAX_RAW as u64),
    })?;
    let raw_len = r.data.len() as u64;
    let (compressed, data) = match compress(&r.data) {
        Some(z) => (true, z),
        None => (false, r.data),
    };
    Ok(ReadFileZResult {
        raw_len,
        compressed,
        data,
        truncated: r.truncated,
    })
}
