//! Arbitrary bytes as control messages: framing, envelope decoding and the protocol core
//! must answer with errors, never panic. Each input is split into frames by its own length
//! prefixes and fed to one session of a unit over vector memory. The handshake's messages
//! (Hello, Auth) are decoded and handled like any other; since no input can forge a proof
//! over the unit's fresh nonce, inputs whose first byte has bit 0x40 set start on a session
//! already opened by a proper handshake, so the requests after it are reached too.
#![no_main]

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tessera_storage::core::{Exposed, Memory, Output, PoolStats, Unit, UnitConfig, Written};
use tessera_storage::proto::{decode_body, frame_len, Request};
use tessera_storage::MemoryError;
use tessera_transport::RemoteDesc;

struct VecMem(bool);

impl Memory for VecMem {
    type Block = Vec<u8>;
    fn lease(&mut self, size: u64, _: u64) -> Result<Vec<u8>, MemoryError> {
        if size > 1 << 20 {
            return Err(MemoryError::LeaseTooLarge { size });
        }
        Ok(vec![0; size as usize])
    }
    type Dest = RemoteDesc;
    fn remote(&self, _: &Vec<u8>, offset: u64, len: u64) -> Result<RemoteDesc, MemoryError> {
        Ok(RemoteDesc::new(1, offset, len))
    }
    fn dest(&self, block: &Vec<u8>, offset: u64, len: u64) -> Result<RemoteDesc, MemoryError> {
        self.remote(block, offset, len)
    }
    fn freeze(&self, block: Vec<u8>, len: u64) -> Bytes {
        Bytes::from(block).slice(..len as usize)
    }
    fn block_len(b: &Vec<u8>) -> u64 {
        b.len() as u64
    }
    fn copy_in(&mut self, data: &[u8], _: u64) -> Result<Bytes, MemoryError> {
        Ok(Bytes::copy_from_slice(data))
    }
    fn expose(&self, _: &Vec<u8>, _: &str, _: &[(u64, u64)]) -> Result<Exposed, MemoryError> {
        Ok(Arc::new(Landed(self.0)))
    }
    fn usage(&self) -> PoolStats {
        PoolStats::default()
    }
}

/// A pushed PUT's frames: written or not, as the input's first byte says.
struct Landed(bool);

impl Written for Landed {
    fn is_written(&self) -> bool {
        self.0
    }
}

fuzz_target!(|data: &[u8]| {
    let cfg = UnitConfig {
        max_payload_bytes: 1 << 20,
        inline_max: 4096,
        ..UnitConfig::default()
    };
    // Whether a pushed PUT's WRITE landed before its COMMIT.
    let landed = data.first().is_some_and(|b| b & 0x20 == 0);
    let mut unit = Unit::new(cfg, VecMem(landed));
    // Both ways a PUT's payload can arrive: pushed (READY, COMMIT) or pulled (READ).
    unit.set_pull_puts(data.first().is_some_and(|b| b & 0x80 != 0));
    unit.open_session(1);
    let now = Instant::now();
    if data.first().is_some_and(|b| b & 0x40 != 0) {
        let out = tessera_storage::testing::handshake::open(&mut unit, now, 1, 0, vec![], None);
        if out.iter().any(|o| matches!(o, Output::Accept { .. })) {
            unit.session_ready(1, "client");
        }
    }
    let mut rest = data;
    while rest.len() >= 4 {
        let Ok(len) = frame_len(rest[..4].try_into().unwrap(), 1 << 16) else {
            return;
        };
        rest = &rest[4..];
        let body = &rest[..len.min(rest.len())];
        rest = &rest[body.len()..];
        if let Ok((id, req)) = decode_body::<Request>(body) {
            let mut accepted = false;
            for out in unit.handle(now, 1, id, req) {
                match out {
                    Output::Read { put, .. } => {
                        let _ = unit.read_done(1, put, Ok(()));
                    }
                    Output::Accept { .. } => accepted = true,
                    _ => {}
                }
            }
            if accepted {
                unit.session_ready(1, "client");
            }
        }
    }
    let _ = unit.handle_timeout(now + std::time::Duration::from_secs(3600));
    unit.close_session(1, now, tessera_storage::core::TornDown::Grace);
    let _ = unit.handle_timeout(now + std::time::Duration::from_secs(7200));
});
