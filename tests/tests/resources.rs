//! Issue 4 acceptance: resource sampling end to end against real private sshds.
//!
//! A fake `nvidia-smi` is put first on the sandbox's PATH (sshd `SetEnv`), so the agent's
//! nvidia-smi sampler, its `[N/A]` handling, its deadline and its failure notes are exercised
//! for real, through `list_sandboxes(check_resources=true)` (`rsb::ops::sandboxes::list`),
//! `select_sandbox("auto")` and the `rsb` / `rsb-agent` CLIs. Every test is bounded in time.

mod common;

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rsb::{config::SshTarget, error::Kind, ops::sandboxes, pool::Pool};
use rsb_tests::{ChaosProxy, Sshd, SshdOptions, output_with_timeout};
use serde_json::Value;

/// Upper bound for any single test: a wedged call fails the test instead of hanging the suite.
const TEST_LIMIT: Duration = Duration::from_secs(120);

async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(TEST_LIMIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {TEST_LIMIT:?}"),
    }
}

// ------------------------------------------------------------------------------------------
// Fake nvidia-smi
// ------------------------------------------------------------------------------------------

const UUID0: &str = "GPU-11111111-aaaa-bbbb-cccc-000000000000";
const UUID1: &str = "GPU-22222222-aaaa-bbbb-cccc-111111111111";

/// Two GPUs; GPU 1's utilisation (and power) is `[N/A]`; one compute process on each GPU.
fn two_gpus_script() -> String {
    format!(
        "#!/bin/sh\n\
         case \"$*\" in\n\
         *--query-gpu=*)\n\
         echo '0, NVIDIA Fake A100-SXM4-80GB, {UUID0}, 37, 20480, 81920, 41, 123.45'\n\
         echo '1, NVIDIA Fake H200, {UUID1}, [N/A], 2048, 143771, 35, [N/A]'\n\
         ;;\n\
         *--query-compute-apps=*)\n\
         echo '4242, {UUID0}, 500'\n\
         echo '4343, {UUID1}, 700'\n\
         ;;\n\
         *) echo \"fake nvidia-smi: unexpected args: $*\" >&2; exit 2 ;;\n\
         esac\n"
    )
}

/// One GPU at the given utilisation, no processes.
fn one_gpu_script(util: u32) -> String {
    format!(
        "#!/bin/sh\n\
         case \"$*\" in\n\
         *--query-gpu=*) echo '0, NVIDIA Fake L4, {UUID0}, {util}, 1000, 23034, 50, 60.00' ;;\n\
         *--query-compute-apps=*) : ;;\n\
         *) exit 2 ;;\n\
         esac\n"
    )
}

const HANG_SCRIPT: &str = "#!/bin/sh\nsleep 30\n";
const EXIT9_SCRIPT: &str = "#!/bin/sh\n\
    echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\n\
    exit 9\n";

/// A directory holding `nvidia-smi` (when `script` is given) and the PATH value that puts it
/// first. `None` gives an empty directory: a PATH with no nvidia-smi on it.
struct FakeBin {
    dir: tempfile::TempDir,
}

impl FakeBin {
    fn new(script: Option<&str>) -> FakeBin {
        let dir = tempfile::Builder::new()
            .prefix("rsb-fakebin-")
            .tempdir()
            .unwrap();
        // The sandbox user (maybe not us, never a problem here) must be able to traverse it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        if let Some(s) = script {
            let p = dir.path().join("nvidia-smi");
            std::fs::write(&p, s).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        FakeBin { dir }
    }

    fn path_env(&self) -> String {
        format!("{}:/usr/bin:/bin", self.dir.path().display())
    }
}

/// An sshd whose sessions (and so the agent) see `fake` first on PATH, plus `extra` env.
fn sshd_with(fake: &FakeBin, extra: &[(&str, &str)]) -> Sshd {
    let mut set_env = vec![("PATH".to_string(), fake.path_env())];
    set_env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Sshd::start_with(SshdOptions {
        set_env,
        ..Default::default()
    })
    .unwrap()
}

// ------------------------------------------------------------------------------------------
// Pools and reply helpers
// ------------------------------------------------------------------------------------------

/// A key-auth target for `sshd`, reached on `port` (the sshd's own, or a proxy's).
fn target_via(sshd: &Sshd, port: u16, connect_timeout: Duration, dir: &Path) -> SshTarget {
    let mut t = target(sshd, port, key_auth(sshd), &dir.join("known_hosts"));
    t.connect_timeout = connect_timeout;
    t
}

fn pool_with(sandboxes: Vec<(&str, SshTarget)>, dir: &Path) -> Arc<Pool> {
    pool_of(
        sandboxes.into_iter().map(|(n, t)| sandbox(n, t)).collect(),
        dir,
    )
}

/// A loopback port nobody listens on: connecting is refused at once.
fn refused_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn entry<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["sandboxes"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == name))
        .unwrap_or_else(|| panic!("no sandbox '{name}' in {v:#}"))
}

fn resources<'a>(v: &'a Value, name: &str) -> &'a Value {
    let r = &entry(v, name)["resources"];
    assert!(
        r.get("error").is_none() && r.is_object(),
        "'{name}' has no resources: {r:#}"
    );
    r
}

fn f(v: &Value) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("expected a number, got {v}"))
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// The documented formula (seed-inventory §3.3, CPU from real utilisation), recomputed from the
/// reply's own displayed numbers.
fn expected_idle_score(r: &Value) -> f64 {
    let cpu = (f(&r["cpu"]["usage_pct"]) / 100.0).clamp(0.0, 1.0);
    let mem = (f(&r["memory"]["used_pct"]) / 100.0).clamp(0.0, 1.0);
    let utils: Vec<f64> = r["gpu"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|g| g["util_pct"].as_f64())
        .collect();
    let gpu = if utils.is_empty() {
        0.0
    } else {
        (utils.iter().sum::<f64>() / utils.len() as f64 / 100.0).clamp(0.0, 1.0)
    };
    round3((1.0 - cpu) * 0.4 + (1.0 - mem) * 0.4 + (1.0 - gpu) * 0.2)
}

fn assert_idle_score(r: &Value) {
    let got = f(&r["idle_score"]);
    let want = expected_idle_score(r);
    assert!(
        (got - want).abs() <= 0.002,
        "idle_score {got} != formula {want} from the reply's numbers: {r:#}"
    );
    assert!((0.0..=1.0).contains(&got), "{got}");
}

/// The seed's keys are all there, with plausible values for this very host (the sshd runs here).
fn assert_seed_keys(r: &Value) {
    for k in ["load_1m", "load_5m", "load_15m", "count", "usage_pct"] {
        assert!(r["cpu"][k].is_number(), "cpu.{k} missing: {r:#}");
    }
    for k in ["total_mb", "used_mb", "free_mb", "used_pct"] {
        assert!(r["memory"][k].is_number(), "memory.{k} missing: {r:#}");
    }
    assert!(r["gpu"].is_array(), "{r:#}");
    assert!(r["idle_score"].is_number(), "{r:#}");
    let cpus = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count() as u64;
    assert_eq!(r["cpu"]["count"].as_u64(), Some(cpus), "{r:#}");
    let mem_total_kb: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap();
    let total_mb = r["memory"]["total_mb"].as_u64().unwrap();
    assert!(
        total_mb.abs_diff(mem_total_kb / 1024) <= 1,
        "memory.total_mb {total_mb} vs /proc/meminfo {} MB",
        mem_total_kb / 1024
    );
    let pct = f(&r["cpu"]["usage_pct"]);
    assert!((0.0..=100.0).contains(&pct), "{pct}");
}

async fn list_timed(pool: &Arc<Pool>) -> (Value, Duration) {
    let t0 = Instant::now();
    let v =
        serde_json::to_value(sandboxes::list(pool, sandboxes::Listing::Resources).await).unwrap();
    (v, t0.elapsed())
}

// ------------------------------------------------------------------------------------------
// 1. GPU list from a fake nvidia-smi; idle_score formula
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvidia_smi_two_gpus_and_idle_score() {
    let fake = FakeBin::new(Some(&two_gpus_script()));
    let sshd = sshd_with(&fake, &[]);
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    bounded("two gpus", async {
        let (v, took) = list_timed(&pool).await;
        eprintln!("cold list(check_resources) took {took:?}:\n{v:#}");
        let e = entry(&v, "s");
        assert_eq!(e["connection_alive"], true, "{e:#}");
        let r = resources(&v, "s");
        assert_seed_keys(r);
        assert_eq!(r["gpu_source"], "nvidia-smi", "{r:#}");
        assert!(
            r.get("gpu_note").is_none(),
            "a clean pass has no note: {r:#}"
        );

        let gpus = r["gpu"].as_array().unwrap();
        assert_eq!(gpus.len(), 2, "{r:#}");
        let (g0, g1) = (&gpus[0], &gpus[1]);
        assert_eq!(g0["index"], 0);
        assert_eq!(g0["name"], "NVIDIA Fake A100-SXM4-80GB");
        assert_eq!(f(&g0["util_pct"]), 37.0);
        assert_eq!(g0["mem_used_mb"], 20480);
        assert_eq!(g0["mem_total_mb"], 81920);
        assert_eq!(f(&g0["mem_used_pct"]), 25.0);
        assert_eq!(f(&g0["temperature_c"]), 41.0);
        assert_eq!(
            f(&g0["power_w"]),
            123.45,
            "f32 readings are rounded for display: {g0}"
        );
        assert_eq!(
            g0["processes"],
            serde_json::json!([{"pid": 4242, "mem_used_mb": 500}])
        );

        assert_eq!(g1["index"], 1);
        assert!(g1["util_pct"].is_null(), "[N/A] is null, not 0: {g1}");
        assert!(g1["power_w"].is_null(), "{g1}");
        assert_eq!(g1["mem_used_mb"], 2048);
        assert_eq!(g1["mem_total_mb"], 143771);
        assert!(
            (f(&g1["mem_used_pct"]) - round1(2048.0 / 143771.0 * 100.0)).abs() < 0.051,
            "{g1}"
        );
        assert_eq!(
            g1["processes"],
            serde_json::json!([{"pid": 4343, "mem_used_mb": 700}])
        );

        // Only GPU 0 reports utilisation, so the GPU term is (1 - 0.37) * 0.2.
        assert_idle_score(r);
        eprintln!(
            "idle_score {} = formula({} cpu%, {} mem%, gpu mean 37%)",
            r["idle_score"], r["cpu"]["usage_pct"], r["memory"]["used_pct"]
        );

        // Warm: same answer shape, same GPUs (from the background sampler, not a fresh run).
        let (v2, took2) = list_timed(&pool).await;
        eprintln!("warm list(check_resources) took {took2:?}");
        let r2 = resources(&v2, "s");
        assert_eq!(r2["gpu"].as_array().unwrap().len(), 2);
        assert_idle_score(r2);
    })
    .await;
    pool.shutdown().await;
}

// ------------------------------------------------------------------------------------------
// 2. nvidia-smi that hangs, that exits 9, and none at all
// ------------------------------------------------------------------------------------------

/// Processes on this machine with exactly this `/proc/<pid>/cmdline` that were started by
/// sessions of `sshd` (the fixture tags them with `RSB_TESTBED_FIXTURE=<its dir>`).
fn fixture_procs(sshd: &Sshd, cmdline: &[u8]) -> usize {
    let tag = format!("RSB_TESTBED_FIXTURE={}", sshd.dir().display()).into_bytes();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == cmdline))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == tag.as_slice()))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_nvidia_smi_is_cut_at_its_deadline() {
    let fake = FakeBin::new(Some(HANG_SCRIPT));
    let sshd = sshd_with(&fake, &[("RSB_NVIDIA_SMI_TIMEOUT_MS", "500")]);
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    bounded("hung nvidia-smi", async {
        // Connect and deploy first, so the timed call below measures the resources path only.
        let h = pool.health("s").await;
        assert!(h.alive, "{:?}", h.error);
        let sampling_started = Instant::now();
        let (mut v, took) = list_timed(&pool).await;
        eprintln!("list with a hung nvidia-smi took {took:?}:\n{v:#}");
        assert!(
            took < Duration::from_millis(2500),
            "a hung nvidia-smi (sleep 30) must not hold the reply: {took:?}"
        );
        let mut r = resources(&v, "s").clone();
        if r["gpu_note"]
            .as_str()
            .is_some_and(|n| n.contains("not answered yet"))
        {
            // The first pass had not hit its deadline when the request's own wait ran out
            // (a loaded box); the next pass has.
            eprintln!("first reply predates the first GPU pass; asking again");
            tokio::time::sleep(Duration::from_millis(1000)).await;
            v = list_timed(&pool).await.0;
            r = resources(&v, "s").clone();
        }
        assert_eq!(r["gpu"], serde_json::json!([]), "{r:#}");
        assert_eq!(r["gpu_source"], "none", "{r:#}");
        let note = r["gpu_note"].as_str().unwrap_or_default();
        assert!(
            note.contains("timed out") && note.contains("500 ms"),
            "the note names the timeout: {r:#}"
        );
        assert_idle_score(&r);

        // The killed nvidia-smi (and its sleep) are gone. Passes run every 2 s + 500 ms, so by
        // now at least two have timed out; had the agent not killed the process group, each
        // would have left a `sleep 30` behind. At most the pass in flight may be alive (the
        // sshd runs on this machine, so /proc shows them).
        let since = sampling_started.elapsed();
        tokio::time::sleep(Duration::from_millis(3300).saturating_sub(since)).await;
        let lingering = fixture_procs(&sshd, b"sleep\x0030\x00");
        assert!(
            lingering <= 1,
            "{lingering} 'sleep 30' of this fixture left running"
        );
    })
    .await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_nvidia_smi_is_none_with_a_note() {
    let fake = FakeBin::new(Some(EXIT9_SCRIPT));
    let sshd = sshd_with(&fake, &[]);
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    bounded("nvidia-smi exit 9", async {
        let (v, took) = list_timed(&pool).await;
        eprintln!("list with nvidia-smi exiting 9 took {took:?}:\n{v:#}");
        let r = resources(&v, "s");
        assert_eq!(r["gpu_source"], "none", "{r:#}");
        assert_eq!(r["gpu"], serde_json::json!([]), "{r:#}");
        let note = r["gpu_note"].as_str().unwrap_or_default();
        assert!(
            note.contains("exited with code 9") && note.contains("NVIDIA-SMI has failed"),
            "{r:#}"
        );
        assert_idle_score(r);
    })
    .await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_nvidia_smi_is_a_clean_none() {
    let fake = FakeBin::new(None);
    let sshd = sshd_with(&fake, &[]);
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    bounded("no nvidia-smi", async {
        let (v, took) = list_timed(&pool).await;
        eprintln!("list without nvidia-smi took {took:?}:\n{v:#}");
        let r = resources(&v, "s");
        if ["/usr/bin/nvidia-smi", "/bin/nvidia-smi"]
            .iter()
            .any(|p| Path::new(p).exists())
        {
            eprintln!("note: this host has a real nvidia-smi on /usr/bin:/bin; skipping 'none'");
            return;
        }
        assert_eq!(r["gpu_source"], "none", "{r:#}");
        assert_eq!(r["gpu"], serde_json::json!([]), "{r:#}");
        assert!(
            r.get("gpu_note").is_none(),
            "no GPU is normal, not an error: {r:#}"
        );
        assert_seed_keys(r);
        // No GPU scores the full 0.2 on the GPU term, as in the seed.
        assert_idle_score(r);
    })
    .await;
    pool.shutdown().await;
}

// ------------------------------------------------------------------------------------------
// 3. CPU % rises under load
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_usage_rises_under_a_busy_loop() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pool = key_pool(&sshd, dir.path());
    bounded("cpu rise", async {
        // Baseline: let the sampler run a full period first so it is a real 1 s interval.
        let _ = sandboxes::list(&pool, sandboxes::Listing::Resources).await;
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (v, _) = list_timed(&pool).await;
        let before = f(&resources(&v, "s")["cpu"]["usage_pct"]);

        let ncpu = std::thread::available_parallelism().map_or(2, |n| n.get());
        // One bounded busy loop per core, on the sandbox host, detached from the ssh session.
        let pids = sshd
            .ssh_run(&format!(
                "for i in $(seq {ncpu}); do timeout 8 sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 & echo $!; done"
            ))
            .unwrap();
        let pids: Vec<u32> = pids.split_whitespace().filter_map(|p| p.parse().ok()).collect();
        assert_eq!(pids.len(), ncpu, "busy loops started: {pids:?}");
        tokio::time::sleep(Duration::from_millis(2200)).await;
        let (v, _) = list_timed(&pool).await;
        let r = resources(&v, "s");
        let after = f(&r["cpu"]["usage_pct"]);
        eprintln!(
            "cpu.usage_pct before {before} %, with {ncpu} busy loop(s) {after} % (load_1m {})",
            r["cpu"]["load_1m"]
        );
        assert!(
            after >= before + 15.0 || after >= 90.0,
            "CPU % should rise under {ncpu} busy loops: before {before}, after {after}"
        );
        if before >= 90.0 {
            eprintln!("note: the baseline was already ≥ 90 % (busy box); the rise is not visible");
        }
        assert_idle_score(r);
        // Stop our loops early (`timeout` passes the TERM on to its child).
        for pid in pids {
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
    })
    .await;
    pool.shutdown().await;
}

// ------------------------------------------------------------------------------------------
// 4. Parallel fan-out with a black-holed host and slow hosts
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dead_host_does_not_delay_the_others() {
    // Short connect timeouts keep the test quick: the dead host's shorter one lets the slowed
    // live hosts below be the slowest part of the call.
    let ct = Duration::from_secs(2);
    let ct_dead = Duration::from_secs(1);
    let (a, b, c, d) = std::thread::scope(|s| {
        let h: Vec<_> = (0..4).map(|_| s.spawn(Sshd::start)).collect();
        let mut v: Vec<Sshd> = h.into_iter().map(|j| j.join().unwrap().unwrap()).collect();
        let d = v.pop().unwrap();
        let c = v.pop().unwrap();
        let b = v.pop().unwrap();
        let a = v.pop().unwrap();
        (a, b, c, d)
    });
    // b and c go through proxies (for the slow variant below); d is black-holed: TCP connects,
    // then nothing ever comes back, so only a deadline ends the attempt.
    let pb = ChaosProxy::start(b.addr()).unwrap();
    let pc = ChaosProxy::start(c.addr()).unwrap();
    let pd = ChaosProxy::start(d.addr()).unwrap();
    pd.blackhole(true);
    let dir = tempfile::tempdir().unwrap();
    let pool = pool_with(
        vec![
            ("a", target_via(&a, a.port(), ct, dir.path())),
            ("b", target_via(&b, pb.port(), ct, dir.path())),
            ("c", target_via(&c, pc.port(), ct, dir.path())),
            ("dead", target_via(&d, pd.port(), ct_dead, dir.path())),
        ],
        dir.path(),
    );
    // The most any one sandbox may cost: connect (+deploy) deadline plus the round-trip one.
    let deadline = ["a", "b", "c", "dead"]
        .iter()
        .map(|n| sandboxes::probe_deadline(&pool, n))
        .max()
        .unwrap();
    bounded("fan-out", async {
        let check = |v: &Value| {
            for n in ["a", "b", "c"] {
                let e = entry(v, n);
                assert_eq!(e["connection_alive"], true, "{e:#}");
                let r = resources(v, n);
                assert!(f(&r["cpu"]["count"]) >= 1.0, "{r:#}");
                assert!(f(&r["memory"]["total_mb"]) > 0.0, "{r:#}");
                assert_idle_score(r);
            }
            let e = entry(v, "dead");
            assert_eq!(e["connection_alive"], false, "{e:#}");
            let err = e["resources"]["error"].as_str().unwrap_or_default();
            assert!(!err.is_empty(), "the dead host has an error entry: {e:#}");
            assert!(
                e["connection_error"].is_string(),
                "and a connection_error: {e:#}"
            );
        };

        // Cold: three connects + deploys in parallel, one connect that never answers.
        let (v, cold) = list_timed(&pool).await;
        eprintln!(
            "cold list over 3 live + 1 black-holed: {cold:?} (connect_timeout {ct:?}, dead's {ct_dead:?}, per-sandbox deadline {deadline:?})"
        );
        eprintln!("dead entry: {:#}", entry(&v, "dead"));
        check(&v);
        assert!(
            cold < deadline + Duration::from_secs(3),
            "cold call {cold:?} exceeds the per-sandbox deadline {deadline:?} + 3 s"
        );

        // Warm: the live ones answer in milliseconds; the dead one costs its connect timeout
        // (it is retried on every call), not more.
        let (v, warm) = list_timed(&pool).await;
        eprintln!("warm list over 3 live + 1 black-holed: {warm:?}");
        check(&v);
        assert!(
            warm < ct_dead + Duration::from_millis(1500),
            "warm call {warm:?} should cost about the dead host's connect timeout {ct_dead:?}"
        );

        // Slow variant: b and c each take seconds (latency on every chunk, both ways). Measure
        // each alone, then all four together: the call costs about the slowest, not the sum.
        let delay = Duration::from_millis(400);
        pb.set_delay(delay);
        pc.set_delay(delay);
        let t0 = Instant::now();
        let pb_alone = sandboxes::probe(&pool, "b", true).await;
        let tb = t0.elapsed();
        let t0 = Instant::now();
        let pc_alone = sandboxes::probe(&pool, "c", true).await;
        let tc = t0.elapsed();
        assert!(
            pb_alone.alive && pc_alone.alive,
            "{:?} {:?}",
            pb_alone.error,
            pc_alone.error
        );
        assert!(matches!(pb_alone.resources, Some(Ok(_))));
        // Samples under RESOURCES_FRESH old are answered from the pool: let them age out so
        // the listing below really asks the slowed hosts.
        tokio::time::sleep(sandboxes::RESOURCES_FRESH).await;
        let (v, slow) = list_timed(&pool).await;
        let slowest = tb.max(tc).max(ct_dead);
        let sum = tb + tc + ct_dead;
        eprintln!(
            "slowed b alone {tb:?}, c alone {tc:?}, dead {ct_dead:?}; all four together {slow:?} \
             (slowest {slowest:?}, sum {sum:?})"
        );
        check(&v);
        assert!(
            slow >= delay * 2,
            "the slowed hosts were really queried: {slow:?}"
        );
        assert!(
            slow < slowest + Duration::from_millis(1500),
            "the call {slow:?} should take about the slowest host {slowest:?}, not the sum {sum:?}"
        );
        pb.reset();
        pc.reset();

        // A warm connection whose link goes silent (no FIN, no RST): the call is bounded.
        // Only the round-trip deadline ends it: keep-alives would take ~12 s to notice.
        pb.blackhole(true);
        tokio::time::sleep(sandboxes::RESOURCES_FRESH).await;
        let (v, silent) = list_timed(&pool).await;
        let eb = entry(&v, "b");
        eprintln!("warm list with b's link silently dead: {silent:?}; b: {eb:#}");
        assert_eq!(eb["connection_alive"], false, "{eb:#}");
        let err = eb["resources"]["error"].as_str().unwrap_or_default();
        assert!(err.contains("did not answer"), "{eb:#}");
        for n in ["a", "c"] {
            assert_eq!(entry(&v, n)["connection_alive"], true);
            assert_idle_score(resources(&v, n));
        }
        assert!(
            silent < sandboxes::ROUND_TRIP_DEADLINE + Duration::from_millis(1500),
            "a silent warm link costs its round-trip deadline, not more: {silent:?}"
        );
        pb.blackhole(false);
    })
    .await;
    pool.shutdown().await;
    drop((pb, pc, pd));
}

// ------------------------------------------------------------------------------------------
// 5. select_sandbox("auto")
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_auto_picks_the_idlest_reachable() {
    let busy_fake = FakeBin::new(Some(&one_gpu_script(100)));
    let idle_fake = FakeBin::new(Some(&one_gpu_script(0)));
    let busy = sshd_with(&busy_fake, &[]);
    let idle = sshd_with(&idle_fake, &[]);
    let dir = tempfile::tempdir().unwrap();
    let ct = Duration::from_secs(3);
    let dead_port = refused_port();
    let pool = pool_with(
        vec![
            ("busy", target_via(&busy, busy.port(), ct, dir.path())),
            ("dead", target_via(&busy, dead_port, ct, dir.path())),
            ("idle", target_via(&idle, idle.port(), ct, dir.path())),
        ],
        dir.path(),
    );
    bounded("select auto", async {
        // Both sandboxes are this same host, so CPU and memory terms are equal up to sampling
        // noise; the GPU term (100 % vs 0 %) separates them by 0.2. On a noisy shared box the
        // two agents' 1 s CPU intervals can differ a lot, so a wrong pick is retried, but only
        // when the reply's own scores show it was the noise (never accepted as a pass).
        let mut picked = None;
        for attempt in 1..=3 {
            let v = sandboxes::select(&pool, "auto").await.unwrap();
            eprintln!("select(auto) attempt {attempt}: {v:#}");
            assert_eq!(v["status"], "selected");
            let reason = v["reason"].as_str().unwrap_or_default();
            assert!(
                reason.contains("idle_score") && reason.contains("dead unreachable"),
                "the reply says why and names the unreachable one: {v:#}"
            );
            assert!(v["idle_score"].is_number(), "{v:#}");
            let chosen = v["active_sandbox"].as_str().unwrap().to_string();
            assert_eq!(pool.active().as_deref(), Some(chosen.as_str()));
            assert_ne!(chosen, "dead");
            if chosen == "idle" {
                assert!(
                    reason.contains("busy "),
                    "the runner-up is listed: {reason}"
                );
                picked = Some(chosen);
                break;
            }
            eprintln!("'busy' won on CPU noise (see scores above); retrying");
            tokio::time::sleep(Duration::from_millis(1100)).await;
        }
        assert_eq!(
            picked.as_deref(),
            Some("idle"),
            "the sandbox with an idle GPU should be chosen"
        );

        // The listing agrees: busy's GPU is at 100 %, idle's at 0 %.
        let v = serde_json::to_value(sandboxes::list(&pool, sandboxes::Listing::Resources).await)
            .unwrap();
        assert_eq!(f(&resources(&v, "busy")["gpu"][0]["util_pct"]), 100.0);
        assert_eq!(f(&resources(&v, "idle")["gpu"][0]["util_pct"]), 0.0);
        assert_eq!(v["active_sandbox"], "idle");
        assert_eq!(entry(&v, "idle")["is_active"], true);

        // A plain name still selects without probing.
        let v = sandboxes::select(&pool, "busy").await.unwrap();
        assert_eq!(v["active_sandbox"], "busy");
    })
    .await;
    pool.shutdown().await;

    // Nothing reachable: a clear error, quickly (refused ports fail fast).
    let pool = pool_with(
        vec![
            ("x", target_via(&busy, refused_port(), ct, dir.path())),
            ("y", target_via(&idle, refused_port(), ct, dir.path())),
        ],
        dir.path(),
    );
    let t0 = Instant::now();
    let e = bounded(
        "select auto, none reachable",
        sandboxes::select(&pool, "auto"),
    )
    .await
    .unwrap_err();
    eprintln!(
        "select(auto) with nothing reachable ({:?}): {e:?}",
        t0.elapsed()
    );
    assert_eq!(e.kind, Kind::Connect, "{e:?}");
    assert!(e.message.contains("no sandbox is reachable"), "{e:?}");
    assert!(!e.hint.is_empty());
    assert_eq!(pool.active().as_deref(), Some("x"), "selection unchanged");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

// ------------------------------------------------------------------------------------------
// 6. CLIs: `rsb sandboxes --resources` and `rsb-agent resources`
// ------------------------------------------------------------------------------------------

/// A binary of this workspace next to the test executable's `deps/` directory
/// (`target/debug/<name>`), so CARGO_TARGET_DIR is honoured.
fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(name))
        .unwrap();
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build -p rsb -p rsb-agent)",
        p.display()
    );
    p
}

/// `rsb` with a sandbox list and nothing from the developer's environment.
fn rsb_cli(list: &Value, home: &Path) -> Command {
    let mut c = Command::new(workspace_bin("rsb"));
    c.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("XDG_DATA_HOME", home.join("data"))
        .env("RSB_STATE_DIR", home.join("state"))
        .env("REMOTE_SANDBOX_LIST", list.to_string());
    c
}

#[test]
fn rsb_sandboxes_resources_cli() {
    let fake = FakeBin::new(Some(&two_gpus_script()));
    let a = sshd_with(&fake, &[]);
    let b = Sshd::start().unwrap();
    let home = tempfile::tempdir().unwrap();
    let sb = |name: &str, s: &Sshd, port: u16| {
        serde_json::json!({
            "name": name, "host": "127.0.0.1", "port": port, "user": s.user(),
            "key_file": s.client_key().display().to_string(), "connect_timeout_s": 3,
        })
    };
    let list = serde_json::json!([
        sb("alpha", &a, a.port()),
        sb("beta", &b, b.port()),
        sb("gone", &b, refused_port()),
    ]);

    let t0 = Instant::now();
    let out = output_with_timeout(
        rsb_cli(&list, home.path()).args(["sandboxes", "--resources"]),
        Duration::from_secs(60),
    )
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!(
        "rsb sandboxes --resources ({:?}, {}):\n{stdout}\nstderr: {}",
        t0.elapsed(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // `gone` is down: the health check fails (exit 3) after the listing, and names it.
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 of 3 sandboxes down: gone"));
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].contains("NAME") && lines[0].contains("IDLE"),
        "header: {stdout}"
    );
    for name in ["alpha", "beta", "gone"] {
        let rows: Vec<&&str> = lines[1..]
            .iter()
            .filter(|l| l.split_whitespace().any(|w| w == name))
            .collect();
        assert_eq!(rows.len(), 1, "one row for {name}: {stdout}");
    }
    assert_eq!(lines.len(), 4, "header + one row per sandbox: {stdout}");
    let row = |name: &str| {
        *lines
            .iter()
            .find(|l| l.split_whitespace().any(|w| w == name))
            .unwrap()
    };
    assert!(row("alpha").contains(" yes "), "{stdout}");
    assert!(row("beta").contains(" yes "), "{stdout}");
    assert!(
        row("gone").contains(" no ") && row("gone").contains("error"),
        "{stdout}"
    );
    // alpha's row shows its two GPUs.
    let alpha_cols: Vec<&str> = row("alpha").split_whitespace().collect();
    assert_eq!(alpha_cols[alpha_cols.len() - 2], "2", "{stdout}");

    // --json is the same data as list_sandboxes(check_resources=true).
    let out = output_with_timeout(
        rsb_cli(&list, home.path()).args(["--json", "sandboxes", "--resources"]),
        Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = resources(&v, "alpha");
    assert_eq!(r["gpu_source"], "nvidia-smi");
    assert_eq!(r["gpu"].as_array().unwrap().len(), 2);
    assert_idle_score(r);
    assert_idle_score(resources(&v, "beta"));
    assert!(entry(&v, "gone")["resources"]["error"].is_string(), "{v:#}");
}

#[test]
fn rsb_agent_resources_runs_locally() {
    let agent = workspace_bin("rsb-agent");
    let fake = FakeBin::new(Some(&two_gpus_script()));

    let out = output_with_timeout(
        Command::new(&agent)
            .arg("resources")
            .env("PATH", fake.path_env()),
        Duration::from_secs(30),
    )
    .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    eprintln!("rsb-agent resources:\n{table}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for k in ["cpu", "memory", "disk", "gpus", "NVIDIA Fake H200"] {
        assert!(table.contains(k), "table lacks {k}: {table}");
    }
    assert!(
        table.contains("over "),
        "CPU % is a measured interval: {table}"
    );

    let out = output_with_timeout(
        Command::new(&agent)
            .args(["resources", "--json"])
            .env("PATH", fake.path_env()),
        Duration::from_secs(30),
    )
    .unwrap();
    assert!(out.status.success());
    let snap: rsb_protocol::ResourceSnapshot = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(snap.gpu.source, rsb_protocol::GpuSource::NvidiaSmi);
    assert_eq!(snap.gpu.gpus.len(), 2);
    assert_eq!(snap.gpu.gpus[1].util_pct, None);
    assert_eq!(snap.gpu.processes.len(), 2);
    assert!(snap.cpu.interval_ms > 0 && snap.cpu.count >= 1);
    assert!(snap.memory.total_bytes > 0);

    // A hung nvidia-smi bounds the CLI too.
    let hang = FakeBin::new(Some(HANG_SCRIPT));
    let t0 = Instant::now();
    let out = output_with_timeout(
        Command::new(&agent)
            .args(["resources", "--json"])
            .env("PATH", hang.path_env())
            .env("RSB_NVIDIA_SMI_TIMEOUT_MS", "300"),
        Duration::from_secs(30),
    )
    .unwrap();
    let took = t0.elapsed();
    assert!(out.status.success());
    let snap: rsb_protocol::ResourceSnapshot = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!(
        "rsb-agent resources --json with a hung nvidia-smi: {took:?}, note {:?}",
        snap.gpu.note
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(snap.gpu.source, rsb_protocol::GpuSource::None);
    assert!(snap.gpu.note.unwrap_or_default().contains("timed out"));
}
