//! `edit_remote_file` and `write_remote_file`: change a file on the sandbox, optionally only
//! if it still holds what a read returned (`expected_hash`).

use rmcp::{
    handler::server::wrapper::Parameters, schemars, schemars::JsonSchema, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, reply};
use crate::ops::edit;

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditRemoteFileParams {
    /// Relative to $HOME; ~ ok.
    pub remote_path: String,
    /// Exact text to replace.
    pub old_string: String,
    /// Replacement text.
    pub new_string: String,
    /// Replace every match.
    #[serde(default)]
    pub replace_all: Option<bool>,
    /// A read's hash; else refuse.
    #[serde(default)]
    pub expected_hash: Option<String>,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteRemoteFileParams {
    /// File, relative to $HOME; ~ ok.
    pub remote_path: String,
    /// Text to write.
    #[serde(default)]
    pub content: Option<String>,
    /// Bytes to write, base64.
    #[serde(default)]
    pub content_base64: Option<String>,
    /// A read's hash; else refuse.
    #[serde(default)]
    pub expected_hash: Option<String>,
    /// Refuse if the path exists.
    #[serde(default)]
    pub create_only: Option<bool>,
    /// Create missing parent dirs.
    #[serde(default)]
    pub make_dirs: Option<bool>,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
}

#[tool_router(router = edit_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(destructive_hint = true, open_world_hint = false),
        description = "Replace old_string in a remote text file; replies hash, diff."
    )]
    async fn edit_remote_file(
        &self,
        Parameters(p): Parameters<EditRemoteFileParams>,
    ) -> ToolResult {
        let req = match edit::edit_request(
            &p.remote_path,
            &p.old_string,
            &p.new_string,
            p.replace_all.unwrap_or(false),
            p.expected_hash.as_deref().unwrap_or(""),
        ) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let client = match self
            .pool
            .client(p.sandbox_name.as_deref().unwrap_or(""))
            .await
        {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        let expected = req.expected_hash.clone();
        reply(
            client
                .call(req)
                .await
                .and_then(|o| edit::outcome(&p.remote_path, expected.as_deref(), o)),
        )
    }

    #[tool(
        annotations(
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        ),
        description = "Write a remote file atomically (mode kept); replies its hash."
    )]
    async fn write_remote_file(
        &self,
        Parameters(p): Parameters<WriteRemoteFileParams>,
    ) -> ToolResult {
        let req = match edit::write_request(
            &p.remote_path,
            p.content.as_deref(),
            p.content_base64.as_deref(),
            p.expected_hash.as_deref().unwrap_or(""),
            p.create_only.unwrap_or(false),
            p.make_dirs.unwrap_or(false),
        ) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let client = match self.pool.client(&p.sandbox_name).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
        let expected = match &req.condition {
            rsb_protocol::WriteCondition::Hash(h) => Some(h.clone()),
            _ => None,
        };
        reply(
            client
                .call(req)
                .await
                .and_then(|o| edit::outcome(&p.remote_path, expected.as_deref(), o)),
        )
    }
}
