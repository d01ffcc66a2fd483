//! The command policy's parsing cost per command (issue 39: p50 ≤ 0.2 ms), release build.
//!
//! `cargo bench -p rsb-tests --bench policy`
//!
//! Checks the 218-command everyday corpus (`local/src/policy/ordinary.txt`: builds, git, pip,
//! python, tests, sed, find) and a few long scripts against a policy with deny and ask rules,
//! as `exec_bash` does before a command runs. Prints p50, p95 and max per check; asserts only
//! that every ordinary command passes without a question (the rules are not a no-op: a rule's
//! own command is denied).

use std::time::{Duration, Instant};

use rsb::config::PolicyRules;
use rsb::policy::{Decision, Policy};

const ROUNDS: usize = 200;

/// Longer scripts, as an agent writes them: a setup with loops, functions and here-docs.
const SCRIPTS: &[&str] = &[
    "set -euo pipefail\ncd ~/proj\npython -m venv .venv && . .venv/bin/activate\n\
     pip install -r requirements.txt\nfor f in tests/test_*.py; do\n  python -m pytest \"$f\" -q || echo \"failed: $f\"\ndone\n\
     git diff --stat | tail -5",
    "build() { cargo build --release 2>&1 | tail -20; }\nbuild\nif [ -f target/release/app ]; then\n  \
     ./target/release/app --version\nfi\ncat > cfg.toml <<'EOF'\n[a]\nb = 1\nEOF\nsed -i 's/b = 1/b = 2/' cfg.toml",
    "N=$(nproc); export OMP_NUM_THREADS=$N\nwhile read -r host; do\n  echo \"$host\" | cut -d: -f1\n\
     done < hosts.txt\nfind . -name '*.log' -mtime +7 -delete\n\
     awk '{s+=$2} END {print s}' data.tsv | tee total.txt",
];

fn main() {
    let rules = PolicyRules {
        deny: vec![
            "rm -rf /*".into(),
            "rm -rf ~*".into(),
            "shutdown*".into(),
            "mkfs*".into(),
            "dd of=/dev/*".into(),
        ],
        ask: vec!["git push*".into(), "curl * | sh".into()],
        ..Default::default()
    };
    let p = Policy::new(&[&rules]);
    assert!(
        matches!(p.check("cd / && rm -rf /home"), Decision::Deny(_)),
        "the rules must be live"
    );
    let corpus: Vec<&str> = include_str!("../../local/src/policy/ordinary.txt")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    for c in corpus.iter().chain(SCRIPTS) {
        assert_eq!(p.check(c), Decision::Allow, "{c:?}");
    }

    println!("policy check, release build, {ROUNDS} rounds");
    let report = |what: &str, cmds: &[&str]| {
        let mut times: Vec<Duration> = Vec::with_capacity(cmds.len() * ROUNDS);
        for _ in 0..ROUNDS {
            for c in cmds {
                let t0 = Instant::now();
                std::hint::black_box(p.check(std::hint::black_box(c)));
                times.push(t0.elapsed());
            }
        }
        times.sort();
        let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
        println!(
            "  {what:<34} n={:<6} p50 {:.4} ms  p95 {:.4} ms  max {:.3} ms  (issue bound: p50 ≤ 0.2 ms)",
            times.len(),
            at(0.5),
            at(0.95),
            at(1.0),
        );
    };
    report(
        &format!("everyday corpus ({} commands)", corpus.len()),
        &corpus,
    );
    let lines: usize = SCRIPTS.iter().map(|s| s.lines().count()).sum();
    report(
        &format!("{} scripts ({lines} lines)", SCRIPTS.len()),
        SCRIPTS,
    );
}
