//! Why a background job failed, read from evidence rather than guessed: the scheduler's own
//! word (Slurm's state), the framework's message in the run's own output, the signal that
//! ended it. A job that ended non-zero with none of these is `unknown`.
//!
//! The output is text from the host: it only selects a reason from a fixed set, and the line
//! quoted as the detail is one line, clipped, with control characters escaped.

use serde_json::{Map, Value, json};

/// One of a fixed set of reasons (`failure_reason` in job replies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The framework said the GPU ran out of memory (PyTorch, CUDA, XLA).
    CudaOom,
    /// The host's or the job's memory limit killed it (Slurm's OUT_OF_MEMORY).
    HostOom,
    /// A collective operation timed out (NCCL, PyTorch's watchdog).
    NcclTimeout,
    /// A write failed for want of space or quota.
    DiskFull,
    /// Slurm preempted it.
    Preempted,
    /// Slurm lost its node.
    NodeFail,
    /// Slurm ended it at its time limit.
    TimeLimit,
    /// A signal ended it (the detail names which).
    Signal,
    /// Python raised an exception nobody caught (the detail is its last line).
    PythonException,
    /// None of the above.
    Unknown,
}

impl Reason {
    /// The reason's word, as `failure_reason` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Reason::CudaOom => "cuda_oom",
            Reason::HostOom => "host_oom",
            Reason::NcclTimeout => "nccl_timeout",
            Reason::DiskFull => "disk_full",
            Reason::Preempted => "preempted",
            Reason::NodeFail => "node_fail",
            Reason::TimeLimit => "time_limit",
            Reason::Signal => "signal",
            Reason::PythonException => "python_exception",
            Reason::Unknown => "unknown",
        }
    }
}

/// A failed job's reason, and the evidence in one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub reason: Reason,
    pub detail: Option<String>,
}

/// How a run ended, as far as the record and the scheduler say.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ended<'a> {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// Slurm's state for the job, when it went through Slurm.
    pub slurm_state: Option<&'a str>,
    /// The agent's evidence of an OOM kill (a SIGKILL while the kernel counted one).
    pub oom_kill: Option<rsb_protocol::OomKill>,
}

impl Ended<'_> {
    /// Whether this end is a failure: non-zero, a signal, or a final Slurm state other than
    /// success. A cancelled job is not one (its reply says `cancelled`), nor one still running.
    pub fn failed(&self) -> bool {
        match self.slurm_state {
            Some("CANCELLED") => false,
            Some(s) if !crate::slurm::state::meaning(s).1 => false,
            Some(s) if s != "COMPLETED" => true,
            _ => self.exit_code.is_some_and(|c| c != 0) || self.signal.is_some(),
        }
    }
}

/// Set `failure_reason` (and `failure_detail`, the evidence) in a job reply, or take them out
/// when the run did not fail.
pub fn put(m: &mut Map<String, Value>, end: Ended<'_>, output: &str) {
    m.remove("failure_reason");
    m.remove("failure_detail");
    if let Some(f) = judge(end, output) {
        m.insert("failure_reason".into(), json!(f.reason.name()));
        if let Some(d) = f.detail {
            m.insert("failure_detail".into(), json!(d));
        }
    }
}

/// The most of the output's tail that is looked at (the end of a run says why it ended).
pub const TAIL_BYTES: usize = 64 * 1024;
const DETAIL_CHARS: usize = 300;

/// Why the run that ended as `end`, having printed `output` (its own output, without rsb's
/// header and exit line), failed; `None` when it did not fail.
pub fn judge(end: Ended<'_>, output: &str) -> Option<Failure> {
    if !end.failed() {
        return None;
    }
    let tail = tail_of(output);
    let found = |reason, line: Option<&str>| {
        Some(Failure {
            reason,
            detail: line.map(one_line),
        })
    };
    match end.slurm_state {
        Some("PREEMPTED") => return found(Reason::Preempted, None),
        Some("NODE_FAIL") => return found(Reason::NodeFail, None),
        Some("OUT_OF_MEMORY") => return found(Reason::HostOom, None),
        Some("TIMEOUT") => return found(Reason::TimeLimit, None),
        _ => {}
    }
    if let Some(k) = end.oom_kill {
        let why = match k {
            rsb_protocol::OomKill::Cgroup => "its memory cgroup reached its limit",
            rsb_protocol::OomKill::Host => "the host ran out of memory",
        };
        return Some(Failure {
            reason: Reason::HostOom,
            detail: Some(format!("killed by the kernel's OOM killer: {why}")),
        });
    }
    if let Some(l) = last_line_with(tail, CUDA_OOM) {
        return found(Reason::CudaOom, Some(l));
    }
    if let Some(l) = last_line_where(tail, |l| {
        let low = l.to_ascii_lowercase();
        (low.contains("nccl") || low.contains("collective operation"))
            && (low.contains("timeout") || low.contains("timed out"))
    }) {
        return found(Reason::NcclTimeout, Some(l));
    }
    if let Some(l) = last_line_with(tail, DISK_FULL) {
        return found(Reason::DiskFull, Some(l));
    }
    if let Some(s) = end.signal.filter(|s| *s > 0) {
        return Some(Failure {
            reason: Reason::Signal,
            detail: Some(format!("killed by signal {s}{}", signal_name(s))),
        });
    }
    // A shell reports its command's death by signal N as exit 128+N, and says so in the log.
    if let Some(s) = end
        .exit_code
        .map(|c| c - 128)
        .filter(|s| (1..=31).contains(s))
        && let Some(l) = last_line_with(tail, shell_says(s))
    {
        return Some(Failure {
            reason: Reason::Signal,
            detail: Some(format!("signal {s}{}: {}", signal_name(s), one_line(l))),
        });
    }
    if let Some(l) = python_exception(tail) {
        return found(Reason::PythonException, Some(l));
    }
    found(Reason::Unknown, None)
}

/// What frameworks print when the GPU runs out of memory.
const CUDA_OOM: &[&str] = &[
    "CUDA out of memory",
    "torch.cuda.OutOfMemoryError",
    "torch.OutOfMemoryError",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "cudaErrorMemoryAllocation",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "RESOURCE_EXHAUSTED: Out of memory",
];

/// What a write that found no space (or no quota) prints: strerror(ENOSPC), (EDQUOT).
const DISK_FULL: &[&str] = &["No space left on device", "Disk quota exceeded", "ENOSPC"];

/// The words bash prints for a command that a signal killed (its `strsignal`).
fn shell_says(signal: i32) -> &'static [&'static str] {
    match signal {
        4 => &["Illegal instruction"],
        6 => &["Aborted"],
        7 => &["Bus error"],
        8 => &["Floating point exception"],
        9 => &["Killed"],
        11 => &["Segmentation fault"],
        15 => &["Terminated"],
        _ => &[],
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        1 => " (SIGHUP)",
        2 => " (SIGINT)",
        4 => " (SIGILL)",
        6 => " (SIGABRT)",
        7 => " (SIGBUS)",
        8 => " (SIGFPE)",
        9 => " (SIGKILL)",
        11 => " (SIGSEGV)",
        13 => " (SIGPIPE)",
        15 => " (SIGTERM)",
        _ => "",
    }
}

/// The last [`TAIL_BYTES`] of `output`, from a line start.
fn tail_of(output: &str) -> &str {
    if output.len() <= TAIL_BYTES {
        return output;
    }
    let mut at = output.len() - TAIL_BYTES;
    while !output.is_char_boundary(at) {
        at += 1;
    }
    let t = &output[at..];
    t.find('\n').map_or(t, |i| &t[i + 1..])
}

fn last_line_where(tail: &str, pred: impl Fn(&str) -> bool) -> Option<&str> {
    tail.lines().rev().find(|l| pred(l))
}

fn last_line_with<'a>(tail: &'a str, needles: &[&str]) -> Option<&'a str> {
    if needles.is_empty() {
        return None;
    }
    last_line_where(tail, |l| needles.iter().any(|n| l.contains(n)))
}

/// After Python's last `Traceback (most recent call last):`, the exception's line: the first
/// line from the left margin that names an exception (`pkg.Name: message` or `Name`).
fn python_exception(tail: &str) -> Option<&str> {
    let at = tail.rfind("Traceback (most recent call last):")?;
    tail[at..].lines().skip(1).find(|l| {
        let head = l.split(':').next().unwrap_or_default();
        !l.starts_with(char::is_whitespace)
            && !head.is_empty()
            && head
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            && (head.ends_with("Error")
                || head.ends_with("Exception")
                || head.ends_with("Interrupt")
                || head.ends_with("Exit")
                || head.contains("Error")
                || head.contains("Exception"))
    })
}

/// One line of host text as a detail: control characters escaped, clipped.
fn one_line(l: &str) -> String {
    let shown = crate::term::shown(l.trim());
    match shown.char_indices().nth(DETAIL_CHARS) {
        Some((i, _)) => format!("{}…", &shown[..i]),
        None => shown.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(c: i32) -> Ended<'static> {
        Ended {
            exit_code: Some(c),
            ..Ended::default()
        }
    }

    fn reason(end: Ended<'_>, out: &str) -> Option<Reason> {
        judge(end, out).map(|f| f.reason)
    }

    #[test]
    fn a_success_is_no_failure_whatever_it_printed() {
        assert_eq!(reason(exit(0), "CUDA out of memory\n"), None);
        assert_eq!(
            reason(
                Ended {
                    exit_code: Some(0),
                    slurm_state: Some("COMPLETED"),
                    ..Ended::default()
                },
                ""
            ),
            None
        );
    }

    #[test]
    fn an_oom_kill_the_agent_saw_is_host_oom_and_a_bare_sigkill_is_a_signal() {
        let killed = |oom_kill| Ended {
            signal: Some(9),
            oom_kill,
            ..Ended::default()
        };
        let f = judge(killed(Some(rsb_protocol::OomKill::Cgroup)), "step 1\n").unwrap();
        assert_eq!(f.reason, Reason::HostOom);
        assert!(
            f.detail
                .unwrap()
                .contains("memory cgroup reached its limit")
        );
        let f = judge(killed(Some(rsb_protocol::OomKill::Host)), "").unwrap();
        assert!(f.detail.unwrap().contains("host ran out of memory"));
        assert_eq!(reason(killed(None), ""), Some(Reason::Signal));
    }

    #[test]
    fn a_plain_exit_1_stays_unknown() {
        let f = judge(exit(1), "step 1\nstep 2\n").unwrap();
        assert_eq!(f.reason, Reason::Unknown);
        assert_eq!(f.detail, None);
    }

    #[test]
    fn the_framework_s_cuda_oom_message_wins_over_the_exception_it_raised() {
        let out = "epoch 1\nTraceback (most recent call last):\n  File \"t.py\", line 3, in <module>\n    x = torch.empty(1 << 40, device='cuda')\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 TiB (GPU 0; 79.1 GiB total capacity)\n";
        let f = judge(exit(1), out).unwrap();
        assert_eq!(f.reason, Reason::CudaOom);
        assert!(
            f.detail
                .unwrap()
                .starts_with("torch.OutOfMemoryError: CUDA out of memory")
        );
    }

    #[test]
    fn disk_full_nccl_and_python_exceptions_are_read_from_the_tail() {
        let out = "writing\nOSError: [Errno 28] No space left on device: 'ckpt.pt'\n";
        assert_eq!(reason(exit(1), out), Some(Reason::DiskFull));
        let out = "[rank0]:[E ProcessGroupNCCL.cpp:563] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600003 milliseconds before timing out.\n";
        assert_eq!(
            reason(
                Ended {
                    signal: Some(6),
                    ..Ended::default()
                },
                out
            ),
            Some(Reason::NcclTimeout)
        );
        let out = "Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n    raise ValueError('bad lr')\nValueError: bad lr\n";
        let f = judge(exit(1), out).unwrap();
        assert_eq!(f.reason, Reason::PythonException);
        assert_eq!(f.detail.as_deref(), Some("ValueError: bad lr"));
        let out = "Traceback (most recent call last):\n  File \"m.py\", line 9, in <module>\nmypkg.errors.ConfigError: no such key 'lr'\n";
        assert_eq!(
            judge(exit(1), out).unwrap().detail.as_deref(),
            Some("mypkg.errors.ConfigError: no such key 'lr'")
        );
    }

    #[test]
    fn a_signal_is_named_and_a_shell_s_128_plus_n_needs_its_own_words() {
        let f = judge(
            Ended {
                signal: Some(11),
                ..Ended::default()
            },
            "",
        )
        .unwrap();
        assert_eq!(f.reason, Reason::Signal);
        assert_eq!(f.detail.as_deref(), Some("killed by signal 11 (SIGSEGV)"));
        let out = "bash: line 1: 4242 Segmentation fault      (core dumped) ./a.out\n";
        let f = judge(exit(139), out).unwrap();
        assert_eq!(f.reason, Reason::Signal);
        assert!(f.detail.unwrap().starts_with("signal 11 (SIGSEGV): bash"));
        // `exit 139` with nothing said about a signal is no evidence of one.
        assert_eq!(reason(exit(139), "done\n"), Some(Reason::Unknown));
    }

    #[test]
    fn slurm_s_own_word_comes_first() {
        let slurm = |s: &'static str| Ended {
            exit_code: Some(0),
            slurm_state: Some(s),
            ..Ended::default()
        };
        assert_eq!(reason(slurm("PREEMPTED"), ""), Some(Reason::Preempted));
        assert_eq!(reason(slurm("NODE_FAIL"), ""), Some(Reason::NodeFail));
        assert_eq!(reason(slurm("OUT_OF_MEMORY"), ""), Some(Reason::HostOom));
        assert_eq!(reason(slurm("TIMEOUT"), ""), Some(Reason::TimeLimit));
        assert_eq!(reason(slurm("FAILED"), "x\n"), Some(Reason::Unknown));
    }

    #[test]
    fn only_the_tail_counts_and_host_text_cannot_forge_a_line() {
        let old = "No space left on device\n".to_string() + &"ok\n".repeat(TAIL_BYTES);
        assert_eq!(reason(exit(1), &old), Some(Reason::Unknown));
        let out = "Traceback (most recent call last):\nValueError: \u{1b}]52;c;x\u{7} ".to_string()
            + &"y".repeat(1000)
            + "\n";
        let d = judge(exit(1), &out).unwrap().detail.unwrap();
        assert!(!d.contains('\u{1b}') && !d.contains('\n'), "{d}");
        assert!(d.chars().count() <= DETAIL_CHARS + 1, "{}", d.len());
    }
}
