use super::*;

/// The issue's deny list.
fn issue_policy() -> Policy {
    Policy::new(&[&PolicyRules {
        deny: vec![
            "rm -rf /*".into(),
            "shutdown*".into(),
            "mkfs*".into(),
            "dd of=/dev/*".into(),
        ],
        ask: vec![],
        ..Default::default()
    }])
}

fn rule(text: &str, cmd: &str) -> bool {
    let r = Rule::parse(text).unwrap();
    shell::commands(cmd).iter().any(|c| r.matches(c))
}

#[test]
fn rules_match_names_flags_and_arguments() {
    assert!(rule("rm -rf /*", "rm -rf /"));
    assert!(rule("rm -rf /*", "rm -fr /"));
    assert!(rule("rm -rf /*", "rm -r -f /home"));
    assert!(rule("rm -rf /*", "rm -rfv -- /"));
    assert!(rule("rm -rf /*", "/bin/rm -rf /"));
    assert!(!rule("rm -rf /*", "rm -r /"));
    assert!(!rule("rm -rf /*", "rm -rf build"));
    assert!(!rule("rm -rf /*", "rmdir -rf /"));
    assert!(rule("shutdown*", "shutdown -h now"));
    assert!(rule("mkfs*", "mkfs.ext4 /dev/sdb1"));
    assert!(rule("dd of=/dev/*", "dd if=/dev/zero of=/dev/sda bs=1M"));
    assert!(!rule("dd of=/dev/*", "dd if=/dev/zero of=disk.img"));
    assert!(rule("/usr/bin/*", "/usr/bin/python x"));
    assert!(!rule("/usr/bin/*", "python x"));
    assert!(rule(
        "git push --force*",
        "git push origin --force-with-lease"
    ));
    assert!(!rule("git push --force*", "git push origin main"));
    // Unknown words could be anything.
    assert!(rule("rm -rf /*", "rm -rf $DIR"));
    assert!(rule("rm -rf /*", "$CMD"));
    assert!(rule("shutdown*", "\"$CMD\""));
    assert!(!rule("rm -rf /*", "\"$CMD\" -la"));
}

/// The same bypass table the integration test runs end to end (`tests/tests/policy.rs`),
/// here with the decision each one must get.
const BYPASSES: &[&str] = &[
    "rm -rf /",
    "r''m -rf /",
    "\"rm\" -rf /",
    "'rm' -rf /",
    "\\rm -rf /",
    "r\\m -rf /",
    "$'\\x72m' -rf /",
    "$(echo rm) -rf /",
    "`echo rm` -rf /",
    "eval rm -rf /",
    "eval 'rm -rf /'",
    "eval \"$(echo rm -rf /)\"",
    "env rm -rf /",
    "env -i PATH=/bin rm -rf /",
    "env -S 'rm -rf /'",
    "command rm -rf /",
    "command -p rm -rf /",
    "builtin eval 'rm -rf /'",
    "exec rm -rf /",
    "nohup rm -rf / &",
    "sudo rm -rf /",
    "sudo -u root -- rm -rf /",
    "nice -n 5 rm -rf /",
    "timeout 5 rm -rf /",
    "time rm -rf /",
    "echo / | xargs rm -rf",
    "echo / | xargs -I{} rm -rf {}",
    "find / -maxdepth 0 -exec rm -rf {} \\;",
    "bash -c 'rm -rf /'",
    "sh -c \"rm -rf /\"",
    "sh -c \"bash -c 'rm -rf /'\"",
    "bash -c \"sh -c \\\"bash -c 'rm -rf /'\\\"\"",
    "bash <<< 'rm -rf /'",
    "sh <<EOF\nrm -rf /\nEOF",
    "echo 'rm -rf /' | bash",
    "ls; rm -rf /",
    "true && rm -rf /",
    "false || rm -rf /",
    "ls | rm -rf /",
    "ls\nrm -rf /",
    "(rm -rf /)",
    "{ rm -rf /; }",
    "echo $(rm -rf /)",
    "cat <(rm -rf /)",
    "alias x='rm -rf /'; x",
    "alias x=rm; x -rf /",
    "f() { rm -rf /; }; f",
    "X=rm; $X -rf /",
    "\"$X\" -rf /",
    "${X} -rf /",
    "/bin/r? -rf /",
    "{rm,-rf,/}",
    "shutdown -h now",
    "/sbin/shutdown now",
    "sudo shutdown -r now",
    "mkfs.ext4 /dev/sdb1",
    "env mkfs -t ext4 /dev/sdb",
    "dd if=/dev/zero of=/dev/sda",
    "timeout 9 dd if=/dev/zero of=/dev/sda",
    "if true; then rm -rf /; fi",
    "for i in 1; do rm -rf /; done",
    "trap 'rm -rf /' EXIT",
    "watch -n 1 rm -rf /",
    "ssh localhost rm -rf /",
    "echo ${x:-$(rm -rf /)}",
    "rm -rf / ((( unbalanced",
    // Strings bash evaluates (issue 39).
    "x='a[$(rm -rf /)]'; (( x ))",
    "x='a[$(rm -rf /)]'; [[ $x -eq 0 ]]",
    "x='a[$(rm -rf /)]'; echo $((x))",
    "x='a[$(rm -rf /)]'; let x",
    "x='a[$(rm -rf /)]'; y=x; (( y + 1 ))",
    "for ((i = 0; i < 1; i++)); do (( x )); x='a[$(rm -rf /)]'; done",
    "read x; (( x ))",
    "(( $(echo 'a[$(rm -rf /)]') ))",
    "printf -v 'a[$(rm -rf /)]' 1",
    "declare 'a[$(rm -rf /)]=1'",
    "read 'a[$(rm -rf /)]' <<< 1",
    "unset 'a[$(rm -rf /)]'",
    "test -v 'a[$(rm -rf /)]'",
    "[[ -v a[$(rm -rf /)] ]]",
    "declare -n r='a[$(rm -rf /)]'; echo $r",
    "x='a[$(rm -rf /)]'; echo ${!x}",
    "x='$(rm -rf /)'; echo \"${x@P}\"",
    "PS4='$(rm -rf /)'; set -x; true",
    "hash -p /bin/rm ls; ls -rf /",
    "BASH_CMDS[ls]=/bin/rm; ls -rf /",
    "x='a[$(rm -rf /)]'; declare -i n; n=$x",
    "x='a[$(rm -rf /)]'; echo $[x]",
    "x='a[$(rm -rf /)]'; b=(1); echo ${b[x]}",
    "x='a[$(rm -rf /)]'; s=abc; echo ${s:x}",
    "f() { echo $(( $1 )); }; f 'a[$(rm -rf /)]'",
    "mapfile -C 'rm -rf /' -c 1 < /etc/hosts",
    "env BASH_ENV=/tmp/x bash -c true",
    "retry() { for i in 1 2; do \"$@\" && return; done; }; retry rm -rf /",
    "find / -name x -exec rm -rf {} +",
    // Wrapper options read right (issue 39 item 2).
    "env --split-string='rm -rf /'",
    "env --split-string 'rm -rf /'",
    "script -qc 'rm -rf /' /dev/null",
    "script -q -c 'rm -rf /' /dev/null",
    "script --command='rm -rf /' /dev/null",
    "su -lc 'rm -rf /'",
    "su - root -c 'rm -rf /'",
    "su --session-command='rm -rf /'",
    "runuser -l root -c 'rm -rf /'",
    "runuser -lc 'rm -rf /' root",
    "echo / | xargs -I{} sh -c 'rm -rf {}'",
    "echo / | xargs -i sh -c 'rm -rf {}'",
    "echo / | xargs --replace=X sh -c 'rm -rf X'",
    "parallel sh -c 'rm -rf {}' ::: /",
    "echo 'rm -rf /' | parallel",
    "echo 'rm -rf /' | su",
    "echo 'rm -rf /' | sudo -s",
    // Launchers outside the table (item 3).
    "srun rm -rf /",
    "srun -N1 -n1 rm -rf /",
    "mpirun -np 2 rm -rf /",
    "numactl -C0 rm -rf /",
    "/lib64/ld-linux-x86-64.so.2 /bin/rm -rf /",
    "systemd-run --user rm -rf /",
    "tmux new -d 'rm -rf /'",
    "screen -dm bash -c 'rm -rf /'",
    "apptainer exec img.sif rm -rf /",
    "conda run -n base rm -rf /",
    "uv run rm -rf /",
    "valgrind rm -rf /",
    "sbatch --wrap='rm -rf /'",
    // A shell reading its script from stdin (item 4).
    "{ bash; } <<< 'rm -rf /'",
    "( sh ) <<EOF\nrm -rf /\nEOF",
    "f() { bash; }; f <<< 'rm -rf /'",
    "f() { bash; }; echo 'rm -rf /' | f",
    "exec 0<<<'rm -rf /'; bash",
    "bash 3<<<'rm -rf /' 0<&3",
    "echo 'rm -rf /' | { bash; }",
    "coproc sh",
    "bash /dev/stdin <<< 'rm -rf /'",
    "timeout 5 bash <<< 'rm -rf /'",
    "ssh localhost bash <<< 'rm -rf /'",
];

/// Ordinary commands: must pass untouched.
const ORDINARY: &[&str] = &[
    "ls",
    "ls -la ~/project",
    "python train.py --epochs 10",
    "git status",
    "git log --oneline | head -20",
    "cd ~/proj && make -j8 2>&1 | tail -50",
    "ps aux | grep python | grep -v grep",
    "rm -rf build/ dist/",
    "rm -f /tmp/x.log",
    "nvidia-smi --query-gpu=utilization.gpu --format=csv",
    "find . -name '*.py' -exec wc -l {} +",
    "cat data.csv | cut -d, -f2 | sort | uniq -c | sort -rn",
    "export CUDA_VISIBLE_DEVICES=0; python -c 'import torch; print(torch.cuda.is_available())'",
    "for f in *.log; do echo \"$f\"; done",
    "timeout 60 python eval.py",
    "tar czf out.tgz results/",
    "dd if=/dev/zero of=test.img bs=1M count=10",
    "echo $(date) >> log.txt",
    "bash run.sh",
    "sudo apt-get install -y htop",
    "command -v mkfs.ext4",
    "du -sh * | sort -h",
];

#[test]
fn every_bypass_is_denied_and_ordinary_commands_pass() {
    let p = issue_policy();
    assert!(BYPASSES.len() >= 40);
    for b in BYPASSES {
        match p.check(b) {
            Decision::Deny(_) => {}
            other => panic!("not denied: {b:?} → {other:?}"),
        }
    }
    for o in ORDINARY {
        assert_eq!(p.check(o), Decision::Allow, "{o:?}");
    }
}

#[test]
fn ask_rules_and_unknown_names_ask() {
    let p = Policy::new(&[&PolicyRules {
        deny: vec!["mkfs*".into()],
        ask: vec!["git push*".into()],
        ..Default::default()
    }]);
    let Decision::Ask(f) = p.check("make && git push origin main") else {
        panic!()
    };
    assert_eq!(f.rule.as_deref(), Some("git push*"));
    assert_eq!(f.command, "git push origin main");
    // No rule can be excluded for `"$X" -la` but deny's `mkfs*` (no argument words):
    // denied; with a narrower deny list it asks.
    assert!(matches!(p.check("\"$X\" -la"), Decision::Deny(_)));
    let narrow = Policy::new(&[&PolicyRules {
        deny: vec!["rm -rf /*".into()],
        ask: vec![],
        ..Default::default()
    }]);
    let Decision::Ask(f) = narrow.check("\"$X\" -la") else {
        panic!()
    };
    assert_eq!((f.rule, f.unknown), (None, true));
    // A deny anywhere beats an earlier ask.
    assert!(matches!(
        p.check("git push; mkfs /dev/x"),
        Decision::Deny(_)
    ));
    // No rules: nothing is parsed, everything runs.
    assert_eq!(Policy::default().check("$(("), Decision::Allow);
}

#[test]
fn sandbox_rules_add_to_the_global_ones() {
    let global = PolicyRules {
        deny: vec!["shutdown*".into()],
        ask_actions: vec![Action::Kill],
        ..Default::default()
    };
    let own = PolicyRules {
        ask: vec!["git push*".into()],
        ask_actions: vec![Action::DeleteExtras],
        ..Default::default()
    };
    let p = Policy::new(&[&global, &own]);
    assert!(matches!(p.check("shutdown now"), Decision::Deny(_)));
    assert!(matches!(p.check("git push"), Decision::Ask(_)));
    assert!(p.asks(Action::Kill) && p.asks(Action::DeleteExtras));
    assert!(!p.asks(Action::Overwrite));
    // Actions alone leave commands unchecked: no parse, no ask for `$X`.
    let actions_only = Policy::new(&[&PolicyRules {
        ask_actions: vec![Action::Kill],
        ..Default::default()
    }]);
    assert_eq!(actions_only.check("$X -rf /"), Decision::Allow);
}

/// The exec path's parsing cost, measured: p50 over many ordinary commands (printed; the
/// issue's bound is 0.2 ms). Run with `--nocapture` to see it; the assertion is generous
/// (a debug build on a loaded machine), `tests/benches/policy.rs` measures the release build (0.017 ms p50).
#[test]
fn parsing_cost_is_measured() {
    let p = issue_policy();
    let mut times = Vec::new();
    for round in 0..20 {
        for c in ORDINARY {
            let t0 = std::time::Instant::now();
            let d = p.check(c);
            times.push(t0.elapsed());
            if round == 0 {
                assert_eq!(d, Decision::Allow);
            }
        }
    }
    times.sort();
    let p50 = times[times.len() / 2];
    println!(
        "policy check p50 {:.3} ms over {} checks (debug build)",
        p50.as_secs_f64() * 1e3,
        times.len()
    );
    assert!(p50 < std::time::Duration::from_millis(20), "p50 {p50:?}");
}

/// Issue 39: `sudo: true` is checked as `sudo -- bash -c '…'`: a rule naming sudo applies, and
/// the command inside is still walked, whatever quotes it holds.
#[test]
fn sudo_calls_are_checked_as_sudo() {
    assert_eq!(as_sudo("id"), "sudo -- bash -c 'id'");
    let words = |c: &str| -> Vec<String> {
        super::shell::commands(&as_sudo(c))
            .iter()
            .map(|s| s.display())
            .collect()
    };
    let w = words("echo 'it''s'; rm -rf /x");
    assert!(w.iter().any(|c| c.starts_with("sudo ")), "{w:?}");
    assert!(w.iter().any(|c| c == "rm -rf /x"), "{w:?}");
    assert!(w.iter().any(|c| c == "echo its"), "{w:?}");
}

/// Issue 39, item 5: the same path, another spelling.
#[test]
fn paths_are_matched_the_short_way_too() {
    for (r, cmd) in [
        ("dd of=/dev/*", "dd if=/dev/zero of=//dev/sda"),
        ("dd of=/dev/*", "dd of=/./dev/sda"),
        ("rm -rf /home/*", "rm -rf /tmp/../home/x"),
        ("rm -rf /home/*", "rm -rf //home//x"),
        ("rm -rf /home/*", "rm -rf /../../home/x/."),
    ] {
        assert!(rule(r, cmd), "{r} / {cmd}");
    }
    assert!(!rule("rm -rf /home/*", "rm -rf /tmp/home/x"));
    assert!(!rule("rm -rf /home/*", "rm -rf home/x"));
    assert_eq!(normalized("/a/b"), None);
    assert_eq!(normalized("of=//dev/sda").as_deref(), Some("of=/dev/sda"));
    assert_eq!(normalized("/a/../"), Some("/".into()));
    assert_eq!(normalized("/a/b/"), None);
    assert_eq!(normalized("x=y"), None);
}
#[test]
fn a_shell_reading_forwarded_stdin_counts_as_matching() {
    let p = issue_policy();
    assert!(matches!(p.check_with("bash", true), Decision::Deny(_)));
    assert!(matches!(p.check_with("sh -s", true), Decision::Deny(_)));
    assert_eq!(p.check_with("wc -l", true), Decision::Allow);
    assert_eq!(p.check("bash"), Decision::Allow);
}

/// 200-odd commands agents run every day (builds, git, pip, python, tests, sed, find, loops
/// with arithmetic): not one may be stopped or asked about.
#[test]
fn a_corpus_of_everyday_commands_passes_without_a_question() {
    let mut rules = PolicyRules {
        deny: vec![
            "rm -rf /*".into(),
            "shutdown*".into(),
            "mkfs*".into(),
            "dd of=/dev/*".into(),
        ],
        ask: vec!["git push*".into()],
        ..Default::default()
    };
    let p = Policy::new(&[&rules]);
    let corpus: Vec<&str> = include_str!("ordinary.txt").lines().collect();
    assert!(corpus.len() >= 200, "{}", corpus.len());
    let stopped: Vec<String> = corpus
        .iter()
        .filter_map(|c| match p.check(c) {
            Decision::Allow => None,
            d => Some(format!("{c:?} → {d:?}")),
        })
        .collect();
    assert!(stopped.is_empty(), "{}", stopped.join("\n"));
    // The rules are live: the same policy stops what it names.
    rules.deny.clear();
    assert!(matches!(p.check("git push --force"), Decision::Ask(_)));
    assert!(matches!(p.check("rm -rf /home"), Decision::Deny(_)));
}
