//! One `squeue` per sandbox per tick for all its jobs, shared by every caller in this process.
//!
//! Controller calls are what sites police, so callers never run squeue themselves: they ask
//! the sandbox's [`Poller`], which answers from its last poll while it is young enough and
//! covered the ids asked for; otherwise it polls once, for every id it knows (the jobs
//! submitted or listed through this process, at most 100 per call), and every waiting caller
//! gets that answer. A failed poll (controller down: each call blocks 9-18 s) is retried with
//! exponential backoff; meanwhile callers get [`Seen::Unreachable`] at once. Polls start at
//! least a [`TICK`] apart: a caller whose id the last poll left out waits for the next.
//!
//! Young enough is the caller's to say, within the poller's pace, as submitit paces its
//! watcher: a question a person or the model just asked ([`FRESH`]) is answered from a poll at
//! most [`TICK`] old; a wait or a watch accepts older answers, up to the pace. The pace starts
//! at [`TICK`], doubles after each poll that changed nothing (no job's state, reason, node or
//! restarts), up to the poller's cap ([`PACE_MAX`], [`DAEMON_PACE_MAX`] for the watchdog, whose
//! watches are checked every `interval_s` anyway), and falls back to [`TICK`] when a poll saw a
//! change, a job is submitted or listed for the first time, or a wait begins ([`Poller::hurry`]).
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

/// How long one poll's answer serves every caller that asks for a fresh one, and the fastest
/// pace.
pub const TICK: Duration = Duration::from_secs(2);
/// What a caller that wants a fresh answer accepts: a poll at most [`TICK`] old.
pub const FRESH: Duration = TICK;
/// The slowest pace of an MCP server's or the CLI's poller while nothing changes.
pub const PACE_MAX: Duration = Duration::from_secs(60);
/// The slowest pace of the watchdog daemon's pollers.
pub const DAEMON_PACE_MAX: Duration = Duration::from_secs(300);
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
    /// When the last poll started: the next starts a [`TICK`] later at the earliest.
    started: Option<Instant>,
    /// How old an answer may be for a caller that accepts any age (0 reads as [`TICK`]).
    pace: Duration,
    /// Ids that ended for good, with their last answer ([`is_final`], or gone), in the order
    /// they ended.
    finals: HashMap<String, Seen>,
    final_order: std::collections::VecDeque<String>,
}

impl Cache {
    fn pace(&self) -> Duration {
        self.pace.max(TICK)
    }

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

/// What a caller does next while its answer is not there yet.
enum Next {
    /// Start the poll (none is in flight, and the last started a tick ago or more).
    Start,
    /// Wait for the poll in flight.
    Wait,
    /// Sleep until the next poll may start.
    Sleep(Instant),
}

pub struct Poller {
    known: Mutex<HashMap<String, Instant>>,
    cache: Mutex<Cache>,
    /// Counts finished polls; waiting callers watch it.
    done: tokio::sync::watch::Sender<u64>,
    /// The slowest pace.
    pace_max: Duration,
}

impl Default for Poller {
    fn default() -> Self {
        Poller::paced_up_to(PACE_MAX)
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
    /// A poller whose pace slows to `max` at most while nothing changes.
    pub fn paced_up_to(max: Duration) -> Self {
        Poller {
            known: Mutex::default(),
            cache: Mutex::default(),
            done: tokio::sync::watch::channel(0).0,
            pace_max: max.max(TICK),
        }
    }

    /// Poll `ids` from now on (a job just submitted, or found by a listing). An id not known
    /// before sets the pace back to [`TICK`]: a new job is when things change.
    pub fn register<'a>(&self, ids: impl IntoIterator<Item = &'a str>) {
        let now = Instant::now();
        let mut new = false;
        {
            let mut k = self.known.lock();
            for id in ids {
                new |= k.insert(id.to_string(), now).is_none();
            }
        }
        if new {
            self.hurry();
        }
    }

    /// Set the pace back to [`TICK`] (a wait begins, a job was submitted).
    pub fn hurry(&self) {
        self.cache.lock().pace = TICK;
    }

    /// The pace now: how old an answer may be for a caller that accepts any age.
    pub fn pace(&self) -> Duration {
        self.cache.lock().pace()
    }

    /// The next [`states`](Self::states) polls afresh (after a scancel: its effect is what
    /// the caller waits to see), and the pace is [`TICK`] again.
    pub fn invalidate(&self) {
        let mut c = self.cache.lock();
        c.at = None;
        c.pace = TICK;
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

    /// The state of each id, waiting at most [`WAIT`], from a poll no older than `max_age`
    /// ([`FRESH`] for a question just asked, [`Duration::MAX`] for any) or the pace, whichever
    /// is shorter; an answer younger than [`TICK`] always serves.
    pub async fn states(
        self: &Arc<Self>,
        client: &AgentClient,
        ids: &[String],
        max_age: Duration,
    ) -> HashMap<String, Seen> {
        self.register(ids.iter().map(String::as_str));
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut timed_out = false;
        // Bounded by WAIT: each round ends the wait, waits for a poll, or sleeps until the
        // next may start; four rounds cover a poll in flight that left out an id registered
        // after it started, the tick's sleep, and the poll after it.
        for _ in 0..4 {
            let now = Instant::now();
            let mut done = self.done.subscribe();
            let next = {
                let mut c = self.cache.lock();
                let covered = ids
                    .iter()
                    .all(|i| c.polled.contains(i) || c.finals.contains_key(i));
                let age = max_age.min(c.pace()).max(TICK);
                let young = c.at.is_some_and(|t| now.duration_since(t) < age);
                let backing_off = c.next_try.is_some_and(|t| now < t);
                if (young && covered) || backing_off {
                    break;
                }
                match (c.polling, c.started.map(|t| t + TICK)) {
                    (Some(_), _) => Next::Wait,
                    // One call per tick: an id the last poll left out waits for the next.
                    (None, Some(due)) if now < due => Next::Sleep(due),
                    (None, _) => {
                        c.polling = Some(now);
                        c.started = Some(now);
                        Next::Start
                    }
                }
            };
            let waited = match next {
                Next::Sleep(due) => {
                    let due = tokio::time::Instant::from_std(due).min(deadline);
                    tokio::time::sleep_until(due).await;
                    (due < deadline).then_some(())
                }
                Next::Start | Next::Wait => {
                    if matches!(next, Next::Start) {
                        let me = self.clone();
                        let client = client.clone();
                        tokio::spawn(async move { me.poll_now(&client).await });
                    }
                    tokio::time::timeout_at(deadline, done.changed())
                        .await
                        .ok()
                        .map(|_| ())
                }
            };
            if waited.is_none() {
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
                    // Gone only when squeue was asked and did not list it.
                    (None, None, None) if c.polled.contains(i) => Seen::Gone,
                    (None, None, None) => Seen::Unreachable(format!(
                        "squeue has not been asked about job {i} yet (ask again)"
                    )),
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
                    c.pace = if unchanged(&c.polled, &c.rows, &all, &rows) {
                        (c.pace() * 2).min(self.pace_max)
                    } else {
                        TICK
                    };
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

/// Whether a poll of `ids` answering `rows` saw nothing move since the last one (`polled`
/// answering `before`): no job it saw changed state, reason, node or restarts (elapsed time
/// does not count; a job new to this poll set the pace back when it was registered).
fn unchanged(
    polled: &HashSet<String>,
    before: &HashMap<String, Row>,
    ids: &[String],
    rows: &HashMap<String, Row>,
) -> bool {
    let key = |r: &Row| {
        (
            r.state.clone(),
            r.reason.clone(),
            r.node.clone(),
            r.restarts,
        )
    };
    ids.iter()
        .filter(|i| polled.contains(*i))
        .all(|i| before.get(i).map(key) == rows.get(i).map(key))
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

    #[test]
    fn only_a_move_of_a_job_seen_before_resets_the_pace() {
        let before =
            parse_rows("12|RUNNING|None|0:05|1:00|n1|0|\n13|PENDING|Priority|0:00|1:00||0|\n");
        let polled: HashSet<String> = ["12".into(), "13".into()].into();
        let ids: Vec<String> = vec!["12".into(), "13".into(), "14".into()];
        let same = |text: &str| unchanged(&polled, &before, &ids, &parse_rows(text));
        // Time passing, and a job new to this poll, are no change.
        assert!(same(
            "12|RUNNING|None|0:09|1:00|n1|0|\n13|PENDING|Priority|0:00|1:00||0|\n14|PENDING|None|0:00|1:00||0|\n"
        ));
        // A new state, reason, node or restart count is; so is a job no longer listed.
        for moved in [
            "12|COMPLETING|None|0:09|1:00|n1|0|\n13|PENDING|Priority|0:00|1:00||0|\n",
            "12|RUNNING|None|0:09|1:00|n1|0|\n13|PENDING|Resources|0:00|1:00||0|\n",
            "12|RUNNING|None|0:09|1:00|n2|0|\n13|PENDING|Priority|0:00|1:00||0|\n",
            "12|RUNNING|None|0:09|1:00|n1|1|\n13|PENDING|Priority|0:00|1:00||0|\n",
            "12|RUNNING|None|0:09|1:00|n1|0|\n",
        ] {
            assert!(!same(moved), "{moved}");
        }
    }
}
