//! Embeds prebuilt static agents into `rsb` when they exist, so a user's `rsb` binary is
//! self-contained. They are looked up in `$RSB_EMBED_AGENTS_DIR/<triple>/rsb-agent`, else in
//! `<workspace>/target/agents/<triple>/rsb-agent` (where `scripts/build-agents.sh` puts them).
//! Missing agents are not a build error: `rsb` then reports at run time how to build them.

use std::{env, fs, path::PathBuf};

const TRIPLES: [&str; 2] = ["x86_64-unknown-linux-musl", "aarch64-unknown-linux-musl"];

fn main() {
    println!("cargo:rerun-if-env-changed=RSB_EMBED_AGENTS_DIR");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let dir = env::var_os("RSB_EMBED_AGENTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../target/agents"));
    let mut out = String::from("pub(crate) static EMBEDDED: &[(&str, &[u8])] = &[\n");
    for t in TRIPLES {
        let p = dir.join(t).join("rsb-agent");
        println!("cargo:rerun-if-changed={}", p.display());
        if let Ok(meta) = fs::metadata(&p)
            && meta.is_file()
            && meta.len() > 0
        {
            let abs = fs::canonicalize(&p).unwrap();
            out.push_str(&format!(
                "    ({t:?}, include_bytes!({:?})),\n",
                abs.display().to_string()
            ));
        }
    }
    out.push_str("];\n");
    let dest = PathBuf::from(env::var("OUT_DIR").unwrap()).join("embedded.rs");
    fs::write(dest, out).unwrap();
}
