//! `search_remote_files`: ripgrep on the sandbox, in the shape of the agents' own Grep tool.

use rmcp::{
    RoleServer, handler::server::wrapper::Parameters, schemars, schemars::JsonSchema,
    service::RequestContext, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, reply, with_progress};
use crate::ops::search;

fn d_head_limit() -> i64 {
    search::DEFAULT_HEAD_LIMIT
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchRemoteFilesParams {
    /// Regex (Rust syntax), per line.
    pub pattern: String,
    /// Dir or file, relative to $HOME.
    #[serde(default)]
    pub remote_path: String,
    /// Pattern is plain text.
    #[serde(default)]
    pub literal: Option<bool>,
    /// Match case-insensitively.
    #[serde(default)]
    pub ignore_case: Option<bool>,
    /// Files to search, e.g. *.py or *.{ts,tsx} !*.min.js
    #[serde(default)]
    pub glob: Option<String>,
    /// Lines around each match.
    #[serde(default)]
    pub context: Option<i64>,
    /// content, files_with_matches or count.
    #[serde(default)]
    pub output_mode: Option<String>,
    /// Max entries.
    #[serde(default = "d_head_limit")]
    pub head_limit: i64,
    /// Entries to skip.
    #[serde(default)]
    pub offset: Option<i64>,
    /// Also search gitignored files.
    #[serde(default)]
    pub no_ignore: Option<bool>,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
}

#[tool_router(router = search_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(read_only_hint = true, open_world_hint = false),
        description = "Search file contents like ripgrep (.gitignore on, binary skipped)."
    )]
    async fn search_remote_files(
        &self,
        Parameters(p): Parameters<SearchRemoteFilesParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let q = search::Query {
            pattern: p.pattern,
            remote_path: p.remote_path,
            literal: p.literal.unwrap_or(false),
            ignore_case: p.ignore_case.unwrap_or(false),
            globs: search::split_globs(p.glob.as_deref().unwrap_or("")),
            context: p.context.unwrap_or(0),
            output_mode: p.output_mode.unwrap_or_default(),
            head_limit: p.head_limit,
            offset: p.offset.unwrap_or(0),
            no_ignore: p.no_ignore.unwrap_or(false),
            ..Default::default()
        };
        let req = match search::request(&q) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let work = async {
            let client = match self.app.pool().client(&p.sandbox_name).await {
                Ok(c) => c,
                Err(e) => return fail(&e),
            };
            let sent = req.clone();
            reply(client.call(sent).await.map(|r| search::reply(&q, &req, r)))
        };
        // A cancel drops `work`, and with it the call: the agent's walk stops.
        with_progress(&ctx, "search_remote_files", work).await
    }
}
