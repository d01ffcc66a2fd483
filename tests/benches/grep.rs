//! `rsb grep` as a person pipes it, end to end (a fresh `rsb` process, its SSH connection and
//! the whole printed result), against `ssh host rg --no-heading -n` on the same sshd in the same
//! run (issue 42 item 4: ≤ 1.0× at every size, median of 5). The tree: 20,000 files of 20
//! lines in 200 directories, with tokens placed so that one pattern matches 50 lines, one
//! 5,000 and one 25,000. Each size's output is also checked byte for byte against rg's
//! (`--sort path`, the order rsb prints).
//!
//! Run: `cargo build --release -p rsb --bin rsb && cargo bench -p rsb-tests --bench grep`.
//! Uses `target/release/rsb` when it exists, else `target/debug/rsb` (not representative).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use rsb_tests::{Sshd, output_with_timeout, workspace_root};
use serde_json::json;

const RUNS: usize = 5;
const FILES: usize = 20_000;
const LINES: usize = 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn rsb_bin() -> (PathBuf, &'static str) {
    let release = workspace_root().join("target/release/rsb");
    if release.exists() {
        return (release, "release");
    }
    (
        workspace_root().join("target/debug/rsb"),
        "debug (NOT representative; build --release)",
    )
}

/// The tree: line `g` of the whole (file-major) holds `needle{m}` when `g` is a multiple of
/// `FILES * LINES / m`, so pattern `needle{m}\b` matches exactly `m` lines.
fn make_tree(root: &Path, sizes: &[usize]) {
    let total = FILES * LINES;
    for f in 0..FILES {
        let dir = root.join(format!("d{:03}", f / 100));
        if f % 100 == 0 {
            std::fs::create_dir_all(&dir).unwrap();
        }
        let mut text = String::with_capacity(LINES * 48);
        for j in 0..LINES {
            let g = f * LINES + j;
            text.push_str(&format!("let value_{g} = compute({j}, {f});"));
            for m in sizes {
                if g.is_multiple_of(total / m) {
                    text.push_str(&format!(" // needle{m}"));
                }
            }
            text.push('\n');
        }
        std::fs::write(dir.join(format!("f{:05}.rs", f)), text).unwrap();
    }
}

/// Milliseconds and stdout of one run.
fn timed(mut cmd: Command) -> (f64, Vec<u8>) {
    let t = Instant::now();
    let out = output_with_timeout(&mut cmd, Duration::from_secs(300)).expect("run");
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (ms, out.stdout)
}

fn main() {
    if std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && !"grep".contains(a.as_str()))
    {
        return;
    }
    if Command::new("rg").arg("--version").output().is_err() {
        println!("grep bench: rg is not installed; skipped");
        return;
    }
    let sizes = [50usize, 5_000, 25_000];
    let sshd = Sshd::start().expect("start the sshd fixture");
    let home = sshd.home().to_path_buf();
    let tree = home.join("tree");
    make_tree(&tree, &sizes);
    println!("tree: {FILES} files of {LINES} lines in 200 directories");
    let _ = Command::new("rg")
        .args(["-c", "zzzz_warm"])
        .arg(&tree)
        .output();

    let (bin, kind) = rsb_bin();
    println!("rsb binary: {} [{kind}]", bin.display());
    let state = tempfile::tempdir().unwrap();
    let list = json!([{
        "name": "bench", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(),
    }]);
    let rsb = |args: &[&str]| {
        let mut c = Command::new(&bin);
        c.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", state.path())
            .env("RSB_STATE_DIR", state.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", list.to_string());
        c
    };
    // Deploy the agent and accept the host key before timing.
    let (_, _) = timed(rsb(&["exec", "true"]));

    let mut worst: f64 = 0.0;
    for m in sizes {
        let pattern = format!("needle{m}\\b");
        let mut rsb_ms = Vec::new();
        let mut rg_ms = Vec::new();
        let mut out = Vec::new();
        let mut count_ms = Vec::new();
        for _ in 0..RUNS {
            count_ms.push(timed(rsb(&["grep", "-c", &pattern, "tree"])).0);
            let (ms, o) = timed(rsb(&["grep", "-n", &pattern, "tree"]));
            rsb_ms.push(ms);
            out = o;
            let remote = format!(
                "cd {} && rg --no-heading -n '{pattern}' tree",
                home.display()
            );
            let (ms, _) = timed(sshd.ssh_command(&remote));
            rg_ms.push(ms);
        }
        let sorted = format!(
            "cd {} && rg --no-heading -n --sort path '{pattern}' tree",
            home.display()
        );
        let (_, want) = timed(sshd.ssh_command(&sorted));
        let lines = out.iter().filter(|b| **b == b'\n').count();
        assert_eq!(lines, m, "rsb grep printed {lines} lines, not {m}");
        let same = out == want;
        let (r, s, c) = (median(rsb_ms), median(rg_ms), median(count_ms));
        println!(
            "{m:>6} matching lines: rsb grep {r:>7.1} ms (-c {c:.1} ms) | ssh rg {s:>7.1} ms | ratio {:.2}x | output identical to rg --sort path: {same}",
            r / s
        );
        assert!(same, "rsb grep's output differs from rg's");
        worst = worst.max(r / s);
    }
    println!(
        "target rsb grep <= 1.0x ssh rg at every size: worst {worst:.2}x {}",
        if worst <= 1.0 { "MET" } else { "MISSED" }
    );
}
