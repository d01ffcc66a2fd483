//! Issue 23: the audit log. Real `rsb exec` processes against the sshd fixture append to
//! `<state dir>/audit/YYYY-MM.jsonl`; `rsb audit` reads it back.

use std::{path::PathBuf, process::Command};

use rsb_tests::{Sshd, workspace_root};
use serde_json::{Value, json};

const FAKE_SECRET: &str = "S3cr3t-pw!";

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(p.exists(), "run `cargo build --workspace --bins` first");
    p
}

fn rsb(tmp: &std::path::Path, list: &str, args: &[&str]) -> Command {
    let home = tmp.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let mut c = Command::new(rsb_bin());
    c.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("RSB_STATE_DIR", tmp.join("state"))
        .env("REMOTE_SANDBOX_LIST", list);
    c
}

#[test]
fn concurrent_appends_stay_whole_lines_and_nothing_forges_or_leaks() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let list = json!([
        {"name": "s", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
         "key_file": sshd.client_key().display().to_string()},
        // Never connected to; its password must still never reach the log.
        {"name": "other", "host": "127.0.0.1", "port": 9, "user": "nobody", "password": FAKE_SECRET},
    ])
    .to_string();
    // Ten processes at once, each command holding a newline, quotes and a JSON line that
    // would look like an entry if it were written raw, plus the configured password.
    let forged = r#"{"time":"2000-01-01T00:00:00Z","sandbox":"forged","tool":"exec_bash"}"#;
    let cmds: Vec<String> = (0..10)
        .map(|i| format!("echo 'n{i} \"q\"\n{forged}' {FAKE_SECRET} >/dev/null; exit {i}"))
        .collect();
    let children: Vec<_> = cmds
        .iter()
        .map(|c| {
            rsb(tmp.path(), &list, &["exec", "-s", "s", c])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, ch) in children.into_iter().enumerate() {
        let out = ch.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(i as i32),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let dir = tmp.path().join("state/audit");
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1);
    let path = files[0].path();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains(FAKE_SECRET), "{text}");
    let all: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("torn line {l:?}: {e}")))
        .collect();
    // Each command's start line, then its end line with the result.
    assert_eq!(all.len(), 20, "{text}");
    let (starts, lines): (Vec<Value>, Vec<Value>) =
        all.into_iter().partition(|v| v["event"] == "start");
    assert_eq!(starts.len(), 10, "{text}");
    assert!(lines.iter().all(|v| v["event"] == "end"), "{text}");
    for e in &lines {
        assert_eq!(
            starts
                .iter()
                .filter(|s| s["action_id"] == e["action_id"])
                .count(),
            1,
            "{e}"
        );
    }
    let mut codes: Vec<i64> = lines
        .iter()
        .map(|v| v["exit_code"].as_i64().unwrap())
        .collect();
    codes.sort();
    assert_eq!(codes, (0..10).collect::<Vec<_>>());
    for v in &lines {
        assert_eq!(v["sandbox"], "s", "{v}");
        assert_eq!(v["origin"], "cli", "{v}");
        assert_eq!(v["tool"], "rsb exec", "{v}");
        assert_eq!(v["user"], sshd.user(), "{v}");
        assert!(
            v["host"]
                .as_str()
                .unwrap()
                .contains(&sshd.port().to_string()),
            "{v}"
        );
        let c = v["command"].as_str().unwrap();
        assert!(c.contains(forged) && c.contains("***"), "{c}");
        assert!(v["time"].as_str().unwrap().ends_with('Z'), "{v}");
        assert!(v["duration_ms"].is_u64(), "{v}");
    }

    // `rsb audit` reads it back, filtered.
    let out = rsb(
        tmp.path(),
        &list,
        &["--json", "audit", "--since", "1h", "--grep", "n3 "],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[1]["exit_code"], 3);
    let out = rsb(tmp.path(), &list, &["-s", "other", "audit"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = rsb(tmp.path(), &list, &["audit", "--since", "2x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--since '2x' is not a duration"));

    // The ten concurrent writers chained in turn: every line but the first holds the hash of
    // the one before it, and `rsb audit verify` says so.
    let raw: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(raw[0]["prev"].is_null(), "{}", raw[0]);
    assert!(raw[1..].iter().all(|v| v["prev"].is_string()), "{text}");
    let verify = |want: i32| {
        let out = rsb(tmp.path(), &list, &["audit", "verify"])
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(want), "{said}");
        said
    };
    assert!(verify(0).contains("audit log intact: 20 lines in 1 files"));

    // One character of a line in the middle changed: the next line names it.
    let mut edited: Vec<String> = text.lines().map(str::to_string).collect();
    edited[4] = edited[4].replacen("exit", "exiT", 1);
    std::fs::write(&path, edited.join("\n") + "\n").unwrap();
    let said = verify(6);
    assert!(
        said.contains("line 6") && said.contains("line 5 before it was changed"),
        "{said}"
    );
    // A line removed: also found.
    let mut cut: Vec<&str> = text.lines().collect();
    cut.remove(7);
    std::fs::write(&path, cut.join("\n") + "\n").unwrap();
    assert!(verify(6).contains("line 8"));
    std::fs::write(&path, &text).unwrap();
    verify(0);
    let out = rsb(tmp.path(), &list, &["--json", "audit", "verify"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["lines"], 20, "{v}");

    // The chain crosses months: with these lines as last month's file, this month's first
    // line links to its last, and a change there is found from here.
    let month = path.file_stem().unwrap().to_str().unwrap().to_string();
    let (y, m): (u32, u32) = (month[..4].parse().unwrap(), month[5..].parse().unwrap());
    let before = if m == 1 {
        format!("{}-12", y - 1)
    } else {
        format!("{y}-{:02}", m - 1)
    };
    let old = dir.join(format!("{before}.jsonl"));
    std::fs::rename(&path, &old).unwrap();
    let out = rsb(tmp.path(), &list, &["exec", "-s", "s", "true"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(verify(0).contains("22 lines in 2 files"));
    let mut last: Vec<String> = text.lines().map(str::to_string).collect();
    last[19] = last[19].replacen("exit", "exiT", 1);
    std::fs::write(&old, last.join("\n") + "\n").unwrap();
    let said = verify(6);
    assert!(
        said.contains(&format!("{month}.jsonl line 1")) && said.contains("previous month"),
        "{said}"
    );
}

/// The CLI's changes are on the record as the MCP tools' are: a job started and killed, a
/// sync (its paths, the reply's numbers), and a refused sync with its error.
#[test]
fn cli_jobs_and_syncs_are_audited() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let list = json!([
        {"name": "s", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
         "key_file": sshd.client_key().display().to_string()},
    ])
    .to_string();
    let run = |args: &[&str]| {
        let out = rsb(tmp.path(), &list, args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[
        "jobs", "start", "-s", "s", "--name", "au-job", "--", "sleep 30",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = run(&["jobs", "kill", "-s", "s", "au-job", "--grace", "1"]);
    assert_eq!(code, Some(0), "{err}");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.txt"), "a\n").unwrap();
    let (code, err) = run(&["sync", &format!("{}/", src.display()), "s:au-up"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _) = run(&["sync", "/nonexistent-rsb-src", "s:au-up"]);
    assert_ne!(code, Some(0));
    assert_eq!(
        std::fs::read_to_string(sshd.home().join("au-up/a.txt")).unwrap(),
        "a\n"
    );

    let text: String = std::fs::read_dir(tmp.path().join("state/audit"))
        .unwrap()
        .flatten()
        .map(|f| std::fs::read_to_string(f.path()).unwrap())
        .collect();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |tool: &str| -> Vec<&Value> { lines.iter().filter(|l| l["tool"] == tool).collect() };
    let start = of("rsb jobs start");
    assert_eq!(start.len(), 1, "{text}");
    assert_eq!(start[0]["command"], "sleep 30");
    assert_eq!(start[0]["origin"], "cli");
    let kill = of("rsb jobs kill");
    assert_eq!(kill.len(), 1, "{text}");
    assert_eq!(kill[0]["command"], "au-job");
    assert!(kill[0]["error"].is_null(), "{text}");
    // A sync that runs a while is a start line, then an end line with its result.
    let syncs = of("rsb sync");
    assert_eq!(
        syncs.len(),
        2,
        "a refused sync before any sandbox is resolved: {text}"
    );
    assert_eq!(syncs[0]["event"], "start");
    assert_eq!(syncs[1]["event"], "end");
    assert_eq!(syncs[0]["action_id"], syncs[1]["action_id"]);
    let syncs = &syncs[1..];
    assert!(syncs[0]["error"].is_null(), "{text}");
    assert_eq!(syncs[0]["detail"]["uploaded_files"], 1, "{text}");
    assert_eq!(
        syncs[0]["command"],
        format!("{}/ -> s:au-up", src.display()),
        "{text}"
    );
}

/// Issue 50, case 6: `rsb audit` printed the `error` column raw, so a failing edit whose path
/// held a newline printed a forged row, and an OSC sequence reached the terminal. Every field
/// is escaped: one entry is one line, and no control byte is printed.
#[test]
fn a_hostile_path_in_an_error_cannot_forge_an_audit_row() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let list = json!([
        {"name": "s", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
         "key_file": sshd.client_key().display().to_string()},
    ])
    .to_string();
    let path = "missing\n2099-01-01T00:00:00Z  s  cli  rsb exec  exit 0\x1b]0;owned\x07.txt";
    let out = rsb(tmp.path(), &list, &["edit", &format!("s:{path}")])
        .env("EDITOR", "true")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = rsb(tmp.path(), &list, &["audit"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 1, "{text:?}");
    assert!(
        text.starts_with("20") && !text.contains("\n2099"),
        "{text:?}"
    );
    assert!(
        !text.trim_end_matches('\n').chars().any(|c| c.is_control()),
        "{text:?}"
    );
    assert!(
        text.contains("rsb edit") && text.contains("\\u{1b}]0;owned"),
        "{text:?}"
    );
}
