//! The client's cancel, chunk-routing and dead-link paths, checked on the wire.

use std::time::{Duration, Instant};

use rsb_protocol::{
    Chunk, ExecRequest, ExecResult, FileKind, FromAgent, ManifestRequest, PingRequest, Reply,
    Request, SyncRules, ToAgent,
};
use tokio::sync::mpsc;

use crate::harness::{Agent, eventually, group_members, read_pid};

fn exec(command: &str, env: &[(&str, &str)]) -> ExecRequest {
    let mut r = ExecRequest::new(command);
    r.env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    r.timeout_ms = 120_000;
    r
}

/// The id the client gave the exec whose environment holds `marker`.
fn exec_id(frames: &[ToAgent], marker: &str) -> Option<u64> {
    frames.iter().find_map(|f| match f {
        ToAgent::Request {
            id,
            body: Request::Exec(e),
        } if e.env.iter().any(|(_, v)| v == marker) => Some(*id),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_call_cancels_the_remote_exec_and_the_agent_confirms() {
    let t = tempfile::tempdir().unwrap();
    let pidfile = t.path().join("pid");
    let pidfile_s = pidfile.to_str().unwrap().to_string();
    let agent = Agent::tapped("cancel").await;
    let c = agent.client.clone();
    let req = exec(
        "echo $$ > \"$PIDFILE\"; sleep 60; echo not reached",
        &[("PIDFILE", &pidfile_s)],
    );
    let call = tokio::spawn(async move { c.call(req).await });
    let pgid = eventually("the command to start", Duration::from_secs(20), || {
        read_pid(&pidfile)
    })
    .await;
    assert!(!group_members(pgid).is_empty(), "the command runs");

    // Dropping the call's future is the only thing the caller does.
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());

    let tap = agent.tap();
    let id = exec_id(&tap.sent(), &pidfile_s).expect("the exec request went out");
    eventually("the client to send Cancel", Duration::from_secs(5), || {
        tap.sent()
            .iter()
            .any(|f| matches!(f, ToAgent::Cancel { id: i } if *i == id))
            .then_some(())
    })
    .await;
    let reply: ExecResult = eventually("the agent's final reply", Duration::from_secs(20), || {
        tap.received().into_iter().find_map(|f| match f {
            FromAgent::Reply {
                id: i,
                body: Reply::Exec(r),
            } if i == id => Some(r),
            _ => None,
        })
    })
    .await;
    assert!(reply.cancelled, "{reply:?}");
    assert!(!reply.timed_out, "{reply:?}");
    assert_eq!(reply.exit_code, None, "ended by a signal: {reply:?}");
    // The agent replies only after the whole group is gone.
    assert_eq!(
        group_members(pgid),
        Vec::<i32>::new(),
        "process group {pgid}"
    );

    // The channel is still good, and the abandoned reply went nowhere.
    let pong = agent
        .client
        .call(PingRequest {
            payload: b"after".to_vec(),
        })
        .await
        .unwrap();
    assert_eq!(pong, b"after");
}

async fn collect(mut rx: mpsc::Receiver<Chunk>) -> Vec<Chunk> {
    let mut v = Vec::new();
    while let Some(c) = rx.recv().await {
        v.push(c);
    }
    v
}

fn stdout_of(chunks: &[Chunk]) -> String {
    let mut out = Vec::new();
    for c in chunks {
        match c {
            Chunk::Stdout(b) => out.extend_from_slice(b),
            other => panic!("an exec stream got a foreign chunk: {other:?}"),
        }
    }
    String::from_utf8(out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_get_only_their_own_chunks() {
    let t = tempfile::tempdir().unwrap();
    for i in 0..300 {
        std::fs::write(t.path().join(format!("f{i:03}")), [i as u8]).unwrap();
    }
    let agent = Agent::tapped("routing").await;
    let c = &agent.client;
    // Slow writers, so the two streams interleave on the wire.
    let lines = "for i in $(seq 1 40); do echo \"$TAG$i\"; sleep 0.01; done";
    let mut a = exec(lines, &[("TAG", "A")]);
    a.stream = true;
    let mut b = exec(lines, &[("TAG", "B")]);
    b.stream = true;
    let manifest = ManifestRequest {
        root: t.path().to_str().unwrap().into(),
        rules: SyncRules::default(),
        hash: false,
        compress: false,
        expect: None,
        confine: None,
    };
    let (txa, rxa) = mpsc::channel(4);
    let (txb, rxb) = mpsc::channel(4);
    let (txm, rxm) = mpsc::channel(4);
    let (ra, ca, rb, cb, rm, cm) = tokio::join!(
        c.call_streaming(a, txa),
        collect(rxa),
        c.call_streaming(b, txb),
        collect(rxb),
        c.call_streaming(manifest, txm),
        collect(rxm),
    );
    let expect = |tag: &str| (1..=40).map(|i| format!("{tag}{i}\n")).collect::<String>();
    for (tag, r, chunks) in [("A", ra, ca), ("B", rb, cb)] {
        let r = r.unwrap();
        assert_eq!(r.exit_code, Some(0));
        assert_eq!(stdout_of(&chunks), expect(tag), "stream {tag}");
        assert_eq!(String::from_utf8(r.stdout.head).unwrap(), expect(tag));
    }
    let summary = rm.unwrap();
    let mut entries = Vec::new();
    for ch in cm {
        match ch {
            Chunk::Manifest(es) => entries.extend(es),
            other => panic!("the manifest stream got a foreign chunk: {other:?}"),
        }
    }
    assert_eq!(summary.entries, 300);
    assert_eq!(entries.len(), 300);
    assert_eq!(
        entries.iter().filter(|e| e.kind == FileKind::File).count(),
        300
    );

    // The test only means something if the two exec streams really interleaved.
    let tap = agent.tap();
    let sent = tap.sent();
    let ids = [
        exec_id(&sent, "A").expect("request A"),
        exec_id(&sent, "B").expect("request B"),
    ];
    let order: Vec<u64> = tap
        .received()
        .into_iter()
        .filter_map(|f| match f {
            FromAgent::Chunk { id, .. } if ids.contains(&id) => Some(id),
            _ => None,
        })
        .collect();
    let switches = order.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(
        switches >= 2,
        "the streams did not interleave ({switches} switches): {order:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_link_fails_every_pending_call_promptly_and_later_calls_fast() {
    let t = tempfile::tempdir().unwrap();
    let mut agent = Agent::tapped("deadlink").await;
    let mut pidfiles = Vec::new();
    let mut calls = Vec::new();
    for (i, stream) in [(0, false), (1, true), (2, false)] {
        let pidfile = t.path().join(format!("pid{i}"));
        let mut req = exec(
            "echo $$ > \"$PIDFILE\"; sleep 60",
            &[("PIDFILE", pidfile.to_str().unwrap())],
        );
        req.stream = stream;
        let c = agent.client.clone();
        calls.push(tokio::spawn(async move {
            if req.stream {
                let (tx, rx) = mpsc::channel(4);
                let (r, _) = tokio::join!(c.call_streaming(req, tx), collect(rx));
                r
            } else {
                c.call(req).await
            }
        }));
        pidfiles.push(pidfile);
    }
    let mut groups = Vec::new();
    for p in &pidfiles {
        groups.push(
            eventually("a command to start", Duration::from_secs(20), || {
                read_pid(p)
            })
            .await,
        );
    }

    agent.tap().cut();
    for (i, call) in calls.into_iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(5), call)
            .await
            .unwrap_or_else(|_| panic!("pending call {i} still waits after the link died"))
            .unwrap();
        let e = r.expect_err("a call on a dead link cannot succeed");
        assert!(e.is_connection_lost(), "call {i}: {e:?}");
    }
    assert!(!agent.client.is_alive());
    let started = Instant::now();
    let e = tokio::time::timeout(
        Duration::from_secs(2),
        agent.client.call(PingRequest { payload: vec![] }),
    )
    .await
    .expect("a call after the link died hangs")
    .unwrap_err();
    assert!(e.is_connection_lost(), "{e:?}");
    assert!(
        e.message.contains("agent channel closed"),
        "the first reason is kept: {e:?}"
    );
    eprintln!("a call on a dead link failed in {:?}", started.elapsed());

    // The agent saw its input end: it stops serving and kills what the calls had started.
    assert_eq!(agent.exit_status(Duration::from_secs(20)).await, 0);
    for g in groups {
        assert_eq!(group_members(g), Vec::<i32>::new(), "process group {g}");
    }
}
