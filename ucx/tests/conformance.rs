//! The conformance suite on the `ucx` backend, agents in one process:
//!
//! - `ucx_tcp`: `tcp` only, peer error handling (RMA is UCX's software emulation over tcp);
//! - `ucx_shm`: `posix,cma,tcp` with peer error handling: notifications over shared memory,
//!   RMA emulated over tcp (UCX does not use cma when it must detect a peer's death);
//! - `ucx_cma`: `posix,cma` without peer error handling: one-sided puts and gets with cma
//!   (`process_vm_writev`/`readv`); a peer's death is not detected in that mode, so the two
//!   peer-death tests are ignored there, with that reason.

use tessera_transport::{conformance_suite, Agent};
use tessera_ucx::{Ucx, UcxConfig};

conformance_suite!(
    ucx_cma,
    |name: &str| {
        let mut config = UcxConfig::new(name);
        config.tls = Some("posix,cma".into());
        config.error_handling = tessera_ucx::ErrorHandling::None;
        Agent::new(name, Ucx::new(config)).unwrap()
    },
    target_checks = KeyBounds,
    peer_death = undetected
);

conformance_suite!(
    ucx_shm,
    |name: &str| {
        let mut config = UcxConfig::new(name);
        config.tls = Some("posix,cma,tcp".into());
        Agent::new(name, Ucx::new(config)).unwrap()
    },
    target_checks = KeyBounds
);

conformance_suite!(
    ucx_tcp,
    |name: &str| {
        let mut config = UcxConfig::new(name);
        config.tls = Some("tcp".into());
        Agent::new(name, Ucx::new(config)).unwrap()
    },
    target_checks = KeyBounds
);
