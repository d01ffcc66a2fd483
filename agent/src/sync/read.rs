//! A sync's source reads: `ReadFile`, compressed when asked and when that pays, and for a
//! small file, one version of it.

use std::{io::Read, path::Path, time::Duration};

use rsb_protocol::{
    AgentError, ReadFileRequest, ReadFileZRequest, ReadFileZResult,
    compress::{MAX_RAW, compress},
};

use super::{cache::Key, fs_clock_ns};

/// Tries at one version before a small file is answered as unsettled (as the scan's).
const WHOLE_ATTEMPTS: usize = 3;
/// Between tries: past the coarse clock's tick (4 ms at HZ=250), so a file last changed in
/// the tick a read began can settle on the next.
const RETRY_AFTER: Duration = Duration::from_millis(5);
/// How long a write may still be copying after it set the ctime: the kernel stamps the time
/// when a write begins, so a read that began a tick later can still overlap that write's copy
/// and see two versions with the identity unchanged across it. A file is read as one version
/// only once its last change is this much older than the read (a 1 MiB write copies in well
/// under a millisecond; the resume test once committed such a mix).
const IN_FLIGHT: Duration = Duration::from_millis(20);
/// How far the coarse clock can trail real time: one tick (10 ms at HZ=100).
const CLOCK_LAG: Duration = Duration::from_millis(10);
/// The longest wait for a change to age before the next try.
const MAX_WAIT: Duration = Duration::from_millis(50);

/// Read as `ReadFile` does (at most [`MAX_RAW`] bytes); compress the bytes when asked and
/// they shrink by a tenth; the local side decompresses them, bounded by `raw_len`.
pub fn read_file_z(req: &ReadFileZRequest) -> Result<ReadFileZResult, AgentError> {
    let path = crate::util::expand_home(&req.path);
    crate::confine::own_reads(req.confine.as_ref(), &path, || read_file_z_in(req))
}

fn read_file_z_in(req: &ReadFileZRequest) -> Result<ReadFileZResult, AgentError> {
    let max = req.max_bytes.min(MAX_RAW as u64);
    let (data, truncated, settled) = if req.whole {
        read_whole(&req.path, req.offset, max)?
    } else {
        let r = crate::fs::read_file(&ReadFileRequest {
            path: req.path.clone(),
            offset: req.offset,
            max_bytes: max,
            // Checked (and confined) by `read_file_z` already.
            confine: None,
        })?;
        (r.data, r.truncated, false)
    };
    let raw_len = data.len() as u64;
    let (compressed, data) = match req.compress.then(|| compress(&data)).flatten() {
        Some(z) => (true, z),
        None => (false, data),
    };
    Ok(ReadFileZResult {
        raw_len,
        compressed,
        data,
        truncated,
        settled,
    })
}

/// A file's bytes as [`read_one_version`] read them.
#[derive(Debug)]
pub struct OneVersion {
    pub data: Vec<u8>,
    /// More bytes follow `offset + data.len()`.
    pub truncated: bool,
    /// The bytes are one version of the file; false when it kept changing during every try
    /// (the bytes are then the last try's).
    pub settled: bool,
}

/// `path` from `offset` (at most `max` bytes), read until its identity held across a read
/// that began in a later clock tick than its last change (see [`Key::settled`]): a write
/// during the read changes the ctime (no one can set it), and one in the tick the read began
/// could leave it equal, so that tick is waited out. The sync's reads at the source and
/// `--watch`'s local reads both use this, so neither commits a file torn by a writer.
pub fn read_one_version(path: &Path, offset: u64, max: u64) -> std::io::Result<OneVersion> {
    let mut last = None;
    let in_flight = IN_FLIGHT.as_nanos() as i64;
    let mut wait = Duration::ZERO;
    for attempt in 0..WHOLE_ATTEMPTS {
        if attempt > 0 {
            std::thread::sleep(wait.max(RETRY_AFTER));
        }
        let clock = fs_clock_ns();
        let (data, truncated, before, after) = read_once(path, offset, max)?;
        let whole = truncated || offset + data.len() as u64 == before.size;
        if before == after && whole && before.settled(clock.saturating_sub(in_flight)) {
            return Ok(OneVersion {
                data,
                truncated,
                settled: true,
            });
        }
        // Changed a moment ago (and not since): read again once the change is old enough by
        // the coarse clock, which lags real time by up to a tick while a change's ctime can
        // be fine-grained (multigrain timestamps, Linux 6.13+). A whole-second file system's
        // two-second margin is not waited out: its read stays unsettled.
        wait = wait_to_settle(&after, clock);
        last = Some((data, truncated));
    }
    let (data, truncated) = last.expect("at least one attempt");
    Ok(OneVersion {
        data,
        truncated,
        settled: false,
    })
}

/// How long to sleep after reading `key` at coarse `clock` so that a read then begins past
/// its settle point plus [`IN_FLIGHT`], however far the coarse clock trails (bounded by
/// [`MAX_WAIT`]).
fn wait_to_settle(key: &Key, clock: i64) -> Duration {
    let due = key
        .settles_at()
        .saturating_add(IN_FLIGHT.as_nanos() as i64)
        .saturating_sub(clock);
    Duration::from_nanos(due.clamp(0, MAX_WAIT.as_nanos() as i64) as u64) + CLOCK_LAG
}

fn read_whole(path: &str, offset: u64, max: u64) -> Result<(Vec<u8>, bool, bool), AgentError> {
    let path = crate::util::expand_home(path);
    let shown = crate::util::path_string(&path);
    let r = read_one_version(&path, offset, max)
        .map_err(|e| AgentError::from_io(&e, "read_file", &shown))?;
    Ok((r.data, r.truncated, r.settled))
}

fn read_once(path: &Path, offset: u64, max: u64) -> std::io::Result<(Vec<u8>, bool, Key, Key)> {
    use std::io::{Seek, SeekFrom};
    let (mut file, meta) = crate::fs::open_regular(path)?;
    let before = Key::of(&meta);
    file.seek(SeekFrom::Start(offset))?;
    let expected = before.size.saturating_sub(offset).min(max) + 1;
    let mut data = Vec::with_capacity(expected as usize);
    (&mut file).take(max + 1).read_to_end(&mut data)?;
    let after = Key::of(&file.metadata()?);
    let truncated = data.len() as u64 > max;
    data.truncate(max as usize);
    Ok((data, truncated, before, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(path: &Path, whole: bool) -> ReadFileZRequest {
        ReadFileZRequest {
            path: path.display().to_string(),
            offset: 0,
            max_bytes: 1 << 20,
            compress: false,
            whole,
            confine: None,
        }
    }

    #[test]
    fn a_quiet_file_is_one_version_and_compression_is_only_when_asked() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a");
        std::fs::write(&p, "x".repeat(100_000)).unwrap();
        // Changed just now: the first try may fall in its tick; a later one settles.
        let r = read_file_z(&req(&p, true)).unwrap();
        assert!(r.settled && !r.compressed && !r.truncated);
        assert_eq!(r.data.len(), 100_000);
        let r = read_file_z(&ReadFileZRequest {
            compress: true,
            ..req(&p, true)
        })
        .unwrap();
        assert!(r.compressed && r.raw_len == 100_000);
        // Without `whole` nothing is claimed.
        assert!(!read_file_z(&req(&p, false)).unwrap().settled);
    }

    #[test]
    fn the_wait_after_a_young_read_reaches_past_the_settle_point() {
        let ms = 1_000_000i64;
        let ctime = 1_700_000_000_123_456_789;
        let key = Key {
            ctime_ns: ctime,
            mtime_ns: ctime,
            dev: 1,
            ino: 2,
            size: 3,
        };
        // The coarse clock read before the change's fine-grained ctime, or just after it:
        // after the wait, a reading that trails real time by a whole tick still settles.
        for behind in [-9 * ms, -4 * ms, 0, 3 * ms, 19 * ms] {
            let clock = ctime + behind;
            let wait = wait_to_settle(&key, clock).as_nanos() as i64;
            // The coarse clock trails by less than a tick.
            let worst = clock + wait - CLOCK_LAG.as_nanos() as i64 + 1;
            assert!(
                key.settled(worst - IN_FLIGHT.as_nanos() as i64),
                "clock {behind} ns from the ctime"
            );
        }
        // Long settled: only the lag is waited.
        assert_eq!(wait_to_settle(&key, ctime + 900 * ms), CLOCK_LAG);
        // A whole-second file system's margin is not waited out.
        let coarse = Key {
            ctime_ns: 1_700_000_000_000_000_000,
            mtime_ns: 1_700_000_000_000_000_000,
            ..key
        };
        assert_eq!(
            wait_to_settle(&coarse, coarse.ctime_ns),
            MAX_WAIT + CLOCK_LAG
        );
    }

    #[test]
    fn a_file_rewritten_during_every_read_is_not_settled() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("hot");
        std::fs::write(&p, vec![b'a'; 256 << 10]).unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let writer = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                use std::os::unix::fs::FileExt;
                let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
                let (a, b) = (vec![b'a'; 256 << 10], vec![b'b'; 256 << 10]);
                for i in 0..2_000_000u64 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    f.write_all_at(if i % 2 == 0 { &b } else { &a }, 0).unwrap();
                }
            })
        };
        let mut settled_mixed = 0;
        for _ in 0..20 {
            let r = read_file_z(&req(&p, true)).unwrap();
            let mixed = r.data.iter().any(|&c| c != r.data[0]);
            if r.settled && mixed {
                settled_mixed += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert_eq!(settled_mixed, 0, "a mix of versions was answered as one");
        let r = read_file_z(&req(&p, true)).unwrap();
        assert!(r.settled, "a quiet file settles");
    }
}
