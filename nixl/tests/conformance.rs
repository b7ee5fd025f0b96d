//! The conformance suite on the `nixl` backend, agents in one process (NIXL's UCX backend with
//! its default transports and peer error handling).

use tessera_nixl::{Nixl, NixlConfig};
use tessera_transport::{conformance_suite, Agent};

conformance_suite!(
    nixl,
    |name: &str| Agent::new(name, Nixl::new(NixlConfig::new(name))).unwrap(),
    target_checks = KeyBounds
);
