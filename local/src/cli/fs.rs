//! `rsb ls` and `rsb cat`.

use std::io::Write;

use rsb::{error::RsbError, ops::fs};
use rsb_protocol::ReadFileRequest;

use super::{Ctx, exit, fail, print_json};
use rsb::term::shown;

pub async fn ls(ctx: &Ctx, path: &str, recursive: bool, max_entries: i64) -> u8 {
    let r = async {
        let req = fs::list_request(path, recursive, max_entries)?;
        let c = ctx.client().await?;
        Ok::<_, RsbError>(fs::list_reply(path, &c.call(req).await?))
    }
    .await;
    let listing = match r {
        Ok(l) => l,
        Err(e) => return fail(ctx.json, &e),
    };
    if ctx.json {
        print_json(&listing);
        return exit::OK;
    }
    for e in &listing.entries {
        let d = if e.is_dir { "/" } else { "" };
        println!("{:>12}  {}{d}", e.size, shown(&e.path));
    }
    for u in &listing.unreadable {
        super::warn(&format!("unreadable: {u}"));
    }
    if listing.truncated {
        super::warn(&format!(
            "listing stopped at {max_entries} entries (raise --max-entries)"
        ));
    }
    exit::OK
}

/// Chunk size of `rsb cat`'s reads: large enough to keep the link busy, far inside a frame.
const CAT_CHUNK: u64 = 4 * 1024 * 1024;

/// `rsb cat --offset/--limit/-n`: read_remote_file's line form.
#[derive(Debug, Clone, Copy)]
pub struct Lines {
    pub offset: i64,
    pub limit: i64,
    pub numbered: bool,
}

/// Stream the whole file to stdout in chunks (no size cap); `--json` prints what
/// `read_remote_file` would for the first `max_bytes`. With a line range or `-n`, one read of
/// those lines (up to 8 MiB), printed as text.
pub async fn cat(ctx: &Ctx, path: &str, json_max_bytes: i64, lines: Lines) -> u8 {
    let by_lines = lines.offset > 0 || lines.limit > 0 || lines.numbered;
    if ctx.json || by_lines {
        let max = if ctx.json {
            json_max_bytes
        } else {
            fs::MAX_READ_BYTES
        };
        let r = async {
            let req = fs::read_request(path, max, lines.offset, lines.limit)?;
            let ranged = req.lines.is_some();
            let c = ctx.client().await?;
            Ok::<_, RsbError>(fs::read_reply(&c.call(req).await?, ranged, lines.numbered))
        }
        .await;
        return match r {
            Ok(f) if ctx.json => {
                print_json(&f);
                exit::OK
            }
            Ok(f) if f.encoding.is_some() => fail(
                false,
                &RsbError::invalid(
                    format!("{path} is not text"),
                    "print it without --offset/--limit/-n",
                ),
            ),
            Ok(f) => {
                print!("{}", f.content);
                if f.truncated && !f.content.is_empty() && !f.content.ends_with('\n') {
                    println!();
                }
                exit::OK
            }
            Err(e) => fail(ctx.json, &e),
        };
    }
    if let Err(e) = fs::read_request(path, 1, 0, 0) {
        return fail(false, &e);
    }
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return fail(false, &e),
    };
    let mut offset = 0u64;
    let mut out = std::io::stdout().lock();
    loop {
        let r = client
            .call(ReadFileRequest {
                path: path.to_string(),
                offset,
                max_bytes: CAT_CHUNK,
                confine: None,
            })
            .await;
        let f = match r {
            Ok(f) => f,
            Err(e) => return fail(false, &e),
        };
        if let Err(e) = out.write_all(&f.data) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return exit::OK;
            }
            eprintln!("rsb: cannot write to stdout: {e}");
            return exit::INTERNAL;
        }
        offset += f.data.len() as u64;
        if !f.truncated || f.data.is_empty() {
            break;
        }
    }
    let _ = out.flush();
    exit::OK
}
