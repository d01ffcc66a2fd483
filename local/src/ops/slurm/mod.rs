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
//! The mechanism (options → argv, the constant scripts, the shared squeue poll, submit, and
//! what a state means) is [`crate::slurm`]'s, one layer down, because the watchdog daemon
//! uses it too; re-exported here under the names the job tools use.
//!
//! - [`jobs`]: submit, status, kill and list, as the job tools see them;
//! - [`resources`]: partitions, nodes, CPUs and GPUs from sinfo, cached.

pub mod jobs;
pub mod resources;

pub use crate::slurm::{SlurmDefaults, SlurmOptions, options, poll, remote};
