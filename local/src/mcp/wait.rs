//! Calls that wait: the last output line a progress notification carries, and
//! `check_background_task(wait_s)`, which answers as soon as the job ends or prints more.
//!
//! Clients that reset their idle timeout on progress keep a long call alive only if progress
//! keeps coming; the last line makes each notification worth showing. A wait is bounded
//! (`MAX_WAIT_S`, under the two-minute mark where clients background a call).

use std::{sync::Arc, time::Duration};

use parking_lot::Mutex;
use rsb_protocol::{
    Chunk, JobEventKind, JobEventsRequest, JobState, JobStatusRequest, JobStatusResult,
};

use crate::{
    client::AgentClient,
    error::{Result, RsbError},
};

/// The longest `wait_s`.
pub(crate) const MAX_WAIT_S: f64 = 110.0;
/// Characters of the last line a progress message carries.
const LINE_CHARS: usize = 200;
/// Bytes of an unfinished line kept (its tail).
const PARTIAL_CAP: usize = 4096;

/// The last non-empty line of a stream of output (a carriage return starts the line anew, as a
/// terminal shows progress bars). Bounded: only the unfinished line's tail is kept.
#[derive(Clone, Default)]
pub(crate) struct LastLine(Arc<Mutex<LineState>>);

#[derive(Default)]
struct LineState {
    partial: Vec<u8>,
    complete: String,
}

impl LastLine {
    pub(crate) fn feed(&self, bytes: &[u8]) {
        let mut s = self.0.lock();
        let mut rest = bytes;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            s.partial.extend_from_slice(&rest[..i]);
            let line = visible(&s.partial);
            if !line.is_empty() {
                s.complete = line;
            }
            s.partial.clear();
            rest = &rest[i + 1..];
        }
        s.partial.extend_from_slice(rest);
        if s.partial.len() > PARTIAL_CAP {
            let cut = s.partial.len() - PARTIAL_CAP;
            s.partial.drain(..cut);
        }
    }

    /// The unfinished line if it shows anything, else the last complete one.
    pub(crate) fn get(&self) -> String {
        let s = self.0.lock();
        let partial = visible(&s.partial);
        if partial.is_empty() {
            s.complete.clone()
        } else {
            partial
        }
    }

    /// `what: running for Ns; last line: …` (one line, control characters escaped).
    pub(crate) fn message(&self, what: &str, secs: f64) -> String {
        let line = self.get();
        if line.is_empty() {
            format!("{what}: running for {secs}s")
        } else {
            format!(
                "{what}: running for {secs}s; last line: {}",
                super::one_line(&line)
            )
        }
    }
}

/// What a terminal would show of one line: the text after its last carriage return, trimmed,
/// at most [`LINE_CHARS`] characters (the end, where a progress line changes).
fn visible(line: &[u8]) -> String {
    let mut line = line;
    while let [rest @ .., b'\r'] = line {
        line = rest;
    }
    let after_cr = match line.iter().rposition(|&b| b == b'\r') {
        Some(i) => &line[i + 1..],
        None => line,
    };
    let s = String::from_utf8_lossy(after_cr);
    let s = s.trim();
    let n = s.chars().count();
    s.chars().skip(n.saturating_sub(LINE_CHARS)).collect()
}

/// Forward streamed exec output into `last` until the call ends (its sender is dropped).
pub(crate) fn track(last: LastLine) -> tokio::sync::mpsc::Sender<Chunk> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Chunk>(64);
    tokio::spawn(async move {
        while let Some(c) = rx.recv().await {
            if let Chunk::Stdout(b) | Chunk::Stderr(b) = c {
                last.feed(&b);
            }
        }
    });
    tx
}

/// `wait_s` checked: 0 (answer at once) to [`MAX_WAIT_S`].
pub(crate) fn wait_duration(wait_s: f64) -> Result<Duration> {
    if !(0.0..=MAX_WAIT_S).contains(&wait_s) {
        return Err(RsbError::invalid(
            format!("wait_s must be between 0 and {MAX_WAIT_S}"),
            "wait in steps of at most 110 s (call again to keep waiting)",
        ));
    }
    Ok(Duration::from_secs_f64(wait_s))
}

fn running(r: &JobStatusResult) -> bool {
    r.info
        .as_ref()
        .is_some_and(|i| i.state == JobState::Running)
}

/// Wait until the job of `first` (a reply already in hand) ends or its log grows past what
/// `first` saw, or until `wait` passed. Returns at once for a job that is not running (or has
/// no record: a bare log has nothing to wait for).
///
/// One request waits: the agent's job-event subscription for this job (`until_ended`, which
/// replies at the end, and `output_after`, one event when the log grows), so the answer comes
/// the moment the agent sees the end (inotify on the job's record) or within its 250 ms look
/// at the log, and nothing is asked meanwhile.
pub(crate) async fn until_change(
    client: &AgentClient,
    req: &JobStatusRequest,
    first: &JobStatusResult,
    wait: Duration,
    last: &LastLine,
) -> Result<()> {
    if !running(first) || wait.is_zero() {
        return Ok(());
    }
    last.feed(&first.log);
    let (tx, mut chunks) = tokio::sync::mpsc::channel(16);
    let events = JobEventsRequest {
        names: vec![req.name.clone()],
        since_ms: 0,
        until_ended: true,
        output_after: Some(first.log_size),
    };
    let call = client.call_streaming(events, tx);
    tokio::pin!(call);
    let deadline = tokio::time::sleep(wait);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            biased;
            // The end (or an error, such as the record removed meanwhile): the status read
            // that follows says how the job stands.
            _ = &mut call => return Ok(()),
            Some(c) = chunks.recv() => {
                if let Chunk::JobEvent(e) = c
                    && e.kind == JobEventKind::Output
                {
                    if let Some(l) = &e.last_line {
                        last.feed(format!("{l}\n").as_bytes());
                    }
                    // A job's last line and its end come moments apart (the wrapper logs the
                    // exit code, then records it): a job that printed and ended is answered
                    // as ended, not as running with one more call to make.
                    let _ = tokio::time::timeout(SETTLE, &mut call).await;
                    return Ok(());
                }
            }
            _ = &mut deadline => return Ok(()),
        }
    }
}

/// After new output, how long a wait looks for the job's end.
const SETTLE: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_line_is_what_a_terminal_shows_last() {
        let l = LastLine::default();
        assert_eq!(l.get(), "");
        l.feed(b"epoch 1\nepoch 2\n\n");
        assert_eq!(l.get(), "epoch 2");
        l.feed(b"step 10%\rstep 20%");
        assert_eq!(l.get(), "step 20%");
        l.feed(b"\r\n");
        assert_eq!(l.get(), "step 20%");
        l.feed(&vec![b'x'; 10_000]);
        assert_eq!(l.get().len(), LINE_CHARS);
        assert_eq!(
            l.message("exec_bash", 4.0),
            format!("exec_bash: running for 4s; last line: {}", "x".repeat(200))
        );
        let l = LastLine::default();
        l.feed(b"a\x1b[31mred\n");
        assert_eq!(
            l.message("w", 2.0),
            "w: running for 2s; last line: a\\u{1b}[31mred"
        );
    }

    #[test]
    fn wait_is_bounded() {
        assert!(wait_duration(0.0).is_ok());
        assert!(wait_duration(110.0).is_ok());
        assert!(wait_duration(110.5).is_err());
        assert!(wait_duration(-1.0).is_err());
        assert!(wait_duration(f64::NAN).is_err());
    }
}
