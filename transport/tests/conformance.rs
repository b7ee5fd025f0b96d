//! The conformance suite, once per backend.

use tessera_transport::{conformance_suite, Agent, Inproc};

conformance_suite!(inproc, |name: &str| Agent::new(name, Inproc::new())
    .unwrap());
