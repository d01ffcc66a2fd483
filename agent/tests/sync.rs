//! The sync requests (`Manifest`, `BlockHashes`, `ApplyOpen`/`Apply`/`ApplyClose`) against
//! `rsb-agent serve` as a child process, the way the orchestrator drives both agents.
//!
//! Every agent gets its own `RSB_CACHE_DIR`, so hash-cache assertions never see another test's
//! cache.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use rsb_protocol::sync::{DEFAULT_EXCLUDES, STAGING_PREFIX};
use rsb_protocol::{
    AgentError, ApplyCloseRequest, ApplyOp, ApplyOpenRequest, ApplyOpened, ApplyRequest,
    BlockHashesRequest, Chunk, ErrorCode, FileKind, FromAgent, ManifestEntry, ManifestRequest,
    ManifestSummary, Reply, Request, StagedWriteRequest, SyncRules, ToAgent, decode, encode,
};

fn agent_bin() -> String {
    std::env::var("RSB_TEST_AGENT").unwrap_or_else(|_| env!("CARGO_BIN_EXE_rsb-agent").to_string())
}

const PATIENCE: Duration = Duration::from_secs(30);

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

/// A running agent and a minimal synchronous client (see `tests/serve.rs`).
struct Agent {
    child: Child,
    stdin: Option<ChildStdin>,
    frames: Receiver<FromAgent>,
    stash: Vec<FromAgent>,
    next_id: u64,
    /// The next `seq` of each apply session.
    seqs: HashMap<u64, u64>,
    _cache: tempfile::TempDir,
}

impl Agent {
    fn start() -> Agent {
        let cache = tempfile::tempdir().unwrap();
        Self::start_with_cache(cache)
    }

    fn start_with_cache(cache: tempfile::TempDir) -> Agent {
        let mut child = Command::new(agent_bin())
            .arg("serve")
            .env("RSB_CACHE_DIR", cache.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the agent");
        let mut stdout = child.stdout.take().unwrap();
        let (tx, frames) = mpsc::channel();
        std::thread::spawn(move || {
            while let Some(body) = read_frame(&mut stdout) {
                let msg: FromAgent = decode(&body).expect("undecodable frame");
                if tx.send(msg).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        let first = frames.recv_timeout(PATIENCE).expect("no Hello");
        assert!(matches!(first, FromAgent::Hello(_)), "{first:?}");
        Agent {
            child,
            stdin,
            frames,
            stash: Vec::new(),
            next_id: 1,
            seqs: HashMap::new(),
            _cache: cache,
        }
    }

    fn cache_dir(&self) -> &Path {
        self._cache.path()
    }

    fn send(&mut self, msg: &ToAgent) {
        let body = encode(msg).unwrap();
        write_frame(self.stdin.as_mut().expect("stdin is open"), &body).expect("write");
    }

    fn request(&mut self, body: Request) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&ToAgent::Request { id, body });
        id
    }

    fn wait_reply(&mut self, id: u64) -> (Vec<Chunk>, Reply) {
        let deadline = Instant::now() + PATIENCE;
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
            let left = deadline.saturating_duration_since(Instant::now());
            match self.frames.recv_timeout(left) {
                Ok(FromAgent::Chunk { id: i, chunk }) if i == id => chunks.push(chunk),
                Ok(FromAgent::Reply { id: i, body }) if i == id => found = Some(body),
                Ok(other) => self.stash.push(other),
                Err(RecvTimeoutError::Timeout) => panic!("timed out waiting for the agent"),
                Err(RecvTimeoutError::Disconnected) => panic!("the agent closed its stdout"),
            }
        }
        (chunks, found.unwrap())
    }

    fn call(&mut self, body: Request) -> Reply {
        let id = self.request(body);
        self.wait_reply(id).1
    }

    fn manifest_with(&mut self, root: &Path, rules: SyncRules, hash: bool) -> Manifest {
        self.manifest_expecting(root, rules, hash, None)
    }

    fn manifest_expecting(
        &mut self,
        root: &Path,
        rules: SyncRules,
        hash: bool,
        expect: Option<[u8; 32]>,
    ) -> Manifest {
        let id = self.request(Request::Manifest(ManifestRequest {
            root: root.to_str().unwrap().into(),
            rules,
            hash,
            compress: false,
            expect,
            confine: None,
        }));
        let (chunks, reply) = self.wait_reply(id);
        let summary = match reply {
            Reply::Manifest(s) => s,
            other => panic!("expected a manifest, got {other:?}"),
        };
        let mut batches = Vec::new();
        for c in chunks {
            match c {
                Chunk::Manifest(b) => batches.push(b),
                other => panic!("unexpected chunk {other:?}"),
            }
        }
        Manifest { batches, summary }
    }

    fn manifest(&mut self, root: &Path) -> Manifest {
        self.manifest_with(root, defaults(&[]), true)
    }

    fn open(&mut self, root: &Path, create_root: bool) -> ApplyOpened {
        match self.call(Request::ApplyOpen(ApplyOpenRequest {
            root: root.to_str().unwrap().into(),
            create_root,
            confine: None,
        })) {
            Reply::ApplyOpened(o) => o,
            other => panic!("expected ApplyOpened, got {other:?}"),
        }
    }

    fn next_seq(&mut self, session: u64) -> u64 {
        let n = self.seqs.entry(session).or_default();
        *n += 1;
        *n - 1
    }

    /// Send the session's next numbered batch without waiting for its reply.
    fn request_apply(&mut self, session: u64, ops: Vec<ApplyOp>) -> u64 {
        let seq = self.next_seq(session);
        self.request(Request::Apply(ApplyRequest { session, seq, ops }))
    }

    fn apply(&mut self, session: u64, ops: Vec<ApplyOp>) -> Result<u32, AgentError> {
        let id = self.request_apply(session, ops);
        match self.wait_reply(id).1 {
            Reply::Applied(r) => Ok(r.applied),
            Reply::Error(e) => Err(e),
            other => panic!("expected Applied, got {other:?}"),
        }
    }

    fn close(&mut self, session: u64, dir_mtimes: Vec<(String, i64)>) -> Result<(), AgentError> {
        let seq = self.next_seq(session);
        match self.call(Request::ApplyClose(ApplyCloseRequest {
            session,
            seq,
            dir_mtimes,
        })) {
            // ApplyClose answers with what it applied and any warnings (mtime of a root that
            // is not the user's); these tests own their roots, so there are none.
            Reply::Applied(r) if r.warnings.is_empty() => Ok(()),
            Reply::Error(e) => Err(e),
            other => panic!("expected Applied without warnings, got {other:?}"),
        }
    }

    fn wait_exit(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "the agent did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
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

struct Manifest {
    batches: Vec<Vec<ManifestEntry>>,
    summary: ManifestSummary,
}

impl Manifest {
    fn entries(&self) -> Vec<&ManifestEntry> {
        self.batches.iter().flatten().collect()
    }
    fn by_rel(&self) -> BTreeMap<String, ManifestEntry> {
        self.entries()
            .into_iter()
            .map(|e| (e.rel.clone(), e.clone()))
            .collect()
    }
    fn rels(&self) -> Vec<String> {
        self.entries().iter().map(|e| e.rel.clone()).collect()
    }
}

fn defaults(lines: &[&str]) -> SyncRules {
    SyncRules {
        default_excludes: true,
        lines: lines.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn b3(data: &[u8]) -> [u8; 32] {
    *blake3::hash(data).as_bytes()
}

fn write(root: &Path, rel: &str, data: impl AsRef<[u8]>) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, data).unwrap();
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

fn mtime_ns(m: &fs::Metadata) -> i64 {
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

/// Timestamps a little in the past, like any file that is not being written right now.
fn settle() {
    std::thread::sleep(Duration::from_millis(30));
}

fn expect_err(r: Result<u32, AgentError>, code: ErrorCode, needle: &str) -> AgentError {
    match r {
        Err(e) if e.code == code && e.message.contains(needle) => e,
        other => panic!("expected a {code:?} error containing {needle:?}, got {other:?}"),
    }
}

/// What is in a staging directory besides its lock.
fn staging_dirs(root: &Path) -> Vec<PathBuf> {
    fs::read_dir(root)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_str().unwrap().starts_with(STAGING_PREFIX))
        .map(|e| e.path())
        .collect()
}

fn staged_files(root: &Path) -> Vec<String> {
    staging_dirs(root)
        .iter()
        .flat_map(|d| fs::read_dir(d).unwrap().flatten())
        .map(|e| e.file_name().to_str().unwrap().to_string())
        .filter(|n| n != "lock")
        .collect()
}

fn file_ops(rel: &str, data: &[u8], mode: u32, mtime_ns: i64) -> Vec<ApplyOp> {
    let mut ops: Vec<ApplyOp> = data
        .chunks(64 * 1024)
        .enumerate()
        .map(|(i, c)| ApplyOp::FileData {
            rel: rel.into(),
            offset: (i * 64 * 1024) as u64,
            data: c.to_vec(),
        })
        .collect();
    ops.push(ApplyOp::FileCommit {
        rel: rel.into(),
        size: data.len() as u64,
        mode,
        mtime_ns,
        hash: b3(data),
    });
    ops
}

// ---------------------------------------------------------------------------------------------
// Manifest

#[test]
fn default_excludes_apply_at_any_depth_and_rules_are_ordered() {
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    for rel in [
        "src/main.py",
        "src/__pycache__/main.cpython-312.pyc",
        "src/pkg/__pycache__/x.pyc",
        "web/node_modules/left-pad/index.js",
        "node_modules/a.js",
        "sub/.git/HEAD",
        ".git/config",
        ".idea/workspace.xml",
        "deep/er/.vscode/settings.json",
        "a.pyc",
        "deep/b.pyc",
        "keep.pyc",
        "notes.log",
        "logs/keep.log",
        "logs/other.log",
        "node_modules.txt",
        "build/out.bin",
        "x/build/out.bin",
    ] {
        write(r, rel, rel);
    }
    let mut agent = Agent::start();
    let m = agent.manifest_with(
        r,
        defaults(&["*.log", "!keep.log", "!keep.pyc", "/build"]),
        false,
    );
    assert_eq!(
        m.rels(),
        [
            "deep",
            "deep/er",
            "keep.pyc",
            "logs",
            "logs/keep.log",
            "node_modules.txt",
            "src",
            "src/main.py",
            "src/pkg",
            "sub",
            "web",
            "x",
            "x/build",
            "x/build/out.bin",
        ]
    );
    assert!(m.summary.errors.is_empty(), "{:?}", m.summary.errors);

    // Later lines win: the re-include first, the exclude last.
    let m = agent.manifest_with(r, defaults(&["!keep.log", "*.log"]), false);
    assert!(!m.rels().contains(&"logs/keep.log".to_string()));

    // Without the defaults, nested .git and node_modules are ordinary directories.
    let m = agent.manifest_with(
        r,
        SyncRules {
            default_excludes: false,
            lines: vec![],
            ..Default::default()
        },
        false,
    );
    for rel in [
        "sub/.git/HEAD",
        "web/node_modules/left-pad/index.js",
        "a.pyc",
    ] {
        assert!(m.rels().contains(&rel.to_string()), "{rel}");
    }
    assert_eq!(DEFAULT_EXCLUDES.len(), 6);
}

/// A caller that names the entries it holds gets none back while the tree is as it was, and
/// all of them (exactly what a plain scan sends) once anything in it changed.
#[test]
fn a_manifest_that_matches_the_callers_digest_sends_no_entries() {
    use rsb_protocol::codec::ManifestDigest;
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    // More than one batch, so that held batches are released in order.
    for i in 0..2500 {
        write(r, &format!("d{}/f{i}.txt", i % 7), format!("file {i}\n"));
    }
    let mut agent = Agent::start();
    let first = agent.manifest(r);
    assert!(first.batches.len() > 1 && !first.summary.unchanged);
    let owned: Vec<ManifestEntry> = first.entries().into_iter().cloned().collect();
    let digest = ManifestDigest::of(&owned);

    let same = agent.manifest_expecting(r, defaults(&[]), true, Some(digest));
    assert!(same.summary.unchanged, "{:?}", same.summary);
    assert!(same.batches.is_empty(), "no entries were sent");
    assert_eq!(same.summary.entries, 2500 + 7);

    // A stale digest: everything comes, as from a plain scan.
    std::thread::sleep(std::time::Duration::from_millis(5));
    write(r, "d3/f3.txt", "changed\n");
    let changed = agent.manifest_expecting(r, defaults(&[]), true, Some(digest));
    assert!(!changed.summary.unchanged);
    assert_eq!(changed.rels(), first.rels());
    assert_eq!(changed.by_rel()["d3/f3.txt"].size, 8);
    assert_eq!(changed.entries(), agent.manifest(r).entries());

    // A root that does not exist matches the digest of no entries.
    let gone = r.join("nope");
    let none = ManifestDigest::of(&[]);
    let m = agent.manifest_expecting(&gone, defaults(&[]), true, Some(none));
    assert!(m.summary.unchanged && m.summary.root_kind.is_none());
}

/// Past the depth where the walk stops holding directories open, entries are still found
/// (stat'ed by path) and described the same way.
#[test]
fn a_tree_deeper_than_the_open_directories_is_walked_whole() {
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    let deep: String = (0..90).map(|i| format!("d{i}/")).collect();
    write(r, &format!("{deep}leaf.txt"), "bottom\n");
    write(r, "d0/d1/top.txt", "top\n");
    let mut agent = Agent::start();
    let m = agent.manifest(r);
    let by = m.by_rel();
    let leaf = &by[&format!("{deep}leaf.txt")];
    assert_eq!((leaf.kind, leaf.size), (FileKind::File, 7));
    assert!(leaf.hash.is_some());
    assert_eq!(by["d0/d1/top.txt"].size, 4);
    assert_eq!(m.summary.entries, 90 + 2);
    assert!(m.summary.errors.is_empty(), "{:?}", m.summary.errors);
}

#[test]
fn a_bad_pattern_is_an_invalid_argument_naming_it() {
    let t = tempfile::tempdir().unwrap();
    let mut agent = Agent::start();
    let reply = agent.call(Request::Manifest(ManifestRequest {
        root: t.path().to_str().unwrap().into(),
        rules: defaults(&["ok", "[z-a]"]),
        hash: true,
        compress: false,
        expect: None,
        confine: None,
    }));
    match reply {
        Reply::Error(e) => {
            assert_eq!(e.code, ErrorCode::InvalidArgument);
            assert!(e.message.contains("[z-a]"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn entries_carry_modes_links_hashes_and_specials_are_skipped() {
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    write(r, "bin/run.sh", "#!/bin/sh\necho hi\n");
    fs::set_permissions(r.join("bin/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    write(r, "data/plain.txt", "plain");
    fs::set_permissions(r.join("data/plain.txt"), fs::Permissions::from_mode(0o640)).unwrap();
    write(r, "ünï cödé/日本 語 file.txt", "unicode");
    write(r, "with space.txt", "");
    std::os::unix::fs::symlink("data/plain.txt", r.join("link-file")).unwrap();
    std::os::unix::fs::symlink("data", r.join("link-dir")).unwrap();
    std::os::unix::fs::symlink("does/not/exist", r.join("dangling")).unwrap();
    mkfifo(&r.join("data/pipe"));
    // A staging directory of a sync in progress is never listed.
    write(r, &format!("{STAGING_PREFIX}123/f1"), "staged");
    settle();

    let mut agent = Agent::start();
    let m = agent.manifest(r);
    let by = m.by_rel();
    assert_eq!(
        by.keys().map(String::as_str).collect::<Vec<_>>(),
        [
            "bin",
            "bin/run.sh",
            "dangling",
            "data",
            "data/plain.txt",
            "link-dir",
            "link-file",
            "with space.txt",
            "ünï cödé",
            "ünï cödé/日本 語 file.txt",
        ]
    );
    let run = &by["bin/run.sh"];
    assert_eq!(run.kind, FileKind::File);
    assert_eq!(run.mode, 0o755);
    assert_eq!(run.size, 18);
    assert_eq!(run.hash, Some(b3(b"#!/bin/sh\necho hi\n")));
    assert_eq!(
        run.mtime_ns,
        mtime_ns(&fs::metadata(r.join("bin/run.sh")).unwrap())
    );
    assert_eq!(by["data/plain.txt"].mode, 0o640);
    assert_eq!(by["with space.txt"].hash, Some(b3(b"")));
    assert_eq!(by["ünï cödé/日本 語 file.txt"].hash, Some(b3(b"unicode")));
    assert_eq!(by["bin"].kind, FileKind::Dir);
    assert_eq!(by["bin"].hash, None);
    for (rel, target) in [
        ("link-file", "data/plain.txt"),
        ("link-dir", "data"),
        ("dangling", "does/not/exist"),
    ] {
        assert_eq!(by[rel].kind, FileKind::Symlink, "{rel}");
        assert_eq!(by[rel].link_target.as_deref(), Some(target), "{rel}");
        assert_eq!(by[rel].hash, None, "{rel}");
    }
    assert_eq!(m.summary.skipped_special_count, 1);
    assert_eq!(m.summary.skipped_special, ["data/pipe"]);
    assert_eq!(m.summary.root_kind, Some(FileKind::Dir));
    assert_eq!(m.summary.entries, 10);
    assert!(m.summary.errors.is_empty(), "{:?}", m.summary.errors);
    // Dirs precede their contents; the whole order is the same every time.
    assert_eq!(agent.manifest(r).rels(), m.rels());
}

#[test]
fn a_missing_root_and_a_file_root() {
    let t = tempfile::tempdir().unwrap();
    let mut agent = Agent::start();
    let m = agent.manifest(&t.path().join("nope"));
    assert_eq!(m.summary.root_kind, None);
    assert_eq!(m.summary.entries, 0);
    assert!(m.batches.is_empty());

    write(t.path(), "one.bin", "12345");
    let m = agent.manifest(&t.path().join("one.bin"));
    assert_eq!(m.summary.root_kind, Some(FileKind::File));
    let e = m.entries();
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].rel, "");
    assert_eq!(e[0].size, 5);
    assert_eq!(e[0].hash, Some(b3(b"12345")));

    // A root that is a symlink is followed (only the root).
    std::os::unix::fs::symlink("one.bin", t.path().join("alias")).unwrap();
    let m = agent.manifest(&t.path().join("alias"));
    assert_eq!(m.summary.root_kind, Some(FileKind::File));
    assert_eq!(m.entries()[0].hash, Some(b3(b"12345")));
    assert!(m.summary.errors.is_empty(), "{:?}", m.summary.errors);
    // A dangling symlink as the root is described as a link.
    std::os::unix::fs::symlink("gone", t.path().join("dangling")).unwrap();
    let m = agent.manifest(&t.path().join("dangling"));
    assert_eq!(m.summary.root_kind, Some(FileKind::Symlink));
    assert_eq!(m.entries()[0].link_target.as_deref(), Some("gone"));
}

#[test]
fn big_trees_stream_in_bounded_batches() {
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    for d in 0..50 {
        for f in 0..100 {
            write(r, &format!("d{d:02}/f{f:03}.txt"), format!("{d}/{f}"));
        }
    }
    let mut agent = Agent::start();
    let m = agent.manifest(r);
    assert_eq!(m.summary.entries, 5050);
    assert_eq!(m.entries().len(), 5050);
    assert!(m.batches.len() >= 3, "{} batches", m.batches.len());
    assert!(m.batches.iter().all(|b| !b.is_empty() && b.len() <= 2000));
    assert!(
        m.entries()
            .iter()
            .all(|e| e.kind == FileKind::Dir || e.hash.is_some())
    );
}

#[test]
fn an_unchanged_tree_is_never_hashed_twice() {
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    let mut total = 0u64;
    for i in 0..300 {
        let data = vec![i as u8; 1000 + i * 37];
        total += data.len() as u64;
        write(r, &format!("d{}/f{i}.bin", i % 7), data);
    }
    write(r, "big.bin", vec![7u8; 3 << 20]);
    total += 3 << 20;
    settle();

    let mut agent = Agent::start();
    let first = agent.manifest(r);
    assert_eq!(first.summary.hashed_bytes, total);
    let second = agent.manifest(r);
    assert_eq!(second.summary.hashed_bytes, 0);
    assert_eq!(first.by_rel(), second.by_rel());

    // The cache is on disk: a fresh agent process hashes nothing either.
    let cache = std::mem::replace(&mut agent._cache, tempfile::tempdir().unwrap());
    drop(agent);
    let mut agent = Agent::start_with_cache(cache);
    assert_eq!(agent.manifest(r).summary.hashed_bytes, 0);

    // A changed file (same size, even) is hashed again, and only it.
    write(r, "d3/f3.bin", vec![0xEEu8; 1000 + 3 * 37]);
    settle();
    let third = agent.manifest(r);
    assert_eq!(third.summary.hashed_bytes, 1000 + 3 * 37);
    assert_eq!(
        third.by_rel()["d3/f3.bin"].hash,
        Some(b3(&vec![0xEEu8; 1111]))
    );
    assert_eq!(agent.manifest(r).summary.hashed_bytes, 0);

    // Touching the mtime alone also counts as a change.
    let f = fs::File::options()
        .write(true)
        .open(r.join("d0/f0.bin"))
        .unwrap();
    f.set_modified(std::time::SystemTime::now()).unwrap();
    drop(f);
    settle();
    assert_eq!(agent.manifest(r).summary.hashed_bytes, 1000);

    // A corrupt cache is ignored and rebuilt.
    let cache_files: Vec<_> = fs::read_dir(agent.cache_dir().join("hashcache"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(cache_files.len(), 1, "{cache_files:?}");
    fs::write(&cache_files[0], b"RSBHC\x01\0\0garbage").unwrap();
    assert_eq!(agent.manifest(r).summary.hashed_bytes, total);
    assert_eq!(agent.manifest(r).summary.hashed_bytes, 0);

    // Without `hash`, nothing is hashed and no hashes are reported.
    let m = agent.manifest_with(r, defaults(&[]), false);
    assert_eq!(m.summary.hashed_bytes, 0);
    assert!(m.entries().iter().all(|e| e.hash.is_none()));
}

// ---------------------------------------------------------------------------------------------
// BlockHashes

#[test]
fn block_hashes_cover_every_block() {
    let t = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..(4096 * 3 + 1000)).map(|i| (i % 251) as u8).collect();
    write(t.path(), "f.bin", &data);
    let path = t.path().join("f.bin").to_str().unwrap().to_string();
    let mut agent = Agent::start();
    match agent.call(Request::BlockHashes(BlockHashesRequest {
        path: path.clone(),
        block_size: 4096,
        confine: None,
    })) {
        Reply::BlockHashes(r) => {
            assert_eq!(r.size, data.len() as u64);
            let want: Vec<[u8; 32]> = data.chunks(4096).map(b3).collect();
            assert_eq!(r.hashes, want);
        }
        other => panic!("{other:?}"),
    }
    for bad in [0, 4095, (64 << 20) + 1] {
        match agent.call(Request::BlockHashes(BlockHashesRequest {
            path: path.clone(),
            block_size: bad,
            confine: None,
        })) {
            Reply::Error(e) => assert_eq!(e.code, ErrorCode::InvalidArgument),
            other => panic!("{other:?}"),
        }
    }
    match agent.call(Request::BlockHashes(BlockHashesRequest {
        path: t.path().to_str().unwrap().into(),
        block_size: 4096,
        confine: None,
    })) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::InvalidArgument, "{}", e.message),
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Apply

#[test]
fn received_files_land_with_exact_bytes_modes_and_mtimes() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("new/dest");
    let mut agent = Agent::start();
    let opened = agent.open(&root, true);
    assert_eq!(opened.root, root.to_str().unwrap());
    assert_eq!(opened.stale_cleaned, 0);
    assert_eq!(staging_dirs(&root).len(), 1);
    let staging = staging_dirs(&root).remove(0);
    assert_eq!(fs::metadata(&staging).unwrap().mode() & 0o777, 0o700);

    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let t_file = 1_600_000_000_123_456_789i64;
    let t_dir = 1_500_000_000_987_654_321i64;
    let mut ops = vec![
        ApplyOp::Mkdir {
            rel: "bin".into(),
            mode: 0o755,
        },
        ApplyOp::Mkdir {
            rel: "ro".into(),
            mode: 0o555,
        },
        ApplyOp::Mkdir {
            rel: "ünï cödé".into(),
            mode: 0o700,
        },
    ];
    ops.extend(file_ops("bin/run.sh", b"#!/bin/sh\n", 0o755, t_file));
    ops.extend(file_ops("ro/big.bin", &big, 0o444, t_file + 1));
    ops.extend(file_ops(
        "ünï cödé/with space.txt",
        b"x y",
        0o600,
        t_file + 2,
    ));
    // An empty file needs no data at all.
    ops.push(ApplyOp::FileCommit {
        rel: "empty".into(),
        size: 0,
        mode: 0o644,
        mtime_ns: t_file,
        hash: b3(b""),
    });
    ops.push(ApplyOp::Symlink {
        rel: "link".into(),
        target: "bin/run.sh".into(),
    });
    ops.push(ApplyOp::Symlink {
        rel: "dangling".into(),
        target: "no/such".into(),
    });
    ops.push(ApplyOp::SetAttr {
        rel: "dangling".into(),
        mode: Some(0o600), // ignored for symlinks
        mtime_ns: Some(t_file + 3),
    });
    let n = ops.len() as u32;
    assert_eq!(agent.apply(opened.session, ops), Ok(n));
    agent
        .close(
            opened.session,
            vec![
                ("ro".into(), t_dir),
                ("bin".into(), t_dir + 1),
                ("".into(), t_dir + 2),
            ],
        )
        .unwrap();

    assert!(staging_dirs(&root).is_empty());
    let check = |rel: &str, data: &[u8], mode: u32, mtime: i64| {
        let p = root.join(rel);
        assert_eq!(fs::read(&p).unwrap(), data, "{rel}");
        let m = fs::metadata(&p).unwrap();
        assert_eq!(m.mode() & 0o7777, mode, "{rel}");
        assert_eq!(mtime_ns(&m), mtime, "{rel}");
    };
    check("bin/run.sh", b"#!/bin/sh\n", 0o755, t_file);
    check("ro/big.bin", &big, 0o444, t_file + 1);
    check("ünï cödé/with space.txt", b"x y", 0o600, t_file + 2);
    check("empty", b"", 0o644, t_file);
    assert_eq!(
        fs::read_link(root.join("link")).unwrap(),
        Path::new("bin/run.sh")
    );
    assert_eq!(
        fs::read_link(root.join("dangling")).unwrap(),
        Path::new("no/such")
    );
    assert_eq!(
        mtime_ns(&fs::symlink_metadata(root.join("dangling")).unwrap()),
        t_file + 3
    );
    // Directory modes that lock the owner out are applied last; mtimes after everything.
    let ro = fs::metadata(root.join("ro")).unwrap();
    assert_eq!(ro.mode() & 0o7777, 0o555);
    assert_eq!(mtime_ns(&ro), t_dir);
    assert_eq!(
        mtime_ns(&fs::metadata(root.join("bin")).unwrap()),
        t_dir + 1
    );
    assert_eq!(mtime_ns(&fs::metadata(&root).unwrap()), t_dir + 2);
    assert_eq!(
        fs::metadata(root.join("ünï cödé")).unwrap().mode() & 0o777,
        0o700
    );

    // What was received is in the hash cache: the destination's manifest hashes nothing.
    let m = agent.manifest(&root);
    assert_eq!(m.summary.hashed_bytes, 0);
    assert_eq!(m.by_rel()["ro/big.bin"].hash, Some(b3(&big)));

    // The session is gone.
    let e = agent.apply(opened.session, vec![]).unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    fs::set_permissions(root.join("ro"), fs::Permissions::from_mode(0o755)).unwrap();
}

fn staged_write(
    agent: &mut Agent,
    root: &Path,
    staging: &str,
    name: &str,
    offset: u64,
    data: &[u8],
    compress: bool,
) -> Result<(), AgentError> {
    let (raw_len, data) = match compress.then(|| rsb_protocol::compress::compress(data)) {
        Some(Some(z)) => (Some(data.len() as u64), z),
        _ => (None, data.to_vec()),
    };
    match agent.call(Request::StagedWrite(StagedWriteRequest {
        root: root.to_str().unwrap().into(),
        staging: staging.into(),
        name: name.into(),
        offset,
        raw_len,
        data,
        confine: None,
    })) {
        Reply::Done => Ok(()),
        Reply::Error(e) => Err(e),
        other => panic!("expected Done, got {other:?}"),
    }
}

/// Issue 47, lanes: a session opens a large file's staged copy to other channels; a second
/// agent process writes its halves out of order (one compressed), and the commit, which
/// trusts none of it, hashes the whole file: a wrong byte is a hash mismatch, the right bytes
/// land exactly. Names that climb out, a staging directory that is not this user's private
/// one, a link or a file the session never staged: refused, nothing created or written.
#[test]
fn a_shared_staged_file_takes_another_agent_s_writes_and_its_commit_checks_them() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let data: Vec<u8> = (0..(3 << 20) as u32).map(|i| (i % 251) as u8).collect();
    let half = data.len() / 2;
    let mut a = Agent::start();
    let mut b = Agent::start();
    let opened = a.open(root, false);
    let s = opened.session;
    let share = |a: &mut Agent| {
        let seq = a.next_seq(s);
        match a.call(Request::Apply(ApplyRequest {
            session: s,
            seq,
            ops: vec![ApplyOp::FileShare {
                rel: "big.bin".into(),
            }],
        })) {
            Reply::Applied(r) => r.shared,
            other => panic!("expected Applied, got {other:?}"),
        }
    };
    let shared = share(&mut a);
    assert_eq!(shared.len(), 1, "{shared:?}");
    let (staging, name) = (opened.staging.as_str(), shared[0].as_str());
    assert!(staging.starts_with(STAGING_PREFIX), "{staging}");
    // The second half first, compressed; then the first half with a wrong byte.
    staged_write(
        &mut b,
        root,
        staging,
        name,
        half as u64,
        &data[half..],
        true,
    )
    .unwrap();
    let mut bad = data[..half].to_vec();
    bad[7] ^= 1;
    staged_write(&mut b, root, staging, name, 0, &bad, false).unwrap();
    let commit = || ApplyOp::FileCommit {
        rel: "big.bin".into(),
        size: data.len() as u64,
        mode: 0o644,
        mtime_ns: 1_000_000_000,
        hash: b3(&data),
    };
    expect_err(
        a.apply(s, vec![commit()]),
        ErrorCode::InvalidArgument,
        "hash mismatch",
    );
    assert!(!root.join("big.bin").exists(), "nothing committed");

    // Refused: names that are not a staged file's, another staging directory, a link.
    let refused = |r: Result<(), AgentError>, code: ErrorCode| {
        let e = r.expect_err("refused");
        assert_eq!(e.code, code, "{e:?}");
    };
    for (st, n) in [
        (staging, "../../etc"),
        (staging, ".."),
        (staging, ""),
        ("..", name),
        ("not-staging", name),
        (staging, "a/b"),
    ] {
        refused(
            staged_write(&mut b, root, st, n, 0, b"x", false),
            ErrorCode::InvalidArgument,
        );
    }
    let outside = root.join("outside.txt");
    fs::write(&outside, "mine").unwrap();
    std::os::unix::fs::symlink(&outside, root.join(staging).join("link")).unwrap();
    assert!(staged_write(&mut b, root, staging, "link", 0, b"x", false).is_err());
    assert_eq!(fs::read_to_string(&outside).unwrap(), "mine");
    assert!(staged_write(&mut b, root, staging, "f99-never", 0, b"x", false).is_err());
    assert!(
        !root.join(staging).join("f99-never").exists(),
        "never created"
    );
    let open_dir = root.join(format!("{STAGING_PREFIX}open"));
    fs::create_dir(&open_dir).unwrap();
    fs::write(open_dir.join("f1-x"), "").unwrap();
    fs::set_permissions(&open_dir, fs::Permissions::from_mode(0o755)).unwrap();
    refused(
        staged_write(
            &mut b,
            root,
            &format!("{STAGING_PREFIX}open"),
            "f1-x",
            0,
            b"x",
            false,
        ),
        ErrorCode::PermissionDenied,
    );
    assert_eq!(fs::read(open_dir.join("f1-x")).unwrap(), b"");
    fs::remove_dir_all(&open_dir).unwrap();
    fs::remove_file(root.join(staging).join("link")).unwrap();

    // The mismatch dropped the staged copy: shared again, the right bytes commit exactly.
    let shared = share(&mut a);
    assert_ne!(shared[0], name, "a fresh staged copy");
    staged_write(
        &mut b,
        root,
        staging,
        &shared[0],
        half as u64,
        &data[half..],
        false,
    )
    .unwrap();
    staged_write(&mut b, root, staging, &shared[0], 0, &data[..half], true).unwrap();
    assert_eq!(a.apply(s, vec![commit()]), Ok(1));
    a.close(s, vec![]).unwrap();
    assert_eq!(fs::read(root.join("big.bin")).unwrap(), data);
    assert!(staging_dirs(root).is_empty());
}

#[test]
fn a_wrong_hash_leaves_the_old_file_and_nothing_partial() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    write(root, "keep.txt", "old content");
    write(root, "a.txt", "a old");
    let mut agent = Agent::start();
    let s = agent.open(root, false).session;
    let mut ops = file_ops("a.txt", b"a new", 0o644, 1_000_000_000);
    let mut bad = file_ops(
        "keep.txt",
        b"new content that is longer",
        0o644,
        1_000_000_000,
    );
    if let Some(ApplyOp::FileCommit { hash, .. }) = bad.last_mut() {
        *hash = b3(b"something else");
    }
    ops.extend(bad);
    ops.extend(file_ops(
        "never.txt",
        b"after the failure",
        0o644,
        1_000_000_000,
    ));
    let e = expect_err(
        agent.apply(s, ops),
        ErrorCode::InvalidArgument,
        "keep.txt: content changed during sync (hash mismatch); re-run",
    );
    assert!(e.message.contains("(op 4 of 6)"), "{}", e.message);
    // Ops before the failure are applied, the failing one and later ones are not.
    assert_eq!(fs::read(root.join("a.txt")).unwrap(), b"a new");
    assert_eq!(fs::read(root.join("keep.txt")).unwrap(), b"old content");
    assert!(!root.join("never.txt").exists());
    assert_eq!(staged_files(root), Vec::<String>::new());
    let mut names: Vec<_> = fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .filter(|n| !n.starts_with(STAGING_PREFIX))
        .collect();
    names.sort();
    assert_eq!(names, ["a.txt", "keep.txt"]);
    // The session still works after a failed batch.
    assert_eq!(
        agent.apply(s, file_ops("keep.txt", b"fixed", 0o600, 5)),
        Ok(2)
    );
    agent.close(s, vec![]).unwrap();
    assert_eq!(fs::read(root.join("keep.txt")).unwrap(), b"fixed");
}

#[test]
fn names_that_escape_the_root_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let outside = t.path().join("outside");
    fs::create_dir_all(&root).unwrap();
    fs::create_dir_all(&outside).unwrap();
    write(&outside, "victim.txt", "untouched");
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
    write(&root, "file", "f");
    let mut agent = Agent::start();
    let s = agent.open(&root, false).session;
    for (rel, needle) in [
        ("../escape.txt", "`..` component"),
        ("a/../../escape.txt", "`..` component"),
        ("/tmp/abs.txt", "absolute path"),
        ("./x", "`.` component"),
        ("a//b", "empty path component"),
        ("", "empty path"),
    ] {
        expect_err(
            agent.apply(s, file_ops(rel, b"x", 0o644, 0)),
            ErrorCode::InvalidArgument,
            needle,
        );
    }
    for op in [
        ApplyOp::Mkdir {
            rel: "link/sub".into(),
            mode: 0o755,
        },
        ApplyOp::Delete {
            rel: "link/victim.txt".into(),
        },
        ApplyOp::Symlink {
            rel: "link/victim.txt".into(),
            target: "/etc/passwd".into(),
        },
        ApplyOp::SetAttr {
            rel: "link/victim.txt".into(),
            mode: Some(0o777),
            mtime_ns: None,
        },
        ApplyOp::FileBase {
            rel: "link/victim.txt".into(),
        },
    ] {
        expect_err(
            agent.apply(s, vec![op]),
            ErrorCode::PermissionDenied,
            "parent link is a symlink, so the destination",
        );
    }
    expect_err(
        agent.apply(s, file_ops("link/victim.txt", b"pwned", 0o644, 0)),
        ErrorCode::PermissionDenied,
        "refusing link/victim.txt: parent link is a symlink",
    );
    expect_err(
        agent.apply(s, file_ops("file/x", b"x", 0o644, 0)),
        ErrorCode::NotADirectory,
        "parent file is not a directory",
    );
    assert_eq!(fs::read(outside.join("victim.txt")).unwrap(), b"untouched");
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 1);
    assert_eq!(staged_files(&root), Vec::<String>::new());
    agent.close(s, vec![]).unwrap();
}

#[test]
fn a_file_where_a_directory_is_and_the_reverse_are_clear_errors() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    write(root, "dir/inside.txt", "inside");
    write(root, "file", "i am a file");
    fs::create_dir(root.join("emptydir")).unwrap();
    let mut agent = Agent::start();
    let s = agent.open(root, false).session;
    expect_err(
        agent.apply(s, file_ops("dir", b"x", 0o644, 0)),
        ErrorCode::IsADirectory,
        "dir exists and is a directory; refusing to replace it with a file",
    );
    expect_err(
        agent.apply(s, file_ops("emptydir", b"x", 0o644, 0)),
        ErrorCode::IsADirectory,
        "emptydir exists and is a directory",
    );
    expect_err(
        agent.apply(
            s,
            vec![ApplyOp::Mkdir {
                rel: "file".into(),
                mode: 0o755,
            }],
        ),
        ErrorCode::NotADirectory,
        "file exists and is not a directory",
    );
    expect_err(
        agent.apply(
            s,
            vec![ApplyOp::Symlink {
                rel: "dir".into(),
                target: "elsewhere".into(),
            }],
        ),
        ErrorCode::IsADirectory,
        "refusing to replace it with a symlink",
    );
    // A non-empty directory is not deleted; an empty one and a missing one are fine.
    agent
        .apply(s, vec![ApplyOp::Delete { rel: "dir".into() }])
        .unwrap_err();
    assert_eq!(
        agent.apply(
            s,
            vec![
                ApplyOp::Delete {
                    rel: "emptydir".into()
                },
                ApplyOp::Delete {
                    rel: "missing".into()
                },
                ApplyOp::Delete {
                    rel: "missing/deeper".into()
                },
                ApplyOp::Delete { rel: "file".into() },
            ],
        ),
        Ok(4)
    );
    assert_eq!(fs::read(root.join("dir/inside.txt")).unwrap(), b"inside");
    assert!(!root.join("emptydir").exists());
    assert!(!root.join("file").exists());
    // A file may replace a symlink (the link itself, not its target).
    write(root, "target.txt", "target");
    std::os::unix::fs::symlink("target.txt", root.join("l")).unwrap();
    agent
        .apply(s, file_ops("l", b"now a file", 0o644, 0))
        .unwrap();
    assert_eq!(fs::read(root.join("target.txt")).unwrap(), b"target");
    assert!(fs::symlink_metadata(root.join("l")).unwrap().is_file());
    // A missing parent is named.
    expect_err(
        agent.apply(s, file_ops("no/such/dir/f", b"x", 0o644, 0)),
        ErrorCode::NotFound,
        "parent no does not exist",
    );
    agent.close(s, vec![]).unwrap();
}

#[test]
fn a_block_delta_rebuilds_the_file() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let bs = 4096usize;
    let old: Vec<u8> = (0..bs * 5).map(|i| (i % 253) as u8).collect();
    write(root, "big.bin", &old);
    fs::set_permissions(root.join("big.bin"), fs::Permissions::from_mode(0o444)).unwrap();
    let mut agent = Agent::start();

    // Change block 2, append half a block.
    let mut new = old.clone();
    new[2 * bs..3 * bs].fill(0xAB);
    new.extend(std::iter::repeat_n(0xCD, bs / 2));
    let s = agent.open(root, false).session;
    let ops = vec![
        ApplyOp::FileBase {
            rel: "big.bin".into(),
        },
        ApplyOp::FileData {
            rel: "big.bin".into(),
            offset: (2 * bs) as u64,
            data: new[2 * bs..3 * bs].to_vec(),
        },
        ApplyOp::FileData {
            rel: "big.bin".into(),
            offset: (5 * bs) as u64,
            data: new[5 * bs..].to_vec(),
        },
        ApplyOp::FileCommit {
            rel: "big.bin".into(),
            size: new.len() as u64,
            mode: 0o644,
            mtime_ns: 42,
            hash: b3(&new),
        },
    ];
    assert_eq!(agent.apply(s, ops), Ok(4));
    assert_eq!(fs::read(root.join("big.bin")).unwrap(), new);

    // Shrinking: base + truncate.
    let short = new[..bs + 10].to_vec();
    let ops = vec![
        ApplyOp::FileBase {
            rel: "big.bin".into(),
        },
        ApplyOp::FileCommit {
            rel: "big.bin".into(),
            size: short.len() as u64,
            mode: 0o600,
            mtime_ns: 43,
            hash: b3(&short),
        },
    ];
    assert_eq!(agent.apply(s, ops), Ok(2));
    assert_eq!(fs::read(root.join("big.bin")).unwrap(), short);
    assert_eq!(
        fs::metadata(root.join("big.bin")).unwrap().mode() & 0o777,
        0o600
    );
    agent.close(s, vec![]).unwrap();

    // Block hashes of the destination drive such a delta.
    match agent.call(Request::BlockHashes(BlockHashesRequest {
        path: root.join("big.bin").to_str().unwrap().into(),
        block_size: bs as u64,
        confine: None,
    })) {
        Reply::BlockHashes(r) => assert_eq!(r.hashes, short.chunks(bs).map(b3).collect::<Vec<_>>()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn pipelined_batches_apply_in_order() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let data: Vec<u8> = (0..2_000_000u32).map(|i| (i % 241) as u8).collect();
    let mut agent = Agent::start();
    let s = agent.open(root, false).session;
    // One op per request, all sent before any reply is read.
    let ids: Vec<u64> = file_ops("f.bin", &data, 0o644, 7)
        .into_iter()
        .map(|op| agent.request_apply(s, vec![op]))
        .collect();
    assert!(ids.len() > 30);
    for id in ids {
        match agent.wait_reply(id).1 {
            Reply::Applied(r) => assert_eq!(r.applied, 1),
            other => panic!("{other:?}"),
        }
    }
    let seq = agent.next_seq(s);
    let id = agent.request(Request::ApplyClose(ApplyCloseRequest {
        session: s,
        seq,
        dir_mtimes: vec![],
    }));
    let (_, reply) = agent.wait_reply(id);
    assert!(
        matches!(reply, Reply::Applied(ref r) if r.warnings.is_empty()),
        "{reply:?}"
    );
    assert_eq!(fs::read(root.join("f.bin")).unwrap(), data);
}

#[test]
fn stale_staging_of_a_killed_sync_is_cleaned_by_the_next_open() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let mut a = Agent::start();
    let s = a.open(root, false).session;
    a.apply(
        s,
        vec![ApplyOp::FileData {
            rel: "half.bin".into(),
            offset: 0,
            data: vec![1; 100_000],
        }],
    )
    .unwrap();
    assert_eq!(staged_files(root).len(), 1);

    // A live session's staging is not touched by another agent.
    let mut b = Agent::start();
    let other = b.open(root, false);
    assert_eq!(other.stale_cleaned, 0);
    assert_eq!(staging_dirs(root).len(), 2);
    b.close(other.session, vec![]).unwrap();

    a.child.kill().unwrap();
    a.child.wait().unwrap();
    assert_eq!(
        staging_dirs(root).len(),
        1,
        "a killed agent leaves its staging"
    );
    assert!(!root.join("half.bin").exists());

    let opened = b.open(root, false);
    assert_eq!(opened.stale_cleaned, 1);
    assert_eq!(staging_dirs(root).len(), 1); // b's new one
    assert_eq!(staged_files(root), Vec::<String>::new());
    b.close(opened.session, vec![]).unwrap();
    assert!(staging_dirs(root).is_empty());
}

#[test]
fn staging_is_removed_when_the_channel_ends() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let mut a = Agent::start();
    let s = a.open(root, false).session;
    a.apply(
        s,
        vec![ApplyOp::FileData {
            rel: "x".into(),
            offset: 0,
            data: vec![1; 10],
        }],
    )
    .unwrap();
    a.stdin = None;
    a.wait_exit();
    assert!(staging_dirs(root).is_empty());
    assert!(!root.join("x").exists());
}

#[test]
fn apply_open_checks_the_root() {
    let t = tempfile::tempdir().unwrap();
    write(t.path(), "file", "x");
    let mut agent = Agent::start();
    for (root, create, code) in [
        (t.path().join("file"), true, ErrorCode::NotADirectory),
        (t.path().join("missing"), false, ErrorCode::NotFound),
    ] {
        match agent.call(Request::ApplyOpen(ApplyOpenRequest {
            root: root.to_str().unwrap().into(),
            create_root: create,
            confine: None,
        })) {
            Reply::Error(e) => assert_eq!(e.code, code, "{}", e.message),
            other => panic!("{other:?}"),
        }
    }
    match agent.call(Request::Apply(ApplyRequest {
        session: 12345,
        seq: 0,
        ops: vec![],
    })) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
}

/// A 1 MiB tmpfs (we run as root in CI containers); skipped where mounting is not allowed.
struct Tmpfs {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount() -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(dir.path())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs {
            path: dir.path().to_path_buf(),
            _dir: dir,
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

#[test]
fn a_full_disk_is_no_space_naming_the_file_and_leaves_nothing() {
    let Some(fs_) = Tmpfs::mount() else {
        eprintln!("skipped: cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)");
        return;
    };
    let root = fs_.path.clone();
    let mut agent = Agent::start();
    let s = agent.open(&root, false).session;
    let data = vec![9u8; 2 << 20];
    let e = expect_err(
        agent.apply(s, file_ops("too big.bin", &data, 0o644, 0)),
        ErrorCode::NoSpace,
        "too big.bin",
    );
    assert!(e.message.contains("no space left"), "{}", e.message);
    assert_eq!(staged_files(&root), Vec::<String>::new());
    assert!(!root.join("too big.bin").exists());
    // The space came back: a small file still fits.
    assert_eq!(agent.apply(s, file_ops("small", b"ok", 0o644, 0)), Ok(2));
    agent.close(s, vec![]).unwrap();
    assert_eq!(fs::read(root.join("small")).unwrap(), b"ok");
}

#[test]
fn a_manifest_can_be_cancelled() {
    let t = tempfile::tempdir().unwrap();
    write(t.path(), "big.bin", vec![3u8; 64 << 20]);
    let mut agent = Agent::start();
    let id = agent.request(Request::Manifest(ManifestRequest {
        root: t.path().to_str().unwrap().into(),
        rules: defaults(&[]),
        hash: true,
        compress: false,
        expect: None,
        confine: None,
    }));
    agent.send(&ToAgent::Cancel { id });
    match agent.wait_reply(id).1 {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::Cancelled),
        // It may also have finished first on a fast machine.
        Reply::Manifest(_) => {}
        other => panic!("{other:?}"),
    }
    // The agent is still healthy.
    assert!(matches!(
        agent.call(Request::Ping(rsb_protocol::PingRequest {
            payload: vec![1]
        })),
        Reply::Pong(_)
    ));
}

/// Timings of the agent side alone, for sizing the orchestrator (not a pass/fail check):
/// `RSB_TEST_AGENT=target/agents/x86_64-unknown-linux-musl/rsb-agent \
///  cargo test -p rsb-agent --test sync -- --ignored --nocapture agent_side_timings`
#[test]
#[ignore]
fn agent_side_timings() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    let mut files = Vec::new();
    for i in 0..2000usize {
        let rel = format!("d{}/e{}/f{i}.txt", i % 20, i % 7);
        let data: Vec<u8> = (0..(1000 + i * 13 % 3000)).map(|j| (i + j) as u8).collect();
        write(&src, &rel, &data);
        files.push((rel, data));
    }
    let big: Vec<u8> = (0..200u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    write(&src, "big.bin", &big);
    // Flush the source's dirty pages now, so that they do not weigh on the fsyncs measured below.
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    settle();
    let mut agent = Agent::start();
    let time = |what: &str, start: Instant| {
        eprintln!("{what:<48} {:>8.1} ms", start.elapsed().as_secs_f64() * 1e3)
    };
    let s = Instant::now();
    let m = agent.manifest(&src);
    time(
        &format!(
            "manifest, cold ({} MiB hashed)",
            m.summary.hashed_bytes >> 20
        ),
        s,
    );
    let s = Instant::now();
    let m = agent.manifest(&src);
    time(
        &format!("manifest, warm ({} bytes hashed)", m.summary.hashed_bytes),
        s,
    );
    let s = Instant::now();
    agent.call(Request::BlockHashes(BlockHashesRequest {
        path: src.join("big.bin").to_str().unwrap().into(),
        block_size: 1 << 20,
        confine: None,
    }));
    time("block hashes of 200 MiB, 1 MiB blocks", s);

    let dst = t.path().join("dst");
    let s = Instant::now();
    let session = agent.open(&dst, true).session;
    let mut dirs: Vec<String> = m
        .entries()
        .iter()
        .filter(|e| e.kind == FileKind::Dir)
        .map(|e| e.rel.clone())
        .collect();
    dirs.sort();
    let mut ops: Vec<ApplyOp> = dirs
        .into_iter()
        .map(|rel| ApplyOp::Mkdir { rel, mode: 0o755 })
        .collect();
    let mut ids = Vec::new();
    let mut bytes = 0;
    for (rel, data) in &files {
        bytes += data.len();
        ops.extend(file_ops(rel, data, 0o644, 1_000_000_000));
        if bytes > 4 << 20 {
            ids.push(agent.request_apply(session, std::mem::take(&mut ops)));
            bytes = 0;
        }
    }
    ids.push(agent.request_apply(session, ops));
    for id in ids {
        assert!(matches!(agent.wait_reply(id).1, Reply::Applied(_)));
    }
    time("apply 2000 small files (batches of ~4 MiB)", s);
    let s = Instant::now();
    let mut ids = Vec::new();
    for (i, chunk) in big.chunks(4 << 20).enumerate() {
        let mut ops: Vec<ApplyOp> = chunk
            .chunks(1 << 20)
            .enumerate()
            .map(|(j, c)| ApplyOp::FileData {
                rel: "big.bin".into(),
                offset: ((i * 4 + j) << 20) as u64,
                data: c.to_vec(),
            })
            .collect();
        if (i + 1) * (4 << 20) >= big.len() {
            ops.push(ApplyOp::FileCommit {
                rel: "big.bin".into(),
                size: big.len() as u64,
                mode: 0o644,
                mtime_ns: 1_000_000_000,
                hash: b3(&big),
            });
        }
        ids.push(agent.request_apply(session, ops));
    }
    for id in ids {
        assert!(matches!(agent.wait_reply(id).1, Reply::Applied(_)));
    }
    time("apply 200 MiB file (4 MiB per Apply)", s);
    let s = Instant::now();
    agent.close(session, vec![]).unwrap();
    time("apply close", s);
    let s = Instant::now();
    let m2 = agent.manifest(&dst);
    time(
        &format!(
            "manifest of the destination ({} bytes hashed)",
            m2.summary.hashed_bytes
        ),
        s,
    );
    // Block delta: 1 MiB changed in the middle.
    let s = Instant::now();
    let session = agent.open(&dst, false).session;
    let mut new = big.clone();
    new[100 << 20..101 << 20].fill(0x5A);
    let ops = vec![
        ApplyOp::FileBase {
            rel: "big.bin".into(),
        },
        ApplyOp::FileData {
            rel: "big.bin".into(),
            offset: 100 << 20,
            data: new[100 << 20..101 << 20].to_vec(),
        },
        ApplyOp::FileCommit {
            rel: "big.bin".into(),
            size: new.len() as u64,
            mode: 0o644,
            mtime_ns: 2_000_000_000,
            hash: b3(&new),
        },
    ];
    agent.apply(session, ops).unwrap();
    agent.close(session, vec![]).unwrap();
    time("block delta of 1 MiB into the 200 MiB file", s);
}

#[test]
fn stale_staging_is_cleaned_by_the_next_manifest_too() {
    // A no-change sync only scans; it must still clear what a killed sync left behind.
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let mut a = Agent::start();
    let s = a.open(root, false).session;
    a.apply(
        s,
        vec![ApplyOp::FileData {
            rel: "half.bin".into(),
            offset: 0,
            data: vec![2; 10_000],
        }],
    )
    .unwrap();
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    assert_eq!(staging_dirs(root).len(), 1);
    let mut b = Agent::start();
    b.manifest(root);
    assert!(
        staging_dirs(root).is_empty(),
        "stale staging survived a manifest"
    );
    assert!(!root.join("half.bin").exists());
}

// ---------------------------------------------------------------------------------------------
// ApplyOnce (watch bursts)

impl Agent {
    fn apply_once(
        &mut self,
        root: &Path,
        expect: Vec<(String, Option<[u8; 32]>)>,
        ops: Vec<ApplyOp>,
        dir_mtimes: Vec<(String, i64)>,
    ) -> Result<u32, AgentError> {
        match self.call(Request::ApplyOnce(rsb_protocol::ApplyOnceRequest {
            root: root.to_string_lossy().into_owned(),
            expect,
            ops,
            dir_mtimes,
            confine: None,
        })) {
            Reply::Applied(r) => Ok(r.applied),
            Reply::Error(e) => Err(e),
            other => panic!("unexpected reply {other:?}"),
        }
    }
}

#[test]
fn apply_once_checks_every_precondition_before_changing_anything() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    write(root, "a.txt", "old");
    fs::create_dir(root.join("d")).unwrap();
    let mut agent = Agent::start();

    // Preconditions hold: both files land, the root gets its mtime back, no staging is left.
    let mut ops = file_ops("a.txt", b"new", 0o640, 1_600_000_000_000_000_000);
    ops.extend(file_ops(
        "b.txt",
        b"fresh",
        0o644,
        1_600_000_000_000_000_000,
    ));
    let n = agent
        .apply_once(
            root,
            vec![("a.txt".into(), Some(b3(b"old"))), ("b.txt".into(), None)],
            ops,
            vec![(String::new(), 1_500_000_000_000_000_000)],
        )
        .unwrap();
    assert_eq!(n, 4);
    assert_eq!(fs::read(root.join("a.txt")).unwrap(), b"new");
    assert_eq!(fs::read(root.join("b.txt")).unwrap(), b"fresh");
    let m = fs::metadata(root.join("a.txt")).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o640);
    assert_eq!(mtime_ns(&m), 1_600_000_000_000_000_000);
    assert_eq!(
        mtime_ns(&fs::metadata(root).unwrap()),
        1_500_000_000_000_000_000
    );
    assert!(staging_dirs(root).is_empty());

    // One precondition fails (a.txt is no longer "old"; `d` is a directory): nothing changes,
    // not even the ops whose own preconditions held.
    for expect in [
        vec![("c.txt".into(), None), ("a.txt".into(), Some(b3(b"old")))],
        vec![("c.txt".into(), None), ("d".into(), None)],
        vec![("c.txt".into(), None), ("b.txt".into(), None)],
    ] {
        let mut ops = file_ops("c.txt", b"c", 0o644, 1);
        ops.push(ApplyOp::Delete {
            rel: "b.txt".into(),
        });
        let e = agent.apply_once(root, expect, ops, vec![]);
        expect_err(e, ErrorCode::AlreadyExists, "changed on the destination");
        assert!(!root.join("c.txt").exists());
        assert_eq!(fs::read(root.join("b.txt")).unwrap(), b"fresh");
        assert!(staging_dirs(root).is_empty());
    }

    // A missing root is an error, not created.
    let e = agent.apply_once(&root.join("nope"), vec![], vec![], vec![]);
    expect_err(e, ErrorCode::NotFound, "does not exist");
    assert!(!root.join("nope").exists());
}

/// An aborted session keeps the staged bytes of a large file; the next session's `FileResume`
/// takes them over (block hashes in the reply), and the commit still verifies the whole file.
/// Small staged files are not kept.
#[test]
fn aborted_large_file_is_kept_and_resumed() {
    use rsb_protocol::ApplyAbortRequest;
    use rsb_protocol::sync::{PARTIAL_DIR, PARTIAL_MIN};
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("dst");
    let mut a = Agent::start();
    let s = a.open(&root, true).session;
    let bs: u64 = 256 * 1024;
    let data: Vec<u8> = (0..PARTIAL_MIN + 3 * bs + 100)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let half = (PARTIAL_MIN + bs) as usize;
    a.apply(
        s,
        vec![
            ApplyOp::FileData {
                rel: "big.bin".into(),
                offset: 0,
                data: data[..half].to_vec(),
            },
            ApplyOp::FileData {
                rel: "small.bin".into(),
                offset: 0,
                data: vec![1; 1000],
            },
        ],
    )
    .unwrap();
    match a.call(Request::ApplyAbort(ApplyAbortRequest { session: s })) {
        Reply::Done => {}
        other => panic!("abort: {other:?}"),
    }
    let kept: Vec<_> = fs::read_dir(root.join(PARTIAL_DIR))
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .collect();
    assert_eq!(kept, vec![half as u64], "only the large file is kept");
    assert_eq!(
        fs::metadata(root.join(PARTIAL_DIR)).unwrap().mode() & 0o777,
        0o700
    );
    assert!(!root.join("big.bin").exists());

    // Resume: the whole blocks come back hashed; send the rest and commit.
    let s = a.open(&root, false).session;
    let seq = a.next_seq(s);
    let id = a.request(Request::Apply(ApplyRequest {
        session: s,
        seq,
        ops: vec![ApplyOp::FileResume {
            rel: "big.bin".into(),
            block_size: bs,
        }],
    }));
    let resumed = match a.wait_reply(id).1 {
        Reply::Applied(r) => r.resumed,
        other => panic!("resume: {other:?}"),
    };
    assert_eq!(resumed.len(), half / bs as usize);
    for (i, h) in resumed.iter().enumerate() {
        let b = &data[i * bs as usize..(i + 1) * bs as usize];
        assert_eq!(*h, b3(b), "block {i}");
    }
    assert!(!root.join(PARTIAL_DIR).exists(), "used up");
    a.apply(
        s,
        vec![
            ApplyOp::FileData {
                rel: "big.bin".into(),
                offset: half as u64,
                data: data[half..].to_vec(),
            },
            ApplyOp::FileCommit {
                rel: "big.bin".into(),
                size: data.len() as u64,
                mode: 0o644,
                mtime_ns: 1_000_000_000,
                hash: b3(&data),
            },
        ],
    )
    .unwrap();
    a.close(s, vec![]).unwrap();
    assert_eq!(fs::read(root.join("big.bin")).unwrap(), data);

    // Nothing kept: FileResume is a no-op with an empty answer.
    let s = a.open(&root, false).session;
    let seq = a.next_seq(s);
    let id = a.request(Request::Apply(ApplyRequest {
        session: s,
        seq,
        ops: vec![ApplyOp::FileResume {
            rel: "other.bin".into(),
            block_size: bs,
        }],
    }));
    match a.wait_reply(id).1 {
        Reply::Applied(r) => assert!(r.resumed.is_empty()),
        other => panic!("resume: {other:?}"),
    }
    a.close(s, vec![]).unwrap();
    assert!(staging_dirs(&root).is_empty());
}

/// A sparse source arrives sparse: all-zero 4 KiB blocks past the staged file's end become
/// holes (a trailing one too), and the bytes are exact.
#[test]
fn zero_blocks_of_a_new_file_stay_holes() {
    use std::os::unix::fs::MetadataExt;
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let mut agent = Agent::start();
    let s = agent.open(root, false).session;
    let mut body = vec![0u8; 3 << 20];
    body[(1 << 20) + 5] = 7;
    body[(2 << 20) - 1] = 9;
    let half = body.len() / 2;
    let ops = vec![
        ApplyOp::FileData {
            rel: "sparse.img".into(),
            offset: 0,
            data: body[..half].to_vec(),
        },
        ApplyOp::FileData {
            rel: "sparse.img".into(),
            offset: half as u64,
            data: body[half..].to_vec(),
        },
        ApplyOp::FileCommit {
            rel: "sparse.img".into(),
            size: body.len() as u64,
            mode: 0o644,
            mtime_ns: 1_000_000_000,
            hash: b3(&body),
        },
    ];
    assert_eq!(agent.apply(s, ops), Ok(3));
    agent.close(s, vec![]).unwrap();
    let p = root.join("sparse.img");
    assert_eq!(fs::read(&p).unwrap(), body);
    let m = fs::metadata(&p).unwrap();
    assert_eq!(m.len(), body.len() as u64);
    // Two 4 KiB blocks hold data; a file system without holes would allocate all 3 MiB.
    assert!(
        m.blocks() * 512 <= 64 * 1024,
        "{} bytes allocated",
        m.blocks() * 512
    );
}

fn source_files(seed: u32, n: u32) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let body: Vec<u8> = (0..2_000u32)
                .flat_map(|j| {
                    format!("fn f{seed}_{i}_{j}() {{ return {}; }}\n", j % 13).into_bytes()
                })
                .collect();
            (format!("s{seed}/f{i}.rs"), body)
        })
        .collect()
}

fn write_ops(files: &[(String, Vec<u8>)]) -> Vec<ApplyOp> {
    let mut ops = Vec::new();
    for (rel, body) in files {
        ops.push(ApplyOp::FileData {
            rel: rel.clone(),
            offset: 0,
            data: body.clone(),
        });
        ops.push(ApplyOp::FileCommit {
            rel: rel.clone(),
            size: body.len() as u64,
            mode: 0o644,
            mtime_ns: 1_000_000_000,
            hash: b3(body),
        });
    }
    ops
}

/// The next piece of `enc`'s stream carrying `ops`.
fn piece(enc: &mut rsb_protocol::compress::StreamEncoder, ops: &[ApplyOp]) -> ApplyOp {
    let raw = encode(&ops.to_vec()).unwrap();
    let (pos, data) = enc.piece(&raw).unwrap();
    ApplyOp::Stream {
        pos,
        raw_len: raw.len() as u64,
        data,
    }
}

/// An upload stream over several requests: every piece lands exact, counted op by op, and a
/// piece carrying what an earlier one did costs next to nothing (the stream's context).
#[test]
fn stream_pieces_land_exact_with_earlier_pieces_as_context() {
    use rsb_protocol::compress::StreamEncoder;
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let mut agent = Agent::start();
    let s = agent.open(root, false).session;
    agent
        .apply(
            s,
            vec![
                ApplyOp::Mkdir {
                    rel: "s1".into(),
                    mode: 0o755,
                },
                ApplyOp::Mkdir {
                    rel: "s2".into(),
                    mode: 0o755,
                },
            ],
        )
        .unwrap();
    let mut enc = StreamEncoder::new().unwrap();
    let first = write_ops(&source_files(1, 20));
    let one = piece(&mut enc, &first);
    // Raw ops beside a piece run in their places.
    let ops = vec![
        ApplyOp::Mkdir {
            rel: "d".into(),
            mode: 0o755,
        },
        one,
    ];
    assert_eq!(agent.apply(s, ops), Ok(1 + first.len() as u32));
    // The same files under other names: the second piece has the first as context.
    let again: Vec<(String, Vec<u8>)> = source_files(1, 20)
        .into_iter()
        .map(|(rel, body)| (rel.replace("s1/", "s2/"), body))
        .collect();
    let second = write_ops(&again);
    let two = piece(&mut enc, &second);
    let ApplyOp::Stream { data, raw_len, .. } = &two else {
        unreachable!()
    };
    assert!(
        (data.len() as u64) < raw_len / 50,
        "{} bytes for {raw_len} seen before",
        data.len()
    );
    assert_eq!(agent.apply(s, vec![two]), Ok(second.len() as u32));
    agent.close(s, vec![]).unwrap();
    for (rel, body) in source_files(1, 20).iter().chain(&again) {
        assert_eq!(&fs::read(root.join(rel)).unwrap(), body, "{rel}");
    }
    assert!(root.join("d").is_dir());
    assert_eq!(staged_files(root), Vec::<String>::new());
}

/// A piece that lies about its length, is not zstd, is out of position, does not decode to
/// ops, or nests another piece fails its request before any op runs, and the stream is broken
/// for the rest of the session: a good piece after it is refused too.
#[test]
fn a_bad_stream_piece_runs_nothing_and_breaks_the_stream() {
    use rsb_protocol::compress::{MAX_RAW, StreamEncoder};
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let files = source_files(7, 5);
    let good = write_ops(&files);
    let mkdir = ApplyOp::Mkdir {
        rel: "must-not-exist".into(),
        mode: 0o755,
    };
    type Bad = Box<dyn Fn(&mut StreamEncoder) -> ApplyOp>;
    let g = good.clone();
    let cases: Vec<(Bad, &str)> = vec![
        (
            Box::new(move |e: &mut StreamEncoder| match piece(e, &g) {
                ApplyOp::Stream { pos, raw_len, data } => ApplyOp::Stream {
                    pos,
                    raw_len: raw_len - 1,
                    data,
                },
                _ => unreachable!(),
            }),
            "more than",
        ),
        (
            Box::new(|_| ApplyOp::Stream {
                pos: 0,
                raw_len: 100,
                data: b"not zstd at all".to_vec(),
            }),
            "corrupt",
        ),
        (
            Box::new(|_| ApplyOp::Stream {
                pos: 0,
                raw_len: MAX_RAW as u64 + 1,
                data: vec![0; 10],
            }),
            "limit",
        ),
        (
            Box::new(|e: &mut StreamEncoder| {
                let skipped = piece(e, &[]);
                drop(skipped);
                piece(e, &[ApplyOp::Delete { rel: "x".into() }])
            }),
            "out of order",
        ),
        (
            Box::new(|e: &mut StreamEncoder| {
                let raw = vec![0xffu8; 4096];
                let (pos, data) = e.piece(&raw).unwrap();
                ApplyOp::Stream {
                    pos,
                    raw_len: raw.len() as u64,
                    data,
                }
            }),
            "decode",
        ),
        (
            Box::new(|e: &mut StreamEncoder| {
                let inner = ApplyOp::Stream {
                    pos: 0,
                    raw_len: 1,
                    data: vec![1],
                };
                piece(e, &[inner])
            }),
            "another stream piece",
        ),
    ];
    let mut agent = Agent::start();
    for (make, needle) in cases {
        let s = agent.open(root, false).session;
        let mut enc = StreamEncoder::new().unwrap();
        let bad = make(&mut enc);
        expect_err(
            agent.apply(s, vec![mkdir.clone(), bad]),
            ErrorCode::InvalidArgument,
            needle,
        );
        assert!(!root.join("must-not-exist").exists(), "{needle}");
        // Whatever the stream's state, the session takes no more pieces.
        let mut fresh = StreamEncoder::new().unwrap();
        let next = piece(&mut fresh, &good);
        let e = agent.apply(s, vec![next]).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{needle}: {e:?}");
        agent.close(s, vec![]).unwrap_or_default();
        assert!(!root.join("s7").exists(), "{needle}");
    }
    assert_eq!(staged_files(root), Vec::<String>::new());
}

#[test]
fn a_compressed_manifest_holds_the_same_entries() {
    let t = tempfile::tempdir().unwrap();
    for i in 0..300 {
        write(
            t.path(),
            &format!("src/mod{}/file_{i}.rs", i % 7),
            format!("{i}"),
        );
    }
    let mut agent = Agent::start();
    let plain = agent.manifest_with(t.path(), defaults(&[]), true);
    let id = agent.request(Request::Manifest(ManifestRequest {
        root: t.path().to_str().unwrap().into(),
        rules: defaults(&[]),
        hash: true,
        compress: true,
        expect: None,
        confine: None,
    }));
    let (chunks, reply) = agent.wait_reply(id);
    assert!(matches!(reply, Reply::Manifest(_)), "{reply:?}");
    let mut entries = Vec::new();
    let mut compressed = 0;
    for c in chunks {
        match c {
            Chunk::ManifestZ { raw_len, data } => {
                compressed += 1;
                assert!((data.len() as u64) < raw_len, "{} of {raw_len}", data.len());
                let raw = rsb_protocol::compress::decompress(&data, raw_len).unwrap();
                entries.extend(decode::<Vec<ManifestEntry>>(&raw).unwrap());
            }
            Chunk::Manifest(b) => entries.extend(b),
            other => panic!("unexpected chunk {other:?}"),
        }
    }
    assert!(compressed > 0, "no batch was sent compressed");
    let want: Vec<ManifestEntry> = plain.batches.into_iter().flatten().collect();
    assert_eq!(entries, want);
}
