//! What a Slurm job is, from the two witnesses rsb has: the wrapper's record (on the shared
//! home: the exit code, and whether the command ended) and Slurm's row (pending, running,
//! why it ended, how often it was requeued). One judgement, so that `check_background_task`
//! and the watchdog never disagree about a job.

use super::poll::{Row, Seen};

/// What a Slurm state means for the job: (rsb state, finished, reason).
pub fn meaning(state: &str) -> (&'static str, bool, Option<&'static str>) {
    match state {
        "PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" => ("pending", false, None),
        "RUNNING" | "CONFIGURING" | "COMPLETING" | "SIGNALING" | "STAGE_OUT" | "RESIZING" => {
            ("running", false, None)
        }
        "SUSPENDED" | "STOPPED" => ("suspended", false, None),
        "COMPLETED" => ("exited", true, None),
        "FAILED" | "BOOT_FAIL" | "DEADLINE" => ("exited", true, None),
        "TIMEOUT" => ("exited", true, Some("timeout")),
        "OUT_OF_MEMORY" => ("exited", true, Some("out_of_memory")),
        "CANCELLED" => ("exited", true, Some("cancelled")),
        "NODE_FAIL" => ("interrupted", true, Some("node_fail")),
        "PREEMPTED" => ("interrupted", true, Some("preempted")),
        _ => ("unknown", false, None),
    }
}

/// The judgement. `state` is `None` where the record alone decides (its own `exited` or
/// `lost`), so the caller keeps what the record said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judged {
    /// `pending | running | suspended | resuming | completing | exited | interrupted | lost |
    /// scheduler_unreachable | unknown`, or `None`: the record's state stands.
    pub state: Option<&'static str>,
    /// Whether it is still running (or will run); `None` with `state`.
    pub running: Option<bool>,
    /// `timeout | out_of_memory | cancelled | node_fail | preempted`: why Slurm ended it.
    pub reason: Option<&'static str>,
    pub slurm_state: Option<String>,
    pub pending_reason: Option<String>,
    pub node: Option<String>,
    /// Slurm's `Restarts`: how often it requeued the job (node failure, preemption).
    pub restarts: Option<u32>,
    /// How the controller failed to answer.
    pub scheduler_error: Option<String>,
}

/// Judge one job. `recorded_end`: the wrapper recorded the command's end; `ran`: the wrapper
/// recorded a start (so a pending job is back in the queue, not new).
pub fn judge(seen: &Seen, recorded_end: bool, ran: bool) -> Judged {
    let mut j = Judged {
        state: None,
        running: None,
        reason: None,
        slurm_state: None,
        pending_reason: None,
        node: None,
        restarts: None,
        scheduler_error: None,
    };
    let set = |j: &mut Judged, s: &'static str, running: bool| {
        j.state = Some(s);
        j.running = Some(running);
    };
    match seen {
        Seen::Row(Row {
            state,
            reason,
            node,
            restarts,
            ..
        }) => {
            j.slurm_state = Some(state.clone());
            j.restarts = Some(*restarts);
            if !node.is_empty() && node != "(null)" {
                j.node = Some(node.clone());
            }
            let (word, finished, why) = meaning(state);
            j.reason = why;
            if word == "pending" {
                j.pending_reason = Some(reason.clone());
                // Back in the queue after it ran: Slurm requeued it (node failure,
                // preemption), and Slurm will run it again.
                let again = ran || recorded_end || *restarts > 0;
                set(&mut j, if again { "resuming" } else { "pending" }, true);
            } else if recorded_end && !finished {
                // The command ended (its code is on record) but Slurm has not closed the job
                // yet (COMPLETING, epilog, or about to requeue it): why it ended is known only
                // once Slurm says so.
                set(&mut j, "completing", true);
            } else if recorded_end {
                // The record has the exit code; Slurm only adds why.
                if word == "interrupted" {
                    set(&mut j, word, false);
                }
            } else {
                set(&mut j, word, !finished);
            }
        }
        Seen::Gone => {
            if !recorded_end {
                // Purged by the controller and nothing on record: it never reported.
                j.slurm_state = Some("unknown".into());
                set(&mut j, "lost", false);
            }
        }
        Seen::Unreachable(e) => {
            // Never "lost", and never final: the record may hold the exit code, but only Slurm
            // can say whether that end was a timeout, a preemption it will requeue, or the end.
            j.scheduler_error = Some(e.clone());
            set(&mut j, "scheduler_unreachable", !recorded_end);
        }
    }
    j
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(state: &str, restarts: u32) -> Seen {
        Seen::Row(Row {
            state: state.into(),
            reason: "BeginTime".into(),
            elapsed: "0:01".into(),
            limit: "UNLIMITED".into(),
            node: "n1".into(),
            restarts,
        })
    }

    /// The poller stops asking about exactly the states that mean the job ended for good:
    /// an end that may be followed by a requeue (node failure, preemption) is not one.
    #[test]
    fn the_poller_s_final_states_are_the_ends_without_a_requeue() {
        for s in [
            "PENDING",
            "REQUEUED",
            "REQUEUE_HOLD",
            "REQUEUE_FED",
            "RUNNING",
            "CONFIGURING",
            "COMPLETING",
            "SIGNALING",
            "STAGE_OUT",
            "RESIZING",
            "SUSPENDED",
            "STOPPED",
            "COMPLETED",
            "FAILED",
            "BOOT_FAIL",
            "DEADLINE",
            "TIMEOUT",
            "OUT_OF_MEMORY",
            "CANCELLED",
            "NODE_FAIL",
            "PREEMPTED",
            "SPECIAL_EXIT",
            "",
        ] {
            assert_eq!(
                super::super::poll::is_final(s),
                meaning(s).0 == "exited",
                "{s}"
            );
        }
    }

    #[test]
    fn a_requeued_job_is_resuming_and_a_fresh_one_pending() {
        assert_eq!(
            judge(&row("PENDING", 0), false, false).state,
            Some("pending")
        );
        let j = judge(&row("PENDING", 1), true, true);
        assert_eq!((j.state, j.restarts), (Some("resuming"), Some(1)));
        assert_eq!(j.pending_reason.as_deref(), Some("BeginTime"));
    }

    #[test]
    fn the_record_decides_the_code_and_slurm_the_reason() {
        let j = judge(&row("FAILED", 0), true, true);
        assert_eq!((j.state, j.reason), (None, None));
        let j = judge(&row("TIMEOUT", 0), true, true);
        assert_eq!((j.state, j.reason), (None, Some("timeout")));
        let j = judge(&row("NODE_FAIL", 0), true, true);
        assert_eq!(
            (j.state, j.reason),
            (Some("interrupted"), Some("node_fail"))
        );
        let j = judge(&row("COMPLETING", 0), true, true);
        assert_eq!(j.state, Some("completing"));
        // Purged, but on record: the record alone decides.
        assert_eq!(judge(&Seen::Gone, true, true).state, None);
        assert_eq!(judge(&Seen::Gone, false, false).state, Some("lost"));
    }

    #[test]
    fn an_unreachable_controller_is_its_own_state_even_with_an_end_on_record() {
        let j = judge(&Seen::Unreachable("down".into()), true, true);
        assert_eq!(j.state, Some("scheduler_unreachable"));
        assert_eq!(j.running, Some(false));
        let j = judge(&Seen::Unreachable("down".into()), false, true);
        assert_eq!(j.running, Some(true));
    }
}
