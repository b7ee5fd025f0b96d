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

/// The engines that count their copies (ucx and nixl leave the copy to their library).
mod copies {
    use tessera_transport::{testing::copies_are_counted, Agent, Inproc};

    #[test]
    fn inproc() {
        copies_are_counted(&|name: &str| Agent::new(name, Inproc::new()).unwrap());
    }

    #[test]
    fn shm() {
        copies_are_counted(&|name: &str| {
            Agent::new(name, tessera_transport::shm::Shm::new()).unwrap()
        });
    }

    #[test]
    fn tcp() {
        copies_are_counted(&|name: &str| {
            Agent::new(name, tessera_transport::tcp::Tcp::new()).unwrap()
        });
    }
}
