//! A `tcp` peer restarted under the same name at a new address. Its own test binary, since
//! `tcp_links` counts this process's sockets.

use tessera_transport::testing::pattern;
use tessera_transport::{tcp::Tcp, Agent, Region};

/// A peer that comes back under the same name at a new address is a new incarnation: transfers
/// go to it, even while the link to the old one still looks alive (its process may not be
/// known dead yet). Reusing the old link would write to the wrong process or fail.
#[test]
fn same_name_at_a_new_address_gets_a_new_link() {
    let a = Agent::new("a", Tcp::new()).unwrap();
    let old = Agent::new("b", Tcp::new()).unwrap();
    let ra = Region::new(1 << 16).unwrap();
    let ga = a.register(&ra).unwrap();
    ra.write_at(0, &pattern(7, 4096)).unwrap();
    let r_old = Region::new(1 << 16).unwrap();
    let g_old = old.register(&r_old).unwrap();
    let to_old = a.add_remote(&old.metadata()).unwrap();
    to_old
        .write(
            &[ga.desc(0, 4096).unwrap()],
            &[g_old.remote(0, 4096).unwrap()],
            None,
        )
        .unwrap()
        .wait()
        .unwrap();
    // The new "b" lives while the old one does: its link stays open.
    let new = Agent::new("b", Tcp::new()).unwrap();
    let r_new = Region::new(1 << 16).unwrap();
    let g_new = new.register(&r_new).unwrap();
    let to_new = a.add_remote(&new.metadata()).unwrap();
    r_old.fill(0, 4096, 0).unwrap();
    to_new
        .write(
            &[ga.desc(0, 4096).unwrap()],
            &[g_new.remote(0, 4096).unwrap()],
            None,
        )
        .unwrap()
        .wait()
        .unwrap();
    let mut got = vec![0u8; 4096];
    r_new.read_at(0, &mut got).unwrap();
    assert_eq!(
        got,
        pattern(7, 4096),
        "the write reached the new incarnation"
    );
    r_old.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "nothing reached the old one");
}
