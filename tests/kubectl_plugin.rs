//! `queueguard status`, and the binary as the kubectl plugin `kubectl-queueguard`: against the
//! mocked API (the requests checked against the operator's RBAC), and the linked binary run the
//! way kubectl runs a plugin, with a kubeconfig naming an API server on loopback.

mod common;

use axum::{Json, Router, extract::Path, routing::get};
use common::api::mock_client;
use http::StatusCode;
use queueguard::overview::{self, Scope};
use serde_json::{Value, json};
use std::process::Command;

const GROUP: &str = "/apis/queueguard.io/v1alpha1";

fn policy(ns: &str, name: &str, waiting: bool) -> Value {
    let mut status = json!({
        "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "ok",
                        "lastTransitionTime": "2026-12-05T10:00:00Z"}],
        "queue": {"name": name, "vhost": "/", "messagesReady": 7, "messagesUnacknowledged": 0, "consumers": 2},
        "consumers": {"attached": 2, "expected": 2, "tracking": "Events"},
        "rollout": {"phase": "Idle"}
    });
    if waiting {
        status["consumers"]["attached"] = json!(1);
        status["rollout"] = json!({"phase": "Stalled", "waitingPods": [
            {"name": format!("{name}-worker-5f7-kq2"), "since": "2026-12-05T10:00:00Z", "waitingFor": [name]}
        ]});
    }
    json!({
        "apiVersion": "queueguard.io/v1alpha1", "kind": "QueuePolicy",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"), "resourceVersion": "1"},
        "spec": {"broker": {"secretRef": {"name": "rabbitmq"}}, "queue": {}, "consumers": {"deployment": format!("{name}-worker")}},
        "status": status
    })
}

fn list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "queueguard.io/v1alpha1", "kind": "QueuePolicyList", "metadata": {"resourceVersion": "1"}, "items": items})
}

#[tokio::test]
async fn status_lists_one_namespace_or_all_through_the_operators_own_rights() {
    let (client, mut api) = mock_client();
    let server = tokio::spawn(async move {
        let call = api.expect("GET", &format!("{GROUP}/namespaces/shop/queuepolicies")).await;
        call.respond(StatusCode::OK, &list(vec![policy("shop", "orders", true)]));
        let call = api.expect("GET", &format!("{GROUP}/queuepolicies")).await;
        call.respond(StatusCode::OK, &list(vec![policy("shop", "orders", true), policy("billing", "invoices", false)]));
    });
    let shop = overview::list(client.clone(), &Scope::Namespace("shop".into())).await.unwrap();
    assert_eq!(shop.len(), 1);
    assert_eq!((shop[0].attached, shop[0].expected), (Some(1), Some(2)));
    assert_eq!(shop[0].waiting[0].pod, "orders-worker-5f7-kq2");
    assert_eq!(shop[0].waiting[0].waiting_for, ["orders"]);
    let all = overview::list(client, &Scope::AllNamespaces).await.unwrap();
    assert_eq!(
        all.iter().map(|r| (r.namespace.as_str(), r.policy.as_str())).collect::<Vec<_>>(),
        [("billing", "invoices"), ("shop", "orders")]
    );
    server.await.unwrap();
}

/// A loopback API server that lists the given policies, and a kubeconfig naming it with
/// namespace `shop` as the context's.
async fn cluster(dir: &std::path::Path) -> std::path::PathBuf {
    async fn namespaced(Path(ns): Path<String>) -> Json<Value> {
        let items = [policy("shop", "orders", true), policy("billing", "invoices", false)];
        Json(list(items.into_iter().filter(|p| p["metadata"]["namespace"] == ns.as_str()).collect()))
    }
    let app = Router::new().route("/apis/queueguard.io/v1alpha1/namespaces/{ns}/queuepolicies", get(namespaced)).route(
        "/apis/queueguard.io/v1alpha1/queuepolicies",
        get(|| async { Json(list(vec![policy("shop", "orders", true), policy("billing", "invoices", false)])) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster: {{server: 'http://{addr}'}}\nusers:\n- name: me\n  user: {{token: not-a-secret}}\ncontexts:\n- name: local\n  context: {{cluster: local, user: me, namespace: shop}}\ncurrent-context: local\n"
        ),
    )
    .unwrap();
    kubeconfig
}

fn plugin(dir: &std::path::Path) -> std::path::PathBuf {
    let link = dir.join("kubectl-queueguard");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_queueguard"), &link).unwrap();
    link
}

fn run(bin: &std::path::Path, args: &[&str], kubeconfig: &std::path::Path) -> (bool, String, String) {
    let out = Command::new(bin).args(args).env("KUBECONFIG", kubeconfig).output().unwrap();
    (out.status.success(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linked_as_kubectl_queueguard_it_answers_kubectl_queueguard_status() {
    let dir = std::env::temp_dir().join(common::unique("kubectl-plugin"));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = cluster(&dir).await;
    let kubectl_queueguard = plugin(&dir);
    let bin = kubectl_queueguard.clone();
    let kc = kubeconfig.clone();
    let outputs = tokio::task::spawn_blocking(move || {
        [
            run(&bin, &["--help"], &kc),
            run(&bin, &["status"], &kc),
            run(&bin, &["status", "-A", "-o", "json"], &kc),
            run(&bin, &["status", "-n", "billing"], &kc),
            run(&bin, &["status", "-n", "x", "-A"], &kc),
            run(&bin, &["status"], std::path::Path::new("/nonexistent/kubeconfig")),
        ]
    })
    .await
    .unwrap();
    let [help, status, json, billing, conflicting, no_cluster] = outputs;

    assert!(help.0 && help.1.contains("Usage: kubectl queueguard [OPTIONS] <COMMAND>"), "{}", help.1);
    assert!(status.0, "{}", status.2);
    let lines: Vec<&str> = status.1.lines().collect();
    assert!(lines[0].starts_with("NAMESPACE") && lines.len() == 3, "the context's namespace only:\n{}", status.1);
    assert!(lines[1].starts_with("shop") && lines[1].contains("1/2") && lines[1].ends_with("Stalled"), "{}", lines[1]);
    assert!(lines[2].starts_with("  pod orders-worker-5f7-kq2 waits for ") && lines[2].ends_with(" for orders"));

    assert!(json.0, "{}", json.2);
    let rows: Value = serde_json::from_str(&json.1).unwrap();
    let names: Vec<&str> = rows.as_array().unwrap().iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["invoices", "orders"]);
    assert_eq!(rows[1]["waiting"][0]["waitingFor"], json!(["orders"]));
    assert_eq!(rows[0]["rollout"], "Idle");

    assert!(billing.0 && billing.1.contains("invoices") && !billing.1.contains("orders"), "{}", billing.1);
    assert!(!conflicting.0 && conflicting.2.contains("cannot be used with"), "{}", conflicting.2);
    assert!(conflicting.2.contains("kubectl queueguard status"), "errors name the plugin: {}", conflicting.2);
    assert!(!no_cluster.0 && no_cluster.2.starts_with("error: "), "{}", no_cluster.2);
    let _ = std::fs::remove_dir_all(&dir);
}
