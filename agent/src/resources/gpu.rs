//! GPU load read by running `nvidia-smi` as a child process with a deadline.
//!
//! Why a child process and not NVML: the shipped agent is a static musl binary, and musl's static
//! `dlopen` is a stub that always fails, so NVML can never load there (measured; crates.md §5).
//! The optional `nvml` feature (glibc builds only) is deliberately not used either: a wedged
//! driver can hang an NVML call inside our own process where nothing can interrupt it, whereas a
//! hung `nvidia-smi` is simply killed at the deadline. One code path that works on every build is
//! worth more than a slightly cheaper call on a build we do not ship.

use std::ffi::OsStr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use rsb_protocol::{GpuInfo, GpuProcess, GpuReport, GpuSource};

use crate::proc::{self, RunError};

pub(crate) const SMI: &str = "nvidia-smi";
pub(crate) const GPU_QUERY: &str = "--query-gpu=index,name,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw";
pub(crate) const APPS_QUERY: &str = "--query-compute-apps=pid,gpu_uuid,used_memory";
pub(crate) const FORMAT: &str = "--format=csv,noheader,nounits";

/// nvidia-smi prints a few hundred bytes per GPU; anything beyond this is not its normal output,
/// and reading it all would only cost memory.
const MAX_OUTPUT: u64 = 1 << 20;
/// Longest note text taken from nvidia-smi's own output, so a chatty failure cannot bloat replies.
const MAX_NOTE_LINE: usize = 200;

/// `nvidia-smi` on the given PATH value, by the agent's one PATH policy ([`proc::find_executable`]).
pub(crate) fn find_smi(path_var: Option<&OsStr>) -> Option<PathBuf> {
    proc::find_executable(SMI, path_var)
}

/// One GPU pass. `age_ms` is left at 0; whoever hands the report out knows how old it is.
///
/// No nvidia-smi means "no NVIDIA GPU here", which is normal and carries no note. Any failure of
/// the GPU query drops the whole report to `source: None` with a note, so nothing stale or partial
/// is passed off as current; a failing process query keeps the fresh GPU list and says why the
/// process list is empty.
pub(crate) fn sample(path_var: Option<&OsStr>, timeout: Duration) -> GpuReport {
    let Some(exe) = find_smi(path_var) else {
        return GpuReport::default();
    };
    let text = match run(&exe, &[GPU_QUERY, FORMAT], timeout) {
        Ok(text) => text,
        Err(note) => {
            return GpuReport {
                note: Some(note),
                ..GpuReport::default()
            };
        }
    };
    let (gpus, bad) = parse_gpus(&text);
    let mut notes = Vec::new();
    if bad > 0 {
        notes.push(format!("skipped {bad} unreadable nvidia-smi line(s)"));
    }
    let processes = match run(&exe, &[APPS_QUERY, FORMAT], timeout) {
        Ok(text) => parse_processes(&text),
        Err(note) => {
            notes.push(format!("GPU processes unavailable: {note}"));
            Vec::new()
        }
    };
    GpuReport {
        source: GpuSource::NvidiaSmi,
        gpus,
        processes,
        note: (!notes.is_empty()).then(|| notes.join("; ")),
        age_ms: 0,
    }
}

/// Runs `exe args` and returns its stdout, or a one-line note saying why there is none.
///
/// The child gets its own process group so that a deadline kills everything it started: a shell
/// wrapper's `sleep` (or a helper of nvidia-smi) would otherwise keep the pipes open.
pub(crate) fn run(exe: &Path, args: &[&str], timeout: Duration) -> Result<String, String> {
    let out = proc::output_with_deadline(Command::new(exe).args(args), timeout, MAX_OUTPUT)
        .map_err(|e| match e {
            RunError::Spawn(e) => format!("cannot run {}: {e}", exe.display()),
            RunError::Wait(e) => format!("waiting for {SMI} failed: {e}"),
            RunError::TimedOut => timed_out(timeout),
            RunError::OutputHeld(_) => format!(
                "{SMI} left its output open past the deadline ({} ms)",
                timeout.as_millis()
            ),
        })?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    Err(describe_failure(out.status, &out.stderr, &out.stdout))
}

pub(crate) fn timed_out(timeout: Duration) -> String {
    format!("{SMI} timed out after {} ms", timeout.as_millis())
}

fn describe_failure(status: ExitStatus, stderr: &[u8], stdout: &[u8]) -> String {
    let what = match (status.code(), status.signal()) {
        (Some(code), _) => format!("{SMI} exited with code {code}"),
        (None, Some(sig)) => format!("{SMI} was killed by signal {sig}"),
        (None, None) => format!("{SMI} failed ({status})"),
    };
    // nvidia-smi prints its "has failed because…" message on stdout, other tools use stderr.
    match first_line(stderr).or_else(|| first_line(stdout)) {
        Some(line) => format!("{what}: {line}"),
        None => what,
    }
}

fn first_line(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    Some(match line.char_indices().nth(MAX_NOTE_LINE) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_string(),
    })
}

/// A CSV field, or `None` for the driver's placeholders (`[N/A]`, `[Not Supported]`,
/// `[Unknown Error]`, …) and anything else that is not a number: a missing reading must not
/// masquerade as zero load.
fn field<T: std::str::FromStr>(raw: &str) -> Option<T> {
    let s = raw.trim();
    if s.is_empty() || s.starts_with('[') {
        return None;
    }
    s.parse().ok()
}

fn field_f32(raw: &str) -> Option<f32> {
    field::<f32>(raw).filter(|v| v.is_finite())
}

/// MiB counts are integers today; a fractional one is rounded rather than dropped.
fn field_mib(raw: &str) -> Option<u64> {
    field::<u64>(raw).or_else(|| {
        field::<f64>(raw)
            .filter(|v| v.is_finite() && *v >= 0.0 && *v < u64::MAX as f64)
            .map(|v| v.round() as u64)
    })
}

/// Parses `--query-gpu` output; returns the GPUs and how many non-empty lines were unreadable.
///
/// The name is the only free-text column, so it is taken as everything between the first field
/// and the last six: a name with a comma in it still parses.
pub(crate) fn parse_gpus(text: &str) -> (Vec<GpuInfo>, usize) {
    let mut gpus = Vec::new();
    let mut bad = 0;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        let n = f.len();
        let index = if n >= 8 { field::<u32>(f[0]) } else { None };
        let Some(index) = index else {
            bad += 1;
            continue;
        };
        gpus.push(GpuInfo {
            index,
            name: f[1..n - 6].join(",").trim().to_string(),
            uuid: f[n - 6].trim().to_string(),
            util_pct: field_f32(f[n - 5]),
            mem_used_mib: field_mib(f[n - 4]),
            mem_total_mib: field_mib(f[n - 3]),
            temperature_c: field_f32(f[n - 2]),
            power_w: field_f32(f[n - 1]),
            lease: None,
        });
    }
    (gpus, bad)
}

/// Parses `--query-compute-apps` output. Lines without a pid (some drivers print a
/// "No running processes found" line) are not processes and are skipped.
pub(crate) fn parse_processes(text: &str) -> Vec<GpuProcess> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() != 3 {
                return None;
            }
            Some(GpuProcess {
                pid: field::<u32>(f[0])?,
                gpu_uuid: f[1].trim().to_string(),
                used_mem_mib: field_mib(f[2]),
                ..GpuProcess::default()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_lines_with_placeholders_spaces_and_commas() {
        let text = "0, NVIDIA H200 NVL, GPU-aaaa, 37, 1024, 143771, 41, 123.45\n\
                    1, NVIDIA A100-SXM4-80GB, GPU-bbbb, [N/A], 0, 81920, [Not Supported], \n\
                    \n\
                    2, Odd, Name, With Commas, GPU-cccc, 5, 1.5, 2, 30, [Unknown Error]\n\
                    garbage line\n\
                    x, a, b, c, d, e, f, g\n";
        let (gpus, bad) = parse_gpus(text);
        assert_eq!(bad, 2, "{gpus:?}");
        assert_eq!(gpus.len(), 3);
        assert_eq!(
            gpus[0],
            GpuInfo {
                index: 0,
                name: "NVIDIA H200 NVL".into(),
                uuid: "GPU-aaaa".into(),
                util_pct: Some(37.0),
                mem_used_mib: Some(1024),
                mem_total_mib: Some(143771),
                temperature_c: Some(41.0),
                power_w: Some(123.45),
                lease: None,
            }
        );
        assert_eq!(gpus[1].util_pct, None);
        assert_eq!(gpus[1].mem_used_mib, Some(0), "a real zero stays zero");
        assert_eq!(gpus[1].temperature_c, None);
        assert_eq!(gpus[1].power_w, None, "an empty trailing field is None");
        assert_eq!(gpus[2].name, "Odd, Name, With Commas");
        assert_eq!(gpus[2].uuid, "GPU-cccc");
        assert_eq!(gpus[2].mem_used_mib, Some(2), "1.5 MiB rounds");
        assert_eq!(gpus[2].power_w, None);
    }

    #[test]
    fn process_lines() {
        let text = "1234, GPU-aaaa, 500\nNo running processes found\n77, GPU-bbbb, [N/A]\n";
        let procs = parse_processes(text);
        assert_eq!(
            procs,
            vec![
                GpuProcess {
                    pid: 1234,
                    gpu_uuid: "GPU-aaaa".into(),
                    used_mem_mib: Some(500),
                    ..GpuProcess::default()
                },
                GpuProcess {
                    pid: 77,
                    gpu_uuid: "GPU-bbbb".into(),
                    used_mem_mib: None,
                    ..GpuProcess::default()
                },
            ]
        );
    }

    #[test]
    fn failure_note_prefers_stderr_and_is_bounded() {
        let status = ExitStatus::from_raw(9 << 8);
        let note = describe_failure(status, b"\n  first err\nsecond", b"out");
        assert_eq!(note, "nvidia-smi exited with code 9: first err");
        let note = describe_failure(status, b"", b"NVIDIA-SMI has failed because x\n");
        assert_eq!(
            note,
            "nvidia-smi exited with code 9: NVIDIA-SMI has failed because x"
        );
        let long = "é".repeat(1000);
        let note = describe_failure(status, long.as_bytes(), b"");
        assert!(note.chars().count() < 260, "{}", note.len());
        let killed = ExitStatus::from_raw(libc::SIGKILL);
        assert_eq!(
            describe_failure(killed, b"", b""),
            "nvidia-smi was killed by signal 9"
        );
    }

    #[test]
    fn path_lookup_skips_relative_and_non_executable() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join(SMI);
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o644)).unwrap();
        let path = std::env::join_paths([Path::new("rel"), dir.path()]).unwrap();
        assert_eq!(find_smi(Some(&path)), None, "not executable");
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(find_smi(Some(&path)), Some(exe));
    }
}
