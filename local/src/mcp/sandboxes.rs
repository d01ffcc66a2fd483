//! Sandbox listing and selection tools.

use rmcp::{
    handler::server::wrapper::Parameters, schemars, schemars::JsonSchema, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, ok};
use crate::ops::sandboxes;

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSandboxesParams {
    /// Also sample load: CPU, memory, GPUs, idle_score (1=idle).
    #[serde(default)]
    pub check_resources: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SelectSandboxParams {
    /// A name, or "auto" (idlest reachable).
    pub sandbox_name: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

#[tool_router(router = sandbox_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "List sandboxes; each probed now (at most 5 s)."
    )]
    async fn list_sandboxes(&self, Parameters(p): Parameters<ListSandboxesParams>) -> ToolResult {
        let depth = if p.check_resources {
            sandboxes::Listing::Resources
        } else {
            // The seed's contract: connection_alive is each sandbox's health, probed now.
            sandboxes::Listing::Probe
        };
        ok(sandboxes::list(self.app.pool(), depth).await)
    }

    #[tool(
        annotations(
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        ),
        description = "Set the active sandbox."
    )]
    async fn select_sandbox(&self, Parameters(p): Parameters<SelectSandboxParams>) -> ToolResult {
        match sandboxes::select(self.app.pool(), &p.sandbox_name).await {
            Ok(v) => ok(v),
            Err(e) if e.kind == crate::error::Kind::UnknownSandbox => {
                let v = serde_json::json!({
                    "error": format!("Unknown sandbox: '{}'", p.sandbox_name),
                    "available": self.app.pool().names(),
                    "hint": e.hint,
                });
                Ok(rmcp::model::CallToolResult::error(vec![
                    rmcp::model::ContentBlock::text(v.to_string()),
                ]))
            }
            Err(e) => fail(&e),
        }
    }

    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "Active sandbox and its health."
    )]
    async fn get_active_sandbox(&self, Parameters(_p): Parameters<NoParams>) -> ToolResult {
        ok(sandboxes::get_active(self.app.pool()).await)
    }
}
