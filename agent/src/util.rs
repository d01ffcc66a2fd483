//! Small helpers shared by the agent's modules and its command-line subcommands.

use std::ffi::{CStr, OsStr, OsString};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
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

/// [`rsb_rules::path::expand_tilde`] against this user's home, looked up only when the path
/// needs it; without a known home the path is kept as given.
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
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
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
        // SAFETY: on success the string fields point into `buf`, NUL-terminated, or are null.
        let field = |p: *const libc::c_char| -> OsString {
            if p.is_null() {
                OsString::new()
            } else {
                OsStr::from_bytes(unsafe { CStr::from_ptr(p) }.to_bytes()).to_owned()
            }
        };
        return Some(Passwd {
            name: field(pwd.pw_name).to_string_lossy().into_owned(),
            home: PathBuf::from(field(pwd.pw_dir)),
        });
    }
}

/// Find an executable on `$PATH` (plus the standard system directories, since a non-login
/// `ssh host cmd` often gets a minimal PATH that still has bash in /bin).
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let fallback = ["/usr/local/bin", "/usr/bin", "/bin"];
    std::env::split_paths(&path)
        .filter(|d| !d.as_os_str().is_empty())
        .chain(fallback.iter().map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| is_executable_file(p))
}

fn is_executable_file(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
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
    fn find_on_path_finds_sh_and_not_nonsense() {
        assert!(find_on_path("sh").is_some());
        assert!(find_on_path("rsb-no-such-tool-4f1c").is_none());
    }
}
