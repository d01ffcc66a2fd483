//! The wall clock that the state dir's ages are read against: when a row was written, when the
//! daemon last beat and pruned, what retention counts as old. One function, so a test can move
//! it: a debug build reads `RSB_TEST_CLOCK` once, `OFFSET_S` (`5184000`: 60 days ahead) or
//! `OFFSET_S*RATE` (`0*120`: from this process's first reading on, two simulated hours pass
//! in each real minute). A release build ignores the variable, so no user's clock can be
//! moved by the environment.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, as this process's clock reads them.
pub fn now_ms() -> i64 {
    let real = real_ms();
    match skew() {
        Some(s) => s.apply(real),
        None => real,
    }
}

/// [`now_ms`] in whole seconds.
pub fn now_s() -> i64 {
    now_ms().div_euclid(1000)
}

/// [`now_ms`] in seconds with a fraction (the transfer tasks' timestamps).
pub fn now_f64() -> f64 {
    now_ms() as f64 / 1000.0
}

/// Whether a file was last modified before `cut` (Unix seconds, as [`now_s`] reads them): how
/// retention ages the files it keeps beside the store.
pub fn modified_before(m: &std::fs::Metadata, cut: i64) -> bool {
    m.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .is_some_and(|d| (d.as_secs() as i64) < cut)
}

fn real_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A test's clock: `offset_ms` ahead, running `rate` times as fast from `base_ms` on.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Skew {
    base_ms: i64,
    offset_ms: i64,
    rate: f64,
}

impl Skew {
    fn apply(&self, real: i64) -> i64 {
        let ran = (real - self.base_ms) as f64 * self.rate;
        self.base_ms + ran as i64 + self.offset_ms
    }
}

/// `OFFSET_S` or `OFFSET_S*RATE`; `None` for anything else (a rate must be positive and at
/// most 10,000).
fn parse(s: &str, base_ms: i64) -> Option<Skew> {
    let (offset, rate) = match s.trim().split_once('*') {
        Some((o, r)) => (o.trim(), r.trim().parse::<f64>().ok()?),
        None => (s.trim(), 1.0),
    };
    let offset_s: i64 = offset.parse().ok()?;
    (rate > 0.0 && rate <= 10_000.0).then_some(Skew {
        base_ms,
        offset_ms: offset_s.checked_mul(1000)?,
        rate,
    })
}

fn skew() -> Option<Skew> {
    if !cfg!(debug_assertions) {
        return None;
    }
    static SKEW: OnceLock<Option<Skew>> = OnceLock::new();
    *SKEW.get_or_init(|| {
        let v = std::env::var("RSB_TEST_CLOCK").ok()?;
        let s = parse(&v, real_ms());
        if s.is_none() {
            tracing::warn!("RSB_TEST_CLOCK={v:?} is not OFFSET_S or OFFSET_S*RATE; ignored");
        }
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_and_a_rate_move_the_clock_from_its_base() {
        let base = 1_700_000_000_000;
        let ahead = parse("5184000", base).unwrap();
        assert_eq!(ahead.apply(base + 1_500), base + 1_500 + 5_184_000_000);
        let fast = parse(" 0 * 120 ", base).unwrap();
        // One real minute is two simulated hours.
        assert_eq!(fast.apply(base + 60_000), base + 7_200_000);
        assert_eq!(fast.apply(base), base);
        let back = parse("-86400*2", base).unwrap();
        assert_eq!(back.apply(base + 10), base + 20 - 86_400_000);
        for bad in [
            "",
            "x",
            "1*0",
            "1*-2",
            "1*20000",
            "1.5",
            "9223372036854775807",
        ] {
            assert_eq!(parse(bad, base), None, "{bad:?}");
        }
    }

    #[test]
    fn without_the_variable_the_clock_is_the_wall_clock() {
        // The test process never sets RSB_TEST_CLOCK.
        let before = real_ms();
        let now = now_ms();
        assert!(now >= before && now - before < 5_000, "{now} vs {before}");
    }
}
