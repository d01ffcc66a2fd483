//! rsb sync versus `rsync -a -e ssh` on the same private sshd, in the same run. Prints a table
//! of medians and ratios; asserts nothing. rsb runs the engine directly (a pool with a warm
//! connection and a warm local agent, as inside `rsb mcp`); rsync pays its ssh connect on every
//! run, which is what a user of rsync pays. A "cold" row shows rsb with a fresh connection.
//!
//! `cargo bench -p rsb-tests --bench sync` (release; build the agents first:
//! `scripts/build-agents.sh && cargo build --release -p rsb-agent`).

#[path = "../tests/common/mod.rs"]
mod common;
use common::gen_bytes;

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use rsb::{
    pool::Pool,
    sync::{CancellationToken, Direction, SyncSpec},
};
use rsb_tests::Sshd;

const MIB: usize = 1024 * 1024;

/// 2,000 small files (30–300 bytes) in 100 nested directories.
fn small_tree(root: &Path) {
    for a in 0..10 {
        for b in 0..10 {
            let d = root.join(format!("d{a}/sub{b}"));
            std::fs::create_dir_all(&d).unwrap();
            for c in 0..20 {
                std::fs::write(
                    d.join(format!("f{c}.txt")),
                    format!("file {a} {b} {c}\n").repeat(1 + c % 20),
                )
                .unwrap();
            }
        }
    }
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64()
}

struct Bench<'a> {
    sshd: &'a Sshd,
    rows: Vec<(String, f64, f64, &'static str)>,
}

impl Bench<'_> {
    fn rsync(&self, src: &str, dst: &str) -> Duration {
        let t = Instant::now();
        let out = Command::new("rsync")
            .args(["-a", "-e", &self.sshd.rsync_ssh_arg(), src, dst])
            .output()
            .unwrap();
        let d = t.elapsed();
        assert!(
            out.status.success(),
            "rsync: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        d
    }

    fn remote(&self, rel: &str) -> String {
        format!(
            "{}@127.0.0.1:{}/",
            self.sshd.user(),
            self.sshd.home().join(rel).display()
        )
    }

    fn row(&mut self, name: &str, rsb: f64, rsync: f64, target: &'static str) {
        println!(
            "  {name:<34} rsb {:>8.1} ms   rsync {:>8.1} ms   ratio {:>5.2}x  (target {target})",
            rsb * 1000.0,
            rsync * 1000.0,
            rsb / rsync
        );
        self.rows.push((name.to_string(), rsb, rsync, target));
    }
}

async fn rsb_sync(pool: &Pool, dir: Direction, local: &Path, remote: &str) -> (Duration, u64) {
    let spec = SyncSpec {
        direction: dir,
        local_path: local.to_path_buf(),
        remote_path: remote.to_string(),
        delete_extras: false,
        rules: SyncSpec::rules(vec![]),
        dry_run: false,
    };
    let t = Instant::now();
    let r = rsb::ops::sync::run(pool, "s", &spec, None, &CancellationToken::new())
        .await
        .expect("rsb sync");
    (t.elapsed(), r.bytes_sent)
}

fn main() {
    let reps: usize = std::env::var("RSB_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    // `RSB_SYNC_FSYNC=1 cargo bench …` measures both agents with per-file fsync (the local
    // agent inherits it; the remote one gets it through sshd's SetEnv).
    let mut opts = rsb_tests::SshdOptions::default();
    if let Ok(v) = std::env::var("RSB_SYNC_FSYNC") {
        println!("RSB_SYNC_FSYNC={v} for both agents");
        opts.set_env.push(("RSB_SYNC_FSYNC".into(), v));
    }
    // `RSB_BENCH_ONLY=big` (or `small`) runs one group of rows: the 200 MiB rows take seconds,
    // the whole table minutes on a loaded box.
    let only = std::env::var("RSB_BENCH_ONLY").ok();
    let group = |g: &str| only.as_deref().is_none_or(|o| o == g);
    let sshd = Sshd::start_with(opts).expect("sshd");
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut b = Bench {
        sshd: &sshd,
        rows: Vec::new(),
    };
    let small = tmp.path().join("small");
    small_tree(&small);
    let big = tmp.path().join("big");
    std::fs::create_dir_all(&big).unwrap();
    std::fs::write(big.join("model.bin"), gen_bytes(5, 200 * MIB)).unwrap();
    let small_s = format!("{}/", small.display());
    let big_s = format!("{}/", big.display());

    rt.block_on(async {
        let pool = common::key_pool(&sshd, tmp.path());
        // Warm: connect (and deploy) once, start the local agent, as a running server has.
        pool.client("s").await.expect("connect");
        pool.local_agent().await.expect("local agent");
        println!("rsb sync vs rsync -a -e ssh (median of {reps}; same sshd, same run)");

        if group("small") {
            // 2,000 small files: first upload into fresh destinations.
            let (mut r1, mut s1) = (Vec::new(), Vec::new());
            for i in 0..reps {
                r1.push(
                    rsb_sync(&pool, Direction::Upload, &small, &format!("s{i}/rsb"))
                        .await
                        .0,
                );
                s1.push(b.rsync(&small_s, &b.remote(&format!("s{i}/rsync"))));
            }
            b.row("2,000-file first upload", median(r1), median(s1), "<= 1.0x");

            // No-change resync.
            let (mut r2, mut s2) = (Vec::new(), Vec::new());
            for _ in 0..reps.max(5) {
                let (d, bytes) = rsb_sync(&pool, Direction::Upload, &small, "s0/rsb").await;
                assert_eq!(bytes, 0);
                r2.push(d);
                s2.push(b.rsync(&small_s, &b.remote("s0/rsync")));
            }
            let rsync_nochange = median(s2);
            b.row(
                "2,000-file no-change resync",
                median(r2),
                rsync_nochange,
                "<= 0.3x",
            );

            // One file changed.
            let (mut r3, mut s3) = (Vec::new(), Vec::new());
            for i in 0..reps {
                std::fs::write(small.join("d3/sub3/f3.txt"), format!("changed {i}\n")).unwrap();
                let (d, bytes) = rsb_sync(&pool, Direction::Upload, &small, "s0/rsb").await;
                assert!(bytes > 0 && bytes < 100);
                r3.push(d);
                s3.push(b.rsync(&small_s, &b.remote("s0/rsync")));
            }
            b.row(
                "2,000-file 1-file resync",
                median(r3),
                median(s3),
                "<= 0.3x",
            );

            // Cold: a fresh pool (SSH connect + agent start) for a no-change resync.
            let mut rc = Vec::new();
            for _ in 0..reps {
                let p = common::key_pool(&sshd, tmp.path());
                let t = Instant::now();
                rsb_sync(&p, Direction::Upload, &small, "s0/rsb").await;
                rc.push(t.elapsed());
                p.shutdown().await;
            }
            b.row(
                "  (no-change, cold connect)",
                median(rc),
                rsync_nochange,
                "info",
            );
        }

        if group("big") {
            // 200 MiB: first upload (twice), then no-change.
            let (mut r4, mut s4) = (Vec::new(), Vec::new());
            for i in 0..reps {
                r4.push(
                    rsb_sync(&pool, Direction::Upload, &big, &format!("b{i}/rsb"))
                        .await
                        .0,
                );
                s4.push(b.rsync(&big_s, &b.remote(&format!("b{i}/rsync"))));
            }
            b.row("200 MiB first upload", median(r4), median(s4), "<= 1.0x");
            let (mut r5, mut s5) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                r5.push(rsb_sync(&pool, Direction::Upload, &big, "b0/rsb").await.0);
                s5.push(b.rsync(&big_s, &b.remote("b0/rsync")));
            }
            b.row(
                "200 MiB no-change resync",
                median(r5),
                median(s5),
                "<= 0.3x",
            );
        }

        if group("small") {
            // 2,000 small files: download into fresh local directories (from the rsb upload).
            let (mut r6, mut s6) = (Vec::new(), Vec::new());
            for i in 0..reps {
                let l = tmp.path().join(format!("down{i}/rsb"));
                r6.push(rsb_sync(&pool, Direction::Download, &l, "s0/rsb").await.0);
                let l2 = tmp.path().join(format!("down{i}/rsync"));
                std::fs::create_dir_all(&l2).unwrap();
                s6.push(b.rsync(&b.remote("s0/rsync"), &format!("{}/", l2.display())));
            }
            b.row(
                "2,000-file first download",
                median(r6),
                median(s6),
                "<= 1.0x",
            );
        }
        pool.shutdown().await;
    });

    println!();
    println!("| scenario | rsb (ms) | rsync (ms) | rsb/rsync | target |");
    println!("|---|---:|---:|---:|---|");
    for (n, r, s, t) in &b.rows {
        println!(
            "| {} | {:.1} | {:.1} | {:.2}x | {t} |",
            n.trim(),
            r * 1000.0,
            s * 1000.0,
            r / s
        );
    }
}
