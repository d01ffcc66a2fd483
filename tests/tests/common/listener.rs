//! An MCP client handler that keeps the notifications `rsb mcp` sends (shared by the channel
//! and Slurm tests through `#[path]`).

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use rmcp::{
    ClientHandler, RoleClient,
    model::{ClientConfig, CustomNotification},
    service::NotificationContext,
};
use serde_json::Value;

/// Keeps every custom notification, with when it arrived. `declare`: the client announces
/// `experimental: {"claude/channel": {}}`, as a client that takes channel notifications does.
#[derive(Clone, Default)]
pub struct Listener {
    pub got: Arc<Mutex<Vec<(Instant, String, Value)>>>,
    pub declare: bool,
}

impl ClientHandler for Listener {
    fn get_info(&self) -> ClientConfig {
        let mut info = ClientConfig::default();
        if self.declare {
            let mut exp = std::collections::BTreeMap::new();
            exp.insert("claude/channel".to_string(), serde_json::Map::new());
            info.capabilities.experimental = Some(exp);
        }
        info
    }

    fn on_custom_notification(
        &self,
        n: CustomNotification,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.got
            .lock()
            .unwrap()
            .push((Instant::now(), n.method, n.params.unwrap_or(Value::Null)));
        std::future::ready(())
    }
}
