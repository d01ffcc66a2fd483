//! Remote file tools.

use rmcp::{
    handler::server::wrapper::Parameters, schemars, schemars::JsonSchema, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, reply};
use crate::ops::fs;

fn d_dot() -> String {
    ".".into()
}
fn d_max_entries() -> i64 {
    fs::DEFAULT_MAX_ENTRIES
}
fn d_max_bytes() -> i64 {
    fs::DEFAULT_MAX_BYTES
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListRemoteFilesParams {
    /// Relative to $HOME; ~ ok.
    #[serde(default = "d_dot")]
    pub remote_path: String,
    /// Include subdirectories.
    #[serde(default)]
    pub recursive: bool,
    /// Cap on entries.
    #[serde(default = "d_max_entries")]
    pub max_entries: i64,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadRemoteFileParams {
    /// Relative to $HOME; ~ ok.
    pub remote_path: String,
    /// Cap on returned bytes.
    #[serde(default = "d_max_bytes")]
    pub max_bytes: i64,
    /// First line (1-based).
    #[serde(default)]
    pub offset: Option<i64>,
    /// Max lines.
    #[serde(default)]
    pub limit: Option<i64>,
    /// Number lines.
    #[serde(default)]
    pub numbered: Option<bool>,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
}

#[tool_router(router = files_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "List a remote directory (symlinks not followed)."
    )]
    async fn list_remote_files(
        &self,
        Parameters(p): Parameters<ListRemoteFilesParams>,
    ) -> ToolResult {
        let req = match fs::list_request(&p.remote_path, p.recursive, p.max_entries) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let client = match self.app.pool().client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        reply(
            client
                .call(req)
                .await
                .map(|r| fs::list_reply(&p.remote_path, &r)),
        )
    }

    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "Read a remote file (binary as base64)."
    )]
    async fn read_remote_file(
        &self,
        Parameters(p): Parameters<ReadRemoteFileParams>,
    ) -> ToolResult {
        let req = match fs::read_request(
            &p.remote_path,
            p.max_bytes,
            p.offset.unwrap_or(0),
            p.limit.unwrap_or(0),
        ) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let client = match self.app.pool().client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        let by_lines = req.lines.is_some();
        reply(
            client
                .call(req)
                .await
                .map(|r| fs::read_reply(&r, by_lines, p.numbered.unwrap_or(false))),
        )
    }
}
