//! Agents torn down release everything their engines took: file descriptors (sockets,
//! memfds, mappings' fds), threads and mappings. One test per binary, so nothing else runs
//! alongside and the counts are exact.

use std::time::Duration;

use tessera_transport::testing::pattern;
use tessera_transport::{shm::Shm, tcp::Tcp, Agent, Inproc, Region};

type Maker<'a> = &'a dyn Fn(&str) -> Agent;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn cycle(make: Maker<'_>) {
    let a = make("a");
    let b = make("b");
    let ra = Region::new(1 << 16).unwrap();
    let rb = Region::new(1 << 16).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    ra.write_at(0, &pattern(1, 4096)).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let b_to_a = b.add_remote(&a.metadata()).unwrap();
    a_to_b
        .write(
            &[ga.desc(0, 4096).unwrap()],
            &[gb.remote(0, 4096).unwrap()],
            Some(b"n"),
        )
        .unwrap()
        .wait()
        .unwrap();
    b_to_a
        .read(
            &[gb.desc(8192, 4096).unwrap()],
            &[ga.remote(0, 4096).unwrap()],
            None,
        )
        .unwrap()
        .wait()
        .unwrap();
    // Drop in an unhelpful order: agents first, handles after.
    drop((a, b));
    drop((a_to_b, b_to_a, ga, gb, ra, rb));
}

/// Waits for engine threads, which exit on their own after a shutdown, to be gone.
fn settle(baseline: (usize, usize)) -> (usize, usize) {
    let mut now = (0, 0);
    for _ in 0..200 {
        now = (count("/proc/self/fd"), count("/proc/self/task"));
        if now.0 <= baseline.0 && now.1 <= baseline.1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    now
}

/// The counts once the warm-up's threads have exited: the lowest seen over a short while.
fn quiet() -> (usize, usize) {
    let mut low = (usize::MAX, usize::MAX);
    for _ in 0..30 {
        low.0 = low.0.min(count("/proc/self/fd"));
        low.1 = low.1.min(count("/proc/self/task"));
        std::thread::sleep(Duration::from_millis(10));
    }
    low
}

#[test]
fn agents_release_fds_and_threads() {
    let makers: [(&str, Maker<'_>); 3] = [
        ("inproc", &|n| Agent::new(n, Inproc::new()).unwrap()),
        ("shm", &|n| Agent::new(n, Shm::new()).unwrap()),
        ("tcp", &|n| Agent::new(n, Tcp::new()).unwrap()),
    ];
    for (kind, make) in makers {
        // One warm-up cycle: lazily created process-wide state is not a leak.
        cycle(make);
        let baseline = quiet();
        for _ in 0..20 {
            cycle(make);
        }
        let after = settle(baseline);
        assert!(
            after.0 <= baseline.0 && after.1 <= baseline.1,
            "{kind}: fds {} -> {}, threads {} -> {}",
            baseline.0,
            after.0,
            baseline.1,
            after.1
        );
    }
}
