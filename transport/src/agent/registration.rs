//! Registration guards: windows onto registered ranges, and the descriptors cut from them.

use std::fmt;

use crate::desc::{LocalDesc, RemoteDesc};
use crate::error::DescError;
use crate::exposure::{Exposure, Ops};
use crate::registry::RegEntry;
use crate::transfer::KeepAlive;
use crate::Region;
use tessera_sync::Arc;

/// A registration guard: a window onto a registered range. Cloning is cheap; the range is
/// deregistered when the last guard, descriptor and transfer on it are gone.
#[derive(Clone)]
#[must_use = "dropping the last guard deregisters the memory"]
pub struct Registration {
    pub(crate) entry: Arc<RegEntry>,
    /// Window start, relative to the registration.
    pub(crate) start: u64,
    pub(crate) len: u64,
}

impl Registration {
    /// The registration's id, as peers name it.
    pub fn id(&self) -> u64 {
        self.entry.id
    }

    /// Length of this window.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where this window starts inside the registration that peers see (non-zero when the
    /// cache answered with a larger registration).
    pub fn offset_in_registration(&self) -> u64 {
        self.start
    }

    /// The region this registration covers.
    pub fn region(&self) -> &Region {
        &self.entry.region
    }

    /// Address of the window's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.entry.base().wrapping_add(self.start as usize)
    }

    /// A local descriptor of the `len` bytes at address `ptr`, when they lie inside this
    /// registration (`None` otherwise, and for `len` 0), wherever this window is: for many
    /// buffers of one registered block in a row (the frames of a batch of values), found once
    /// with [`Agent::find_registered`] and not looked up again. Where registrations overlap,
    /// the registry may answer another one that covers them as well.
    ///
    /// [`Agent::find_registered`]: crate::Agent::find_registered
    pub fn desc_at(&self, ptr: *const u8, len: u64) -> Option<LocalDesc> {
        let offset = (ptr as u64).checked_sub(self.entry.base() as u64)?;
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= self.entry.len => Some(LocalDesc {
                reg: self.entry.clone(),
                offset,
                len,
                keep: None,
            }),
            _ => None,
        }
    }

    fn window(&self, offset: u64, len: u64) -> Result<u64, DescError> {
        if len == 0 {
            return Err(DescError::Empty);
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.start + offset),
            _ => Err(DescError::OutOfRange {
                reg: self.entry.id,
                offset,
                len,
                reg_len: self.len,
            }),
        }
    }

    /// A local descriptor of `len` bytes at `offset` in this window.
    pub fn desc(&self, offset: u64, len: u64) -> Result<LocalDesc, DescError> {
        Ok(LocalDesc {
            offset: self.window(offset, len)?,
            reg: self.entry.clone(),
            len,
            keep: None,
        })
    }

    /// Like [`Registration::desc`], also keeping `keep` alive as long as the descriptor and
    /// any transfer using it.
    pub fn desc_keeping(
        &self,
        offset: u64,
        len: u64,
        keep: KeepAlive,
    ) -> Result<LocalDesc, DescError> {
        let mut d = self.desc(offset, len)?;
        d.keep = Some(keep);
        Ok(d)
    }

    /// Lets peer `peer` touch `len` bytes at `offset` of this window with `ops`, until the
    /// returned [`Exposure`] drops; it also counts the bytes that peer's completed WRITEs
    /// covered. On a scoped registration ([`Agent::register_scoped`](crate::Agent::register_scoped))
    /// this is the only way a peer reaches it; on an unscoped one it only counts.
    pub fn expose(
        &self,
        peer: &str,
        offset: u64,
        len: u64,
        ops: Ops,
    ) -> Result<Exposure, DescError> {
        let start = self.window(offset, len)?;
        Ok(self.entry.scope.expose(peer, start, len, ops, None))
    }

    /// Like [`Registration::expose`] for WRITEs, and announced to the engine as standing
    /// ([`Transport::standing`](crate::engine::Transport::standing)): an engine whose
    /// initiator asks for a grant before each transfer (`shm`) hands it to the peer's side
    /// now, so that the peer's WRITEs inside it need no round trip until it drops. For ranges
    /// a peer writes right after learning of them (a landing block kept ready for a client);
    /// the target still checks every WRITE it sees against its exposures. A registration this
    /// agent's engine never saw (local only) has nobody to announce to and is refused.
    pub fn expose_standing(
        &self,
        peer: &str,
        offset: u64,
        len: u64,
    ) -> Result<Exposure, DescError> {
        let start = self.window(offset, len)?;
        let exposure = self.entry.scope.expose(peer, start, len, Ops::WRITE, None);
        match &self.entry.listed {
            Some(listed) => Ok(exposure.announce(listed.engine.clone(), self.entry.id)),
            None => Err(DescError::Local { reg: self.entry.id }),
        }
    }

    pub(crate) fn expose_keeping(
        &self,
        peer: &str,
        offset: u64,
        len: u64,
        ops: Ops,
        keep: KeepAlive,
    ) -> Result<Exposure, DescError> {
        let start = self.window(offset, len)?;
        Ok(self.entry.scope.expose(peer, start, len, ops, Some(keep)))
    }

    /// Whether the registration is scoped (see [`Registration::expose`]).
    pub fn is_scoped(&self) -> bool {
        self.entry.scope.enforced
    }

    /// The same range as a peer names it, to send to the peer.
    pub fn remote(&self, offset: u64, len: u64) -> Result<RemoteDesc, DescError> {
        Ok(RemoteDesc::new(
            self.entry.id,
            self.window(offset, len)?,
            len,
        ))
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.entry.id)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}
