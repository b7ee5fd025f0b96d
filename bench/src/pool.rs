//! The `pool` suite: `tessera-rdt-pool` against Ray's RDT pool figures, with its references
//! (one memcpy of the same bytes, one READ of one 10 MiB tensor) measured in the same run.
//!
//! Sender and receiver are two agents of this process on the `shm` backend, so a READ is the
//! engine's one memcpy between two registrations and the figures isolate the pool's own costs.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use tessera_alloc::Layout;
use tessera_rdt_pool::{DType, ObjectDescriptor, ReceiverPool, SenderPool, TensorRef};
use tessera_transport::{shm::Shm, Agent, LocalDesc, Op, Peer, RegisteredPool, RemoteDesc};

use crate::timing::{best_of, us};
use crate::Report;

const VIEWS: usize = 10_000;
const VIEW_BYTES: usize = 256 * 4;
const TOTAL: usize = VIEWS * VIEW_BYTES;
const SCATTER: usize = 16 * 1024;
const SCATTER_BYTES: usize = 256;
const RUNS: usize = 20;
const RUNS_SCATTER: usize = 5;

fn agents() -> Result<(Arc<Agent>, Arc<Agent>)> {
    Ok((
        Arc::new(Agent::new("bench-sender", Shm::new())?),
        Arc::new(Agent::new("bench-receiver", Shm::new())?),
    ))
}

/// Runs the suite.
pub fn run(report: &mut Report) -> Result<()> {
    let (tx, rx) = agents()?;
    let sender = SenderPool::new(tx.clone(), 64 << 20)?;
    let receiver = ReceiverPool::new(rx.clone(), 64 << 20)?;
    let peer = rx.add_remote(&tx.metadata())?;
    let data: Vec<u8> = (0..TOTAL).map(|i| (i * 31 % 251) as u8).collect();
    let refs: Vec<TensorRef<'_>> = data
        .chunks(VIEW_BYTES)
        .map(|c| TensorRef::new(DType::F32, &[256], c))
        .collect::<Result<_, _>>()?;

    // Allocation and packing alone: the layouts of the 10k views and one group lease from a
    // registered pool of the same size, without the copy or the descriptor.
    let bare = RegisteredPool::new(&tx, 64 << 20)?;
    let alloc = best_of(
        RUNS,
        || (),
        |()| {
            let layouts: Vec<Layout> = refs
                .iter()
                .map(|r| Layout::new(r.bytes(), r.dtype().align() as u64))
                .collect::<Result<_, _>>()
                .expect("valid layouts");
            bare.lease_group(&layouts).expect("fits")
        },
    );
    let put = best_of(
        RUNS,
        || {
            let _ = sender.free("10k");
        },
        |()| sender.put("10k", &refs).expect("fits"),
    );
    let mut dst = vec![0u8; TOTAL];
    dst.copy_from_slice(&data);
    let memcpy = best_of(
        RUNS,
        || (),
        |()| {
            dst.copy_from_slice(std::hint::black_box(&data));
            dst[7]
        },
    );
    let alloc_us = us(alloc);
    let put_us = us(put);
    let memcpy_us = us(memcpy);
    report.put(
        "put_10k_alloc_us",
        alloc_us,
        format!("best of {RUNS}: layouts of 10,000 f32[256] views + one lease_group from a registered pool (packing and allocation, no copy); Ray: 4,600 us; goal <= 500"),
    );
    report.put(
        "put_10k_total_us",
        put_us,
        format!("best of {RUNS}: SenderPool::put of the 10,000 views (allocation, copy of 10 MiB, descriptor); Ray: 28,000 us"),
    );
    report.put(
        "memcpy_10m_us",
        memcpy_us,
        format!("best of {RUNS}: one copy_from_slice of the same 10 MiB into a warm buffer"),
    );
    report.put(
        "put_10k_vs_memcpy",
        put_us / memcpy_us,
        "put_10k_total_us / memcpy_10m_us",
    );
    report.put(
        "put_10k_goal_us",
        1.5 * memcpy_us + 500.0,
        "the goal for put_10k_total_us: 1.5 x memcpy_10m_us + 500",
    );

    // Receiver: fetch of the 10k object (one READ), and its unpack measured as the fetch
    // minus a bare READ of the same bytes into a block of the same pool.
    let desc = sender.put("10k", &refs)?;
    anyhow::ensure!(desc.blocks.len() == 1, "10k views packed into one block");
    let fetch = best_of(
        RUNS,
        || (),
        |()| {
            receiver
                .fetch(&desc, &peer)
                .expect("fetch")
                .wait()
                .expect("landed")
        },
    );
    let bare_rx = RegisteredPool::new(&rx, 64 << 20)?;
    let read_one = |desc: &ObjectDescriptor| {
        let block = bare_rx.lease(desc.bytes(), 64).expect("fits");
        let mut at = 0;
        let locals: Vec<LocalDesc> = desc
            .blocks
            .iter()
            .map(|b| {
                let d = block.desc_range(at, b.remote.len).expect("in block");
                at += b.remote.len;
                d
            })
            .collect();
        let remotes: Vec<RemoteDesc> = desc.blocks.iter().map(|b| b.remote).collect();
        peer.read(&locals, &remotes, None)
            .expect("posted")
            .wait()
            .expect("landed");
    };
    let read = best_of(RUNS, || (), |()| read_one(&desc));
    let unpack_us = (us(fetch) - us(read)).max(0.0);
    report.put(
        "fetch_10k_us",
        us(fetch),
        format!("best of {RUNS}: ReceiverPool::fetch + wait of the 10,000-view object: validate, lease, one READ, 10,000 Tensor views"),
    );
    report.put(
        "read_10m_us",
        us(read),
        format!("best of {RUNS}: a bare READ of the same 10 MiB block into a leased block (shm, one memcpy)"),
    );
    report.put(
        "unpack_10k_us",
        unpack_us,
        "fetch_10k_us - read_10m_us: validation, receive lease and building the 10,000 views; Ray: 35,000 us; goal <= 1000",
    );

    // Transfer of the 10k packed views against one 10 MiB tensor, and against one descriptor
    // per view (what Ray's pooling avoids).
    let single = sender.put(
        "single",
        &[TensorRef::new(DType::F32, &[(TOTAL / 4) as u64], &data)?],
    )?;
    let read_single = best_of(RUNS, || (), |()| read_one(&single));
    let views_vs_single = us(read) / us(read_single);
    report.put(
        "read_single_10m_us",
        us(read_single),
        format!("best of {RUNS}: READ of one f32[2,560,000] object's block"),
    );
    report.put(
        "views_vs_single",
        views_vs_single,
        "read_10m_us / read_single_10m_us: transfer of 10,000 packed views against one tensor of the same bytes; goal <= 1.1",
    );
    let per_view = per_view_read(&peer, &bare_rx, &desc)?;
    report.put(
        "read_10k_descs_us",
        per_view,
        format!("best of {RUNS}: the same 10 MiB as 10,000 uncoalesced descriptors (one per view)"),
    );
    report.put(
        "per_view_descs_vs_packed",
        per_view / us(read),
        "read_10k_descs_us / read_10m_us: what packing saves",
    );

    // Allocate + free of a 1 KiB object with 1,001 holes in the pool.
    let cycle = put_free_with_holes(&tx, 1001)?;
    report.put(
        "put_free_1k_1001_holes_us",
        cycle,
        "best of 5 runs of 10,000 cycles, per cycle: SenderPool::put + free of one f32[256] with 1,001 free holes; Ray: ~290 us",
    );

    // Worst-case scattered placement: 16k tensors into 16k separate holes.
    let scatter = scatter_16k(&tx)?;
    report.put(
        "scatter_16k_us",
        scatter,
        format!("best of {RUNS_SCATTER}: put of 16,384 u8[256] tensors into a pool whose free space is 16,384 separate 256-byte holes (one block each); Ray: 1.3 s for 4,096"),
    );
    Ok(())
}

fn per_view_read(peer: &Peer, pool: &RegisteredPool, desc: &ObjectDescriptor) -> Result<f64> {
    let block = pool.lease(desc.bytes(), 64)?;
    let base = desc.blocks[0].remote;
    let mut locals = Vec::with_capacity(VIEWS);
    let mut remotes = Vec::with_capacity(VIEWS);
    for t in &desc.tensors {
        let p = t.place.context("placed")?;
        let len = t.bytes();
        locals.push(block.desc_range(p.offset, len)?);
        remotes.push(RemoteDesc::new(base.reg, base.offset + p.offset, len));
    }
    let prepared = peer.prepare_uncoalesced(Op::Read, &locals, &remotes)?;
    anyhow::ensure!(prepared.plan().segments().len() == VIEWS);
    Ok(us(best_of(
        RUNS,
        || (),
        |()| prepared.post(None).expect("posted").wait().expect("landed"),
    )))
}

fn scatter_16k(agent: &Arc<Agent>) -> Result<f64> {
    let cap = (2 * SCATTER * SCATTER_BYTES) as u64;
    let pool = SenderPool::new(agent.clone(), cap)?;
    let filler = vec![0u8; SCATTER_BYTES];
    let data = vec![1u8; SCATTER * SCATTER_BYTES];
    let refs: Vec<TensorRef<'_>> = data
        .chunks(SCATTER_BYTES)
        .map(|c| TensorRef::new(DType::U8, &[SCATTER_BYTES as u64], c))
        .collect::<Result<_, _>>()?;
    let mut best = f64::MAX;
    for _ in 0..RUNS_SCATTER {
        for i in 0..2 * SCATTER {
            pool.put(
                i.to_le_bytes(),
                &[TensorRef::new(DType::U8, &[SCATTER_BYTES as u64], &filler)?],
            )?;
        }
        for i in (0..2 * SCATTER).step_by(2) {
            pool.free(i.to_le_bytes())?;
        }
        let start = Instant::now();
        let d = pool.put("scatter", &refs)?;
        best = best.min(start.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(d.blocks.len() == SCATTER, "one block per hole");
        pool.free("scatter")?;
        for i in (1..2 * SCATTER).step_by(2) {
            pool.free(i.to_le_bytes())?;
        }
    }
    Ok(best)
}

fn put_free_with_holes(agent: &Arc<Agent>, holes: usize) -> Result<f64> {
    let pool = SenderPool::new(agent.clone(), (2 * holes * 2048 + (1 << 20)) as u64)?;
    let filler = vec![0u8; 2048];
    for i in 0..2 * holes {
        pool.put(
            i.to_le_bytes(),
            &[TensorRef::new(DType::U8, &[2048], &filler)?],
        )?;
    }
    for i in (0..2 * holes).step_by(2) {
        pool.free(i.to_le_bytes())?;
    }
    let data = vec![1u8; 1024];
    let t = [TensorRef::new(DType::F32, &[256], &data)?];
    const CYCLES: u32 = 10_000;
    let best = best_of(
        5,
        || (),
        |()| {
            for _ in 0..CYCLES {
                pool.put("one", &t).expect("fits");
                pool.free("one").expect("live");
            }
        },
    );
    Ok(us(best) / f64::from(CYCLES))
}
