//! Port forwarding tools. Listed only with REMOTE_SANDBOX_EXPOSE_ADVANCED_TOOLS, so the default
//! `tools/list` keeps its size; a forward lives as long as the server, or (`detach`) as long as
//! the watchdog daemon that serves it.

use rmcp::{
    RoleServer, handler::server::wrapper::Parameters, schemars, schemars::JsonSchema,
    service::RequestContext, tool, tool_router,
};
use serde::Deserialize;

use super::{RsbServer, ToolResult, fail, ok, reply};
use crate::{
    error::RsbError,
    ops::forward::{self, DEFAULT_REMOTE_HOST, ForwardRequest},
};

fn d_host() -> String {
    DEFAULT_REMOTE_HOST.into()
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForwardPortParams {
    #[serde(default)]
    pub remote_port: Option<i64>,
    #[serde(default = "d_host")]
    pub remote_host: String,
    /// Unix socket on the sandbox, instead of a port.
    #[serde(default)]
    pub socket_path: String,
    /// 0 = the remote port if free, else any.
    #[serde(default)]
    pub local_port: i64,
    /// Non-loopback is reachable from other machines: needs allow_external.
    #[serde(default)]
    pub bind: String,
    /// Allow a bind that other machines can reach.
    #[serde(default)]
    pub allow_external: bool,
    #[serde(default)]
    pub sandbox_name: String,
    /// Served by the watchdog daemon: outlives this server.
    #[serde(default)]
    pub detach: bool,
}

impl ForwardPortParams {
    fn request(&self) -> Result<ForwardRequest, RsbError> {
        let target = match (self.socket_path.is_empty(), self.remote_port) {
            (false, None) => forward::unix_target(&self.socket_path)?,
            (true, Some(p)) => forward::tcp_target(
                &self.remote_host,
                u16::try_from(p).map_err(|_| {
                    RsbError::invalid(
                        format!("remote_port {p} is not a port"),
                        "ports are 1-65535",
                    )
                })?,
            )?,
            _ => {
                return Err(RsbError::invalid(
                    "pass exactly one of remote_port and socket_path",
                    "remote_port (with remote_host, default localhost) for TCP, socket_path for a Unix socket",
                ));
            }
        };
        let local = (self.local_port != 0).then_some(self.local_port);
        let bind = forward::parse_bind(&self.bind)?;
        forward::check_exposure(bind, self.allow_external)?;
        Ok(ForwardRequest {
            sandbox: self.sandbox_name.clone(),
            local_port: forward::local_port(local, &target)?,
            bind,
            target,
        })
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListForwardsParams {}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StopForwardParams {
    pub forward_id: u64,
}

fn json<T: serde::Serialize>(v: &T) -> ToolResult {
    match serde_json::to_value(v) {
        Ok(v) => ok(v),
        Err(e) => fail(&RsbError::internal(format!("cannot encode reply: {e}"))),
    }
}

#[tool_router(router = forward_router, vis = "pub(super)")]
impl RsbServer {
    #[tool(
        description = "Forward a local port to a sandbox port or Unix socket over SSH (like ssh -L); returns local_url."
    )]
    async fn forward_port(
        &self,
        Parameters(p): Parameters<ForwardPortParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let req = match p.request() {
            Ok(r) => r,
            Err(e) => return fail(&e),
        };
        let act = forward::act("forward_port", &req);
        let r = super::policy::caller(&ctx)
            .act(self.app.pool(), act, async |sandbox| {
                let req = req.on(sandbox);
                if p.detach {
                    return forward::detach(&self.app, &req).await;
                }
                let f = forward::start(self.app.pool(), &req, None).await?;
                Ok(self.forwards.add(f))
            })
            .await;
        reply(r)
    }

    #[tool(
        description = "List port forwards (this server's and detached ones) with connection and byte counts."
    )]
    async fn list_forwards(&self, Parameters(_): Parameters<ListForwardsParams>) -> ToolResult {
        let listed = self.forwards.list(&self.app.store()).await;
        match listed {
            Ok(l) => json(&l),
            Err(e) => fail(&e),
        }
    }

    #[tool(description = "Stop a port forward and free its local port.")]
    async fn stop_forward(
        &self,
        Parameters(p): Parameters<StopForwardParams>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let r = super::policy::caller(&ctx)
            .act_on(
                self.app.config(),
                "stop_forward",
                format!("forward {}", p.forward_id),
                async || self.forwards.stop(&self.app.store(), p.forward_id).await,
                |info| info.sandbox.clone(),
            )
            .await;
        reply(r)
    }
}
