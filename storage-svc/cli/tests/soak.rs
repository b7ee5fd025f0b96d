//! Soak: 32 sessions of mixed PUT/GET/CLEAR (values 1 KiB..64 MiB, mostly small, each
//! derived from a seed and verified on every GET against what its session stored and
//! cleared) against a unit process with a token, beside attackers: idle connections,
//! slowloris, garbage frames, unauthenticated payload-engine connections and a missing-key
//! GET flood. Nothing may be lost or corrupted and every session request must succeed.
//! `TESSERA_SOAK_SECS` lengthens the run (default 15 s of workload).

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use std::time::Duration;

use common::UnitProcess;
use hostile::{client_config, Attack, Kind, SoakConfig, Target};
use tessera_storage::Backend;

const TOKEN: &str = "soak-token";

fn soak_secs() -> u64 {
    std::env::var("TESSERA_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_beside_attackers_loses_and_corrupts_nothing() {
    let token = hostile::serve_token_args(TOKEN);
    let args: Vec<&str> = token.iter().map(String::as_str).collect();
    let unit = UnitProcess::start(Backend::Shm, &args);
    let target = Target {
        control: unit.addr.clone(),
        pid: unit.child.id(),
        backend: unit.backend,
        payload: None,
        session: client_config(&unit.addr, unit.backend, TOKEN, 8 << 20),
    };
    let attacks: Vec<Attack> = [
        Kind::Idle(128),
        Kind::Slowloris(64),
        Kind::Garbage,
        Kind::PayloadPreauth(8),
        Kind::MissingGets(1 << 18),
    ]
    .iter()
    .map(|k| Attack::start(k, &target, None))
    .collect();
    let report = hostile::soak(
        client_config(&unit.addr, unit.backend, TOKEN, 80 << 20),
        SoakConfig {
            sessions: 32,
            duration: Duration::from_secs(soak_secs()),
            ..SoakConfig::default()
        },
    )
    .await;
    let counters: Vec<String> = attacks
        .iter()
        .map(|a| {
            format!(
                "{}: {} sent, {} refused",
                a.name,
                a.counters.ops.load(std::sync::atomic::Ordering::Relaxed),
                a.counters
                    .refused
                    .load(std::sync::atomic::Ordering::Relaxed)
            )
        })
        .collect();
    drop(attacks);
    eprintln!(
        "soak: {} PUT, {} GET, {} CLEAR in {:.1} s; lost {}, corrupt {}, failed {}; attackers: {}",
        report.put.len(),
        report.get.len(),
        report.clear.len(),
        report.elapsed.as_secs_f64(),
        report.lost,
        report.corrupt,
        report.failed,
        counters.join("; ")
    );
    for n in &report.notes {
        eprintln!("soak: {n}");
    }
    assert!(
        !report.get.is_empty() && !report.put.is_empty(),
        "the soak ran no requests"
    );
    assert_eq!(report.lost, 0, "stored values came back missing");
    assert_eq!(report.corrupt, 0, "values came back with other bytes");
    assert_eq!(
        report.failed, 0,
        "session requests failed: {:?}",
        report.notes
    );
}

/// The soak's check tells a value from every other: another seed's value of the same length,
/// a page of another value, one byte changed, a value cut short, the stamp of its last page
/// changed; also values made and checked in several parts, and past the pattern, where the
/// bytes come from an RNG.
#[test]
fn the_soak_check_tells_each_value_from_others() {
    use hostile::{content, matches};
    use tessera_storage::Value;
    for len in [1000, 3 * 4096 + 5, (1 << 20) + 4097, (64 << 20) + 1] {
        let v = content(7, len);
        assert!(matches(&Value::Bytes(v.clone()), 7, len), "{len}");
        if len < 64 << 20 {
            let stamp = 7u64.to_le_bytes();
            assert!(v
                .chunks(4096)
                .all(|p| p[..p.len().min(8)] == stamp[..p.len().min(8)]));
        }
        let mut last = v.to_vec();
        last[(len - 1) / 4096 * 4096] ^= 1;
        assert!(!matches(&Value::Bytes(last.into()), 7, len), "{len}");
        assert!(!matches(&Value::Bytes(content(8, len)), 7, len), "{len}");
        assert!(!matches(&Value::Bytes(v.slice(..len - 1)), 7, len), "{len}");
        let mut changed = v.to_vec();
        changed[len / 2] ^= 1;
        assert!(!matches(&Value::Bytes(changed.into()), 7, len), "{len}");
        if len > 8192 {
            let mut mixed = v.to_vec();
            mixed[4096..8192].copy_from_slice(&content(8, len)[4096..8192]);
            assert!(!matches(&Value::Bytes(mixed.into()), 7, len), "{len}");
        }
    }
}
