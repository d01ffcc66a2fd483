//! Issue 23, the command policy: `rsb mcp` driven by rmcp's own client against the sshd
//! fixture, with the issue's deny list in the sandbox's `policy`.
//!
//! The fixture's user may be root, so no attempt may be harmful if the guard failed: the
//! `rm -rf /*` attempts target an absolute victim directory (which the rule's `/*` matches),
//! and `shutdown`, `mkfs*` and `dd` resolve to shims first in the session's PATH that only
//! append to a marks file. Attempts that would skip PATH (`/sbin/shutdown`, `sudo shutdown`,
//! `command -p shutdown`) are in the unit table (`local/src/policy/tests.rs`) instead.
//!
//! Needs the `rsb` binary: `cargo build -p rsb --bins`.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use rmcp::{
    ClientHandler, ErrorData, RoleClient, ServiceExt,
    model::{
        CallToolRequestParams, ClientCapabilities, ClientConfig, ElicitRequestParams, ElicitResult,
        ElicitationAction, ElicitationCapability,
    },
    service::{RequestContext, RunningService},
    transport::TokioChildProcess,
};
use rsb_tests::{Sshd, SshdOptions, workspace_root};
use serde_json::{Value, json};

const DENY: [&str; 4] = ["rm -rf /*", "shutdown*", "mkfs*", "dd of=/dev/*"];

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(p.exists(), "run `cargo build -p rsb --bins` first");
    p
}

/// The fixture as sandbox `s`, with `policy` as its own.
fn sandbox_list(sshd: &Sshd, policy: &Value) -> String {
    json!([{
        "name": "s", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(),
        "policy": policy,
    }])
    .to_string()
}

/// `rsb ARGS` with no terminal, its home and state under `tmp`, the sandboxes of `list`.
fn cli(tmp: &Path, list: &str, env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    cli_command(tmp, list, env, args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

/// [`cli`] with `input` piped to rsb's stdin.
fn cli_piped(
    tmp: &Path,
    list: &str,
    env: &[(&str, &str)],
    args: &[&str],
    input: &str,
) -> std::process::Output {
    use std::io::Write;
    let mut child = cli_command(tmp, list, env, args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // rsb may refuse before reading it all: a broken pipe is part of the answer.
    let _ = stdin.write_all(input.as_bytes());
    drop(stdin);
    child.wait_with_output().unwrap()
}

fn cli_command(
    tmp: &Path,
    list: &str,
    env: &[(&str, &str)],
    args: &[&str],
) -> std::process::Command {
    let home = tmp.join("home");
    let mut c = std::process::Command::new(rsb_bin());
    c.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
        .env("RSB_STATE_DIR", tmp.join("state"))
        .env("REMOTE_SANDBOX_LIST", list)
        .envs(env.iter().copied());
    c
}

/// A client that answers elicitation with `answer` (when it declares the capability) and
/// keeps every question it was asked. With `hold` set, an answer waits until the test
/// releases it (the user thinking), and `pending` is signalled when the question arrives.
#[derive(Clone)]
struct Client {
    elicitation: bool,
    answer: Arc<Mutex<ElicitationAction>>,
    asked: Arc<Mutex<Vec<String>>>,
    hold: Arc<Mutex<Option<Arc<tokio::sync::Notify>>>>,
    pending: Arc<tokio::sync::Notify>,
}

impl ClientHandler for Client {
    fn get_info(&self) -> ClientConfig {
        let mut caps = ClientCapabilities::default();
        if self.elicitation {
            caps.elicitation = Some(ElicitationCapability::default());
        }
        let mut info = ClientConfig::default();
        info.capabilities = caps;
        info
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        if let ElicitRequestParams::FormElicitationParams { message, .. } = request {
            self.asked.lock().unwrap().push(message);
        }
        let hold = self.hold.lock().unwrap().clone();
        if let Some(h) = hold {
            self.pending.notify_one();
            h.notified().await;
        }
        Ok(ElicitResult::new(self.answer.lock().unwrap().clone()))
    }
}

struct Mcp {
    svc: RunningService<RoleClient, Client>,
    client: Client,
    tmp: tempfile::TempDir,
}

#[derive(Debug)]
struct Reply {
    is_error: bool,
    text: String,
    v: Value,
}

impl Mcp {
    async fn start(sshd: &Sshd, policy: Value, elicitation: bool) -> Mcp {
        Mcp::start_list(sandbox_list(sshd, &policy), elicitation).await
    }

    async fn start_list(list: String, elicitation: bool) -> Mcp {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("home");
        std::fs::create_dir_all(&home).unwrap();
        let stderr = std::fs::File::create(tmp.path().join("rsb-mcp.stderr")).unwrap();
        let mut cmd = tokio::process::Command::new(rsb_bin());
        cmd.arg("mcp")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("RSB_SSH_CONFIG", home.join(".ssh/config"))
            .env("RSB_STATE_DIR", tmp.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", list)
            // Every tool, forwards included, for the pair tests.
            .env("REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS", "1");
        let (transport, _) = TokioChildProcess::builder(cmd)
            .stderr(stderr)
            .spawn()
            .unwrap();
        let client = Client {
            elicitation,
            answer: Arc::new(Mutex::new(ElicitationAction::Decline)),
            asked: Default::default(),
            hold: Default::default(),
            pending: Default::default(),
        };
        let svc = tokio::time::timeout(Duration::from_secs(20), client.clone().serve(transport))
            .await
            .expect("initialize timed out")
            .expect("initialize");
        Mcp { svc, client, tmp }
    }

    async fn call(&self, tool: &str, args: Value) -> Reply {
        let Value::Object(args) = args else { panic!() };
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
        let r = tokio::time::timeout(Duration::from_secs(60), self.svc.call_tool(params))
            .await
            .unwrap_or_else(|_| panic!("{tool} did not answer in 60 s"))
            .unwrap();
        let raw = serde_json::to_value(&r).unwrap();
        let text = raw["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Reply {
            is_error: r.is_error == Some(true),
            v: serde_json::from_str(&text).unwrap_or(Value::Null),
            text,
        }
    }

    async fn exec(&self, command: &str) -> Reply {
        self.call("exec_bash", json!({"command": command, "timeout_s": 10}))
            .await
    }

    /// The audit lines that record a policy decision.
    fn decisions(&self) -> Vec<Value> {
        let dir = self.tmp.path().join("state/audit");
        let mut out = Vec::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            for l in std::fs::read_to_string(e.path()).unwrap().lines() {
                let v: Value = serde_json::from_str(l).unwrap();
                if v["detail"]["policy"].is_string() {
                    out.push(v);
                }
            }
        }
        out
    }
}

/// Shims for `shutdown`, `mkfs`, `mkfs.ext4` and `dd` that only record that they ran, in a
/// directory the fixture's sessions put first in PATH.
fn shims(dir: &Path, marks: &Path) -> String {
    for name in ["shutdown", "mkfs", "mkfs.ext4", "dd"] {
        let p = dir.join(name);
        std::fs::write(
            &p,
            format!("#!/bin/sh\necho \"$0 $*\" >> '{}'\n", marks.display()),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    format!(
        "{}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        dir.display()
    )
}

/// The bypass table: `{V}` is the victim directory (absolute, so `/*` matches it).
const BYPASSES: &[&str] = &[
    r#"rm -rf {V}"#,
    r#"r''m -rf {V}"#,
    r#""rm" -rf {V}"#,
    r#"\rm -rf {V}"#,
    r#"r\m -rf {V}"#,
    r#"$'\x72m' -rf {V}"#,
    r#"$(echo rm) -rf {V}"#,
    r#"`echo rm` -rf {V}"#,
    r#"eval rm -rf {V}"#,
    r#"eval 'rm -rf {V}'"#,
    r#"eval "$(echo rm -rf {V})""#,
    r#"env rm -rf {V}"#,
    r#"env -i rm -rf {V}"#,
    r#"command rm -rf {V}"#,
    r#"command -p rm -rf {V}"#,
    r#"echo {V} | xargs rm -rf"#,
    r#"echo {V} | xargs -I{} rm -rf {}"#,
    r#"bash -c 'rm -rf {V}'"#,
    r#"sh -c "rm -rf {V}""#,
    r#"sh -c "bash -c 'rm -rf {V}'""#,
    r#"bash -c "sh -c \"bash -c 'rm -rf {V}'\"""#,
    r#"bash <<< 'rm -rf {V}'"#,
    "sh <<'EOF'\nrm -rf {V}\nEOF",
    r#"echo 'rm -rf {V}' | bash"#,
    r#"true; rm -rf {V}"#,
    r#"true && rm -rf {V}"#,
    r#"false || rm -rf {V}"#,
    r#"echo x | rm -rf {V}"#,
    "echo start\nrm -rf {V}",
    r#"(rm -rf {V})"#,
    r#"{ rm -rf {V}; }"#,
    r#"echo $(rm -rf {V})"#,
    r#"cat <(rm -rf {V})"#,
    r#"alias x='rm -rf {V}'; x"#,
    "shopt -s expand_aliases\nalias x=rm\nx -rf {V}",
    r#"f() { rm -rf {V}; }; f"#,
    r#"X=rm; $X -rf {V}"#,
    r#"sudo rm -rf {V}"#,
    r#"nice -n 5 rm -rf {V}"#,
    r#"timeout 5 rm -rf {V}"#,
    r#"nohup rm -rf {V}"#,
    r#"exec rm -rf {V}"#,
    r#"find {V} -maxdepth 0 -exec rm -rf {} \;"#,
    r#"trap 'rm -rf {V}' EXIT"#,
    r#"/bin/r? -rf {V}"#,
    r#"shutdown -h now"#,
    r#"sh -c 'shutdown -r now'"#,
    r#"$(echo shutdown) now"#,
    r#"mkfs.ext4 /dev/sdz9"#,
    r#"env mkfs -t ext4 /dev/sdz9"#,
    r#"dd if=/dev/zero of=/dev/sdz9 count=1"#,
    r#"eval "d""d of=/dev/sdz9""#,
    // The same path, another spelling (issue 39).
    r#"dd if=/dev/zero of=//dev/sdz9 count=1"#,
    r#"dd if=/dev/zero of=/./dev/sdz9 count=1"#,
    r#"dd if=/dev/zero of=/tmp/../dev/sdz9 count=1"#,
    // Strings bash evaluates as code (issue 39): each of these ran before.
    r#"x='a[$(rm -rf {V})]'; (( x ))"#,
    r#"x='a[$(rm -rf {V})]'; [[ $x -eq 0 ]]"#,
    r#"x='a[$(rm -rf {V})]'; echo $((x))"#,
    r#"x='a[$(rm -rf {V})]'; let x"#,
    r#"x='a[$(rm -rf {V})]'; y=x; (( y + 1 ))"#,
    r#"for i in 1 2; do (( x )); x='a[$(rm -rf {V})]'; done"#,
    r#"echo 'a[$(rm -rf {V})]' > /tmp/rsb-policy-n; read n < /tmp/rsb-policy-n; (( n ))"#,
    r#"(( $(echo 'a[$(rm -rf {V})]') ))"#,
    r#"printf -v 'a[$(rm -rf {V})]' 1"#,
    r#"declare 'a[$(rm -rf {V})]=1'"#,
    r#"read 'a[$(rm -rf {V})]' <<< 1"#,
    r#"test -v 'a[$(rm -rf {V})]'"#,
    r#"declare -n r='a[$(rm -rf {V})]'; echo $r"#,
    r#"x='a[$(rm -rf {V})]'; echo ${!x}"#,
    r#"x='$(rm -rf {V})'; echo "${x@P}""#,
    r#"PS4='$(rm -rf {V})'; set -x; true"#,
    r#"hash -p /bin/rm ls; ls -rf {V}"#,
    r#"BASH_CMDS[ls]=/bin/rm; ls -rf {V}"#,
    r#"x='a[$(rm -rf {V})]'; declare -i n; n=$x"#,
    r#"x='a[$(rm -rf {V})]'; b=(1); echo ${b[x]}"#,
    r#"f() { echo $(( $1 )); }; f 'a[$(rm -rf {V})]'"#,
    r#"retry() { "$@"; }; retry rm -rf {V}"#,
    // Wrapper options read right (item 2).
    r#"env --split-string='rm -rf {V}'"#,
    r#"script -qc 'rm -rf {V}' /dev/null"#,
    r#"echo {V} | xargs -I{} sh -c 'rm -rf {}'"#,
    r#"echo {V} | xargs -i sh -c 'rm -rf {}'"#,
    // Launchers outside the table (item 3).
    r#"/lib64/ld-linux-x86-64.so.2 /bin/rm -rf {V}"#,
    r#"setpriv rm -rf {V}"#,
    r#"prlimit --nofile=1024 rm -rf {V}"#,
    r#"tmux new -d 'rm -rf {V}'"#,
    r#"sbatch --wrap='rm -rf {V}'"#,
    // A shell reading its script from stdin (item 4).
    r#"{ bash; } <<< 'rm -rf {V}'"#,
    "( sh ) <<EOF\nrm -rf {V}\nEOF",
    r#"f() { bash; }; f <<< 'rm -rf {V}'"#,
    r#"exec 0<<<'rm -rf {V}'; bash"#,
    r#"bash 3<<<'rm -rf {V}' 0<&3"#,
    r#"echo 'rm -rf {V}' | { bash; }"#,
    r#"bash /dev/stdin <<< 'rm -rf {V}'"#,
    r#"timeout 5 bash <<< 'rm -rf {V}'"#,
    r#"coproc sh; echo 'rm -rf {V}' >&${COPROC[1]}"#,
    r#"su -lc 'rm -rf {V}'"#,
    r#"runuser -l root -c 'rm -rf {V}'"#,
    r#"su --session-command='rm -rf {V}'"#,
    // The issue's launchers, installed here or not: each is refused before anything runs.
    r#"srun -N1 rm -rf {V}"#,
    r#"mpirun -np 2 rm -rf {V}"#,
    r#"numactl -C0 rm -rf {V}"#,
    r#"systemd-run --user --wait rm -rf {V}"#,
    r#"screen -dm bash -c 'rm -rf {V}'"#,
    r#"apptainer exec img.sif rm -rf {V}"#,
    r#"conda run -n base rm -rf {V}"#,
    r#"uv run rm -rf {V}"#,
    r#"valgrind rm -rf {V}"#,
    r#"parallel sh -c 'rm -rf {}' ::: {V}"#,
    // The same path, another spelling.
    r#"rm -rf /tmp/..{V}"#,
    r#"rm -rf /./{V}"#,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bypass_table_is_denied_and_nothing_ran_on_the_host() {
    let shim_dir = tempfile::tempdir().unwrap();
    let marks = shim_dir.path().join("marks");
    let path = shims(shim_dir.path(), &marks);
    let sshd = Sshd::start_with(SshdOptions {
        set_env: vec![("PATH".into(), path)],
        ..Default::default()
    })
    .unwrap();
    let victim = sshd.home().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("keep"), "x").unwrap();
    let mcp = Mcp::start(&sshd, json!({"deny": DENY}), true).await;

    // The shims and the victim are live: without the guard, these would have been hit.
    let probe = mcp
        .exec(&format!(
            "test -f {}/keep && command -v dd",
            victim.display()
        ))
        .await;
    assert!(!probe.is_error, "{}", probe.text);
    assert!(
        probe.v["stdout"]
            .as_str()
            .unwrap()
            .starts_with(&shim_dir.path().display().to_string()),
        "{}",
        probe.text
    );

    assert!(BYPASSES.len() >= 40);
    let v = victim.display().to_string();
    for b in BYPASSES {
        let cmd = b.replace("{V}", &v);
        let r = mcp.exec(&cmd).await;
        assert!(r.is_error, "not refused: {cmd:?} → {}", r.text);
        let err = r.v["error"].as_str().unwrap_or_default();
        assert!(
            err.starts_with("policy: denied by rule \""),
            "{cmd:?} → {}",
            r.text
        );
        assert!(!err.contains('\n') && r.v["hint"].is_string(), "{}", r.text);
        assert!(
            victim.join("keep").exists(),
            "{cmd:?} ran: the victim is gone"
        );
        assert!(
            !marks.exists(),
            "{cmd:?} ran: {}",
            std::fs::read_to_string(&marks).unwrap_or_default()
        );
    }
    assert!(
        mcp.client.asked.lock().unwrap().is_empty(),
        "a deny never asks"
    );
    let decisions = mcp.decisions();
    assert_eq!(decisions.len(), BYPASSES.len(), "{decisions:#?}");
    assert!(
        decisions
            .iter()
            .all(|d| d["detail"]["policy"] == "deny" && d["tool"] == "exec_bash")
    );
    assert_eq!(decisions[0]["detail"]["rule"], "rm -rf /*");

    // Ordinary commands pass untouched, pipelines included.
    for (cmd, want) in [
        ("ls -a", "."),
        ("python3 -c 'print(6*7)'", "42"),
        ("git --version && git status 2>&1 | head -1", "git version"),
        ("ls -a | grep -c . | tr -d ' '", ""),
        (
            "mkdir -p scratch && rm -rf scratch && echo removed",
            "removed",
        ),
    ] {
        let r = mcp.exec(cmd).await;
        assert!(!r.is_error, "{cmd}: {}", r.text);
        assert!(
            r.v["stdout"].as_str().unwrap_or_default().contains(want),
            "{cmd}: {}",
            r.text
        );
    }
    // The background tool is guarded the same way, its resume command too.
    let r = mcp
        .call(
            "exec_bash_background",
            json!({"command": format!("sh -c 'rm -rf {v}'")}),
        )
        .await;
    assert!(
        r.is_error && r.text.contains("policy: denied"),
        "{}",
        r.text
    );
    let r = mcp
        .call(
            "exec_bash_background",
            json!({"command": "sleep 1", "resume_command": "shutdown now"}),
        )
        .await;
    assert!(r.is_error && r.text.contains("shutdown*"), "{}", r.text);
    let r = mcp
        .call(
            "exec_bash_background",
            json!({"command": "sleep 1", "resume_plan_json": r#"{"resume_command": "mkfs.ext4 /dev/sdz9"}"#}),
        )
        .await;
    assert!(r.is_error && r.text.contains("mkfs*"), "{}", r.text);
    assert!(victim.join("keep").exists() && !marks.exists());
    let _ = mcp.svc.cancel().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_uses_elicitation_and_a_client_without_it_is_refused() {
    let sshd = Sshd::start().unwrap();
    let home = sshd.home().to_path_buf();
    let policy = json!({"ask": ["touch *"], "deny": ["rm -rf /*"]});
    let victim = home.join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    let mcp = Mcp::start(&sshd, policy.clone(), true).await;

    // Accepted: it runs, once asked.
    *mcp.client.answer.lock().unwrap() = ElicitationAction::Accept;
    let yes = home.join("approved");
    let r = mcp.exec(&format!("touch {}", yes.display())).await;
    assert!(!r.is_error, "{}", r.text);
    assert!(yes.exists());
    {
        let asked = mcp.client.asked.lock().unwrap();
        assert_eq!(asked.len(), 1);
        assert!(
            asked[0].contains("touch *") && asked[0].contains(&yes.display().to_string()),
            "{}",
            asked[0]
        );
    }

    // Declined: nothing runs, and the reply names the rule.
    *mcp.client.answer.lock().unwrap() = ElicitationAction::Decline;
    let no = home.join("declined");
    let r = mcp
        .exec(&format!("echo hi && touch {}", no.display()))
        .await;
    assert!(r.is_error, "{}", r.text);
    assert!(
        r.v["error"].as_str().unwrap().contains("declined") && r.text.contains("touch *"),
        "{}",
        r.text
    );
    assert!(!no.exists());

    // Cancelled: the same.
    *mcp.client.answer.lock().unwrap() = ElicitationAction::Cancel;
    let r = mcp.exec(&format!("touch {}", no.display())).await;
    assert!(r.is_error && r.text.contains("cancelled"), "{}", r.text);
    assert!(!no.exists());

    // A deny rule is never asked about, even with an approving client.
    *mcp.client.answer.lock().unwrap() = ElicitationAction::Accept;
    let r = mcp
        .exec(&format!("bash -c 'rm -rf {}'", victim.display()))
        .await;
    assert!(r.is_error && r.text.contains("denied"), "{}", r.text);
    assert!(victim.exists());
    assert_eq!(mcp.client.asked.lock().unwrap().len(), 3);

    let words: Vec<String> = mcp
        .decisions()
        .iter()
        .map(|d| d["detail"]["policy"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(words, ["approved", "declined", "cancelled", "deny"]);

    // The whole job is shown: every command that needs asking, each with the simple command
    // its rule matched, escaped for a terminal (an OSC 52 in a command cannot act).
    *mcp.client.answer.lock().unwrap() = ElicitationAction::Decline;
    let a = home.join("job-a");
    let b = home.join("job-b");
    let r = mcp
        .call(
            "exec_bash_background",
            json!({
                "command": format!("sleep 1; touch {}", a.display()),
                "resume_command": format!("touch {} # \u{1b}]52;c;aGk=\u{7}", b.display()),
            }),
        )
        .await;
    assert!(r.is_error && r.text.contains("declined"), "{}", r.text);
    {
        let asked = mcp.client.asked.lock().unwrap();
        let q = asked.last().unwrap();
        assert!(q.contains("before 2 of its commands"), "{q}");
        assert!(
            q.contains(&format!("command:\nsleep 1; touch {}", a.display()))
                && q.contains(&format!(
                    "(matches the ask rule \"touch *\": `touch {}`)",
                    a.display()
                )),
            "{q}"
        );
        assert!(
            q.contains("resume_command:\ntouch ") && q.contains("\\u{1b}]52;c;aGk=\\u{7}"),
            "{q}"
        );
        assert!(!q.contains('\u{1b}') && !q.contains('\u{7}'), "{q:?}");
    }
    assert!(!a.exists() && !b.exists());
    let declined = mcp
        .decisions()
        .iter()
        .filter(|d| d["detail"]["policy"] == "declined" && d["tool"] == "exec_bash_background")
        .count();
    assert_eq!(declined, 2, "one audit line per asked command");
    let _ = mcp.svc.cancel().await;

    // A client that did not declare elicitation: a clear refusal, nothing runs.
    let mcp = Mcp::start(&sshd, policy, false).await;
    let r = mcp.exec(&format!("touch {}", no.display())).await;
    assert!(r.is_error, "{}", r.text);
    let err = r.v["error"].as_str().unwrap();
    assert!(
        err.contains("needs the user's approval") && err.contains("elicitation"),
        "{err}"
    );
    assert!(
        r.v["hint"].as_str().unwrap().contains("[policy]"),
        "{}",
        r.text
    );
    assert!(!no.exists());
    assert!(mcp.client.asked.lock().unwrap().is_empty());
    assert_eq!(mcp.decisions()[0]["detail"]["policy"], "not_asked");
    let _ = mcp.svc.cancel().await;
}

/// `rsb exec` and `rsb jobs start`: a deny is exit 7 and one line; an ask with no terminal
/// is refused (exit 7) unless `--yes` approves it; every decision is an audit line.
#[test]
fn the_cli_refuses_asks_without_a_terminal_unless_told_yes() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let list = sandbox_list(&sshd, &json!({"ask": ["touch *"]}));
    let rsb = |args: &[&str]| {
        cli(
            tmp.path(),
            &list,
            &[("RSB_POLICY_DENY", r#"["rm -rf /*"]"#)],
            args,
        )
    };
    let f = sshd.home().join("cli-touched");
    let victim = sshd.home().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    let touch = format!("touch {}", f.display());

    let out = rsb(&[
        "exec",
        "-s",
        "s",
        &format!("bash -c 'rm -rf {}'", victim.display()),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(
        err.contains("policy: denied by rule \"rm -rf /*\""),
        "{err}"
    );
    assert!(victim.exists());

    let out = rsb(&["exec", "-s", "s", &touch]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(
        err.contains("needs the user's approval") && err.contains("--yes"),
        "{err}"
    );
    assert!(!f.exists());
    let out = rsb(&["jobs", "start", "-s", "s", &touch]);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!f.exists());

    let out = rsb(&["exec", "-s", "s", "--yes", &touch]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(f.exists());

    let out = rsb(&["audit", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<String> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .filter_map(|l| l["detail"]["policy"].as_str().map(str::to_string))
        .collect();
    assert_eq!(words, ["deny", "not_asked", "not_asked", "approved"]);
}

/// A shell reading its script from rsb's own stdin runs code the policy never saw: `… | rsb
/// exec sb bash` and `rsb shell sb <<< …` count as matching every rule (issue 39 item 4).
/// Without a policy, `rsb shell` runs and leaves its audit line.
#[test]
fn a_shell_fed_through_the_cli_counts_as_matching() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("home")).unwrap();
    let victim = sshd.home().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    let script = format!("rm -rf {}\n", victim.display());
    let guarded = sandbox_list(&sshd, &json!({"deny": ["rm -rf /*"]}));
    for args in [
        &["exec", "-s", "s", "bash"][..],
        &["exec", "-s", "s", "sh -s"],
        &["shell", "s"],
    ] {
        let out = cli_piped(tmp.path(), &guarded, &[], args, &script);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(7), "{args:?}: {err}");
        assert!(
            err.contains("policy: denied by rule \"rm -rf /*\"")
                && err.contains("reads its script from stdin"),
            "{args:?}: {err}"
        );
        assert!(victim.exists(), "{args:?} ran");
    }
    // A command that does not run its input as code is not affected.
    let out = cli_piped(
        tmp.path(),
        &guarded,
        &[],
        &["exec", "-s", "s", "wc -l"],
        "a\nb\n",
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "2");

    let open = sandbox_list(&sshd, &json!({}));
    let out = cli_piped(
        tmp.path(),
        &open,
        &[],
        &["shell", "s"],
        "echo from-shell; exit 3\n",
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("from-shell"));
    let out = cli(tmp.path(), &open, &[], &["audit", "--json"]);
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let shell: Vec<&Value> = lines
        .iter()
        .filter(|l| l["tool"] == "rsb shell" && l["detail"].is_null())
        .collect();
    assert_eq!(shell.len(), 2, "{lines:#?}");
    assert_eq!(shell[0]["event"], "start", "{}", shell[0]);
    assert_eq!(shell[1]["event"], "end", "{}", shell[1]);
    assert_eq!(shell[1]["exit_code"], 3, "{}", shell[1]);
    assert_eq!(
        lines
            .iter()
            .filter(|l| l["detail"]["policy"] == "deny")
            .count(),
        3,
        "{lines:#?}"
    );
}

/// `ask_actions`: a sync's `delete_extras` and `overwrite`, and `kill_background_task`, are
/// asked about with what they would destroy; a decline changes nothing; a sync with nothing
/// to destroy is not asked about; a client that cannot be asked is refused; the CLI's
/// `rsb sync --delete` and `rsb jobs kill` refuse without a terminal unless `--yes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destructive_actions_are_asked_with_what_they_would_destroy() {
    let sshd = Sshd::start().unwrap();
    let home = sshd.home().to_path_buf();
    let policy = json!({"ask_actions": ["delete_extras", "kill", "overwrite"]});
    let mcp = Mcp::start(&sshd, policy.clone(), true).await;
    let asked = || mcp.client.asked.lock().unwrap().clone();
    let answer = |a: ElicitationAction| *mcp.client.answer.lock().unwrap() = a;
    let src = mcp.tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.txt"), "a1").unwrap();
    let remote = home.join("proj");
    let up = |extra: Value| {
        let mut args = json!({"local_path": src.display().to_string(), "remote_path": "proj"});
        args.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        args
    };

    // Nothing destroyed: never asked.
    let r = mcp.call("sync_local_to_remote", up(json!({}))).await;
    assert!(!r.is_error, "{}", r.text);
    let r = mcp
        .call("sync_local_to_remote", up(json!({"delete_extras": true})))
        .await;
    assert!(!r.is_error, "{}", r.text);
    assert!(asked().is_empty(), "{:?}", asked());

    // An extra on the destination: asked, with its name; declined, it stays.
    std::fs::write(remote.join("extra.txt"), "keep me").unwrap();
    answer(ElicitationAction::Decline);
    let r = mcp
        .call("sync_local_to_remote", up(json!({"delete_extras": true})))
        .await;
    assert!(r.is_error, "{}", r.text);
    let err = r.v["error"].as_str().unwrap();
    assert!(
        err.contains("delete_extras") && err.contains("declined"),
        "{err}"
    );
    assert!(remote.join("extra.txt").exists());
    let q = asked();
    assert_eq!(q.len(), 1);
    assert!(
        q[0].contains("\n  extra.txt") && q[0].contains("would delete 1 destination entry"),
        "{}",
        q[0]
    );
    assert!(
        !q[0].contains("\n  a.txt"),
        "only what it destroys: {}",
        q[0]
    );
    // Approved, it goes.
    answer(ElicitationAction::Accept);
    let r = mcp
        .call("sync_local_to_remote", up(json!({"delete_extras": true})))
        .await;
    assert!(!r.is_error, "{}", r.text);
    assert!(!remote.join("extra.txt").exists());
    assert_eq!(r.v["deleted_files"], 1, "{}", r.text);

    // An edit on the destination since the last sync, and a local one: overwrite asks.
    std::fs::write(remote.join("a.txt"), "remote edit").unwrap();
    std::fs::write(src.join("a.txt"), "a2").unwrap();
    let r = mcp.call("sync_local_to_remote", up(json!({}))).await;
    assert_eq!(
        r.v["conflict_count"], 1,
        "a plain sync keeps it: {}",
        r.text
    );
    assert_eq!(asked().len(), 2, "a plain sync asks nothing");
    answer(ElicitationAction::Decline);
    let r = mcp
        .call("sync_local_to_remote", up(json!({"overwrite": true})))
        .await;
    assert!(r.is_error && r.text.contains("overwrite"), "{}", r.text);
    assert_eq!(
        std::fs::read_to_string(remote.join("a.txt")).unwrap(),
        "remote edit"
    );
    let q = asked();
    assert!(
        q[2].contains("would replace 1 destination file") && q[2].contains("\n  a.txt"),
        "{}",
        q[2]
    );

    // kill_background_task: declined, the job runs on; approved, it stops.
    let r = mcp
        .call(
            "exec_bash_background",
            json!({"command": "sleep 300", "session_name": "k"}),
        )
        .await;
    assert!(!r.is_error, "{}", r.text);
    let r = mcp
        .call("kill_background_task", json!({"tmux_session": "k"}))
        .await;
    assert!(r.is_error && r.text.contains("kill"), "{}", r.text);
    assert!(asked()[3].contains("'k'"), "{}", asked()[3]);
    let r = mcp
        .call("check_background_task", json!({"tmux_session": "k"}))
        .await;
    assert_eq!(r.v["state"], "running", "{}", r.text);
    answer(ElicitationAction::Accept);
    let r = mcp
        .call(
            "kill_background_task",
            json!({"tmux_session": "k", "grace_s": 0.5}),
        )
        .await;
    assert!(!r.is_error, "{}", r.text);
    assert_ne!(r.v["state"], "running", "{}", r.text);

    let decisions: Vec<(String, String)> = mcp
        .decisions()
        .iter()
        .map(|d| {
            (
                d["detail"]["action"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                d["detail"]["policy"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let want = [
        ("delete_extras", "declined"),
        ("delete_extras", "approved"),
        ("overwrite", "declined"),
        ("kill", "declined"),
        ("kill", "approved"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(decisions, want);
    let _ = mcp.svc.cancel().await;

    // A client without elicitation: refused, nothing deleted.
    std::fs::write(remote.join("extra2.txt"), "keep me").unwrap();
    let mcp2 = Mcp::start(&sshd, policy.clone(), false).await;
    let r = mcp2
        .call("sync_local_to_remote", up(json!({"delete_extras": true})))
        .await;
    assert!(r.is_error, "{}", r.text);
    assert!(
        r.v["error"]
            .as_str()
            .unwrap()
            .contains("needs the user's approval")
            && r.v["hint"].as_str().unwrap().contains("ask_actions"),
        "{}",
        r.text
    );
    assert!(remote.join("extra2.txt").exists());
    let _ = mcp2.svc.cancel().await;

    // The CLI: no terminal, no --yes: exit 7, nothing deleted or killed; --yes does it.
    let list = sandbox_list(&sshd, &policy);
    let rsb = |args: &[&str]| cli(mcp2.tmp.path(), &list, &[], args);
    let src_s = format!("{}/", src.display());
    let out = rsb(&["sync", "--delete", &src_s, "s:proj"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(err.contains("extra2.txt") || err.contains("--yes"), "{err}");
    assert!(remote.join("extra2.txt").exists());
    let out = rsb(&["sync", "--delete", "--force", "-y", &src_s, "s:proj"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!remote.join("extra2.txt").exists());
    assert_eq!(std::fs::read_to_string(remote.join("a.txt")).unwrap(), "a2");
    let out = rsb(&["jobs", "start", "-s", "s", "--name", "k2", "sleep 300"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = rsb(&["jobs", "kill", "-s", "s", "k2"]);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = rsb(&["jobs", "kill", "-s", "s", "-y", "--grace", "0.5", "k2"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 39: the exec and background tools checked the policy of the sandbox they resolved,
/// then resolved it again to run, so a `select_sandbox` while the user decided ran the
/// approved command elsewhere. Now a call resolves once: the command runs on the sandbox the
/// question named, or not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_runs_where_it_was_asked_even_after_select_sandbox() {
    let (a, b) = (Sshd::start().unwrap(), Sshd::start().unwrap());
    let policy = json!({"ask": ["touch *"]});
    let entry = |name: &str, sshd: &Sshd| {
        json!({"name": name, "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
               "key_file": sshd.client_key().display().to_string(), "policy": policy})
    };
    let list = json!([entry("a", &a), entry("b", &b)]).to_string();
    let mcp = Mcp::start_list(list, true).await;
    *mcp.client.answer.lock().unwrap() = ElicitationAction::Accept;
    for (tool, extra) in [
        ("exec_bash", json!({"timeout_s": 10})),
        ("exec_bash_background", json!({"watch": false})),
    ] {
        let r = mcp
            .call("select_sandbox", json!({"sandbox_name": "a"}))
            .await;
        assert!(!r.is_error, "{}", r.text);
        let hold = Arc::new(tokio::sync::Notify::new());
        *mcp.client.hold.lock().unwrap() = Some(hold.clone());
        let marker = format!("approved-{tool}");
        let mut args = json!({"command": format!("touch ~/{marker}")});
        args.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let call = mcp.call(tool, args);
        let switch = async {
            mcp.client.pending.notified().await;
            // The user is still deciding: the model switches the active sandbox.
            let r = mcp
                .call("select_sandbox", json!({"sandbox_name": "b"}))
                .await;
            assert!(!r.is_error, "{}", r.text);
            *mcp.client.hold.lock().unwrap() = None;
            hold.notify_one();
        };
        let (r, ()) = tokio::join!(call, switch);
        assert!(!r.is_error, "{tool}: {}", r.text);
        let asked = mcp.client.asked.lock().unwrap().last().cloned().unwrap();
        assert!(asked.contains("on sandbox 'a'"), "{asked}");
        let (on_a, on_b) = (a.home().join(&marker), b.home().join(&marker));
        let t0 = Instant::now();
        while !on_a.exists() && t0.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            on_a.exists(),
            "{tool}: the approved command did not run on a"
        );
        assert!(!on_b.exists(), "{tool}: the approved command ran on b");
    }
    let _ = mcp.svc.cancel().await;
}

/// Issue 39: `sudo: true` and `rsb exec --sudo` are checked as `sudo -- bash -c '…'`, so a
/// rule naming sudo applies (before, the policy saw only the command); the same command
/// without sudo still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sudo_calls_meet_rules_that_name_sudo() {
    let sshd = Sshd::start().unwrap();
    let policy = json!({"deny": ["sudo *"]});
    let mcp = Mcp::start(&sshd, policy.clone(), false).await;
    let marker = sshd.home().join("made-as-root");
    let cmd = format!("touch {}", marker.display());
    let r = mcp
        .call("exec_bash", json!({"command": cmd, "sudo": true}))
        .await;
    assert!(r.is_error && r.text.contains("denied"), "{}", r.text);
    assert!(r.text.contains("sudo *"), "{}", r.text);
    assert!(!marker.exists());
    let r = mcp.exec(&cmd).await;
    assert!(!r.is_error, "{}", r.text);
    assert!(marker.exists());
    std::fs::remove_file(&marker).unwrap();
    let _ = mcp.svc.cancel().await;

    let tmp = tempfile::tempdir().unwrap();
    let out = cli(
        tmp.path(),
        &sandbox_list(&sshd, &policy),
        &[],
        &["exec", "--sudo", "-s", "s", &cmd],
    );
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("sudo *"),
        "{out:?}"
    );
    assert!(!marker.exists());
}

/// The audit lines under `state/audit`, in order, without what differs by front end or by run
/// (origin, tool, times, ids, durations, host data, a started job's pid).
fn audit_shape(state: &Path) -> Vec<Value> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(state.join("audit"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        for l in std::fs::read_to_string(f).unwrap().lines() {
            let mut v: Value = serde_json::from_str(l).unwrap();
            // The run's own values: a job's pid, a sync's time, a forward's start and port.
            if let Some(d) = v["detail"].as_object_mut() {
                for k in ["pid", "duration_s", "started_at", "local_url"] {
                    d.remove(k);
                }
            }
            out.push(json!({
                "sandbox": v["sandbox"], "event": v["event"], "command": v["command"],
                "cwd": v["cwd"], "exit_code": v["exit_code"], "bytes": v["bytes"],
                "error": v["error"], "detail": v["detail"],
            }));
        }
    }
    out
}

/// One sshd, the same policy behind a real MCP client that approves when asked and behind
/// the CLI (each with its own state dir), for the pair tests of issue 45 step 4.
struct Pair {
    sshd: Sshd,
    mcp: Mcp,
    cli_tmp: tempfile::TempDir,
    list: String,
}

impl Pair {
    async fn start(policy: Value) -> Pair {
        let sshd = Sshd::start().unwrap();
        let mcp = Mcp::start(&sshd, policy.clone(), true).await;
        *mcp.client.answer.lock().unwrap() = ElicitationAction::Accept;
        let cli_tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(cli_tmp.path().join("home")).unwrap();
        let list = sandbox_list(&sshd, &policy);
        Pair {
            sshd,
            mcp,
            cli_tmp,
            list,
        }
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        cli(self.cli_tmp.path(), &self.list, &[], args)
    }

    /// The two audit logs, which must match line for line ([`audit_shape`]); one of them.
    fn same_audit(&self) -> Vec<Value> {
        let from_mcp = audit_shape(&self.mcp.tmp.path().join("state"));
        let from_cli = audit_shape(&self.cli_tmp.path().join("state"));
        assert_eq!(
            from_mcp,
            from_cli,
            "mcp:\n{}\ncli:\n{}",
            serde_json::to_string_pretty(&from_mcp).unwrap(),
            serde_json::to_string_pretty(&from_cli).unwrap()
        );
        from_mcp
    }
}

/// Issue 45 step 4: one action path. The same requests through `exec_bash` (a real MCP
/// client that approves when asked) and `rsb exec --yes` get the same policy decisions and
/// leave the same audit lines (start, end, exit code, bytes, the decision and its rule).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_bash_and_rsb_exec_decide_and_audit_a_request_alike() {
    let pair = Pair::start(json!({"ask": ["touch *"], "deny": ["rm -rf /*"]})).await;
    let home = pair.sshd.home().to_path_buf();
    let victim = home.join("victim-pair");
    std::fs::create_dir_all(&victim).unwrap();
    let requests: [(String, Option<&str>); 4] = [
        ("echo same".into(), None),
        (
            format!("touch {}", home.join("pair-touched").display()),
            None,
        ),
        (format!("bash -c 'rm -rf {}'", victim.display()), None),
        ("printf 12345; exit 3".into(), Some("/tmp")),
    ];
    for (command, cwd) in &requests {
        let mut args = json!({"command": command, "timeout_s": 10});
        if let Some(c) = cwd {
            args["cwd"] = json!(c);
        }
        let r = pair.mcp.call("exec_bash", args).await;
        let mut cli_args = vec!["exec", "-s", "s", "--yes"];
        if let Some(c) = cwd {
            cli_args.extend(["--cwd", c]);
        }
        cli_args.push(command);
        let out = pair.cli(&cli_args);
        println!(
            "{command}: mcp {} / cli exit {:?}",
            r.text,
            out.status.code()
        );
    }
    assert!(victim.exists(), "the denied command ran");
    let lines = pair.same_audit();
    let policy_words = lines.iter().filter(|l| l["detail"]["policy"].is_string());
    assert_eq!(
        policy_words.count(),
        2,
        "one approval and one denial: {lines:?}"
    );
    // Three commands ran: a start and an end line each, the last with its code and bytes.
    let ends: Vec<&Value> = lines.iter().filter(|l| l["event"] == "end").collect();
    assert_eq!(ends.len(), 3, "{lines:?}");
    assert_eq!(ends[2]["exit_code"], 3);
    assert_eq!(ends[2]["bytes"], 5);
    assert_eq!(ends[2]["cwd"], "/tmp");
    let _ = pair.mcp.svc.cancel().await;
}

/// Issue 45 step 4, the job tools: `exec_bash_background` and `rsb jobs start --yes`, and
/// `kill_background_task` and `rsb jobs kill --yes` under `ask_actions`, decide and audit the
/// same requests alike (one line each: the command, the policy's word, the reply's numbers or
/// the error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_bash_background_and_rsb_jobs_start_decide_and_audit_alike() {
    let policy = json!({"ask": ["touch *"], "deny": ["rm -rf /*"], "ask_actions": ["kill"]});
    let pair = Pair::start(policy).await;
    let home = pair.sshd.home().to_path_buf();
    let victim = home.join("victim-jobs");
    std::fs::create_dir_all(&victim).unwrap();
    let requests: [(String, Option<&str>); 3] = [
        ("sleep 0.1".into(), Some("/tmp")),
        (
            format!("touch {}", home.join("jobs-touched").display()),
            None,
        ),
        (format!("rm -rf {}", victim.display()), None),
    ];
    for (command, cwd) in &requests {
        // `rsb jobs start` registers no watch; the tool does unless told not to.
        let mut args = json!({"command": command, "watch": false});
        if let Some(c) = cwd {
            args["cwd"] = json!(c);
        }
        let r = pair.mcp.call("exec_bash_background", args).await;
        let mut cli_args = vec!["jobs", "start", "-s", "s", "--yes"];
        if let Some(c) = cwd {
            cli_args.extend(["--cwd", c]);
        }
        cli_args.push(command);
        let out = pair.cli(&cli_args);
        println!(
            "{command}: mcp {} / cli exit {:?} {}",
            r.text,
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(victim.exists(), "the denied job ran");
    // A kill under ask_actions, approved: the MCP client's job first, then the CLI's, under
    // one name (the audit records the name).
    let r = pair
        .mcp
        .call(
            "exec_bash_background",
            json!({"command": "sleep 60", "session_name": "pairjob", "watch": false}),
        )
        .await;
    assert!(!r.is_error, "{}", r.text);
    let r = pair
        .mcp
        .call(
            "kill_background_task",
            json!({"tmux_session": "pairjob", "grace_s": 1}),
        )
        .await;
    assert!(!r.is_error, "{}", r.text);
    for args in [
        &["jobs", "start", "-s", "s", "--name", "pairjob", "sleep 60"][..],
        &[
            "jobs", "kill", "-s", "s", "--yes", "--grace", "1", "pairjob",
        ],
    ] {
        let out = pair.cli(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    }
    let lines = pair.same_audit();
    // Two approvals (a command, the kill) and a denial; three jobs started, a line each.
    let words: Vec<&str> = lines
        .iter()
        .filter_map(|l| l["detail"]["policy"].as_str())
        .collect();
    assert_eq!(words, ["approved", "deny", "approved"], "{lines:?}");
    let started: Vec<&Value> = lines
        .iter()
        .filter(|l| l["detail"]["status"].is_string())
        .collect();
    assert_eq!(started.len(), 3, "{lines:?}");
    assert_eq!(started[0]["cwd"], "/tmp");
    let killed = lines.last().unwrap();
    assert_eq!(killed["command"], "pairjob", "{lines:?}");
    assert!(killed["error"].is_null(), "{lines:?}");
    let _ = pair.mcp.svc.cancel().await;
}

/// Issue 45 step 4, the sync tools: `sync_local_to_remote`/`sync_remote_to_local` and
/// `rsb sync --yes` run the same day on a fresh destination (a first upload, a `delete_extras`
/// under `ask_actions` that deletes an extra, a dry run, a download, a download of a missing
/// path) and leave the same lines: the approval with what it destroys, a start and an end per
/// sync with the same command and the reply's numbers or the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_tools_and_rsb_sync_decide_and_audit_alike() {
    let pair = Pair::start(json!({"ask_actions": ["delete_extras", "overwrite"]})).await;
    let remote = pair.sshd.home().join("pair-sync");
    let work = tempfile::tempdir().unwrap();
    let src = format!("{}/", work.path().join("src").display());
    let down = work.path().join("down").display().to_string();
    std::fs::create_dir_all(work.path().join("src/sub")).unwrap();
    std::fs::write(work.path().join("src/a.txt"), "a1").unwrap();
    std::fs::write(work.path().join("src/sub/b.txt"), "b22").unwrap();
    for front in ["mcp", "cli"] {
        let _ = std::fs::remove_dir_all(&remote);
        let _ = std::fs::remove_dir_all(&down);
        for step in 0..5 {
            if step == 1 {
                std::fs::write(remote.join("extra.txt"), "extra").unwrap();
            }
            let (tool, args, cli_args): (&str, Value, Vec<&str>) = match step {
                0 => (
                    "sync_local_to_remote",
                    json!({"local_path": src, "remote_path": "pair-sync"}),
                    vec![&src, "s:pair-sync"],
                ),
                1 => (
                    "sync_local_to_remote",
                    json!({"local_path": src, "remote_path": "pair-sync", "delete_extras": true}),
                    vec!["--delete", &src, "s:pair-sync"],
                ),
                2 => (
                    "sync_local_to_remote",
                    json!({"local_path": src, "remote_path": "pair-sync", "dry_run": true}),
                    vec!["-n", &src, "s:pair-sync"],
                ),
                3 => (
                    "sync_remote_to_local",
                    json!({"remote_path": "pair-sync/", "local_path": down}),
                    vec!["s:pair-sync/", &down],
                ),
                _ => (
                    "sync_remote_to_local",
                    json!({"remote_path": "pair-missing/", "local_path": down}),
                    vec!["s:pair-missing/", &down],
                ),
            };
            let ok = if front == "mcp" {
                let r = pair.mcp.call(tool, args).await;
                println!("{step} mcp: {}", r.text);
                !r.is_error
            } else {
                let mut full = vec!["sync", "--yes"];
                full.extend(cli_args);
                let out = pair.cli(&full);
                println!(
                    "{step} cli: {} {}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                out.status.success()
            };
            assert_eq!(ok, step < 4, "{front} step {step}");
        }
        assert!(
            !remote.join("extra.txt").exists(),
            "{front}: approved delete"
        );
        assert_eq!(
            std::fs::read_to_string(Path::new(&down).join("sub/b.txt")).unwrap(),
            "b22"
        );
    }
    let lines = pair.same_audit();
    let words: Vec<&str> = lines
        .iter()
        .filter_map(|l| l["detail"]["policy"].as_str())
        .collect();
    assert_eq!(words, ["approved"], "{lines:#?}");
    let ends: Vec<&Value> = lines.iter().filter(|l| l["event"] == "end").collect();
    assert_eq!(ends.len(), 5, "{lines:#?}");
    assert_eq!(ends[0]["detail"]["uploaded_files"], 2, "{lines:#?}");
    assert_eq!(ends[1]["detail"]["deleted_files"], 1, "{lines:#?}");
    assert_eq!(ends[2]["detail"]["dry_run"], true, "{lines:#?}");
    assert_eq!(ends[3]["detail"]["downloaded_files"], 2, "{lines:#?}");
    assert!(ends[4]["error"].is_string(), "{lines:#?}");
    let _ = pair.mcp.svc.cancel().await;
}

/// Issue 45 step 4, forwards and edits: `forward_port` and `rsb forward` leave the same start
/// line (the target, the reply's numbers), `stop_forward` and `rsb forward --stop` the same
/// refusal of an unknown id, and `write_remote_file` and `rsb edit` each one line naming the
/// path and what was written, never the content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_and_edits_decide_and_audit_alike() {
    let pair = Pair::start(json!({})).await;
    let r = pair
        .mcp
        .call("forward_port", json!({"remote_port": 9}))
        .await;
    assert!(!r.is_error, "{}", r.text);
    let cli_tmp = pair.cli_tmp.path().to_path_buf();
    let mut child = cli_command(&cli_tmp, &pair.list, &[], &["forward", "--json", "s:9"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut line = String::new();
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let first = rx.recv_timeout(Duration::from_secs(30));
    let _ = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let first = first.expect("rsb forward printed nothing in 30 s");
    assert!(first.contains("\"listening\""), "{first}");
    // An id nobody has: both refuse it, and say so on the record.
    let r = pair
        .mcp
        .call("stop_forward", json!({"forward_id": 1_234_567}))
        .await;
    assert!(r.is_error, "{}", r.text);
    let out = pair.cli(&["forward", "--stop", "1234567"]);
    assert_ne!(out.status.code(), Some(0));
    let lines = pair.same_audit();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert_eq!(lines[0]["command"], "localhost:9", "{lines:#?}");
    assert_eq!(lines[0]["detail"]["forward_id"], 1, "{lines:#?}");
    assert!(lines[0]["error"].is_null(), "{lines:#?}");
    assert_eq!(lines[1]["command"], "forward 1234567", "{lines:#?}");
    assert!(lines[1]["error"].is_string(), "{lines:#?}");

    // A write and an edit: the path, the bytes written, never the content.
    let body = "pair-written-5Tq\n";
    let r = pair
        .mcp
        .call(
            "write_remote_file",
            json!({"remote_path": "pair-edit.txt", "content": body}),
        )
        .await;
    assert!(!r.is_error, "{}", r.text);
    let script = cli_tmp.join("editor.sh");
    std::fs::write(&script, "#!/bin/sh\nprintf 'pair-edited-8Wz\\n' > \"$1\"\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let editor = script.display().to_string();
    let out = cli(
        &cli_tmp,
        &pair.list,
        &[("VISUAL", editor.as_str())],
        &["edit", "s:pair-edit.txt"],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(pair.sshd.home().join("pair-edit.txt")).unwrap(),
        "pair-edited-8Wz\n"
    );
    for (state, tool, bytes) in [
        (pair.mcp.tmp.path().join("state"), "write_remote_file", None),
        (cli_tmp.join("state"), "rsb edit", Some(16)),
    ] {
        let text: String = std::fs::read_dir(state.join("audit"))
            .unwrap()
            .flatten()
            .map(|f| std::fs::read_to_string(f.path()).unwrap())
            .collect();
        assert!(
            !text.contains("pair-written") && !text.contains("pair-edited"),
            "{text}"
        );
        let line: Value = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .find(|l| l["tool"] == tool)
            .unwrap_or_else(|| panic!("no {tool} line: {text}"));
        assert_eq!(line["command"], "pair-edit.txt", "{line}");
        assert!(line["error"].is_null(), "{line}");
        match bytes {
            None => assert_eq!(line["bytes"], body.len(), "{line}"),
            Some(n) => {
                assert_eq!(line["detail"]["written"], true, "{line}");
                assert_eq!(line["detail"]["bytes_written"], n, "{line}");
            }
        }
    }
    let _ = pair.mcp.svc.cancel().await;
}
