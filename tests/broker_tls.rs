//! amqps:// with a private CA from the Secret's `caCert`: a TLS terminator with a freshly minted
//! CA sits in front of the real broker, so the operator's TLS path is exercised end to end.

mod common;

use common::*;
use queueguard::{
    broker::{BrokerCredentials, BrokerPool},
    converge::{self, Mode},
    pass,
    status::Reason,
};

/// Starts a TLS listener on 127.0.0.1 forwarding to the broker; returns its port and the CA PEM.
async fn tls_terminator() -> (u16, String) {
    let (acceptor, ca) = tls::acceptor();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tls::forward(listener, acceptor, broker_addr());
    (port, ca)
}

#[tokio::test]
async fn amqps_with_the_secrets_ca_certificate_declares_the_queue() {
    let (port, ca) = tls_terminator().await;
    let name = unique("tls");
    let plan = plan_of(&policy(&name, "{}"));
    let uri = format!("amqps://guest:guest@127.0.0.1:{port}/%2F");

    let untrusted = BrokerCredentials {
        uri: uri.clone(),
        management_uri: Some(management_base()),
        ca_cert: None,
        addresses: None,
        prometheus_uri: None,
    };
    let pool = BrokerPool::new(unique("conn"));
    let broker = pass::broker_for_plan(&pool, &plan, &untrusted).unwrap();
    let refused = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert_eq!(
        refused.queue.reason,
        Reason::BrokerUnreachable,
        "a certificate from an unknown CA is refused: {refused:#?}"
    );
    assert!(!exists(&name).await);

    let trusted = BrokerCredentials {
        uri,
        management_uri: Some(management_base()),
        ca_cert: Some(ca),
        addresses: None,
        prometheus_uri: None,
    };
    let broker = pass::broker_for_plan(&pool, &plan, &trusted).unwrap();
    assert_eq!(broker.uri.display(), format!("amqps://127.0.0.1:{port}/%2F"));
    let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert!(outcome.is_ready(), "{outcome:#?}");
    assert!(exists(&name).await);
    remove_all(&plan).await;
}
