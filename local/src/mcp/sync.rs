//! Sync tools: `sync_local_to_remote`, `sync_remote_to_local`, `check_file_transfer_task`,
//! `cancel_file_transfer_task` (seed names, parameters and defaults).

use std::sync::Arc;

use parking_lot::Mutex;
use rmcp::{
    RoleServer,
    handler::server::wrapper::Parameters,
    schemars::{self, JsonSchema},
    service::RequestContext,
    tool, tool_router,
};
use serde::Deserialize;
use serde_json::Value;

use super::{RsbServer, ToolResult, fail, reply};
use crate::{
    error::RsbError,
    ops::sync::{self as ops, SyncArgs},
    sync::{Progress, ProgressFn},
};

fn d_dot() -> String {
    ".".into()
}
fn d_mirror() -> String {
    "./remote_mirror".into()
}
fn d_50() -> i64 {
    50
}
fn d_grace() -> f64 {
    5.0
}

/// `excludes`: a list of patterns, null, or the list JSON-encoded in a string (seed quirk).
fn excludes_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": ["array", "string", "null"],
        "items": {"type": "string"},
        "default": null
    })
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncUpParams {
    #[serde(default = "d_dot")]
    pub local_path: String,
    #[serde(default = "d_dot")]
    pub remote_path: String,
    #[serde(default)]
    pub delete_extras: bool,
    // gitignore patterns (the tool description says so; no schema text).
    #[serde(default)]
    #[schemars(schema_with = "excludes_schema")]
    pub excludes: Option<Value>,
    #[serde(default)]
    pub exclude_file: Option<String>,
    #[serde(default)]
    pub sandbox_name: String,
    #[serde(default)]
    pub dry_run: bool,
    #[serde(default)]
    pub overwrite: bool,
    #[serde(default)]
    pub safe: bool,
    #[serde(default)]
    pub confirm_delete: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncDownParams {
    #[serde(default = "d_dot")]
    pub remote_path: String,
    #[serde(default = "d_mirror")]
    pub local_path: String,
    #[serde(default)]
    #[schemars(schema_with = "excludes_schema")]
    pub excludes: Option<Value>,
    #[serde(default)]
    pub exclude_file: Option<String>,
    #[serde(default)]
    pub sandbox_name: String,
    #[serde(default)]
    pub dry_run: bool,
    #[serde(default)]
    pub overwrite: bool,
    #[serde(default)]
    pub safe: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckTransferParams {
    pub task_id: i64,
    #[serde(default = "d_50")]
    pub last_n_lines: i64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelTransferParams {
    pub task_id: i64,
    #[serde(default = "d_grace")]
    pub force_kill_after_s: f64,
}

/// Run a sync, sending MCP progress notifications (files, bytes, rate) every 2 s when the
/// client asked for them. A cancelled call stops the sync through its token, so the
/// destination's staging session is closed properly.
async fn with_sync_progress<F, Fut>(ctx: &RequestContext<RoleServer>, work: F) -> ToolResult
where
    F: FnOnce(Option<ProgressFn>) -> Fut,
    Fut: std::future::Future<Output = crate::error::Result<Value>>,
{
    let latest: Arc<Mutex<Option<Progress>>> = Arc::new(Mutex::new(None));
    let l2 = latest.clone();
    let cb: ProgressFn = Arc::new(move |p: &Progress| {
        *l2.lock() = Some(p.clone());
    });
    let ticker = super::progress_ticker(ctx, move |secs| match latest.lock().clone() {
        Some(p) => format!(
            "sync {}: {}/{} files, {}/{} bytes, {:.1} MB/s {}",
            p.phase.as_str(),
            p.files_done,
            p.files_total,
            p.bytes_done,
            p.bytes_total,
            p.rate_bps / 1e6,
            p.current_path
        ),
        None => format!("sync: running for {secs}s"),
    });
    tokio::select! {
        r = work(Some(cb)) => reply(r),
        _ = ticker => unreachable!(),
    }
}

fn args_up(p: SyncUpParams) -> Result<SyncArgs, RsbError> {
    Ok(SyncArgs {
        local_path: p.local_path,
        remote_path: p.remote_path,
        delete_extras: p.delete_extras,
        excludes: ops::parse_excludes(p.excludes.as_ref())?,
        exclude_file: p.exclude_file,
        sandbox: p.sandbox_name,
        dry_run: p.dry_run,
        overwrite: p.overwrite,
        safe: p.safe,
        confirm_delete: p.confirm_delete,
    })
}

impl RsbServer {
    /// The sync tools with compact schemas: no `$schema` line and no `false` default on rsb's
    /// own flags (a missing flag is false), since every listed byte is context the client
    /// pays for.
    pub(super) fn sync_tools() -> rmcp::handler::server::router::tool::ToolRouter<Self> {
        let mut r = Self::sync_router();
        for route in r.map.values_mut() {
            let mut schema = (*route.attr.input_schema).clone();
            schema.remove("$schema");
            if let Some(Value::Object(props)) = schema.get_mut("properties") {
                // rsb's own flags; the seed's parameters keep their documented defaults.
                for name in ["dry_run", "overwrite", "safe", "confirm_delete"] {
                    if let Some(Value::Object(p)) = props.get_mut(name) {
                        p.remove("default");
                    }
                }
            }
            route.attr.input_schema = Arc::new(schema);
        }
        r
    }
}

#[tool_router(router = sync_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        description = "Sync a local file/dir to the sandbox: exact (blake3), only changes, keeps modes/symlinks, atomic per file. gitignore-style excludes; defaults skip .git, node_modules, __pycache__, .idea, .vscode, *.pyc. Large plans run in background (check_file_transfer_task). Destination edits since the last sync are kept as conflicts unless overwrite."
    )]
    async fn sync_local_to_remote(
        &self,
        Parameters(p): Parameters<SyncUpParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let args = match args_up(p) {
            Ok(a) => a,
            Err(e) => return fail(&e),
        };
        let pool = self.pool.clone();
        let cancel = ctx.ct.clone();
        with_sync_progress(&ctx, |cb| async move {
            ops::sync_local_to_remote(&pool, args, cb, &cancel).await
        })
        .await
    }

    #[tool(
        description = "Download a sandbox file/dir to a local path (same semantics as sync_local_to_remote)."
    )]
    async fn sync_remote_to_local(
        &self,
        Parameters(p): Parameters<SyncDownParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let excludes = match ops::parse_excludes(p.excludes.as_ref()) {
            Ok(e) => e,
            Err(e) => return fail(&e),
        };
        let args = SyncArgs {
            local_path: p.local_path,
            remote_path: p.remote_path,
            delete_extras: false,
            excludes,
            exclude_file: p.exclude_file,
            sandbox: p.sandbox_name,
            dry_run: p.dry_run,
            overwrite: p.overwrite,
            safe: p.safe,
            confirm_delete: false,
        };
        let pool = self.pool.clone();
        let cancel = ctx.ct.clone();
        with_sync_progress(&ctx, |cb| async move {
            ops::sync_remote_to_local(&pool, args, cb, &cancel).await
        })
        .await
    }

    #[tool(description = "Status, progress and log tail of a background file transfer.")]
    async fn check_file_transfer_task(
        &self,
        Parameters(p): Parameters<CheckTransferParams>,
    ) -> ToolResult {
        reply(
            self.pool
                .transfers()
                .and_then(|t| t.check(p.task_id, p.last_n_lines)),
        )
    }

    #[tool(
        description = "Cancel a background file transfer (stops within a second; no partial files)."
    )]
    async fn cancel_file_transfer_task(
        &self,
        Parameters(p): Parameters<CancelTransferParams>,
    ) -> ToolResult {
        if p.task_id <= 0 {
            return fail(&RsbError::invalid(
                "task_id must be positive",
                "pass the task_id returned by sync_local_to_remote",
            ));
        }
        let t = match self.pool.transfers() {
            Ok(t) => t,
            Err(e) => return fail(&e),
        };
        reply(t.cancel(p.task_id, p.force_kill_after_s).await)
    }
}
