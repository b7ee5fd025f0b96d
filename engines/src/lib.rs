#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use tessera_transport::auth::Token;
use tessera_transport::{inproc::Inproc, shm::Shm, tcp::Tcp, Agent, AgentError};

/// An engine, by the name that configuration files, command lines and peers use for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum EngineKind {
    /// Agents in this process only ([`Inproc`]); no system library.
    Inproc,
    /// Agents on this host, through shared memory ([`Shm`]); no system library.
    Shm,
    /// Agents anywhere, over TCP ([`Tcp`]); no system library.
    Tcp,
    /// UCP one-sided puts and gets through UCX (cargo feature `ucx`).
    Ucx,
    /// A NIXL agent with its UCX backend (cargo feature `nixl`).
    Nixl,
}

impl EngineKind {
    /// Every engine, built in or not, in the order of this list.
    pub const ALL: [EngineKind; 5] = [
        EngineKind::Inproc,
        EngineKind::Shm,
        EngineKind::Tcp,
        EngineKind::Ucx,
        EngineKind::Nixl,
    ];

    /// The engine's name: `inproc`, `shm`, `tcp`, `ucx` or `nixl` (what [`Transport::kind`]
    /// of its engine answers).
    ///
    /// [`Transport::kind`]: tessera_transport::engine::Transport::kind
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Inproc => "inproc",
            EngineKind::Shm => "shm",
            EngineKind::Tcp => "tcp",
            EngineKind::Ucx => "ucx",
            EngineKind::Nixl => "nixl",
        }
    }

    /// The cargo feature of this crate that builds the engine in, for those that need a
    /// system library.
    pub fn feature(self) -> Option<&'static str> {
        match self {
            EngineKind::Ucx => Some("ucx"),
            EngineKind::Nixl => Some("nixl"),
            EngineKind::Inproc | EngineKind::Shm | EngineKind::Tcp => None,
        }
    }

    /// Whether this build has the engine.
    pub fn available(self) -> bool {
        match self {
            EngineKind::Ucx => cfg!(feature = "ucx"),
            EngineKind::Nixl => cfg!(feature = "nixl"),
            EngineKind::Inproc | EngineKind::Shm | EngineKind::Tcp => true,
        }
    }

    /// An agent named `name` on this engine with the default [`EngineOptions`].
    pub fn agent(self, name: &str) -> Result<Agent, EngineError> {
        self.agent_with(name, &EngineOptions::default())
    }

    /// An agent named `name` on this engine, configured by `options` (each engine reads the
    /// options meant for it and ignores the others). An engine this build lacks is
    /// [`EngineError::NotBuilt`]; never another engine instead.
    pub fn agent_with(self, name: &str, options: &EngineOptions) -> Result<Agent, EngineError> {
        let agent = match self {
            EngineKind::Inproc => Agent::new(name, Inproc::new()),
            EngineKind::Shm => {
                let shm = Shm::new();
                match options.token.clone() {
                    Some(t) => Agent::new(name, shm.with_token(t)),
                    None => Agent::new(name, shm),
                }
            }
            EngineKind::Tcp => {
                let tcp = match options.tcp_bind {
                    Some(addr) => Tcp::bind(addr),
                    None => Tcp::new(),
                };
                // Without a token, `Tcp` refuses to start off loopback, saying why.
                match options.token.clone() {
                    Some(t) => Agent::new(name, tcp.with_token(t)),
                    None => Agent::new(name, tcp),
                }
            }
            EngineKind::Ucx => return ucx_agent(name, options),
            EngineKind::Nixl => return nixl_agent(name, options),
        };
        Ok(agent?)
    }
}

/// `shm`: processes of one host, no system library.
impl Default for EngineKind {
    fn default() -> Self {
        EngineKind::Shm
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineKind {
    type Err = UnknownEngine;

    /// One of the names [`EngineKind::name`] gives; the engine need not be built in.
    fn from_str(s: &str) -> Result<Self, UnknownEngine> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownEngine(s.to_owned()))
    }
}

/// What the engines take besides the agent's name. [`Default`]: what each engine's own
/// default constructor does.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// `tcp`: the address to listen on (default 127.0.0.1 at a port the OS picks). `shm`,
    /// `ucx` and `nixl` take no address: UCX picks its interfaces from `UCX_NET_DEVICES`.
    pub tcp_bind: Option<SocketAddr>,
    /// `ucx`: the transports (`UCX_TLS` syntax); `None` leaves them to the environment.
    pub ucx_tls: Option<String>,
    /// `ucx`: detect a peer's death (`UCP_ERR_HANDLING_MODE_PEER`, the default). Without it
    /// UCX can use one-sided cma, but a dead peer is not noticed.
    pub ucx_peer_errors: bool,
    /// `shm` and `tcp`: the shared token peers must prove they hold before anything else
    /// on a connection (see tessera-transport's trust model). `None` (the default): `shm`
    /// serves only processes of this user, and `tcp` only binds loopback addresses, serving
    /// only this user's processes; a non-loopback `tcp_bind` without a token is an error.
    /// `inproc`, `ucx` and `nixl` ignore it.
    pub token: Option<Token>,
}

impl EngineOptions {
    /// These options with `token` (see [`EngineOptions::token`]).
    pub fn with_token(mut self, token: Token) -> Self {
        self.token = Some(token);
        self
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            tcp_bind: None,
            ucx_tls: None,
            ucx_peer_errors: true,
            token: None,
        }
    }
}

/// A name that is none of [`EngineKind`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine {0:?}: expected inproc, shm, tcp, ucx or nixl")]
pub struct UnknownEngine(pub String);

/// Why [`EngineKind::agent`] made no agent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The engine needs a cargo feature this build lacks.
    #[error(
        "this build lacks the {kind} engine: build with the cargo feature `{feature}` \
         (its libraries come from `cargo xtask deps`)"
    )]
    NotBuilt {
        /// The engine asked for.
        kind: EngineKind,
        /// The feature that builds it in.
        feature: &'static str,
    },
    /// The agent did not start.
    #[error(transparent)]
    Agent(#[from] AgentError),
}

#[cfg(feature = "ucx")]
fn ucx_agent(name: &str, options: &EngineOptions) -> Result<Agent, EngineError> {
    use tessera_ucx::{ErrorHandling, Ucx, UcxConfig};
    let mut config = UcxConfig::new(name);
    config.tls.clone_from(&options.ucx_tls);
    if !options.ucx_peer_errors {
        config.error_handling = ErrorHandling::None;
    }
    Ok(Agent::new(name, Ucx::new(config))?)
}

#[cfg(not(feature = "ucx"))]
fn ucx_agent(_: &str, _: &EngineOptions) -> Result<Agent, EngineError> {
    Err(not_built(EngineKind::Ucx))
}

#[cfg(feature = "nixl")]
fn nixl_agent(name: &str, _: &EngineOptions) -> Result<Agent, EngineError> {
    use tessera_nixl::{Nixl, NixlConfig};
    Ok(Agent::new(name, Nixl::new(NixlConfig::new(name)))?)
}

#[cfg(not(feature = "nixl"))]
fn nixl_agent(_: &str, _: &EngineOptions) -> Result<Agent, EngineError> {
    Err(not_built(EngineKind::Nixl))
}

#[cfg(not(all(feature = "ucx", feature = "nixl")))]
fn not_built(kind: EngineKind) -> EngineError {
    EngineError::NotBuilt {
        kind,
        feature: kind.feature().unwrap_or(kind.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in EngineKind::ALL {
            assert_eq!(k.to_string().parse::<EngineKind>(), Ok(k));
        }
        assert_eq!(
            "rdma".parse::<EngineKind>(),
            Err(UnknownEngine("rdma".into()))
        );
        assert!("UCX".parse::<EngineKind>().is_err());
    }

    #[test]
    fn engines_without_a_library_make_agents() {
        for k in [EngineKind::Inproc, EngineKind::Shm, EngineKind::Tcp] {
            let agent = k.agent("a").unwrap();
            assert_eq!(agent.kind(), k.name());
        }
        let options = EngineOptions {
            tcp_bind: Some("127.0.0.1:0".parse().unwrap()),
            ..EngineOptions::default()
        };
        assert_eq!(
            EngineKind::Tcp.agent_with("b", &options).unwrap().kind(),
            "tcp"
        );
    }

    /// `tcp` off loopback needs a token; with one it starts, and `shm` takes one too.
    #[test]
    fn tcp_off_loopback_needs_a_token() {
        let options = EngineOptions {
            tcp_bind: Some("0.0.0.0:0".parse().unwrap()),
            ..EngineOptions::default()
        };
        let err = EngineKind::Tcp.agent_with("c", &options).unwrap_err();
        assert!(err.to_string().contains("without a token"), "{err}");
        let options = options.with_token(Token::new("t").unwrap());
        assert_eq!(
            EngineKind::Tcp.agent_with("d", &options).unwrap().kind(),
            "tcp"
        );
        assert_eq!(
            EngineKind::Shm.agent_with("e", &options).unwrap().kind(),
            "shm"
        );
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_uses_the_names() {
        for k in EngineKind::ALL {
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{k}\""));
            assert_eq!(serde_json::from_str::<EngineKind>(&json).unwrap(), k);
        }
        assert!(serde_json::from_str::<EngineKind>("\"rdma\"").is_err());
    }

    /// Without its feature, an engine is refused naming the feature, never replaced.
    #[test]
    fn an_engine_not_built_in_is_refused_naming_its_feature() {
        for k in [EngineKind::Ucx, EngineKind::Nixl] {
            if k.available() {
                continue;
            }
            let err = k.agent("a").unwrap_err();
            assert!(matches!(err, EngineError::NotBuilt { kind, .. } if kind == k));
            assert!(
                err.to_string()
                    .contains(&format!("cargo feature `{}`", k.name())),
                "{err}"
            );
        }
    }
}
