//! Exec round trip on a warm agent channel versus OpenSSH's `ssh host true`, on the same
//! private sshd in the same run. Prints medians and ratios; asserts nothing.
//!
//! `cargo bench -p rsb-tests --bench exec_latency`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use rsb_protocol::{ExecRequest, PingRequest};
use rsb_tests::Sshd;

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

fn main() {
    let sshd = Sshd::start().expect("sshd");
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let pool = common::key_pool(&sshd, dir.path());
        let t0 = Instant::now();
        let c = pool.client("s").await.expect("connect");
        println!(
            "first connect (connect+auth+probe+deploy+hello): {:.1} ms",
            t0.elapsed().as_secs_f64() * 1000.0
        );
        let mut ping = Vec::new();
        let mut exec = Vec::new();
        for _ in 0..50 {
            c.call(PingRequest { payload: vec![] }).await.unwrap();
            c.call(ExecRequest::new("true")).await.unwrap();
        }
        for _ in 0..500 {
            let t = Instant::now();
            c.call(PingRequest { payload: vec![] }).await.unwrap();
            ping.push(t.elapsed());
        }
        for _ in 0..300 {
            let t = Instant::now();
            let r = c.call(ExecRequest::new("echo hi")).await.unwrap();
            exec.push(t.elapsed());
            assert_eq!(r.stdout.head, b"hi\n");
        }
        let mut ssh = Vec::new();
        for _ in 0..30 {
            let t = Instant::now();
            let o = sshd.ssh_command("true").output().unwrap();
            assert!(o.status.success());
            ssh.push(t.elapsed());
        }
        let (e50, e99) = (pct(&mut exec, 0.5), pct(&mut exec, 0.99));
        let (p50, p99) = (pct(&mut ping, 0.5), pct(&mut ping, 0.99));
        let s50 = pct(&mut ssh, 0.5);
        println!("agent ping          p50 {p50:.3} ms  p99 {p99:.3} ms  (n=500)");
        println!("agent exec echo hi  p50 {e50:.3} ms  p99 {e99:.3} ms  (n=300)");
        println!("ssh host true       p50 {s50:.3} ms               (n=30)");
        println!("ratio exec/ssh p50  {:.3}", e50 / s50);
        pool.shutdown().await;
    });
}
