//! The async client: pipelined control connections to one or more units, and the payload
//! plane (PUT frames from the caller's memory, WRITEn by the client into the unit's block or,
//! over the one-sided engines, READ by the unit; GETs written by the unit into the client's
//! own registered pool).

use std::time::Duration;
use tessera_sync::{Arc, Mutex};

use bytes::Bytes;
use tessera_framecodec::{Decoder, Limits, Value};
use tessera_transport::{Agent, LocalDesc, RegisteredPool};

use crate::busy_poll::BusyPoll;
use crate::core::Stats;
use crate::error::{ClientError, ErrorKind, RemoteError};
use crate::plane::Backend;
use crate::plane::BackendExt;
use crate::proto::{Request, Response};

mod conn;
mod get;
mod placement;
mod put;

use self::conn::Conn;
pub use self::placement::{Modulo, Placement, Rendezvous};

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
    /// Shared secret, if the units require one: the client proves it holds it and checks that
    /// the unit does too (challenge-response; it never travels and `Debug` never shows it).
    pub token: Option<tessera_transport::auth::Token>,
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
    /// Copies of every value (1 to the number of units): a PUT stores each index on this
    /// many units (its placement's [`Placement::replicas`]) and succeeds only when all
    /// stored it; a GET asks the first and, when a unit fails or lacks the key, the next; a
    /// CLEAR clears them all.
    pub replicas: usize,
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
            replicas: 1,
        }
    }
}

/// A client of one or more units. Cheap to share behind an `Arc`; requests are pipelined.
pub struct Client {
    conns: Vec<Slot>,
    /// What new sessions are opened with (after a session-fatal error).
    cfg: ClientConfig,
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
        if cfg.replicas == 0 || cfg.replicas > cfg.units.len() {
            return Err(ClientError::ApiMisuse(format!(
                "replicas = {}: give 1 to the number of units ({})",
                cfg.replicas,
                cfg.units.len()
            )));
        }
        let backend = cfg.backend;
        let payload_addr = cfg.payload_addr;
        let bytes = cfg.recv_pool_bytes;
        let token = cfg.token.clone();
        let (agent, pool) = tokio::task::spawn_blocking(move || {
            let agent = backend.role_agent_at("client", payload_addr, token.as_ref())?;
            let pool = RegisteredPool::new(&agent, bytes).map_err(ClientError::from_pool)?;
            Ok::<_, ClientError>((Arc::new(agent), pool))
        })
        .await??;
        let mut conns = Vec::with_capacity(cfg.units.len());
        for (unit, addr) in cfg.units.iter().enumerate() {
            let conn = Conn::open(unit, addr, &cfg, &agent).await?;
            conns.push(Slot(tokio::sync::Mutex::new(Arc::new(conn))));
        }
        Ok(Client {
            conns,
            cfg: cfg.clone(),
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

    /// The session with `unit`: the current one, or a new one when the current one ended
    /// (its connection closed, or the unit failed it: `peer_failed`). The request that met
    /// the failure was not retried; its error was returned to its caller.
    async fn conn(&self, unit: usize) -> Result<Arc<Conn>, ClientError> {
        let slot = self
            .conns
            .get(unit)
            .ok_or_else(|| ClientError::ApiMisuse(format!("no unit {unit}")))?;
        let mut cur = slot.0.lock().await;
        if cur.ended() {
            let addr = &self.cfg.units[unit];
            tracing::debug!(unit, %addr, "session ended; opening a new one");
            *cur = Arc::new(Conn::open(unit, addr, &self.cfg, &self.agent).await?);
        }
        Ok(cur.clone())
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

    /// The client's receive pool: GET results too large to come inline are views of it.
    pub fn recv_pool(&self) -> &RegisteredPool {
        &self.pool
    }

    /// Bytes of the receive pool held back from timed-out GETs (a unit may still write
    /// them); they are counted in the pool's `used` and return when the client drops.
    pub fn quarantined_bytes(&self) -> u64 {
        self.quarantine.lock().iter().map(|b| b.len()).sum()
    }

    /// Copies of every value ([`ClientConfig::replicas`]).
    pub fn replicas(&self) -> usize {
        self.cfg.replicas
    }

    /// The units of every index, flat: replica `k` of `indexes[p]` is at `p * replicas + k`.
    /// A placement that names too few units, one twice or one beyond the list would lose a
    /// copy: it is refused.
    fn placements(&self, partition: &str, indexes: &[u64]) -> Result<Vec<usize>, ClientError> {
        let (r, n) = (self.cfg.replicas, self.conns.len());
        let mut flat = Vec::with_capacity(indexes.len() * r);
        let mut one = Vec::with_capacity(r);
        for &i in indexes {
            self.placement
                .replicas(partition, i, &self.cfg.units, r, &mut one);
            let distinct = one.iter().enumerate().all(|(k, u)| !one[..k].contains(u));
            if one.len() != r || !distinct || one.iter().any(|&u| u >= n) {
                return Err(ClientError::ApiMisuse(format!(
                    "the placement gave units {one:?} for index {i}: {r} distinct units below \
                     {n} are needed"
                )));
            }
            flat.extend_from_slice(&one);
        }
        Ok(flat)
    }

    /// For each unit, the positions of `indexes` it holds a copy of.
    fn split(&self, partition: &str, indexes: &[u64]) -> Result<Vec<Vec<usize>>, ClientError> {
        let r = self.cfg.replicas;
        let mut per = vec![Vec::new(); self.conns.len()];
        for (pos, units) in self.placements(partition, indexes)?.chunks(r).enumerate() {
            for &u in units {
                per[u].push(pos);
            }
        }
        Ok(per)
    }

    /// Stores `columns` (one `(field, values)` per field, one value per index) at `indexes`.
    /// The units are asked concurrently; each unit replaces its keys atomically (a PUT that
    /// fails on one unit may have been stored on another). With several replicas it succeeds
    /// only when every unit holding a copy stored it, and fails with
    /// [`ClientError::Replicas`] naming those that did not. Tensors travel from the caller's
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
        for (unit, positions) in self.split(partition, indexes)?.into_iter().enumerate() {
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
        let results = join_all(work).await;
        if self.cfg.replicas == 1 {
            return results.into_iter().collect();
        }
        let failed: Vec<ClientError> = results.into_iter().filter_map(Result::err).collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(ClientError::Replicas { failed })
        }
    }

    /// Reads `fields` at `indexes`: one `Vec<Value>` per field, in the requested order.
    /// Tensors of large GETs are views into the client's receive pool, owning their block.
    ///
    /// With several replicas, indexes whose unit failed (unreachable, a broken session, a
    /// transfer error, no answer in time) or lacked a key are asked of their next replica.
    /// Indexes whose every replica failed are [`ClientError::Lost`]; keys that a reachable
    /// replica lacked and no other had are the missing error of the unit that said so.
    pub async fn get(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[&str],
    ) -> Result<Vec<Vec<Value>>, ClientError> {
        let fields: Vec<String> = fields.iter().map(|f| (*f).to_owned()).collect();
        let mut out: Vec<Vec<Option<Value>>> = vec![vec![None; indexes.len()]; fields.len()];
        let r = self.cfg.replicas;
        let places = self.placements(partition, indexes)?;
        let mut pending: Vec<usize> = (0..indexes.len()).collect();
        // Per position: whether a reachable replica answered that it lacks a key.
        let mut lacked = vec![false; if r > 1 { indexes.len() } else { 0 }];
        let mut missing: Option<ClientError> = None;
        let mut failures: Vec<ClientError> = Vec::new();
        for rank in 0..r {
            if pending.is_empty() {
                break;
            }
            let mut per = vec![Vec::new(); self.conns.len()];
            for &p in &pending {
                per[places[p * r + rank]].push(p);
            }
            pending.clear();
            let mut work = Vec::new();
            for (unit, positions) in per.into_iter().enumerate() {
                if positions.is_empty() {
                    continue;
                }
                let idx: Vec<u64> = positions.iter().map(|p| indexes[*p]).collect();
                let fields = fields.clone();
                work.push(async move {
                    let cols = self.get_unit(unit, partition, idx, fields).await;
                    (positions, cols)
                });
            }
            for (positions, r_unit) in join_all(work).await {
                match r_unit {
                    Ok(cols) => {
                        for (f, col) in cols.into_iter().enumerate() {
                            for (p, v) in positions.iter().zip(col) {
                                out[f][*p] = Some(v);
                            }
                        }
                    }
                    Err(e) if r > 1 && e.is_missing() => {
                        for &p in &positions {
                            lacked[p] = true;
                        }
                        pending.extend(positions);
                        missing.get_or_insert(e);
                    }
                    Err(e) if r > 1 && e.is_unit_failure() => {
                        pending.extend(positions);
                        failures.push(e);
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if !pending.is_empty() {
            // In the order they were asked for.
            pending.sort_unstable();
            let lost: Vec<u64> = pending
                .iter()
                .filter(|&&p| !lacked[p])
                .map(|&p| indexes[p])
                .collect();
            if !lost.is_empty() {
                return Err(ClientError::Lost {
                    indexes: lost,
                    causes: failures,
                });
            }
            if let Some(e) = missing {
                return Err(e);
            }
        }
        Ok(out
            .into_iter()
            .map(|c| c.into_iter().map(|v| v.unwrap_or(Value::Null)).collect())
            .collect())
    }

    /// Removes `indexes` (all fields). Idempotent.
    pub async fn clear(&self, partition: &str, indexes: &[u64]) -> Result<(), ClientError> {
        self.clear_fields(partition, indexes, None).await
    }

    /// Removes `fields` (all when `None`) at `indexes`, on every unit that holds a copy.
    /// Idempotent.
    pub async fn clear_fields(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: Option<&[&str]>,
    ) -> Result<(), ClientError> {
        for (unit, positions) in self.split(partition, indexes)?.into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let conn = self.conn(unit).await?;
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
        for unit in 0..self.conns.len() {
            let conn = self.conn(unit).await?;
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
        for unit in 0..self.conns.len() {
            let conn = self.conn(unit).await?;
            match conn.call(Request::Stats).await?.1 {
                Response::Stats(s) => out.push(s),
                other => return Err(conn.unexpected(other)),
            }
        }
        Ok(out)
    }

    /// Sends one raw request to a unit and returns its response (for tools and tests).
    pub async fn raw(&self, unit: usize, req: Request) -> Result<Response, ClientError> {
        let conn = self.conn(unit).await?;
        Ok(conn.call(req).await?.1)
    }
}

/// A unit's session, replaced by a new one once it ended.
struct Slot(tokio::sync::Mutex<Arc<Conn>>);

/// Runs `futs` concurrently on the current task and returns their outputs in order.
pub async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
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
