//! Background jobs supervised by the agent: started detached, recorded on disk, readable later
//! from a new connection.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStartRequest {
    /// `[A-Za-z0-9_-]{1,64}`; matched exactly.
    pub name: String,
    pub command: String,
    pub cwd: Option<String>,
    /// Absolute, or relative to `cwd` (or `$HOME` without one); `~` expanded by the agent.
    pub log_file: String,
    pub env: Vec<(String, String)>,
    /// Use tmux when present (`true`), or force the setsid runner (`false`).
    pub prefer_tmux: bool,
    /// The caller's id for this launch, stored with the job. A start whose id matches the
    /// name's latest launch returns that job instead of launching again, so a caller that lost
    /// the reply (or died before reading it) repeats the request safely, and never decides by
    /// comparing its clock with the host's.
    pub launch_id: Option<String>,
    /// Confine the job's command (and everything it starts) with Landlock, as an exec's
    /// [`crate::Confine`]; the wrapper that supervises it and writes its log stays unconfined.
    pub confine: Option<crate::Confine>,
    /// Run on this many of these GPUs, leased for the job's life (see [`GpuAsk`]).
    pub gpus: Option<GpuAsk>,
}

/// GPUs for a job: the wrapper leases the first `count` of `candidates` (GPU UUIDs, in the
/// caller's order of preference) that no other rsb job holds, and starts the job with
/// `CUDA_VISIBLE_DEVICES` set to their UUIDs and `CUDA_DEVICE_ORDER=PCI_BUS_ID`. A lease is an
/// exclusive `flock` on `<GPU_LEASE_DIR>/<uuid>`, shared by every user's agents on the host and
/// held by the job's wrapper, so the kernel ends it with the wrapper, however that ends. Fewer
/// free than `count`: the start fails with [`ErrorCode::Busy`](crate::ErrorCode::Busy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuAsk {
    pub count: u32,
    pub candidates: Vec<String>,
}

/// Where GPU leases live on a host (one lock file per GPU UUID, a sticky world-writable
/// directory that every user's rsb agents share).
pub const GPU_LEASE_DIR: &str = "/tmp/rsb-gpu-leases";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    Running,
    /// Ended on its own; see `exit_code` / `signal`.
    Exited,
    /// Its supervisor vanished without recording an end (tmux session killed, host rebooted).
    Lost,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobInfo {
    pub name: String,
    pub command: String,
    pub cwd: String,
    pub log_file: String,
    pub runner: String,
    pub pid: u32,
    pub started_ms: u64,
    pub state: JobState,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// The kernel's OOM killer ended the run: it died by SIGKILL (itself, or the command its
    /// shell waited for) one or two seconds after an OOM kill was counted, in its memory cgroup
    /// or on the host.
    pub oom_kill: Option<OomKill>,
    pub ended_ms: Option<u64>,
    /// The [`JobStartRequest::launch_id`] this run was started with (empty without one).
    pub launch_id: String,
    /// Where this run's output begins in `log_file` (a reused name appends to the log; 0 for
    /// records older than this field).
    pub log_start: u64,
    /// In a start's reply only: the ended run of the same name that this start moved aside
    /// (its record kept in the job's history, its output in its log before this run's).
    pub previous: Option<Box<JobInfo>>,
    /// In a start's reply only: the start asked for confinement with `require: false` and the
    /// host could not give it: why (the job runs unconfined).
    pub unconfined: Option<String>,
    /// The UUIDs of the GPUs this run leased (empty: none asked).
    pub gpus: Vec<String>,
}

/// Where an OOM kill that ended a run was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OomKill {
    /// The run's memory cgroup (`memory.events` or v1's `memory.oom_control`): its limit.
    Cgroup,
    /// The host (`/proc/vmstat`): the machine ran out of memory.
    Host,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStatusRequest {
    pub name: String,
    /// Read this log instead of the job's recorded one (seed compatibility).
    pub log_file: Option<String>,
    /// Lines of log tail to return when `offset` is `None`.
    pub last_n_lines: u32,
    /// Byte cursor: return log bytes from here (up to `max_bytes`).
    pub offset: Option<u64>,
    pub max_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStatusResult {
    /// `None` when no job with this exact name is recorded.
    pub info: Option<JobInfo>,
    pub log_found: bool,
    #[serde(with = "serde_bytes")]
    pub log: Vec<u8>,
    /// Offset of `log[0]` in the file.
    pub log_start: u64,
    /// Where the next cursor read should start.
    pub next_offset: u64,
    pub log_size: u64,
    pub log_truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobKillRequest {
    pub name: String,
    pub grace_ms: u64,
}

/// Every job recorded on the host, running or ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobListRequest;

/// Subscribe to job events on the host, as they happen: the agent watches the jobs' records
/// (inotify on Linux, a re-read every [`JOB_EVENTS_RESCAN_MS`] besides, for ends inotify cannot
/// see: a supervisor that died) and sends each as a [`Chunk::JobEvent`](crate::Chunk::JobEvent).
/// Without `until_ended` the request runs until cancelled, and its reply is never sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobEventsRequest {
    /// Only these jobs (exact names); empty: every job on the host.
    pub names: Vec<String>,
    /// A job that ended at or after this time (ms since the epoch) before the subscription
    /// began is reported at once, as an end the subscriber missed; 0 reports none.
    pub since_ms: u64,
    /// Reply (with the jobs' records) once every named job has ended or been lost: `rsb wait`.
    /// A named job that is not recorded is an error. Needs `names`.
    pub until_ended: bool,
    /// Also send one [`JobEventKind::Output`] when a named job that runs has a log larger than
    /// this many bytes (looked at every 250 ms): `check_background_task(wait_s)`, which
    /// answers at the job's end or its next output. Needs `names`.
    pub output_after: Option<u64>,
}

/// How often a subscription re-reads every record even without a file event.
pub const JOB_EVENTS_RESCAN_MS: u64 = 2_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobEventKind {
    /// A run began (a new `started_ms` for the name).
    Started,
    /// The run ended on its own or was killed: `info.exit_code` or `info.signal`.
    Ended,
    /// Its supervisor vanished without recording an end.
    Lost,
    /// The running job's log grew past [`JobEventsRequest::output_after`] (`info.log_file`;
    /// `last_line` its last line so far). Sent once.
    Output,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobEvent {
    pub kind: JobEventKind,
    pub info: JobInfo,
    /// The last line the run printed (never rsb's own header or `EXIT_CODE=` line), lossily
    /// UTF-8, at most 500 bytes; `None` when it printed nothing. Text from the host.
    pub last_line: Option<String>,
}

/// Where the agent keeps its job records, relative to the remote home: `<JOBS_ROOT>/<name>/`
/// holds a job's spec, state and (for Slurm) its batch script.
pub const JOBS_ROOT: &str = ".cache/rsb/jobs";

/// A confined job's log when none is given: `<JOBS_ROOT>/<name>/<CONFINED_LOG>`, rsb's own
/// place, since the usual default (`<cwd>/.codex_logs/<name>.log`) may lie outside the write
/// roots that the job's writes, rsb's included, keep to.
pub const CONFINED_LOG: &str = "output.log";

/// The header the job runner writes into the log at the start of each run, one line each.
pub const LOG_HEADER: [&str; 3] = ["== session: ", "== started_at: ", "== command: "];
/// The line the job runner writes after the run's output: `EXIT_CODE=<n>`.
pub const LOG_EXIT_CODE: &str = "EXIT_CODE=";

/// A run's log tail (read from the run's `log_start`) without the runner's own lines: the
/// header a short run's tail starts with (or its end, where the tail began inside it), and
/// the `EXIT_CODE=` line it ends with.
pub fn job_output(tail: &[u8]) -> &[u8] {
    let mut rest = tail;
    for p in LOG_HEADER {
        if rest.starts_with(p.as_bytes()) {
            rest = rest
                .iter()
                .position(|&b| b == b'\n')
                .map_or(&[][..], |i| &rest[i + 1..]);
        }
    }
    let exit = LOG_EXIT_CODE.as_bytes();
    let body = rest.strip_suffix(b"\n").unwrap_or(rest);
    match body.iter().rposition(|&b| b == b'\n') {
        Some(i) if body[i + 1..].starts_with(exit) => &rest[..i + 1],
        None if body.starts_with(exit) => &[],
        _ => rest,
    }
}

/// A job name becomes a directory name and a tmux session name (and a Slurm job's name), so
/// only characters inert in all of them are allowed; tmux would silently rewrite `.` and `:`.
/// One rule for the agent and for `rsb`, which checks before it submits to Slurm.
pub fn valid_job_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::job_output;

    #[test]
    fn a_runs_output_is_its_own_lines() {
        let run = b"== session: w\n== started_at: 2026\n== command: x\nbye\nEXIT_CODE=5\n";
        assert_eq!(job_output(run), b"bye\n");
        assert_eq!(
            job_output(b"== session: w\n== started_at: t\n== command: x\nEXIT_CODE=0\n"),
            b""
        );
        assert_eq!(job_output(b"a\nb\nEXIT_CODE=1\n"), b"a\nb\n");
        assert_eq!(
            job_output(b"a\n== session: not at the top\n"),
            b"a\n== session: not at the top\n"
        );
        assert_eq!(job_output(b"partial"), b"partial");
    }
}
