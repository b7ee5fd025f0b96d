//! The conformance suite, once per backend.

use tessera_transport::{conformance_suite, Agent, Inproc};

conformance_suite!(inproc, |name: &str| Agent::new(name, Inproc::new())
    .unwrap());
conformance_suite!(shm, |name: &str| Agent::new(
    name,
    tessera_transport::shm::Shm::new()
)
.unwrap());
conformance_suite!(tcp, |name: &str| Agent::new(
    name,
    tessera_transport::tcp::Tcp::new()
)
.unwrap());
