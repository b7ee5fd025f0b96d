//! The conformance suite every backend passes, instantiated per backend by
//! [`conformance_suite!`](crate::conformance_suite).
//!
//! Each function takes a factory that makes a fresh agent of the backend under test, so that
//! engines added later (UCX, NIXL) run the same tests from their own test binaries:
//!
//! ```ignore
//! tessera_transport::conformance_suite!(ucx, |name: &str| {
//!     tessera_transport::Agent::new(name, my_ucx::Ucx::new().unwrap()).unwrap()
//! });
//! ```
//!
//! The functions panic on failure, as tests do; they are not meant for production code.

use std::collections::HashMap;
use std::time::Duration;

use crate::{Agent, Op, Peer, Region, Registration, RemoteDesc, TransferError};

mod transfers;
pub use transfers::*;
mod faults;
mod lifecycle;
pub mod raw;
pub use faults::{Fault, Faults, Faulty};
pub use lifecycle::*;

/// Makes a fresh agent of the backend under test.
pub type Factory<'a> = &'a dyn Fn(&str) -> Agent;

/// Generous bound on how long any one transfer may take before a test calls it a hang: 120 s,
/// or `TESSERA_TEST_HANG_GUARD_SECS` when set. It guards against hangs only; no test asserts
/// speed.
///
/// Mutation runs set it low, so that a mutant that hangs transfers fails its tests within
/// their time limit; and then a failing test ends its process at once (exit status 101, after
/// the panic's message), since unwinding would drop agents that wait for the very transfers
/// the mutant hung.
pub fn hang_guard() -> Duration {
    static GUARD: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *GUARD.get_or_init(|| {
        match std::env::var("TESSERA_TEST_HANG_GUARD_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
        {
            Some(secs) => {
                let report = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    report(info);
                    std::process::exit(101);
                }));
                Duration::from_secs(secs)
            }
            None => Duration::from_secs(120),
        }
    })
}

/// Runs `f` on a thread of its own and returns what it returns, or, when it has not within
/// [`hang_guard`], runs `before_exit` (to stop helper processes) and ends the test process
/// with a failure: for a test of a call that a hung engine would block (a post that waits for
/// a lock its progress thread holds), whose engine could then not be dropped either.
pub fn finish_or_exit<T: Send>(
    what: &str,
    f: impl FnOnce() -> T + Send,
    before_exit: impl FnOnce(),
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(hang_guard()) {
            Ok(v) => v,
            Err(_) => {
                before_exit();
                eprintln!("{what}: not finished within {:?}", hang_guard());
                std::process::exit(1);
            }
        }
    })
}

/// Sends `signal` (`STOP`, `CONT`, ...) to `child`, through `kill(1)`.
pub fn signal(child: &std::process::Child, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -{signal} {} failed", child.id());
}

/// Instantiates the conformance suite as a module of `#[test]`s for one backend.
///
/// `$make` is an expression of type `Fn(&str) -> Agent`. The test over 4 GiB moves 4 GiB of
/// memory and is `#[ignore]`d: run it by name (`big_transfer_over_4gib`).
///
/// One-sided engines, whose targets never see a request, say so with a third argument,
/// `target_checks = KeyBounds` (see [`TargetChecks`]); the default is `Requests`. A
/// configuration that cannot notice a peer's death (UCX without peer error handling, as used
/// for cma) adds `peer_death = undetected`: its two peer-death tests are then `#[ignore]`d,
/// with that reason, rather than left to hang.
#[macro_export]
macro_rules! conformance_suite {
    ($module:ident, $make:expr) => {
        $crate::conformance_suite!($module, $make, target_checks = Requests);
    };
    ($module:ident, $make:expr, target_checks = $checks:ident) => {
        $crate::conformance_suite!(@suite $module, $make, $checks, allow(unused));
    };
    ($module:ident, $make:expr, target_checks = $checks:ident, peer_death = undetected) => {
        $crate::conformance_suite!(
            @suite $module,
            $make,
            $checks,
            ignore = "this configuration cannot detect a peer's death (UCX error handling mode none)"
        );
    };
    (@suite $module:ident, $make:expr, $checks:ident, $peer_death:meta) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            fn make(name: &str) -> $crate::Agent {
                let f = $make;
                f(name)
            }

            #[test]
            fn write_then_read() {
                $crate::testing::write_then_read(&make);
            }
            #[test]
            fn large_unaligned() {
                $crate::testing::large_unaligned(&make);
            }
            #[test]
            fn scatter_gather_1000() {
                $crate::testing::scatter_gather_1000(&make);
            }
            #[test]
            fn across_registrations() {
                $crate::testing::across_registrations(&make);
            }
            #[test]
            fn notifications() {
                $crate::testing::notifications(&make);
            }
            #[test]
            fn coalescing_and_prepared() {
                $crate::testing::coalescing_and_prepared(&make);
            }
            #[test]
            fn unregistered_sources() {
                $crate::testing::unregistered_sources(&make);
            }
            #[test]
            fn out_of_range_initiator() {
                $crate::testing::out_of_range_initiator(&make);
            }
            #[test]
            fn out_of_range_target() {
                $crate::testing::out_of_range_target_with(
                    &make,
                    $crate::testing::TargetChecks::$checks,
                );
            }
            #[test]
            #[$peer_death]
            fn peer_death() {
                $crate::testing::peer_death(&make);
            }
            #[test]
            fn sparse_windows_above_4gib() {
                $crate::testing::sparse_windows_above_4gib(&make);
            }
            #[test]
            #[ignore = "moves 4 GiB; run by name"]
            fn big_transfer_over_4gib() {
                $crate::testing::big_transfer_over_4gib(&make);
            }
            #[test]
            fn concurrent_threads() {
                $crate::testing::concurrent_threads(&make);
            }
            #[test]
            fn concurrent_tasks() {
                $crate::testing::concurrent_tasks(&make);
            }
            #[test]
            fn sub_range_registrations() {
                $crate::testing::sub_range_registrations(&make);
            }
            #[test]
            fn crossing_transfers() {
                $crate::testing::crossing_transfers(&make);
            }
            #[test]
            #[$peer_death]
            fn restarted_peer() {
                $crate::testing::restarted_peer(&make);
            }
            #[test]
            fn metadata_update() {
                $crate::testing::metadata_update(&make);
            }
            #[test]
            fn target_drops_its_handle() {
                $crate::testing::target_drops_its_handle(&make);
            }
            #[test]
            fn registration_cache_and_deferred_release() {
                $crate::testing::registration_cache_and_deferred_release(&make);
            }
            #[test]
            fn local_only_registrations() {
                $crate::testing::local_only_registrations(&make);
            }
        }
    };
}

/// The target agent of a case that also runs with the target in a second process: the
/// cases written against it (`*_with`) are the same code in one process ([`LocalTarget`]) and
/// across two (the transport's tests drive `tessera-transport-peer` through it).
pub trait Target {
    /// The target agent's name.
    fn name(&self) -> String;
    /// Its metadata now.
    fn metadata(&mut self) -> Vec<u8>;
    /// Registers a fresh zeroed region of `len` bytes; returns the registration id.
    fn register(&mut self, len: u64) -> u64;
    /// Writes `data` into its registration `reg` at `offset` (its own memory, no transfer).
    fn write_at(&mut self, reg: u64, offset: u64, data: &[u8]);
    /// Reads `len` bytes of its registration `reg` at `offset`.
    fn read_at(&mut self, reg: u64, offset: u64, len: u64) -> Vec<u8>;
    /// Adds the initiator's metadata: the target's handle on the initiator.
    fn add_remote(&mut self, metadata: &[u8]);
    /// The next notification `(from, message)`, waiting up to [`hang_guard`].
    fn wait_notification(&mut self) -> Option<(String, Vec<u8>)>;
    /// The next notification, without waiting.
    fn try_notification(&mut self) -> Option<(String, Vec<u8>)>;
    /// A transfer by the target between its registration `local` and the initiator's
    /// registration `remote`, waited for.
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &mut self,
        op: Op,
        local: u64,
        local_offset: u64,
        remote: u64,
        remote_offset: u64,
        len: u64,
        notify: Option<&[u8]>,
    ) -> Result<(), TargetError>;
}

/// Why a [`Target`]'s own transfer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TargetError {
    /// In this process: the transfer's error.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// In this process: a descriptor of the target's own registration was refused.
    #[error(transparent)]
    Desc(#[from] crate::DescError),
    /// The target has no handle on the initiator yet ([`Target::add_remote`] first).
    #[error("the target has no handle on the initiator")]
    NoPeer,
    /// In another process: the error line it answered.
    #[error("the target process answered: {0}")]
    Remote(String),
}

/// A [`Target`] agent in this process.
pub struct LocalTarget {
    agent: Agent,
    regs: HashMap<u64, Registration>,
    peer: Option<Peer>,
}

impl LocalTarget {
    /// Wraps `agent`.
    pub fn new(agent: Agent) -> Self {
        Self {
            agent,
            regs: HashMap::new(),
            peer: None,
        }
    }
}

impl Target for LocalTarget {
    fn name(&self) -> String {
        self.agent.name().to_owned()
    }

    fn metadata(&mut self) -> Vec<u8> {
        self.agent.metadata()
    }

    fn register(&mut self, len: u64) -> u64 {
        let g = self
            .agent
            .register(&Region::new(len).expect("region"))
            .expect("register");
        let id = g.id();
        self.regs.insert(id, g);
        id
    }

    fn write_at(&mut self, reg: u64, offset: u64, data: &[u8]) {
        let g = &self.regs[&reg];
        g.region()
            .write_at(g.offset_in_registration() + offset, data)
            .expect("write inside the registration");
    }

    fn read_at(&mut self, reg: u64, offset: u64, len: u64) -> Vec<u8> {
        let g = &self.regs[&reg];
        read(
            g.region(),
            g.offset_in_registration() + offset,
            len as usize,
        )
    }

    fn add_remote(&mut self, metadata: &[u8]) {
        self.peer = Some(
            self.agent
                .add_remote(metadata)
                .expect("target adds initiator"),
        );
    }

    fn wait_notification(&mut self) -> Option<(String, Vec<u8>)> {
        self.agent
            .wait_notification(hang_guard())
            .map(|n| (n.from, n.msg))
    }

    fn try_notification(&mut self) -> Option<(String, Vec<u8>)> {
        self.agent.try_notification().map(|n| (n.from, n.msg))
    }

    fn transfer(
        &mut self,
        op: Op,
        local: u64,
        local_offset: u64,
        remote: u64,
        remote_offset: u64,
        len: u64,
        notify: Option<&[u8]>,
    ) -> Result<(), TargetError> {
        let peer = self.peer.as_ref().ok_or(TargetError::NoPeer)?;
        let l = [self.regs[&local].desc(local_offset, len)?];
        let r = [RemoteDesc::new(remote, remote_offset, len)];
        let t = match op {
            Op::Write => peer.write(&l, &r, notify),
            Op::Read => peer.read(&l, &r, notify),
        }?;
        Ok(finish(t)?)
    }
}

/// Runs a `*_with` case in one process: `agent-a` from `make` and `agent-b` as its target.
pub fn with_local_target(make: Factory<'_>, case: fn(&Agent, &mut dyn Target)) {
    let a = make("agent-a");
    let mut b = LocalTarget::new(make("agent-b"));
    case(&a, &mut b);
}

/// A byte pattern that differs per position and per seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn read(region: &Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    region
        .read_at(offset, &mut out)
        .expect("read inside the region");
    out
}

/// Two agents that know each other: (a, b, a's handle on b, b's handle on a).
pub fn pair(make: Factory<'_>) -> (Agent, Agent, Peer, Peer) {
    let a = make("agent-a");
    let b = make("agent-b");
    let (a_to_b, b_to_a) = connect(&a, &b);
    (a, b, a_to_b, b_to_a)
}

/// Exchanges metadata both ways.
pub fn connect(a: &Agent, b: &Agent) -> (Peer, Peer) {
    let a_to_b = a.add_remote(&b.metadata()).expect("a adds b");
    let b_to_a = b.add_remote(&a.metadata()).expect("b adds a");
    (a_to_b, b_to_a)
}

fn finish(t: crate::Transfer) -> Result<(), TransferError> {
    match t.wait_timeout(hang_guard()) {
        Err(TransferError::Timeout { .. }) => panic!("transfer hung past {:?}", hang_guard()),
        other => other,
    }
}
