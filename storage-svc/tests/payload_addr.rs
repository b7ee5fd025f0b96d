//! The `tcp` payload engines listen on and advertise the addresses they are given, so units and
//! clients on different hosts can reach each other (here: two loopback addresses).

use std::net::SocketAddr;

use tessera_storage::{Backend, Client, ClientConfig, Server, ServerConfig, Tensor, Value};

fn mentions(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_plane_on_given_addresses() {
    let unit_addr: SocketAddr = "127.0.0.3:0".parse().unwrap();
    let client_addr: SocketAddr = "127.0.0.2:0".parse().unwrap();
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Tcp,
        payload_addr: Some(unit_addr),
        pool_bytes: 16 << 20,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let client = Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Tcp,
        payload_addr: Some(client_addr),
        recv_pool_bytes: 16 << 20,
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    assert!(mentions(&client.agent().metadata(), "127.0.0.2:"));
    // Large enough for the payload plane (a WRITE each way), not inline.
    let data: Vec<f32> = (0..200_000).map(|i| i as f32).collect();
    let t = Value::Tensor(Tensor::from_slice(&[200_000], &data).unwrap());
    client
        .put("p", &[7], &[("x".into(), vec![t])])
        .await
        .unwrap();
    let got = client.get("p", &[7], &["x"]).await.unwrap();
    assert_eq!(
        got[0][0].as_tensor().unwrap().to_vec::<f32>().unwrap(),
        data
    );
    drop(got);
    client.clear("p", &[7]).await.unwrap();
    server.shutdown().await;
}
