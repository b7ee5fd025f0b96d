//! The engine's state and its waiter thread: transfers in flight, peers' loaded metadata, and
//! the thread that polls NIXL for the status of pending transfers and fetches notifications.

use super::*;

/// A range of this process's memory, as NIXL's registration API wants it.
#[derive(Debug)]
pub(super) struct RawRange {
    pub(super) addr: usize,
    pub(super) len: usize,
}

impl MemoryRegion for RawRange {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for RawRange {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

pub(super) type Done = Box<dyn FnOnce(Result<(), NixlEngineError>) + Send>;

pub(super) struct InFlight {
    pub(super) req: XferRequest,
    pub(super) peer: String,
    pub(super) keep: Vec<Arc<RegInner>>,
    /// `None` once reported (timed out): the request is quarantined.
    pub(super) done: Option<Done>,
    pub(super) deadline: Option<Instant>,
}

pub(super) struct RemoteReg {
    pub(super) len: u64,
    /// (start offset, address, length) of each chunk.
    pub(super) chunks: Vec<(u64, u64, u64)>,
}

#[derive(Default)]
pub(super) struct PeerState {
    pub(super) handles: usize,
    pub(super) pending: usize,
    pub(super) regs: HashMap<u64, RemoteReg>,
}

pub(super) struct State {
    pub(super) inflight: Vec<InFlight>,
    pub(super) peers: HashMap<String, PeerState>,
    pub(super) notes: VecDeque<(String, Vec<u8>)>,
    pub(super) stopped: bool,
}

pub(super) struct Inner {
    pub(super) name: String,
    pub(super) agent: Agent,
    pub(super) backend: Backend,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    pub(super) poll_min: Duration,
    pub(super) poll_max: Duration,
    pub(super) notify_poll: Duration,
    pub(super) timeout: Option<Duration>,
    pub(super) max_chunk: u64,
    pub(super) max_notification: usize,
    pub(super) on_notify: Option<NotifyFn>,
    pub(super) registrations: tessera_sync::atomic::AtomicUsize,
}

/// Work to finish after the state lock is released.
#[derive(Default)]
pub(super) struct After {
    pub(super) finished: Vec<(Done, Result<(), NixlEngineError>)>,
    pub(super) release: Vec<Arc<RegInner>>,
    pub(super) notes: Vec<(String, Vec<u8>)>,
}

impl Inner {
    /// Fetches NIXL's notifications into `out`. Lock held by the caller.
    pub(super) fn fetch_notes(&self, out: &mut Vec<(String, Vec<u8>)>) {
        let Ok(mut map) = NotificationMap::new() else {
            return;
        };
        if self.agent.get_notifications(&mut map, None).is_err() {
            return;
        }
        let agents: Vec<String> = map
            .agents()
            .filter_map(|a| a.ok().map(str::to_owned))
            .collect();
        for agent in agents {
            let n = map.get_notifications_size(&agent).unwrap_or(0);
            for i in 0..n {
                if let Ok(msg) = map.get_notification_bytes(&agent, i) {
                    out.push((agent.clone(), msg));
                }
            }
        }
    }

    /// One round over in-flight transfers. Returns whether any finished.
    pub(super) fn round(&self, st: &mut State, after: &mut After, now: Instant) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < st.inflight.len() {
            let x = &mut st.inflight[i];
            let outcome = match self.agent.get_xfer_status(&x.req) {
                Ok(XferStatus::InProgress) => None,
                Ok(XferStatus::Success) => Some(Ok(())),
                Err(source) => Some(Err(NixlEngineError::TransferFailed {
                    peer: x.peer.clone(),
                    source,
                })),
            };
            match outcome {
                None => {
                    if let (Some(d), Some(after_t)) = (x.deadline, self.timeout) {
                        if now >= d {
                            if let Some(done) = x.done.take() {
                                moved = true;
                                after.finished.push((
                                    done,
                                    Err(NixlEngineError::Timeout {
                                        peer: x.peer.clone(),
                                        after: after_t,
                                    }),
                                ));
                            }
                        }
                    }
                    i += 1;
                }
                Some(result) => {
                    moved = true;
                    let x = st.inflight.swap_remove(i);
                    // NIXL reported the request finished: now it may be released.
                    drop(x.req);
                    if let Some(p) = st.peers.get_mut(&x.peer) {
                        p.pending -= 1;
                    }
                    after.release.extend(x.keep);
                    if let Some(done) = x.done {
                        after.finished.push((done, result));
                    }
                }
            }
        }
        self.invalidate_idle_peers(st);
        moved
    }

    /// Drops the remote metadata of peers with no handle and nothing pending.
    pub(super) fn invalidate_idle_peers(&self, st: &mut State) {
        let idle: Vec<String> = st
            .peers
            .iter()
            .filter(|(_, p)| p.handles == 0 && p.pending == 0)
            .map(|(n, _)| n.clone())
            .collect();
        for name in idle {
            st.peers.remove(&name);
            let _ = self.agent.invalidate_remote_md(&name);
        }
    }

    pub(super) fn run_after(&self, after: After) {
        drop(after.release);
        for (done, result) in after.finished {
            done(result);
        }
        for (from, msg) in after.notes {
            match &self.on_notify {
                Some(f) => {
                    let f = f.clone();
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                        f(&from, msg)
                    }));
                }
                None => self.state.lock().notes.push_back((from, msg)),
            }
        }
    }
}

pub(super) fn waiter(inner: Arc<Inner>) {
    let mut backoff = inner.poll_min;
    let mut st = inner.state.lock();
    loop {
        if st.stopped {
            return;
        }
        let mut after = After::default();
        let moved = inner.round(&mut st, &mut after, Instant::now());
        if inner.on_notify.is_some() {
            inner.fetch_notes(&mut after.notes);
        }
        let got = moved || !after.notes.is_empty();
        let idle = st.inflight.is_empty();
        drop(st);
        inner.run_after(after);
        st = inner.state.lock();
        if got {
            backoff = inner.poll_min;
            continue;
        }
        st = if idle && st.inflight.is_empty() {
            backoff = inner.poll_min;
            if inner.on_notify.is_some() {
                inner.cv.wait_timeout(st, inner.notify_poll).0
            } else {
                inner.cv.wait(st)
            }
        } else {
            let g = inner.cv.wait_timeout(st, backoff).0;
            backoff = (backoff * 2).min(inner.poll_max);
            g
        };
    }
}
