//! A Slurm login node as a sandbox (`scheduler = "slurm"`): exec, files and sync work there as
//! on any host, and background jobs go through the cluster's scheduler instead of running on
//! the login node.
//!
//! The job record is the agent's (`~/.cache/rsb/jobs/NAME/{spec,state}`): rsb writes the spec
//! with a fresh launch id, then `sbatch` runs a generated batch script that execs the agent's
//! `job-run` wrapper on the compute node. The wrapper's record, on the shared home, is the truth
//! for the exit code (there is often no `sacct`); Slurm's `squeue` gives the state and the
//! reason. Every Slurm command runs through the agent's exec with a constant script whose data
//! (options, paths, the spec) travels in the environment, so nothing a user writes is ever
//! spliced into a shell string.
//!
//! - [`options`]: the options (sandbox defaults and per job; the type and its checks are
//!   [`crate::config`]'s) and the sbatch argv;
//! - [`remote`]: the constant scripts and how they are run;
//! - [`poll`]: one squeue per sandbox per tick for all its jobs, shared by every caller;
//! - [`jobs`]: submit, status, kill and list, as the job tools see them;
//! - [`resources`]: partitions, nodes, CPUs and GPUs from sinfo, cached.

pub mod jobs;
pub mod options;
pub mod poll;
pub mod remote;
pub mod resources;

pub use options::{SlurmDefaults, SlurmOptions};
