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
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::sync::Arc;

/// Starts a TLS listener on 127.0.0.1 forwarding to the broker; returns its port and the CA PEM.
async fn tls_terminator() -> (u16, String) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();

    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(leaf.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let target = broker_addr();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, target) = (acceptor.clone(), target.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut upstream) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
            });
        }
    });
    (port, ca_cert.pem())
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
