//! Timing helpers: best of several runs, since the machine is shared and noisy.

use std::time::{Duration, Instant};

/// Runs `f` `runs` times and returns the shortest wall time. `f` gets the run index and may
/// do untimed setup by returning it from `setup`.
pub fn best_of<S, T>(
    runs: usize,
    mut setup: impl FnMut() -> S,
    mut f: impl FnMut(S) -> T,
) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..runs {
        let input = setup();
        let start = Instant::now();
        let out = f(input);
        let elapsed = start.elapsed();
        std::hint::black_box(out);
        best = best.min(elapsed);
    }
    best
}

/// Nanoseconds as f64.
pub fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

/// Microseconds as f64.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
