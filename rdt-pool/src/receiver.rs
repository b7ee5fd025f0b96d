//! The receiver pool: fetches read an object's blocks into leased receive blocks, one READ
//! descriptor per block, and hand out tensors that are views of them.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tessera_alloc::{AllocError, Group, Layout};
use tessera_framecodec::Tensor;
use tessera_transport::{
    Agent, FrozenBlock, LocalDesc, Peer, PoolBlock, PoolError, RegisteredPool, Registration,
    RemoteDesc, Status, Transfer, TransferError,
};

use crate::descriptor::{ObjectDescriptor, PackedLayout};
use crate::error::FetchError;
use crate::report::PoolReport;
use tessera_sync::atomic::{AtomicU64, Ordering};
use tessera_sync::{Arc, Mutex};

/// The receiver side: one region registered once with an agent, carved into receive blocks.
/// Cloning is cheap and shares the pool.
///
/// Use the same agent for a process's [`SenderPool`](crate::SenderPool) and `ReceiverPool`:
/// fetched tensors can then be put again (forwarded) without a copy.
#[derive(Clone)]
pub struct ReceiverPool {
    inner: Arc<Inner>,
}

struct Inner {
    agent: Arc<Agent>,
    pool: RegisteredPool,
    stats: Arc<Stats>,
    quarantine: Mutex<Vec<Quarantined>>,
}

#[derive(Default)]
pub(crate) struct Stats {
    leased: AtomicU64,
    live_objects: AtomicU64,
}

/// Blocks of a transfer whose outcome was unknown when its fetch gave up.
struct Quarantined {
    transfer: Transfer,
    _blocks: Vec<PoolBlock>,
    bytes: u64,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ReceiverPool>();
    assert_send_sync::<Fetch<'static>>();
};

/// What keeps a receive block leased: the owner of the `Bytes` every view of it slices.
struct ViewOwner {
    block: FrozenBlock,
    stats: Arc<Stats>,
    _object: Arc<ObjectTicket>,
}

impl AsRef<[u8]> for ViewOwner {
    fn as_ref(&self) -> &[u8] {
        self.block.as_ref()
    }
}

impl Drop for ViewOwner {
    fn drop(&mut self) {
        self.stats
            .leased
            .fetch_sub(self.block.len(), Ordering::AcqRel);
    }
}

/// Counts a fetched object as live while any of its blocks is viewed.
struct ObjectTicket {
    stats: Arc<Stats>,
}

impl Drop for ObjectTicket {
    fn drop(&mut self) {
        self.stats.live_objects.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Turns landed receive blocks into tensors: each block becomes one `Bytes` owning its lease,
/// and each tensor a slice of it. The block returns to the pool when the last tensor, or any
/// slice of one, is dropped.
pub(crate) fn views(
    group: Group<PoolBlock>,
    desc: &ObjectDescriptor,
    at: &[(usize, u64)],
    stats: &Arc<Stats>,
) -> Result<Vec<Tensor>, FetchError> {
    let mut frozen = Vec::with_capacity(group.blocks.len());
    for block in group.blocks {
        frozen.push(block.freeze().map_err(|_| FetchError::StillHeld)?);
    }
    stats.live_objects.fetch_add(1, Ordering::AcqRel);
    let ticket = Arc::new(ObjectTicket {
        stats: stats.clone(),
    });
    let bytes: Vec<Bytes> = frozen
        .into_iter()
        .map(|block| {
            stats.leased.fetch_add(block.len(), Ordering::AcqRel);
            Bytes::from_owner(ViewOwner {
                block,
                stats: stats.clone(),
                _object: ticket.clone(),
            })
        })
        .collect();
    drop(ticket);
    desc.tensors
        .iter()
        .map(|t| {
            let data = match t.place {
                None => Bytes::new(),
                Some(p) => {
                    let (b, base) = at[p.block as usize];
                    let start = (base + p.offset) as usize;
                    bytes[b].slice(start..start + t.bytes() as usize)
                }
            };
            Tensor::new(t.dtype, &t.shape, data).map_err(FetchError::Tensor)
        })
        .collect()
}

impl ReceiverPool {
    /// A pool of `capacity` bytes, registered with `agent` once. Share the agent (`Arc`) with the
    /// process's other pool.
    pub fn new(agent: Arc<Agent>, capacity: u64) -> Result<Self, PoolError> {
        Ok(Self {
            inner: Arc::new(Inner {
                pool: RegisteredPool::new(&agent, capacity)?,
                agent,
                stats: Arc::new(Stats::default()),
                quarantine: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The agent the pool is registered with.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.inner.agent
    }

    /// The pool's registration.
    pub fn registration(&self) -> &Registration {
        self.inner.pool.registration()
    }

    /// Starts fetching the object `desc` describes from `peer`: validates the descriptor,
    /// leases receive blocks (one best-fit block for the whole object when a free range
    /// holds it) and posts one READ with one descriptor per remote block. Await the
    /// [`Fetch`], or call [`Fetch::wait`] / [`Fetch::wait_timeout`].
    pub fn fetch<'d>(
        &self,
        desc: &'d ObjectDescriptor,
        peer: &Peer,
    ) -> Result<Fetch<'d>, FetchError> {
        desc.validate()?;
        self.sweep();
        let layouts = desc
            .blocks
            .iter()
            .map(|b| Layout::new(b.remote.len, b.align))
            .collect::<Result<Vec<_>, _>>()
            .map_err(FetchError::Alloc)?;
        let group = self
            .inner
            .pool
            .lease_group(&layouts)
            .map_err(|e| self.fetch_oom(e, desc))?;
        let at: Vec<(usize, u64)> = group
            .placements
            .iter()
            .map(|p| p.map_or((0, 0), |p| (p.block, p.offset)))
            .collect();
        let transfer = if desc.blocks.is_empty() {
            None
        } else {
            let locals = desc
                .blocks
                .iter()
                .zip(&at)
                .map(|(b, &(i, off))| group.blocks[i].desc_range(off, b.remote.len))
                .collect::<Result<Vec<LocalDesc>, _>>()?;
            let remotes: Vec<RemoteDesc> = desc.blocks.iter().map(|b| b.remote).collect();
            // On error `group` drops here: the blocks are free again at once.
            Some(
                peer.read(&locals, &remotes, None)
                    .map_err(FetchError::Transfer)?,
            )
        };
        Ok(Fetch {
            pending: Some(Pending {
                transfer,
                group,
                at,
                desc,
            }),
            pool: self.inner.clone(),
        })
    }

    /// [`fetch`](Self::fetch) and wait for it, giving up after `timeout` (the blocks are then
    /// quarantined until the transfer resolves).
    pub fn fetch_blocking(
        &self,
        desc: &ObjectDescriptor,
        peer: &Peer,
        timeout: Duration,
    ) -> Result<Vec<Tensor>, FetchError> {
        self.fetch(desc, peer)?.wait_timeout(timeout)
    }

    /// Reads the object into `dst`, laid out as [`ObjectDescriptor::packed_layout`] says, and
    /// returns that layout. No pool block is taken when `dst` lies in memory registered with
    /// this pool's agent: the data lands there directly. Otherwise it is read into a receive
    /// block and copied out once.
    ///
    /// It waits for the transfer to resolve, however long that takes (the engines bound how
    /// long a silent peer holds one), since the engine writes into `dst`.
    pub fn fetch_into(
        &self,
        desc: &ObjectDescriptor,
        peer: &Peer,
        dst: &mut [u8],
    ) -> Result<PackedLayout, FetchError> {
        let layout = desc.packed_layout()?;
        if (dst.len() as u64) < layout.size {
            return Err(FetchError::DestinationTooSmall {
                len: dst.len() as u64,
                needed: layout.size,
            });
        }
        if layout.size == 0 {
            return Ok(layout);
        }
        if let Some(reg) = self.inner.agent.find_registered(dst.as_ptr(), layout.size) {
            return self.fetch_into_registered(desc, peer, &reg, 0);
        }
        let remotes: Vec<RemoteDesc> = desc.blocks.iter().map(|b| b.remote).collect();
        let block = self
            .inner
            .pool
            .lease(layout.size, layout.align)
            .map_err(|e| self.fetch_oom(e, desc))?;
        let locals = desc
            .blocks
            .iter()
            .zip(&layout.blocks)
            .map(|(b, &off)| block.desc_range(off, b.remote.len))
            .collect::<Result<Vec<LocalDesc>, _>>()?;
        let t = peer
            .read(&locals, &remotes, None)
            .map_err(FetchError::Transfer)?;
        drop(locals);
        wait_forever(&t).map_err(FetchError::Transfer)?;
        block
            .read_at(0, &mut dst[..layout.size as usize])
            .map_err(|e| {
                FetchError::Transfer(TransferError::Backend {
                    peer: peer.name().to_owned(),
                    source: tessera_transport::BackendError::new("copy-out", e),
                })
            })?;
        Ok(layout)
    }

    /// Reads the object straight into `reg` at `offset`, laid out as
    /// [`ObjectDescriptor::packed_layout`] says, and returns that layout; no pool block is
    /// taken. Waits for the transfer to resolve.
    pub fn fetch_into_registered(
        &self,
        desc: &ObjectDescriptor,
        peer: &Peer,
        reg: &Registration,
        offset: u64,
    ) -> Result<PackedLayout, FetchError> {
        let layout = desc.packed_layout()?;
        let room = reg.len().saturating_sub(offset);
        if room < layout.size {
            return Err(FetchError::DestinationTooSmall {
                len: room,
                needed: layout.size,
            });
        }
        if layout.size == 0 {
            return Ok(layout);
        }
        let remotes: Vec<RemoteDesc> = desc.blocks.iter().map(|b| b.remote).collect();
        let locals = desc
            .blocks
            .iter()
            .zip(&layout.blocks)
            .map(|(b, &off)| reg.desc(offset + off, b.remote.len))
            .collect::<Result<Vec<LocalDesc>, _>>()?;
        let t = peer
            .read(&locals, &remotes, None)
            .map_err(FetchError::Transfer)?;
        drop(locals);
        wait_forever(&t).map_err(FetchError::Transfer)?;
        Ok(layout)
    }

    /// Starts reading each tensor of the object straight into its own destination, the
    /// caller's memory (Ray's `target_buffers`): `dsts[i]` receives tensor `i`, is exactly its
    /// bytes long, and is `None` exactly for a tensor without bytes. Register the caller's
    /// buffers with [`Agent::register_local`] to describe them. One READ with one descriptor
    /// per tensor (the engine coalesces neighbours); no pool block is taken. `None` when no
    /// tensor has bytes.
    ///
    /// The engine writes into `dsts` until the returned transfer resolves: keep them (their
    /// registrations hold their memory) until then, whatever else gives up waiting.
    pub fn read_into_tensors(
        &self,
        desc: &ObjectDescriptor,
        peer: &Peer,
        dsts: &[Option<LocalDesc>],
    ) -> Result<Option<Transfer>, FetchError> {
        desc.validate()?;
        if dsts.len() != desc.tensors.len() {
            return Err(FetchError::Destinations {
                given: dsts.len(),
                tensors: desc.tensors.len(),
            });
        }
        let mut locals = Vec::with_capacity(dsts.len());
        let mut remotes = Vec::with_capacity(dsts.len());
        for (i, (t, dst)) in desc.tensors.iter().zip(dsts).enumerate() {
            let needed = t.place.map_or(0, |_| t.bytes());
            let len = dst.as_ref().map_or(0, LocalDesc::len);
            let (Some(place), Some(dst)) = (t.place, dst) else {
                if len == needed {
                    continue;
                }
                return Err(FetchError::DestinationMismatch {
                    tensor: i,
                    len,
                    needed,
                });
            };
            if len != needed {
                return Err(FetchError::DestinationMismatch {
                    tensor: i,
                    len,
                    needed,
                });
            }
            // Inside its block: `validate` checked `offset + bytes <= block length`. A block
            // placed where no sum fits names no registration's range; saturated, the
            // initiator's check against the peer's metadata refuses it.
            let block = desc.blocks[place.block as usize].remote;
            remotes.push(RemoteDesc {
                reg: block.reg,
                offset: block.offset.saturating_add(place.offset),
                len: needed,
            });
            locals.push(dst.clone());
        }
        if locals.is_empty() {
            return Ok(None);
        }
        peer.read(&locals, &remotes, None)
            .map(Some)
            .map_err(FetchError::Transfer)
    }

    fn fetch_oom(&self, e: PoolError, desc: &ObjectDescriptor) -> FetchError {
        match e {
            PoolError::Alloc(AllocError::OutOfMemory {
                free, largest_free, ..
            }) => FetchError::OutOfMemory {
                requested: desc.bytes(),
                blocks: desc.blocks.len(),
                free,
                largest_free,
            },
            PoolError::Alloc(a) => FetchError::Alloc(a),
            _ => FetchError::OutOfMemory {
                requested: desc.bytes(),
                blocks: desc.blocks.len(),
                free: 0,
                largest_free: 0,
            },
        }
    }

    /// Drops quarantine entries whose transfer resolved; returns the bytes still held.
    fn sweep(&self) -> u64 {
        let mut q = self.inner.quarantine.lock();
        q.retain(|e| e.transfer.status() == Status::Pending);
        q.iter().map(|e| e.bytes).sum()
    }

    /// Occupancy now. Quarantined blocks whose transfer has resolved are released first.
    pub fn report(&self) -> PoolReport {
        let quarantined = self.sweep();
        let r = self.inner.pool.report();
        PoolReport {
            capacity: r.capacity,
            used: r.used,
            leased: self.inner.stats.leased.load(Ordering::Acquire),
            quarantined,
            free: r.free,
            largest_free: r.largest_free,
            live_objects: self.inner.stats.live_objects.load(Ordering::Acquire),
            in_place: 0,
        }
    }
}

impl fmt::Debug for ReceiverPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceiverPool")
            .field("report", &self.report())
            .finish()
    }
}

/// A fetch in flight: a `Future` of the object's tensors.
///
/// Dropping it before it resolves, or giving up in [`Fetch::wait_timeout`], quarantines its
/// blocks until the transfer resolves: they are never handed out while a late write could
/// land in them.
#[must_use = "a fetch quarantines its blocks if dropped before it resolves"]
pub struct Fetch<'d> {
    pending: Option<Pending<'d>>,
    pool: Arc<Inner>,
}

struct Pending<'d> {
    transfer: Option<Transfer>,
    group: Group<PoolBlock>,
    /// For each descriptor block: its receive block and offset there.
    at: Vec<(usize, u64)>,
    desc: &'d ObjectDescriptor,
}

impl<'d> Fetch<'d> {
    /// Blocks the thread until the fetch resolves.
    pub fn wait(mut self) -> Result<Vec<Tensor>, FetchError> {
        let p = self.take();
        let result = match &p.transfer {
            Some(t) => wait_forever(t),
            None => Ok(()),
        };
        self.finish(p, result)
    }

    /// Blocks up to `timeout`. On timeout the blocks are quarantined until the transfer
    /// resolves, and [`FetchError::Timeout`] is returned.
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<Vec<Tensor>, FetchError> {
        let p = self.take();
        let result = match &p.transfer {
            Some(t) => t.wait_timeout(timeout),
            None => Ok(()),
        };
        let Err(TransferError::Timeout { peer, after }) = result else {
            return self.finish(p, result);
        };
        // The transfer may have resolved between the timeout and now: then its outcome counts.
        match p.transfer.as_ref().map(Transfer::status) {
            Some(Status::Pending) => {
                let quarantined = self.pool.quarantine(p);
                Err(FetchError::Timeout {
                    peer,
                    after,
                    quarantined,
                })
            }
            Some(Status::Failed(e)) => self.finish(p, Err(e)),
            Some(Status::Done) | None => self.finish(p, Ok(())),
        }
    }

    /// Bytes this fetch reads.
    pub fn bytes(&self) -> u64 {
        self.pending.as_ref().map_or(0, |p| p.desc.bytes())
    }

    fn take(&mut self) -> Pending<'d> {
        match self.pending.take() {
            Some(p) => p,
            // `pending` is only taken by the consuming methods and `poll` after `Ready`.
            None => unreachable!("fetch polled after completion"),
        }
    }

    fn finish(
        &self,
        p: Pending<'d>,
        result: Result<(), TransferError>,
    ) -> Result<Vec<Tensor>, FetchError> {
        let Pending {
            transfer,
            group,
            at,
            desc,
        } = p;
        drop(transfer);
        // On failure `group` drops: the engine released its hold before reporting, so the
        // blocks are free again at once.
        result.map_err(FetchError::Transfer)?;
        views(group, desc, &at, &self.pool.stats)
    }
}

fn wait_forever(t: &Transfer) -> Result<(), TransferError> {
    loop {
        match t.wait_timeout(Duration::from_secs(3600)) {
            Err(TransferError::Timeout { .. }) if t.status() == Status::Pending => continue,
            other => return other,
        }
    }
}

impl Inner {
    fn quarantine(&self, p: Pending<'_>) -> u64 {
        let bytes = p.group.blocks.iter().map(PoolBlock::len).sum();
        if let Some(transfer) = p.transfer {
            self.quarantine.lock().push(Quarantined {
                transfer,
                _blocks: p.group.blocks,
                bytes,
            });
        }
        bytes
    }
}

impl Future for Fetch<'_> {
    type Output = Result<Vec<Tensor>, FetchError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(p) = self.pending.as_mut() else {
            return Poll::Ready(Err(FetchError::AlreadyResolved));
        };
        let result = match p.transfer.as_mut() {
            Some(t) => match Pin::new(t).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            },
            None => Ok(()),
        };
        let p = self.take();
        Poll::Ready(self.finish(p, result))
    }
}

impl Drop for Fetch<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            if p.transfer
                .as_ref()
                .is_some_and(|t| t.status() == Status::Pending)
            {
                self.pool.quarantine(p);
            }
        }
    }
}

impl fmt::Debug for Fetch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fetch")
            .field("bytes", &self.bytes())
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{BlockDesc, Place, TensorDesc};
    use tessera_framecodec::DType;
    use tessera_sync::{model, thread};
    use tessera_transport::Inproc;

    fn overlaps(a: &std::ops::Range<u64>, b: &std::ops::Range<u64>) -> bool {
        a.start < b.end && b.start < a.end
    }

    /// Views of one block dropped on two threads, one of them keeping only a slice of its
    /// view, while the main thread leases from the same pool: a lease never overlaps a block
    /// that is still viewed, and viewed bytes never change under their views.
    #[test]
    fn loom_views_dropped_on_threads_never_share_a_viewed_block() {
        model(|| {
            let agent = Agent::new("loom", Inproc::new()).unwrap();
            let pool = RegisteredPool::new(&agent, 32).unwrap();
            let stats = Arc::new(Stats::default());
            let half = |offset| TensorDesc {
                dtype: DType::U8,
                shape: smallvec::smallvec![16],
                place: Some(Place { block: 0, offset }),
            };
            let desc = ObjectDescriptor {
                blocks: vec![BlockDesc {
                    remote: RemoteDesc::new(0, 0, 32),
                    align: 8,
                }],
                tensors: vec![half(0), half(16)],
            };
            let group = pool.lease_group(&[Layout::new(32, 8).unwrap()]).unwrap();
            let range = group.blocks[0].offset()..group.blocks[0].offset() + 32;
            group.blocks[0].write_at(0, &[7u8; 32]).unwrap();
            let mut tensors = views(group, &desc, &[(0, 0)], &stats).unwrap();
            // Ranges still viewed; an entry leaves before its last view is dropped, so the set
            // never holds a block that is no longer viewed.
            let viewed = Arc::new(Mutex::new(vec![range]));
            let holders = Arc::new(AtomicU64::new(2));
            let second = tensors.pop().unwrap();
            let first = tensors.pop().unwrap();
            let spawn = |view: Bytes| {
                let viewed = viewed.clone();
                let holders = holders.clone();
                thread::spawn(move || {
                    assert!(view.iter().all(|&b| b == 7), "viewed bytes changed");
                    if holders.fetch_sub(1, Ordering::AcqRel) == 1 {
                        viewed.lock().clear();
                    }
                    drop(view);
                })
            };
            // One thread keeps only a slice of its view: the parent view is gone first.
            let slice = first.data().slice(4..8);
            drop(first);
            let a = spawn(slice);
            let b = spawn(second.into_data());
            for _ in 0..2 {
                if let Ok(lease) = pool.lease(32, 8) {
                    let got = lease.offset()..lease.offset() + 32;
                    assert!(
                        viewed.lock().iter().all(|r| !overlaps(r, &got)),
                        "a viewed block was leased again"
                    );
                    lease.write_at(0, &[0xff; 32]).unwrap();
                }
            }
            a.join().unwrap();
            b.join().unwrap();
            assert!(pool.lease(32, 8).is_ok());
            assert_eq!(stats.leased.load(Ordering::Acquire), 0);
            assert_eq!(stats.live_objects.load(Ordering::Acquire), 0);
        });
    }
}

#[cfg(test)]
mod fetch_loom {
    use super::*;
    use crate::{SenderPool, TensorRef};
    use tessera_framecodec::DType;
    use tessera_sync::{model, thread};
    use tessera_transport::Inproc;

    /// The whole path: fetched views dropped on two threads while the receiver fetches the
    /// same object again into a pool that holds only one copy. A second fetch either finds
    /// the pool full or gets memory no live view points into, and it always reads the right
    /// bytes.
    #[test]
    fn loom_fetch_again_while_views_drop_on_threads() {
        model(|| {
            let tx = Arc::new(Agent::new("tx", Inproc::new()).unwrap());
            let rx = Arc::new(Agent::new("rx", Inproc::new()).unwrap());
            let sender = SenderPool::new(tx.clone(), 64).unwrap();
            let receiver = ReceiverPool::new(rx.clone(), 32).unwrap();
            let peer = rx.add_remote(&tx.metadata()).unwrap();
            let data: Vec<u8> = (0..32).collect();
            let desc = sender
                .put(
                    "o",
                    &[
                        TensorRef::new(DType::U8, &[16], &data[..16]).unwrap(),
                        TensorRef::new(DType::U8, &[16], &data[16..]).unwrap(),
                    ],
                )
                .unwrap();
            let mut views = receiver.fetch(&desc, &peer).unwrap().wait().unwrap();
            let range = |b: &Bytes| b.as_ptr() as usize..b.as_ptr() as usize + b.len();
            let second = views.pop().unwrap().into_data();
            let first = views.pop().unwrap().into_data().slice(2..6);
            let viewed = Arc::new(Mutex::new(vec![range(&first), range(&second)]));
            let spawn = |view: Bytes, expect: Vec<u8>| {
                let viewed = viewed.clone();
                thread::spawn(move || {
                    assert_eq!(&view[..], &expect[..], "viewed bytes changed");
                    let r = view.as_ptr() as usize..view.as_ptr() as usize + view.len();
                    viewed.lock().retain(|v| *v != r);
                    drop(view);
                })
            };
            let a = spawn(first, data[2..6].to_vec());
            let b = spawn(second, data[16..].to_vec());
            match receiver.fetch(&desc, &peer) {
                Ok(fetch) => {
                    let again = fetch.wait().unwrap();
                    for t in &again {
                        let got = range(t.data());
                        assert!(
                            viewed
                                .lock()
                                .iter()
                                .all(|v| got.end <= v.start || v.end <= got.start),
                            "a fetch landed in a block that is still viewed"
                        );
                    }
                    assert_eq!(&again[1].data()[..], &data[16..]);
                }
                Err(FetchError::OutOfMemory { .. }) => {}
                Err(e) => panic!("unexpected {e}"),
            }
            a.join().unwrap();
            b.join().unwrap();
            let r = receiver.report();
            assert_eq!((r.used, r.leased, r.live_objects), (0, 0, 0));
        });
    }
}
