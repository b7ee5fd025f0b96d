//! Rust errors as the exceptions of `tessera.errors`, each carrying the error's fields.
//!
//! The classes are defined in Python (`python/tessera/errors.py`), so that they are ordinary
//! classes users can subclass and pickle; this module builds instances of them by name.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule};
use pyo3::IntoPyObjectExt;

use tessera_rdt_pool::{DescriptorError, FetchError, FreeError, PutError};
use tessera_storage::{ClientError, ErrorKind, ServerError};
use tessera_transport::{ConnectError, PoolError};

static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// One field of an exception: a name and a value made when the exception is.
pub(crate) type Field = (
    &'static str,
    Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>,
);

/// A field from any value Python can take.
pub(crate) fn field<T>(name: &'static str, value: T) -> Field
where
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    (name, Box::new(move |py| value.into_py_any(py)))
}

/// A `tessera.errors.<class>` with `message` and `fields` as attributes.
pub(crate) fn error(class: &'static str, message: String, fields: Vec<Field>) -> PyErr {
    Python::attach(|py| match build(py, class, &message, fields) {
        Ok(e) => e,
        // The package's Python half is missing or broken: still say what happened.
        Err(e) => PyRuntimeError::new_err(format!("{message} (and raising {class} failed: {e})")),
    })
}

fn build(py: Python<'_>, class: &str, message: &str, fields: Vec<Field>) -> PyResult<PyErr> {
    let module =
        MODULE.get_or_try_init(py, || Ok::<_, PyErr>(py.import("tessera.errors")?.unbind()))?;
    let kwargs = PyDict::new(py);
    for (name, make) in fields {
        kwargs.set_item(name, make(py)?)?;
    }
    let exc = module
        .bind(py)
        .getattr(class)?
        .call((message,), Some(&kwargs))?;
    Ok(PyErr::from_value(exc))
}

/// A `TesseraError` without more to say than its message.
pub(crate) fn tessera(message: String) -> PyErr {
    error("TesseraError", message, Vec::new())
}

/// The caller passed something this API does not take (also a `ValueError`).
pub(crate) fn usage(message: String) -> PyErr {
    error("UsageError", message, Vec::new())
}

/// A value of a type tessera cannot store (also a `TypeError`).
pub(crate) fn value_type(message: String) -> PyErr {
    error("ValueTypeError", message, Vec::new())
}

/// An object used after `close()`.
pub(crate) fn closed(what: &str) -> PyErr {
    error(
        "ClosedError",
        format!("this {what} is closed"),
        vec![field("what", what.to_owned())],
    )
}

/// A runtime or object inherited across a fork.
pub(crate) fn forked(parent: u32) -> PyErr {
    error(
        "ForkedError",
        format!(
            "tessera was started in process {parent} and this process ({}) is a fork of it: \
             its runtime, sessions and registrations belong to the parent. Create clients and \
             agents in the child after it starts (multiprocessing's \"spawn\" or \
             \"forkserver\" start method)",
            std::process::id()
        ),
        vec![field("parent_pid", parent)],
    )
}

fn kind_name(kind: ErrorKind) -> &'static str {
    kind.as_str()
}

/// A storage client's error.
pub(crate) fn client(e: ClientError) -> PyErr {
    let message = chain(&e);
    match e {
        ClientError::Remote { unit, source } => {
            let kind = kind_name(source.kind);
            let mut fields = vec![
                field("kind", kind),
                field("unit", unit),
                field("detail", source.message.clone()),
            ];
            let class = match source.kind {
                ErrorKind::Missing => {
                    fields.push(field("missing", source.missing.clone()));
                    "MissingKeys"
                }
                ErrorKind::Capacity | ErrorKind::OutOfMemory => "CapacityError",
                ErrorKind::Unauthorized => "AuthError",
                _ => "StorageError",
            };
            error(class, message, fields)
        }
        ClientError::Unreachable { unit, addr, .. } => error(
            "ConnectError",
            message,
            vec![field("unit", unit), field("address", addr)],
        ),
        ClientError::Io { unit, .. } => error("ConnectError", message, vec![field("unit", unit)]),
        ClientError::Unauthenticated { unit, had_token } => error(
            "AuthError",
            message,
            vec![
                field("kind", "unauthorized"),
                field("unit", unit),
                field("had_token", had_token),
            ],
        ),
        ClientError::BackendMismatch { unit, theirs, ours } => error(
            "ConfigError",
            message,
            vec![
                field("unit", unit),
                field("unit_backend", theirs),
                field("backend", ours.name()),
            ],
        ),
        ClientError::Connect { unit, .. } | ClientError::Transfer { unit, .. } => {
            error("TransferError", message, vec![field("unit", unit)])
        }
        ClientError::Agent(_) => error("EngineError", message, Vec::new()),
        ClientError::Timeout { unit, after } => error(
            "TesseraTimeout",
            message,
            vec![field("unit", unit), field("after", after.as_secs_f64())],
        ),
        ClientError::OutOfMemory {
            requested,
            align,
            free,
            largest_free,
        } => error(
            "CapacityError",
            message,
            vec![
                field("kind", "client_pool"),
                field("requested", requested),
                field("align", align),
                field("free", free),
                field("largest_free", largest_free),
            ],
        ),
        ClientError::Encode(_) | ClientError::Layout(_) => error("CodecError", message, Vec::new()),
        ClientError::ApiMisuse(_) => usage(message),
        ClientError::Memory(_) => error("RegistrationError", message, Vec::new()),
        ClientError::Wire { unit, .. } | ClientError::Unexpected { unit, .. } => {
            error("ProtocolError", message, vec![field("unit", unit)])
        }
        ClientError::Decode(_) => error("ProtocolError", message, Vec::new()),
        ClientError::Replicas { failed } => {
            let units: Vec<usize> = failed.iter().filter_map(ClientError::unit).collect();
            error(
                "StorageError",
                message,
                vec![field("kind", "replicas"), field("units", units)],
            )
        }
        ClientError::Lost { indexes, causes } => {
            let units: Vec<usize> = causes.iter().filter_map(ClientError::unit).collect();
            error(
                "StorageError",
                message,
                vec![
                    field("kind", "lost"),
                    field("indexes", indexes),
                    field("units", units),
                ],
            )
        }
        _ => tessera(message),
    }
}

/// A unit that did not start.
pub(crate) fn server(e: ServerError) -> PyErr {
    let message = chain(&e);
    match e {
        ServerError::Bind { addr, .. } => {
            error("ConnectError", message, vec![field("address", addr)])
        }
        ServerError::Config(_) => error("ConfigError", message, Vec::new()),
        ServerError::Agent(_) => error("EngineError", message, Vec::new()),
        _ => error("ServerError", message, Vec::new()),
    }
}

/// An engine this build lacks, or an agent that did not start.
pub(crate) fn engine(e: tessera_engines::EngineError) -> PyErr {
    let message = chain(&e);
    match e {
        tessera_engines::EngineError::NotBuilt { kind, feature } => error(
            "EngineNotBuilt",
            message,
            vec![field("backend", kind.name()), field("feature", feature)],
        ),
        _ => error("EngineError", message, Vec::new()),
    }
}

/// A peer's metadata that could not be added.
pub(crate) fn connect(e: ConnectError) -> PyErr {
    error("TransferError", chain(&e), Vec::new())
}

/// A pool that could not be made.
pub(crate) fn pool(e: PoolError) -> PyErr {
    error("PoolError", chain(&e), Vec::new())
}

/// A sender pool's put.
pub(crate) fn put(e: PutError) -> PyErr {
    let message = chain(&e);
    match e {
        PutError::OutOfMemory { .. } => {
            error("CapacityError", message, vec![field("kind", "sender_pool")])
        }
        _ => error("PoolError", message, Vec::new()),
    }
}

/// A sender pool's free.
pub(crate) fn free(e: FreeError) -> PyErr {
    let message = chain(&e);
    match e {
        FreeError::UnknownObject { .. } => error("UnknownObject", message, Vec::new()),
        _ => error("PoolError", message, Vec::new()),
    }
}

/// A receiver pool's fetch.
pub(crate) fn fetch(e: FetchError) -> PyErr {
    let message = chain(&e);
    match e {
        FetchError::Descriptor(_) => error("DescriptorError", message, Vec::new()),
        FetchError::OutOfMemory { .. } => error(
            "CapacityError",
            message,
            vec![field("kind", "receiver_pool")],
        ),
        FetchError::Transfer(_) => error("TransferError", message, Vec::new()),
        FetchError::Timeout { .. } => error("TesseraTimeout", message, Vec::new()),
        FetchError::Destinations { .. }
        | FetchError::DestinationMismatch { .. }
        | FetchError::DestinationTooSmall { .. } => error("UsageError", message, Vec::new()),
        _ => error("PoolError", message, Vec::new()),
    }
}

/// A descriptor that does not parse.
pub(crate) fn descriptor(e: DescriptorError) -> PyErr {
    error("DescriptorError", chain(&e), Vec::new())
}

/// An error and each cause whose text it does not already contain, joined with ": ".
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}
