//! The Rust side of `cargo xtask bench python`: the same operations through the same client
//! (or agent), with values made in Rust, so each Python figure has its Rust reference from the
//! same process, unit and moment. Not part of the API (`tessera._native._bench_*`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use pyo3::prelude::*;
use tessera_framecodec::{DType, Tensor, Value};
use tessera_rdt_pool::{SenderPool, TensorRef};

use crate::agent::PyAgent;
use crate::errors;
use crate::runtime;
use crate::storage::PyClient;

fn tensors(count: usize, bytes: usize) -> Vec<Value> {
    (0..count)
        .map(|i| {
            // Not zero: a zeroed vector's pages would all be the shared zero page, never touched.
            let data = Bytes::from(vec![1 + (i % 251) as u8; bytes]);
            Value::Tensor(Tensor::new(DType::U8, &[bytes as u64], data).expect("u8 tensor"))
        })
        .collect()
}

/// Seconds of each of `iters` PUTs of `count` tensors of `bytes` bytes at indexes `0..count`.
#[pyfunction]
pub(crate) fn _bench_put(
    py: Python<'_>,
    client: &PyClient,
    partition: String,
    count: usize,
    bytes: usize,
    iters: usize,
) -> PyResult<Vec<f64>> {
    let client = client.inner()?;
    let cols = vec![("x".to_owned(), tensors(count, bytes))];
    let idx: Vec<u64> = (0..count as u64).collect();
    runtime::wait(py, async move {
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            client.put(&partition, &idx, &cols).await?;
            out.push(t.elapsed().as_secs_f64());
        }
        Ok::<_, tessera_storage::ClientError>(out)
    })?
    .map_err(errors::client)
}

/// Seconds of each of `iters` GETs of field `x` at indexes `0..count` (results dropped).
#[pyfunction]
pub(crate) fn _bench_get(
    py: Python<'_>,
    client: &PyClient,
    partition: String,
    count: usize,
    iters: usize,
) -> PyResult<Vec<f64>> {
    let client = client.inner()?;
    let idx: Vec<u64> = (0..count as u64).collect();
    runtime::wait(py, async move {
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let got = client.get(&partition, &idx, &["x"]).await?;
            out.push(t.elapsed().as_secs_f64());
            drop(got);
        }
        Ok::<_, tessera_storage::ClientError>(out)
    })?
    .map_err(errors::client)
}

/// Seconds of each of `iters` sender-pool puts of `count` views of `bytes` bytes each, cut
/// from one Rust buffer, into a pool of `agent` (the object freed after each).
#[pyfunction]
pub(crate) fn _bench_pool_put(
    py: Python<'_>,
    agent: &PyAgent,
    count: usize,
    bytes: usize,
    iters: usize,
) -> PyResult<Vec<f64>> {
    let agent = agent.inner()?;
    py.detach(|| {
        let capacity = (count * bytes).max(1) as u64 * 2 + (1 << 20);
        let pool = SenderPool::new(Arc::clone(&agent), capacity).map_err(errors::pool)?;
        let buf = vec![7u8; count * bytes];
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let refs: Vec<TensorRef<'_>> = buf
                .chunks(bytes.max(1))
                .take(count)
                .map(|c| TensorRef::new(DType::U8, &[c.len() as u64], c).expect("u8 view"))
                .collect();
            pool.put(b"bench", &refs).map_err(errors::put)?;
            out.push(t.elapsed().as_secs_f64());
            pool.free(b"bench").map_err(errors::free)?;
        }
        Ok(out)
    })
}
