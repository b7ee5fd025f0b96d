//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use tessera_rdt_pool::{ReceiverPool, SenderPool};
use tessera_transport::{Agent, Inproc, Peer};

/// A sender and a receiver on two in-process agents, and the receiver's handle on the sender.
pub struct Pair {
    pub sender: SenderPool,
    pub receiver: ReceiverPool,
    pub peer: Peer,
    pub sender_agent: Arc<Agent>,
    pub receiver_agent: Arc<Agent>,
}

pub fn pair(send_capacity: u64, recv_capacity: u64) -> Pair {
    let sender_agent = Arc::new(Agent::new("sender", Inproc::new()).unwrap());
    let receiver_agent = Arc::new(Agent::new("receiver", Inproc::new()).unwrap());
    let sender = SenderPool::new(sender_agent.clone(), send_capacity).unwrap();
    let receiver = ReceiverPool::new(receiver_agent.clone(), recv_capacity).unwrap();
    let peer = receiver_agent.add_remote(&sender_agent.metadata()).unwrap();
    Pair {
        sender,
        receiver,
        peer,
        sender_agent,
        receiver_agent,
    }
}

/// Deterministic bytes: `len` bytes from `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
