//! Test support, not part of the crate's contract: heap memory for driving the protocol core
//! ([`Unit`](crate::core::Unit)) without a transport or a registered pool. The crate's own
//! unit and loom tests and its integration tests share it.

use bytes::Bytes;

/// Runs futures concurrently on the current task and returns their outputs in order (what the
/// client uses to fan a request out to several units).
pub use crate::client::join_all;
use tessera_transport::RemoteDesc;

use crate::core::{Exposed, Landing, Memory, PoolStats, Written};
use crate::error::MemoryError;
use tessera_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tessera_sync::unchecked::{AtomicBool as StdAtomicBool, Ordering as StdOrdering};
use tessera_sync::Arc;

/// Heap memory that counts the bytes of its live blocks and refuses a lease past its
/// capacity. Every block is named to peers as registration 1 at the block's offsets. Clones
/// share the count.
#[derive(Clone)]
pub struct VecMem {
    live: Arc<AtomicU64>,
    cap: u64,
    /// Whether exposed frames count as written (see [`VecMem::writes_land`]).
    land: Arc<AtomicBool>,
}

impl VecMem {
    /// Memory that leases at most `cap` bytes at once.
    pub fn new(cap: u64) -> Self {
        Self {
            live: Arc::new(AtomicU64::new(0)),
            cap,
            land: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Whether a pushed PUT's frames count as written when its COMMIT comes (true at first):
    /// false plays a client that COMMITs without WRITEing. Clones share it.
    pub fn writes_land(&self, land: bool) {
        self.land.store(land, Ordering::SeqCst);
    }

    /// Bytes in blocks not yet dropped.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::SeqCst)
    }
}

/// A block of [`VecMem`]; dropping it gives its bytes back to the count.
pub struct VecBlock {
    buf: Vec<u8>,
    live: Arc<AtomicU64>,
}

impl Drop for VecBlock {
    fn drop(&mut self) {
        self.live.fetch_sub(self.buf.len() as u64, Ordering::SeqCst);
    }
}

impl AsRef<[u8]> for VecBlock {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Memory for VecMem {
    type Block = VecBlock;
    fn lease(&mut self, size: u64, align: u64) -> Result<VecBlock, MemoryError> {
        if self.live().saturating_add(size) > self.cap {
            let free = self.cap.saturating_sub(self.live());
            return Err(tessera_alloc::AllocError::OutOfMemory {
                requested: size,
                align,
                free,
                largest_free: free,
            }
            .into());
        }
        self.live.fetch_add(size, Ordering::SeqCst);
        Ok(VecBlock {
            buf: vec![0; size as usize],
            live: self.live.clone(),
        })
    }
    type Dest = RemoteDesc;
    fn dest(&self, block: &VecBlock, offset: u64, len: u64) -> Result<RemoteDesc, MemoryError> {
        self.remote(block, offset, len)
    }
    fn remote(&self, _block: &VecBlock, offset: u64, len: u64) -> Result<RemoteDesc, MemoryError> {
        Ok(RemoteDesc::new(1, offset, len))
    }
    fn freeze(&self, block: VecBlock, len: u64) -> Bytes {
        Bytes::from_owner(block).slice(..len as usize)
    }
    fn block_len(block: &VecBlock) -> u64 {
        block.buf.len() as u64
    }
    fn shrink(block: &mut VecBlock, len: u64) {
        let len = len as usize;
        if len < block.buf.len() {
            let freed = (block.buf.len() - len) as u64;
            block.buf.truncate(len);
            block.buf.shrink_to_fit();
            block.live.fetch_sub(freed, Ordering::SeqCst);
        }
    }
    fn expose_landing(
        &self,
        _block: &VecBlock,
        _peer: &str,
    ) -> Result<crate::core::Landed, MemoryError> {
        Ok(Arc::new(Lands(self.land.clone())))
    }
    fn copy_in(&mut self, data: &[u8], align: u64) -> Result<Bytes, MemoryError> {
        let mut block = self.lease(data.len() as u64, align)?;
        block.buf.copy_from_slice(data);
        Ok(Bytes::from_owner(block))
    }
    fn expose(
        &self,
        _block: &VecBlock,
        _peer: &str,
        _ranges: &[(u64, u64)],
    ) -> Result<Exposed, MemoryError> {
        Ok(Arc::new(Lands(self.land.clone())))
    }
    fn usage(&self) -> PoolStats {
        PoolStats {
            capacity: self.cap,
            used: self.live(),
            ..PoolStats::default()
        }
    }
}

/// The client's side of a session's handshake, for tests that speak the protocol by hand.
pub mod handshake {
    use serde_bytes::ByteBuf;
    use tessera_transport::auth::{self, Nonce, Token};

    use crate::proto::{handshake_parts, Request, Response, CLIENT_PROOF, UNIT_PROOF};

    /// A client's half-done handshake: its nonce and agent metadata.
    pub struct Hello {
        nonce: Nonce,
        agent: Vec<u8>,
    }

    impl Hello {
        /// A fresh Hello naming `agent`.
        pub fn new(agent: Vec<u8>) -> Self {
            Self {
                nonce: auth::nonce(),
                agent,
            }
        }

        /// The Hello to send.
        pub fn request(&self) -> Request {
            Request::Hello {
                nonce: ByteBuf::from(self.nonce.to_vec()),
                agent: self.agent.clone(),
            }
        }

        /// The Auth answering the unit's `Challenge`, proving `token` (the unit's proof is
        /// not checked: tests may play a client that ignores it). Panics on another answer.
        pub fn auth(&self, challenge: &Response, token: Option<&Token>) -> Request {
            let Response::Challenge { nonce, .. } = challenge else {
                panic!("no challenge: {challenge:?}");
            };
            let parts = handshake_parts(&self.nonce, nonce, &self.agent);
            Request::Auth {
                proof: ByteBuf::from(auth::prove(token, CLIENT_PROOF, &parts).to_vec()),
            }
        }

        /// Whether the unit's `Challenge` proves `token`.
        pub fn unit_proves(&self, challenge: &Response, token: Option<&Token>) -> bool {
            let Response::Challenge { nonce, proof } = challenge else {
                return false;
            };
            let parts = handshake_parts(&self.nonce, nonce, &self.agent);
            auth::check(token, UNIT_PROOF, &parts, proof)
        }
    }

    /// Says Hello and Auth (request ids `first`, `first + 1`) to session `session` of `unit`
    /// and returns what the unit answered the Auth (an `Accept` when `token` is right).
    pub fn open<M: crate::core::Memory>(
        unit: &mut crate::core::Unit<M>,
        now: std::time::Instant,
        session: crate::core::SessionId,
        first: u64,
        agent: Vec<u8>,
        token: Option<&Token>,
    ) -> Vec<crate::core::Output<M::Dest>> {
        let h = Hello::new(agent);
        let out = unit.handle(now, session, first, h.request());
        let challenge = match out.as_slice() {
            [crate::core::Output::Reply { response, .. }] => response.clone(),
            _ => return out,
        };
        unit.handle(now, session, first + 1, h.auth(&challenge, token))
    }
}

/// A [`VecMem`] PUT's frames: written when the memory says WRITEs land.
struct Lands(Arc<AtomicBool>);

impl Written for Lands {
    fn is_written(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A [`VecMem`] credit: every range counts as written when the memory says WRITEs land.
impl Landing for Lands {
    fn ranges_written(&self, _ranges: &[(u64, u64)]) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The cpu the calling thread runs on now.
#[allow(unsafe_code)] // FFI: sched_getcpu(3).
pub fn current_cpu() -> usize {
    // SAFETY: sched_getcpu takes no arguments.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).expect("sched_getcpu")
}

/// Pins the calling thread to `cpu`; false where it may not run there.
#[allow(unsafe_code)] // FFI: sched_setaffinity(2).
pub fn pin(cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity are
    // given that set and its size, for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of_val(&set), &set) == 0
    }
}

/// A thread of the normal scheduling class spinning on one cpu, wanting it all, until
/// dropped.
pub struct Spinner {
    stop: Arc<StdAtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    /// Starts spinning on `cpu`.
    pub fn on(cpu: usize) -> Spinner {
        let stop = Arc::new(StdAtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                assert!(pin(cpu), "pinning a spinner to cpu {cpu}");
                while !stop.load(StdOrdering::Relaxed) {
                    std::hint::spin_loop();
                }
            }
        });
        Spinner {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.stop.store(true, StdOrdering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
