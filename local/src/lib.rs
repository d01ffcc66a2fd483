//! rsb: remote machines over SSH as sandboxes for AI agents.
//!
//! Request flow: MCP tool / CLI → [`pool::Pool`] (one connection per sandbox) →
//! [`client::AgentClient`] (framed, multiplexed) → `rsb-agent serve` on the host.

pub mod app;
pub mod audit;
pub mod client;
pub mod config;
pub mod connect;
pub mod error;
pub mod exec_stream;
pub mod forward;
pub mod gpus;
#[cfg(test)]
mod layering;
pub mod mcp;
pub mod ops;
pub mod policy;
pub mod pool;
pub mod server_env;
pub mod slurm;
pub mod ssh;
pub mod store;
pub mod sync;
pub mod term;
pub mod watchdog;
