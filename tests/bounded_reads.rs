//! Every answer the operator reads from an endpoint a Secret names is bounded: a management API
//! or a rabbitmq_prometheus listener that answers with hundreds of megabytes is refused once its
//! answer passes the cap, with the endpoint named, and the process does not grow with it.
//! (Issue 31, 14: a 400 MB answer drove the process to 834 MiB RSS.)

mod common;

use queueguard::broker::{BrokerCredentials, body::CAP, prometheus, uri::BrokerUri};
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An HTTP server that answers every request with 200 and an endless chunked body (up to 400 MB);
/// counts the bytes it managed to send.
async fn endless() -> (u16, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                if socket.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b' '; 1 << 20];
                let framed = [format!("{:x}\r\n", chunk.len()).into_bytes(), chunk, b"\r\n".to_vec()].concat();
                for _ in 0..400 {
                    if socket.write_all(&framed).await.is_err() {
                        return;
                    }
                    counter.fetch_add(1 << 20, Ordering::Relaxed);
                }
                let _ = socket.write_all(b"0\r\n\r\n").await;
            });
        }
    });
    (port, sent)
}

fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

#[tokio::test]
async fn a_management_api_that_answers_without_end_is_refused_past_the_cap() {
    let (port, sent) = endless().await;
    let credentials = BrokerCredentials {
        uri: "amqp://guest:guest@127.0.0.1:5672/%2F".into(),
        management_uri: Some(format!("http://127.0.0.1:{port}")),
        ca_cert: None,
        addresses: None,
        prometheus_uri: None,
    };
    let endpoint = BrokerUri::from_credentials(&credentials).unwrap().management().clone();
    let client = queueguard::broker::management::ManagementClient::new(endpoint, None).unwrap();
    let before = rss_mib();
    let read = tokio::time::timeout(Duration::from_secs(60), client.queue("/", "orders")).await.unwrap();
    let error = read.expect_err("an endless answer is refused").to_string();
    let grew = rss_mib().saturating_sub(before);
    println!("refused after {} MiB sent; RSS grew {grew} MiB: {error}", sent.load(Ordering::Relaxed) >> 20);
    assert!(error.contains(&format!("127.0.0.1:{port}")), "names the endpoint: {error}");
    assert!(error.contains("passed 16 MiB"), "says why: {error}");
    assert!(!error.contains("guest"), "no credentials: {error}");
    assert!(grew < 64, "the answer was not held: RSS grew {grew} MiB");
    assert!(sent.load(Ordering::Relaxed) < 200 << 20, "the read stopped early");
    assert_eq!(CAP, 16 << 20);
}

#[tokio::test]
async fn a_prometheus_listener_that_answers_without_end_is_refused_past_the_cap() {
    let (port, sent) = endless().await;
    let url = url::Url::parse(&format!("http://127.0.0.1:{port}/metrics/detailed")).unwrap();
    queueguard::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let before = rss_mib();
    let read = tokio::time::timeout(Duration::from_secs(60), prometheus::scrape(&http, &url, "/", "rabbit@x")).await;
    let error = read.unwrap().expect_err("an endless answer is refused");
    let grew = rss_mib().saturating_sub(before);
    println!("refused after {} MiB sent; RSS grew {grew} MiB: {error}", sent.load(Ordering::Relaxed) >> 20);
    assert!(error.contains(&format!("127.0.0.1:{port}")) && error.contains("passed 16 MiB"), "{error}");
    assert!(grew < 64, "RSS grew {grew} MiB");
}
