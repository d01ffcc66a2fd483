//! What this session follows: the watches, transfers and jobs it started whose end it has not
//! reported, and the ends already reported, so that each run's end is pushed once whichever
//! source (the agent's stream, the store) reports it first.

use std::collections::{BTreeMap, BTreeSet};

/// What this session started and wants to hear about. Handlers add to it; the pusher drops an
/// entry once it has reported the end.
#[derive(Default)]
pub struct Followed {
    state: parking_lot::Mutex<State>,
    pub(super) wake: tokio::sync::Notify,
}

impl State {
    fn remember_end(&mut self, key: RunKey) {
        if self.ended.len() >= ENDED_KEPT {
            self.ended.pop_front();
        }
        self.ended.push_back(key);
    }
}

#[derive(Default)]
struct State {
    /// Watch id → the last event id reported for it (0: none yet, so an event written between
    /// the registration and this entry is still reported).
    watches: BTreeMap<i64, i64>,
    /// Background transfer task ids.
    transfers: BTreeSet<i64>,
    /// Jobs this session started (watched or not) whose end is not reported yet, each run by
    /// its sandbox, name and start (ms, the agent's clock) → its watch id, 0 when unwatched.
    /// The agent's event stream reports their ends ([`super::job_ends`]).
    jobs: BTreeMap<RunKey, i64>,
    /// Unwatched Slurm jobs this session submitted whose end is not reported yet: (sandbox,
    /// name) → Slurm job id. Their end is Slurm's word with the record's, from the shared
    /// poller ([`super::job_ends::follow_slurm`]); a watched one's comes from its watch.
    slurm: BTreeMap<(String, String), String>,
    /// The runs whose end was reported, oldest first, by whichever source came first: the
    /// agent's stream or a watch's event in the store. The other's report of the same end is
    /// dropped ([`Followed::claim_end`]).
    ended: std::collections::VecDeque<RunKey>,
}

/// One run of a job: its sandbox, name and `started_ms`.
pub type RunKey = (String, String, u64);

/// How many reported ends are remembered for deduplication: far more than can be reported
/// twice within the store's and the stream's lag of each other.
const ENDED_KEPT: usize = 4096;

impl Followed {
    pub fn watch(&self, id: i64) {
        if id > 0 {
            self.state.lock().watches.entry(id).or_insert(0);
            self.wake.notify_one();
        }
    }

    pub fn transfer(&self, id: i64) {
        if id > 0 {
            self.state.lock().transfers.insert(id);
            self.wake.notify_one();
        }
    }

    /// A job this session started: its end is pushed from the agent's stream the moment it
    /// happens, watched or not.
    pub fn job(&self, sandbox: &str, name: &str, started_ms: u64, watch_id: i64) {
        if started_ms == 0 || name.is_empty() {
            return;
        }
        let key = (sandbox.to_string(), name.to_string(), started_ms);
        let mut s = self.state.lock();
        if !s.ended.contains(&key) {
            s.jobs.insert(key, watch_id);
            drop(s);
            self.wake.notify_one();
        }
    }

    /// An unwatched Slurm job this session submitted: its end is pushed once Slurm and the
    /// record say it is over, as `check_background_task` would answer.
    pub fn slurm_job(&self, sandbox: &str, name: &str, slurm_id: &str) {
        if name.is_empty() || slurm_id.is_empty() {
            return;
        }
        let key = (sandbox.to_string(), name.to_string());
        self.state.lock().slurm.insert(key, slurm_id.to_string());
        self.wake.notify_one();
    }

    /// This sandbox's unreported Slurm jobs: (name, Slurm job id).
    pub(super) fn slurm_jobs(&self, sandbox: &str) -> Vec<(String, String)> {
        let s = self.state.lock();
        s.slurm
            .iter()
            .filter(|((sb, _), _)| sb == sandbox)
            .map(|((_, n), id)| (n.clone(), id.clone()))
            .collect()
    }

    /// The sandboxes with Slurm jobs whose end is not reported yet.
    pub(super) fn slurm_sandboxes(&self) -> BTreeSet<String> {
        let s = self.state.lock();
        s.slurm.keys().map(|k| k.0.clone()).collect()
    }

    /// The Slurm job `name` on `sandbox` ended: whether it was still unreported (the caller
    /// reports it).
    pub(super) fn take_slurm(&self, sandbox: &str, name: &str) -> bool {
        let key = (sandbox.to_string(), name.to_string());
        self.state.lock().slurm.remove(&key).is_some()
    }

    /// The earliest start among this sandbox's unreported jobs: a subscription asks the agent
    /// for every end since then, so one that came before it (or while it was down) is heard.
    /// `None`: nothing left to hear about there.
    pub(super) fn first_started(&self, sandbox: &str) -> Option<u64> {
        let s = self.state.lock();
        s.jobs
            .keys()
            .filter(|(sb, _, _)| sb == sandbox)
            .map(|k| k.2)
            .min()
    }

    /// The sandboxes with jobs whose end is not reported yet.
    pub(super) fn job_sandboxes(&self) -> BTreeSet<String> {
        let s = self.state.lock();
        s.jobs.keys().map(|k| k.0.clone()).collect()
    }

    /// The stream saw this run end: `Some(watch id)` when it is this session's and its end
    /// was not reported yet (the caller reports it), `None` otherwise.
    pub(super) fn take_job(&self, key: &RunKey) -> Option<i64> {
        let mut s = self.state.lock();
        let watch_id = s.jobs.remove(key)?;
        s.remember_end(key.clone());
        Some(watch_id)
    }

    /// A watch's event in the store ends this run: whether it is the first report of that
    /// end (send it) or the stream reported it already (drop it). Either way the stream will
    /// not report it again.
    pub(super) fn claim_end(&self, key: &RunKey) -> bool {
        let mut s = self.state.lock();
        if s.ended.contains(key) {
            return false;
        }
        s.jobs.remove(key);
        s.remember_end(key.clone());
        true
    }

    pub(super) fn is_empty(&self) -> bool {
        let s = self.state.lock();
        s.watches.is_empty() && s.transfers.is_empty() && s.jobs.is_empty() && s.slurm.is_empty()
    }

    pub(super) fn snapshot(&self) -> (BTreeMap<i64, i64>, BTreeSet<i64>) {
        let s = self.state.lock();
        (s.watches.clone(), s.transfers.clone())
    }

    /// What one read of the store found: each watch's last event read (`(watch id, event
    /// id)`), and the watches and transfers that will report nothing more.
    pub(super) fn apply(
        &self,
        watch_cursors: &[(i64, i64)],
        watches_ended: &[i64],
        transfers_ended: &[i64],
    ) {
        let mut s = self.state.lock();
        for (id, last) in watch_cursors {
            if let Some(c) = s.watches.get_mut(id) {
                *c = (*c).max(*last);
            }
        }
        for id in watches_ended {
            s.watches.remove(id);
        }
        for id in transfers_ended {
            s.transfers.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 40: a run's end is sent once, by whichever of the agent's stream and the store
    /// reports it first; a resumed run of the same name (another start) is its own end.
    #[test]
    fn each_run_s_end_is_claimed_once_by_the_stream_or_the_store() {
        let f = Followed::default();
        let run = |n: &str, t: u64| ("gpu1".to_string(), n.to_string(), t);
        f.job("gpu1", "train", 1_000, 4);
        f.job("gpu1", "eval", 2_000, 0);
        f.job("gpu2", "x", 500, 0);
        assert_eq!(f.first_started("gpu1"), Some(1_000));
        assert_eq!(f.job_sandboxes().len(), 2);
        // The stream first: the store's report of the same end is dropped.
        assert_eq!(f.take_job(&run("train", 1_000)), Some(4));
        assert!(!f.claim_end(&run("train", 1_000)));
        assert_eq!(f.take_job(&run("train", 1_000)), None);
        // The store first: the stream finds nothing left to report.
        assert!(f.claim_end(&run("eval", 2_000)));
        assert_eq!(f.take_job(&run("eval", 2_000)), None);
        assert_eq!(f.first_started("gpu1"), None);
        // A resumed run: a new start, heard on its own.
        assert!(f.claim_end(&run("train", 9_000)));
        // Not this session's job: the stream ignores it; a job whose end was already
        // reported is not followed again.
        assert_eq!(f.take_job(&run("other", 1_000)), None);
        f.job("gpu1", "train", 1_000, 4);
        assert_eq!(f.first_started("gpu1"), None);
        assert!(!f.is_empty(), "gpu2's job is still followed");
    }
}
