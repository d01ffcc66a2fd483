//! A Slurm sandbox's resources: per partition nodes, CPUs and GPUs (total and free), memory and
//! pending jobs; the user's own jobs; an idle score for `select_sandbox("auto")`. One call
//! (sinfo twice, squeue once) per [`CACHE`], shared by every caller in this process.
//!
//! GPU counts come from sinfo's `Gres` / `GresUsed` per node: `squeue %b` misses jobs that
//! asked with `--gpus`, and TRES carry no GPUs without slurmdbd.

use std::collections::{BTreeMap, HashMap};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;

use crate::slurm::remote;
use crate::{client::AgentClient, error::Result};

/// Sites police controller calls: a resources answer serves a minute.
pub const CACHE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Partition {
    pub name: String,
    pub default: bool,
    pub available: String,
    pub nodes: u32,
    pub cpus_total: u32,
    pub cpus_free: u32,
    pub gpus_total: u32,
    pub gpus_free: u32,
    pub memory_mb_per_node: u64,
    pub time_limit: String,
    /// The user's own jobs in the partition (the controller is not asked for everyone's).
    pub pending_jobs: u32,
    pub running_jobs: u32,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SlurmResources {
    pub scheduler: &'static str,
    pub partitions: Vec<Partition>,
    pub gpus_total: u32,
    pub gpus_free: u32,
    pub cpus_total: u32,
    pub cpus_free: u32,
    pub my_running_jobs: u32,
    pub my_pending_jobs: u32,
    /// 0 = fully busy, 1 = idle: free GPUs weigh 0.6, free CPUs 0.4 (CPUs only without GPUs).
    pub idle_score: f64,
    /// How old this answer is (it is cached for a minute).
    pub sample_age_ms: u64,
}

static CACHED: LazyLock<Mutex<HashMap<String, (Instant, SlurmResources)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The sandbox's resources, from a sample at most [`CACHE`] old.
pub async fn get(client: &AgentClient) -> Result<SlurmResources> {
    if let Some((at, r)) = CACHED.lock().get(client.sandbox()).cloned()
        && at.elapsed() < CACHE
    {
        return Ok(SlurmResources {
            sample_age_ms: at.elapsed().as_millis() as u64,
            ..r
        });
    }
    let out = remote::run(client, remote::SINFO, &[], Vec::new()).await?;
    if !out.ok() {
        return Err(out.failed("sinfo/squeue"));
    }
    let r = parse(&out.stdout);
    CACHED
        .lock()
        .insert(client.sandbox().to_string(), (Instant::now(), r.clone()));
    Ok(r)
}

/// GPUs in a Gres field: `gpu:a100:4(S:0),gpu:2,shard:8` → 6.
pub fn gpu_count(gres: &str) -> u32 {
    gres.split(',')
        .filter(|g| g.starts_with("gpu"))
        .filter_map(|g| g.split('(').next()?.rsplit(':').next()?.parse::<u32>().ok())
        .sum()
}

/// Whether a node in this `StateCompact` (`idle`, `mix`, `alloc`, with flag characters such as
/// `~` powered down or `#` powering up) takes new jobs. Not responding (`*`), down, drained or
/// draining, failing, in maintenance, completing and every other state do not count.
fn schedulable(state: &str) -> bool {
    let s = state.trim();
    if s.contains('*') {
        return false;
    }
    let base: String = s.chars().take_while(|c| c.is_ascii_alphabetic()).collect();
    matches!(
        base.to_ascii_lowercase().as_str(),
        "idle" | "mix" | "alloc" | "mixed" | "allocated"
    )
}

/// `alloc/idle/other/total`.
fn cpus(s: &str) -> (u32, u32) {
    let f: Vec<u32> = s.split('/').filter_map(|x| x.parse().ok()).collect();
    match f.as_slice() {
        [_, idle, _, total] => (*total, *idle),
        _ => (0, 0),
    }
}

pub fn parse(text: &str) -> SlurmResources {
    let mut section = "";
    let mut me = String::new();
    let mut parts: BTreeMap<String, Partition> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    // node -> (cpus total, cpus idle, gpus total, gpus used); a node in several partitions
    // counts once in the totals.
    let mut nodes: BTreeMap<String, (u32, u32, u32, u32)> = BTreeMap::new();
    let mut queue: Vec<(String, String, String)> = Vec::new();
    // partition -> CPUs (total, idle) of its schedulable nodes.
    let mut node_cpus: BTreeMap<String, (u32, u32)> = BTreeMap::new();
    let mut saw_nodes = false;
    for l in text.lines() {
        if let Some(s) = l.strip_prefix('@') {
            let (s, rest) = s.split_once(' ').unwrap_or((s, ""));
            section = match s {
                "partitions" => "p",
                "nodes" => {
                    saw_nodes = true;
                    "n"
                }
                "queue" => "q",
                "me" => {
                    me = rest.trim().to_string();
                    "m"
                }
                _ => "",
            };
            continue;
        }
        let f: Vec<&str> = l.trim().split('|').collect();
        match section {
            "p" if f.len() >= 7 => {
                let default = f[0].ends_with('*');
                let name = f[0].trim_end_matches('*').to_string();
                let (total, free) = cpus(f[3]);
                order.push(name.clone());
                parts.insert(
                    name.clone(),
                    Partition {
                        name,
                        default,
                        available: f[1].into(),
                        nodes: f[2].parse().unwrap_or(0),
                        cpus_total: total,
                        cpus_free: free,
                        memory_mb_per_node: f[5].trim_end_matches('+').parse().unwrap_or(0),
                        time_limit: f[6].into(),
                        ..Default::default()
                    },
                );
            }
            "n" if f.len() >= 8 => {
                let part = f[1].trim_end_matches('*');
                // A node that is down, drained, draining, failing or not responding runs
                // nothing new: its CPUs and GPUs are neither free nor part of the total.
                if !schedulable(f[2]) {
                    continue;
                }
                let (ct, ci) = cpus(f[3]);
                let (gt, gu) = (gpu_count(f[6]), gpu_count(f[7]));
                if let Some(p) = parts.get_mut(part) {
                    p.gpus_total += gt;
                    p.gpus_free += gt.saturating_sub(gu);
                    let (t, i) = node_cpus.entry(part.to_string()).or_default();
                    *t += ct;
                    *i += ci;
                }
                nodes.insert(f[0].to_string(), (ct, ci, gt, gu));
            }
            "q" if f.len() >= 3 => queue.push((
                f[0].trim_end_matches('*').to_string(),
                f[1].to_string(),
                f[2].to_string(),
            )),
            _ => {}
        }
    }
    // The partition line's CPU counts include its down and drained nodes; the node lines
    // say which are schedulable.
    if saw_nodes {
        for (name, p) in parts.iter_mut() {
            let (t, i) = node_cpus.get(name).copied().unwrap_or_default();
            p.cpus_total = t;
            p.cpus_free = i;
        }
    }
    let mut r = SlurmResources {
        scheduler: "slurm",
        ..Default::default()
    };
    for (p, state, user) in &queue {
        for p in p.split(',') {
            if let Some(part) = parts.get_mut(p) {
                match state.as_str() {
                    "PENDING" => part.pending_jobs += 1,
                    "RUNNING" => part.running_jobs += 1,
                    _ => {}
                }
            }
        }
        if *user == me {
            match state.as_str() {
                "PENDING" => r.my_pending_jobs += 1,
                "RUNNING" => r.my_running_jobs += 1,
                _ => {}
            }
        }
    }
    for (ct, ci, gt, gu) in nodes.values() {
        r.cpus_total += ct;
        r.cpus_free += ci;
        r.gpus_total += gt;
        r.gpus_free += gt.saturating_sub(*gu);
    }
    let frac = |free: u32, total: u32| {
        if total == 0 {
            0.0
        } else {
            free as f64 / total as f64
        }
    };
    let score = if r.gpus_total > 0 {
        0.6 * frac(r.gpus_free, r.gpus_total) + 0.4 * frac(r.cpus_free, r.cpus_total)
    } else {
        frac(r.cpus_free, r.cpus_total)
    };
    r.idle_score = (score * 1000.0).round() / 1000.0;
    r.partitions = order.into_iter().filter_map(|n| parts.remove(&n)).collect();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "@partitions\n\
        debug*|up|1|1/3/0/4|gpu:fake:2|4096|infinite\n\
        gpu|up|1|1/3/0/4|gpu:fake:2|4096|1:00:00\n\
        @nodes\n\
        rsbnode|debug*|mix|1/3/0/4|4096|256|gpu:fake:2|gpu:fake:1(IDX:0)|\n\
        rsbnode|gpu|mix|1/3/0/4|4096|256|gpu:fake:2|gpu:fake:1(IDX:0)|\n\
        @queue\n\
        gpu|RUNNING|sbx\n\
        gpu|PENDING|other\n\
        @me sbx\n";

    #[test]
    fn partitions_gpus_and_my_jobs() {
        let r = parse(SAMPLE);
        assert_eq!(r.partitions.len(), 2);
        assert!(r.partitions[0].default);
        assert_eq!(r.partitions[1].gpus_total, 2);
        assert_eq!(r.partitions[1].gpus_free, 1);
        assert_eq!(r.partitions[1].pending_jobs, 1);
        // one node shared by both partitions counts once
        assert_eq!(
            (r.gpus_total, r.gpus_free, r.cpus_total, r.cpus_free),
            (2, 1, 4, 3)
        );
        assert_eq!((r.my_running_jobs, r.my_pending_jobs), (1, 0));
        assert_eq!(r.idle_score, 0.6);
    }

    /// Issue 43: GPUs and CPUs of down and drained nodes counted as free.
    #[test]
    fn only_schedulable_nodes_count() {
        let text = "@partitions\n\
            gpu*|up|4|8/40/16/64|gpu:a100:4|4096|1-00:00:00\n\
            @nodes\n\
            n1|gpu*|mix|8/8/0/16|4096|256|gpu:a100:4|gpu:a100:2(IDX:0-1)|\n\
            n2|gpu*|idle~|0/16/0/16|4096|0|gpu:a100:4|gpu:a100:0(IDX:N/A)|\n\
            n3|gpu*|drain|0/16/0/16|4096|0|gpu:a100:4|gpu:a100:0(IDX:N/A)|\n\
            n4|gpu*|idle*|0/0/16/16|4096|0|gpu:a100:4|gpu:a100:0(IDX:N/A)|\n\
            n5|gpu*|down*|0/0/16/16|4096|0|gpu:a100:4|gpu:a100:0(IDX:N/A)|\n\
            n6|gpu*|drng|16/0/0/16|4096|0|gpu:a100:4|gpu:a100:4(IDX:0-3)|\n\
            @queue\n\
            @me sbx\n";
        let r = parse(text);
        // n1 (mixed) and n2 (idle, powered down until a job needs it) only.
        assert_eq!(
            (r.gpus_total, r.gpus_free, r.cpus_total, r.cpus_free),
            (8, 6, 32, 24)
        );
        let p = &r.partitions[0];
        assert_eq!(
            (p.gpus_total, p.gpus_free, p.cpus_total, p.cpus_free),
            (8, 6, 32, 24)
        );
        for (state, ok) in [
            ("idle", true),
            ("mix", true),
            ("alloc", true),
            ("idle~", true),
            ("mix#", true),
            ("idle*", false),
            ("drain", false),
            ("drng", false),
            ("down*", false),
            ("fail", false),
            ("maint", false),
            ("comp", false),
            ("", false),
        ] {
            assert_eq!(schedulable(state), ok, "{state}");
        }
    }

    #[test]
    fn gpu_counts_from_gres() {
        assert_eq!(gpu_count("gpu:a100:4(S:0),gpu:2,shard:8"), 6);
        assert_eq!(gpu_count("(null)"), 0);
        assert_eq!(gpu_count("gpu:fake:0(IDX:N/A)"), 0);
    }
}
