//! `rsb-nvml` through NVML's real loading path on a machine without a GPU: no library at all,
//! a library whose init fails (the driver not loaded), and a stand-in library
//! (`fake_nvml.c`, built here with the system C compiler) that serves two GPUs, so the dlopen,
//! every call and the ABI's struct layouts run for real.

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_rsb-nvml");

/// `rsb-nvml --count 1` with `lib_dir` as the only library path, bounded in time.
fn sample(lib_dir: &Path, mode: &str) -> Output {
    let out = Command::new("timeout")
        .args(["20", BIN, "--count", "1", "--interval-ms", "100"])
        .env("LD_LIBRARY_PATH", lib_dir)
        .env("FAKE_NVML", mode)
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(124), "rsb-nvml hung");
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn no_library_a_failed_init_and_a_full_sample() {
    let dir = tempfile::tempdir().unwrap();
    // No libnvidia-ml.so.1 anywhere the loader looks (this test's machine has no driver; one
    // with a GPU would load the real library before LD_LIBRARY_PATH's empty directory).
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("note: this machine has an NVIDIA driver; the no-library case is not checked");
    } else {
        let out = sample(dir.path(), "ok");
        assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("cannot load libnvidia-ml.so.1"),
            "{}",
            text(&out.stderr)
        );
        assert!(out.stdout.is_empty());
    }

    let lib = dir.path().join("libnvidia-ml.so.1");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_nvml.c");
    let cc = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("a C compiler (cc) is needed to build the stand-in NVML library");
    assert!(cc.status.success(), "{}", text(&cc.stderr));

    let out = sample(dir.path(), "driver");
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("NVML did not start"),
        "{}",
        text(&out.stderr)
    );

    let out = sample(dir.path(), "ok");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "gpus\n\
         0, NVIDIA Fake H100, GPU-fake-0, 37, 1024, 81920, 41, 123.45\n\
         1, NVIDIA Fake H100, GPU-fake-1, [N/A], 0, 81920, 41, 123.45\n\
         apps\n4242, GPU-fake-0, 500\n\
         energy\nGPU-fake-0, 987654\nGPU-fake-1, 987654\n\
         mig\nend\n"
    );
}
