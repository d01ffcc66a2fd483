//! What a run reports while it goes, and the baseline it leaves.
//!
//! One tracker per run is shared by every task of the transfer; it is the only place that
//! knows both what was planned and what each acknowledged commit carried, so the baseline a
//! run leaves (completed, failed or cancelled) is built here and nowhere else.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use parking_lot::Mutex;

use super::CommitJournal;
use crate::sync::{Phase, Progress, ProgressFn};

/// Progress callbacks at most this often (plus every phase change and the end).
pub(super) const PROGRESS_EVERY: Duration = Duration::from_millis(50);

pub(super) fn tmark(t: &Tracker, what: &str) {
    if std::env::var_os("RSB_SYNC_TIMING").is_some() {
        eprintln!(
            "[sync timing] {what}: {:.1} ms",
            t.start.elapsed().as_secs_f64() * 1000.0
        );
    }
}

pub(super) struct Tracker {
    cb: Option<ProgressFn>,
    pub(super) start: Instant,
    /// The large file being sent and how many of its bytes the destination holds staged
    /// (acknowledged, or kept from an interrupted sync), for the cancel message.
    pub(super) large: Mutex<Option<(String, u64)>>,
    state: Mutex<TrackState>,
    /// The baseline this run leaves before any commit: what both sides held when it planned
    /// (unchanged files, conflicts' old entries, the old entries of files about to be sent).
    /// Set once the plan is made.
    pub(super) base: Mutex<Option<HashMap<String, [u8; 32]>>>,
    /// `rel` → the hash each acknowledged `FileCommit` carried: exactly what the destination
    /// now holds, whatever the manifest said when the run scanned.
    committed: Mutex<HashMap<String, [u8; 32]>>,
    /// Where each acknowledged batch's commits are recorded as they come, so a run killed
    /// outright still leaves them ([`super::RunOptions::journal`]).
    journal: Option<CommitJournal>,
}

struct TrackState {
    p: Progress,
    last_emit: Option<Instant>,
    xfer_start: Option<Instant>,
}

impl Tracker {
    pub(super) fn new(cb: Option<ProgressFn>) -> Tracker {
        Tracker {
            cb,
            start: Instant::now(),
            large: Mutex::new(None),
            base: Mutex::new(None),
            committed: Mutex::new(Default::default()),
            journal: None,
            state: Mutex::new(TrackState {
                p: Progress::default(),
                last_emit: None,
                xfer_start: None,
            }),
        }
    }

    /// Record every acknowledged commit in `journal` too.
    pub(super) fn with_journal(mut self, journal: Option<CommitJournal>) -> Tracker {
        self.journal = journal;
        self
    }

    pub(super) fn update(&self, force: bool, f: impl FnOnce(&mut Progress)) {
        let snapshot = {
            let mut st = self.state.lock();
            let before = st.p.phase;
            f(&mut st.p);
            let now = Instant::now();
            if st.p.phase == Phase::Transferring && st.xfer_start.is_none() {
                st.xfer_start = Some(now);
            }
            st.p.elapsed_s = self.start.elapsed().as_secs_f64();
            if let Some(t) = st.xfer_start {
                let secs = now.duration_since(t).as_secs_f64();
                if secs > 0.0 {
                    st.p.rate_bps = st.p.bytes_done as f64 / secs;
                }
            }
            let due = force
                || before != st.p.phase
                || st
                    .last_emit
                    .is_none_or(|t| now.duration_since(t) >= PROGRESS_EVERY);
            if !due || self.cb.is_none() {
                return;
            }
            st.last_emit = Some(now);
            st.p.clone()
        };
        if let Some(cb) = &self.cb {
            cb(&snapshot);
        }
    }

    pub(super) fn phase(&self, ph: Phase) {
        self.update(true, |p| p.phase = ph);
    }

    /// A batch acknowledged: its progress, and the hashes its commits carried.
    pub(super) fn batch_acked(&self, b: BatchInfo) {
        self.acked(b.files, b.bytes, b.last.as_deref());
        self.commit(b.commits);
    }

    /// A large file's commit acknowledged.
    pub(super) fn file_committed(&self, rel: &str, hash: [u8; 32]) {
        self.commit(vec![(rel.to_string(), hash)]);
    }

    /// Acknowledged commits: journaled (outside every lock: the journal writes to the store),
    /// then laid over the baseline this run leaves.
    fn commit(&self, commits: Vec<(String, [u8; 32])>) {
        if let Some(j) = self.journal.as_ref().filter(|_| !commits.is_empty()) {
            j(&commits);
        }
        self.committed.lock().extend(commits);
    }

    /// The baseline after what this run did so far: the planned one with every acknowledged
    /// commit's hash over it. `None` before a plan was made (nothing to save).
    pub(super) fn baseline(&self) -> Option<HashMap<String, [u8; 32]>> {
        let mut b = self.base.lock().clone()?;
        b.extend(self.committed.lock().iter().map(|(k, v)| (k.clone(), *v)));
        Some(b)
    }

    pub(super) fn acked(&self, files: u64, bytes: u64, path: Option<&str>) {
        self.update(false, |p| {
            p.files_done += files;
            p.bytes_done += bytes;
            if let Some(path) = path {
                p.current_path = path.to_string();
            }
        });
    }
}

/// What one small batch carries, for progress once it is acknowledged.
pub(super) struct BatchInfo {
    pub(super) files: u64,
    pub(super) bytes: u64,
    pub(super) last: Option<String>,
    /// `(rel, hash)` of the batch's `FileCommit`s.
    pub(super) commits: Vec<(String, [u8; 32])>,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A tracker whose callback keeps every report.
    fn recording() -> (Tracker, Arc<Mutex<Vec<Progress>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let keep = seen.clone();
        let cb: ProgressFn = Arc::new(move |p: &Progress| keep.lock().push(p.clone()));
        (Tracker::new(Some(cb)), seen)
    }

    fn batch(files: u64, bytes: u64, last: &str, commits: &[(&str, u8)]) -> BatchInfo {
        BatchInfo {
            files,
            bytes,
            last: Some(last.to_string()),
            commits: commits
                .iter()
                .map(|(r, h)| (r.to_string(), [*h; 32]))
                .collect(),
        }
    }

    #[test]
    fn every_phase_change_is_reported_at_once() {
        let (t, seen) = recording();
        t.phase(Phase::Scanning);
        t.phase(Phase::Planning);
        t.phase(Phase::Transferring);
        let phases: Vec<Phase> = seen.lock().iter().map(|p| p.phase).collect();
        assert_eq!(
            phases,
            [Phase::Scanning, Phase::Planning, Phase::Transferring]
        );
    }

    #[test]
    fn acknowledgements_are_coalesced_to_one_report_per_50_ms() {
        let (t, seen) = recording();
        let start = Instant::now();
        t.phase(Phase::Transferring);
        for i in 0..1000 {
            t.acked(1, 10, Some(&format!("f{i}")));
        }
        let elapsed = start.elapsed();
        let bound = 2 + (elapsed.as_millis() / PROGRESS_EVERY.as_millis()) as usize;
        let n = seen.lock().len();
        assert!(n <= bound, "{n} reports in {elapsed:?} (at most {bound})");
        // Nothing is lost by coalescing: the next report has it all.
        t.update(true, |_| {});
        let last = seen.lock().last().cloned().unwrap();
        assert_eq!((last.files_done, last.bytes_done), (1000, 10_000));
        assert_eq!(last.current_path, "f999");
    }

    #[test]
    fn a_forced_update_always_reports() {
        let (t, seen) = recording();
        for _ in 0..5 {
            t.update(true, |p| p.files_total += 1);
        }
        assert_eq!(seen.lock().len(), 5);
        assert_eq!(seen.lock()[4].files_total, 5);
    }

    #[test]
    fn the_rate_counts_from_the_start_of_the_transfer() {
        let (t, seen) = recording();
        t.phase(Phase::Scanning);
        // Bytes before the transfer starts (a resumed file's kept ones) set no rate.
        t.update(true, |p| p.bytes_done = 5_000_000);
        assert_eq!(seen.lock().last().unwrap().rate_bps, 0.0);
        t.update(true, |p| {
            p.phase = Phase::Transferring;
            p.bytes_done = 0;
        });
        let sleep = Duration::from_millis(20);
        std::thread::sleep(sleep);
        t.update(true, |p| p.bytes_done = 1_000_000);
        let p = seen.lock().last().cloned().unwrap();
        assert!(p.rate_bps > 0.0);
        assert!(
            p.rate_bps <= 1_000_000.0 / sleep.as_secs_f64(),
            "{} B/s after at least {sleep:?}",
            p.rate_bps
        );
        assert!(p.elapsed_s >= sleep.as_secs_f64());
    }

    #[test]
    fn no_plan_leaves_no_baseline() {
        let t = Tracker::new(None);
        t.batch_acked(batch(1, 3, "a", &[("a", 1)]));
        assert_eq!(t.baseline(), None, "a run that never planned saves nothing");
    }

    #[test]
    fn acknowledged_commits_are_laid_over_the_planned_baseline() {
        let t = Tracker::new(None);
        *t.base.lock() = Some(HashMap::from([
            ("a".to_string(), [1; 32]),
            ("b".to_string(), [2; 32]),
        ]));
        t.batch_acked(batch(2, 7, "c", &[("a", 3), ("c", 4)]));
        t.file_committed("d", [5; 32]);
        let b = t.baseline().unwrap();
        assert_eq!(b.len(), 4);
        assert_eq!(b["a"], [3; 32], "the commit's hash, not the planned one");
        assert_eq!(b["b"], [2; 32], "untouched files keep theirs");
        assert_eq!(b["c"], [4; 32]);
        assert_eq!(b["d"], [5; 32]);
        // The planned baseline itself is not changed by reading it.
        assert_eq!(t.base.lock().as_ref().unwrap()["a"], [1; 32]);
    }

    #[test]
    fn every_acknowledged_commit_is_journaled_as_it_comes() {
        type Batches = Vec<Vec<(String, [u8; 32])>>;
        let got: Arc<Mutex<Batches>> = Default::default();
        let g = got.clone();
        let t =
            Tracker::new(None).with_journal(Some(Arc::new(move |c: &[(String, [u8; 32])]| {
                g.lock().push(c.to_vec())
            })));
        t.batch_acked(batch(2, 7, "c", &[("a", 3), ("c", 4)]));
        t.batch_acked(batch(1, 1, "x", &[]));
        t.file_committed("d", [5; 32]);
        let want: Batches = vec![
            vec![("a".into(), [3; 32]), ("c".into(), [4; 32])],
            vec![("d".into(), [5; 32])],
        ];
        assert_eq!(
            *got.lock(),
            want,
            "one call per batch, none for a batch without commits"
        );
    }

    #[test]
    fn a_batch_moves_the_counts_without_a_callback() {
        let t = Tracker::new(None);
        t.phase(Phase::Transferring);
        t.batch_acked(batch(3, 30, "x/y", &[]));
        t.batch_acked(batch(2, 20, "z", &[]));
        let p = t.state.lock().p.clone();
        assert_eq!((p.files_done, p.bytes_done), (5, 50));
        assert_eq!(p.current_path, "z");
    }

    #[test]
    fn an_acknowledgement_without_a_path_keeps_the_current_one() {
        let (t, seen) = recording();
        t.acked(1, 1, Some("big.bin"));
        t.acked(0, 100, None);
        t.update(true, |_| {});
        assert_eq!(seen.lock().last().unwrap().current_path, "big.bin");
    }
}
