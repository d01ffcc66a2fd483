//! GPU leases between rsb agents on one host ([`rsb_protocol::GpuAsk`]).
//!
//! A lease is an exclusive `flock(2)` on `GPU_LEASE_DIR/<uuid>`, taken by a job's wrapper
//! before the job starts and held (close-on-exec: the job does not inherit it) until the
//! wrapper exits. The kernel drops it with the wrapper however that ends, SIGKILL included, so
//! a lease has no expiry clock to get wrong and no holder that can vanish and keep it. The
//! directory is shared by every user's agents (sticky and world-writable, like /tmp), so two
//! sessions, two users or two rsb servers never place jobs onto the same GPU.
//!
//! Leases are advisory: they keep rsb's placements apart, not other programs, and a co-tenant
//! can ignore them. Such programs show as processes in the GPU report, and placement avoids
//! their GPUs. A lease file is opened without following links and without blocking, so one a
//! co-tenant planted (a link, a FIFO) is refused, never obeyed.

use std::fs::File;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rsb_protocol::{GPU_LEASE_DIR, GpuHolder};
use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;

/// Starts a wrapper's error message whose start failed for want of free GPUs
/// ([`rsb_protocol::ErrorCode::Busy`]).
pub(crate) const BUSY: &str = "GPUs busy: ";

/// A GPU UUID as drivers print them (`GPU-…`, `MIG-…`): it names a file, so nothing else.
pub(crate) fn valid_uuid(u: &str) -> bool {
    (1..=96).contains(&u.len()) && u.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The lease file of `uuid`, in the shared directory (made on first use).
pub(crate) fn lease_path(uuid: &str) -> std::io::Result<PathBuf> {
    let dir = Path::new(GPU_LEASE_DIR);
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let m = std::fs::symlink_metadata(dir)?;
    if !m.is_dir() {
        return Err(std::io::Error::other(format!(
            "{GPU_LEASE_DIR} is not a directory"
        )));
    }
    // Made through the umask: every user's agents must be able to add files.
    if m.uid() == rustix::process::geteuid().as_raw() && m.mode() & 0o7777 != 0o1777 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))?;
    }
    Ok(dir.join(uuid))
}

/// Opens (creating when missing) the lease file of `uuid`: never through a link, never
/// blocking, only a regular file. An existing file is opened without `O_CREAT`, which a
/// sticky directory's `protected_regular` would refuse for another user's file.
fn open(uuid: &str) -> std::io::Result<File> {
    let path = lease_path(uuid)?;
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let create = flags | OFlags::CREATE | OFlags::EXCL;
    let fd = match rustix::fs::open(&path, flags, Mode::empty()) {
        Err(Errno::NOENT) => match rustix::fs::open(&path, create, Mode::from_raw_mode(0o444)) {
            Err(Errno::EXIST) => rustix::fs::open(&path, flags, Mode::empty()),
            r => r,
        },
        r => r,
    }?;
    let file = File::from(fd);
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

/// Leases the first `count` of `ask` that no one holds, in order: their UUIDs and the files
/// whose locks are the leases (drop them to end the leases). Fewer free: a message starting
/// with [`BUSY`], and nothing held.
pub(crate) fn take(ask: &[String], count: usize) -> Result<(Vec<String>, Vec<File>), String> {
    let (mut uuids, mut files, mut held, mut errors) = (Vec::new(), Vec::new(), 0, Vec::new());
    for uuid in ask {
        if uuids.len() == count {
            break;
        }
        let leased = open(uuid).and_then(|f| {
            rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive)?;
            Ok(f)
        });
        match leased {
            Ok(f) => {
                uuids.push(uuid.clone());
                files.push(f);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => held += 1,
            Err(e) => errors.push(format!("{uuid}: {e}")),
        }
    }
    if uuids.len() < count {
        let mut why = format!(
            "{BUSY}{count} asked, {} of the {} offered free ({held} leased by other rsb jobs)",
            uuids.len(),
            ask.len()
        );
        if !errors.is_empty() {
            why.push_str(&format!("; cannot lease {}", errors.join(", ")));
        }
        return Err(why);
    }
    Ok((uuids, files))
}

/// Who holds the lease of each of `uuids` now, from `/proc/locks` (read once; nothing is
/// locked to find out, so a report never gets in a placement's way).
pub(crate) fn holders(uuids: &[&str]) -> Vec<Option<GpuHolder>> {
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let dir = Path::new(GPU_LEASE_DIR);
    let holder = |uuid: &str| {
        let key = lock_key(&std::fs::symlink_metadata(dir.join(uuid)).ok()?);
        // `1: FLOCK  ADVISORY  WRITE 2345 08:01:1234 0 EOF`; a waiter's line starts `->`.
        let pid = locks.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 5 && f[1] == "FLOCK" && f[5] == key).then(|| f[4].parse().ok())?
        })?;
        Some(who(pid))
    };
    uuids
        .iter()
        .map(|u| valid_uuid(u).then(|| holder(u))?)
        .collect()
}

/// How `/proc/locks` names a file: `MAJOR:MINOR:INODE`, the device numbers in hex.
#[cfg(target_os = "linux")]
fn lock_key(m: &std::fs::Metadata) -> String {
    let (major, minor) = (rustix::fs::major(m.dev()), rustix::fs::minor(m.dev()));
    format!("{major:02x}:{minor:02x}:{}", m.ino())
}

/// No `/proc/locks` here (a development build on a Mac): no lease is ever seen held.
#[cfg(not(target_os = "linux"))]
fn lock_key(_: &std::fs::Metadata) -> String {
    String::new()
}

/// `pid`'s user, and the rsb job it is or runs under (the nearest `rsb-agent job-run`
/// ancestor's `--name`, 32 generations at most).
pub(crate) fn who(pid: u32) -> GpuHolder {
    let uid = std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid());
    let mut at = pid;
    let mut job = None;
    for _ in 0..32 {
        let Some(argv) = crate::proc::args(at) else {
            break;
        };
        let mut args = argv.iter().skip(1);
        if args.next().is_some_and(|a| a == b"job-run") {
            job = args
                .skip_while(|a| a.as_slice() != b"--name")
                .nth(1)
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .filter(|n| rsb_protocol::jobs::valid_job_name(n));
            break;
        }
        match crate::proc::Stat::read(at) {
            Some(st) if st.ppid > 1 => at = st.ppid,
            _ => break,
        }
    }
    GpuHolder { pid, uid, job }
}
