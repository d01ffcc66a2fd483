//! A sandbox's Slurm options as data, and the checks a value must pass before it can be one
//! sbatch argument. They live in config because a sandbox entry stores them and its checks run
//! at load time; the Slurm backend (`slurm/options.rs`) merges them per job and builds the
//! argv, and re-exports the type.

use rmcp::schemars::{self, JsonSchema};
use serde::{Deserialize, Serialize};

use crate::error::{Result, RsbError};

/// Per-job Slurm options; the same keys are a sandbox's defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SlurmOptions {
    /// -p
    pub partition: Option<String>,
    /// --gpus=N
    pub gpus: Option<u32>,
    /// --gres (e.g. gpu:a100:2)
    pub gres: Option<String>,
    /// --cpus-per-task
    pub cpus: Option<u32>,
    /// --mem (e.g. 4G)
    pub mem: Option<String>,
    /// --time (e.g. 1:00:00)
    pub time: Option<String>,
    pub account: Option<String>,
    pub qos: Option<String>,
    pub constraint: Option<String>,
    /// Let Slurm requeue the job on node failure or preemption (--requeue / --no-requeue).
    pub requeue: Option<bool>,
    /// USR1 to the job this long before its time limit (--signal=B:USR1@N), for checkpoints.
    pub signal_before_timeout_s: Option<u32>,
    /// More sbatch options, each one `--opt=value` element.
    pub sbatch_args: Vec<String>,
}

/// A sandbox's defaults have the same shape as a job's options.
pub type SlurmDefaults = SlurmOptions;

/// Options that cannot come from `sbatch_args` (in full, as one of getopt's abbreviations, or
/// as a short flag anywhere in a cluster such as `-vW`), each with why: rsb sets them for
/// every job (its record, log and lost-reply lookup depend on them), or they would take the
/// job where rsb cannot follow it.
const CONTROLLED: &[(&str, Option<char>, &str)] = &[
    ("output", Some('o'), SETS),
    ("job-name", Some('J'), SETS),
    ("comment", None, SETS),
    ("parsable", None, SETS),
    ("open-mode", None, SETS),
    ("signal", None, SETS),
    ("requeue", None, SETS),
    ("no-requeue", None, SETS),
    (
        "error",
        Some('e'),
        "the job's stderr goes to its log with stdout, where rsb reads it",
    ),
    ("wrap", None, "rsb submits its own batch script"),
    (
        "array",
        Some('a'),
        "rsb follows one Slurm job per rsb job; start one job per task instead",
    ),
    (
        "wait",
        Some('W'),
        "sbatch would not return until the job ends; rsb wait and the watchdog follow it",
    ),
    (
        "clusters",
        Some('M'),
        "rsb follows jobs on the login node's own cluster; configure a sandbox on the other cluster's login node",
    ),
];
const SETS: &str = "rsb sets it for every job";

/// sbatch's short options that take no argument, so the next letter of a cluster (`-vW`,
/// `-Ha1-3`) is another option. Every other letter takes the rest of the cluster as its value
/// (required, or optional like `-k`).
const SHORT_FLAGS: &[char] = &['H', 'h', 'O', 'Q', 's', 'u', 'V', 'v', 'W'];

impl SlurmOptions {
    fn texts(&self) -> [(&'static str, &Option<String>); 7] {
        [
            ("partition", &self.partition),
            ("gres", &self.gres),
            ("mem", &self.mem),
            ("time", &self.time),
            ("account", &self.account),
            ("qos", &self.qos),
            ("constraint", &self.constraint),
        ]
    }

    /// Refuse what cannot be one sbatch option: control characters (a newline would let a
    /// value pose as a second line wherever Slurm echoes it), empty values, extra arguments that
    /// are not options (one would become the batch script's name) and options rsb controls.
    pub fn check(&self) -> Result<()> {
        for (key, v) in self.texts() {
            if let Some(v) = v {
                check_value(key, v)?;
            }
        }
        if self.gpus == Some(0) || self.cpus == Some(0) {
            return Err(RsbError::invalid(
                "slurm gpus and cpus must be at least 1",
                "leave the key out for none",
            ));
        }
        for a in &self.sbatch_args {
            check_value("sbatch_args element", a)?;
            if !a.starts_with('-') || a == "-" || a == "--" {
                return Err(RsbError::invalid(
                    format!("slurm sbatch_args element {a:?} is not an option"),
                    "write each extra option as one element, with its value: \"--nodes=2\"",
                ));
            }
            if let Some((o, why)) = controlled(a) {
                return Err(RsbError::invalid(
                    format!("slurm sbatch_args cannot set {o}: {why}"),
                    "use the job's log_file / session_name, or the requeue and signal_before_timeout_s options",
                ));
            }
        }
        Ok(())
    }
}

fn check_value(key: &str, v: &str) -> Result<()> {
    if v.trim().is_empty() {
        return Err(RsbError::invalid(
            format!("slurm {key} is empty"),
            "leave the key out, or give it a value",
        ));
    }
    if v.chars().any(char::is_control) {
        return Err(RsbError::invalid(
            format!("slurm {key} contains a control character (newline, tab, NUL...)"),
            "Slurm options are single-line values",
        ));
    }
    Ok(())
}

/// The controlled option an extra argument would set, if any, and why it cannot: `--name[=v]`
/// and every getopt abbreviation of a controlled long name, or a controlled letter anywhere in
/// a short cluster before the first letter that takes the rest as its value.
fn controlled(a: &str) -> Option<(String, &'static str)> {
    if let Some(long) = a.strip_prefix("--") {
        let name = long.split('=').next().unwrap_or_default();
        return CONTROLLED
            .iter()
            .find(|(c, _, _)| !name.is_empty() && c.starts_with(name))
            .map(|(c, _, why)| (format!("--{c}"), *why));
    }
    for c in a.strip_prefix('-')?.chars() {
        if let Some((_, _, why)) = CONTROLLED.iter().find(|(_, s, _)| *s == Some(c)) {
            return Some((format!("-{c}"), *why));
        }
        if !SHORT_FLAGS.contains(&c) {
            break;
        }
    }
    None
}

/// Turn a sandbox entry's `scheduler` and `slurm` keys into its Slurm defaults: `Some` for a
/// Slurm login node. The error is (message, hint), for the caller to label with the entry.
pub(super) fn slurm_defaults(
    scheduler: Option<&str>,
    slurm: Option<SlurmDefaults>,
) -> Result<Option<SlurmDefaults>, (String, String)> {
    match scheduler.map(str::trim) {
        None | Some("") | Some("none") => match slurm {
            None => Ok(None),
            Some(_) => Err((
                "has 'slurm' options but no scheduler = \"slurm\"".into(),
                "Add scheduler = \"slurm\" to the sandbox, or remove its 'slurm' table.".into(),
            )),
        },
        Some("slurm") => {
            let d = slurm.unwrap_or_default();
            d.check().map_err(|e| (e.message, e.hint))?;
            Ok(Some(d))
        }
        Some(_) => Err((
            "has an unknown scheduler (only \"slurm\" is supported)".into(),
            "Write scheduler = \"slurm\" for a Slurm login node, or remove the key.".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controlled_options_are_refused_in_any_spelling() {
        for a in [
            "--output=x",
            "--out=x",
            "-o",
            "-ox",
            "--job-name=y",
            "--job=y",
            "--comment=z",
            "--parsable",
            "--signal=USR2",
            "--no-requeue",
        ] {
            let o = SlurmOptions {
                sbatch_args: vec![a.into()],
                ..Default::default()
            };
            let e = o.check().unwrap_err();
            assert!(e.message.contains("rsb sets it"), "{a}: {}", e.message);
        }
        // Issue 43: a controlled letter later in a cluster of flags, and options that would
        // take the job where rsb cannot follow it, each refused with its own reason.
        for (a, says) in [
            ("-Ha1-3", "-a: rsb follows one Slurm job"),
            ("-vW", "-W: sbatch would not return"),
            ("-ve/tmp/x", "-e: the job's stderr"),
            ("-QvJname", "-J: rsb sets it"),
            ("--array=1-3", "--array: rsb follows one Slurm job"),
            ("--clusters=other", "--clusters: rsb follows jobs"),
            ("--cluster=other", "--clusters"),
            ("-Mother", "-M: rsb follows jobs"),
            ("-e", "-e"),
            ("--wrap=id", "--wrap: rsb submits its own"),
            ("-W", "-W: sbatch would not return"),
        ] {
            let o = SlurmOptions {
                sbatch_args: vec![a.into()],
                ..Default::default()
            };
            let e = o.check().unwrap_err();
            assert!(e.message.contains(says), "{a}: {}", e.message);
            assert!(
                !e.message.contains("rsb sets it") || says.contains("sets"),
                "{a}: {}",
                e.message
            );
        }
        for a in [
            "--nodes=2",
            "--exclusive",
            "--constraint=a100",
            "-N2",
            "--export=ALL",
            // The letters after one that takes a value are that value: a partition named
            // "aW" and a node list are not -a or -W.
            "-paW",
            "-wnode-a1",
            "-HvN2",
            "-kW",
        ] {
            let o = SlurmOptions {
                sbatch_args: vec![a.into()],
                ..Default::default()
            };
            assert!(o.check().is_ok(), "{a}");
        }
    }

    #[test]
    fn values_with_control_characters_or_non_options_are_refused() {
        let bad = [
            SlurmOptions {
                partition: Some("debug\n#SBATCH --wrap=id".into()),
                ..Default::default()
            },
            SlurmOptions {
                sbatch_args: vec!["x; touch /tmp/p".into()],
                ..Default::default()
            },
            SlurmOptions {
                mem: Some(" ".into()),
                ..Default::default()
            },
        ];
        for o in bad {
            assert!(o.check().is_err(), "{o:?}");
        }
    }
}
