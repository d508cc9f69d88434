//! The broker going away and coming back: the reconciler reports BrokerUnreachable meanwhile and
//! recovers on its own, with no restart.

mod common;

use common::*;
use queueguard::{
    broker::{BrokerCredentials, BrokerPool},
    converge::{self, Mode},
    pass,
    status::{Reason, Truth},
};
use std::time::Duration;

#[tokio::test]
async fn an_outage_is_reported_and_recovered_from_without_a_restart() {
    let proxy = Proxy::start(&broker_addr()).await;
    let name = unique("outage");
    let plan = plan_of(&policy(&name, "{}"));
    let creds = BrokerCredentials {
        uri: proxy.uri(),
        management_uri: Some(management_base()),
        ca_cert: None,
        addresses: None,
        prometheus_uri: None,
    };
    let pool = BrokerPool::new(unique("conn"));
    let broker = pass::broker_for_plan(&pool, &plan, &creds).unwrap();
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());

    proxy.cut();
    let down = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert_eq!((down.queue.status, down.queue.reason), (Truth::Unknown, Reason::BrokerUnreachable), "{down:#?}");
    assert_eq!(down.ready().reason, Reason::BrokerUnreachable);
    assert!(down.queue.message.contains(&format!("127.0.0.1:{}", proxy.port)), "{}", down.queue.message);
    assert!(!down.queue.message.contains("guest:guest"), "no credentials in messages");
    let still_down = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert_eq!(still_down.queue.reason, Reason::BrokerUnreachable);

    proxy.restore();
    let recovered = eventually(Duration::from_secs(20), || async {
        converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready()
    })
    .await;
    assert!(recovered, "ready again once the broker is back, within the backoff");
    assert_eq!(pool.connections_opened(), 2, "one reconnect");
    remove_all(&plan).await;
}

#[tokio::test]
async fn a_connection_force_closed_by_an_administrator_is_replaced() {
    let name = unique("force-close");
    let connection_name = unique("operator");
    let plan = plan_of(&policy(&name, "{}"));
    let pool = BrokerPool::new(connection_name.clone());
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());

    // The management API lists a new connection within its statistics interval.
    let mut closed = false;
    for _ in 0..100 {
        let conns = broker.management.connections().await.unwrap();
        if let Some(c) = conns.iter().find(|c| c.connection_name() == Some(connection_name.as_str())) {
            broker.management.close_connection(&c.name).await.unwrap();
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(closed, "the operator's connection shows up under its name");
    let recovered = eventually(Duration::from_secs(20), || async {
        converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready()
    })
    .await;
    assert!(recovered);
    assert_eq!(pool.connections_opened(), 2);
    remove_all(&plan).await;
}

/// Stops and starts the real broker, so it only runs when asked (scripts/test.sh asks, after the
/// rest of the suite, because it disturbs every other test using the broker).
#[tokio::test]
async fn a_real_broker_restart_needs_no_operator_restart() {
    if std::env::var("QUEUEGUARD_TEST_BROKER_RESTART").as_deref() != Ok("1") {
        eprintln!("skipped: set QUEUEGUARD_TEST_BROKER_RESTART=1 to stop and start the local broker");
        return;
    }
    let name = unique("restart");
    let plan = plan_of(&policy(&name, "{}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());

    rabbitmqctl("stop_app");
    let down = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert_eq!(down.ready().reason, Reason::BrokerUnreachable, "{down:#?}");
    rabbitmqctl("start_app");
    let recovered = eventually(Duration::from_secs(60), || async {
        converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready()
    })
    .await;
    assert!(recovered, "ready again after the broker restarted");
    assert!(exists(&name).await, "the durable queue survived the restart");
    remove_all(&plan).await;
}

fn rabbitmqctl(command: &str) {
    let status = std::process::Command::new("rabbitmqctl").arg(command).status().expect("rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {command}");
}
