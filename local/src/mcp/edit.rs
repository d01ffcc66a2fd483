//! `edit_remote_file` and `write_remote_file`: change a file on the sandbox, optionally only
//! if it still holds what a read returned (`expected_hash`).

use rmcp::{
    RoleServer, handler::server::wrapper::Parameters, schemars, schemars::JsonSchema,
    service::RequestContext, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, policy::caller, reply};
use crate::ops::{action::Act, edit};

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
        let req = match edit::parse_patch(&p.patch) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let act = Act {
            sandbox: &p.sandbox_name,
            tool: "apply_patch",
            command: Some(edit::patch_paths(&req)),
            ..Default::default()
        };
        let pool = self.app.pool();
        let r = caller(&ctx)
            .act(pool, act, async |sandbox| {
                edit::patch(&pool.client(&sandbox).await?, req).await
            })
            .await;
        reply(r)
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
        let act = Act {
            sandbox: p.sandbox_name.as_deref().unwrap_or(""),
            tool: "edit_remote_file",
            command: Some(p.remote_path.clone()),
            ..Default::default()
        };
        let pool = self.app.pool();
        let r = caller(&ctx)
            .act(pool, act, async |sandbox| {
                edit::edit(&pool.client(&sandbox).await?, req, &p.remote_path).await
            })
            .await;
        reply(r)
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
        let act = Act {
            sandbox: &p.sandbox_name,
            tool: "write_remote_file",
            command: Some(p.remote_path.clone()),
            bytes: Some(req.data.len() as u64),
            ..Default::default()
        };
        let pool = self.app.pool();
        let r = caller(&ctx)
            .act(pool, act, async |sandbox| {
                edit::write(&pool.client(&sandbox).await?, req, &p.remote_path).await
            })
            .await;
        reply(r)
    }
}
