//! Small helpers shared by the agent's modules and its command-line subcommands.

use std::ffi::{CStr, OsStr, OsString};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The invoking user's home: `$HOME` first (what a login shell would use), then the passwd
/// entry, because an agent started by `ssh host cmd` may run without a populated environment.
pub fn home_dir() -> Option<PathBuf> {
    match std::env::var_os("HOME") {
        Some(h) if !h.is_empty() => Some(PathBuf::from(h)),
        _ => passwd_entry()
            .map(|p| p.home)
            .filter(|h| !h.as_os_str().is_empty()),
    }
}

/// Where the sync's hash caches live, if anywhere (no `$RSB_CACHE_DIR` and no home: no
/// cache). rsb's own data, like the jobs' records: the sync writes there and the confinement
/// keeps it reachable.
pub fn hash_cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("RSB_CACHE_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => home_dir()?.join(".cache").join("rsb"),
    };
    Some(base.join("hashcache"))
}

/// [`rsb_rules::path::expand_tilde`] against this user's home, looked up only when the path
/// needs it; without a known home the path is kept as given.
/// This agent's binary, to start a wrapper or a reaper from. Linux names a replaced binary
/// `PATH (deleted)`: another rsb deploying to the host at the same moment renames its copy over
/// ours. The install path is content-addressed (`<version>-<hash12>`, in a directory only this
/// user can write), so what is there now is the same agent, and it is used.
pub fn own_exe() -> io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let Some(live) = exe.to_str().and_then(|s| s.strip_suffix(" (deleted)")) else {
        return Ok(exe);
    };
    match Path::new(live).is_file() {
        true => Ok(PathBuf::from(live)),
        false => Err(io::Error::other(format!("{} was deleted", exe.display()))),
    }
}

pub fn expand_home(path: &str) -> PathBuf {
    let home = rsb_rules::path::starts_with_tilde(path)
        .then(home_dir)
        .flatten();
    match home {
        Some(home) => rsb_rules::path::expand_tilde(path, &home),
        None => PathBuf::from(path),
    }
}

/// A path as a protocol string. Non-UTF-8 bytes are replaced, since the wire type is `String`.
pub fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// The fields of the current user's passwd entry that the agent reports.
pub struct Passwd {
    pub name: String,
    pub home: PathBuf,
}

/// Looks up the current uid. A static musl build reads `/etc/passwd` only (no NSS), so users
/// from LDAP/SSSD are not found here; callers fall back to the environment.
pub fn passwd_entry() -> Option<Passwd> {
    let uid = rustix::process::getuid().as_raw();
    let mut buf = vec![0 as libc::c_char; 4096];
    loop {
        // SAFETY: an all-zero passwd is a valid value for this plain C struct.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the duration of the call and `buf.len()` is the
        // real size of `buf`.
        let rc =
            unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result) };
        if rc == libc::ERANGE && buf.len() < (1 << 20) {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 || result.is_null() {
            return None;
        }
        let field = |p: *const libc::c_char| -> OsString {
            if p.is_null() {
                return OsString::new();
            }
            // SAFETY: on success the string fields point into `buf`, NUL-terminated.
            let text = unsafe { CStr::from_ptr(p) };
            OsStr::from_bytes(text.to_bytes()).to_owned()
        };
        return Some(Passwd {
            name: field(pwd.pw_name).to_string_lossy().into_owned(),
            home: PathBuf::from(field(pwd.pw_dir)),
        });
    }
}

/// A JSON string literal. One policy for every JSON the agent writes by hand (it carries no
/// serde_json, to stay small): quotes and backslashes escaped, `\n` `\r` `\t` as such, and every
/// other control character (C0, DEL and C1, i.e. Unicode category Cc) as `\u00XX`, so the text
/// stays safe to print on a terminal whatever a job name or an nvidia-smi message held.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// blake3 of a file, streamed (the agent never holds a whole file in memory to hash it).
pub fn hash_file(path: &Path) -> io::Result<String> {
    let file = std::fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(file)?;
    Ok(hasher.finalize().to_hex().to_string())
}

/// Write to stdout without panicking: `print!` aborts the agent (panic=abort) when the reader
/// of a pipe has gone away, e.g. `rsb-agent hash f | head -0`.
pub fn write_stdout(text: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// `rsb-agent hash FILE...`: prints `<blake3>  <file>` per file, like `b3sum`, so a person on
/// the host can compare against what rsb reports.
pub fn hash_cli(args: &[String]) -> i32 {
    if args.is_empty() {
        eprintln!("usage: rsb-agent hash FILE...");
        return 2;
    }
    let mut code = 0;
    for name in args {
        match hash_file(Path::new(name)) {
            Ok(hex) => {
                if write_stdout(&format!("{hex}  {name}\n")).is_err() {
                    // The reader is gone; nothing more can be reported.
                    return 1;
                }
            }
            Err(e) => {
                eprintln!("rsb-agent hash: {name}: {e}");
                code = 1;
            }
        }
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expand_home_only_touches_a_leading_tilde() {
        let Some(home) = home_dir() else {
            panic!("the test environment has no home directory");
        };
        assert_eq!(expand_home("~"), home);
        assert_eq!(expand_home("~/"), home);
        assert_eq!(expand_home("~/a/b"), home.join("a/b"));
        assert_eq!(expand_home("~user/x"), PathBuf::from("~user/x"));
        assert_eq!(expand_home("/x/~/y"), PathBuf::from("/x/~/y"));
        assert_eq!(expand_home("$HOME/x"), PathBuf::from("$HOME/x"));
        assert_eq!(expand_home("rel"), PathBuf::from("rel"));
    }

    #[test]
    fn json_strings_escape_every_control_character() {
        assert_eq!(json_string("plain é ✓"), "\"plain é ✓\"");
        assert_eq!(json_string("q\"b\\"), r#""q\"b\\""#);
        assert_eq!(json_string("\n\r\t"), r#""\n\r\t""#);
        // NUL, ESC, unit separator, DEL and two C1 controls (NEL, CSI).
        assert_eq!(
            json_string("a\u{0}b\u{1b}\u{1f}\u{7f}\u{85}\u{9b}z"),
            r#""a\u0000b\u001b\u001f\u007f\u0085\u009bz""#
        );
        // U+00A0 (no-break space) is not a control character and stays as it is.
        assert_eq!(json_string("\u{a0}"), "\"\u{a0}\"");
        for c in (0u32..0x20).chain(0x7f..0xa0) {
            let s = char::from_u32(c).unwrap().to_string();
            let quoted = json_string(&s);
            assert!(quoted.is_ascii(), "{c:#x} left raw: {quoted:?}");
            let back: String = serde_json::from_str(&quoted).unwrap();
            assert_eq!(back, s, "{c:#x} does not read back");
        }
    }
}
