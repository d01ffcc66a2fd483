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
    // (which reads the remembered agent path), and the transfer registry.
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
    pool.transfers().expect("the transfer registry opens");
    pool.shutdown().await;
}
