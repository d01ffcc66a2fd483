//! `AgentClient` and the sync engine against agents served in-process: `rsb_agent::serve::run`
//! on its own thread (its own single-threaded runtime and `LocalSet`, as the binary runs it),
//! connected by an in-memory duplex stream. Fast and without sshd; the sshd tests in `tests/`
//! cover the real transport.
//!
//! A [`harness::Tap`] between the two ends records every frame and can cut the link, so the
//! tests check what went over the wire (a `Cancel`, the agent's final reply) rather than
//! guessing from timing.

mod apply;
mod client;
mod engine;
mod harness;
