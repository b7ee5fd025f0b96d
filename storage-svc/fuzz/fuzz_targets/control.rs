//! Arbitrary bytes as control messages: framing, envelope decoding and the protocol core
//! must answer with errors, never panic. Each input is split into frames by its own length
//! prefixes and fed to one session of a unit over vector memory. The handshake's messages
//! (Hello, Auth) are decoded and handled like any other; since no input can forge a proof
//! over the unit's fresh nonce, inputs whose first byte has bit 0x40 set start on a session
//! already opened by a proper handshake, so the requests after it are reached too.
#![no_main]

use std::time::Instant;

use libfuzzer_sys::fuzz_target;
use tessera_storage::core::{Output, Unit, UnitConfig};
use tessera_storage::proto::{decode_body, frame_len, Request};
use tessera_storage::testing::VecMem;

fuzz_target!(|data: &[u8]| {
    let cfg = UnitConfig {
        max_payload_bytes: 1 << 20,
        inline_max: 4096,
        ..UnitConfig::default()
    };
    // The crate's own test memory (16 MiB); whether a pushed PUT's WRITE landed before its
    // COMMIT.
    let mem = VecMem::new(16 << 20);
    mem.writes_land(data.first().is_some_and(|b| b & 0x20 == 0));
    let mut unit = Unit::new(cfg, mem);
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
