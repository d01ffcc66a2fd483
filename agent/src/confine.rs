//! Landlock: the kernel confines a command to the trees it may change, whatever it is written
//! in and however it spells its commands (a policy that reads bash can be spelled around).
//!
//! The ruleset is built in the agent, before the fork: its descriptor and the descriptors of
//! the writable roots are opened and checked there, so every error is reported by name. The
//! child, between fork and exec, makes two system calls: `prctl(PR_SET_NO_NEW_PRIVS)` and
//! `landlock_restrict_self`. The domain is inherited across exec and fork, so the command and
//! everything it starts stay inside it; the agent itself is never confined.
//!
//! Raw system calls rather than the `landlock` crate: three calls and three structs, and the
//! agent's 2 MiB budget has about 40 KB of room left. Writes are handled (the access
//! rights that create, change, rename or delete); reading and executing are handled only when
//! `read` roots are given, and then stay allowed beneath them, the write roots and the
//! system's trees ([`rsb_protocol::SYSTEM_READABLE`]). Renaming or linking across directories needs ABI 2 (`REFER`); truncation is
//! covered from ABI 3; TCP connect and bind rules from ABI 4 (`net`); from ABI 6 the command is
//! scoped: it cannot signal a process outside its domain (the agent, another command or job,
//! another user's work) nor connect to an abstract unix socket made outside it. A test may
//! lower the ABI the agent sees with `RSB_TEST_LANDLOCK_ABI`.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use rsb_protocol::{AgentError, Confine, ErrorCode};

use crate::util::expand_home;

/// Files every confined command may still write: where output is thrown away and terminals.
const ALWAYS_WRITABLE: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
];

/// The Landlock ABI this kernel serves (0: none, or not Linux).
pub fn abi() -> u32 {
    if let Some(v) = std::env::var("RSB_TEST_LANDLOCK_ABI")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        return v;
    }
    sys::abi()
}

/// A ruleset ready to be applied in a child ([`Prepared::apply_in_child`]).
pub struct Prepared {
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    ruleset: OwnedFd,
    /// The TCP ports enforced (`None`: TCP not confined, asked or not).
    pub net: Option<Vec<u16>>,
}

/// What [`prepare`] decided.
pub enum Decision {
    /// Confined; with what the host could not enforce, when the request allowed that.
    Confine(Prepared, Option<String>),
    /// The host cannot confine and the request allowed that: why.
    Unconfined(String),
}

/// Landlock ABI that TCP rules need.
const NET_ABI: u32 = 4;
/// Landlock ABI that signal and abstract-socket scoping need.
const SCOPE_ABI: u32 = 6;

/// Build the ruleset `c` asks for. Fails when a root cannot be opened, or when the host cannot
/// confine and `c.require` is set.
pub fn prepare(c: &Confine) -> Result<Decision, AgentError> {
    let abi = abi();
    // What the host lacks: refused, or (allowed by `require: false`) noted.
    let refused = |why: &str, fix: &str| {
        AgentError::new(
            ErrorCode::Unsupported,
            format!("confine: {why}; the command was not run ({fix})"),
        )
    };
    if abi == 0 {
        let why = format!(
            "this kernel ({}) has no Landlock (it needs Linux 5.13 or later with landlock in the lsm= list)",
            sys::kernel()
        );
        if c.require {
            return Err(refused(
                &why,
                "set confine.require = false to run unconfined",
            ));
        }
        return Ok(Decision::Unconfined(why));
    }
    let mut partial = None;
    let mut net = c.net.clone();
    if net.is_some() && abi < NET_ABI {
        let why = format!(
            "the network: this kernel ({}) serves Landlock ABI {abi}, and TCP rules need ABI {NET_ABI} (Linux 6.7)",
            sys::kernel()
        );
        if c.require {
            return Err(refused(
                &why,
                "drop confine.net or set confine.require = false",
            ));
        }
        partial = Some(why);
        net = None;
    }
    let mut roots = open_roots(&c.write, "writable")?;
    roots.extend(open_present(ALWAYS_WRITABLE));
    let reads = match &c.read {
        Some(r) => {
            let mut fds = open_roots(r, "readable")?;
            fds.extend(open_present(rsb_protocol::SYSTEM_READABLE));
            Some(fds)
        }
        None => None,
    };
    let scope = abi >= SCOPE_ABI;
    let ruleset = sys::ruleset(abi, Some(&roots), reads.as_deref(), net.as_deref(), scope)
        .map_err(|e| {
            AgentError::new(
                ErrorCode::Io,
                format!("confine: cannot build the Landlock ruleset: {e}"),
            )
        })?;
    Ok(Decision::Confine(Prepared { ruleset, net }, partial))
}

impl Prepared {
    /// Have `cmd`'s child confine itself just before exec.
    pub fn apply_in_child(&self, cmd: &mut std::process::Command) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let fd = self.ruleset.as_raw_fd();
            // SAFETY: runs between fork and exec and makes two system calls (prctl and
            // landlock_restrict_self), both async-signal-safe; it allocates nothing and reads
            // only the descriptor number, which the child inherited.
            unsafe {
                cmd.pre_exec(move || sys::restrict_self(fd));
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = cmd;
    }
}

/// rsb's own changes to files (write, edit, patch, a sync's apply) under a sandbox's write
/// roots: they are commands the model asks for too, so they keep to the same trees.
///
/// Two layers. The boundary is a descriptor check: the directory a change is made in, held
/// open, is walked up by `..` to a root's (device, inode), so neither a symlink on the path nor
/// one swapped in later redirects the change (every step after the check goes through that
/// descriptor). Beneath it, where Landlock is available, [`own_writes`] runs the change in a
/// thread of its own that the kernel confines to the roots (a thread's domain is its own and
/// ends with it), which also covers directories a change creates on its way.
pub struct Writable(Option<Roots>);

struct Roots {
    /// (device, inode) of each root, held open (the Landlock rules are built from them).
    ids: Vec<(u64, u64)>,
    fds: Vec<OwnedFd>,
    /// The roots as configured, for messages.
    shown: String,
}

/// Most `..` steps a check takes (deeper than any real tree).
const MAX_DEPTH: usize = 4096;

impl Writable {
    /// No confinement: every check passes.
    pub fn any() -> Writable {
        Writable(None)
    }

    /// `c`'s write roots, opened (each must exist).
    pub fn open(c: &Confine) -> Result<Writable, AgentError> {
        let mut ids = Vec::with_capacity(c.write.len());
        let mut fds = Vec::with_capacity(c.write.len());
        for w in &c.write {
            let fd = sys::open_path(&expand_home(w)).map_err(|e| root_error("writable", w, &e))?;
            let st = rustix::fs::fstat(&fd).map_err(|e| root_error("writable", w, &e.into()))?;
            ids.push(dev_ino(&st));
            fds.push(fd);
        }
        let shown = if c.write.is_empty() {
            "none".to_string()
        } else {
            c.write.join(", ")
        };
        Ok(Writable(Some(Roots { ids, fds, shown })))
    }

    fn refused(&self, what: &str, shown: &str) -> AgentError {
        let roots = self.0.as_ref().map_or("", |r| r.shown.as_str());
        AgentError::new(
            ErrorCode::PermissionDenied,
            format!(
                "confine: {what} {shown} is outside this sandbox's writable roots ({roots}); rsb's own writes keep to them, as commands do"
            ),
        )
    }

    /// Before `path` is resolved (and missing directories made): its deepest existing
    /// ancestor, symlinks followed, is beneath a root, and nothing after it climbs out.
    pub fn check_path(&self, path: &Path, what: &str) -> Result<(), AgentError> {
        match &self.0 {
            Some(roots) if !roots.holds(path) => {
                Err(self.refused(what, &crate::util::path_string(path)))
            }
            _ => Ok(()),
        }
    }

    /// After resolving: `dir`, the held directory a change is made in, is beneath a root.
    pub fn check_dir(
        &self,
        dir: &impl std::os::fd::AsFd,
        shown: &str,
        what: &str,
    ) -> Result<(), AgentError> {
        match &self.0 {
            Some(roots) if !roots.beneath(dir) => Err(self.refused(what, shown)),
            _ => Ok(()),
        }
    }
}

/// Each of `roots` (`~` expanded), opened; each must exist.
fn open_roots(roots: &[String], kind: &str) -> Result<Vec<OwnedFd>, AgentError> {
    roots
        .iter()
        .map(|r| sys::open_path(&expand_home(r)).map_err(|e| root_error(kind, r, &e)))
        .collect()
}

/// Those of `paths` this host has, opened.
fn open_present(paths: &[&str]) -> impl Iterator<Item = OwnedFd> {
    paths
        .iter()
        .filter_map(|p| sys::open_path(Path::new(p)).ok())
}

fn root_error(kind: &str, w: &str, e: &io::Error) -> AgentError {
    AgentError::new(
        if e.kind() == io::ErrorKind::NotFound {
            ErrorCode::NotFound
        } else {
            ErrorCode::Io
        },
        format!(
            "confine: the {kind} root {w} cannot be opened: {e}; create it or change confine.{}",
            if kind == "readable" { "read" } else { "write" }
        ),
    )
}

// `st_dev`/`st_ino` are not u64 on every target.
#[allow(clippy::unnecessary_cast)]
fn dev_ino(st: &rustix::fs::Stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

/// A directory, for walking up from and for `fstat` only.
fn open_dir(path: &Path) -> rustix::io::Result<OwnedFd> {
    rustix::fs::open(path, dir_flags(), rustix::fs::Mode::empty())
}

fn dir_flags() -> rustix::fs::OFlags {
    use rustix::fs::OFlags;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let how = OFlags::PATH;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let how = OFlags::RDONLY;
    how | OFlags::DIRECTORY | OFlags::CLOEXEC
}

impl Roots {
    /// `path`'s deepest existing ancestor, symlinks followed, is beneath a root, and nothing
    /// after it climbs out.
    fn holds(&self, path: &Path) -> bool {
        for anc in path.ancestors().filter(|a| !a.as_os_str().is_empty()) {
            let Ok(fd) = open_dir(anc) else {
                continue;
            };
            let rest = path.strip_prefix(anc).unwrap_or(path);
            let climbs = rest
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir));
            return !climbs && self.beneath(&fd);
        }
        false
    }

    /// `dir` is a root or beneath one: walked up by `..` (what the kernel resolves, mounts
    /// included) until a root's identity or the top.
    fn beneath(&self, dir: &impl std::os::fd::AsFd) -> bool {
        let Ok(mut cur) = rustix::fs::openat(dir, ".", dir_flags(), rustix::fs::Mode::empty())
        else {
            return false;
        };
        for _ in 0..MAX_DEPTH {
            let Ok(st) = rustix::fs::fstat(&cur) else {
                return false;
            };
            let id = dev_ino(&st);
            if self.ids.contains(&id) {
                return true;
            }
            let Ok(up) = rustix::fs::openat(&cur, "..", dir_flags(), rustix::fs::Mode::empty())
            else {
                return false;
            };
            match rustix::fs::fstat(&up) {
                Ok(ust) if dev_ino(&ust) != id => cur = up,
                _ => return false,
            }
        }
        false
    }
}

/// Run `f`, rsb's own change to files, under `c`'s write roots: `f` checks what it changes
/// with the [`Writable`] it is given, and where Landlock is available it runs in a new thread
/// the kernel confines to the roots (the domain is the thread's own and ends with it; the
/// agent's other threads are untouched). Without `c`, `f` runs here, unchecked.
pub fn own_writes<T: Send>(
    c: Option<&Confine>,
    f: impl FnOnce(&Writable) -> Result<T, AgentError> + Send,
) -> Result<T, AgentError> {
    let (w, ruleset) = match c {
        Some(c) => {
            let w = Writable::open(c)?;
            let abi = abi();
            let fds = w.0.as_ref().map_or(&[][..], |r| r.fds.as_slice());
            let ruleset = (abi > 0)
                .then(|| sys::ruleset(abi, Some(fds), None, None, false))
                .transpose()
                .map_err(ruleset_error)?;
            (w, ruleset)
        }
        None => (Writable::any(), None),
    };
    run_confined(ruleset.as_ref(), || f(&w))
}

/// Open a confined job's log for appending, one of rsb's own writes: its directory, held, is
/// beneath a write root (walked up by identity), and the file is opened through it without
/// following a final symlink, so a link planted in a root does not send the job's output
/// elsewhere (`~/.bashrc`).
pub fn open_log(c: &Confine, path: &Path) -> Result<std::fs::File, AgentError> {
    use rustix::fs::{Mode, OFlags};
    let shown = crate::util::path_string(path);
    let io_err = |e: io::Error| AgentError::from_io(&e, "log file", &shown);
    let w = Writable::open(c)?;
    w.check_path(path, "log file")?;
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(w.refused("log file", &shown));
    };
    std::fs::create_dir_all(dir).map_err(io_err)?;
    let dir = rustix::fs::open(dir, OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| io_err(e.into()))?;
    w.check_dir(&dir, &shown, "log file")?;
    let how = OFlags::WRONLY | OFlags::APPEND | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    match rustix::fs::openat(&dir, name, how, Mode::from_raw_mode(0o644)) {
        Ok(fd) => Ok(fd.into()),
        // A symlink as the log: it would lead the output wherever it points.
        Err(rustix::io::Errno::LOOP) => Err(w.refused("log file", &shown)),
        Err(e) => Err(io_err(e.into())),
    }
}

fn ruleset_error(e: io::Error) -> AgentError {
    AgentError::new(
        ErrorCode::Io,
        format!("confine: cannot build the Landlock ruleset: {e}"),
    )
}

/// `f`, run in a new thread confined by `ruleset`, or here without one (called from one
/// place, so that `f`'s body is not copied into two).
fn run_confined<T: Send>(
    ruleset: Option<&OwnedFd>,
    f: impl FnOnce() -> Result<T, AgentError> + Send,
) -> Result<T, AgentError> {
    let mut f = Some(f);
    let mut out = None;
    run_body(ruleset, &mut || {
        if let Some(f) = f.take() {
            out = Some(f());
        }
    })?;
    out.unwrap_or_else(|| Err(AgentError::new(ErrorCode::Internal, "worker failed")))
}

/// Run `f`, rsb's own read of `path` (a file, a listing, a sync's walk, a search), under `c`'s
/// read roots when it has them: `path`, its symlinks resolved, must be beneath a read root, a
/// write root, one of the system's directories or rsb's own data (the check that answers by
/// name, and the only one `stat` meets: Landlock does not govern it); and where Landlock is
/// available `f` runs in a thread the kernel confines to reading those trees, so a symlink met
/// inside a tree or swapped in after the check leads nowhere else.
pub fn own_reads<T: Send>(
    c: Option<&Confine>,
    path: &Path,
    f: impl FnOnce() -> Result<T, AgentError> + Send,
) -> Result<T, AgentError> {
    let ruleset = reads_allowed(c, path)?;
    run_confined(ruleset.as_ref(), f)
}

/// [`own_reads`]'s check of `path`; the ruleset its read runs under (`None`: reads are not
/// confined, or this host has no Landlock and the check is all there is).
fn reads_allowed(c: Option<&Confine>, path: &Path) -> Result<Option<OwnedFd>, AgentError> {
    let Some((c, read)) = c.and_then(|c| Some((c, c.read.as_ref()?))) else {
        return Ok(None);
    };
    let mut fds = open_roots(read, "readable")?;
    fds.extend(open_roots(&c.write, "writable")?);
    fds.extend(open_present(rsb_protocol::SYSTEM_READABLE));
    // rsb's own data: its jobs' records and logs, and its hash cache.
    let own = [
        crate::util::home_dir().map(|h| h.join(rsb_protocol::JOBS_ROOT)),
        crate::util::hash_cache_dir(),
    ];
    fds.extend(own.iter().flatten().filter_map(|d| sys::open_path(d).ok()));
    let mut ids = Vec::with_capacity(fds.len());
    for fd in &fds {
        ids.push(dev_ino(&rustix::fs::fstat(fd).map_err(|e| {
            AgentError::new(
                ErrorCode::Io,
                format!("confine: a root cannot be read: {e}"),
            )
        })?));
    }
    let shown: Vec<&str> = read.iter().chain(&c.write).map(String::as_str).collect();
    let roots = Roots {
        ids,
        fds,
        shown: format!(
            "{}, the system's directories, rsb's job logs",
            shown.join(", ")
        ),
    };
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    if !roots.holds(&target) {
        return Err(AgentError::new(
            ErrorCode::PermissionDenied,
            format!(
                "confine: read {} is outside this sandbox's readable roots ({}); rsb's own reads keep to them, as commands do",
                crate::util::path_string(path),
                roots.shown
            ),
        ));
    }
    let abi = abi();
    if abi == 0 {
        return Ok(None);
    }
    sys::ruleset(abi, None, Some(&roots.fds), None, false)
        .map(Some)
        .map_err(ruleset_error)
}

/// Run `body` in a new thread confined by `ruleset` and wait for it, or here without one (not
/// generic: one copy in the agent, whatever the change).
fn run_body(ruleset: Option<&OwnedFd>, body: &mut (dyn FnMut() + Send)) -> Result<(), AgentError> {
    let Some(ruleset) = ruleset else {
        body();
        return Ok(());
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            sys::restrict_thread(ruleset).map_err(|e| {
                AgentError::new(
                    ErrorCode::Io,
                    format!("confine: cannot confine this call (landlock_restrict_self: {e}); nothing was done"),
                )
            })?;
            body();
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(AgentError::new(
                ErrorCode::Internal,
                "worker failed: a confined call panicked",
            ))
        })
    })
}

#[cfg(target_os = "linux")]
mod sys {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    const SYS_CREATE_RULESET: libc::c_long = 444;
    const SYS_ADD_RULE: libc::c_long = 445;
    const SYS_RESTRICT_SELF: libc::c_long = 446;
    const CREATE_RULESET_VERSION: u32 = 1;
    const RULE_PATH_BENEATH: u32 = 1;

    const EXECUTE: u64 = 1 << 0;
    const READ_FILE: u64 = 1 << 2;
    const READ_DIR: u64 = 1 << 3;
    /// The rights that read and execute.
    const READS: u64 = EXECUTE | READ_FILE | READ_DIR;

    const WRITE_FILE: u64 = 1 << 1;
    const REMOVE_DIR: u64 = 1 << 4;
    const REMOVE_FILE: u64 = 1 << 5;
    const MAKE_CHAR: u64 = 1 << 6;
    const MAKE_DIR: u64 = 1 << 7;
    const MAKE_REG: u64 = 1 << 8;
    const MAKE_SOCK: u64 = 1 << 9;
    const MAKE_FIFO: u64 = 1 << 10;
    const MAKE_BLOCK: u64 = 1 << 11;
    const MAKE_SYM: u64 = 1 << 12;
    /// ABI 2.
    const REFER: u64 = 1 << 13;
    /// ABI 3.
    const TRUNCATE: u64 = 1 << 14;
    /// The rights a rule on a file (not a directory) may carry.
    const FILE_RIGHTS: u64 = EXECUTE | READ_FILE | WRITE_FILE | TRUNCATE;

    /// The rights that change the file system, as far as `abi` knows them.
    fn writes(abi: u32) -> u64 {
        let mut w = WRITE_FILE
            | REMOVE_DIR
            | REMOVE_FILE
            | MAKE_CHAR
            | MAKE_DIR
            | MAKE_REG
            | MAKE_SOCK
            | MAKE_FIFO
            | MAKE_BLOCK
            | MAKE_SYM;
        if abi >= 2 {
            w |= REFER;
        }
        if abi >= 3 {
            w |= TRUNCATE;
        }
        w
    }

    const RULE_NET_PORT: u32 = 2;
    const BIND_TCP: u64 = 1 << 0;
    const CONNECT_TCP: u64 = 1 << 1;
    const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
    const SCOPE_SIGNAL: u64 = 1 << 1;

    #[repr(C)]
    struct RulesetAttr {
        handled_access_fs: u64,
        /// ABI 4.
        handled_access_net: u64,
        /// ABI 6.
        scoped: u64,
    }

    #[repr(C)]
    struct NetPortAttr {
        allowed_access: u64,
        port: u64,
    }

    #[repr(C, packed)]
    struct PathBeneathAttr {
        allowed_access: u64,
        parent_fd: i32,
    }

    pub fn abi() -> u32 {
        // SAFETY: with a null attribute and size 0 this only asks for the ABI version.
        let v = unsafe {
            libc::syscall(
                SYS_CREATE_RULESET,
                std::ptr::null::<RulesetAttr>(),
                0usize,
                CREATE_RULESET_VERSION,
            )
        };
        u32::try_from(v).unwrap_or(0)
    }

    pub fn kernel() -> String {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| format!("Linux {}", s.trim()))
            .unwrap_or_else(|_| "Linux".into())
    }

    pub fn open_path(path: &Path) -> io::Result<OwnedFd> {
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path"))?;
        // SAFETY: a valid C string; the returned descriptor is owned below.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A ruleset handling every write right of `abi`, allowing them beneath each of `roots`
    /// (a file root gets the rights a file can have; `None`: writes not handled). `reads`: reading and executing handled
    /// too, allowed beneath these and the write roots (`None`: not handled).
    /// `net`: the TCP ports allowed (`None`: TCP not handled). `scope`: signals and abstract
    /// unix sockets stay inside the domain.
    pub fn ruleset(
        abi: u32,
        roots: Option<&[OwnedFd]>,
        reads: Option<&[OwnedFd]>,
        net: Option<&[u16]>,
        scope: bool,
    ) -> io::Result<OwnedFd> {
        let handled = roots.map_or(0, |_| writes(abi)) | reads.map_or(0, |_| READS);
        let attr = RulesetAttr {
            handled_access_fs: handled,
            handled_access_net: if net.is_some() {
                BIND_TCP | CONNECT_TCP
            } else {
                0
            },
            scoped: if scope {
                SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
            } else {
                0
            },
        };
        // The size an older kernel knows when the newer fields are not used.
        let size = if scope {
            std::mem::size_of::<RulesetAttr>()
        } else if net.is_some() {
            16
        } else {
            8
        };
        // SAFETY: `attr` is a valid ruleset attribute at least the size passed.
        let fd =
            unsafe { libc::syscall(SYS_CREATE_RULESET, &attr as *const RulesetAttr, size, 0u32) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor owned by nothing else.
        let ruleset = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let granted = roots
            .unwrap_or_default()
            .iter()
            .map(|r| (r, handled))
            .chain(reads.unwrap_or_default().iter().map(|r| (r, READS)));
        for (root, rights) in granted {
            let is_dir = rustix::fs::fstat(root)
                .map(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir())
                .unwrap_or(false);
            let rule = PathBeneathAttr {
                allowed_access: if is_dir { rights } else { rights & FILE_RIGHTS },
                parent_fd: root.as_raw_fd(),
            };
            // SAFETY: `rule` is a valid path-beneath attribute; both descriptors are open.
            let r = unsafe {
                libc::syscall(
                    SYS_ADD_RULE,
                    ruleset.as_raw_fd(),
                    RULE_PATH_BENEATH,
                    &rule as *const PathBeneathAttr,
                    0u32,
                )
            };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        for &port in net.unwrap_or_default() {
            let rule = NetPortAttr {
                allowed_access: BIND_TCP | CONNECT_TCP,
                port: u64::from(port),
            };
            // SAFETY: `rule` is a valid net-port attribute; the ruleset descriptor is open.
            let r = unsafe {
                libc::syscall(
                    SYS_ADD_RULE,
                    ruleset.as_raw_fd(),
                    RULE_NET_PORT,
                    &rule as *const NetPortAttr,
                    0u32,
                )
            };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(ruleset)
    }

    /// This thread only: [`restrict_self`] (both calls act on the calling thread).
    pub fn restrict_thread(ruleset: &OwnedFd) -> io::Result<()> {
        restrict_self(ruleset.as_raw_fd())
    }

    /// In the child: no new privileges (required to confine without CAP_SYS_ADMIN, and what
    /// keeps a set-id program from running with more rights), then the ruleset.
    pub fn restrict_self(ruleset: RawFd) -> io::Result<()> {
        // SAFETY: plain system calls with integer arguments.
        unsafe {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::syscall(SYS_RESTRICT_SELF, ruleset, 0u32) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    use std::io;
    use std::os::fd::OwnedFd;
    use std::path::Path;

    pub fn abi() -> u32 {
        0
    }

    pub fn kernel() -> String {
        "not Linux".into()
    }

    pub fn open_path(path: &Path) -> io::Result<OwnedFd> {
        Ok(std::fs::File::open(path)?.into())
    }

    pub fn restrict_thread(_ruleset: &OwnedFd) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "Landlock is Linux's",
        ))
    }

    pub fn ruleset(
        _abi: u32,
        _roots: Option<&[OwnedFd]>,
        _reads: Option<&[OwnedFd]>,
        _net: Option<&[u16]>,
        _scope: bool,
    ) -> io::Result<OwnedFd> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "Landlock is Linux's",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn confine(roots: &[&Path]) -> Confine {
        Confine {
            write: roots.iter().map(|p| p.display().to_string()).collect(),
            read: None,
            net: None,
            require: true,
        }
    }

    /// The descriptor check: a root and what is beneath it pass, by any spelling; a sibling,
    /// a parent, a `..` out of it and a symlink inside it that points out do not.
    #[test]
    fn writable_holds_to_the_roots_by_identity_not_spelling() {
        let t = tempfile::tempdir().unwrap();
        let (root, out) = (t.path().join("root"), t.path().join("out"));
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::create_dir_all(&out).unwrap();
        std::os::unix::fs::symlink(&out, root.join("link")).unwrap();
        std::os::unix::fs::symlink(root.join("a"), t.path().join("to-a")).unwrap();
        let w = Writable::open(&confine(&[&root])).unwrap();
        for ok in [
            root.clone(),
            root.join("a/b/new.txt"),
            root.join("a/missing/deeper/new.txt"),
            t.path().join("to-a/b/file"),
            root.join("a/../a/b"),
        ] {
            assert!(w.check_path(&ok, "write").is_ok(), "{}", ok.display());
        }
        for bad in [
            out.join("x"),
            t.path().to_path_buf(),
            root.join("../out/x"),
            root.join("link/x"),
            root.join("a/missing/../../../out/x"),
            std::path::PathBuf::from("/x"),
        ] {
            let e = w.check_path(&bad, "write").unwrap_err();
            assert_eq!(e.code, ErrorCode::PermissionDenied, "{}", bad.display());
            assert!(e.message.contains("writable roots"), "{}", e.message);
        }
        let held = |p: &Path| open_dir(p).unwrap();
        assert!(w.check_dir(&held(&root.join("a/b")), "", "write").is_ok());
        assert!(w.check_dir(&held(&root.join("link")), "", "write").is_err());
        assert!(w.check_dir(&held(&out), "", "write").is_err());
        assert!(Writable::any().check_path(&out, "write").is_ok());
        let e = Writable::open(&confine(&[&t.path().join("nope")]))
            .err()
            .unwrap();
        assert!(e.message.contains("cannot be opened"), "{}", e.message);
    }

    /// `data`, `work` and `secret` under `at`, each with a file `f` holding its own name, and
    /// `data/link` pointing at `secret/f`.
    fn three_trees(at: &Path) -> (PathBuf, PathBuf, PathBuf) {
        let trees = (at.join("data"), at.join("work"), at.join("secret"));
        for d in [&trees.0, &trees.1, &trees.2] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("f"), d.file_name().unwrap().as_encoded_bytes()).unwrap();
        }
        std::os::unix::fs::symlink(trees.2.join("f"), trees.0.join("link")).unwrap();
        trees
    }

    /// With `read` roots, a confined command reads and executes only beneath them, the write
    /// roots and the system's trees: a secret beside them is out of reach by any path, and
    /// the shell and its programs still run.
    #[test]
    fn read_roots_keep_a_command_to_them() {
        if abi() < 1 {
            eprintln!("no Landlock here: skipped");
            return;
        }
        let t = tempfile::tempdir_in(std::env::var_os("HOME").unwrap()).unwrap();
        let (data, work, _) = three_trees(t.path());
        let mut c = confine(&[&work]);
        c.read = Some(vec![data.display().to_string()]);
        let Decision::Confine(p, None) = prepare(&c).unwrap() else {
            panic!("not confined");
        };
        let run = |script: &str| {
            let mut cmd = std::process::Command::new("/bin/sh");
            cmd.args(["-c", script]).current_dir(t.path());
            p.apply_in_child(&mut cmd);
            let out = cmd.output().unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        };
        assert_eq!(
            run("cat data/f work/f; ls /usr/bin | grep -c '^ls$'"),
            (Some(0), "datawork1\n".into())
        );
        assert_eq!(
            run("echo new > work/g && cat work/g"),
            (Some(0), "new\n".into())
        );
        for bad in [
            "cat secret/f",
            "cat data/link",
            "ls secret",
            "cat ../*/secret/f",
            "cp secret/f work/",
        ] {
            assert_ne!(run(bad).0, Some(0), "{bad} read the secret");
        }
        let mut missing = c.clone();
        missing.read = Some(vec![t.path().join("nope").display().to_string()]);
        let e = prepare(&missing).err().unwrap();
        assert!(
            e.message.contains("the readable root") && e.message.contains("confine.read"),
            "{}",
            e.message
        );
    }

    /// rsb's own reads: a path out of the roots is refused by name, a symlink pointing out
    /// included; a read the check would not see (a swap after it) meets the kernel in the
    /// confined thread; the system's files stay readable.
    #[test]
    fn own_reads_keep_to_the_read_roots() {
        let t = tempfile::tempdir().unwrap();
        let (data, work, secret) = three_trees(t.path());
        let mut c = confine(&[&work]);
        c.read = Some(vec![data.display().to_string()]);
        let read = |p: &Path| std::fs::read(p).map_err(|e| AgentError::from_io(&e, "read", ""));
        for ok in [data.join("f"), work.join("f"), PathBuf::from("/etc/passwd")] {
            assert!(
                own_reads(Some(&c), &ok, || read(&ok)).is_ok(),
                "{}",
                ok.display()
            );
        }
        for bad in [
            secret.join("f"),
            data.join("link"),
            data.join("../secret/f"),
        ] {
            let e = own_reads(Some(&c), &bad, || read(&bad)).unwrap_err();
            assert!(e.message.contains("readable roots"), "{}", e.message);
        }
        assert!(own_reads(None, &secret.join("f"), || read(&secret.join("f"))).is_ok());
        if abi() >= 1 {
            let e = own_reads(Some(&c), &data.join("f"), || read(&secret.join("f"))).unwrap_err();
            assert_eq!(e.code, ErrorCode::PermissionDenied, "{}", e.message);
            std::fs::read(secret.join("f")).unwrap();
        }
    }

    /// A confined job's log: beneath a root it opens (directories made), appending; outside
    /// one, through `..`, or as a symlink planted in a root, it is refused and nothing written.
    #[test]
    fn a_confined_jobs_log_keeps_to_the_write_roots() {
        let t = tempfile::tempdir().unwrap();
        let (root, rc) = (t.path().join("root"), t.path().join(".bashrc"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(&rc, "mine\n").unwrap();
        std::os::unix::fs::symlink(&rc, root.join("rc.log")).unwrap();
        let c = confine(&[&root]);
        use std::io::Write;
        let mut f = open_log(&c, &root.join("logs/a.log")).unwrap();
        f.write_all(b"one\n").unwrap();
        open_log(&c, &root.join("logs/a.log"))
            .unwrap()
            .write_all(b"two\n")
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(root.join("logs/a.log")).unwrap(),
            "one\ntwo\n"
        );
        for bad in [
            rc.clone(),
            root.join("rc.log"),
            root.join("../.bashrc"),
            t.path().join("new/x.log"),
        ] {
            let e = open_log(&c, &bad).unwrap_err();
            assert!(
                e.message.contains("writable roots"),
                "{}: {}",
                bad.display(),
                e.message
            );
        }
        assert_eq!(std::fs::read_to_string(&rc).unwrap(), "mine\n");
        assert!(!t.path().join("new").exists());
    }

    /// With Landlock, the change runs in a thread the kernel confines (a write the check
    /// would not see is refused too), and the calling thread stays free.
    #[test]
    fn own_writes_confine_a_thread_of_their_own() {
        if abi() < 1 {
            eprintln!("no Landlock here: skipped");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let (root, out) = (t.path().join("root"), t.path().join("out"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&out).unwrap();
        let c = confine(&[&root]);
        let r = own_writes(Some(&c), |_| {
            std::fs::write(root.join("in.txt"), "in")
                .map_err(|e| AgentError::from_io(&e, "w", ""))?;
            std::fs::write(out.join("x"), "x").map_err(|e| AgentError::from_io(&e, "w", ""))
        });
        assert_eq!(r.unwrap_err().code, ErrorCode::PermissionDenied);
        assert!(root.join("in.txt").exists() && !out.join("x").exists());
        std::fs::write(out.join("after"), "free").unwrap();
    }
}
