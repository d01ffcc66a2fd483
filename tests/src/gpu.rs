//! GPUs for tests on machines without one: a fake `nvidia-smi` first on a private sshd's PATH,
//! and the cleanup of the GPU lease files a test's fake UUIDs leave in the shared lease
//! directory.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::{Sshd, SshdOptions};

/// A fake `nvidia-smi` with `gpus` as `(uuid, used MiB, util %)` of 80 GiB each, and one
/// compute process (a pid that does not exist) on each GPU listed in `busy`.
pub fn fake_smi(gpus: &[(&str, u64, u32)], busy: &[&str]) -> String {
    let mut s = String::from("#!/bin/sh\ncase \"$*\" in\n*--query-gpu=*)\n");
    for (i, (uuid, used, util)) in gpus.iter().enumerate() {
        s.push_str(&format!(
            "echo '{i}, NVIDIA Fake H100, {uuid}, {util}, {used}, 81920, 40, 100.0'\n"
        ));
    }
    s.push_str(";;\n*--query-compute-apps=*)\n");
    for (i, uuid) in busy.iter().enumerate() {
        s.push_str(&format!("echo '{}, {uuid}, 60000'\n", 3_999_900 + i));
    }
    s.push_str(";;\n*) exit 2 ;;\nesac\n");
    s
}

/// An sshd whose sessions find `script` as `nvidia-smi` first on PATH; keep the directory
/// as long as the sshd.
pub fn gpu_host(script: &str) -> (Sshd, tempfile::TempDir) {
    let bin = tempfile::Builder::new()
        .prefix("rsb-gpus-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let smi = bin.path().join("nvidia-smi");
    std::fs::write(&smi, script).unwrap();
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:/usr/bin:/bin", bin.path().display());
    let sshd = Sshd::start_with(SshdOptions {
        set_env: vec![("PATH".into(), path)],
        ..Default::default()
    })
    .unwrap();
    (sshd, bin)
}

/// Removes the lease files of these (test-unique) GPU UUIDs when dropped, also on failure.
pub struct Leases(pub Vec<String>);

impl Drop for Leases {
    fn drop(&mut self) {
        for u in &self.0 {
            let _ = std::fs::remove_file(Path::new(rsb_protocol::GPU_LEASE_DIR).join(u));
        }
    }
}
