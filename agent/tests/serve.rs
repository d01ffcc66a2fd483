//! `rsb-agent serve` driven as a child process over real pipes, the way rsb drives it over SSH.
//!
//! The client here is deliberately tiny and synchronous: a reader thread decodes frames into a
//! channel, and every wait is a `recv_timeout`, so a hung agent fails a test instead of hanging it.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rsb_protocol::{
    AgentError, Captured, Chunk, ErrorCode, ExecRequest, ExecResult, FileKind, FromAgent, Hello,
    ListDirRequest, ListDirResult, MAGIC, PROTOCOL_VERSION, ReadFileRequest, ReadFileResult, Reply,
    Request, StatRequest, ToAgent, decode, encode,
};

/// The agent under test: this build's binary, or `RSB_TEST_AGENT` (e.g. the static musl
/// release build, to run the same checks against what is actually deployed).
fn agent_bin() -> String {
    std::env::var("RSB_TEST_AGENT").unwrap_or_else(|_| env!("CARGO_BIN_EXE_rsb-agent").to_string())
}
/// Upper bound for any single wait on the agent in these tests.
const PATIENCE: Duration = Duration::from_secs(20);

fn read_frame(r: &mut impl Read) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    r.read_exact(&mut body).ok()?;
    Some(body)
}

fn write_frame(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    w.write_all(&(body.len() as u32).to_be_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// A running agent and a minimal client for it.
struct Agent {
    child: Child,
    stdin: Option<ChildStdin>,
    frames: Receiver<FromAgent>,
    /// Frames read while waiting for something else, in arrival order.
    stash: Vec<FromAgent>,
    stderr: Option<JoinHandle<String>>,
    hello: Hello,
    next_id: u64,
}

impl Agent {
    fn start() -> Agent {
        Self::start_with(Command::new(agent_bin()).arg("serve"))
    }

    fn start_with(cmd: &mut Command) -> Agent {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the agent");
        let mut stdout = child.stdout.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let (tx, frames) = mpsc::channel();
        std::thread::spawn(move || {
            while let Some(body) = read_frame(&mut stdout) {
                let msg: FromAgent = decode(&body).expect("the agent sent an undecodable frame");
                if tx.send(msg).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let stdin = child.stdin.take();
        let first = frames
            .recv_timeout(PATIENCE)
            .expect("no Hello from the agent");
        let FromAgent::Hello(hello) = first else {
            panic!("first frame is not Hello: {first:?}")
        };
        Agent {
            child,
            stdin,
            frames,
            stash: Vec::new(),
            stderr: Some(stderr),
            hello,
            next_id: 1,
        }
    }

    fn send(&mut self, msg: &ToAgent) {
        let body = encode(msg).unwrap();
        write_frame(self.stdin.as_mut().expect("stdin is open"), &body)
            .expect("write to the agent");
    }

    fn request(&mut self, body: Request) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&ToAgent::Request { id, body });
        id
    }

    fn recv(&mut self, deadline: Instant) -> FromAgent {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.frames.recv_timeout(left) {
            Ok(f) => f,
            Err(RecvTimeoutError::Timeout) => panic!("timed out waiting for the agent"),
            Err(RecvTimeoutError::Disconnected) => panic!("the agent closed its stdout"),
        }
    }

    /// Chunks and the final reply of request `id`; other frames are kept for later calls.
    fn wait_reply(&mut self, id: u64, within: Duration) -> (Vec<Chunk>, Reply) {
        let deadline = Instant::now() + within;
        let mut chunks = Vec::new();
        let mut rest = Vec::new();
        let mut found = None;
        for f in std::mem::take(&mut self.stash) {
            match f {
                FromAgent::Chunk { id: i, chunk } if i == id && found.is_none() => {
                    chunks.push(chunk)
                }
                FromAgent::Reply { id: i, body } if i == id && found.is_none() => {
                    found = Some(body)
                }
                other => rest.push(other),
            }
        }
        self.stash = rest;
        while found.is_none() {
            match self.recv(deadline) {
                FromAgent::Chunk { id: i, chunk } if i == id => chunks.push(chunk),
                FromAgent::Reply { id: i, body } if i == id => found = Some(body),
                other => self.stash.push(other),
            }
        }
        (chunks, found.unwrap())
    }

    /// The next chunk of request `id` (for commands that announce their pgid).
    fn wait_chunk(&mut self, id: u64, within: Duration) -> Chunk {
        let deadline = Instant::now() + within;
        if let Some(pos) = self
            .stash
            .iter()
            .position(|f| matches!(f, FromAgent::Chunk { id: i, .. } if *i == id))
        {
            let FromAgent::Chunk { chunk, .. } = self.stash.remove(pos) else {
                unreachable!()
            };
            return chunk;
        }
        loop {
            match self.recv(deadline) {
                FromAgent::Chunk { id: i, chunk } if i == id => return chunk,
                FromAgent::Reply { id: i, body } if i == id => {
                    panic!("request ended early: {body:?}")
                }
                other => self.stash.push(other),
            }
        }
    }

    fn call(&mut self, body: Request) -> Reply {
        let id = self.request(body);
        self.wait_reply(id, PATIENCE).1
    }

    fn exec(&mut self, req: ExecRequest) -> ExecResult {
        match self.call(Request::Exec(req)) {
            Reply::Exec(r) => r,
            other => panic!("expected an exec result, got {other:?}"),
        }
    }

    fn close_stdin(&mut self) {
        self.stdin = None;
    }

    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not exit within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Everything the agent wrote to stderr; only complete once it has exited.
    fn stderr_text(&mut self) -> String {
        self.stderr
            .take()
            .map(|h| h.join().unwrap())
            .unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn exec_req(cmd: &str) -> ExecRequest {
    ExecRequest::new(cmd)
}

fn text(c: &Captured) -> String {
    let mut v = c.head.clone();
    v.extend_from_slice(&c.tail);
    String::from_utf8(v).unwrap()
}

fn expect_error(reply: Reply, code: ErrorCode) -> AgentError {
    match reply {
        Reply::Error(e) if e.code == code => e,
        other => panic!("expected a {code:?} error, got {other:?}"),
    }
}

/// No live process is left in the group. Zombies count as gone: an init that does not reap
/// orphans (as in some containers) leaves them behind, but they run nothing.
fn group_gone(pgid: i32) -> bool {
    // SAFETY: signal 0 only probes.
    if unsafe { libc::kill(-pgid, 0) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    !dir.flatten().any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            return false;
        };
        let f: Vec<&str> = rest.split_whitespace().take(3).collect();
        f.len() == 3 && f[2].parse::<i32>().ok() == Some(pgid) && f[0] != "Z"
    })
}

fn first_line_pgid(c: &Captured) -> i32 {
    let t = text(c);
    t.lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("no pgid in {t:?}"))
}

fn unique(tag: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{tag}-{}-{n}", std::process::id())
}

#[test]
fn hello_describes_this_agent() {
    let mut agent = Agent::start();
    let h = agent.hello.clone();
    assert_eq!(h.magic, MAGIC);
    assert_eq!(h.protocol_version, PROTOCOL_VERSION);
    assert_eq!(h.agent_version, env!("CARGO_PKG_VERSION"));
    let bytes = std::fs::read(agent_bin()).unwrap();
    assert_eq!(h.agent_hash, blake3::hash(&bytes).to_hex().to_string());
    assert_eq!(h.os, "linux");
    assert_eq!(h.arch, std::env::consts::ARCH);
    assert_eq!(h.pid, agent.child.id());
    // SAFETY: getuid has no preconditions.
    assert_eq!(h.uid, unsafe { libc::getuid() });
    assert_eq!(
        h.kernel,
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap()
            .trim()
    );
    assert_eq!(
        h.hostname,
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim()
    );
    assert_eq!(h.home, std::env::var("HOME").unwrap());
    assert!(!h.user.is_empty());
    assert!(h.capabilities.bash);
    assert!(!h.capabilities.nvml);
    agent.close_stdin();
    assert!(agent.wait_exit(PATIENCE).success());
}

#[test]
fn version_and_hash_subcommands() {
    let bin = agent_bin();
    let out = Command::new(&bin).arg("version").output().unwrap();
    assert!(out.status.success());
    let hash = blake3::hash(&std::fs::read(&bin).unwrap())
        .to_hex()
        .to_string();
    let line = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        line,
        format!(
            "rsb-agent {} (protocol {PROTOCOL_VERSION}, blake3 {hash}, {})\n",
            env!("CARGO_PKG_VERSION"),
            std::env::consts::ARCH
        )
    );

    let out = Command::new(&bin)
        .args(["hash", &bin, "/nonexistent-rsb-file"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "a missing file makes hash fail");
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{hash}  {bin}\n")
    );
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("/nonexistent-rsb-file")
    );
}

#[test]
fn ping_echoes_its_payload() {
    let mut agent = Agent::start();
    let payload: Vec<u8> = (0..=255u8).cycle().take(1 << 20).collect();
    match agent.call(Request::Ping(rsb_protocol::PingRequest {
        payload: payload.clone(),
    })) {
        Reply::Pong(p) => assert_eq!(p, payload),
        other => panic!("{other:?}"),
    }
}

#[test]
fn fifty_concurrent_execs_keep_their_output_apart() {
    let mut agent = Agent::start();
    let tag = unique("echo");
    let ids: Vec<(usize, u64)> = (0..50)
        .map(|i| {
            let cmd = if i % 10 == 0 {
                format!("echo {tag}-{i}; echo err-{tag}-{i} >&2; exit {}", i / 10)
            } else {
                format!("echo {tag}-{i}")
            };
            (i, agent.request(Request::Exec(exec_req(&cmd))))
        })
        .collect();
    for (i, id) in ids {
        let Reply::Exec(r) = agent.wait_reply(id, PATIENCE).1 else {
            panic!("exec {i} failed")
        };
        assert_eq!(text(&r.stdout), format!("{tag}-{i}\n"));
        if i % 10 == 0 {
            assert_eq!(text(&r.stderr), format!("err-{tag}-{i}\n"));
            assert_eq!(r.exit_code, Some((i / 10) as i32));
        } else {
            assert_eq!(r.stderr.total, 0);
            assert_eq!(r.exit_code, Some(0));
        }
    }
}

#[test]
fn timeout_terminates_the_whole_group() {
    let mut agent = Agent::start();
    let mut req = exec_req("echo $$; sleep 30");
    req.timeout_ms = 2000;
    let t = Instant::now();
    let r = agent.exec(req);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(
        took >= Duration::from_millis(1900),
        "returned before the timeout: {took:?}"
    );
    assert!(r.timed_out && !r.cancelled);
    assert_eq!((r.exit_code, r.signal), (None, Some(libc::SIGTERM)));
    let pgid = first_line_pgid(&r.stdout);
    assert!(
        group_gone(pgid),
        "process group {pgid} survived the timeout"
    );
}

#[test]
fn a_group_ignoring_sigterm_is_killed_after_the_grace() {
    let mut agent = Agent::start();
    let mut req = exec_req("trap '' TERM; echo $$; sleep 30");
    req.timeout_ms = 1000;
    req.kill_grace_ms = 500;
    let t = Instant::now();
    let r = agent.exec(req);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(
        took >= Duration::from_millis(1400),
        "SIGKILL came before the grace ended: {took:?}"
    );
    assert!(r.timed_out);
    assert_eq!(r.signal, Some(libc::SIGKILL));
    let pgid = first_line_pgid(&r.stdout);
    assert!(group_gone(pgid), "process group {pgid} survived SIGKILL");
}

#[test]
fn exit_124_is_not_a_timeout() {
    let mut agent = Agent::start();
    let r = agent.exec(exec_req("exit 124"));
    assert_eq!(r.exit_code, Some(124));
    assert_eq!(r.signal, None);
    assert!(!r.timed_out && !r.cancelled);
}

#[test]
fn cwd_and_env_are_data() {
    let mut agent = Agent::start();
    let dir = PathBuf::from(format!("/tmp/a b {}", unique("cwd")));
    std::fs::create_dir_all(&dir).unwrap();
    let mut req = exec_req("pwd; printf '%s' \"$RSB_T\"");
    req.cwd = Some(dir.to_str().unwrap().to_string());
    req.env = vec![("RSB_T".into(), "x; $(touch /tmp/nope) `id`".into())];
    let r = agent.exec(req);
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(
        text(&r.stdout),
        format!("{}\nx; $(touch /tmp/nope) `id`", dir.display())
    );
    std::fs::remove_dir(&dir).unwrap();

    let pwned = format!("/tmp/pwned-{}", unique("cwd"));
    let mut req = exec_req("echo ran");
    req.cwd = Some(format!("/tmp; touch {pwned}"));
    let e = expect_error(agent.call(Request::Exec(req)), ErrorCode::NotFound);
    assert!(e.message.contains("/tmp; touch"), "{}", e.message);
    assert!(
        !Path::new(&pwned).exists(),
        "the cwd was interpreted by a shell"
    );

    // A file is not a directory, and the command does not run there either.
    let marker = format!("/tmp/{}", unique("ran"));
    let mut req = exec_req(&format!("touch {marker}"));
    req.cwd = Some("/etc/hostname".into());
    expect_error(agent.call(Request::Exec(req)), ErrorCode::NotADirectory);
    assert!(!Path::new(&marker).exists());

    let mut req = exec_req("pwd");
    req.cwd = Some("~".into());
    assert_eq!(
        text(&agent.exec(req).stdout).trim_end(),
        std::env::var("HOME").unwrap()
    );
}

#[test]
fn stdin_is_closed() {
    let mut agent = Agent::start();
    let t = Instant::now();
    let mut req = exec_req("cat");
    req.timeout_ms = 10_000;
    let r = agent.exec(req);
    assert_eq!(r.exit_code, Some(0));
    assert!(!r.timed_out);
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[test]
fn large_output_stays_within_the_caps() {
    let mut agent = Agent::start();
    let mut req = exec_req("head -c 10000000 /dev/zero; printf 'END' ; printf 'abc' >&2");
    req.max_stdout = 1000;
    req.max_stderr = 1000;
    let r = agent.exec(req);
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.stdout.total, 10_000_003);
    assert_eq!((r.stdout.head.len(), r.stdout.tail.len()), (500, 500));
    assert!(r.stdout.head.iter().all(|&b| b == 0));
    assert!(r.stdout.tail.ends_with(b"END"));
    assert_eq!(r.stdout.omitted(), 10_000_003 - 1000);
    // Within the cap: everything in head.
    assert_eq!(
        (
            r.stderr.head.as_slice(),
            r.stderr.tail.len(),
            r.stderr.total
        ),
        (&b"abc"[..], 0, 3)
    );

    // Exactly at the cap is not truncated.
    let mut req = exec_req("head -c 1000 /dev/zero");
    req.max_stdout = 1000;
    let r = agent.exec(req);
    assert_eq!((r.stdout.head.len(), r.stdout.tail.len()), (1000, 0));
    assert!(!r.stdout.truncated());
}

#[test]
fn output_is_byte_exact() {
    let mut agent = Agent::start();
    let r = agent.exec(exec_req(
        r"printf '\xff\xfe\x00abc\x80\n'; printf '\xc3\x28' >&2",
    ));
    assert_eq!(r.stdout.head, b"\xff\xfe\x00abc\x80\n");
    assert_eq!(r.stderr.head, b"\xc3\x28");
}

#[test]
fn streamed_chunks_precede_the_reply_and_match_it() {
    let mut agent = Agent::start();
    let mut req = exec_req("for i in 1 2 3; do echo out$i; sleep 0.05; done; echo oops >&2");
    req.stream = true;
    let id = agent.request(Request::Exec(req));
    let (chunks, reply) = agent.wait_reply(id, PATIENCE);
    let Reply::Exec(r) = reply else {
        panic!("{reply:?}")
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    for c in chunks {
        match c {
            Chunk::Stdout(b) => out.extend(b),
            Chunk::Stderr(b) => err.extend(b),
            other => panic!("exec streamed a non-output chunk: {other:?}"),
        }
    }
    assert_eq!(out, b"out1\nout2\nout3\n");
    assert_eq!(err, b"oops\n");
    assert_eq!(r.stdout.head, out);
    assert_eq!(r.stderr.head, err);
    // Nothing for this request may arrive after its reply.
    let pong = agent.call(Request::Ping(rsb_protocol::PingRequest {
        payload: vec![1],
    }));
    assert_eq!(pong, Reply::Pong(vec![1]));
    assert!(
        agent
            .stash
            .iter()
            .all(|f| !matches!(f, FromAgent::Chunk { id: i, .. } if *i == id))
    );
}

#[test]
fn background_children_do_not_hold_the_reply() {
    let mut agent = Agent::start();
    let t = Instant::now();
    let r = agent.exec(exec_req("sleep 100 & echo $!"));
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(r.exit_code, Some(0));
    assert!(!r.timed_out);
    let pid: i32 = text(&r.stdout).trim().parse().unwrap();
    // SAFETY: plain kill of the sleep this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

#[test]
fn cancel_stops_a_running_exec() {
    let mut agent = Agent::start();
    let mut req = exec_req("echo $$; sleep 30");
    req.stream = true;
    req.timeout_ms = 0;
    let id = agent.request(Request::Exec(req));
    let Chunk::Stdout(first) = agent.wait_chunk(id, PATIENCE) else {
        panic!("expected stdout")
    };
    let pgid: i32 = String::from_utf8(first).unwrap().trim().parse().unwrap();
    let t = Instant::now();
    agent.send(&ToAgent::Cancel { id });
    let (_, reply) = agent.wait_reply(id, PATIENCE);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "cancel took {:?}",
        t.elapsed()
    );
    let Reply::Exec(r) = reply else {
        panic!("{reply:?}")
    };
    assert!(r.cancelled && !r.timed_out);
    assert_eq!(r.signal, Some(libc::SIGTERM));
    assert!(group_gone(pgid), "process group {pgid} survived the cancel");
    // The channel is still usable, and cancelling a finished request is harmless.
    agent.send(&ToAgent::Cancel { id });
    assert_eq!(
        agent.call(Request::Ping(rsb_protocol::PingRequest { payload: vec![] })),
        Reply::Pong(vec![])
    );
}

#[test]
fn stdin_eof_kills_running_commands_and_exits() {
    let mut agent = Agent::start();
    let mut req = exec_req("echo $$; sleep 30");
    req.stream = true;
    req.timeout_ms = 0;
    let id = agent.request(Request::Exec(req));
    let Chunk::Stdout(first) = agent.wait_chunk(id, PATIENCE) else {
        panic!("expected stdout")
    };
    let pgid: i32 = String::from_utf8(first).unwrap().trim().parse().unwrap();
    agent.close_stdin();
    let (_, reply) = agent.wait_reply(id, Duration::from_secs(5));
    let Reply::Exec(r) = reply else {
        panic!("{reply:?}")
    };
    assert!(r.cancelled);
    let st = agent.wait_exit(Duration::from_secs(5));
    assert!(st.success(), "{st:?}");
    assert!(
        group_gone(pgid),
        "process group {pgid} outlived the agent's stdin"
    );
}

#[test]
fn garbage_frames_end_the_agent_without_a_panic() {
    // A well-framed body that is not a message, and a length prefix beyond the frame limit.
    let bad: [&[u8]; 2] = [
        &[0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff, 0xff],
        &[0xff, 0xff, 0xff, 0xff, 1, 2, 3],
    ];
    for bytes in bad {
        let mut agent = Agent::start();
        let stdin = agent.stdin.as_mut().unwrap();
        stdin.write_all(bytes).unwrap();
        stdin.flush().unwrap();
        let st = agent.wait_exit(Duration::from_secs(5));
        assert!(!st.success() && st.code().is_some(), "{st:?}");
        let err = agent.stderr_text();
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains("closing the channel"), "{err}");
    }
}

#[test]
fn a_closed_stdout_ends_the_agent_quietly() {
    let mut child = Command::new(agent_bin())
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let hello: FromAgent = decode(&read_frame(&mut stdout).unwrap()).unwrap();
    assert!(matches!(hello, FromAgent::Hello(_)));
    let mut stdin = child.stdin.take().unwrap();
    let mut req = exec_req("head -c 8000000 /dev/zero");
    req.max_stdout = 8_000_000;
    let body = encode(&ToAgent::Request {
        id: 1,
        body: Request::Exec(req),
    })
    .unwrap();
    write_frame(&mut stdin, &body).unwrap();
    // Let the agent start writing the 8 MB reply (it blocks on the full pipe), then go away.
    std::thread::sleep(Duration::from_millis(300));
    drop(stdout);
    // stdin stays open: the agent must notice the dead stdout on its own.
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the agent kept running with stdout closed"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.code().is_some(), "killed by a signal: {status:?}");
    assert!(!err.contains("panicked"), "{err}");
    drop(stdin);
}

/// A tree used by the fs tests:
/// a.txt, b/, b/c.bin, b/d/, b/d/e.txt, link -> b, z.txt
fn fs_tree() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    std::fs::write(r.join("a.txt"), "hello").unwrap();
    std::fs::create_dir_all(r.join("b/d")).unwrap();
    std::fs::write(r.join("b/c.bin"), (0..=255u8).collect::<Vec<_>>()).unwrap();
    std::fs::write(r.join("b/d/e.txt"), "e").unwrap();
    std::os::unix::fs::symlink("b", r.join("link")).unwrap();
    std::fs::write(r.join("z.txt"), "z").unwrap();
    std::fs::set_permissions(r.join("a.txt"), std::fs::Permissions::from_mode(0o640)).unwrap();
    t
}

fn list(agent: &mut Agent, path: &str, recursive: bool, max_entries: u64) -> ListDirResult {
    match agent.call(Request::ListDir(ListDirRequest {
        path: path.into(),
        recursive,
        max_entries,
        confine: None,
    })) {
        Reply::ListDir(r) => r,
        other => panic!("{other:?}"),
    }
}

fn rels(r: &ListDirResult) -> Vec<&str> {
    r.entries.iter().map(|e| e.rel.as_str()).collect()
}

#[test]
fn stat_describes_files_links_and_dirs() {
    let tree = fs_tree();
    let root = tree.path().to_str().unwrap().to_string();
    let mut agent = Agent::start_with(Command::new(agent_bin()).arg("serve").env("HOME", &root));
    let stat = |agent: &mut Agent, path: &str, follow: bool| {
        agent.call(Request::Stat(StatRequest {
            path: path.into(),
            follow,
            confine: None,
        }))
    };

    let Reply::Stat(s) = stat(&mut agent, "~/a.txt", false) else {
        panic!()
    };
    let meta = std::fs::metadata(tree.path().join("a.txt")).unwrap();
    assert_eq!(s.path, format!("{root}/a.txt"));
    assert_eq!((s.kind, s.size, s.mode), (FileKind::File, 5, 0o640));
    use std::os::unix::fs::MetadataExt;
    assert_eq!(s.mtime_ns, meta.mtime() * 1_000_000_000 + meta.mtime_nsec());
    assert_eq!(s.symlink_target, None);

    let Reply::Stat(s) = stat(&mut agent, &format!("{root}/link"), false) else {
        panic!()
    };
    assert_eq!(
        (s.kind, s.symlink_target.as_deref()),
        (FileKind::Symlink, Some("b"))
    );
    let Reply::Stat(s) = stat(&mut agent, &format!("{root}/link"), true) else {
        panic!()
    };
    assert_eq!(
        (s.kind, s.symlink_target.as_deref()),
        (FileKind::Dir, Some("b"))
    );

    let Reply::Stat(s) = stat(&mut agent, "~", true) else {
        panic!()
    };
    assert_eq!((s.kind, s.path.as_str()), (FileKind::Dir, root.as_str()));

    let e = expect_error(
        stat(&mut agent, &format!("{root}/missing"), false),
        ErrorCode::NotFound,
    );
    assert!(e.message.contains("/missing"), "{}", e.message);
}

#[test]
fn list_dir_is_sorted_exact_and_does_not_follow_links() {
    let tree = fs_tree();
    let root = tree.path().to_str().unwrap().to_string();
    let mut agent = Agent::start();

    let r = list(&mut agent, &root, false, 100);
    assert_eq!(rels(&r), ["a.txt", "b", "link", "z.txt"]);
    let kinds: Vec<FileKind> = r.entries.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            FileKind::File,
            FileKind::Dir,
            FileKind::Symlink,
            FileKind::File
        ]
    );
    assert!(!r.truncated && r.errors.is_empty());
    assert_eq!(r.root, root);

    let all = ["a.txt", "b", "b/c.bin", "b/d", "b/d/e.txt", "link", "z.txt"];
    let r = list(&mut agent, &root, true, 100);
    assert_eq!(rels(&r), all);
    assert_eq!(r.entries[2].size, 256);
    assert_eq!(r.entries[0].mode, 0o640);

    // Exactly max_entries entries exist: not truncated. One fewer allowed: truncated.
    let r = list(&mut agent, &root, true, 7);
    assert_eq!((rels(&r).len(), r.truncated), (7, false));
    for n in [0usize, 1, 3, 6] {
        let r = list(&mut agent, &root, true, n as u64);
        assert_eq!(rels(&r), all[..n], "max_entries {n}");
        assert!(r.truncated, "max_entries {n}");
    }
    // The last entry is a directory whose only content is beyond the cap.
    let r = list(&mut agent, &format!("{root}/b"), true, 2);
    assert_eq!((rels(&r), r.truncated), (vec!["c.bin", "d"], true));
    std::fs::remove_file(tree.path().join("b/d/e.txt")).unwrap();
    let r = list(&mut agent, &format!("{root}/b"), true, 2);
    assert_eq!((rels(&r), r.truncated), (vec!["c.bin", "d"], false));

    expect_error(
        agent.call(Request::ListDir(ListDirRequest {
            path: format!("{root}/nope"),
            recursive: false,
            max_entries: 10,
            confine: None,
        })),
        ErrorCode::NotFound,
    );
    expect_error(
        agent.call(Request::ListDir(ListDirRequest {
            path: format!("{root}/a.txt"),
            recursive: true,
            max_entries: 10,
            confine: None,
        })),
        ErrorCode::NotADirectory,
    );
}

#[test]
fn list_dir_reports_unreadable_subdirs_as_errors() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        eprintln!("skipped: root can read any directory, so there is nothing unreadable to list");
        return;
    }
    let tree = fs_tree();
    let locked = tree.path().join("b/d");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    let mut agent = Agent::start();
    let r = list(&mut agent, tree.path().to_str().unwrap(), true, 100);
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(rels(&r), ["a.txt", "b", "b/c.bin", "b/d", "link", "z.txt"]);
    assert_eq!(r.errors.len(), 1);
    assert!(r.errors[0].starts_with("b/d: "), "{:?}", r.errors);
}

#[test]
fn read_file_reads_ranges_and_refuses_what_is_not_a_file() {
    let tree = fs_tree();
    let root = tree.path().to_str().unwrap().to_string();
    let mut agent = Agent::start();
    let mut read = |path: String, offset: u64, max_bytes: u64| {
        agent.call(Request::ReadFile(ReadFileRequest {
            path,
            offset,
            max_bytes,
            confine: None,
        }))
    };
    let ok = |r: Reply| -> ReadFileResult {
        match r {
            Reply::ReadFile(r) => r,
            other => panic!("{other:?}"),
        }
    };

    let r = ok(read(format!("{root}/a.txt"), 0, 100));
    assert_eq!(
        (r.data.as_slice(), r.size, r.truncated),
        (&b"hello"[..], 5, false)
    );
    let r = ok(read(format!("{root}/a.txt"), 1, 2));
    assert_eq!(
        (r.data.as_slice(), r.offset, r.truncated),
        (&b"el"[..], 1, true)
    );
    let r = ok(read(format!("{root}/a.txt"), 3, 2));
    assert_eq!((r.data.as_slice(), r.truncated), (&b"lo"[..], false));
    let r = ok(read(format!("{root}/a.txt"), 9, 2));
    assert_eq!((r.data.len(), r.size, r.truncated), (0, 5, false));
    let r = ok(read(format!("{root}/b/c.bin"), 0, 1 << 20));
    assert_eq!(r.data, (0..=255u8).collect::<Vec<_>>());

    expect_error(read(format!("{root}/missing"), 0, 10), ErrorCode::NotFound);
    expect_error(read(format!("{root}/b"), 0, 10), ErrorCode::IsADirectory);

    let fifo = tree.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let t = Instant::now();
    let e = expect_error(
        read(fifo.to_str().unwrap().to_string(), 0, 10),
        ErrorCode::InvalidArgument,
    );
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(e.message.contains("not a regular file"), "{}", e.message);
}

#[test]
fn read_file_is_clamped_to_one_frame() {
    let t = tempfile::tempdir().unwrap();
    let big = t.path().join("big");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(20 << 20).unwrap();
    let mut agent = Agent::start();
    let reply = agent.call(Request::ReadFile(ReadFileRequest {
        path: big.to_str().unwrap().into(),
        offset: 0,
        max_bytes: u64::MAX,
        confine: None,
    }));
    let Reply::ReadFile(r) = reply else {
        panic!("{reply:?}")
    };
    assert!(r.truncated);
    assert_eq!(r.size, 20 << 20);
    assert!(r.data.len() > 15 << 20 && r.data.len() < rsb_protocol::MAX_FRAME);
}

#[test]
fn requests_with_a_duplicate_id_are_refused() {
    let mut agent = Agent::start();
    let mut req = exec_req("sleep 0.5; echo first");
    req.timeout_ms = 5000;
    agent.send(&ToAgent::Request {
        id: 77,
        body: Request::Exec(req),
    });
    agent.send(&ToAgent::Request {
        id: 77,
        body: Request::Ping(rsb_protocol::PingRequest { payload: vec![] }),
    });
    let (_, reply) = agent.wait_reply(77, PATIENCE);
    let e = expect_error(reply, ErrorCode::InvalidArgument);
    assert!(e.message.contains("already in flight"));
    let Reply::Exec(r) = agent.wait_reply(77, PATIENCE).1 else {
        panic!()
    };
    assert_eq!(text(&r.stdout), "first\n");
}

/// The aarch64 musl agent under qemu: proves the cross build runs, not just links.
#[test]
fn aarch64_agent_under_qemu() {
    // Where scripts/build-agents.sh puts it (and where rsb's build embeds it from).
    let agents = std::env::var_os("RSB_EMBED_AGENTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/agents"));
    let agent_path = agents.join("aarch64-unknown-linux-musl/rsb-agent");
    let qemu = [
        "/usr/bin/qemu-aarch64-static",
        "/usr/local/bin/qemu-aarch64-static",
    ]
    .into_iter()
    .map(Path::new)
    .find(|p| p.exists());
    let required = std::env::var("RSB_REQUIRE_AARCH64").is_ok_and(|v| v == "1");
    let (Some(qemu), true) = (qemu, agent_path.exists()) else {
        let msg = format!(
            "aarch64 agent test needs qemu-aarch64-static and {} (build it with scripts/build-agents.sh)",
            agent_path.display()
        );
        assert!(!required, "RSB_REQUIRE_AARCH64=1 but: {msg}");
        eprintln!("skipped: {msg}");
        return;
    };
    let mut agent = Agent::start_with(Command::new(qemu).arg(&agent_path).arg("serve"));
    assert_eq!(agent.hello.arch, "aarch64");
    assert_eq!(agent.hello.magic, MAGIC);
    let hash = blake3::hash(&std::fs::read(&agent_path).unwrap())
        .to_hex()
        .to_string();
    assert_eq!(agent.hello.agent_hash, hash);
    assert_eq!(
        agent.call(Request::Ping(rsb_protocol::PingRequest {
            payload: b"arm".to_vec()
        })),
        Reply::Pong(b"arm".to_vec())
    );
    let r = agent.exec(exec_req("echo hi"));
    assert_eq!((text(&r.stdout).as_str(), r.exit_code), ("hi\n", Some(0)));
    agent.close_stdin();
    assert!(agent.wait_exit(PATIENCE).success());
}

#[test]
fn unknown_ids_and_parallel_reads_do_not_disturb_each_other() {
    let tree = fs_tree();
    let root = tree.path().to_str().unwrap().to_string();
    let mut agent = Agent::start();
    agent.send(&ToAgent::Cancel { id: 12345 });
    let ids: HashSet<u64> = (0..20)
        .map(|i| {
            let body = if i % 2 == 0 {
                Request::ReadFile(ReadFileRequest {
                    path: format!("{root}/a.txt"),
                    offset: 0,
                    max_bytes: 5,
                    confine: None,
                })
            } else {
                Request::Stat(StatRequest {
                    path: format!("{root}/z.txt"),
                    follow: false,
                    confine: None,
                })
            };
            agent.request(body)
        })
        .collect();
    for id in &ids {
        match agent.wait_reply(*id, PATIENCE).1 {
            Reply::ReadFile(r) => assert_eq!(r.data, b"hello"),
            Reply::Stat(s) => assert_eq!(s.size, 1),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_small_reply_overtakes_queued_bulk_replies() {
    let t = tempfile::tempdir().unwrap();
    let big = t.path().join("big");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let mut child = Command::new(agent_bin())
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    assert!(matches!(
        decode(&read_frame(&mut stdout).unwrap()).unwrap(),
        FromAgent::Hello(_)
    ));
    // Not reading stdout: the first 15 MiB reply fills the pipe and the others queue behind it.
    for id in 1..=3 {
        let body = Request::ReadFile(ReadFileRequest {
            path: big.to_str().unwrap().into(),
            offset: 0,
            max_bytes: 15 << 20,
            confine: None,
        });
        write_frame(&mut stdin, &encode(&ToAgent::Request { id, body }).unwrap()).unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    let ping = ToAgent::Request {
        id: 99,
        body: Request::Ping(rsb_protocol::PingRequest { payload: vec![7] }),
    };
    write_frame(&mut stdin, &encode(&ping).unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // Reading is bounded: four frames, then the agent is killed by the Drop below if stuck.
    let order: Vec<u64> = (0..4)
        .map(
            |_| match decode(&read_frame(&mut stdout).expect("a frame")).unwrap() {
                FromAgent::Reply { id, .. } => id,
                other => panic!("{other:?}"),
            },
        )
        .collect();
    let pong_at = order.iter().position(|&id| id == 99).unwrap();
    // At most the one bulk frame already being written may precede the pong.
    assert!(pong_at <= 1, "reply order {order:?}");
    drop(stdin);
    let deadline = Instant::now() + PATIENCE;
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the agent did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_slow_client_loses_no_streamed_output() {
    let mut child = Command::new(agent_bin())
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    assert!(matches!(
        decode(&read_frame(&mut stdout).unwrap()).unwrap(),
        FromAgent::Hello(_)
    ));
    let mut req = exec_req("head -c 3000000 /dev/zero");
    req.stream = true;
    req.max_stdout = 4_000_000;
    let body = encode(&ToAgent::Request {
        id: 1,
        body: Request::Exec(req),
    })
    .unwrap();
    write_frame(&mut stdin, &body).unwrap();
    // Not reading: the agent's writer and then its pipe reader block, and the command's last
    // bytes sit in its pipe when it exits, well past the agent's drain deadline.
    std::thread::sleep(Duration::from_millis(1500));
    let mut streamed = 0usize;
    let deadline = Instant::now() + PATIENCE;
    let result = loop {
        assert!(Instant::now() < deadline, "no reply");
        match decode(&read_frame(&mut stdout).expect("a frame")).unwrap() {
            FromAgent::Chunk {
                chunk: Chunk::Stdout(b),
                ..
            } => streamed += b.len(),
            FromAgent::Reply {
                body: Reply::Exec(r),
                ..
            } => break r,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(result.exit_code, Some(0));
    assert_eq!(result.stdout.total, 3_000_000);
    assert_eq!(result.stdout.head.len(), 3_000_000);
    assert_eq!(streamed, 3_000_000);
    drop(stdin);
    let _ = child.wait();
}

#[test]
fn output_read_before_the_drain_deadline_is_still_streamed() {
    let mut child = Command::new(agent_bin())
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    assert!(matches!(
        decode(&read_frame(&mut stdout).unwrap()).unwrap(),
        FromAgent::Hello(_)
    ));
    // A background writer fills the agent's queues (this client is not reading); then the main
    // process prints one last line and exits, so that line is read while every send is blocked,
    // and stays blocked far beyond the 200 ms drain.
    let mut req = exec_req("head -c 2000000 /dev/zero >&2 & sleep 0.5; printf last");
    req.stream = true;
    let body = encode(&ToAgent::Request {
        id: 1,
        body: Request::Exec(req),
    })
    .unwrap();
    write_frame(&mut stdin, &body).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let mut streamed = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    let result = loop {
        assert!(Instant::now() < deadline, "no reply");
        match decode(&read_frame(&mut stdout).expect("a frame")).unwrap() {
            FromAgent::Chunk {
                chunk: Chunk::Stdout(b),
                ..
            } => streamed.extend(b),
            FromAgent::Chunk { .. } => {}
            FromAgent::Reply {
                body: Reply::Exec(r),
                ..
            } => break r,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(result.stdout.head, b"last");
    assert_eq!(
        streamed, b"last",
        "the streamed output lost what the reply has"
    );
    drop(stdin);
    let _ = child.wait();
}

/// Starts `echo $$; sleep 1000` (a command bash must fork for) and returns its process group.
fn start_long_exec(agent: &mut Agent) -> (u64, i32) {
    let mut req = exec_req("echo $$; sleep 1000; :");
    req.stream = true;
    req.timeout_ms = 0;
    let id = agent.request(Request::Exec(req));
    let Chunk::Stdout(first) = agent.wait_chunk(id, PATIENCE) else {
        panic!("expected stdout")
    };
    (
        id,
        String::from_utf8(first).unwrap().trim().parse().unwrap(),
    )
}

fn wait_group_gone(pgid: i32, within: Duration) {
    let deadline = Instant::now() + within;
    while !group_gone(pgid) {
        if Instant::now() >= deadline {
            // SAFETY: cleanup of the test's own command group.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            panic!("process group {pgid} outlived the agent by {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_sigkilled_agent_leaves_no_orphans() {
    let mut agent = Agent::start();
    let (_, pgid) = start_long_exec(&mut agent);
    // A command that finished on its own left a background process on purpose: not an orphan.
    let done = agent.exec(exec_req("sleep 1000 >/dev/null 2>&1 & echo $!"));
    let bg: i32 = text(&done.stdout).trim().parse().unwrap();
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    wait_group_gone(pgid, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: probing and then killing the test's own background sleep.
    let alive = unsafe { libc::kill(bg, 0) } == 0;
    unsafe { libc::kill(bg, libc::SIGKILL) };
    assert!(alive, "a finished command's background process was killed");
}

#[test]
fn sigterm_and_sighup_stop_running_commands_and_exit() {
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        let mut agent = Agent::start();
        let (id, pgid) = start_long_exec(&mut agent);
        // SAFETY: signalling our own child.
        assert_eq!(unsafe { libc::kill(agent.child.id() as i32, sig) }, 0);
        let (_, reply) = agent.wait_reply(id, Duration::from_secs(5));
        assert!(
            matches!(reply, Reply::Exec(ref r) if r.cancelled),
            "{reply:?}"
        );
        let st = agent.wait_exit(Duration::from_secs(5));
        assert!(st.success(), "signal {sig}: {st:?}");
        wait_group_gone(pgid, Duration::from_secs(1));
    }
}

fn stdout_of(chunks: &[Chunk]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        if let Chunk::Stdout(b) = c {
            out.extend_from_slice(b);
        }
    }
    out
}

fn input(agent: &mut Agent, id: u64, input: rsb_protocol::ExecInput) {
    agent.send(&ToAgent::Input { id, input });
}

#[test]
fn stdin_is_fed_from_input_frames_and_acknowledged() {
    use rsb_protocol::ExecInput;
    let mut agent = Agent::start();
    let mut req = exec_req("wc -l");
    req.stdin = true;
    let id = agent.request(Request::Exec(req));
    input(&mut agent, id, ExecInput::Data(b"a\nb\n".to_vec()));
    input(&mut agent, id, ExecInput::Eof);
    let (chunks, reply) = agent.wait_reply(id, PATIENCE);
    let Reply::Exec(r) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(text(&r.stdout).trim(), "2");
    let acked: u64 = chunks
        .iter()
        .map(|c| match c {
            Chunk::InputConsumed(n) => *n,
            _ => 0,
        })
        .sum();
    assert_eq!(acked, 4, "{chunks:?}");

    // Several MiB within the window: the sender waits for acknowledgements, and every byte
    // arrives. A command that never reads its stdin still ends and acknowledges what it dropped.
    let mut req = exec_req("wc -c");
    req.stdin = true;
    let id = agent.request(Request::Exec(req));
    let total: u64 = 6 << 20;
    let piece = vec![b'x'; 64 * 1024];
    let (mut sent, mut acked) = (0u64, 0u64);
    let deadline = Instant::now() + PATIENCE;
    while sent < total {
        assert!(
            Instant::now() < deadline,
            "stalled at {sent} sent, {acked} acked"
        );
        if sent - acked + piece.len() as u64 <= rsb_protocol::INPUT_WINDOW {
            input(&mut agent, id, ExecInput::Data(piece.clone()));
            sent += piece.len() as u64;
            continue;
        }
        match agent.recv(deadline) {
            FromAgent::Chunk {
                id: i,
                chunk: Chunk::InputConsumed(n),
            } if i == id => acked += n,
            other => panic!("unexpected {other:?}"),
        }
    }
    input(&mut agent, id, ExecInput::Eof);
    let (_, reply) = agent.wait_reply(id, PATIENCE);
    let Reply::Exec(r) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(text(&r.stdout).trim(), total.to_string());

    let mut req = exec_req("exit 0");
    req.stdin = true;
    let id = agent.request(Request::Exec(req));
    for _ in 0..4 {
        input(&mut agent, id, ExecInput::Data(piece.clone()));
    }
    let (_, reply) = agent.wait_reply(id, PATIENCE);
    assert!(
        matches!(reply, Reply::Exec(ref r) if r.exit_code == Some(0)),
        "{reply:?}"
    );
    // Input for a finished request is dropped, and the channel carries on.
    input(&mut agent, id, ExecInput::Data(b"late".to_vec()));
    assert_eq!(
        agent.call(Request::Ping(rsb_protocol::PingRequest {
            payload: vec![7]
        })),
        Reply::Pong(vec![7])
    );
}

#[test]
fn a_tty_exec_runs_on_a_terminal_of_the_given_size_and_follows_resizes() {
    use rsb_protocol::{ExecInput, TtySize};
    let mut agent = Agent::start();
    let mut req = exec_req("tty; stty size; read line; stty size; echo \"got $line\"; exit 3");
    req.tty = Some(TtySize {
        rows: 40,
        cols: 100,
    });
    req.timeout_ms = 20_000;
    let id = agent.request(Request::Exec(req));
    // Wait until the first `stty size` ran, then resize and answer the `read`.
    let mut seen = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    while !String::from_utf8_lossy(&seen).contains("40 100") {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            String::from_utf8_lossy(&seen)
        );
        if let Chunk::Stdout(b) = agent.wait_chunk(id, PATIENCE) {
            seen.extend_from_slice(&b);
        }
    }
    input(
        &mut agent,
        id,
        ExecInput::Resize(TtySize {
            rows: 50,
            cols: 132,
        }),
    );
    input(&mut agent, id, ExecInput::Data(b"hello\r".to_vec()));
    let (chunks, reply) = agent.wait_reply(id, PATIENCE);
    seen.extend_from_slice(&stdout_of(&chunks));
    let out = String::from_utf8_lossy(&seen).replace('\r', "");
    let Reply::Exec(r) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(r.exit_code, Some(3), "{out}");
    assert!(out.starts_with("/dev/pts/"), "{out}");
    assert!(out.contains("\n40 100\n"), "{out}");
    assert!(out.contains("\n50 132\n"), "{out}");
    assert!(out.contains("got hello"), "{out}");
}

/// Waits for the agent's stale-agent record in `runtime/rsb/agents` to say "heartbeat seen".
fn wait_record(runtime: &Path, pid: u32) -> PathBuf {
    let path = runtime.join("rsb/agents").join(pid.to_string());
    let deadline = Instant::now() + PATIENCE;
    loop {
        if std::fs::read_to_string(&path).is_ok_and(|s| s.trim_end().ends_with(" 1")) {
            return path;
        }
        assert!(
            Instant::now() < deadline,
            "no heartbeat record at {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn age(path: &Path, by: Duration) {
    let f = std::fs::File::options().append(true).open(path).unwrap();
    f.set_modified(std::time::SystemTime::now() - by).unwrap();
}

#[test]
fn the_next_agent_stops_a_stale_one_but_not_a_quiet_one_without_heartbeats() {
    let runtime = tempfile::tempdir().unwrap();
    let start = |rt: &Path| {
        Agent::start_with(
            Command::new(agent_bin())
                .arg("serve")
                .env("XDG_RUNTIME_DIR", rt),
        )
    };
    // A quiet agent whose client never heartbeats is never judged (it may be idle for hours).
    let mut quiet = start(runtime.path());
    let quiet_record = runtime
        .path()
        .join("rsb/agents")
        .join(quiet.child.id().to_string());
    let deadline = Instant::now() + PATIENCE;
    while !quiet_record.exists() {
        assert!(Instant::now() < deadline, "no record");
        std::thread::sleep(Duration::from_millis(50));
    }

    // A heartbeating agent that then went quiet (its link cut) with a command running.
    let mut stale = start(runtime.path());
    for _ in 0..3 {
        assert_eq!(
            stale.call(Request::Ping(rsb_protocol::PingRequest { payload: vec![] })),
            Reply::Pong(vec![])
        );
    }
    let (_, pgid) = start_long_exec(&mut stale);
    let record = wait_record(runtime.path(), stale.child.id());
    age(&record, Duration::from_secs(600));
    age(&quiet_record, Duration::from_secs(600));

    let mut next = start(runtime.path());
    let st = stale.wait_exit(Duration::from_secs(10));
    assert!(st.code().is_some() || std::os::unix::process::ExitStatusExt::signal(&st).is_some());
    wait_group_gone(pgid, Duration::from_secs(5));
    assert!(!record.exists(), "the stale record was left behind");
    // The quiet one and the new one still serve.
    assert_eq!(
        quiet.call(Request::Ping(rsb_protocol::PingRequest {
            payload: vec![1]
        })),
        Reply::Pong(vec![1])
    );
    assert_eq!(
        next.call(Request::Ping(rsb_protocol::PingRequest {
            payload: vec![2]
        })),
        Reply::Pong(vec![2])
    );
}
