//! The order of an apply session's requests: strictly by `seq`, with a bounded wait for a gap.

use super::*;

/// The apply sessions of one channel.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<u64, Arc<Entry>>>,
}

/// One session: its turn order, and its state (locked by the request whose turn it is).
pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) order: watch::Sender<Order>,
    pub(super) state: Arc<tokio::sync::Mutex<Session>>,
}

#[derive(Default)]
pub(super) struct Order {
    /// The number whose turn it is.
    pub(super) next: u64,
    /// Numbers above `next` whose requests have arrived and not finished.
    pub(super) arrived: BTreeSet<u64>,
    /// Numbers above `next` given up before their turn (cancelled while waiting).
    pub(super) skipped: BTreeSet<u64>,
    /// Why the session takes no more requests (closed, aborted, a gap).
    pub(super) ended: Option<String>,
}

impl Sessions {
    pub(super) fn map(&self) -> MutexGuard<'_, HashMap<u64, Arc<Entry>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn lookup(&self, id: u64) -> Result<Arc<Entry>, AgentError> {
        self.map().get(&id).cloned().ok_or_else(|| {
            AgentError::new(
                ErrorCode::NotFound,
                format!("unknown sync session {id} (closed, or opened on another channel)"),
            )
        })
    }

    /// On channel end: remove the staging of every session still open (best effort; what is
    /// left is cleaned by the next `ApplyOpen` on that root).
    pub async fn close_all(&self) {
        let open: Vec<Arc<Entry>> = self.map().drain().map(|(_, e)| e).collect();
        for e in open {
            e.end("the channel closed");
            let Ok(guard) = tokio::time::timeout(SHUTDOWN_WAIT, e.state.clone().lock_owned()).await
            else {
                continue;
            };
            let _ = tokio::task::spawn_blocking(move || {
                let mut s = guard;
                s.abandon(true);
            })
            .await;
        }
    }
}

impl Entry {
    /// Refuse every request still waiting, and every later one.
    pub(super) fn end(&self, why: &str) {
        self.order.send_modify(|o| {
            if o.ended.is_none() {
                o.ended = Some(why.to_string());
            }
        });
    }

    pub(super) fn ended_error(&self, why: &str) -> AgentError {
        err(
            ErrorCode::NotFound,
            format!("sync session {} is over: {why}", self.id),
        )
    }

    /// Wait until every request numbered below `seq` has run (or was given up). The returned
    /// turn passes to `seq + 1` when dropped, however the request ends.
    pub(super) async fn turn(
        &self,
        seq: u64,
        cancel: &CancellationToken,
    ) -> Result<Turn<'_>, AgentError> {
        let mut refused = None;
        self.order.send_if_modified(|o| {
            refused = if let Some(why) = &o.ended {
                Some(self.ended_error(why))
            } else if seq < o.next || o.arrived.contains(&seq) || o.skipped.contains(&seq) {
                Some(err(
                    ErrorCode::InvalidArgument,
                    format!(
                        "apply request {seq} of sync session {} was already received                          (next expected: {})",
                        self.id, o.next
                    ),
                ))
            } else if seq - o.next > MAX_AHEAD {
                Some(err(
                    ErrorCode::InvalidArgument,
                    format!(
                        "apply request {seq} of sync session {} is too far ahead                          (next expected: {}, at most {MAX_AHEAD} may be pending)",
                        self.id, o.next
                    ),
                ))
            } else {
                None
            };
            if refused.is_some() {
                return false;
            }
            o.arrived.insert(seq);
            true
        });
        if let Some(e) = refused {
            return Err(e);
        }
        let turn = Turn { entry: self, seq };
        let mut rx = self.order.subscribe();
        let mut gap: Option<(u64, tokio::time::Instant)> = None;
        loop {
            {
                let o = rx.borrow_and_update();
                if let Some(why) = &o.ended {
                    return Err(self.ended_error(why));
                }
                if o.next == seq {
                    return Ok(turn);
                }
                let missing =
                    (o.next..seq).find(|k| !o.arrived.contains(k) && !o.skipped.contains(k));
                gap = match (missing, gap) {
                    (None, _) => None,
                    (Some(k), Some((g, since))) if g == k => Some((g, since)),
                    (Some(k), _) => Some((k, tokio::time::Instant::now())),
                };
            }
            let deadline = gap.map(|(_, since)| since + GAP_WAIT);
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(cancelled()),
                r = rx.changed() => {
                    if r.is_err() {
                        return Err(self.ended_error("the channel closed"));
                    }
                }
                _ = sleep_until(deadline) => {
                    let (k, _) = gap.expect("a deadline means a gap");
                    let why = format!(
                        "apply request {k} never arrived (request {seq} waited {GAP_WAIT:?} for                          it); requests must be numbered 0, 1, 2, … without gaps"
                    );
                    self.end(&why);
                    return Err(err(
                        ErrorCode::InvalidArgument,
                        format!("sync session {}: {why}", self.id),
                    ));
                }
            }
        }
    }
}

pub(super) async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// A request's place in its session's order; dropping it lets the next number go.
pub(super) struct Turn<'a> {
    pub(super) entry: &'a Entry,
    pub(super) seq: u64,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let seq = self.seq;
        self.entry.order.send_modify(|o| {
            o.arrived.remove(&seq);
            if o.next == seq {
                o.next += 1;
                while o.skipped.remove(&o.next) {
                    o.next += 1;
                }
            } else if seq > o.next {
                o.skipped.insert(seq);
            }
        });
    }
}
