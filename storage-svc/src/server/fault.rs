//! Faults that this crate's own tests inject: compiled only under `cfg(test)`, never part of
//! a build's API.

use std::sync::Mutex;

use crate::core::SessionId;
use crate::proto::Request;

/// Where a request on an armed partition panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Inside the core's handling of the request, with the unit locked.
    Handle,
    /// In the session task after the request was handled (outside the per-request guard).
    Session,
    /// In the executor, writing the GET's payload.
    Write,
}

static ARMED: Mutex<Vec<(String, Fault)>> = Mutex::new(Vec::new());
static WRITES: Mutex<Vec<(SessionId, u64)>> = Mutex::new(Vec::new());
thread_local! {
    static SESSION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Every request on `partition` panics at `fault` (partitions keep tests apart).
pub(crate) fn arm(partition: &str, fault: Fault) {
    ARMED.lock().unwrap().push((partition.to_owned(), fault));
}

fn armed(req: &Request) -> Option<Fault> {
    let partition = match req {
        Request::Put { partition, .. }
        | Request::Get { partition, .. }
        | Request::Clear { partition, .. } => partition,
        _ => return None,
    };
    let armed = ARMED.lock().unwrap();
    armed.iter().find(|(p, _)| p == partition).map(|&(_, f)| f)
}

pub(crate) fn before_handle(sid: SessionId, id: u64, req: &Request) {
    match armed(req) {
        Some(Fault::Handle) => panic!("injected fault while handling request {id}"),
        Some(Fault::Session) => SESSION.with(|s| s.set(true)),
        Some(Fault::Write) => WRITES.lock().unwrap().push((sid, id)),
        None => {}
    }
}

pub(crate) fn after_handle(op: &str) {
    if SESSION.with(|s| s.replace(false)) {
        panic!("injected fault in the session task after a {op} request");
    }
}

pub(crate) fn before_write(sid: SessionId, get: u64) {
    if WRITES.lock().unwrap().contains(&(sid, get)) {
        panic!("injected fault writing GET {get}");
    }
}
