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
/// Acknowledgements whose quickest tells whether data queues (about a round trip's worth of
/// requests: half of the most in flight).
const ROUND_ACKS: usize = LARGE_WINDOW / 2;
/// At most [`LARGE_WINDOW`] full requests.
const LARGE_MAX_BYTES: u64 = LARGE_WINDOW as u64 * CHUNKS_PER_REQUEST as u64 * BLOCK_SIZE;

/// The byte window of one large file's requests, a delay-based controller (as TCP Vegas).
/// The target is the rate acknowledgements arrive at (over the last few) times the delay a
/// request of this size takes without a queue (the quickest acknowledgement seen, plus the
/// longer sending time of a larger request) plus [`LARGE_QUEUE_TIME`]. When data queues,
/// acknowledgements slow, the window shrinks and the queue drains to about
/// [`LARGE_QUEUE_TIME`].
///
/// A window that only follows the rate it gets never learns that a long link carries more:
/// at 100 ms it stayed at its start (three 256 KiB requests in flight, 9 MB/s where the link
/// carried twice that). So until the first queue (a round of acknowledgements that all waited
/// more than [`LARGE_QUEUE_TIME`] beyond the quickest), each acknowledgement widens the window
/// by its bytes, doubling it each round trip (as slow start); from the first queue on it is
/// the target's. A slow link queues from its first round, so it never grows.
pub(super) struct Window {
    in_flight: u64,
    acked: u64,
    /// (when, bytes acknowledged by then), the last few acknowledgements.
    recent: VecDeque<(Instant, u64)>,
    min_delay: Option<Duration>,
    limit: u64,
    /// Until the first queue: grow by what is acknowledged (doubling each round trip).
    growing: bool,
    /// How long each of the last [`ROUND_ACKS`] acknowledgements waited beyond the quickest.
    waits: VecDeque<Duration>,
    /// The size of the request whose acknowledgement was the quickest.
    min_bytes: u64,
    /// The highest rate acknowledgements arrived at (bytes per second).
    max_rate: f64,
    /// The most the window may grow to: [`LARGE_MAX_BYTES`] per channel the file's bytes
    /// travel over.
    max: u64,
}

impl Window {
    /// The window of a file whose bytes travel over `channels` channels.
    pub(super) fn new(channels: usize) -> Window {
        Window {
            in_flight: 0,
            acked: 0,
            recent: VecDeque::new(),
            min_delay: None,
            limit: LARGE_START_BYTES,
            growing: true,
            waits: VecDeque::new(),
            min_bytes: 0,
            max_rate: 0.0,
            max: LARGE_MAX_BYTES * channels.max(1) as u64,
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
        if self.min_delay.is_none_or(|d| delay < d) {
            self.min_delay = Some(delay);
            self.min_bytes = n;
        }
        self.acked += n;
        self.recent.push_back((now, self.acked));
        if self.recent.len() > 8 {
            self.recent.pop_front();
        }
        let (t0, b0) = self.recent[0];
        let secs = now.duration_since(t0).as_secs_f64();
        if self.recent.len() < 4 || secs < 0.005 {
            return;
        }
        let rate = (self.acked - b0) as f64 / secs;
        self.max_rate = self.max_rate.max(rate);
        let quickest = self.min_delay.unwrap_or_default();
        // A larger request than the quickest one also takes longer to send, which is not
        // queueing.
        let own = Duration::try_from_secs_f64(
            n.saturating_sub(self.min_bytes) as f64 / self.max_rate.max(1.0),
        )
        .unwrap_or_default();
        let target = (rate * (quickest + own + LARGE_QUEUE_TIME).as_secs_f64()) as u64;
        self.waits.push_back(delay.saturating_sub(quickest + own));
        if self.waits.len() > ROUND_ACKS {
            self.waits.pop_front();
        }
        // Until the first queue, every acknowledgement widens the window by its bytes. The
        // least wait of the last round tells: the head of a burst this window sent itself
        // waits for nothing, so only a queue that every request met counts.
        let queue = self.waits.iter().min().copied().unwrap_or_default();
        if queue > LARGE_QUEUE_TIME {
            self.growing = false;
        }
        let want = if self.growing {
            self.limit.max(target) + n
        } else {
            target
        };
        self.limit = want.clamp(LARGE_MIN_BYTES, self.max);
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
        let mut w = Window::new(1);
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
        let mut w = Window::new(1);
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
        let mut w = Window::new(1);
        let ms = Duration::from_millis;
        feed(&mut w, Instant::now(), 3, MIB, ms(10), ms(1));
        assert_eq!(w.limit, LARGE_START_BYTES);
        // The fourth is: the limit moves.
        let mut w = Window::new(1);
        feed(&mut w, Instant::now(), 4, MIB, ms(10), ms(1));
        assert_ne!(w.limit, LARGE_START_BYTES);
    }

    #[test]
    fn acknowledgements_inside_5_ms_are_not_a_rate() {
        let mut w = Window::new(1);
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
    fn a_queueing_link_gets_the_rate_times_the_quickest_delay_plus_queue_time() {
        let mut w = Window::new(1);
        let ms = Duration::from_millis;
        // 1 MiB every 10 ms (100 MiB/s over the last seven intervals); the first took 2 ms,
        // the others 40 ms: a queue every request of the last round met.
        let t = feed(&mut w, Instant::now(), 1, MIB, ms(10), ms(2));
        feed(&mut w, t, 7, MIB, ms(10), ms(40));
        let rate = 7.0 * MIB as f64 / 0.070;
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
        let mut w = Window::new(1);
        let ms = Duration::from_millis;
        // 64 KiB every 100 ms, 50 ms delay then 300 (queued): 640 KiB/s × 60 ms = 38 KiB.
        let t = feed(&mut w, Instant::now(), 1, 64 * KIB, ms(100), ms(50));
        feed(&mut w, t, 7, 64 * KIB, ms(100), ms(300));
        assert_eq!(w.limit, LARGE_MIN_BYTES);
        assert_eq!(w.chunks(), 1, "one chunk per request at the floor");
    }

    #[test]
    fn a_fast_link_is_capped_at_eight_full_requests() {
        let mut w = Window::new(1);
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
        let mut quick = Window::new(1);
        let t = feed(&mut quick, t0, 1, MIB, ms(10), ms(1));
        feed(&mut quick, t, 6, MIB, ms(10), ms(30));
        let mut slow = Window::new(1);
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
        let mut w = Window::new(1);
        // Fast: 1 MiB per 5 ms (200 MiB/s) × 11 ms ≈ 2.2 MiB, queueing (30 ms after 1 ms).
        let t = feed(&mut w, Instant::now(), 1, MIB, ms(5), ms(1));
        let t = feed(&mut w, t, 7, MIB, ms(5), ms(30));
        let fast = w.limit;
        assert!(near(fast, 7.0 * MIB as f64 / 0.035 * 0.011), "{fast}");
        // Then the link slows: 1 MiB per 20 ms. Once the fast ones have left the last
        // eight, the limit is the slow rate's alone.
        feed(&mut w, t, 8, MIB, ms(20), ms(60));
        let slow = 7.0 * MIB as f64 / 0.140 * 0.011;
        assert!(w.limit < fast);
        assert!(near(w.limit, slow), "{} for {slow}", w.limit);
        assert_eq!(w.recent.len(), 8, "the history stays bounded");
    }

    #[test]
    fn without_a_queue_the_window_grows_by_what_was_acknowledged() {
        let ms = Duration::from_millis;
        let mut w = Window::new(1);
        // 1 MiB every 100 ms, each 100 ms after its send: a long link carrying all it is given.
        // The rate (10 MiB/s × 110 ms = 1.1 MiB) alone would keep the window where it started.
        let t = feed(&mut w, Instant::now(), 4, MIB, ms(100), ms(100));
        assert!(near(w.limit, 2.1 * MIB as f64), "{}", w.limit);
        let before = w.limit;
        let t = feed(&mut w, t, 1, MIB, ms(100), ms(100));
        assert_eq!(w.limit, before + MIB);
        // A queue (a round of acknowledgements all slower than the quickest by more than
        // the queue time and a quarter) ends the doubling: back to the rate's target.
        let t = feed(&mut w, t, ROUND_ACKS as u32, MIB, ms(100), ms(250));
        assert!(near(w.limit, 1.1 * MIB as f64), "{}", w.limit);
        // From then on the window is the rate's: no more doubling, even without a queue.
        feed(&mut w, t, 1, MIB, ms(100), ms(100));
        assert!(near(w.limit, 1.1 * MIB as f64), "{}", w.limit);
    }

    /// `w` sending one large file over a link of `rate` bytes/s and round trip `rtt` for
    /// `secs`, as the transfer loop does (requests of `chunks()` blocks while the window has
    /// room, at most [`LARGE_WINDOW`] in flight): bytes acknowledged per second, and the
    /// longest any request waited in the link's queue after the first second.
    fn simulate(rate: f64, rtt: Duration, secs: f64) -> (f64, Duration) {
        let mut w = Window::new(1);
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs_f64(secs);
        let mut now = t0;
        let mut link_free = t0;
        // (sent, bytes, acknowledged)
        let mut flight: VecDeque<(Instant, u64, Instant)> = VecDeque::new();
        let (mut done, mut worst) = (0u64, Duration::ZERO);
        while now < end {
            loop {
                let size = w.chunks() as u64 * BLOCK_SIZE;
                if flight.len() >= LARGE_WINDOW || (!flight.is_empty() && w.full(size)) {
                    break;
                }
                let wire = Duration::from_secs_f64(size as f64 / rate);
                let start = link_free.max(now);
                if now > t0 + Duration::from_secs(1) {
                    worst = worst.max(start - now);
                }
                link_free = start + wire;
                w.sent(size);
                flight.push_back((now, size, link_free + rtt));
            }
            let (sent, size, acked) = flight.pop_front().expect("in flight");
            now = acked;
            done += size;
            w.acked_at(size, sent, now);
        }
        (done as f64 / now.duration_since(t0).as_secs_f64(), worst)
    }

    #[test]
    fn a_long_link_is_filled_and_a_short_one_keeps_its_queue_short() {
        let ms = Duration::from_millis;
        // 40 MB/s at 100 ms: 4 MB in flight are needed.
        let (got, worst) = simulate(40e6, ms(100), 5.0);
        println!(
            "100 ms, 40 MB/s: {:.1} MB/s, queued at most {worst:?}",
            got / 1e6
        );
        assert!(got >= 0.8 * 40e6, "{:.1} MB/s of 40", got / 1e6);
        // 200 MB/s at 1 ms (a loopback-like link): full speed, and what waits behind the
        // file (an exec) waits about the queue time, not the 40 ms its 8 MiB would take.
        let (got, worst) = simulate(200e6, ms(1), 3.0);
        println!(
            "1 ms, 200 MB/s: {:.1} MB/s, queued at most {worst:?}",
            got / 1e6
        );
        assert!(got >= 0.9 * 200e6, "{:.1} MB/s of 200", got / 1e6);
        assert!(worst <= ms(25), "queued {worst:?}");
        // Slow links, where the floor alone queues (512 KiB take 420 ms at 10 Mbit/s): the
        // window must stay near it, not grow because the quickest delay had a queue in it.
        for (rate, rtt, most) in [(1.25e6, ms(2), ms(500)), (6.25e6, ms(20), ms(100))] {
            let (got, worst) = simulate(rate, rtt, 20.0);
            println!(
                "{rtt:?}, {:.2} MB/s: {:.2} MB/s, queued at most {worst:?}",
                rate / 1e6,
                got / 1e6
            );
            assert!(got >= 0.9 * rate, "{:.2} MB/s", got / 1e6);
            assert!(worst <= most, "queued {worst:?} at {rate} B/s");
        }
    }

    #[test]
    fn chunks_keep_two_requests_inside_the_window() {
        let mut w = Window::new(1);
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
