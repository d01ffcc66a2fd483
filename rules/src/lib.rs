//! The rules both ends of rsb apply to paths, in one place so the two sides cannot disagree:
//! which entries a sync excludes ([`Rules`], gitignore semantics through a port of git's
//! wildmatch) and how a user's path is read ([`path`]: `~` expansion, lexical normalising,
//! anchoring remote paths at `$HOME`), and how a string becomes one shell word ([`shell`]).
//!
//! This crate has no dependencies and knows nothing of the protocol: the static agent links it
//! and must stay under 2 MiB, and `rsb` links it to decide single-file excludes locally with
//! exactly the engine the agent uses for directories.

pub mod path;
mod rules;
pub mod shell;

pub use rules::{DEFAULT_EXCLUDES, Layer, PatternError, Rules};
