//! What every front end's action shares: who asks (its origin) and how the user is asked (MCP
//! elicitation, the terminal's y/N) come from the front end as a [`Caller`]; the policy's gate
//! and the audit's lines are taken here, once, so `exec_bash` and `rsb exec` decide and record
//! the same request the same way.

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::{
    audit,
    config::Config,
    error::Result,
    policy::{self, Answer},
    pool::Pool,
};

/// Puts a policy question to the user and waits for the answer.
pub type Ask = Arc<dyn Fn(String) -> BoxFuture<'static, Answer> + Send + Sync>;

/// An action as a front end asks for it: one audit line (a job started, a job killed, a file
/// written), or a start and an end line ([`Act::long`]: a sync).
#[derive(Default)]
pub struct Act<'a> {
    /// The sandbox as named (`""`: the active one); resolved once, for the gate, the action
    /// and its line alike.
    pub sandbox: &'a str,
    /// The tool or command, as the policy's questions and the audit name it.
    pub tool: &'a str,
    /// What the audit records as the command.
    pub command: Option<String>,
    pub cwd: Option<String>,
    /// What the policy checks, each with the parameter it came in (none: nothing to check).
    pub checked: Vec<(&'static str, String)>,
    /// One of rsb's own destructive actions, for the policy's `ask_actions`, and what it does
    /// in the same words from every front end ("stopping the background task 'x'"; the
    /// sandbox is added).
    pub approval: Option<(policy::Action, String)>,
    /// An action that runs a while (a sync): a start line before it and an end line after,
    /// so the log shows it running and an action cut short says so; else one line at its end.
    pub long: bool,
    /// What the action writes, in bytes, when the request says (a file write's length).
    pub bytes: Option<u64>,
}

/// The front end's part of an action.
#[derive(Clone)]
pub struct Caller {
    /// `mcp:<client>` or `cli`, as the audit and the policy's questions name it.
    pub origin: String,
    pub ask: Ask,
}

impl Caller {
    pub fn new(origin: impl Into<String>, ask: Ask) -> Caller {
        Caller {
            origin: origin.into(),
            ask,
        }
    }

    /// Check `commands` (each with the parameter it came in) of `tool` on `sandbox` against its
    /// policy, asking the user when a rule says so (the decision is an audit line); `Ok`: run
    /// them. Nothing to check is `Ok` at once.
    pub async fn gate(
        &self,
        config: &Config,
        sandbox: &str,
        tool: &str,
        commands: &[(&'static str, String)],
        cwd: Option<&str>,
        stdin_forwarded: bool,
    ) -> Result<()> {
        if commands.is_empty() {
            return Ok(());
        }
        let req = policy::Request {
            sandbox,
            origin: self.origin.clone(),
            tool,
            commands: commands.iter().map(|(k, c)| (*k, c.as_str())).collect(),
            cwd,
            stdin_forwarded,
        };
        let ask = self.ask.clone();
        policy::gate(config, &req, move |q| ask(q)).await
    }

    /// One of rsb's own destructive actions through the policy's `ask_actions`; `Ok`: do it.
    pub async fn approve(
        &self,
        config: &Config,
        sandbox: &str,
        tool: &str,
        action: policy::Action,
        what: String,
    ) -> Result<()> {
        let req = policy::ActionRequest {
            sandbox,
            origin: self.origin.clone(),
            tool,
            action,
            what,
        };
        let ask = self.ask.clone();
        policy::gate_action(config, &req, move |q| ask(q)).await
    }

    /// The one path of an [`Act`]: its sandbox resolved once, the gate (its commands, its
    /// destructive action), `run` on that sandbox, and one audit line with the duration and
    /// the reply's numbers or the error.
    pub async fn act<T: serde::Serialize>(
        &self,
        pool: &Pool,
        act: Act<'_>,
        run: impl AsyncFnOnce(String) -> Result<T>,
    ) -> Result<T> {
        let sandbox = pool.resolve(act.sandbox)?;
        let config = pool.config();
        self.gate(
            config,
            &sandbox,
            act.tool,
            &act.checked,
            act.cwd.as_deref(),
            false,
        )
        .await?;
        if let Some((action, what)) = act.approval {
            let what = format!("{what} on sandbox '{sandbox}'");
            self.approve(config, &sandbox, act.tool, action, what)
                .await?;
        }
        if act.long {
            let started = self.start(config, &sandbox, act.tool, act.command, act.cwd);
            let r = run(sandbox).await;
            started.end(|a| {
                a.bytes = act.bytes;
                outcome(a, &r)
            });
            return r;
        }
        let t0 = std::time::Instant::now();
        let r = run(sandbox.clone()).await;
        let line = audit::Action {
            cwd: act.cwd,
            bytes: act.bytes,
            ..self.line(act.tool, act.command, t0, &r)
        };
        audit::record(config, &sandbox, &line);
        r
    }

    /// An action on something rsb already runs, named by its id (stopping a forward,
    /// cancelling a transfer or a watch): nothing to resolve or check, and one audit line on
    /// the sandbox the thing runs on, read from the result by `sandbox_of` (`""` when it
    /// failed).
    pub async fn act_on<'l, T: serde::Serialize>(
        &self,
        log: impl Into<audit::Log<'l>>,
        tool: &str,
        command: String,
        run: impl AsyncFnOnce() -> Result<T>,
        sandbox_of: impl FnOnce(&T) -> String,
    ) -> Result<T> {
        let t0 = std::time::Instant::now();
        let r = run().await;
        let line = self.line(tool, Some(command), t0, &r);
        let sandbox = r.as_ref().map(sandbox_of).unwrap_or_default();
        log.into().record(&sandbox, &line);
        r
    }

    /// The one line of an action that began at `t0` and ended with `r`.
    fn line<T: serde::Serialize>(
        &self,
        tool: &str,
        command: Option<String>,
        t0: std::time::Instant,
        r: &Result<T>,
    ) -> audit::Action {
        let mut line = audit::Action {
            origin: self.origin.clone(),
            tool: tool.into(),
            command,
            duration_ms: Some(t0.elapsed().as_millis() as u64),
            ..Default::default()
        };
        outcome(&mut line, r);
        line
    }

    /// The start line of an action that runs a while; its end line is written by
    /// [`audit::Started::end`] (a start dropped unended writes one that says so).
    pub fn start<'a>(
        &self,
        config: &'a Config,
        sandbox: &str,
        tool: &str,
        command: Option<String>,
        cwd: Option<String>,
    ) -> audit::Started<'a> {
        audit::start(
            config,
            sandbox,
            audit::Action {
                origin: self.origin.clone(),
                tool: tool.into(),
                command,
                cwd,
                ..Default::default()
            },
        )
    }
}

/// What an action's (end) line says of its result: the reply's numbers, or the error.
fn outcome<T: serde::Serialize>(line: &mut audit::Action, r: &Result<T>) {
    match r {
        Ok(v) => {
            line.detail = serde_json::to_value(v)
                .ok()
                .and_then(|v| audit::reply_summary(&v))
        }
        Err(e) => line.error = Some(e.message.clone()),
    }
}
