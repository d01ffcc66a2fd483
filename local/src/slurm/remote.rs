//! The Slurm commands rsb runs on a login node. Each is a constant bash script run through the
//! agent's exec; everything variable (argv elements, paths, the spec) is in the request's
//! environment, as data: `RSB_N` and `RSB_A0..` become a bash array expanded as `"${args[@]}"`.
//! So a value with `;`, spaces, quotes or `$(...)` reaches the Slurm command as one argument.

use std::time::Duration;

use rsb_protocol::{ExecRequest, ExecResult};

use crate::{
    client::AgentClient,
    error::{Kind, Result, RsbError},
};

/// A down controller makes each client command block 9-18 s before it fails; past this the
/// call is given up, so no tool waits on Slurm longer than this.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(25);

/// Builds `args` from `RSB_N` / `RSB_A<i>` without any value passing through the parser.
const ARGS: &str = r#"args=(); i=0; while [ "$i" -lt "${RSB_N:-0}" ]; do v="RSB_A$i"; args+=("${!v}"); i=$((i+1)); done
"#;

/// What a run of a constant script returned.
pub struct Out {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// The last line the command wrote on stderr: what Slurm says went wrong.
    pub fn last_error(&self) -> &str {
        self.stderr.trim().lines().last().unwrap_or("no message")
    }

    /// `what` failed on the login node, with Slurm's own words.
    pub fn failed(&self, what: &str) -> RsbError {
        RsbError::new(
            Kind::Agent(rsb_protocol::ErrorCode::Io),
            format!("{what} failed: {}", self.last_error()),
            "check `scontrol ping` on the login node",
        )
    }
}

/// The most stdout a Slurm command may reply with (a node list of a large cluster is a few
/// MiB); more is an error, never a silent cut.
const MAX_REPLY: u64 = 8 << 20;

fn text(c: &rsb_protocol::Captured) -> String {
    let mut b = c.head.clone();
    b.extend_from_slice(&c.tail);
    String::from_utf8_lossy(&b).into_owned()
}

/// Run `script` (constant text) with `args` as `"${args[@]}"` and `env` as data.
pub async fn run(
    client: &AgentClient,
    script: &str,
    args: &[String],
    env: Vec<(String, String)>,
) -> Result<Out> {
    let mut req = ExecRequest::new(format!("{ARGS}{script}"));
    req.timeout_ms = CALL_TIMEOUT.as_millis() as u64;
    req.max_stdout = MAX_REPLY;
    req.env = env;
    req.env.push(("RSB_N".into(), args.len().to_string()));
    for (i, a) in args.iter().enumerate() {
        if a.contains('\0') {
            return Err(RsbError::invalid(
                "a Slurm argument contains a NUL byte",
                "remove it",
            ));
        }
        req.env.push((format!("RSB_A{i}"), a.clone()));
    }
    let r: ExecResult = client.call(req).await?;
    if r.timed_out {
        return Err(RsbError::new(
            Kind::Timeout,
            format!(
                "the Slurm command did not answer within {} s (controller down?)",
                CALL_TIMEOUT.as_secs()
            ),
            "check `scontrol ping` on the login node; rsb retries with backoff",
        ));
    }
    // A cut reply joins its head and tail mid-line: rows would be lost or garbled without a
    // word. Say so instead.
    if r.stdout.truncated() {
        return Err(RsbError::new(
            Kind::Agent(rsb_protocol::ErrorCode::Io),
            format!(
                "the Slurm command's reply was {} bytes, over rsb's {} MiB limit",
                r.stdout.total,
                MAX_REPLY >> 20
            ),
            "this cluster answers with more than rsb reads; please report it with the cluster's size",
        ));
    }
    Ok(Out {
        code: r.exit_code,
        stdout: text(&r.stdout),
        stderr: text(&r.stderr),
    })
}

/// `squeue` for the ids in args, every state, one `|`-separated row per job: id, state,
/// reason, elapsed, limit, node, restarts (`-O`, because `-o` has no restart count).
pub const SQUEUE: &str = r#"ids=$(IFS=,; printf '%s' "${args[*]}")
exec squeue -h -t all -j "$ids" -O 'JobID:|,State:|,Reason:|,TimeUsed:|,TimeLimit:|,NodeList:|,RestartCnt:|'
"#;

/// `scancel` the ids in args.
pub const SCANCEL: &str = "exec scancel \"${args[@]}\"\n";

/// Find jobs by name: `squeue -h -t all -u ME -n NAME -o '%i|%k'` (id and comment).
pub const FIND: &str = r#"exec squeue -h -t all -u "$(id -un)" -n "$RSB_JOBNAME" -o '%i|%k'
"#;

/// Record the Slurm id of a job found by [`FIND`] (its submit's reply was lost), so later
/// calls find it by its name.
pub const ADOPT: &str = r#"printf '%s\n' "$RSB_ID" > "$RSB_D/slurm_job.tmp" && mv -f "$RSB_D/slurm_job.tmp" "$RSB_D/slurm_job"
"#;

/// Everything resources need in one call: partitions, nodes, and the user's own jobs (a
/// cluster's whole queue can be 100,000 jobs: the controller is not asked for it).
pub const SINFO: &str = r#"echo '@partitions'
sinfo -h -o '%P|%a|%D|%C|%G|%m|%l' || exit 31
echo '@nodes'
sinfo -h -N -O 'NodeList:|,Partition:|,StateCompact:|,CPUsState:|,Memory:|,AllocMem:|,Gres:|,GresUsed:' || exit 31
echo '@queue'
squeue -h -u "$(id -un)" -o '%P|%T|%u' || exit 31
echo "@me $(id -un)"
"#;

/// Submit: record first (spec with the launch id), then the batch script, then one sbatch.
/// Exit codes: 17 already running, 21 bad cwd, 23 cannot write, 30 sbatch refused.
pub const SUBMIT: &str = r#"set -u
umask 077
d=$RSB_D
mkdir -p "$d" || { echo "cannot create the job directory $d" >&2; exit 23; }
[ -d "$RSB_CWD" ] || { echo "cwd $RSB_CWD is not a directory" >&2; exit 21; }
if [ -s "$d/slurm_job" ]; then
  old=$(head -c 64 "$d/slurm_job")
  st=$(squeue -h -t all -j "$old" -o %T 2>/dev/null)
  case "$st" in
    PENDING|RUNNING|CONFIGURING|COMPLETING|SUSPENDED|REQUEUE*|RESIZING|SIGNALING|STAGE_OUT|RESV_DEL_HOLD)
      echo "a job with this name is already $st as Slurm job $old" >&2; exit 17;;
  esac
fi
mkdir -p "$(dirname -- "$RSB_LOG")" || { echo "cannot create the log directory for $RSB_LOG" >&2; exit 23; }
rm -f "$d/state" "$d/slurm_job"
printf '%s' "$RSB_SPEC" > "$d/spec.tmp" && mv -f "$d/spec.tmp" "$d/spec" || exit 23
printf '%s\n' "$RSB_LAUNCH_ID" > "$d/launch_id.tmp" && mv -f "$d/launch_id.tmp" "$d/launch_id" || exit 23
printf '%s' "$RSB_SCRIPT" > "$d/batch.sh.tmp" && chmod 700 "$d/batch.sh.tmp" && mv -f "$d/batch.sh.tmp" "$d/batch.sh" || exit 23
fs=$(stat -f -c %T "$d" 2>/dev/null || echo unknown)
afs=$(stat -f -c %T "$RSB_AGENT" 2>/dev/null || echo unknown)
# Which file systems the compute nodes share with the login node (the one list of them).
shared() { case "$1" in *nfs*|*lustre*|*gpfs*|*beegfs*|*cifs*|*smb*|*fuse*|*ceph*|*panfs*|*wekafs*) echo yes;; *) echo no;; esac; }
fss=$(shared "$fs"); afss=$(shared "$afs")
# The cluster's node list matters only when the record or the agent is on a local file system
# (is the login node the only node?): no controller call otherwise, nor when an earlier submit
# of this rsb process learned it (RSB_NODES).
nodes=${RSB_NODES-}
[ -n "$nodes" ] || [ "$fss$afss" = yesyes ] || nodes=$(sinfo -h -o %n 2>/dev/null | sort -u | tr '\n' ' ')
# sbatch exports this shell's environment to the job (--export=ALL): rsb's own variables (the
# spec, the script) are not the job's.
for v in $(compgen -e); do case $v in RSB_*) unset "$v";; esac; done
out=$(sbatch "${args[@]}" 2>"$d/sbatch.err"); rc=$?
if [ "$rc" -ne 0 ]; then cat "$d/sbatch.err" >&2; rm -f "$d/spec"; exit 30; fi
id=${out%%;*}
printf '%s\n' "$id" > "$d/slurm_job"
printf 'id=%s\nfs=%s\nfs_shared=%s\nagent_fs=%s\nagent_fs_shared=%s\nhost=%s\nnodes=%s\n' "$id" "$fs" "$fss" "$afs" "$afss" "$(hostname -s)" "$nodes"
"#;

/// Every rsb job with a Slurm id under the jobs root: `@NAME`, the id line, then its spec.
pub const INVENTORY: &str = r#"for f in "$RSB_ROOT"/*/slurm_job; do
  [ -f "$f" ] || continue
  d=${f%/slurm_job}
  printf '@%s\n' "${d##*/}"
  head -c 64 "$f"
done
"#;
