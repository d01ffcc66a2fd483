//! Evidence of an OOM kill: the kernel's counters, read by a job's wrapper every [`TICK`] while
//! the job runs and again when it ends by SIGKILL. A count that grew in the job's memory cgroup
//! (the wrapper's own: the job is its child and stays there) within the last one or two ticks
//! means the cgroup's limit killed it; one that grew only on the host means the machine ran out
//! of memory. The window keeps another process's OOM kill earlier in a shared cgroup from being
//! taken for this job's. Nothing is guessed from the log: a run that was not SIGKILLed is never
//! called an OOM kill.

use std::time::Duration;

use rsb_protocol::OomKill;

/// How often a running job's wrapper reads the counters.
pub(crate) const TICK: Duration = Duration::from_secs(1);

/// The OOM kills counted so far: the host's and this process's memory cgroup's (`None` where a
/// counter cannot be read: no `/proc`, a cgroup hierarchy mounted elsewhere).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Counts {
    host: Option<u64>,
    cgroup: Option<u64>,
}

/// The first number after `key` at the start of a line of `path` (`oom_kill 3`).
fn counter(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

/// This process's memory cgroup counter: v1's `memory` hierarchy where there is one (a hybrid
/// host has no memory controller in v2), else v2's unified one.
fn cgroup_counter() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut v2 = None;
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            let file = format!("/sys/fs/cgroup/memory{path}/memory.oom_control");
            return counter(&file, "oom_kill");
        }
        if id == "0" && controllers.is_empty() {
            v2 = Some(format!("/sys/fs/cgroup{path}/memory.events"));
        }
    }
    counter(&v2?, "oom_kill")
}

pub(crate) fn counts() -> Counts {
    Counts {
        host: counter("/proc/vmstat", "oom_kill"),
        cgroup: cgroup_counter(),
    }
}

/// Where an OOM kill was counted since `before`, for a run that died by SIGKILL.
pub(crate) fn since(before: Counts) -> Option<OomKill> {
    let now = counts();
    let grew = |a: Option<u64>, b: Option<u64>| matches!((a, b), (Some(a), Some(b)) if b > a);
    if grew(before.cgroup, now.cgroup) {
        Some(OomKill::Cgroup)
    } else if grew(before.host, now.host) {
        Some(OomKill::Host)
    } else {
        None
    }
}

/// How the record stores it, and reads it back.
pub(crate) fn word(k: OomKill) -> &'static str {
    match k {
        OomKill::Cgroup => "cgroup",
        OomKill::Host => "host",
    }
}

pub(crate) fn from_word(w: &str) -> Option<OomKill> {
    match w {
        "cgroup" => Some(OomKill::Cgroup),
        "host" => Some(OomKill::Host),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_where_the_kernel_has_them() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("memory.events");
        std::fs::write(
            &f,
            "low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\noom_group_kill 0\n",
        )
        .unwrap();
        assert_eq!(counter(f.to_str().unwrap(), "oom_kill"), Some(1));
        assert_eq!(counter(f.to_str().unwrap(), "oom"), Some(2));
        assert_eq!(counter(f.to_str().unwrap(), "nope"), None);
        if cfg!(target_os = "linux") {
            assert!(
                counts().host.is_some(),
                "/proc/vmstat has oom_kill since Linux 4.13"
            );
        }
        let before = Counts {
            host: Some(5),
            cgroup: None,
        };
        assert_eq!(
            since(before).is_some(),
            counts().host.is_some_and(|h| h > 5)
        );
        assert_eq!(from_word(word(OomKill::Cgroup)), Some(OomKill::Cgroup));
        assert_eq!(from_word(word(OomKill::Host)), Some(OomKill::Host));
    }
}
