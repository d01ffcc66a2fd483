//! Background jobs (owned by the jobs work; this is the agreed interface).

use rsb_protocol::{
    AgentError, ErrorCode, JobInfo, JobKillRequest, JobStartRequest, JobStatusRequest,
    JobStatusResult,
};

pub async fn start(_req: JobStartRequest) -> Result<JobInfo, AgentError> {
    Err(AgentError::new(ErrorCode::Unsupported, "jobs: not built yet"))
}

pub async fn status(_req: JobStatusRequest) -> Result<JobStatusResult, AgentError> {
    Err(AgentError::new(ErrorCode::Unsupported, "jobs: not built yet"))
}

pub async fn kill(_req: JobKillRequest) -> Result<JobInfo, AgentError> {
    Err(AgentError::new(ErrorCode::Unsupported, "jobs: not built yet"))
}

pub async fn list() -> Result<Vec<JobInfo>, AgentError> {
    Err(AgentError::new(ErrorCode::Unsupported, "jobs: not built yet"))
}

/// `rsb-agent jobs [--json]`
pub fn cli_main(_args: &[String]) -> i32 {
    eprintln!("rsb-agent jobs: not built yet");
    1
}

/// `rsb-agent job-run ...` (the wrapper a job runs under)
pub fn job_run_main(_args: &[String]) -> i32 {
    eprintln!("rsb-agent job-run: not built yet");
    1
}
