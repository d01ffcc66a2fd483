//! The `rsb` CLI as a user meets it (issue 12): one table of rows, each running the real binary
//! against a private sshd and asserting its exit code, stdout and stderr. Rows run in order
//! (the jobs rows build on each other); each is bounded by a timeout.
//!
//! Needs the `rsb` binary: `cargo build --workspace --bins`.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use rsb_tests::{Sshd, output_with_timeout, workspace_root};
use serde_json::{Value, json};

fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// One invocation and what it must do.
struct Row {
    /// `rsb` arguments, or a `bash -c` script when `shell` is set (`RSB` = the binary).
    args: Vec<String>,
    shell: bool,
    env: Vec<(String, Option<String>)>,
    code: i32,
    out_eq: Option<String>,
    out_has: Vec<String>,
    out_lacks: Vec<String>,
    err_has: Vec<String>,
    err_lacks: Vec<String>,
    err_empty: bool,
    out_len: Option<usize>,
    /// Upper bound on the run time (and the kill deadline).
    limit: Duration,
    /// Lower bound on the run time (to prove there was no early stop).
    at_least: Duration,
}

fn rsb(args: &[&str]) -> Row {
    Row {
        args: args.iter().map(|s| s.to_string()).collect(),
        shell: false,
        env: Vec::new(),
        code: 0,
        out_eq: None,
        out_has: Vec::new(),
        out_lacks: Vec::new(),
        err_has: Vec::new(),
        err_lacks: Vec::new(),
        err_empty: false,
        out_len: None,
        limit: Duration::from_secs(60),
        at_least: Duration::ZERO,
    }
}

fn bash(script: &str) -> Row {
    Row {
        shell: true,
        ..rsb(&[script])
    }
}

impl Row {
    fn code(mut self, c: i32) -> Self {
        self.code = c;
        self
    }
    fn out(mut self, s: &str) -> Self {
        self.out_has.push(s.into());
        self
    }
    fn out_eq(mut self, s: &str) -> Self {
        self.out_eq = Some(s.into());
        self
    }
    fn no_out(mut self, s: &str) -> Self {
        self.out_lacks.push(s.into());
        self
    }
    fn err(mut self, s: &str) -> Self {
        self.err_has.push(s.into());
        self
    }
    fn no_err(mut self, s: &str) -> Self {
        self.err_lacks.push(s.into());
        self
    }
    fn quiet(mut self) -> Self {
        self.err_empty = true;
        self
    }
    fn env(mut self, k: &str, v: &str) -> Self {
        self.env.push((k.into(), Some(v.into())));
        self
    }
    fn unset(mut self, k: &str) -> Self {
        self.env.push((k.into(), None));
        self
    }
    fn len(mut self, n: usize) -> Self {
        self.out_len = Some(n);
        self
    }
    fn took(mut self, at_least: Duration, limit: Duration) -> Self {
        self.at_least = at_least;
        self.limit = limit;
        self
    }
}

struct Env {
    home: PathBuf,
    state: PathBuf,
    list: String,
}

/// A script that installs a systemd unit running `bin` for the state dir `$SD` (and giving the
/// daemon the SSH agent at `sock`), runs `doctor -s SANDBOX`, and removes the unit. (`\x52`
/// spells R: the row's `RSB` stands for the binary.)
fn unit_then_doctor(bin: &str, sock: Option<&str>, sandbox: &str) -> String {
    let auth = sock.map_or_else(String::new, |s| {
        format!(
            "printf 'Environment=\"SSH_AUTH_SOCK=%s\"\\n' '{s}' >> \"$u/rsb-watchdog.service\"; "
        )
    });
    format!(
        "u=\"$XDG_CONFIG_HOME/systemd/user\" && mkdir -p \"$u\" && \
         printf '[Service]\\nExecStart=\"%s\" watchdog run\\nEnvironment=\"\\x52SB_STATE_DIR=%s\"\\n' \
         '{bin}' \"$SD\" > \"$u/rsb-watchdog.service\"; {auth}RSB doctor -s {sandbox}; c=$?; \
         rm -f \"$u/rsb-watchdog.service\"; exit $c"
    )
}

fn command(env: &Env, row: &Row) -> Command {
    let bin = rsb_bin();
    let mut cmd = if row.shell {
        let mut c = Command::new("bash");
        c.arg("-c")
            .arg(row.args[0].replace("RSB", &bin.display().to_string()));
        c
    } else {
        let mut c = Command::new(&bin);
        c.args(&row.args);
        c
    };
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &env.home)
        .env("XDG_CONFIG_HOME", env.home.join(".config"))
        .env("XDG_DATA_HOME", env.home.join(".local/share"))
        // The ssh config is the passwd home's unless this says otherwise: keep the user's own
        // out of the tests.
        .env("RSB_SSH_CONFIG", env.home.join(".ssh/config"))
        .env("RSB_STATE_DIR", &env.state)
        .env("REMOTE_SANDBOX_LIST", &env.list);
    for (k, v) in &row.env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd
}

/// Run a row; on mismatch, a message naming the row and everything it printed.
fn check(env: &Env, i: usize, row: &Row) -> Result<(), String> {
    let t0 = Instant::now();
    let out = output_with_timeout(&mut command(env, row), row.limit)
        .map_err(|e| format!("row {i} {:?}: {e}", row.args))?;
    let took = t0.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let code = out.status.code().unwrap_or(-1);
    let shown = if row.out_len.is_some() {
        format!("<{} bytes>", out.stdout.len())
    } else {
        stdout.clone()
    };
    let ctx = || {
        format!(
            "row {i} {:?}: exit {code} in {took:?}\n--- stdout\n{shown}\n--- stderr\n{stderr}",
            row.args
        )
    };
    let mut bad = Vec::new();
    if code != row.code {
        bad.push(format!("exit code {code}, expected {}", row.code));
    }
    if let Some(eq) = &row.out_eq
        && &stdout != eq
    {
        bad.push(format!("stdout is not {eq:?}"));
    }
    for s in &row.out_has {
        if !stdout.contains(s) {
            bad.push(format!("stdout lacks {s:?}"));
        }
    }
    for s in &row.out_lacks {
        if stdout.contains(s) {
            bad.push(format!("stdout has {s:?}"));
        }
    }
    for s in &row.err_has {
        if !stderr.contains(s) {
            bad.push(format!("stderr lacks {s:?}"));
        }
    }
    for s in &row.err_lacks {
        if stderr.contains(s) {
            bad.push(format!("stderr has {s:?}"));
        }
    }
    if row.err_empty && !stderr.is_empty() {
        bad.push("stderr is not empty".into());
    }
    if let Some(n) = row.out_len
        && out.stdout.len() != n
    {
        bad.push(format!(
            "stdout has {} bytes, expected {n}",
            out.stdout.len()
        ));
    }
    if took < row.at_least {
        bad.push(format!("ended after {took:?}, before {:?}", row.at_least));
    }
    if bad.is_empty() {
        println!("ok   row {i:>2} exit {code:>3} {took:>8.2?} {:?}", row.args);
        Ok(())
    } else {
        Err(format!("{}\n{}", bad.join("; "), ctx()))
    }
}

/// A host key that is not the fixture's, as `ssh-keygen` writes it.
fn other_host_key(dir: &Path) -> String {
    let key = dir.join("other_host_key");
    let ok = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .unwrap()
        .success();
    assert!(ok, "ssh-keygen failed");
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    public
        .split_whitespace()
        .take(2)
        .collect::<Vec<_>>()
        .join(" ")
}

fn big_file(p: &Path, n: usize) -> Vec<u8> {
    let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(p, &data).unwrap();
    data
}

#[test]
fn cli_table() {
    let sshd = Sshd::start().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let list = json!([
        {"name": "gpu1", "host": sshd.host(), "port": sshd.port(), "user": sshd.user(),
         "key_file": sshd.client_key().display().to_string()},
        {"name": "dead", "host": "127.0.0.1", "port": closed, "user": "nobody",
         "key_file": "/nonexistent/rsb-test-key", "connect_timeout_s": 2},
    ])
    .to_string();
    let env = Env {
        home: home.clone(),
        state: tmp.path().join("state"),
        list,
    };
    let h = sshd.home();
    let hd = h.display().to_string();
    const BIG: usize = 9 * 1024 * 1024 + 123;
    let big = big_file(&h.join("big.bin"), BIG);
    std::fs::create_dir_all(h.join("dir/sub")).unwrap();
    std::fs::write(h.join("dir/a.txt"), "a\n").unwrap();
    // A remote name holding OSC 52 (writes the user's clipboard in many terminals).
    std::fs::create_dir_all(h.join("evil")).unwrap();
    std::fs::write(h.join("evil/x\u{1b}]52;c;aGk=\u{7}.txt"), "e\n").unwrap();
    let config_path = home.join(".config/rsb/config.toml").display().to_string();
    let secs = Duration::from_secs;
    let _stop_daemon = common::StopDaemon(env.state.clone());
    // The same sshd as `moved`, under a name whose known_hosts entry holds another key: a host
    // that was reinstalled (or an interception). In rsb's own known_hosts: `~/.ssh/known_hosts`
    // is the passwd home's, as for `ssh`, which a test must not write.
    let known_hosts = env.state.join("known_hosts");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&env.state).unwrap();
        std::fs::set_permissions(&env.state, std::fs::Permissions::from_mode(0o700)).unwrap();
        let moved = format!("[localhost]:{}", sshd.port());
        std::fs::write(
            &known_hosts,
            format!("{moved} {}\n", other_host_key(tmp.path())),
        )
        .unwrap();
        std::fs::set_permissions(&known_hosts, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let moved = format!("[localhost]:{}", sshd.port());
    let kh = known_hosts.display().to_string();
    // A tree for the grep rows: one match, one gitignored match.
    std::fs::create_dir_all(h.join("gdir")).unwrap();
    std::fs::write(h.join("gdir/.gitignore"), "*.log\n").unwrap();
    std::fs::create_dir_all(h.join("gdir/.git")).unwrap();
    std::fs::write(h.join("gdir/a.py"), "x needle\ny\n").unwrap();
    std::fs::write(h.join("gdir/b.log"), "needle\n").unwrap();
    std::fs::write(h.join("gdir/c.txt"), "back\\slash\ttab\n").unwrap();
    // A tree whose result spans several streamed batches (6,000 matching lines, a file's lines
    // cut between two batches), with a CRLF line, bytes that are not UTF-8, `a.b` beside `a/`
    // (path order), and a hidden file: `rsb grep` must print what rg prints, byte for byte.
    let gbig = h.join("gbig");
    std::fs::create_dir_all(gbig.join("a")).unwrap();
    for f in 0..30 {
        let text: String = (0..300)
            .map(|i| {
                if i % 3 == 2 {
                    format!("plain {f} {i}\n")
                } else {
                    format!("needle {f} {i} {}\n", "x".repeat(i % 7))
                }
            })
            .collect();
        std::fs::write(gbig.join(format!("f{f:02}.txt")), text).unwrap();
    }
    std::fs::write(gbig.join("a/inner.txt"), "needle inner\n").unwrap();
    std::fs::write(gbig.join("a.b"), "x\nneedle crlf\r\ny\r\n").unwrap();
    std::fs::write(gbig.join("latin.txt"), b"caf\xe9 needle \xff\xfe\n").unwrap();
    std::fs::write(gbig.join(".hidden"), "needle hidden\n").unwrap();
    std::fs::write(h.join("gbin"), b"needle\n\0needle\n").unwrap();
    // Roots named through a symlink are followed, as rg follows the paths it is given.
    std::os::unix::fs::symlink("gbig/f00.txt", h.join("gfile-link")).unwrap();
    std::os::unix::fs::symlink("gbig", h.join("gdir-link")).unwrap();
    // What rg prints (sorted as rsb sorts), then what rsb grep prints: the same bytes.
    let same_as_rg = |flags: &str| {
        bash(&format!(
            "a=$(mktemp) b=$(mktemp); RSB grep -n {flags} needle gbig > \"$a\"; \
             (cd '{}' && rg --no-config --no-heading -n --sort path {flags} needle gbig) > \"$b\"; \
             if cmp \"$a\" \"$b\"; then echo same; else diff \"$a\" \"$b\" | head -20; fi; \
             wc -l < \"$a\" >&2; rm -f \"$a\" \"$b\"",
            h.display()
        ))
        .out_eq("same\n")
    };
    // rg's habits, row by row (issue 41 item 5): the same stdout and exit code as rg run on
    // the sandbox in the home (piped, so rg prints no line numbers unless asked).
    let rgt = h.join("rgt");
    std::fs::create_dir_all(rgt.join("src")).unwrap();
    std::fs::create_dir_all(rgt.join("docs")).unwrap();
    std::fs::create_dir_all(rgt.join(".git")).unwrap();
    std::fs::write(rgt.join(".gitignore"), "*.log\n").unwrap();
    std::fs::write(
        rgt.join("src/main.rs"),
        "fn main() {\n    let foo = 1;\n    let foobar = 2;\n    println!(\"{}\", foo);\n}\n",
    )
    .unwrap();
    std::fs::write(
        rgt.join("src/lib.py"),
        "def foo():\n    return 'FOO'\n\nclass Bar:\n    pass\n",
    )
    .unwrap();
    std::fs::write(
        rgt.join("docs/readme.md"),
        "# Foo\nUse foo-bar here.\nnothing\n",
    )
    .unwrap();
    std::fs::write(rgt.join(".hidden.py"), "foo = 'hidden'\n").unwrap();
    std::fs::write(rgt.join(".dot.txt"), "foo dot\n").unwrap();
    std::fs::write(
        rgt.join("notes.txt"),
        "alpha\nbeta foo\ngamma\ndelta\nepsilon foo\nzeta\n",
    )
    .unwrap();
    std::fs::write(rgt.join("build.log"), "foo in log\n").unwrap();
    // CRLF, Latin-1 and a last line without a line break, for --json's `bytes` and offsets.
    std::fs::write(
        rgt.join("docs/mixed.txt"),
        b"x foo\r\ncaf\xe9 foo foo\nlast foo",
    )
    .unwrap();
    // `rg --json` and `rsb grep --json`, the times taken out (the only fields that differ).
    let like_rg_json = |args: &str| {
        let untimed = r#"sed -E 's/"elapsed(_total)?":\{[^}]*\}//g'"#;
        bash(&format!(
            "a=$(mktemp) b=$(mktemp); RSB grep --json {args} 2>/dev/null | {untimed} > \"$a\"; ra=${{PIPESTATUS[0]}}; \
             (cd '{}' && rg --no-config --sort path --json {args}) 2>/dev/null | {untimed} > \"$b\"; rb=${{PIPESTATUS[0]}}; \
             if [ $ra = $rb ] && cmp -s \"$a\" \"$b\"; then echo same $ra $(wc -l < \"$a\"); \
             else echo \"rsb exit $ra, rg exit $rb\"; diff \"$a\" \"$b\" | head -20; fi; \
             rm -f \"$a\" \"$b\"",
            h.display()
        ))
    };
    let like_rg = |args: &str| {
        bash(&format!(
            "a=$(mktemp) b=$(mktemp); RSB grep {args} > \"$a\" 2>/dev/null; ra=$?; \
             (cd '{}' && rg --no-config --sort path {args}) > \"$b\" 2>/dev/null; rb=$?; \
             if [ $ra = $rb ] && cmp -s \"$a\" \"$b\"; then echo same $ra; \
             else echo \"rsb exit $ra, rg exit $rb\"; diff \"$a\" \"$b\" | head -20; fi; \
             rm -f \"$a\" \"$b\"",
            h.display()
        ))
    };
    // A small tree for the sync rows, with a .gitignore.
    let proj = tmp.path().join("proj");
    std::fs::create_dir_all(proj.join("sub")).unwrap();
    std::fs::write(proj.join(".gitignore"), "*.log\n").unwrap();
    std::fs::write(proj.join("a.txt"), "a\n").unwrap();
    std::fs::write(proj.join("sub/b.txt"), "b\n").unwrap();
    std::fs::write(proj.join("sub/run.log"), "log\n").unwrap();
    let proj = proj.display().to_string();
    // The directory's contents, as rsync reads a trailing slash.
    let contents = format!("{proj}/");
    let free = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let moved_list = json!([
        {"name": "moved", "host": "localhost", "port": sshd.port(), "user": sshd.user(),
         "key_file": sshd.client_key().display().to_string()},
    ])
    .to_string();

    // An SSH agent's socket (nothing answers on it: doctor only looks at where it is), and a
    // sandbox that would log in through it.
    let agent_sock = env.home.join("agent.sock").display().to_string();
    let _agent = std::os::unix::net::UnixListener::bind(&agent_sock).unwrap();
    let agent_list =
        json!([{"name": "agentbox", "host": "127.0.0.1", "port": 9, "user": "nobody"}]).to_string();

    let rows: Vec<Row> = vec![
        // exec: argv boundaries, exit codes, no default timeout, --timeout.
        rsb(&["exec", "--", "printf", "%s\\n", "a b"]).out_eq("a b\n"),
        rsb(&["exec", "echo one; echo two >&2"])
            .out_eq("one\n")
            .err("two"),
        rsb(&["exec", "exit 7"]).code(7),
        rsb(&["exec", "--", "sh", "-c", "kill -TERM $$"]).code(143),
        rsb(&["exec", "--", "sleep", "3"]).took(secs(3), secs(60)),
        rsb(&["exec", "--timeout", "1", "--", "sleep", "30"])
            .code(124)
            .err("timed out after 1s")
            .took(secs(1), secs(20)),
        rsb(&["exec", "--timeout", "0", "--", "true"]),
        rsb(&["--json", "exec", "--", "echo", "hi"]).out("\"stdout\":\"hi\\n\""),
        bash("printf 'a\\nb\\n' | RSB --json exec -- wc -l").out("\"stdout\":\"2\\n\""),
        rsb(&["exec", "--cwd", "~/dir", "--", "ls"]).out_eq("a.txt\nsub\n"),
        // grep: rg's output and exit codes (0 a match, 1 none, 2 an error).
        rsb(&["grep", "needle", "gdir"]).out_eq("gdir/a.py:x needle\n"),
        rsb(&["grep", "needle", "gpu1:gdir", "-l"]).out_eq("gdir/a.py\n"),
        rsb(&["grep", "-c", "--no-ignore", "needle", "gdir"]).out_eq("gdir/a.py:1\ngdir/b.log:1\n"),
        rsb(&["grep", "-C", "1", "needle", "gdir"]).out_eq("gdir/a.py:x needle\ngdir/a.py-y\n"),
        rsb(&["grep", "--color", "always", "need", "gdir"]).out("\u{1b}[1;31mneed\u{1b}[0mle"),
        rsb(&["--json", "grep", "needle", "gdir"]).out("\"type\":\"match\"").out("\"summary\""),
        rsb(&["grep", "zzz_none", "gdir"]).code(1).out_eq(""),
        rsb(&["grep", "(", "gdir"]).code(2).err("invalid regex"),
        rsb(&["grep", "x", "no/such/dir"]).code(2).err("No such file"),
        // A remote name with an escape sequence is printed as text, never raw.
        // Piped, the bytes as rg prints them (a terminal gets them escaped).
        rsb(&["grep", "e", "evil"]).out("\u{1b}]52"),
        rsb(&["grep", "slash", "gdir"]).out_eq("gdir/c.txt:back\\slash\ttab\n"),
        same_as_rg("").err("6003"),
        same_as_rg("-C 1").err("9037"),
        same_as_rg("-C 3 -i -g '*.txt' -g '!f2*'"),
        same_as_rg("-l"),
        // A reader that leaves early ends the stream (no hang, nothing printed after).
        bash("RSB grep needle gbig | head -1").out_eq("gbig/a/inner.txt:needle inner\n"),
        same_as_rg("-c"),
        like_rg("foo rgt").out_eq("same 0\n"),
        like_rg("-n foo rgt").out_eq("same 0\n"),
        like_rg("-w foo rgt").out_eq("same 0\n"),
        like_rg("-i foo rgt").out_eq("same 0\n"),
        like_rg("-v foo rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-n -A 1 foo rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-B 2 -n foo rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-C 1 foo rgt").out_eq("same 0\n"),
        like_rg("-e alpha -e zeta -e 'fo+' rgt").out_eq("same 0\n"),
        like_rg("-t py foo rgt").out_eq("same 0\n"),
        like_rg("-T py -T md -l foo rgt").out_eq("same 0\n"),
        like_rg("--hidden foo rgt").out_eq("same 0\n"),
        like_rg("-c foo rgt").out_eq("same 0\n"),
        like_rg("-l foo rgt/src rgt/docs rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-nw foo rgt/src rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-F -e 'foo-bar' -e '{}' rgt").out_eq("same 0\n"),
        like_rg("--no-ignore foo rgt").out_eq("same 0\n"),
        like_rg("-H foo rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-S FOO rgt").out_eq("same 0\n"),
        like_rg("-g '*.md' -i FOO rgt").out_eq("same 0\n"),
        like_rg("-vc foo rgt/src").out_eq("same 0\n"),
        like_rg("-uu -l foo rgt").out_eq("same 0\n"),
        like_rg("-I -n foo rgt/src rgt/notes.txt").out_eq("same 0\n"),
        // -U: a match spans lines; every line it touches prints, -c counts matches.
        like_rg("-U 'foo = 1;\\n    let' rgt").out_eq("same 0\n"),
        like_rg("-U -n -C 1 'foo\\ngamma' rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-U -c 'o\\n' rgt").out_eq("same 0\n"),
        like_rg("-U -c '(?s)alpha.*zeta' rgt").out_eq("same 0\n"),
        like_rg("-U -v 'foo\\ngamma' rgt/notes.txt").out_eq("same 0\n"),
        like_rg("-U -l -i '^CLASS bar:\\n' rgt").out_eq("same 0\n"),
        like_rg("'foo\\ngamma' rgt").out_eq("same 2\n"),
        rsb(&["grep", "foo\\ngamma", "rgt"]).code(2).err("-U (--multiline)"),
        like_rg("zzz rgt").out_eq("same 1\n"),
        // --json is rg's JSON lines: begin, match, context, end, summary, byte for byte but
        // for the times (`bytes` for Latin-1, CRLF and a last line without a line break).
        like_rg_json("foo rgt").out_eq("same 0 21\n"),
        like_rg_json("-C 1 foo rgt/notes.txt").out_eq("same 0 9\n"),
        like_rg_json("-v foo rgt/notes.txt").out_eq("same 0 7\n"),
        like_rg_json("-w -i foo rgt/src rgt/docs").out_eq("same 0 18\n"),
        like_rg_json("foo rgt/docs/mixed.txt").out_eq("same 0 6\n"),
        like_rg_json("zzz rgt").out_eq("same 1 1\n"),
        like_rg_json("-q foo rgt").out_eq("same 0 0\n"),
        like_rg_json("-l foo rgt").out_eq("same 2 0\n"),
        like_rg_json("-c foo rgt").out_eq("same 2 0\n"),
        like_rg("-v foo rgt/notes.txt rgt/missing").out_eq("same 2\n"),
        like_rg("--no-such-flag foo rgt").out_eq("same 2\n"),
        like_rg("-A x foo rgt").out_eq("same 2\n"),
        like_rg("-t nosuchtype foo rgt").out_eq("same 2\n"),
        // rg's usage error, not a search for "-w" (the old hint said `-- -w`).
        rsb(&["grep", "--frobnicate", "foo", "rgt"]).code(2).err("'--frobnicate'"),
        like_rg("-q foo rgt").out_eq("same 0\n"),
        like_rg("-q zzz rgt").out_eq("same 1\n"),
        rsb(&["grep", "-t", "nosuchtype", "foo", "rgt"]).code(2).err("known types: asm"),
        rsb(&["grep", "foo", "gpu1:rgt/src", "dead:rgt"]).code(2).err("two sandboxes"),
        rsb(&["grep", "-l", "foo", "gpu1:rgt/src", "gpu1:rgt/docs"])
            .out_eq("rgt/src/lib.py\nrgt/src/main.rs\nrgt/docs/mixed.txt\nrgt/docs/readme.md\n"),
        // One file searched: no path printed, as rg prints it.
        rsb(&["grep", "--head-limit", "2", "--offset", "3", "needle", "gbig/f00.txt"])
            .out_eq("needle 0 4 xxxx\nneedle 0 6 xxxxxx\n")
            .err("195 more matching lines; --offset 5 continues"),
        rsb(&["grep", "-c", "needle", "gbig/f00.txt"]).out_eq("200\n"),
        rsb(&["grep", "-c", "needle", "gfile-link"]).out_eq("200\n"),
        rsb(&["grep", "needle", "gbin"])
            .code(1)
            .out_eq("")
            .err("1 binary file (a NUL byte) not searched"),
        rsb(&["grep", "-n", "needle 0 4 x", "gfile-link"]).out_eq("5:needle 0 4 xxxx\n"),
        rsb(&["grep", "needle inner", "gdir-link"]).out_eq("gdir-link/a/inner.txt:needle inner\n"),
        rsb(&["grep", "-l", "needle", "gbig/f00.txt"]).out_eq("gbig/f00.txt\n"),
        // Usage errors and did-you-mean.
        rsb(&["exce", "ls"]).code(1).err("'exec'"),
        rsb(&[]).code(1).err("Usage: rsb"),
        rsb(&["-s", "gpu2", "exec", "true"])
            .code(1)
            .err("unknown sandbox `gpu2`")
            .err("did you mean `gpu1`"),
        rsb(&["exec", "true"])
            .env("RSB_SANDBOX", "nope")
            .code(1)
            .err("unknown sandbox `nope`")
            .err("ssh_config_host = \"nope\""),
        // Nothing configured: the hint names the ssh config that has no such Host.
        rsb(&["-s", "nohost26", "exec", "true"])
            .unset("REMOTE_SANDBOX_LIST")
            .code(1)
            .err("unknown sandbox `nohost26`")
            .err(".ssh/config has no `Host nohost26`"),
        // `rsb shell` with piped stdin: as `ssh host <<< cmd`, no pty, the shell's status.
        bash("RSB shell gpu1 <<< 'echo hi; tty -s || echo no-tty; exit 3'")
            .code(3)
            .out_eq("hi\nno-tty\n"),
        rsb(&["sync", "uxl:foo", "/tmp/rsb-cli-x"])
            .code(1)
            .err("unknown sandbox `uxl`"),
        rsb(&["ls", "--max-entries", "0", "."])
            .code(1)
            .err("--max-entries")
            .no_err("max_entries"),
        // Files.
        rsb(&["cat", "nope.txt"])
            .code(4)
            .err("no such file")
            .no_err("list_remote_files"),
        rsb(&["cat", "~/big.bin"]).len(BIG),
        rsb(&["cat", "~/dir"])
            .code(4)
            .err("is a directory")
            .err("`rsb ls`"),
        rsb(&["ls", "~/dir"]).out("/dir/a.txt\n").out("/dir/sub/\n"),
        rsb(&["--json", "ls", "~/dir"])
            .out("\"entries\"")
            .out("/dir/a.txt\""),
        // Remote names reach the terminal escaped; --json keeps the exact bytes.
        rsb(&["ls", "~/evil"])
            .out("/evil/x\\u{1b}]52;c;aGk=\\u{7}.txt\n")
            .no_out("\u{1b}")
            .no_out("\u{7}"),
        rsb(&["--json", "ls", "~/evil"]).out("/evil/x\\u001b]52;c;aGk=\\u0007.txt\""),
        // Sandboxes: a table; warnings only about the sandboxes a command uses. A sandbox
        // down is a failed health check (issue 41, item 9): exit 3 after the listing.
        rsb(&["sandboxes"])
            .code(3)
            .out("NAME")
            .out("gpu1")
            .out("dead")
            .err("rsb: warning: REMOTE_SANDBOX_LIST[1]: key_file")
            .err("rsb: 1 of 2 sandboxes down: dead"),
        rsb(&["sandboxes", "--resources", "-s", "gpu1"])
            .code(3)
            .out("CPU%")
            .out("IDLE"),
        rsb(&["--json", "sandboxes"])
            .code(3)
            .out("\"active_sandbox\":\"gpu1\"")
            .out("\"connection_alive\":false"),
        rsb(&["exec", "true"]).quiet(),
        rsb(&["-s", "dead", "exec", "true"])
            .code(3)
            .err("rsb: warning: REMOTE_SANDBOX_LIST[1]: key_file"),
        // Configuration.
        rsb(&["config", "path"]).out_eq(&format!("{config_path}\n")),
        rsb(&["config", "check"]).out("2 sandbox(es) from REMOTE_SANDBOX_LIST"),
        rsb(&["config", "check"])
            .env("REMOTE_SANDBOX_LIST", "[{")
            .code(2),
        rsb(&["exec", "true"])
            .env("REMOTE_SANDBOX_LIST", "[{")
            .code(2)
            .err("hint:"),
        rsb(&["exec", "--", "echo", "here"])
            .unset("REMOTE_SANDBOX_LIST")
            .out_eq("here\n")
            .err("rsb: note: no sandboxes configured")
            .err(&config_path),
        rsb(&["--help"])
            .out("Exit codes:")
            .out(&config_path)
            .out("124"),
        // Jobs: table, --json, logs -f exit code, kill/rm/prune.
        rsb(&[
            "jobs",
            "start",
            "--name",
            "j1",
            "--",
            "sh",
            "-c",
            "echo out; exit 3",
        ])
        .out_eq("j1\n"),
        rsb(&["jobs", "logs", "-f", "j1"])
            .code(3)
            .out("out")
            .took(Duration::ZERO, secs(30)),
        rsb(&["jobs", "list"])
            .out("NAME")
            .out("STATE")
            .out("j1")
            .no_out("{"),
        rsb(&["--json", "jobs", "list"]).out("\"tmux_session\":\"j1\""),
        rsb(&["jobs", "kill", "nosuchjob"])
            .code(4)
            .err("no job named `nosuchjob`")
            .err("`rsb jobs list`")
            .no_err("check the path"),
        rsb(&["jobs", "start", "--name", "j2", "sleep 30"]).out_eq("j2\n"),
        rsb(&["jobs", "rm", "j2"])
            .code(1)
            .err("still running")
            .err("rsb jobs kill j2"),
        rsb(&["jobs", "kill", "--grace", "1", "j2"]).out("j2"),
        rsb(&["jobs", "rm", "j1"]).out_eq("j1\n"),
        rsb(&["jobs", "logs", "j1"])
            .code(4)
            .err("no job named `j1`"),
        rsb(&["jobs", "prune", "--older-than", "1h"])
            .no_out("j2")
            .err("removed 0"),
        rsb(&["jobs", "prune"]).out_eq("j2\n"),
        rsb(&["jobs", "prune", "--older-than", "5x"])
            .code(1)
            .err("unknown unit"),
        // GPU placement: a host without GPUs says so; `-s auto` names every sandbox.
        rsb(&["jobs", "start", "--gpus", "1", "--name", "g1", "true"])
            .code(4)
            .err("no 1 free GPU(s): gpu1 has no NVIDIA GPUs"),
        rsb(&["-s", "auto", "jobs", "start", "--gpus", "2", "true"])
            .code(4)
            .err("gpu1 has no NVIDIA GPUs; dead: "),
        rsb(&["jobs", "start", "--gpus", "65", "true"])
            .code(1)
            .err("gpus must be 0 to 64"),
        rsb(&["jobs", "start", "--min-gpu-free-mem-gb", "8", "true"])
            .code(1)
            .err("needs gpus"),
        // wait: the end at once (the agent pushes it), the last lines, the job's exit code.
        bash("RSB jobs start --name w1 -- 'sleep 1; echo bye; exit 5' >/dev/null && RSB wait w1")
            .code(5)
            .out_eq("bye\n")
            .err("job `w1` exited 5 after 1.")
            .took(secs(1), secs(3)),
        rsb(&["wait", "gpu1", "w1", "-n", "0"])
            .code(5)
            .out_eq("")
            .took(Duration::ZERO, secs(2)),
        rsb(&["wait", "nope"]).code(4).err("no job named `nope`"),
        bash("RSB jobs start --name w2 -- \"trap '' TERM; sleep 30\" >/dev/null && RSB wait --timeout 1 w2")
            .code(124)
            .err("job `w2` is still running after 1 s")
            .took(secs(1), secs(4)),
        rsb(&["jobs", "kill", "--grace", "0", "w2"]).out("w2"),
        rsb(&["wait", "w2"]).code(137).err("killed by signal 9"),
        // Sync: quiet by default, -v lists each file sent (rsync-like), --gitignore.
        rsb(&["sync", &contents, "gpu1:cli-q"])
            .out("sent 4 files")
            .no_out("a.txt"),
        rsb(&["sync", "-v", "--gitignore", &contents, "gpu1:cli-v"])
            .out("send    a.txt")
            .out("send    sub/b.txt")
            .out("send    .gitignore")
            .no_out("run.log")
            .out("sent 3 files"),
        rsb(&["sync", "-v", "--delete", &contents, "gpu1:cli-v"])
            .out("send    sub/run.log")
            .no_out("a.txt"),
        // What the .gitignore leaves out is never deleted on the destination (as --exclude).
        rsb(&["sync", "-v", "--delete", "--gitignore", &contents, "gpu1:cli-v"])
            .no_out("delete")
            .no_out("send")
            .out("3 unchanged"),
        rsb(&["sync", "-n", &contents, "gpu1:cli-n"]).out("send    sub/b.txt"),
        // rsync's habit `-avz` (issue 41, item 9): -z turns compression on, even on loopback,
        // where rsb would not compress by itself.
        rsb(&["sync", "-avz", &contents, "gpu1:cli-z"])
            .err("-a is implied")
            .out("sent 4 files")
            .out("compressed"),
        rsb(&["sync", &contents, "gpu1:cli-z2"]).no_out("compressed"),
        // rsync's trailing-slash rule (issue 41, item 4): without the slash, the directory
        // itself goes into the destination.
        rsb(&["sync", &proj, "gpu1:cli-r"]).out("sent 4 files"),
        rsb(&["exec", "cat ~/cli-r/proj/sub/b.txt"]).out_eq("b\n"),
        // Its contents straight into the (non-empty) home: asked first, so with no terminal
        // refused (exit 7) and nothing sent; a dry run changes nothing and is not asked.
        rsb(&["sync", &contents, "gpu1:"])
            .code(7)
            .err("not syncing the contents"),
        rsb(&["exec", "test -e ~/sub/b.txt || echo clean"]).out_eq("clean\n"),
        rsb(&["sync", "-n", &contents, "gpu1:"]).out("send    sub/b.txt"),
        // About rsb itself.
        rsb(&["version"])
            .out("rsb ")
            .out("agent x86_64-unknown-linux-musl blake3:"),
        rsb(&["man"]).out(".TH"),
        bash("source <(RSB completions bash) && complete -p rsb").out("rsb"),
        // `rsb edit`: the editor's change is written back; an unchanged copy writes nothing;
        // a remote change meanwhile keeps the local copy and writes nothing (exit 4).
        bash(&format!(
            "printf 'hello\\n' > {hd}/ed.txt && RSB edit gpu1:ed.txt && cat {hd}/ed.txt"
        ))
        .env("EDITOR", "sed -i s/hello/bye/")
        .out_eq("bye\n")
        .err("rsb: wrote gpu1:"),
        bash(&format!("printf 'same\\n' > {hd}/ed1.txt && RSB edit gpu1:ed1.txt"))
        .env("EDITOR", "true")
        .err("no changes"),
        bash(&format!(
            "printf 'base\\n' > {hd}/ed2.txt; RSB edit gpu1:ed2.txt; echo \"code $?\"; cat {hd}/ed2.txt"
        ))
        .env(
            "EDITOR",
            &format!("f() {{ echo remote > {hd}/ed2.txt; echo mine > \"$1\"; }}; f"),
        )
        .out("code 4\nremote\n")
        .err("changed since it was opened")
        .err("your copy: "),
        rsb(&["edit", "nosuchpath"]).code(1).err("SANDBOX:PATH"),
        rsb(&["completions", "zsh"]).out("#compdef rsb"),
        // The state dir: what it holds, whether the store is usable, pruning now (issue 46).
        rsb(&["state"])
            .out("rsb.sqlite3 ")
            .out("the store")
            .out("audit/ ")
            .out("the audit log, a file a month")
            .out("rows of sync baselines")
            .out("rows of watched jobs"),
        rsb(&["state", "check"])
            .out(&format!(
                "ok: {}/rsb.sqlite3 (schema {}, every page reads)",
                env.state.display(),
                rsb::store::SCHEMA_VERSION
            ))
            .no_err("rsb:"),
        rsb(&["--json", "state", "check"]).out_eq(&format!(
            "{{\"ok\":true,\"schema\":{}}}\n",
            rsb::store::SCHEMA_VERSION
        )),
        rsb(&["--json", "state", "prune"])
            .out("\"baselines\":")
            .out("\"bytes_freed\":"),
        rsb(&["state", "prune"]).out("pruned: ").out(" freed"),
        // Doctor: a verdict per line, healthy vs broken host.
        rsb(&["doctor", "-s", "gpu1"])
            .out("ok    watchdog: not running (nothing needs it")
            .out("ok    forwards: no detached forwards")
            .out("ok    gpu1: keys: key file")
            .out("ok    gpu1: reachable")
            .out("ok    gpu1: host key: verified")
            .out("ok    gpu1: auth")
            .out("ok    gpu1: agent")
            .out("ok    gpu1: confine: Landlock ABI ")
            .out("gpu1: clock")
            .no_out("FAIL"),
        rsb(&["doctor", "-s", "dead"])
            .code(3)
            .out("warn  dead: config: REMOTE_SANDBOX_LIST[1]: key_file")
            .out("FAIL  dead: keys: key file /nonexistent/rsb-test-key does not exist")
            .out("FAIL  dead: reachable"),
        // An installed service (issue 44): doctor names the binary it runs, and warns when an
        // upgrade removed it (a Homebrew Cellar or nix store path), saying how to fix it.
        bash(&unit_then_doctor("/opt/gone/Cellar/rsb/0.1/bin/rsb", None, "gpu1"))
            .env("SD", &env.state.display().to_string())
            .out("warn  service: the systemd service ")
            .out("runs /opt/gone/Cellar/rsb/0.1/bin/rsb, which no longer exists")
            .out("run `rsb watchdog install` again"),
        bash(&unit_then_doctor(&rsb_bin().display().to_string(), None, "gpu1"))
            .env("SD", &env.state.display().to_string())
            .out(&format!(
                "ok    service: systemd service {}/.config/systemd/user/rsb-watchdog.service runs {}",
                env.home.display(),
                rsb_bin().display()
            )),
        // The daemon's SSH agent against this shell's, for a sandbox that logs in through it
        // (issue 44): the socket written into the service, and none (this one, under /tmp, is
        // made anew at each login, so it cannot be written).
        bash(&unit_then_doctor(&rsb_bin().display().to_string(), Some(&agent_sock), "agentbox"))
            .env("SD", &env.state.display().to_string())
            .env("SSH_AUTH_SOCK", &agent_sock)
            .env("REMOTE_SANDBOX_LIST", &agent_list)
            .code(3)
            .out(&format!("ok    service: the daemon asks your SSH agent at {agent_sock}")),
        bash(&unit_then_doctor(&rsb_bin().display().to_string(), None, "agentbox"))
            .env("SD", &env.state.display().to_string())
            .env("SSH_AUTH_SOCK", &agent_sock)
            .env("REMOTE_SANDBOX_LIST", &agent_list)
            .code(3)
            .out(&format!(
                "warn  service: the daemon cannot ask your SSH agent for agentbox: your SSH_AUTH_SOCK ({agent_sock}) is made anew"
            )),
        // A changed host key: what changed, where the old key is, the command that fixes it.
        rsb(&["doctor"])
            .env("REMOTE_SANDBOX_LIST", &moved_list)
            .code(3)
            .out(&format!(
                "FAIL  moved: host key: CHANGED: {moved} now presents ssh-ed25519 SHA256:"
            ))
            .out(&format!("not the key in {kh} line 1;"))
            .out(&format!("run `ssh-keygen -R '{moved}' -f {kh}` and retry"))
            .out("ok    moved: reachable: passed"),
        rsb(&["exec", "true"])
            .env("REMOTE_SANDBOX_LIST", &moved_list)
            .code(3)
            .err("has CHANGED"),
        bash(&format!(
            "ssh-keygen -R '{moved}' -f {kh} >/dev/null 2>&1 && RSB doctor"
        ))
        .env("REMOTE_SANDBOX_LIST", &moved_list)
        .out("ok    moved: host key: verified")
        .no_out("FAIL"),
        // Detached forwards and the watchdog daemon that serves them.
        rsb(&["forward", "--detach", "gpu1:9", &free.to_string()])
            .out("detached, id 1000001")
            .took(Duration::ZERO, secs(30)),
        rsb(&["doctor", "-s", "gpu1"])
            .out("ok    watchdog: running (pid")
            .out(&format!(
                "ok    forward: 1000001 127.0.0.1:{free} -> gpu1:localhost:9 (listening"
            ))
            .no_out("FAIL"),
        rsb(&["forward", "--stop", "1000001"]).out("stopped forward 1000001"),
    ];
    assert!(rows.len() >= 30, "{} rows", rows.len());
    let mut failures = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        if let Err(e) = check(&env, i, row) {
            eprintln!("FAIL {e}\n");
            failures.push(e);
        }
    }
    // The streamed file is the file, byte for byte.
    let out = output_with_timeout(
        &mut command(&env, &rsb(&["cat", "~/big.bin"])),
        Duration::from_secs(60),
    )
    .unwrap();
    assert!(out.stdout == big, "rsb cat big.bin differs from the file");
    let v: Value = serde_json::from_slice(
        &output_with_timeout(
            &mut command(&env, &rsb(&["--json", "exec", "exit 5"])),
            Duration::from_secs(30),
        )
        .unwrap()
        .stdout,
    )
    .unwrap();
    assert_eq!(v["exit_code"], 5, "{v}");
    // rsb's own known_hosts (accept-new recorded the fixture's key) is private, as every file
    // in the state dir.
    {
        use std::os::unix::fs::PermissionsExt;
        let kh = env.state.join("known_hosts");
        let mode = std::fs::metadata(&kh)
            .unwrap_or_else(|e| panic!("{}: {e}", kh.display()))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{}", kh.display());
    }
    println!("{} rows, {} failed", rows.len(), failures.len());
    if !failures.is_empty() {
        // The detached-forward rows depend on the daemon: its log says what it did.
        let log = std::fs::read_to_string(env.state.join("watchdog.log")).unwrap_or_default();
        eprintln!("the watchdog daemon's log:\n{log}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
