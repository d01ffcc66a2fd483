//! The on-disk record of a job: two small `key=value` files, `spec` and `state`.
//!
//! Format (version 1), one entry per line, `key=value`, split at the first `=`:
//! - keys are fixed ASCII identifiers; a key may repeat (`env`);
//! - values are bytes with `\\`, `\n`, `\r` and `\xHH` escapes, so a multi-line command or an
//!   environment value that is not UTF-8 still takes exactly one line;
//! - unknown keys are ignored, so a newer agent can add keys an older one still reads;
//! - the first line is `format=1`.
//!
//! A hand-written format keeps the static agent small and lets a person read (and `grep`) a
//! job's record on the host without tools.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

pub const FORMAT: &str = "1";

/// An ordered list of entries; order is kept so the file reads like the code that wrote it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Record {
    entries: Vec<(String, Vec<u8>)>,
}

impl Record {
    pub fn new() -> Self {
        let mut r = Record::default();
        r.set("format", FORMAT);
        r
    }

    /// Append an entry (keys may repeat).
    pub fn push(&mut self, key: &str, value: impl AsRef<[u8]>) {
        self.entries
            .push((key.to_string(), value.as_ref().to_vec()));
    }

    /// Replace every entry named `key` by one entry (appended when there was none).
    pub fn set(&mut self, key: &str, value: impl AsRef<[u8]>) {
        if let Some(pos) = self.entries.iter().position(|(k, _)| k == key) {
            self.entries[pos].1 = value.as_ref().to_vec();
            let mut seen = false;
            self.entries.retain(|(k, _)| {
                if k != key {
                    return true;
                }
                let keep = !seen;
                seen = true;
                keep
            });
        } else {
            self.push(key, value);
        }
    }

    pub fn get_bytes(&self, key: &str) -> Option<&[u8]> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }

    /// The value as text; `None` when missing or not UTF-8.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.get_bytes(key)
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(|v| v.parse().ok())
    }

    pub fn get_i32(&self, key: &str) -> Option<i32> {
        self.get(key).and_then(|v| v.parse().ok())
    }

    pub fn get_all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.entries
            .iter()
            .filter(move |(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }

    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in &self.entries {
            out.extend_from_slice(k.as_bytes());
            out.push(b'=');
            escape_into(v, &mut out);
            out.push(b'\n');
        }
        out
    }

    /// Parse a record; a line without `=` (a torn write cannot produce one, since files are
    /// replaced by rename) is reported rather than skipped so corruption is visible.
    pub fn parse(data: &[u8]) -> Result<Record, String> {
        let mut r = Record::default();
        for (i, line) in data.split(|&b| b == b'\n').enumerate() {
            if line.is_empty() {
                continue;
            }
            let Some(eq) = line.iter().position(|&b| b == b'=') else {
                return Err(format!("line {}: no '='", i + 1));
            };
            let key = std::str::from_utf8(&line[..eq])
                .map_err(|_| format!("line {}: key is not UTF-8", i + 1))?;
            let value = unescape(&line[eq + 1..]).map_err(|e| format!("line {}: {e}", i + 1))?;
            r.entries.push((key.to_string(), value));
        }
        match r.get("format") {
            Some(FORMAT) => Ok(r),
            Some(other) => Err(format!("unsupported record format {other}")),
            None => Err("missing format line".to_string()),
        }
    }

    pub fn read(path: &Path) -> std::io::Result<Record> {
        let data = std::fs::read(path)?;
        Record::parse(&data).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        })
    }

    /// Write atomically: a reader sees the old record or the new one, never a mix, and a crash
    /// leaves at worst a stray temp file. The data is synced before the rename so a host crash
    /// cannot leave an empty record behind a successful rename.
    pub fn write_atomic(&self, path: &Path) -> std::io::Result<()> {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("record");
        let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
        let result = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&self.render())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

fn escape_into(v: &[u8], out: &mut Vec<u8>) {
    for &b in v {
        match b {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            0..=0x1f | 0x7f => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
            _ => out.push(b),
        }
    }
}

fn unescape(v: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        if v[i] != b'\\' {
            out.push(v[i]);
            i += 1;
            continue;
        }
        match v.get(i + 1) {
            Some(b'\\') => out.push(b'\\'),
            Some(b'n') => out.push(b'\n'),
            Some(b'r') => out.push(b'\r'),
            Some(b'x') => {
                let hex = v.get(i + 2..i + 4).ok_or("truncated \\x escape")?;
                let hex = std::str::from_utf8(hex).map_err(|_| "bad \\x escape")?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| "bad \\x escape")?);
                i += 2;
            }
            _ => return Err("bad escape".to_string()),
        }
        i += 2;
    }
    Ok(out)
}

/// Create a directory (and missing parents) readable only by the owner: job records hold the
/// job's environment.
pub fn create_private_dir(path: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
}

/// A job's confinement in its spec, its roots absolute: what `start` decided on this host, or
/// what a Slurm submit asks of whichever compute node runs the job. The wrapper applies it to
/// the job's command ([`confine_of`]).
pub fn set_confine(spec: &mut Record, c: &rsb_protocol::Confine) {
    spec.set("confine", "1");
    for r in &c.write {
        spec.push("confine_write", r);
    }
    if let Some(read) = &c.read {
        spec.set("confine_reads", "1");
        for r in read {
            spec.push("confine_read", r);
        }
    }
    if let Some(ports) = &c.net {
        spec.set("confine_net", "1");
        for p in ports {
            spec.push("confine_port", p.to_string());
        }
    }
    spec.set("confine_require", if c.require { "1" } else { "0" });
}

fn all(spec: &Record, key: &str) -> Vec<String> {
    spec.get_all(key)
        .map(|r| String::from_utf8_lossy(r).into_owned())
        .collect()
}

/// The confinement [`set_confine`] wrote (`require` is true unless the spec says otherwise).
pub fn confine_of(spec: &Record) -> Option<rsb_protocol::Confine> {
    (spec.get("confine") == Some("1")).then(|| rsb_protocol::Confine {
        write: all(spec, "confine_write"),
        read: (spec.get("confine_reads") == Some("1")).then(|| all(spec, "confine_read")),
        net: (spec.get("confine_net") == Some("1")).then(|| {
            spec.get_all("confine_port")
                .filter_map(|p| std::str::from_utf8(p).ok()?.parse().ok())
                .collect()
        }),
        require: spec.get("confine_require") != Some("0"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_awkward_bytes() {
        let mut r = Record::new();
        r.set("command", "echo a\nexit 3\r\n\\x\t\x7f=ü");
        r.push("env", b"K=\xff\x00v".as_slice());
        r.push("env", "A=b");
        let text = r.render();
        assert_eq!(
            text.iter().filter(|&&b| b == b'\n').count(),
            4,
            "one line per entry"
        );
        let back = Record::parse(&text).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.get("command"), Some("echo a\nexit 3\r\n\\x\t\x7f=ü"));
        let envs: Vec<&[u8]> = back.get_all("env").collect();
        assert_eq!(envs, vec![b"K=\xff\x00v".as_slice(), b"A=b".as_slice()]);
    }

    #[test]
    fn set_replaces_and_dedups() {
        let mut r = Record::new();
        r.push("a", "1");
        r.push("a", "2");
        r.set("a", "3");
        assert_eq!(r.get_all("a").count(), 1);
        assert_eq!(r.get_u64("a"), Some(3));
    }

    #[test]
    fn rejects_corruption_and_other_formats() {
        assert!(Record::parse(b"format=1\nno equals\n").is_err());
        assert!(Record::parse(b"format=2\n").is_err());
        assert!(Record::parse(b"a=1\n").is_err());
        assert!(Record::parse(b"format=1\na=\\q\n").is_err());
        assert!(Record::parse(b"format=1\na=\\x4\n").is_err());
        assert!(Record::parse(b"format=1\nfuture_key=x\n").is_ok());
    }

    #[test]
    fn atomic_write_replaces_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state");
        let mut r = Record::new();
        r.set("pid", "1");
        r.write_atomic(&p).unwrap();
        r.set("pid", "2");
        r.write_atomic(&p).unwrap();
        assert_eq!(Record::read(&p).unwrap().get_u64("pid"), Some(2));
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temp file left behind: {names:?}");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}
