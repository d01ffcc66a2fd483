//! Forwarded HTTP through `rsb forward` versus `ssh -N -L` on the same private sshd, in the same
//! run: 100 MiB download throughput and small-request latency (a new TCP connection, so a new
//! forwarded channel, per request), medians of several interleaved runs, printed as ratios.
//! The HTTP server is Python's `http.server` in the sandbox; a row without any forward shows
//! what it can do on its own. Asserts nothing.
//!
//! Run: `cargo build --release -p rsb --bin rsb && cargo bench -p rsb-tests --bench forward`
//! (build the agents first with `scripts/build-agents.sh`; rsb embeds them). Needs python3.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/forward.rs"]
mod fwd;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use common::gen_bytes;
use fwd::*;
use rsb_tests::Sshd;

const MIB: usize = 1024 * 1024;
const BIG_MIB: usize = 100;
const THROUGHPUT_RUNS: usize = 5;
const LATENCY_ROUNDS: usize = 6;
const LATENCY_PER_ROUND: usize = 50;

async fn download(addr: SocketAddr) -> Duration {
    let t = Instant::now();
    let (code, len) = http_get_with(addr, "/big.bin", Duration::from_secs(300), |_| {})
        .await
        .unwrap();
    assert_eq!((code, len), (200, (BIG_MIB * MIB) as u64));
    t.elapsed()
}

async fn small(addr: SocketAddr) -> Duration {
    let t = Instant::now();
    let (code, body) = http_get(addr, "/small.txt").await.unwrap();
    assert_eq!((code, body.len()), (200, 1024));
    t.elapsed()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !python3() {
        eprintln!("SKIP forward bench: python3 is not installed (it serves HTTP in the sandbox)");
        return;
    }
    let sshd = Sshd::start().unwrap();
    let www = sshd.home().join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("big.bin"), gen_bytes(9, BIG_MIB * MIB)).unwrap();
    std::fs::write(www.join("small.txt"), vec![b'x'; 1024]).unwrap();

    let mut env = RsbEnv::new(&[entry("s", &sshd, sshd.port())]);
    env.bin = rsb_bin_release_if_built();
    println!("rsb: {}", env.bin.display());
    let (http, port) = http_server(&env, "s", &www);
    let rsb = RsbForward::spawn(&env, &[&format!("s:{port}"), "0"]);
    let ssh_port = free_port();
    let _ssh = SshForward::spawn(&sshd, ssh_port, port);
    let paths: [(&str, SocketAddr); 3] = [
        ("rsb forward", rsb.addr),
        ("ssh -L", SocketAddr::from(([127, 0, 0, 1], ssh_port))),
        (
            "direct (no forward)",
            SocketAddr::from(([127, 0, 0, 1], port)),
        ),
    ];

    // Warm every path (the first channel, page cache for the file).
    for (_, a) in paths {
        download(a).await;
        for _ in 0..10 {
            small(a).await;
        }
    }

    let mut secs = vec![Vec::new(); paths.len()];
    for _ in 0..THROUGHPUT_RUNS {
        for (i, (_, a)) in paths.iter().enumerate() {
            secs[i].push(download(*a).await.as_secs_f64());
        }
    }
    let mut lat = vec![Vec::new(); paths.len()];
    for _ in 0..LATENCY_ROUNDS {
        for (i, (_, a)) in paths.iter().enumerate() {
            for _ in 0..LATENCY_PER_ROUND {
                lat[i].push(small(*a).await.as_secs_f64() * 1000.0);
            }
        }
    }

    println!(
        "\n{BIG_MIB} MiB download, median of {THROUGHPUT_RUNS}; 1 KiB GET on a new connection, {} requests",
        LATENCY_ROUNDS * LATENCY_PER_ROUND
    );
    let mibs: Vec<f64> = secs
        .iter()
        .map(|s| BIG_MIB as f64 / median(s.clone()))
        .collect();
    for (i, (name, _)) in paths.iter().enumerate() {
        println!(
            "  {name:<20} {:>7.0} MiB/s   latency p50 {:>6.2} ms  p99 {:>6.2} ms",
            mibs[i],
            median(lat[i].clone()),
            p99(lat[i].clone())
        );
    }
    println!(
        "  rsb / ssh -L:        throughput {:.2}x   latency p50 {:.2}x  p99 {:.2}x",
        mibs[0] / mibs[1],
        median(lat[0].clone()) / median(lat[1].clone()),
        p99(lat[0].clone()) / p99(lat[1].clone())
    );
    drop(rsb);
    drop(http);
}
