//! Fingerprint the protocol sources, so an agent and an `rsb` built from different versions of
//! this crate refuse each other at the handshake with a clear message instead of misreading
//! frames later (bincode is not self-describing).

use std::{fs, path::PathBuf};

fn main() {
    let src = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("src");
    let mut files: Vec<PathBuf> = fs::read_dir(&src)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    // FNV-1a: stable across toolchains, no dependencies.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        for b in f
            .file_name()
            .unwrap()
            .as_encoded_bytes()
            .iter()
            .chain(fs::read(f).unwrap().iter())
        {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=RSB_PROTOCOL_FINGERPRINT={h:016x}");
}
