//! The Slurm job backend's mechanism, below both of its users: the job tools (`ops::slurm`)
//! and the watchdog daemon, which must submit, poll and judge Slurm jobs without calling up
//! into `ops`.
//!
//! - [`options`]: sbatch's argv from the options (the type and its checks are
//!   [`crate::config`]'s);
//! - [`remote`]: the constant scripts and how they are run;
//! - [`poll`]: one squeue per sandbox per tick for all its jobs, shared by every caller, and
//!   never holding a caller longer than [`poll::WAIT`];
//! - [`submit`]: the record first, then one sbatch; a repeated launch id returns the job it
//!   already submitted;
//! - [`discover`]: the host probe and the "this is a login node" verdict, for `rsb doctor`
//!   and a sandbox's first connect;
//! - [`state`]: what a Slurm state and the wrapper's record mean together, for the tools'
//!   replies and the watchdog's decisions alike.

pub mod discover;
pub mod options;
pub mod poll;
pub mod remote;
pub mod state;
pub mod submit;

pub use options::{SlurmDefaults, SlurmOptions};
