//! The sender pool: puts copy views into one registered region, packed, and describe them.

use std::collections::HashMap;
use std::fmt;

use bytes::Bytes;
use tessera_alloc::{AllocError, Group, Layout, Placement};
use tessera_transport::{Agent, PoolBlock, PoolError, RegisteredPool, Registration, RemoteDesc};

use crate::descriptor::{BlockDesc, ObjectDescriptor, Place, TensorDesc, MAX_ALIGN, MAX_TENSORS};
use crate::error::{FreeError, PutError};
use crate::report::PoolReport;
use crate::tensor_ref::{Source, TensorRef};
use tessera_framecodec::Dims;
use tessera_sync::{Arc, Mutex};

/// The sender side: one region registered once with an agent, holding put objects until they
/// are freed. Cloning is cheap and shares the pool.
#[derive(Clone)]
pub struct SenderPool {
    inner: Arc<Inner>,
}

struct Inner {
    agent: Arc<Agent>,
    pool: RegisteredPool,
    objects: Mutex<HashMap<Box<[u8]>, Object>>,
}

/// What a put object holds: its pool blocks, and whatever keeps its in-place views alive.
struct Object {
    blocks: Vec<PoolBlock>,
    _keep: Vec<Keep>,
    pool_bytes: u64,
    in_place: u64,
    desc: Arc<ObjectDescriptor>,
}

/// Held, never read: dropping it is what releases the memory.
enum Keep {
    Bytes(#[allow(dead_code)] Bytes),
    Reg(#[allow(dead_code)] Registration),
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SenderPool>();
};

/// How one tensor of a put travels.
enum Route {
    Empty,
    Copy(usize),
    InPlace,
}

/// Bytes an in-place tensor lives in, as the agent's registration names them.
fn resolve(
    agent: &Agent,
    t: &TensorRef<'_>,
    index: usize,
) -> Result<Option<(u64, u64, Keep, Keep)>, PutError> {
    match &t.source {
        Source::Registered(reg, offset) => {
            let ptr = reg.as_ptr().wrapping_add(*offset as usize);
            match agent.find_registered(ptr, t.bytes) {
                Some(found) if found.id() == reg.id() => {
                    let at = found.offset_in_registration();
                    Ok(Some((
                        reg.id(),
                        at,
                        Keep::Reg(found),
                        Keep::Reg(reg.clone()),
                    )))
                }
                _ => Err(PutError::NotRegisteredHere { index }),
            }
        }
        Source::Shared(bytes) if t.is_contiguous() => {
            match agent.find_registered(bytes.as_ptr(), t.bytes) {
                Some(found) => Ok(Some((
                    found.id(),
                    found.offset_in_registration(),
                    Keep::Reg(found),
                    Keep::Bytes(bytes.clone()),
                ))),
                None => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

/// Places `items` into `blocks` in order, each at its alignment (absolute in the region), a
/// run per block; `None` if they do not fit.
fn fit_into(blocks: &[PoolBlock], items: &[Layout]) -> Option<Vec<Option<Placement>>> {
    let mut out = Vec::with_capacity(items.len());
    let mut b = 0usize;
    let mut cursor = 0u64;
    for item in items {
        if item.size() == 0 {
            out.push(None);
            continue;
        }
        loop {
            let block = blocks.get(b)?;
            let abs = block.offset().checked_add(cursor)?;
            let start = abs.checked_add(item.align() - 1)? & !(item.align() - 1);
            let rel = start - block.offset();
            if rel.checked_add(item.size())? <= block.len() {
                out.push(Some(Placement {
                    block: b,
                    offset: rel,
                }));
                cursor = rel + item.size();
                break;
            }
            b += 1;
            cursor = 0;
        }
    }
    Some(out)
}

impl SenderPool {
    /// A pool of `capacity` bytes, registered with `agent` once. Share the agent (`Arc`) with the
    /// process's other pool.
    pub fn new(agent: Arc<Agent>, capacity: u64) -> Result<Self, PoolError> {
        Ok(Self {
            inner: Arc::new(Inner {
                pool: RegisteredPool::new(&agent, capacity)?,
                agent,
                objects: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The agent the pool is registered with.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.inner.agent
    }

    /// The pool's registration.
    pub fn registration(&self) -> &Registration {
        self.inner.pool.registration()
    }

    /// Puts `tensors` under `id` and returns the descriptor a receiver fetches them with.
    ///
    /// Tensors that need a copy (see [`TensorRef`]) are packed, each at its dtype's
    /// alignment, into one block when a free range holds them all, else into a few blocks
    /// each holding a run of whole tensors; exactly the bytes each view covers are copied.
    /// Tensors already in registered memory are described in place. Zero-size tensors take
    /// no space and no descriptor. A re-put of a live `id` replaces it, reusing its blocks
    /// when the new tensors fit there; readers of the previous version must be done.
    ///
    /// On error nothing stays allocated for this put; `id` keeps its previous object, unless
    /// the error says the previous one was released to make room.
    pub fn put(
        &self,
        id: impl AsRef<[u8]>,
        tensors: &[TensorRef<'_>],
    ) -> Result<Arc<ObjectDescriptor>, PutError> {
        self.put_with(id.as_ref(), tensors, |block, offset, data| {
            block.write_at(offset, data).map_err(PutError::from)
        })
    }

    pub(crate) fn put_with(
        &self,
        id: &[u8],
        tensors: &[TensorRef<'_>],
        mut write: impl FnMut(&PoolBlock, u64, &[u8]) -> Result<(), PutError>,
    ) -> Result<Arc<ObjectDescriptor>, PutError> {
        if tensors.len() > MAX_TENSORS {
            return Err(PutError::TooManyTensors {
                count: tensors.len(),
                max: MAX_TENSORS,
            });
        }
        let agent = &self.inner.agent;
        let mut routes = Vec::with_capacity(tensors.len());
        let mut layouts = Vec::new();
        let mut keep = Vec::new();
        // (registration, offset, length, tensor index) of each in-place tensor.
        let mut in_place: Vec<(u64, u64, u64, usize)> = Vec::new();
        for (index, t) in tensors.iter().enumerate() {
            if t.bytes == 0 {
                routes.push(Route::Empty);
                continue;
            }
            if let Some((reg, offset, k1, k2)) = resolve(agent, t, index)? {
                keep.push(k1);
                keep.push(k2);
                in_place.push((reg, offset, t.bytes, index));
                routes.push(Route::InPlace);
                continue;
            }
            let layout = Layout::new(t.bytes, t.dtype.align() as u64).map_err(PutError::Alloc)?;
            routes.push(Route::Copy(layouts.len()));
            layouts.push(layout);
        }

        let Allocated {
            group,
            previous,
            previous_released,
        } = self.allocate(id, &layouts)?;
        let restore = |previous: Option<Object>| {
            if let Some(prev) = previous {
                self.inner.objects.lock().entry(id.into()).or_insert(prev);
            }
        };
        // From here on every failure drops `group`, which returns every block: rollback.
        for (t, route) in tensors.iter().zip(&routes) {
            let Route::Copy(j) = *route else { continue };
            let Some(p) = group.placements[j] else {
                continue;
            };
            let block = &group.blocks[p.block];
            let mut at = p.offset;
            let mut failed = None;
            t.gather(|run| {
                if failed.is_none() {
                    if let Err(e) = write(block, at, run) {
                        failed = Some(e);
                    }
                    at += run.len() as u64;
                }
            });
            if let Some(e) = failed {
                restore(previous);
                return Err(e);
            }
        }

        // The pool blocks that hold something, one descriptor each.
        let n = group.blocks.len();
        let mut align = vec![0u64; n];
        for (j, p) in group.placements.iter().enumerate() {
            if let Some(p) = p {
                align[p.block] = align[p.block].max(layouts[j].align());
            }
        }
        let mut blocks = Vec::with_capacity(n + in_place.len().min(16));
        let mut index_of = vec![u32::MAX; n];
        let mut kept = Vec::with_capacity(n);
        for (b, block) in group.blocks.into_iter().enumerate() {
            if align[b] == 0 {
                continue; // a reused block the new object does not need
            }
            let remote = match block.remote() {
                Ok(r) => r,
                Err(e) => {
                    restore(previous);
                    return Err(e.into());
                }
            };
            index_of[b] = blocks.len() as u32;
            blocks.push(BlockDesc {
                remote,
                align: align[b].min(MAX_ALIGN),
            });
            kept.push(block);
        }
        let pool_bytes = kept.iter().map(PoolBlock::len).sum();

        // In-place tensors: overlapping or adjacent ranges of one registration merge into one
        // descriptor, so forwarding 10k views of one received block is one read again.
        in_place.sort_unstable();
        let mut ranges: Vec<(u64, u64, u64, u64)> = Vec::new(); // (reg, start, end, align)
        let mut range_of = vec![0usize; tensors.len()];
        for &(reg, offset, len, index) in &in_place {
            let end = offset + len;
            let a = tensors[index].dtype.align() as u64;
            match ranges.last_mut() {
                Some(r) if r.0 == reg && offset <= r.2 => {
                    r.2 = r.2.max(end);
                    r.3 = r.3.max(a);
                }
                _ => ranges.push((reg, offset, end, a)),
            }
            range_of[index] = ranges.len() - 1;
        }
        let first_in_place = blocks.len();
        let in_place_bytes = ranges.iter().map(|r| r.2 - r.1).sum();
        blocks.extend(ranges.iter().map(|&(reg, start, end, a)| BlockDesc {
            remote: RemoteDesc::new(reg, start, end - start),
            align: a.min(MAX_ALIGN),
        }));
        let mut offsets = vec![0u64; tensors.len()];
        for &(_, offset, _, index) in &in_place {
            offsets[index] = offset - ranges[range_of[index]].1;
        }

        let tensors = tensors
            .iter()
            .zip(&routes)
            .enumerate()
            .map(|(index, (t, route))| TensorDesc {
                dtype: t.dtype,
                shape: Dims::from_slice(&t.shape),
                place: match *route {
                    Route::Empty => None,
                    Route::Copy(j) => group.placements[j].map(|p| Place {
                        block: index_of[p.block],
                        offset: p.offset,
                    }),
                    Route::InPlace => Some(Place {
                        block: (first_in_place + range_of[index]) as u32,
                        offset: offsets[index],
                    }),
                },
            })
            .collect();
        let desc = Arc::new(ObjectDescriptor { blocks, tensors });
        let _ = previous_released;
        let object = Object {
            blocks: kept,
            _keep: keep,
            pool_bytes,
            in_place: in_place_bytes,
            desc: desc.clone(),
        };
        let replaced = self.inner.objects.lock().insert(id.into(), object);
        // Outside the lock: dropping returns blocks to the allocator.
        drop(replaced);
        drop(previous);
        Ok(desc)
    }

    /// Blocks for `layouts`: the id's previous blocks when they fit, else fresh ones. The
    /// previous object is taken out of the table; it comes back to be restored on failure or
    /// dropped on success.
    fn allocate(&self, id: &[u8], layouts: &[Layout]) -> Result<Allocated, PutError> {
        let previous = self.inner.objects.lock().remove(id);
        if layouts.is_empty() {
            return Ok(Allocated {
                group: Group {
                    blocks: Vec::new(),
                    placements: Vec::new(),
                },
                previous,
                previous_released: false,
            });
        }
        let previous = match previous {
            Some(prev) => match fit_into(&prev.blocks, layouts) {
                Some(placements) => {
                    return Ok(Allocated {
                        group: Group {
                            blocks: prev.blocks,
                            placements,
                        },
                        previous: None,
                        previous_released: true,
                    })
                }
                None => Some(prev),
            },
            None => None,
        };
        match self.inner.pool.lease_group(layouts) {
            Ok(group) => Ok(Allocated {
                group,
                previous,
                previous_released: false,
            }),
            Err(PoolError::Alloc(e @ AllocError::OutOfMemory { .. })) => match previous {
                None => Err(put_error(e, false)),
                Some(prev) => {
                    drop(prev);
                    match self.inner.pool.lease_group(layouts) {
                        Ok(group) => Ok(Allocated {
                            group,
                            previous: None,
                            previous_released: true,
                        }),
                        Err(PoolError::Alloc(e)) => Err(put_error(e, true)),
                        Err(_) => Err(PutError::OutOfMemory {
                            requested: layouts.iter().map(|l| l.size()).sum(),
                            free: 0,
                            largest_free: 0,
                            previous_released: true,
                        }),
                    }
                }
            },
            Err(e) => {
                if let Some(prev) = previous {
                    self.inner.objects.lock().entry(id.into()).or_insert(prev);
                }
                Err(match e {
                    PoolError::Alloc(a) => PutError::Alloc(a),
                    PoolError::Region(r) => PutError::Copy(r),
                    _ => PutError::OutOfMemory {
                        requested: layouts.iter().map(|l| l.size()).sum(),
                        free: 0,
                        largest_free: 0,
                        previous_released: false,
                    },
                })
            }
        }
    }

    /// Releases `id`'s blocks and whatever kept its in-place views alive.
    pub fn free(&self, id: impl AsRef<[u8]>) -> Result<(), FreeError> {
        let id = id.as_ref();
        let removed = self.inner.objects.lock().remove(id);
        match removed {
            Some(object) => {
                drop(object);
                Ok(())
            }
            None => Err(FreeError::UnknownObject {
                id: String::from_utf8_lossy(id).into_owned(),
            }),
        }
    }

    /// The descriptor of a live object.
    pub fn descriptor(&self, id: impl AsRef<[u8]>) -> Option<Arc<ObjectDescriptor>> {
        self.inner
            .objects
            .lock()
            .get(id.as_ref())
            .map(|o| o.desc.clone())
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: impl AsRef<[u8]>) -> bool {
        self.inner.objects.lock().contains_key(id.as_ref())
    }

    /// Occupancy now.
    pub fn report(&self) -> PoolReport {
        let (leased, in_place, live_objects) = {
            let objects = self.inner.objects.lock();
            objects.values().fold((0, 0, 0), |(l, i, n), o| {
                (l + o.pool_bytes, i + o.in_place, n + 1)
            })
        };
        let r = self.inner.pool.report();
        PoolReport {
            capacity: r.capacity,
            used: r.used,
            leased,
            quarantined: 0,
            free: r.free,
            largest_free: r.largest_free,
            live_objects,
            in_place,
        }
    }
}

struct Allocated {
    group: Group<PoolBlock>,
    /// The id's previous object, when its blocks were not reused.
    previous: Option<Object>,
    previous_released: bool,
}

fn put_error(e: AllocError, previous_released: bool) -> PutError {
    match e {
        AllocError::OutOfMemory {
            requested,
            free,
            largest_free,
            ..
        } => PutError::OutOfMemory {
            requested,
            free,
            largest_free,
            previous_released,
        },
        other => PutError::Alloc(other),
    }
}

impl fmt::Debug for SenderPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SenderPool")
            .field("report", &self.report())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_framecodec::DType;
    use tessera_transport::Inproc;

    fn pool(capacity: u64) -> SenderPool {
        let agent = Arc::new(Agent::new("s", Inproc::new()).unwrap());
        SenderPool::new(agent, capacity).unwrap()
    }

    /// Ray leaks the block when the copy fails after the commit (a conjugate complex view);
    /// here every block returns and a re-put's previous object survives.
    #[test]
    fn a_copy_failing_after_allocation_rolls_back() {
        let p = pool(4096);
        let a = [1u8; 64];
        let c = [2u8; 32];
        let refs = [
            TensorRef::new(DType::F32, &[16], &a).unwrap(),
            TensorRef::new(DType::Complex128, &[2], &c).unwrap(),
        ];
        let mut calls = 0;
        let failing = |block: &PoolBlock, at: u64, data: &[u8]| {
            calls += 1;
            if calls == 2 {
                return Err(PutError::Copy(tessera_transport::RegionError::Empty));
            }
            block.write_at(at, data).map_err(PutError::from)
        };
        assert!(matches!(
            p.put_with(b"x", &refs, failing),
            Err(PutError::Copy(_))
        ));
        let r = p.report();
        assert_eq!((r.used, r.live_objects), (0, 0));
        assert!(!p.contains("x"));

        // A re-put that needs new blocks and fails keeps the previous object.
        let before = p.put("x", &refs[..1]).unwrap();
        let used = p.report().used;
        assert!(p
            .put_with(b"x", &refs, |_, _, _| Err(PutError::Copy(
                tessera_transport::RegionError::Empty
            )))
            .is_err());
        assert_eq!(p.descriptor("x"), Some(before));
        assert_eq!(p.report().used, used);
    }

    /// A put copies each covered byte once and nothing else: a transposed view of a larger
    /// storage moves exactly its elements, never the storage.
    #[test]
    fn a_put_copies_exactly_the_covered_bytes_once() {
        let p = pool(1 << 20);
        let storage: Vec<u8> = (0..=255).cycle().take(64 * 64 * 4).collect();
        let refs = [
            TensorRef::strided(DType::F32, &[16, 8], &[1, 64], &storage).unwrap(),
            TensorRef::new(DType::U8, &[100], &storage[..100]).unwrap(),
            TensorRef::new(DType::F64, &[0], &[]).unwrap(),
        ];
        let mut copied = 0u64;
        let mut calls = 0u64;
        p.put_with(b"c", &refs, |block, at, data| {
            copied += data.len() as u64;
            calls += 1;
            block.write_at(at, data).map_err(PutError::from)
        })
        .unwrap();
        assert_eq!(copied, 16 * 8 * 4 + 100);
        assert_eq!(
            calls,
            16 * 8 + 1,
            "one run per gathered element, one for the contiguous view"
        );
    }

    #[test]
    fn re_put_with_the_same_shapes_reuses_its_blocks() {
        let p = pool(4096);
        let a = [1u8; 100];
        let d1 = p
            .put("w", &[TensorRef::new(DType::U8, &[100], &a).unwrap()])
            .unwrap();
        let b = [2u8; 100];
        let d2 = p
            .put("w", &[TensorRef::new(DType::U8, &[100], &b).unwrap()])
            .unwrap();
        assert_eq!(d1, d2, "same block, same descriptor");
        assert_eq!(p.report().used, 100);
    }
}
