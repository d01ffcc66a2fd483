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
//! agent's 2 MiB budget has about 40 KB of room left. Only writes are handled (the access
//! rights that create, change, rename or delete): reading and executing stay allowed
//! everywhere. Renaming or linking across directories needs ABI 2 (`REFER`); truncation is
//! covered from ABI 3; TCP connect and bind rules from ABI 4 (`net`); from ABI 6 the command is
//! scoped: it cannot signal a process outside its domain (the agent, another command or job,
//! another user's work) nor connect to an abstract unix socket made outside it. A test may
//! lower the ABI the agent sees with `RSB_TEST_LANDLOCK_ABI`.

use std::io;
use std::os::fd::OwnedFd;

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
    let mut roots = Vec::with_capacity(c.write.len() + ALWAYS_WRITABLE.len());
    for w in &c.write {
        let path = expand_home(w);
        let fd = sys::open_path(&path).map_err(|e| {
            AgentError::new(
                if e.kind() == io::ErrorKind::NotFound {
                    ErrorCode::NotFound
                } else {
                    ErrorCode::Io
                },
                format!(
                    "confine: the writable root {w} cannot be opened: {e}; create it or change confine.write"
                ),
            )
        })?;
        roots.push(fd);
    }
    for d in ALWAYS_WRITABLE {
        if let Ok(fd) = sys::open_path(std::path::Path::new(d)) {
            roots.push(fd);
        }
    }
    let ruleset = sys::ruleset(abi, &roots, net.as_deref(), abi >= SCOPE_ABI).map_err(|e| {
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
    /// (a file root gets the rights a file can have).
    /// `net`: the TCP ports allowed (`None`: TCP not handled). `scope`: signals and abstract
    /// unix sockets stay inside the domain.
    pub fn ruleset(
        abi: u32,
        roots: &[OwnedFd],
        net: Option<&[u16]>,
        scope: bool,
    ) -> io::Result<OwnedFd> {
        let handled = writes(abi);
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
        for root in roots {
            let is_dir = rustix::fs::fstat(root)
                .map(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir())
                .unwrap_or(false);
            let allowed = if is_dir {
                handled
            } else {
                handled & (WRITE_FILE | TRUNCATE)
            };
            let rule = PathBeneathAttr {
                allowed_access: allowed,
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

    pub fn ruleset(
        _abi: u32,
        _roots: &[OwnedFd],
        _net: Option<&[u16]>,
        _scope: bool,
    ) -> io::Result<OwnedFd> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "Landlock is Linux's",
        ))
    }
}
