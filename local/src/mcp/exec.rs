//! `exec_bash`: one command to completion, its output captured.

use rmcp::{
    RoleServer, handler::server::wrapper::Parameters, schemars, schemars::JsonSchema,
    service::RequestContext, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, reply, wait, with_progress_msg};
use crate::ops::exec;

fn d_timeout() -> i64 {
    exec::DEFAULT_TIMEOUT_S
}
fn d_max_chars() -> i64 {
    exec::DEFAULT_MAX_OUTPUT_CHARS
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBashParams {
    /// Run by bash -c.
    pub command: String,
    /// ~ ok; null=$HOME.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Then kill its process group.
    #[serde(default = "d_timeout")]
    pub timeout_s: i64,
    /// Per stream (head+tail).
    #[serde(default = "d_max_chars")]
    pub max_output_chars: i64,
    /// ""=active sandbox
    #[serde(default)]
    pub sandbox_name: String,
    /// As root via sudo.
    #[serde(default)]
    pub sudo: bool,
}

#[tool_router(router = exec_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        annotations(destructive_hint = true, open_world_hint = true),
        description = "Run a command on the sandbox (stdin closed)."
    )]
    async fn exec_bash(
        &self,
        Parameters(p): Parameters<ExecBashParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let mut req = match exec::build_request(
            &p.command,
            p.cwd.as_deref(),
            p.timeout_s,
            p.max_output_chars,
        ) {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        // With a progress token the output also streams, so that each progress notification
        // can carry the command's last line; the reply still carries the capped capture.
        let last = wait::LastLine::default();
        let streamed = ctx.meta.get_progress_token().is_some();
        req.stream = streamed;
        let work = async {
            let tool = if p.sudo {
                "exec_bash(sudo)"
            } else {
                "exec_bash"
            };
            let checked = if p.sudo {
                crate::policy::as_sudo(&p.command)
            } else {
                p.command.clone()
            };
            let cmd = exec::Command {
                sandbox: &p.sandbox_name,
                tool,
                command: p.command.clone(),
                checked: Some(vec![("command", checked)]),
                cwd: p.cwd.as_deref(),
                stdin_forwarded: false,
            };
            let pool = self.app.pool();
            let out = exec::run_command(
                pool,
                &super::policy::caller(&ctx),
                cmd,
                req,
                async |client, req| {
                    let confine = req.confine.clone();
                    let r = if p.sudo {
                        exec::sudo(pool, &client, req).await
                    } else if streamed {
                        client.call_streaming(req, wait::track(last.clone())).await
                    } else {
                        client.call(req).await
                    }?;
                    Ok((
                        exec::confined_reply(&r, p.timeout_s, confine.as_ref()),
                        exec::Ran::of(&r, confine.as_ref()),
                    ))
                },
            )
            .await;
            reply(out)
        };
        let line = last.clone();
        with_progress_msg(&ctx, move |secs| line.message("exec_bash", secs), work).await
    }
}
