//! Reading a job's log while the job may still be appending to it.
//!
//! Both readers take the file size once and read only below it, so a reply never ends in the
//! middle of a write that had not finished when the request arrived, and `next_offset` is
//! always a byte the caller has not been given.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// What a read returns; mirrors the log fields of `JobStatusResult`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LogSlice {
    pub found: bool,
    pub data: Vec<u8>,
    pub start: u64,
    pub next_offset: u64,
    pub size: u64,
    pub truncated: bool,
}

const BLOCK: u64 = 64 * 1024;

/// Through [`crate::fs::open_regular`], like `read_file`: a `log_file` naming a FIFO must not
/// hang the request, and a device (`/dev/zero`) is an error, not an empty log.
fn open(path: &Path) -> std::io::Result<Option<(File, u64)>> {
    match crate::fs::open_regular(path) {
        Ok((f, meta)) => Ok(Some((f, meta.len()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Read exactly `len` bytes at `at`, or fewer if the file shrank meanwhile.
fn read_range(f: &File, at: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(got);
    Ok(buf)
}

/// Bytes `[offset, offset + max)` below the current size. Repeated calls with the returned
/// `next_offset` see every byte exactly once; `truncated` says more bytes remain. A cursor past the end (the log was truncated or
/// replaced) is clamped to the end, so the caller resumes with what is written from now on
/// rather than waiting forever for a size the file will never reach again.
pub fn read_cursor(path: &Path, offset: u64, max: u64) -> std::io::Result<LogSlice> {
    let Some((f, size)) = open(path)? else {
        return Ok(LogSlice {
            next_offset: offset,
            start: offset,
            ..LogSlice::default()
        });
    };
    let start = offset.min(size);
    let want = max.min(size - start);
    let data = read_range(&f, start, want)?;
    let next = start + data.len() as u64;
    Ok(LogSlice {
        found: true,
        start,
        next_offset: next,
        size,
        truncated: next < size,
        data,
    })
}

/// The last `lines` lines at or after `floor` (the start of the current run, so a rerun that
/// appends to the same log never shows the previous run's `EXIT_CODE`), at most `max` bytes.
/// When the cap cuts, the *newest* bytes are kept, because that is where a finished job's
/// `EXIT_CODE=` line is; the cut is moved forward to a line start when one is in reach so the
/// first line is never a fragment. `truncated` says the cap cut the requested lines.
pub fn read_tail(path: &Path, lines: u32, max: u64, floor: u64) -> std::io::Result<LogSlice> {
    let Some((f, size)) = open(path)? else {
        return Ok(LogSlice::default());
    };
    let floor = floor.min(size);
    let mut slice = LogSlice {
        found: true,
        start: size,
        next_offset: size,
        size,
        ..LogSlice::default()
    };
    if lines == 0 || max == 0 || size == floor {
        slice.truncated = max == 0 && lines > 0 && size > floor;
        return Ok(slice);
    }
    // Scan backwards for the newline that precedes the wanted lines. A newline that ends the
    // file terminates the last line rather than starting an empty one.
    let mut newlines_needed = lines as u64
        + if last_byte_is_newline(&f, size)? {
            1
        } else {
            0
        };
    let mut start = floor;
    let mut pos = size;
    // Lines that begin more than `max` bytes from the end would be cut anyway.
    let low = floor.max(size.saturating_sub(max.saturating_add(1)));
    'scan: while pos > low {
        let from = pos.saturating_sub(BLOCK).max(low);
        let block = read_range(&f, from, pos - from)?;
        for (i, &b) in block.iter().enumerate().rev() {
            if b == b'\n' {
                newlines_needed -= 1;
                if newlines_needed == 0 {
                    start = from + i as u64 + 1;
                    break 'scan;
                }
            }
        }
        pos = from;
    }
    let mut truncated = false;
    if size - start > max {
        truncated = true;
        start = size - max;
    }
    let mut data = read_range(&f, start, size - start)?;
    if truncated
        && let Some(nl) = data.iter().position(|&b| b == b'\n')
        && nl + 1 < data.len()
    {
        data.drain(..=nl);
        start += nl as u64 + 1;
    }
    slice.start = start;
    slice.truncated = truncated;
    slice.data = data;
    Ok(slice)
}

fn last_byte_is_newline(f: &File, size: u64) -> std::io::Result<bool> {
    Ok(size > 0 && read_range(f, size - 1, 1)? == b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(data: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        std::fs::write(&p, data).unwrap();
        (dir, p)
    }

    #[test]
    fn tail_counts_lines_from_the_end() {
        let (_d, p) = file_with(b"a\nb\nc\nd\n");
        let s = read_tail(&p, 2, 1 << 20, 0).unwrap();
        assert_eq!(s.data, b"c\nd\n");
        assert_eq!(
            (s.start, s.next_offset, s.size, s.truncated),
            (4, 8, 8, false)
        );
        let s = read_tail(&p, 10, 1 << 20, 0).unwrap();
        assert_eq!(s.data, b"a\nb\nc\nd\n");
        assert_eq!(s.start, 0);
    }

    #[test]
    fn tail_includes_unterminated_last_line() {
        let (_d, p) = file_with(b"a\nb\nprogress 50%");
        let s = read_tail(&p, 2, 1 << 20, 0).unwrap();
        assert_eq!(s.data, b"b\nprogress 50%");
    }

    #[test]
    fn tail_respects_the_run_floor() {
        let (_d, p) = file_with(b"old\nEXIT_CODE=0\nnew\n");
        let s = read_tail(&p, 50, 1 << 20, 16).unwrap();
        assert_eq!(s.data, b"new\n");
        assert_eq!(s.start, 16);
    }

    #[test]
    fn tail_cap_keeps_the_newest_bytes_and_the_exit_line() {
        let mut data = vec![b'x'; 30_000];
        data.extend_from_slice(b"\nEXIT_CODE=0\n");
        let (_d, p) = file_with(&data);
        let s = read_tail(&p, 50, 20_000, 0).unwrap();
        assert!(s.truncated);
        assert_eq!(s.data, b"EXIT_CODE=0\n", "cut moved to a line start");
        assert_eq!(s.start, 30_001);
        // One huge line with no newline inside the window: keep the raw tail.
        let (_d2, p2) = file_with(&vec![b'y'; 100_000]);
        let s = read_tail(&p2, 5, 1000, 0).unwrap();
        assert_eq!(s.data.len(), 1000);
        assert_eq!(s.start, 99_000);
        assert!(s.truncated);
    }

    #[test]
    fn tail_over_many_blocks() {
        let mut data = Vec::new();
        for i in 0..50_000 {
            data.extend_from_slice(format!("line {i}\n").as_bytes());
        }
        let (_d, p) = file_with(&data);
        let s = read_tail(&p, 3, 1 << 20, 0).unwrap();
        assert_eq!(s.data, b"line 49997\nline 49998\nline 49999\n");
        let s = read_tail(&p, 20_000, 1 << 20, 0).unwrap();
        assert!(s.data.starts_with(b"line 30000\n"));
        assert!(!s.truncated);
    }

    #[test]
    fn cursor_pieces_concatenate_to_the_file() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let (_d, p) = file_with(&data);
        let mut got = Vec::new();
        let mut off = 0;
        loop {
            let s = read_cursor(&p, off, 777).unwrap();
            assert_eq!(s.start, off);
            got.extend_from_slice(&s.data);
            off = s.next_offset;
            if !s.truncated {
                break;
            }
        }
        assert_eq!(got, data);
        let s = read_cursor(&p, 50_000, 10).unwrap();
        assert_eq!((s.start, s.next_offset, s.data.len()), (10_000, 10_000, 0));
    }

    #[test]
    fn missing_log_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("nope");
        assert!(!read_tail(&p, 5, 100, 0).unwrap().found);
        let s = read_cursor(&p, 7, 100).unwrap();
        assert!(!s.found);
        assert_eq!(s.next_offset, 7);
    }
}
