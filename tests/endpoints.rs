//! The operator's HTTP endpoints, served for real: probes, and /metrics showing the live state
//! of a real broker connection.

mod common;

use common::*;
use queueguard::{
    broker::BrokerPool,
    consumers::TrackerPool,
    http::{Endpoints, Health, serve},
    metrics::Metrics,
};
use std::{sync::Arc, time::Duration};

async fn get(url: &str) -> (u16, String) {
    let r = reqwest::get(url).await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn probes_and_metrics_answer() {
    queueguard::tls::install_crypto_provider();
    let brokers = Arc::new(BrokerPool::new(unique("endpoints")));
    let trackers = Arc::new(TrackerPool::new(&unique("endpoints")));
    let health = Arc::new(Health::new(false));
    let endpoints = Arc::new(Endpoints {
        metrics: Arc::new(Metrics::default()),
        health: health.clone(),
        brokers: brokers.clone(),
        trackers: trackers.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener, endpoints, Default::default()));

    assert_eq!(get(&format!("{base}/healthz")).await.0, 200);
    let (code, body) = get(&format!("{base}/readyz")).await;
    assert_eq!((code, body.trim()), (503, "watches not synced yet"));
    health.set_leading(true);
    health.set_synced();
    assert_eq!(get(&format!("{base}/readyz")).await.0, 200);

    // One broker endpoint and its tracker, connected for real: both gauges read 1, and no
    // credentials show.
    let plan = plan_of(&policy("endpoints", &format!("{{name: {}}}", unique("endpoints"))));
    let broker = broker(&brokers, &plan);
    drop(broker.amqp.channel().await.expect("the local broker answers"));
    let tracker = trackers.tracker(&broker.uri, None).unwrap();
    assert!(eventually(Duration::from_secs(10), || async { tracker.broker().amqp.is_connected() }).await);
    let (code, text) = get(&format!("{base}/metrics")).await;
    assert_eq!(code, 200);
    for connection in ["declarations", "events"] {
        let up = format!(
            "queueguard_broker_connection_up{{broker=\"amqp://127.0.0.1:5672/%2F\",connection=\"{connection}\"}} 1"
        );
        assert!(text.contains(&up), "{up} in {text}");
    }
    assert!(!text.contains("guest"), "credentials never reach /metrics");
    assert!(text.contains("queueguard_leader 0"), "not leading yet: {text}");
}
