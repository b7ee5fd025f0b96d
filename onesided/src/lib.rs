#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod fault;
mod key;
mod pending;
mod wire;

pub use fault::Fault;
pub use key::{KeyChunk, KeyFormat};
pub use pending::Pending;
pub use wire::{in_bounds, Malformed, Reader};

use std::collections::HashMap;
use std::fmt;
use tessera_sync::{Arc, Mutex};

use tessera_transport::engine::{Completion, Connection, Host, Op, PeerInfo, Plan, Segment, Xfer};
use tessera_transport::{BackendError, Side, TransferError};

/// An adapter's engine: none before start and after shutdown.
pub struct EngineSlot<E> {
    kind: &'static str,
    engine: Mutex<Option<Arc<E>>>,
}

impl<E> EngineSlot<E> {
    /// An empty slot of the backend `kind` (for errors).
    pub fn new(kind: &'static str) -> Self {
        Self {
            kind,
            engine: Mutex::new(None),
        }
    }

    /// Starts the engine with `make`, once: a second start is an error and leaves the running
    /// engine alone.
    pub fn start(
        &self,
        make: impl FnOnce() -> Result<E, BackendError>,
    ) -> Result<(), BackendError> {
        let mut slot = self.engine.lock();
        if slot.is_some() {
            return Err(BackendError::new(
                self.kind,
                "the engine was already started",
            ));
        }
        *slot = Some(Arc::new(make()?));
        Ok(())
    }

    /// A handle on the running engine, or an error once it is shut down (or before start).
    pub fn get(&self) -> Result<Arc<E>, BackendError> {
        self.engine
            .lock()
            .clone()
            .ok_or_else(|| BackendError::new(self.kind, "the engine is shut down"))
    }

    /// Takes the engine out; it goes when the last handle on it does.
    pub fn stop(&self) {
        let engine = self.engine.lock().take();
        drop(engine);
    }
}

/// An engine's notification handler (the same type in both engines' configurations).
pub type NotifyFn = Arc<dyn Fn(&str, Vec<u8>) + Send + Sync>;

/// The notification handler an engine is started with: each notification from a peer goes to
/// the agent's queue.
pub fn notify_to(host: &Host) -> NotifyFn {
    let host = host.clone();
    Arc::new(move |from: &str, msg: Vec<u8>| host.notify(from, msg))
}

/// Registration id -> the engine's handle on that local memory. Cloning shares the table.
pub struct Regs<R>(Arc<Mutex<HashMap<u64, R>>>);

impl<R> Clone for Regs<R> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<R> Default for Regs<R> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<R: Clone> Regs<R> {
    /// Records `mem` as the handle of registration `id`.
    pub fn insert(&self, id: u64, mem: R) {
        self.0.lock().insert(id, mem);
    }

    /// Forgets `id`; its handle is dropped after the table is unlocked.
    pub fn remove(&self, id: u64) {
        let mem = self.0.lock().remove(&id);
        drop(mem);
    }

    /// Handles on the local registration of each of `plan`'s segments, taken out of the table
    /// so that no lock is held while the engine runs (a completion reported in place may
    /// deregister). A registration no longer in the table is an error naming `peer`.
    pub fn of_plan(&self, plan: &Plan, peer: &str) -> Result<Vec<R>, TransferError> {
        let regs = self.0.lock();
        plan.segments()
            .iter()
            .map(|s| {
                regs.get(&s.local_reg)
                    .cloned()
                    .ok_or_else(|| TransferError::UnknownRegistration {
                        peer: peer.to_owned(),
                        side: Side::Local,
                        index: 0,
                        reg: s.local_reg,
                    })
            })
            .collect()
    }
}

/// An engine's handle on one peer, as [`Link`] drives it.
pub trait PeerHandle: Send + Sync + Sized + 'static {
    /// The engine's handle on local memory.
    type Region: Clone + Send + Sync + 'static;
    /// One segment of a transfer as the engine takes it, borrowing its local memory.
    type Op<'a>;
    /// The engine's error.
    type Error: fmt::Display + 'static;
    /// The backend's kind, for errors.
    const KIND: &'static str;
    /// How an error names the closed handle of peer `{:?}`: "the endpoint of", ...
    const CLOSED: &'static str;

    /// Unpacks the key a peer announced for its registration `id`.
    fn add_remote(&self, id: u64, key: &[u8]) -> Result<(), Self::Error>;

    /// Forgets the key of the peer's registration `id`.
    fn remove_remote(&self, id: u64);

    /// Segment `s` of a plan, over `local`, its local registration.
    fn op<'a>(local: &'a Self::Region, s: &Segment) -> Self::Op<'a>;

    /// The remote registration an op names.
    fn remote_of(op: &Self::Op<'_>) -> u64;

    /// Posts `ops` and the notification; unless this returns an error, the engine runs
    /// `done` once with the outcome.
    fn post_ops(
        &self,
        op: Op,
        ops: &[Self::Op<'_>],
        notify: Option<Vec<u8>>,
        done: impl FnOnce(Result<(), Self::Error>) + Send + 'static,
    ) -> Result<(), Self::Error>;

    /// What the engine's error means for a transfer.
    fn fault(e: Self::Error) -> Fault<Self::Error>;

    /// The engine's error as a transfer error naming `peer` (see [`Fault::transfer_error`]);
    /// `remote_reg` gives the remote registration of op `index`, for range errors.
    fn transfer_error(
        peer: &str,
        e: Self::Error,
        remote_reg: impl Fn(usize) -> u64,
    ) -> TransferError {
        Self::fault(e).transfer_error(Self::KIND, peer, remote_reg)
    }

    /// Posts `xfer` on `link` (see [`Connection::post`]): what an empty plan or a closed
    /// connection becomes, then [`Link::post_plan`].
    fn post(link: &Link<Self>, xfer: Xfer);
}

/// One peer of a one-sided engine: its handle and the keys it announced.
pub struct Link<P: PeerHandle> {
    peer: String,
    /// Shared so that no lock is held while the engine runs; closed when the last clone drops.
    handle: Mutex<Option<Arc<P>>>,
    /// Remote registration id -> the key unpacked for it.
    keys: Mutex<HashMap<u64, Vec<u8>>>,
    regs: Regs<P::Region>,
}

impl<P: PeerHandle> Link<P> {
    /// A connection to `peer` over `handle`, with every key `peer` announces.
    pub fn open(
        peer: &PeerInfo,
        handle: P,
        regs: Regs<P::Region>,
    ) -> Result<Arc<Self>, BackendError> {
        let link = Self {
            peer: peer.name.clone(),
            handle: Mutex::new(Some(Arc::new(handle))),
            keys: Mutex::new(HashMap::new()),
            regs,
        };
        link.update(peer)?;
        Ok(Arc::new(link))
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The peer's handle, or `None` once the connection is closed.
    pub fn handle(&self) -> Option<Arc<P>> {
        self.handle.lock().clone()
    }

    /// Posts the plan `done` owns: looks up its local registrations (a missing one fails the
    /// transfer), then takes the peer's handle from `handle` and posts the plan's segments
    /// with the notification. The completion is reported by the engine's callback or, when
    /// nothing was posted, here, after the handles the post borrowed are dropped.
    pub fn post_plan(
        &self,
        done: Completion,
        notify: Option<Vec<u8>>,
        handle: impl FnOnce() -> Result<Arc<P>, P::Error>,
    ) {
        let mems = match self.regs.of_plan(done.plan(), &self.peer) {
            Ok(m) => m,
            Err(e) => {
                done.complete(Err(e));
                return;
            }
        };
        let ops: Vec<P::Op<'_>> = done
            .plan()
            .segments()
            .iter()
            .zip(&mems)
            .map(|(s, m)| P::op(m, s))
            .collect();
        let op = done.plan().op();
        let peer = self.peer.clone();
        let (tracked, callback) = track(done, move |e| P::transfer_error(&peer, e, |_| 0));
        let posted = handle().and_then(|h| h.post_ops(op, &ops, notify, callback));
        if let Err(e) = posted {
            let err = P::transfer_error(&self.peer, e, |i| ops.get(i).map_or(0, P::remote_of));
            drop(ops);
            drop(mems);
            tracked.fail(err);
        }
    }
}

impl<P: PeerHandle> Connection for Link<P> {
    fn post(&self, xfer: Xfer) {
        P::post(self, xfer);
    }

    /// Unpacks each announced key that is new or changed and forgets the keys no longer
    /// announced.
    fn update(&self, peer: &PeerInfo) -> Result<(), BackendError> {
        let handle = self.handle().ok_or_else(|| {
            BackendError::new(P::KIND, format!("{} {:?} is closed", P::CLOSED, self.peer))
        })?;
        let mut keys = self.keys.lock();
        for r in &peer.regs {
            if keys.get(&r.id) == Some(&r.key) {
                continue;
            }
            handle.add_remote(r.id, &r.key).map_err(|e| {
                BackendError::new(
                    P::KIND,
                    format!("key of registration {} of {:?}: {e}", r.id, peer.name),
                )
            })?;
            keys.insert(r.id, r.key.clone());
        }
        let gone: Vec<u64> = keys
            .keys()
            .filter(|id| !peer.regs.iter().any(|r| r.id == **id))
            .copied()
            .collect();
        for id in gone {
            handle.remove_remote(id);
            keys.remove(&id);
        }
        Ok(())
    }

    fn close(&self) {
        let handle = self.handle.lock().take();
        drop(handle);
    }
}

/// A transfer's [`Completion`] while the engine holds its callback: [`track`] makes both.
struct Tracked {
    slot: Arc<Mutex<Option<Completion>>>,
}

impl Tracked {
    /// Posting failed: reports `err`, unless the callback already reported an outcome.
    /// Drop the handles the post borrowed first, so the transfer's memory is released
    /// before whoever awaits it hears.
    fn fail(self, err: TransferError) {
        if let Some(done) = self.slot.lock().take() {
            done.complete(Err(err));
        }
    }
}

/// Holds `done` for an engine's callback: the callback reports the engine's outcome (errors
/// through `to_error`); if the engine never runs it, [`Tracked::fail`] reports instead.
fn track<E: 'static>(
    done: Completion,
    to_error: impl FnOnce(E) -> TransferError + Send + 'static,
) -> (Tracked, impl FnOnce(Result<(), E>) + Send + 'static) {
    let slot = Arc::new(Mutex::new(Some(done)));
    let cb_slot = slot.clone();
    let callback = move |r: Result<(), E>| {
        if let Some(done) = cb_slot.lock().take() {
            done.complete(r.map_err(to_error));
        }
    };
    (Tracked { slot }, callback)
}
