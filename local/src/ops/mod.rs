//! What each capability means to a user, independent of how it is asked for: the MCP tools and
//! the CLI both call these, so validation, defaults and reply shapes exist once.

pub mod action;
pub mod edit;
pub mod exec;
pub mod failure;
pub mod forward;
pub mod fs;
pub mod jobs;
pub mod output;
pub mod resources;
pub mod sandboxes;
pub mod search;
pub mod slurm;
pub mod sync;
pub mod watchdog;
