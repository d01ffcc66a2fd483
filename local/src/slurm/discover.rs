//! Noticing a Slurm login node: `rsb doctor` and a sandbox's first connect run the same
//! probe and the same verdict, so the two never disagree about what a host is.

use std::collections::BTreeMap;

use rsb_protocol::ExecRequest;

use crate::client::AgentClient;

/// What the host offers that a user needs to know before running there: a Slurm login node's
/// sbatch and sinfo, the NVIDIA driver and its CUDA version, Python, conda, environment
/// modules and scratch space. rsb's own constant text; each tool is bounded by `timeout`.
pub const HOST_PROBE: &str = r#"p() { printf '%s=%s\n' "$1" "$2"; }
p sbatch "$(command -v sbatch 2>/dev/null)"
command -v sinfo >/dev/null 2>&1 && p sinfo "$(timeout 5 sinfo -h -o %P 2>/dev/null | tr '\n' ' ')"
if command -v nvidia-smi >/dev/null 2>&1; then
  p driver "$(timeout 5 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  p cuda "$(timeout 5 nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)"
fi
command -v python3 >/dev/null 2>&1 && p python "$(python3 --version 2>&1 | head -n 1)"
command -v conda >/dev/null 2>&1 && p conda "$(conda --version 2>&1 | head -n 1)"
if [ -n "${MODULESHOME:-}${LMOD_CMD:-}" ] || command -v modulecmd >/dev/null 2>&1; then p modules yes; fi
p scratch "${SCRATCH:-}"
[ -d /scratch ] && p scratch_dir /scratch
exit 0"#;

/// The `key=value` lines of [`HOST_PROBE`]'s output.
pub fn probe_values(out: &str) -> std::collections::BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// The hint for a sandbox not declared `scheduler = "slurm"` whose host answers sbatch and
/// sinfo: how to declare it. `None` for any other host.
pub fn undeclared_login_node(v: &BTreeMap<String, String>) -> Option<String> {
    let get = |k: &str| v.get(k).map(String::as_str).filter(|s| !s.is_empty());
    let (_, parts) = (get("sbatch")?, get("sinfo")?);
    Some(format!(
        "sbatch and sinfo answer here (partitions: {parts}): a Slurm login node; add \
         scheduler = \"slurm\" to this sandbox so background jobs go through sbatch \
         instead of running on the login node"
    ))
}

/// How long the probe may take (each tool in it is bounded by `timeout 5`).
pub const PROBE_TIMEOUT_MS: u64 = 20_000;

/// Run [`HOST_PROBE`] on `client`'s host: its `key=value` answers.
pub async fn probe(client: &AgentClient) -> crate::error::Result<BTreeMap<String, String>> {
    let mut req = ExecRequest::new(HOST_PROBE.to_string());
    req.timeout_ms = PROBE_TIMEOUT_MS;
    req.max_stdout = 16 * 1024;
    req.max_stderr = 4 * 1024;
    let r = client.call(req).await?;
    Ok(probe_values(&String::from_utf8_lossy(&r.stdout.head)))
}

/// How long the first-connect look waits before probing: the call that connected is usually
/// about to use the host, and the probe should not compete with it.
pub const FIRST_CONNECT_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

/// The first-connect look ([`crate::pool::Pool::on_first_connect`]): the probe, then the
/// hint for an undeclared login node, logged once.
pub async fn first_connect(client: AgentClient) -> Option<String> {
    tokio::time::sleep(FIRST_CONNECT_DELAY).await;
    let v = probe(&client).await.ok()?;
    let hint = undeclared_login_node(&v)?;
    tracing::warn!(sandbox = %client.sandbox(), "{hint}");
    Some(hint)
}
