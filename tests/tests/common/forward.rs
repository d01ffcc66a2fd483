//! Helpers for the forwarding tests and benchmark: the real `rsb` binary in a controlled
//! environment, a Python HTTP server started in the sandbox as an rsb job, a running
//! `rsb forward` whose JSON lines are collected, and a minimal HTTP/1.0 client.
#![allow(dead_code)]

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use rsb_tests::{Sshd, output_with_timeout, workspace_root};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub fn rsb_bin() -> PathBuf {
    let p = workspace_root().join("target/debug/rsb");
    assert!(
        p.exists(),
        "{} does not exist: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// Is `python3` on PATH? The tests serve HTTP with it; they say so when they skip.
pub fn python3() -> bool {
    Command::new("python3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A `REMOTE_SANDBOX_LIST` entry for sandbox `name` on `port` (the sshd or a proxy in front).
pub fn entry(name: &str, sshd: &Sshd, port: u16) -> Value {
    json!({
        "name": name, "host": "127.0.0.1", "port": port, "user": sshd.user(),
        "key_file": sshd.client_key().display().to_string(), "connect_timeout_s": 5,
    })
}

/// `target/release/rsb` when it exists (benchmarks), else the debug build.
pub fn rsb_bin_release_if_built() -> PathBuf {
    let release = workspace_root().join("target/release/rsb");
    if release.exists() {
        release
    } else {
        eprintln!(
            "note: {} is missing; using the debug build, whose numbers are not representative",
            release.display()
        );
        rsb_bin()
    }
}

/// Environment for `rsb` children: no config file, no ssh config, no agent, private state.
pub struct RsbEnv {
    pub list: String,
    pub bin: PathBuf,
    pub dir: tempfile::TempDir,
}

impl RsbEnv {
    pub fn new(entries: &[Value]) -> RsbEnv {
        RsbEnv {
            list: Value::Array(entries.to_vec()).to_string(),
            bin: rsb_bin(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    pub fn command(&self) -> Command {
        let home = self.dir.path().join("home");
        std::fs::create_dir_all(&home).unwrap();
        let mut c = Command::new(&self.bin);
        c.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            .env("RSB_STATE_DIR", self.dir.path().join("state"))
            .env("REMOTE_SANDBOX_LIST", &self.list);
        c
    }

    /// Run `rsb ARGS` to completion (bounded), asserting success; returns stdout.
    pub fn run(&self, args: &[&str]) -> String {
        let out = output_with_timeout(self.command().args(args), Duration::from_secs(60)).unwrap();
        assert!(
            out.status.success(),
            "rsb {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// A background job in the sandbox, started and killed with `rsb jobs`; it is also killed
/// with every other process of the fixture when the sshd goes away.
pub struct Job<'a> {
    env: &'a RsbEnv,
    sandbox: String,
    pub name: String,
    pub log: PathBuf,
}

impl<'a> Job<'a> {
    pub fn start(env: &'a RsbEnv, sandbox: &str, name: &str, cwd: &Path, cmd: &str) -> Job<'a> {
        let log = cwd.join(format!("{name}.log"));
        env.run(&[
            "jobs",
            "start",
            "--sandbox",
            sandbox,
            "--name",
            name,
            "--cwd",
            &cwd.display().to_string(),
            "--log",
            &log.display().to_string(),
            "--",
            cmd,
        ]);
        Job {
            env,
            sandbox: sandbox.into(),
            name: name.into(),
            log,
        }
    }

    /// Wait (bounded) for a log line containing `needle`; returns that line.
    pub fn wait_line(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            // Whole lines only: a line still being written can hold half of what we parse.
            if let Some(l) = text
                .split_inclusive('\n')
                .find(|l| l.ends_with('\n') && l.contains(needle))
            {
                return l.trim_end().to_string();
            }
            assert!(
                Instant::now() < deadline,
                "job {} never logged {needle:?}; log:\n{text}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        let _ = output_with_timeout(
            self.env.command().args([
                "jobs",
                "kill",
                "--sandbox",
                &self.sandbox,
                "--grace",
                "1",
                &self.name,
            ]),
            Duration::from_secs(30),
        );
    }
}

/// Python's `http.server` on a free loopback port of the sandbox, serving `root`. Run through
/// a few lines rather than `python3 -m http.server`, whose listen backlog of 5 makes the
/// kernel drop SYNs under 100 parallel connects; the retransmits (1, 3, 7, 15 s...) would
/// measure Python, not the forward.
const HTTP_SERVER: &str = r#"
import functools, http.server, sys
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024
    daemon_threads = True
class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
srv = Server(("127.0.0.1", 0), functools.partial(Quiet, directory=sys.argv[1]))
print("Serving HTTP on 127.0.0.1 port", srv.server_address[1], flush=True)
srv.serve_forever()
"#;

pub fn http_server<'a>(env: &'a RsbEnv, sandbox: &str, root: &Path) -> (Job<'a>, u16) {
    let script = root.parent().unwrap().join("rsb_test_http.py");
    std::fs::write(&script, HTTP_SERVER).unwrap();
    let job = Job::start(
        env,
        sandbox,
        "http",
        root,
        &format!(
            "exec python3 -u '{}' '{}'",
            script.display(),
            root.display()
        ),
    );
    // "Serving HTTP on 127.0.0.1 port 43215 (http://127.0.0.1:43215/) ..."
    let line = job.wait_line("Serving HTTP on", Duration::from_secs(20));
    let port = line
        .split_whitespace()
        .skip_while(|w| *w != "port")
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    (job, port)
}

/// A running `rsb --json forward ...`; its JSON lines are collected as they arrive.
pub struct RsbForward {
    child: Child,
    pub lines: Arc<Mutex<Vec<Value>>>,
    pub listening: Value,
    pub addr: SocketAddr,
}

impl RsbForward {
    pub fn spawn(env: &RsbEnv, args: &[&str]) -> RsbForward {
        let mut child = env
            .command()
            .arg("--json")
            .arg("forward")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let l2 = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v = serde_json::from_str(&line).unwrap_or(json!({"unparsed": line}));
                l2.lock().unwrap().push(v);
            }
        });
        let mut f = RsbForward {
            child,
            lines,
            listening: Value::Null,
            addr: "127.0.0.1:1".parse().unwrap(),
        };
        let first = f.wait_event(|v| v["event"] == "listening" || v["event"] == "error", 60);
        assert_eq!(
            first["event"], "listening",
            "rsb forward did not start: {first}"
        );
        f.addr = first["local_address"].as_str().unwrap().parse().unwrap();
        f.listening = first;
        f
    }

    /// The first line matching `pred`, waiting up to `secs`.
    pub fn wait_event(&mut self, pred: impl Fn(&Value) -> bool, secs: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(v) = self.lines.lock().unwrap().iter().find(|v| pred(v)) {
                return v.clone();
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                // Let the reader thread drain what is left.
                std::thread::sleep(Duration::from_millis(200));
                if let Some(v) = self.lines.lock().unwrap().iter().find(|v| pred(v)) {
                    return v.clone();
                }
                panic!(
                    "rsb forward exited ({st}) before the expected line; lines: {:?}",
                    self.lines.lock().unwrap()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no expected line within {secs}s; lines: {:?}",
                self.lines.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn count(&self, pred: impl Fn(&Value) -> bool) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|v| pred(v))
            .count()
    }

    /// Wait up to `secs` until at least `n` lines match `pred`; returns the count.
    pub fn wait_count(&self, pred: impl Fn(&Value) -> bool, n: usize, secs: u64) -> usize {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let c = self.count(&pred);
            if c >= n || Instant::now() > deadline {
                return c;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Ctrl-C, as a user would; returns the exit status (bounded wait, then SIGKILL).
    pub fn interrupt(&mut self) -> std::process::ExitStatus {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100));
                return st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("rsb forward did not stop within 10 s of SIGINT");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RsbForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ssh -N -L` on the same sshd, the reference the benchmark compares against.
pub struct SshForward(Child);

impl SshForward {
    pub fn spawn(sshd: &Sshd, local_port: u16, remote_port: u16) -> SshForward {
        let child = Command::new("ssh")
            .args(sshd.ssh_options())
            .args(["-N", "-o", "ExitOnForwardFailure=yes", "-p"])
            .arg(sshd.port().to_string())
            .arg("-L")
            .arg(format!("127.0.0.1:{local_port}:127.0.0.1:{remote_port}"))
            .arg(format!("{}@127.0.0.1", sshd.user()))
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", local_port)).is_err() {
            assert!(Instant::now() < deadline, "ssh -L never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        SshForward(child)
    }
}

impl Drop for SshForward {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.0 GET; the body is handed to `sink` as it arrives. Returns the status code and
/// the body length. Bounded by `within`.
pub async fn http_get_with(
    addr: SocketAddr,
    path: &str,
    within: Duration,
    mut sink: impl FnMut(&[u8]),
) -> Result<(u16, u64), String> {
    let work = async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut buf = vec![0u8; 256 * 1024];
        let mut head = Vec::new();
        let mut status = None;
        let mut len = 0u64;
        loop {
            let n = s.read(&mut buf).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                break;
            }
            if status.is_none() {
                head.extend_from_slice(&buf[..n]);
                if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                    let text = String::from_utf8_lossy(&head[..end]).into_owned();
                    let code = text
                        .split_whitespace()
                        .nth(1)
                        .and_then(|c| c.parse().ok())
                        .ok_or_else(|| format!("bad status line: {text:?}"))?;
                    status = Some(code);
                    let body = head.split_off(end + 4);
                    sink(&body);
                    len += body.len() as u64;
                }
            } else {
                sink(&buf[..n]);
                len += n as u64;
            }
        }
        status
            .map(|c| (c, len))
            .ok_or_else(|| "connection closed before the headers".to_string())
    };
    tokio::time::timeout(within, work)
        .await
        .map_err(|_| format!("no complete answer within {within:?}"))?
}

/// GET `path` and return (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, Vec<u8>), String> {
    let mut body = Vec::new();
    let (code, _) = http_get_with(addr, path, Duration::from_secs(30), |b| {
        body.extend_from_slice(b)
    })
    .await?;
    Ok((code, body))
}
