//! Sessions and quarantine: a session's state (Hello said, failed), the blocks a late WRITE
//! of its client could still reach, and what closed sessions exposed until their clients'
//! transfers are torn down.
//!
//! Invariant kept here: `quarantined` is the sum of the lengths of every quarantined block,
//! of open and of closed sessions.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::{Memory, PartitionStats, SessionId, TornDown, Unit};

/// Which kind of request a session's state is checked for.
#[derive(Clone, Copy)]
pub(super) enum Step {
    Hello,
    Auth,
    Other,
}
use crate::error::ErrorKind;

#[derive(PartialEq, Eq)]
pub(super) enum SessionState {
    /// Waiting for `Hello`.
    New,
    /// `Challenge` sent; waiting for the client's proof.
    Challenged(Box<Handshake>),
    /// Authenticated; the driver connects to the client's agent.
    Accepting,
    Open,
    Failed,
}

/// What a session's handshake said, for the client's proof to cover.
#[derive(PartialEq, Eq)]
pub(super) struct Handshake {
    pub(super) client_nonce: Vec<u8>,
    pub(super) unit_nonce: Vec<u8>,
    pub(super) agent: Vec<u8>,
}

/// A quarantined block: the block (kept only so that it is not reused), its length and its
/// partition.
pub(super) type Quarantined = (Box<dyn Send + Sync>, u64, String);

struct Session {
    state: SessionState,
    /// Blocks that a late WRITE could still reach, until the session is torn down (their
    /// bytes are charged to its peer in `Sessions::by_peer`).
    quarantine: Vec<Quarantined>,
    /// The name of the client's agent, once the driver connected to it: what its pushed PUTs'
    /// blocks are exposed to.
    peer: String,
}

/// What a closed session exposed, quarantined until its client's transfers are torn down.
struct Closed {
    quarantine: Vec<Quarantined>,
    deadline: Option<Instant>,
    /// The session's agent, still charged for these blocks.
    peer: String,
}

/// Open sessions, closed ones whose blocks are still quarantined, and the bytes quarantined.
#[derive(Default)]
pub(super) struct Sessions {
    open: HashMap<SessionId, Session>,
    closed: HashMap<SessionId, Closed>,
    quarantined: u64,
    /// Open sessions whose agent the driver connected to (a peer name set): those that may
    /// hold credits.
    ready: usize,
    /// Bytes quarantined per agent name, over its open and closed sessions: a client that
    /// reconnects keeps what its earlier sessions left quarantined.
    by_peer: HashMap<String, u64>,
}

impl Sessions {
    /// The state of open session `session`.
    pub(super) fn state(&self, session: SessionId) -> Option<&SessionState> {
        self.open.get(&session).map(|s| &s.state)
    }

    /// The name of the session's agent (empty before the driver connected to it).
    pub(super) fn peer(&self, session: SessionId) -> &str {
        self.open.get(&session).map_or("", |s| s.peer.as_str())
    }

    /// Open sessions.
    pub(super) fn len(&self) -> usize {
        self.open.len()
    }

    /// Open sessions whose agent the driver connected to ([`Unit::session_ready`]).
    pub(super) fn ready(&self) -> usize {
        self.ready
    }

    /// Bytes quarantined, of open and closed sessions.
    pub(super) fn quarantined(&self) -> u64 {
        self.quarantined
    }

    /// Bytes quarantined for the agent of open session `session`, over all its sessions.
    pub(super) fn session_quarantined(&self, session: SessionId) -> u64 {
        let Some(s) = self.open.get(&session) else {
            return 0;
        };
        self.by_peer.get(&s.peer).copied().unwrap_or(0)
    }

    fn charge(&mut self, peer: &str, bytes: u64) {
        if bytes > 0 {
            *self.by_peer.entry(peer.to_owned()).or_default() += bytes;
        }
    }

    fn discharge(&mut self, peer: &str, bytes: u64) {
        if let Some(n) = self.by_peer.get_mut(peer) {
            *n = n.saturating_sub(bytes);
            if *n == 0 {
                self.by_peer.remove(peer);
            }
        }
    }

    pub(super) fn set_state(&mut self, session: SessionId, state: SessionState) {
        if let Some(s) = self.open.get_mut(&session) {
            s.state = state;
        }
    }

    /// Takes the handshake of a challenged session (it is then `Accepting` until the proof is
    /// checked and the state set again).
    pub(super) fn take_handshake(&mut self, session: SessionId) -> Option<Handshake> {
        let s = self.open.get_mut(&session)?;
        match std::mem::replace(&mut s.state, SessionState::Accepting) {
            SessionState::Challenged(h) => Some(*h),
            other => {
                s.state = other;
                None
            }
        }
    }

    fn fail(&mut self, session: SessionId) {
        if let Some(s) = self.open.get_mut(&session) {
            s.state = SessionState::Failed;
        }
    }

    /// Quarantines `block` (`len` bytes of `partition`) with open session `session`, until it
    /// is torn down. Without such a session the block just drops.
    pub(super) fn quarantine(
        &mut self,
        session: SessionId,
        block: Box<dyn Send + Sync>,
        len: u64,
        partition: String,
    ) {
        if let Some(s) = self.open.get_mut(&session) {
            self.quarantined += len;
            s.quarantine.push((block, len, partition));
            let peer = s.peer.clone();
            self.charge(&peer, len);
        }
    }

    /// Ends open session `session`: its quarantine and `exposed` (the blocks its prepared
    /// PUTs exposed) stay quarantined until `deadline`, or until `release_closed` when there is
    /// none.
    fn close(
        &mut self,
        session: SessionId,
        exposed: Vec<Quarantined>,
        how: TornDown,
        deadline: Option<Instant>,
    ) {
        let (mut quarantine, peer) = self
            .open
            .remove(&session)
            .map(|s| (s.quarantine, s.peer))
            .unwrap_or_default();
        if !peer.is_empty() {
            self.ready -= 1;
        }
        let exposed_bytes = exposed.iter().map(|q| q.1).sum::<u64>();
        self.quarantined += exposed_bytes;
        self.charge(&peer, exposed_bytes);
        quarantine.extend(exposed);
        if quarantine.is_empty() {
            return;
        }
        tracing::debug!(
            session,
            blocks = quarantine.len(),
            ?how,
            "closed session's exposed blocks stay quarantined"
        );
        self.closed.insert(
            session,
            Closed {
                quarantine,
                deadline,
                peer,
            },
        );
    }

    fn release_closed(&mut self, session: SessionId) -> u64 {
        let Some(c) = self.closed.remove(&session) else {
            return 0;
        };
        let bytes: u64 = c.quarantine.iter().map(|q| q.1).sum();
        self.quarantined -= bytes;
        self.discharge(&c.peer, bytes);
        bytes
    }

    /// The earliest late-write grace of a closed session.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.closed.values().filter_map(|c| c.deadline).min()
    }

    /// Releases the closed sessions whose late-write grace is over at `now`.
    pub(super) fn expire(&mut self, now: Instant) {
        let graced: Vec<_> = self
            .closed
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(s, _)| *s)
            .collect();
        for session in graced {
            let bytes = self.release_closed(session);
            tracing::debug!(session, bytes, "late-write grace over; quarantine released");
        }
    }

    /// Quarantined bytes per partition, into `per`.
    pub(super) fn partition_stats<'a>(&'a self, per: &mut BTreeMap<&'a str, PartitionStats>) {
        let open = self.open.values().map(|s| &s.quarantine);
        for q in open.chain(self.closed.values().map(|c| &c.quarantine)) {
            // A credit belongs to no partition: it counts in the unit's total only.
            for (_, len, part) in q.iter().filter(|(_, _, part)| !part.is_empty()) {
                per.entry(part).or_default().quarantined_bytes += len;
            }
        }
    }

    /// Drops every session and quarantine (teardown).
    pub(super) fn clear(&mut self) {
        self.open.clear();
        self.closed.clear();
        self.quarantined = 0;
        self.ready = 0;
        self.by_peer.clear();
    }
}

impl<M: Memory> Unit<M> {
    /// A new connection arrived as `session`; it must say Hello first.
    pub fn open_session(&mut self, session: SessionId) {
        let replaced = self.sessions.open.insert(
            session,
            Session {
                state: SessionState::New,
                quarantine: Vec::new(),
                peer: String::new(),
            },
        );
        // Ids are not reused; were one, the count of ready sessions stays true.
        if replaced.is_some_and(|s| !s.peer.is_empty()) {
            self.sessions.ready -= 1;
        }
    }

    /// The driver connected to the session's agent, named `peer` (after
    /// [`Output::Accept`](super::Output)); it may now use the payload plane.
    pub fn session_ready(&mut self, session: SessionId, peer: &str) {
        if let Some(s) = self.sessions.open.get_mut(&session) {
            if s.state == SessionState::Accepting {
                s.state = SessionState::Open;
                if s.peer.is_empty() && !peer.is_empty() {
                    self.sessions.ready += 1;
                }
                s.peer = peer.to_owned();
            }
        }
    }

    /// Whether `session` is open and authenticated (its Hello's proof checked).
    pub fn authenticated(&self, session: SessionId) -> bool {
        matches!(
            self.sessions.state(session),
            Some(SessionState::Accepting | SessionState::Open | SessionState::Failed)
        )
    }

    /// Marks a session failed: every later request is refused until it reconnects.
    pub fn fail_session(&mut self, session: SessionId) {
        self.sessions.fail(session);
    }

    /// The session's control connection is gone. Its pending GETs are dropped, and its pulled
    /// PUTs still being read released (their blocks were never exposed). Its prepared pushed
    /// PUTs (each answered READY: their blocks were exposed) and its quarantine stay
    /// quarantined, since the client's WRITEs travel on the payload plane and may still land:
    /// until [`Unit::release_closed`] when `how` is [`TornDown::Signalled`], or until
    /// `late_write_grace` from `now` ([`Unit::handle_timeout`]) when it is [`TornDown::Grace`].
    pub fn close_session(&mut self, session: SessionId, now: Instant, how: TornDown) {
        self.gets.close_session(session);
        // Every pushed PUT was answered READY in the step that prepared it: all exposed. A
        // pulled PUT's block was never shown to the client; its READ (if in flight) keeps the
        // block's memory itself, so the core releases it (dropping it).
        let mut exposed: Vec<Quarantined> = self
            .puts
            .take_session(session)
            .into_iter()
            .filter(|p| !p.reading)
            .map(|p| p.into_quarantined())
            .collect();
        // Its credits were exposed from the start.
        exposed.extend(self.close_credits(session));
        let deadline = match how {
            TornDown::Signalled => None,
            TornDown::Grace => Some(now + self.cfg.late_write_grace),
        };
        self.sessions.close(session, exposed, how, deadline);
    }

    /// Closed sessions whose exposed blocks are still quarantined.
    pub fn closed_sessions(&self) -> Vec<SessionId> {
        self.sessions.closed.keys().copied().collect()
    }

    /// The client of closed session `session` can no longer write (its link is torn down):
    /// its quarantined blocks go back to the pool. Returns the bytes released.
    pub fn release_closed(&mut self, session: SessionId) -> u64 {
        self.sessions.release_closed(session)
    }

    /// Why a request of `session` (a Hello or not) is refused in the session's state, if it
    /// is: Hello first and once, nothing after the session failed.
    pub(super) fn refused_by_state(
        &self,
        session: SessionId,
        step: Step,
    ) -> Option<(ErrorKind, &'static str)> {
        let Some(state) = self.sessions.state(session) else {
            return Some((ErrorKind::NoSession, "unknown session"));
        };
        match (step, state) {
            (Step::Hello, SessionState::New) => None,
            (Step::Hello, _) => Some((ErrorKind::BadRequest, "second Hello")),
            (Step::Auth, SessionState::Challenged(_)) => None,
            (Step::Auth, _) => Some((ErrorKind::BadRequest, "Auth out of turn")),
            (Step::Other, SessionState::New | SessionState::Challenged(_)) => {
                Some((ErrorKind::NoSession, "say Hello first"))
            }
            (Step::Other, SessionState::Accepting) => {
                Some((ErrorKind::NoSession, "the session is not open yet"))
            }
            (Step::Other, SessionState::Failed) => {
                Some((ErrorKind::PeerFailed, "session failed; reconnect"))
            }
            (Step::Other, SessionState::Open) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use serde_bytes::ByteBuf;
    use tessera_framecodec::{Tensor, Value};

    use crate::core::{Output, TornDown, Unit, UnitConfig};
    use crate::proto::{Request, Response};
    use crate::testing::{handshake, VecMem};

    /// Opens session `session` of agent `peer` and, when `quarantine`, leaves a block of it
    /// quarantined (a prepared PUT cancelled after its exposure).
    fn session(unit: &mut Unit<VecMem>, now: Instant, session: u64, peer: &str, quarantine: bool) {
        unit.open_session(session);
        let out = handshake::open(unit, now, session, 0, vec![], None);
        assert!(matches!(out[..], [Output::Accept { .. }]));
        unit.session_ready(session, peer);
        if !quarantine {
            return;
        }
        let t = Tensor::from_slice(&[256], &[0u8; 256]).unwrap();
        let v = Value::List(vec![Value::List(vec![Value::Tensor(t)])]);
        let frames = tessera_framecodec::encode(&v).unwrap();
        let put = Request::Put {
            partition: "p".into(),
            indexes: vec![1],
            fields: vec!["x".into()],
            meta: ByteBuf::from(frames.meta.to_vec()),
            inline: None,
            pull: None,
        };
        let out = unit.handle(now, session, 1, put);
        assert!(matches!(
            out[..],
            [Output::Reply {
                response: Response::PutReady { .. },
                ..
            }]
        ));
        let cancel = Request::Cancel {
            of: 1,
            maybe_written: true,
        };
        assert_eq!(unit.handle(now, session, 2, cancel).len(), 1);
    }

    /// The per-agent quarantine charges hold an entry only for agents that have bytes in
    /// quarantine: clients that come and go, leaving nothing behind or once what they left is
    /// released, do not grow the unit's state.
    #[test]
    fn per_agent_charges_do_not_outlive_the_quarantine() {
        // A plain test without the loom cfg; under it, one model (VecMem's counters are loom's).
        tessera_sync::model(|| {
            let inline = UnitConfig {
                inline_max: 16,
                ..UnitConfig::default()
            };
            let mut unit = Unit::new(inline, VecMem::new(u64::MAX));
            let now = Instant::now();
            for s in 1..=3 {
                session(&mut unit, now, s, &format!("agent-{s}"), false);
                unit.close_session(s, now, TornDown::Signalled);
            }
            assert!(
                unit.sessions.by_peer.is_empty(),
                "{:?}",
                unit.sessions.by_peer
            );
            session(&mut unit, now, 4, "kept", true);
            session(&mut unit, now, 5, "kept", true);
            let held = unit.stats().quarantined_bytes;
            assert!(held > 0);
            assert_eq!(unit.sessions.by_peer.get("kept"), Some(&held));
            unit.close_session(4, now, TornDown::Signalled);
            unit.close_session(5, now, TornDown::Signalled);
            assert_eq!(unit.release_closed(4), held / 2);
            assert_eq!(unit.sessions.by_peer.get("kept"), Some(&(held / 2)));
            assert_eq!(unit.release_closed(5), held / 2);
            assert!(
                unit.sessions.by_peer.is_empty(),
                "{:?}",
                unit.sessions.by_peer
            );
        });
    }
}
