//! `rsb mcp`: the MCP stdio server. Tool handlers are thin: parse, call `ops`, shape the reply.
//!
//! Replies are one JSON text block (no output schemas: they would multiply the context cost of
//! `tools/list`). Domain errors are `isError: true` with `{"error", "hint"}`. Calls run
//! concurrently; a cancelled call's future is dropped, which cancels its agent request.

mod files;
mod jobs;
mod sandboxes;

use std::{sync::Arc, time::Duration};

use rmcp::{
    ErrorData, RoleServer, ServerHandler, ServiceExt,
    handler::server::router::tool::ToolRouter,
    model::{
        CallToolResult, ContentBlock, Implementation, ProgressNotificationParam,
        ServerCapabilities, ServerConfig,
    },
    service::RequestContext,
    tool_handler,
};
use serde_json::{Value, json};

use crate::{config::Config, error::RsbError, pool::Pool};

#[derive(Clone)]
pub struct RsbServer {
    pub(crate) pool: Arc<Pool>,
    tool_router: ToolRouter<RsbServer>,
}

impl RsbServer {
    pub fn new(config: Config) -> Self {
        let pool = Arc::new(Pool::new(Arc::new(config)));
        let tool_router = Self::sandbox_router() + Self::jobs_router() + Self::files_router();
        RsbServer { pool, tool_router }
    }
}

pub(crate) type ToolResult = Result<CallToolResult, ErrorData>;

pub(crate) fn ok(v: Value) -> ToolResult {
    Ok(CallToolResult::success(vec![ContentBlock::text(
        v.to_string(),
    )]))
}

pub(crate) fn fail(e: &RsbError) -> ToolResult {
    let mut v = json!({"error": e.message, "hint": e.hint});
    if e.is_connection_lost() {
        v["connection_error"] = json!(true);
    }
    Ok(CallToolResult::error(vec![ContentBlock::text(
        v.to_string(),
    )]))
}

pub(crate) fn reply(r: crate::error::Result<Value>) -> ToolResult {
    match r {
        Ok(v) => ok(v),
        Err(e) => fail(&e),
    }
}

/// Run `work` unless the client cancels; while it runs longer than a few seconds and the
/// client sent a progress token, send a progress notification every couple of seconds.
pub(crate) async fn with_progress<F>(
    ctx: &RequestContext<RoleServer>,
    what: &str,
    work: F,
) -> ToolResult
where
    F: std::future::Future<Output = ToolResult>,
{
    let token = ctx.meta.get_progress_token();
    let peer = ctx.peer.clone();
    let what = what.to_string();
    let ticker = async move {
        let Some(token) = token else {
            return std::future::pending::<()>().await;
        };
        let start = tokio::time::Instant::now();
        let mut tick =
            tokio::time::interval_at(start + Duration::from_secs(2), Duration::from_secs(2));
        loop {
            tick.tick().await;
            let secs = start.elapsed().as_secs_f64().round();
            let p = ProgressNotificationParam::new(token.clone(), secs)
                .with_message(format!("{what}: running for {secs}s"));
            let _ = peer.notify_progress(p).await;
        }
    };
    tokio::select! {
        r = work => r,
        _ = ctx.ct.cancelled() => fail(&RsbError::new(
            crate::error::Kind::Agent(rsb_protocol::ErrorCode::Cancelled),
            format!("{} cancelled by the client", ctx_name(&ctx.id)), "the remote command was stopped")),
        _ = ticker => unreachable!(),
    }
}

fn ctx_name(id: &rmcp::model::RequestId) -> String {
    format!("request {id}")
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for RsbServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(
                "remote-sandbox",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(
                "Remote machines over SSH as sandboxes. list_sandboxes(check_resources=true) then \
                 select_sandbox (or \"auto\"); exec_bash for commands; exec_bash_background + \
                 check_background_task for long jobs; sync_* tools move files.",
            )
    }
}

/// Serve MCP on stdin/stdout until the client closes the stream.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let server = RsbServer::new(config);
    let pool = server.pool.clone();
    let running = match server.serve(rmcp::transport::stdio()).await {
        Ok(r) => r,
        // A client that closes stdin before initializing is not an error worth a stack trace.
        Err(e) => {
            tracing::info!("MCP session ended before initialization: {e}");
            return Ok(());
        }
    };
    let _ = running.waiting().await;
    pool.shutdown().await;
    Ok(())
}
