//! The byte window of one large file: how much of it may be unacknowledged at once.
//!
//! Kept apart because it is the one piece of the engine that decides from timing: a pure
//! controller, fed (bytes, when sent, when acknowledged) and asked for a limit, so its
//! behaviour is unit-tested with made-up clocks instead of a link.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use super::{CHUNKS_PER_REQUEST, LARGE_WINDOW};
use crate::sync::plan::BLOCK_SIZE;

/// Unacknowledged bytes of one large file are kept to about this much sending time at the
/// rate acknowledgements arrive, so an exec or a ping queued behind them (in the SSH window and
/// the socket buffers, where the control lane cannot reorder) waits about this long, not
/// seconds on a slow link. Bounded below by [`LARGE_MIN_BYTES`] and above by
/// [`LARGE_WINDOW`] requests.
const LARGE_QUEUE_TIME: Duration = Duration::from_millis(10);
const LARGE_MIN_BYTES: u64 = 512 * 1024;
/// The window before a rate is known. Each large file starts with this much sent at once, so
/// it is what an exec meets in the link at a file's start: traced, the slowest exec round trips
/// during an upload were those that met this first burst (2 MiB ahead, 80–120 ms on a busy
/// loopback).
const LARGE_START_BYTES: u64 = 1024 * 1024;

/// The byte window of one large file's requests: the rate acknowledgements arrive at (over the
/// last few), times the quickest acknowledgement seen (the link's and the agent's own delay)
/// plus [`LARGE_QUEUE_TIME`]. When data queues, acknowledgements slow, the window shrinks and
/// the queue drains to about [`LARGE_QUEUE_TIME`] (a delay-based controller, as TCP Vegas).
pub(super) struct Window {
    in_flight: u64,
    acked: u64,
    /// (when, bytes acknowledged by then), the last few acknowledgements.
    recent: VecDeque<(Instant, u64)>,
    min_delay: Option<Duration>,
    limit: u64,
}

impl Window {
    pub(super) fn new() -> Window {
        Window {
            in_flight: 0,
            acked: 0,
            recent: VecDeque::new(),
            min_delay: None,
            limit: LARGE_START_BYTES,
        }
    }

    pub(super) fn full(&self, next: u64) -> bool {
        self.in_flight + next > self.limit
    }

    pub(super) fn sent(&mut self, n: u64) {
        self.in_flight += n;
    }

    /// `n` wire bytes of a request handed to the channel at `sent_at` were acknowledged.
    pub(super) fn acked(&mut self, n: u64, sent_at: Instant) {
        self.acked_at(n, sent_at, Instant::now());
    }

    /// [`Window::acked`] at a given moment: the controller itself, free of the clock.
    fn acked_at(&mut self, n: u64, sent_at: Instant, now: Instant) {
        self.in_flight = self.in_flight.saturating_sub(n);
        let delay = now.duration_since(sent_at);
        self.min_delay = Some(self.min_delay.map_or(delay, |d| d.min(delay)));
        self.acked += n;
        self.recent.push_back((now, self.acked));
        if self.recent.len() > 8 {
            self.recent.pop_front();
        }
        let (t0, b0) = self.recent[0];
        let secs = now.duration_since(t0).as_secs_f64();
        if self.recent.len() >= 4 && secs >= 0.005 {
            let rate = (self.acked - b0) as f64 / secs;
            let span = self.min_delay.unwrap_or_default() + LARGE_QUEUE_TIME;
            let want = (rate * span.as_secs_f64()) as u64;
            self.limit = want.clamp(
                LARGE_MIN_BYTES,
                LARGE_WINDOW as u64 * CHUNKS_PER_REQUEST as u64 * BLOCK_SIZE,
            );
        }
    }

    /// Chunks per request: two requests fit the window, so one is written while the other is
    /// applied; 1 to [`CHUNKS_PER_REQUEST`].
    pub(super) fn chunks(&self) -> usize {
        ((self.limit / 2 / BLOCK_SIZE) as usize).clamp(1, CHUNKS_PER_REQUEST)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;
    const KIB: u64 = 1024;

    /// `count` acknowledgements of `bytes` each, `every` apart, each `delay` after its send,
    /// on a clock that starts at `t0`; returns the clock after the last one.
    fn feed(
        w: &mut Window,
        t0: Instant,
        count: u32,
        bytes: u64,
        every: Duration,
        delay: Duration,
    ) -> Instant {
        let mut now = t0;
        for _ in 0..count {
            now += every;
            w.sent(bytes);
            w.acked_at(bytes, now - delay, now);
        }
        now
    }

    fn near(got: u64, want: f64) -> bool {
        (got as f64 - want).abs() <= want * 0.01
    }

    #[test]
    fn a_new_window_holds_the_start_burst() {
        let mut w = Window::new();
        assert_eq!(w.limit, LARGE_START_BYTES);
        assert!(!w.full(LARGE_START_BYTES), "the start burst fits");
        assert!(w.full(LARGE_START_BYTES + 1));
        w.sent(LARGE_START_BYTES);
        assert!(w.full(1), "nothing more until an acknowledgement");
        // Two requests of two 256 KiB chunks fill 1 MiB.
        assert_eq!(w.chunks(), 2);
    }

    #[test]
    fn acknowledged_bytes_leave_the_flight_and_never_underflow() {
        let mut w = Window::new();
        let t = Instant::now();
        w.sent(300 * KIB);
        w.acked_at(100 * KIB, t, t + Duration::from_millis(1));
        assert_eq!(w.in_flight, 200 * KIB);
        // An acknowledgement larger than what is in flight (a resent request) clamps at 0.
        w.acked_at(900 * KIB, t, t + Duration::from_millis(2));
        assert_eq!(w.in_flight, 0);
        assert!(!w.full(LARGE_START_BYTES));
    }

    #[test]
    fn three_acknowledgements_are_not_yet_a_rate() {
        let mut w = Window::new();
        let ms = Duration::from_millis;
        feed(&mut w, Instant::now(), 3, MIB, ms(10), ms(1));
        assert_eq!(w.limit, LARGE_START_BYTES);
        // The fourth is: the limit moves.
        let mut w = Window::new();
        feed(&mut w, Instant::now(), 4, MIB, ms(10), ms(1));
        assert_ne!(w.limit, LARGE_START_BYTES);
    }

    #[test]
    fn acknowledgements_inside_5_ms_are_not_a_rate() {
        let mut w = Window::new();
        let ms = Duration::from_millis;
        // Six acknowledgements 0.5 ms apart span 2.5 ms: a burst of the reader, not the
        // link's rate, which would read as 2 GB/s.
        feed(
            &mut w,
            Instant::now(),
            6,
            MIB,
            Duration::from_micros(500),
            ms(1),
        );
        assert_eq!(w.limit, LARGE_START_BYTES);
    }

    #[test]
    fn the_window_is_the_rate_times_the_quickest_delay_plus_queue_time() {
        let mut w = Window::new();
        let ms = Duration::from_millis;
        // 1 MiB every 10 ms (100 MiB/s over the last three intervals), 2 ms delay.
        feed(&mut w, Instant::now(), 4, MIB, ms(10), ms(2));
        let rate = 3.0 * MIB as f64 / 0.030;
        assert!(
            near(w.limit, rate * 0.012),
            "limit {} for {}",
            w.limit,
            rate * 0.012
        );
        assert_eq!(w.chunks(), 2);
    }

    #[test]
    fn a_slow_link_is_floored_at_512_kib() {
        let mut w = Window::new();
        let ms = Duration::from_millis;
        // 64 KiB every 100 ms, 50 ms delay: 640 KiB/s × 60 ms = 38 KiB wanted.
        feed(&mut w, Instant::now(), 8, 64 * KIB, ms(100), ms(50));
        assert_eq!(w.limit, LARGE_MIN_BYTES);
        assert_eq!(w.chunks(), 1, "one chunk per request at the floor");
    }

    #[test]
    fn a_fast_link_is_capped_at_eight_full_requests() {
        let mut w = Window::new();
        let ms = Duration::from_millis;
        // 8 MiB every 5 ms with 20 ms of delay would want 50 MB in flight.
        feed(&mut w, Instant::now(), 8, 8 * MIB, ms(5), ms(20));
        let cap = LARGE_WINDOW as u64 * CHUNKS_PER_REQUEST as u64 * BLOCK_SIZE;
        assert_eq!(cap, 8 * MIB);
        assert_eq!(w.limit, cap);
        assert_eq!(w.chunks(), CHUNKS_PER_REQUEST);
    }

    #[test]
    fn the_quickest_delay_is_kept_when_later_ones_queue() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // Same rate; one window saw a 1 ms acknowledgement first, the other only 30 ms ones.
        let mut quick = Window::new();
        let t = feed(&mut quick, t0, 1, MIB, ms(10), ms(1));
        feed(&mut quick, t, 6, MIB, ms(10), ms(30));
        let mut slow = Window::new();
        feed(&mut slow, t0, 7, MIB, ms(10), ms(30));
        assert_eq!(quick.min_delay, Some(ms(1)));
        assert_eq!(slow.min_delay, Some(ms(30)));
        // Queueing delay is not the link's: it must not grow the window.
        assert!(quick.limit < slow.limit, "{} < {}", quick.limit, slow.limit);
        let rate = 6.0 * MIB as f64 / 0.060;
        assert!(near(quick.limit, rate * 0.011), "{}", quick.limit);
    }

    #[test]
    fn slower_acknowledgements_shrink_the_window_within_eight() {
        let ms = Duration::from_millis;
        let mut w = Window::new();
        // Fast: 1 MiB per 5 ms (200 MiB/s) × 11 ms ≈ 2.2 MiB.
        let t = feed(&mut w, Instant::now(), 8, MIB, ms(5), ms(1));
        let fast = w.limit;
        assert!(near(fast, 7.0 * MIB as f64 / 0.035 * 0.011), "{fast}");
        // Then the link queues: 1 MiB per 20 ms. Once the fast ones have left the last
        // eight, the limit is the slow rate's alone.
        feed(&mut w, t, 8, MIB, ms(20), ms(1));
        let slow = 7.0 * MIB as f64 / 0.140 * 0.011;
        assert!(w.limit < fast);
        assert!(near(w.limit, slow), "{} for {slow}", w.limit);
        assert_eq!(w.recent.len(), 8, "the history stays bounded");
    }

    #[test]
    fn chunks_keep_two_requests_inside_the_window() {
        let mut w = Window::new();
        for (limit, chunks) in [
            (LARGE_MIN_BYTES, 1),
            (MIB, 2),
            (3 * MIB / 2, 3),
            (2 * MIB, 4),
            (8 * MIB, 4),
        ] {
            w.limit = limit;
            assert_eq!(w.chunks(), chunks, "limit {limit}");
            assert!(
                2 * chunks as u64 * BLOCK_SIZE <= limit,
                "two requests fit {limit}"
            );
        }
    }
}
