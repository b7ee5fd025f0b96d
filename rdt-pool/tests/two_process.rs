//! A round trip between this process (receiver) and a real second one (sender) over `shm` and
//! `tcp`: mixed dtypes, strided and zero-size tensors, several blocks, verified byte for byte;
//! then a fetch from a stopped sender times out, quarantines its blocks, and they come back
//! once the sender resumes.
//!
//! The second process is this test binary run again with `TESSERA_RDT_CHILD` set, which turns
//! the `child_sender` test into the sender.

mod common;

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::pattern;
use tessera_rdt_pool::{DType, FetchError, ObjectDescriptor, ReceiverPool, SenderPool, TensorRef};
use tessera_transport::testing::hang_guard;
use tessera_transport::{shm::Shm, tcp::Tcp, Agent};

fn agent(kind: &str, name: &str) -> Arc<Agent> {
    Arc::new(match kind {
        "shm" => Agent::new(name, Shm::new()).unwrap(),
        _ => Agent::new(name, Tcp::new()).unwrap(),
    })
}

/// The object both processes agree on: (dtype, shape, strides of the view, storage seed and
/// storage length in bytes).
struct Spec {
    dtype: DType,
    shape: Vec<u64>,
    strides: Option<Vec<u64>>,
    storage: Vec<u8>,
}

fn specs() -> Vec<Spec> {
    let mut out = Vec::new();
    let dtypes = [
        DType::Complex128,
        DType::BF16,
        DType::I8,
        DType::F64,
        DType::F16,
        DType::Complex64,
        DType::U8,
        DType::F8E4M3,
        DType::I32,
    ];
    for (i, &dtype) in dtypes.iter().enumerate() {
        // 4-12 KiB each, so the object needs several of the sender's 32 KiB holes.
        let elems = (4 * 1024 + 1000 * i as u64) / dtype.size() as u64;
        out.push(Spec {
            dtype,
            shape: vec![elems],
            strides: None,
            storage: pattern(100 + i as u64, (elems as usize) * dtype.size()),
        });
        if i == 3 {
            out.push(Spec {
                dtype: DType::F32,
                shape: vec![0, 7],
                strides: None,
                storage: Vec::new(),
            });
        }
    }
    // A transposed 64x48 bf16 view of a 48x64 storage: gathered, 6 KiB.
    out.push(Spec {
        dtype: DType::BF16,
        shape: vec![64, 48],
        strides: Some(vec![1, 64]),
        storage: pattern(7, 48 * 64 * 2),
    });
    out.push(Spec {
        dtype: DType::Complex128,
        shape: vec![3, 0],
        strides: None,
        storage: Vec::new(),
    });
    out
}

fn expected(spec: &Spec) -> Vec<u8> {
    let r = match &spec.strides {
        None => TensorRef::new(spec.dtype, &spec.shape, &spec.storage),
        Some(s) => TensorRef::strided(spec.dtype, &spec.shape, s, &spec.storage),
    }
    .unwrap();
    let mut out = Vec::new();
    // Gather through a one-tensor put on a private in-process pool.
    let a = Arc::new(Agent::new("oracle", tessera_transport::Inproc::new()).unwrap());
    let b = Arc::new(Agent::new("oracle-rx", tessera_transport::Inproc::new()).unwrap());
    let s = SenderPool::new(a.clone(), 1 << 20).unwrap();
    let rx = ReceiverPool::new(b.clone(), 1 << 20).unwrap();
    let d = s.put("o", &[r]).unwrap();
    let peer = b.add_remote(&a.metadata()).unwrap();
    for t in rx.fetch(&d, &peer).unwrap().wait().unwrap() {
        out.extend_from_slice(t.data());
    }
    out
}

#[test]
fn child_sender() {
    let Ok(kind) = std::env::var("TESSERA_RDT_CHILD") else {
        return;
    };
    let agent = agent(&kind, "child");
    let pool = SenderPool::new(agent.clone(), 256 * 1024).unwrap();
    // Eight 32 KiB objects fill the pool; freeing every other one leaves four 32 KiB holes.
    let filler = vec![0xa5u8; 32 * 1024];
    for i in 0..8 {
        pool.put(
            format!("f{i}"),
            &[TensorRef::new(DType::U8, &[32 * 1024], &filler).unwrap()],
        )
        .unwrap();
    }
    for i in (0..8).step_by(2) {
        pool.free(format!("f{i}")).unwrap();
    }
    let specs = specs();
    let refs: Vec<TensorRef<'_>> = specs
        .iter()
        .map(|s| match &s.strides {
            None => TensorRef::new(s.dtype, &s.shape, &s.storage).unwrap(),
            Some(st) => TensorRef::strided(s.dtype, &s.shape, st, &s.storage).unwrap(),
        })
        .collect();
    let desc = pool.put("mixed", &refs).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "META {}", hex::encode(agent.metadata())).unwrap();
    writeln!(out, "DESC {}", hex::encode(desc.to_bytes().unwrap())).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if let Some(h) = line.strip_prefix("ADD ") {
            agent.add_remote(&hex::decode(h).expect("hex")).unwrap();
            writeln!(out, "ADDED").unwrap();
            out.flush().unwrap();
        } else if line == "EXIT" {
            break;
        }
    }
}

struct Child {
    proc: std::process::Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Child {
    fn spawn(kind: &str) -> Self {
        let mut proc = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_sender", "--nocapture", "--test-threads=1"])
            .env("TESSERA_RDT_CHILD", kind)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("child starts");
        let stdin = proc.stdin.take().unwrap();
        let lines = BufReader::new(proc.stdout.take().unwrap()).lines();
        Self { proc, stdin, lines }
    }

    /// The next line with `prefix`, skipping the test harness's own output.
    fn expect(&mut self, prefix: &str) -> String {
        loop {
            let line = self.lines.next().expect("child answers").unwrap();
            // The harness may print `test child_sender ... ` on the same line first.
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].to_owned();
            }
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.proc.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }

    /// Waits until the kernel reports the child stopped.
    fn wait_stopped(&self) {
        let stat = format!("/proc/{}/stat", self.proc.id());
        let guard = std::time::Instant::now();
        loop {
            let s = std::fs::read_to_string(&stat).unwrap();
            let state = s.rsplit(')').next().unwrap().split_whitespace().next();
            if state == Some("T") || state == Some("t") {
                return;
            }
            assert!(guard.elapsed() < hang_guard(), "child never stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.proc.id().to_string()])
            .status();
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

fn round_trip(kind: &str) {
    let mut child = Child::spawn(kind);
    let meta = hex::decode(child.expect("META ")).expect("hex");
    let desc =
        ObjectDescriptor::from_bytes(&hex::decode(child.expect("DESC ")).expect("hex")).unwrap();
    let me = agent(kind, "parent");
    let pool = ReceiverPool::new(me.clone(), 1 << 20).unwrap();
    let peer = me.add_remote(&meta).unwrap();
    child.send(&format!("ADD {}", hex::encode(me.metadata())));
    child.expect("ADDED");

    let specs = specs();
    assert!(desc.blocks.len() >= 3, "placed across several blocks");
    assert!(desc.blocks.iter().all(|b| b.remote.len > 0));
    assert_eq!(desc.tensors.len(), specs.len());
    let tensors = pool
        .fetch(&desc, &peer)
        .unwrap()
        .wait_timeout(hang_guard())
        .unwrap();
    for (i, (t, s)) in tensors.iter().zip(&specs).enumerate() {
        assert_eq!(
            (t.dtype(), t.shape()),
            (s.dtype, &s.shape[..]),
            "tensor {i}"
        );
        assert!(t.data()[..] == expected(s)[..], "tensor {i} bytes differ");
        if !t.data().is_empty() {
            assert_eq!(
                t.data().as_ptr() as usize % s.dtype.align(),
                0,
                "tensor {i} aligned"
            );
        }
    }
    let c128 = tensors[0].as_slice::<[f64; 2]>().unwrap();
    assert_eq!(c128.len() as u64, specs[0].shape[0]);
    let bf16 = tensors[1]
        .to_vec::<tessera_framecodec::half::bf16>()
        .unwrap();
    assert_eq!(bf16.len() as u64, specs[1].shape[0]);
    let r = pool.report();
    assert_eq!(
        (r.leased, r.live_objects, r.quarantined),
        (desc.bytes(), 1, 0)
    );

    // A stopped sender cannot answer: the fetch times out and its blocks are quarantined.
    child.signal("-STOP");
    child.wait_stopped();
    match pool
        .fetch(&desc, &peer)
        .unwrap()
        .wait_timeout(Duration::from_millis(200))
    {
        Err(FetchError::Timeout { quarantined, .. }) => assert_eq!(quarantined, desc.bytes()),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let r = pool.report();
    assert_eq!(r.quarantined, desc.bytes());
    assert_eq!(
        r.used,
        2 * desc.bytes(),
        "never handed out while a late write could land"
    );
    // A fetch dropped while its READ is in flight is quarantined the same way.
    drop(pool.fetch(&desc, &peer).unwrap());
    let r = pool.report();
    assert_eq!(
        (r.quarantined, r.used),
        (2 * desc.bytes(), 3 * desc.bytes())
    );
    child.signal("-CONT");
    let guard = std::time::Instant::now();
    while pool.report().quarantined > 0 {
        assert!(guard.elapsed() < hang_guard(), "quarantine never resolved");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        pool.report().used,
        desc.bytes(),
        "quarantined blocks came back"
    );
    drop(tensors);
    assert_eq!(pool.report().used, 0);
    child.send("EXIT");
}

#[test]
fn shm_round_trip() {
    round_trip("shm");
}

#[test]
fn tcp_round_trip() {
    round_trip("tcp");
}
