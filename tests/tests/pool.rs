//! The sandbox pool survives a panic in a caller: its locks cannot poison.

mod common;

use common::*;
use rsb_protocol::ExecRequest;
use rsb_tests::Sshd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_while_a_pool_lock_is_held_leaves_the_sandbox_usable() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    pool.client("s").await.expect("first connect");

    let hook = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.panic_while_locked("s")
    }));
    assert!(hook.is_err(), "the hook panics");

    // Every path that takes those locks still works: the active sandbox, the reconnect path
    // (which reads the remembered agent path), and the transfer registry of an app on it.
    assert_eq!(pool.active().as_deref(), Some("s"));
    pool.select("s").unwrap();
    sshd.kill_sessions();
    let mut req = ExecRequest::new("echo after-panic");
    req.timeout_ms = 10_000;
    let mut last = None;
    // The first call may still see the old link die; the next one reconnects.
    for _ in 0..3 {
        let r = async { pool.client("s").await?.call(req.clone()).await }.await;
        match r {
            Ok(r) => {
                last = Some(String::from_utf8_lossy(&r.stdout.head).into_owned());
                break;
            }
            Err(e) => assert!(e.is_connection_lost(), "{e:?}"),
        }
    }
    assert_eq!(last.as_deref(), Some("after-panic\n"));
    let app = rsb::app::App::on(pool.clone());
    app.transfers().await.expect("the transfer registry opens");
    app.shutdown().await;
}

/// Issue 14 scale: `list_sandboxes(check_resources=true)` over 100 sandboxes, 97 on one sshd
/// and 3 on closed ports. Every row answers; each dead one carries its own one-line error while
/// the others have numbers; the agent is uploaded at most once for the shared host, and the
/// agents share SSH connections (8 per connection at most); a repeat
/// within [`sandboxes::RESOURCES_FRESH`] is answered from the pooled samples (their age in the
/// reply), and after it from the agents again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_sandboxes_all_answer_and_dead_ones_stay_their_own() {
    use rsb::ops::sandboxes;
    use serde_json::Value;
    use std::time::{Duration, Instant};

    const LIVE: usize = 97;
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kh = dir.path().join("known_hosts");
    let closed: Vec<u16> = (0..3)
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        })
        .collect();
    let mut list: Vec<_> = (0..LIVE)
        .map(|i| {
            let mut t = target(&sshd, sshd.port(), key_auth(&sshd), &kh);
            t.connect_timeout = Duration::from_secs(20);
            sandbox(&format!("s{i:03}"), t)
        })
        .collect();
    for (i, port) in closed.iter().enumerate() {
        // Spread among the live ones, so an error cannot shift the rows after it.
        list.insert(
            i * 40 + 10,
            sandbox(
                &format!("dead{i}"),
                target(&sshd, *port, key_auth(&sshd), &kh),
            ),
        );
    }
    let pool = pool_of(list, dir.path());
    let names: Vec<String> = pool.names().to_vec();

    let check = |v: &Value| {
        let rows = v["sandboxes"].as_array().expect("sandboxes");
        assert_eq!(rows.len(), LIVE + 3);
        for (row, name) in rows.iter().zip(&names) {
            assert_eq!(row["name"], name.as_str(), "rows keep the configured order");
            if name.starts_with("dead") {
                assert_eq!(row["connection_alive"], false, "{row:#}");
                let e = row["connection_error"].as_str().unwrap_or_default();
                assert!(!e.is_empty() && !e.contains('\n'), "{row:#}");
                assert!(
                    e.contains(&format!("'{name}'")) || e.contains("refused"),
                    "{row:#}"
                );
                assert!(row["resources"]["error"].is_string(), "{row:#}");
            } else {
                assert_eq!(row["connection_alive"], true, "{row:#}");
                assert!(row["resources"]["idle_score"].is_number(), "{row:#}");
                assert!(row["resources"]["sample_age_ms"].is_u64(), "{row:#}");
            }
        }
    };
    let ages = |v: &Value| -> Vec<u64> {
        v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["resources"]["sample_age_ms"].as_u64())
            .collect()
    };

    let t0 = Instant::now();
    let cold = tokio::time::timeout(
        Duration::from_secs(120),
        sandboxes::list(&pool, sandboxes::Listing::Resources),
    )
    .await
    .expect("cold listing within 120 s");
    let cold_took = t0.elapsed();
    let cold = serde_json::to_value(cold).unwrap();
    check(&cold);
    let mut deployed = 0;
    for n in names.iter().filter(|n| !n.starts_with("dead")) {
        deployed += usize::from(pool.last_connect_deployed(n).await == Some(true));
    }
    assert!(deployed <= 1, "one upload for one host, not {deployed}");
    // 97 agents (one per sandbox) ride shared SSH connections, 8 at most on each.
    let conns = established_to(sshd.port());
    eprintln!("97 live sandboxes use {conns} SSH connections");
    assert!(
        (97usize.div_ceil(8)..40).contains(&conns),
        "connections are shared, 8 agents at most on each: {conns}"
    );

    let t1 = Instant::now();
    let warm =
        serde_json::to_value(sandboxes::list(&pool, sandboxes::Listing::Resources).await).unwrap();
    let warm_took = t1.elapsed();
    check(&warm);
    eprintln!("100 sandboxes (3 dead): cold {cold_took:?}, warm {warm_took:?}");
    // The refused ports are retried on every call and fail at once; the live rows come from
    // samples under a second old.
    assert!(
        ages(&warm).iter().all(|a| *a < 1000),
        "warm samples are fresh: {:?}",
        ages(&warm)
    );

    tokio::time::sleep(sandboxes::RESOURCES_FRESH).await;
    let again =
        serde_json::to_value(sandboxes::list(&pool, sandboxes::Listing::Resources).await).unwrap();
    check(&again);
    assert!(
        ages(&again).iter().all(|a| *a == 0),
        "older samples are fetched again: {:?}",
        ages(&again)
    );
    pool.shutdown().await;
}

/// Established TCP connections from this machine to loopback `port` (the client ends).
fn established_to(port: u16) -> usize {
    let want = format!("{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| {
            t.lines()
                .skip(1)
                .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        })
        .filter(|f| f.len() > 3 && f[3] == "01" && f[2].rsplit(':').next() == Some(want.as_str()))
        .count()
}
