//! Writes into a session's staged file from another channel ([`StagedWriteRequest`]): a large
//! upload spread over several SSH channels, each with its own flow-control window. Nothing
//! here trusts the bytes: the session's commit hashes the whole staged file.

use rsb_protocol::StagedWriteRequest;

use super::*;

/// Write `req`'s bytes into the staged file it names. Served by any agent of this user on the
/// host (the session itself lives in another process's channel); reaches the file only through
/// the staging directory's descriptor, checked to be this user's private directory beneath the
/// write roots, and never creates anything.
pub async fn staged_write(
    req: StagedWriteRequest,
    cancel: &CancellationToken,
) -> Result<(), AgentError> {
    blocking(cancel, move || write(&req)).await
}

fn write(req: &StagedWriteRequest) -> Result<(), AgentError> {
    let plain = |n: &str| !n.is_empty() && n != "." && n != ".." && !n.contains(['/', '\0']);
    if !req.staging.starts_with(STAGING_PREFIX) || !plain(&req.staging) || !plain(&req.name) {
        return Err(err(
            ErrorCode::InvalidArgument,
            format!(
                "staged write: {:?} in {:?} is not a staged file's name",
                req.name, req.staging
            ),
        ));
    }
    let (root, shown, writable) = writable_root(&req.root, req.confine.as_ref())?;
    let root_fd = rfs::open(
        &root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(&e.into(), "open", &shown))?;
    let staging = rfs::openat(
        &root_fd,
        req.staging.as_str(),
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(&e.into(), "open staging in", &shown))?;
    let me = rustix::process::geteuid().as_raw();
    let st = rfs::fstat(&staging).map_err(|e| io(&e.into(), "stat staging in", &shown))?;
    if st.st_uid != me || st.st_mode & 0o077 != 0 {
        return Err(err(
            ErrorCode::PermissionDenied,
            format!(
                "staged write: {} in {shown} is not this user's private staging directory \
                 (tampered with?); nothing was written",
                req.staging
            ),
        ));
    }
    writable.check_dir(&staging, &shown, "sync into")?;
    let file = File::from(
        rfs::openat(
            &staging,
            req.name.as_str(),
            OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io(&e.into(), "open staged", &req.name))?,
    );
    let fst = rfs::fstat(&file).map_err(|e| io(&e.into(), "stat staged", &req.name))?;
    if fst.st_uid != me || file_type(&fst) != rfs::FileType::RegularFile {
        return Err(err(
            ErrorCode::PermissionDenied,
            format!(
                "staged write: {} is not a staged file of this user; nothing was written",
                req.name
            ),
        ));
    }
    let inflated;
    let data = match req.raw_len {
        Some(n) => {
            inflated = rsb_protocol::compress::decompress(&req.data, n)
                .map_err(|m| err(ErrorCode::InvalidArgument, format!("staged write: {m}")))?;
            &inflated
        }
        None => &req.data,
    };
    if req.offset.checked_add(data.len() as u64).is_none() {
        return Err(err(
            ErrorCode::InvalidArgument,
            format!("staged write: offset {} is out of range", req.offset),
        ));
    }
    write_sparse(&file, data, req.offset).map_err(|e| io(&e, "write staged", &req.name))
}
