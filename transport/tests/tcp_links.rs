//! Two `tcp` agents that transfer in both directions share one connection.

use tessera_transport::testing::pattern;
use tessera_transport::{tcp::Tcp, Agent, Region};

/// This process's established TCP sockets (both ends of an in-process connection count).
fn established() -> usize {
    let ours: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| {
            let t = t.to_string_lossy().into_owned();
            Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 9 && f[3] == "01" && ours.contains(f[9])
        })
        .count()
}

#[test]
fn one_connection_per_pair_of_agents() {
    let a = Agent::new("a", Tcp::new()).unwrap();
    let b = Agent::new("b", Tcp::new()).unwrap();
    let ra = Region::new(1 << 16).unwrap();
    let rb = Region::new(1 << 16).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    ra.write_at(0, &pattern(1, 4096)).unwrap();
    rb.write_at(8192, &pattern(2, 4096)).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let b_to_a = b.add_remote(&a.metadata()).unwrap();
    for _ in 0..3 {
        a_to_b
            .write(
                &[ga.desc(0, 4096).unwrap()],
                &[gb.remote(0, 4096).unwrap()],
                None,
            )
            .unwrap()
            .wait()
            .unwrap();
        b_to_a
            .write(
                &[gb.desc(8192, 4096).unwrap()],
                &[ga.remote(8192, 4096).unwrap()],
                Some(b"x"),
            )
            .unwrap()
            .wait()
            .unwrap();
        b_to_a
            .read(
                &[gb.desc(16384, 4096).unwrap()],
                &[ga.remote(0, 4096).unwrap()],
                None,
            )
            .unwrap()
            .wait()
            .unwrap();
    }
    let mut got = vec![0u8; 4096];
    ra.read_at(8192, &mut got).unwrap();
    assert_eq!(got, pattern(2, 4096));
    rb.read_at(16384, &mut got).unwrap();
    assert_eq!(got, pattern(1, 4096));
    // Both ends of one connection live in this process.
    assert_eq!(established(), 2, "one connection between a and b");
}
