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
    sync::{Direction, Progress, ProgressFn},
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
    /// From server cwd; ~ ok.
    #[serde(default = "d_dot")]
    pub local_path: String,
    /// From $HOME; ~ ok.
    #[serde(default = "d_dot")]
    pub remote_path: String,
    /// Delete remote extras.
    #[serde(default)]
    pub delete_extras: bool,
    /// gitignore patterns.
    #[serde(default)]
    #[schemars(schema_with = "excludes_schema")]
    pub excludes: Option<Value>,
    /// Pattern file.
    #[serde(default)]
    pub exclude_file: Option<String>,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
    /// Report only.
    #[serde(default)]
    pub dry_run: bool,
    /// Replace conflicts.
    #[serde(default)]
    pub overwrite: bool,
    /// No earlier sync: differing files conflict.
    #[serde(default)]
    pub safe: bool,
    /// Confirm risky deletes.
    #[serde(default)]
    pub confirm_delete: bool,
    /// Apply .gitignore files.
    #[serde(default)]
    pub gitignore: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncDownParams {
    /// From $HOME; ~ ok.
    #[serde(default = "d_dot")]
    pub remote_path: String,
    /// From server cwd; ~ ok.
    #[serde(default = "d_mirror")]
    pub local_path: String,
    /// gitignore patterns.
    #[serde(default)]
    #[schemars(schema_with = "excludes_schema")]
    pub excludes: Option<Value>,
    /// Pattern file.
    #[serde(default)]
    pub exclude_file: Option<String>,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
    /// Report only.
    #[serde(default)]
    pub dry_run: bool,
    /// Replace conflicts.
    #[serde(default)]
    pub overwrite: bool,
    /// No earlier sync: differing files conflict.
    #[serde(default)]
    pub safe: bool,
    /// Apply .gitignore files.
    #[serde(default)]
    pub gitignore: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckTransferParams {
    /// Sync reply's id.
    pub task_id: i64,
    /// Log lines.
    #[serde(default = "d_50")]
    pub last_n_lines: i64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelTransferParams {
    /// Sync reply's id.
    pub task_id: i64,
    /// Then SIGKILL.
    #[serde(default = "d_grace")]
    pub force_kill_after_s: f64,
}

/// Run a sync, sending MCP progress notifications (files, bytes, rate) every 2 s when the
/// client asked for them. A cancelled call stops the sync through its token, so the
/// destination's staging session is closed properly.
async fn with_sync_progress<F, Fut>(
    ctx: &RequestContext<RoleServer>,
    work: F,
) -> crate::error::Result<Value>
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
        Some(p) if p.phase == crate::sync::Phase::Waiting => format!(
            "sync waiting for another sync of the same roots ({}) for {secs}s",
            p.waiting_for
        ),
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
        r = work(Some(cb)) => r,
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
        gitignore: p.gitignore,
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
                for name in [
                    "dry_run",
                    "overwrite",
                    "safe",
                    "confirm_delete",
                    "gitignore",
                ] {
                    if let Some(Value::Object(p)) = props.get_mut(name) {
                        p.remove("default");
                    }
                }
            }
            route.attr.input_schema = Arc::new(schema);
        }
        r
    }

    /// After the full schemas are kept for checking calls: list `excludes` as what a model
    /// should send, a list of patterns (null and the seed's JSON-in-a-string form are still
    /// accepted, since calls are checked against [`excludes_schema`]).
    pub(super) fn list_sync_compact(
        router: &mut rmcp::handler::server::router::tool::ToolRouter<Self>,
    ) {
        for route in router.map.values_mut() {
            let mut schema = (*route.attr.input_schema).clone();
            if let Some(Value::Object(props)) = schema.get_mut("properties")
                && let Some(Value::Object(p)) = props.get_mut("excludes")
            {
                p.insert("type".into(), Value::String("array".into()));
                p.remove("items");
                route.attr.input_schema = Arc::new(schema);
            }
        }
    }
}

impl RsbServer {
    /// A sync tool's call ([`ops::act`]), with progress notifications while it runs; a
    /// transfer that went to the background is followed for the session's push.
    async fn sync(
        &self,
        ctx: &RequestContext<RoleServer>,
        tool: &str,
        args: SyncArgs,
        direction: Direction,
    ) -> ToolResult {
        let (app, cancel) = (self.app.clone(), ctx.ct.clone());
        let caller = super::policy::caller(ctx);
        let r = with_sync_progress(ctx, |cb| async move {
            ops::act(&app, &caller, tool, args, direction, cb, &cancel).await
        })
        .await;
        if let Ok(v) = &r
            && let Some(id) = v["task_id"].as_i64()
        {
            self.followed.transfer(id);
        }
        reply(r)
    }
}

#[tool_router(router = sync_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        ),
        description = "Upload a file/dir exactly, only changes (excludes .git, node_modules, __pycache__, *.pyc, editor dirs). Big plans go background; remote edits since last sync stay conflicts."
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
        self.sync(&ctx, "sync_local_to_remote", args, Direction::Upload)
            .await
    }

    #[tool(
        annotations(idempotent_hint = true, open_world_hint = false),
        description = "Download a sandbox file/dir; as sync_local_to_remote."
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
            gitignore: p.gitignore,
        };
        self.sync(&ctx, "sync_remote_to_local", args, Direction::Download)
            .await
    }

    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "Status and log of a background transfer."
    )]
    async fn check_file_transfer_task(
        &self,
        Parameters(p): Parameters<CheckTransferParams>,
    ) -> ToolResult {
        let r = match self.app.transfers().await {
            Ok(t) => t.check(p.task_id, p.last_n_lines).await,
            Err(e) => Err(e),
        };
        reply(r)
    }

    #[tool(
        annotations(
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        ),
        description = "Cancel a background transfer (no partial files)."
    )]
    async fn cancel_file_transfer_task(
        &self,
        Parameters(p): Parameters<CancelTransferParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        if p.task_id <= 0 {
            return fail(&RsbError::invalid(
                "task_id must be positive",
                "pass the task_id returned by sync_local_to_remote",
            ));
        }
        let t = match self.app.transfers().await {
            Ok(t) => t,
            Err(e) => return fail(&e),
        };
        let r = super::policy::caller(&ctx)
            .act_on(
                self.app.config(),
                "cancel_file_transfer_task",
                format!("task {}", p.task_id),
                async || t.cancel(p.task_id, p.force_kill_after_s).await,
                // The reply does not name the transfer's sandbox.
                |_| String::new(),
            )
            .await;
        reply(r)
    }
}
