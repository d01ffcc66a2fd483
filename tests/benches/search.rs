//! `search_remote_files` on a real source tree, end to end through `rsb mcp` as a client sees
//! it, against `ssh host rg …` and `ssh host grep -rn …` on the same sshd in the same run, and
//! the agent's scan throughput against `rg` timed on the host itself (issue 24 targets: warm
//! ≤ 0.5× `ssh host rg`; throughput ≥ 0.5× rg's; a pattern matching every line keeps the reply
//! bounded).
//!
//! The tree: this machine's cargo registry sources and `/usr/include`, hard-linked into the
//! fixture's home (the same bytes, no copy), skipping what is not readable.
//!
//! Run: `cargo build --release -p rsb --bin rsb && cargo bench -p rsb-tests --bench search`.
//! Uses `target/release/rsb` when it exists, else `target/debug/rsb` (not representative).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use rmcp::{ServiceExt, model::CallToolRequestParams, transport::TokioChildProcess};
use rsb_tests::{Sshd, output_with_timeout, workspace_root};
use serde_json::{Value, json};

const RUNS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn rsb_bin() -> (PathBuf, &'static str) {
    let root = workspace_root();
    let release = root.join("target/release/rsb");
    if release.exists() {
        return (release, "release");
    }
    (
        root.join("target/debug/rsb"),
        "debug (NOT representative; build --release)",
    )
}

/// Hard-link `src` into `dst` (`cp -al`); files that cannot be linked are skipped.
fn link_tree(src: &Path, dst: &Path) {
    let status = Command::new("cp")
        .arg("-al")
        .arg(src)
        .arg(dst)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("cp");
    if !status.success() {
        println!(
            "(cp -al {} reported errors; some files skipped)",
            src.display()
        );
    }
}

fn tree_size(root: &Path) -> (u64, u64) {
    let out = Command::new("find")
        .arg(root)
        .args(["-type", "f", "-printf", "%s\n"])
        .output()
        .unwrap();
    let sizes: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();
    (sizes.len() as u64, sizes.iter().sum())
}

/// Milliseconds, and the trimmed stdout (a `wc -l` count here).
fn timed(mut cmd: Command) -> (f64, String) {
    let t = Instant::now();
    let out = output_with_timeout(&mut cmd, Duration::from_secs(300)).expect("run");
    let s = t.elapsed().as_secs_f64() * 1000.0;
    assert!(out.status.code().unwrap_or(9) <= 1, "{cmd:?}: {out:?}");
    (s, String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    if std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && !"search".contains(a.as_str()))
    {
        return;
    }
    if Command::new("rg").arg("--version").output().is_err() {
        println!("search bench: rg is not installed; skipped");
        return;
    }
    let sshd = Sshd::start().expect("start the sshd fixture");
    let home = sshd.home().to_path_buf();
    let tree = home.join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    let registry = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"))
        .join("registry/src");
    for src in [registry.as_path(), Path::new("/usr/include")] {
        if src.is_dir() {
            link_tree(src, &tree.join(src.file_name().unwrap()));
        }
    }
    let (files, bytes) = tree_size(&tree);
    println!(
        "tree: {files} files, {:.0} MB (cargo registry sources + /usr/include, hard links)",
        bytes as f64 / 1e6
    );
    // Warm the page cache the same way for everyone.
    let _ = Command::new("rg")
        .args(["-c", "zzzz_warm_zzzz"])
        .arg(&tree)
        .output();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (bin, kind) = rsb_bin();
    println!("rsb binary: {} [{kind}]", bin.display());
    let list = json!([{
        "name": "bench", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(),
    }]);
    let state = tempfile::tempdir().unwrap();
    let client = rt.block_on(async {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.arg("mcp")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", state.path())
            .env("RSB_STATE_DIR", state.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", list.to_string());
        let (transport, _) = TokioChildProcess::builder(cmd)
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn rsb mcp");
        ().serve(transport).await.expect("MCP initialize")
    });
    let search = |args: Value| -> (f64, usize, Value) {
        let Value::Object(args) = args else {
            unreachable!()
        };
        rt.block_on(async {
            let t = Instant::now();
            let r = client
                .call_tool(CallToolRequestParams::new("search_remote_files").with_arguments(args))
                .await
                .expect("search_remote_files");
            let s = t.elapsed().as_secs_f64() * 1000.0;
            let text = serde_json::to_value(&r).unwrap()["content"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            assert_ne!(r.is_error, Some(true), "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            (s, text.len(), v)
        })
    };
    // Connect and deploy before timing.
    search(json!({"pattern": "zzzz_warm_zzzz", "remote_path": "tree"}));

    let cases: [(&str, &str, bool); 3] = [
        ("literal", "unsafe impl Send", true),
        ("regex", r"fn \w+_unchecked\(", false),
        ("rare", "EXDEV", true),
    ];
    println!();
    let mut ratios_rg = Vec::new();
    let mut ratios_tp = Vec::new();
    for (what, pattern, literal) in cases {
        let mut rsb_ms = Vec::new();
        let mut total = 0;
        for _ in 0..RUNS {
            let (ms, _, v) = search(json!({"pattern": pattern, "literal": literal,
                "remote_path": "tree", "head_limit": 100}));
            total = v["total"].as_u64().unwrap();
            rsb_ms.push(ms);
        }
        let fixed = if literal { "-F " } else { "" };
        // Inside single quotes the shell keeps backslashes as they are (none of the patterns
        // holds a quote).
        let remote = format!(
            "cd {} && rg -n {fixed}-e '{pattern}' tree | head -c 100000000 | wc -l",
            home.display(),
        );
        let mut ssh_rg = Vec::new();
        let mut ssh_grep = Vec::new();
        let mut local_rg = Vec::new();
        let mut rg_lines = 0;
        for _ in 0..RUNS {
            let (ms, lines) = timed(sshd.ssh_command(&remote));
            assert_eq!(lines, total.to_string(), "ssh rg found what rsb found");
            ssh_rg.push(ms);
            let g = format!(
                "cd {} && grep -rn {}-e '{}' tree | wc -l",
                home.display(),
                if literal { "-F " } else { "-E " },
                pattern.replace(r"\w", "[[:alnum:]_]")
            );
            let (ms, _) = timed(sshd.ssh_command(&g));
            ssh_grep.push(ms);
            let mut c = Command::new("rg");
            c.current_dir(&home).arg("-c").arg("--no-config");
            if literal {
                c.arg("-F");
            }
            c.arg("-e").arg(pattern).arg("tree");
            let t = Instant::now();
            let out = c.output().unwrap();
            local_rg.push(t.elapsed().as_secs_f64() * 1000.0);
            rg_lines = String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| l.rsplit(':').next()?.parse::<u64>().ok())
                .sum::<u64>();
        }
        let (r, s, g, l) = (
            median(rsb_ms),
            median(ssh_rg),
            median(ssh_grep),
            median(local_rg),
        );
        println!(
            "{what:<8} {pattern:<22} rsb mcp {r:>7.1} ms | ssh rg {s:>7.1} ms | ssh grep -rn {g:>8.1} ms | rg on host {l:>7.1} ms | matches rsb {total} rg {rg_lines}"
        );
        println!(
            "         ratio rsb/ssh-rg {:.2}x, rsb/ssh-grep {:.2}x; scan throughput rsb/rg {:.2}x",
            r / s,
            r / g,
            l / r
        );
        ratios_rg.push(r / s);
        ratios_tp.push(l / r);
    }
    // A pattern that matches every line: the reply stays bounded.
    let (ms, size, v) = search(json!({"pattern": ".", "remote_path": "tree", "head_limit": 5000}));
    println!(
        "every line ('.'): {ms:.1} ms, reply {size} B for {} of {} matching lines",
        v["shown"], v["total"]
    );
    let worst_rg = ratios_rg.iter().copied().fold(0.0, f64::max);
    let worst_tp = ratios_tp.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "target warm <= 0.5x ssh rg: worst {worst_rg:.2}x {}",
        if worst_rg <= 0.5 { "MET" } else { "MISSED" }
    );
    println!(
        "target throughput >= 0.5x rg: worst {worst_tp:.2}x {}",
        if worst_tp >= 0.5 { "MET" } else { "MISSED" }
    );
    println!(
        "target bounded reply (<= 128 KiB): {} B {}",
        size,
        if size <= 128 * 1024 { "MET" } else { "MISSED" }
    );
    rt.block_on(async {
        let _ = client.cancel().await;
    });
}
