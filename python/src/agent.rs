//! Agents, peers and the tensor pools of Ray RDT's shape: a sender packs tensors into its
//! registered pool and hands out one descriptor; a receiver reads the object into its own
//! pool with one READ and gives each block back when the last view of it is gone.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::IntoPyObjectExt;
use tessera_engines::{EngineKind, EngineOptions};
use tessera_rdt_pool::{ObjectDescriptor, PoolReport, ReceiverPool, SenderPool, TensorRef};
use tessera_transport::{Agent, LocalDesc, Peer, Region};

use crate::convert::{self, TensorType};
use crate::errors::{self, field};
use crate::runtime;

fn same_process(pid: u32) -> PyResult<()> {
    if pid == std::process::id() {
        Ok(())
    } else {
        Err(errors::forked(pid))
    }
}

/// A named endpoint of one engine: registers memory, publishes metadata, adds peers.
#[pyclass(name = "Agent", module = "tessera", frozen)]
pub(crate) struct PyAgent {
    agent: Arc<Agent>,
    backend: EngineKind,
    pid: u32,
}

impl PyAgent {
    /// The agent, for the bench functions.
    pub(crate) fn inner(&self) -> PyResult<Arc<Agent>> {
        same_process(self.pid)?;
        Ok(self.agent.clone())
    }
}

#[pymethods]
impl PyAgent {
    #[new]
    #[pyo3(signature = (name, backend="shm", *, token=None, tcp_bind=None))]
    fn new(
        py: Python<'_>,
        name: String,
        backend: &str,
        token: Option<&Bound<'_, PyAny>>,
        tcp_bind: Option<&str>,
    ) -> PyResult<Self> {
        let kind: EngineKind = backend
            .parse()
            .map_err(|e: tessera_engines::UnknownEngine| {
                errors::error(
                    "ConfigError",
                    e.to_string(),
                    vec![field("backend", backend.to_owned())],
                )
            })?;
        let tcp_bind = tcp_bind
            .map(|a| {
                a.parse::<SocketAddr>().map_err(|e| {
                    errors::error("ConfigError", format!("tcp_bind {a:?}: {e}"), Vec::new())
                })
            })
            .transpose()?;
        let options = EngineOptions {
            token: crate::storage::token(token)?,
            tcp_bind,
            ..EngineOptions::default()
        };
        let agent = py
            .detach(|| kind.agent_with(&name, &options))
            .map_err(errors::engine)?;
        Ok(Self {
            agent: Arc::new(agent),
            backend: kind,
            pid: std::process::id(),
        })
    }

    #[getter]
    fn name(&self) -> &str {
        self.agent.name()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.backend.name()
    }

    /// What a peer needs to reach this agent: opaque bytes, sent any way.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        same_process(self.pid)?;
        let md = py.detach(|| self.agent.metadata());
        Ok(PyBytes::new(py, &md))
    }

    /// Adds (or refreshes) the peer whose metadata this is.
    fn add_remote(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<PyPeer> {
        same_process(self.pid)?;
        let md = metadata.to_vec();
        let peer = py
            .detach(|| self.agent.add_remote(&md))
            .map_err(errors::connect)?;
        Ok(PyPeer {
            peer,
            applied: Mutex::new(md),
            pid: self.pid,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "tessera.Agent({:?}, backend={:?})",
            self.agent.name(),
            self.backend.name()
        )
    }
}

/// A forked child leaks an inherited agent (see `PyClient`'s `Drop`): its engine's threads are
/// the parent's.
impl Drop for PyAgent {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(self.agent.clone());
        }
    }
}

impl Drop for PySenderPool {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(self.pool.clone());
        }
    }
}

impl Drop for PyReceiverPool {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(self.pool.clone());
        }
    }
}

/// A peer of an agent, from its metadata.
#[pyclass(name = "Peer", module = "tessera", frozen)]
pub(crate) struct PyPeer {
    peer: Peer,
    /// The peer's metadata this handle last learned (from `add_remote` or a descriptor).
    applied: Mutex<Vec<u8>>,
    pid: u32,
}

#[pymethods]
impl PyPeer {
    #[getter]
    fn name(&self) -> &str {
        self.peer.name()
    }

    fn __repr__(&self) -> String {
        format!("tessera.Peer({:?})", self.peer.name())
    }
}

fn report_dict(py: Python<'_>, r: PoolReport) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    d.set_item("capacity", r.capacity)?;
    d.set_item("used", r.used)?;
    d.set_item("leased", r.leased)?;
    d.set_item("quarantined", r.quarantined)?;
    d.set_item("free", r.free)?;
    d.set_item("largest_free", r.largest_free)?;
    d.set_item("live_objects", r.live_objects)?;
    d.set_item("in_place", r.in_place)?;
    d.into_py_any(py)
}

/// What `SenderPool.put` returns: the object descriptor with the sender agent's metadata at
/// the time of the put, so that a receiver whose peer handle predates the pool (or a pool that
/// has registered more since) learns the registrations the descriptor names.
/// `MAGIC`, the metadata's length (u32, little-endian), the metadata, the descriptor.
const MAGIC: &[u8; 4] = b"TSO1";

fn envelope(metadata: &[u8], descriptor: &[u8]) -> PyResult<Vec<u8>> {
    let len = u32::try_from(metadata.len())
        .map_err(|_| errors::tessera("agent metadata over 4 GiB".into()))?;
    let mut out = Vec::with_capacity(8 + metadata.len() + descriptor.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(metadata);
    out.extend_from_slice(descriptor);
    Ok(out)
}

/// The sender's metadata and the descriptor of an envelope.
fn open_envelope(bytes: &[u8]) -> PyResult<(&[u8], &[u8])> {
    let bad = || {
        errors::error(
            "DescriptorError",
            "not an object descriptor from tessera.rdt.SenderPool.put".into(),
            Vec::new(),
        )
    };
    let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or_else(bad)?;
    let (len, rest) = rest.split_first_chunk::<4>().ok_or_else(bad)?;
    let len = u32::from_le_bytes(*len) as usize;
    if rest.len() < len {
        return Err(bad());
    }
    Ok(rest.split_at(len))
}

/// An object id: `str` or `bytes`.
fn object_id(id: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = id.extract::<String>() {
        return Ok(s.into_bytes());
    }
    id.extract::<Vec<u8>>()
        .map_err(|_| errors::value_type("an object id is a str or bytes".into()))
}

/// Bytes of a put copied from borrowed views with the GIL held, at most (see `put`).
const BORROW_MAX: usize = 1 << 20;

/// A put's reference to a borrowed view's bytes.
fn borrowed_ref(v: &convert::View) -> PyResult<TensorRef<'_>> {
    let data: &[u8] = if v.span == 0 {
        &[]
    } else {
        // SAFETY: `v` is a producer's view of a tensor that the caller's `objs` keeps alive,
        // and the GIL stays held from when the view was taken until the put has copied these
        // bytes, so no Python code can free or resize the memory meanwhile; `span` bytes from
        // `ptr` reach past its last element.
        unsafe { std::slice::from_raw_parts(v.ptr, v.span) }
    };
    let r = match &v.strides {
        None => TensorRef::new(v.dtype, &v.shape, data),
        Some(st) => TensorRef::strided(v.dtype, &v.shape, st, data),
    };
    r.map_err(|e| errors::error("CodecError", errors::chain(&e), Vec::new()))
}

/// The sender's pool: `put` copies tensors into registered blocks (tensors already in memory
/// registered with the agent are described in place) and returns the object's descriptor.
#[pyclass(name = "SenderPool", module = "tessera.rdt", frozen)]
pub(crate) struct PySenderPool {
    pool: SenderPool,
    pid: u32,
}

#[pymethods]
impl PySenderPool {
    #[new]
    #[pyo3(signature = (agent, capacity))]
    fn new(py: Python<'_>, agent: &PyAgent, capacity: u64) -> PyResult<Self> {
        same_process(agent.pid)?;
        let a = agent.agent.clone();
        let pool = py
            .detach(|| SenderPool::new(a, capacity))
            .map_err(errors::pool)?;
        Ok(Self {
            pool,
            pid: agent.pid,
        })
    }

    /// Puts `tensors` under `id` and returns the descriptor (bytes) a receiver fetches with.
    fn put<'py>(
        &self,
        py: Python<'py>,
        id: &Bound<'py, PyAny>,
        tensors: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        same_process(self.pid)?;
        let id = object_id(id)?;
        let objs: Vec<Bound<'py, PyAny>> = tensors
            .try_iter()
            .map_err(|_| errors::value_type("put takes a sequence of tensors".into()))?
            .collect::<PyResult<_>>()?;
        // Small tensors of a producer with a borrowed view (torch) are copied from that view
        // with the GIL held: no managed tensor, no handle to release per tensor. Otherwise
        // (or past `BORROW_MAX` bytes in all) the tensors are held through handles that keep
        // their memory alive, and the copy runs without the GIL.
        let mut views = Vec::with_capacity(objs.len());
        let mut borrowed = 0usize;
        let mut apis = Vec::new();
        for obj in &objs {
            match convert::borrowed_view(obj, &mut apis)? {
                Some(v) if borrowed + v.span <= BORROW_MAX => {
                    borrowed += v.span;
                    views.push(Some(v));
                }
                _ => views.push(None),
            }
        }
        // (Index, tensor) of those without a borrowed view: none at all in the common case
        // of small torch tensors.
        let mut owned: Vec<(usize, tessera_framecodec::Tensor)> = Vec::new();
        for (i, (obj, v)) in objs.iter().zip(&views).enumerate() {
            if v.is_none() {
                owned.push((i, convert::tensor(obj)?));
            }
        }
        let mut refs: Vec<TensorRef<'_>> = Vec::with_capacity(objs.len());
        let mut next_owned = owned.iter().peekable();
        for (i, v) in views.iter().enumerate() {
            refs.push(match (v, next_owned.next_if(|(at, _)| *at == i)) {
                (_, Some((_, t))) => TensorRef::from_tensor(t),
                (Some(v), None) => borrowed_ref(v)?,
                (None, None) => return Err(errors::tessera("a tensor without a source".into())),
            });
        }
        let pool = &self.pool;
        let put = || {
            let desc = pool.put(&id, &refs)?;
            Ok::<_, tessera_rdt_pool::PutError>((desc, pool.agent().metadata()))
        };
        let (desc, metadata) =
            if borrowed > 0 { put() } else { py.detach(put) }.map_err(errors::put)?;
        drop(refs);
        drop(owned);
        crate::release::drain(py);
        let bytes = desc.to_bytes().map_err(errors::descriptor)?;
        Ok(PyBytes::new(py, &envelope(&metadata, &bytes)?))
    }

    /// Frees `id`'s blocks (receivers must be done reading it).
    fn free(&self, id: &Bound<'_, PyAny>) -> PyResult<()> {
        same_process(self.pid)?;
        self.pool.free(object_id(id)?).map_err(errors::free)
    }

    fn __contains__(&self, id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.pool.contains(object_id(id)?))
    }

    fn report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        report_dict(py, self.pool.report())
    }
}

/// How a fetch ended.
enum Fetched<T> {
    Done(T),
    Failed(tessera_rdt_pool::FetchError),
    TimedOut,
    Cancelled,
}

impl<T> Fetched<T> {
    /// The fetched value, or the Python error of how it ended.
    fn into_result(self, peer: &str, after: Duration) -> PyResult<T> {
        match self {
            Fetched::Done(t) => Ok(t),
            Fetched::Failed(e) => Err(errors::fetch(e)),
            Fetched::TimedOut => Err(errors::error(
                "TesseraTimeout",
                format!("fetch from peer {peer:?}: no completion within {after:?}"),
                vec![field("after", after.as_secs_f64())],
            )),
            Fetched::Cancelled => Err(errors::error(
                "TransferError",
                format!("fetch from peer {peer:?}: cancelled"),
                vec![field("cancelled", true)],
            )),
        }
    }
}

/// `fetch` until it resolves, `cancel` is set or `after` has passed; a cancellation wins over
/// a completion that comes at the same time. What `fetch` holds is dropped when it loses: a
/// pool fetch then quarantines its blocks, and a READ's plan keeps its memory until it
/// resolves.
async fn until_resolved<T>(
    fetch: impl std::future::Future<Output = Result<T, tessera_rdt_pool::FetchError>>,
    cancel: Option<Arc<Cancellation>>,
    after: Duration,
) -> Fetched<T> {
    let cancelled = async {
        match &cancel {
            Some(c) => c.cancelled().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        _ = cancelled => Fetched::Cancelled,
        r = fetch => match r {
            Ok(t) => Fetched::Done(t),
            Err(e) => Fetched::Failed(e),
        },
        _ = tokio::time::sleep(after) => Fetched::TimedOut,
    }
}

/// A cancellation that any thread may set, once; fetches given it end when it is set.
#[derive(Default)]
pub(crate) struct Cancellation {
    set: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

impl Cancellation {
    async fn cancelled(&self) {
        loop {
            let notified = self.notify.notified();
            if self.set.load(std::sync::atomic::Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }
}

/// `tessera.rdt.Cancel`: pass it to `ReceiverPool.fetch(..., cancel=c)`, call `c.cancel()`
/// from anywhere to abort the fetch.
#[pyclass(name = "Cancel", module = "tessera.rdt", frozen)]
pub(crate) struct PyCancel {
    inner: Arc<Cancellation>,
}

#[pymethods]
impl PyCancel {
    #[new]
    fn new() -> Self {
        Self {
            inner: Arc::new(Cancellation::default()),
        }
    }

    /// Aborts the fetches given this (now and later). Idempotent.
    fn cancel(&self) {
        self.inner
            .set
            .store(true, std::sync::atomic::Ordering::Release);
        self.inner.notify.notify_waiters();
    }

    #[getter]
    fn cancelled(&self) -> bool {
        self.inner.set.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl PyReceiverPool {
    /// The caller's `into` tensors as destinations of the object's tensors: each checked
    /// against its tensor's dtype and shape, and registered for this pool's agent as the
    /// local side of a READ (a registration holds the Python object until dropped).
    fn targets<'py>(
        &self,
        into: &Bound<'py, PyAny>,
        desc: &ObjectDescriptor,
    ) -> PyResult<(Bound<'py, PyList>, Vec<Option<LocalDesc>>)> {
        let targets = PyList::empty(into.py());
        for obj in into.try_iter()? {
            targets.append(obj?)?;
        }
        if targets.len() != desc.tensors.len() {
            return Err(errors::usage(format!(
                "into= gives {} tensors for an object of {}",
                targets.len(),
                desc.tensors.len()
            )));
        }
        let agent = self.pool.agent();
        let mut dsts = Vec::with_capacity(targets.len());
        for (i, (obj, t)) in targets.iter().zip(&desc.tensors).enumerate() {
            let target = convert::target(&obj)?;
            if target.dtype != t.dtype || target.shape.as_slice() != &t.shape[..] {
                return Err(errors::usage(format!(
                    "into[{i}] is {}{:?}; the object's tensor {i} is {}{:?}",
                    target.dtype.name(),
                    target.shape,
                    t.dtype.name(),
                    &t.shape[..]
                )));
            }
            let Some(ptr) = std::ptr::NonNull::new(target.ptr).filter(|_| target.len > 0) else {
                dsts.push(None);
                continue;
            };
            let len = target.len as u64;
            let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(Mutex::new(target.hold));
            // SAFETY: `ptr..ptr + len` is the writable, contiguous host memory of the target
            // tensor, valid while the export in `owner` (a DLPack import or a buffer export of
            // the Python object) is held, which the region keeps until it drops; nothing in
            // this package reads or writes it through references. The caller gave the tensor
            // to be written and does not touch it until the fetch returns.
            let region = unsafe { Region::from_raw_parts(ptr, len, Some(owner)) }
                .map_err(|e| errors::usage(format!("into[{i}]: {e}")))?;
            let reg = agent
                .register_local(&region)
                .map_err(|e| errors::error("EngineError", errors::chain(&e), Vec::new()))?;
            dsts.push(Some(
                reg.desc(0, len)
                    .map_err(|e| errors::usage(format!("into[{i}]: {e}")))?,
            ));
        }
        Ok((targets, dsts))
    }

    /// Brings `peer` up to the sender's `metadata` from a descriptor, if it changed.
    fn learn(&self, py: Python<'_>, peer: &PyPeer, metadata: &[u8]) -> PyResult<()> {
        let mut applied = peer.applied.lock().unwrap_or_else(|e| e.into_inner());
        if applied.as_slice() == metadata {
            return Ok(());
        }
        let agent = self.pool.agent();
        let fresh = py
            .detach(|| agent.add_remote(metadata))
            .map_err(errors::connect)?;
        if fresh.name() != peer.peer.name() {
            return Err(errors::error(
                "DescriptorError",
                format!(
                    "the object was put by agent {:?}, and is fetched from peer {:?}",
                    fresh.name(),
                    peer.peer.name()
                ),
                Vec::new(),
            ));
        }
        *applied = metadata.to_vec();
        Ok(())
    }
}

/// The receiver's pool: `fetch` reads an object into its blocks with one READ; the views it
/// returns keep their block, which returns when the last view of it is gone.
#[pyclass(name = "ReceiverPool", module = "tessera.rdt", frozen)]
pub(crate) struct PyReceiverPool {
    pool: ReceiverPool,
    tensor_type: TensorType,
    pid: u32,
}

#[pymethods]
impl PyReceiverPool {
    #[new]
    #[pyo3(signature = (agent, capacity, *, tensor_type="numpy"))]
    fn new(py: Python<'_>, agent: &PyAgent, capacity: u64, tensor_type: &str) -> PyResult<Self> {
        same_process(agent.pid)?;
        let tensor_type = TensorType::parse(tensor_type)?;
        let a = agent.agent.clone();
        let pool = py
            .detach(|| ReceiverPool::new(a, capacity))
            .map_err(errors::pool)?;
        Ok(Self {
            pool,
            tensor_type,
            pid: agent.pid,
        })
    }

    /// Reads the object `descriptor` describes from `peer`; its tensors, in put order.
    /// `cancel` (a [`PyCancel`]) aborts it from another thread: the fetch then fails with
    /// `TransferError`, and its blocks return once the READ has resolved.
    ///
    /// `into`: the caller's own tensors, one per tensor of the object, of its dtype and
    /// shape, contiguous and writable; the READ lands in them directly (no pool block, no
    /// copy) and they are returned. A fetch that fails, times out or is cancelled leaves
    /// their contents undefined, and holds them until its READ has resolved.
    #[pyo3(signature = (descriptor, peer, *, timeout=60.0, cancel=None, into=None))]
    fn fetch(
        &self,
        py: Python<'_>,
        descriptor: &[u8],
        peer: &PyPeer,
        timeout: f64,
        cancel: Option<&PyCancel>,
        into: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        same_process(self.pid)?;
        same_process(peer.pid)?;
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(errors::usage(format!(
                "timeout must be a positive number of seconds, not {timeout}"
            )));
        }
        let (metadata, descriptor) = open_envelope(descriptor)?;
        let desc = ObjectDescriptor::from_bytes(descriptor).map_err(errors::descriptor)?;
        self.learn(py, peer, metadata)?;
        let pool = self.pool.clone();
        let peer_name = peer.peer.name().to_owned();
        let peer = peer.peer.clone();
        let after = Duration::from_secs_f64(timeout);
        let cancel = cancel.map(|c| c.inner.clone());
        if let Some(into) = into {
            let (targets, dsts) = self.targets(into, &desc)?;
            let transfer = py
                .detach(|| pool.read_into_tensors(&desc, &peer, &dsts))
                .map_err(errors::fetch)?;
            if let Some(transfer) = transfer {
                // A READ given up on (timeout, cancel) is dropped here with the destinations;
                // the engine's plan of it holds their registrations, and so the caller's
                // memory, until it resolves.
                let outcome = runtime::wait(
                    py,
                    until_resolved(
                        async move {
                            let r = transfer.await;
                            drop(dsts);
                            r.map_err(tessera_rdt_pool::FetchError::Transfer)
                        },
                        cancel,
                        after,
                    ),
                )?;
                outcome.into_result(&peer_name, after)?;
            }
            return targets.into_py_any(py);
        }
        // A fetch given up on (timeout, cancel) is dropped, which quarantines its blocks until
        // the READ resolves.
        let outcome = runtime::wait(
            py,
            until_resolved(
                async move {
                    match pool.fetch(&desc, &peer) {
                        Ok(f) => f.await,
                        Err(e) => Err(e),
                    }
                },
                cancel,
                after,
            ),
        )?;
        let tensors = outcome.into_result(&peer_name, after)?;
        let list = PyList::empty(py);
        for t in tensors {
            list.append(convert::tensor_to_py(py, t, self.tensor_type)?)?;
        }
        list.into_py_any(py)
    }

    fn report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        report_dict(py, self.pool.report())
    }
}
