//! The admission webhook end to end, short of a cluster: it issues its certificate into a
//! Secret and writes the CA into the MutatingWebhookConfiguration (mocked API, each request
//! checked), then answers a real AdmissionReview over HTTPS, verified against that CA.

mod common;

use base64::Engine;
use common::api::*;
use http::StatusCode;
use kube::runtime::{reflector, watcher};
use queueguard::{
    crd::QueuePolicy,
    webhook::{
        certs::SelfSigned,
        server::{CertSource, Webhook},
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
    let (store, mut writer) = reflector::store::<QueuePolicy>();
    writer.apply_watcher_event(&watcher::Event::Apply(guarding_policy()));
    let addr = free_addr();
    let certs = CertSource::SelfSigned(SelfSigned {
        namespace: "ops".into(),
        secret: "qg-webhook-tls".into(),
        service: "qg-webhook".into(),
        webhook_config: "qg".into(),
    });
    tokio::spawn(Webhook { addr, certs }.serve(client, store));

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
    let mut answer = None;
    for _ in 0..50 {
        match https.post(&url).header("content-type", "application/json").body(REVIEW).send().await {
            Ok(r) => {
                answer = Some(r);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
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
