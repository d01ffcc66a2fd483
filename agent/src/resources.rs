//! Resource sampling (owned by the resources work; this is the agreed interface).

use rsb_protocol::{AgentError, ResourceSnapshot, ResourcesRequest};

/// Background sampler shared by all requests on one agent.
pub struct Sampler {}

impl Sampler {
    pub fn new() -> std::sync::Arc<Sampler> {
        std::sync::Arc::new(Sampler {})
    }

    pub async fn snapshot(&self, _req: ResourcesRequest) -> Result<ResourceSnapshot, AgentError> {
        Err(AgentError::new(rsb_protocol::ErrorCode::Unsupported, "resources: not built yet"))
    }
}

/// `rsb-agent resources [--json]`
pub fn cli_main(_args: &[String]) -> i32 {
    eprintln!("rsb-agent resources: not built yet");
    1
}
