//! The policy's `ask`, as MCP elicitation: the client shows the question and the user
//! accepts or declines. A client that did not declare elicitation cannot be asked, and the
//! call is refused with a reply that says how to allow the command instead.

use std::{sync::Arc, time::Duration};

use rmcp::{
    RoleServer,
    model::{ElicitRequestParams, ElicitationAction, ElicitationSchema},
    service::{ElicitationMode, Peer, RequestContext},
};

use crate::{ops::action::Caller, policy::Answer};

/// How long a question may wait for the user; past it the command does not run.
const ASK_TIMEOUT: Duration = Duration::from_secs(600);

/// This call's side of an action ([`crate::ops::action`]): its client as the origin, and the
/// user asked through the client's elicitation.
pub(super) fn caller(ctx: &RequestContext<RoleServer>) -> Caller {
    let peer = ctx.peer.clone();
    Caller::new(
        super::origin(ctx),
        Arc::new(move |question| {
            let peer = peer.clone();
            Box::pin(async move { ask(&peer, question).await })
        }),
    )
}

/// The commands among `fields` (parameter name, value; empty ones dropped) and those a
/// resume plan carries, each with where it came from.
pub(super) fn commands_of(
    fields: &[(&'static str, &str)],
    plan_json: &str,
) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = fields
        .iter()
        .filter(|(_, c)| !c.trim().is_empty())
        .map(|(k, c)| (*k, c.to_string()))
        .collect();
    if let Ok(serde_json::Value::Object(plan)) = serde_json::from_str(plan_json) {
        for (k, field) in [
            ("launch_command", "resume_plan_json.launch_command"),
            ("resume_command", "resume_plan_json.resume_command"),
            ("checkpoint_command", "resume_plan_json.checkpoint_command"),
        ] {
            if let Some(c) = plan.get(k).and_then(serde_json::Value::as_str)
                && !c.trim().is_empty()
            {
                out.push((field, c.to_string()));
            }
        }
    }
    out
}

async fn ask(peer: &Peer<RoleServer>, question: String) -> Answer {
    if !peer
        .supported_elicitation_modes()
        .contains(&ElicitationMode::Form)
    {
        return Answer::CannotAsk(
            "this MCP client does not support elicitation, so the user cannot be asked".into(),
        );
    }
    // No fields: the answer is the action itself (accept runs the command).
    let params = ElicitRequestParams::FormElicitationParams {
        meta: None,
        message: question,
        requested_schema: ElicitationSchema::new(Default::default()),
    };
    match peer
        .create_elicitation_with_timeout(params, Some(ASK_TIMEOUT))
        .await
    {
        Ok(r) => match r.action {
            ElicitationAction::Accept => Answer::Approved,
            ElicitationAction::Decline => Answer::Declined,
            _ => Answer::Cancelled,
        },
        Err(e) => {
            tracing::info!("policy: the approval question failed: {e}");
            Answer::Cancelled
        }
    }
}
