//! Faults that this crate's own tests inject: compiled only under `cfg(test)`, never part of
//! a build's API.

use tessera_sync::StaticMutex;

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

static ARMED: StaticMutex<Vec<(String, Fault)>> = StaticMutex::new(Vec::new());
static WRITES: StaticMutex<Vec<(SessionId, u64)>> = StaticMutex::new(Vec::new());
thread_local! {
    static SESSION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Every request on `partition` panics at `fault` (partitions keep tests apart).
pub(crate) fn arm(partition: &str, fault: Fault) {
    ARMED.lock().push((partition.to_owned(), fault));
}

fn armed(req: &Request) -> Option<Fault> {
    let partition = match req {
        Request::Put { partition, .. }
        | Request::Get { partition, .. }
        | Request::GetOffer { partition, .. }
        | Request::Clear { partition, .. } => partition,
        _ => return None,
    };
    let armed = ARMED.lock();
    armed.iter().find(|(p, _)| p == partition).map(|&(_, f)| f)
}

/// The partitions of the `GetOffer` requests handled, in order.
static OFFERS: StaticMutex<Vec<String>> = StaticMutex::new(Vec::new());

/// How many `GetOffer` requests on `partition` were handled.
pub(crate) fn offers(partition: &str) -> usize {
    OFFERS.lock().iter().filter(|p| *p == partition).count()
}

pub(crate) fn before_handle(sid: SessionId, id: u64, req: &Request) {
    watched_handle(req);
    if let Request::GetOffer { partition, .. } = req {
        OFFERS.lock().push(partition.clone());
    }
    match armed(req) {
        Some(Fault::Handle) => panic!("injected fault while handling request {id}"),
        Some(Fault::Session) => SESSION.with(|s| s.set(true)),
        Some(Fault::Write) => WRITES.lock().push((sid, id)),
        None => {}
    }
}

pub(crate) fn after_handle(op: &str) {
    if SESSION.with(|s| s.replace(false)) {
        panic!("injected fault in the session task after a {op} request");
    }
}

pub(crate) fn before_write(sid: SessionId, get: u64) {
    if WRITES.lock().contains(&(sid, get)) {
        panic!("injected fault writing GET {get}");
    }
}

/// Watched partitions: whose GET (or PUT stored in slices) is under way, and whether another
/// request was handled, or made to wait for the partition, while it was.
static WATCHED: StaticMutex<Vec<Watch>> = StaticMutex::new(Vec::new());

struct Watch {
    partition: String,
    started: std::sync::mpsc::Sender<()>,
    under_way: bool,
    served_during: bool,
    waited_during: bool,
}

/// Watches GETs of `partition`, and PUTs of it stored in slices: `started` hears when one
/// starts being handled.
pub(crate) fn watch_get(partition: &str, started: std::sync::mpsc::Sender<()>) {
    WATCHED.lock().push(Watch {
        partition: partition.to_owned(),
        started,
        under_way: false,
        served_during: false,
        waited_during: false,
    });
}

/// Whether another request (of any partition) was handled while a GET or sliced PUT of
/// `partition` was under way.
pub(crate) fn served_during_get(partition: &str) -> bool {
    WATCHED
        .lock()
        .iter()
        .any(|w| w.partition == partition && w.served_during)
}

/// Whether a request was made to wait for `partition` while its GET or sliced PUT was
/// under way.
pub(crate) fn waited_during(partition: &str) -> bool {
    WATCHED
        .lock()
        .iter()
        .any(|w| w.partition == partition && w.waited_during)
}

/// A request waits for `partition`, held by one handled in slices.
pub(crate) fn waits(partition: &str) {
    for w in WATCHED.lock().iter_mut() {
        if w.partition == partition && w.under_way {
            w.waited_during = true;
        }
    }
}

fn watched_handle(req: &Request) {
    let get_of = match req {
        Request::Get { partition, .. } => Some(partition),
        _ => None,
    };
    for w in WATCHED.lock().iter_mut() {
        if get_of == Some(&w.partition) {
            get_started(w);
        } else if w.under_way {
            w.served_during = true;
        }
    }
}

fn get_started(w: &mut Watch) {
    w.under_way = true;
    let _ = w.started.send(());
}

static CHECKS: StaticMutex<Vec<(String, std::sync::mpsc::Sender<()>)>> =
    StaticMutex::new(Vec::new());

/// Watches the key checks of sliced GETs of `partition`: `begun` hears when one begins.
pub(crate) fn watch_check(partition: &str, begun: std::sync::mpsc::Sender<()>) {
    CHECKS.lock().push((partition.to_owned(), begun));
}

/// A sliced GET of `partition` begins to check its keys (the unit not locked).
pub(crate) fn check_begins(partition: &str) {
    for (p, begun) in CHECKS.lock().iter() {
        if p == partition {
            let _ = begun.send(());
        }
    }
}

/// A GET of `partition` starts being handled in slices (the unit locked), or a PUT of it
/// starts being stored in slices.
pub(crate) fn before_sliced(partition: &str) {
    for w in WATCHED.lock().iter_mut() {
        if w.partition == partition {
            get_started(w);
        }
    }
}

/// Between two slices of a GET or PUT of `partition` (the unit unlocked): a watched one waits,
/// for 30 s at most, until another request was handled or made to wait for its partition, so
/// that a test of the slicing does not depend on how fast the request is.
pub(crate) async fn between_slices(partition: &str) {
    let served = || {
        WATCHED.lock().iter().any(|w| {
            w.partition == partition && (!w.under_way || w.served_during || w.waited_during)
        })
    };
    let watched = WATCHED.lock().iter().any(|w| w.partition == partition);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while watched && !served() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// A GET of `partition` was answered (the unit still locked), or a PUT of it stored.
pub(crate) fn get_done(partition: &str) {
    for w in WATCHED.lock().iter_mut() {
        if w.partition == partition {
            w.under_way = false;
        }
    }
}
