//! `rsb mcp`: the MCP stdio server. Tool handlers are thin: parse, call `ops`, shape the reply.
//!
//! Replies are one JSON text block (no output schemas: they would multiply the context cost of
//! `tools/list`). Domain errors are `isError: true` with `{"error", "hint"}`. Calls run
//! concurrently; a cancelled call's future is dropped, which cancels its agent request.

mod channel;
mod edit;
mod exec;
mod followed;
mod forward;
mod fs;
mod job_ends;
mod jobs;
mod policy;
mod push;
mod sandboxes;
mod search;
mod stdio;
mod sync;
mod wait;
mod watchdog;

use std::{collections::HashMap, sync::Arc, time::Duration};

use rmcp::{
    ErrorData, RoleServer, ServerHandler, ServiceExt,
    handler::server::router::tool::ToolRouter,
    model::{
        CallToolResult, ContentBlock, Implementation, JsonObject, ProgressNotificationParam,
        ServerCapabilities, ServerConfig,
    },
    service::RequestContext,
    tool_handler,
};
use serde_json::{Value, json};

use crate::{
    app::App,
    config::{Config, ConfigError},
    error::RsbError,
    pool::Pool,
};

#[derive(Clone)]
pub struct RsbServer {
    /// The pool and the store this server works with (one per `rsb mcp` process).
    pub(crate) app: Arc<App>,
    /// Port forwards started by `forward_port`; stopped when the server ends.
    pub(crate) forwards: Arc<crate::ops::forward::Forwards>,
    tool_router: ToolRouter<RsbServer>,
    /// Each tool's full input schema, which [`check_args`] validates against; `tools/list`
    /// carries the compact one ([`compact_schemas`]).
    full_schemas: Arc<HashMap<String, Arc<JsonObject>>>,
    /// Set when the configuration could not be loaded: the tools are still listed, and every
    /// call replies with this error (as the seed did), so the client sees why.
    config_error: Option<Arc<ConfigError>>,
    /// Set once the session's first tool reply went out: that reply says which configured
    /// sandboxes are this machine ([`local_notice`]).
    first_reply_sent: Arc<std::sync::atomic::AtomicBool>,
    /// The watches and background transfers this session started: what the channel pushes
    /// about ([`channel`]).
    pub(crate) followed: Arc<followed::Followed>,
    /// This server's session, as the audit log names it (random, per `rsb mcp` process).
    session: Arc<str>,
}

impl RsbServer {
    pub fn new(config: Config) -> Self {
        let advanced = config.expose_advanced_tools;
        let pool = Arc::new(Pool::new(Arc::new(config)));
        // Once per sandbox, after its first connect and off its path: is it a Slurm login
        // node that is not declared one?
        pool.on_first_connect(Arc::new(|c| {
            Box::pin(crate::slurm::discover::first_connect(c))
        }));
        let mut tool_router = Self::sandbox_router()
            + Self::exec_router()
            + Self::jobs_router()
            + Self::files_router()
            + Self::edit_router()
            + Self::search_router()
            + Self::sync_tools();
        // Advanced tools stay out of the default list: every listed byte is context the
        // client pays on each session.
        if advanced {
            tool_router += Self::watchdog_router();
            tool_router += Self::forward_router();
            tool_router += Self::patch_router();
        }
        let full_schemas = Arc::new(compact_schemas(&mut tool_router));
        Self::list_sync_compact(&mut tool_router);
        RsbServer {
            app: App::on(pool),
            forwards: Default::default(),
            tool_router,
            full_schemas,
            config_error: None,
            first_reply_sent: Default::default(),
            session: crate::audit::fresh_id().into(),
            followed: Default::default(),
        }
    }

    /// A server whose every tool call fails with `err` (a config error never holds a secret).
    pub fn with_config_error(err: ConfigError) -> Self {
        let config = Config {
            sandboxes: Vec::new(),
            expose_advanced_tools: false,
            inline_sync_max_files: crate::config::DEFAULT_INLINE_SYNC_MAX_FILES,
            inline_sync_max_bytes: crate::config::DEFAULT_INLINE_SYNC_MAX_BYTES,
            policy: Default::default(),
            state_dir: std::path::PathBuf::new(),
            source: "invalid configuration".into(),
            warnings: Vec::new(),
        };
        RsbServer {
            config_error: Some(Arc::new(err)),
            ..Self::new(config)
        }
    }
}

/// Drop from each listed input schema what costs a model context but tells it nothing it
/// needs: the `$schema` URI, `additionalProperties: false`, integer/float `format`s and
/// `default: null` (an optional parameter left out is null; about 1.7 KB of the default list)
/// and the `"null"` of an optional parameter's type. Returns the full schemas, which calls are
/// still checked against.
fn compact_schemas(router: &mut ToolRouter<RsbServer>) -> HashMap<String, Arc<JsonObject>> {
    let mut full = HashMap::new();
    for (name, route) in router.map.iter_mut() {
        full.insert(name.to_string(), route.attr.input_schema.clone());
        let mut s = (*route.attr.input_schema).clone();
        s.remove("$schema");
        s.remove("additionalProperties");
        if let Some(Value::Object(props)) = s.get_mut("properties") {
            for p in props.values_mut() {
                if let Value::Object(p) = p {
                    p.remove("format");
                    if p.get("default") == Some(&Value::Null) {
                        p.remove("default");
                    }
                    // An optional `T` (an `Option` field) is listed as `T`: leaving it out
                    // is how a model says null.
                    if let Some(Value::Array(types)) = p.get("type")
                        && types.len() == 2
                        && types.contains(&json!("null"))
                    {
                        let t = types.iter().find(|t| **t != json!("null")).cloned();
                        if let Some(t) = t {
                            p.insert("type".into(), t);
                        }
                    }
                }
            }
        }
        route.attr.input_schema = Arc::new(s);
    }
    full
}

pub(crate) type ToolResult = Result<CallToolResult, ErrorData>;

/// A typed `ops` result (or a `Value`) as the reply's one JSON text block.
pub(crate) fn ok<T: serde::Serialize>(v: T) -> ToolResult {
    match serde_json::to_string(&v) {
        Ok(text) => Ok(CallToolResult::success(vec![ContentBlock::text(text)])),
        Err(e) => fail(&RsbError::internal(format!("cannot encode the reply: {e}"))),
    }
}

/// Control characters (a newline in a path, say) are escaped so an error is always one line.
fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    if s.chars().any(char::is_control) {
        s.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        s.into()
    }
}

pub(crate) fn fail(e: &RsbError) -> ToolResult {
    let mut v = json!({"error": one_line(&e.message), "hint": one_line(&e.hint)});
    if e.is_connection_lost() {
        v["connection_error"] = json!(true);
    }
    Ok(CallToolResult::error(vec![ContentBlock::text(
        v.to_string(),
    )]))
}

pub(crate) fn reply<T: serde::Serialize>(r: crate::error::Result<T>) -> ToolResult {
    match r {
        Ok(v) => ok(v),
        Err(e) => fail(&e),
    }
}

/// Every 2 s, a progress notification with `message(seconds elapsed)`, when the client sent a
/// progress token; never completes (callers race it against their work).
pub(crate) fn progress_ticker(
    ctx: &RequestContext<RoleServer>,
    message: impl Fn(f64) -> String + Send + 'static,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let token = ctx.meta.get_progress_token();
    let peer = ctx.peer.clone();
    async move {
        let Some(token) = token else {
            return std::future::pending::<()>().await;
        };
        let start = tokio::time::Instant::now();
        let mut tick =
            tokio::time::interval_at(start + Duration::from_secs(2), Duration::from_secs(2));
        // Under load, missed ticks are skipped rather than fired back to back.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last = None;
        loop {
            tick.tick().await;
            let Some(secs) = next_progress(last, start.elapsed()) else {
                continue;
            };
            last = Some(secs);
            let p = ProgressNotificationParam::new(token.clone(), secs).with_message(message(secs));
            let _ = peer.notify_progress(p).await;
        }
    }
}

/// The progress value for a tick (whole seconds elapsed), or none when it would not exceed the
/// last one sent: MCP requires progress to increase with each notification.
fn next_progress(last: Option<f64>, elapsed: Duration) -> Option<f64> {
    let secs = elapsed.as_secs_f64().round();
    last.is_none_or(|l| secs > l).then_some(secs)
}

/// Run `work` unless the client cancels; while it runs longer than a few seconds and the
/// client sent a progress token, send a progress notification every couple of seconds.
pub(crate) async fn with_progress<F>(
    ctx: &RequestContext<RoleServer>,
    what: &str,
    work: F,
) -> ToolResult
where
    F: std::future::Future<Output = ToolResult>,
{
    let what = what.to_string();
    with_progress_msg(
        ctx,
        move |secs| format!("{what}: running for {secs}s"),
        work,
    )
    .await
}

/// [`with_progress`] whose notifications say `message(seconds elapsed)` (the last output line,
/// say: `wait::LastLine::message`).
pub(crate) async fn with_progress_msg<F>(
    ctx: &RequestContext<RoleServer>,
    message: impl Fn(f64) -> String + Send + 'static,
    work: F,
) -> ToolResult
where
    F: std::future::Future<Output = ToolResult>,
{
    let ticker = progress_ticker(ctx, message);
    tokio::select! {
        r = work => r,
        _ = ctx.ct.cancelled() => fail(&RsbError::new(
            crate::error::Kind::Agent(rsb_protocol::ErrorCode::Cancelled),
            format!("{} cancelled by the client", ctx_name(&ctx.id)), "the remote command was stopped")),
        _ = ticker => unreachable!(),
    }
}

/// Check call arguments against the tool's input schema (names, required, JSON types) so a bad
/// call gets an error naming the parameter; serde's own message for a wrong type does not.
/// Values are never echoed: they may hold anything.
fn check_args(
    schema: &serde_json::Map<String, Value>,
    args: Option<&serde_json::Map<String, Value>>,
) -> Result<(), RsbError> {
    let empty = serde_json::Map::new();
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let args = args.unwrap_or(&empty);
    for (k, v) in args {
        let Some(p) = props.get(k) else {
            let valid: Vec<&str> = props.keys().map(String::as_str).collect();
            return Err(RsbError::invalid(
                format!("unknown parameter '{k}'"),
                if valid.is_empty() {
                    "this tool takes no parameters".to_string()
                } else {
                    format!("valid parameters: {}", valid.join(", "))
                },
            ));
        };
        let types: Vec<&str> = match p.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => continue,
        };
        let fits = |t: &str| match t {
            // schemars marks i64 fields `format: int64`; a larger u64 would not fit.
            "integer" => {
                v.is_i64()
                    || (v.is_u64() && p.get("format").and_then(Value::as_str) != Some("int64"))
            }
            "number" => v.is_number(),
            "string" => v.is_string(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            "array" => v.is_array(),
            "object" => v.is_object(),
            _ => true,
        };
        if !types.iter().any(|t| fits(t)) {
            let got = match v {
                Value::Null => "null",
                Value::Bool(_) => "a boolean",
                Value::Number(n) if n.is_f64() => "a floating-point number",
                Value::Number(_) if types.contains(&"integer") => "an out-of-range integer",
                Value::Number(_) => "a number",
                Value::String(_) => "a string",
                Value::Array(_) => "an array",
                Value::Object(_) => "an object",
            };
            return Err(RsbError::invalid(
                format!("parameter '{k}' must be {}, got {got}", types.join(" or ")),
                "fix the argument's JSON type (see the tool's input schema)",
            ));
        }
    }
    if let Some(req) = schema.get("required").and_then(Value::as_array) {
        for r in req.iter().filter_map(Value::as_str) {
            if !args.contains_key(r) {
                return Err(RsbError::invalid(
                    format!("missing required parameter '{r}'"),
                    "pass every required parameter (see the tool's input schema)",
                ));
            }
        }
    }
    Ok(())
}

/// The audit log's origin of a call: `mcp:<client name>`.
pub(crate) fn origin(ctx: &RequestContext<RoleServer>) -> String {
    match ctx.peer.peer_info() {
        Some(i) => format!("mcp:{}", i.client_info.name),
        None => "mcp".into(),
    }
}

fn ctx_name(id: &rmcp::model::RequestId) -> String {
    format!("request {id}")
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for RsbServer {
    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, ErrorData> {
        if let Some(e) = &self.config_error {
            let mut v = json!({
                "error": format!("Sandbox configuration error: {}", e.message),
                "hint": e.hint,
            });
            if request.name == "list_sandboxes" {
                // The seed's diagnostics: which variables are set (never their values).
                let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
                v["diagnostics"] = json!({
                    "REMOTE_SANDBOX_LIST_set": set("REMOTE_SANDBOX_LIST"),
                    "REMOTE_SANDBOX_LIST_length": std::env::var("REMOTE_SANDBOX_LIST").map(|s| s.len()).unwrap_or(0),
                    "REMOTE_HOST_set": set("REMOTE_HOST"),
                    "init_error": e.message,
                });
                v["sandboxes"] = json!([]);
            }
            return Ok(CallToolResult::error(vec![ContentBlock::text(v.to_string())]).into());
        }
        if self.tool_router.get(&request.name).is_some()
            && let Some(schema) = self.full_schemas.get(request.name.as_ref())
            && let Err(e) = check_args(schema, request.arguments.as_ref())
        {
            return fail(&e).map(Into::into);
        }
        // Every audit line this call writes names it: the session, the request, the client's
        // tool-use id.
        let call = crate::audit::CallIds {
            session: self.session.to_string(),
            request: context.id.to_string(),
            tool_use: request
                .meta
                .as_ref()
                .and_then(|m| crate::audit::tool_use_id(m))
                .or_else(|| crate::audit::tool_use_id(&context.meta)),
        };
        let tcc = rmcp::handler::server::tool::ToolCallContext::new(self, request, context);
        let mut reply = crate::audit::CALL
            .scope(call, self.tool_router.call(tcc))
            .await?;
        if !self
            .first_reply_sent
            .swap(true, std::sync::atomic::Ordering::Relaxed)
            && let Some(notice) = local_notice(self.app.pool())
            && let rmcp::model::CallToolResponse::Complete(r) = &mut reply
        {
            add_notice(r, &notice);
        }
        Ok(reply)
    }

    fn get_info(&self) -> ServerConfig {
        let mut caps = ServerCapabilities::builder().enable_tools().build();
        // Claude Code listens for channel notifications from a server that declares this
        // (and was started with its channels flag); other clients ignore an unknown
        // experimental capability and notification.
        caps.experimental = Some(std::collections::BTreeMap::from([(
            channel::CAPABILITY.to_string(),
            JsonObject::new(),
        )]));
        ServerConfig::new(caps)
            .with_server_info(Implementation::new(
                "remote-sandbox",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(instructions(self.app.pool()))
    }
}

/// The server's `instructions`: the tools in one breath, plus which sandboxes are this machine.
fn instructions(pool: &Pool) -> String {
    let mut s = String::from(
        "Remote machines over SSH as sandboxes. list_sandboxes(check_resources=true) then \
         select_sandbox (or \"auto\"); exec_bash for commands; exec_bash_background + \
         check_background_task for long jobs; sync_* tools move files. A <channel> message \
         from this server says that a watched job or a background transfer you started ended \
         or changed state; its watch_id / task_id attributes are what check_background_task \
         and check_file_transfer_task take.",
    );
    if let Some(n) = local_notice(pool) {
        s.push(' ');
        s.push_str(&n);
    }
    s
}

/// "Sandbox `local` is THIS machine ..." when any configured sandbox is local; said in the
/// instructions and in a session's first reply, because a client may show neither the
/// listing nor the server's stderr, and commands there run on the user's own computer.
fn local_notice(pool: &Pool) -> Option<String> {
    let local: Vec<&str> = pool
        .names()
        .iter()
        .filter(|n| pool.is_local(n))
        .map(String::as_str)
        .collect();
    if local.is_empty() {
        return None;
    }
    let which = local
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut s = format!(
        "Sandbox {which} is THIS machine: commands there run on the computer rsb runs on, not on a remote host."
    );
    if pool.config().source == crate::config::BUILTIN_LOCAL {
        s.push_str(" No remote sandbox is configured (set REMOTE_HOST or REMOTE_SANDBOX_LIST).");
    }
    Some(s)
}

/// Adds `notice` to a reply: as a key of its JSON object, else as a second text block.
fn add_notice(r: &mut CallToolResult, notice: &str) {
    if let Some(ContentBlock::Text(t)) = r.content.first_mut()
        && let Ok(Value::Object(mut m)) = serde_json::from_str::<Value>(&t.text)
    {
        m.insert("notice".into(), json!(notice));
        t.text = Value::Object(m).to_string();
        return;
    }
    r.content.push(ContentBlock::text(notice.to_string()));
}

/// Serve MCP on stdin/stdout until the client closes the stream.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    serve_server(RsbServer::new(config)).await
}

/// Serve MCP with a configuration that failed to load: every tool call replies with `err`.
pub async fn serve_config_error(err: ConfigError) -> anyhow::Result<()> {
    serve_server(RsbServer::with_config_error(err)).await
}

async fn serve_server(server: RsbServer) -> anyhow::Result<()> {
    let app = server.app.clone();
    let forwards = server.forwards.clone();
    let followed = server.followed.clone();
    let (transport, writer) = stdio::transport(
        tokio::io::stdin(),
        tokio::io::stdout(),
        stdio::MAX_LINE_BYTES,
    );
    match server.serve(transport).await {
        Ok(running) => {
            let ct = tokio_util::sync::CancellationToken::new();
            // Only a client that listens gets channel notifications: one that never asked
            // may fail on a method it does not know.
            let listens = running
                .peer()
                .peer_info()
                .is_some_and(|i| channel::listens(&i));
            let pusher = listens.then(|| {
                tokio::spawn(channel::run(
                    running.peer().clone(),
                    app.pool().clone(),
                    followed,
                    ct.clone(),
                ))
            });
            let _ = running.waiting().await;
            ct.cancel();
            if let Some(p) = pusher {
                let _ = p.await;
            }
        }
        // A client that closes stdin before initializing is not an error worth a stack trace.
        Err(e) => tracing::info!("MCP session ended before initialization: {e}"),
    }
    forwards.stop_all().await;
    app.shutdown().await;
    // The transport is gone with the service; what it queued (a last error reply) is flushed
    // before the process exits. Bounded, since a client that stopped reading blocks the write.
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_only_ever_increases() {
        let ms = Duration::from_millis;
        assert_eq!(next_progress(None, ms(2_000)), Some(2.0));
        // Two late ticks 0.2 s apart round to the same second: the second is not sent.
        assert_eq!(next_progress(Some(4.0), ms(4_400)), None);
        assert_eq!(next_progress(Some(4.0), ms(3_900)), None);
        assert_eq!(next_progress(Some(4.0), ms(6_100)), Some(6.0));
        let mut last = None;
        for t in [2_000, 3_900, 4_100, 4_400, 6_000, 6_001, 8_500] {
            if let Some(v) = next_progress(last, ms(t)) {
                assert!(last.is_none_or(|l| v > l));
                last = Some(v);
            }
        }
    }

    fn schema() -> serde_json::Map<String, Value> {
        json!({
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "cwd": {"type": ["string", "null"], "default": null},
                "timeout_s": {"type": "integer", "format": "int64", "default": 120},
                "flag": {"type": "boolean"},
            },
            "required": ["command"],
        })
        .as_object()
        .unwrap()
        .clone()
    }

    fn check(args: Value) -> Result<(), String> {
        check_args(&schema(), args.as_object()).map_err(|e| e.message)
    }

    #[test]
    fn arguments_are_checked_against_the_schema_by_name() {
        assert_eq!(check(json!({"command": "x", "cwd": null})), Ok(()));
        assert_eq!(
            check(json!({"command": "x", "cwd": "/", "timeout_s": 5})),
            Ok(())
        );
        assert_eq!(
            check(json!({"command": "x", "bogus": 1})),
            Err("unknown parameter 'bogus'".into())
        );
        assert_eq!(
            check(json!({})),
            Err("missing required parameter 'command'".into())
        );
        assert_eq!(
            check(json!({"command": "x", "timeout_s": "abc"})),
            Err("parameter 'timeout_s' must be integer, got a string".into())
        );
        assert_eq!(
            check(json!({"command": "x", "timeout_s": 1.5})),
            Err("parameter 'timeout_s' must be integer, got a floating-point number".into())
        );
        assert_eq!(
            check(json!({"command": "x", "timeout_s": u64::MAX})),
            Err("parameter 'timeout_s' must be integer, got an out-of-range integer".into())
        );
        assert_eq!(
            check(json!({"command": "x", "flag": "yes"})),
            Err("parameter 'flag' must be boolean, got a string".into())
        );
        // A secret passed in the wrong place is never echoed.
        let e = check(json!({"command": "x", "timeout_s": "S3cr3t"})).unwrap_err();
        assert!(!e.contains("S3cr3t"), "{e}");
    }

    #[test]
    fn errors_are_one_line() {
        assert_eq!(one_line("plain"), "plain");
        assert_eq!(one_line("a\nb\tc\u{1b}"), "a\\nb\\tc\\u{1b}");
    }
}
