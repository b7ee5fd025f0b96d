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

/// The same suite with every shm and tcp agent holding one token.
fn token() -> tessera_transport::auth::Token {
    tessera_transport::auth::Token::new("conformance").unwrap()
}
conformance_suite!(shm_token, |name: &str| Agent::new(
    name,
    tessera_transport::shm::Shm::new().with_token(token())
)
.unwrap());
conformance_suite!(tcp_token, |name: &str| Agent::new(
    name,
    tessera_transport::tcp::Tcp::new().with_token(token())
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
