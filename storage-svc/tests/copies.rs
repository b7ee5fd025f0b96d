//! Copy counting: a PUT and a GET of an N-byte payload allocate no payload-sized buffer
//! anywhere in the process (unit and client share it here, over `inproc`), the stored value
//! and the returned value live in registered memory (the unit's pool, the client's receive
//! pool), and the transport's engines copy exactly N bytes for each, once: the PUT's WRITE
//! from the client's frame into the unit's pool, the GET's WRITE from the unit's pool into
//! the client's receive pool.

use tessera_storage::{Backend, Client, ClientConfig, Server, ServerConfig, Tensor, Value};
use tessera_testkit::CountingAlloc;

/// Counts the bytes of every allocation of at least 1 MiB.
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new(1 << 20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_and_get_copy_the_payload_once_in_the_transport() {
    const N: usize = 64 << 20;
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Inproc,
        pool_bytes: 256 << 20,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let client = Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Inproc,
        recv_pool_bytes: 256 << 20,
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    let data: Vec<f32> = (0..N / 4).map(|i| i as f32).collect();
    let tensor = Tensor::from_slice(&[(N / 4) as u64], &data).unwrap();
    drop(data);
    let cols = vec![("x".to_string(), vec![Value::Tensor(tensor.clone())])];
    // Warm-up: first-use allocations of the runtime and the codec.
    client.put("p", &[0], &cols).await.unwrap();
    drop(client.get("p", &[0], &["x"]).await.unwrap());
    let before = server.stats();
    // Bytes the transport's engines copied, both agents together: (WRITE, READ).
    let copied = || {
        let (c, u) = (client.agent().report(), server.agent().report());
        (
            c.copied_write_bytes + u.copied_write_bytes,
            c.copied_read_bytes + u.copied_read_bytes,
        )
    };
    let start = copied();

    let large_before = GLOBAL.bytes();
    client.put("p", &[0], &cols).await.unwrap();
    let after_put = copied();
    let got = client.get("p", &[0], &["x"]).await.unwrap();
    let after_get = copied();
    let large = GLOBAL.bytes() - large_before;
    assert_eq!(large, 0, "payload-sized allocations during PUT + GET");
    assert_eq!(
        after_put.0 - start.0,
        N as u64,
        "bytes the transport copied for the PUT"
    );
    assert_eq!(
        after_get.0 - after_put.0,
        N as u64,
        "bytes the transport copied for the GET"
    );
    assert_eq!(after_get.1, start.1, "no READs");

    let after = server.stats();
    let moved_in = after.bytes_in - before.bytes_in;
    let moved_out = after.bytes_out - before.bytes_out;
    assert!(
        moved_in >= N as u64 && moved_in < N as u64 + 4096,
        "{moved_in}"
    );
    assert!(
        moved_out >= N as u64 && moved_out < N as u64 + 4096,
        "{moved_out}"
    );
    assert_eq!(after.compacted_bytes, 0);
    let t = got[0][0].as_tensor().unwrap();
    // The GET's tensor is a view into the client's registered receive pool.
    assert!(client
        .agent()
        .find_registered(t.data().as_ptr(), N as u64)
        .is_some());
    assert_eq!(t.data(), tensor.data());
    drop(got);
    assert_eq!(client.recv_pool_used(), 0);
    server.shutdown().await;
}
