//! The payload plane's memory: the registered pool behind [`Memory`], `Bytes` views that own a
//! pool block, and registering caller frames in place. With the epoll calls of `busy_poll`,
//! the only `unsafe` of the crate lives here, at the boundary with registered memory: a PUT's
//! block viewed before it is written ([`BlockBytes`]), caller frames wrapped as regions
//! (`register_group`, `register_in_place`) and WRITEs from frames that are not registered
//! (`post_write`). A block whose writes are complete goes through the transport's
//! `FrozenBlock` ([`freeze_written`]), with no `unsafe` here.

use std::ptr::NonNull;
use tessera_sync::Arc;

use bytes::Bytes;
use tessera_transport::{
    Agent, BackendError, Exposure, KeepAlive, LocalDesc, Ops, Peer, PoolBlock, Region,
    Registration, RemoteDesc, Transfer,
};

use crate::chunks::ChunkPool;
use crate::core::{Exposed, Landed, Landing, Memory, PoolStats, Written};
use crate::error::{MemoryError, PayloadError};
use tessera_engines::{EngineError, EngineOptions};

/// The payload engine of a unit and its clients: an [`EngineKind`](tessera_engines::EngineKind)
/// by its name (`inproc`, `shm`, `tcp`, `ucx`, `nixl`: `Display`, `FromStr` and the serde form
/// alike), `shm` by default. A unit and its clients use the same one, chosen by
/// configuration; a transfer never falls back to another engine.
///
/// `Ucx` and `Nixl` exist in every build, so that a configuration or a command line naming
/// them parses the same everywhere; they are usable only when this crate is built with the
/// cargo feature of the same name. Without it, starting a unit or a client on them fails with
/// an error naming the feature (`available()` tells beforehand). What storage adds to an
/// engine is [`BackendExt`].
///
/// ```
/// use tessera_storage::Backend;
/// assert_eq!("tcp".parse::<Backend>(), Ok(Backend::Tcp));
/// assert_eq!(Backend::Ucx.to_string(), "ucx");
/// assert_eq!(Backend::default(), Backend::Shm);
/// assert!("udp".parse::<Backend>().is_err());
/// ```
pub use tessera_engines::EngineKind as Backend;

/// A name that is no [`Backend`]'s (`Backend::from_str`).
pub use tessera_engines::UnknownEngine as ParseBackendError;

/// What the storage service adds to an engine: which way PUT payloads flow, and agents named
/// uniquely for a unit's or a client's role.
pub trait BackendExt: Copy {
    /// Whether PUT payloads are pulled: the client names its frames and the unit READs them,
    /// instead of the client WRITEing into a block the unit exposes. True for the one-sided
    /// engines (`ucx`, `nixl`), so that the unit is always the initiator of their transfers:
    /// over UCX's tcp transport a client that dies while it WRITEs into the unit can abort the
    /// unit's process (inside UCX, answering the dead client's emulated put), while an
    /// initiator just sees its request fail. The one place this choice is made.
    fn pulls_puts(self) -> bool;

    /// A fresh agent for `role` with a name unique across hosts (host name, process id and a
    /// counter).
    fn role_agent(self, role: &str) -> Result<Agent, tessera_transport::AgentError> {
        self.role_agent_at(role, None, None)
    }

    /// Like [`Self::role_agent`]; for `tcp`, the payload engine listens on and advertises
    /// `payload_addr` (an address of this host that peers can reach, port 0 for any) instead
    /// of 127.0.0.1. `inproc` and `shm` ignore it (they never leave the host). `ucx` and
    /// `nixl` refuse it: UCX chooses its interfaces itself, from `UCX_NET_DEVICES` (and its
    /// transports from `UCX_TLS`), so an address given here could not be honoured.
    ///
    /// With `token`, the `shm` and `tcp` engines serve only peers that prove they hold it
    /// (the unit's and its clients' token, the same as the control plane's); without one,
    /// only processes of this user, and `tcp` refuses a non-loopback `payload_addr`.
    ///
    /// A backend whose cargo feature is off fails with an error naming the feature.
    fn role_agent_at(
        self,
        role: &str,
        payload_addr: Option<std::net::SocketAddr>,
        token: Option<&tessera_transport::auth::Token>,
    ) -> Result<Agent, tessera_transport::AgentError>;
}

impl BackendExt for Backend {
    fn pulls_puts(self) -> bool {
        matches!(self, Backend::Ucx | Backend::Nixl)
    }

    fn role_agent_at(
        self,
        role: &str,
        payload_addr: Option<std::net::SocketAddr>,
        token: Option<&tessera_transport::auth::Token>,
    ) -> Result<Agent, tessera_transport::AgentError> {
        if !self.available() {
            return Err(unavailable(self));
        }
        if let (Backend::Ucx | Backend::Nixl, Some(addr)) = (self, payload_addr) {
            return Err(BackendError::new(
                self.name(),
                format!(
                    "a payload address ({addr}) applies to the tcp backend only; UCX picks \
                     its interfaces from UCX_NET_DEVICES (e.g. UCX_NET_DEVICES=eth0)"
                ),
            )
            .into());
        }
        static NEXT: tessera_sync::Counter = tessera_sync::Counter::new(0);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let name = format!(
            "tessera-{role}-{}-{}-{}",
            host.trim(),
            std::process::id(),
            NEXT.next()
        );
        // Each engine reads only the options meant for it: `inproc` and `shm` ignore the address.
        let options = EngineOptions {
            tcp_bind: payload_addr,
            token: token.cloned(),
            ..EngineOptions::default()
        };
        self.agent_with(&name, &options).map_err(|e| match e {
            EngineError::Agent(e) => e,
            _ => unavailable(self),
        })
    }
}

fn unavailable(backend: Backend) -> tessera_transport::AgentError {
    let feature = backend.feature().unwrap_or(backend.name());
    BackendError::new(
        backend.name(),
        format!(
            "this build of tessera-storage lacks it: build with the cargo feature `{feature}` \
             (its libraries come from `cargo xtask deps`)"
        ),
    )
    .into()
}

/// A PUT's receive block as bytes before its payload lands: `Bytes::from_owner(BlockBytes(
/// block))` keeps the block leased until the last slice is gone. The transport's
/// `FrozenBlock` cannot serve here: it needs the block's last handle, and a pulled PUT's READ
/// destinations (made before the block is frozen) hold the block until the READ is gone.
pub(crate) struct BlockBytes(PoolBlock);

#[allow(unsafe_code)] // Reading a registered block that a transfer fills later.
impl AsRef<[u8]> for BlockBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `as_slice` asks that nothing write the block while a slice of it is used.
        // The core freezes a PUT's block at PREPARE, before the block is exposed (READY sent,
        // READ posted), and the client's WRITE or the unit's READ fills it afterwards, so:
        // - the slice returned here is used by `Bytes::from_owner` only, for the block's
        //   address and length, at PREPARE, before any transfer of the block exists;
        // - the views cut from those bytes (`decode_contiguous` reads the meta, never the
        //   block) are read only once the payload landed (COMMIT, or `Unit::read_done`), and
        //   no descriptor of the block is handed out again after that;
        // - a block whose transfer failed, expired or was cancelled after exposure is
        //   quarantined with its views, which nobody reads again.
        unsafe { self.0.as_slice() }
    }
}

/// The first `len` bytes of a block whose writes are complete (a GET's block after GET_DONE,
/// a compacted copy), as bytes that own it through the transport's `FrozenBlock`: slices keep
/// it leased and it returns to its pool when the last one drops. Fails while a descriptor or
/// transfer of the block is still alive.
pub(crate) fn freeze_written(mut block: PoolBlock, len: u64) -> Result<Bytes, MemoryError> {
    // A block leased larger than it turned out to be (a GET's offered block) keeps `len`.
    if len > 0 {
        block.shrink(len);
    }
    let frozen = block.freeze().map_err(|_| MemoryError::InUse)?;
    Ok(Bytes::from_owner(frozen).slice(..len as usize))
}

/// The unit's registered memory (chunks of registered pools) as the protocol core's
/// [`Memory`].
pub(crate) struct PoolMemory {
    pub(crate) pool: ChunkPool<Arc<Agent>>,
}

impl Memory for PoolMemory {
    type Block = PoolBlock;
    type Dest = LocalDesc;

    fn lease(&mut self, size: u64, align: u64) -> Result<PoolBlock, MemoryError> {
        self.pool.lease(size, align)
    }

    fn remote(&self, block: &PoolBlock, offset: u64, len: u64) -> Result<RemoteDesc, MemoryError> {
        Ok(block.remote_range(offset, len)?)
    }

    /// The descriptor keeps the block leased as long as it and any READ using it live, so a
    /// block dropped by the core while its READ is in flight is not leased again before the
    /// READ is gone.
    fn dest(&self, block: &PoolBlock, offset: u64, len: u64) -> Result<LocalDesc, MemoryError> {
        Ok(block.desc_range(offset, len)?)
    }

    fn freeze(&self, block: PoolBlock, len: u64) -> Bytes {
        Bytes::from_owner(BlockBytes(block)).slice(..len as usize)
    }

    fn block_len(block: &PoolBlock) -> u64 {
        block.len()
    }

    fn shrink(block: &mut PoolBlock, len: u64) {
        // A block still described elsewhere (a pulled PUT's READ destinations) keeps its
        // length; nothing of it is lost, only not given back early.
        let _ = block.shrink(len);
    }

    fn expose_landing(&self, block: &PoolBlock, peer: &str) -> Result<Landed, MemoryError> {
        let exposure = block
            .registration()
            .expose_standing(peer, block.offset(), block.len())?;
        Ok(Arc::new(CreditExposed(exposure)))
    }

    fn copy_in(&mut self, data: &[u8], align: u64) -> Result<Bytes, MemoryError> {
        if data.is_empty() {
            return Ok(Bytes::new());
        }
        let block = self.lease(data.len() as u64, align)?;
        block.write_at(0, data)?;
        freeze_written(block, data.len() as u64)
    }

    fn expose(
        &self,
        block: &PoolBlock,
        peer: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Exposed, MemoryError> {
        // One exposure from the first frame's start to the last one's end: the padding between
        // frames is the client's to write as well, it is never published.
        let start = ranges.iter().map(|r| r.0).min().unwrap_or(0);
        let end = ranges.iter().map(|r| r.0 + r.1).max().unwrap_or(0);
        let exposure =
            block
                .registration()
                .expose(peer, block.offset() + start, end - start, Ops::WRITE)?;
        Ok(Arc::new(FramesExposed {
            exposure,
            ranges: ranges.iter().map(|&(o, l)| (o - start, l)).collect(),
            bytes: ranges.iter().map(|r| r.1).sum(),
        }))
    }

    fn usage(&self) -> PoolStats {
        self.pool.usage()
    }

    fn trim(&mut self) -> u64 {
        self.pool.trim()
    }
}

/// A pushed PUT's frames exposed to the client's agent, as one exposure from the first
/// frame to the last: the unit's engine grants the client's WRITEs only inside it (where it
/// sees every request, see tessera-transport's trust model) and records what landed. The
/// PUT counts as written once every frame's range is covered; the padding between frames
/// need not be.
struct FramesExposed {
    exposure: Exposure,
    /// The frames' `(offset, len)` relative to the exposure's start.
    ranges: Vec<(u64, u64)>,
    /// Their bytes: what the exposure has covered at least once they are all written.
    bytes: u64,
}

impl Written for FramesExposed {
    fn is_written(&self) -> bool {
        self.exposure.ranges_written(&self.ranges)
    }

    fn poll_written(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        self.exposure.poll_written(self.bytes, cx)
    }
}

/// A credit's block exposed whole, standing, to the client's agent (see
/// [`Memory::expose_landing`]).
struct CreditExposed(Exposure);

impl Landing for CreditExposed {
    fn ranges_written(&self, ranges: &[(u64, u64)]) -> bool {
        self.0.ranges_written(ranges)
    }

    fn poll_bytes(&self, bytes: u64, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        self.0.poll_written(bytes, cx)
    }

    fn spin_bytes(&self, bytes: u64, window: std::time::Duration) -> bool {
        self.0.spin_written(bytes, window)
    }
}

/// Posts a WRITE of `frames` (none empty, in order) to `descs` at `peer`. `owner` owns the
/// frames' `Bytes` (or keeps their owner alive); the transfer holds it until the engine is
/// done with them.
///
/// Where the agent's engine reaches local memory by address (`inproc`, `shm`, `tcp`), the
/// frames are not registered at all: registering them would only record regions no peer can
/// name, and for a batch of a thousand small tensors that bookkeeping (lookups, groups,
/// descriptors and their release) cost about as much as the copy. Elsewhere each is
/// described with [`source_descs`].
#[allow(unsafe_code)] // A WRITE from caller frames that are not registered.
pub(crate) fn post_write<'a>(
    agent: &Agent,
    peer: &Peer,
    frames: impl IntoIterator<Item = &'a Bytes>,
    owner: KeepAlive,
    descs: &[RemoteDesc],
) -> Result<Transfer, PayloadError> {
    if agent.local_side_needs_registration() {
        let locals = source_descs(agent, frames)?;
        return Ok(peer.write(&locals, descs, None)?);
    }
    let mut sources = Vec::with_capacity(descs.len());
    for (index, f) in frames.into_iter().enumerate() {
        if f.is_empty() {
            return Err(MemoryError::EmptyFrame { index }.into());
        }
        sources.push((f.as_ptr(), f.len() as u64));
    }
    // SAFETY: each source is the whole of a frame's `Bytes`, valid for reads while any
    // reference to its memory lives, and immutable (nobody writes through a `Bytes`; caller
    // memory wrapped as one, and stored values, are read-only by the crate's contract);
    // `owner` owns those `Bytes` (the caller says so), and the transfer holds it until the
    // engine is done with the sources.
    Ok(unsafe { peer.write_unregistered(&sources, descs, owner, None) }?)
}

/// Local descriptors of `frames` for a WRITE, in the order of `frames`: memory that already
/// lives in a registration of `agent` (a pool block, a received buffer) reuses it; other
/// memory is registered in place, the registrations owning a reference to their frames. Never
/// copies. Frames must not be empty (callers filter them).
///
/// Where the agent's engine needs no local registration (`inproc`, `shm`, `tcp`), frames
/// close together in memory share one local-only registration (see [`coalesce`]): a batch of
/// small tensors costs a few registrations instead of one per tensor. Such descriptors are
/// for this agent's own WRITEs only; no peer can name them. Where the engine needs a real
/// registration (`ucx`, `nixl`, the engines whose PUTs the unit pulls, naming the client's
/// frames), each frame is registered alone, exactly its own bytes, since whatever a real
/// engine registers is exposed to peers.
pub(crate) fn source_descs<'a>(
    agent: &Agent,
    frames: impl IntoIterator<Item = &'a Bytes>,
) -> Result<Vec<LocalDesc>, MemoryError> {
    let frames = frames.into_iter();
    // The registration the last frame was found in: frames of one block in a row (a GET's
    // values, stored together) are described from it without a lookup each.
    let mut last: Option<Registration> = None;
    if agent.local_side_needs_registration() {
        return frames
            .map(|f| match find_in_registration(agent, &mut last, f) {
                Some(d) => Ok(d),
                None => register_in_place(agent, f),
            })
            .collect();
    }
    let frames: Vec<&Bytes> = frames.collect();
    let mut descs: Vec<Option<LocalDesc>> = Vec::with_capacity(frames.len());
    let mut registered: Vec<(usize, usize)> = Vec::new();
    let mut loose: Vec<Span> = Vec::new();
    for (index, f) in frames.iter().enumerate() {
        if f.is_empty() {
            // It has no byte to anchor a group's span (its pointer may dangle).
            return Err(MemoryError::EmptyFrame { index });
        }
        // In the last frame's registration: its region is recorded already.
        if let Some(d) = last
            .as_ref()
            .and_then(|r| r.desc_at(f.as_ptr(), f.len() as u64))
        {
            descs.push(Some(d));
            continue;
        }
        match agent.find_registered(f.as_ptr(), f.len() as u64) {
            Some(reg) => {
                // The registration lies inside its region: keep groups out of the region's
                // range (frames found in the same region in a row record it once).
                let region = reg.region();
                let lo = region.as_ptr() as usize;
                let range = (lo, lo + region.len() as usize);
                if registered.last() != Some(&range) {
                    registered.push(range);
                }
                descs.push(Some(reg.desc(0, f.len() as u64)?));
                last = Some(reg);
            }
            None => {
                loose.push(Span {
                    addr: f.as_ptr() as usize,
                    len: f.len(),
                    index,
                });
                descs.push(None);
            }
        }
    }
    // Frames found in registrations of several regions in turn pushed each region again.
    registered.sort_unstable();
    registered.dedup();
    for group in coalesce(&mut loose, &registered) {
        register_group(agent, &frames, group, &mut descs)?;
    }
    let made = descs.iter().flatten().count();
    if made != descs.len() {
        return Err(MemoryError::Described {
            frames: descs.len(),
            descs: made,
        });
    }
    Ok(descs.into_iter().flatten().collect())
}

/// A frame's bytes in memory, and its position among the frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    addr: usize,
    len: usize,
    index: usize,
}

impl Span {
    fn end(&self) -> usize {
        self.addr + self.len
    }
}

/// Largest gap between two frames of one group: under a page, so that every page a group's
/// span touches holds a byte of one of its frames (every page size is at least this).
const MAX_GAP: usize = 4096;

/// Sorts `spans` by address and cuts them into groups, each to be registered as one span from
/// its first byte to its last: a frame joins the group before it when it starts less than
/// [`MAX_GAP`] bytes after the group's end (or overlaps it) and the bytes it adds to the span
/// overlap none of the `registered` address ranges (half-open). Returns the groups as slices
/// of `spans`, in address order.
fn coalesce<'s>(spans: &'s mut [Span], registered: &[(usize, usize)]) -> Vec<&'s [Span]> {
    spans.sort_unstable_by_key(|s| (s.addr, s.index));
    let clear = |lo: usize, hi: usize| registered.iter().all(|&(a, b)| hi <= a || b <= lo);
    let mut groups = Vec::new();
    let mut first = 0;
    let mut end = 0usize;
    for (i, s) in spans.iter().enumerate() {
        let joins = i == 0
            || (s.addr < end.saturating_add(MAX_GAP) && (s.end() <= end || clear(end, s.end())));
        if !joins {
            groups.push(first..i);
            first = i;
        }
        end = if joins { end.max(s.end()) } else { s.end() };
    }
    if !spans.is_empty() {
        groups.push(first..spans.len());
    }
    let spans: &'s [Span] = spans;
    groups.into_iter().map(|r| &spans[r]).collect()
}

/// Registers one group (sorted by address, non-empty) as one local-only registration
/// spanning its frames, and fills in each member's descriptor.
#[allow(unsafe_code)] // A region over caller frames (no owner-taking constructor exists).
fn register_group(
    agent: &Agent,
    frames: &[&Bytes],
    group: &[Span],
    descs: &mut [Option<LocalDesc>],
) -> Result<(), MemoryError> {
    let (Some(head), Some(end)) = (group.first(), group.iter().map(Span::end).max()) else {
        return Ok(());
    };
    let base = head.addr;
    let ptr = NonNull::new(base as *mut u8).ok_or(MemoryError::EmptyFrame { index: head.index })?;
    // The region owns every member frame, so their memory lives as long as the region, its
    // registration and every transfer using them.
    let members: Vec<Bytes> = group.iter().map(|s| frames[s.index].clone()).collect();
    // SAFETY: `Region::from_raw_parts` asks that every byte anything accesses through the
    // region be valid for that access until the owner drops, and that no reference observe a
    // transfer's concurrent change:
    // - the span `base..end` runs from the first byte of the lowest member frame to the last
    //   byte of the one that ends last (members are never empty: `source_descs` refuses
    //   empty frames), and is mapped throughout: each gap in it is under a page
    //   (`coalesce` joins a frame only if it starts less than `MAX_GAP` = 4096 bytes after the
    //   group's end) and lies between two member frames, so every page the span touches holds
    //   a byte of some member, live memory of its `Bytes`;
    // - nothing ever accesses a byte outside the member frames: the registration is
    //   local-only (`source_descs` takes this path only where the engine needs no local
    //   registration, and `register_local` then never asks the engine, which registers
    //   nothing, nor lists it, so no peer can name it); its only descriptors, made below,
    //   each name exactly one member frame; and neither the region nor the registration
    //   leaves this function;
    // - those descriptors are only the sources of WRITEs, which read; the member `Bytes` are
    //   immutable (nobody writes them) and `members` keeps each alive, unmoved, until the
    //   region, its registration and every transfer using them are gone.
    let region =
        unsafe { Region::from_raw_parts(ptr, (end - base) as u64, Some(Box::new(members))) }?;
    let reg = agent.register_local(&region)?;
    for s in group {
        let desc = reg.desc((s.addr - base) as u64, s.len as u64)?;
        descs[s.index] = Some(desc);
    }
    Ok(())
}

/// The frame described inside a registration of `agent` that already covers it: `last`, the
/// one the frame before was found in, when it does.
fn find_in_registration(
    agent: &Agent,
    last: &mut Option<Registration>,
    frame: &Bytes,
) -> Option<LocalDesc> {
    let len = frame.len() as u64;
    if let Some(d) = last.as_ref().and_then(|r| r.desc_at(frame.as_ptr(), len)) {
        return Some(d);
    }
    let reg = agent.find_registered(frame.as_ptr(), len)?;
    let desc = reg.desc(0, len).ok()?;
    *last = Some(reg);
    Some(desc)
}

#[allow(unsafe_code)] // A region over a caller frame (no owner-taking constructor exists).
fn register_in_place(agent: &Agent, frame: &Bytes) -> Result<LocalDesc, MemoryError> {
    let len = frame.len() as u64;
    let ptr =
        NonNull::new(frame.as_ptr() as *mut u8).ok_or(MemoryError::EmptyFrame { index: 0 })?;
    // SAFETY: `ptr..ptr + len` is exactly the frame's memory, kept alive, unmoved, by the
    // clone of the `Bytes` that the region owns until the region, its registration and every
    // transfer using it are gone; all of it is valid for reads, so the engine may register
    // the whole range. This crate only ever reads it: as the source of a WRITE, or, for a
    // pulled PUT, by the unit's READ (the protocol's only use of the id it names). Nothing
    // writes these bytes (a `Bytes` is immutable), so no reference observes a concurrent
    // change.
    let region = unsafe { Region::from_raw_parts(ptr, len, Some(Box::new(frame.clone()))) }?;
    let reg = agent.register(&region)?;
    Ok(reg.desc(0, len)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_transport::{Inproc, RegisteredPool};

    fn agent(name: &str) -> Agent {
        Agent::new(name, Inproc::new()).unwrap()
    }

    /// Checks that `descs` name `frames` one for one, in order.
    fn assert_describes(descs: &[LocalDesc], frames: &[Bytes]) {
        assert_eq!(descs.len(), frames.len());
        for (i, (d, f)) in descs.iter().zip(frames).enumerate() {
            assert_eq!(d.as_ptr().cast_const(), f.as_ptr(), "frame {i}'s address");
            assert_eq!(d.len(), f.len() as u64, "frame {i}'s length");
        }
    }

    #[test]
    fn frames_close_together_share_one_local_only_registration() {
        let a = agent("a");
        let buf = Bytes::from(vec![7u8; 64 << 10]);
        // Out of address order, with gaps up to 4095 bytes and an overlap.
        let frames = [
            buf.slice(9_000..9_100),
            buf.slice(0..1_000),
            buf.slice(4_000..5_000),
            buf.slice(900..2_000),
            buf.slice(5_000 + 4_095..14_000),
        ];
        let descs = source_descs(&a, &frames).unwrap();
        assert_describes(&descs, &frames);
        assert!(descs.iter().all(|d| d.reg() == descs[0].reg()), "{descs:?}");
        assert_eq!(descs[1].offset(), 0, "the span starts at the lowest frame");
        assert_eq!(descs[0].offset(), 9_000);
        assert_eq!(a.report().registrations, 0, "local-only: never listed");
        assert!(a.find_registered(buf.as_ptr(), 10).is_none());
        let with_empty = [buf.slice(0..10), Bytes::new(), buf.slice(10..20)];
        assert!(source_descs(&a, &with_empty).is_err(), "an empty frame");
    }

    #[test]
    fn frames_a_page_apart_or_more_are_registered_apart() {
        let a = agent("a");
        let buf = Bytes::from(vec![7u8; 64 << 10]);
        // The middle of another allocation: half a mebibyte from anything else.
        let other = Bytes::from(vec![8u8; 1 << 20]).slice(512 << 10..(512 << 10) + 100);
        let frames = [
            buf.slice(100..200),
            other,
            buf.slice(200 + 4_096..300 + 4_096),
            buf.slice(0..100),
        ];
        let descs = source_descs(&a, &frames).unwrap();
        assert_describes(&descs, &frames);
        assert_eq!(descs[0].reg(), descs[3].reg(), "adjacent");
        assert_ne!(descs[0].reg(), descs[2].reg(), "a gap of 4096 bytes");
        assert_ne!(descs[0].reg(), descs[1].reg());
        assert_ne!(descs[2].reg(), descs[1].reg());
    }

    #[test]
    fn frames_in_a_registration_reuse_it() {
        let a = agent("a");
        let pool = RegisteredPool::new(&a, 1 << 16).unwrap();
        let block = pool.lease(4096, 64).unwrap();
        block.write_at(0, &[3; 4096]).unwrap();
        let pooled = freeze_written(block, 4096).unwrap();
        let heap = Bytes::from(vec![4u8; 300]);
        let frames = [
            heap.slice(0..100),
            pooled.slice(10..20),
            heap.slice(200..300),
        ];
        let descs = source_descs(&a, &frames).unwrap();
        assert_describes(&descs, &frames);
        assert_eq!(descs[1].reg(), pool.registration().id());
        assert_eq!(descs[0].reg(), descs[2].reg());
        assert_ne!(descs[0].reg(), descs[1].reg());
        assert_eq!(a.report().registrations, 1, "the pool's alone");
    }

    /// Frames of two registered blocks in turn, and heap memory between them: each is
    /// described in its own registration, exactly its bytes, whether found by a lookup or
    /// from the registration of the frame before.
    #[test]
    fn frames_of_registered_blocks_in_a_row_are_described_exactly() {
        let a = agent("a");
        let one = RegisteredPool::new(&a, 1 << 16).unwrap();
        let two = RegisteredPool::new(&a, 1 << 16).unwrap();
        let frozen = |pool: &RegisteredPool, byte: u8| {
            let block = pool.lease(4096, 64).unwrap();
            block.write_at(0, &[byte; 4096]).unwrap();
            freeze_written(block, 4096).unwrap()
        };
        let (x, y) = (frozen(&one, 1), frozen(&two, 2));
        let heap = Bytes::from(vec![4u8; 300]);
        let frames = [
            x.slice(0..10),
            x.slice(100..4096),
            x.slice(10..11),
            y.slice(0..64),
            x.slice(64..128),
            heap.slice(0..100),
            y.slice(4000..4096),
            y.slice(64..65),
        ];
        let descs = source_descs(&a, &frames).unwrap();
        assert_describes(&descs, &frames);
        let (r1, r2) = (one.registration().id(), two.registration().id());
        let regs: Vec<u64> = descs.iter().map(LocalDesc::reg).collect();
        assert_eq!(regs[..5], [r1, r1, r1, r2, r1]);
        assert_eq!(regs[6..], [r2, r2]);
        assert!(
            regs[5] != r1 && regs[5] != r2,
            "heap memory registered apart"
        );
    }

    #[test]
    fn groups_never_span_registered_memory() {
        let span = |addr, len, index| Span { addr, len, index };
        let mut spans = [
            span(10_000, 100, 0),
            span(10_200, 100, 1),
            span(12_000, 100, 2),
            span(12_050, 10, 3),
        ];
        // A registration in the gap between the second and third frames splits them.
        let groups = coalesce(&mut spans, &[(11_000, 11_500)]);
        let indexes: Vec<Vec<usize>> = groups
            .iter()
            .map(|g| g.iter().map(|s| s.index).collect())
            .collect();
        assert_eq!(indexes, [vec![0, 1], vec![2, 3]]);
        // Without it they form one group; touching it at an end does not count.
        assert_eq!(coalesce(&mut spans, &[(10_300, 10_300)]).len(), 1);
        assert_eq!(coalesce(&mut spans, &[(9_000, 10_000)]).len(), 1);
        assert_eq!(coalesce(&mut spans, &[]).len(), 1);
        assert!(coalesce(&mut [], &[]).is_empty());
    }

    proptest::proptest! {
        /// Any frames and registered ranges: every frame lands in exactly one group; a group
        /// is sorted, each member starts under a page after the bytes before it, and adds no
        /// byte of a registered range; and a group's first frame could not have joined the
        /// group before.
        #[test]
        fn coalesce_groups_are_sound_and_maximal(
            frames in proptest::collection::vec((0usize..40_000, 1usize..6_000), 0..40),
            registered in proptest::collection::vec((0usize..40_000, 1usize..3_000), 0..4),
        ) {
            let registered: Vec<(usize, usize)> =
                registered.into_iter().map(|(lo, len)| (lo, lo + len)).collect();
            let overlaps = |lo: usize, hi: usize| {
                lo < hi && registered.iter().any(|&(a, b)| lo < b && a < hi)
            };
            let mut spans: Vec<Span> = frames
                .iter()
                .enumerate()
                .map(|(index, &(addr, len))| Span { addr, len, index })
                .collect();
            let groups = coalesce(&mut spans, &registered);
            let mut seen: Vec<usize> = groups.iter().flat_map(|g| g.iter().map(|s| s.index)).collect();
            seen.sort_unstable();
            proptest::prop_assert_eq!(seen, (0..frames.len()).collect::<Vec<_>>());
            let mut prev: Option<(usize, usize)> = None;
            for g in &groups {
                let head = g[0];
                if let Some((prev_head, end)) = prev {
                    proptest::prop_assert!(head.addr >= prev_head, "groups in address order");
                    let could_join = head.addr < end + MAX_GAP
                        && (head.end() <= end || !overlaps(end, head.end()));
                    proptest::prop_assert!(!could_join, "group at {} could have joined", head.addr);
                }
                let mut end = head.end();
                for w in g.windows(2) {
                    proptest::prop_assert!(w[0].addr <= w[1].addr);
                    let s = w[1];
                    proptest::prop_assert!(s.addr < end + MAX_GAP);
                    proptest::prop_assert!(!overlaps(end, s.end()));
                    end = end.max(s.end());
                }
                prev = Some((head.addr, end));
            }
        }
    }

    /// The descriptors of one coalesced registration move exactly the frames' bytes, and the
    /// frames' memory outlives their last user (here the transfer, after every handle of the
    /// caller is gone).
    #[test]
    fn coalesced_sources_write_exactly_the_frames() {
        let a = agent("a");
        let b = agent("b");
        let inbox = Region::new(1 << 16).unwrap();
        let gb = b.register(&inbox).unwrap();
        let peer = a.add_remote(&b.metadata()).unwrap();
        let buf = Bytes::from((0..20_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        let frames = [
            buf.slice(5_000..6_000),
            buf.slice(0..3_000),
            buf.slice(7_000..20_000),
        ];
        let descs = source_descs(&a, &frames).unwrap();
        let mut at = 0;
        let remotes: Vec<RemoteDesc> = frames
            .iter()
            .map(|f| {
                let r = gb.remote(at, f.len() as u64).unwrap();
                at += f.len() as u64;
                r
            })
            .collect();
        let expected: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
        let t = peer.write(&descs, &remotes, None).unwrap();
        drop((descs, frames, buf));
        t.wait().unwrap();
        let mut got = vec![0u8; expected.len()];
        inbox.read_at(0, &mut got).unwrap();
        assert_eq!(got, expected);
    }

    /// A WRITE posted from frames that are not registered moves exactly their bytes, and
    /// their memory outlives their last user (the transfer, holding their owner); an empty
    /// frame is refused before anything moves.
    #[test]
    fn frames_are_written_without_registering_them() {
        let a = agent("a");
        let b = agent("b");
        assert!(!a.local_side_needs_registration());
        let inbox = Region::new(1 << 16).unwrap();
        let gb = b.register(&inbox).unwrap();
        let peer = a.add_remote(&b.metadata()).unwrap();
        let frames: Vec<Bytes> = (0..50u8)
            .map(|i| Bytes::from(vec![i; 100 + usize::from(i)]))
            .collect();
        let mut at = 0;
        let remotes: Vec<RemoteDesc> = frames
            .iter()
            .map(|f| {
                let r = gb.remote(at, f.len() as u64).unwrap();
                at += f.len() as u64;
                r
            })
            .collect();
        let expected: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
        let with_empty = [frames[0].clone(), Bytes::new()];
        let refused = post_write(&a, &peer, &with_empty, Arc::new(()), &remotes[..2]);
        assert!(
            matches!(
                refused,
                Err(PayloadError::Memory(MemoryError::EmptyFrame { index: 1 }))
            ),
            "{refused:?}"
        );
        let frames = Arc::new(frames);
        let t = post_write(&a, &peer, frames.iter(), frames.clone(), &remotes).unwrap();
        drop(frames);
        t.wait().unwrap();
        let mut got = vec![0u8; expected.len()];
        inbox.read_at(0, &mut got).unwrap();
        assert_eq!(got, expected);
        assert_eq!(a.report().copied_write_bytes, expected.len() as u64);
    }

    /// Where the engine needs a real local registration, each frame is registered alone,
    /// exactly its own bytes, and listed like any registration.
    #[cfg(feature = "ucx")]
    #[test]
    fn ucx_registers_each_frame_alone() {
        let a = Backend::Ucx.role_agent("plane").unwrap();
        assert!(a.local_side_needs_registration());
        let buf = Bytes::from(vec![7u8; 16 << 10]);
        let frames = [buf.slice(0..100), buf.slice(200..300), buf.slice(300..400)];
        let descs = source_descs(&a, &frames).unwrap();
        assert_describes(&descs, &frames);
        assert_ne!(descs[0].reg(), descs[1].reg());
        assert_ne!(descs[1].reg(), descs[2].reg());
        assert!(descs.iter().all(|d| d.offset() == 0));
        assert_eq!(a.report().registrations, 3);
        assert_eq!(a.report().registered_bytes, 300);
    }

    /// Without its feature, `ucx` or `nixl` is an error naming the feature; with it, a
    /// payload address is refused naming UCX_NET_DEVICES. Never another engine instead.
    #[test]
    fn ucx_and_nixl_refuse_what_they_cannot_honour() {
        let addr = Some("127.0.0.1:0".parse().unwrap());
        for b in [Backend::Ucx, Backend::Nixl] {
            let err = b.role_agent_at("t", addr, None).unwrap_err().to_string();
            let expected = if b.available() {
                "UCX_NET_DEVICES".to_owned()
            } else {
                format!("cargo feature `{}`", b.name())
            };
            assert!(err.contains(&expected), "{err}");
        }
    }
}
