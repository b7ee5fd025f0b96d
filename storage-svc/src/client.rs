//! The async client: pipelined control connections to one or more units, and the payload
//! plane (PUT frames from the caller's memory, WRITEn by the client into the unit's block or,
//! over the one-sided engines, READ by the unit; GETs written by the unit into the client's
//! own registered pool).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde_bytes::ByteBuf;
use tessera_framecodec::{decode_contiguous, encode, Decoder, Frames, Limits, Value};
use tessera_transport::{Agent, LocalDesc, Peer, RegisteredPool, RemoteDesc};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use crate::busy_poll::{BusyPoll, Waiting};
use crate::core::{decode_inline, Stats};
use crate::error::{ClientError, ErrorKind, RemoteError};
use crate::plane::{freeze, source_descs, Backend};
use crate::proto::{self, frame_descs, PullSource, Request, Response};

/// Which unit holds an index. TransferQueue's placement is [`Modulo`].
pub trait Placement: Send + Sync {
    /// The unit (in `0..units`) that holds `index`.
    fn unit_of(&self, index: u64, units: usize) -> usize;
}

/// `index % units`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Modulo;

impl Placement for Modulo {
    fn unit_of(&self, index: u64, units: usize) -> usize {
        (index % units as u64) as usize
    }
}

/// Client configuration.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Control addresses of the units (`HOST:PORT` or `unix:PATH`), in placement order.
    pub units: Vec<String>,
    /// Payload backend; must be the units' backend.
    pub backend: Backend,
    /// `tcp` backend: the address of this host the client's payload engine listens on and
    /// advertises to units (port 0 picks one). Unset: 127.0.0.1, for units on this host.
    /// `ucx` and `nixl` refuse it (UCX takes its interfaces from `UCX_NET_DEVICES`).
    pub payload_addr: Option<std::net::SocketAddr>,
    /// Shared secret, if the units require one.
    pub token: Option<String>,
    /// Bytes of the client's registered receive pool (GETs land here).
    pub recv_pool_bytes: u64,
    /// Largest control message accepted from a unit.
    pub max_message_bytes: u64,
    /// How long a unit's answer to any request, a PUT's WRITE or a GET's completion may take
    /// before the client gives up ([`ClientError::Timeout`]; the outcome is then unknown and
    /// not retried).
    pub timeout: Duration,
    /// Polls the control connections for answers before a worker of the caller's runtime
    /// parks, when that runtime was built with [`BusyPoll::on_park`] (off by default).
    pub busy_poll: Option<BusyPoll>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            units: vec!["127.0.0.1:7470".into()],
            backend: Backend::Shm,
            payload_addr: None,
            token: None,
            recv_pool_bytes: 1 << 30,
            max_message_bytes: 256 << 20,
            timeout: Duration::from_secs(60),
            busy_poll: None,
        }
    }
}

#[derive(Default)]
struct Pending {
    /// Set once the connection is gone: later calls fail at once instead of waiting.
    closed: bool,
    map: HashMap<u64, oneshot::Sender<Result<Response, ClientError>>>,
    /// Polled for answers while one is awaited (`ClientConfig::busy_poll`).
    poll: Option<BusyPoll>,
}

type Waiters = Arc<Mutex<Pending>>;

struct Conn {
    unit: usize,
    tx: mpsc::UnboundedSender<Outgoing>,
    waiters: Waiters,
    next: AtomicU64,
    peer: Peer,
    inline_max: u64,
    align: u64,
    timeout: Duration,
    /// PUT payloads are READ by the unit (`Backend::pulls_puts`).
    pull: bool,
}

/// A client of one or more units. Cheap to share behind an `Arc`; requests are pipelined.
pub struct Client {
    conns: Vec<Conn>,
    placement: Box<dyn Placement>,
    agent: Arc<Agent>,
    pool: RegisteredPool,
    decoder: Decoder,
    timeout: Duration,
    /// Receive blocks a timed-out GET may still be written into; held until the client drops.
    quarantine: Mutex<Vec<tessera_transport::PoolBlock>>,
    /// Sources of pulled PUTs whose answer never came (the unit may still read them): their
    /// frames and registrations are held until the client drops.
    held_sources: Mutex<Vec<(Vec<LocalDesc>, Vec<Bytes>)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Client {
    /// Connects to every unit of `cfg` with [`Modulo`] placement.
    pub async fn connect(cfg: ClientConfig) -> Result<Client, ClientError> {
        Self::connect_with(cfg, Box::new(Modulo)).await
    }

    /// Connects with a custom placement.
    pub async fn connect_with(
        cfg: ClientConfig,
        placement: Box<dyn Placement>,
    ) -> Result<Client, ClientError> {
        if cfg.units.is_empty() {
            return Err(ClientError::ApiMisuse("no units".into()));
        }
        let backend = cfg.backend;
        let payload_addr = cfg.payload_addr;
        let bytes = cfg.recv_pool_bytes;
        let (agent, pool) = tokio::task::spawn_blocking(move || {
            let agent = backend
                .agent_at("client", payload_addr)
                .map_err(|e| e.to_string())?;
            let pool = RegisteredPool::new(&agent, bytes).map_err(|e| e.to_string())?;
            Ok::<_, String>((Arc::new(agent), pool))
        })
        .await
        .map_err(|e| ClientError::Transport {
            unit: 0,
            message: e.to_string(),
        })?
        .map_err(|message| ClientError::Transport { unit: 0, message })?;
        let mut conns = Vec::with_capacity(cfg.units.len());
        for (unit, addr) in cfg.units.iter().enumerate() {
            conns.push(Conn::open(unit, addr, &cfg, &agent).await?);
        }
        Ok(Client {
            conns,
            placement,
            agent,
            pool,
            decoder: Decoder::with_limits({
                let mut l = Limits::default();
                l.max_total_bytes = u64::MAX / 2;
                l
            }),
            timeout: cfg.timeout,
            quarantine: Mutex::new(Vec::new()),
            held_sources: Mutex::new(Vec::new()),
        })
    }

    /// Number of units.
    pub fn units(&self) -> usize {
        self.conns.len()
    }

    /// The client's transport agent (its registrations are reused as PUT sources).
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Usage of the client's receive pool.
    pub fn recv_pool_used(&self) -> u64 {
        self.pool.report().used
    }

    fn split(&self, indexes: &[u64]) -> Vec<Vec<usize>> {
        let mut per = vec![Vec::new(); self.conns.len()];
        for (pos, i) in indexes.iter().enumerate() {
            per[self.placement.unit_of(*i, self.conns.len())].push(pos);
        }
        per
    }

    /// Stores `columns` (one `(field, values)` per field, one value per index) at `indexes`.
    /// The units are asked concurrently; each unit replaces its keys atomically (a PUT that
    /// fails on one unit may have been stored on another). Tensors travel from the caller's
    /// memory.
    pub async fn put(
        &self,
        partition: &str,
        indexes: &[u64],
        columns: &[(String, Vec<Value>)],
    ) -> Result<(), ClientError> {
        if columns.iter().any(|(_, v)| v.len() != indexes.len()) {
            return Err(ClientError::ApiMisuse(
                "every field needs one value per index".into(),
            ));
        }
        let fields: Vec<String> = columns.iter().map(|(f, _)| f.clone()).collect();
        let mut work = Vec::new();
        for (unit, positions) in self.split(indexes).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let idx: Vec<u64> = positions.iter().map(|p| indexes[*p]).collect();
            let value = Value::List(
                columns
                    .iter()
                    .map(|(_, vals)| {
                        Value::List(positions.iter().map(|p| vals[*p].clone()).collect())
                    })
                    .collect(),
            );
            let fields = fields.clone();
            work.push(async move { self.put_unit(unit, partition, idx, fields, &value).await });
        }
        join_all(work).await.into_iter().collect()
    }

    async fn put_unit(
        &self,
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        value: &Value,
    ) -> Result<(), ClientError> {
        let conn = &self.conns[unit];
        let frames = encode(value).map_err(|e| ClientError::Codec(e.to_string()))?;
        let inline = frames.payload_bytes() <= conn.inline_max;
        if !inline && conn.pull {
            return self
                .put_pulled(conn, partition, indexes, fields, &frames)
                .await;
        }
        let req = Request::Put {
            partition: partition.to_owned(),
            indexes,
            fields,
            meta: ByteBuf::from(frames.meta.to_vec()),
            inline: inline.then(|| {
                frames
                    .payloads
                    .iter()
                    .map(|f| ByteBuf::from(f.to_vec()))
                    .collect()
            }),
            pull: None,
        };
        let mut answer = conn.send(req, !inline)?;
        // The frames are registered while the unit prepares its block: once the request is
        // on its way (the writer may share this thread's core).
        answer.sent().await;
        let locals = (!inline).then(|| {
            source_descs(
                &self.agent,
                frames.payloads.iter().filter(|f| !f.is_empty()),
            )
        });
        let (id, resp) = answer.wait().await?;
        let terr = |message: String| ClientError::Transport { unit, message };
        let ready = match resp {
            Response::Done => return Ok(()),
            Response::PutReady { block, agent } => match (agent, locals) {
                (_, Some(Err(e))) => Err(terr(e)),
                (_, None) => Err(terr("READY for an inline PUT".into())),
                // The unit registered more memory: its peer handle learns the new
                // registrations before any WRITE names them.
                (Some(md), Some(Ok(locals))) => self
                    .agent
                    .add_remote(&md)
                    .map(|_| (block, locals))
                    .map_err(|e| terr(e.to_string())),
                (None, Some(Ok(locals))) => Ok((block, locals)),
            },
            other => return Err(conn.unexpected(other)),
        };
        let (block, locals) = match ready {
            Ok(r) => r,
            Err(e) => {
                // Nothing was written: the unit frees the block.
                let _ = conn
                    .call(Request::Cancel {
                        of: id,
                        maybe_written: false,
                    })
                    .await;
                return Err(e);
            }
        };
        if let Err(e) = self.write_frames(conn, &frames, &block, locals).await {
            // The block may hold part of the payload: the unit quarantines it. No retry.
            let _ = conn
                .call(Request::Cancel {
                    of: id,
                    maybe_written: true,
                })
                .await;
            return Err(e);
        }
        match conn.call(Request::Commit { put: id }).await?.1 {
            Response::Done => Ok(()),
            other => Err(conn.unexpected(other)),
        }
    }

    /// A PUT whose payload the unit READs: the frames are registered in place (or found in a
    /// registration) and named in the request; they stay registered until the unit answered,
    /// or, when no answer comes, until the client drops.
    async fn put_pulled(
        &self,
        conn: &Conn,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        frames: &Frames,
    ) -> Result<(), ClientError> {
        let terr = |message: String| ClientError::Transport {
            unit: conn.unit,
            message,
        };
        let sources = source_descs(
            &self.agent,
            frames.payloads.iter().filter(|f| !f.is_empty()),
        )
        .map_err(terr)?;
        let mut it = sources.iter();
        let descs = frames
            .payloads
            .iter()
            .map(|f| match f.is_empty() {
                true => Some(RemoteDesc::new(0, 0, 0)),
                false => it.next().map(LocalDesc::to_remote),
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| terr("fewer sources than frames".into()))?;
        let req = Request::Put {
            partition: partition.to_owned(),
            indexes,
            fields,
            meta: ByteBuf::from(frames.meta.to_vec()),
            inline: None,
            pull: Some(PullSource {
                descs,
                agent: ByteBuf::from(self.agent.metadata()),
            }),
        };
        let answer = conn.call(req).await;
        if matches!(answer, Err(ClientError::Timeout { .. })) {
            // No answer: the unit may still be reading these frames.
            lock(&self.held_sources).push((sources, frames.payloads.iter().cloned().collect()));
        } else {
            drop(sources);
        }
        match answer?.1 {
            Response::Done => Ok(()),
            other => Err(conn.unexpected(other)),
        }
    }

    /// WRITEs the non-empty frames, registered as `locals` in order, into the unit's receive
    /// `block`, laid out as the unit lays them out.
    async fn write_frames(
        &self,
        conn: &Conn,
        frames: &Frames,
        block: &RemoteDesc,
        locals: Vec<LocalDesc>,
    ) -> Result<(), ClientError> {
        let terr = |message: String| ClientError::Transport {
            unit: conn.unit,
            message,
        };
        let layout = frames
            .layout(conn.align)
            .map_err(|e| ClientError::Codec(e.to_string()))?;
        let remotes = frame_descs(block, &layout).map_err(terr)?;
        if remotes.len() != locals.len() {
            return Err(terr("the layout does not match the frames".into()));
        }
        let t = conn
            .peer
            .write(&locals, &remotes, None)
            .map_err(|e| terr(e.to_string()))?;
        drop(locals);
        match tokio::time::timeout(self.timeout, t).await {
            Ok(r) => r.map_err(|e| terr(e.to_string())),
            Err(_) => Err(terr("WRITE timed out; outcome unknown".into())),
        }
    }

    /// Reads `fields` at `indexes`: one `Vec<Value>` per field, in the requested order.
    /// Tensors of large GETs are views into the client's receive pool, owning their block.
    pub async fn get(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[&str],
    ) -> Result<Vec<Vec<Value>>, ClientError> {
        let fields: Vec<String> = fields.iter().map(|f| (*f).to_owned()).collect();
        let mut out: Vec<Vec<Option<Value>>> = vec![vec![None; indexes.len()]; fields.len()];
        let mut work = Vec::new();
        for (unit, positions) in self.split(indexes).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let idx: Vec<u64> = positions.iter().map(|p| indexes[*p]).collect();
            let fields = fields.clone();
            work.push(async move {
                let cols = self.get_unit(unit, partition, idx, fields).await?;
                Ok::<_, ClientError>((positions, cols))
            });
        }
        for r in join_all(work).await {
            let (positions, cols) = r?;
            for (f, col) in cols.into_iter().enumerate() {
                for (p, v) in positions.iter().zip(col) {
                    out[f][*p] = Some(v);
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|c| c.into_iter().map(|v| v.unwrap_or(Value::Null)).collect())
            .collect())
    }

    async fn get_unit(
        &self,
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
    ) -> Result<Vec<Vec<Value>>, ClientError> {
        let conn = &self.conns[unit];
        let n = indexes.len();
        let nf = fields.len();
        let req = Request::Get {
            partition: partition.to_owned(),
            indexes,
            fields,
        };
        let (id, resp) = conn.call(req).await?;
        let value = match resp {
            Response::Values { meta, frames } => {
                decode_inline(&meta, frames).map_err(ClientError::Codec)?
            }
            Response::GetReady { meta } => self.get_payload(conn, id, &meta).await?,
            other => return Err(conn.unexpected(other)),
        };
        let bad = || conn.unexpected(Response::GetDone);
        let Value::List(cols) = value else {
            return Err(bad());
        };
        if cols.len() != nf {
            return Err(bad());
        }
        cols.into_iter()
            .map(|c| match c {
                Value::List(items) if items.len() == n => Ok(items),
                _ => Err(bad()),
            })
            .collect()
    }

    async fn get_payload(&self, conn: &Conn, get: u64, meta: &[u8]) -> Result<Value, ClientError> {
        let table = self
            .decoder
            .frame_table(meta)
            .map_err(|e| ClientError::Codec(e.to_string()))?;
        let layout = table
            .layout(conn.align)
            .map_err(|e| ClientError::Codec(e.to_string()))?;
        let block = match self.pool.lease(layout.size.max(1), layout.align) {
            Ok(b) => b,
            Err(e) => {
                let _ = conn
                    .call(Request::Cancel {
                        of: get,
                        maybe_written: false,
                    })
                    .await;
                return Err(ClientError::OutOfMemory(e.to_string()));
            }
        };
        // The unit lays the frames out in the block as this client did.
        let exposed = block
            .remote_range(0, layout.size.max(1))
            .map_err(|e| ClientError::OutOfMemory(e.to_string()))?;
        let done = tokio::time::timeout(
            self.timeout,
            conn.call(Request::GetInto {
                get,
                block: exposed,
            }),
        );
        match done.await {
            Ok(Ok((_, Response::GetDone))) => {}
            Ok(Ok((_, other))) => return Err(conn.unexpected(other)),
            Ok(Err(e)) => {
                if matches!(e, ClientError::Remote { ref source, .. } if source.kind == ErrorKind::Transfer)
                {
                    lock(&self.quarantine).push(block);
                }
                return Err(e);
            }
            Err(_) => {
                // The unit may still write into the block: keep it out of the pool.
                lock(&self.quarantine).push(block);
                return Err(ClientError::Transport {
                    unit: conn.unit,
                    message: "GET timed out; outcome unknown".into(),
                });
            }
        }
        let size = layout.size;
        let buf: Bytes = freeze(block, size);
        decode_contiguous(meta, &buf, layout.align).map_err(|e| ClientError::Codec(e.to_string()))
    }

    /// Removes `indexes` (all fields). Idempotent.
    pub async fn clear(&self, partition: &str, indexes: &[u64]) -> Result<(), ClientError> {
        self.clear_fields(partition, indexes, None).await
    }

    /// Removes `fields` (all when `None`) at `indexes`. Idempotent.
    pub async fn clear_fields(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: Option<&[&str]>,
    ) -> Result<(), ClientError> {
        for (unit, positions) in self.split(indexes).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let conn = &self.conns[unit];
            let req = Request::Clear {
                partition: partition.to_owned(),
                indexes: positions.iter().map(|p| indexes[*p]).collect(),
                fields: fields.map(|fs| fs.iter().map(|f| (*f).to_owned()).collect()),
            };
            match conn.call(req).await?.1 {
                Response::Done => {}
                other => return Err(conn.unexpected(other)),
            }
        }
        Ok(())
    }

    /// Removes a partition from every unit. Idempotent.
    pub async fn drop_partition(&self, partition: &str) -> Result<(), ClientError> {
        for conn in &self.conns {
            let req = Request::DropPartition {
                partition: partition.to_owned(),
            };
            match conn.call(req).await?.1 {
                Response::Done => {}
                other => return Err(conn.unexpected(other)),
            }
        }
        Ok(())
    }

    /// Statistics of every unit, in unit order.
    pub async fn stats(&self) -> Result<Vec<Stats>, ClientError> {
        let mut out = Vec::with_capacity(self.conns.len());
        for conn in &self.conns {
            match conn.call(Request::Stats).await?.1 {
                Response::Stats(s) => out.push(s),
                other => return Err(conn.unexpected(other)),
            }
        }
        Ok(out)
    }

    /// Sends one raw request to a unit and returns its response (for tools and tests).
    pub async fn raw(&self, unit: usize, req: Request) -> Result<Response, ClientError> {
        let conn = self
            .conns
            .get(unit)
            .ok_or_else(|| ClientError::ApiMisuse(format!("no unit {unit}")))?;
        Ok(conn.call(req).await?.1)
    }
}

impl Conn {
    async fn open(
        unit: usize,
        addr: &str,
        cfg: &ClientConfig,
        agent: &Arc<Agent>,
    ) -> Result<Conn, ClientError> {
        let io = |source| ClientError::Io { unit, source };
        let (r, w): (
            Box<dyn AsyncRead + Send + Unpin>,
            Box<dyn AsyncWrite + Send + Unpin>,
        ) = if let Some(path) = addr.strip_prefix("unix:") {
            let s = tokio::net::UnixStream::connect(path).await.map_err(io)?;
            let fd = s.as_raw_fd();
            let (r, w) = s.into_split();
            (
                Box::new(BusyPoll::watched(cfg.busy_poll.as_ref(), fd, r, false)),
                Box::new(w),
            )
        } else {
            let s = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
            s.set_nodelay(true).map_err(io)?;
            let fd = s.as_raw_fd();
            let (r, w) = s.into_split();
            (
                Box::new(BusyPoll::watched(cfg.busy_poll.as_ref(), fd, r, false)),
                Box::new(w),
            )
        };
        let (tx, rx) = mpsc::unbounded_channel::<Outgoing>();
        let waiters: Waiters = Arc::new(Mutex::new(Pending {
            poll: cfg.busy_poll.clone(),
            ..Pending::default()
        }));
        tokio::spawn(write_loop(w, rx));
        tokio::spawn(read_loop(unit, r, waiters.clone(), cfg.max_message_bytes));
        let hello = Request::Hello {
            token: cfg.token.clone(),
            agent: agent.metadata(),
        };
        let (_, resp) = call_raw(unit, &tx, &waiters, 0, hello, cfg.timeout).await?;
        let Response::Welcome {
            agent: md,
            backend,
            inline_max,
            align,
        } = resp
        else {
            return Err(ClientError::Unexpected {
                unit,
                what: format!("{resp:?}"),
            });
        };
        if backend != cfg.backend.kind() {
            return Err(ClientError::Transport {
                unit,
                message: format!(
                    "unit uses backend {backend}, client {}; no fallback",
                    cfg.backend.kind()
                ),
            });
        }
        let a = agent.clone();
        let peer = tokio::task::spawn_blocking(move || a.add_remote(&md))
            .await
            .map_err(|e| ClientError::Transport {
                unit,
                message: e.to_string(),
            })?
            .map_err(|e| ClientError::Transport {
                unit,
                message: e.to_string(),
            })?;
        Ok(Conn {
            unit,
            tx,
            waiters,
            next: AtomicU64::new(1),
            peer,
            inline_max,
            align,
            timeout: cfg.timeout,
            pull: cfg.backend.pulls_puts(),
        })
    }

    async fn call(&self, req: Request) -> Result<(u64, Response), ClientError> {
        self.send(req, false)?.wait().await
    }

    /// Sends `req`; its answer comes through the returned [`Answer`], which with `confirm`
    /// can also tell when the request is on the socket.
    fn send(&self, req: Request, confirm: bool) -> Result<Answer<'_>, ClientError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        send_raw(
            self.unit,
            &self.tx,
            &self.waiters,
            id,
            req,
            self.timeout,
            confirm,
        )
    }

    fn unexpected(&self, resp: Response) -> ClientError {
        ClientError::Unexpected {
            unit: self.unit,
            what: format!("{resp:?}").chars().take(200).collect(),
        }
    }
}

async fn call_raw(
    unit: usize,
    tx: &mpsc::UnboundedSender<Outgoing>,
    waiters: &Waiters,
    id: u64,
    req: Request,
    timeout: Duration,
) -> Result<(u64, Response), ClientError> {
    send_raw(unit, tx, waiters, id, req, timeout, false)?
        .wait()
        .await
}

/// Sends `req` as request `id` and returns the wait for its answer: the request is on its way
/// when this returns, so the caller can work while the unit does.
fn send_raw<'a>(
    unit: usize,
    tx: &mpsc::UnboundedSender<Outgoing>,
    waiters: &'a Waiters,
    id: u64,
    req: Request,
    timeout: Duration,
    confirm: bool,
) -> Result<Answer<'a>, ClientError> {
    let buf = proto::encode_frame(id, &req).map_err(|source| ClientError::Wire { unit, source })?;
    let (otx, orx) = oneshot::channel();
    let polled = {
        let mut w = lock(waiters);
        if w.closed {
            return Err(connection_closed(unit));
        }
        w.map.insert(id, otx);
        w.poll.as_ref().map(BusyPoll::waiting)
    };
    let (written, sent) = match confirm {
        true => {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        }
        false => (None, None),
    };
    if tx.send(Outgoing { buf, written }).is_err() {
        lock(waiters).map.remove(&id);
        return Err(connection_closed(unit));
    }
    Ok(Answer {
        unit,
        id,
        rx: orx,
        sent,
        waiters,
        timeout,
        _polled: polled,
    })
}

fn connection_closed(unit: usize) -> ClientError {
    ClientError::Io {
        unit,
        source: std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "connection closed"),
    }
}

/// A sent request's answer to come.
struct Answer<'a> {
    unit: usize,
    id: u64,
    rx: oneshot::Receiver<Result<Response, ClientError>>,
    /// Fires once the request is on the socket (when asked for).
    sent: Option<oneshot::Receiver<()>>,
    waiters: &'a Waiters,
    timeout: Duration,
    /// Parking workers poll for the answer while it is awaited.
    _polled: Option<Waiting>,
}

impl Answer<'_> {
    /// Until the connection's writer put the request on the socket, gave up, or the answer's
    /// own timeout passed (a unit that stopped reading blocks the writer): the answer then
    /// reports what happened.
    async fn sent(&mut self) {
        if let Some(rx) = self.sent.take() {
            let _ = tokio::time::timeout(self.timeout, rx).await;
        }
    }

    async fn wait(self) -> Result<(u64, Response), ClientError> {
        let Self {
            unit,
            id,
            rx,
            waiters,
            timeout,
            _polled: _waiting,
            ..
        } = self;
        // A unit that never answers (stopped, or a session task that died) must not hold the
        // caller forever.
        let Ok(answer) = tokio::time::timeout(timeout, rx).await else {
            lock(waiters).map.remove(&id);
            return Err(ClientError::Timeout {
                unit,
                after: timeout,
            });
        };
        match answer {
            Ok(Ok(Response::Error(source))) => Err(ClientError::Remote { unit, source }),
            Ok(Ok(r)) => Ok((id, r)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(connection_closed(unit)),
        }
    }
}

/// A request for the connection's writer, and whom to tell once it is on the socket.
struct Outgoing {
    buf: Vec<u8>,
    written: Option<oneshot::Sender<()>>,
}

async fn write_loop(
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    while let Some(out) = rx.recv().await {
        if w.write_all(&out.buf).await.is_err() {
            break;
        }
        if let Some(tx) = out.written {
            let _ = tx.send(());
        }
    }
}

async fn read_loop(
    unit: usize,
    mut r: Box<dyn AsyncRead + Send + Unpin>,
    waiters: Waiters,
    max: u64,
) {
    let fail_all = |waiters: &Waiters, why: &str| {
        let mut pending = lock(waiters);
        pending.closed = true;
        for (_, w) in pending.map.drain() {
            let _ = w.send(Err(ClientError::Io {
                unit,
                source: std::io::Error::new(std::io::ErrorKind::ConnectionAborted, why.to_owned()),
            }));
        }
    };
    loop {
        let mut prefix = [0u8; proto::LEN_PREFIX];
        if r.read_exact(&mut prefix).await.is_err() {
            fail_all(&waiters, "connection closed");
            return;
        }
        let len = match proto::frame_len(prefix, max) {
            Ok(l) => l,
            Err(e) => {
                fail_all(&waiters, &e.to_string());
                return;
            }
        };
        let mut buf = vec![0u8; len];
        if r.read_exact(&mut buf).await.is_err() {
            fail_all(&waiters, "connection closed");
            return;
        }
        match proto::decode_body::<Response>(&buf) {
            Ok((id, resp)) => {
                if let Some(w) = lock(&waiters).map.remove(&id) {
                    let _ = w.send(Ok(resp));
                }
            }
            Err((id, e)) => {
                if let Some(w) = lock(&waiters).map.remove(&id) {
                    let _ = w.send(Err(ClientError::Wire { unit, source: e }));
                }
            }
        }
    }
}

/// Runs `futs` concurrently on the current task and returns their outputs in order.
async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<std::pin::Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futs.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// Builds a [`RemoteError`] for tests and tools.
pub fn remote_error(kind: ErrorKind, message: &str) -> RemoteError {
    RemoteError {
        kind,
        message: message.to_owned(),
        missing: Vec::new(),
    }
}
