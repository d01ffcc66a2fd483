//! Apply sessions: `seq` order whatever the arrival order, duplicates and gaps refused, abort,
//! and sessions that belong to one channel.

use std::path::Path;
use std::time::{Duration, Instant};

use rsb::error::Kind;
use rsb_protocol::{
    ApplyAbortRequest, ApplyCloseRequest, ApplyOp, ApplyOpenRequest, ApplyRequest, ErrorCode,
    sync::STAGING_PREFIX,
};

use crate::harness::{Agent, eventually};

fn staging_dirs(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(STAGING_PREFIX))
        .collect()
}

async fn open(agent: &Agent, root: &Path) -> u64 {
    agent
        .client
        .call(ApplyOpenRequest {
            root: root.to_str().unwrap().into(),
            create_root: false,
            confine: None,
        })
        .await
        .unwrap()
        .session
}

fn data(rel: &str, bytes: &[u8]) -> ApplyOp {
    ApplyOp::FileData {
        rel: rel.into(),
        offset: 0,
        data: bytes.to_vec(),
    }
}

fn commit(rel: &str, bytes: &[u8]) -> ApplyOp {
    ApplyOp::FileCommit {
        rel: rel.into(),
        size: bytes.len() as u64,
        mode: 0o644,
        mtime_ns: 1_000_000_000,
        hash: *blake3::hash(bytes).as_bytes(),
    }
}

fn req(session: u64, seq: u64, ops: Vec<ApplyOp>) -> ApplyRequest {
    ApplyRequest { session, seq, ops }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_runs_in_seq_order_whatever_the_arrival_order() {
    let t = tempfile::tempdir().unwrap();
    let agent = Agent::start("seq").await;
    let s = open(&agent, t.path()).await;
    let body = b"written by request 0, committed by request 1";

    // The commit (seq 1) arrives first and must wait for the data (seq 0).
    let c = agent.client.clone();
    let early = tokio::spawn(async move { c.call(req(s, 1, vec![commit("f", body)])).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!early.is_finished(), "seq 1 ran before seq 0 arrived");
    let first = agent.client.call(req(s, 0, vec![data("f", body)])).await;
    assert_eq!(first.unwrap().applied, 1);
    assert_eq!(early.await.unwrap().unwrap().applied, 1);
    assert_eq!(std::fs::read(t.path().join("f")).unwrap(), body);

    // A number already used is refused, and changes nothing.
    let e = agent
        .client
        .call(req(s, 1, vec![data("g", b"dup")]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::Agent(ErrorCode::InvalidArgument), "{e:?}");
    assert!(e.message.contains("already received"), "{e:?}");

    // The close is numbered too; after it the session is gone.
    agent
        .client
        .call(ApplyCloseRequest {
            session: s,
            seq: 2,
            dir_mtimes: vec![],
        })
        .await
        .unwrap();
    let e = agent.client.call(req(s, 3, vec![])).await.unwrap_err();
    assert_eq!(e.kind, Kind::Agent(ErrorCode::NotFound), "{e:?}");
    assert!(staging_dirs(t.path()).is_empty());
    assert!(!t.path().join("g").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_that_never_fills_ends_the_session() {
    let t = tempfile::tempdir().unwrap();
    let agent = Agent::start("gap").await;
    let s = agent_session(&agent, t.path()).await;
    let started = Instant::now();
    // seq 1 is never sent.
    let e = tokio::time::timeout(
        Duration::from_secs(20),
        agent.client.call(req(s, 2, vec![data("late", b"x")])),
    )
    .await
    .expect("a request after a gap waits without bound")
    .unwrap_err();
    let waited = started.elapsed();
    assert_eq!(e.kind, Kind::Agent(ErrorCode::InvalidArgument), "{e:?}");
    assert!(
        e.message.contains("request 1 never arrived"),
        "the message names the missing request: {e:?}"
    );
    assert!(
        waited >= rsb_agent::sync::GAP_WAIT,
        "gave up after {waited:?}"
    );
    // The session takes nothing more, not even the missing number…
    let e = agent
        .client
        .call(req(s, 1, vec![data("late", b"x")]))
        .await
        .unwrap_err();
    assert!(e.message.contains("never arrived"), "{e:?}");
    // …but can be aborted, which removes its staging.
    agent
        .client
        .call(ApplyAbortRequest { session: s })
        .await
        .unwrap();
    assert!(staging_dirs(t.path()).is_empty());
    assert!(!t.path().join("late").exists());
}

/// An open session whose seq 0 has run.
async fn agent_session(agent: &Agent, root: &Path) -> u64 {
    let s = open(agent, root).await;
    let r = agent.client.call(req(s, 0, vec![data("a", b"a")])).await;
    assert_eq!(r.unwrap().applied, 1);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_fails_waiting_requests_at_once_and_keeps_committed_files() {
    let t = tempfile::tempdir().unwrap();
    let agent = Agent::start("abort").await;
    let s = open(&agent, t.path()).await;
    let kept = b"committed before the abort";
    let r = agent
        .client
        .call(req(s, 0, vec![data("kept", kept), commit("kept", kept)]))
        .await;
    assert_eq!(r.unwrap().applied, 2);
    // Waits for seq 1..=4, which never come.
    let c = agent.client.clone();
    let waiting = tokio::spawn(async move { c.call(req(s, 5, vec![data("no", b"x")])).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    agent
        .client
        .call(ApplyAbortRequest { session: s })
        .await
        .unwrap();
    let e = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the waiting request outlived the abort")
        .unwrap()
        .unwrap_err();
    assert!(e.message.contains("aborted"), "{e:?}");
    assert!(
        started.elapsed() < rsb_agent::sync::GAP_WAIT,
        "the abort, not the gap timeout, ended the wait ({:?})",
        started.elapsed()
    );
    assert_eq!(std::fs::read(t.path().join("kept")).unwrap(), kept);
    assert!(!t.path().join("no").exists());
    assert!(staging_dirs(t.path()).is_empty());
    let e = agent
        .client
        .call(ApplyAbortRequest { session: s })
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::Agent(ErrorCode::NotFound), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_belong_to_their_channel_and_end_with_it() {
    let t = tempfile::tempdir().unwrap();
    let a = Agent::tapped("channel-a").await;
    let b = Agent::start("channel-b").await;
    let s = agent_session(&a, t.path()).await;
    assert_eq!(staging_dirs(t.path()).len(), 1);

    // Same process, other channel: the session does not exist there.
    for e in [
        b.client
            .call(req(s, 1, vec![data("b", b"b")]))
            .await
            .unwrap_err(),
        b.client
            .call(ApplyAbortRequest { session: s })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(e.kind, Kind::Agent(ErrorCode::NotFound), "{e:?}");
        assert!(e.message.contains("unknown sync session"), "{e:?}");
    }
    assert_eq!(staging_dirs(t.path()).len(), 1, "b touched a's session");
    assert!(!t.path().join("b").exists());

    // Channel a ends: its session's staging goes, and nothing was committed.
    a.tap().cut();
    eventually(
        "the ended channel's staging to go",
        Duration::from_secs(10),
        || staging_dirs(t.path()).is_empty().then_some(()),
    )
    .await;
    assert!(!t.path().join("a").exists());
    // b opens its own session there, with nothing stale left to clean.
    let opened = b
        .client
        .call(ApplyOpenRequest {
            root: t.path().to_str().unwrap().into(),
            create_root: false,
            confine: None,
        })
        .await
        .unwrap();
    assert_eq!(opened.stale_cleaned, 0);
}
