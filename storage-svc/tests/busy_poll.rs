//! A unit and a client that both busy-poll their control sockets (each on its own runtime
//! built with `BusyPoll::on_park`) store and read back values over TCP and Unix control
//! sockets, and the pollers count what is awaited: one per open session, none once every
//! answer arrived. Pollers that learn expect answers (a client's) and requests (a unit's).

use std::time::{Duration, Instant};

use tessera_storage::{
    Backend, BusyPoll, Client, ClientConfig, Server, ServerConfig, Tensor, Value,
};

fn runtime(poll: &BusyPoll) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .on_thread_park(poll.on_park())
        .build()
        .unwrap()
}

fn until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A unit bound at `bind` over shm and a client of it, each on a runtime of its own polled
/// by its poller.
struct Pair {
    unit_rt: tokio::runtime::Runtime,
    server: Server,
    client_rt: tokio::runtime::Runtime,
    client: Client,
}

impl Pair {
    /// Closes the client, then shuts the unit down.
    fn close(self) {
        drop(self.client);
        drop(self.client_rt);
        self.unit_rt.block_on(self.server.shutdown());
    }
}

fn pair(bind: &str, unit_poll: &BusyPoll, client_poll: &BusyPoll) -> Pair {
    let unit_rt = runtime(unit_poll);
    let server = unit_rt
        .block_on(Server::start(ServerConfig {
            bind: bind.to_owned(),
            backend: Backend::Shm,
            pool_bytes: 16 << 20,
            pool_chunk_bytes: 16 << 20,
            busy_poll: Some(unit_poll.clone()),
            ..ServerConfig::default()
        }))
        .unwrap();
    let client_rt = runtime(client_poll);
    let client = client_rt
        .block_on(Client::connect(ClientConfig {
            units: vec![server.addr().to_owned()],
            backend: Backend::Shm,
            recv_pool_bytes: 16 << 20,
            busy_poll: Some(client_poll.clone()),
            ..ClientConfig::default()
        }))
        .unwrap();
    Pair {
        unit_rt,
        server,
        client_rt,
        client,
    }
}

/// How far past a request (or an answer) an expecting poller of these tests polls.
const LONGEST: Duration = Duration::from_secs(2);

/// A poller with a 50 us window that, `expecting`, also polls for what it expects within
/// [`LONGEST`].
fn poller(expecting: bool) -> BusyPoll {
    let window = Duration::from_micros(50);
    match expecting {
        true => BusyPoll::expecting(window, LONGEST).unwrap(),
        false => BusyPoll::new(window).unwrap(),
    }
}

/// A client whose poller polls for expected answers (`BusyPoll::expecting`) learns how long
/// requests of one shape take and says when each next answer is expected, within the bound;
/// a plain poller expects nothing.
#[test]
fn a_client_expects_answers_of_a_shape_it_has_seen() {
    for expecting in [true, false] {
        let unit_poll = poller(false);
        let client_poll = poller(expecting);
        let p = pair("127.0.0.1:0", &unit_poll, &client_poll);
        let batch: Vec<Value> = (0..64u32)
            .map(|i| Value::Tensor(Tensor::from_slice(&[1024], &[i; 1024]).unwrap()))
            .collect();
        let indexes: Vec<u64> = (0..64).collect();
        let cols = [("x".to_owned(), batch)];
        p.client_rt.block_on(async {
            p.client.put("p", &indexes, &cols).await.unwrap();
            assert_eq!(client_poll.expected(), None, "a shape not seen yet");
            // Each kind of request (a first PUT, credited ones, GETs) is seen again.
            let mut sent = Instant::now();
            for _ in 0..3 {
                sent = Instant::now();
                p.client.put("p", &indexes, &cols).await.unwrap();
                drop(p.client.get("p", &indexes, &["x"]).await.unwrap());
            }
            match (expecting, client_poll.expected()) {
                (true, Some(by)) => assert!(by > sent && by <= Instant::now() + LONGEST),
                (false, None) => {}
                (_, by) => panic!("expecting {expecting}: {by:?}"),
            }
        });
        p.close();
    }
}

/// A unit whose poller polls for expected requests learns how long a session pauses between
/// its requests and, having answered, says when the next should come: after the pause;
/// a plain poller expects nothing.
#[test]
fn a_unit_expects_the_next_request_of_a_session_that_pauses_steadily() {
    let pause = Duration::from_millis(20);
    for expecting in [true, false] {
        let unit_poll = poller(expecting);
        let client_poll = poller(false);
        let p = pair("127.0.0.1:0", &unit_poll, &client_poll);
        let value = || vec![Value::Tensor(Tensor::from_slice(&[1], &[7u32]).unwrap())];
        let sent = p.client_rt.block_on(async {
            let mut sent = Instant::now();
            // As many as the unit remembers, so that the handshake's quick ones are forgotten.
            for i in 0..8 {
                tokio::time::sleep(pause).await;
                sent = Instant::now();
                p.client
                    .put("p", &[i], &[("x".into(), value())])
                    .await
                    .unwrap();
            }
            sent
        });
        if expecting {
            // Set once the unit waits for the next request, which may be after the client
            // got its answer; until then the expectation is the one that followed the request
            // before, a pause earlier.
            until(
                "the request after the last is expected a pause later",
                || unit_poll.expected().is_some_and(|by| by >= sent + pause),
            );
            assert!(unit_poll.expected().unwrap() <= Instant::now() + LONGEST);
        } else {
            assert_eq!(unit_poll.expected(), None);
        }
        p.close();
    }
}

#[test]
fn polled_unit_and_client_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let unix = format!("unix:{}", dir.path().join("unit.sock").display());
    for bind in ["127.0.0.1:0".to_owned(), unix] {
        let unit_poll = BusyPoll::new(Duration::from_micros(200)).unwrap();
        let client_poll = BusyPoll::new(Duration::from_micros(200)).unwrap();
        let Pair {
            unit_rt,
            server,
            client_rt,
            client,
        } = pair(&bind, &unit_poll, &client_poll);
        until("the session is awaited", || unit_poll.awaited() == 1);
        client_rt.block_on(async {
            for i in 0..200u64 {
                // Inline (4 bytes) and through the payload plane (64 KiB), alternately.
                let n = if i % 2 == 0 { 1 } else { 16 << 10 };
                let data: Vec<i32> = (0..n).map(|k| k ^ (i as i32)).collect();
                let t = Value::Tensor(Tensor::from_slice(&[n as u64], &data).unwrap());
                client
                    .put("p", &[i], &[("x".into(), vec![t])])
                    .await
                    .unwrap();
                let got = client.get("p", &[i], &["x"]).await.unwrap();
                assert_eq!(
                    got[0][0].as_tensor().unwrap().to_vec::<i32>().unwrap(),
                    data
                );
            }
            client.drop_partition("p").await.unwrap();
        });
        assert_eq!(client_poll.awaited(), 0, "every answer arrived ({bind})");
        drop(client);
        until("the closed session is no longer awaited", || {
            unit_poll.awaited() == 0
        });
        unit_rt.block_on(server.shutdown());
    }
}
