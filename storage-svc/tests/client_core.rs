//! The client's protocol machines (`core::client`) driven against the unit's core
//! (`core::Unit`) with no sockets: a simulated pair moves each request to the unit and each
//! of its outputs back (replies, the unit's WRITEs into the client's receive block, its READs
//! of a pulled PUT's frames), as quinn-proto's tests drive two connections.

use std::time::Instant;

use bytes::Bytes;
use tessera_framecodec::{encode, Decoder, Tensor, Value};
use tessera_storage::core::client::{Columns, GetOp, GetStep, PutOp, PutStep};
use tessera_storage::core::{Output, TornDown, Unit, UnitConfig};
use tessera_storage::proto::{PullSource, Request, Response};
use tessera_storage::testing::VecMem;
use tessera_storage::{ClientError, ErrorKind, PayloadError};
use tessera_transport::RemoteDesc;

const S: u64 = 7;
const INLINE_MAX: u64 = 1024;
const ALIGN: u64 = 64;

/// One unit's core and one client session on it.
struct Pair {
    unit: Unit<VecMem>,
    now: Instant,
    next: u64,
    /// The client's receive block of the GET in flight (the unit WRITEs into it).
    block: Vec<u8>,
    /// The meta the unit sent ahead of the last answer (`Writing`), if any.
    ahead: Option<serde_bytes::ByteBuf>,
}

impl Pair {
    fn new(pull: bool) -> Self {
        let cfg = UnitConfig {
            inline_max: INLINE_MAX,
            align: ALIGN,
            ..UnitConfig::default()
        };
        let mut unit = Unit::new(cfg, VecMem::new(1 << 24));
        unit.set_pull_puts(pull);
        unit.open_session(S);
        let mut p = Self {
            unit,
            now: Instant::now(),
            next: 0,
            block: Vec::new(),
            ahead: None,
        };
        let out = tessera_storage::testing::handshake::open(
            &mut p.unit,
            p.now,
            S,
            0,
            b"client".to_vec(),
            None,
        );
        assert!(matches!(
            out.as_slice(),
            [Output::Accept { session: S, .. }]
        ));
        p.unit.session_ready(S, "client");
        p
    }

    /// Sends `req` to the unit and carries out what it asks until its answer comes.
    fn call(&mut self, req: Request) -> Result<(u64, Response), ClientError> {
        self.next += 1;
        let id = self.next;
        let mut out = self.unit.handle(self.now, S, id, req);
        self.ahead = None;
        loop {
            // A meta sent ahead of the WRITE comes first, under the request's id.
            let ahead = matches!(
                &out[..],
                [
                    Output::Reply {
                        response: Response::Writing { .. },
                        ..
                    },
                    Output::Write { .. }
                ]
            );
            if ahead {
                if let Output::Reply {
                    id: got,
                    response: Response::Writing { meta },
                    ..
                } = out.remove(0)
                {
                    assert_eq!(got, id, "ahead under its request id");
                    self.ahead = Some(meta);
                }
            }
            let [o] = <[_; 1]>::try_from(out).expect("one output per step");
            out = match o {
                Output::Reply {
                    id: got, response, ..
                } => {
                    assert_eq!(got, id, "answered under its request id");
                    return match response {
                        Response::Error(source) => Err(ClientError::Remote { unit: 0, source }),
                        r => Ok((id, r)),
                    };
                }
                // The unit WRITEs a GET's frames into the client's block.
                Output::Write {
                    id: into,
                    get,
                    frames,
                    descs,
                    ..
                } => {
                    for (f, d) in frames.iter().zip(&descs) {
                        assert_eq!(d.reg, 9, "into the block the client named");
                        let at = d.offset as usize;
                        self.block[at..at + f.len()].copy_from_slice(f);
                    }
                    self.unit.transfer_done(S, get, into, Ok(()))
                }
                // The unit READs a pulled PUT's frames (the test memory stays zeroed).
                Output::Read { put, .. } => self.unit.read_done(S, put, Ok(())),
                other => panic!("unexpected output {other:?}"),
            };
        }
    }

    /// Drives a PUT machine to its end; `write` says how the client's WRITE ends.
    fn put_with(
        &mut self,
        idx: &[u64],
        value: &Value,
        pull: bool,
        write: impl Fn() -> Result<(), ClientError>,
    ) -> Result<(), ClientError> {
        let frames = encode(value).unwrap();
        let pull = pull.then(|| PullSource {
            descs: frames
                .payloads
                .iter()
                .map(|f| RemoteDesc::new(5, 0, f.len() as u64))
                .collect(),
            agent: b"client".to_vec().into(),
        });
        let (mut op, mut step) = PutOp::new(
            0,
            "p",
            idx.to_vec(),
            vec!["x".into()],
            &frames,
            INLINE_MAX,
            ALIGN,
            pull,
        );
        loop {
            step = match step {
                PutStep::Send(req) => op.on_answer(self.call(req)),
                PutStep::Write { descs, .. } => {
                    let lens: Vec<u64> = frames
                        .payloads
                        .iter()
                        .map(|f| f.len() as u64)
                        .filter(|l| *l > 0)
                        .collect();
                    assert_eq!(descs.iter().map(|d| d.len).collect::<Vec<_>>(), lens);
                    op.on_written(write(), true)
                }
                PutStep::Done(r) => return r,
                other => panic!("a prepared PUT asked for {other:?}"),
            };
        }
    }

    fn put(&mut self, idx: &[u64], value: &Value) -> Result<(), ClientError> {
        self.put_with(idx, value, false, || Ok(()))
    }

    /// Drives a GET machine to its end; `lease` says whether the client's pool has a block.
    fn get_with(&mut self, idx: &[u64], lease: bool) -> Result<Columns, ClientError> {
        let (mut op, mut step) = GetOp::new(
            0,
            "p",
            idx.to_vec(),
            vec!["x".into()],
            ALIGN,
            Decoder::default(),
        );
        loop {
            step = match step {
                GetStep::Send(req) => op.on_answer(self.call(req)),
                GetStep::Lease { layout } if lease => {
                    let len = layout.size.max(1);
                    self.block = vec![0xee; len as usize];
                    op.on_block(Ok(RemoteDesc::new(9, 0, len)))
                }
                GetStep::Lease { layout } => op.on_block(Err(ClientError::OutOfMemory {
                    requested: layout.size,
                    align: layout.align,
                    free: 0,
                    largest_free: 0,
                })),
                GetStep::Land => op.on_landed(Bytes::from(std::mem::take(&mut self.block))),
                GetStep::Done(r) => {
                    assert!(!op.quarantine_block());
                    return r;
                }
            };
        }
    }

    fn get(&mut self, idx: &[u64]) -> Result<Columns, ClientError> {
        self.get_with(idx, true)
    }
}

fn bytes(i: u64, n: usize) -> Value {
    Value::Bytes(
        (0..n)
            .map(|k| (k as u64 * 31 + i) as u8)
            .collect::<Vec<_>>()
            .into(),
    )
}

/// Inline PUTs, then one GET of all of them, too large to answer inline: GET_READY, the
/// client's block in GET_INTO, the unit's WRITE, GET_DONE, every byte as stored.
#[test]
fn inline_puts_then_a_deferred_get_round_trip_every_byte() {
    let mut p = Pair::new(false);
    let idx: Vec<u64> = (0..8).collect();
    for i in &idx {
        let v = Value::List(vec![Value::List(vec![bytes(*i, 512)])]);
        p.put(&[*i], &v).unwrap();
    }
    let got = p.get(&idx).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0],
        idx.iter().map(|i| bytes(*i, 512)).collect::<Vec<_>>()
    );
    // A small GET is answered inline.
    assert_eq!(p.get(&[3]).unwrap()[0], vec![bytes(3, 512)]);
    let s = p.unit.stats();
    assert_eq!((s.pending_puts, s.pending_gets, s.leased_bytes), (0, 0, 0));
}

/// A pushed PUT: READY, the frames' descriptors in the unit's block, WRITE, COMMIT; a GET of
/// it comes back with its shape (the test memory is not written by the "WRITE").
#[test]
fn a_pushed_put_writes_then_commits() {
    let mut p = Pair::new(false);
    let t = Tensor::from_slice(&[100, 250], &vec![1.5f32; 25_000]).unwrap();
    let v = Value::List(vec![Value::List(vec![Value::Tensor(t)])]);
    p.put(&[1], &v).unwrap();
    let s = p.unit.stats();
    assert_eq!((s.keys, s.pending_puts, s.leased_bytes), (1, 0, 0));
    let got = p.get(&[1]).unwrap();
    let Value::Tensor(back) = &got[0][0] else {
        panic!("{got:?}")
    };
    assert_eq!(back.shape(), &[100, 250]);
}

/// A WRITE that fails cancels with `maybe_written`: the unit quarantines the block, stores
/// nothing, and the PUT fails with the WRITE's error.
#[test]
fn a_failed_write_cancels_and_the_block_is_quarantined() {
    let mut p = Pair::new(false);
    let v = Value::List(vec![Value::List(vec![bytes(1, 100_000)])]);
    let e = p
        .put_with(&[1], &v, false, || {
            Err(ClientError::Transfer {
                unit: 0,
                source: PayloadError::TimedOut {
                    after: std::time::Duration::from_secs(1),
                },
            })
        })
        .unwrap_err();
    assert!(matches!(e, ClientError::Transfer { .. }), "{e:?}");
    let s = p.unit.stats();
    assert_eq!((s.keys, s.pending_puts, s.leased_bytes), (0, 0, 0));
    assert!(s.quarantined_bytes >= 100_000, "{s:?}");
    p.unit.close_session(S, p.now, TornDown::Signalled);
    assert!(p.unit.release_closed(S) >= 100_000);
}

/// A receive block the client cannot lease cancels the GET: the unit drops it, and the
/// caller gets the pool's exhaustion as data.
#[test]
fn a_get_without_a_block_is_cancelled() {
    let mut p = Pair::new(false);
    let v = Value::List(vec![Value::List(vec![bytes(1, 100_000)])]);
    p.put(&[1], &v).unwrap();
    let e = p.get_with(&[1], false).unwrap_err();
    assert!(
        matches!(e, ClientError::OutOfMemory { requested, .. } if requested >= 100_000),
        "{e:?}"
    );
    assert_eq!(p.unit.stats().pending_gets, 0);
    // The unit's errors reach the machine as data too.
    let e = p.get(&[2]).unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::Missing));
}

/// Over a unit that pulls PUT payloads, the PUT names the frames and its one answer comes
/// once the unit READ them; a pushed PUT there is refused.
#[test]
fn a_pulled_put_is_answered_after_the_units_read() {
    let mut p = Pair::new(true);
    let v = Value::List(vec![Value::List(vec![bytes(1, 100_000)])]);
    p.put_with(&[1], &v, true, || panic!("a pulled PUT writes nothing"))
        .unwrap();
    assert_eq!(p.unit.stats().keys, 1);
    let e = p.put(&[2], &v).unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest));
    // Inline PUTs need no payload plane either way.
    p.put(&[3], &Value::List(vec![Value::List(vec![bytes(3, 10)])]))
        .unwrap();
    assert_eq!(p.get(&[3]).unwrap()[0], vec![bytes(3, 10)]);
}

/// A GET whose meta the unit sends ahead of its WRITE into the offered block: decoded
/// while the values land, bound once `GetDone` says they did, the same values a full decode
/// of the block gives. A meta ahead that does not lay out fails the GET once the WRITE is
/// over, and keeps the block out of the pool.
#[test]
fn a_meta_sent_ahead_is_decoded_while_the_values_land() {
    let mut p = Pair::new(false);
    // Values of 4 KiB and more travel as frames of their own, each of another length: an
    // entry of the meta each (equal ones would be one run of the table).
    let n = 800u64;
    let idx: Vec<u64> = (0..n).collect();
    let vals: Vec<Value> = (0..n).map(|i| bytes(i, 4096 + i as usize)).collect();
    p.put(&idx, &Value::List(vec![Value::List(vals)])).unwrap();
    let offer = |p: &mut Pair| {
        p.block = vec![0xee; 4 << 20];
        let (op, step) = GetOp::offered(
            0,
            "p",
            idx.clone(),
            vec!["x".into()],
            ALIGN,
            Decoder::default(),
            RemoteDesc::new(9, 0, 4 << 20),
        );
        let GetStep::Send(req @ Request::GetOffer { .. }) = step else {
            panic!("{step:?}")
        };
        let answer = p.call(req);
        let meta = p.ahead.take().expect("the meta ahead of the WRITE");
        (op, meta, answer)
    };
    let (mut op, meta, answer) = offer(&mut p);
    assert!(meta.len() >= tessera_storage::core::EARLY_META_BYTES);
    op.on_ahead(meta.clone());
    assert!(matches!(answer, Ok((_, Response::GetDone))), "{answer:?}");
    let GetStep::Land = op.on_answer(answer) else {
        panic!("not landed")
    };
    let size = op.landed_size().unwrap();
    let block = Bytes::from(std::mem::take(&mut p.block)).slice(..size as usize);
    let whole = tessera_framecodec::decode_contiguous(&meta, &block, ALIGN).unwrap();
    let GetStep::Done(Ok(got)) = op.on_landed(block) else {
        panic!("not decoded")
    };
    assert_eq!(Value::List(vec![Value::List(got[0].clone())]), whole);
    assert_eq!(got[0].len(), n as usize);
    assert!(!op.quarantine_block());
    // A meta ahead that does not lay out.
    let (mut op, _, answer) = offer(&mut p);
    op.on_ahead(serde_bytes::ByteBuf::from(vec![1, 2, 3]));
    assert!(matches!(op.on_answer(answer), GetStep::Done(Err(_))));
    assert!(op.quarantine_block(), "the unit wrote into the block");
}

/// Credits and offered blocks, machine against core: a pushed PUT's answer brings credits;
/// the next PUT sends its `PutCredited` and writes meanwhile (one round trip, no block
/// prepared), and brings a replacement; a GET that offers a block large enough is written
/// into it and answered `Written`, one round trip, every byte as stored; one whose block is
/// too small goes on as a plain GET. A WRITE into a credit that fails ends the PUT with its
/// error, and the unit, finding nothing written, stores nothing.
#[test]
fn credited_puts_and_offered_gets_take_one_round_trip() {
    let mut p = Pair::new(false);
    let v = |i: u64| Value::List(vec![Value::List(vec![bytes(i, 50_000)])]);
    // The first PUT is prepared; its answer brings the session's credits.
    let frames = encode(&v(1)).unwrap();
    let (mut op, step) = PutOp::new(
        0,
        "p",
        vec![1],
        vec!["x".into()],
        &frames,
        INLINE_MAX,
        ALIGN,
        None,
    );
    let PutStep::Send(req) = step else {
        panic!("{step:?}")
    };
    let PutStep::Write { .. } = op.on_answer(p.call(req)) else {
        panic!("no READY")
    };
    let PutStep::Send(commit) = op.on_written(Ok(()), true) else {
        panic!("no COMMIT")
    };
    assert!(matches!(
        op.on_answer(p.call(commit)),
        PutStep::Done(Ok(()))
    ));
    let (mut credits, _) = op.take_credits();
    assert_eq!(credits.len(), 2, "the session's credits");
    // The second goes into a credit: the request and the WRITE together, then the answer.
    let frames = encode(&v(2)).unwrap();
    let layout = frames.layout(ALIGN).unwrap();
    assert!(layout.size <= credits[0].block.len);
    let credit = credits.remove(0);
    let (mut op, step) =
        PutOp::credited(0, "p", vec![2], vec!["x".into()], &frames, layout, &credit);
    let PutStep::SendWrite { req, descs } = step else {
        panic!("{step:?}")
    };
    assert!(matches!(req, Request::PutCredited { credit: c, .. } if c == credit.id));
    assert!(descs
        .iter()
        .all(|d| d.offset + d.len <= credit.block.offset + credit.block.len));
    assert!(matches!(op.on_written(Ok(()), true), PutStep::Await));
    assert!(matches!(op.on_answer(p.call(req)), PutStep::Done(Ok(()))));
    let (more, _) = op.take_credits();
    assert_eq!(more.len(), 1, "the used credit replaced");
    let s = p.unit.stats();
    assert_eq!((s.keys, s.pending_puts, s.leased_bytes), (2, 0, 0));
    // A failed WRITE into a credit: the PUT fails with it, and nothing is stored.
    let frames = encode(&v(3)).unwrap();
    let credit = credits.remove(0);
    let layout = frames.layout(ALIGN).unwrap();
    let (mut op, step) =
        PutOp::credited(0, "p", vec![3], vec!["x".into()], &frames, layout, &credit);
    let PutStep::SendWrite { .. } = step else {
        panic!("{step:?}")
    };
    let failed = ClientError::Transfer {
        unit: 0,
        source: PayloadError::TimedOut {
            after: std::time::Duration::from_secs(1),
        },
    };
    assert!(matches!(
        op.on_written(Err(failed), true),
        PutStep::Done(Err(ClientError::Transfer { .. }))
    ));
    // A GET offering a block the values fit: written into it, one round trip.
    p.block = vec![0xee; 1 << 20];
    let (mut op, step) = GetOp::offered(
        0,
        "p",
        vec![2, 1],
        vec!["x".into()],
        ALIGN,
        Decoder::default(),
        RemoteDesc::new(9, 0, 1 << 20),
    );
    let GetStep::Send(req @ Request::GetOffer { .. }) = step else {
        panic!("{step:?}")
    };
    let GetStep::Land = op.on_answer(p.call(req)) else {
        panic!("not written into the offer")
    };
    assert!(!op.offer_untouched());
    let size = op.landed_size().unwrap();
    assert!((100_000..1 << 20).contains(&size));
    let GetStep::Done(Ok(got)) = op.on_landed(Bytes::from(std::mem::take(&mut p.block))) else {
        panic!("not landed")
    };
    // The prepared PUT's payload stays zeroed in the test memory, the credited one too.
    assert_eq!(got[0].len(), 2);
    // Offered too small: a plain GET from there on, the offered block untouched.
    let (mut op, step) = GetOp::offered(
        0,
        "p",
        vec![2],
        vec!["x".into()],
        ALIGN,
        Decoder::default(),
        RemoteDesc::new(9, 0, 1000),
    );
    let GetStep::Send(req) = step else {
        panic!("{step:?}")
    };
    let GetStep::Lease { .. } = op.on_answer(p.call(req)) else {
        panic!("no GET_READY")
    };
    assert!(op.offer_untouched());
    assert_eq!(p.unit.stats().keys, 2);
}
