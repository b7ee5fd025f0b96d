//! Model-based property test: random sequences of put, re-put, free, fetch and view drops on a
//! small sender and receiver pool, checked after every step against a plain oracle (a map of
//! id to tensor contents and the list of held views).

mod common;

use std::collections::HashMap;

use common::{pair, pattern};
use proptest::prelude::*;
use tessera_rdt_pool::{DType, FetchError, PutError, Tensor, TensorRef};

const DTYPES: [DType; 6] = [
    DType::U8,
    DType::BF16,
    DType::F32,
    DType::F64,
    DType::Complex128,
    DType::I16,
];

#[derive(Debug, Clone)]
enum Op {
    Put {
        id: u8,
        tensors: Vec<(usize, u64)>,
        seed: u64,
    },
    Free {
        id: u8,
    },
    Fetch {
        id: u8,
        keep_slice: bool,
    },
    Drop {
        index: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..4, prop::collection::vec((0usize..DTYPES.len(), 0u64..24), 0..6), any::<u64>())
            .prop_map(|(id, tensors, seed)| Op::Put { id, tensors, seed }),
        2 => (0u8..5).prop_map(|id| Op::Free { id }),
        3 => (0u8..4, any::<bool>()).prop_map(|(id, keep_slice)| Op::Fetch { id, keep_slice }),
        2 => (0usize..8).prop_map(|index| Op::Drop { index }),
    ]
}

/// What a held view must keep showing: its bytes as fetched.
struct Held {
    views: Vec<bytes::Bytes>,
    expected: Vec<Vec<u8>>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pools_match_the_oracle(ops in prop::collection::vec(op(), 1..40)) {
        let p = pair(512, 512);
        let mut oracle: HashMap<u8, Vec<(DType, Vec<u8>)>> = HashMap::new();
        let mut held: Vec<Held> = Vec::new();
        for op in ops {
            match op {
                Op::Put { id, tensors, seed } => {
                    let specs: Vec<(DType, u64, Vec<u8>)> = tensors
                        .iter()
                        .enumerate()
                        .map(|(i, &(d, n))| {
                            let dtype = DTYPES[d];
                            (dtype, n, pattern(seed ^ i as u64, n as usize * dtype.size()))
                        })
                        .collect();
                    let refs: Vec<TensorRef<'_>> = specs
                        .iter()
                        .map(|(dtype, n, data)| TensorRef::new(*dtype, &[*n], data).unwrap())
                        .collect();
                    match p.sender.put([id], &refs) {
                        Ok(desc) => {
                            prop_assert!(desc.blocks.iter().all(|b| b.remote.len > 0));
                            oracle.insert(id, specs.into_iter().map(|(d, _, b)| (d, b)).collect());
                        }
                        Err(PutError::OutOfMemory { previous_released, .. }) => {
                            if previous_released {
                                oracle.remove(&id);
                            }
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Free { id } => {
                    prop_assert_eq!(p.sender.free([id]).is_ok(), oracle.remove(&id).is_some());
                }
                Op::Fetch { id, keep_slice } => {
                    let Some(want) = oracle.get(&id) else {
                        prop_assert!(p.sender.descriptor([id]).is_none());
                        continue;
                    };
                    let desc = p.sender.descriptor([id]).unwrap();
                    let fetched = p.receiver.fetch(&desc, &p.peer);
                    match fetched {
                        Ok(f) => {
                            let got: Vec<Tensor> = f.wait().unwrap();
                            prop_assert_eq!(got.len(), want.len());
                            let mut h = Held { views: Vec::new(), expected: Vec::new() };
                            for (t, (dtype, bytes)) in got.iter().zip(want) {
                                prop_assert_eq!(t.dtype(), *dtype);
                                prop_assert_eq!(&t.data()[..], &bytes[..]);
                                let view = if keep_slice && t.data().len() > 2 {
                                    t.data().slice(1..)
                                } else {
                                    t.data().clone()
                                };
                                h.expected.push(view.to_vec());
                                h.views.push(view);
                            }
                            held.push(h);
                        }
                        Err(FetchError::OutOfMemory { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Drop { index } => {
                    if !held.is_empty() {
                        held.remove(index % held.len());
                    }
                }
            }
            // A view never changes while it lives, whatever was put or fetched since.
            for h in &held {
                for (v, e) in h.views.iter().zip(&h.expected) {
                    prop_assert_eq!(&v[..], &e[..]);
                }
            }
            let s = p.sender.report();
            prop_assert_eq!(s.used, s.leased);
            prop_assert_eq!(s.live_objects, oracle.len() as u64);
            let r = p.receiver.report();
            prop_assert_eq!((r.used, r.quarantined), (r.leased, 0));
            let live = held.iter().filter(|h| h.views.iter().any(|v| !v.is_empty())).count();
            prop_assert_eq!(r.live_objects, live as u64);
        }
        drop(held);
        prop_assert_eq!(p.receiver.report().used, 0);
        for id in oracle.keys() {
            p.sender.free([*id]).unwrap();
        }
        prop_assert_eq!(p.sender.report().used, 0);
    }
}
