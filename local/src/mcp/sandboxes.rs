//! Sandbox selection and command execution tools.

use rmcp::{
    RoleServer, handler::server::wrapper::Parameters, schemars, schemars::JsonSchema,
    service::RequestContext, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, ok, reply, with_progress};
use crate::ops::{exec, sandboxes};

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSandboxesParams {
    /// Also sample CPU/memory/GPU and compute idle_score (0 busy .. 1 idle).
    #[serde(default)]
    pub check_resources: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SelectSandboxParams {
    /// Sandbox name, or "auto" for the idlest reachable one.
    pub sandbox_name: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

fn d_timeout() -> i64 {
    exec::DEFAULT_TIMEOUT_S
}
fn d_max_chars() -> i64 {
    exec::DEFAULT_MAX_OUTPUT_CHARS
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBashParams {
    pub command: String,
    /// Working directory (~ allowed).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Then SIGTERM, SIGKILL to the whole process group.
    #[serde(default = "d_timeout")]
    pub timeout_s: i64,
    /// Per stream; head and tail are kept.
    #[serde(default = "d_max_chars")]
    pub max_output_chars: i64,
    /// Override the active sandbox for this call.
    #[serde(default)]
    pub sandbox_name: String,
}

#[tool_router(router = sandbox_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        description = "List sandboxes and connection health. check_resources=true adds CPU/memory/GPU load and idle_score (1=idle)."
    )]
    async fn list_sandboxes(&self, Parameters(p): Parameters<ListSandboxesParams>) -> ToolResult {
        ok(sandboxes::list(&self.pool, p.check_resources).await)
    }

    #[tool(
        description = "Set the active sandbox for later calls; \"auto\" picks the idlest reachable one."
    )]
    async fn select_sandbox(&self, Parameters(p): Parameters<SelectSandboxParams>) -> ToolResult {
        match sandboxes::select(&self.pool, &p.sandbox_name).await {
            Ok(v) => ok(v),
            Err(e) if e.kind == crate::error::Kind::UnknownSandbox => {
                let v = serde_json::json!({
                    "error": format!("Unknown sandbox: '{}'", p.sandbox_name),
                    "available": self.pool.names(),
                    "hint": e.hint,
                });
                Ok(rmcp::model::CallToolResult::error(vec![
                    rmcp::model::ContentBlock::text(v.to_string()),
                ]))
            }
            Err(e) => fail(&e),
        }
    }

    #[tool(description = "Active sandbox and its live connection health.")]
    async fn get_active_sandbox(&self, Parameters(_p): Parameters<NoParams>) -> ToolResult {
        ok(sandboxes::get_active(&self.pool).await)
    }

    #[tool(
        description = "Run a bash command on the sandbox (stdin closed). Returns exit_code, stdout, stderr; timed_out=true only when the timeout killed it."
    )]
    async fn exec_bash(
        &self,
        Parameters(p): Parameters<ExecBashParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let req = match exec::build_request(
            &p.command,
            p.cwd.as_deref(),
            p.timeout_s,
            p.max_output_chars,
        ) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let work = async {
            let client = match self.pool.client(&p.sandbox_name).await {
                Ok(c) => c,
                Err(e) => return fail(&e),
            };
            reply(client.call(req).await.map(|r| exec::reply(&r, p.timeout_s)))
        };
        with_progress(&ctx, "exec_bash", work).await
    }
}
