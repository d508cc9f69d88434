//! The admission webhook end to end, short of a cluster: it issues its certificate into a
//! Secret and writes the CA into the MutatingWebhookConfiguration (mocked API, each request
//! checked), then answers a real AdmissionReview over HTTPS, verified against that CA.

mod common;

use base64::Engine;
use common::api::*;
use http::StatusCode;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::{reflector, watcher};
use queueguard::{
    crd::QueuePolicy,
    webhook::{
        certs::{self, SelfSigned},
        server::{CertSource, DIR_CHECK_EVERY, Timeouts, Webhook},
    },
};
use serde_json::{Value, json};
use std::{net::SocketAddr, time::Duration};

const SECRET: &str = "/api/v1/namespaces/ops/secrets/qg-webhook-tls";
const SECRETS: &str = "/api/v1/namespaces/ops/secrets";
const CONFIG: &str = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/qg";
const REVIEW: &str = include_str!("fixtures/admission/replicaset-creates-pod.json");

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(text: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(text.as_str().expect("base64 text")).unwrap()
}

fn guarding_policy() -> QueuePolicy {
    serde_yaml_ng::from_str(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {name: orders, namespace: shop}\nspec:\n  broker: {secretRef: {name: rabbitmq}}\n  queue: {name: orders}\n  consumers: {deployment: order-worker}\n",
    )
    .unwrap()
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

#[tokio::test]
async fn the_webhook_keeps_its_certificate_and_adds_the_gate_over_https() {
    queueguard::tls::install_crypto_provider();
    let (client, mut api) = mock_client();
    // The policy list is still coming in (a replica starting): the request waits for it.
    let (store, mut writer) = reflector::store::<QueuePolicy>();
    writer.apply_watcher_event(&watcher::Event::Init);
    writer.apply_watcher_event(&watcher::Event::InitApply(guarding_policy()));
    let addr = free_addr();
    let certs = CertSource::SelfSigned(SelfSigned {
        namespace: "ops".into(),
        secret: "qg-webhook-tls".into(),
        service: "qg-webhook".into(),
        webhook_config: "qg".into(),
    });
    tokio::spawn(Webhook { addr, certs, timeouts: Default::default() }.serve(client, store, None));

    // No Secret yet: the operator issues a CA and a serving certificate and stores them.
    api.expect("GET", SECRET).await.respond(
        StatusCode::NOT_FOUND,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}),
    );
    let create = api.expect("POST", SECRETS).await;
    let secret = create.body.clone();
    assert_eq!(secret["type"], "kubernetes.io/tls");
    assert_eq!(
        secret["metadata"]["annotations"]["queueguard.io/dns-names"],
        "qg-webhook.ops.svc,qg-webhook.ops.svc.cluster.local"
    );
    for key in ["ca.crt", "ca.key", "tls.crt", "tls.key"] {
        assert!(!unb64(&secret["data"][key]).is_empty(), "{key} stored");
    }
    create.respond(StatusCode::CREATED, &secret);
    let ca = unb64(&secret["data"]["ca.crt"]);

    // Then it writes that CA into the webhook configuration, by webhook name.
    api.expect("GET", CONFIG).await.respond(
        StatusCode::OK,
        &json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "qg"},
            "webhooks": [{
                "name": "pods.queueguard.io", "sideEffects": "None", "admissionReviewVersions": ["v1"],
                "clientConfig": {"service": {"name": "qg-webhook", "namespace": "ops", "path": "/mutate-pods", "port": 443}}
            }]
        }),
    );
    let patch = api.expect("PATCH", CONFIG).await;
    assert_eq!(patch.content_type, "application/strategic-merge-patch+json");
    assert_eq!(
        patch.body,
        json!({"webhooks": [{"name": "pods.queueguard.io", "clientConfig": {"caBundle": b64(&ca)}}]})
    );
    patch.respond(StatusCode::OK, &json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": "qg"}}));

    // The API server reaches it by the Service's DNS name and trusts only that CA.
    let https = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(&ca).unwrap()])
        .resolve("qg-webhook.ops.svc", addr)
        .build()
        .unwrap();
    let url = format!("https://qg-webhook.ops.svc:{}/mutate-pods", addr.port());
    let (client, target) = (https.clone(), url.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        writer.apply_watcher_event(&watcher::Event::InitDone);
    });
    let asked = tokio::spawn(async move {
        for _ in 0..50 {
            match client.post(&target).header("content-type", "application/json").body(REVIEW).send().await {
                Ok(r) => return Some(r),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        None
    });
    // The new pod's ReplicaSet says which workload it belongs to (its metadata only).
    let rs = api.expect("GET", "/apis/apps/v1/namespaces/shop/replicasets/order-worker-7d9c5b6f4").await;
    rs.respond(
        StatusCode::OK,
        &json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": "order-worker-7d9c5b6f4", "namespace": "shop",
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "order-worker", "uid": "d", "controller": true}]}}),
    );
    let answer = asked.await.unwrap();
    let answer = answer.expect("the webhook answers over TLS");
    assert_eq!(answer.status(), 200);
    let review: Value = answer.json().await.unwrap();
    assert_eq!(review["kind"], "AdmissionReview");
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    let response = &review["response"];
    assert_eq!(response["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002", "the answer names the request");
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    let ops: Value = serde_json::from_slice(&unb64(&response["patch"])).unwrap();
    assert_eq!(
        ops,
        json!([{"op": "add", "path": "/spec/readinessGates", "value": [{"conditionType": "queueguard.io/consumer-attached"}]}])
    );

    // A pod of a Deployment no policy guards passes unchanged.
    let other = REVIEW.replace("order-worker-7d9c5b6f4", "web-5f6d8c9b7");
    let review: Value = https
        .post(&url)
        .header("content-type", "application/json")
        .body(other)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(review["response"]["allowed"], true);
    assert!(review["response"].get("patch").is_none(), "{review}");
}

/// With `rbac.scope: Namespaces` the operator acts only in its namespaces: a pod elsewhere gets
/// no gate, which nobody would ever open, and costs no lookup.
#[tokio::test]
async fn a_pod_where_the_operator_does_not_act_gets_no_gate() {
    queueguard::tls::install_crypto_provider();
    let dir = std::env::temp_dir().join(format!("qg-webhook-ns-{}-{}", std::process::id(), addr_nanos()));
    std::fs::create_dir_all(&dir).unwrap();
    let tls = write_certificate(&dir);
    let (client, mut api) = mock_client();
    let (store, mut writer) = reflector::store::<QueuePolicy>();
    writer.apply_watcher_event(&watcher::Event::Apply(guarding_policy()));
    let addr = free_addr();
    let billing_only = Some(std::sync::Arc::new(std::collections::BTreeSet::from(["billing".to_owned()])));
    let webhook = Webhook { addr, certs: CertSource::Dir(dir), timeouts: Default::default() };
    tokio::spawn(webhook.serve(client, store, billing_only));
    let https = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(tls.ca_pem.as_bytes()).unwrap()])
        .resolve("qg-webhook.ops.svc", addr)
        .build()
        .unwrap();
    let url = format!("https://qg-webhook.ops.svc:{}/mutate-pods", addr.port());
    let mut answer = None;
    for _ in 0..50 {
        match https.post(&url).header("content-type", "application/json").body(REVIEW).send().await {
            Ok(r) => {
                answer = Some(r.json::<Value>().await.unwrap());
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let review = answer.expect("the webhook answers");
    assert_eq!(review["response"]["allowed"], true);
    assert!(review["response"].get("patch").is_none(), "shop is not the operator's: {review}");
    assert!(api.next(Duration::from_millis(200)).await.is_none(), "no ReplicaSet read for a pod it leaves alone");
}

/// A webhook on a certificate from a directory (as cert-manager mounts it), with short limits.
async fn webhook_with_timeouts(timeouts: Timeouts) -> (SocketAddr, String) {
    let (addr, ca, _dir) = webhook_from_dir(timeouts).await;
    (addr, ca)
}

/// A certificate of its own CA (cert-manager's self-signed issuer with `rotationPolicy: Always`
/// makes a new CA at each renewal) written into `dir` the way the kubelet updates a mounted
/// Secret: the new files appear at once, by rename.
fn write_certificate(dir: &std::path::Path) -> certs::WebhookTls {
    let tls = certs::issue(None, &certs::dns_names("qg-webhook", "ops"), Timestamp::now()).unwrap();
    for (file, pem) in [("tls.key", &tls.key_pem), ("tls.crt", &tls.cert_pem)] {
        let staged = dir.join(format!(".{file}.new"));
        std::fs::write(&staged, pem).unwrap();
        std::fs::rename(staged, dir.join(file)).unwrap();
    }
    tls
}

async fn webhook_from_dir(timeouts: Timeouts) -> (SocketAddr, String, std::path::PathBuf) {
    queueguard::tls::install_crypto_provider();
    let dir = std::env::temp_dir().join(format!("qg-webhook-{}-{}", std::process::id(), addr_nanos()));
    std::fs::create_dir_all(&dir).unwrap();
    let tls = write_certificate(&dir);
    let (client, _api) = mock_client();
    let (store, _writer) = reflector::store::<QueuePolicy>();
    let addr = free_addr();
    tokio::spawn(Webhook { addr, certs: CertSource::Dir(dir.clone()), timeouts }.serve(client, store, None));
    for _ in 0..50 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (addr, tls.ca_pem, dir)
}

/// Whether a TLS handshake that trusts only `ca_pem` succeeds.
async fn trusted_by(addr: SocketAddr, ca_pem: &str) -> bool {
    handshake(addr, ca_pem).await.is_ok()
}

/// cert-manager renews the certificate with a new CA and cainjector moves `caBundle` at once:
/// the webhook serves the new certificate within seconds, not at its next hourly read.
#[tokio::test]
async fn a_renewed_certificate_in_the_directory_is_served_within_seconds() {
    let (addr, old_ca, dir) = webhook_from_dir(Timeouts::default()).await;
    assert!(trusted_by(addr, &old_ca).await);
    let renewed = write_certificate(&dir);
    assert!(!trusted_by(addr, &renewed.ca_pem).await, "still the old certificate right after the renewal");
    let started = std::time::Instant::now();
    let limit = DIR_CHECK_EVERY * 3;
    while !trusted_by(addr, &renewed.ca_pem).await {
        assert!(started.elapsed() < limit, "the renewed certificate is not served after {limit:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("serving the renewed certificate {:?} after it was written", started.elapsed());
    assert!(!trusted_by(addr, &old_ca).await, "the old CA is no longer what the webhook presents");
    let _ = std::fs::remove_dir_all(dir);
}

fn addr_nanos() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos()
}

async fn tls_to(addr: SocketAddr, ca_pem: &str) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    handshake(addr, ca_pem).await.unwrap()
}

/// A TLS connection to the webhook trusting only `ca_pem`.
async fn handshake(
    addr: SocketAddr,
    ca_pem: &str,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap()).unwrap();
    let config = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    connector.connect(ServerName::try_from("qg-webhook.ops.svc").unwrap(), tcp).await
}

/// Reads until the server closes; returns what it sent and how long that took.
async fn until_closed(mut stream: impl tokio::io::AsyncRead + Unpin) -> (String, Duration) {
    use tokio::io::AsyncReadExt;
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the webhook still holds the connection after 5 s");
    (String::from_utf8_lossy(&answer).into_owned(), started.elapsed())
}

const SHORT: Timeouts = Timeouts { handshake: Duration::from_millis(300), request: Duration::from_millis(500) };

#[tokio::test]
async fn a_client_that_never_starts_tls_is_let_go_after_the_handshake_timeout() {
    let (addr, _) = webhook_with_timeouts(SHORT).await;
    let silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (_, after) = until_closed(silent).await;
    eprintln!("silent client closed after {after:?} (handshake timeout 300 ms)");
    assert!(after >= Duration::from_millis(250) && after < Duration::from_secs(2), "{after:?}");
}

#[tokio::test]
async fn a_request_that_stalls_is_answered_408_or_closed_after_the_request_timeout() {
    use tokio::io::AsyncWriteExt;
    let (addr, ca) = webhook_with_timeouts(SHORT).await;
    // Headers, then half the body it announced, then nothing.
    let mut stalled_body = tls_to(addr, &ca).await;
    stalled_body
        .write_all(b"POST /mutate-pods HTTP/1.1\r\nhost: qg-webhook.ops.svc\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"kind\":")
        .await
        .unwrap();
    let (answer, after) = until_closed(stalled_body).await;
    eprintln!("stalled body answered after {after:?}: {:?}", answer.lines().next());
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(after >= Duration::from_millis(450) && after < Duration::from_secs(2), "{after:?}");

    // Half the headers, then nothing.
    let mut stalled_headers = tls_to(addr, &ca).await;
    stalled_headers.write_all(b"POST /mutate-pods HTTP/1.1\r\nhost: qg").await.unwrap();
    let (_, after) = until_closed(stalled_headers).await;
    eprintln!("stalled headers closed after {after:?}");
    assert!(after >= Duration::from_millis(450) && after < Duration::from_secs(2), "{after:?}");

    // And the webhook still answers a well-behaved client.
    let https = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(ca.as_bytes()).unwrap()])
        .resolve("qg-webhook.ops.svc", addr)
        .build()
        .unwrap();
    let url = format!("https://qg-webhook.ops.svc:{}/mutate-pods", addr.port());
    let answer = https.post(&url).header("content-type", "application/json").body(REVIEW).send().await.unwrap();
    assert_eq!(answer.status(), 200);
}
