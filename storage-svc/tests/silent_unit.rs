//! A unit that accepts the connection but never answers (stopped, or its session task died):
//! the client gets a timeout error, it does not wait forever.

use std::time::Duration;

use tessera_storage::{Backend, Client, ClientConfig, ClientError};

#[tokio::test]
async fn a_silent_unit_is_a_timeout_not_a_hang() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // Accept and hold the connection open, reading nothing back.
    let holder = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(s);
    });
    let connect = Client::connect(ClientConfig {
        units: vec![addr],
        backend: Backend::Inproc,
        recv_pool_bytes: 1 << 20,
        timeout: Duration::from_millis(300),
        ..ClientConfig::default()
    });
    let err = tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .expect("connect waited past its own timeout")
        .err()
        .expect("a unit that never answers cannot be connected to");
    assert!(
        matches!(err, ClientError::Timeout { unit: 0, .. }),
        "unexpected error: {err}"
    );
    holder.abort();
}
