//! Whether a sync deflates file bytes on their way across the link, and what that saved.
//!
//! Compression pays only where the link, not the CPU, is the bottleneck: one core compresses
//! text at level 1 at 100+ MB/s and the agent inflates faster still, so a link of tens of
//! Mbit/s gains almost the compression ratio, while loopback or a fast LAN only loses CPU to
//! it. `auto` (the default) therefore decides per transfer from the measured round trip to the
//! remote agent (a link [`SLOW_RTT`] or more away is a wide-area link, slower than the
//! compressor), and per payload from what it saves: a payload that does not shrink by a tenth
//! travels raw, and a large file whose first chunk did not shrink sends the rest raw without
//! trying. `RSB_SYNC_COMPRESS=on|off` overrides the link decision (`on`: a slow link that is
//! near, such as a congested Wi-Fi; `off`: a far link faster than a core compresses).

use std::{
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::Duration,
};

use rsb_protocol::ApplyOp;

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

    /// This process deflates what it sends.
    pub fn here(&self) -> bool {
        self.on && !self.at_source
    }

    /// The source agent deflates what it reads (`ReadFileZ`).
    pub fn at_source(&self) -> bool {
        self.on && self.at_source
    }

    /// Count a payload that crossed the link compressed.
    pub fn record(&self, raw: u64, wire: u64) {
        self.raw.fetch_add(raw, Ordering::Relaxed);
        self.wire.fetch_add(wire, Ordering::Relaxed);
    }

    /// Compress one payload when on and worth it (CPU-bound: call off the async runtime for
    /// more than a few KiB). `skip` is the file's memory that an earlier chunk did not shrink.
    pub fn compress(&self, data: &[u8], skip: Option<&AtomicBool>) -> Option<Vec<u8>> {
        if !self.here() || skip.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return None;
        }
        let z = rsb_protocol::compress::compress(data);
        match &z {
            Some(z) => self.record(data.len() as u64, z.len() as u64),
            None => {
                if let Some(s) = skip {
                    s.store(true, Ordering::Relaxed);
                }
            }
        }
        z
    }

    /// A batch of ops as one [`ApplyOp::Packed`] when on here and it shrinks by a tenth
    /// (small files compress better together: each has its neighbours as context), else the
    /// ops as they are. CPU-bound: call off the async runtime.
    pub fn pack(&self, ops: Vec<ApplyOp>) -> Vec<ApplyOp> {
        if !self.here() {
            return ops;
        }
        let Ok(raw) = rsb_protocol::codec::encode(&ops) else {
            return ops;
        };
        if raw.len() > rsb_protocol::compress::MAX_RAW {
            return ops;
        }
        match rsb_protocol::compress::compress(&raw) {
            Some(data) => {
                self.record(raw.len() as u64, data.len() as u64);
                vec![ApplyOp::Packed {
                    raw_len: raw.len() as u64,
                    data,
                }]
            }
            None => ops,
        }
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
    fn incompressible_chunk_stops_the_file() {
        let c = Compress::new(true, false);
        let skip = AtomicBool::new(false);
        let mut x = 1u32;
        let rnd: Vec<u8> = (0..50_000)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect();
        assert!(c.compress(&rnd, Some(&skip)).is_none());
        assert!(skip.load(Ordering::Relaxed));
        let text = "hello world, hello sync\n".repeat(1000);
        assert!(c.compress(text.as_bytes(), Some(&skip)).is_none());
        assert!(c.compress(text.as_bytes(), None).is_some());
        assert_eq!(c.saved().0, text.len() as u64);
        assert!(
            Compress::new(false, false)
                .compress(text.as_bytes(), None)
                .is_none()
        );
        assert!(
            Compress::new(true, true)
                .compress(text.as_bytes(), None)
                .is_none()
        );
    }
}
