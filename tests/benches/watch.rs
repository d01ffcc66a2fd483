//! `rsb sync --watch` save-to-remote latency: one file of a 300-file project saved (editor
//! style: write + rename), timed until the new bytes are readable in the sandbox, on loopback
//! and through the chaos proxy at 20 ms RTT. Target: ≤ 1 RTT + 50 ms debounce (a closed,
//! renamed-into-place save ends its burst after the 20 ms settle time instead). The
//! reference is what a hand-rolled `rsync -a -e ssh` loop pays per save on the same sshd and
//! link (its own connect included, as such a loop does), in the same run.
//!
//! Each save should take the one-request fast path; the `fast` column counts those that did.
//!
//! `RSB_WATCH_BENCH_N` edits per link (default 30). Uses `target/release/rsb` when built
//! (and its sibling `target/release/rsb-agent` as the local agent: build both).

#[path = "../tests/common/forward.rs"]
mod fwd;

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use fwd::{RsbEnv, entry, rsb_bin_release_if_built};
use rsb_tests::{ChaosProxy, Sshd};
use serde_json::Value;

fn pct(v: &[Duration], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

fn save(p: &Path, data: &[u8]) {
    let tmp = p.with_extension("swp~");
    std::fs::write(&tmp, data).unwrap();
    std::fs::rename(&tmp, p).unwrap();
}

struct Watch {
    child: Child,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl Watch {
    fn spawn(env: &RsbEnv, local: &Path, remote: &str) -> Watch {
        let mut child = env
            .command()
            .args(["--json", "sync", "--watch"])
            // Its contents (rsync's trailing slash), as the mirror of `remote`.
            .arg(format!("{}/", local.display()))
            .arg(format!("s:{remote}"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let l2 = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    l2.lock().unwrap().push(v);
                }
            }
        });
        let w = Watch { child, lines };
        let deadline = Instant::now() + Duration::from_secs(120);
        while !w
            .lines
            .lock()
            .unwrap()
            .iter()
            .any(|v| v["event"] == "synced")
        {
            assert!(Instant::now() < deadline, "no initial sync within 120 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        w
    }

    /// Burst syncs that took the fast path.
    fn fast(&self) -> usize {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter(|v| v["event"] == "synced" && v["path"] == "fast")
            .count()
    }

    /// The engine's own time for each burst sync (ms).
    fn burst_ms(&self) -> Vec<Duration> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter(|v| v["event"] == "synced" && v["burst"].as_u64() > Some(0))
            .filter_map(|v| v["ms"].as_f64())
            .map(|ms| Duration::from_secs_f64(ms / 1000.0))
            .collect()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rsync(sshd: &Sshd, port: u16, src: &Path, dst: &str) -> Duration {
    sshd.rsync(
        &["-a"],
        Some(port),
        &format!("{}/", src.display()),
        &sshd.rsync_remote(dst),
    )
}

fn main() {
    let n: usize = std::env::var("RSB_WATCH_BENCH_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let sshd = Sshd::start().unwrap();
    let proxy = ChaosProxy::start(sshd.addr()).unwrap();
    proxy.set_delay(Duration::from_millis(10));
    let local = tempfile::tempdir().unwrap();
    for d in 0..10 {
        for f in 0..30 {
            let p = local.path().join(format!("pkg{d}/mod{f}.py"));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, format!("# {d} {f}\n").repeat(40)).unwrap();
        }
    }
    let has_rsync = Command::new("rsync").arg("--version").output().is_ok();
    if !has_rsync {
        eprintln!("rsync is not installed: no reference column");
    }

    println!("rsb sync --watch save-to-remote latency ({n} edits per link, 300-file tree)");
    println!(
        "| link | p50 (ms) | p99 (ms) | sync p50 (ms) | fast | rsync -a per save p50 (ms) | p50 / rsync | target (ms) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, port, rtt_ms) in [
        ("loopback", sshd.port(), 0.0),
        ("20 ms RTT", proxy.port(), 20.0),
    ] {
        let mut env = RsbEnv::new(&[entry("s", &sshd, port)]);
        env.bin = rsb_bin_release_if_built();
        let remote_rel = format!("bench-{port}");
        let w = Watch::spawn(&env, local.path(), &remote_rel);
        let remote = sshd.home().join(&remote_rel);
        let mut lat = Vec::new();
        for i in 0..n {
            let rel = format!("pkg{}/mod{}.py", i % 10, i % 30);
            let body = format!("# edit {i} on {name}\n").repeat(40).into_bytes();
            let t = Instant::now();
            save(&local.path().join(&rel), &body);
            let deadline = t + Duration::from_secs(30);
            while std::fs::read(remote.join(&rel)).ok().as_deref() != Some(&body[..]) {
                assert!(Instant::now() < deadline, "edit {i} never arrived");
                std::thread::sleep(Duration::from_micros(500));
            }
            lat.push(t.elapsed());
            // Let the burst close so each edit is its own burst.
            std::thread::sleep(Duration::from_millis(150));
        }
        let sync_p50 = {
            let b = w.burst_ms();
            if b.is_empty() { f64::NAN } else { pct(&b, 0.5) }
        };
        let (rs, ratio) = if has_rsync {
            let rs: Vec<_> = (0..5)
                .map(|_| rsync(&sshd, port, local.path(), &format!("rsync-{port}")))
                .collect();
            let r = pct(&rs, 0.5);
            (format!("{r:.1}"), format!("{:.2}x", pct(&lat, 0.5) / r))
        } else {
            ("-".into(), "-".into())
        };
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {}/{n} | {rs} | {ratio} | ≤ {:.0} |",
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            sync_p50,
            w.fast(),
            rtt_ms + 50.0
        );
        drop(w);
    }
}
