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
            // One sandbox for the whole call: the one the policy asks about is the one that
            // runs it, whatever select_sandbox does while the user decides.
            let sandbox = match self.app.pool().resolve(&p.sandbox_name) {
                Ok(s) => s,
                Err(e) => return fail(&e),
            };
            let checked = if p.sudo {
                crate::policy::as_sudo(&p.command)
            } else {
                p.command.clone()
            };
            if let Err(e) = super::policy::gate(
                self,
                &ctx,
                &sandbox,
                tool,
                vec![("command", &checked)],
                p.cwd.as_deref(),
            )
            .await
            {
                return fail(&e);
            }
            let client = match self.app.pool().client(&sandbox).await {
                Ok(c) => c,
                Err(e) => return fail(&e),
            };
            req.confine = client.confine().cloned();
            let confine = req.confine.clone();
            let started = crate::audit::start(
                self.app.config(),
                client.sandbox(),
                crate::audit::Action {
                    origin: super::origin(&ctx),
                    tool: tool.into(),
                    command: Some(p.command.clone()),
                    cwd: p.cwd.clone(),
                    ..Default::default()
                },
            );
            let r = if p.sudo {
                match self.app.pool().sandbox_config(client.sandbox()) {
                    Some(sb) => exec::run_sudo(&client, sb, req).await,
                    None => Err(crate::error::RsbError::internal(
                        "the sandbox has no config",
                    )),
                }
            } else if streamed {
                client.call_streaming(req, wait::track(last.clone())).await
            } else {
                client.call(req).await
            };
            let exit_code = r.as_ref().ok().map(|r| exec::exit_status(r) as i64);
            let bytes = r.as_ref().ok().map(|r| r.stdout.total + r.stderr.total);
            let out = r.map(|r| exec::confined_reply(&r, p.timeout_s, confine.as_ref()));
            started.end(|a| {
                a.exit_code = exit_code;
                a.bytes = bytes;
                a.error = out.as_ref().err().map(|e| e.message.clone());
                // A confined command that failed (most often a write the kernel denied), or
                // one that ran unconfined: the line the reply carries.
                a.detail = out
                    .as_ref()
                    .ok()
                    .and_then(|o| o.confinement.as_ref())
                    .map(|c| serde_json::json!({ "confinement": c }));
            });
            reply(out)
        };
        let line = last.clone();
        with_progress_msg(&ctx, move |secs| line.message("exec_bash", secs), work).await
    }
}
