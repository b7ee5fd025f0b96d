//! A unit in its own process, killed when the guard drops (also on test failure).

#![allow(dead_code, unreachable_pub)]

pub mod scenarios;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use tessera_storage::{Backend, Client, ClientConfig, Tensor, Value};

pub struct UnitProcess {
    pub child: Child,
    pub addr: String,
    pub backend: Backend,
}

impl UnitProcess {
    pub fn start(backend: Backend, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-storage"))
            .args(["serve", "--announce", "--bind", "127.0.0.1:0", "--backend"])
            .arg(backend.name())
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn unit");
        let addr = announced(&mut child);
        Self {
            child,
            addr,
            backend,
        }
    }

    pub fn config(&self) -> ClientConfig {
        ClientConfig {
            units: vec![self.addr.clone()],
            backend: self.backend,
            recv_pool_bytes: 256 << 20,
            ..ClientConfig::default()
        }
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.config()).await.expect("connect")
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The address a unit started with `stdout` piped says it listens on (its first line). The
/// rest of its stdout is dropped: the unit writes nothing more there.
pub fn announced(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("the unit's stdout is piped"))
        .read_line(&mut line)
        .expect("the unit's first line");
    tessera_storage::announced_addr(&line)
        .unwrap_or_else(|| panic!("the unit did not start: {line:?}"))
        .to_owned()
}

impl Drop for UnitProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// FNV-1a over every payload and scalar of a value.
pub fn checksum(v: &Value) -> u64 {
    fn mix(h: &mut u64, bytes: &[u8]) {
        for b in bytes {
            *h ^= *b as u64;
            *h = h.wrapping_mul(0x100000001b3);
        }
    }
    fn go(h: &mut u64, v: &Value) {
        match v {
            Value::Null => mix(h, b"n"),
            Value::Bool(b) => mix(h, &[*b as u8]),
            Value::I64(x) => mix(h, &x.to_le_bytes()),
            Value::U64(x) => mix(h, &x.to_le_bytes()),
            Value::F64(x) => mix(h, &x.to_le_bytes()),
            Value::Str(s) => mix(h, s.as_bytes()),
            Value::Bytes(b) => mix(h, b),
            Value::Tensor(t) => {
                mix(h, format!("{:?}{:?}", t.dtype(), t.shape()).as_bytes());
                mix(h, t.contiguous().unwrap().data());
            }
            Value::List(items) => items.iter().for_each(|i| go(h, i)),
            Value::Map(items) => items.iter().for_each(|(k, i)| {
                mix(h, k.as_bytes());
                go(h, i)
            }),
        }
    }
    let mut h = 0xcbf29ce484222325;
    go(&mut h, v);
    h
}

/// One RL rollout: token ids, log-probs, a reward and a 64x64x3 image, seeded by `i`.
pub fn rollout(i: u64, n: usize) -> Vec<(String, Value)> {
    let tokens: Vec<i32> = (0..n)
        .map(|k| (k as i32).wrapping_mul(31) ^ i as i32)
        .collect();
    let logp: Vec<f32> = (0..n).map(|k| -((k as f32) + i as f32) / 1000.0).collect();
    let image: Vec<u8> = (0..64 * 64 * 3).map(|k| (k as u64 ^ i) as u8).collect();
    vec![
        (
            "tokens".into(),
            Value::Tensor(Tensor::from_slice(&[n as u64], &tokens).unwrap()),
        ),
        (
            "logp".into(),
            Value::Tensor(Tensor::from_slice(&[n as u64], &logp).unwrap()),
        ),
        (
            "reward".into(),
            Value::Tensor(Tensor::from_slice(&[], &[i as f32 * 0.5]).unwrap()),
        ),
        (
            "image".into(),
            Value::Tensor(Tensor::from_slice(&[64, 64, 3], &image).unwrap()),
        ),
    ]
}

/// Columns for `put` from rows.
pub fn columns(rows: Vec<Vec<(String, Value)>>) -> Vec<(String, Vec<Value>)> {
    let mut cols: Vec<(String, Vec<Value>)> = Vec::new();
    for row in rows {
        for (k, (name, v)) in row.into_iter().enumerate() {
            if cols.len() <= k {
                cols.push((name, Vec::new()));
            }
            cols[k].1.push(v);
        }
    }
    cols
}
