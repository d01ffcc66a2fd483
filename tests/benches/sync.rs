//! rsb sync versus `rsync -a -e ssh` on the same private sshd, in the same run. Prints a table
//! of medians and ratios; asserts nothing. rsb runs the engine directly (a pool with a warm
//! connection and a warm local agent, as inside `rsb mcp`); rsync pays its ssh connect on every
//! run, which is what a user of rsync pays. A "cold" row shows rsb with a fresh connection.
//!
//! `cargo bench -p rsb-tests --bench sync` (release; build the agents first:
//! `scripts/build-agents.sh && cargo build --release -p rsb-agent`).

#[path = "../tests/common/mod.rs"]
mod common;
use common::{gen_bytes, gen_text, small_tree};

use std::{
    path::Path,
    time::{Duration, Instant},
};

use rsb::{
    app::App,
    sync::{CancellationToken, Direction, SyncSpec},
};
use rsb_tests::{ChaosProxy, Sshd};

const MIB: usize = 1024 * 1024;

/// A source tree of text: 480 files of 2–150 KB in 40 directories plus two 3 MiB logs (the
/// large-file path), about 40 MB in all, so `rsync -a` needs several seconds at 50 Mbit/s.
fn text_tree(root: &Path) {
    for d in 0..40u64 {
        let dir = root.join(format!("src/m{d}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..12u64 {
            let i = d * 12 + f;
            let len = 2_000 + (i * 7919 % 149) as usize * 1_000;
            std::fs::write(dir.join(format!("f{f}.rs")), gen_text(i + 1, len)).unwrap();
        }
    }
    std::fs::create_dir_all(root.join("logs")).unwrap();
    for l in 0..2u64 {
        let p = root.join(format!("logs/run{l}.log"));
        std::fs::write(p, gen_text(1000 + l, 3 * MIB)).unwrap();
    }
}

/// Every file under `a` is under `b` with the same bytes (blake3), and no more files: a
/// compressed upload must land exact.
fn assert_same_tree(a: &Path, b: &Path) {
    fn files(root: &Path, dir: &Path, out: &mut Vec<(String, [u8; 32])>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                files(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.push((rel, *blake3::hash(&std::fs::read(&p).unwrap()).as_bytes()));
            }
        }
    }
    let (mut x, mut y) = (Vec::new(), Vec::new());
    files(a, a, &mut x);
    files(b, b, &mut y);
    x.sort();
    y.sort();
    assert_eq!(x.len(), y.len(), "{} vs {}", a.display(), b.display());
    assert!(x == y, "{} and {} differ", a.display(), b.display());
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
        self.sshd.rsync(&["-a"], None, src, dst)
    }

    /// rsync with `flags`, through the proxy listening on `port` when given.
    fn rsync_via(&self, flags: &[&str], port: Option<u16>, src: &str, dst: &str) -> Duration {
        self.sshd.rsync(flags, port, src, dst)
    }

    fn remote(&self, rel: &str) -> String {
        self.sshd.rsync_remote(rel)
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

async fn rsb_sync(pool: &App, dir: Direction, local: &Path, remote: &str) -> (Duration, u64) {
    let (d, r) = rsb_report(pool, dir, local, remote).await;
    (d, r.bytes_sent)
}

async fn rsb_report(
    pool: &App,
    dir: Direction,
    local: &Path,
    remote: &str,
) -> (Duration, rsb::sync::SyncReport) {
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
    (t.elapsed(), r)
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
    // `RSB_BENCH_ONLY=big` (or `small`, or `slow`: through the chaos proxy at 20 ms RTT and
    // 50 Mbit/s) runs one group of rows: the 200 MiB rows take seconds, the whole table minutes
    // on a loaded box.
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
        let pool = common::key_app(&sshd, tmp.path());
        // Warm: connect (and deploy) once, start the local agent, as a running server has.
        pool.pool().client("s").await.expect("connect");
        pool.pool().local_agent().await.expect("local agent");
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
                let p = common::key_app(&sshd, tmp.path());
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

        if only.as_deref() == Some("profile") {
            // For a profiler: one upload, then RSB_BENCH_PROFILE_N no-change resyncs.
            let n: usize = std::env::var("RSB_BENCH_PROFILE_N")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(200);
            rsb_sync(&pool, Direction::Upload, &small, "p/rsb").await;
            let mut r = Vec::new();
            for _ in 0..n {
                r.push(rsb_sync(&pool, Direction::Upload, &small, "p/rsb").await.0);
            }
            println!(
                "  {n} no-change resyncs of 2,000 files: median {:.1} ms",
                median(r) * 1000.0
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

        if group("slow") {
            slow_rows(&mut b, &sshd, tmp.path(), &small, reps).await;
        }
        if group("far") {
            far_rows(&mut b, &sshd, tmp.path(), &big, reps).await;
        }
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

/// Through the chaos proxy as a wide-area link: 10 ms each way (20 ms round trip) and
/// 50 Mbit/s each way, for rsb and for rsync alike (rsync's ssh connects through the proxy).
async fn slow_rows(b: &mut Bench<'_>, sshd: &Sshd, tmp: &Path, small: &Path, reps: usize) {
    let proxy = ChaosProxy::start(sshd.addr()).expect("proxy");
    proxy.set_latency(Duration::from_millis(10));
    proxy.set_rate_mbit(50);
    let port = Some(proxy.port());
    let pool = common::app_on(sshd, proxy.port(), &tmp.join("slow-state"));
    pool.pool().client("s").await.expect("connect");
    pool.pool().local_agent().await.expect("local agent");
    println!("through the chaos proxy: 20 ms RTT, 50 Mbit/s");

    // 2,000 small files, no change (the first upload puts them there).
    let small_s = format!("{}/", small.display());
    rsb_sync(&pool, Direction::Upload, small, "w0/rsb").await;
    b.rsync_via(&["-a"], port, &small_s, &b.remote("w0/rsync"));
    let (mut r, mut s) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let (d, bytes) = rsb_sync(&pool, Direction::Upload, small, "w0/rsb").await;
        assert_eq!(bytes, 0);
        r.push(d);
        s.push(b.rsync_via(&["-a"], port, &small_s, &b.remote("w0/rsync")));
    }
    b.row(
        "slow: 2,000-file no-change",
        median(r),
        median(s),
        "<= 0.1x",
    );

    // A compressible source tree, first upload: rsb (compression auto) vs rsync -a and -az.
    let text = tmp.join("text");
    text_tree(&text);
    let text_s = format!("{}/", text.display());
    let (mut r, mut s, mut z) = (Vec::new(), Vec::new(), Vec::new());
    let mut wire = None;
    for i in 0..reps {
        let (d, rep) = rsb_report(&pool, Direction::Upload, &text, &format!("t{i}/rsb")).await;
        assert_same_tree(&text, &sshd.home().join(format!("t{i}/rsb")));
        wire = Some((rep.bytes_sent, rep.bytes_wire));
        r.push(d);
        s.push(b.rsync_via(&["-a"], port, &text_s, &b.remote(&format!("t{i}/rsync"))));
        z.push(b.rsync_via(&["-az"], port, &text_s, &b.remote(&format!("t{i}/rsyncz"))));
    }
    if let Some((raw, w)) = wire {
        println!("  (text tree: {raw} bytes, on the wire {w:?})");
    }
    let rm = median(r);
    b.row("slow: text tree first upload", rm, median(s), "<= 0.3x");
    b.row("slow: text tree vs rsync -az", rm, median(z), "<= 0.8x");
    pool.shutdown().await;
}

/// Through the chaos proxy as a long fat link: 50 ms each way (100 ms round trip), no rate
/// limit, for rsb and rsync alike. What bounds a transfer here is how much either keeps in
/// flight, not the bandwidth: the proxy itself holds 8 MiB per direction in flight (80 MB/s).
async fn far_rows(b: &mut Bench<'_>, sshd: &Sshd, tmp: &Path, big: &Path, reps: usize) {
    let proxy = ChaosProxy::start(sshd.addr()).expect("proxy");
    proxy.set_latency(Duration::from_millis(50));
    let port = Some(proxy.port());
    let pool = common::app_on(sshd, proxy.port(), &tmp.join("far-state"));
    pool.pool().client("s").await.expect("connect");
    pool.pool().local_agent().await.expect("local agent");
    println!("through the chaos proxy: 100 ms RTT, no rate limit");
    let big_s = format!("{}/", big.display());
    let (mut r, mut s) = (Vec::new(), Vec::new());
    for i in 0..reps {
        let (d, _) = rsb_sync(&pool, Direction::Upload, big, &format!("far{i}/rsb")).await;
        assert_same_tree(big, &sshd.home().join(format!("far{i}/rsb")));
        println!("    rsb upload {:.1} s", d.as_secs_f64());
        r.push(d);
        let d = b.rsync_via(&["-a"], port, &big_s, &b.remote(&format!("far{i}/rsync")));
        println!("    rsync upload {:.1} s", d.as_secs_f64());
        s.push(d);
    }
    b.row("far: 200 MiB first upload", median(r), median(s), "<= 0.5x");
    let (mut r, mut s) = (Vec::new(), Vec::new());
    for i in 0..reps {
        let l = tmp.join(format!("fardown{i}/rsb"));
        let (d, _) = rsb_sync(&pool, Direction::Download, &l, "far0/rsb").await;
        assert_same_tree(big, &l);
        println!("    rsb download {:.1} s", d.as_secs_f64());
        r.push(d);
        let l2 = tmp.join(format!("fardown{i}/rsync"));
        std::fs::create_dir_all(&l2).unwrap();
        let d = b.rsync_via(
            &["-a"],
            port,
            &b.remote("far0/rsync"),
            &format!("{}/", l2.display()),
        );
        println!("    rsync download {:.1} s", d.as_secs_f64());
        s.push(d);
    }
    b.row(
        "far: 200 MiB first download",
        median(r),
        median(s),
        "<= 0.5x",
    );
    pool.shutdown().await;
}
