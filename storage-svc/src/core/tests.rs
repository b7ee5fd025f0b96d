//! Loom models of the core shared by a session executor and the timer, and unit tests of the
//! core that the crate's own test binary runs first.

use super::*;
use crate::testing::VecMem;
use tessera_sync::{model, thread, Arc, Mutex};

fn prepare(unit: &mut Unit<VecMem>, now: Instant, id: u64) -> Response {
    let t = tessera_framecodec::Tensor::from_slice(&[256], &[0u8; 256]).unwrap();
    let v = Value::List(vec![Value::List(vec![Value::Tensor(t)])]);
    let frames = tessera_framecodec::encode(&v).unwrap();
    let out = unit.handle(
        now,
        1,
        id,
        Request::Put {
            partition: "p".into(),
            indexes: vec![id],
            fields: vec!["x".into()],
            meta: ByteBuf::from(frames.meta.to_vec()),
            inline: None,
            pull: None,
        },
    );
    match out.into_iter().next() {
        Some(Output::Reply { response, .. }) => response,
        other => panic!("{other:?}"),
    }
}

/// On session 1: PUT `put` prepared and committed (request `commit`), then a GET of it
/// (request `get`) answered `GetReady`, and its GET_INTO (request `into`) turned into the
/// unit's WRITE.
fn get_being_written(unit: &mut Unit<VecMem>, now: Instant, [put, commit, get, into]: [u64; 4]) {
    assert!(matches!(prepare(unit, now, put), Response::PutReady { .. }));
    assert_eq!(
        unit.handle(now, 1, commit, Request::Commit { put }).len(),
        1
    );
    let req = Request::Get {
        partition: "p".into(),
        indexes: vec![put],
        fields: vec!["x".into()],
    };
    assert!(matches!(
        unit.handle(now, 1, get, req).into_iter().next(),
        Some(Output::Reply {
            response: Response::GetReady { .. },
            ..
        })
    ));
    let req = Request::GetInto {
        get,
        block: RemoteDesc::new(7, 0, 256),
    };
    let out = unit.handle(now, 1, into, req).into_iter().next();
    assert!(
        matches!(out, Some(Output::Write { get: g, id, .. }) if g == get && id == into),
        "{out:?}"
    );
}

/// A session's teardown, its executor finishing a GET and the timer expiring its prepared
/// PUT, in any order on three threads: the leased and quarantined accounting ends at zero
/// and every block is back.
#[test]
fn loom_session_executor_and_timer_release_everything() {
    model(|| {
        let leased = VecMem::new(u64::MAX);
        let cfg = UnitConfig {
            inline_max: 16,
            ..UnitConfig::default()
        };
        let mut unit = Unit::new(cfg.clone(), leased.clone());
        let now = Instant::now();
        unit.open_session(1);
        let _ = crate::testing::handshake::open(&mut unit, now, 1, 0, vec![], None);
        unit.session_ready(1, "client");
        // A prepared PUT that expires, one cancelled after exposure (quarantined), a
        // stored value and a GET of it being written.
        assert!(matches!(
            prepare(&mut unit, now, 1),
            Response::PutReady { .. }
        ));
        assert!(matches!(
            prepare(&mut unit, now, 2),
            Response::PutReady { .. }
        ));
        let cancel = Request::Cancel {
            of: 2,
            maybe_written: true,
        };
        assert_eq!(unit.handle(now, 1, 3, cancel).len(), 1);
        get_being_written(&mut unit, now, [4, 40, 5, 6]);
        let s = unit.stats();
        assert!(s.leased_bytes > 0 && s.quarantined_bytes > 0 && s.pending_gets == 1);
        assert!(s.credit_bytes > 0, "the COMMIT's answer granted credits");
        let exposed = s.leased_bytes + s.quarantined_bytes + s.credit_bytes;

        let unit = Arc::new(Mutex::new(unit));
        let executor = {
            let unit = unit.clone();
            thread::spawn(move || {
                unit.lock().transfer_done(1, 5, 6, Ok(()));
            })
        };
        let timer = {
            let unit = unit.clone();
            thread::spawn(move || {
                unit.lock().handle_timeout(now + cfg.prepare_ttl);
            })
        };
        unit.lock().close_session(1, now, TornDown::Signalled);
        executor.join().unwrap();
        timer.join().unwrap();
        let mut unit = unit.lock();
        // Every exposed block (the expired or still prepared PUT, the cancelled one and the
        // unused credits) stays quarantined until the client's link is known gone.
        let s = unit.stats();
        assert_eq!(
            (s.quarantined_bytes, s.leased_bytes, s.credit_bytes),
            (exposed, 0, 0),
            "{s:?}"
        );
        assert_eq!(unit.closed_sessions(), vec![1]);
        assert!(unit.release_closed(1) > 0);
        let s = unit.stats();
        assert_eq!(
            (
                s.leased_bytes,
                s.quarantined_bytes,
                s.pending_puts,
                s.pending_gets
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(s.sessions, 0);
        assert_eq!(s.keys, 1, "the stored value stays");
        unit.teardown();
        drop(unit);
        assert_eq!(leased.live(), 0, "every block is back");
    });
}

/// A pulled PUT's READ completing on the executor, the session's teardown and the timer,
/// in any order on three threads: the READ's block is stored or released exactly once and
/// the accounting ends at zero.
#[test]
fn loom_pulled_put_read_teardown_and_timer() {
    model(|| {
        let leased = VecMem::new(u64::MAX);
        let cfg = UnitConfig {
            inline_max: 16,
            ..UnitConfig::default()
        };
        let mut unit = Unit::new(cfg.clone(), leased.clone());
        unit.set_pull_puts(true);
        let now = Instant::now();
        unit.open_session(1);
        let _ = crate::testing::handshake::open(&mut unit, now, 1, 0, vec![], None);
        unit.session_ready(1, "client");
        let t = tessera_framecodec::Tensor::from_slice(&[256], &[0u8; 256]).unwrap();
        let v = Value::List(vec![Value::List(vec![Value::Tensor(t)])]);
        let frames = tessera_framecodec::encode(&v).unwrap();
        let descs = frames
            .payloads
            .iter()
            .map(|f| RemoteDesc::new(3, 0, f.len() as u64))
            .collect();
        let put = Request::Put {
            partition: "p".into(),
            indexes: vec![1],
            fields: vec!["x".into()],
            meta: ByteBuf::from(frames.meta.to_vec()),
            inline: None,
            pull: Some(crate::proto::PullSource {
                descs,
                agent: ByteBuf::new(),
            }),
        };
        assert!(matches!(
            unit.handle(now, 1, 1, put).into_iter().next(),
            Some(Output::Read { put: 1, .. })
        ));
        assert!(unit.stats().leased_bytes > 0);

        let unit = Arc::new(Mutex::new(unit));
        let executor = {
            let unit = unit.clone();
            thread::spawn(move || {
                unit.lock().read_done(1, 1, Ok(()));
            })
        };
        let timer = {
            let unit = unit.clone();
            thread::spawn(move || {
                unit.lock().handle_timeout(now + cfg.prepare_ttl);
            })
        };
        unit.lock().close_session(1, now, TornDown::Signalled);
        executor.join().unwrap();
        timer.join().unwrap();
        let mut unit = unit.lock();
        let s = unit.stats();
        assert_eq!(
            (
                s.leased_bytes,
                s.quarantined_bytes,
                s.pending_puts,
                s.sessions
            ),
            (0, 0, 0, 0)
        );
        assert!(s.keys <= 1);
        assert_eq!(unit.release_closed(1), 0, "nothing held for late WRITEs");
        unit.teardown();
        drop(unit);
        assert_eq!(leased.live(), 0, "every block is back");
    });
}

/// The key checks a driver runs before it takes the unit: exactly `max_keys` keys pass, one
/// more is too many, and a repeated index or field is a bad request.
#[test]
fn key_checks_hold_at_their_bounds() {
    let cfg = UnitConfig {
        max_keys: 6,
        ..UnitConfig::default()
    };
    let fields = |n: usize| (0..n).map(|i| format!("f{i}")).collect::<Vec<_>>();
    let kind = |r: Result<(), RemoteError>| r.map_err(|e| e.kind);
    assert_eq!(kind(check_keys(&cfg, &[1, 2, 3], &fields(2))), Ok(()));
    assert_eq!(kind(check_keys(&cfg, &[1], &fields(6))), Ok(()));
    assert_eq!(
        kind(check_keys(&cfg, &[1, 2, 3, 4, 5, 6, 7], &fields(1))),
        Err(ErrorKind::TooLarge)
    );
    assert_eq!(
        kind(check_keys(&cfg, &[1], &[])),
        Err(ErrorKind::BadRequest)
    );
    // Increasing indexes skip the duplicate set; anything else goes through it.
    for dup in [&[1, 2, 1][..], &[1, 1], &[1, 2, 2], &[3, 2, 3]] {
        assert_eq!(
            kind(check_keys(&cfg, dup, &fields(1))),
            Err(ErrorKind::BadRequest),
            "{dup:?}"
        );
    }
    for unique in [&[3, 2, 1][..], &[1, 3, 2], &[u64::MAX, 0]] {
        assert_eq!(
            kind(check_keys(&cfg, unique, &fields(1))),
            Ok(()),
            "{unique:?}"
        );
    }
    assert_eq!(
        kind(check_keys(&cfg, &[1, 2], &["a".into(), "a".into()])),
        Err(ErrorKind::BadRequest)
    );
    assert_eq!(kind(check_keys(&cfg, &[], &fields(1))), Ok(()));
}

/// A deferred GET's WRITE done: request `id` (the GET_INTO) is answered `GetDone`, the bytes
/// written are counted once, and nothing is left pending; a completion for a GET no longer
/// pending answers nothing.
#[test]
fn a_get_write_done_is_answered_and_counted() {
    // A plain test without the loom cfg; under it, one model (VecMem's counters are loom's).
    model(|| {
        let cfg = UnitConfig {
            inline_max: 16,
            ..UnitConfig::default()
        };
        let mut unit = Unit::new(cfg, VecMem::new(u64::MAX));
        let now = Instant::now();
        unit.open_session(1);
        let _ = crate::testing::handshake::open(&mut unit, now, 1, 0, vec![], None);
        unit.session_ready(1, "client");
        get_being_written(&mut unit, now, [1, 2, 3, 4]);
        let out = unit.transfer_done(1, 3, 4, Ok(()));
        assert!(
            matches!(
                out[..],
                [Output::Reply {
                    session: 1,
                    id: 4,
                    response: Response::GetDone,
                }]
            ),
            "{out:?}"
        );
        let s = unit.stats();
        assert_eq!((s.pending_gets, s.bytes_out), (0, 256));
        assert!(unit.transfer_done(1, 3, 4, Ok(())).is_empty());
        assert_eq!(unit.stats().bytes_out, 256);
    });
}
