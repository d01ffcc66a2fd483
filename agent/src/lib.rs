//! The remote half of rsb as a library: the binary (`main.rs`) is a thin dispatcher over these
//! modules, and `rsb`'s tests drive [`serve`] in-process over an in-memory duplex stream
//! instead of a child process, so client and sync-engine paths are tested fast and without sshd.

pub mod confine;
pub mod edit;
pub mod exec;
pub mod fs;
pub mod hello;
pub mod jobs;
pub mod lease;
pub mod proc;
pub mod reaper;
pub mod resources;
pub mod responder;
pub mod search;
pub mod serve;
pub mod stale;
pub mod sync;
pub mod util;
