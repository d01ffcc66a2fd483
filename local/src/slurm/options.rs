//! Slurm options for a job: a sandbox's defaults (`slurm = { ... }` in its config entry) and a
//! job's own (`exec_bash_background`'s `slurm` parameter), merged field by field, then turned
//! into sbatch's argv. Each value is one argv element; none is ever parsed by a shell.
//!
//! The type and its checks are config's: a sandbox entry stores the defaults and checks them at
//! load time, and config depends on nothing above it.

pub use crate::config::{SlurmDefaults, SlurmOptions};

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
        // Not requeued unless asked: a site's default of requeueing would rerun the command
        // from the start under the same record, behind the watch's back.
        if self.requeue == Some(true) {
            v.push("--requeue".into());
        } else {
            v.push("--no-requeue".into());
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
    fn a_job_is_not_requeued_unless_asked() {
        let argv = |requeue| {
            SlurmOptions {
                requeue,
                ..Default::default()
            }
            .sbatch_argv("rsb-j", "rsb:L", "/o", "/b")
        };
        assert!(argv(None).contains(&"--no-requeue".to_string()));
        assert!(argv(Some(false)).contains(&"--no-requeue".to_string()));
        let asked = argv(Some(true));
        assert!(asked.contains(&"--requeue".to_string()));
        assert!(!asked.contains(&"--no-requeue".to_string()));
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
