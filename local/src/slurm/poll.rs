//! One `squeue` per sandbox per tick for all its jobs, shared by every caller in this process.
//!
//! Controller calls are what sites police, so callers never run squeue themselves: they ask
//! the sandbox's [`Poller`], which answers from its last poll while it is younger than
//! [`TICK`] and covered the ids asked for; otherwise it polls once, for every id it knows (the
//! jobs submitted or listed through this process, at most 100 per call), and every waiting
//! caller gets that answer. A failed poll (controller down: each call blocks 9-18 s) is
//! retried with exponential backoff; meanwhile callers get [`Seen::Unreachable`] at once.
//!
//! An id whose job reached a final state (completed, failed, cancelled, timed out, out of
//! memory, past its deadline, failed to boot) or that the controller no longer knows is never
//! asked again: its last answer is kept ([`FINALS_KEPT`] of them) and served at once, as
//! submitit caches final states. Node failure and preemption are not final (a job that may
//! be requeued comes back under the same id).
//!
//! The poll runs as a task of its own, and a caller waits for it at most [`WAIT`]: a down
//! controller holds squeue for 9-18 s, and no tool call or watchdog check may wait that long
//! on it. A caller that gives up gets [`Seen::Unreachable`]; the poll carries on, and its
//! answer (or its failure, with backoff) serves the next callers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::remote;
use crate::client::AgentClient;

/// How long one poll's answer serves every caller.
pub const TICK: Duration = Duration::from_secs(2);
/// The longest a caller waits for a poll in flight (a healthy squeue answers in ~10 ms).
pub const WAIT: Duration = Duration::from_secs(4);
/// Ids not asked about for this long are no longer polled.
const FORGET: Duration = Duration::from_secs(600);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// squeue's `-j` list is kept short, as sites expect.
const IDS_PER_CALL: usize = 100;
/// Final answers kept per sandbox (the oldest go first; a forgotten id is asked once more).
const FINALS_KEPT: usize = 10_000;

/// Slurm states a job never leaves: its id need not be asked again.
pub fn is_final(state: &str) -> bool {
    matches!(
        state,
        "COMPLETED"
            | "CANCELLED"
            | "FAILED"
            | "TIMEOUT"
            | "OUT_OF_MEMORY"
            | "DEADLINE"
            | "BOOT_FAIL"
    )
}

/// One squeue row: id, state, reason, elapsed, limit, node, restarts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub state: String,
    pub reason: String,
    pub elapsed: String,
    pub limit: String,
    pub node: String,
    /// Slurm's `Restarts`: how often it requeued the job.
    pub restarts: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    Row(Row),
    /// Not known to the controller (never was, or purged after MinJobAge).
    Gone,
    /// The controller did not answer; the message says how.
    Unreachable(String),
}

#[derive(Default)]
struct Cache {
    at: Option<Instant>,
    polled: HashSet<String>,
    rows: HashMap<String, Row>,
    error: Option<String>,
    failures: u32,
    next_try: Option<Instant>,
    /// When the poll now in flight started.
    polling: Option<Instant>,
    /// Ids that ended for good, with their last answer ([`is_final`], or gone), in the order
    /// they ended.
    finals: HashMap<String, Seen>,
    final_order: std::collections::VecDeque<String>,
}

impl Cache {
    fn keep_final(&mut self, id: String, seen: Seen) {
        if self.finals.insert(id.clone(), seen).is_none() {
            self.final_order.push_back(id);
        }
        while self.final_order.len() > FINALS_KEPT {
            if let Some(old) = self.final_order.pop_front() {
                self.finals.remove(&old);
            }
        }
    }
}

pub struct Poller {
    known: Mutex<HashMap<String, Instant>>,
    cache: Mutex<Cache>,
    /// Counts finished polls; waiting callers watch it.
    done: tokio::sync::watch::Sender<u64>,
}

impl Default for Poller {
    fn default() -> Self {
        Poller {
            known: Mutex::default(),
            cache: Mutex::default(),
            done: tokio::sync::watch::channel(0).0,
        }
    }
}

static POLLERS: LazyLock<Mutex<HashMap<String, Arc<Poller>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The poller of `sandbox`, shared by every caller in this process.
pub fn poller(sandbox: &str) -> Arc<Poller> {
    POLLERS
        .lock()
        .entry(sandbox.to_string())
        .or_default()
        .clone()
}

impl Poller {
    /// Poll `ids` from now on (a job just submitted, or found by a listing).
    pub fn register<'a>(&self, ids: impl IntoIterator<Item = &'a str>) {
        let now = Instant::now();
        let mut k = self.known.lock();
        for id in ids {
            k.insert(id.to_string(), now);
        }
    }

    /// The next [`states`](Self::states) polls afresh (after a scancel: its effect is what
    /// the caller waits to see).
    pub fn invalidate(&self) {
        self.cache.lock().at = None;
    }

    /// Why the controller is taken to be down right now (the poll in flight has outlasted
    /// [`WAIT`], or the last poll failed and its backoff runs), without asking it. Once the
    /// backoff ends the next caller asks again, so a controller back up is never refused for
    /// longer than that.
    pub fn down(&self) -> Option<String> {
        let c = self.cache.lock();
        if let Some(t) = c.polling.filter(|t| t.elapsed() >= WAIT) {
            return Some(format!(
                "squeue has not answered for {} s",
                t.elapsed().as_secs()
            ));
        }
        let backing_off = c.next_try.is_some_and(|t| Instant::now() < t);
        c.error.clone().filter(|_| backing_off)
    }

    /// The state of each id, from a poll at most [`TICK`] old, waiting at most [`WAIT`].
    pub async fn states(
        self: &Arc<Self>,
        client: &AgentClient,
        ids: &[String],
    ) -> HashMap<String, Seen> {
        self.register(ids.iter().map(String::as_str));
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut timed_out = false;
        // Twice at most: a poll already in flight may have left out an id registered after
        // it started.
        for _ in 0..2 {
            let now = Instant::now();
            let mut done = self.done.subscribe();
            let start = {
                let mut c = self.cache.lock();
                let covered = ids
                    .iter()
                    .all(|i| c.polled.contains(i) || c.finals.contains_key(i));
                let young = c.at.is_some_and(|t| now.duration_since(t) < TICK);
                let backing_off = c.next_try.is_some_and(|t| now < t);
                if (young && covered) || backing_off {
                    break;
                }
                let start = c.polling.is_none();
                if start {
                    c.polling = Some(now);
                }
                start
            };
            if start {
                let me = self.clone();
                let client = client.clone();
                tokio::spawn(async move { me.poll_now(&client).await });
            }
            if tokio::time::timeout_at(deadline, done.changed())
                .await
                .is_err()
            {
                timed_out = true;
                break;
            }
        }
        let c = self.cache.lock();
        let slow = c.polling.filter(|_| timed_out).map(|t| t.elapsed());
        ids.iter()
            .map(|i| {
                if let Some(f) = c.finals.get(i) {
                    return (i.clone(), f.clone());
                }
                let seen = match (slow, &c.error, c.rows.get(i)) {
                    (Some(d), _, _) => Seen::Unreachable(format!(
                        "squeue has not answered for {} s (is the Slurm controller down?)",
                        d.as_secs()
                    )),
                    (None, Some(e), _) => Seen::Unreachable(e.clone()),
                    (None, None, Some(r)) => Seen::Row(r.clone()),
                    (None, None, None) => Seen::Gone,
                };
                (i.clone(), seen)
            })
            .collect()
    }

    /// One poll for every known id; its answer (or its failure) replaces the cache.
    async fn poll_now(&self, client: &AgentClient) {
        let now = Instant::now();
        let all: Vec<String> = {
            let finals: HashSet<String> = self.cache.lock().finals.keys().cloned().collect();
            let mut k = self.known.lock();
            k.retain(|id, t| now.duration_since(*t) < FORGET && !finals.contains(id));
            k.keys().cloned().collect()
        };
        let r = poll(client, &all).await;
        {
            let mut c = self.cache.lock();
            c.at = Some(Instant::now());
            c.polling = None;
            match r {
                Ok(rows) => {
                    for id in &all {
                        match rows.get(id) {
                            Some(r) if is_final(&r.state) => {
                                c.keep_final(id.clone(), Seen::Row(r.clone()))
                            }
                            Some(_) => {}
                            None => c.keep_final(id.clone(), Seen::Gone),
                        }
                    }
                    c.polled = all.into_iter().collect();
                    c.rows = rows;
                    c.error = None;
                    c.failures = 0;
                    c.next_try = None;
                }
                Err(e) => {
                    c.failures += 1;
                    let back = Duration::from_secs(1u64 << c.failures.min(5)).min(MAX_BACKOFF);
                    c.next_try = Some(Instant::now() + back);
                    c.error = Some(e);
                }
            }
        }
        self.done.send_modify(|n| *n += 1);
    }
}

/// squeue for `ids`, in calls of at most [`IDS_PER_CALL`].
async fn poll(client: &AgentClient, ids: &[String]) -> Result<HashMap<String, Row>, String> {
    let mut rows = HashMap::new();
    for chunk in ids.chunks(IDS_PER_CALL) {
        let out = remote::run(client, remote::SQUEUE, chunk, Vec::new())
            .await
            .map_err(|e| e.message)?;
        if !out.ok() {
            // One unknown id makes squeue fail ("Invalid job id specified"); a list does not.
            if chunk.len() == 1 && out.stderr.contains("Invalid job id") {
                continue;
            }
            return Err(format!("squeue failed: {}", out.last_error()));
        }
        rows.extend(parse_rows(&out.stdout));
    }
    Ok(rows)
}

/// Rows of [`remote::SQUEUE`]'s `id|state|reason|elapsed|limit|node|restarts|`, keyed by id.
pub fn parse_rows(text: &str) -> HashMap<String, Row> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.trim().split('|').collect();
            (f.len() >= 7).then(|| {
                (
                    f[0].to_string(),
                    Row {
                        state: f[1].to_string(),
                        reason: f[2].to_string(),
                        elapsed: f[3].to_string(),
                        limit: f[4].to_string(),
                        node: f[5].trim().to_string(),
                        restarts: f[6].trim().parse().unwrap_or(0),
                    },
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_parse_and_skip_garbage() {
        let r = parse_rows(
            "12|RUNNING|None|0:05|1:00|rsbnode|0|\n13|PENDING|Resources|0:00|UNLIMITED||2|\nnoise\n",
        );
        assert_eq!(r.len(), 2);
        assert_eq!(r["12"].node, "rsbnode");
        assert_eq!((r["12"].restarts, r["13"].restarts), (0, 2));
        assert_eq!(r["13"].reason, "Resources");
        assert_eq!(r["13"].node, "");
    }
}
