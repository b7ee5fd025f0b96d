//! The async client: pipelined control connections to one or more units, and the payload
//! plane (PUT frames from the caller's memory, WRITEn by the client into the unit's block or,
//! over the one-sided engines, READ by the unit; GETs written by the unit into the client's
//! own registered pool).

use std::time::Duration;
use tessera_sync::{Arc, Mutex};

use bytes::Bytes;
use tessera_framecodec::{encode, Decoder, Encoder, Limits, Value};
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
mod repair;

use self::conn::{Conn, InFlight};
pub use self::placement::{Modulo, Placement, Rendezvous};
pub use self::repair::RepairReport;

/// Client configuration.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Control addresses of the units (`HOST:PORT` or `unix:PATH`), in placement order.
    /// Unused when `cluster` (the `etcd` feature) names a cluster.
    pub units: Vec<String>,
    /// The cluster whose live units to use, found and followed through etcd, instead of a
    /// fixed list: the client reads the set, watches it, reaches units that join and stops
    /// using those whose lease expired. Placement is by the units' names (rendezvous, unless
    /// another is given).
    #[cfg(feature = "etcd")]
    pub cluster: Option<tessera_cluster::ClusterConfig>,
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
    /// Fault every page of the receive pool in when the client connects (as an RDMA
    /// registration pins them), so that no GET lands in fresh memory and pays for its first
    /// touch (on a VM, several microseconds a page); the whole pool is then resident. Off by
    /// default.
    pub prefault_recv_pool: bool,
    /// Largest control message accepted from a unit.
    pub max_message_bytes: u64,
    /// How long a unit's answer to any request, a PUT's WRITE or a GET's completion may take
    /// before the client gives up ([`ClientError::Timeout`]; the outcome is then unknown and
    /// not retried).
    pub timeout: Duration,
    /// Polls the control connections for answers before a worker of the caller's runtime
    /// parks, when that runtime was built with [`BusyPoll::on_park`] (off by default). A
    /// poller built with [`BusyPoll::expecting`] also polls past its window for an answer
    /// the client expects later, from the answer times of the latest requests of its shape.
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
            #[cfg(feature = "etcd")]
            cluster: None,
            backend: Backend::Shm,
            payload_addr: None,
            token: None,
            recv_pool_bytes: 1 << 30,
            prefault_recv_pool: false,
            max_message_bytes: 256 << 20,
            timeout: Duration::from_secs(60),
            busy_poll: None,
            replicas: 1,
        }
    }
}

/// A client of one or more units. Cheap to share behind an `Arc`; requests are pipelined.
pub struct Client {
    /// The units in use now; a cluster's discovery task replaces it as members come and go.
    units: Arc<Mutex<Arc<Units>>>,
    #[cfg(feature = "etcd")]
    discovery: Option<crate::cluster::Discovery>,
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
    /// The requests in flight over all sessions.
    flying: Arc<InFlight>,
}

impl Client {
    /// Connects to every unit of `cfg` with [`Modulo`] placement, or follows its cluster with
    /// [`Rendezvous`] placement (a unit joining or leaving moves only its share).
    pub async fn connect(cfg: ClientConfig) -> Result<Client, ClientError> {
        #[cfg(feature = "etcd")]
        if cfg.cluster.is_some() {
            return Self::connect_with(cfg, Box::new(Rendezvous)).await;
        }
        Self::connect_with(cfg, Box::new(Modulo)).await
    }

    /// Connects with a custom placement.
    pub async fn connect_with(
        cfg: ClientConfig,
        placement: Box<dyn Placement>,
    ) -> Result<Client, ClientError> {
        #[cfg(feature = "etcd")]
        let cluster = cfg.cluster.clone();
        #[cfg(not(feature = "etcd"))]
        let cluster: Option<std::convert::Infallible> = None;
        if cluster.is_none() {
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
        } else if cfg.replicas == 0 {
            return Err(ClientError::ApiMisuse(
                "replicas = 0: give 1 or more".into(),
            ));
        }
        let backend = cfg.backend;
        let payload_addr = cfg.payload_addr;
        let bytes = cfg.recv_pool_bytes;
        let prefault = cfg.prefault_recv_pool;
        let token = cfg.token.clone();
        let (agent, pool) = tokio::task::spawn_blocking(move || {
            let agent = backend.role_agent_at("client", payload_addr, token.as_ref())?;
            let pool = RegisteredPool::new(&agent, bytes).map_err(ClientError::from_pool)?;
            if prefault {
                pool.populate().map_err(ClientError::from_pool)?;
            }
            Ok::<_, ClientError>((Arc::new(agent), pool))
        })
        .await??;
        let units = Arc::new(Mutex::new(Arc::new(Units::default())));
        let flying = Arc::new(InFlight::default());
        #[cfg(feature = "etcd")]
        let discovery = match &cluster {
            Some(c) => Some(crate::cluster::Discovery::start(c, cfg.timeout, &units).await?),
            None => None,
        };
        if cluster.is_none() {
            // A fixed list: every unit is reached now, so that a wrong address fails here.
            let mut fixed = Units::default();
            for (number, addr) in cfg.units.iter().enumerate() {
                let conn = Conn::open(number, addr, &cfg, &agent, &flying).await?;
                fixed.ids.push(addr.clone());
                fixed.slots.push(Arc::new(Slot::open(number, addr, conn)));
            }
            *units.lock() = Arc::new(fixed);
        }
        Ok(Client {
            units,
            #[cfg(feature = "etcd")]
            discovery,
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
            flying,
        })
    }

    /// The units in use now, in placement order.
    fn current(&self) -> Arc<Units> {
        self.units.lock().clone()
    }

    /// The session with the unit of `slot`: the current one, or a new one when there is none
    /// yet or the current one ended (its connection closed, or the unit failed it:
    /// `peer_failed`). The request that met the failure was not retried; its error was
    /// returned to its caller.
    async fn conn(&self, slot: &Slot) -> Result<Arc<Conn>, ClientError> {
        let mut cur = slot.conn.lock().await;
        match &*cur {
            Some(conn) if !conn.ended() => return Ok(conn.clone()),
            Some(_) => {
                tracing::debug!(unit = slot.number, addr = %slot.addr, "session ended; opening a new one");
            }
            None => {}
        }
        let conn = Arc::new(
            Conn::open(
                slot.number,
                &slot.addr,
                &self.cfg,
                &self.agent,
                &self.flying,
            )
            .await?,
        );
        *cur = Some(conn.clone());
        Ok(conn)
    }

    /// The unit at `pos` of the current set.
    fn slot(&self, pos: usize) -> Result<Arc<Slot>, ClientError> {
        self.current()
            .slots
            .get(pos)
            .cloned()
            .ok_or_else(|| ClientError::ApiMisuse(format!("no unit {pos}")))
    }

    /// Number of units in use now.
    pub fn units(&self) -> usize {
        self.current().slots.len()
    }

    /// The units in use now, and how current that set is.
    pub fn membership(&self) -> Membership {
        let units = self.current();
        Membership {
            units: units
                .slots
                .iter()
                .zip(&units.ids)
                .map(|(s, id)| Member {
                    number: s.number,
                    name: id.clone(),
                    addr: s.addr.clone(),
                })
                .collect(),
            #[cfg(feature = "etcd")]
            stale_for: self.discovery.as_ref().and_then(|d| d.staleness()),
            #[cfg(not(feature = "etcd"))]
            stale_for: None,
            revision: units.revision,
        }
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

    /// The units of every index in `units`, flat: replica `k` of `indexes[p]` is at
    /// `p * r + k`. A placement that names too few units, one twice or one beyond the list
    /// would lose a copy: it is refused.
    fn placements(
        &self,
        units: &Units,
        r: usize,
        partition: &str,
        indexes: &[u64],
    ) -> Result<Vec<usize>, ClientError> {
        let n = units.slots.len();
        if r == 0 || r > n {
            return Err(ClientError::TooFewUnits {
                live: n,
                needed: r.max(1),
            });
        }
        if n == 1 {
            // The one unit holds every index: the only placement there is.
            return Ok(vec![0; indexes.len()]);
        }
        let mut flat = Vec::with_capacity(indexes.len() * r);
        let mut one = Vec::with_capacity(r);
        for &i in indexes {
            self.placement
                .replicas(partition, i, &units.ids, r, &mut one);
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

    /// Copies a read or a clear reaches: every replica, or every live unit when fewer are
    /// live (a cluster's unit lost).
    fn reach(&self, units: &Units) -> usize {
        self.cfg.replicas.min(units.slots.len())
    }

    /// For each unit of `units`, the positions of `indexes` it holds one of `r` copies of.
    fn split(
        &self,
        units: &Units,
        r: usize,
        partition: &str,
        indexes: &[u64],
    ) -> Result<Vec<Vec<usize>>, ClientError> {
        let mut per = vec![Vec::new(); units.slots.len()];
        for (pos, on) in self
            .placements(units, r, partition, indexes)?
            .chunks(r)
            .enumerate()
        {
            for &u in on {
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
        let units = self.current();
        let per = self.split(&units, self.cfg.replicas, partition, indexes)?;
        let mut work = Vec::new();
        for (slot, positions) in units.slots.iter().zip(per) {
            if positions.is_empty() {
                continue;
            }
            let idx: Vec<u64> = positions.iter().map(|p| indexes[*p]).collect();
            let fields = fields.clone();
            work.push(async move {
                let frames = if positions.len() == indexes.len() {
                    // Every index on this unit, in order (positions ascend): the columns are
                    // encoded where the caller keeps them, no value cloned.
                    let lists: Vec<&[Value]> = columns.iter().map(|(_, v)| v.as_slice()).collect();
                    Encoder::new().encode_lists(&lists)?
                } else {
                    encode(&Value::List(
                        columns
                            .iter()
                            .map(|(_, vals)| {
                                Value::List(positions.iter().map(|p| vals[*p].clone()).collect())
                            })
                            .collect(),
                    ))?
                };
                self.put_unit(slot, partition, idx, fields, frames).await
            });
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
        let units = self.current();
        let r = self.reach(&units);
        let places = self.placements(&units, r, partition, indexes)?;
        let mut pending: Vec<usize> = (0..indexes.len()).collect();
        // Per position: whether a reachable replica answered that it lacks a key.
        let mut lacked = vec![false; if r > 1 { indexes.len() } else { 0 }];
        let mut missing: Option<ClientError> = None;
        let mut failures: Vec<ClientError> = Vec::new();
        for rank in 0..r {
            if pending.is_empty() {
                break;
            }
            let mut per = vec![Vec::new(); units.slots.len()];
            for &p in &pending {
                per[places[p * r + rank]].push(p);
            }
            pending.clear();
            let mut work = Vec::new();
            for (slot, positions) in units.slots.iter().zip(per) {
                if positions.is_empty() {
                    continue;
                }
                let idx: Vec<u64> = positions.iter().map(|p| indexes[*p]).collect();
                let fields = fields.clone();
                work.push(async move {
                    let cols = self.get_unit(slot, partition, idx, fields).await;
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
        let units = self.current();
        let per = self.split(&units, self.reach(&units), partition, indexes)?;
        for (slot, positions) in units.slots.iter().zip(per) {
            if positions.is_empty() {
                continue;
            }
            let conn = self.conn(slot).await?;
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
        for slot in &self.current().slots {
            let conn = self.conn(slot).await?;
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
        let units = self.current();
        let mut out = Vec::with_capacity(units.slots.len());
        for slot in &units.slots {
            let conn = self.conn(slot).await?;
            match conn.call(Request::Stats).await?.1 {
                Response::Stats(s) => out.push(s),
                other => return Err(conn.unexpected(other)),
            }
        }
        Ok(out)
    }

    /// Statistics of every unit in use now, each with its own outcome: one unit that is
    /// down (a cluster's unit whose lease has not expired yet) does not hide the others.
    pub async fn stats_each(&self) -> Vec<(Member, Result<Stats, ClientError>)> {
        let units = self.current();
        let asks = units.slots.iter().map(|slot| async move {
            let conn = self.conn(slot).await?;
            match conn.call(Request::Stats).await?.1 {
                Response::Stats(s) => Ok(s),
                other => Err(conn.unexpected(other)),
            }
        });
        let results = join_all(asks.collect()).await;
        units
            .slots
            .iter()
            .zip(&units.ids)
            .zip(results)
            .map(|((slot, id), r)| {
                let member = Member {
                    number: slot.number,
                    name: id.clone(),
                    addr: slot.addr.clone(),
                };
                (member, r)
            })
            .collect()
    }

    /// Sends one raw request to the unit at `unit` of the current set and returns its
    /// response (for tools and tests).
    pub async fn raw(&self, unit: usize, req: Request) -> Result<Response, ClientError> {
        let conn = self.conn(&*self.slot(unit)?).await?;
        Ok(conn.call(req).await?.1)
    }
}

/// The units a client uses, in placement order.
#[derive(Default)]
pub(crate) struct Units {
    /// Each unit's name for placement: its address as given, or the name it announced.
    pub(crate) ids: Vec<String>,
    pub(crate) slots: Vec<Arc<Slot>>,
    /// The cluster's etcd revision this set is as of (0 for a fixed list).
    pub(crate) revision: i64,
}

/// A unit and its session, opened when first needed and replaced by a new one once it
/// ended.
pub(crate) struct Slot {
    /// The unit's number in errors and logs: its position in a fixed list, or the order in
    /// which this client first saw it in a cluster.
    pub(crate) number: usize,
    pub(crate) addr: String,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
}

impl Slot {
    /// A unit not reached yet.
    #[cfg(feature = "etcd")]
    pub(crate) fn new(number: usize, addr: &str) -> Self {
        Self {
            number,
            addr: addr.to_owned(),
            conn: tokio::sync::Mutex::new(None),
        }
    }

    fn open(number: usize, addr: &str, conn: Conn) -> Self {
        Self {
            number,
            addr: addr.to_owned(),
            conn: tokio::sync::Mutex::new(Some(Arc::new(conn))),
        }
    }
}

/// The units a client uses now ([`Client::membership`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// In placement order.
    pub units: Vec<Member>,
    /// How long the set has been the last known one because etcd is unreachable (a cluster
    /// client only): the units keep serving, but joins and losses are not seen meanwhile.
    pub stale_for: Option<Duration>,
    /// The cluster's etcd revision the set is as of (0 for a fixed list).
    pub revision: i64,
}

/// One unit of a [`Membership`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its number in errors ([`ClientError::unit`]).
    pub number: usize,
    /// Its name for placement.
    pub name: String,
    /// Its control address.
    pub addr: String,
}

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
