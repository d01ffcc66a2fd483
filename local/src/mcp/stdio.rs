//! The stdio transport of `rsb mcp`: newline-delimited JSON-RPC in which every line gets an
//! answer.
//!
//! rmcp's own stdio transport drops a line silently when it is not JSON (invalid UTF-8, a
//! truncated object, nesting past serde_json's depth limit of 128) or is longer than its line
//! cap, so a client that sent one waits forever for a reply. JSON-RPC 2.0 wants a
//! `-32700 Parse error` (id null) for unparsable input and `-32600 Invalid Request` for JSON that
//! is not a request; this transport sends them itself and keeps serving.
//!
//! Lines are capped at [`MAX_LINE_BYTES`] while they are read (never buffered past the cap, the
//! rest of an oversized line is discarded), so a 100 MB line costs at most the cap in memory.
//! All output goes through one writer task, so an error reply never interleaves with a reply
//! rmcp is writing, and a cancelled receive can never leave half a line on stdout.

use std::io;

use rmcp::{
    RoleServer,
    service::{RxJsonRpcMessage, TxJsonRpcMessage},
    transport::Transport,
};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader},
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

/// The longest request line accepted. rsb's largest requests are commands and paths (a command
/// reaches `bash -c` as one argument, which Linux caps at 128 KiB), so 16 MiB, the agent
/// protocol's frame cap, leaves ample room while bounding what one line can cost.
pub const MAX_LINE_BYTES: usize = 16 << 20;

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;

/// One line for stdout; `done` learns whether it reached the pipe (rmcp's sends wait for it).
struct Out {
    bytes: Vec<u8>,
    done: Option<oneshot::Sender<io::Result<()>>>,
}

pub struct LineTransport<R> {
    read: BufReader<R>,
    /// The line being read; kept across a cancelled `receive` so the next call resumes it.
    line: Vec<u8>,
    /// Dropping the rest of an oversized line, up to its newline.
    discarding: bool,
    /// An error reply that could not be queued yet (the receive was cancelled first).
    pending: Option<Vec<u8>>,
    out: mpsc::Sender<Out>,
    max_line: usize,
}

/// A transport over `read`/`write` plus the writer task, which ends once the transport is
/// dropped and everything queued has been written; await it so no reply is lost at exit.
pub fn transport<R, W>(read: R, write: W, max_line: usize) -> (LineTransport<R>, JoinHandle<()>)
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (out, rx) = mpsc::channel(64);
    let writer = tokio::spawn(write_loop(write, rx));
    let t = LineTransport {
        read: BufReader::with_capacity(64 << 10, read),
        line: Vec::new(),
        discarding: false,
        pending: None,
        out,
        max_line,
    };
    (t, writer)
}

async fn write_loop<W: AsyncWrite + Unpin>(mut w: W, mut rx: mpsc::Receiver<Out>) {
    while let Some(o) = rx.recv().await {
        let r = async {
            w.write_all(&o.bytes).await?;
            w.flush().await
        }
        .await;
        let failed = r.is_err();
        if let Some(done) = o.done {
            let _ = done.send(r);
        }
        if failed {
            // The client is gone; dropping `rx` makes every later send fail promptly.
            break;
        }
    }
}

enum LineRead {
    Line,
    Oversized,
    Eof,
}

impl<R: AsyncRead + Unpin + Send> LineTransport<R> {
    /// Read up to and including the next `\n` into `self.line`, never past `max_line` bytes.
    /// Cancel-safe: `fill_buf` consumes nothing, and copy + `consume` happen without an await.
    async fn read_line(&mut self) -> io::Result<LineRead> {
        loop {
            let available = self.read.fill_buf().await?;
            if available.is_empty() {
                return Ok(LineRead::Eof);
            }
            let newline = available.iter().position(|b| *b == b'\n');
            let take = newline.map_or(available.len(), |i| i + 1);
            if self.discarding {
                self.read.consume(take);
                if newline.is_some() {
                    self.discarding = false;
                }
                continue;
            }
            if self.line.len() + take > self.max_line {
                self.line.clear();
                self.read.consume(take);
                self.discarding = newline.is_none();
                return Ok(LineRead::Oversized);
            }
            self.line.extend_from_slice(&available[..take]);
            self.read.consume(take);
            if newline.is_some() {
                return Ok(LineRead::Line);
            }
        }
    }
}

/// What one complete line is: a message for rmcp, nothing (blank lines, notifications that are
/// not for us), or the error reply it deserves.
fn classify(line: &[u8]) -> Result<Option<RxJsonRpcMessage<RoleServer>>, Vec<u8>> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    // RFC 8259 lets a parser ignore a byte order mark.
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let text = std::str::from_utf8(line).map_err(|e| {
        error_reply(
            None,
            PARSE_ERROR,
            &format!("Parse error: invalid UTF-8 at byte {}", e.valid_up_to()),
        )
    })?;
    // Syntax errors never quote the input, so serde's message is safe to return (a secret
    // pasted into a broken request is not echoed). Its depth limit (128) is what turns a
    // request nested 100,000 deep into an error instead of a stack overflow.
    let value: Value = serde_json::from_str(text)
        .map_err(|e| error_reply(None, PARSE_ERROR, &format!("Parse error: {e}")))?;
    let kind = match &value {
        Value::Object(_) => None,
        Value::Array(_) => Some("an array (JSON-RPC batches are not part of MCP)"),
        Value::Null => Some("null"),
        Value::Bool(_) => Some("a boolean"),
        Value::Number(_) => Some("a number"),
        Value::String(_) => Some("a string"),
    };
    if let Some(kind) = kind {
        return Err(error_reply(
            None,
            INVALID_REQUEST,
            &format!("Invalid Request: expected a JSON-RPC 2.0 object, got {kind}"),
        ));
    }
    let id = value
        .get("id")
        .filter(|id| id.is_string() || id.is_i64() || id.is_u64())
        .cloned();
    let notification = value.get("method").is_some() && value.get("id").is_none();
    match serde_json::from_value(value) {
        Ok(msg) => Ok(Some(msg)),
        // A notification never gets a reply, even a malformed one (JSON-RPC 2.0 §4.1); rmcp
        // also drops notifications from other protocols this way.
        Err(e) if notification => {
            tracing::debug!("ignoring a notification rsb cannot read: {e}");
            Ok(None)
        }
        // serde's message for a shape error may quote a value, so it is not returned.
        Err(_) => Err(error_reply(
            id,
            INVALID_REQUEST,
            "Invalid Request: not a JSON-RPC 2.0 request (needs \"jsonrpc\": \"2.0\", an id, \
             a method and object params)",
        )),
    }
}

fn error_reply(id: Option<Value>, code: i64, message: &str) -> Vec<u8> {
    let mut bytes = serde_json::to_vec(&json!({
        "jsonrpc": "2.0",
        "id": id.unwrap_or(Value::Null),
        "error": {"code": code, "message": message},
    }))
    .expect("a JSON value always serialises");
    bytes.push(b'\n');
    bytes
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "stdout is closed")
}

impl<R: AsyncRead + Unpin + Send> Transport<RoleServer> for LineTransport<R> {
    type Error = io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let out = self.out.clone();
        async move {
            let mut bytes = serde_json::to_vec(&item).map_err(io::Error::other)?;
            bytes.push(b'\n');
            let (done, written) = oneshot::channel();
            out.send(Out {
                bytes,
                done: Some(done),
            })
            .await
            .map_err(|_| closed())?;
            written.await.map_err(|_| closed())?
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        loop {
            if self.pending.is_some() {
                // `reserve` is cancel-safe; the reply stays pending until it is queued whole.
                let permit = self.out.reserve().await.ok()?;
                let bytes = self.pending.take().expect("checked above");
                permit.send(Out { bytes, done: None });
            }
            let read = match self.read_line().await {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("cannot read stdin: {e}");
                    return None;
                }
            };
            match read {
                LineRead::Oversized => {
                    tracing::warn!(
                        max_line = self.max_line,
                        "discarding a request line over the size limit"
                    );
                    self.pending = Some(error_reply(
                        None,
                        INVALID_REQUEST,
                        &format!(
                            "Invalid Request: message longer than {} bytes",
                            self.max_line
                        ),
                    ));
                }
                // A last line without its newline is still a line.
                LineRead::Eof if !self.line.is_empty() && !self.discarding => {
                    let line = std::mem::take(&mut self.line);
                    match classify(&line) {
                        Ok(Some(msg)) => return Some(msg),
                        Ok(None) => return None,
                        Err(reply) => {
                            if let Ok(permit) = self.out.reserve().await {
                                permit.send(Out {
                                    bytes: reply,
                                    done: None,
                                });
                            }
                            return None;
                        }
                    }
                }
                LineRead::Eof => return None,
                LineRead::Line => {
                    let verdict = classify(&self.line);
                    self.line.clear();
                    match verdict {
                        Ok(Some(msg)) => return Some(msg),
                        Ok(None) => {}
                        Err(reply) => self.pending = Some(reply),
                    }
                }
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(line: &[u8]) -> (i64, Value) {
        let reply = classify(line).expect_err("an error reply");
        let v: Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(v["jsonrpc"], "2.0");
        (v["error"]["code"].as_i64().unwrap(), v["id"].clone())
    }

    #[test]
    fn malformed_lines_get_the_json_rpc_error_they_deserve() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(code(deep.as_bytes()), (PARSE_ERROR, Value::Null));
        assert_eq!(code(b"{\"a\":\xff}\n"), (PARSE_ERROR, Value::Null));
        assert_eq!(
            code(b"{\"jsonrpc\":\"2.0\",\"id\":1,"),
            (PARSE_ERROR, Value::Null)
        );
        assert_eq!(code(b"42\n"), (INVALID_REQUEST, Value::Null));
        assert_eq!(code(b"[]\n"), (INVALID_REQUEST, Value::Null));
        assert_eq!(code(b"{\"id\":7,\"x\":1}\n"), (INVALID_REQUEST, json!(7)));
        assert!(matches!(classify(b"  \r\n"), Ok(None)));
        let init = br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
        assert!(matches!(classify(init), Ok(Some(_))));
    }

    #[test]
    fn a_secret_in_a_malformed_request_is_not_echoed() {
        let reply =
            classify(br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":"hunter2"}"#);
        let text = String::from_utf8(reply.expect_err("an error reply")).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
    }
}
