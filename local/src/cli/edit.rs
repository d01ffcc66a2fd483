//! `rsb edit SANDBOX:PATH`: `$VISUAL`/`$EDITOR` on a local copy, written back only if the
//! remote file still holds what was fetched (the read's hash is the write's precondition).

use std::os::unix::fs::DirBuilderExt;

use rsb::{
    error::RsbError,
    ops::{action::Act, edit, fs},
};
use rsb_protocol::{EditOutcome, Refusal, WriteCondition, WriteRequest};

use super::{Ctx, exit, fail};

pub async fn run(ctx: &Ctx, target: &str) -> u8 {
    let (name, path) = match super::sync::split_remote(ctx.app.pool(), target) {
        Some((n, p)) if !p.is_empty() => (n, p),
        _ => {
            return fail(
                false,
                &RsbError::invalid(
                    format!("{target}: expected SANDBOX:PATH"),
                    "e.g. rsb edit gpu1:src/main.rs (:PATH for the -s or active sandbox)",
                ),
            );
        }
    };
    // The path only: what was written is file content, which the audit never holds.
    let sandbox = match name {
        "" => match ctx.resolve() {
            Ok(s) => s,
            Err(e) => return fail(false, &e),
        },
        n => n.to_string(),
    };
    let act = Act {
        sandbox: &sandbox,
        tool: "rsb edit",
        command: Some(path.to_string()),
        ..Default::default()
    };
    let r = super::policy::caller(false)
        .act(ctx.app.pool(), act, async |sandbox| {
            edit_once(ctx, &sandbox, path).await
        })
        .await;
    match r {
        Ok(e) => e.code,
        Err(e) => fail(false, &e),
    }
}

/// How an edit ended: its exit code, and for its audit line whether it wrote and how much.
#[derive(serde::Serialize)]
struct Edited {
    #[serde(skip)]
    code: u8,
    written: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_written: Option<u64>,
}

impl Edited {
    fn nothing(code: u8) -> Edited {
        Edited {
            code,
            written: false,
            bytes_written: None,
        }
    }
}

async fn edit_once(ctx: &Ctx, name: &str, path: &str) -> Result<Edited, RsbError> {
    let client = ctx.app.pool().client(name).await?;
    let remote = edit::home_relative(path);
    let req = fs::read_request(&remote, fs::MAX_READ_BYTES, 0, 0)?;
    let got = client.call(req).await?;
    let Some(hash) = got.hash.clone() else {
        return Err(RsbError::invalid(
            format!("{path} is too large to edit (over 32 MiB)"),
            "edit it on the host (rsb shell)",
        ));
    };
    if got.truncated {
        return Err(RsbError::invalid(
            format!("{path} is over {} MiB", fs::MAX_READ_BYTES >> 20),
            "edit it on the host (rsb shell)",
        ));
    }
    // A private directory (0700) holds the copy, named as the remote file for the editor.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("rsb-edit-{}-{nanos:x}", std::process::id()));
    let io = |e: std::io::Error| RsbError::internal(format!("local copy: {e}"));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(io)?;
    let base = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_else(|| "file".into());
    let local = dir.join(base);
    std::fs::write(&local, &got.data).map_err(io)?;
    let editor = std::env::var("VISUAL")
        .or_else(|_| std::env::var("EDITOR"))
        .unwrap_or_else(|_| "vi".into());
    // The editor setting may carry arguments (`code -w`): the user's own shell line, with the
    // file as its argument, never spliced in.
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(&local)
        .status()
        .map_err(io)?;
    if !status.success() {
        eprintln!(
            "rsb: the editor exited with {status}; nothing was written; your copy: {}",
            local.display()
        );
        return Ok(Edited::nothing(exit::REMOTE));
    }
    let data = std::fs::read(&local).map_err(io)?;
    if data == got.data {
        eprintln!("rsb: {path}: no changes");
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(Edited::nothing(exit::OK));
    }
    let len = data.len() as u64;
    let outcome = client
        .call(WriteRequest {
            path: remote,
            data,
            condition: WriteCondition::Hash(hash.clone()),
            make_dirs: false,
            confine: client.confine().cloned(),
        })
        .await?;
    match outcome {
        EditOutcome::Refused(Refusal::Changed { .. }) => {
            eprintln!(
                "rsb: {name}:{path} changed since it was opened; nothing was written; your copy: {}",
                local.display()
            );
            Ok(Edited::nothing(exit::REMOTE))
        }
        o => {
            let r = edit::outcome(path, Some(&hash), o);
            if r.is_err() {
                eprintln!("rsb: your copy: {}", local.display());
            } else {
                let _ = std::fs::remove_dir_all(&dir);
            }
            let r = r?;
            eprintln!("rsb: wrote {name}:{} ({})", r.path, r.hash);
            Ok(Edited {
                code: exit::OK,
                written: true,
                bytes_written: Some(len),
            })
        }
    }
}
