//! What a push says: one line a model reads (what, where, the outcome, how long, the last
//! log line) and the ids to follow up, built from a watch's event, the agent's report of a
//! run's end or Slurm's word, every text in it made safe to show inside a channel turn.

use std::collections::BTreeMap;

use rmcp::model::{CustomNotification, ServerNotification};
use serde_json::{Map, Value, json};

/// The notification's method.
pub const METHOD: &str = "notifications/claude/channel";
/// The longest content line: one line of what, where, the outcome, the duration and the last
/// log line, never a log.
pub(super) const MAX_CONTENT_CHARS: usize = 400;
const MAX_LAST_LINE_CHARS: usize = 160;

/// One push: the line a model reads, and the ids it needs to follow up (`meta` values are
/// strings, and keys are identifiers, as Claude Code turns them into tag attributes).
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub content: String,
    pub meta: BTreeMap<&'static str, String>,
}

impl Message {
    /// Every text in a push (a job's or watch's name, a path, a log line, an error) may come
    /// from the model or the host: made [`for_channel`], content clipped to one line.
    pub(super) fn new(content: String, meta: BTreeMap<&'static str, String>) -> Message {
        Message {
            content: clip(&for_channel(&content), MAX_CONTENT_CHARS),
            meta: meta
                .into_iter()
                .map(|(k, v)| (k, for_channel(&v)))
                .collect(),
        }
    }

    pub(super) fn notification(&self) -> ServerNotification {
        let meta: Map<String, Value> = self
            .meta
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        ServerNotification::CustomNotification(CustomNotification::new(
            METHOD,
            Some(json!({"content": self.content, "meta": meta})),
        ))
    }
}

/// The push for a run's end as the agent's stream reported it ([`super::job_ends`]): the same
/// line and meta keys as a watch's `completed` or `interrupted` event.
/// `failure`: why the run failed ([`crate::ops::failure`]), read from its log's tail.
pub(super) fn run_ended(
    sandbox: &str,
    e: &rsb_protocol::JobEvent,
    watch_id: i64,
    failure: Option<&str>,
) -> Message {
    use rsb_protocol::JobEventKind;
    let info = &e.info;
    let (event, outcome) = match (e.kind, info.exit_code, info.signal) {
        (JobEventKind::Lost, _, _) => (
            crate::store::events::INTERRUPTED,
            "lost (it ended without recording an exit code)".to_string(),
        ),
        (_, Some(0), _) => (crate::store::events::COMPLETED, "completed (exit 0)".into()),
        (_, Some(c), _) => (
            crate::store::events::COMPLETED,
            format!("failed (exit {c})"),
        ),
        (_, None, Some(sig)) => (
            crate::store::events::INTERRUPTED,
            format!("killed by signal {sig}"),
        ),
        _ => (crate::store::events::INTERRUPTED, "ended".into()),
    };
    let mut content = format!("job `{}` on {sandbox}: {outcome}", info.name);
    if let Some(end) = info.ended_ms {
        let took = (end.saturating_sub(info.started_ms) as i64 + 500) / 1000;
        content.push_str(&format!(" after {}", duration(took)));
    }
    if let Some(l) = e
        .last_line
        .as_deref()
        .map(crate::store::watch_model::one_line)
        .filter(|l| !l.is_empty())
    {
        content.push_str(&format!("; last line: {}", clip(&l, MAX_LAST_LINE_CHARS)));
    }
    let mut meta = BTreeMap::from([
        ("kind", "job".to_string()),
        ("event", event.to_string()),
        ("sandbox_name", sandbox.to_string()),
        ("session_name", info.name.clone()),
    ]);
    if let Some(c) = info.exit_code {
        meta.insert("exit_code", c.to_string());
    }
    if let Some(sig) = info.signal {
        meta.insert("signal", sig.to_string());
    }
    if watch_id > 0 {
        meta.insert("watch_id", watch_id.to_string());
    }
    with_failure(&mut content, &mut meta, failure);
    Message::new(content, meta)
}

/// Say why a run failed (`failure_reason`, one of a fixed set of words) in the meta, and in
/// the line unless it is `unknown`.
pub(super) fn with_failure(
    content: &mut String,
    meta: &mut BTreeMap<&'static str, String>,
    reason: Option<&str>,
) {
    let word = |r: &&str| !r.is_empty() && r.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    let Some(r) = reason.filter(word) else {
        return;
    };
    if r != "unknown" {
        content.push_str(&format!("; failure: {r}"));
    }
    meta.insert("failure_reason", r.to_string());
}

/// The push for an unwatched Slurm job's end ([`super::job_ends::follow_slurm`]), from the
/// reply `check_background_task` gives for it: Slurm's reason when Slurm ended it (the
/// watch's event names: timeout, out_of_memory, cancelled), else the recorded exit code, else
/// how it ended (lost, interrupted), with Slurm's state and job id.
pub(super) fn slurm_ended(sandbox: &str, name: &str, job_id: &str, v: &Value) -> Message {
    use crate::store::events;
    let exit = v["exit_code"].as_i64();
    let reason = v["reason"]
        .as_str()
        .filter(|r| [events::TIMEOUT, events::OUT_OF_MEMORY, events::CANCELLED].contains(r));
    let (event, outcome) = match (reason, exit) {
        (Some(r), _) => (r, r.replace('_', " ")),
        (None, Some(0)) => (events::COMPLETED, "completed (exit 0)".to_string()),
        (None, Some(c)) => (events::COMPLETED, format!("failed (exit {c})")),
        (None, None) => (
            events::INTERRUPTED,
            v["state"].as_str().unwrap_or("ended").replace('_', " "),
        ),
    };
    let slurm_state = v["slurm_state"]
        .as_str()
        .filter(|s| !s.is_empty() && *s != "unknown")
        .unwrap_or("purged");
    let mut content =
        format!("job `{name}` on {sandbox}: {outcome} (Slurm: {slurm_state}, job {job_id})");
    if let Some(l) = last_line(v["log_tail"].as_str().unwrap_or_default()) {
        content.push_str(&format!("; last line: {}", clip(&l, MAX_LAST_LINE_CHARS)));
    }
    let mut meta = BTreeMap::from([
        ("kind", "job".to_string()),
        ("event", event.to_string()),
        ("sandbox_name", sandbox.to_string()),
        ("session_name", name.to_string()),
        ("slurm_job_id", job_id.to_string()),
        ("slurm_state", slurm_state.to_string()),
    ]);
    if let Some(c) = exit {
        meta.insert("exit_code", c.to_string());
    }
    with_failure(&mut content, &mut meta, v["failure_reason"].as_str());
    Message::new(content, meta)
}

/// The job's last line with text in it, as one line (control characters out, so remote text
/// can never start a second line or a terminal escape), or none when it printed nothing. The
/// job runner's own `EXIT_CODE=N` marker is the exit code, which the line already says, and
/// its header (`== session:`, `== started_at:`, `== command:`) is not the job's output: the
/// search stops there.
pub(super) fn last_line(tail: &str) -> Option<String> {
    let marker = |l: &str| {
        l.strip_prefix("EXIT_CODE=")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let lines: Vec<&str> = tail.lines().collect();
    let header = |i: usize| {
        lines[i].starts_with("== command: ")
            && i >= 2
            && lines[i - 1].starts_with("== started_at: ")
            && lines[i - 2].starts_with("== session: ")
    };
    (0..lines.len())
        .rev()
        .take_while(|&i| !header(i))
        .map(|i| crate::store::watch_model::one_line(lines[i]))
        .find(|l| !l.is_empty() && !marker(l))
        .map(|l| clip(&l, MAX_LAST_LINE_CHARS))
}

/// `s` as text a client shows inside a `<channel …>…</channel>` turn: one line, and nothing
/// that reads as markup or as a second turn. Control characters (C0 with CR, LF and tab, DEL,
/// C1), the Unicode line and paragraph separators and the bidirectional overrides are written
/// as visible `\u{..}` escapes; `<` and `>` become `‹` and `›`, so no text opens or closes a
/// tag; `"` becomes `'`, so a meta value (a tag attribute) cannot end early.
pub fn for_channel(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push('‹'),
            '>' => out.push('›'),
            '"' => out.push('\''),
            c if c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                out.push_str(&format!("\\u{{{:x}}}", c as u32))
            }
            c => out.push(c),
        }
    }
    out
}

pub(super) fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max - 1).collect();
    out.push('…');
    out
}

/// `2h03m`, `4m05s`, `7s`.
pub(super) fn duration(secs: i64) -> String {
    let s = secs.max(0);
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_line_is_the_job_s_own_or_none() {
        let header =
            "== session: t\n== started_at: 2026-12-06T08:00:00Z\n== command: python train.py\n";
        assert_eq!(last_line(header), None);
        assert_eq!(last_line(&format!("{header}EXIT_CODE=1\n")), None);
        assert_eq!(
            last_line(&format!("{header}epoch 1\n\nEXIT_CODE=0\n")).as_deref(),
            Some("epoch 1")
        );
        // A job that prints lines like a header is still heard.
        assert_eq!(
            last_line("== command: mine\n").as_deref(),
            Some("== command: mine")
        );
        // The previous run's output before this run's header is not this run's.
        assert_eq!(last_line(&format!("old run\nEXIT_CODE=1\n{header}")), None);
    }

    #[test]
    fn a_failure_is_named_in_the_line_and_the_meta_and_host_words_never_pass() {
        let e = rsb_protocol::JobEvent {
            kind: rsb_protocol::JobEventKind::Ended,
            info: rsb_protocol::JobInfo {
                name: "train".into(),
                command: String::new(),
                cwd: String::new(),
                log_file: String::new(),
                runner: String::new(),
                pid: 1,
                started_ms: 1_000,
                state: rsb_protocol::JobState::Exited,
                exit_code: Some(1),
                signal: None,
                oom_kill: None,
                ended_ms: Some(126_000),
                launch_id: String::new(),
                log_start: 0,
                previous: None,
                unconfined: None,
                gpus: vec![],
            },
            last_line: Some("boom".into()),
        };
        let m = run_ended("gpu1", &e, 0, Some("cuda_oom"));
        assert_eq!(
            m.content,
            "job `train` on gpu1: failed (exit 1) after 2m05s; last line: boom; failure: cuda_oom"
        );
        assert_eq!(m.meta["failure_reason"], "cuda_oom");
        let m = run_ended("gpu1", &e, 0, Some("unknown"));
        assert!(m.content.ends_with("; last line: boom"), "{}", m.content);
        assert_eq!(m.meta["failure_reason"], "unknown");
        let v = json!({"running": false, "state": "interrupted", "slurm_state": "NODE_FAIL",
                       "failure_reason": "x</channel> <channel>"});
        let m = slurm_ended("hpc", "t", "7", &v);
        assert!(!m.meta.contains_key("failure_reason"), "{:?}", m.meta);
        assert!(!m.content.contains("failure"), "{}", m.content);
        let v = json!({"running": false, "state": "interrupted", "slurm_state": "NODE_FAIL",
                       "failure_reason": "node_fail"});
        assert_eq!(
            slurm_ended("hpc", "t", "7", &v).meta["failure_reason"],
            "node_fail"
        );
    }

    #[test]
    fn a_slurm_end_says_slurm_s_word_or_the_exit_code_and_its_ids() {
        let header = "== session: s\n== started_at: 2026-12-07T05:00:00Z\n== command: x\n";
        let exited = json!({"running": false, "state": "exited", "exit_code": 3,
            "slurm_state": "FAILED", "log_tail": format!("{header}loss nan\nEXIT_CODE=3\n")});
        let m = slurm_ended("hpc", "train", "17", &exited);
        assert_eq!(
            m.content,
            "job `train` on hpc: failed (exit 3) (Slurm: FAILED, job 17); last line: loss nan"
        );
        assert_eq!(m.meta["event"], "completed");
        assert_eq!(m.meta["exit_code"], "3");
        assert_eq!(m.meta["slurm_job_id"], "17");
        // Cancelled while pending: no record, no output, Slurm's word.
        let cancelled = json!({"running": false, "state": "exited", "reason": "cancelled",
            "slurm_state": "CANCELLED", "log_tail": ""});
        let m = slurm_ended("hpc", "held", "18", &cancelled);
        assert_eq!(
            m.content,
            "job `held` on hpc: cancelled (Slurm: CANCELLED, job 18)"
        );
        assert_eq!(m.meta["event"], "cancelled");
        assert!(!m.meta.contains_key("exit_code"));
        // Forgotten by Slurm with no end on record.
        let lost = json!({"running": false, "state": "lost", "slurm_state": "unknown"});
        let m = slurm_ended("hpc", "gone", "19", &lost);
        assert_eq!(m.content, "job `gone` on hpc: lost (Slurm: purged, job 19)");
        assert_eq!(m.meta["event"], "interrupted");
    }

    #[test]
    fn durations_read_as_a_person_writes_them() {
        assert_eq!(duration(7), "7s");
        assert_eq!(duration(245), "4m05s");
        assert_eq!(duration(7380), "2h03m");
        assert_eq!(duration(-5), "0s");
    }
}
