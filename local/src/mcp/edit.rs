//! `edit_remote_file` and `write_remote_file`: change a file on the sandbox, optionally only
//! if it still holds what a read returned (`expected_hash`).

use rmcp::{
    RoleServer, handler::server::wrapper::Parameters, schemars, schemars::JsonSchema,
    service::RequestContext, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, audited};
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
    /// hash from a read; refuse if the file changed since.
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
    /// hash from a read; refuse if the file changed since.
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

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyPatchParams {
    /// Codex format: *** Begin Patch … *** End Patch; paths relative to $HOME.
    pub patch: String,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
}

#[tool_router(router = patch_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(destructive_hint = true, open_world_hint = false),
        description = "Apply a Codex-format patch (*** Add/Update/Delete File, @@ hunks) on the sandbox. Every hunk of every file is checked first: one that does not apply changes no file. Each file is replaced atomically."
    )]
    async fn apply_patch(
        &self,
        Parameters(p): Parameters<ApplyPatchParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let t0 = std::time::Instant::now();
        let parsed = edit::parse_patch(&p.patch);
        // The audit line names the files, never the patch's text (file content).
        let what = match &parsed {
            Ok(req) => {
                let paths: Vec<&str> = req.files.iter().map(|f| f.path.as_str()).collect();
                paths.join(", ")
            }
            Err(_) => "(unparsable patch)".into(),
        };
        let r = async {
            let client = self.app.pool().client(&p.sandbox_name).await?;
            let mut req = parsed?;
            req.confine = client.confine().cloned();
            client
                .call(req)
                .await
                .map_err(edit::patch_error)
                .and_then(edit::patch_outcome)
        }
        .await;
        let sandbox = self.app.pool().resolve(&p.sandbox_name).unwrap_or_default();
        let tool = ("apply_patch", sandbox.as_str(), Some(what));
        audited(self.app.config(), &ctx, tool, t0, r)
    }
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
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let t0 = std::time::Instant::now();
        let name = p.sandbox_name.as_deref().unwrap_or("");
        let r = async {
            let req = edit::edit_request(
                &p.remote_path,
                &p.old_string,
                &p.new_string,
                p.replace_all.unwrap_or(false),
                p.expected_hash.as_deref().unwrap_or(""),
            )?;
            let client = self.app.pool().client(name).await?;
            let req = rsb_protocol::EditRequest {
                confine: client.confine().cloned(),
                ..req
            };
            let expected = req.expected_hash.clone();
            client
                .call(req)
                .await
                .and_then(|o| edit::outcome(&p.remote_path, expected.as_deref(), o))
        }
        .await;
        let sandbox = self.app.pool().resolve(name).unwrap_or_default();
        let tool = (
            "edit_remote_file",
            sandbox.as_str(),
            Some(p.remote_path.clone()),
        );
        audited(self.app.config(), &ctx, tool, t0, r)
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
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let t0 = std::time::Instant::now();
        let mut bytes = None;
        let r = async {
            let req = edit::write_request(
                &p.remote_path,
                p.content.as_deref(),
                p.content_base64.as_deref(),
                p.expected_hash.as_deref().unwrap_or(""),
                p.create_only.unwrap_or(false),
                p.make_dirs.unwrap_or(false),
            )?;
            bytes = Some(req.data.len() as u64);
            let make_dirs = req.make_dirs;
            let client = self.app.pool().client(&p.sandbox_name).await?;
            let req = rsb_protocol::WriteRequest {
                confine: client.confine().cloned(),
                ..req
            };
            let expected = match &req.condition {
                rsb_protocol::WriteCondition::Hash(h) => Some(h.clone()),
                _ => None,
            };
            client
                .call(req)
                .await
                .map_err(|e| edit::write_failed(e, make_dirs))
                .and_then(|o| edit::outcome(&p.remote_path, expected.as_deref(), o))
        }
        .await;
        let sandbox = self.app.pool().resolve(&p.sandbox_name).unwrap_or_default();
        super::audited_bytes(
            self.app.config(),
            &ctx,
            (
                "write_remote_file",
                sandbox.as_str(),
                Some(p.remote_path.clone()),
            ),
            t0,
            bytes,
            r,
        )
    }
}
