//! A fault-injecting engine: [`Faulty`] wraps any engine and, for the transfers a [`Faults`]
//! handle arms, fails them at completion (after the engine moved the bytes), at submission, by
//! losing the engine's completion, or by reporting late. The layers above (pools, storage, the
//! Python package) test their asynchronous failure paths with it, on any engine.

use std::collections::VecDeque;
use std::thread;
use std::time::Duration;

use crate::engine::{Completion, Connection, Host, PeerInfo, RegInfo, Transport, Xfer};
use crate::error::{BackendError, RegisterError, TransferError};
use crate::transfer::Op;
use tessera_sync::atomic::AtomicUsize;
use tessera_sync::{Arc, Mutex};

/// What happens to an armed transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The engine runs the transfer to its end; then the transfer is reported failed
    /// ([`TransferError::PeerGone`], as when a link is cut in the middle of a payload). The
    /// bytes may have moved, all or some: a caller must treat them as garbage.
    FailAtCompletion,
    /// Reported failed at once; the engine never sees the transfer.
    FailAtSubmission,
    /// The engine runs the transfer; its completion is then dropped unreported, which the
    /// agent turns into [`TransferError::StatusLost`].
    LoseCompletion,
    /// The engine's outcome is reported this much later than the engine reported it.
    Delay(Duration),
}

/// The faults to inject, shared between a test and its [`Faulty`] engines. Each armed fault
/// applies to one transfer, in the order armed, whichever connection posts it.
#[derive(Debug, Clone, Default)]
pub struct Faults(Arc<Mutex<State>>);

#[derive(Debug, Default)]
struct State {
    armed: VecDeque<(Option<Op>, Fault)>,
    injected: u64,
}

impl Faults {
    /// No fault armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Arms `fault` for the next transfer in either direction.
    pub fn next(&self, fault: Fault) {
        self.0.lock().armed.push_back((None, fault));
    }

    /// Arms `fault` for the next transfer in direction `op`.
    pub fn next_on(&self, op: Op, fault: Fault) {
        self.0.lock().armed.push_back((Some(op), fault));
    }

    /// How many faults were injected so far.
    pub fn injected(&self) -> u64 {
        self.0.lock().injected
    }

    /// How many armed faults no transfer has met yet.
    pub fn armed(&self) -> usize {
        self.0.lock().armed.len()
    }

    fn take(&self, op: Op) -> Option<Fault> {
        let mut s = self.0.lock();
        let i = s
            .armed
            .iter()
            .position(|(o, _)| o.is_none_or(|o| o == op))?;
        let (_, fault) = s.armed.remove(i)?;
        s.injected += 1;
        Some(fault)
    }
}

/// An engine that behaves as `inner`, except for the transfers its [`Faults`] arm. Its kind is
/// the inner engine's, so it connects to plain agents of that engine.
pub struct Faulty<T> {
    inner: T,
    faults: Faults,
}

impl<T: Transport> Faulty<T> {
    /// `inner`, with the faults `faults` arms.
    pub fn new(inner: T, faults: Faults) -> Self {
        Self { inner, faults }
    }
}

impl<T: Transport> Transport for Faulty<T> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn start(&self, host: Host) -> Result<(), BackendError> {
        self.inner.start(host)
    }

    fn register(&self, reg: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        self.inner.register(reg)
    }

    fn deregister(&self, id: u64) {
        self.inner.deregister(id);
    }

    fn local_side_needs_registration(&self) -> bool {
        self.inner.local_side_needs_registration()
    }

    fn address(&self) -> Vec<u8> {
        self.inner.address()
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        Ok(Arc::new(FaultyConnection {
            inner: self.inner.connect(peer)?,
            faults: self.faults.clone(),
        }))
    }

    fn tracks_links(&self) -> bool {
        self.inner.tracks_links()
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}

struct FaultyConnection {
    inner: Arc<dyn Connection>,
    faults: Faults,
}

impl Connection for FaultyConnection {
    fn post(&self, xfer: Xfer) {
        let Some(fault) = self.faults.take(xfer.plan().op()) else {
            return self.inner.post(xfer);
        };
        let Xfer { notify, done } = xfer;
        let peer = done.peer().to_owned();
        if fault == Fault::FailAtSubmission {
            return done.complete(Err(injected(peer, "failed at submission")));
        }
        // The engine runs the transfer under a completion of its own, which holds the plan, so
        // nothing the transfer touches is released before the engine is done with it.
        let (engine_done, engine) =
            Completion::start(done.plan_handle(), Arc::new(AtomicUsize::new(0)));
        self.inner.post(Xfer {
            notify,
            done: engine_done,
        });
        thread::spawn(move || {
            let outcome = engine.wait();
            match fault {
                Fault::FailAtCompletion => {
                    done.complete(Err(injected(peer, "the link was cut during the payload")))
                }
                Fault::LoseCompletion => drop(done),
                Fault::Delay(by) => {
                    thread::sleep(by);
                    done.complete(outcome);
                }
                Fault::FailAtSubmission => unreachable!("handled before posting"),
            }
        });
    }

    fn update(&self, peer: &PeerInfo) -> Result<(), BackendError> {
        self.inner.update(peer)
    }

    fn close(&self) {
        self.inner.close();
    }
}

fn injected(peer: String, what: &str) -> TransferError {
    TransferError::PeerGone {
        peer,
        detail: format!("injected fault: {what}"),
    }
}
