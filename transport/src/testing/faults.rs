//! A fault-injecting engine: [`Faulty`] wraps any engine and, for the transfers a [`Faults`]
//! handle arms, fails them at completion (after the engine moved the bytes), at submission, by
//! losing the engine's completion, by reporting late, or by cutting the engine's real link
//! while the transfer is in flight. The layers above (pools, storage, the Python package)
//! test their asynchronous failure paths with it, on any engine.

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
    /// The transfer is handed to the engine, and the engine's real link to the peer is cut
    /// ([`Connection::cut`]) as soon as the engine has taken it: the outcome is the one the
    /// engine itself reports for a link that failed under a transfer, never one made up here.
    /// Per engine:
    ///
    /// - `tcp`: the link's socket is shut down both ways. The transfer fails with
    ///   [`TransferError::PeerGone`] from wherever the engine's writer or reader had got to
    ///   (`connection closed`, `writing: ...` inside a WRITE's payload, `receiving a payload:
    ///   ...` inside a READ's); so does every other transfer on the link, in
    ///   either direction, since both agents share it. The target's reader meets the end of
    ///   the stream (inside a WRITE's payload, if the cut caught one) and releases its grants;
    ///   the bytes of a WRITE that had arrived stay written, so treat the range as garbage.
    ///   Later transfers through the same [`Peer`](crate::Peer) fail with `PeerGone`; a
    ///   fresh `add_remote` once every handle on the peer is gone dials a new link.
    /// - `shm`: the socket is shut down both ways. The transfer, whose `GRANT` cannot arrive
    ///   any more, fails with `PeerGone` (`connection closed`) before any byte moves; one
    ///   whose copy had started (see [`Fault::CutLinkAfter`]) completes its `memcpy` and
    ///   then fails sending `DONE`, so all its bytes may have landed yet it fails, its
    ///   exposures do not count it and its notification is not delivered. The target drops
    ///   the link's grants. Later transfers through the same `Peer` fail with `PeerGone`; a
    ///   fresh `add_remote` once every handle on the peer is gone connects again.
    /// - `inproc`: there is no link; the engine completed the transfer inside `post`, so the
    ///   fault changes nothing and the transfer succeeds.
    ///
    /// A transfer small enough that the engine finished it before the cut landed keeps the
    /// engine's outcome (success); on `tcp` and `shm` a transfer of a few MiB or more cannot.
    CutLink,
    /// As [`Fault::CutLink`], but the cut lands this long after the engine took the
    /// transfer, to catch it in the middle of its payload: the outcome is the engine's,
    /// success included if it finished first.
    CutLinkAfter(Duration),
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
        match fault {
            Fault::CutLink => {
                self.inner.post(xfer);
                self.inner.cut();
                return;
            }
            Fault::CutLinkAfter(after) => {
                self.inner.post(xfer);
                let inner = self.inner.clone();
                thread::spawn(move || {
                    thread::sleep(after);
                    inner.cut();
                });
                return;
            }
            _ => {}
        }
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
                Fault::FailAtSubmission | Fault::CutLink | Fault::CutLinkAfter(_) => {
                    unreachable!("handled before posting")
                }
            }
        });
    }

    fn update(&self, peer: &PeerInfo) -> Result<(), BackendError> {
        self.inner.update(peer)
    }

    fn close(&self) {
        self.inner.close();
    }

    fn cut(&self) -> bool {
        self.inner.cut()
    }
}

fn injected(peer: String, what: &str) -> TransferError {
    TransferError::PeerGone {
        peer,
        detail: format!("injected fault: {what}"),
    }
}
