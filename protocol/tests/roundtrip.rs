//! Every message survives encode → decode unchanged, and hostile bytes give an error, never a panic.

use rsb_protocol::*;

fn samples() -> (Vec<ToAgent>, Vec<FromAgent>) {
    let exec = ExecRequest {
        command: "echo 'hi'; exit 3".into(),
        cwd: Some("/tmp/a b".into()),
        env: vec![("K".into(), "v=1".into())],
        timeout_ms: 2_000,
        kill_grace_ms: 500,
        max_stdout: 10,
        max_stderr: 20,
        stream: true,
        stdin: true,
        tty: Some(TtySize { rows: 24, cols: 80 }),
        confine: Some(Confine {
            write: vec!["~/work".into(), "/tmp".into()],
            read: Some(vec!["~/data".into()]),
            net: Some(vec![443, 22]),
            require: false,
        }),
    };
    let requests = vec![
        Request::Ping(PingRequest {
            payload: vec![0, 1, 255],
        }),
        Request::Exec(exec),
        Request::Stat(StatRequest {
            path: "~/x".into(),
            follow: true,
            confine: None,
        }),
        Request::ListDir(ListDirRequest {
            path: ".".into(),
            recursive: true,
            max_entries: 5,
            confine: None,
        }),
        Request::ReadFile(ReadFileRequest {
            path: "f".into(),
            offset: 7,
            max_bytes: 9,
            confine: None,
        }),
        Request::Resources(ResourcesRequest { max_wait_ms: 300 }),
        Request::JobStart(JobStartRequest {
            name: "train-1".into(),
            command: "python x.py".into(),
            cwd: None,
            log_file: ".codex_logs/train-1.log".into(),
            env: vec![],
            prefer_tmux: true,
            launch_id: None,
            confine: Some(Confine {
                write: vec!["/scratch".into()],
                read: None,
                net: Some(vec![]),
                require: true,
            }),
            gpus: Some(GpuAsk {
                count: 2,
                candidates: vec!["GPU-a".into(), "MIG-b".into()],
            }),
        }),
        Request::JobStatus(JobStatusRequest {
            name: "j".into(),
            log_file: None,
            last_n_lines: 50,
            offset: Some(12),
            max_bytes: 100,
        }),
        Request::JobKill(JobKillRequest {
            name: "j".into(),
            grace_ms: 1000,
        }),
        Request::JobList(JobListRequest),
        Request::Manifest(ManifestRequest {
            root: "~/proj".into(),
            rules: SyncRules {
                default_excludes: true,
                lines: vec!["*.log".into(), "!keep.log".into()],
                gitignore: true,
                gitignore_files: Some(vec![("sub".into(), vec!["!x".into()])]),
            },
            hash: true,
            compress: true,
            expect: Some([7; 32]),
            confine: None,
        }),
        Request::BlockHashes(BlockHashesRequest {
            path: "big.bin".into(),
            block_size: 262_144,
            confine: None,
        }),
        Request::ApplyOpen(ApplyOpenRequest {
            root: "/dst".into(),
            create_root: true,
            confine: Some(Confine {
                write: vec!["/dst".into()],
                read: None,
                net: None,
                require: true,
            }),
        }),
        Request::Apply(ApplyRequest {
            session: 9,
            seq: 3,
            ops: vec![
                ApplyOp::Mkdir {
                    rel: "a".into(),
                    mode: 0o755,
                },
                ApplyOp::Symlink {
                    rel: "a/l".into(),
                    target: "../x".into(),
                },
                ApplyOp::FileBase { rel: "big".into() },
                ApplyOp::FileData {
                    rel: "big".into(),
                    offset: 4096,
                    data: vec![1, 2, 3],
                },
                ApplyOp::FileCommit {
                    rel: "big".into(),
                    size: 3,
                    mode: 0o644,
                    mtime_ns: -1,
                    hash: [7; 32],
                },
                ApplyOp::SetAttr {
                    rel: "a".into(),
                    mode: None,
                    mtime_ns: Some(5),
                },
                ApplyOp::Delete { rel: "old".into() },
                ApplyOp::FileResume {
                    rel: "big".into(),
                    block_size: 1 << 18,
                },
                ApplyOp::Stream {
                    pos: 300,
                    raw_len: 200,
                    data: vec![3, 4, 5],
                },
                ApplyOp::FileShare { rel: "big".into() },
            ],
        }),
        Request::ApplyClose(ApplyCloseRequest {
            session: 9,
            seq: 4,
            dir_mtimes: vec![("a".into(), 1)],
        }),
        Request::ApplyAbort(ApplyAbortRequest { session: 9 }),
        Request::ApplyOnce(ApplyOnceRequest {
            root: "/dst".into(),
            expect: vec![("a".into(), Some([3; 32])), ("b".into(), None)],
            ops: vec![ApplyOp::Delete { rel: "a".into() }],
            dir_mtimes: vec![(String::new(), 7)],
            confine: None,
        }),
        Request::ReadFileZ(ReadFileZRequest {
            path: "/f".into(),
            offset: 5,
            max_bytes: 1 << 20,
            compress: true,
            whole: true,
            confine: None,
        }),
        Request::ReadText(ReadTextRequest {
            path: "~/a.rs".into(),
            lines: Some(LineRange {
                first: 3,
                count: 10,
            }),
            max_bytes: 1000,
            confine: None,
        }),
        Request::Edit(EditRequest {
            path: "~/a.rs".into(),
            old: "a\r\n".into(),
            new: "é".into(),
            replace_all: true,
            expected_hash: Some("0f".repeat(16)),
            confine: Some(Confine {
                write: vec!["~/w".into(), "/tmp".into()],
                read: None,
                net: Some(vec![]),
                require: false,
            }),
        }),
        Request::Write(WriteRequest {
            path: "d/n".into(),
            data: vec![0, 255],
            condition: WriteCondition::CreateOnly,
            make_dirs: true,
            confine: None,
        }),
        Request::Patch(PatchRequest {
            files: vec![
                PatchFile {
                    path: "a".into(),
                    op: PatchOp::Add { text: "x\n".into() },
                },
                PatchFile {
                    path: "b".into(),
                    op: PatchOp::Delete,
                },
                PatchFile {
                    path: "c".into(),
                    op: PatchOp::Update {
                        move_to: Some("d".into()),
                        chunks: vec![PatchChunk {
                            context: Some("fn f()".into()),
                            old: vec!["a".into()],
                            new: vec!["b".into(), "c".into()],
                            end_of_file: true,
                        }],
                    },
                },
            ],
            confine: Some(Confine {
                write: vec![],
                read: None,
                net: None,
                require: true,
            }),
        }),
        Request::Search(SearchRequest {
            root: "~/proj".into(),
            pattern: "fn \\w+\\(".into(),
            literal: false,
            ignore_case: true,
            globs: vec!["*.rs".into(), "!target/**".into()],
            before: 2,
            after: 3,
            word: true,
            invert: true,
            multiline: true,
            hidden: true,
            types: vec!["*.py".into(), "*.pyi".into()],
            types_not: vec!["*.md".into()],
            mode: SearchMode::Count,
            offset: 7,
            limit: 100,
            no_ignore: true,
            max_filesize: 1 << 24,
            max_line_bytes: 500,
            deadline_ms: 30_000,
            stream: true,
            ranges: false,
            confine: None,
        }),
        Request::JobEvents(JobEventsRequest {
            names: vec!["train".into()],
            since_ms: 1_700_000_000_000,
            until_ended: true,
            output_after: Some(4096),
        }),
        Request::StagedWrite(StagedWriteRequest {
            root: "/r".into(),
            staging: ".rsb-staging-9".into(),
            name: "f1-big".into(),
            offset: 1 << 20,
            raw_len: Some(9),
            data: vec![1, 2, 3],
            confine: None,
        }),
    ];
    let mut to_agent: Vec<ToAgent> = requests
        .into_iter()
        .enumerate()
        .map(|(i, body)| ToAgent::Request {
            id: i as u64 * 1_000_003,
            body,
        })
        .collect();
    to_agent.push(ToAgent::Cancel { id: u64::MAX });
    for input in [
        ExecInput::Data(b"in\xff".to_vec()),
        ExecInput::Eof,
        ExecInput::Resize(TtySize {
            rows: 50,
            cols: 132,
        }),
    ] {
        to_agent.push(ToAgent::Input { id: 9, input });
    }
    to_agent.push(ToAgent::Credit {
        id: 9,
        bytes: 4 << 20,
    });

    let job = JobInfo {
        name: "j".into(),
        command: "c".into(),
        cwd: "/".into(),
        log_file: "/l".into(),
        runner: "tmux".into(),
        pid: 42,
        started_ms: 1,
        state: JobState::Exited,
        exit_code: Some(7),
        signal: None,
        oom_kill: Some(OomKill::Cgroup),
        ended_ms: Some(2),
        launch_id: "L".into(),
        log_start: 0,
        previous: None,
        unconfined: None,
        gpus: vec![],
    };
    let again = JobInfo {
        log_start: 31,
        previous: Some(Box::new(job.clone())),
        unconfined: Some("no Landlock".into()),
        gpus: vec!["GPU-a".into()],
        ..job.clone()
    };
    let replies = vec![
        Reply::Pong(vec![9]),
        Reply::Exec(ExecResult {
            exit_code: None,
            signal: Some(9),
            timed_out: true,
            cancelled: false,
            duration_ms: 2001,
            stdout: Captured {
                head: b"a".to_vec(),
                tail: b"z".to_vec(),
                total: 100,
            },
            stderr: Captured::default(),
            survivors: vec![4242],
            unconfined: Some("no Landlock".into()),
        }),
        Reply::Stat(FileStat {
            path: "/x".into(),
            kind: FileKind::Symlink,
            size: 3,
            mode: 0o777,
            mtime_ns: -5,
            symlink_target: Some("../y".into()),
        }),
        Reply::ListDir(ListDirResult {
            root: "/r".into(),
            entries: vec![DirEntry {
                rel: "a/b".into(),
                kind: FileKind::File,
                size: 1,
                mode: 0o644,
                mtime_ns: 1_700_000_000_000_000_000,
            }],
            truncated: true,
            errors: vec!["sub: permission denied".into()],
        }),
        Reply::ReadFile(ReadFileResult {
            path: "/f".into(),
            size: 10,
            offset: 2,
            data: vec![0xff, 0xfe],
            truncated: true,
        }),
        Reply::Resources(ResourceSnapshot {
            hostname: "h".into(),
            cpu: CpuInfo {
                usage_pct: 12.5,
                count: 2,
                load_1m: 0.5,
                load_5m: 0.25,
                load_15m: 0.1,
                interval_ms: 1000,
            },
            memory: MemoryInfo {
                total_bytes: 1,
                used_bytes: 1,
                available_bytes: 0,
                swap_total_bytes: 0,
                swap_used_bytes: 0,
            },
            disk: Some(DiskInfo {
                path: "/root".into(),
                total_bytes: 10,
                free_bytes: 5,
            }),
            uptime_s: 99,
            gpu: GpuReport {
                source: GpuSource::NvidiaSmi,
                gpus: vec![GpuInfo {
                    index: 0,
                    name: "H200".into(),
                    uuid: "GPU-1".into(),
                    util_pct: None,
                    mem_used_mib: Some(1),
                    mem_total_mib: Some(2),
                    temperature_c: Some(40.0),
                    power_w: None,
                    lease: Some(GpuHolder {
                        pid: 3,
                        uid: Some(1000),
                        job: Some("train".into()),
                    }),
                }],
                processes: vec![GpuProcess {
                    pid: 1,
                    gpu_uuid: "GPU-1".into(),
                    used_mem_mib: Some(5),
                    uid: Some(0),
                    job: None,
                }],
                note: Some("n".into()),
                age_ms: 3,
            },
        }),
        Reply::Job(job.clone()),
        Reply::Job(again.clone()),
        Reply::JobStatus(JobStatusResult {
            info: Some(job.clone()),
            log_found: true,
            log: b"EXIT_CODE=7\n".to_vec(),
            log_start: 0,
            next_offset: 12,
            log_size: 12,
            log_truncated: false,
        }),
        Reply::JobList(vec![job]),
        Reply::Manifest(ManifestSummary {
            root: "/r".into(),
            root_kind: Some(FileKind::Dir),
            entries: 2,
            skipped_special: vec!["fifo".into()],
            skipped_special_count: 1,
            hashed_bytes: 0,
            errors: vec![],
            gitignore_files: vec![(String::new(), vec!["*.o".into()])],
            unchanged: true,
        }),
        Reply::BlockHashes(BlockHashesResult {
            size: 5,
            hashes: vec![[1; 32]],
        }),
        Reply::ApplyOpened(ApplyOpened {
            session: 1,
            root: "/r".into(),
            stale_cleaned: 2,
            staging: ".rsb-staging-1".into(),
        }),
        Reply::Applied(ApplyResult {
            applied: 7,
            warnings: vec!["w".into()],
            resumed: vec![[2; 32]],
            shared: vec!["f1-x".into()],
        }),
        Reply::Done,
        Reply::Error(AgentError::new(ErrorCode::NotFound, "nope")),
        Reply::ReadFileZ(ReadFileZResult {
            raw_len: 10,
            compressed: true,
            data: vec![7; 3],
            truncated: false,
            settled: true,
        }),
        Reply::ReadText(ReadTextResult {
            path: "/h/a.rs".into(),
            size: 9,
            hash: Some("ab".repeat(16)),
            data: b"x\n".to_vec(),
            truncated: true,
            first_line: 3,
            lines: 1,
            total_lines: None,
        }),
        Reply::Edited(EditOutcome::Done(Changed {
            in_place: false,
            path: "/h/a.rs".into(),
            hash: "cd".repeat(16),
            created: false,
            replacements: 2,
            changed_lines: vec![(1, 2), (9, 9)],
            diff: "@@ -1 +1 @@\n-a\n+b\n".into(),
            diff_truncated: false,
        })),
        Reply::Edited(EditOutcome::Refused(Refusal::NoMatch {
            near: vec![NearLine {
                line: 4,
                text: "  a".into(),
            }],
        })),
        Reply::Edited(EditOutcome::Refused(Refusal::Changed { current: None })),
        Reply::Patched(PatchOutcome::Refused {
            path: "c".into(),
            hunk: 2,
            refusal: Refusal::Ambiguous { count: 2 },
        }),
        Reply::Searched(SearchResult {
            root: "/home/u/proj".into(),
            total: 3,
            total_matches: 3,
            files_matched: 2,
            entries: vec![SearchEntry {
                path: "caf\u{fffd}.rs".into(),
                exact_path: false,
                line: Some(SearchLine {
                    number: 4,
                    offset: 1 << 33,
                    text: "fn é()".into(),
                    cut: 9,
                    matches: vec![(0, 5)],
                    raw: Some(b"fn \xe9()\r".to_vec()),
                }),
                before: vec![],
                after: vec![SearchLine {
                    number: 5,
                    offset: 88,
                    text: String::new(),
                    cut: 0,
                    matches: vec![],
                    raw: None,
                }],
                count: 1,
                file_bytes: 1 << 34,
            }],
            files_searched: 10,
            skipped_binary: 1,
            skipped_large: 0,
            skipped_slow_lines: 2,
            complete: false,
            errors: vec!["x: Permission denied".into()],
        }),
    ];
    let mut from_agent: Vec<FromAgent> = vec![FromAgent::Hello(Hello {
        magic: MAGIC,
        protocol_version: PROTOCOL_VERSION,
        protocol_fingerprint: PROTOCOL_FINGERPRINT.into(),
        agent_version: "0.1.0".into(),
        agent_hash: "ab".repeat(32),
        os: "linux".into(),
        arch: "x86_64".into(),
        kernel: "6.1".into(),
        hostname: "h".into(),
        user: "u".into(),
        uid: 1000,
        home: "/home/u".into(),
        pid: 7,
        capabilities: Capabilities {
            bash: true,
            tmux: false,
            nvidia_smi: true,
            nvml: false,
            landlock_abi: 7,
        },
    })];
    from_agent.extend(
        replies
            .into_iter()
            .map(|body| FromAgent::Reply { id: 3, body }),
    );
    from_agent.push(FromAgent::Chunk {
        id: 4,
        chunk: Chunk::Stdout(b"out".to_vec()),
    });
    from_agent.push(FromAgent::Chunk {
        id: 4,
        chunk: Chunk::Stderr(vec![0x80]),
    });
    from_agent.push(FromAgent::Chunk {
        id: 4,
        chunk: Chunk::InputConsumed(65536),
    });
    from_agent.push(FromAgent::Chunk {
        id: 5,
        chunk: Chunk::Search(vec![SearchEntry {
            path: "a.rs".into(),
            exact_path: true,
            line: None,
            before: vec![],
            after: vec![],
            count: 3,
            file_bytes: 12,
        }]),
    });
    from_agent.push(FromAgent::Chunk {
        id: 6,
        chunk: Chunk::JobEvent(Box::new(JobEvent {
            kind: JobEventKind::Lost,
            info: again.clone(),
            last_line: Some("epoch 3/10".into()),
        })),
    });
    (to_agent, from_agent)
}

#[test]
fn every_message_round_trips() {
    let (to, from) = samples();
    let kinds: Vec<&str> = to
        .iter()
        .filter_map(|m| match m {
            ToAgent::Request { body, .. } => Some(body.kind()),
            ToAgent::Cancel { .. } | ToAgent::Input { .. } | ToAgent::Credit { .. } => None,
        })
        .collect();
    assert_eq!(
        kinds,
        Request::KINDS,
        "one sample per request kind, in wire order"
    );
    for m in &to {
        let bytes = encode(m).unwrap();
        assert_eq!(&decode::<ToAgent>(&bytes).unwrap(), m);
    }
    for m in &from {
        let bytes = encode(m).unwrap();
        assert_eq!(&decode::<FromAgent>(&bytes).unwrap(), m);
    }
}

/// xorshift64: deterministic, dependency-free noise.
struct Noise(u64);
impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Every strict prefix of a frame and the frame with any trailing byte must fail to decode as
/// its own type: a decoder that accepted either would let a cut or a run-on frame through.
fn assert_exact<T>(name: &str, frame: &[u8])
where
    T: serde::de::DeserializeOwned + std::fmt::Debug,
{
    for cut in 0..frame.len() {
        if let Ok(v) = decode::<T>(&frame[..cut]) {
            panic!(
                "{name}: the {cut}-byte prefix of a {}-byte frame decoded as {v:?}",
                frame.len()
            );
        }
    }
    for extra in [0u8, 1, 0x7f, 0xff] {
        let mut longer = frame.to_vec();
        longer.push(extra);
        assert!(
            decode::<T>(&longer).is_err(),
            "{name}: a trailing {extra:#04x} was accepted"
        );
    }
    let mut doubled = frame.to_vec();
    doubled.extend_from_slice(frame);
    assert!(
        decode::<T>(&doubled).is_err(),
        "{name}: two frames back to back were accepted as one"
    );
}

#[test]
fn every_strict_prefix_and_any_trailing_bytes_fail() {
    let (to, from) = samples();
    for m in &to {
        let name = match m {
            ToAgent::Request { body, .. } => body.kind(),
            ToAgent::Cancel { .. } => "cancel",
            ToAgent::Input { .. } => "input",
            ToAgent::Credit { .. } => "credit",
        };
        assert_exact::<ToAgent>(name, &encode(m).unwrap());
    }
    for m in &from {
        let name = match m {
            FromAgent::Hello(_) => "hello",
            FromAgent::Reply { body, .. } => body.kind(),
            FromAgent::Chunk { .. } => "chunk",
        };
        assert_exact::<FromAgent>(name, &encode(m).unwrap());
    }
}

#[test]
fn garbage_frames_are_errors_not_panics() {
    let (to, from) = samples();
    let mut frames: Vec<Vec<u8>> = to.iter().map(|m| encode(m).unwrap().to_vec()).collect();
    frames.extend(from.iter().map(|m| encode(m).unwrap().to_vec()));
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    for f in &frames {
        // Random bit flips: any result is fine as long as nothing panics.
        for _ in 0..200 {
            let mut g = f.clone();
            let i = (noise.next() as usize) % g.len();
            g[i] ^= 1 << (noise.next() % 8);
            let _ = decode::<FromAgent>(&g);
            let _ = decode::<ToAgent>(&g);
        }
    }
    // Pure noise, including huge claimed lengths inside the body.
    for len in [0usize, 1, 2, 7, 64, 4096] {
        for _ in 0..200 {
            let g: Vec<u8> = (0..len).map(|_| noise.next() as u8).collect();
            let _ = decode::<FromAgent>(&g);
            let _ = decode::<ToAgent>(&g);
        }
    }
    // A length prefix claiming more than the whole buffer must not allocate it.
    let huge = [0xfcu8, 0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0];
    assert!(decode::<Vec<u8>>(&huge).is_err());
}

#[test]
fn oversized_frames_are_refused_at_the_sender() {
    let big = ToAgent::Request {
        id: 1,
        body: Request::Ping(PingRequest {
            payload: vec![0; MAX_FRAME + 1],
        }),
    };
    assert!(matches!(
        encode(&big),
        Err(CodecError::Encode(_)) | Err(CodecError::TooLarge(_))
    ));
}

#[tokio::test]
async fn framing_rejects_a_length_over_the_limit() {
    use futures::StreamExt;
    use tokio_util::codec::FramedRead;
    let mut raw = Vec::new();
    raw.extend_from_slice(&((MAX_FRAME as u32) + 1).to_be_bytes());
    raw.extend_from_slice(&[0u8; 16]);
    let mut fr = FramedRead::new(&raw[..], frame_codec());
    assert!(fr.next().await.unwrap().is_err());
}

/// `Call` ties each request to one reply variant: the agent's wrapping and the client's
/// unwrapping agree, the name is the request's kind, and any other reply is handed back.
#[test]
fn each_call_unwraps_only_its_own_reply() {
    fn check<C: Call>(req: C, reply: C::Reply)
    where
        C::Reply: Clone + PartialEq + std::fmt::Debug,
    {
        let wire_req: Request = req.into();
        assert_eq!(wire_req.kind(), C::NAME);
        let wire = C::into_reply(reply.clone());
        assert_eq!(C::from_reply(wire.clone()), Ok(reply));
        let err = Reply::Error(AgentError::new(ErrorCode::Io, "x"));
        assert_eq!(C::from_reply(err.clone()), Err(Box::new(err)));
        // A reply of another variant is returned as is, not misread.
        let other = if matches!(wire, Reply::Done) {
            Reply::Pong(vec![1])
        } else {
            Reply::Done
        };
        assert_eq!(C::from_reply(other.clone()), Err(Box::new(other)));
    }
    let (to, from) = samples();
    let reqs: Vec<Request> = to
        .into_iter()
        .filter_map(|m| match m {
            ToAgent::Request { body, .. } => Some(body),
            ToAgent::Cancel { .. } | ToAgent::Input { .. } | ToAgent::Credit { .. } => None,
        })
        .collect();
    let replies: Vec<Reply> = from
        .into_iter()
        .filter_map(|m| match m {
            FromAgent::Reply { body, .. } => Some(body),
            _ => None,
        })
        .collect();
    let reply = |kind: &str| {
        replies
            .iter()
            .find(|r| r.kind() == kind)
            .cloned()
            .unwrap_or_else(|| panic!("no {kind} reply sample"))
    };
    let mut checked = 0;
    for r in reqs {
        checked += 1;
        match r {
            Request::Ping(q) => check(q, vec![9]),
            Request::Exec(q) => check(q, ExecRequest::from_reply(reply("exec")).unwrap()),
            Request::Stat(q) => check(q, StatRequest::from_reply(reply("stat")).unwrap()),
            Request::ListDir(q) => check(q, ListDirRequest::from_reply(reply("list_dir")).unwrap()),
            Request::ReadFile(q) => {
                check(q, ReadFileRequest::from_reply(reply("read_file")).unwrap())
            }
            Request::Resources(q) => {
                check(q, ResourcesRequest::from_reply(reply("resources")).unwrap())
            }
            Request::JobStart(q) => check(q, JobStartRequest::from_reply(reply("job")).unwrap()),
            Request::JobStatus(q) => check(
                q,
                JobStatusRequest::from_reply(reply("job_status")).unwrap(),
            ),
            Request::JobKill(q) => check(q, JobKillRequest::from_reply(reply("job")).unwrap()),
            Request::JobList(q) => check(q, JobListRequest::from_reply(reply("job_list")).unwrap()),
            Request::Manifest(q) => {
                check(q, ManifestRequest::from_reply(reply("manifest")).unwrap())
            }
            Request::BlockHashes(q) => check(
                q,
                BlockHashesRequest::from_reply(reply("block_hashes")).unwrap(),
            ),
            Request::ApplyOpen(q) => check(
                q,
                ApplyOpenRequest::from_reply(reply("apply_opened")).unwrap(),
            ),
            Request::Apply(q) => check(q, ApplyRequest::from_reply(reply("applied")).unwrap()),
            Request::ApplyClose(q) => check(q, ApplyResult::default()),
            Request::ApplyAbort(q) => check(q, ()),
            Request::ApplyOnce(q) => check(
                q,
                ApplyResult {
                    applied: 1,
                    ..ApplyResult::default()
                },
            ),
            Request::ReadFileZ(q) => check(
                q,
                ReadFileZRequest::from_reply(reply("read_file_z")).unwrap(),
            ),
            Request::ReadText(q) => {
                check(q, ReadTextRequest::from_reply(reply("read_text")).unwrap())
            }
            Request::Edit(q) => check(q, EditRequest::from_reply(reply("edited")).unwrap()),
            Request::Write(q) => check(q, EditOutcome::Refused(Refusal::Exists)),
            Request::Patch(q) => check(q, PatchRequest::from_reply(reply("patched")).unwrap()),
            Request::Search(q) => check(q, SearchRequest::from_reply(reply("searched")).unwrap()),
            Request::JobEvents(q) => {
                check(q, JobEventsRequest::from_reply(reply("job_list")).unwrap())
            }
            Request::StagedWrite(q) => check(q, ()),
        }
    }
    assert_eq!(checked, Request::KINDS.len());
}
