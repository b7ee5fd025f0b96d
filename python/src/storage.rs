//! `tessera.storage`'s native half: a unit embedded in this process ([`PyServer`]) and a
//! client of units ([`PyClient`]), blocking or awaitable.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use pyo3::IntoPyObjectExt;
use tessera_storage::{
    Backend, Client, ClientConfig, Modulo, Placement, Rendezvous, Server, ServerConfig, Token,
    Value,
};

use crate::convert::{self, TensorType};
use crate::errors::{self, field};
use crate::runtime;

/// A `Serialize` value as Python objects (through JSON: stats and reports, not payloads).
pub(crate) fn to_python<T: serde::Serialize>(py: Python<'_>, v: &T) -> PyResult<Py<PyAny>> {
    let text = serde_json::to_string(v)
        .map_err(|e| errors::tessera(format!("encoding statistics: {e}")))?;
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

pub(crate) fn backend(name: &str) -> PyResult<Backend> {
    name.parse::<Backend>().map_err(|e| {
        errors::error(
            "ConfigError",
            e.to_string(),
            vec![field("backend", name.to_owned())],
        )
    })
}

pub(crate) fn token(t: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Token>> {
    let Some(t) = t else { return Ok(None) };
    if t.is_none() {
        return Ok(None);
    }
    let text: String = match t.extract::<String>() {
        Ok(s) => s,
        Err(_) => String::from_utf8(t.extract::<Vec<u8>>()?)
            .map_err(|_| errors::usage("a token given as bytes must be UTF-8".into()))?,
    };
    Token::new(&text)
        .map(Some)
        .map_err(|e| errors::error("ConfigError", format!("token: {e}"), Vec::new()))
}

/// A unit of this process: `Server.start(config_json)`.
#[pyclass(name = "Server", module = "tessera._native", frozen)]
pub(crate) struct PyServer {
    server: Mutex<Option<Server>>,
    address: String,
    backend: &'static str,
    pid: u32,
}

#[pymethods]
impl PyServer {
    /// Starts a unit from a `ServerConfig` as JSON (what `tessera.storage.Server` builds).
    #[new]
    fn new(py: Python<'_>, config_json: &str) -> PyResult<Self> {
        let cfg: ServerConfig = serde_json::from_str(config_json).map_err(|e| {
            errors::error(
                "ConfigError",
                format!("unit configuration: {e}"),
                Vec::new(),
            )
        })?;
        let backend = cfg.backend.name();
        let server = runtime::wait(py, Server::start(cfg))?.map_err(errors::server)?;
        Ok(Self {
            address: server.addr().to_owned(),
            server: Mutex::new(Some(server)),
            backend,
            pid: std::process::id(),
        })
    }

    /// The control address clients connect to.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// The unit's statistics (the STATS figures) as a dict.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let stats = self.with(|s| s.stats())?;
        to_python(py, &stats)
    }

    /// Bytes of memory the unit has registered.
    fn registered_bytes(&self) -> PyResult<u64> {
        self.with(|s| s.registered_bytes())
    }

    /// Stops the unit: its sessions end and what they held is released. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if self.pid != std::process::id() {
            return Err(errors::forked(self.pid));
        }
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = server {
            runtime::wait(py, s.shutdown())?;
        }
        Ok(())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
}

impl PyServer {
    fn with<R>(&self, f: impl FnOnce(&Server) -> R) -> PyResult<R> {
        if self.pid != std::process::id() {
            return Err(errors::forked(self.pid));
        }
        let guard = self.server.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .as_ref()
            .map(f)
            .ok_or_else(|| errors::closed("server"))
    }
}

/// A client of one or more units.
#[pyclass(name = "Client", module = "tessera._native", frozen)]
pub(crate) struct PyClient {
    client: RwLock<Option<Arc<Client>>>,
    tensor_type: TensorType,
    units: Vec<String>,
    backend: &'static str,
    pid: u32,
}

#[allow(clippy::too_many_arguments)]
fn config(
    units: Vec<String>,
    backend_name: &str,
    recv_pool_bytes: u64,
    token_obj: Option<&Bound<'_, PyAny>>,
    timeout: f64,
    payload_addr: Option<&str>,
    max_message_bytes: u64,
    prefault_recv_pool: bool,
    busy_poll: bool,
) -> PyResult<ClientConfig> {
    if units.is_empty() {
        return Err(errors::usage(
            "a client needs at least one unit address".into(),
        ));
    }
    if !(timeout.is_finite() && timeout > 0.0) {
        return Err(errors::usage(format!(
            "timeout must be a positive number of seconds, not {timeout}"
        )));
    }
    let payload_addr = payload_addr
        .map(|a| {
            a.parse().map_err(|e| {
                errors::error(
                    "ConfigError",
                    format!("payload_addr {a:?}: {e}"),
                    Vec::new(),
                )
            })
        })
        .transpose()?;
    Ok(ClientConfig {
        units,
        backend: backend(backend_name)?,
        payload_addr,
        token: token(token_obj)?,
        recv_pool_bytes,
        prefault_recv_pool,
        max_message_bytes,
        timeout: Duration::from_secs_f64(timeout),
        busy_poll: busy_poll.then(runtime::busy_poll).transpose()?,
        ..ClientConfig::default()
    })
}

/// A placement by name: `"modulo"` (index % units, replicas the units after it) or
/// `"rendezvous"` (highest-random-weight hashing of partition and index over the units'
/// addresses).
fn placement_of(name: &str) -> PyResult<Box<dyn Placement>> {
    match name {
        "modulo" => Ok(Box::new(Modulo)),
        "rendezvous" => Ok(Box::new(Rendezvous)),
        other => Err(errors::error(
            "ConfigError",
            format!("placement {other:?}: expected \"modulo\" or \"rendezvous\""),
            Vec::new(),
        )),
    }
}

/// `obj` as indexes: ints 0 or more.
fn indexes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let mut out = Vec::new();
    for item in obj
        .try_iter()
        .map_err(|_| errors::usage("indexes must be a sequence of ints".into()))?
    {
        let item = item?;
        match item.extract::<u64>() {
            Ok(i) => out.push(i),
            Err(_) => {
                return Err(errors::usage(format!(
                    "indexes are ints 0 or more, not {}",
                    item.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                )))
            }
        }
    }
    Ok(out)
}

/// The PUT's columns: per field, one value per index, from a list (or tuple) of values or a
/// tensor whose first dimension runs over the indexes (split into row views, no copy).
fn columns(n: usize, fields: &Bound<'_, PyDict>) -> PyResult<Vec<(String, Vec<Value>)>> {
    let mut out = Vec::with_capacity(fields.len());
    for (name, column) in fields.iter() {
        let name: String = name
            .extract()
            .map_err(|_| errors::value_type("field names must be str".into()))?;
        let values = if column.cast::<PyList>().is_ok() || column.cast::<PyTuple>().is_ok() {
            let values: Vec<Value> = column
                .try_iter()?
                .map(|v| convert::value(&v?))
                .collect::<PyResult<_>>()?;
            if values.len() != n {
                return Err(errors::usage(format!(
                    "field {name:?} has {} values for {n} indexes",
                    values.len()
                )));
            }
            values
        } else {
            let t = convert::tensor(&column).map_err(|e| {
                let py = column.py();
                errors::value_type(format!(
                    "field {name:?}: a column is a list with one value per index or a tensor \
                     whose first dimension is the number of indexes ({})",
                    e.value(py)
                ))
            })?;
            if t.shape().first().copied() != Some(n as u64) {
                return Err(errors::usage(format!(
                    "field {name:?}: a tensor column of shape {:?} for {n} indexes (its first \
                     dimension must be the number of indexes)",
                    t.shape()
                )));
            }
            t.unbind()
                .map_err(|e| errors::tessera(format!("field {name:?}: {e}")))?
                .into_iter()
                .map(Value::Tensor)
                .collect()
        };
        out.push((name, values));
    }
    Ok(out)
}

fn got_dict(
    py: Python<'_>,
    fields: &[String],
    cols: Vec<Vec<Value>>,
    tt: TensorType,
) -> PyResult<Py<PyAny>> {
    let out = PyDict::new(py);
    for (name, col) in fields.iter().zip(cols) {
        let list = PyList::empty(py);
        for v in col {
            list.append(convert::to_py(py, v, tt)?)?;
        }
        out.set_item(name, list)?;
    }
    Ok(out.into_any().unbind())
}

impl PyClient {
    /// The client, for the bench functions.
    pub(crate) fn inner(&self) -> PyResult<Arc<Client>> {
        self.client()
    }

    fn client(&self) -> PyResult<Arc<Client>> {
        if self.pid != std::process::id() {
            return Err(errors::forked(self.pid));
        }
        self.client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| errors::closed("client"))
    }
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (units, backend="shm", recv_pool_bytes=1 << 30, token=None, tensor_type="numpy", timeout=60.0, payload_addr=None, max_message_bytes=256 << 20, replicas=1, placement="modulo", prefault_recv_pool=false, busy_poll=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        units: Vec<String>,
        backend: &str,
        recv_pool_bytes: u64,
        token: Option<&Bound<'_, PyAny>>,
        tensor_type: &str,
        timeout: f64,
        payload_addr: Option<&str>,
        max_message_bytes: u64,
        replicas: usize,
        placement: &str,
        prefault_recv_pool: bool,
        busy_poll: bool,
    ) -> PyResult<Self> {
        let tensor_type = TensorType::parse(tensor_type)?;
        let cfg = config(
            units.clone(),
            backend,
            recv_pool_bytes,
            token,
            timeout,
            payload_addr,
            max_message_bytes,
            prefault_recv_pool,
            busy_poll,
        )?;
        let cfg = ClientConfig { replicas, ..cfg };
        let placement = placement_of(placement)?;
        let backend = cfg.backend.name();
        let client =
            runtime::wait(py, Client::connect_with(cfg, placement))?.map_err(errors::client)?;
        Ok(Self {
            client: RwLock::new(Some(Arc::new(client))),
            tensor_type,
            units,
            backend,
            pid: std::process::id(),
        })
    }

    /// `Client(...)`, connecting without blocking the event loop.
    #[staticmethod]
    #[pyo3(signature = (units, backend="shm", recv_pool_bytes=1 << 30, token=None, tensor_type="numpy", timeout=60.0, payload_addr=None, max_message_bytes=256 << 20, replicas=1, placement="modulo", prefault_recv_pool=false, busy_poll=true))]
    #[allow(clippy::too_many_arguments)]
    fn connect_async<'py>(
        py: Python<'py>,
        units: Vec<String>,
        backend: &str,
        recv_pool_bytes: u64,
        token: Option<&Bound<'py, PyAny>>,
        tensor_type: &str,
        timeout: f64,
        payload_addr: Option<&str>,
        max_message_bytes: u64,
        replicas: usize,
        placement: &str,
        prefault_recv_pool: bool,
        busy_poll: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tensor_type = TensorType::parse(tensor_type)?;
        let cfg = config(
            units.clone(),
            backend,
            recv_pool_bytes,
            token,
            timeout,
            payload_addr,
            max_message_bytes,
            prefault_recv_pool,
            busy_poll,
        )?;
        let cfg = ClientConfig { replicas, ..cfg };
        let placement = placement_of(placement)?;
        let backend = cfg.backend.name();
        runtime::awaitable(py, async move {
            let client = Client::connect_with(cfg, placement)
                .await
                .map_err(errors::client)?;
            Python::attach(|py| {
                Py::new(
                    py,
                    PyClient {
                        client: RwLock::new(Some(Arc::new(client))),
                        tensor_type,
                        units,
                        backend,
                        pid: std::process::id(),
                    },
                )
                .map(Py::into_any)
            })
        })
    }

    #[getter]
    fn units(&self) -> Vec<String> {
        self.units.clone()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    #[getter]
    fn tensor_type(&self) -> &'static str {
        self.tensor_type.name()
    }

    /// Stores `fields` (`{field: column}`) at `indexes` of `partition`.
    fn put(
        &self,
        py: Python<'_>,
        partition: String,
        indexes: &Bound<'_, PyAny>,
        fields: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let client = self.client()?;
        let idx = self::indexes(indexes)?;
        let cols = columns(idx.len(), fields)?;
        runtime::wait(py, async move { client.put(&partition, &idx, &cols).await })?
            .map_err(errors::client)
    }

    fn put_async<'py>(
        &self,
        py: Python<'py>,
        partition: String,
        indexes: &Bound<'py, PyAny>,
        fields: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let client = self.client()?;
        let idx = self::indexes(indexes)?;
        let cols = columns(idx.len(), fields)?;
        runtime::awaitable(py, async move {
            client
                .put(&partition, &idx, &cols)
                .await
                .map_err(errors::client)?;
            Python::attach(|py| Ok(py.None()))
        })
    }

    /// Reads `fields` at `indexes`: `{field: [value per index]}`.
    fn get(
        &self,
        py: Python<'_>,
        partition: String,
        indexes: &Bound<'_, PyAny>,
        fields: Vec<String>,
    ) -> PyResult<Py<PyAny>> {
        let client = self.client()?;
        let idx = self::indexes(indexes)?;
        let names = fields.clone();
        let cols = runtime::wait(py, async move {
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            client.get(&partition, &idx, &refs).await
        })?
        .map_err(errors::client)?;
        got_dict(py, &fields, cols, self.tensor_type)
    }

    fn get_async<'py>(
        &self,
        py: Python<'py>,
        partition: String,
        indexes: &Bound<'py, PyAny>,
        fields: Vec<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let client = self.client()?;
        let idx = self::indexes(indexes)?;
        let tt = self.tensor_type;
        runtime::awaitable(py, async move {
            let refs: Vec<&str> = fields.iter().map(String::as_str).collect();
            let cols = client
                .get(&partition, &idx, &refs)
                .await
                .map_err(errors::client)?;
            Python::attach(|py| got_dict(py, &fields, cols, tt))
        })
    }

    /// Removes `indexes` (only `fields` when given) of `partition`, or the whole partition
    /// with `all=True`.
    #[pyo3(signature = (partition, indexes=None, *, fields=None, all=false))]
    fn clear(
        &self,
        py: Python<'_>,
        partition: String,
        indexes: Option<&Bound<'_, PyAny>>,
        fields: Option<Vec<String>>,
        all: bool,
    ) -> PyResult<()> {
        let client = self.client()?;
        let what = clear_what(indexes, fields, all)?;
        runtime::wait(py, async move { what.run(&client, &partition).await })?
            .map_err(errors::client)
    }

    #[pyo3(signature = (partition, indexes=None, *, fields=None, all=false))]
    fn clear_async<'py>(
        &self,
        py: Python<'py>,
        partition: String,
        indexes: Option<&Bound<'py, PyAny>>,
        fields: Option<Vec<String>>,
        all: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let client = self.client()?;
        let what = clear_what(indexes, fields, all)?;
        runtime::awaitable(py, async move {
            what.run(&client, &partition)
                .await
                .map_err(errors::client)?;
            Python::attach(|py| Ok(py.None()))
        })
    }

    /// Every unit's statistics, in unit order: a list of dicts.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let client = self.client()?;
        let stats =
            runtime::wait(py, async move { client.stats().await })?.map_err(errors::client)?;
        to_python(py, &stats)
    }

    fn stats_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let client = self.client()?;
        runtime::awaitable(py, async move {
            let stats = client.stats().await.map_err(errors::client)?;
            Python::attach(|py| to_python(py, &stats))
        })
    }

    /// The client's receive pool and what this process copied on the way in, as a dict.
    fn report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let client = self.client()?;
        crate::release::drain(py);
        let pool = client.recv_pool();
        let r = pool.report();
        let quarantined = client.quarantined_bytes();
        let region = pool.registration().region();
        let (copies, copied_bytes) = convert::copies();
        let d = PyDict::new(py);
        d.set_item("capacity", r.capacity)?;
        d.set_item("used", r.used)?;
        d.set_item("leased", r.used.saturating_sub(quarantined))?;
        d.set_item("quarantined", quarantined)?;
        d.set_item("free", r.free)?;
        d.set_item("largest_free", r.largest_free)?;
        d.set_item("live_blocks", r.live_blocks)?;
        d.set_item("address", region.as_ptr() as usize)?;
        d.set_item("copies", copies)?;
        d.set_item("copied_bytes", copied_bytes)?;
        d.set_item("pending_releases", crate::release::pending())?;
        d.into_py_any(py)
    }

    /// Closes the sessions. Results already returned stay valid; requests still running
    /// (after a Ctrl-C) finish first. Idempotent.
    fn close(&self) {
        self.client
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
}

/// A forked child leaks what it inherited instead of tearing it down: the runtime threads and
/// engine threads it would need are the parent's and do not exist in the child.
impl Drop for PyClient {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            let inherited = self
                .client
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            std::mem::forget(inherited);
        }
    }
}

impl Drop for PyServer {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            let inherited = self
                .server
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            std::mem::forget(inherited);
        }
    }
}

/// What a CLEAR removes.
enum Clear {
    Partition,
    Indexes(Vec<u64>, Option<Vec<String>>),
}

fn clear_what(
    indexes: Option<&Bound<'_, PyAny>>,
    fields: Option<Vec<String>>,
    all: bool,
) -> PyResult<Clear> {
    match (indexes, all) {
        (Some(_), true) => Err(errors::usage(
            "clear takes indexes or all=True, not both".into(),
        )),
        (None, false) => Err(errors::usage(
            "clear needs the indexes to remove, or all=True to drop the partition".into(),
        )),
        (None, true) if fields.is_some() => Err(errors::usage(
            "all=True drops the whole partition: fields do not apply".into(),
        )),
        (None, true) => Ok(Clear::Partition),
        (Some(i), false) => Ok(Clear::Indexes(self::indexes(i)?, fields)),
    }
}

impl Clear {
    async fn run(
        self,
        client: &Client,
        partition: &str,
    ) -> Result<(), tessera_storage::ClientError> {
        match self {
            Clear::Partition => client.drop_partition(partition).await,
            Clear::Indexes(idx, None) => client.clear(partition, &idx).await,
            Clear::Indexes(idx, Some(fields)) => {
                let refs: Vec<&str> = fields.iter().map(String::as_str).collect();
                client.clear_fields(partition, &idx, Some(&refs)).await
            }
        }
    }
}
