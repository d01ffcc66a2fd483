//! Whether a sync compresses file bytes on their way across the link, and what that saved.
//!
//! Compression pays only where the link, not the CPU, is the bottleneck: one core compresses
//! text at level 1 at 100+ MB/s and the agent inflates faster still, so a link of tens of
//! Mbit/s gains almost the compression ratio, while loopback or a fast LAN only loses CPU to
//! it. `auto` (the default) therefore decides per transfer from the measured round trip to the
//! remote agent (a link [`SLOW_RTT`] or more away is a wide-area link, slower than the
//! compressor). An upload then sends its file bytes as one zstd stream for the session
//! (`ApplyOp::Stream`, level 3 with an 8 MiB window: at 300 MB/s a core outruns a gigabit
//! link); a large file whose first piece did not shrink by a tenth sends the rest raw without
//! trying, and a download's reads are compressed by the source agent, each on its own. `RSB_SYNC_COMPRESS=on|off` overrides the link decision (`on`: a slow link that is
//! near, such as a congested Wi-Fi; `off`: a far link faster than a core compresses).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use crate::error::{Result, RsbError};

/// The environment variable that overrides the link decision.
pub const ENV: &str = "RSB_SYNC_COMPRESS";

/// The round trip from which a link counts as slow. Loopback and a LAN answer in well under a
/// millisecond (a few on a loaded host); links tens of Mbit/s wide are wide-area links, whose
/// round trips are 10 ms and more.
pub const SLOW_RTT: Duration = Duration::from_millis(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Auto,
    On,
    Off,
}

impl Mode {
    /// From [`ENV`]; unset or empty is `auto`.
    pub fn from_env() -> Result<Mode> {
        match std::env::var(ENV).as_deref().map(str::trim) {
            Err(_) | Ok("") | Ok("auto") => Ok(Mode::Auto),
            Ok("on") => Ok(Mode::On),
            Ok("off") => Ok(Mode::Off),
            Ok(other) => Err(RsbError::invalid(
                format!("{ENV}={other:?} is not a compression mode"),
                format!("set {ENV} to auto, on or off (or unset it)"),
            )),
        }
    }

    /// On for this transfer, given the measured round trip to the remote agent?
    pub fn decide(self, rtt: Duration) -> bool {
        match self {
            Mode::On => true,
            Mode::Off => false,
            Mode::Auto => rtt >= SLOW_RTT,
        }
    }
}

/// The last link decision of `auto` per sandbox, from the round trips a transfer measured: a
/// sync that finds nothing to change measures nothing (its two requests are all it costs), so
/// whether its manifest reply travels compressed follows the sandbox's last transfer. Unknown
/// (no transfer yet in this process) reads as near: uncompressed, as on loopback.
static FAR: std::sync::Mutex<Option<std::collections::HashMap<String, bool>>> =
    std::sync::Mutex::new(None);

/// Remember `auto`'s decision for `sandbox`'s link.
pub fn remember(sandbox: &str, far: bool) {
    let mut m = FAR.lock().unwrap_or_else(|e| e.into_inner());
    m.get_or_insert_with(Default::default)
        .insert(sandbox.to_string(), far);
}

impl Mode {
    /// Ask `sandbox`'s agent for a compressed manifest? `auto`: when its last transfer found
    /// the link far ([`remember`]).
    pub fn manifest(self, sandbox: &str) -> bool {
        match self {
            Mode::On => true,
            Mode::Off => false,
            Mode::Auto => FAR
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .and_then(|m| m.get(sandbox).copied())
                .unwrap_or(false),
        }
    }
}

/// One transfer's compression: on or off, where, and the bytes of the payloads compressed.
#[derive(Debug, Default)]
pub struct Compress {
    on: bool,
    /// The source agent compresses (a download: the link is between it and this process);
    /// otherwise this process does, before the destination's agent.
    at_source: bool,
    /// Raw bytes of the payloads sent compressed…
    raw: AtomicU64,
    /// …and their size on the wire.
    wire: AtomicU64,
}

impl Compress {
    pub fn new(on: bool, at_source: bool) -> Compress {
        Compress {
            on,
            at_source,
            ..Default::default()
        }
    }

    pub fn on(&self) -> bool {
        self.on
    }

    /// This process compresses what it sends.
    pub fn here(&self) -> bool {
        self.on && !self.at_source
    }

    /// The source agent compresses what it reads (`ReadFileZ`).
    pub fn at_source(&self) -> bool {
        self.on && self.at_source
    }

    /// Count a payload that crossed the link compressed.
    pub fn record(&self, raw: u64, wire: u64) {
        self.raw.fetch_add(raw, Ordering::Relaxed);
        self.wire.fetch_add(wire, Ordering::Relaxed);
    }

    /// What `raw` bytes are expected to cost on the wire, from the ratio of what was sent
    /// compressed so far (raw before anything was): the large-file window counts wire bytes
    /// before the stream has compressed them.
    pub fn estimate(&self, raw: u64) -> u64 {
        let (r, w) = self.saved();
        if !self.here() || r == 0 || raw == 0 {
            return raw;
        }
        (raw as u128 * w as u128 / r as u128).clamp(1, raw.max(1) as u128) as u64
    }

    /// `(raw, wire)` bytes of the payloads sent compressed.
    pub fn saved(&self) -> (u64, u64) {
        (
            self.raw.load(Ordering::Relaxed),
            self.wire.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_round_trip() {
        assert!(!Mode::Auto.decide(Duration::from_micros(300)));
        assert!(Mode::Auto.decide(Duration::from_millis(20)));
        assert!(Mode::On.decide(Duration::ZERO));
        assert!(!Mode::Off.decide(Duration::from_secs(1)));
    }

    #[test]
    fn manifest_follows_the_last_transfer() {
        assert!(!Mode::Auto.manifest("never-seen"));
        remember("far-one", true);
        remember("near-one", false);
        assert!(Mode::Auto.manifest("far-one"));
        assert!(!Mode::Auto.manifest("near-one"));
        assert!(!Mode::Off.manifest("far-one"));
        assert!(Mode::On.manifest("near-one"));
        remember("far-one", false);
        assert!(!Mode::Auto.manifest("far-one"));
    }

    #[test]
    fn the_estimate_follows_the_ratio_so_far() {
        let c = Compress::new(true, false);
        assert_eq!(c.estimate(1000), 1000);
        c.record(4000, 1000);
        assert_eq!(c.estimate(1000), 250);
        assert_eq!(c.estimate(0), 0);
        let off = Compress::new(false, false);
        off.record(4000, 1000);
        assert_eq!(off.estimate(1000), 1000);
        assert_eq!(Compress::new(true, true).estimate(1000), 1000);
    }
}
