//! Slurm options as data: a sandbox's defaults (`slurm = { ... }` in its config entry) and a
//! job's own (`exec_bash_background`'s `slurm` parameter), merged field by field, then turned
//! into sbatch's argv. Each value is one argv element; none is ever parsed by a shell.

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

/// Options rsb sets itself: the record, the log and the lost-reply lookup depend on them, so
/// they cannot come from `sbatch_args` (in full or as one of getopt's abbreviations).
const CONTROLLED_LONG: &[&str] = &[
    "output",
    "error",
    "job-name",
    "comment",
    "parsable",
    "wrap",
    "array",
    "open-mode",
    "wait",
    "signal",
    "requeue",
    "no-requeue",
];
const CONTROLLED_SHORT: &[char] = &['o', 'e', 'J', 'a', 'W'];

impl SlurmOptions {
    /// The job's options over the sandbox's defaults; `sbatch_args` are the defaults' then the
    /// job's.
    pub fn over(&self, defaults: &SlurmOptions) -> SlurmOptions {
        let pick = |a: &Option<String>, b: &Option<String>| a.clone().or_else(|| b.clone());
        SlurmOptions {
            partition: pick(&self.partition, &defaults.partition),
            gpus: self.gpus.or(defaults.gpus),
            gres: pick(&self.gres, &defaults.gres),
            cpus: self.cpus.or(defaults.cpus),
            mem: pick(&self.mem, &defaults.mem),
            time: pick(&self.time, &defaults.time),
            account: pick(&self.account, &defaults.account),
            qos: pick(&self.qos, &defaults.qos),
            constraint: pick(&self.constraint, &defaults.constraint),
            requeue: self.requeue.or(defaults.requeue),
            signal_before_timeout_s: self
                .signal_before_timeout_s
                .or(defaults.signal_before_timeout_s),
            sbatch_args: defaults
                .sbatch_args
                .iter()
                .chain(&self.sbatch_args)
                .cloned()
                .collect(),
        }
    }

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
            if let Some(o) = controlled(a) {
                return Err(RsbError::invalid(
                    format!("slurm sbatch_args cannot set {o}: rsb sets it for every job"),
                    "use the job's log_file / session_name, or the requeue and signal_before_timeout_s options",
                ));
            }
        }
        Ok(())
    }

    /// sbatch's argv after `sbatch`: the user's extra options first, then the typed ones, then
    /// the ones rsb controls (later options win in sbatch, and [`check`](Self::check) refused
    /// them in the extras anyway), then the script.
    pub fn sbatch_argv(
        &self,
        job_name: &str,
        comment: &str,
        out: &str,
        script: &str,
    ) -> Vec<String> {
        let mut v: Vec<String> = self.sbatch_args.clone();
        let mut opt = |k: &str, val: &Option<String>| {
            if let Some(x) = val {
                v.push(format!("--{k}={x}"));
            }
        };
        opt("partition", &self.partition);
        opt("gres", &self.gres);
        opt("mem", &self.mem);
        opt("time", &self.time);
        opt("account", &self.account);
        opt("qos", &self.qos);
        opt("constraint", &self.constraint);
        if let Some(g) = self.gpus {
            v.push(format!("--gpus={g}"));
        }
        if let Some(c) = self.cpus {
            v.push(format!("--cpus-per-task={c}"));
        }
        match self.requeue {
            Some(true) => v.push("--requeue".into()),
            Some(false) => v.push("--no-requeue".into()),
            None => {}
        }
        if let Some(s) = self.signal_before_timeout_s {
            v.push(format!("--signal=B:USR1@{s}"));
        }
        v.push("--parsable".into());
        v.push(format!("--job-name={job_name}"));
        v.push(format!("--comment={comment}"));
        v.push(format!("--output={out}"));
        v.push("--open-mode=append".into());
        v.push(script.into());
        v
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

/// The controlled option an extra argument would set, if any: `--name[=v]` and every getopt
/// abbreviation of a controlled long name, or a short flag `-X...`.
fn controlled(a: &str) -> Option<String> {
    if let Some(long) = a.strip_prefix("--") {
        let name = long.split('=').next().unwrap_or_default();
        return CONTROLLED_LONG
            .iter()
            .find(|c| c.starts_with(name))
            .map(|c| format!("--{c}"));
    }
    let c = a.strip_prefix('-')?.chars().next()?;
    CONTROLLED_SHORT.contains(&c).then(|| format!("-{c}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_options_override_defaults_and_extras_concatenate() {
        let d = SlurmOptions {
            partition: Some("gpu".into()),
            mem: Some("1G".into()),
            sbatch_args: vec!["--nodes=1".into()],
            ..Default::default()
        };
        let j = SlurmOptions {
            partition: Some("debug".into()),
            sbatch_args: vec!["--hold".into()],
            ..Default::default()
        };
        let m = j.over(&d);
        assert_eq!(m.partition.as_deref(), Some("debug"));
        assert_eq!(m.mem.as_deref(), Some("1G"));
        assert_eq!(m.sbatch_args, vec!["--nodes=1", "--hold"]);
    }

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
            "--wrap=id",
            "-W",
            "--array=1-3",
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
        for a in [
            "--nodes=2",
            "--exclusive",
            "--constraint=a100",
            "-N2",
            "--export=ALL",
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

    #[test]
    fn argv_puts_controlled_options_last_and_each_value_in_one_element() {
        let o = SlurmOptions {
            partition: Some("a b;'c\"".into()),
            gpus: Some(2),
            signal_before_timeout_s: Some(60),
            requeue: Some(false),
            sbatch_args: vec!["--nodes=1".into()],
            ..Default::default()
        };
        let v = o.sbatch_argv("rsb-j", "rsb:L", "/h/out-%j", "/h/batch.sh");
        assert_eq!(
            v,
            vec![
                "--nodes=1",
                "--partition=a b;'c\"",
                "--gpus=2",
                "--no-requeue",
                "--signal=B:USR1@60",
                "--parsable",
                "--job-name=rsb-j",
                "--comment=rsb:L",
                "--output=/h/out-%j",
                "--open-mode=append",
                "/h/batch.sh",
            ]
        );
    }
}
