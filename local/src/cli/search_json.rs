//! `rsb grep --json`: ripgrep's JSON lines, so a tool that reads `rg --json` reads rsb's. For
//! each file with a match, `begin`, its `match` and `context` lines, `end` with the file's
//! stats; then one `summary`. The fields and their order are rg 13's, so apart from the times
//! the bytes are rg's (tested against rg on the sandbox).
//!
//! Where rsb differs: the times are as this client saw them; with `-U` each line of a match
//! is its own `match` message (rg joins a match's lines into one); a line over the streamed
//! cut prints cut; a path that is not UTF-8 prints lossily as `text`.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use base64::Engine as _;
use rsb::ops::search::Printed;
use rsb_protocol::SearchLine;
use serde::Serialize;

/// Text as rg's JSON spells it: `{"text": …}` when UTF-8, else `{"bytes": base64}`.
#[derive(Serialize)]
#[serde(untagged)]
enum Data<'a> {
    Text { text: Cow<'a, str> },
    Bytes { bytes: String },
}

impl<'a> Data<'a> {
    fn of(b: &'a [u8]) -> Data<'a> {
        match std::str::from_utf8(b) {
            Ok(text) => Data::Text { text: text.into() },
            Err(_) => Data::Bytes {
                bytes: base64::engine::general_purpose::STANDARD.encode(b),
            },
        }
    }
}

#[derive(Serialize)]
struct Submatch<'a> {
    #[serde(rename = "match")]
    matched: Data<'a>,
    start: usize,
    end: usize,
}

#[derive(Serialize)]
struct Line<'a> {
    path: Data<'a>,
    lines: Data<'a>,
    line_number: u64,
    absolute_offset: u64,
    submatches: Vec<Submatch<'a>>,
}

/// rg's per-file elapsed time: `secs`, `nanos`, `human`.
#[derive(Serialize)]
struct Elapsed {
    secs: u64,
    nanos: u32,
    human: String,
}

/// The summary's: the same, its keys sorted (rg writes the summary from a JSON map).
#[derive(Serialize)]
struct ElapsedSorted {
    human: String,
    nanos: u32,
    secs: u64,
}

fn human(d: Duration) -> String {
    format!("{:0.6}s", d.as_secs_f64())
}

impl From<Duration> for Elapsed {
    fn from(d: Duration) -> Elapsed {
        Elapsed {
            secs: d.as_secs(),
            nanos: d.subsec_nanos(),
            human: human(d),
        }
    }
}

impl From<Duration> for ElapsedSorted {
    fn from(d: Duration) -> ElapsedSorted {
        ElapsedSorted {
            human: human(d),
            nanos: d.subsec_nanos(),
            secs: d.as_secs(),
        }
    }
}

#[derive(Serialize)]
struct FileStats {
    elapsed: Elapsed,
    searches: u64,
    searches_with_match: u64,
    bytes_searched: u64,
    bytes_printed: u64,
    matched_lines: u64,
    matches: u64,
}

#[derive(Serialize)]
struct SortedStats {
    bytes_printed: u64,
    bytes_searched: u64,
    elapsed: ElapsedSorted,
    matched_lines: u64,
    matches: u64,
    searches: u64,
    searches_with_match: u64,
}

#[derive(Serialize)]
#[serde(tag = "type", content = "data", rename_all = "lowercase")]
enum Message<'a> {
    Begin {
        path: Data<'a>,
    },
    Match(Line<'a>),
    Context(Line<'a>),
    End {
        path: Data<'a>,
        binary_offset: Option<u64>,
        stats: FileStats,
    },
}

#[derive(Serialize)]
struct SummaryData {
    elapsed_total: ElapsedSorted,
    stats: SortedStats,
}

#[derive(Serialize)]
struct Summary {
    data: SummaryData,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// Counts of one file, or of all.
#[derive(Default, Clone, Copy)]
struct Counts {
    bytes_searched: u64,
    bytes_printed: u64,
    matched_lines: u64,
    matches: u64,
    elapsed: Duration,
    searches: u64,
}

/// The file being printed.
struct Open {
    path: String,
    since: Instant,
    counts: Counts,
}

/// Prints a search's lines as rg's JSON messages; [`Json::finish`] ends the last file and
/// prints the summary.
pub struct Json {
    started: Instant,
    open: Option<Open>,
    total: Counts,
}

impl Json {
    pub fn new() -> Json {
        Json {
            started: Instant::now(),
            open: None,
            total: Counts::default(),
        }
    }

    /// Append the messages of one printed line (a `--` prints nothing) to `buf`.
    pub fn line(&mut self, p: &Printed, buf: &mut Vec<u8>) {
        let Printed::Line {
            path,
            line,
            is_match,
            file_bytes,
        } = p
        else {
            return;
        };
        if self.open.as_ref().is_none_or(|o| &o.path != path) {
            self.end(buf);
            let at = buf.len();
            write(
                buf,
                &Message::Begin {
                    path: Data::Text { text: path.into() },
                },
            );
            self.open = Some(Open {
                path: path.clone(),
                since: Instant::now(),
                counts: Counts {
                    bytes_searched: *file_bytes,
                    bytes_printed: (buf.len() - at) as u64,
                    searches: 1,
                    ..Counts::default()
                },
            });
        }
        let (data, matches) = line_data(path, line, *file_bytes, *is_match);
        let at = buf.len();
        write(
            buf,
            &if *is_match {
                Message::Match(data)
            } else {
                Message::Context(data)
            },
        );
        if let Some(o) = &mut self.open {
            o.counts.bytes_printed += (buf.len() - at) as u64;
            o.counts.matched_lines += u64::from(*is_match);
            o.counts.matches += matches;
        }
    }

    /// End the open file, if any: its `end` message.
    fn end(&mut self, buf: &mut Vec<u8>) {
        let Some(o) = self.open.take() else { return };
        let c = Counts {
            elapsed: o.since.elapsed(),
            ..o.counts
        };
        write(
            buf,
            &Message::End {
                path: Data::Text {
                    text: o.path.as_str().into(),
                },
                binary_offset: None,
                stats: FileStats {
                    elapsed: c.elapsed.into(),
                    searches: 1,
                    searches_with_match: 1,
                    bytes_searched: c.bytes_searched,
                    bytes_printed: c.bytes_printed,
                    matched_lines: c.matched_lines,
                    matches: c.matches,
                },
            },
        );
        let t = &mut self.total;
        t.bytes_searched += c.bytes_searched;
        t.bytes_printed += c.bytes_printed;
        t.matched_lines += c.matched_lines;
        t.matches += c.matches;
        t.elapsed += c.elapsed;
        t.searches += 1;
    }

    /// The last file's `end`, then the `summary` of all.
    pub fn finish(&mut self, buf: &mut Vec<u8>) {
        self.end(buf);
        let t = self.total;
        let summary = Summary {
            data: SummaryData {
                elapsed_total: self.started.elapsed().into(),
                stats: SortedStats {
                    bytes_printed: t.bytes_printed,
                    bytes_searched: t.bytes_searched,
                    elapsed: t.elapsed.into(),
                    matched_lines: t.matched_lines,
                    matches: t.matches,
                    searches: t.searches,
                    searches_with_match: t.searches,
                },
            },
            kind: "summary",
        };
        write(buf, &summary);
    }
}

fn write<T: Serialize>(buf: &mut Vec<u8>, v: &T) {
    // Plain structs of strings and numbers: encoding cannot fail.
    if serde_json::to_writer(&mut *buf, v).is_ok() {
        buf.push(b'\n');
    }
}

/// A line's message data, and its count of matches. Its text is the file's bytes with the
/// line break, when it had one (it ends before the file does); submatch offsets are in those
/// bytes.
fn line_data<'a>(
    path: &'a str,
    line: &'a SearchLine,
    file_bytes: u64,
    is_match: bool,
) -> (Line<'a>, u64) {
    let raw: &[u8] = line.raw.as_deref().unwrap_or(line.text.as_bytes());
    let ends = line.offset + raw.len() as u64 + line.cut;
    let lines = if ends < file_bytes {
        let mut l = raw.to_vec();
        l.push(b'\n');
        match String::from_utf8(l) {
            Ok(text) => Data::Text { text: text.into() },
            Err(e) => Data::Bytes {
                bytes: base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
            },
        }
    } else {
        Data::of(raw)
    };
    // The ranges are in the lossy text: in the bytes where those are not UTF-8.
    let exact = std::str::from_utf8(raw).is_ok();
    let submatches: Vec<Submatch> = if is_match {
        line.matches
            .iter()
            .filter(|(s, e)| e > s)
            .map(|&(s, e)| {
                let (s, e) = if exact {
                    (s as usize, e as usize)
                } else {
                    (in_bytes(raw, s as usize), in_bytes(raw, e as usize))
                };
                let (s, e) = (s.min(raw.len()), e.min(raw.len()));
                Submatch {
                    matched: Data::of(&raw[s..e]),
                    start: s,
                    end: e,
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let n = submatches.len() as u64;
    (
        Line {
            path: Data::Text { text: path.into() },
            lines,
            line_number: line.number,
            absolute_offset: line.offset,
            submatches,
        },
        n,
    )
}

/// The byte offset in `raw` of offset `at` in `String::from_utf8_lossy(raw)`, where each
/// invalid sequence became one U+FFFD (3 bytes).
fn in_bytes(raw: &[u8], at: usize) -> usize {
    let (mut text, mut bytes) = (0usize, 0usize);
    for chunk in raw.utf8_chunks() {
        let valid = chunk.valid().len();
        if at <= text + valid {
            return bytes + (at - text);
        }
        text += valid;
        bytes += valid;
        let invalid = chunk.invalid().len();
        if invalid > 0 {
            if at < text + 3 {
                return bytes;
            }
            text += 3;
            bytes += invalid;
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lossy_offsets_map_to_the_bytes() {
        // "caf\xe9 foo": lossily "caf\u{fffd} foo", where `foo` is at 7; in the bytes, at 5.
        let raw = b"caf\xe9 foo";
        assert_eq!(in_bytes(raw, 7), 5);
        assert_eq!(in_bytes(raw, 10), 8);
        assert_eq!(in_bytes(raw, 3), 3);
        assert_eq!(in_bytes(b"plain", 4), 4);
        assert_eq!(in_bytes(b"\xff\xfeab", 8), 4);
    }
}
